"""Reference models of a wave group's NCCL calls, for the CPU tests of the NCCL route's C steps (test helpers, not
the product): ``group_collective`` issues one group's transfers as ``torch.distributed`` calls on tensor slices,
``issue_group`` the same transfers as raw pointers and element counts on a communicator. The C steps that
``routes.nccl.group_steps`` builds must describe exactly these calls (``test_nccl_direct.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from flashoverlap_inductor.routes.unfused import reduce_scatter_into
from flashoverlap_inductor.schedule.steps import GroupStep


def group_collective(collective: str, peers: Sequence[int], g: int, step: GroupStep, buf: torch.Tensor,
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
            reduce_scatter_into(out_flat[step.out[0]:step.out[1]], buf[step.lo:step.hi], group=group)
    else:
        p2p = [dist.P2POp(dist.isend, buf[lo:hi], peers[j], group, tag=g) for j, lo, hi in step.sends]
        p2p += [dist.P2POp(dist.irecv, out_flat[lo:hi], peers[j], group, tag=g) for j, lo, hi in step.recvs]
        if p2p:
            for work in dist.batch_isend_irecv(p2p) or ():
                work.wait()
        if step.local is not None:
            b_lo, o_lo, count = step.local
            out_flat[o_lo:o_lo + count].copy_(buf[b_lo:b_lo + count])


def issue_group(comm, collective: str, step: GroupStep, buf: torch.Tensor, out_flat: torch.Tensor,
                stream: int) -> None:
    """``runtime_gpu.group_collective`` issued straight into NCCL on ``stream`` (the same transfers on the same
    communicator; all_to_all peers are group ranks, which are the communicator's ranks). Every range is contiguous
    rows of a row-major [rows, N] tensor, so it is one pointer and an element count."""
    n, dtype = buf.shape[1], buf.dtype
    row_bytes = n * buf.element_size()
    b0, o0 = buf.data_ptr(), out_flat.data_ptr()
    if collective == "all_reduce":
        if step.hi > step.lo:
            comm.all_reduce(b0 + step.lo * row_bytes, b0 + step.lo * row_bytes, (step.hi - step.lo) * n, dtype, stream)
    elif collective == "reduce_scatter" and step.sends:  # natural rows: one reduce per chunk piece (row_order)
        pieces = [(j, b0 + lo * row_bytes, (hi - lo) * n) for j, lo, hi in step.sends if hi > lo]
        if pieces:
            comm.reduce_pieces(pieces, o0 + step.out[0] * row_bytes, dtype, stream)
    elif collective == "reduce_scatter":
        if step.hi > step.lo:
            comm.reduce_scatter(b0 + step.lo * row_bytes, o0 + step.out[0] * row_bytes,
                                (step.out[1] - step.out[0]) * n, dtype, stream)
    else:
        sends = [(j, b0 + lo * row_bytes, (hi - lo) * n) for j, lo, hi in step.sends if hi > lo]
        recvs = [(j, o0 + lo * row_bytes, (hi - lo) * n) for j, lo, hi in step.recvs if hi > lo]
        if sends or recvs:
            comm.send_recv(sends, recvs, dtype, stream)
        if step.local is not None:
            b_lo, o_lo, count = step.local
            out_flat[o_lo:o_lo + count].copy_(buf[b_lo:b_lo + count])
