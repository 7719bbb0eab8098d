"""The whole-block path's small steps as library calls (``csrc/moe_plan.cu``), the default wherever the library
loads (the experiment ``moe_plan_triton`` turns them off): the routing plan (``fo_moe_plan``), the deferred settle's
poison (``fo_moe_poison``) and the dispatch's moves of a block's rows and GEMM results into expert order
(``fo_moe_move_rows``: all of a block's in one call).

Same results as ``moe_plan_kernel``'s Triton kernels (``tests/test_moe_plan_kernel.py`` runs the same cases through
both against the torch reference), in one ctypes call each where the Triton path takes a torch fill and two launches
(the plan) or one launch (the poison): on the 2-GPU hosts a Triton launch held the host 40-80 us even straight into
its compiled kernel (``runtime/triton_launch.py``; docs/results.md, twenty-fourth session), about a quarter of a fused
MoE call's host time. On 2 H200s (twenty-fifth session) the library made the deferred dispatch 1.10-1.20x and the
combine 1.08-1.22x faster at qwen3 shapes, and its GPU tests passed.

Taken (``should_plan`` / ``should_poison`` / ``should_move``) unless ``moe_plan_triton`` is on, where the tensors are
on the current CUDA device, the library loads on an sm90 GPU (``native.kernels.available``) and the call is within the
kernels' limits (``moe_plan_kernel.fits``, checked by its caller; outputs of 2-, 4- or 8-byte floats, 1-8 ranks; 2-D
moves with contiguous rows); counted ``moe:plan_lib``, ``moe:poison_lib`` and ``moe:move_lib``. A call the library
refuses (its arguments: error codes below 100) is logged once and, like every later one, taken by the Triton kernels
and torch ops; the device's own errors (CUDA errors) are raised.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from .. import _inductor_compat as compat
from .. import config
from ..native import kernels
from . import moe_settle
from .base import note, stats

OPT_OUT = "moe_plan_triton"  # the experiment that keeps these steps in Triton launches and torch ops
MAX_BLOCKS = 8  # FO_MOE_MAX_BLOCKS
MAX_PIECES = 8  # FO_MOE_MAX_PIECES
POISON_SLOTS = 4  # FO_MOE_POISON_SLOTS
MOVE_SLOTS = 4  # FO_MOE_MOVE_SLOTS
# the settle vector's layout the kernels assume (FO_MOE_SETTLE_LEN fields in this order)
assert (moe_settle.FAIL, moe_settle.ROWS, moe_settle.IDX_MAX, moe_settle.IDX_MIN, moe_settle.OFFS_STEP,
        moe_settle.UNNAMED, moe_settle.OFFS_LAST, moe_settle.KEY_STEP) == tuple(range(8)) \
    and moe_settle.SETTLE_LEN == 8, "csrc/moe_plan.cu assumes the settle vector's layout"
_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000,
             torch.float64: 0x7FF8000000000000}


class PlanArgs(ctypes.Structure):
    """``fo_moe_plan_args`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("index", ctypes.c_void_p), ("offs", ctypes.c_void_p), ("index_bytes", ctypes.c_int32),
                ("offs_bytes", ctypes.c_int32), ("rows", ctypes.c_int64), ("experts", ctypes.c_int32),
                ("blocks", ctypes.c_int32), ("ends", ctypes.c_int64 * MAX_BLOCKS), ("work", ctypes.c_void_p),
                ("work_len", ctypes.c_int64), ("count", ctypes.c_void_p), ("facts", ctypes.c_void_p),
                ("inv", ctypes.c_void_p), ("hits", ctypes.c_void_p), ("idx", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("table_cols", ctypes.c_int32), ("pieces", ctypes.c_int32),
                ("cuts", (ctypes.c_int64 * MAX_BLOCKS) * MAX_PIECES), ("bounds", ctypes.c_void_p),
                ("stream", ctypes.c_void_p)]


class PoisonArgs(ctypes.Structure):
    """``fo_moe_poison_args`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("every", ctypes.c_void_p), ("mirror", ctypes.c_void_p), ("world", ctypes.c_int32),
                ("outputs", ctypes.c_int32),
                ("out", ctypes.c_void_p * POISON_SLOTS), ("numel", ctypes.c_int64 * POISON_SLOTS),
                ("elem_bytes", ctypes.c_int32 * POISON_SLOTS), ("nan_bits", ctypes.c_uint64 * POISON_SLOTS),
                ("stream", ctypes.c_void_p)]


