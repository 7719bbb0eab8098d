"""A skipped call recovers (CPU): the bookkeeping of the symmetric-memory routes' resynchronization, with CPU
stand-ins for the device state (``tests/test_gpu_gather.py``, ``test_gpu_peer.py`` and ``test_gpu_ring.py`` run the
real thing on GPUs).

Covered: raising a symmetric route's fault marks its (device, group), an NCCL-route fault does not; a record a peer
wrote into this rank's block (its mirror untouched: the rank skipped the call) raises in ``routes.check()``, not
before; the store barrier lets every rank pass or none (a rank that gives up withdraws; one the last rank counted
passes); ``symmetric.resync`` zeroes every route's flag page and epochs in place on every rank, rewrites the fault
block, clears the mark, and raises ``RankMismatch`` on every rank when they resynchronized at different calls, and
refuses inside a CUDA-graph capture; the dispatcher resynchronizes a marked group before anything else of the call
(capture flag passed on), and the compiled wrapper before a run.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
import torch.distributed as dist

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import backend, config, errors, routes
from flashoverlap_inductor.routes import gather_peer, symmetric
from flashoverlap_inductor.runtime import faults, streams

PAGE, OFFSET = 256, 128  # a stand-in flag page and its fault block's offset (bytes)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    saved = dict(faults._domains), set(faults._resync), dict(symmetric._resyncs)
    faults._domains.clear()
    faults._resync.clear()
    yield
    for live, old in zip((faults._domains, faults._resync, symmetric._resyncs), saved, strict=True):
        live.clear()
        live.update(old)


def _domain(route: str, group: str, device: int = 0, resync: bool = True, rank: int = 0,
            page: torch.Tensor | None = None) -> faults.FaultDomain:
    """A CPU fault domain (its block inside ``page`` when given), registered like the routes' are."""
    block = torch.zeros(faults.BLOCK_BYTES, dtype=torch.uint8) if page is None else page[OFFSET:OFFSET + 128]
    dom = faults.FaultDomain(device, route, group, block, torch.zeros(faults.MIRROR_INTS, dtype=torch.int32),
                             resync=resync)
    dom.rank = rank
    block.view(torch.int32)[7] = rank
    faults._domains[(route, device, group)] = dom
    return dom


def _record(dom: faults.FaultDomain, code: int, mirror: bool) -> None:
    """A timed-out wait's record: in the block; in the mirror too when this rank's own call copied it there."""
    rec = torch.tensor([code, 3005, 1, 2, 1, 7, 0, dom.rank], dtype=torch.int32)
    dom.block.view(torch.int32)[:8] = rec
    if mirror:
        dom.mirror.copy_(rec)


def test_raising_a_symmetric_fault_marks_its_group():
    dom = _domain("gather_peer", "g")
    _record(dom, 1, mirror=True)
    with pytest.raises(errors.FlashOverlapTimeout, match="next call first resynchronizes"):
        faults.raise_pending(0)
    assert faults.resync_due(0, "g") and faults.marked() == [(0, "g")]
    assert not faults.resync_due(1, "g") and not faults.resync_due(0, "h")
    assert int(dom.block.view(torch.int32)[0]) == 0 and int(dom.mirror[0]) == 0  # cleared
    faults.resynced(0, "g")
    assert not faults.resync_due(0, "g")


def test_a_shared_protocol_fault_names_every_route_on_it():
    """The copy-engine protocol's flag page serves the all_gather, both pull routes and the MoE peer transfers: a
    timeout names them all and its wait without naming one collective (a pull route's all_reduce once read
    "(all_gather)")."""
    dom = _domain("gather_peer", "g")
    dom.label = gather_peer.FAULT_LABEL
    _record(dom, 1, mirror=True)
    with pytest.raises(errors.FlashOverlapTimeout) as info:
        faults.raise_pending(0)
    text = str(info.value)
    assert "gather_peer / scatter_pull / reduce_pull / moe_peer route" in text and "rank 5's rows of this call" in text
    assert "all_gather" not in text
    faults.forget("gather_peer")  # the route's reset still finds its domain by the route's name
    assert ("gather_peer", 0, "g") not in faults._domains


def test_an_nccl_route_fault_marks_nothing():
    dom = _domain("nccl", "(caller stream slot 0)", resync=False)
    _record(dom, 3, mirror=True)
    with pytest.raises(errors.FlashOverlapTimeout, match="runs normally"):
        faults.raise_pending()
    assert faults.marked() == []


def test_reset_forgets_the_marks():
    faults._resync.add((0, "g"))
    faults.forget("peer")  # one route's reset: the marks stay (they are per group, over every route)
    assert faults.resync_due(0, "g")
    faults.forget()
    assert not faults.resync_due(0, "g")


