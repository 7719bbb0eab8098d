"""The failure contract of the NCCL all_gather -> GEMMs route (``routes/gather_nccl.py``), on CPU.

The route's own call (``gather_nccl.run_call``) runs here with ``gather_ring.HostStreams`` (every step in order on the
host) instead of CUDA streams: on real gloo ranks (2 and 3) for what the ranks see (one rank's GEMM or preparation
fails: it raises its cause, every other rank ``PeerFailure`` naming it, no rank returns a wrong tensor, the next call
is exact; repeated and simultaneous failures), and in one process with fakes for what gloo cannot show without
hanging a peer (a step or the exchange that cannot be issued aborts the group; captures run no exchange; the order
of the ring steps, the GEMMs, the exchange and the joins). The GPU tests are in ``tests/test_gpu_gather_nccl.py``.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from dist_utils import get_pool

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import errors
from flashoverlap_inductor.routes import gather_nccl, gather_ring
from flashoverlap_inductor.schedule import gather as schedule

K, ROWS, N = 16, 4, 8


def _ctx(a, b, bias, group, gather_dim=0, ret=False, capturing=False):
    world = group.size()
    return types.SimpleNamespace(a=a, b=list(b), bias=list(bias), group=group, gather_dim=gather_dim,
                                 y_shape=schedule.gathered_shape(list(a.shape), gather_dim, world),
                                 return_gathered=ret, capturing=capturing)


def _failing_gemm(at: int, exc_type=RuntimeError):
    """``schedule.shard_gemm`` that raises at its ``at``-th invocation (-1: never) and computes otherwise."""
    real, seen = schedule.shard_gemm, [0]

    def gemm(*args, **kwargs):
        seen[0] += 1
        if seen[0] - 1 == at:
            raise exc_type("injected GEMM failure")
        return real(*args, **kwargs)

    return gemm


# ---------------------------------------------------------------------------------------- gloo ranks (2 and 3)


def _data(seed: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(seed * 10 + rank))
    wgen = torch.Generator().manual_seed(seed)
    b = [torch.randn(K, N, generator=wgen), torch.randn(K, N + 4, generator=wgen)]
    bias = [torch.randn(N, generator=wgen), None]
    parts = [torch.empty_like(a) for _ in range(world)]
    dist.all_gather(parts, a)
    g = torch.cat(parts)
    return a, b, bias, [torch.addmm(bias[0], g, b[0]), g @ b[1]], g


def _one_call(a, b, bias, want, g) -> str:
    """One call of the route on the world group: "ok" (every output exact), "own: ..." (this rank's cause),
    "peer: <ranks named>" (``PeerFailure``), or what was wrong."""
    ctx = _ctx(a, b, bias, dist.group.WORLD, ret=True)
    try:
        got = gather_nccl.run_call(ctx, gather_ring.HostStreams())
    except errors.PeerFailure as exc:
        return "peer: " + ",".join(str(j) for j in range(dist.get_world_size()) if f"rank {j} (" in str(exc))
    except (RuntimeError, KeyboardInterrupt) as exc:
        return f"own: {exc}"
    for y, ref in zip(got, [*want, g], strict=True):
        if not torch.allclose(y, ref, rtol=1e-5, atol=1e-5):
            return "WRONG"
    return "ok"


def calls_worker(fail_ranks: list[list[int]], mode: str) -> list[str]:
    """Calls in a row; call i fails on the ranks ``fail_ranks[i]`` (their GEMM, ``mode`` "first" / "last" /
    "interrupt", or their preparation, "prepare"); then ``raise_pending`` (``routes.check()``'s part)."""
    gather_nccl.ROUTE.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = []
    for i, failing in enumerate(fail_ranks):
        a, b, bias, want, g = _data(i)
        patch = contextlib_nullcontext()
        if rank in failing:
            if mode == "prepare":
                patch = _patched(gather_nccl, "GatherCall", _raises(RuntimeError("injected: no memory for staging")))
            else:
                at = {"first": 0, "last": world * len(b) - 1, "interrupt": 1}[mode]
                exc_type = KeyboardInterrupt if mode == "interrupt" else RuntimeError
                patch = _patched(schedule, "shard_gemm", _failing_gemm(at, exc_type))
        with patch:
            seen.append(_one_call(a, b, bias, want, g))
    try:
        gather_nccl.raise_pending(sync=False)
        seen.append("check: none")
    except errors.PeerFailure as exc:
        seen.append(f"check: {exc}")
    return seen


def ring_worker(mode: str) -> list[str]:
    """The ring alone (``run_streams`` on host streams), rank 1 failing: "gemm" (its first GEMM raises) or "void"
    (it could not prepare: ``VoidRing``). Per shard block of each other rank's first result: exact / nan / WRONG."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b, bias, want, _ = _data(7)
    ctx = _ctx(a, b, bias, dist.group.WORLD)
    if rank == 1 and mode == "void":
        assert gather_ring.run_streams(gather_ring.VoidRing(ctx), gather_ring.HostStreams(), compute=False) is None
        return ["void"]
    call = gather_ring.GatherCall(ctx)
    with _patched(schedule, "shard_gemm", _failing_gemm(0)) if rank == 1 else contextlib_nullcontext():
        failure = gather_ring.run_streams(call, gather_ring.HostStreams())
    if failure is not None:
        return [f"failed: {failure}"]
    y, ref = call.result()[0], want[0]
    out = []
    for j in range(world):
        blk, exp = y[j * ROWS:(j + 1) * ROWS], ref[j * ROWS:(j + 1) * ROWS]
        out.append("nan" if blk.isnan().all() else "exact" if torch.allclose(blk, exp, atol=1e-5) else "WRONG")
    return out


@pytest.fixture(scope="module", params=[2, 3])
def pool(request):
    return get_pool(request.param)


@pytest.mark.parametrize("mode", ["first", "last", "prepare", "interrupt"])
def test_one_rank_failing_reaches_every_rank(pool, mode):
    """Rank 1 fails in the first call: it raises its cause, every other rank ``PeerFailure`` naming rank 1 in that
    call (host streams settle the exchange before the check); the next calls are exact everywhere, and nothing is
    left for ``routes.check()``."""
    results = pool.run(calls_worker, [[1], [], []], mode)
    cause = "injected: no memory" if mode == "prepare" else "injected GEMM failure"
    assert results[1][0].startswith("own: ") and cause in results[1][0], results
    for r, seen in enumerate(results):
        if r != 1:
            assert seen[0] == "peer: 1", (r, results)
        assert seen[1:] == ["ok", "ok", "check: none"], (r, results)


def test_repeated_and_simultaneous_failures(pool):
    """Counts only grow: a rank that fails again is reported again. Ranks 0 and 1 failing in one call: each raises
    its own cause there and reports the other at the end of its next call; a third rank names both at once."""
    results = pool.run(calls_worker, [[1], [], [1], [0, 1], [], []], "first")
    own = "own: injected GEMM failure"
    for r, seen in enumerate(results):
        assert seen[0] == seen[2] == (own if r == 1 else "peer: 1"), (r, results)
        assert seen[1] == seen[5] == "ok" and seen[6] == "check: none", (r, results)
        assert seen[3:5] == ([own, f"peer: {1 - r}"] if r in (0, 1) else ["peer: 0,1", "ok"]), (r, results)


def test_rank_0_reports_rank_1_after_its_own_failure(pool):
    """A rank that failed in the same call as a peer raises its own cause there; the peer's failure, already counted
    in that call's exchange, is raised at its next check (here ``routes.check()``'s part)."""
    results = pool.run(calls_worker, [[0, 1]], "first")
    assert results[0][1].startswith("check: ") and "rank 1 (" in results[0][1], results
    assert results[1][1].startswith("check: ") and "rank 0 (" in results[1][1], results


@pytest.mark.parametrize("mode", ["gemm", "void"])
def test_peers_never_get_wrong_rows(pool, mode):
    """A GEMM failure leaves every peer's result exact; a rank that could not prepare sends NaN shards, so a peer's
    rows of every shard that passed through it are NaN and the others exact, never other data."""
    results = pool.run(ring_worker, mode)
    assert results[1] == (["void"] if mode == "void" else ["failed: injected GEMM failure"]), results
    for r, blocks in enumerate(results):
        if r == 1:
            continue
        assert "WRONG" not in blocks and blocks[r] == "exact", (r, results)
        if mode == "gemm":
            assert blocks == ["exact"] * pool.world_size, (r, results)
        else:
            assert blocks[1] == "nan", (r, results)


def simulated_dispatch_worker(mode: str) -> list[str]:
    """``tests/test_gpu_gather_nccl.failure_worker`` on gloo ranks, through the op and the dispatcher, with the
    route's CUDA parts simulated (the call counts as CUDA, the group as NCCL, the streams are the host's)."""
    import contextlib
    from unittest import mock

    from test_gpu_gather_nccl import failure_worker

    from flashoverlap_inductor import routes

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(routes, "_on_cuda", lambda a: True))
        stack.enter_context(mock.patch.object(routes.streams, "resources",
                                              lambda index: types.SimpleNamespace(name="simulated", index=index)))
        stack.enter_context(mock.patch.object(gather_nccl, "is_nccl_group", lambda group: True))
        stack.enter_context(mock.patch.object(gather_nccl, "CudaStreams", lambda device: gather_ring.HostStreams()))
        routes.reset()
        try:
            return failure_worker(mode)
        finally:
            routes.reset()


@pytest.mark.parametrize("mode", ["first", "last", "prepare"])
def test_the_gpu_failure_worker_on_simulated_cuda(mode):
    """The GPU test's worker, its route simulated on 2 gloo ranks (host streams settle the exchange in the failed
    call, so rank 0 raises ``PeerFailure`` there); what the GPU test asserts holds."""
    results = get_pool(2).run(simulated_dispatch_worker, mode)
    assert results == [["peer", "exact", "exact", "check: none"], ["own", "exact", "exact", "check: none"]], results


# ------------------------------------------------------------------------------------- one process, with fakes


class FakeGroup:
    group_name = "fake"

    def __init__(self, rank: int = 0, world: int = 2) -> None:
        self._rank, self._world = rank, world

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank


class Log:
    """What a fake call did, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []


