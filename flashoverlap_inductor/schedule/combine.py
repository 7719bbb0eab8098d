"""Geometry of the fused MoE combine (``flashoverlap::gemm_unpermute_all_to_all``, ``ops``): which GEMM rows land in
which send block, and the order in which a rank computes and sends its blocks. Pure functions of the op's arguments
(host int64 tensors and ints); the CPU route uses them now, a GPU route would use the same cut.

Terms (all sizes in rows):

* the GEMM output ``y`` has ``entries`` rows (one per index entry), cut into *groups* (experts): group g is rows
  ``[ends[g - 1], ends[g])`` (``ends[-1]`` 0 before the first); rows at or past ``ends[-1]`` are in no group (the
  grouped GEMM leaves them undefined; the op makes them 0, and writes nothing for them);
* row r goes to row ``index[r]`` of the send buffer, which has ``R = sum(send_sizes)`` rows (a negative index counts
  from the end, as in ``index_put``); the send buffer is cut into ``world`` *blocks*, block j = rows
  ``[send_off[j], send_off[j + 1])``, which the all_to_all sends to rank j.

The pipelining idea: ``y``'s rows are ordered by expert, the blocks by destination, so block j needs some rows of
every expert. ``plan_blocks`` lists, per block, each expert's rows for it (a contiguous run in the MoE forms: expert
e's rows are ordered by source rank) and where each lands in the block, so a rank computes block j's rows alone,
writes them into block j and sends it while it computes the next block. ``block_order``: the other ranks' blocks
first (their transfers start early), this rank's own block last (it moves by a local copy, overlapping the
transfers in flight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def block_order(world: int, rank: int) -> list[int]:
    """The blocks in the order a rank computes and sends them: ``rank + 1, rank + 2, ...`` (mod ``world``), then
    ``rank`` itself. Every rank's order is a permutation of ``range(world)``."""
    return [(rank + s) % world for s in range(1, world)] + [rank]


def offsets(sizes: Sequence[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]`` (``len(sizes) + 1`` entries)."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out


def group_ends(sizes_or_offs: Sequence[int] | torch.Tensor, rows: int, cumulative: bool) -> list[int]:
    """The groups' end rows: from per-group row counts (``cumulative=False``: the per-expert loop's pieces) or from
    ``torch._grouped_mm``'s cumulative offsets (``cumulative=True``), clamped to ``rows``. Raises ``ValueError`` for
    decreasing offsets or negative sizes."""
    values = [int(x) for x in (sizes_or_offs.tolist() if isinstance(sizes_or_offs, torch.Tensor) else sizes_or_offs)]
    ends = values if cumulative else offsets(values)[1:]
    if any(x < 0 for x in values) or any(b < a for a, b in zip(ends, ends[1:], strict=False)):
        raise ValueError(f"flashoverlap: expert group offsets must be non-negative and non-decreasing, got {values}")
    return [min(e, rows) for e in ends]


def normalize_index(index: torch.Tensor, send_rows: int) -> torch.Tensor:
    """``index`` as int64 destination rows in ``[0, send_rows)`` (negative entries count from the end); raises
    ``IndexError`` for an entry out of range, as ``index_put`` does."""
    idx = index.to(torch.int64)
    idx = torch.where(idx < 0, idx + send_rows, idx)
    if idx.numel() and (bool((idx < 0).any()) or bool((idx >= send_rows).any())):
        bad = index[(idx < 0) | (idx >= send_rows)][0].item()
        raise IndexError(f"flashoverlap: index {bad} is out of bounds for a send buffer of {send_rows} rows")
    return idx


@dataclass(frozen=True)
class Segment:
    """Rows of one group (expert) that go to one block. ``first``/``count``: the rows ``[first, first + count)`` of
    ``y`` when ``rows`` is None (contiguous), else ``rows`` (int64, ascending) lists them; ``dest``: each row's
    destination row inside the block (int64, ``count`` entries)."""

    group: int
    first: int
    count: int
    rows: torch.Tensor | None
    dest: torch.Tensor

    def row_ids(self) -> torch.Tensor:
        """The rows of ``y`` (int64), contiguous or not."""
        return torch.arange(self.first, self.first + self.count) if self.rows is None else self.rows


@dataclass(frozen=True)
class Block:
    """Send block ``block`` = send-buffer rows ``[lo, hi)``; ``segments``: the rows of ``y`` it receives, by group."""

    block: int
    lo: int
    hi: int
    segments: tuple[Segment, ...]


def plan_blocks(index: torch.Tensor, ends: Sequence[int], send_sizes: Sequence[int]) -> list[Block]:
    """Per block (indexed by destination rank), the rows of ``y`` it receives, cut by group (module docstring).
    ``index``: normalized (``normalize_index``), one entry per row of ``y``; ``ends``: ``group_ends``. Every row of a
    group appears in exactly one segment; rows in no group in none."""
    idx = index.to(torch.int64).cpu()
    off = offsets(send_sizes)
    block_of = torch.searchsorted(torch.tensor(off[1:], dtype=torch.int64), idx, right=True)
    blocks = []
    for j in range(len(send_sizes)):
        rows = torch.nonzero(block_of == j).flatten()  # ascending
        segs = []
        start = 0
        for g, end in enumerate(ends):
            lo = int(torch.searchsorted(rows, start))
            hi = int(torch.searchsorted(rows, end))
            start = end
            if hi == lo:
                continue
            sel = rows[lo:hi]
            first, count = int(sel[0]), hi - lo
            contiguous = int(sel[-1]) - first + 1 == count
            segs.append(Segment(g, first, count, None if contiguous else sel, idx[sel] - off[j]))
        blocks.append(Block(j, off[j], off[j + 1], tuple(segs)))
    return blocks
