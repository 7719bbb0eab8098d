"""The MoE P2P route's transfers on CUDA issued straight into NCCL (``native/nccl_direct.py``), on the process
group's own communicator, from a side stream of this module's: one NCCL group (``ncclSend`` + ``ncclRecv``) per ring
step, where ``torch.distributed.batch_isend_irecv`` held the host 0.3-0.7 ms per MoE call under cProfile (2 H100s,
``examples/device/moe_profile.py --cprofile``; the whole unfused op issues in ~0.1 ms). Measured without the profiler on
the next machines, a call's host time did not drop measurably (~1 ms; docs/results.md, twenty-third session).

Invariants:

* **The same mechanism on every rank at every call.** ``transfer`` is taken where the group's communicator exists
  (torch makes it at the group's first collective, the same call on every rank; the route's agreement check is one)
  and the NCCL library torch loaded is bound (the same on every rank of one program); else ``moe_p2p.exchange``
  issues ``batch_isend_irecv`` as before. NCCL runs one communicator's operations in issue order, whatever stream
  they are on, so the steps issued here and torch's own calls on the group (the settle's all_gather) keep the
  order every rank issued them in.
* **Streams.** The side stream waits for the caller's current stream at issue (the rows to send exist); the returned
  ``Transfer``'s ``wait()`` makes the caller's current stream wait for the step's NCCL kernels (no host wait). Every
  transfer a call issues is waited for before the call returns (``cpu._wait_all``), and the step's tensors are
  recorded on the side stream (``record_stream``), so memory freed on any path, an exception's included, is never
  reused while NCCL still reads or writes it.
* **Aborted groups.** Every abort of ours goes through ``nccl_direct.abort``, which forgets the group's communicator
  (``ncclCommAbort`` frees it); ``communicator`` then raises for the group, so no later step or status exchange
  touches the freed communicator.
* **Bounded.** NCCL's kernels have no bound of their own: each step is watched by the host watchdog
  (``runtime/nccl_watch.py``) from the moment the device reaches it; past twice the wait bound (``timeout_ns``) plus
  a grace the group is aborted, so a peer that never issued its half does not hang this rank (the settle's
  all_gather then fails or leaves its sentinel: every rank raises). A step NCCL refuses aborts the group at once and
  raises (``NcclError``), as the NCCL route does: its peer's kernels would otherwise wait forever.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import _inductor_compat as compat
from .. import config, errors
from ..native import nccl_direct
from ..runtime import nccl_watch
from .base import stats
from .nccl import is_nccl_group

log = logging.getLogger("flashoverlap")
_side: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This module's stream on ``device`` (highest priority: NCCL's kernels get the SMs a GEMM frees first)."""
    stream = _side.get(device.index)
    if stream is None:
        low, high = torch.cuda.Stream.priority_range()
        stream = _side[device.index] = torch.cuda.Stream(device, priority=min(low, high))
    return stream


class Transfer:
    """One issued ring step: ``wait()`` makes the caller's current stream wait for it (as ``dist.Work.wait()`` does)
    and drops the step's tensors (kept alive until then)."""

    def __init__(self, done: torch.cuda.Event, device: torch.device, keep: tuple) -> None:
        self.done, self.device, self.keep = done, device, keep

    def wait(self) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        self.keep = ()
        return True


def communicator(group: dist.ProcessGroup, device: torch.device) -> nccl_direct.Communicator | None:
    """The group's communicator where the direct path is taken (module docstring), else None. Raises
    ``errors.FlashOverlapTimeout`` for a group this process aborted (its communicator is freed): nothing more is
    issued on it, by either path."""
    if device.type != "cuda":
        return None
    if nccl_direct.aborted(group):
        raise errors.FlashOverlapTimeout(
            f"flashoverlap: the process group {getattr(group, 'group_name', '?')} was aborted (a MoE transfer or "
            "status exchange outlived its bound or NCCL refused it): make a new group")
    return nccl_direct.communicator(group, device)


_group_timeout_ms: dict[str, float | None] = {}  # a group's own timeout, read once (~50 us through torch)


def bound_s(group: dist.ProcessGroup) -> float:
    """The wait bound of a call on ``group`` in seconds (the settings' ``timeout_ns``, else the group's timeout)."""
    name = group.group_name
    if name not in _group_timeout_ms:
        _group_timeout_ms[name] = compat.group_timeout_ms(group)
    return config.current().timeout_ns(_group_timeout_ms[name]) * 1e-9


