"""The MoE ops' peer transfers (experiment ``moe_peer``, ``routes/moe_peer.py``: every all_to_all block pushed by copy
engine into its destination's symmetric receive slot) with 2 and 3 ranks sharing one GPU: a gloo group, torch's
symmetric memory under ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``. Ranks time-slice the GPU, so these check the
transfers, the slots and the failure contract, not speed.

Skipped unless CUDA, an sm90 GPU and a library with ``fo_gather_call`` are present. The cases are
``tests/test_gpu_moe.py``'s (its workers, run here under ``{"moe_p2p_cuda", "moe_peer"}``): both ops in bf16 on random
uneven splits with empty pairs, the loop and grouped forms (one and two terms), the MoE permutation and a random one,
plans ``blocks`` (the whole-block path: the combine's library call writes each block straight into its destination's
slot, under ``moe_peer_push`` its blocks are pushed as their events fire; the dispatch reads each peer block in its
slot), ``blocks:c=2`` (the general path) and
``experts`` (the dispatch cut by expert), against an fp64 oracle and the unfused reference, outputs
pre-poisoned; every call must count ``moe:moe_peer`` (so no check passes on NCCL's or gloo's transfers, which cannot
move CUDA rows of a gloo group anyway). Also: a block past its slot (routing data that grew) is spilled by a direct
exchange, exact, nothing redone, and the next call of that size fits; a GEMM fault on one rank raises on every rank
and the next call is exact; a rank that comes late past the wait bound makes every rank raise
``FlashOverlapTimeout`` with poisoned outputs, and the next calls (resynchronized first) are exact with no reset.
Under the deferred settle (``moe_settle_deferred``): the same three (the fault a call later as ``PoisonedResult``,
also judged per graph run; the late rank's call NaN, the next raising on every rank), and the e2e harness's
expert-parallel MoE block compiled over peer transfers against eager, under either settle (2 ranks).
"""

from __future__ import annotations

import time

import pytest
import test_gpu_moe as tg
import torch
from dist_utils import DistPool, gather_library_ready, gpu0_setup

PEER = {"moe_p2p_cuda", "moe_peer"}
SHORT_MS = 1500.0  # the late-rank case's bound
STALL_S = 4.0  # how late the late rank comes (> SHORT_MS)

pytestmark = pytest.mark.skipif(not gather_library_ready(), reason="needs a CUDA sm90 GPU and the built library")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def pool(request):
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    p = DistPool(request.param, env, timeout_s=400.0, backend="gloo", setup=gpu0_setup)
    yield p
    p.close()


def _peer_calls() -> int:
    from flashoverlap_inductor import routes

    return routes.stats["moe:moe_peer"]


def ops_worker(forms: list[str], kinds: list[str], plans: list[str], seeds: list[int], push: bool = False
               ) -> tuple[list[str], int]:
    """``test_gpu_moe.ops_worker`` under the peer transfers (``push``: with ``moe_peer_push``); every call counted
    ``moe:moe_peer``. Returns what went wrong and how many combines wrote their blocks straight into the slots."""
    from flashoverlap_inductor import routes

    tg.EXPERIMENTS = PEER | ({"moe_peer_push"} if push else set())
    before, direct, in_slots = _peer_calls(), routes.stats["moe_peer:direct"], routes.stats["moe_peer:in_slots"]
    bad = tg.ops_worker(forms, kinds, plans, seeds)
    calls = 2 * len(forms) * len(kinds) * len(plans) * len(seeds)
    if _peer_calls() - before != calls:
        bad.append(f"{_peer_calls() - before} calls took the peer transfers, not {calls}")
    if "blocks" in plans and forms != ["loop"] and routes.stats["moe_peer:in_slots"] == in_slots:
        bad.append("no whole-block dispatch read its peer blocks in their slots")
    return bad, routes.stats["moe_peer:direct"] - direct


def _scaled_case(op: str, scale: int, seed: int, dev: torch.device) -> tuple[dict, object]:
    """``op``'s grouped MoE case with ``scale`` times ``tg.SCALE`` rows, and its fp64 reference (the dispatch's p
    and y side by side)."""
    import torch.distributed as dist

    saved, g = tg.SCALE, dist.group.WORLD
    tg.SCALE = scale * saved
    try:
        c = tg.combine_case("grouped", "moe", seed, dev) if op == "combine" else tg.dispatch_case("grouped", "moe",
                                                                                                  seed, dev)
    finally:
        tg.SCALE = saved
    return c, tg.combine_fp64(c, g) if op == "combine" else torch.cat(tg.dispatch_fp64(c, g), dim=1)


