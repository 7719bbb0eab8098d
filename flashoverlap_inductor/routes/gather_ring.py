"""all_gather -> GEMMs as a ring over ``torch.distributed`` point-to-point ops, each arrived shard's rows computed
while the next shard travels. Used by the CPU route (gloo, host waits) and the NCCL route (CUDA, stream waits).

Ring step s (1 .. world-1): send the shard received at step s-1 (at step 1: the local one) to rank + 1 and receive
the shard of rank ``rank - s`` from rank - 1 into ``staging[rank - s]`` ([world, shard_rows, K], the dim-0
all_gather's layout). The GEMMs of shard j write their rows of each result (``schedule.gather.shard_view``): the
local shard first, then in arrival order. Every rank issues the same ring steps whatever happens, so a rank whose
GEMM fails still delivers its shard and the peers' results stay exact (they depend only on the shards); a rank that
could not even prepare its call (``GatherCall`` raised: no memory for ``staging``) issues them from ``VoidRing``,
which sends NaN shards, so that a peer's rows of a lost shard are NaN, never other data.

``run_streams`` takes its streams from a ``CudaStreams`` (the NCCL route) or a ``HostStreams`` (every step in order
on the host: the CPU tests of the NCCL route's failure contract, ``tests/test_gather_nccl_contract.py``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..schedule import gather as schedule


class GatherCall:
    """One call's buffers: the shard ``a`` as [shard_rows, K], ``staging``, the results ``outs`` ([rows, N_i])."""

    def __init__(self, ctx) -> None:
        a, group = ctx.a, ctx.group
        self.group, self.world, self.rank = group, group.size(), group.rank()
        self.geo = schedule.geometry(list(a.shape), ctx.gather_dim, self.world)
        self.a = a.reshape(self.geo.shard_rows, self.geo.k).contiguous()
        self.b, self.bias = list(ctx.b), [None if c is None else c.reshape(-1) for c in ctx.bias]
        self.staging = a.new_empty(self.world, self.geo.shard_rows, self.geo.k)
        self.outs = [a.new_empty(self.geo.rows, w.shape[-1]) for w in self.b]
        self.shape, self.return_gathered = list(ctx.y_shape), ctx.return_gathered

    def peers(self) -> tuple[int, int]:
        """Global ranks of the next and the previous rank of the ring."""
        g, r, w = self.group, self.rank, self.world
        return dist.get_global_rank(g, (r + 1) % w), dist.get_global_rank(g, (r - 1) % w)

    def source(self, step: int) -> int:
        """The shard received at ring step ``step``."""
        return (self.rank - step) % self.world

    def issue(self, step: int) -> list:
        """Ring step ``step``'s send and receive (async works)."""
        sent = self.a if step == 1 else self.staging[self.source(step - 1)]
        return ring_step(self.group, self.peers(), step, sent, self.staging[self.source(step)])

    def compute(self, j: int) -> None:
        """Every GEMM's rows of shard j."""
        x = self.a if j == self.rank else self.staging[j]
        for w, c, out in zip(self.b, self.bias, self.outs, strict=True):
            schedule.shard_gemm(x, w, c, schedule.shard_view(out, self.geo, j))

    def result(self) -> list[torch.Tensor]:
        if not self.return_gathered:
            return self.outs
        self.staging[self.rank].copy_(self.a)
        return [*self.outs, schedule.assemble(self.staging, self.geo, self.shape)]


def run_host(call: GatherCall) -> BaseException | None:
    """The ring with host waits (gloo): step s+1 is issued once step s landed, then shard s computed. Returns the
    first failure (after every step was issued and waited for), None when all went well."""
    failure: BaseException | None = None
    pending: list = []

    def guarded(fn, *args) -> None:
        nonlocal failure
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - settled by the caller, after every ring step ran
            failure = failure or exc

    def wait(works: list) -> None:
        for work in works:
            work.wait()

    if call.world > 1:
        try:
            pending = call.issue(1)
        except BaseException as exc:  # noqa: BLE001 - as above
            failure = exc
    if failure is None:
        guarded(call.compute, call.rank)
    for step in range(1, call.world):
        guarded(wait, pending)
        pending = []
        if step + 1 < call.world:
            try:
                pending = call.issue(step + 1)
            except BaseException as exc:  # noqa: BLE001 - as above
                failure = failure or exc
        if failure is None:
            guarded(call.compute, call.source(step))
    return failure


