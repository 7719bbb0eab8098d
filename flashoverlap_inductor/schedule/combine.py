"""Geometry of the MoE expert-parallel ops (``flashoverlap::gemm_unpermute_all_to_all``, the combine, and
``flashoverlap::all_to_all_permute_gemm``, the dispatch; ``ops``): the ring steps both routes take, the plan string,
and which expert rows belong to which transfer *unit*. Functions of the ops' arguments (host ints, and tensors on
the ops' device); the P2P route (``routes/combine.py``, ``routes/moe_dispatch.py``) runs the same cut on every device.

Terms (all sizes in rows):

* the *expert rows*: the combine's GEMM output ``y`` (one row per index entry) or the dispatch's permuted rows ``p``
  (one row per index entry), ordered by expert: *group* g is rows ``[ends[g - 1], ends[g])`` (``ends[-1]`` 0 before
  the first); rows at or past ``ends[-1]`` are in no group (the grouped GEMM leaves them undefined);
* the *blocked buffer*: the combine's send buffer (row r of ``y`` goes to row ``index[r]``) or the dispatch's
  receive buffer (row r of ``p`` comes from row ``index[r]``), cut into ``world`` *blocks* by the split sizes (block
  j: the rows for, or from, rank j), each block cut into ``chunks`` *units* of near-equal rows (``chunk_sizes``):
  unit ``u = j * chunks + q`` is chunk q of block j. A negative index counts from the end, as in ``index_put``.

Ring steps (``ring_steps``): at step ``s = 1 .. world - 1`` rank r sends block ``dst = (r + s) % world`` and receives
block ``src = (r - s) % world``, in one batch per chunk (the same order on every rank, so the point-to-point ops of a
step pair up on NCCL, which runs them in issue order). The sizes are per rank, but a sender's ``input_split_sizes[dst]``
equals its receiver's ``output_split_sizes[src]``, so both sides cut the same chunks and skip the same empty ones.

Units (``plan_units``): the rows of each unit, unit by unit and ascending within a unit (so group by group: in the
MoE forms each (unit, group) is a contiguous run, expert e's rows being ordered by rank), with each row's place in
the blocked buffer and the per-(unit, group) row counts, from one stable sort and a few searches on the device (no
per-unit loop); only the small per-(unit, group) table comes to the host.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_CHUNKS = 16
# N in 1 .. MAX_CHUNKS; "auto" is "blocks" (no GPU measurement yet). "experts" / "experts:c=N": the dispatch's experts
# cut into 2 / N pieces, each peer's block in as many chunks (routes/moe_expert_cut.py); the combine has no expert
# cut and sends whole blocks under them (its "blocks").
PLANS = ("blocks", "auto", "blocks:c=N", "experts", "experts:c=N")
_CHUNKED = re.compile(r"(?:blocks|experts):c=(\d+)")


NO_ROWS = "+no_rows"  # a dispatch plan's suffix: the op returns its permuted rows ``p`` as [0, K] (``rows_kept``)


def rows_kept(plan: str) -> tuple[str, bool]:
    """A dispatch plan without its ``NO_ROWS`` suffix, and whether the op returns ``p`` (the graph reads only the
    GEMMs' results: the pass adds the suffix where nothing else reads ``p``, e.g. in inference, and the whole-block
    path then never writes ``p``'s rows, 57% of its moves' bytes at qwen3 shapes)."""
    return (plan[:-len(NO_ROWS)], False) if plan.endswith(NO_ROWS) else (plan, True)


def cuts_by_expert(plan: str) -> bool:
    """Whether ``plan`` (valid: ``parse_plan``) asks the dispatch to cut its experts into pieces."""
    return plan.startswith("experts")


def parse_plan(plan: str, what: str) -> int:
    """The chunks per block of a plan string: ``"blocks"`` and ``"auto"`` 1, ``"experts"`` 2, ``"blocks:c=N"`` and
    ``"experts:c=N"`` N (1 <= N <= ``MAX_CHUNKS``). Raises ``ValueError`` for anything else (``what`` names the op in
    the message)."""
    if plan in ("blocks", "auto"):
        return 1
    if plan == "experts":
        return 2
    m = _CHUNKED.fullmatch(plan)
    if m is None or not 1 <= int(m.group(1)) <= MAX_CHUNKS:
        raise ValueError(f"flashoverlap: unknown {what} plan {plan!r} (expected one of {PLANS}, N in 1 .. "
                         f"{MAX_CHUNKS})")
    return int(m.group(1))


def ring_steps(world: int, rank: int) -> list[tuple[int, int]]:
    """``(dst, src)`` of steps ``s = 1 .. world - 1``: ``((rank + s) % world, (rank - s) % world)``. Over the steps
    every peer is a destination once and a source once; at step s, rank r's destination has r as its source."""
    return [((rank + s) % world, (rank - s) % world) for s in range(1, world)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]`` (``len(sizes) + 1`` entries)."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out


