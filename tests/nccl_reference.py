"""Reference models of a wave group's NCCL calls, for the CPU tests of the NCCL route's C steps (test helpers, not
the product): ``issue_group`` issues one group's transfers as raw pointers and element counts on a communicator,
exactly the tensor slices ``routes.cpu.issue_group`` hands to ``torch.distributed``. The C steps that
``routes.nccl.group_steps`` builds must describe exactly these calls (``test_nccl_direct.py``)."""

from __future__ import annotations

import torch

from flashoverlap_inductor.schedule.steps import GroupStep


def issue_group(comm, collective: str, step: GroupStep, buf: torch.Tensor, out_flat: torch.Tensor,
                stream: int) -> None:
    """``routes.cpu.issue_group`` issued straight into NCCL on ``stream`` (the same transfers on the same
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
