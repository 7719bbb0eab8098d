"""Per-group collectives issued straight into NCCL, on the communicator torch.distributed already made.

``ProcessGroupNCCL`` exposes its ``ncclComm_t`` (``compat.nccl_communicator``), and the NCCL library it calls is
loaded in this process. Calling that library's ``ncclAllReduce`` / ``ncclReduceScatter`` / ``ncclSend`` +
``ncclRecv`` through ctypes on our side stream costs a few microseconds per group, where a ``torch.distributed``
call costs tens (work objects, events between the caller's and the process group's streams) -- the per-group host
cost that kept small fused shapes from overlapping. It also puts the NCCL kernels on the side stream, whose
priority is the highest there is, so SMs that the GEMM frees go to NCCL first.

Invariants:

* One NCCL library: the one already mapped into the process (``/proc/self/maps``), checked against
  ``torch.cuda.nccl.version()``; never a second copy (a ``ncclComm_t`` is only valid in the library that made it).
* One communicator: the process group's own (the issue's "torch.distributed's communicator, not a second one").
  Ranks of the communicator are the group's ranks. NCCL orders the operations of one communicator in issue order
  across streams, so calls made here and torch's own calls on the group interleave the same way on every rank.
* No communicator yet (torch creates it lazily at the group's first collective), a non-NCCL group, a missing
  library or a version mismatch: ``communicator()`` returns None and the call takes the unfused route. Whether
  a communicator exists is the same on every rank at the same call (they run the same collectives), so every rank
  takes the same path.

Sizes are in elements; pointers are raw device addresses; ``stream`` is a ``cudaStream_t`` as an int.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from dataclasses import dataclass

import torch

from flashoverlap_inductor import _inductor_compat as compat

log = logging.getLogger("flashoverlap")

NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
NCCL_SUM = 0
NCCL_DTYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}  # the fused GEMMs' output dtypes
NCCL_INT64 = 4  # ncclInt64: the MoE route's status vectors (routes/moe_nccl.py)


class NcclError(RuntimeError):
    """A direct NCCL call returned an error code."""


def _mapped_nccl_paths() -> list[str]:
    """Paths of every ``libnccl.so*`` mapped into this process (Linux), in map order."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if "libnccl.so" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


