"""GEMMs that leave SMs free: ``gemm_carveout(sms, device)`` around torch GEMMs on CUDA makes cuBLAS and
cuBLASLt target the device's SMs less ``sms``, so that a small kernel launched on another stream meanwhile (the
gather peer route's one-thread protocol steps) finds an SM at once instead of after the GEMM.

Why it is needed: cuBLAS's sm90 GEMMs are persistent (one CTA per SM, each holding ~228 KB of shared memory until
the GEMM ends), so no other CTA fits beside them; a one-thread kernel issued after such a GEMM started waits for its
end (measured on 2 H200s: the gather route's pull started 0.08 ms late, ``docs/results.md``).

Two knobs, both set and restored around the block (host state only, no device work, so a CUDA-graph capture
records the GEMMs as they were chosen):

* torch's ``_set_sm_carveout_experimental`` (``_inductor_compat.swap_matmul_sm_carveout``), which its cuBLASLt
  paths (``addmm`` with a bias, batched GEMMs, ``_scaled_mm``) pass on as ``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``;
* ``cublasSetSmCountTarget`` on the calling thread's cuBLAS handle (``torch.cuda.current_blas_handle()``, the one
  torch's plain ``mm`` uses on this thread and device), through the cuBLAS library torch loaded.

Invariant: outside the block both are as they were before it (restored in ``finally``). The torch knob is
process-wide: another host thread's GEMMs issued during the block get the carveout too (slower by ~sms/SMs, never
wrong). Where neither knob is reachable (no CUDA, an old torch, no cuBLAS symbol) the block runs unchanged and
``available()`` says so; the route then still computes the same values.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator

import torch

from .. import _inductor_compat as compat

log = logging.getLogger("flashoverlap")


@functools.cache
def _cublas() -> ctypes.CDLL | None:
    """The cuBLAS library this process loaded (found in ``/proc/self/maps``; the same handle torch holds), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcublas.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.cublasSetSmCountTarget.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.cublasGetSmCountTarget.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
            return lib
        except (OSError, AttributeError):
            continue
    return None


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def available(device: torch.device) -> bool:
    """Whether cuBLAS's handle target can be set for GEMMs on ``device`` (torch's own knob aside)."""
    if device.type != "cuda":
        return False
    torch.cuda.current_blas_handle()  # loads cuBLAS (torch does so lazily)
    return _cublas() is not None


@contextlib.contextmanager
def gemm_carveout(sms: int, device: torch.device) -> Iterator[None]:
    """Inside the block, torch's cuBLAS / cuBLASLt GEMMs on ``device`` (the current device, this thread) target the
    device's SMs less ``sms`` (1 <= sms < SMs); a no-op for other devices or ``sms <= 0`` (module docstring)."""
    if device.type != "cuda" or sms <= 0:
        yield
        return
    count = max(_sm_count(device.index) - sms, 1)
    swapped, previous = compat.swap_matmul_sm_carveout(sms)
    handle = torch.cuda.current_blas_handle()
    lib, before = _cublas(), ctypes.c_int(0)
    targeted = lib is not None and lib.cublasGetSmCountTarget(handle, ctypes.byref(before)) == 0 \
        and lib.cublasSetSmCountTarget(handle, count) == 0
    try:
        yield
    finally:
        if targeted:
            lib.cublasSetSmCountTarget(handle, before.value)
        if swapped:
            compat.swap_matmul_sm_carveout(previous)
