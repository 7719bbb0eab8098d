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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
