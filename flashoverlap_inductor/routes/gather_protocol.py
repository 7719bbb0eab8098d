"""The all_gather copy-engine protocol's host side, shared by the all_gather peer route (``gather_peer``) and the
reduce_scatter pull route (``scatter_pull``): ``fo_gather_args`` as a ctypes struct, the flag page and shard
buffers of one (device, group) it points into, and the per-call helpers both routes' ``execute`` use (the struct of a
call shape, its pull events, the finish and what a finish that could not join leaves recorded, the push schedule's
receive slots). The protocol itself (waits, flags, epochs, the fault block) is stated in ``csrc/flashoverlap_sm90.h``
and ``routes/gather_peer.py``.

Units: bytes for buffers, shards and set strides; elements for ``output_numel``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
from dataclasses import dataclass

import torch

from flashoverlap_inductor.runtime import faults

from .gather_start import SLOT_SETS
from .symmetric import SymmetricBuffer

log = logging.getLogger("flashoverlap")

MAX_WORLD = 8  # FO_GATHER_MAX_WORLD (<= faults.MAX_PEERS + 1)
MAX_OUTPUTS = 8  # FO_GATHER_MAX_OUTPUTS: the GEMMs' results and the gathered rows
FLAG_INTS = 9 * MAX_WORLD  # FO_GATHER_FLAG_INTS (the push counters, then fo_scatter_run's pieces)
MAX_PIECES = 8  # FO_SCATTER_MAX_PIECES
FAULT_OFFSET = 4 * FLAG_INTS  # bytes: the group's fo_fault block, after the flags
FLAG_BYTES = FAULT_OFFSET + faults.BLOCK_BYTES


class GatherArgs(ctypes.Structure):
    """``fo_gather_args`` of ``csrc/flashoverlap_sm90.h`` (pointers as ints; sizes in bytes or elements)."""

    _fields_ = [("world", ctypes.c_int32), ("rank", ctypes.c_int32), ("shard_bytes", ctypes.c_int64),
                ("a", ctypes.c_void_p), ("buffers", ctypes.c_void_p * MAX_WORLD),
                ("flags", ctypes.c_void_p * MAX_WORLD), ("epoch", ctypes.c_void_p), ("staging", ctypes.c_void_p),
                ("copy_own", ctypes.c_int32), ("launch_id", ctypes.c_int32), ("timeout_ns", ctypes.c_int64),
                ("fault", ctypes.c_void_p), ("mirror", ctypes.c_void_p), ("cur_stream", ctypes.c_void_p),
                ("copy_stream", ctypes.c_void_p), ("shard_events", ctypes.c_void_p * MAX_WORLD),
                ("num_outputs", ctypes.c_int32), ("elem_bytes", ctypes.c_int32), ("bf16", ctypes.c_int32),
                ("options", ctypes.c_int32), ("outputs", ctypes.c_void_p * MAX_OUTPUTS),
                ("output_numel", ctypes.c_int64 * MAX_OUTPUTS), ("slot_set", ctypes.c_int32),
                ("set_bytes", ctypes.c_int64),
                # FO_GATHER_BLOCKS (routes/moe_peer.py), per peer; zero for every other call
                ("blocks", ctypes.c_void_p * MAX_WORLD), ("block_bytes", ctypes.c_int64 * MAX_WORLD),
                ("block_events", ctypes.c_void_p * MAX_WORLD), ("recv", ctypes.c_void_p * MAX_WORLD),
                ("recv_bytes", ctypes.c_int64 * MAX_WORLD), ("slot_bytes", ctypes.c_int64), ("phase", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


@dataclass
class GatherFlags:
    """The flag page of one (device, group), every rank's mapped here, and what this rank keeps beside it."""

    buf: torch.Tensor  # uint8 [FLAG_BYTES], symmetric, zeroed once
    hdl: object
    views: list[torch.Tensor]  # every rank's page mapped here (keeps the mappings alive)
    epoch: torch.Tensor  # int32 [1]: calls begun (advanced by the device)
    copy: torch.cuda.Stream  # the protocol and the pulls, in call order
    events: list[torch.cuda.Event]  # [j]: rank j's shard landed in staging (recorded by the library on ``copy``)
    fault: faults.FaultDomain  # the group's fault block (in ``buf``), which the peers' waits also write


