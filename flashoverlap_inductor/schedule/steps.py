"""Per-call schedules: the group plan of a call shape, its buffer layout and each group's steps (pure, memoized).

``resolve_schedule`` turns a plan string (``GroupPlan.to_str()``; the dispatcher resolves ``"auto"`` with the cost
model before, so nothing here imports it) into the buffer layout of this call; ``schedule_steps`` into each group's
work on one rank: the GEMM rows it computes and the transfers of its collective. The CPU route runs these steps with
``torch.distributed``; the NCCL route hands the same steps to the library (``routes.nccl``). Rows are flattened rows
of ``y = a @ b``.

Invariant: every function here depends only on the call shape, the plan string and the settings, which all ranks
share, so every rank cuts its groups alike (all_to_all with explicit split sizes uses rank-independent uniform
fractions, see ``resolve_schedule``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from . import plan as planlib

log = logging.getLogger("flashoverlap")

# Tile shape and group count of the fallback plan when "auto" has no cost-model plan or a plan is stale.
FALLBACK_TILE = (128, 128)
FALLBACK_GROUPS = 4
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def even_splits(dim0: int, world: int, what: str) -> list[int]:
    if dim0 % world:
        raise ValueError(f"flashoverlap: {what}: dim 0 size {dim0} does not divide by world size {world}")
    return [dim0 // world] * world


def all_to_all_splits(dim0: int, world: int, output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """(output, input) split sizes in dim-0 units, with None replaced by even splits; validated."""
    ins = [int(x) for x in input_split_sizes] if input_split_sizes is not None else even_splits(dim0, world, "input")
    outs = [int(x) for x in output_split_sizes] if output_split_sizes is not None else even_splits(dim0, world,
                                                                                                    "output")
    if len(ins) != world or len(outs) != world:
        raise ValueError(f"flashoverlap: all_to_all needs {world} split sizes, got input {ins}, output {outs}")
    if sum(ins) != dim0 or min(ins + outs) < 0:
        raise ValueError(f"flashoverlap: all_to_all input_split_sizes {ins} must be >= 0 and sum to dim 0 = {dim0}")
    return outs, ins



class _FractionPlan(NamedTuple):
    """Rank-independent uniform fractions ``g / G`` for ``plan.buffer_layout``: its cuts
    ``floor(L * row_bounds[g] / row_bounds[-1])`` then depend only on each chunk's length ``L``."""

    m: int
    row_bounds: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """Everything a runtime needs for one call shape (memoized).

    ``layout``: the buffer layout of this rank's GEMM output. ``recv_pieces[g][j]``: rows (flattened) this rank
    receives from rank j in group g (all_to_all only; ``()`` otherwise). ``plan``: the GroupPlan used (None for
    fraction plans). ``description``: for logs.
    """

    layout: planlib.BufferLayout
    recv_pieces: tuple[tuple[int, ...], ...]
    plan: planlib.GroupPlan | None
    description: str

    @property
    def num_groups(self) -> int:
        return len(self.layout.group_bounds) - 1


def fallback_plan(rows: int, n: int) -> planlib.GroupPlan:
    """The uniform plan of ``FALLBACK_GROUPS`` groups: what a plan "auto" runs when the cost model cannot give one
    (``cost_model.call_plan``), or when "auto" reaches the schedule unresolved (a direct caller)."""
    return planlib.uniform_plan(rows, n, FALLBACK_TILE[0], FALLBACK_TILE[1], FALLBACK_GROUPS)


@functools.lru_cache(maxsize=4096)
def resolve_schedule(collective: str, plan_str: str, rows: int, n: int, k: int, dtype: str, world: int,
                     send_rows: tuple[int, ...] | None = None, recv_rows: tuple[int, ...] | None = None,
                     a2a_groups: int = 4) -> Schedule:
    """The schedule of one call: ``rows``/``n``/``k`` are the flattened GEMM sizes; ``send_rows``/``recv_rows``
    the all_to_all split sizes in flattened rows (None = even splits, which implies equal rows on every rank);
    ``a2a_groups``: the uniform fractions of all_to_all with explicit split sizes
    (``Settings.all_to_all_default_groups``). ``plan_str`` is concrete: the dispatcher resolves "auto" with the
    cost model (``cost_model.call_plan``); an unresolved "auto" gets ``fallback_plan``."""
    if collective == "all_to_all" and (send_rows is not None or recv_rows is not None):
        groups = max(1, int(a2a_groups))
        send = list(send_rows) if send_rows is not None else planlib.chunks_for("all_to_all", rows, world)
        recv = list(recv_rows) if recv_rows is not None else send
        frac = _FractionPlan(rows, tuple(range(groups + 1)))
        layout = planlib.buffer_layout(frac, send)  # type: ignore[arg-type]  # duck-typed: m + row_bounds
        recv_pieces = planlib.chunk_pieces(recv, frac.row_bounds)
        if plan_str != "auto":
            log.debug("flashoverlap: all_to_all with explicit split sizes: plan %s replaced by uniform fractions "
                      "1/%d (ranks may hold different rows; only rank-independent fractions agree)", plan_str, groups)
        return Schedule(layout, tuple(map(tuple, recv_pieces)), None, f"uniform fractions 1/{groups}")
    if plan_str == "auto":
        plan = fallback_plan(rows, n)
    else:
        try:
            plan = planlib.GroupPlan.from_str(plan_str)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"flashoverlap: bad plan string {plan_str!r}: {exc}") from exc
    if plan.m != rows or plan.n != n:
        _warn_once(f"stale:{plan_str}:{rows}:{n}", "flashoverlap: plan %s does not fit a %s call with %d rows x %d "
                   "cols; using a uniform plan", plan_str, collective, rows, n)
        plan = planlib.uniform_plan(rows, n, plan.tile_m, plan.tile_n, plan.num_groups)
    chunks = planlib.chunks_for(collective, rows, world)
    layout = planlib.buffer_layout(plan, chunks)
    recv_pieces: tuple[tuple[int, ...], ...] = ()
    if collective == "all_to_all":  # even splits: every rank has this plan, so it receives what it sends
        recv_pieces = tuple(map(tuple, planlib.chunk_pieces(chunks, plan.row_bounds)))
    return Schedule(layout, recv_pieces, plan, plan.to_str())



