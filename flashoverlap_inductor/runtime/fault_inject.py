"""Test-only fault injection into the NCCL route's host call (``fo_fused_call``, ``csrc/fused_call.cu``).

Off by default: nothing is injected unless a caller arms it, explicitly, with ``nccl(NcclInjection(...))`` around
the calls it means, on the rank it means (the GPU probe ``examples/device/fault_probe_nccl.py``, the tests). No
setting, environment variable or import arms it, and leaving the ``with`` block disarms it, whatever raised.

What can be injected (``NcclInjection``; the library's ``fo_nccl_inject`` does it, process-wide):

- ``code`` (an ``ncclResult_t``; ``NCCL_RESULTS``) for the ``nth`` NCCL enqueue call after arming (``nth >= 1``,
  counting ``ncclAllReduce`` / ``ncclReduceScatter`` / ``ncclReduce`` / ``ncclSend`` / ``ncclRecv`` of fused calls,
  the one-int fault exchange included, ``ncclGroupStart`` / ``End`` not): any code but ``ncclInProgress`` means
  NCCL *refused* the call (nothing enqueued). The library returns ``300 + code``, which the route
  (``routes/nccl.py``, ``execute``) treats as NCCL refusing a call (codes 300-399): it aborts the process group
  through torch (``_inductor_compat.abort_group``) and raises ``KernelLibraryError``.
- ``code == NCCL_IN_PROGRESS`` (7): the call is made, reported as still in progress, and the next ``polls`` polls
  of ``ncclCommGetAsyncError`` report in progress too before the real state: the library's wait-out loop
  (bounded by the call's timeout) must end in success and the call must be correct. A ``polls`` that outlasts
  the bound (about 60 us a poll) ends in ``307`` (still in progress after the timeout), handled as a refusal.
- ``stall_ms`` > 0: the next fused call with rows spins that long on the GPU (caller's stream, after the call's
  fork, before its GEMM): this rank's GEMM starts late while its waits' deadline already runs, so a stall past
  ``wait_timeout_ms`` makes this rank's wait give up (the failure contract: NaN on every rank, then
  ``FlashOverlapTimeout`` on every rank), with the same settings on every rank (settings that differ across
  ranks raise ``RankMismatch`` instead).

``nccl(...)`` yields an ``InjectionStats`` whose ``read()`` gives the counts so far (``fired``: injected NCCL
results, ``polled``: injected in-progress polls, ``stalled``: stalls run), so a probe can tell "the fault was
handled" from "the fault never fired". A library built before the hook lacks ``fo_nccl_inject``:
``available()`` is False and arming raises ``KernelLibraryError`` (rebuild: ``python -m
flashoverlap_inductor.build``).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

NCCL_IN_PROGRESS = 7
NCCL_RESULTS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}
REFUSED = range(300, 400)  # library return codes 300 + ncclResult_t: the route aborts the group (routes/nccl.py)


@dataclass(frozen=True)
class NcclInjection:
    """One injection (module docstring). ``nth``: the NCCL enqueue call to replace, 1 = the first after arming
    (0: none, e.g. a stall alone); ``code``: its ``ncclResult_t`` (0: none); ``polls``: in-progress polls after an
    injected ``ncclInProgress``; ``stall_ms``: the next fused call's GEMM delay in ms of GPU time (0: none).
    Invariants (``__post_init__``): ``nth >= 0``, ``code`` 0 or a key of ``NCCL_RESULTS``, ``polls >= 0``, ``polls``
    only with ``ncclInProgress``, ``stall_ms >= 0``, and a code exactly when ``nth >= 1``."""

    nth: int = 0
    code: int = 0
    polls: int = 0
    stall_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.nth < 0 or self.polls < 0 or self.stall_ms < 0:
            raise ValueError(f"NcclInjection: nth, polls and stall_ms must be >= 0, got {self}")
        if self.code and self.code not in NCCL_RESULTS:
            raise ValueError(f"NcclInjection: code {self.code} is no ncclResult_t error ({NCCL_RESULTS})")
        if bool(self.code) != (self.nth >= 1):
            raise ValueError(f"NcclInjection: a code needs nth >= 1 and nth >= 1 needs a code, got {self}")
        if self.polls and self.code != NCCL_IN_PROGRESS:
            raise ValueError(f"NcclInjection: polls only follow an injected ncclInProgress, got {self}")

    def describe(self) -> str:
        parts = []
        if self.code:
            what = (f"in progress, then {self.polls} in-progress polls" if self.code == NCCL_IN_PROGRESS
                    else f"refused with {NCCL_RESULTS[self.code]} ({self.code})")
            parts.append(f"NCCL call {self.nth} {what}")
        if self.stall_ms:
            parts.append(f"GEMM stalled {self.stall_ms:g} ms")
        return ", ".join(parts) or "nothing"


@dataclass
class InjectionStats:
    """The library's injection counts since arming (``read()``: ``{"fired", "polled", "stalled"}``); after the
    ``with`` block, those it ended with (``final``)."""

    lib: Any
    final: dict[str, int] | None = None

    def read(self) -> dict[str, int]:
        if self.final is not None:
            return dict(self.final)
        vals = [ctypes.c_int64(0) for _ in range(3)]
        self.lib.fo_nccl_inject_stats(*(ctypes.byref(v) for v in vals))
        return dict(zip(("fired", "polled", "stalled"), (int(v.value) for v in vals), strict=True))


def _bind(lib: Any) -> Any:
    """``lib`` with the hook's argument types declared; raises ``KernelLibraryError`` when it has no hook."""
    from flashoverlap_inductor.native import kernels

    try:
        arm, stats = lib.fo_nccl_inject, lib.fo_nccl_inject_stats
    except AttributeError as exc:
        raise kernels.KernelLibraryError("the kernel library has no fo_nccl_inject (built before the fault "
                                         "injection hook): rebuild with `python -m flashoverlap_inductor.build`"
                                         ) from exc
    if isinstance(lib, ctypes.CDLL):  # (a fake in the CPU tests takes Python ints)
        i64 = ctypes.c_int64
        arm.restype, arm.argtypes = ctypes.c_int, [i64, ctypes.c_int, i64, i64]
        stats.restype, stats.argtypes = ctypes.c_int, [ctypes.POINTER(i64)] * 3
    return lib