def set_bytes(ws: SymmetricBuffer) -> int:
    """Bytes from one push slot set to the next in ``ws`` (``fo_gather_args.set_bytes``): its capacity split evenly,
    the same on every rank and for every call shape (a push call needs ``SLOT_SETS * world * shard_bytes`` of room,
    so its ``world`` slots fit in one set)."""
    return ws.capacity // SLOT_SETS


def new_args(ws: SymmetricBuffer, world: int, rank: int, shard_bytes: int, dtype: torch.dtype, launch_id: int,
             timeout_ns: int, options: int) -> GatherArgs:
    """The protocol's struct for calls of one shape on ``ws`` (this route's and ``scatter_pull``'s): the workspace's,
    the flags' and the streams' pointers, the push sets' stride (``set_bytes``), the bound; every per-call field
    (``a``, ``staging``, ``cur_stream``, the outputs, ``slot_set``, ``copy_own``) is the caller's to set."""
    f = ws.flags
    p = GatherArgs()
    p.world, p.rank, p.shard_bytes = world, rank, shard_bytes
    for r in range(world):
        p.buffers[r], p.flags[r] = ws.views[r].data_ptr(), f.views[r].data_ptr()
    put_events(p, f.events, rank, world)
    p.epoch, p.launch_id, p.timeout_ns = f.epoch.data_ptr(), launch_id, timeout_ns
    p.fault, p.mirror, p.copy_stream = f.fault.block_ptr, f.fault.mirror_ptr, f.copy.cuda_stream
    p.elem_bytes, p.bf16 = dtype.itemsize, int(dtype == torch.bfloat16)
    p.options, p.set_bytes = options, set_bytes(ws)
    return p


def put_events(p: GatherArgs, events: list, rank: int, world: int) -> None:
    """``events[j]``'s CUDA event as peer ``j``'s in ``p`` (recorded by the library when ``j``'s shard is here):
    the flags' own, or a probed call's timing events and after it the flags' again."""
    for r in range(world):
        p.shard_events[r] = events[r].cuda_event if r != rank else None


def probe_events(probe, p: GatherArgs, rank: int, world: int) -> list:
    """Timing events of ``probe`` for this call's pulls (``pull:<j>``, recorded by the library on the copy stream),
    put into the call's struct in place of the flags' own (``execute`` puts those back)."""
    events = probe.events_for([f"pull:{j}" for j in range(world)], "copy")
    put_events(p, events, rank, world)
    return events


def finish(lib, p: GatherArgs, ws: SymmetricBuffer, used: tuple, route: str) -> int:
    """``fo_gather_finish`` of a call of this protocol (this route's or ``scatter_pull``'s), in its ``finally``: its
    status. Where it could not join, the tensors the copy stream may still use (``used``; None skipped) are recorded
    on it, and, while the call's own error propagates, this one is logged."""
    rc = lib.fo_gather_finish(ctypes.byref(p))
    if rc != 0:
        unjoined(ws, used)
        if sys.exc_info()[0] is not None:
            log.warning("flashoverlap %s: fo_gather_finish after a failed call: %s", route,
                        lib.fo_last_error().decode())
    return rc


def unjoined(ws: SymmetricBuffer, used: tuple) -> None:
    """After a finish that could not join: ``used``'s tensors (None skipped) recorded on the copy stream, which may
    still read or write them."""
    for t in used:
        if t is not None:
            t.record_stream(ws.flags.copy)


def slot_views(ws: SymmetricBuffer, rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple:
    """Push: this rank's receive slots in ``ws``, one view of ``shape`` per set (set ``b`` at ``b * set_bytes(ws)``,
    the library's layout; ``shape`` covers the set's ``world`` slots)."""
    step, size = set_bytes(ws), math.prod(shape) * dtype.itemsize
    return tuple(ws.views[rank][b * step:b * step + size].view(dtype).view(shape) for b in range(SLOT_SETS))