class FakeStreams(gather_ring.HostStreams):
    def __init__(self, log: Log) -> None:
        self.log, self.side = log, False

    def fork(self) -> None:
        self.log.events.append("fork")

    def on_side(self):
        streams = self

        class Side:
            def __enter__(self):
                streams.side = True

            def __exit__(self, *exc):
                streams.side = False

        return Side()

    def mark(self):
        self.log.events.append("mark")
        return "event"

    def wait(self, ev) -> None:
        self.log.events.append("wait")

    def join(self) -> None:
        self.log.events.append("join")


@pytest.fixture
def fake(monkeypatch):
    """World 2, this rank 0: the peer's shard is ``peer``; the ring, the exchange and the abort are recorded."""
    gather_nccl.ROUTE.reset()
    log = Log()
    state = types.SimpleNamespace(log=log, peer=torch.randn(ROWS, K), peer_count=0, aborted=[], streams=None,
                                  step_error=None, reduce_error=None, group=FakeGroup())
    state.streams = FakeStreams(log)

    def ring_step(group, peers, step, sent, received):
        assert state.streams.side, "a ring step outside the side stream"
        log.events.append(f"step {step}")
        if state.step_error is not None:
            raise state.step_error
        received.copy_(state.peer)
        return []

    def all_reduce(t, op=None, group=None, async_op=False):
        assert state.streams.side, "the exchange outside the side stream"
        log.events.append("exchange")
        if state.reduce_error is not None:
            raise state.reduce_error
        t[1] = max(int(t[1]), state.peer_count)
        return None

    real_gemm = schedule.shard_gemm

    def gemm(*args, **kwargs):
        log.events.append("gemm")
        return real_gemm(*args, **kwargs)

    monkeypatch.setattr(gather_ring, "ring_step", ring_step)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r)
    monkeypatch.setattr(schedule, "shard_gemm", gemm)
    monkeypatch.setattr(compat, "abort_group", lambda group: state.aborted.append(group) or True)
    yield state
    gather_nccl.ROUTE.reset()


