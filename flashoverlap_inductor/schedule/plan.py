"""Wave-group plans and output layouts: the one source of truth for the tile -> group mapping.

A fused GEMM+collective writes its [rows, N] result into an output *buffer*, tile by tile, in row-major tile
order (all N-tiles of a tile-row before the next tile-row). The buffer's rows are cut into G contiguous
*groups*; the collective of group g starts as soon as every tile overlapping its rows is in memory. Every
consumer of this fact (the GPU kernel launcher, the CPU schedule, the cost model, the tests) calls the
functions below; none recomputes it.

Units: rows and columns are elements of the GEMM output; tiles are ``tile_m x tile_n`` output tiles;
"tile-row" t covers buffer rows ``[t * tile_m, min((t + 1) * tile_m, rows))``.

Layout. The GEMM input ``A`` is split along its rows into *chunks*: one chunk for all_reduce (the whole
matrix), ``world_size`` equal chunks for reduce_scatter (chunk k is rank k's shard) and the
``input_split_sizes`` chunks for all_to_all (chunk k goes to rank k). Group g takes from every chunk k the
piece ``[floor(L_k * B_g / M), floor(L_k * B_{g+1} / M))`` of that chunk's rows, where ``B`` are the plan's
nominal row bounds and ``M`` the total rows. The buffer holds group 0's pieces (chunk 0's piece, then chunk
1's, ...), then group 1's, and so on. So each group is one contiguous range of the buffer, and a collective on
that range delivers, for reduce_scatter and all_to_all, the next contiguous piece of every rank's natural
output. With one chunk the buffer *is* the natural [M, N] output (no reordering at all).

On the GPU the buffer order can also be reached without moving A (``row_order``, the default): the GEMM keeps the
natural rows and its scheduler runs the tile-rows in group order; ``natural_group_of_tile_row`` is the tile ->
group mapping of that route and ``scheduled_tile_rows`` its order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class GroupPlan:
    """How one GEMM's output rows are cut into wave groups.

    Invariants (checked by ``__post_init__``): ``row_bounds[0] == 0``, ``row_bounds[-1] == m``, strictly
    increasing; ``tile_m, tile_n >= 1``. ``kernel`` names a GPU kernel configuration ("" = the default).
    """

    m: int
    n: int
    tile_m: int
    tile_n: int
    row_bounds: tuple[int, ...]
    kernel: str = ""

    def __post_init__(self) -> None:
        b = self.row_bounds
        if self.m < 1 or self.n < 1 or self.tile_m < 1 or self.tile_n < 1:
            raise ValueError(f"GroupPlan: sizes must be positive, got {self}")
        if len(b) < 2 or b[0] != 0 or b[-1] != self.m or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"GroupPlan: row_bounds must rise strictly from 0 to m={self.m}, got {b}")

    @property
    def num_groups(self) -> int:
        return len(self.row_bounds) - 1

    @property
    def tile_rows(self) -> int:
        """Number of tile-rows of the output (the last one may be partial)."""
        return math.ceil(self.m / self.tile_m)

    @property
    def tile_cols(self) -> int:
        return math.ceil(self.n / self.tile_n)

    def group_rows(self) -> list[int]:
        """Nominal rows per group (before per-chunk rounding)."""
        return [y - x for x, y in zip(self.row_bounds, self.row_bounds[1:])]

    def to_str(self) -> str:
        """Compact text form, stored as a string argument of the fused op (FX-graph- and cache-friendly)."""
        bounds = ",".join(str(x) for x in self.row_bounds)
        return f"v1;m={self.m};n={self.n};tile={self.tile_m}x{self.tile_n};bounds={bounds};kernel={self.kernel}"

    @staticmethod
    def from_str(text: str) -> GroupPlan:
        fields = dict(part.split("=", 1) for part in text.split(";")[1:])
        if not text.startswith("v1;"):
            raise ValueError(f"unknown plan format: {text!r}")
        tm, tn = (int(x) for x in fields["tile"].split("x"))
        bounds = tuple(int(x) for x in fields["bounds"].split(","))
        return GroupPlan(int(fields["m"]), int(fields["n"]), tm, tn, bounds, fields.get("kernel", ""))


def uniform_plan(
    m: int, n: int, tile_m: int, tile_n: int, num_groups: int, align: int = 1, kernel: str = ""
) -> GroupPlan:
    """``num_groups`` groups of (nearly) equal whole tile-rows; every inner bound is a multiple of
    ``lcm(tile_m, align)`` rows. Fewer groups result when the matrix has fewer aligned blocks."""
    unit = math.lcm(tile_m, align)
    blocks = max(1, m // unit)
    g = max(1, min(num_groups, blocks))
    inner = sorted({round(blocks * i / g) * unit for i in range(1, g)} - {0})
    bounds = (0, *[x for x in inner if x < m], m)
    return GroupPlan(m, n, tile_m, tile_n, bounds, kernel)


def plan_from_tile_row_counts(
    m: int, n: int, tile_m: int, tile_n: int, counts: Sequence[int], kernel: str = ""
) -> GroupPlan:
    """A plan whose group g holds ``counts[g]`` tile-rows (the last group is clipped at ``m``)."""
    bounds, acc = [0], 0
    for c in counts:
        acc = min(m, acc + c * tile_m)
        if acc > bounds[-1]:
            bounds.append(acc)
    if bounds[-1] != m:
        bounds.append(m)
    return GroupPlan(m, n, tile_m, tile_n, tuple(bounds), kernel)


def chunk_pieces(chunks: Sequence[int], row_bounds: Sequence[int]) -> list[list[int]]:
    """``pieces[g][k]``: rows of chunk k that group g carries; chunk k is cut at ``floor(L_k * B_g / B_G)``.

    Each chunk's pieces sum to its length. The cut depends only on the chunk's length and the plan's
    fractions ``B_g / B_G``, so a receiver computes what a sender with the same fractions sends it by calling
    this on its ``output_split_sizes`` (all_to_all) without knowing the sender's rows.
    """
    total = row_bounds[-1]
    cuts = [[(length * b) // total for b in row_bounds] for length in chunks]
    return [[c[g + 1] - c[g] for c in cuts] for g in range(len(row_bounds) - 1)]


@dataclass(frozen=True)
class BufferLayout:
    """Where each group lives in the output buffer, and which input rows fill it.

    ``group_bounds`` are the realized buffer-row bounds (len G+1). ``pieces[g][k]`` are the rows of chunk k in
    group g. ``segments`` lists contiguous copies ``(buffer_row, source_row, rows)`` that map the natural input
    rows onto the buffer, in buffer order; with one chunk it is a single identity segment.
    """

    group_bounds: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    segments: tuple[tuple[int, int, int], ...]

    @property
    def is_identity(self) -> bool:
        return len(self.segments) == 1 and self.segments[0][0] == self.segments[0][1] == 0

    def group_segments(self, g: int) -> list[tuple[int, int, int]]:
        """The segments of group g, clipped to its buffer rows ``group_bounds[g]..group_bounds[g+1]``
        (a merged segment may span several groups)."""
        lo, hi = self.group_bounds[g], self.group_bounds[g + 1]
        out = []
        for dst, src, rows in self.segments:
            start, stop = max(dst, lo), min(dst + rows, hi)
            if start < stop:
                out.append((start, src + start - dst, stop - start))
        return out

    def output_offsets(self, g: int) -> list[int]:
        """For each chunk k, the row offset inside chunk k's destination where group g's piece lands
        (the sum of the earlier groups' pieces of that chunk)."""
        return [sum(p[k] for p in self.pieces[:g]) for k in range(len(self.pieces[0]))]

    def natural_pieces(self, g: int) -> list[tuple[int, int, int]]:
        """``(buffer_row, natural_row, rows)`` of every chunk's piece in group g, chunk by chunk (empty pieces
        included): where the piece sits in the buffer and in the natural (input / GEMM output) row order."""
        chunk_len = [sum(p[k] for p in self.pieces) for k in range(len(self.pieces[0]))]
        offsets = self.output_offsets(g)
        out, buf_row = [], self.group_bounds[g]
        for k, rows in enumerate(self.pieces[g]):
            out.append((buf_row, sum(chunk_len[:k]) + offsets[k], rows))
            buf_row += rows
        return out

    def natural_row(self, buffer_row: int, rows: int = 1) -> int:
        """The natural row of ``buffer_row``; raises unless the ``rows`` buffer rows from it are also contiguous in
        natural order (one piece, or pieces that happen to be adjacent)."""
        for dst, src, count in self.segments:
            if dst <= buffer_row and buffer_row + rows <= dst + count:
                return src + buffer_row - dst
        raise ValueError(f"buffer rows {buffer_row}..{buffer_row + rows} are not contiguous in natural order")


def buffer_layout(plan: GroupPlan, chunks: Sequence[int]) -> BufferLayout:
    """The buffer layout of ``plan`` for input chunks ``chunks`` (see the module docstring)."""
    if sum(chunks) != plan.m:
        raise ValueError(f"chunks {list(chunks)} do not sum to the plan's rows {plan.m}")
    pieces = chunk_pieces(chunks, plan.row_bounds)
    starts = [sum(chunks[:k]) for k in range(len(chunks))]
    done = [0] * len(chunks)
    bounds, segments, row = [0], [], 0
    for per_chunk in pieces:
        for k, rows in enumerate(per_chunk):
            if rows:
                segments.append((row, starts[k] + done[k], rows))
                done[k] += rows
                row += rows
        bounds.append(row)
    merged: list[tuple[int, int, int]] = []
    for seg in segments:  # join runs that are contiguous on both sides
        if merged and merged[-1][0] + merged[-1][2] == seg[0] and merged[-1][1] + merged[-1][2] == seg[1]:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + seg[2])
        else:
            merged.append(seg)
    return BufferLayout(tuple(bounds), tuple(tuple(p) for p in pieces), tuple(merged))


