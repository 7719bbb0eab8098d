"""The unfused route: cuBLAS then one blocking NCCL collective, on the caller's stream.

Takes every CUDA call: the dispatcher's last resort where no fused route takes a call (no library or sm90 GPU,
fp32, unaligned sizes, a batch of distinct ``b``, a plan of one group, a call shape first seen inside a CUDA-graph
capture, ...). Same semantics as every route (``ops``): ``y = a @ b (+ bias)``, then the collective along dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedule import gather as gather_schedule
from ..schedule import steps as schedule
from .base import LastResortRoute, stats

# torch >= 2.13 renamed dist.reduce_scatter_tensor -> reduce_scatter_single (the old name warns); 2.11 has only the
# old one. ``reduce_scatter_into(out, inp, group=...)``: the one version shim every route and tool uses.
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ b (+ bias)`` exactly as aten mm/addmm/bmm/baddbmm round it (bias added inside the GEMM), contiguous."""
    if a.dim() == 2:
        y = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    elif b.dim() == 3:
        y = torch.bmm(a, b) if bias is None else torch.baddbmm(bias, a, b)
    else:
        y = torch.matmul(a, b) if bias is None else torch.matmul(a, b).add_(bias)
    return y.contiguous()


def gather_then_gemms(a: torch.Tensor, b: list, bias: list, group: dist.ProcessGroup, gather_dim: int,
                      shape: list[int], return_gathered: bool) -> list[torch.Tensor]:
    """all_gather -> GEMMs, unfused: one all_gather of the shard, the gathered tensor, one GEMM per weight."""
    geo = gather_schedule.geometry(list(a.shape), gather_dim, group.size())
    staging = a.new_empty(group.size(), geo.shard_rows, geo.k)
    dist.all_gather_into_tensor(staging, a.reshape(geo.shard_rows, geo.k).contiguous(), group=group)
    g = gather_schedule.assemble(staging, geo, shape)
    flat = g.reshape(-1, geo.k)
    outs = [gemm(flat, w, c) for w, c in zip(b, bias, strict=True)]
    return [*outs, g] if return_gathered else outs


def run(collective: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
        output_split_sizes=None, input_split_sizes=None) -> torch.Tensor:
    """The whole call, unfused."""
    y = gemm(a, b, bias)
    if collective == "all_reduce":
        dist.all_reduce(y, group=group)
        return y
    if collective == "reduce_scatter":
        out = y.new_empty([y.shape[0] // group.size(), *y.shape[1:]])
        reduce_scatter_into(out, y, group=group)
        return out
    outs, ins = schedule.all_to_all_splits(y.shape[0], group.size(), output_split_sizes, input_split_sizes)
    out = y.new_empty([sum(outs), *y.shape[1:]])
    dist.all_to_all_single(out, y, outs, ins, group=group)
    return out


def reference(collective: str, ctx) -> object:
    """The call of ``ctx`` unfused: what this route returns for it (the semantics every route has)."""
    if collective == "all_gather":
        return gather_then_gemms(ctx.a, ctx.b, ctx.bias, ctx.group, ctx.gather_dim, ctx.y_shape, ctx.return_gathered)
    return run(collective, ctx.a, ctx.b, ctx.bias, ctx.group, ctx.output_split_sizes, ctx.input_split_sizes)


class UnfusedRoute(LastResortRoute):
    name = "unfused"
    devices = ("cuda",)

    def execute(self, launch: tuple[str], ctx) -> torch.Tensor:
        stats["unfused"] += 1
        return reference(launch[0], ctx)


ROUTE = UnfusedRoute()
