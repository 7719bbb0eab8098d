"""CUDA runtime of the fused ops: for now cuBLAS then NCCL, unfused (the kernel library replaces this body).

Same entry points and semantics as ``runtime_cpu`` (see ``ops``): ``y = a @ b (+ bias)`` on the current stream,
then one blocking collective on the op's group. The plan is accepted and ignored here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import ops

log = logging.getLogger("flashoverlap")

_announced = False


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    global _announced
    if not _announced:
        _announced = True
        log.info("flashoverlap: CUDA fused kernels not built yet; running cuBLAS then NCCL (no overlap)")
    if a.dim() == 2:  # bias added inside the GEMM (one rounding), exactly like aten addmm/baddbmm
        y = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    elif b.dim() == 3:
        y = torch.bmm(a, b) if bias is None else torch.baddbmm(bias, a, b)
    else:
        y = torch.matmul(a, b) if bias is None else torch.matmul(a, b).add_(bias)
    return y.contiguous()


def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
                    plan: str) -> torch.Tensor:
    y = _gemm(a, b, bias)
    dist.all_reduce(y, group=group)
    return y


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
                        plan: str) -> torch.Tensor:
    y = _gemm(a, b, bias)
    out = y.new_empty([y.shape[0] // group.size(), *y.shape[1:]])
    ops.reduce_scatter_into(out, y, group=group)
    return out


def gemm_all_to_all(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                    output_split_sizes: Sequence[int] | None, input_split_sizes: Sequence[int] | None,
                    group: dist.ProcessGroup, plan: str) -> torch.Tensor:
    y = _gemm(a, b, bias)
    outs, ins = ops.all_to_all_splits(y.shape[0], group.size(), output_split_sizes, input_split_sizes)
    out = y.new_empty([sum(outs), *y.shape[1:]])
    dist.all_to_all_single(out, y, outs, ins, group=group)
    return out