def available(lib: Any = None) -> bool:
    """Whether the kernel library (``lib``, else the loaded one) has the hook; never raises."""
    try:
        if lib is None:
            from flashoverlap_inductor.native import kernels

            lib = kernels.library()
        _bind(lib)
        return True
    except Exception:  # noqa: BLE001 - no library, or one without the hook
        return False


@contextlib.contextmanager
def nccl(injection: NcclInjection, lib: Any = None) -> Iterator[InjectionStats]:
    """Arm ``injection`` in the kernel library (``lib``: the loaded one when None; a fake in the CPU tests) for
    the block, then disarm it (also when the block raises). Process-wide while armed: arm it on the rank that
    should fail, around the calls that should fail."""
    if lib is None:
        from flashoverlap_inductor.native import kernels

        lib = kernels.library()
    lib = _bind(lib)
    stall_ns = int(injection.stall_ms * 1e6)
    rc = lib.fo_nccl_inject(injection.nth, injection.code, injection.polls, stall_ns)
    if rc != 0:  # the stall kernel could not be loaded (a CUDA error): nothing armed
        from flashoverlap_inductor.native import kernels

        kernels.check(rc, "fo_nccl_inject")
    stats = InjectionStats(lib)
    try:
        yield stats
    finally:
        stats.final = stats.read()  # kept: disarming zeroes the library's counts
        lib.fo_nccl_inject(0, 0, 0, 0)
