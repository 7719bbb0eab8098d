"""The MoE dispatch cut by expert's compute in one library call (``fo_moe_dispatch_cut``, ``csrc/moe_dispatch_cut.cu``):
after ``moe_expert_cut.run_dispatch`` issued its transfers, the routing plan, the own block's moves, and per expert
piece the peers' landed chunks moved into ``p`` and the terms' grouped GEMMs, all enqueued on the current stream by
one ctypes call. The same steps as the Python loop of ``moe_expert_cut`` (whose library steps it composes: the same
kernels in the same order, so the same bits), which held the host ~360 us per call at Qwen3-MoE 2048 tokens on one
H200 (forty-fourth session, docs/results.md) in ~10 steps of 20-90 us each.

Taken (``should_run``) on CUDA where the library's MoE steps are in use (``moe_plan_lib.usable``; not under the
experiment ``moe_plan_triton``) and no call was refused in this process, within the kernels' limits
(``moe_plan_kernel.fits``: 1-8 blocks, at most 1024 experts; 1-``MAX_PIECES`` pieces; 1-4 terms), and where every
issued transfer is a ``moe_nccl.Transfer`` (an event the library's stream waits for; ``torch.distributed``'s works
before the group's communicator exists go by the Python loop). Per rank, like the Python loop's library steps: the
transfers, the settle and the results are the same on either path. A refusal of the arguments (before any launch,
rc < 100: nothing was enqueued) is logged once and every later call takes the Python loop; a failure after the
first launch (rc >= 100: a CUDA error, or a step that failed with earlier steps enqueued) is raised (the call's
failure).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from ..native import grouped, kernels
from ..schedule.combine import offsets
from . import moe_nccl, moe_peer, moe_plan_kernel, moe_plan_lib
from .base import note, stats

MAX_UNITS = moe_plan_lib.MAX_BLOCKS * moe_plan_lib.MAX_PIECES  # FO_MOE_MAX_UNITS
MAX_TERMS = 4  # FO_MOE_MAX_TERMS
_refused: list[str] = []  # the library's refusal of a call's arguments, once: the Python loop from then on


class DispatchArgs(ctypes.Structure):
    """``fo_moe_dispatch_args`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("plan", moe_plan_lib.PlanArgs), ("rank", ctypes.c_int32), ("pieces", ctypes.c_int32),
                ("terms", ctypes.c_int32), ("reserved", ctypes.c_int32), ("x", ctypes.c_void_p),
                ("recv", ctypes.c_void_p), ("p", ctypes.c_void_p), ("x_stride", ctypes.c_int64),
                ("recv_stride", ctypes.c_int64), ("p_stride", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("x_off", ctypes.c_int64 * moe_plan_lib.MAX_PIECES), ("recv_off", ctypes.c_int64 * (MAX_UNITS + 1)),
                ("landed", ctypes.c_void_p * MAX_UNITS), ("order", ctypes.c_int32 * moe_plan_lib.MAX_BLOCKS),
                ("gemm", grouped.GroupedGemmArgs * MAX_TERMS), ("stream", ctypes.c_void_p)]


def should_run(x: torch.Tensor, index: torch.Tensor, offs: torch.Tensor, world: int, pieces: int, terms: int,
               landing: list[tuple[int, list]]) -> bool:
    """Whether ``run`` takes this call (module docstring), for a caller that found ``moe_plan_lib.usable(x)`` (asked
    once per call, by ``moe_expert_cut.run_dispatch``); ``x``: the dispatch's rows (bf16, as the cut takes)."""
    return (not _refused and 1 <= pieces <= moe_plan_lib.MAX_PIECES and 1 <= terms <= MAX_TERMS
            and moe_plan_kernel.fits(index, offs, world) and index.device == x.device and offs.device == x.device
            and all(isinstance(w, (moe_nccl.Transfer, moe_peer.Landed)) for _, works in landing for w in works))


def run(x: torch.Tensor, recv: torch.Tensor, index: torch.Tensor, offs: torch.Tensor, block_rows: list[int],
        cuts: list[list[int]], terms: list[tuple[torch.Tensor, torch.Tensor]], p: torch.Tensor,
        send_off: list[int], recv_off: list[int], landing: list[tuple[int, list]], order: list[int], rank: int,
        pieces: int) -> torch.Tensor | None:
    """Enqueue the cut's compute (module docstring) on the current stream: ``p`` (the expert rows) and each term's
    ``y`` of ``terms`` (``(w, y)``: ``w`` each expert's ``[N, K]`` weight as ``grouped.b_layout_of`` reads it).
    ``block_rows``: the blocks' rows in the buffer (the output split sizes); ``cuts``, ``send_off``, ``recv_off``:
    ``moe_expert_cut.run_dispatch``'s; ``landing``: the transfers' ``(unit, works)``; ``order``: the peer blocks in
    the order their chunks are moved. Returns the plan's settle vector (``moe_fast.BlockPlan.facts``), or None where
    the library refused the arguments (nothing enqueued: the caller runs the Python loop). ``should_run`` holds."""
    plan_args, (facts,) = moe_plan_lib.plan_args(index, offs, offsets(block_rows), cuts, views=False)
    a = DispatchArgs()
    a.plan = plan_args
    a.rank, a.pieces, a.terms = rank, pieces, len(terms)
    row_bytes = int(x.shape[1]) * x.element_size()
    a.x, a.recv, a.p = x.data_ptr(), recv.data_ptr(), p.data_ptr()
    a.x_stride, a.p_stride, a.row_bytes = int(x.stride(0)) * x.element_size(), int(p.stride(0)) * p.element_size(), \
        row_bytes
    a.recv_stride = int(recv.stride(0)) * recv.element_size()
    a.x_off[:pieces] = send_off[rank * pieces:(rank + 1) * pieces]
    a.recv_off[:len(recv_off)] = recv_off
    for u, works in landing:
        if works:
            a.landed[u] = works[-1].done.cuda_event  # the unit's last step: NCCL runs a stream's steps in order
    a.order[:len(order)] = order
    for t, (w, y) in enumerate(terms):
        a.gemm[t] = grouped.call_args(p, w, offs, y, grouped.b_layout_of(w), 0, int(w.shape[0]),
                                      stream=plan_args.stream)
    a.stream = plan_args.stream
    message = kernels.refusal(kernels.ready(x.device).fo_moe_dispatch_cut(ctypes.byref(a)), "fo_moe_dispatch_cut")
    if message:
        _refused.append(message)
        note("moe:cut_lib", logging.WARNING, "flashoverlap: fo_moe_dispatch_cut refused its arguments (%s); the "
             "dispatch cut by expert runs its Python steps from now on", message)
        return None
    stats["moe:cut_lib"] += 1
    stats["moe:plan_lib"] += 1  # the plan and the moves by the library's kernels, as on the Python steps
    stats["moe:move_lib"] += 1
    return facts