_failed: list[str] = []  # a library call's refusal (its arguments), once: the Triton kernels from then on
_no_mirror: list[str] = []  # fo_moe_poison's refusal of a status mirror, once: the settle copies from then on


class MoveArgs(ctypes.Structure):
    """``fo_moe_move_args`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("inv", ctypes.c_void_p), ("rows", ctypes.c_int64), ("dst_rows", ctypes.c_int64),
                ("moves", ctypes.c_int32), ("reserved", ctypes.c_int32), ("src", ctypes.c_void_p * MOVE_SLOTS),
                ("dst", ctypes.c_void_p * MOVE_SLOTS), ("row_bytes", ctypes.c_int64 * MOVE_SLOTS),
                ("src_stride", ctypes.c_int64 * MOVE_SLOTS), ("dst_stride", ctypes.c_int64 * MOVE_SLOTS),
                ("word_bytes", ctypes.c_int32 * MOVE_SLOTS), ("stream", ctypes.c_void_p)]


def on() -> bool:
    """Whether the library takes these steps under the current settings (``moe_plan_triton`` off) and no library call
    was refused in this process (whether it loads is asked by the predicates)."""
    return OPT_OUT not in config.current().experiments and not _failed


@functools.cache
def library_on(device_index: int) -> bool:
    """Whether the library loads on this process's sm90 GPU (``kernels.available``), asked once per device; its
    kernels are loaded then (``kernels.ready``), not beside a call's NCCL transfers in flight."""
    if not kernels.available():
        return False
    kernels.ready(device_index)
    return True


def usable(like: torch.Tensor) -> bool:
    """Whether the library can take a call on ``like``'s device (``on``, a CUDA tensor of the current device, the
    library loading there): the dispatch then readies a block's moves for one call (``should_move`` decides)."""
    return on() and like.is_cuda and like.device.index == torch.cuda.current_device() and library_on(like.device.index)


def should_plan(index: torch.Tensor, offs: torch.Tensor) -> bool:
    """Whether ``moe_plan_kernel.build`` takes ``plan`` for a call within the kernels' limits
    (``moe_plan_kernel.fits``, checked there; module docstring)."""
    return (on() and index.is_cuda and offs.device == index.device
            and index.device.index == torch.cuda.current_device() and library_on(index.device.index))


def plan(index: torch.Tensor, offs: torch.Tensor, bounds: list[int],
         cuts: list[list[int]] | None = None) -> tuple[torch.Tensor, ...] | None:
    """``(idx, inv, table, facts)`` of ``moe_fast.BlockPlan`` (``moe_plan_kernel.build``'s contract) in one library
    call on the current stream: the workspace zeroed there, then two kernels. With ``cuts`` (``cuts[j][q]``: block
    j's rows in its first q + 1 chunks) of 1 to ``MAX_PIECES`` pieces also the expert pieces' bounds (int32, pieces +
    1: ``moe_fast.pieces_with_torch``'s), a fifth entry; of more pieces, none (the caller computes them). None where
    the library refused the call (``_called``): the caller takes the Triton kernels."""
    a, built = plan_args(index, offs, bounds, cuts)
    if not _called(kernels.ready(index.device).fo_moe_plan(ctypes.byref(a)), "fo_moe_plan"):
        return None
    stats["moe:plan_lib"] += 1
    return built