def group_of_tile_row(group_bounds: Sequence[int], tile_m: int) -> list[int]:
    """THE tile -> group mapping: tile-row t belongs to the group that holds its first row.

    A tile-row that straddles groups g and g+1 is counted in g; group g+1 is released after g on the same
    stream, so it never reads rows before they are written. Every tile of a tile-row shares its group.
    """
    rows = group_bounds[-1]
    out, g = [], 0
    for t in range(math.ceil(rows / tile_m)):
        while group_bounds[g + 1] <= t * tile_m:
            g += 1
        out.append(g)
    return out


def natural_group_of_tile_row(layout: BufferLayout, tile_m: int) -> list[int]:
    """THE tile -> group mapping when the GEMM keeps the natural row order and the scheduler runs the tile-rows in
    group order (``scheduled_tile_rows``; the "schedule" route of reduce_scatter / all_to_all layouts).

    Natural tile-row t belongs to the earliest group that holds any of its rows (a tile-row may straddle pieces
    of several groups, e.g. two chunks). Groups are released in order on one stream, so every later group it
    touches is released after it: no group ever reads rows before they are written.
    """
    rows = layout.group_bounds[-1]
    out = [len(layout.pieces)] * math.ceil(rows / tile_m)
    for g in range(len(layout.pieces)):
        for _, natural, count in layout.natural_pieces(g):
            if count:
                for t in range(natural // tile_m, -(-(natural + count) // tile_m)):
                    out[t] = min(out[t], g)
    return out


def scheduled_tile_rows(group_of_row: Sequence[int]) -> list[int]:
    """The scheduler's tile-row order for ``group_of_row`` (``natural_group_of_tile_row``): by group, then by
    tile-row. Entry s is the tile-row computed where the natural schedule would compute tile-row s
    (``csrc/tile_order.hpp``)."""
    return sorted(range(len(group_of_row)), key=lambda t: (group_of_row[t], t))


def tiles_of_groups(group_of_row: Sequence[int], num_groups: int, tile_n: int, n: int) -> list[int]:
    """Tiles each group waits for under a tile-row -> group map (any layout): tile-rows x ``ceil(n / tile_n)``."""
    cols = math.ceil(n / tile_n)
    out = [0] * num_groups
    for g in group_of_row:
        out[g] += cols
    return out


def tiles_per_group(group_bounds: Sequence[int], tile_m: int, tile_n: int, n: int) -> list[int]:
    """Tiles whose completion group g waits for (a group may own none: it then waits for nothing).

    Closed form of counting ``group_of_tile_row``: group g owns the tile-rows t with ``t * tile_m`` in
    ``[B_g, B_{g+1})``, i.e. ``ceil(B_{g+1} / tile_m) - ceil(B_g / tile_m)`` of them.
    """
    cols = math.ceil(n / tile_n)
    first = [-(-b // tile_m) for b in group_bounds]
    return [(hi - lo) * cols for lo, hi in zip(first, first[1:])]


def chunks_for(
    collective: str, rows: int, world_size: int, input_split_sizes: Sequence[int] | None = None
) -> list[int]:
    """The input chunks of ``collective`` over ``rows`` output rows (see the module docstring)."""
    if collective == "all_reduce":
        return [rows]
    if collective == "reduce_scatter":
        if rows % world_size:
            raise ValueError(f"reduce_scatter: {rows} rows do not divide by world size {world_size}")
        return [rows // world_size] * world_size
    if collective == "all_to_all":
        if input_split_sizes:
            return [int(x) for x in input_split_sizes]
        if rows % world_size:
            raise ValueError(f"all_to_all: {rows} rows do not divide by world size {world_size}")
        return [rows // world_size] * world_size
    raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
