"""Per-device resources of the overlapped CUDA path (``runtime_gpu``), created once and cached, and a thin
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from . import kernels

T = TypeVar("T")

log = logging.getLogger("flashoverlap")

MAX_GROUPS = 256  # counters per slot: the most wave groups one fused call may have
MAX_SLOTS = 512  # counter slots per device: one per caller stream, plus one per captured call


class KernelLib:
    """The loaded library, called through its C ABI with raw pointers (no per-call Python checks).

    Sizes in elements, times in ns. Every function raises ``kernels.KernelLibraryError`` on a nonzero code.
    """

    def __init__(self) -> None:
        self.lib = kernels.library()
        self._index: dict[tuple[str, int, str], int] | None = None

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.fo_last_error().decode(errors="replace")
            raise kernels.KernelLibraryError(f"{what} failed (code {rc}): {msg}")

    def config_index(self, name: str, dtype: torch.dtype, b_layout: str) -> int:
        """Index of configuration ``name`` compiled for ``dtype`` and B layout ``"nk"``/``"kn"`` (``fo_config_info``
        ints[9] = dtype, ints[10] = B layout)."""
        if self._index is None:
            table = {}
            for i in range(self.lib.fo_num_configs()):
                buf = ctypes.create_string_buffer(128)
                ints = (ctypes.c_int * 12)()
                self.check(self.lib.fo_config_info(i, buf, 128, ints), "fo_config_info")
                table[(buf.value.decode(), ints[9], kernels.B_LAYOUTS[ints[10]])] = i
            self._index = table
        key = (name, kernels.DTYPES[dtype], b_layout)
        if key not in self._index:
            raise KeyError(f"configuration {name!r} is not compiled for {dtype} with B as {b_layout}")
        return self._index[key]

    def workspace_bytes(self, index: int, m: int, n: int, k: int, sm_count: int, raster: int, swizzle: int) -> int:
        size = ctypes.c_size_t(0)
        self.check(self.lib.fo_gemm_workspace_size(index, m, n, k, sm_count, raster, swizzle, ctypes.byref(size)),
                   "fo_gemm_workspace_size")
        return int(size.value)

    def gemm(self, index: int, a: torch.Tensor, b: torch.Tensor, ldb: int, bias: torch.Tensor | None,
             out: torch.Tensor, counters_ptr: int, gmap: torch.Tensor, order: torch.Tensor | None, signal_mode: int,
             sm_count: int, raster: int, swizzle: int, workspace: torch.Tensor | None, stream_ptr: int) -> None:
        """``out[M,N] = a[M,K] @ b (+ bias)`` on ``stream_ptr``, signalling ``counters[gmap[tile_row]]``, tile-rows
        in ``order`` (None = natural order)."""
        m, k = a.shape
        rc = self.lib.fo_gemm(index, a.data_ptr(), a.stride(0), b.data_ptr(), ldb,
                              bias.data_ptr() if bias is not None else None, None, 0, out.data_ptr(), out.stride(0), m,
                              out.shape[1], k, counters_ptr, gmap.data_ptr(),
                              order.data_ptr() if order is not None else None, signal_mode, sm_count, raster, swizzle,
                              workspace.data_ptr() if workspace is not None else None,
                              workspace.numel() if workspace is not None else 0, stream_ptr)
        self.check(rc, "fo_gemm")

    def fused_call(self, index: int, a: torch.Tensor | None, b: torch.Tensor | None, ldb: int,
                   bias: torch.Tensor | None, d: torch.Tensor, buf: torch.Tensor, rows: int, k: int,
                   gmap: torch.Tensor | None, order: torch.Tensor | None, signal_mode: int, sm_count: int,
                   raster: int, swizzle: int, workspace: torch.Tensor | None, counters_ptr: int, expected_ptr: int,
                   csteps: Any, out: torch.Tensor, nccl_dtype: int, comm: int, timeout_ns: int, record_ptr: int,
                   cur_ptr: int, side_ptr: int) -> None:
        """The whole fused op (``fo_fused_call``): GEMM ``d = a @ b (+ bias)`` on ``cur_ptr`` (skipped when
        ``rows`` is 0; tile-rows in ``order``), every group's wait, staging copy ``d -> buf`` and NCCL call(s) on
        ``side_ptr``, then the join. ``d`` and ``buf`` are the same tensor unless the steps stage."""
        rc = self.lib.fo_fused_call(
            index, a.data_ptr() if a is not None else None, a.stride(0) if a is not None else 0,
            b.data_ptr() if b is not None else None, ldb, bias.data_ptr() if bias is not None else None,
            d.data_ptr(), buf.data_ptr(), d.stride(0), rows, d.shape[1], k,
            gmap.data_ptr() if gmap is not None else None, order.data_ptr() if order is not None else None,
            signal_mode, sm_count, raster, swizzle, workspace.data_ptr() if workspace is not None else None,
            workspace.numel() if workspace is not None else 0, counters_ptr, expected_ptr, csteps.groups,
            csteps.steps_ptr, csteps.p2p_ptr, out.data_ptr(), buf.element_size(), nccl_dtype, comm, timeout_ns,
            record_ptr, cur_ptr, side_ptr)
        self.check(rc, "fo_fused_call")

    def wait(self, counter_ptr: int, expected_ptr: int, tiles: int, timeout_ns: int, record_ptr: int, tag: int,
             stream_ptr: int) -> None:
        """Hold ``stream_ptr`` until ``*counter >= *expected + tiles``; then ``*expected`` = that target."""
        self.check(self.lib.fo_wait_counter(counter_ptr, expected_ptr, tiles, timeout_ns, record_ptr, tag,
                                            stream_ptr), "fo_wait_counter")


@functools.lru_cache(maxsize=1)
def kernel_lib() -> KernelLib:
    return KernelLib()


@functools.cache
def _own_record(index: int) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, pin_memory=True)


def error_record(index: int) -> torch.Tensor:
    """The pinned timeout record of device ``index`` (kernels.py's own when it has one, so that
    ``kernels.raise_if_timed_out`` sees the same record)."""
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
    record: torch.Tensor  # pinned int32 [4]
    slots: dict[int, int] = field(default_factory=dict)
    used: int = 0

    def slot(self, stream: torch.cuda.Stream, dedicated: bool = False) -> int | None:
        """The counter slot of ``stream`` (assigned on first use; None when all are taken).

        ``dedicated``: a new slot that nothing else ever gets, for a call being captured into a CUDA graph: its
        replays may run beside eager calls on any stream (pool streams reuse handles), and two captured calls
        must not share counters either."""
        if not dedicated:
            i = self.slots.get(stream.cuda_stream)
            if i is not None:
                return i
        if self.used >= MAX_SLOTS:
            return None
        i, self.used = self.used, self.used + 1
        if not dedicated:
            self.slots[stream.cuda_stream] = i
        return i

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
    if preload is not None:  # load every library kernel now: a lazy load at first launch can deadlock a waiter
        preload(index)
    with torch.cuda.device(index):
        props = torch.cuda.get_device_properties(index)
        side = torch.cuda.Stream(device=index, priority=-100)  # clamped to the highest priority there is
        zeros = persistent(index, lambda: torch.zeros(2, MAX_SLOTS, MAX_GROUPS, dtype=torch.int32,
                                                      device=f"cuda:{index}"))
        res = DeviceResources(index, props.name, int(props.multi_processor_count), side, zeros[0], zeros[1],
                              error_record(index))
    _resources[index] = res
    log.debug("flashoverlap: set up cuda:%d (%s, %d SMs): side stream, %d counter slots", index, res.name,
              res.sm_count, MAX_SLOTS)
    return res


def existing() -> list[DeviceResources]:
    """Resources created so far (for ``check``)."""
    return list(_resources.values())