def transfer(comm: nccl_direct.Communicator, send: torch.Tensor | None, recv: torch.Tensor | None, dst: int, src: int,
             group: dist.ProcessGroup, what: str, after: torch.cuda.Event | None = None) -> list[Transfer]:
    """``moe_p2p.exchange`` through ``comm`` (counted ``moe:nccl_direct``): send ``send`` (contiguous rows) to
    group rank ``dst`` and receive ``recv`` (contiguous) from ``src`` in one NCCL group on the side stream; an empty
    or None side is left out (its peer's split size is the same 0). The side stream waits for ``after`` (recorded
    behind the work that wrote ``send``: ``moe_combine_lib``'s block events), else for the caller's stream as it is
    now. Returns the step to wait on (none when nothing was issued)."""
    return transfer_blocks(comm, [(dst, send, after)], [(src, recv)], group, what)


def transfer_blocks(comm: nccl_direct.Communicator, sends: list[tuple[int, torch.Tensor | None, object]],
                    recvs: list[tuple[int, torch.Tensor | None]], group: dist.ProcessGroup, what: str
                    ) -> list[Transfer]:
    """Blocks to and from several peers in one NCCL group on the side stream (no order among them to deadlock on):
    ``sends`` = ``(group rank, contiguous rows, event or None)`` (the side stream waits for each event, recorded
    behind the work that wrote the rows, else for the caller's stream as it is now), ``recvs`` = ``(group rank,
    contiguous rows)``; empty or None rows are left out (their peer's split size is the same 0). Returns the one
    step to wait on (none when nothing was issued)."""
    sends = [(j, t, ev) for j, t, ev in sends if t is not None and t.numel()]
    recvs = [(j, t) for j, t in recvs if t is not None and t.numel()]
    if not sends and not recvs:
        return []
    tensors = [t for _, t, _ in sends] + [t for _, t in recvs]
    if any(not t.is_contiguous() for t in tensors):
        raise ValueError(f"flashoverlap: {what}: a transfer's rows must be contiguous")
    device = tensors[0].device
    caller, side = torch.cuda.current_stream(device), side_stream(device)
    waits = list(dict.fromkeys(ev for _, _, ev in sends if ev is not None))
    if not sends or any(ev is None for _, _, ev in sends):  # a send without an event, or none: the caller's now
        now = torch.cuda.Event()
        now.record(caller)
        waits.append(now)
    for ev in waits:
        side.wait_event(ev)
    started = waits[0]  # the watchdog's start: where the side stream is when the step may begin
    if len(waits) > 1:
        started = torch.cuda.Event()
        started.record(side)
    for t in tensors:  # the caching allocator keeps their blocks until the side stream's work on them is done,
        t.record_stream(side)  # whatever exits the caller takes before it waits for the step
    try:
        comm.send_recv([(j, t.data_ptr(), t.numel()) for j, t, _ in sends],
                       [(j, t.data_ptr(), t.numel()) for j, t in recvs], tensors[0].dtype, side.cuda_stream)
    except nccl_direct.NcclError as exc:  # the peer's half may be queued already: it must not wait forever
        caller.wait_stream(side)
        raise _refused(exc, group, f"a transfer of {what}") from exc
    done = torch.cuda.Event()
    done.record(side)
    step = Transfer(done, device, tuple(tensors))
    _watch(started, done, group, what)
    stats["moe:nccl_direct"] += 1
    return [step]


def exchange_blocks(sends: list[tuple[int, torch.Tensor | None, object]], recvs: list[tuple[int, torch.Tensor | None]],
                    group: dist.ProcessGroup, what: str, tag: int) -> tuple[dict[int, object], list]:
    """``transfer_blocks`` on any group of CUDA rows (``moe_peer``'s blocks too large for their slots: both ends of
    a pair know its rows, so both take this): one NCCL group where the group's communicator is at hand, one
    ``batch_isend_irecv`` (tag ``tag``) on another NCCL group (watched by NCCL's own timeout only), and on a gloo
    group (the tests' ranks sharing a GPU) through host copies (a host sync: the sends' rows are read after the
    caller's stream; bounded by gloo's timeout only). Returns, per source rank received from, what to ``wait()`` on
    (a ``Transfer``, with its ``done`` event, else ``dist`` works), and every step issued, which the caller's stream
    must wait for before the call ends (a rank that only sends has no source to wait on)."""
    sends = [(j, t, ev) for j, t, ev in sends if t is not None and t.numel()]
    recvs = [(j, t) for j, t in recvs if t is not None and t.numel()]
    if not sends and not recvs:
        return {}, []
    device = (sends[0][1] if sends else recvs[0][1]).device
    comm = communicator(group, device)
    if comm is not None:
        step = transfer_blocks(comm, sends, recvs, group, what)[0]
    elif is_nccl_group(group):  # the communicator is made at the group's first collective: before it, torch's
        step = _Works(p2p_ops([(j, t) for j, t, _ in sends], recvs, group, tag))
    else:  # gloo moves host rows only
        caller = torch.cuda.current_stream(device)
        for _, _, ev in sends:
            if ev is not None:
                caller.wait_event(ev)
        host_recvs = [(j, torch.empty(t.shape, dtype=t.dtype)) for j, t in recvs]
        for w in p2p_ops([(j, t.cpu()) for j, t, _ in sends], host_recvs, group, tag):
            w.wait()
        for (_, t), (_, h) in zip(recvs, host_recvs, strict=True):
            t.copy_(h)
        done = torch.cuda.Event()
        done.record(caller)
        step = Transfer(done, device, ())
    return dict.fromkeys((j for j, _ in recvs), step), [step]