def ring_step(group, peers: tuple[int, int], step: int, sent: torch.Tensor, received: torch.Tensor) -> list:
    """One ring step: send ``sent`` to ``peers[0]`` and receive ``received`` from ``peers[1]`` (async works)."""
    nxt, prev = peers
    ops = [dist.P2POp(dist.isend, sent, nxt, group, tag=step), dist.P2POp(dist.irecv, received, prev, group, tag=step)]
    return [w for w in (dist.batch_isend_irecv(ops) or ()) if w is not None]


class VoidRing:
    """The ring steps of a rank whose ``GatherCall`` could not be made: every step sends a NaN shard (zeros for a
    dtype without NaN) and receives into a scratch shard, so the peers' steps complete and their rows of every shard
    that passed through this rank are NaN. Two shards of memory instead of the call's ``staging`` and outputs."""

    def __init__(self, ctx) -> None:
        self.group, self.world, self.rank = ctx.group, ctx.group.size(), ctx.group.rank()
        geo = schedule.geometry(list(ctx.a.shape), ctx.gather_dim, self.world)
        self.a = ctx.a  # its device, for the streams
        buf = ctx.a.new_empty(2, geo.shard_rows, geo.k)
        buf[0].fill_(float("nan") if buf.is_floating_point() or buf.is_complex() else 0)
        self.sent, self.scratch = buf[0], buf[1]

    peers = GatherCall.peers

    def issue(self, step: int) -> list:
        return ring_step(self.group, self.peers(), step, self.sent, self.scratch)


class StepIssueError(RuntimeError):
    """Issuing ring step ``step`` (or making the side stream wait for it) raised ``cause``: the step may be half
    enqueued, so the ring cannot be completed; the NCCL route aborts the group (``gather_nccl``)."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(f"ring step {step} could not be issued: {cause!r}")
        self.step, self.cause = step, cause


class CudaStreams:
    """The NCCL route's streams: the caller's (``cur``: the GEMMs) and the device's side stream (the ring steps)."""

    def __init__(self, device: torch.device) -> None:
        self.cur = torch.cuda.current_stream(device)
        self.side = _side_stream(device)

    def fork(self) -> None:
        self.side.wait_stream(self.cur)

    def on_side(self):
        return torch.cuda.stream(self.side)

    def mark(self) -> torch.cuda.Event:
        """An event of the side stream's work so far."""
        ev = torch.cuda.Event()
        ev.record(self.side)
        return ev

    def wait(self, ev) -> None:
        self.cur.wait_event(ev)

    def join(self) -> None:
        self.cur.wait_stream(self.side)


class HostStreams:
    """Every step in order on the host (gloo works are waited on the host): no stream to fork, mark or join."""

    def fork(self) -> None:
        pass

    def on_side(self):
        return contextlib.nullcontext()

    def mark(self) -> None:
        return None

    def wait(self, ev) -> None:
        pass

    def join(self) -> None:
        pass


def run_streams(call, streams=None, compute: bool = True) -> BaseException | None:
    """The ring on CUDA streams, without host waits: every step issued at once from a side stream (step s+1 after
    step s landed: the side stream waits on each step's works), the GEMMs (``compute``; ``call`` a ``GatherCall``)
    on the caller's stream, each after an event of its shard's step; the caller's stream joins the side stream at
    the end, whatever happened. ``streams``: ``CudaStreams`` of ``call.a``'s device by default.

    Returns the first failure of the GEMMs or of the events (every ring step was issued), None when all went well;
    raises ``StepIssueError`` when issuing a step, or waiting for its works, raised (the later steps are not
    issued: the caller aborts the group)."""
    streams = CudaStreams(call.a.device) if streams is None else streams
    failure: BaseException | None = None
    events: list = []
    streams.fork()
    try:
        with streams.on_side():
            for step in range(1, call.world):
                try:
                    for work in call.issue(step):
                        work.wait()  # the side stream waits for the step (no host wait with NCCL)
                except BaseException as exc:  # noqa: BLE001 - the step may be half enqueued: the caller aborts
                    raise StepIssueError(step, exc) from exc
                try:
                    events.append(streams.mark())
                except BaseException as exc:  # noqa: BLE001 - the step is issued: issue the others, compute none
                    failure = failure or exc
        if compute and failure is None:
            call.compute(call.rank)
            for step, ev in enumerate(events, start=1):
                streams.wait(ev)
                call.compute(call.source(step))
    except StepIssueError:
        raise
    except BaseException as exc:  # noqa: BLE001 - settled by the caller (the route's failure exchange)
        failure = failure or exc
    finally:  # even after a failure: nothing allocated on cur is reused while a transfer may still write it
        streams.join()
    return failure


_side: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index or 0
    if index not in _side:
        _side[index] = torch.cuda.Stream(device=device)
    return _side[index]
