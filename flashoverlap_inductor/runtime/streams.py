"""Per-device resources of the overlapped CUDA path (the CUDA routes), created once and cached, and a thin
launcher over the library's C ABI (``csrc/flashoverlap_sm90.h``) for the per-call path.

* ``side``: one high-priority stream per device. Every group's wait kernel and collective is issued on it
  (ProcessGroupNCCL's own stream then waits for it), and the caller's stream joins it at the end of each call.
* Counters: a pool of int32 tile counters per device, one *slot* of ``MAX_GROUPS`` counters plus as many
  ``expected`` epoch targets per caller stream. The GEMM adds 1 per finished tile to its group's counter; counters
  are never reset. Each call first copies counters -> expected on the caller's stream (every earlier call on that
  stream has been joined by then, so nothing else moves them), then the wait kernel of group g holds the side
  stream until ``counters[g] >= expected[g] + tiles[g]`` and stores that target. So the targets live on the device
  (CUDA-graph replays advance them), a timed-out call cannot desynchronise later ones, and calls of different
  shapes can share one slot. One slot per caller stream keeps GEMMs running concurrently on different streams
  apart.
* Timeout record: the pinned host int32[4] ``{code, tag, seen, target}`` that the wait kernel writes when it gives
  up; ``timed_out()`` is a plain host load (no device sync), cheap enough for every call.

``resources()`` also loads every library kernel on the device (``kernels.ready``): a kernel loaded lazily at its
first launch may synchronize the context while a wait kernel spins. Nothing here allocates while a stream is
capturing: ``resources()`` returns None then if the device has none yet, and the runtime takes the unfused path.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from flashoverlap_inductor.native import kernels

T = TypeVar("T")

log = logging.getLogger("flashoverlap")

MAX_GROUPS = 256  # counters per slot: the most wave groups one fused call may have
MAX_SLOTS = 512  # counter slots per device: one per caller stream, plus one per captured call
FAULT_INTS = 32  # one fo_fault block (128 bytes)


@functools.cache
def _own_record(index: int) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, pin_memory=True)


def error_record(index: int) -> torch.Tensor:
    """The pinned timeout record of device ``index`` (``native.kernels``'s own when it has one, so that
    ``kernel_calls.raise_if_timed_out`` sees the same record)."""
    shared = getattr(kernels, "_error_record", None)
    return shared(index) if shared is not None else _own_record(index)


@dataclass
class DeviceResources:
    """Everything the overlapped path keeps per device (see the module docstring)."""

    index: int
    name: str
    sm_count: int
    side: torch.cuda.Stream
    counters: torch.Tensor  # int32 [MAX_SLOTS, MAX_GROUPS]
    expected: torch.Tensor  # int32 [MAX_SLOTS, MAX_GROUPS]
    record: torch.Tensor  # pinned int32 [4] (the single-kernel waits of kernel_calls)
    faults: torch.Tensor  # int32 [MAX_SLOTS, FAULT_INTS]: the NCCL route's fault block per slot (``runtime.faults``)
    mirrors: torch.Tensor  # pinned int32 [MAX_SLOTS, 8]: their host mirrors
    slots: dict[int, int] = field(default_factory=dict)
    used: int = 0
    free: list[int] = field(default_factory=list)  # recycled eager slots
    lock: threading.Lock = field(default_factory=threading.Lock)

    def slot(self, stream: int, dedicated: bool = False) -> int | None:
        """The counter slot of ``stream`` (a ``cudaStream_t`` as an int; assigned on first use; None when all are
        taken).

        ``dedicated``: a new slot that nothing else ever gets, for a call being captured into a CUDA graph: its
        replays may run beside eager calls on any stream (pool streams reuse handles), and two captured calls
        must not share counters either."""
        with self.lock:
            if not dedicated:
                i = self.slots.get(stream)
                if i is not None:
                    return i
            if not self.free and self.used >= MAX_SLOTS and self.slots:
                self._recycle()
            if self.free:
                i = self.free.pop()
            elif self.used < MAX_SLOTS:
                i, self.used = self.used, self.used + 1
            else:
                return None
            if not dedicated:
                self.slots[stream] = i
            return i

    def _recycle(self) -> None:
        """Every slot is taken: after a device sync (no call in flight uses any), the eager streams' slots are free
        again (their counters and targets resynchronize at every call). Captured calls' slots are kept; only they
        can exhaust the pool (``slot`` then returns None, on every rank alike when the ranks capture alike)."""
        torch.cuda.synchronize(self.index)
        self.free.extend(sorted(self.slots.values(), reverse=True))
        self.slots.clear()
        log.info("flashoverlap: all %d counter slots of cuda:%d in use; recycled the eager streams' slots",
                 MAX_SLOTS, self.index)

    def timed_out(self) -> bool:
        """Whether a wait kernel recorded a timeout (host read of pinned memory; no device sync)."""
        return ctypes.c_int32.from_address(self.record.data_ptr()).value != 0

    def raise_if_timed_out(self) -> None:
        """Raise ``kernels.FlashOverlapTimeout`` for a recorded timeout, and clear the record."""
        code, tag, seen, target = (int(x) for x in self.record.tolist())
        if code:
            self.record.zero_()
            raise kernels.FlashOverlapTimeout(
                f"GPU wait for group {tag} timed out on cuda:{self.index}: counter at {seen}, target {target}; the "
                "signalling GEMM did not finish (hung, failed, or launched with other counters). The result of "
                "that fused call may be wrong.")


_resources: dict[int, DeviceResources] = {}
_alloc_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashoverlap-alloc")


def persistent(index: int, make: Callable[[], T]) -> T:
    """Run ``make`` (which allocates tensors that live across calls) on device ``index`` in a worker thread.

    Inductor's CUDA-graph trees route every allocation *of the calling thread* into their graph pool while they
    warm up or record a graph, and then reject pool tensors that are not graph outputs. Our cached buffers
    (counters, tile->group maps, gather indices) must outlive any one graph, so they are allocated from another
    thread, which the pool's thread filter does not see. ``make`` must not launch work that the caller's stream
    has to order against except through a device synchronize, which this function does.
    """

    if not torch.cuda.is_available():  # CPU dry runs (tests with fakes): no graph pool to escape
        return make()

    def run() -> T:
        with torch.cuda.device(index):
            out = make()
            torch.cuda.synchronize(index)
            return out

    return _alloc_thread.submit(run).result()


def resources(index: int) -> DeviceResources | None:
    """The resources of CUDA device ``index``; created on first use, None while capturing before that."""
    res = _resources.get(index)
    if res is not None:
        return res
    if torch.cuda.is_current_stream_capturing():
        return None
    preload = getattr(kernels, "ready", None)
    # load every library kernel now (a lazy load at first launch can deadlock a waiter); without the library there
    # is nothing to load, and every route that needs it declines (the call runs unfused, logged once)
    if preload is not None and kernels.available():
        preload(index)
    with torch.cuda.device(index):
        props = torch.cuda.get_device_properties(index)
        side = torch.cuda.Stream(device=index, priority=-100)  # clamped to the highest priority there is
        zeros = persistent(index, lambda: torch.zeros(2, MAX_SLOTS, MAX_GROUPS, dtype=torch.int32,
                                                      device=f"cuda:{index}"))
        faults = persistent(index, lambda: torch.zeros(MAX_SLOTS, FAULT_INTS, dtype=torch.int32,
                                                       device=f"cuda:{index}"))
        mirrors = torch.zeros(MAX_SLOTS, 8, dtype=torch.int32, pin_memory=True)
        res = DeviceResources(index, props.name, int(props.multi_processor_count), side, zeros[0], zeros[1],
                              error_record(index), faults, mirrors)
    _resources[index] = res
    log.debug("flashoverlap: set up cuda:%d (%s, %d SMs): side stream, %d counter slots", index, res.name,
              res.sm_count, MAX_SLOTS)
    return res


def existing() -> list[DeviceResources]:
    """Resources created so far (for ``check``)."""
    return list(_resources.values())
