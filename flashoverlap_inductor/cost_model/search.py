"""Search over wave-group partitions: a fast predictive search and an exhaustive reference.

Candidates cut the output rows only at *candidate bounds* (``candidate_bounds``); the rows between two
neighbours are a *block*:

* all_reduce: every multiple of ``tile_m`` (groups of whole tile-rows; the last tile-row may be partial).
* reduce_scatter and all_to_all with even splits: every multiple of ``lcm(tile_m, world_size)``, so every inner
  bound divides by the world size (each group's collective hands every rank the same number of rows) and stays
  tile-aligned. If the matrix holds fewer than two such blocks, each tile-row boundary rounded down to a
  multiple of ``world_size``: a group then ends up to ``world_size - 1`` rows before its last tile-row ends,
  those rows go to the next group, and ``plan.group_of_tile_row`` still makes each group wait for exactly its
  own tile-rows (the next group is released after it).
* all_to_all with ``input_split_sizes``: not searched here; the bounds must be fractions every rank shares
  (``plan.chunk_pieces``), which ``decide`` fixes without looking at this rank's sizes.

**Predictive** (``predictive_search``): blocks are bundled into at most ``max_units`` (default 10) units of
``ceil(blocks / max_units)`` blocks (the last unit takes the remainder) and *every* composition of the units
(2^(U-1) group-size sequences) is a candidate, searched depth-first with branch-and-bound. Each tree node
extends a prefix by one group in O(1) from precomputed per-unit completion times and per-range comm times, and
a subtree is pruned when a lower bound (remaining work without interference + the smallest possible last
collective; and, for a subadditive curve, the remaining bytes in one call after the comm stream frees up) is no
better than the best plan so far. So the result is the optimum over unit compositions, in a few ms.

**Exhaustive** (``exhaustive_search``): every composition of the blocks themselves, each evaluated from scratch
through ``CostModel.fused`` (buffer layout, ``tiles_per_group``, recurrence). Exponential; for tests on small
matrices (``max_blocks``, default 16).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from flashoverlap_inductor.schedule.plan import GroupPlan, buffer_layout

from .pipeline import CostModel, advance_comm, advance_compute

DEFAULT_TILE = (128, 256)
DEFAULT_MAX_UNITS = 10


@dataclass(frozen=True)
class SearchResult:
    """The best plan found, its predicted fused time (ms) and how many complete candidates were evaluated."""

    plan: GroupPlan
    predicted_ms: float
    evaluated: int
    mode: str


def candidate_bounds(collective: str, m: int, tile_m: int, world_size: int) -> list[int]:
    """``[0, ..., m]``: the rows a group may start at, plus ``m`` (see the module docstring)."""
    if collective == "all_reduce":
        return [*range(0, m, tile_m), m]
    aligned = math.lcm(tile_m, world_size)
    if m // aligned >= 2:
        return [*range(0, m, aligned), m]
    cuts = {t * tile_m // world_size * world_size for t in range(1, math.ceil(m / tile_m))}
    return [0, *sorted(c for c in cuts if 0 < c < m), m]


def unit_bounds(bounds: Sequence[int], max_units: int) -> list[int]:
    """Every ``ceil(blocks / max_units)``-th candidate bound (and ``m``): at most ``max_units`` units."""
    blocks = len(bounds) - 1
    per_unit = math.ceil(blocks / max(1, max_units))
    return [*bounds[0:blocks:per_unit], bounds[-1]]


def predictive_search(model: CostModel, collective: str, m: int, n: int, k: int, dtype: str, world_size: int,
                      chunks: Sequence[int], *, tile_m: int = DEFAULT_TILE[0], tile_n: int = DEFAULT_TILE[1],
                      max_units: int = DEFAULT_MAX_UNITS, kernel: str = "", min_groups: int = 1) -> SearchResult:
    """Best composition of units by branch-and-bound (see the module docstring); ``chunks`` as
    ``plan.chunks_for``. The returned time equals ``model.fused(plan, ...).total_ms``. Only plans of at least
    ``min_groups`` groups compete (fewer when there are fewer units)."""
    ub = unit_bounds(candidate_bounds(collective, m, tile_m, world_size), max_units)
    units = len(ub) - 1
    fine = GroupPlan(m, n, tile_m, tile_n, tuple(ub), kernel)
    rb = buffer_layout(fine, chunks).group_bounds  # realized buffer bounds at every unit boundary
    # A coarse group ending at unit boundary j completes when fine group j-1 does (carry-forward semantics).
    cf = [0.0, *model.gemm.group_completion_ms(rb, n, k, dtype, tile_m, tile_n)]
    comm = [[0.0] * (units + 1) for _ in range(units + 1)]
    for i in range(units):
        for j in range(i + 1, units + 1):
            comm[i][j] = model.group_comm_ms(collective, world_size, rb[j] - rb[i], n, dtype)
    slowdown = model.gemm.effective_interference
    comm_slow = model.gemm.comm_slowdown
    subadditive = model.curve.is_subadditive(collective, world_size)
    last_min = comm[units - 1][units]
    best_ms, best_cuts, evaluated = math.inf, [units], 0
    cuts: list[int] = []

    def visit(i: int, e_comp: float, e_comm: float) -> None:
        nonlocal best_ms, best_cuts, evaluated
        for j in range(units, i, -1):  # large groups first: good plans early, stronger pruning
            c = advance_compute(e_comp, e_comm, cf[j] - cf[i], slowdown)
            e = advance_comm(max(c, e_comm), comm[i][j], cf[units], comm_slow)
            cuts.append(j)
            if j == units:
                evaluated += 1
                if e < best_ms and len(cuts) >= min(min_groups, units):
                    best_ms, best_cuts = e, list(cuts)
            else:
                bound = c + (cf[units] - cf[j]) + last_min
                if subadditive:
                    bound = max(bound, e + comm[j][units])
                if bound < best_ms:
                    visit(j, c, e)
            cuts.pop()

    visit(0, 0.0, 0.0)
    plan = GroupPlan(m, n, tile_m, tile_n, (0, *(ub[j] for j in best_cuts)), kernel)
    return SearchResult(plan, best_ms, evaluated, f"predictive({units} units)")


def exhaustive_search(model: CostModel, collective: str, m: int, n: int, k: int, dtype: str, world_size: int,
                      chunks: Sequence[int], *, tile_m: int = DEFAULT_TILE[0], tile_n: int = DEFAULT_TILE[1],
                      max_blocks: int = 16, kernel: str = "") -> SearchResult:
    """Every composition of the blocks, each through ``model.fused`` (the reference evaluation)."""
    bb = candidate_bounds(collective, m, tile_m, world_size)
    blocks = len(bb) - 1
    if blocks > max_blocks:
        raise ValueError(f"exhaustive search: {blocks} blocks > max_blocks={max_blocks} (2^{blocks - 1} plans)")
    best: tuple[float, GroupPlan] | None = None
    evaluated = 0
    for mask in itertools.product((False, True), repeat=blocks - 1):
        bounds = (0, *(bb[i + 1] for i, cut in enumerate(mask) if cut), m)
        plan = GroupPlan(m, n, tile_m, tile_n, bounds, kernel)
        total = model.fused(plan, collective, chunks, k, dtype, world_size).total_ms
        evaluated += 1
        if best is None or total < best[0]:
            best = (total, plan)
    assert best is not None
    return SearchResult(best[1], best[0], evaluated, f"exhaustive({blocks} blocks)")
