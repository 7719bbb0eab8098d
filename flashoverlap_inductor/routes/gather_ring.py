"""all_gather -> GEMMs as a ring over ``torch.distributed`` point-to-point ops, each arrived shard's rows computed
while the next shard travels. Used by the CPU route (gloo, host waits) and the NCCL route (CUDA, stream waits).

Ring step s (1 .. world-1): send the shard received at step s-1 (at step 1: the local one) to rank + 1 and receive
the shard of rank ``rank - s`` from rank - 1 into ``staging[rank - s]`` ([world, shard_rows, K], the dim-0
all_gather's layout). The GEMMs of shard j write their rows of each result (``schedule.gather.shard_view``): the
local shard first, then in arrival order. Every rank issues the same ring steps whatever happens, so a rank whose
GEMM fails still delivers its shard and the peers' results stay exact (they depend only on the shards).
"""

from __future__ import annotations

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
        nxt, prev = self.peers()
        sent = self.a if step == 1 else self.staging[self.source(step - 1)]
        ops = [dist.P2POp(dist.isend, sent, nxt, self.group, tag=step),
               dist.P2POp(dist.irecv, self.staging[self.source(step)], prev, self.group, tag=step)]
        return [w for w in (dist.batch_isend_irecv(ops) or ()) if w is not None]

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


def run_streams(call: GatherCall) -> None:
    """The ring on CUDA streams, without host waits: every step issued at once from a side stream (step s+1 after
    step s landed: the side stream waits on each step's works), the GEMMs on the caller's stream, each after an
    event of its shard's step; the caller's stream joins the side stream at the end."""
    cur = torch.cuda.current_stream(call.a.device)
    side = _side_stream(call.a.device)
    side.wait_stream(cur)
    events = []
    with torch.cuda.stream(side):
        for step in range(1, call.world):
            for work in call.issue(step):
                work.wait()  # the side stream waits for the step (no host wait with NCCL)
            ev = torch.cuda.Event()
            ev.record(side)
            events.append(ev)
    try:
        call.compute(call.rank)
        for step, ev in enumerate(events, start=1):
            cur.wait_event(ev)
            call.compute(call.source(step))
    finally:  # even after a GEMM error: nothing allocated on cur is reused while a transfer may still write it
        cur.wait_stream(side)


_side: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index or 0
    if index not in _side:
        _side[index] = torch.cuda.Stream(device=device)
    return _side[index]