def _fake_call(state, capturing=False, a=None):
    a = torch.randn(ROWS, K) if a is None else a
    b, bias = [torch.randn(K, N)], [torch.randn(N)]
    ctx = _ctx(a, b, bias, state.group, capturing=capturing)
    want = torch.addmm(bias[0], torch.cat([a, state.peer]), b[0])
    return ctx, want


def test_order_of_a_call(fake):
    """Every ring step goes out on the side stream before any GEMM; the exchange after every GEMM, on the side
    stream, after the ring's join; the caller's stream joins again after it. The result is exact."""
    ctx, want = _fake_call(fake)
    got = gather_nccl.run_call(ctx, fake.streams)
    torch.testing.assert_close(got[0], want)
    assert fake.log.events == ["fork", "step 1", "mark", "gemm", "wait", "gemm", "join", "exchange", "join"]


def test_a_peer_failure_raises_after_the_call_issued_everything(fake):
    """The exchange brings a peer's count: this rank raises ``PeerFailure`` naming it, once, after its ring and its
    exchange ran; the next call returns its (exact) outputs."""
    fake.peer_count = 1
    ctx, _ = _fake_call(fake)
    with pytest.raises(errors.PeerFailure, match=r"rank 1 \(global rank 1\).*1 failed call\b"):
        gather_nccl.run_call(ctx, fake.streams)
    assert fake.log.events.count("step 1") == 1 and fake.log.events[-2:] == ["exchange", "join"]
    ctx, want = _fake_call(fake)
    torch.testing.assert_close(gather_nccl.run_call(ctx, fake.streams)[0], want)
    fake.peer_count = 3
    with pytest.raises(errors.PeerFailure, match="2 failed calls"):
        gather_nccl.run_call(_fake_call(fake)[0], fake.streams)


