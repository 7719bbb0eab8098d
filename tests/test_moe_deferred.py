"""The MoE settle without a host read (``routes/moe_deferred.py``, the experiment ``moe_settle_deferred``) on 2 gloo
ranks, both ops on the whole-block path: the first ``HELD_BEFORE_DEFERRING`` calls settle on the host, the later ones
defer (counted ``moe:deferred``) and stay bit for bit the unfused reference; a failed premise, an index out of
bounds or a GEMM fault on one rank in a deferred call leave every rank's outputs NaN (the failing rank raises its own
fault in that call) and every rank raises ``errors.PoisonedResult`` (the cause chained) at the end of the next call,
or in ``routes.check()``; the call after is exact; without the experiment nothing defers.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from dist_utils import get_pool
from test_moe_fast import _call, _case, _mutate, _reference, _same

from flashoverlap_inductor import config, errors, routes
from flashoverlap_inductor.routes import moe_deferred, moe_fast, moe_plan_lib, moe_settle


def _nan(outs: list[torch.Tensor]) -> bool:
    assert all(t.numel() for t in outs), "the case gives every rank rows (seed 2)"
    return all(bool(t.isnan().all()) for t in outs)


def deferred_worker(op: str, fault: str | None, bad_rank: int, experiments: tuple[str, ...], checked: bool
                    ) -> list[str]:
    """Warm calls, then one call with ``fault`` on ``bad_rank`` (None, "premise", "index", "gemm", "both": premise and
    gemm), then two good
    calls (``checked``: ``routes.check()`` before them): the outcome of each call after the warm ones."""
    torch.use_deterministic_algorithms(True)
    moe_deferred.forget()
    c = _case(op, "grouped2", "moe", 2)  # every rank gets rows in both ops
    want = _reference(op, c)
    rank, log = dist.get_rank(), []
    with config.patch(experiments=set(experiments)):
        for _ in range(moe_deferred.HELD_BEFORE_DEFERRING):
            _same(_call(op, c), want, "warm")
        deferred = routes.stats["moe:deferred"]
        bad = c
        if rank == bad_rank and fault in ("premise", "both"):
            bad = _mutate(c, "twice")
        elif rank == bad_rank and fault == "index":
            bad = dict(c, index=c["index"].clone())
            bad["index"][0] = c["index"].shape[0] + 3
        real, seen = torch._grouped_mm, []

        def flaky(*args, **kwargs):
            seen.append(1)
            if rank == bad_rank and fault in ("gemm", "both") and len(seen) == 2:
                raise RuntimeError("injected GEMM fault")
            return real(*args, **kwargs)

        with mock.patch.object(moe_fast.torch, "_grouped_mm", flaky):
            try:
                got = _call(op, bad)
                log.append("NaN" if _nan(got) else "exact" if all(torch.equal(x, y) for x, y in zip(got, want,
                                                                                                     strict=True))
                           else "other")
            except RuntimeError as exc:
                log.append(f"raised {type(exc).__name__}: {exc}")
        if checked:
            try:
                routes.check()
                log.append("check: ok")
            except errors.PoisonedResult as exc:
                log.append(f"check: PoisonedResult from {type(exc.__cause__).__name__}")
        for _ in range(2):
            try:
                got = _call(op, c)
                log.append("exact" if all(torch.equal(x, y) for x, y in zip(got, want, strict=True)) else "other")
            except errors.PoisonedResult as exc:
                log.append(f"PoisonedResult from {type(exc.__cause__).__name__}")
        log.append(f"deferred {routes.stats['moe:deferred'] - deferred}")
    return log


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_calls_defer_after_the_held_ones_and_stay_exact(pool, op):
    for log in pool.run(deferred_worker, op, None, 0, (moe_deferred.EXPERIMENT,), False):
        assert log == ["exact", "exact", "exact", "deferred 3"], log


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_nothing_defers_without_the_experiment(pool, op):
    for log in pool.run(deferred_worker, op, None, 0, (), False):
        assert log == ["exact", "exact", "exact", "deferred 0"], log


@pytest.mark.parametrize("op", ["combine", "dispatch"])
@pytest.mark.parametrize("fault, cause", [("premise", None), ("index", "IndexError")])
def test_bad_routing_poisons_every_rank_and_the_next_call_raises(pool, op, fault, cause):
    """A failed premise (which a deferred call cannot redo) or an index out of bounds on rank 1: NaN on both ranks,
    ``PoisonedResult`` at the end of the next call on both (the bad index's own ``IndexError`` chained on rank 1,
    ``PeerFailure`` on rank 0), then exact."""
    logs = pool.run(deferred_worker, op, fault, 1, (moe_deferred.EXPERIMENT,), False)
    for rank, log in enumerate(logs):
        why = "NoneType" if cause is None else (cause if rank == 1 else "PeerFailure")
        assert log == ["NaN", f"PoisonedResult from {why}", "exact", "deferred 3"], (rank, log)


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_two_behind_judges_the_call_after_next(pool, op):
    """Under ``moe_judge_two_behind`` a bad call's ``PoisonedResult`` comes at the end of the call after next, on
    every rank (the call between returns exact)."""
    logs = pool.run(deferred_worker, op, "premise", 1, (moe_deferred.EXPERIMENT, moe_deferred.TWO_BEHIND), False)
    for rank, log in enumerate(logs):
        assert log == ["NaN", "exact", "PoisonedResult from NoneType", "deferred 3"], (rank, log)


def test_judged_now_leaves_the_newest_call_under_two_behind():
    one, two = frozenset({moe_deferred.EXPERIMENT}), frozenset({moe_deferred.EXPERIMENT, moe_deferred.TWO_BEHIND})
    assert [moe_deferred.judged_now(n, one) for n in range(3)] == [0, 1, 2]
    assert [moe_deferred.judged_now(n, two) for n in range(3)] == [0, 0, 1]


def test_judged_now_inside_a_graph_run_leaves_all_but_the_excess():
    per = frozenset({moe_deferred.EXPERIMENT, moe_deferred.PER_GRAPH})
    top = moe_deferred.MAX_PENDING
    assert [moe_deferred.judged_now(n, per) for n in (0, 1, 2)] == [0, 1, 2]  # outside a graph run: as before
    with moe_deferred.graph_run():
        assert [moe_deferred.judged_now(n, per) for n in (0, 1, top, top + 3)] == [0, 0, 0, 3]
        assert moe_deferred.judged_now(2, frozenset({moe_deferred.EXPERIMENT})) == 2  # not under the experiment


def per_graph_worker(op: str) -> list[str]:
    """Under ``moe_judge_per_graph``, graph runs as ``backend.checked`` makes them (``moe_deferred.graph_run``): rank
    1's premise fails in run 1's first call; per run, each call's outcome, the calls pending at its end, and how the
    run ended."""
    torch.use_deterministic_algorithms(True)
    moe_deferred.forget()
    c = _case(op, "grouped2", "moe", 2)
    want = _reference(op, c)
    bad = _mutate(c, "twice") if dist.get_rank() == 1 else c
    log = []
    with config.patch(experiments={moe_deferred.EXPERIMENT, moe_deferred.PER_GRAPH}):
        for _ in range(moe_deferred.HELD_BEFORE_DEFERRING):
            _same(_call(op, c), want, "warm")
        for run, cases in enumerate(([bad, c], [c, c], [c]), start=1):
            try:
                with moe_deferred.graph_run():
                    for case in cases:
                        got = _call(op, case)
                        log.append("NaN" if _nan(got) else "exact" if all(
                            torch.equal(x, y) for x, y in zip(got, want, strict=True)) else "other")
                    log.append(f"pending {moe_deferred.pending(dist.group.WORLD)}")
                log.append(f"run {run}: ok")
            except errors.PoisonedResult as exc:
                log.append(f"run {run}: PoisonedResult from {type(exc.__cause__).__name__}")
    return log


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_per_graph_judges_a_run_at_the_end_of_the_next(pool, op):
    """No call inside a graph run waits for an earlier one; the bad call of run 1 is judged at the end of run 2 (its
    calls exact), on both ranks alike; run 3 judges what run 2 left and ends clean."""
    for rank, log in enumerate(pool.run(per_graph_worker, op)):
        assert log == ["NaN", "exact", "pending 2", "run 1: ok",
                       "exact", "exact", "pending 4", "run 2: PoisonedResult from NoneType",
                       "exact", "pending 4", "run 3: ok"], (rank, log)


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_gemm_fault_raises_there_and_poisons_the_peer(pool, op):
    """Rank 1's GEMM raises mid-call: rank 1 raises it in that call; rank 0's outputs are NaN and it raises
    ``PoisonedResult`` (from ``PeerFailure``) at the end of its next call; rank 1 does not raise twice."""
    log0, log1 = pool.run(deferred_worker, op, "gemm", 1, (moe_deferred.EXPERIMENT,), False)
    assert log0 == ["NaN", "PoisonedResult from PeerFailure", "exact", "deferred 3"], log0
    assert log1 == ["raised RuntimeError: injected GEMM fault", "exact", "exact", "deferred 2"], log1


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_rank_that_raised_its_own_fault_does_not_raise_again_for_its_own_data(pool, op):
    """Rank 1's premise fails and its GEMM raises in the same deferred call: rank 1 raises the fault then and not
    again (its own data are its own failure's); rank 0 raises ``PoisonedResult`` (from ``PeerFailure``) once."""
    log0, log1 = pool.run(deferred_worker, op, "both", 1, (moe_deferred.EXPERIMENT,), False)
    assert log0 == ["NaN", "PoisonedResult from PeerFailure", "exact", "deferred 3"], log0
    assert log1 == ["raised RuntimeError: injected GEMM fault", "exact", "exact", "deferred 2"], log1


def test_routes_check_raises_what_no_call_judged_yet(pool):
    for rank, log in enumerate(pool.run(deferred_worker, "combine", "index", 1, (moe_deferred.EXPERIMENT,), True)):
        why = "IndexError" if rank == 1 else "PeerFailure"
        assert log == ["NaN", f"check: PoisonedResult from {why}", "exact", "exact", "deferred 3"], (rank, log)


def warm_fault_worker(op: str) -> list[int]:
    """A GEMM fault on rank 1 in a host-settled call before the group qualifies: both ranks start the count again
    there (the failing one included), so both defer from the same later call: per call after it, ``moe:deferred``."""
    torch.use_deterministic_algorithms(True)
    moe_deferred.forget()
    c = _case(op, "grouped2", "moe", 2)
    real, seen = torch._grouped_mm, []

    def flaky(*args, **kwargs):
        seen.append(1)
        if dist.get_rank() == 1 and len(seen) == 1:
            raise RuntimeError("injected GEMM fault")
        return real(*args, **kwargs)

    counts = []
    with config.patch(experiments={moe_deferred.EXPERIMENT}):
        for _ in range(moe_deferred.HELD_BEFORE_DEFERRING - 1):
            _call(op, c)
        with mock.patch.object(moe_fast.torch, "_grouped_mm", flaky), pytest.raises(RuntimeError):
            _call(op, c)
        start = routes.stats["moe:deferred"]
        for _ in range(moe_deferred.HELD_BEFORE_DEFERRING + 2):
            _same(_call(op, c), _reference(op, c), "after the fault")
            counts.append(routes.stats["moe:deferred"] - start)
    return counts


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_fault_before_the_group_qualifies_restarts_the_count_on_every_rank(pool, op):
    c0, c1 = pool.run(warm_fault_worker, op)
    assert c0 == c1 == [0, 0, 0, 0, 1, 2], (c0, c1)


class RankZeroOfTwo:
    """A stand-in group for judging settle vectors on the host: rank 0 of 2, named ``name``."""

    def __init__(self, name: str) -> None:
        self.group_name = name

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


GOOD = [0, 5, 4, 0, 0, 0, 5, 0]  # a settle vector of a good whole-block call: 5 rows, index 0..4, offsets end at 5
UNSENT = [moe_settle.UNSENT] * moe_settle.SETTLE_LEN  # a slot the exchange never wrote


def test_a_status_that_never_arrived_raises_on_every_rank():
    """The settle's gathered vectors start as ``UNSENT`` (``moe_settle``): an exchange that never ran (its group
    aborted by the NCCL watchdog) is judged a peer's failure, never a good call."""
    with pytest.raises(errors.PeerFailure, match="never arrived"):
        moe_settle.judge([GOOD, UNSENT], "a call", RankZeroOfTwo("g"))
    assert moe_settle.judge([GOOD, GOOD], "a call", RankZeroOfTwo("g")) is False


def test_a_deferred_call_whose_own_status_never_arrived_raises():
    """``moe_deferred._judge``: this rank's slot left ``UNSENT`` is not its own raised failure (``FAIL > 0``): the
    call is judged, and raises, even where the peers' slots look good."""
    p = moe_deferred.Pending(None, None, "a call", RankZeroOfTwo("g2"))
    with pytest.raises(errors.PoisonedResult):
        moe_deferred._judge([UNSENT, GOOD], p, True)
    moe_deferred._judge([[1, *GOOD[1:]], GOOD], p, True)  # its own failure, raised in its call: not again


def test_a_query_never_judges_a_call_over_peer_transfers():
    """``raise_pending(sync=False)`` (``routes.check(sync=False)``: what this host saw so far) leaves a call over peer
    transfers (``Pending.fault``) pending, whatever its status: its judgement may raise the peer fault and teach the
    rows bound, which every rank must do at one call; a judgement that waits takes it."""
    g = RankZeroOfTwo("g4")
    moe_deferred._pending["g4"] = [moe_deferred.Pending(torch.tensor(GOOD * 2), None, "a call", g, fault=object())]
    try:
        moe_deferred.raise_pending(g, sync=False)
        assert moe_deferred.pending(g) == 1
        moe_deferred.raise_pending(g, sync=True)
        assert moe_deferred.pending(g) == 0
    finally:
        moe_deferred._pending.pop("g4", None)


def test_only_a_judgement_every_rank_shares_teaches_the_peer_transfers_rows_bound():
    """A deferred call's ``ROWS`` raise the group's rows bound (the peer transfers' slots grow collectively at the
    next call) only where the judgement waited for the call, as every rank does at the same call; a judgement that
    only queried (``routes.check(sync=False)``: what this host saw so far) leaves it."""
    g = RankZeroOfTwo("g3")
    moe_settle.raise_rows_bound(g, 1)
    p, big = moe_deferred.Pending(None, None, "a call", g), [0, 9, 8, 0, 0, 0, 9, 0]
    try:
        moe_deferred._judge([GOOD, big], p, False)
        assert moe_settle.rows_bound(g) == 1
        moe_deferred._judge([GOOD, big], p, True)
        assert moe_settle.rows_bound(g) == 9
    finally:
        moe_settle.forget()


def test_wrapped_runs_outlive_the_first_run_hook():
    """``compat.wrap_runs`` then ``compat.run_first`` (as the backend calls them): the first run has both, every later
    run still runs inside the wrapper."""
    from flashoverlap_inductor import _inductor_compat as compat

    seen = []
    compiled = type("Graph", (), {})()
    compiled.current_callable = lambda inputs: seen.append(("run", getattr(moe_deferred._run, "depth", 0)))
    assert compat.wrap_runs(compiled, moe_deferred.graph_run)
    assert compat.run_first(compiled, lambda inputs: seen.append(("first", 0)))
    for _ in range(3):
        compiled.current_callable([])
    assert seen == [("first", 0), ("run", 1), ("run", 1), ("run", 1)] and moe_deferred._run.depth == 0
    assert not compat.wrap_runs(object(), moe_deferred.graph_run)


def compiled_moe_worker() -> dict:
    """tiny-moe (one layer, 2 experts per rank) under the ``ep`` plan, compiled by the flashoverlap backend with the
    MoE ops fused and judged per graph: 6 training steps; the graph runs counted, the deferred calls, the calls
    pending at the end, and the losses against the same steps under Inductor."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from flashoverlap_inductor.bench import models, plans
    from flashoverlap_inductor.bench.runner import TrainLoss, flashoverlap_backend

    moe_deferred.forget()
    spec = models.PRESETS["tiny-moe"].with_overrides(layers=1)
    base = plans.apply(models.build(spec, torch.device("cpu"), torch.float32, 0, 16), spec, "ep",
                       init_device_mesh("cpu", (2,)))
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, spec.vocab, (1, 16), generator=gen),) * 2 for _ in range(6)]
    out = {}
    for name in ("inductor", "flashoverlap"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        options = {"flashoverlap.fuse": "always", "flashoverlap.experiments": frozenset(
            {moe_deferred.EXPERIMENT, moe_deferred.PER_GRAPH})} if name == "flashoverlap" else {}
        fn = torch.compile(TrainLoss(model), backend=flashoverlap_backend() if options else "inductor",
                           options=options or None, dynamic=False)
        before = dict(routes.stats)
        losses = []
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            for ids, tgt in data:
                loss = fn(ids, tgt)
                loss.backward()
                losses.append(loss.item())
        out[name] = losses
        out[f"{name}:runs"] = routes.stats["moe:graph_run"] - before.get("moe:graph_run", 0)
        out[f"{name}:deferred"] = routes.stats["moe:deferred"] - before.get("moe:deferred", 0)
    out["pending"] = moe_deferred.pending(dist.group.WORLD)
    routes.check()
    return out


def test_a_compiled_moe_model_runs_its_forward_and_backward_as_graph_runs(pool):
    """Every run of a compiled graph with fused MoE ops, the backward that autograd calls included, is a graph run
    (2 per training step), and the losses are Inductor's. (This fp32 per-expert-loop model takes the general path,
    which never defers: the judgement points are ``per_graph_worker``'s.)"""
    for res in pool.run(compiled_moe_worker):
        assert res["inductor:runs"] == 0 and res["flashoverlap:runs"] == 12, res
        assert res["flashoverlap:deferred"] == 0 and res["pending"] == 0, res
        torch.testing.assert_close(res["flashoverlap"], res["inductor"], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned mirrors)")
def test_a_judged_calls_pinned_mirror_and_event_serve_a_later_call(monkeypatch):
    """A deferred call's status goes to the host through a pinned mirror and an event (``moe_deferred._mirror``; the
    caller fills the one and records the other); once judged (``raise_pending``), both are kept for a later call of
    the same size, which reads its own values."""
    monkeypatch.setattr(moe_deferred, "_free_mirrors", {})
    every = torch.arange(16, dtype=torch.int64, device="cuda")
    host, done = moe_deferred._mirror(every)
    host.copy_(every, non_blocking=True)
    done.record()
    done.synchronize()
    assert host.is_pinned() and host.tolist() == list(range(16))
    moe_deferred._recycle(moe_deferred.Pending(host, done, "a call", None, every.device.index))
    again, done_again = moe_deferred._mirror(every + 100)
    assert again is host and done_again is done
    again.copy_(every + 100, non_blocking=True)
    done_again.record()
    done_again.synchronize()
    assert again.tolist() == list(range(100, 116))
    other, _ = moe_deferred._mirror(torch.zeros(8, dtype=torch.int64, device="cuda"))  # another size: a new one
    assert other is not host


class OneRank(RankZeroOfTwo):
    """A stand-in group of one rank (no status exchange), named ``name``."""

    def size(self) -> int:
        return 1


def _vectors(world: int, bad_rank: int | None, rows: int = 40) -> torch.Tensor:
    """``world`` settle vectors of a good call of ``rows`` rows, rank ``bad_rank``'s with unnamed rows."""
    good = [0] * moe_settle.SETTLE_LEN
    good[moe_settle.ROWS], good[moe_settle.IDX_MAX], good[moe_settle.OFFS_LAST] = rows, rows - 1, rows
    every = torch.tensor([good] * world, dtype=torch.int64)
    if bad_rank is not None:
        every[bad_rank, moe_settle.UNNAMED] = 3
    return every.reshape(-1).cuda()


@pytest.mark.skipif(not torch.cuda.is_available() or not moe_plan_lib.library_on(0),
                    reason="needs a CUDA device and the built library")
@pytest.mark.parametrize("bad_rank", [None, 0, 1])
def test_the_poison_kernel_mirrors_the_vectors_to_the_host_good_or_bad(bad_rank):
    every = _vectors(2, bad_rank)
    outs = [torch.ones(5, 7, device="cuda", dtype=torch.bfloat16), torch.ones(300, device="cuda")]
    mirror = torch.full((every.numel(),), -7, dtype=torch.int64, pin_memory=True)
    assert moe_deferred.poison_if_bad(outs, every, 2, mirror)
    torch.cuda.synchronize()
    assert mirror.tolist() == every.tolist()
    assert all(bool(o.isnan().all()) == (bad_rank is not None) for o in outs)
    assert all(bool((o == 1).all()) for o in outs) or bad_rank is not None


@pytest.mark.skipif(not torch.cuda.is_available() or not moe_plan_lib.library_on(0),
                    reason="needs a CUDA device and the built library")
def test_a_deferred_calls_status_reaches_the_host_through_the_kernels_mirror(monkeypatch):
    """``settle_later`` on one rank: a good call judged silently, a bad one poisoned on the device and raised a call
    later from the status the poison kernel wrote to the pinned mirror (no copy issued)."""
    monkeypatch.setattr(moe_deferred, "_free_mirrors", {})
    group = OneRank("one-rank-mirror")
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: copies.append(1) or real_copy(self, *a, **k))
    good, bad_out = torch.ones(4, 8, device="cuda"), torch.ones(4, 8, device="cuda")
    moe_deferred.settle_later(None, _vectors(1, None), [good], "a good call", good.device, group)
    moe_deferred.raise_pending(group, sync=True)
    moe_deferred.settle_later(None, _vectors(1, 0), [bad_out], "a bad call", bad_out.device, group)
    with pytest.raises(errors.PoisonedResult, match="a bad call"):
        moe_deferred.raise_pending(group, sync=True)
    assert not copies and bool((good == 1).all()) and bool(bad_out.isnan().all())
    assert moe_deferred.pending(group) == 0


def test_a_poison_that_raises_leaves_the_status_pending_and_the_own_failure_first(monkeypatch):
    """``settle_later`` whose poison raises: the call's status is still pending (judged a call later like any other);
    a rank whose own call failed raises its own failure, one that did not the poison's error."""
    group = OneRank("one-rank-poison-raises")

    def broken(*args, **kwargs):
        raise RuntimeError("the poison broke")

    monkeypatch.setattr(moe_deferred, "poison_if_bad", broken)
    with pytest.raises(ValueError, match="own failure"):
        moe_deferred.settle_later(ValueError("own failure"), None, [torch.ones(3)], "a call", torch.device("cpu"),
                                  group)
    assert moe_deferred.pending(group) == 1
    with pytest.raises(RuntimeError, match="the poison broke"):
        moe_deferred.settle_later(None, None, [torch.ones(3)], "a call", torch.device("cpu"), group)
    assert moe_deferred.pending(group) == 2
    moe_deferred.forget()