def test_a_skipper_learns_of_the_fault_in_check():
    """A peer's wait wrote this rank's block; this rank ran nothing since, so its mirror is empty: the per-call
    check (mirrors only) sees nothing, ``routes.check()`` (after its sync) reads the block and raises and marks."""
    dom = _domain("peer", "g", rank=1)
    _record(dom, 2, mirror=False)
    faults.raise_pending(0)  # what the start of a call sees: nothing
    routes.check(sync=False)  # what the compiled wrapper sees: nothing
    assert not faults.marked()
    with pytest.raises(errors.FlashOverlapTimeout, match="a wait of rank 1 timed out"):
        routes.check()
    assert faults.marked() == [(0, "g")]
    routes.check()  # raised once: cleared


def _fake_group(rank: int, world: int, name: str = "g") -> types.SimpleNamespace:
    return types.SimpleNamespace(rank=lambda: rank, size=lambda: world, group_name=name)


def _ranks(world: int, fn, *args) -> list:
    """``fn(rank, *args)`` on ``world`` threads; their results or exceptions, by rank."""
    out: list = [None] * world

    def run(r: int) -> None:
        try:
            out[r] = fn(r, *args)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_barrier_every_rank_passes_or_none():
    store = dist.HashStore()

    def arrive(rank: int, key: str, present: int, timeout_s: float):
        if rank >= present:
            return "absent"
        symmetric.barrier(store, key, 3, timeout_s, "g")
        return "passed"

    assert _ranks(3, arrive, "b0", 3, 5.0) == ["passed"] * 3
    got = _ranks(3, arrive, "b1", 2, 0.3)
    assert all(isinstance(e, errors.FlashOverlapTimeout) and "not all 3 ranks" in str(e) for e in got[:2]), got
    assert store.add("b1", 0) == 0  # both withdrew: a retry starts clean
    assert _ranks(3, arrive, "b1", 3, 5.0) == ["passed"] * 3


def test_barrier_a_rank_the_last_one_counted_passes():
    """A wait that gives up after the last rank arrived (and counted it) passes: no rank fails alone."""
    store = dist.HashStore()

    class Late:  # its first wait gives up just as the last rank arrives
        def __init__(self):
            self.waits = 0

        def __getattr__(self, name):
            return getattr(store, name)

        def wait(self, keys, timeout):
            self.waits += 1
            if self.waits == 1:
                store.add("b", 1)  # the other rank arrives, counts both and sets go
                store.set("b/go", "1")
                raise dist.DistStoreError("Wait timeout")
            return store.wait(keys, timeout)

    late = Late()
    symmetric.barrier(late, "b", 2, 0.1, "g")
    assert late.waits == 2 and store.add("b", 0) == 2


class _FakeRoute(symmetric.SymmetricRoute):
    """A symmetric route whose state is CPU stand-ins: per (device, group) a page holding the fault block, and
    epochs."""

    epoch_field = "epoch"

    def __init__(self, name: str):
        self.name = name
        self.flags: dict = {}

    def state(self):
        return self.flags, {}

    def add(self, index: int, rank: int, group: str = "g") -> types.SimpleNamespace:
        page = torch.full((PAGE,), 7, dtype=torch.uint8)
        f = types.SimpleNamespace(buf=page, epoch=torch.tensor([5, 9], dtype=torch.int32),
                                  fault=_domain(self.name, group, index, rank=rank, page=page))
        _record(f.fault, 2, mirror=True)
        self.flags[(index, group)] = f
        return f


def _resync_ranks(world: int, ids: list[str], monkeypatch, capturing: bool = False):
    """``symmetric.resync`` on ``world`` threads (rank r as device r: the module's state is per (device, group)),
    over one store, each with two fake routes; every rank marked, as raising the fault marks it."""
    store = dist.HashStore()
    monkeypatch.setattr(compat, "group_store", lambda group: store)
    routes_of = []
    for r in range(world):
        mine = [_FakeRoute("peer"), _FakeRoute("ring")]
        for route in mine:
            route.add(r, r)
        routes_of.append(mine)
        faults._resync.add((r, "g"))

    def run(rank: int):
        symmetric.resync(_fake_group(rank, world), rank, routes_of[rank], 0.5, capturing, ids[rank])
        return "ok"

    return _ranks(world, run), routes_of, store