def chunk_sizes(block_sizes: Sequence[int], chunks: int) -> list[int]:
    """The units' sizes, block by block: block j of n rows gives chunks ``n * (q + 1) // chunks - n * q // chunks``
    for q in ``range(chunks)`` (they sum to n; a function of n alone, so sender and receiver agree)."""
    return [int(n) * (q + 1) // chunks - int(n) * q // chunks for n in block_sizes for q in range(chunks)]


def group_ends(sizes_or_offs: Sequence[int] | torch.Tensor, rows: int, cumulative: bool) -> list[int]:
    """The groups' end rows: from per-group row counts (``cumulative=False``: the per-expert loop's pieces) or from
    ``torch._grouped_mm``'s cumulative offsets (``cumulative=True``), clamped to ``rows``. Raises ``ValueError`` for
    decreasing offsets or negative sizes."""
    values = [int(x) for x in (sizes_or_offs.tolist() if isinstance(sizes_or_offs, torch.Tensor) else sizes_or_offs)]
    ends = values if cumulative else offsets(values)[1:]
    if any(x < 0 for x in values) or any(b < a for a, b in zip(ends, ends[1:], strict=False)):
        raise ValueError(f"flashoverlap: expert group offsets must be non-negative and non-decreasing, got {values}")
    return [min(e, rows) for e in ends]


@dataclass(frozen=True)
class UnitPlan:
    """The expert rows cut by unit and group (module docstring). On the index's device: ``order`` (int64, one entry
    per expert row): the rows unit by unit, ascending within a unit, so group by group with the rows in no group
    last; ``target`` (int64): each one's row in the blocked buffer (``index[order]``, normalized); ``device_counts``
    (int64 ``[units, groups]``). On the host: ``counts`` (the same), ``first`` / ``last`` (int64 ``[units, groups]``:
    the first and last row of each (unit, group) run; meaningless where its count is 0), ``starts`` (``units + 1``
    ints: unit u's rows are ``order[starts[u]:starts[u + 1]]``). ``groups`` = the expert groups + 1 (rows in no group).
    Every expert row is in exactly one unit."""

    order: torch.Tensor
    target: torch.Tensor
    device_counts: torch.Tensor
    counts: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    starts: list[int]

    def grouped_rows(self, u: int) -> int:
        """Unit u's rows in an expert group: the first ones of the unit."""
        return int(self.counts[u, :-1].sum())

    def segments(self, u: int) -> list[tuple[int, int, int, int | None]]:
        """Unit u's non-empty expert groups as ``(group, pos, count, row0)``: rows ``order[pos:pos + count]``, which
        are the consecutive rows ``row0 ..`` when ``row0`` is not None."""
        out, pos = [], self.starts[u]
        for g, (count, first, last) in enumerate(zip(self.counts[u, :-1].tolist(), self.first[u, :-1].tolist(),
                                                     self.last[u, :-1].tolist(), strict=True)):
            if count:
                out.append((g, pos, count, first if last - first + 1 == count else None))
                pos += count
        return out

    def expert_offsets(self) -> torch.Tensor:
        """Per unit, ``torch._grouped_mm``'s cumulative expert offsets (int32, on the device; computed there, no host
        trip): row u starts with unit u's E offsets; rows are E rounded up to 4 long, so that each row starts 16-byte
        aligned (use ``[u, :E]``)."""
        units, experts = self.device_counts.shape[0], self.device_counts.shape[1] - 1
        table = torch.zeros(units, -(-experts // 4) * 4, dtype=torch.int32, device=self.device_counts.device)
        table[:, :experts] = self.device_counts[:, :experts].cumsum(1)
        return table


def plan_units(index: torch.Tensor, ends: torch.Tensor, unit_bounds: torch.Tensor, buffer_rows: int,
               extra: torch.Tensor | None = None) -> tuple[UnitPlan, torch.Tensor | None]:
    """Cut the expert rows by unit, on ``index``'s device (no per-unit loop; ``index``: the op's, one entry per
    expert row, negative entries counting from the end; ``ends``: the groups' end rows, int64, non-decreasing, on the
    device; ``unit_bounds``: ``offsets(unit_sizes)`` as an int64 device tensor). Brings the per-(unit, group) counts
    and runs, the index check and ``extra`` (an int tensor of the device, e.g. ``offs``; returned on the host as
    int64) to the host in one copy: the call's one host sync on CUDA. Raises ``IndexError`` for an index entry out of
    ``[-buffer_rows, buffer_rows)``, as ``index_put`` does (after that copy; nothing was indexed with it)."""
    dev, rows = index.device, int(index.shape[0])
    units, groups = int(unit_bounds.shape[0]) - 1, int(ends.shape[0]) + 1
    raw = index.to(torch.int64)
    idx = torch.where(raw < 0, raw + buffer_rows, raw)
    bad = (idx < 0) | (idx >= buffer_rows)
    idx = idx.clamp(0, max(buffer_rows - 1, 0))
    row_group = torch.searchsorted(ends, torch.arange(rows, device=dev), right=True)
    unit = torch.searchsorted(unit_bounds[1:].contiguous(), idx, right=True)
    # sorted as int16 where the units fit (a radix sort's passes follow the key's bytes: 2 instead of 8 on CUDA)
    by_unit = torch.sort(unit.to(torch.int16) if units < 2**15 else unit, stable=True)
    order = by_unit.indices
    key = by_unit.values.to(torch.int64) * groups + row_group[order]  # non-decreasing: rows ascend within a unit
    bounds = torch.searchsorted(key, torch.arange(units * groups + 1, device=dev))
    counts = bounds.diff()
    if rows:
        first = order[bounds[:-1].clamp(max=rows - 1)]
        last = order[(bounds[1:] - 1).clamp(min=0)]
        first_bad = bad.to(torch.int8).argmax().view(1)  # a 1-D index: a 0-d one would be read on the host
        check = torch.cat([bad.sum().view(1), raw.index_select(0, first_bad)])
    else:
        first = last = torch.zeros_like(counts)
        check = torch.zeros(2, dtype=torch.int64, device=dev)
    parts = [counts, first, last, check, *([] if extra is None else [extra.reshape(-1).to(torch.int64)])]
    host = torch.cat(parts).cpu().split([p.numel() for p in parts])
    if int(host[3][0]):
        raise IndexError(f"flashoverlap: index {int(host[3][1])} is out of bounds for a buffer of {buffer_rows} rows")
    shape = (units, groups)
    counts_h = host[0].view(shape)
    return (UnitPlan(order, idx[order], counts.view(shape), counts_h, host[1].view(shape), host[2].view(shape),
                     offsets(counts_h.sum(1).tolist())), None if extra is None else host[4])
