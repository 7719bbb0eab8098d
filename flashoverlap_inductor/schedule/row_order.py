"""How the fused GEMM meets a reduce_scatter / all_to_all buffer layout: the tile-row order (the default) or the
A-row gather.

``plan.buffer_layout`` puts each wave group in one contiguous range of a *buffer* whose rows are a permutation of
the natural rows (group 0's piece of every chunk, then group 1's, ...). Two routes realize it on the GPU:

* ``"gather"``: copy A's rows into buffer order (``index_select``, 2 x rows x K x 2 bytes on the critical path
  before the GEMM), then run the GEMM in natural tile order into the buffer.
* ``"schedule"`` (default): keep A and the GEMM output ``d`` in natural row order and let the tile scheduler run
  the tile-rows in group order (``csrc/tile_order.hpp``; ``plan.natural_group_of_tile_row`` and
  ``plan.scheduled_tile_rows`` give the map and the order). Then all_to_all sends every piece straight from ``d``
  (each piece is contiguous in natural order), and reduce_scatter issues, per group, one NCCL group of W
  ``ncclReduce`` calls, one per chunk piece with the chunk's rank as root (the step's ``sends`` list them as
  ``(root, lo, hi)`` natural rows); each root receives its piece's sum straight into its output rows.

(A third route, "stage" -- reduce_scatter staged by 2-D copies into a contiguous buffer --, was measured against
"schedule" and removed: docs/results.md.) Units: rows of the GEMM output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from . import plan as planlib
from .steps import GroupStep

log = logging.getLogger("flashoverlap")

ROUTES = ("schedule", "gather")


def route(override: str | None = None, collective: str = "all_to_all", world: int = 2) -> str:
    """``override`` (``Settings.tuning.row_order``), else the measured default: "schedule", except reduce_scatter on
    more than 2 ranks, which keeps "gather" (its grouped ``ncclReduce`` calls are measured on 2 GPUs only;
    all_to_all moves the same pieces on either route, so only its GEMM changes)."""
    default = "gather" if collective == "reduce_scatter" and world > 2 else "schedule"
    value = override or default
    if value not in ROUTES:
        raise ValueError(f"flashoverlap: row order must be one of {ROUTES}, got {value!r}")
    return value


@dataclass(frozen=True)
class NaturalOrder:
    """The "schedule" route of one call shape: the scheduler's order, the tile-row -> group map, the tiles per
    group, and the steps with all_to_all sends / reduce_scatter pieces in natural rows."""

    order: list[int]
    group_of_row: list[int]
    tiles: tuple[int, ...]
    steps: tuple[GroupStep, ...]


def natural_order(collective: str, layout: planlib.BufferLayout, steps: Sequence[GroupStep],
                  tile_m: int, tile_n: int, n: int) -> NaturalOrder | str:
    """The "schedule" route for ``steps`` (``steps.schedule_steps``) on ``layout``, or the reason it cannot run (the
    caller then gathers)."""
    groups = len(steps)
    gmap = planlib.natural_group_of_tile_row(layout, tile_m)
    order = planlib.scheduled_tile_rows(gmap)
    tiles = tuple(planlib.tiles_of_groups(gmap, groups, tile_n, n))
    if collective == "all_to_all":
        new_steps = []
        for step in steps:
            sends = tuple((j, layout.natural_row(lo, hi - lo), layout.natural_row(lo, hi - lo) + hi - lo)
                          if hi > lo else (j, lo, hi) for j, lo, hi in step.sends)
            local = step.local
            if local is not None and local[2] > 0:
                local = (layout.natural_row(local[0], local[2]), local[1], local[2])
            new_steps.append(replace(step, sends=sends, local=local))
        return NaturalOrder(order, gmap, tiles, tuple(new_steps))
    if collective != "reduce_scatter":
        return f"{collective} has no buffer layout"
    new_steps = [replace(step, sends=tuple((k, nat, nat + count) for k, (_, nat, count)
                                           in enumerate(layout.natural_pieces(g)) if count))
                 for g, step in enumerate(steps)]
    return NaturalOrder(order, gmap, tiles, tuple(new_steps))