def plan_args(index: torch.Tensor, offs: torch.Tensor, bounds: list[int], cuts: list[list[int]] | None = None,
              views: bool = True) -> tuple[PlanArgs, tuple[torch.Tensor, ...]]:
    """``fo_moe_plan``'s arguments for ``plan`` (on the current stream) and the tensors it fills, all in one
    allocation: ``(idx, inv, table, facts)``, plus the pieces' bounds where ``cuts`` has 1 to ``MAX_PIECES`` pieces;
    with ``views`` False only ``(facts,)`` (``moe_cut_lib``: the rest stays on the device, read by the library)."""
    rows, experts, blocks = int(index.shape[0]), int(offs.shape[0]), len(bounds) - 1
    padded = rows + (rows & 1)  # facts, inv, hits, idx and table each from a 16-byte boundary
    counted = blocks * experts + (blocks * experts) % 2
    head = counted + moe_settle.SETTLE_LEN
    work_len = head + 2 * padded
    table_cols = -(-experts // 4) * 4
    table_words = blocks * table_cols // 2  # int32 pairs; table_cols is a multiple of 4
    pieces = len(cuts[0]) if cuts is not None and len(cuts[0]) <= MAX_PIECES else 0  # more: BlockPlan's torch bounds
    at_table = work_len + padded
    at_bounds = at_table + table_words
    buf = torch.empty(at_bounds + (pieces + 2) // 2, dtype=torch.int64, device=index.device)
    base = buf.data_ptr()
    a = PlanArgs()
    a.index, a.offs, a.index_bytes, a.offs_bytes = index.data_ptr(), offs.data_ptr(), index.element_size(), \
        offs.element_size()
    a.rows, a.experts, a.blocks = rows, experts, blocks
    a.ends[:] = [bounds[j + 1] if j < blocks else rows for j in range(MAX_BLOCKS)]
    a.work, a.work_len = base, work_len
    a.count, a.facts = base, base + 8 * counted
    a.inv, a.hits = base + 8 * head, base + 8 * (head + padded)
    a.idx, a.table, a.table_cols = base + 8 * work_len, base + 8 * at_table, table_cols
    if pieces:
        a.pieces, a.bounds = pieces, base + 8 * at_bounds
        for j, row in enumerate(cuts):
            for q, cut in enumerate(row[:-1]):
                a.cuts[q][j] = cut
    a.stream = compat.current_raw_stream(index.device.index)
    if not views:
        return a, (buf[counted:head],)
    built = (buf[work_len:work_len + rows], buf[head:head + rows],
             buf[at_table:at_bounds].view(torch.int32).view(blocks, table_cols), buf[counted:head])
    if pieces:
        built = (*built, buf[at_bounds:].view(torch.int32)[:pieces + 1])
    return a, built


def _called(rc: int, what: str) -> bool:
    """Whether the library call ``what`` returned 0; a refusal of its arguments (rc < 100) is recorded (``_failed``:
    the Triton kernels from now on) and logged once; the device's errors raise ``KernelLibraryError``."""
    message = kernels.refusal(rc, what)
    if not message:
        return True
    _failed.append(f"{what}: {message}")
    note("moe:plan_lib", logging.WARNING, "flashoverlap: %s refused its arguments (%s); the MoE plan and poison use "
         "the Triton kernels from now on", what, message)
    return False


def should_poison(outputs: list[torch.Tensor], world: int) -> bool:
    """Whether ``moe_deferred.poison_if_bad`` takes ``poison`` for ``outputs`` (non-empty, each contiguous on the
    current CUDA device, of a float dtype the kernel knows) of a ``world``-rank call."""
    return (on() and 1 <= world <= 8 and bool(outputs)
            and all(o.is_cuda and o.is_contiguous() and o.dtype in _NAN_BITS and o.device == outputs[0].device
                    for o in outputs)
            and outputs[0].device.index == torch.cuda.current_device() and library_on(outputs[0].device.index))


def poison(outputs: list[torch.Tensor], vectors: torch.Tensor, world: int,
           mirror: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Every tensor of ``outputs`` NaN where any of the ``world`` settle vectors in ``vectors`` (int64, contiguous,
    on the outputs' device) is bad; one library call per ``POISON_SLOTS`` outputs, on the current stream; the first
    also copies ``vectors`` into ``mirror`` where given (pinned host memory, as many int64; a refused mirror is
    dropped: ``mirrors``). Returns the outputs left unpoisoned (from the first the library refused: ``_called``; none
    normally)."""
    dev = outputs[0].device
    lib = kernels.ready(dev)
    for first in range(0, len(outputs), POISON_SLOTS):
        part = outputs[first:first + POISON_SLOTS]
        a = PoisonArgs()
        a.every, a.world, a.outputs = vectors.data_ptr(), world, len(part)
        if first == 0 and mirror is not None and not _no_mirror:
            a.mirror = mirror.data_ptr()
        for k, out in enumerate(part):
            a.out[k], a.numel[k], a.elem_bytes[k] = out.data_ptr(), out.numel(), out.element_size()
            a.nan_bits[k] = _NAN_BITS[out.dtype]
        a.stream = compat.current_raw_stream(dev.index)
        rc = lib.fo_moe_poison(ctypes.byref(a))
        if rc != 0 and rc < 100 and a.mirror:  # the mirror refused (not memory the device addresses): without it
            _no_mirror.append(kernels.last_error())
            note("moe:poison_mirror", logging.WARNING, "flashoverlap: fo_moe_poison refused the status mirror (%s); "
                 "the settle copies the status from now on", _no_mirror[-1])
            a.mirror = None
            rc = lib.fo_moe_poison(ctypes.byref(a))
        if not _called(rc, "fo_moe_poison"):
            return outputs[first:]
        stats["moe:poison_lib"] += 1
    return []


def mirrors() -> bool:
    """Whether ``poison`` writes the status mirror it is given (no refusal of one in this process)."""
    return not _no_mirror


def should_move(inv: torch.Tensor, moves: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether ``move_rows`` takes these ``(dst, src)`` pairs: 1 to ``MOVE_SLOTS`` of them, 2-D with contiguous rows of
    one dtype per pair (even bytes), ``src`` as many rows as ``inv`` (int64, contiguous), all on the current device."""
    if not (inv.dtype == torch.int64 and inv.dim() == 1 and inv.is_contiguous() and 1 <= len(moves) <= MOVE_SLOTS
            and usable(inv)):
        return False
    for dst, src in moves:
        if not (dst.dim() == 2 and src.dim() == 2 and dst.dtype == src.dtype and dst.shape[1] == src.shape[1]
                and src.shape[0] == inv.shape[0] and dst.stride(1) == 1 and src.stride(1) == 1
                and dst.device == inv.device and src.device == inv.device and dst.shape[1] > 0
                and dst.stride(0) >= dst.shape[1] and src.stride(0) >= src.shape[1]
                and (dst.shape[1] * dst.element_size()) % 2 == 0 and dst.shape[0] == moves[0][0].shape[0]):
            return False
    return True


def _word(*sizes: int) -> int:
    """The widest of 16, 8, 4 and 2 bytes that divides every size."""
    return next((w for w in (16, 8, 4, 2) if all(n % w == 0 for n in sizes)), 0)  # 0: the library refuses


def move_rows(inv: torch.Tensor, moves: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """For each ``(dst, src)`` pair, ``dst[inv[r]] = src[r]`` (as ``dst.index_copy_(0, inv, src)``) in one library call
    on the current stream; ``should_move`` holds. False where the library refused the call (``_called``: the caller
    moves them with torch ops)."""
    a = MoveArgs()
    a.inv, a.rows, a.dst_rows, a.moves = inv.data_ptr(), int(inv.shape[0]), int(moves[0][0].shape[0]), len(moves)
    for k, (dst, src) in enumerate(moves):
        size = dst.element_size()
        row, s_stride, d_stride = dst.shape[1] * size, src.stride(0) * size, dst.stride(0) * size
        a.src[k], a.dst[k] = src.data_ptr(), dst.data_ptr()
        a.row_bytes[k], a.src_stride[k], a.dst_stride[k] = row, s_stride, d_stride
        a.word_bytes[k] = _word(row, s_stride, d_stride, src.data_ptr(), dst.data_ptr())
    a.stream = compat.current_raw_stream(inv.device.index)
    if not _called(kernels.ready(inv.device).fo_moe_move_rows(ctypes.byref(a)), "fo_moe_move_rows"):
        return False
    stats["moe:move_lib"] += 1
    return True
