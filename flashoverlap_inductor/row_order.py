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
* ``"stage"``: as "schedule", but reduce_scatter copies each group's W pieces into a contiguous buffer (one 2-D
  copy after the group's wait) and runs ``ncclReduceScatter`` on it (measured against "schedule").

Units: rows of the GEMM output; the copy descriptors are in elements (rows x N).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from . import plan as planlib
from . import runtime_cpu

log = logging.getLogger("flashoverlap")

ROUTES = ("schedule", "stage", "gather")
MAX_PITCH_BYTES = (1 << 31) - 1  # cudaMemcpy2DAsync's pitch limit on current GPUs


def route(override: str | None = None, collective: str = "all_to_all", world: int = 2) -> str:
    """``override`` (``runtime_gpu.ROW_ORDER``), else ``$FLASHOVERLAP_ROW_ORDER``, else the measured default:
    "schedule", except reduce_scatter on more than 2 ranks, which keeps "gather" (its grouped ``ncclReduce`` calls
    are measured on 2 GPUs only; all_to_all moves the same pieces on either route, so only its GEMM changes)."""
    default = "gather" if collective == "reduce_scatter" and world > 2 else "schedule"
    value = override or os.environ.get("FLASHOVERLAP_ROW_ORDER") or default
    if value not in ROUTES:
        raise ValueError(f"flashoverlap: row order must be one of {ROUTES}, got {value!r}")
    return value


@dataclass(frozen=True)
class StageCopy:
    """One group's 2-D copy ``d -> buf`` (elements): ``height`` pieces of ``width``, read every ``src_pitch`` from
    ``src``, written every ``dst_pitch`` from ``dst``."""

    src: int
    dst: int
    width: int
    height: int
    src_pitch: int
    dst_pitch: int

    def apply(self, d: torch.Tensor, buf: torch.Tensor) -> None:
        """The copy with torch on the current stream (the Python host loop)."""
        src = d.view(-1).as_strided((self.height, self.width), (self.src_pitch, 1), self.src)
        buf.view(-1).as_strided((self.height, self.width), (self.dst_pitch, 1), self.dst).copy_(src)


@dataclass(frozen=True)
class NaturalOrder:
    """The "schedule" route of one call shape: the scheduler's order, the tile-row -> group map, the tiles per
    group, the steps with all_to_all sends in natural rows, and reduce_scatter's per-group copies."""

    order: list[int]
    group_of_row: list[int]
    tiles: tuple[int, ...]
    steps: tuple[runtime_cpu.GroupStep, ...]
    stage: tuple[StageCopy | None, ...] | None


def natural_order(collective: str, layout: planlib.BufferLayout, steps: Sequence[runtime_cpu.GroupStep],
                  tile_m: int, tile_n: int, n: int, elem_bytes: int, stage: bool = False) -> NaturalOrder | str:
    """The "schedule" route (``stage``: the "stage" route) for ``steps`` (``runtime_cpu.schedule_steps``) on
    ``layout``, or the reason it cannot run (the caller then gathers)."""
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
        return NaturalOrder(order, gmap, tiles, tuple(new_steps), None)
    if collective != "reduce_scatter":
        return f"{collective} has no buffer layout"
    if not stage:
        new_steps = [replace(step, sends=tuple((k, nat, nat + count) for k, (_, nat, count)
                                               in enumerate(layout.natural_pieces(g)) if count))
                     for g, step in enumerate(steps)]
        return NaturalOrder(order, gmap, tiles, tuple(new_steps), None)
    copies: list[StageCopy | None] = []
    for g in range(groups):
        pieces = layout.natural_pieces(g)
        rows = {count for _, _, count in pieces}
        if len(rows) != 1:
            return f"group {g} has unequal pieces {[c for _, _, c in pieces]}"
        count = rows.pop()
        if count == 0:
            copies.append(None)
            continue
        naturals = [nat for _, nat, _ in pieces]
        pitch = naturals[1] - naturals[0] if len(naturals) > 1 else count
        if any(b - a != pitch for a, b in zip(naturals, naturals[1:])):
            return f"group {g}'s pieces are not evenly spaced"
        if pitch * n * elem_bytes > MAX_PITCH_BYTES:
            return f"a pitch of {pitch * n * elem_bytes} bytes exceeds cudaMemcpy2D's limit"
        copies.append(StageCopy(naturals[0] * n, pieces[0][0] * n, count * n, len(pieces), pitch * n, count * n))
    return NaturalOrder(order, gmap, tiles, tuple(steps), tuple(copies))