def test_own_failure_raised_after_the_exchange(fake):
    """A GEMM that raises: the ring was issued, the exchange still runs (carrying this rank's count 1), then the
    cause is raised; a KeyboardInterrupt stays one. The peer is never reported for this rank's own failure."""
    fake.streams.log.events.clear()
    with _patched(schedule, "shard_gemm", _failing_gemm(0)):
        with pytest.raises(RuntimeError, match="injected GEMM failure"):
            gather_nccl.run_call(_fake_call(fake)[0], fake.streams)
    assert fake.log.events == ["fork", "step 1", "mark", "join", "exchange", "join"]
    st = next(iter(gather_nccl._status.values()))
    assert st.mine == 1 and int(st.counts[0]) == 1 and st.mirror.tolist() == [1, 0]
    with _patched(schedule, "shard_gemm", _failing_gemm(1, KeyboardInterrupt)):
        with pytest.raises(KeyboardInterrupt):
            gather_nccl.run_call(_fake_call(fake)[0], fake.streams)
    assert int(st.counts[0]) == 2 and not fake.aborted
    gather_nccl.raise_pending(sync=False)  # nothing from the peer


def test_prepare_failure_sends_nan_shards(fake, monkeypatch):
    """No memory for the call: the ring goes out from ``VoidRing`` (a NaN shard sent at every step), the exchange
    runs, the cause is raised; nothing is aborted."""
    sent = []
    real_step = gather_ring.ring_step

    def ring_step(group, peers, step, s, received):
        sent.append(s.clone())
        return real_step(group, peers, step, s, received)

    monkeypatch.setattr(gather_ring, "ring_step", ring_step)
    monkeypatch.setattr(gather_nccl, "GatherCall", _raises(RuntimeError("injected: no memory")))
    with pytest.raises(RuntimeError, match="injected: no memory"):
        gather_nccl.run_call(_fake_call(fake)[0], fake.streams)
    assert len(sent) == 1 and sent[0].shape == (ROWS, K) and sent[0].isnan().all()
    assert "exchange" in fake.log.events and "gemm" not in fake.log.events and not fake.aborted