@dataclass(frozen=True)
class GroupStep:
    """One group's work, in flattened rows. ``segments``: (buffer_row, source_row, rows) GEMM copies;
    ``lo, hi``: its buffer rows; ``out``: reduce_scatter output rows; ``sends``/``recvs``: all_to_all
    (group rank, lo, hi) ranges of the buffer / output; ``local``: (buf_lo, out_lo, rows) for ourselves."""

    segments: tuple[tuple[int, int, int], ...]
    lo: int
    hi: int
    out: tuple[int, int] = (0, 0)
    sends: tuple[tuple[int, int, int], ...] = ()
    recvs: tuple[tuple[int, int, int], ...] = ()
    local: tuple[int, int, int] | None = None


@functools.lru_cache(maxsize=4096)
def schedule_steps(collective: str, plan_str: str, rows: int, n: int, k: int, dtype: str, world: int, rank: int,
                   send_rows: tuple[int, ...] | None = None, recv_rows: tuple[int, ...] | None = None,
                   a2a_groups: int = 4) -> tuple[GroupStep, ...]:
    """The per-group steps of one call shape on ``rank`` (memoized; the per-call path only walks them)."""
    sched = resolve_schedule(collective, plan_str, rows, n, k, dtype, world, send_rows, recv_rows, a2a_groups)
    lay = sched.layout
    log.debug("flashoverlap cpu: %s rows=%d n=%d rank=%d: %d groups (%s)", collective, rows, n, rank,
              sched.num_groups, sched.description)
    steps = []
    for g in range(sched.num_groups):
        lo, hi = lay.group_bounds[g], lay.group_bounds[g + 1]
        step = GroupStep(_segments_within(lay.segments, lo, hi), lo, hi)
        if collective == "reduce_scatter":
            off = lay.output_offsets(g)[rank]
            step = GroupStep(step.segments, lo, hi, out=(off, off + lay.pieces[g][rank]))
        elif collective == "all_to_all":
            recv_starts = _prefix(recv_rows if recv_rows is not None else even_splits(rows, world, "rows"))
            sends, recvs, local = [], [], None
            buf = lo
            for j in range(world):
                count_out, count_in = lay.pieces[g][j], sched.recv_pieces[g][j]
                out_lo = recv_starts[j] + sum(p[j] for p in sched.recv_pieces[:g])
                if j == rank:
                    if count_out != count_in:
                        raise ValueError(f"flashoverlap: all_to_all sends {count_out} rows to itself in group {g} "
                                         f"but expects {count_in}: input/output split sizes disagree for rank {rank}")
                    local = (buf, out_lo, count_out) if count_out else None
                else:
                    if count_out:
                        sends.append((j, buf, buf + count_out))
                    if count_in:
                        recvs.append((j, out_lo, out_lo + count_in))
                buf += count_out
            step = GroupStep(step.segments, lo, hi, sends=tuple(sends), recvs=tuple(recvs), local=local)
        steps.append(step)
    return tuple(steps)


def _segments_within(segments: Sequence[tuple[int, int, int]], lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    """The parts of ``segments`` inside buffer rows ``[lo, hi)``. ``buffer_layout`` merges runs that are
    contiguous on both sides, so one segment may span several groups (the identity layout is a single segment);
    ``BufferLayout.group_segments`` gives such a segment wholly to its first group, which would compute the
    whole GEMM before the first collective. Clipping keeps every group's GEMM work in its own step."""
    out = []
    for buf_row, src_row, rows in segments:
        start, stop = max(lo, buf_row), min(hi, buf_row + rows)
        if start < stop:
            out.append((start, src_row + start - buf_row, stop - start))
    return tuple(out)


def _prefix(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


