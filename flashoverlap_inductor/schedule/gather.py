"""The all_gather -> GEMM schedule: which shard arrives when, and where its rows go (one source of truth for every
route of ``flashoverlap::all_gather_gemm`` and for the cost model).

Geometry. Rank r holds the shard ``a`` ([..., K], any rank >= 2); the gathered tensor is ``cat(shards, gather_dim)``
(``gather_dim`` < ``a.dim() - 1``: never the K dim). With ``lead = prod(a.shape[:gather_dim])`` and ``unit =
prod(a.shape[gather_dim:-1])`` (rows of one shard per leading element), shard j's flattened local row ``p * unit + u``
is flattened gathered row ``p * world * unit + j * unit + u``. So shard j's rows of any [rows, N] result are the
strided view ``y.view(lead, world, unit, N)[:, j]``, contiguous when ``lead == 1`` (gather_dim 0, or leading sizes of
1). The GEMMs of the op are ``y_i = gathered.reshape(-1, K) @ b_i (+ bias_i)``, computed shard by shard into those
views: each output row depends on its own input row only, so the order is free.

Order. Every route computes the local shard first (its rows need no transfer), then the others in ring order
``rank - 1, rank - 2, ...`` (mod world): in a ring all_gather step s brings the shard of rank ``rank - s`` from the
previous rank, so that is the order in which they land.

Pieces. The peer route pulls each peer's shard in 1 .. ``MAX_PIECES`` pieces (``piece_bounds``: runs of flattened
shard rows, on whole leading elements when ``lead > 1``, else on multiples of ``PIECE_ALIGN`` rows) and runs each
piece's GEMMs as soon as that piece landed: with 2 ranks the one peer shard is half the rows, and whole it keeps the
GEMMs waiting ``comm - gemm / 2`` ms whenever the transfer is the longer side. ``pieces(geo, requested)`` is the one
choice of the count (``Tuning.gather_pieces``; None: 1), the cost model's and the route's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_PIECES = 4  # FO_GATHER_MAX_PIECES of csrc/flashoverlap_sm90.h
PIECE_ALIGN = 128  # rows: a piece boundary of a contiguous shard (one GEMM tile's M), so no tile straddles pieces


@dataclass(frozen=True)
class GatherGeometry:
    """Sizes of one all_gather_gemm call (elements and rows; the same on every rank)."""

    world: int
    lead: int  # prod(a.shape[:gather_dim])
    unit: int  # prod(a.shape[gather_dim:-1]): rows of one shard per leading element
    k: int

    @property
    def shard_rows(self) -> int:
        """Flattened rows of one shard (``lead * unit``)."""
        return self.lead * self.unit

    @property
    def rows(self) -> int:
        """Flattened rows of the gathered tensor (``world * shard_rows``)."""
        return self.world * self.shard_rows

    @property
    def contiguous_shards(self) -> bool:
        """Whether each shard's rows are one contiguous run of the gathered rows (then the gathered tensor is the
        dim-0 all_gather's buffer, with no reordering copy)."""
        return self.lead == 1


def geometry(shape: list[int] | torch.Size, gather_dim: int, world: int) -> GatherGeometry:
    """The geometry of a shard of ``shape`` gathered along ``gather_dim`` over ``world`` ranks."""
    return GatherGeometry(world, math.prod(shape[:gather_dim]), math.prod(shape[gather_dim:-1]), shape[-1])


def gathered_shape(shape: list[int] | torch.Size, gather_dim: int, world: int) -> list[int]:
    """The shape of ``cat(shards, gather_dim)``."""
    out = list(shape)
    out[gather_dim] = out[gather_dim] * world
    return out


def arrival_order(rank: int, world: int) -> list[int]:
    """The shards in the order every route computes them: the local one, then ring order."""
    return [(rank - s) % world for s in range(world)]


def shard_view(rows: torch.Tensor, geo: GatherGeometry, j: int) -> torch.Tensor:
    """Shard j's rows of a [geo.rows, C] tensor: [shard_rows, C] when contiguous, else [lead, unit, C] (strided)."""
    if geo.contiguous_shards:
        return rows[j * geo.unit:(j + 1) * geo.unit]
    return rows.view(geo.lead, geo.world, geo.unit, rows.shape[-1])[:, j]


def shard_gemm(x: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = x @ b (+ bias)`` for one shard: ``x`` [shard_rows, K] contiguous; ``out`` a ``shard_view`` ([rows, N]
    or [lead, unit, N] strided). Rounds like aten ``mm`` / ``addmm`` (the bias added inside the GEMM)."""
    if out.dim() == 2:
        if bias is None:
            torch.mm(x, b, out=out)
        else:
            torch.addmm(bias, x, b, out=out)
        return
    lead, unit, n = out.shape
    x3, b3 = x.view(lead, unit, x.shape[-1]), b.expand(lead, *b.shape)
    if bias is None:
        torch.bmm(x3, b3, out=out)
    else:
        torch.baddbmm(bias.expand(lead, unit, n), x3, b3, out=out)


def assemble(staging: torch.Tensor, geo: GatherGeometry, shape: list[int]) -> torch.Tensor:
    """The gathered tensor of ``shape`` from ``staging`` ([world, shard_rows, K]: shard j at ``staging[j]``, the
    dim-0 all_gather's layout): a view when shards are contiguous, else one reordering copy."""
    if geo.contiguous_shards:
        return staging.view(shape)
    return staging.view(geo.world, geo.lead, geo.unit, geo.k).transpose(0, 1).reshape(shape)


def pieces(geo: GatherGeometry, requested: int | None) -> int:
    """Pieces per pulled shard: ``requested`` (1 .. ``MAX_PIECES``; None: 1, measured as fast as more on 2 H200s,
    where a pull never kept the GEMMs waiting), at most the shard's boundaries allow (``lead`` leading elements, or
    ``shard_rows // PIECE_ALIGN`` aligned runs). Pure: the same on every rank."""
    want = 1 if requested is None else int(requested)
    if not 1 <= want <= MAX_PIECES:
        raise ValueError(f"gather pieces: {want} (1 .. {MAX_PIECES})")
    units = geo.lead if geo.lead > 1 else max(1, geo.shard_rows // PIECE_ALIGN)
    return max(1, min(want, units))


def piece_bounds(geo: GatherGeometry, count: int) -> list[tuple[int, int]]:
    """``count`` pieces of a shard as [lo, hi) flattened shard rows: increasing, covering ``[0, shard_rows)``, the
    boundaries on whole leading elements (``lead > 1``: multiples of ``unit``) or on multiples of ``PIECE_ALIGN``
    rows. ``count`` as ``pieces`` gives it."""
    if geo.lead > 1:
        step, units = geo.unit, geo.lead
    else:
        step, units = PIECE_ALIGN, max(1, geo.shard_rows // PIECE_ALIGN)
    cuts = [k * units // count * step for k in range(count)] + [geo.shard_rows]
    return [(cuts[k], cuts[k + 1]) for k in range(count)]


def piece_view(rows: torch.Tensor, geo: GatherGeometry, j: int, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of shard j (a ``piece_bounds`` piece) of a [geo.rows, C] tensor: [hi - lo, C] when shards are
    contiguous, else [(hi - lo) / unit, unit, C] (strided)."""
    if geo.contiguous_shards:
        return rows[j * geo.unit + lo:j * geo.unit + hi]
    return rows.view(geo.lead, geo.world, geo.unit, rows.shape[-1])[lo // geo.unit:hi // geo.unit, j]