def p2p_ops(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], group: dist.ProcessGroup,
         tag: int) -> list:
    """One ``batch_isend_irecv`` of ``sends`` / ``recvs`` (group rank, rows; tag ``tag``); returns its works (none
    where both are empty)."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, j), group, tag=tag) for j, t in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, j), group, tag=tag) for j, t in recvs]
    return [w for w in (dist.batch_isend_irecv(ops) or ()) if w is not None] if ops else []


class _Works:
    """``dist`` works waited for as one step (``wait()`` as ``Transfer``'s: the caller's stream waits; no event)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def _refused(exc: nccl_direct.NcclError, group: dist.ProcessGroup, what: str) -> nccl_direct.NcclError:
    """Abort ``group`` after NCCL refused ``what`` (the peers' halves may be queued: they must not wait forever);
    returns the error to raise."""
    aborted = nccl_direct.abort(group)
    return nccl_direct.NcclError(
        f"flashoverlap: NCCL refused {what}; the process group {getattr(group, 'group_name', '?')} was "
        f"{'aborted' if aborted else 'NOT aborted'} so that no rank waits forever: {exc}")


def _watch(started: torch.cuda.Event, done: torch.cuda.Event, group: dist.ProcessGroup, what: str) -> None:
    """Hand an issued exchange to the NCCL watchdog; a failure to watch is logged, not raised (the exchange is in
    flight and its caller must still wait for it)."""
    try:
        nccl_watch.watchdog().watch(started, done, bound_s(group), group, None, what)
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("flashoverlap: %s is not watched (no bound on its NCCL kernels)", what)


def gather_status(every: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup, what: str) -> None:
    """The settle's exchange (``moe_settle``, ``moe_deferred``): ``every`` = every rank's int64 vector ``local``, in
    rank order; on the caller's current stream straight into NCCL where the transfers go (watched likewise; counted
    ``moe:nccl_direct_status``), else ``dist.all_gather_into_tensor``. Raises where the exchange could not be issued."""
    comm = communicator(group, local.device)
    if comm is None:
        if local.is_cuda and not is_nccl_group(group):  # gloo with CUDA rows (moe_peer's tests): through the host
            host = every.cpu()
            dist.all_gather_into_tensor(host, local.cpu(), group=group)
            every.copy_(host)
            return
        dist.all_gather_into_tensor(every, local, group=group)
        return
    stream = torch.cuda.current_stream(local.device)
    started = torch.cuda.Event()
    started.record(stream)
    try:
        comm.all_gather_int64(local.data_ptr(), every.data_ptr(), local.numel(), stream.cuda_stream)
    except nccl_direct.NcclError as exc:
        raise _refused(exc, group, f"the status exchange of {what}") from exc
    done = torch.cuda.Event()
    done.record(stream)
    _watch(started, done, group, f"the status exchange of {what}")
    stats["moe:nccl_direct_status"] += 1


def check_not_given_up(group: dist.ProcessGroup, what: str) -> None:
    """Raise ``errors.FlashOverlapTimeout`` where the NCCL watchdog gave up a transfer or status exchange of
    ``group``: what the aborted kernels left in the buffers (the status vectors included) cannot be trusted. Called
    after the host waited for the call's exchange (``moe_settle.settle``, ``moe_deferred.raise_pending``)."""
    if nccl_watch.watchdog().gave_up(group) or nccl_direct.aborted(group):
        raise errors.FlashOverlapTimeout(
            f"flashoverlap: {what}: a transfer or the status exchange of group {getattr(group, 'group_name', '?')} "
            f"outlived its bound ({bound_s(group):.1f} s: wait_timeout_ms, else the group's timeout; a peer that "
            "skipped the call or stopped); the NCCL watchdog aborted the group (make a new one), and this rank does "
            "not return the call's output")