class NcclLibrary:
    """The process's NCCL library, bound through ctypes (argument types declared once)."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)  # already mapped: dlopen returns the loaded instance
        v = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(v)) != NCCL_SUCCESS:
            raise NcclError(f"ncclGetVersion failed in {path}")
        self.version = int(v.value)
        p, sz, i, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
        lib.ncclAllReduce.argtypes = [p, p, sz, i, i, p, p]
        lib.ncclReduceScatter.argtypes = [p, p, sz, i, i, p, p]
        lib.ncclReduce.argtypes = [p, p, sz, i, i, i, p, p]
        lib.ncclAllGather.argtypes = [p, p, sz, i, p, p]
        lib.ncclSend.argtypes = [p, sz, i, i, p, p]
        lib.ncclRecv.argtypes = [p, sz, i, i, p, p]
        lib.ncclGroupStart.argtypes = []
        lib.ncclGroupEnd.argtypes = []
        lib.ncclGetErrorString.argtypes = [i]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclCommCount.argtypes = [p, ctypes.POINTER(i)]
        lib.ncclCommUserRank.argtypes = [p, ctypes.POINTER(i)]
        lib.ncclCommGetAsyncError.argtypes = [p, ctypes.POINTER(i)]
        for fn in (lib.ncclAllReduce, lib.ncclReduceScatter, lib.ncclReduce, lib.ncclAllGather, lib.ncclSend,
                   lib.ncclRecv, lib.ncclGroupStart, lib.ncclGroupEnd, lib.ncclCommCount, lib.ncclCommUserRank,
                   lib.ncclCommGetAsyncError):
            fn.restype = u
        self.lib = lib

    def check(self, rc: int, what: str, comm: int | None = None) -> None:
        """Raise ``NcclError`` for an error code. ``ncclInProgress`` (a non-blocking communicator) is waited out
        through ``ncclCommGetAsyncError`` (bounded by the settings' wait timeout) before the next call."""
        if rc == NCCL_IN_PROGRESS and comm is not None:
            from flashoverlap_inductor import config

            state, deadline = ctypes.c_int(NCCL_IN_PROGRESS), time.monotonic() + config.current().timeout_ns() / 1e9
            while state.value == NCCL_IN_PROGRESS and time.monotonic() < deadline:
                self.lib.ncclCommGetAsyncError(ctypes.c_void_p(comm), ctypes.byref(state))
            rc = state.value
            if rc == NCCL_IN_PROGRESS:
                raise NcclError(f"{what}: the non-blocking communicator stayed in progress past the timeout")
        if rc != NCCL_SUCCESS:
            msg = self.lib.ncclGetErrorString(rc)
            raise NcclError(f"{what} failed: NCCL error {rc} ({msg.decode() if msg else '?'})")


def _version_code(v: tuple[int, ...] | int) -> int:
    if isinstance(v, int):
        return v
    major, minor, patch = (list(v) + [0, 0, 0])[:3]
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch


@functools.lru_cache(maxsize=1)
def library() -> NcclLibrary | None:
    """The NCCL library torch uses, or None (logged) when it cannot be found or its version differs."""
    try:
        want = _version_code(torch.cuda.nccl.version())
    except Exception as exc:
        log.info("flashoverlap: torch reports no NCCL (%r); the NCCL route is off", exc)
        return None
    for path in _mapped_nccl_paths():
        try:
            lib = NcclLibrary(path)
        except (OSError, AttributeError, NcclError) as exc:
            log.info("flashoverlap: %s is not usable (%r)", path, exc)
            continue
        if lib.version == want:
            log.info("flashoverlap: direct NCCL calls through %s (version %d)", path, lib.version)
            return lib
        log.info("flashoverlap: %s has NCCL %d, torch uses %d: not used", path, lib.version, want)
    log.info("flashoverlap: torch's NCCL library is not mapped as a shared library; per-group collectives go "
             "through torch.distributed")
    return None


@dataclass(frozen=True)
class Communicator:
    """A process group's ``ncclComm_t`` on one device, with the library to call it through."""

    lib: NcclLibrary
    comm: int
    size: int
    rank: int

    def all_reduce(self, send: int, recv: int, count: int, dtype: torch.dtype, stream: int) -> None:
        """Sum ``count`` elements of every rank's ``send`` into ``recv`` (may alias)."""
        self.lib.check(self.lib.lib.ncclAllReduce(send, recv, count, NCCL_DTYPES[dtype], NCCL_SUM, self.comm, stream),
                       "ncclAllReduce", self.comm)

    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: torch.dtype, stream: int) -> None:
        """``recv`` (``recv_count`` elements) = the sum over ranks of block ``rank`` of ``send`` (``size`` blocks)."""
        self.lib.check(self.lib.lib.ncclReduceScatter(send, recv, recv_count, NCCL_DTYPES[dtype], NCCL_SUM,
                                                      self.comm, stream), "ncclReduceScatter", self.comm)

    def all_gather_int64(self, send: int, recv: int, count: int, stream: int) -> None:
        """``recv`` (``size * count`` int64) = every rank's ``count`` int64 at ``send``, in rank order."""
        self.lib.check(self.lib.lib.ncclAllGather(send, recv, count, NCCL_INT64, self.comm, stream), "ncclAllGather",
                       self.comm)

    def reduce_pieces(self, pieces: list[tuple[int, int, int]], recv: int, dtype: torch.dtype, stream: int) -> None:
        """One NCCL group of ``ncclReduce`` calls: ``pieces`` are ``(root, pointer, count)``; each root receives the
        sum of its piece over the ranks at ``recv`` (reduce_scatter from natural rows, ``row_order``)."""
        lib, t = self.lib.lib, NCCL_DTYPES[dtype]
        self.lib.check(lib.ncclGroupStart(), "ncclGroupStart")
        try:
            for root, ptr, count in pieces:
                self.lib.check(lib.ncclReduce(ptr, recv, count, t, NCCL_SUM, root, self.comm, stream), "ncclReduce")
        finally:
            self.lib.check(lib.ncclGroupEnd(), "ncclGroupEnd", self.comm)

    def send_recv(self, sends: list[tuple[int, int, int]], recvs: list[tuple[int, int, int]], dtype: torch.dtype,
                  stream: int) -> None:
        """One NCCL group of point-to-point transfers: ``sends``/``recvs`` are ``(peer, pointer, count)`` with
        ``peer`` a rank of the communicator (= of the process group)."""
        lib, t = self.lib.lib, NCCL_DTYPES[dtype]
        self.lib.check(lib.ncclGroupStart(), "ncclGroupStart")
        try:
            for peer, ptr, count in sends:
                self.lib.check(lib.ncclSend(ptr, count, t, peer, self.comm, stream), "ncclSend")
            for peer, ptr, count in recvs:
                self.lib.check(lib.ncclRecv(ptr, count, t, peer, self.comm, stream), "ncclRecv")
        finally:
            self.lib.check(lib.ncclGroupEnd(), "ncclGroupEnd", self.comm)