@pytest.mark.parametrize("where", ["step", "exchange", "void"])
def test_what_cannot_be_issued_aborts_the_group(fake, monkeypatch, where):
    """A ring step or the exchange that raised may be half enqueued, and a rank with no memory even for
    ``VoidRing`` has nothing to send: the group is aborted through torch (so no peer waits forever) and a
    ``FlashOverlapError`` names what failed; nothing is issued after."""
    if where == "step":
        fake.step_error = RuntimeError("NCCL error: unhandled system error")
    elif where == "exchange":
        fake.reduce_error = RuntimeError("NCCL error: remote process exited")
    else:
        monkeypatch.setattr(gather_nccl, "GatherCall", _raises(RuntimeError("injected: no memory")))
        monkeypatch.setattr(gather_nccl, "VoidRing", _raises(RuntimeError("injected: no memory at all")))
    ctx, _ = _fake_call(fake)
    with pytest.raises(errors.FlashOverlapError, match="was aborted") as info:
        gather_nccl.run_call(ctx, fake.streams)
    assert len(fake.aborted) == 1 and fake.aborted[0] is ctx.group
    what = {"step": "ring step 1", "exchange": "failure exchange", "void": "prepare its ring steps"}[where]
    assert what in str(info.value)
    if where != "exchange":
        assert "exchange" not in fake.log.events and "gemm" not in fake.log.events


def test_an_interrupt_while_issuing_aborts_and_stays_an_interrupt(fake):
    fake.step_error = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        gather_nccl.run_call(_fake_call(fake)[0], fake.streams)
    assert len(fake.aborted) == 1 and "exchange" not in fake.log.events


def test_a_capture_runs_no_exchange_and_no_check(fake):
    """Inside a capture (the same on every rank) there is no exchange and no host check; the next call outside it
    exchanges again and raises what is new."""
    fake.peer_count = 1
    ctx, _ = _fake_call(fake)
    with pytest.raises(errors.PeerFailure):
        gather_nccl.run_call(ctx, fake.streams)
    fake.peer_count = 2
    fake.log.events.clear()
    ctx, want = _fake_call(fake, capturing=True)
    torch.testing.assert_close(gather_nccl.run_call(ctx, fake.streams)[0], want)
    assert "exchange" not in fake.log.events
    with pytest.raises(errors.PeerFailure, match="1 failed call"):
        gather_nccl.run_call(_fake_call(fake)[0], fake.streams)


def test_routes_check_raises_a_pending_peer_failure(fake):
    """``routes.check()`` raises what the mirror holds and no call reported yet (a rank whose last call returned)."""
    from flashoverlap_inductor import routes

    st = gather_nccl.status_for(FakeGroup(), torch.device("cpu"))
    st.mirror[1] = 1
    with pytest.raises(errors.PeerFailure, match=r"in routes\.check\(\)"):
        routes.check(sync=False)
    routes.check(sync=False)  # reported once


def test_status_is_one_per_group_and_device():
    gather_nccl.ROUTE.reset()
    g1, g2 = FakeGroup(), FakeGroup(1, 3)
    s1 = gather_nccl.status_for(g1, torch.device("cpu"))
    assert gather_nccl.status_for(g1, torch.device("cpu")) is s1
    s2 = gather_nccl.status_for(g2, torch.device("cpu"))
    assert s2 is not s1 and s2.rank == 1 and s2.counts.shape == (3,) and s2.seen == [0, 0, 0]
    gather_nccl.ROUTE.reset()
    assert not gather_nccl._status


# ----------------------------------------------------------------------------------------------------- helpers


def _raises(exc: BaseException):
    def fn(*args, **kwargs):
        raise exc

    return fn


def _patched(obj, name, value):
    from unittest import mock

    return mock.patch.object(obj, name, value)


def contextlib_nullcontext():
    import contextlib

    return contextlib.nullcontext()
