"""The NCCL route of all_gather -> GEMMs: the ring of ``gather_ring`` on CUDA streams, through the process group's
own point-to-point ops (so its watchdog bounds every transfer, as for any NCCL collective). Any world size >= 2.

Per call: a side stream issues every ring step at once; the caller's stream computes the local shard's GEMMs, then
each arrived shard's after an event of its step; cuBLAS does the GEMMs (one per shard and weight, into the shard's
rows of each result). The caller's stream joins the side stream, which then runs the failure exchange (below), and
joins it again. Declines (the same on every rank): another collective, one rank (nothing to overlap), a group whose
backend is not NCCL, a plan it does not know.

Failure contract (``docs/design.md``; the CPU route's in ``routes/cpu.py``): a fault on one rank reaches every rank
of the group as an exception, no rank returns a wrong tensor, the next call needs no reset, every wait is bounded,
and which collectives run never depends on a failure. A "fault" here is an exception on a rank's host while it
enqueues its part of a call (a GEMM that raises, no memory, a ``KeyboardInterrupt``); a transfer that fails or hangs
is NCCL's, ended by the process group's watchdog at its timeout on every rank, as for any NCCL collective.

- Every rank issues every ring step of every call, whatever failed. The steps go out before the GEMMs, so a GEMM
  that raises (any of them, the last included) finds them issued with exact data: the peers' results are exact
  (they depend only on the shards). A rank that cannot prepare the call (``GatherCall`` raised: no memory for
  ``staging`` or the outputs) issues them from ``gather_ring.VoidRing`` (two shards of memory), which sends NaN
  shards: a peer's rows of any shard that passed through it are NaN, never other data. A rank that cannot do even
  that, or whose step (or failure exchange, below) could not be issued (it may be half enqueued, so the ring cannot
  be completed), aborts the group through torch (``nccl_direct.abort``) and raises: its own later calls
  fail at once, and the peers' pending NCCL calls end with torch's error at the group's timeout, never hang.
- The failure exchange: every call outside a capture ends with one ``all_reduce`` (MAX) of ``int32[world]`` on the
  side stream, after the ring's last step: slot j holds rank j's failure count (monotonic; only rank j raises its
  slot, on the device, and only in a call that failed), so after it every rank's device knows every rank's count;
  a non-blocking copy puts them into a pinned host mirror, and the caller's stream joins the side stream after
  that copy, so whatever waits for a call's outputs (``.item()``, a sync) also waits for its status. The host reads
  the mirror without any device sync at the end of each of its calls on the group, after that call's collectives
  were issued, and in ``routes.check()`` after its sync (``raise_pending``): a count above the one it last
  reported raises ``errors.PeerFailure`` naming the rank(s). The failing rank raises its own exception in the
  call, after the exchange.
- When each rank raises: the failing rank in the failed call; every other rank at the end of the first later call
  whose host read finds the failed call's status in the mirror: the next call when the host waited for the failed
  call's outputs in between (a ``.item()``, a sync) or the device got there first, else a later one, and in
  ``routes.check()`` in any case. That call's collectives were all issued, so the ranks' call sequences stay paired
  whoever raises when; its outputs are dropped. The next call runs normally: counts only grow, so nothing is
  cleared, resynchronized or reset. Inside a compiled graph the raise ends that run of the graph on that rank while
  its peers (which raise at another call) issue the run's later collectives: after a fault, call ``routes.check()``
  on every rank and restart the step, as after any collective error.
- Decisions: the steps and the exchange run in every call (the exchange in none inside a CUDA-graph capture, which
  is the same on every rank), failure or not. Inside a capture nothing runs on the device and nothing of the host
  runs at a replay, so there is nothing to exchange; a rank whose capture raised has no graph (torch discards it),
  and replaying its peers' graphs alone would wait in NCCL, bounded by the watchdog, like any collective captured
  on some ranks only.

Why this exchange: the CPU route's exchange is blocking (an ``all_reduce`` then ``.item()``: a host sync per call,
which would end the host's run-ahead and cannot be captured). Putting the status into the ring steps themselves
cannot cover a GEMM failure: the steps are enqueued before the GEMMs (that is the overlap), so a status that a
later GEMM's failure changes races with the send that would carry it, unless the last step waited for the GEMMs
(for 2 ranks, the only step: no overlap left). Deferring the status to the next call's traffic would tell the
peers' devices one call late (their hosts two) and never when no call follows. The tiny ``all_reduce`` is enqueued
after the GEMMs, so it carries every failure of its call. It runs on the side stream right after the last step has
landed, beside the last shard's GEMMs (the side stream is idle by then), so the caller's stream, which waits for
it, loses nothing unless those GEMMs take less than one tiny all_reduce (about 10 us); the rest is host time, one
c10d launch and one 4 x world byte copy per call, and no sync.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from .. import config, errors
from ..native import nccl_direct
from ..runtime import streams as device_streams
from .gather_ring import CudaStreams, GatherCall, StepIssueError, VoidRing, run_streams
from .nccl import is_nccl_group

log = logging.getLogger("flashoverlap")

PLANS = ("auto", "ring")
NAME = "gather_nccl"
END_OF_CALL = ("at the end of a later call (this one), whose collectives were all issued and whose outputs are not "
               "returned")


def unsupported_plan(plan: str) -> str | None:
    if plan not in PLANS:
        return f"plan: {plan!r} is not an all_gather plan ({', '.join(PLANS)})"
    return None


@dataclass
class Status:
    """The failure counts of one (device, group): ``counts`` (int32 [world] on the device, every rank's count as of
    the last exchange), ``mirror`` (the same on the host, pinned where CUDA exists), this rank's own count ``mine``,
    the value ``written`` into its slot, and per rank the count ``seen`` already reported here."""

    group: dist.ProcessGroup
    rank: int
    counts: torch.Tensor
    mirror: torch.Tensor
    mine: int = 0
    written: int = 0
    seen: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def failed(self) -> None:
        """This rank failed in the call being settled (it raises the cause itself: never reported here). Counted on
        from the mirror's own slot when that is higher (a rank whose state alone was reset gets its old count back
        from its peers at the next exchange: a count below it would never show)."""
        with self.lock:
            self.mine = max(self.mine, int(self.mirror[self.rank])) + 1
            self.seen[self.rank] = self.mine

    def exchange(self, streams) -> BaseException | None:
        """The failure exchange, on the side stream (module docstring). Returns what raised before or after the
        ``all_reduce`` (the caller raises it once the call is settled); raises ``StepIssueError`` when the
        ``all_reduce`` itself could not be issued."""
        late: BaseException | None = None
        with streams.on_side():
            if self.written != self.mine:
                try:
                    self.counts[self.rank:self.rank + 1].fill_(self.mine)
                    self.written = self.mine
                except BaseException as exc:  # noqa: BLE001 - the exchange still runs; the next call writes it
                    late = exc
            try:
                work = dist.all_reduce(self.counts, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
                if work is not None:
                    work.wait()  # the side stream waits (no host wait with NCCL)
            except BaseException as exc:  # noqa: BLE001 - may be half enqueued: the caller aborts
                raise StepIssueError(0, exc) from exc
            try:
                self.mirror.copy_(self.counts, non_blocking=True)
            except BaseException as exc:  # noqa: BLE001 - the next call's copy brings the counts (they only grow)
                late = late or exc
        return late

    def raise_if_peers_failed(self, when: str = END_OF_CALL) -> None:
        """Raise ``errors.PeerFailure`` when the mirror shows a peer's count above the one reported here (a host
        read of the mirror: no device sync); ``when``: where this rank raises it, in words."""
        counts = [int(v) for v in self.mirror.tolist()]
        with self.lock:
            new = {j: c - self.seen[j] for j, c in enumerate(counts) if j != self.rank and c > self.seen[j]}
            for j in new:
                self.seen[j] = counts[j]
        if not new:
            return
        names = ", ".join(f"rank {j}{_global(self.group, j)} ({n} failed call{'s' if n > 1 else ''})"
                          for j, n in sorted(new.items()))
        where = f"cuda:{self.counts.device.index}" if self.counts.is_cuda else self.counts.device.type
        raise errors.PeerFailure(
            f"flashoverlap: {names} of group {_group_name(self.group)} failed in a fused all_gather -> GEMMs call on "
            f"the {NAME} route ({where}); that rank raised the cause. Rank {self.rank} issued all its collectives "
            "of that call, and its outputs of it were exact, or NaN in the rows of shards the failing rank could "
            f"not send (never other data); rank {self.rank} raises this {when}. The next call runs normally (no "
            "reset needed).")


_status: dict[tuple, Status] = {}
_status_lock = threading.Lock()


def status_for(group: dist.ProcessGroup, device: torch.device) -> Status:
    """The ``Status`` of (``device``, ``group``), made on first use (outside captures: the CUDA one allocates)."""
    key = (device.type, device.index, id(group))
    with _status_lock:
        st = _status.get(key)
        if st is not None and st.group is group:  # the group itself is kept alive: its id is not reused
            return st
        world = group.size()
        if device.type == "cuda":
            index = device.index or 0
            counts = device_streams.persistent(index, lambda: torch.zeros(world, dtype=torch.int32,
                                                                           device=f"cuda:{index}"))
            mirror = torch.zeros(world, dtype=torch.int32, pin_memory=True)
        else:
            counts, mirror = torch.zeros(world, dtype=torch.int32), torch.zeros(world, dtype=torch.int32)
        st = _status[key] = Status(group, group.rank(), counts, mirror, seen=[0] * world)
        return st


def raise_pending(sync: bool = True) -> None:
    """Raise ``errors.PeerFailure`` for a peer's failure that no call of this rank reported yet, after synchronizing
    the devices when ``sync`` (``routes.check()``)."""
    for st in list(_status.values()):
        if sync and st.counts.is_cuda:
            torch.cuda.synchronize(st.counts.device)
        st.raise_if_peers_failed("in routes.check()")


def run_call(ctx, streams) -> list[torch.Tensor]:
    """One call (module docstring): the ring on ``streams`` (``gather_ring.CudaStreams``, or ``HostStreams`` in the
    CPU tests), the failure exchange (not inside a capture), then this rank's failure, a peer's, or the outputs."""
    failure: BaseException | None = None
    status = None
    if not ctx.capturing:
        try:
            status = status_for(ctx.group, ctx.a.device)
        except BaseException as exc:  # noqa: BLE001 - the ring still runs; then the group is aborted (no exchange)
            failure = exc
    call = None
    try:
        call = GatherCall(ctx)
    except BaseException as exc:  # noqa: BLE001 - the ring still runs, from VoidRing
        failure = failure or exc
    try:
        ring = call if call is not None else VoidRing(ctx)
    except BaseException as exc:  # noqa: BLE001 - no memory for two shards either: nothing to send the peers
        _abort(ctx, "could not prepare its ring steps", exc, failure)
    try:
        got = run_streams(ring, streams, compute=call is not None and failure is None)
    except StepIssueError as exc:
        _abort(ctx, f"could not issue ring step {exc.step}", exc.cause, failure)
    failure = failure or got
    out = None
    if failure is None:
        try:
            out = call.result()
        except BaseException as exc:  # noqa: BLE001 - settled below
            failure = exc
    if not ctx.capturing:
        if status is None:
            _abort(ctx, "could not keep its failure counts", failure, None)
        if failure is not None:
            status.failed()
        try:
            late = status.exchange(streams)
        except StepIssueError as exc:
            _abort(ctx, "could not issue the failure exchange", exc.cause, failure)
        failure = failure or late
        streams.join()  # the outputs are ready (in stream order) once the status is in the mirror
    if failure is not None:
        raise failure
    if status is not None:
        status.raise_if_peers_failed()
    return out


def _abort(ctx, what: str, cause: BaseException | None, earlier: BaseException | None) -> NoReturn:
    """Abort the group (its ring cannot be completed) and raise: ``cause`` itself when it is no ``Exception`` (a
    ``KeyboardInterrupt`` stays one), else ``errors.FlashOverlapError`` from it."""
    group = ctx.group
    aborted = nccl_direct.abort(group)
    msg = (f"flashoverlap: rank {group.rank()} of group {_group_name(group)} {what} in a fused all_gather of a "
           f"{list(ctx.a.shape)} shard (dim {ctx.gather_dim}) -> {len(ctx.b)} GEMM(s) on the {NAME} route; the "
           f"process group was {'aborted' if aborted else 'NOT aborted (the abort failed)'} so that no rank waits "
           "forever: the peers' NCCL calls on it end with torch's error at the group's timeout. Cause: "
           f"{cause!r}" + (f" (after {earlier!r})" if earlier is not None and earlier is not cause else ""))
    log.error("%s", msg)
    if cause is not None and not isinstance(cause, Exception):
        raise cause
    raise errors.FlashOverlapError(msg) from cause


def _group_name(group: dist.ProcessGroup) -> str:
    return getattr(group, "group_name", "?")


def _global(group: dist.ProcessGroup, j: int) -> str:
    try:
        return f" (global rank {dist.get_global_rank(group, j)})"
    except Exception:  # noqa: BLE001 - a group this process cannot map: the group rank alone
        return ""


class GatherNcclRoute:
    name = NAME
    devices = ("cuda",)
    collectives = ("all_gather",)
    last_resort = False

    def unsupported(self, call, settings: config.Settings) -> str | None:
        if call.collective != "all_gather":
            return f"{call.collective} is not an all_gather"
        if call.world < 2:
            return "one rank: nothing to gather"
        return unsupported_plan(call.plan)

    def make_launch(self, call, settings: config.Settings, ctx) -> tuple | str:
        if not is_nccl_group(ctx.group):
            return "backend: the group's backend is not NCCL"
        return (call,)

    def execute(self, launch: tuple, ctx) -> list[torch.Tensor]:
        try:
            streams = CudaStreams(ctx.a.device)
        except BaseException as exc:  # noqa: BLE001 - no side stream: the ring cannot be issued
            _abort(ctx, "could not get its side stream", exc, None)
        return run_call(ctx, streams)

    def reset(self) -> None:
        """Forget the failure counts (``routes.reset()``: tests, on every rank of a group alike)."""
        with _status_lock:
            _status.clear()


ROUTE = GatherNcclRoute()