def _call(op: str, c: dict, key: str | None = None) -> torch.Tensor:
    """One ``blocks`` call of ``op`` (under the settings of ``key``, else ``tg.EXPERIMENTS``'s); the dispatch's p
    and y side by side."""
    import torch.distributed as dist

    from flashoverlap_inductor import config

    key = key or config.current().replace(experiments=tg.EXPERIMENTS).key()
    return tg.call_op(op, c, dist.group.WORLD, key)


SPILL_KEYS = ("moe_peer:spill", "moe:moe_peer", "dispatch:redo", "combine:redo")


def overflow_worker() -> tuple[list[str], dict[str, int]]:
    """Calls whose blocks outgrow the slots the group learned (each op in turn, with 64x and then 512x the rows,
    past the slots' least capacity and power-of-two rounding): the blocks past their slots are spilled (one direct
    exchange per rank; ``moe_peer:spill``), nothing is redone, exact; the same call again fits (the host settle
    taught the group the rows, so the slots grew at that call, alike on every rank), exact. Returns what went wrong
    and this rank's spills per round."""
    from flashoverlap_inductor import routes

    tg.EXPERIMENTS = PEER
    dev, bad, spills = torch.device("cuda", torch.cuda.current_device()), [], {}
    for op in ("combine", "dispatch"):  # the group's bound: these calls' rows
        _call(op, _scaled_case(op, 1, 3, dev)[0])
    for op, scale in (("dispatch", 64), ("combine", 512)):
        c, want = _scaled_case(op, scale, 3, dev)
        for round_ in ("outgrown", "grown"):
            before = {k: routes.stats[k] for k in SPILL_KEYS}
            tg._poison_allocator(dev)
            got = _call(op, c)
            torch.cuda.synchronize()
            grew = {k: routes.stats[k] - v for k, v in before.items()}
            spills[f"{op} {round_}"] = grew["moe_peer:spill"]  # on the ranks of an outgrown pair
            if grew[f"{op}:redo"] or grew["moe:moe_peer"] != 1:
                bad.append(f"{op} {round_}: counters grew by {grew}")
            if tg._err(got, want) > tg.TOL:
                bad.append(f"{op} {round_}: wrong, rel err {tg._err(got, want):.3g}")
    return bad, spills


def deferred_worker(op: str) -> tuple[list[str], int]:
    """``test_gpu_moe.deferred_worker`` under the peer transfers (the group's exchange through the host: gloo):
    deferred calls exact, rank 1's GEMM fault raised by rank 1 in the call, NaN outputs elsewhere and
    ``PoisonedResult`` a call later, then exact. Returns its outcomes and how many calls took the peer transfers."""
    tg.EXPERIMENTS = PEER
    before = _peer_calls()
    out = tg.deferred_worker(op, (), sync_free=False)
    return out, _peer_calls() - before


def per_graph_worker(op: str) -> list[str]:
    """``test_gpu_moe.per_graph_worker`` under the peer transfers: the deferred settle judged at the end of the next
    graph run, rank 1's GEMM fault raised by rank 1 in its run, the others' NaN call raised at the end of run 3."""
    tg.EXPERIMENTS = PEER
    return tg.per_graph_worker(op, sync_free=False)


def deferred_overflow_worker(op: str) -> list[str]:
    """Under the deferred settle (no host read, no redo possible): a call whose blocks outgrow the slots spills
    them and is exact, with no ``PoisonedResult``; the next call still spills (the outgrown call is judged at its
    end, which teaches the group its rows); the one after fits. Per call: "spilled exact", "exact" or what went
    wrong."""
    from flashoverlap_inductor import config, errors, routes
    from flashoverlap_inductor.routes import moe_deferred

    tg.EXPERIMENTS = PEER
    dev, out = torch.device("cuda", torch.cuda.current_device()), []
    moe_deferred.forget()
    key = config.current().replace(experiments={*PEER, moe_deferred.EXPERIMENT}).key()
    small, _ = _scaled_case(op, 1, 4, dev)
    for _ in range(moe_deferred.HELD_BEFORE_DEFERRING):
        _call(op, small, key)
    big, want = _scaled_case(op, 64, 4, dev)
    for _ in range(3):
        before = {k: routes.stats[k] for k in (*SPILL_KEYS, "moe:deferred")}
        tg._poison_allocator(dev)
        try:
            got = _call(op, big, key)
            torch.cuda.synchronize()
        except errors.FlashOverlapError as exc:
            out.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        grew = {k: routes.stats[k] - v for k, v in before.items()}
        if grew["moe:deferred"] != 1 or grew[f"{op}:redo"]:
            out.append(f"counters grew by {grew}")
        elif tg._err(got, want) > tg.TOL:
            out.append(f"WRONG: rel err {tg._err(got, want):.3g}")
        else:
            out.append("spilled exact" if grew["moe_peer:spill"] else "exact")
    moe_deferred.raise_pending(sync=True)  # the last call's status: good
    return out


