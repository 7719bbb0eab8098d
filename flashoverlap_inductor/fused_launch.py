"""The fused op as one host call into the library (``fo_fused_call``, ``csrc/fused_call.cu``).

``runtime_gpu`` builds a call shape's per-group steps once (``group_steps``: the same transfers as
``runtime_gpu.group_collective`` / ``direct_group_collective``, as offsets into the GEMM buffer and the output)
and then, per call, makes a single ctypes call that enqueues the epoch resync, the stream fork, the signal GEMM,
every group's bounded wait and NCCL call(s) on the side stream, and the join. That removes the per-group Python
work (a ctypes wait launch, an NCCL call, stream switches and events) from the host path of every fused op.

Units: offsets and counts in elements of the [rows, N] row-major buffer and output.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from . import kernels, nccl_direct, row_order, runtime_cpu

log = logging.getLogger("flashoverlap")

# "c" (default): one fo_fused_call per op when the direct NCCL route is available; "python": the per-group loop.
HOST_LOOP: str = os.environ.get("FLASHOVERLAP_HOST_LOOP", "c")


@dataclass(frozen=True)
class CSteps:
    """A call shape's steps as the C structures (kept alive by the launch that owns them)."""

    steps: ctypes.Array
    p2p: ctypes.Array | None
    groups: int

    @property
    def steps_ptr(self) -> int:
        return ctypes.addressof(self.steps)

    @property
    def p2p_ptr(self) -> int | None:
        return ctypes.addressof(self.p2p) if self.p2p is not None else None


def group_steps(collective: str, steps: Sequence[runtime_cpu.GroupStep], tiles: Sequence[int], n: int,
                stage: Sequence[row_order.StageCopy | None] | None = None) -> CSteps:
    """``fo_group_step``/``fo_p2p_step`` arrays for ``steps`` (``runtime_cpu.schedule_steps``, or their natural-row
    form from ``row_order``) with the GEMM's ``tiles`` per group and, per group, its staging copy (``stage``);
    ``n`` = elements per row. all_to_all peers are group ranks (= the communicator's)."""
    arr = (kernels.GroupStep * len(steps))()
    p2p: list[tuple[int, int, int, int]] = []
    for g, step in enumerate(steps):
        s = arr[g]
        s.tiles = int(tiles[g])
        copy = stage[g] if stage else None
        if copy is not None:
            s.copy_src, s.copy_dst, s.copy_width, s.copy_height = copy.src, copy.dst, copy.width, copy.height
            s.copy_src_pitch, s.copy_dst_pitch = copy.src_pitch, copy.dst_pitch
        if collective == "all_reduce":
            s.kind = kernels.STEP_KINDS["all_reduce"] if step.hi > step.lo else kernels.STEP_KINDS["none"]
            s.buf_offset, s.count = step.lo * n, (step.hi - step.lo) * n
        elif collective == "reduce_scatter" and step.sends:  # natural rows: one ncclReduce per piece (row_order)
            s.kind, s.out_offset, s.first_p2p = kernels.STEP_KINDS["reduce_pieces"], step.out[0] * n, len(p2p)
            p2p += [(0, j, lo * n, (hi - lo) * n) for j, lo, hi in step.sends if hi > lo]
            s.num_p2p = len(p2p) - s.first_p2p
        elif collective == "reduce_scatter":
            s.kind = kernels.STEP_KINDS["reduce_scatter"] if step.hi > step.lo else kernels.STEP_KINDS["none"]
            s.buf_offset, s.out_offset = step.lo * n, step.out[0] * n
            s.count = (step.out[1] - step.out[0]) * n
        else:
            s.kind = kernels.STEP_KINDS["all_to_all"]
            s.first_p2p = len(p2p)
            p2p += [(0, j, lo * n, (hi - lo) * n) for j, lo, hi in step.sends if hi > lo]
            p2p += [(1, j, lo * n, (hi - lo) * n) for j, lo, hi in step.recvs if hi > lo]
            s.num_p2p = len(p2p) - s.first_p2p
            if step.local is not None:
                b_lo, o_lo, count = step.local
                s.local_buf, s.local_out, s.local_count = b_lo * n, o_lo * n, count * n
    p2p_arr = None
    if p2p:
        p2p_arr = (kernels.P2PStep * len(p2p))()
        for i, (recv, peer, offset, count) in enumerate(p2p):
            p2p_arr[i].recv, p2p_arr[i].peer, p2p_arr[i].offset, p2p_arr[i].count = recv, peer, offset, count
    return CSteps(arr, p2p_arr, len(steps))


_bound: list[str] = []


def ready(comm: nccl_direct.Communicator | None) -> bool:
    """Whether ``fo_fused_call`` can run this call: the C host loop is on, the direct NCCL route is in use
    (``comm``) and the library is bound to that NCCL (once per process; a failure is logged and disables it)."""
    if HOST_LOOP != "c" or comm is None:
        return False
    if not _bound:
        lib = kernels.library()
        if not hasattr(lib, "fo_fused_call"):
            _bound.append("")
        elif lib.fo_nccl_bind(comm.lib.path.encode()) != 0:
            log.warning("flashoverlap: per-group calls stay in Python: %s", lib.fo_last_error().decode())
            _bound.append("")
        else:
            _bound.append(comm.lib.path)
    return _bound[0] == comm.lib.path