# (id(group), device index) -> (group, communicator): reading the communicator costs ~100 us per call on torch 2.11,
# so a group's communicator is looked up once. A process group keeps its communicator for its whole life (an
# aborted group is unusable; a re-initialized one is a new group object).
_by_group: dict[tuple[int, int | None], tuple[object, Communicator]] = {}
_aborted: list[object] = []  # groups this process aborted: their communicators are freed (ncclCommAbort)


def abort(group: object) -> bool:
    """Abort ``group`` through torch (``_inductor_compat.abort_group``; True when an abort ran), first recording it so
    that ``communicator`` never hands out its freed ``ncclComm_t`` again (every abort of ours goes through here)."""
    if not aborted(group):
        _aborted.append(group)
    for key in [k for k, (g, _) in _by_group.items() if g is group]:
        del _by_group[key]
    return compat.abort_group(group)


def aborted(group: object) -> bool:
    """Whether this process aborted ``group`` (``abort``)."""
    return any(g is group for g in _aborted)


def communicator(group: object, device: torch.device) -> Communicator | None:
    """The ``ncclComm_t`` of ``group`` on ``device`` (None: the NCCL route declines; see the module docstring).

    Until torch has created the communicator (lazily, at the group's first collective) this returns None on every
    rank alike, and again once this process aborted the group (``abort``); once found it is cached per group and
    device, after a size/rank check against the group."""
    if aborted(group):  # its communicator is freed: the callers take torch's path, which raises for an aborted group
        return None
    cached = _by_group.get((id(group), device.index))
    if cached is not None and cached[0] is group:  # the group object itself is kept alive: its id is not reused
        return cached[1]
    lib = library()
    if lib is None:
        return None
    try:
        ptr = compat.nccl_communicator(group, device)
    except Exception:  # not NCCL, no communicator yet, or a torch without the binding
        return None
    if not ptr:
        return None
    size, rank = group.size(), group.rank()  # type: ignore[attr-defined]
    count, user_rank = ctypes.c_int(0), ctypes.c_int(0)
    lib.check(lib.lib.ncclCommCount(ptr, ctypes.byref(count)), "ncclCommCount")
    lib.check(lib.lib.ncclCommUserRank(ptr, ctypes.byref(user_rank)), "ncclCommUserRank")
    if (count.value, user_rank.value) != (size, rank):
        log.warning("flashoverlap: the process group's communicator has %d ranks (rank %d), the group %d (rank %d): "
                    "the NCCL route declines", count.value, user_rank.value, size, rank)
        return None
    comm = Communicator(lib, ptr, size, rank)
    _by_group[(id(group), device.index)] = (group, comm)
    return comm


_bound: list[str] = []


def bind_library(comm: Communicator) -> bool:
    """Whether the kernel library's ``fo_fused_call`` calls the NCCL library ``comm`` lives in: bound once per
    process (``fo_nccl_bind``); a failure is logged once and the NCCL route then declines every call."""
    from flashoverlap_inductor.native import kernels

    if not _bound:
        lib = kernels.library()
        if lib.fo_nccl_bind(comm.lib.path.encode()) != 0:
            log.warning("flashoverlap: the NCCL route is off: %s", lib.fo_last_error().decode())
            _bound.append("")
        else:
            _bound.append(comm.lib.path)
    return _bound[0] == comm.lib.path
