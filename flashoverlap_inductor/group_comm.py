"""Per-group collectives through ``torch.distributed`` (the route of ``FLASHOVERLAP_NCCL=torch`` and of the
Python host loop's fallback): each group's transfers exactly as ``runtime_cpu._run`` issues them, as tensor slices
of the [rows, N] GEMM buffer and the [rows_out, N] output. ``nccl_direct.direct_group_collective`` and the C host
loop (``fused_launch``) make the same transfers straight into NCCL (``tests/test_nccl_direct.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import ops, runtime_cpu


def group_collective(collective: str, peers: Sequence[int], g: int, step: runtime_cpu.GroupStep, buf: torch.Tensor,
                     out_flat: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Group ``g``'s collective on the current stream, exactly as ``runtime_cpu._run`` issues it: ``buf`` is the
    [rows, N] GEMM buffer, ``out_flat`` the [rows_out, N] output, ``peers`` the global rank of each group rank
    (all_to_all only)."""
    if collective == "all_reduce":
        if step.hi > step.lo:
            dist.all_reduce(buf[step.lo:step.hi], group=group)
    elif collective == "reduce_scatter" and step.sends:  # natural rows: one reduce per chunk piece, in place
        for j, lo, hi in step.sends:
            if hi > lo:
                dist.reduce(buf[lo:hi], dist.get_global_rank(group, j), group=group)
        own = next((lo for j, lo, hi in step.sends if j == group.rank() and hi > lo), None)
        if own is not None:
            out_flat[step.out[0]:step.out[1]].copy_(buf[own:own + step.out[1] - step.out[0]])
    elif collective == "reduce_scatter":
        if step.hi > step.lo:
            ops.reduce_scatter_into(out_flat[step.out[0]:step.out[1]], buf[step.lo:step.hi], group=group)
    else:
        p2p = [dist.P2POp(dist.isend, buf[lo:hi], peers[j], group, tag=g) for j, lo, hi in step.sends]
        p2p += [dist.P2POp(dist.irecv, out_flat[lo:hi], peers[j], group, tag=g) for j, lo, hi in step.recvs]
        if p2p:
            for work in dist.batch_isend_irecv(p2p) or ():
                work.wait()
        if step.local is not None:
            b_lo, o_lo, count = step.local
            out_flat[o_lo:o_lo + count].copy_(buf[b_lo:b_lo + count])