def fault_worker(op: str, path: str) -> list[str]:
    """``test_gpu_moe.fault_worker`` under the peer transfers: rank 1's injected GEMM fault raises on every rank, and
    the next call is exact."""
    tg.EXPERIMENTS = PEER
    return tg.fault_worker(op, path)


def late_worker(op: str) -> list[str]:
    """Rank 1 comes ``STALL_S`` late to a call bounded at ``SHORT_MS``: every rank raises ``FlashOverlapTimeout``
    with its outputs poisoned; then, with no reset, two calls (the first resynchronizes the group) are exact."""
    import torch.distributed as dist

    from flashoverlap_inductor import config, errors, routes

    tg.EXPERIMENTS = PEER
    g, dev, rank = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()), dist.get_rank()
    c = tg.combine_case("grouped", "moe", 6, dev) if op == "combine" else tg.dispatch_case("grouped", "moe", 6, dev)
    want = tg.combine_fp64(c, g) if op == "combine" else tg.dispatch_fp64(c, g)[1]

    def call() -> torch.Tensor:
        return tg._combine(c, g, "blocks") if op == "combine" else tg._dispatch(c, g, "blocks")[1]

    out = []
    with config.patch(wait_timeout_ms=SHORT_MS):
        call()  # the slots and flags exist, and the ranks agreed on these settings (a host exchange), before
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            time.sleep(STALL_S)
        t0 = time.monotonic()
        try:
            got = call()
            torch.cuda.synchronize()
            out.append(f"returned (finite: {bool(torch.isfinite(got).all())})")
        except errors.FlashOverlapTimeout:
            out.append("timeout")
        except Exception as exc:  # noqa: BLE001 - the outcome is the test's
            out.append(f"{type(exc).__name__}: {exc}"[:300])
        if time.monotonic() - t0 > STALL_S + 30:
            out.append("too slow")
    resyncs = routes.stats["resync"]
    for _ in range(2):
        got = call()
        torch.cuda.synchronize()
        out.append("exact" if tg._err(got, want) <= tg.TOL else f"WRONG: {tg._err(got, want):.3g}")
    out.append(f"resyncs {routes.stats['resync'] - resyncs}")
    return out


def late_deferred_worker(op: str) -> list[str]:
    """Under the deferred settle, rank 1 comes ``STALL_S`` late to a call bounded at ``SHORT_MS``: that call returns
    NaN on every rank (no host read: nothing known yet); the next raises ``PoisonedResult`` on every rank, at its
    end, with the wait's ``FlashOverlapTimeout`` chained (the judgement of the late call, one point on every rank);
    then two calls (the first resynchronizes the group) are exact with no reset."""
    import torch.distributed as dist

    from flashoverlap_inductor import config, errors, routes
    from flashoverlap_inductor.routes import moe_deferred

    tg.EXPERIMENTS = PEER
    dev, rank = torch.device("cuda", torch.cuda.current_device()), dist.get_rank()
    moe_deferred.forget()
    c, want = _scaled_case(op, 1, 6, dev)
    out = []
    with config.patch(wait_timeout_ms=SHORT_MS):
        key = config.current().replace(experiments={*PEER, moe_deferred.EXPERIMENT}).key()
        for _ in range(moe_deferred.HELD_BEFORE_DEFERRING):  # settled on the host: the group defers from here
            _call(op, c, key)
        moe_deferred.raise_pending(sync=True)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            time.sleep(STALL_S)
        resyncs, deferred = routes.stats["resync"], routes.stats["moe:deferred"]
        for _ in range(4):
            t0 = time.monotonic()
            try:
                got = _call(op, c, key)
                torch.cuda.synchronize()
                out.append("exact" if tg._err(got, want) <= tg.TOL else "NaN" if bool(got.isnan().all()) else
                           f"WRONG: {tg._err(got, want):.3g}")
            except errors.PoisonedResult as exc:
                out.append(f"poisoned ({type(exc.__cause__).__name__})")
            except Exception as exc:  # noqa: BLE001 - the outcome is the test's
                out.append(f"{type(exc).__name__}: {exc}"[:300])
            if time.monotonic() - t0 > STALL_S + 30:
                out.append("too slow")
        moe_deferred.raise_pending(sync=True)
    out.append(f"resyncs {routes.stats['resync'] - resyncs}")
    out.append(f"deferred {routes.stats['moe:deferred'] - deferred}")
    return out


