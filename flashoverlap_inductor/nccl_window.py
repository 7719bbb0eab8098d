"""Symmetric NCCL windows for the fused all_reduce's GEMM output (an experiment: ``runtime_gpu.AR_WINDOW``).

NCCL >= 2.27 all-reduces a buffer registered with ``ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)`` (memory
from ``ncclMemAlloc``) with its symmetric kernels: loads and stores straight into the peer's window, 7 CTAs
instead of the ring's 24 on 2 H200s (``examples/device/window_probe.py``; NCCL_NVLS_ENABLE=0, so no multicast).
Fewer CTAs beside the GEMM leave it more SMs; the price is a slower collective alone and a copy of each reduced
group out of the window into the op's output.

Invariants:

* One window per (communicator, counter slot): a slot's calls run in its caller stream's order and each call
  joins its side stream back before the next GEMM of that slot writes the window again; calls of other slots
  (streams, captured graphs) have their own windows.
* Registration is collective: every rank asks for the same window at the same call (same shapes, same slot
  history), so every rank registers or grows it together. A window only grows (deregister, free, allocate,
  register), never inside a CUDA-graph capture (``get`` returns None there; the caller uses its plain buffers).
* Windows live until ``release()`` or process exit (the communicator must outlive them).

Sizes are in bytes.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from .nccl_direct import Communicator, NcclError

log = logging.getLogger("flashoverlap")

WIN_COLL_SYMMETRIC = 0x01
_GRANULE = 1 << 21  # sizes round up to 2 MiB, so a window grows rarely


class Window:
    """A ``ncclMemAlloc`` buffer of ``nbytes`` registered as a symmetric window of ``comm``."""

    def __init__(self, comm: Communicator, nbytes: int, device: torch.device) -> None:
        lib = comm.lib.lib
        p, sz = ctypes.c_void_p, ctypes.c_size_t
        for name in ("ncclMemAlloc", "ncclMemFree", "ncclCommWindowRegister", "ncclCommWindowDeregister"):
            if not hasattr(lib, name):
                raise NcclError(f"{comm.lib.path} has no {name} (NCCL >= 2.27 needed)")
        lib.ncclMemAlloc.argtypes = [ctypes.POINTER(p), sz]
        lib.ncclMemFree.argtypes = [p]
        lib.ncclCommWindowRegister.argtypes = [p, p, sz, ctypes.POINTER(p), ctypes.c_int]
        lib.ncclCommWindowDeregister.argtypes = [p, p]
        self.comm, self.nbytes, self.ptr, self.win = comm, nbytes, p(), p()
        comm.lib.check(lib.ncclMemAlloc(ctypes.byref(self.ptr), nbytes), "ncclMemAlloc")
        try:
            comm.lib.check(lib.ncclCommWindowRegister(p(comm.comm), self.ptr, nbytes, ctypes.byref(self.win),
                                                      WIN_COLL_SYMMETRIC), "ncclCommWindowRegister", comm.comm)
        except NcclError:
            lib.ncclMemFree(self.ptr)
            raise
        iface = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr.value, False), "version": 3}
        self.bytes = torch.as_tensor(type("CudaArray", (), {"__cuda_array_interface__": iface})(), device=device)

    def view(self, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The window's first ``rows * n`` elements as a row-major [rows, n] tensor of ``dtype``."""
        return self.bytes[: rows * n * dtype.itemsize].view(dtype).view(rows, n)

    def free(self) -> None:
        lib = self.comm.lib.lib
        torch.cuda.synchronize(self.bytes.device)
        self.comm.lib.check(lib.ncclCommWindowDeregister(ctypes.c_void_p(self.comm.comm), self.win),
                            "ncclCommWindowDeregister", self.comm.comm)
        self.comm.lib.check(lib.ncclMemFree(self.ptr), "ncclMemFree")


_windows: dict[tuple[int, int], Window] = {}


def get(comm: Communicator, slot: int, nbytes: int, device: torch.device) -> Window | None:
    """The window of (``comm``, ``slot``) with at least ``nbytes`` (grown collectively when smaller), or None inside
    a CUDA-graph capture when it would have to grow, or when NCCL cannot make one (logged)."""
    key = (comm.comm, slot)
    w = _windows.get(key)
    if w is not None and w.nbytes >= nbytes:
        return w
    if torch.cuda.is_current_stream_capturing():
        return None
    size = -(-nbytes // _GRANULE) * _GRANULE
    try:
        if w is not None:
            del _windows[key]
            w.free()
        _windows[key] = w = Window(comm, size, device)
    except NcclError as exc:
        log.warning("flashoverlap: no symmetric NCCL window (%s); all_reduce uses plain buffers", exc)
        return None
    log.info("flashoverlap: symmetric NCCL window of %d bytes for slot %d", size, slot)
    return w


def release() -> None:
    """Deregister and free every window (collective: all ranks together)."""
    while _windows:
        _windows.popitem()[1].free()


def issue_all_reduce(comm: Communicator, lo: int, hi: int, window: torch.Tensor, out: torch.Tensor, mode: str,
                     stream: torch.cuda.Stream) -> None:
    """All-reduce rows ``[lo, hi)`` of the [rows, N] ``window`` view into the same rows of ``out`` on ``stream``:
    ``mode`` "oop" as one out-of-place NCCL call, "copy" in place in the window then a copy-engine copy out."""
    if hi <= lo:
        return
    n, row_bytes = window.shape[1], window.shape[1] * window.element_size()
    src, dst = window.data_ptr() + lo * row_bytes, out.data_ptr() + lo * row_bytes
    if mode == "oop":
        comm.all_reduce(src, dst, (hi - lo) * n, window.dtype, stream.cuda_stream)
        return
    comm.all_reduce(src, src, (hi - lo) * n, window.dtype, stream.cuda_stream)
    with torch.cuda.stream(stream):
        out[lo:hi].copy_(window[lo:hi])  # contiguous, same device and dtype: cudaMemcpyAsync (copy engine)