def test_resync_zeroes_every_rank_in_place_and_clears_the_marks(monkeypatch):
    got, routes_of, store = _resync_ranks(3, ["all_gather N=512 K=256 bfloat16"] * 3, monkeypatch)
    assert got == ["ok"] * 3
    for r, mine in enumerate(routes_of):
        for route in mine:
            f = route.flags[(r, "g")]
            ints = f.buf.view(torch.int32)
            assert not f.epoch.any() and int(ints[:OFFSET // 4].abs().sum()) == 0  # flags and epochs: zero
            block = f.fault.block.view(torch.int32)
            assert int(block[0]) == 0 and int(block[7]) == r and int(f.fault.mirror.abs().sum()) == 0
            assert f.buf.data_ptr() == f.fault.block.data_ptr() - OFFSET  # in place: the same memory
        assert not faults.resync_due(r, "g")
        assert symmetric._resyncs[(r, "g")] == 1  # the next resynchronization uses fresh keys


def test_ranks_that_resynchronize_at_different_calls_all_raise(monkeypatch):
    ids = ["all_gather N=512 K=256 bfloat16", "reduce_scatter N=256 K=512 bfloat16"]
    got, _, _ = _resync_ranks(2, ids, monkeypatch)
    for e in got:
        assert isinstance(e, errors.RankMismatch) and "rank 0: all_gather" in str(e) and "rank 1: reduce" in str(e)
    assert faults.marked() == []  # their state is fresh all the same


def test_resync_refuses_inside_a_capture(monkeypatch):
    got, routes_of, _ = _resync_ranks(2, ["x"] * 2, monkeypatch, capturing=True)
    assert all(isinstance(e, errors.FlashOverlapError) and "CUDA-graph capture" in str(e) for e in got), got
    assert faults.marked() == [(0, "g"), (1, "g")]  # still due: the next eager call does it
    assert routes_of[0][0].flags[(0, "g")].epoch.tolist() == [5, 9]  # untouched


def test_a_rank_that_does_not_come_fails_the_others_clearly_and_they_retry(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(compat, "group_store", lambda group: store)
    monkeypatch.setattr(symmetric, "RESYNC_MIN_S", 0.2)
    faults._resync.update({(0, "g"), (1, "g")})
    calls = {0: [], 1: []}

    def run(rank: int, present: tuple[int, ...]):
        if rank not in present:
            return "absent"
        symmetric.resync(_fake_group(rank, 2), rank, [], 0.2, False, "all_reduce N=8 K=8 bfloat16")
        calls[rank].append(1)
        return "ok"

    got = _ranks(2, run, (0,))
    assert isinstance(got[0], errors.FlashOverlapTimeout) and "not all 2 ranks" in str(got[0])
    assert faults.resync_due(0, "g")  # kept: its next call tries again
    assert _ranks(2, run, (0, 1)) == ["ok", "ok"]
    assert faults.marked() == []


class _Stop(Exception):
    pass


def _dispatch_marked(monkeypatch, mark: tuple[int, str], capturing: bool) -> list:
    """One all_gather call through the dispatcher on a simulated CUDA device; ``mark`` set; ``symmetric.resync``
    and the agreement replaced by recorders that stop the call."""
    seen: list = []
    monkeypatch.setattr(routes, "_on_cuda", lambda a: True)
    monkeypatch.setattr(routes, "_capturing", lambda a: capturing)
    monkeypatch.setattr(streams, "resources", lambda index: types.SimpleNamespace(name="sim", index=index))
    monkeypatch.setattr(compat, "group_timeout_ms", lambda group, device_type="cuda": 4000.0)

    def fake_resync(group, index, rts, timeout_s, capt, call_id):
        seen.append(("resync", index, group.group_name, capt, call_id, timeout_s, sorted(r.name for r in rts)))
        raise _Stop

    def fake_items(*a, **k):
        seen.append(("agree",))
        raise _Stop

    monkeypatch.setattr(symmetric, "resync", fake_resync)
    monkeypatch.setattr(routes.agree, "items", fake_items)
    group = _fake_group(0, 2, "tp")
    a, w = torch.randn(4, 8), torch.randn(8, 6)
    routes.reset()
    faults._resync.add(mark)
    try:
        with config.patch(wait_timeout_ms=None):
            with pytest.raises(_Stop):
                routes.dispatch("all_gather", a, [w], [None], group, "auto", "", [8, 6], gather_dim=0)
    finally:
        routes.reset()
    return seen


def test_the_dispatcher_resynchronizes_a_marked_group_first(monkeypatch):
    seen = _dispatch_marked(monkeypatch, (0, "tp"), False)
    assert seen == [("resync", 0, "tp", False, "all_gather N=6 K=8 float32", 4.0, ["gather_peer", "peer", "ring"])]


def test_the_dispatcher_passes_a_capture_on(monkeypatch):
    seen = _dispatch_marked(monkeypatch, (0, "tp"), True)
    assert seen[0][:4] == ("resync", 0, "tp", True)


def test_the_dispatcher_leaves_other_groups_alone(monkeypatch):
    assert _dispatch_marked(monkeypatch, (0, "other"), False) == [("agree",)]


def test_the_compiled_wrapper_resynchronizes_before_a_run(monkeypatch):
    order: list[str] = []
    monkeypatch.setattr(routes, "resync_marked", lambda: order.append("resync"))
    run = backend.checked(lambda x: order.append("run") or x)
    run(1)
    assert order == ["run"]  # nothing marked: a set test only
    faults._resync.add((0, "g"))
    run(1)
    assert order == ["run", "resync", "run"]


def test_resync_marked_resolves_each_marked_group(monkeypatch):
    done: list = []
    monkeypatch.setattr(compat, "resolve_group", lambda name: _fake_group(0, 2, name))
    monkeypatch.setattr(routes, "_resync", lambda group, index, settings, capturing, call_id: done.append(
        (index, group.group_name, capturing, call_id)) or faults.resynced(index, group.group_name))
    faults._resync.update({(1, "b"), (0, "a")})
    routes.resync_marked()
    assert done == [(0, "a", False, "the run of a compiled graph"), (1, "b", False, "the run of a compiled graph")]
    assert faults.marked() == []