def compiled_block_worker(deferred: bool) -> dict:
    """The e2e harness's expert-parallel MoE block (tiny-moe: 4 experts, 2 per rank, ``torch._grouped_mm``, bf16)
    compiled under ``fuse="always"`` with the peer transfers (and the deferred settle where ``deferred``), against
    the same block run eagerly: per training step (fresh inputs per rank) its output, input gradient and every
    parameter gradient within a bf16 tolerance. Returns the mismatches and the counters' growth (or ``skip``: gloo
    cannot carry the graph's unfused exchange of CUDA counts here)."""
    import copy

    import torch.distributed as dist

    from flashoverlap_inductor import routes
    from flashoverlap_inductor.bench import models, moe
    from flashoverlap_inductor.routes import moe_deferred

    g, dev = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device())
    try:
        probe = torch.arange(g.size(), device=dev, dtype=torch.int64)
        dist.all_to_all_single(torch.empty_like(probe), probe, group=g)
    except Exception as exc:  # noqa: BLE001 - reported as the skip's reason
        return {"skip": f"gloo all_to_all of CUDA tensors: {type(exc).__name__}: {exc}"[:300]}
    moe_deferred.forget()
    spec = models.PRESETS["tiny-moe"].with_overrides(layers=1)
    block = models.build(spec, torch.device("cpu"), torch.float32, 0, 16).model.layers[0].mlp
    ref = moe.ExpertParallelMoE(block, g, "grouped").to(dev, torch.bfloat16)
    got = copy.deepcopy(ref)
    experiments = PEER | ({moe_deferred.EXPERIMENT} if deferred else set())
    keys = ("fused:all_to_all_dispatch", "fused:all_to_all_combine", "moe:moe_peer", "moe:deferred", "moe_peer:spill")
    before, bad = {k: routes.stats[k] for k in keys}, []
    tol = {"rtol": 3e-2, "atol": 3e-2}
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(got, backend="flashoverlap", options={"flashoverlap.fuse": "always",
                                                                       "flashoverlap.experiments": experiments})
        for step in range(4):
            gen = torch.Generator().manual_seed(100 * step + dist.get_rank())  # each rank its own tokens
            x, dy = (torch.randn(2, 24, spec.hidden, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
            for m in (ref, got):
                m.zero_grad(set_to_none=True)
            x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
            out_ref, out_got = ref(x_ref), compiled(x_got)
            out_ref.backward(dy)
            out_got.backward(dy)
            pairs = [("output", out_got, out_ref), ("input grad", x_got.grad, x_ref.grad)]
            pairs += [(f"grad {n}", q.grad, p.grad) for (n, p), (_, q) in zip(ref.named_parameters(),
                                                                           got.named_parameters(), strict=True)]
            for name, a, b in pairs:
                try:
                    torch.testing.assert_close(a.float(), b.float(), **tol)
                except (AssertionError, AttributeError) as exc:
                    bad.append(f"step {step} {name}: {exc}"[:300])
    routes.check()  # the calls still pending judged: all good
    torch._dynamo.reset()
    return {"bad": bad, **{k: routes.stats[k] - v for k, v in before.items()}}


def test_both_ops_match_fp64_and_the_reference_over_peer_transfers(pool):
    got = pool.run(ops_worker, ["grouped", "grouped2", "loop"], ["moe", "perm"], ["blocks", "blocks:c=2"], [1, 2])
    assert [bad for bad, _ in got] == [[]] * pool.world_size, got
    # the whole-block combines' library call (grouped forms, plan "blocks": 8 calls, those whose blocks fit the
    # slots) wrote their blocks straight into the peers' slots
    assert all(1 <= direct <= 8 for _, direct in got), got


def test_the_combine_pushed_by_copy_engine_under_moe_peer_push(pool):
    got = pool.run(ops_worker, ["grouped", "grouped2"], ["moe"], ["blocks"], [1, 2], True)
    assert got == [([], 0)] * pool.world_size, got


def test_the_expert_cut_dispatch_over_peer_transfers(pool):
    got = pool.run(ops_worker, ["grouped"], ["moe"], ["experts", "experts:c=3"], [1, 2])
    assert [bad for bad, _ in got] == [[]] * pool.world_size, got


def test_a_block_past_its_slot_is_spilled_exact_and_the_slots_grow(pool):
    got = pool.run(overflow_worker)
    assert [bad for bad, _ in got] == [[]] * pool.world_size, got
    for op in ("dispatch", "combine"):  # some rank spilled a block, none once the slots grew
        assert sum(o[f"{op} outgrown"] for _, o in got) > 0 and sum(o[f"{op} grown"] for _, o in got) == 0, got


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_the_settle_without_a_host_read_over_peer_transfers(pool, op):
    got = pool.run(deferred_worker, op)
    calls = 4 + 1 + 1 + 2  # held on the host, one deferred, the faulted one, two after it
    for rank, (out, peer_calls) in enumerate(got):
        want = ["exact", "own", "exact", "exact"] if rank == 1 else ["exact", "NaN", "poisoned (PeerFailure)",
                                                                      "exact"]
        assert out == want and peer_calls == calls, got


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_per_graph_judging_over_peer_transfers(pool, op):
    got = pool.run(per_graph_worker, op)
    for rank, r in enumerate(got):
        want = ["pending 2", "exact", "exact", "run 1: ok", "own", "pending 4", "exact", "run 2: ok", "pending 4",
                "exact", "exact", "run 3: ok"] if rank == 1 else \
            ["pending 2", "exact", "exact", "run 1: ok", "pending 4", "NaN", "exact", "run 2: ok", "pending 4",
             "run 3: poisoned (PeerFailure)"]
        assert r == want, got


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_block_past_its_slot_under_the_deferred_settle_is_spilled_not_poisoned(pool, op):
    got = pool.run(deferred_overflow_worker, op)
    assert all(r[0] == "spilled exact" and r[1] in ("spilled exact", "exact") and r[2] == "exact" for r in got), got
    assert any(r[1] == "spilled exact" for r in got), got


@pytest.mark.parametrize("op, path", [("combine", "whole-block"), ("dispatch", "whole-block"),
                                      ("combine", "general")])
def test_a_gemm_fault_on_one_rank_raises_on_every_rank_over_peer_transfers(pool, op, path):
    got = pool.run(fault_worker, op, path)
    assert got[1][0] == "own" and all(r[0] == "peer" for i, r in enumerate(got) if i != 1), got
    assert all(r[1] == "exact" for r in got), got


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_late_rank_makes_every_rank_raise_and_the_next_calls_are_exact(pool, op):
    got = pool.run(late_worker, op)
    for r in got:
        assert r[0] == "timeout" and r[1:3] == ["exact", "exact"], got
        assert r[3] == "resyncs 1", got


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_late_rank_under_the_deferred_settle_poisons_then_raises_on_every_rank_at_one_call(pool, op):
    got = pool.run(late_deferred_worker, op)
    assert all(r == ["NaN", "poisoned (FlashOverlapTimeout)", "exact", "exact", "resyncs 1", "deferred 4"]
               for r in got), got


@pytest.mark.parametrize("deferred", [False, True], ids=["host_settle", "deferred"])
def test_a_compiled_moe_block_over_peer_transfers_matches_eager(pool, deferred):
    if pool.world_size != 2:
        pytest.skip("tiny-moe's 4 experts over 2 ranks")
    got = pool.run(compiled_block_worker, deferred)
    if "skip" in got[0]:
        pytest.skip(got[0]["skip"])
    for r in got:  # 4 steps: the forward dispatch and combine, their backward forms, every one fused and peer
        assert r["bad"] == [] and r["fused:all_to_all_dispatch"] == 8 and r["fused:all_to_all_combine"] == 8, got
        assert r["moe:moe_peer"] == 16 and (r["moe:deferred"] > 0) == deferred, got
