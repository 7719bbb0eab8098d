"""The MoE combine's whole-block compute in one library call (``fo_moe_combine_blocks``,
``csrc/moe_combine_blocks.cu``): the routing plan, then per block in send order each term's expert rows gathered by
``inv`` and its grouped GEMM into the block's rows (later terms added in), and an event per block, all enqueued on
the current stream by one ctypes call. ``moe_fast.run_combine`` then issues each peer block's transfer behind its
event (``moe_nccl.transfer(after=...)``), so a block travels while the next computes, as in its Python loop
(~4 torch calls per block and term plus the plan's call).

The own block's rows are written straight into the output (no copy); the peers' into one send buffer, block j at
its first buffer row. The GEMM is the library's grouped GEMM (``native/grouped.py``) where the Python loop calls
``torch._grouped_mm``: both accumulate in fp32 and round once, the terms rounded each and then summed as torch sums
bf16 tensors; the two GEMMs may differ by a bf16 rounding per term (``tests/test_moe_combine_lib.py``: bit for bit
against the library's own uncut GEMM, within that tolerance of torch's).

Taken (``should_run``) on CUDA where the library's MoE steps are in use (``moe_plan_lib.usable``) and no call was
refused in this process, for bf16 terms of the grouped form within the kernels' limits (``moe_plan_kernel.fits``;
1-``MAX_TERMS`` terms; N and each K multiples of 8; weights in a layout the library reads), and where the group's
NCCL communicator is at hand (the transfers then wait for the blocks' events; ``batch_isend_irecv`` would wait for
the whole stream). Per rank: the transfers, the settle and the results are those of the Python loop. A refusal of
the arguments (rc < 100: nothing enqueued) is logged once and every later call takes the Python loop; a failure
after the first launch (rc >= 100) raises ``KernelLibraryError`` (the caller poisons what it sends and settles).
Transfers, settle and routing facts are those of the Python loop; the results differ from it only as the GEMMs do.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from ..native import grouped, kernels
from ..schedule.combine import offsets
from . import moe_plan_kernel, moe_plan_lib
from .base import note, stats

MAX_TERMS = 4  # FO_MOE_MAX_TERMS
_refused: list[str] = []  # the library's refusal of a call's arguments, once: the Python loop from then on
_Blocks = ctypes.c_void_p * moe_plan_lib.MAX_BLOCKS


class CombineArgs(ctypes.Structure):
    """``fo_moe_combine_args`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("plan", moe_plan_lib.PlanArgs), ("terms", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("a", ctypes.c_void_p * MAX_TERMS), ("a_stride", ctypes.c_int64 * MAX_TERMS),
                ("scratch", ctypes.c_void_p * MAX_TERMS), ("sum", ctypes.c_void_p), ("out", _Blocks),
                ("out_stride", ctypes.c_int64), ("ready", _Blocks), ("order", ctypes.c_int32 * moe_plan_lib.MAX_BLOCKS),
                ("gemm", grouped.GroupedGemmArgs * MAX_TERMS), ("stream", ctypes.c_void_p)]


def weights(b: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each term's weights as the library reads them: each expert's ``[N, K]`` (the op's ``[E, K, N]`` transposed)."""
    return [w.transpose(-2, -1) for w in b]


def should_run(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor, index: torch.Tensor,
               world: int) -> bool:
    """Whether ``run`` takes this call (module docstring), for a caller that found ``moe_plan_lib.usable(a[0])``
    and the group's NCCL communicator."""
    if _refused or not 1 <= len(a) <= MAX_TERMS or not moe_plan_kernel.fits(index, offs, world):
        return False
    n, rows = int(b[0].shape[-1]), int(index.shape[0])
    for x, w in zip(a, b, strict=True):  # the library trusts these shapes: checked again here
        if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or not grouped.op_weight_fits(w)
                or x.stride(1) != 1 or x.device != index.device or w.device != index.device
                or int(w.shape[2]) != n or int(x.shape[0]) != rows or int(w.shape[1]) != int(x.shape[1])):
            return False
    return offs.device == index.device and offs.dtype == torch.int32


def run(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor, index: torch.Tensor, ins: list[int],
        order: list[int], send: torch.Tensor | None, own: torch.Tensor, rank: int,
        ready: list[torch.cuda.Event | None], targets: list[torch.Tensor | None] | None = None
        ) -> torch.Tensor | None:
    """Enqueue the combine's compute (module docstring) on the current stream: block j's rows (``ins[j]``, the
    input split sizes) into ``send`` at its first buffer row, or into ``targets[j]`` where given (``moe_peer``: the
    destination's receive slot, mapped here; ``send`` then None), the own block's (``rank``) into ``own``;
    ``ready[j]`` recorded behind block j (None: none). Every destination's rows share ``own``'s stride. ``order``:
    every block once, in compute order. Returns the plan's settle vector (``moe_fast.BlockPlan.facts``), or None
    where the library refused the arguments (nothing enqueued: the caller runs the Python loop). ``should_run``
    holds."""
    bounds = offsets(ins)
    plan_args, (facts,) = moe_plan_lib.plan_args(index, offs, bounds, views=False)
    c = CombineArgs()
    c.plan, c.terms = plan_args, len(a)
    largest = max(ins)
    keep = []
    for t, (x, w) in enumerate(zip(a, weights(b), strict=True)):
        scratch = x.new_empty(max(largest, 1), int(x.shape[1]))
        keep.append(scratch)
        c.a[t], c.a_stride[t], c.scratch[t] = x.data_ptr(), int(x.stride(0)) * 2, scratch.data_ptr()
        c.gemm[t] = grouped.call_args(scratch, w, offs, own, grouped.b_layout_of(w), 0, int(w.shape[0]),
                                      stream=plan_args.stream)  # its out pointer is each block's, set below
    if len(a) > 1:
        total = own.new_empty(max(largest, 1), int(own.shape[1]))
        keep.append(total)
        c.sum = total.data_ptr()
    stride = int(own.stride(0)) * 2
    dests = [send[bounds[j]:bounds[j + 1]] if targets is None else targets[j] for j in range(len(ready))]
    if any(j != rank and ins[j] and (d is None or int(d.stride(0)) * 2 != stride or d.data_ptr() % 16)
           for j, d in enumerate(dests)):
        raise ValueError("flashoverlap: the combine's output and send rows must share one stride, on 16 bytes")
    for j, event in enumerate(ready):
        c.out[j] = own.data_ptr() if j == rank else None if dests[j] is None else dests[j].data_ptr()
        if event is not None and not event.cuda_event:
            event.record()  # torch creates an event at its first record (a null handle before): the library re-records
            # (on the current device's stream: the caller's usable() holds index on the current device)
        c.ready[j] = None if event is None else event.cuda_event
    c.out_stride = stride
    c.order[:len(order)] = order
    c.stream = plan_args.stream
    rc = kernels.ready(index.device).fo_moe_combine_blocks(ctypes.byref(c))
    del keep  # scratch of the current stream: a later allocation on it is ordered after these kernels
    message = kernels.refusal(rc, "fo_moe_combine_blocks")
    if message:
        _refused.append(message)
        note("moe:combine_lib", logging.WARNING, "flashoverlap: fo_moe_combine_blocks refused its arguments (%s); "
             "the combine runs its Python loop from now on", message)
        return None
    stats["moe:combine_lib"] += 1
    stats["moe:plan_lib"] += 1  # the plan by the library's kernels, as on the Python loop
    return facts
