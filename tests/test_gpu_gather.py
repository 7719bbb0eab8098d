"""GPU tests of the all_gather -> GEMMs peer route (``routes.gather_peer``: every shard pulled by copy engine from its
rank's symmetric memory, cuBLAS GEMMs per shard on the caller's stream) with 2 and 4 ranks sharing one GPU: a gloo
group, torch's symmetric memory under ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` (as
``examples/device/ring_probe4.py`` does). Ranks time-slice the GPU, so these check the schedule, the flags and the
failure contract, not speed (``examples/device/gather_probe.py`` times the per-shard GEMMs).

Skipped unless CUDA, an sm90 GPU and a library with ``fo_gather_call`` are present. Every call runs on fresh random
bf16 data and is compared with eager PyTorch on the same rank (gloo ``all_gather`` of the shards, then ``torch.mm``
/ ``addmm``) and with an fp64 reference; the gathered tensor must equal eager's bit for bit; every call must count
``route:gather_peer`` (so no check can pass on the unfused route). Covered: gather_dim 0 and 1 (contiguous and
strided shard rows), 1 and 3 weights, bias or none, the gathered tensor returned or not, a shard buffer that grows,
the same calls queued with no synchronization between them (the done flags guard every buffer; ``gather_start``
"handshake" and "eager" alternating, and with "push" too), the GEMMs in one library call equal to ``torch.mm``'s bit
for bit (the experiment ``gather_torch_gemms`` runs the latter), a rank that comes late (every rank's outputs NaN,
every rank raises ``FlashOverlapTimeout``, the next call is correct with no reset), and a rank that skips a call
(the others raise within the bound, the skipper in ``routes.check()``; with no reset, the next call resynchronizes
the group first and it and the one after are correct on every rank). The matching and fault tests run under
``gather_start="push"`` (the default on 2 ranks: two receive slot sets used alternately), ``"handshake"``, and push
under the experiment ``gather_copy_notify`` (on the world-4 pool each peer is told by copy engine; queued among
plain push calls).
"""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import DistPool, gather_library_ready, gpu0_setup

LONG_MS = 60000.0  # the bound of normal calls: time-sliced ranks may wait for another context's turn
SHORT_MS = 1500.0  # the bound of the fault cases
STALL_S = 4.0  # how late the late rank comes (> SHORT_MS)
SLACK_S = 5.0  # a timed-out call ends within its bound plus this (poison kernel, time slicing)




pytestmark = pytest.mark.skipif(not gather_library_ready(), reason="needs a CUDA sm90 GPU and the built library")




@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def pool(request):
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "FLASHOVERLAP_TRANSPORT": "peer",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    p = DistPool(request.param, env, timeout_s=300.0, backend="gloo", setup=gpu0_setup)
    yield p
    p.close()


# (shard shape, gather_dim): 2D; 3D along dim 1 with 2 leading rows (strided shard views); 3D along dim 0; a
# leading size of 1 along dim 1 with ragged rows (contiguous again)
SHAPES = [((256, 512), 0), ((2, 96, 512), 1), ((3, 64, 256), 0), ((1, 200, 384), 1)]
WEIGHTS = [[384], [256, 128, 64]]  # N of each GEMM: one, and three sharing the gather (q/k/v)
FLAGS = [(False, False), (True, True), (True, False), (False, True)]  # (bias, return_gathered)
GROW = ((2048, 1024), 0)  # a 4 MiB shard: the shard buffer grows past 1 MiB


def _inputs(seed: int, shape, ns: list[int], bias: bool):
    """This rank's shard and weights (W.t() of Linear weights), drawn on the GPU (no host sync)."""
    import torch.distributed as dist

    gen = torch.Generator(device="cuda").manual_seed(seed * 100 + dist.get_rank())
    k = shape[-1]
    a = torch.randn(shape, generator=gen, device="cuda").bfloat16()
    ws = [(torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16().t() for n in ns]
    cs = [torch.randn(n, generator=gen, device="cuda").bfloat16() if bias else None for n in ns]
    return a, ws, cs


def _op(a, ws, cs, gather_dim: int, ret: bool) -> list[torch.Tensor]:
    import torch.distributed as dist

    group = dist.group.WORLD
    return torch.ops.flashoverlap.all_gather_gemm(a, ws, cs, gather_dim, group.size(), group.group_name, "auto", ret)


def _eager(a, ws, cs, gather_dim: int) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Eager PyTorch: gloo all_gather of the shards (as fp32: exact for bf16), cat, then mm / addmm; and fp64
    references."""
    import torch.distributed as dist

    parts = [torch.empty(a.shape, dtype=torch.float32) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, a.cpu().float().contiguous())  # bf16 -> fp32 is exact; gloo has no 16-bit ints
    g = torch.cat([p.bfloat16().cuda() for p in parts], gather_dim)
    flat = g.reshape(-1, g.shape[-1])
    ys = [torch.mm(flat, w) if c is None else torch.addmm(c, flat, w) for w, c in zip(ws, cs, strict=True)]
    refs = [flat.double() @ w.double() + (0 if c is None else c.double()) for w, c in zip(ws, cs, strict=True)]
    return ys, g, refs


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _check(outs, a, ws, cs, gather_dim: int, ret: bool, what: str) -> None:
    ys, g, refs = _eager(a, ws, cs, gather_dim)
    assert len(outs) == len(ws) + ret, (what, len(outs))
    for i, (y, e, ref) in enumerate(zip(outs, ys, refs, strict=False)):
        assert y.shape == e.shape and y.dtype == e.dtype, (what, i, y.shape, e.shape)
        assert bool(torch.isfinite(y).all()), (what, i, "not finite")
        err, eager_err = _rel(y, ref), _rel(e, ref)
        assert err < 1.5e-2 and err <= 2 * eager_err + 2e-3, (what, i, err, eager_err)
    if ret:
        assert outs[-1].shape == g.shape and torch.equal(outs[-1], g), (what, "gathered tensor differs")


def _cases() -> list[tuple]:
    out = []
    for si, (shape, gdim) in enumerate(SHAPES):
        for wi, ns in enumerate(WEIGHTS):
            for fi, (bias, ret) in enumerate(FLAGS):
                out.append((100 * si + 10 * wi + fi, shape, gdim, ns, bias, ret))
    out.append((999, *GROW, [512], True, True))
    out.append((998, *SHAPES[1], WEIGHTS[1], False, True))  # the small buffer again, after the growth
    return out


# the gather_start of the matching and fault tests; "push+copy": push under the experiment gather_copy_notify (on 3+
# ranks each peer told by copy engine right after its push)
STARTS = ("handshake", "push", "push+copy")
COPY_NOTIFY = "gather_copy_notify"


def _start(token: str) -> dict:
    """The settings of a start token of ``STARTS`` (or "eager") for ``config.patch``."""
    from flashoverlap_inductor import config

    if not token.startswith("push"):
        return {"gather_start": token}
    have = config.current().experiments
    return {"gather_start": "push",
            "experiments": have | {COPY_NOTIFY} if token == "push+copy" else have - {COPY_NOTIFY}}


def match_task(start: str) -> dict:
    """Every case synchronized and checked under ``gather_start=start``, then every case queued back to back and
    checked after one sync, the starts alternating (with "push": all three, so the schedules share flags in one
    queue)."""
    from flashoverlap_inductor import config, routes

    routes.reset()
    cases = _cases()
    # push: runs of push calls queued back to back (where the two slot sets matter) between the other starts; with
    # the copy-engine notification, also plain push calls between (the peers' ready flags then get copied values and
    # adds in one queue)
    mixed = {"push": ("push", "push", "push", "handshake", "push", "push", "eager"),
             "push+copy": ("push+copy", "push+copy", "push+copy", "handshake", "push+copy", "push", "eager")}.get(
        start, ("handshake", "eager"))
    with config.patch(wait_timeout_ms=LONG_MS, **_start(start)):
        for seed, shape, gdim, ns, bias, ret in cases:
            before = routes.stats["route:gather_peer"]
            a, ws, cs = _inputs(seed, shape, ns, bias)
            outs = _op(a, ws, cs, gdim, ret)
            torch.cuda.synchronize()
            routes.check()
            assert routes.stats["route:gather_peer"] == before + 1, (shape, gdim, ns, dict(routes.stats))
            _check(outs, a, ws, cs, gdim, ret, f"{shape} dim {gdim} N={ns} bias={bias} gathered={ret}")
        synced = routes.stats["route:gather_peer"]
        queued = []
        for i, (seed, shape, gdim, ns, bias, ret) in enumerate(cases):  # both GEMM starts, mixed in one queue
            a, ws, cs = _inputs(seed + 5000, shape, ns, bias)
            with config.patch(**_start(mixed[i % len(mixed)])):
                queued.append((a, ws, cs, gdim, ret, _op(a, ws, cs, gdim, ret)))
        torch.cuda.synchronize()
        routes.check()
        for i, (a, ws, cs, gdim, ret, outs) in enumerate(queued):
            _check(outs, a, ws, cs, gdim, ret, f"queued case {i}")
    lists = {key[2:]: sorted(ws.capacity for ws in lst) for key, lst in routes.gather_peer._workspaces.items()}
    return {"synced": synced, "total": routes.stats["route:gather_peer"], "pull": lists.get((), []),
            "push": lists.get(("push",), [])}


@pytest.mark.parametrize("start", STARTS)
def test_gather_peer_matches_eager(pool, start):
    from flashoverlap_inductor.routes.gather_start import SLOT_SETS

    n, world = len(_cases()), pool.world_size
    per_rank = pool.run(match_task, start)
    for r in per_rank:
        assert r["synced"] == n and r["total"] == 2 * n, per_rank
        # 1 MiB, grown once to 4 MiB, the small one reused (under push, the 4 MiB case's queued call pushes too)
        assert r["pull"] == ([1 << 20, 4 << 20] if start == "handshake" else [1 << 20]), per_rank
        # the push schedule's own list: SLOT_SETS sets of world slots per rank (of the 256 KiB shard, of 4 MiB)
        pow2 = 1 << (SLOT_SETS * world - 1).bit_length()  # workspaces are powers of two
        assert r["push"] == ([max(1 << 20, pow2 << 18), pow2 << 22] if start.startswith("push") else []), per_rank


def library_gemms_task() -> dict[str, int]:
    """Every case without bias three times on fresh data: the GEMMs in one library call (``routes.gather_gemms``,
    where the case's shards are contiguous: cuBLASLt with its plan kept per shape), the same through
    ``cublasGemmEx`` (the experiment ``gather_gemm_ex``) and under the experiment ``gather_torch_gemms`` (one
    ``torch.mm`` per shard and weight). ``cublasGemmEx``'s results must equal ``torch.mm``'s bit for bit; cuBLASLt's
    must pass the fp64 check (``_check``) and are counted where they are equal bit for bit too (the heuristic's
    first algorithm is cuBLAS's own choice unless the workspaces differ); the library call must have run exactly where
    it applies, through cuBLASLt unless under ``gather_gemm_ex``."""
    from flashoverlap_inductor import config, routes
    from flashoverlap_inductor.schedule import gather as schedule

    routes.reset()
    took = skipped = lt_equal = lt_differ = 0
    with config.patch(wait_timeout_ms=LONG_MS):
        for seed, shape, gdim, ns, bias, ret in _cases():
            if bias:
                continue
            a, ws, cs = _inputs(seed + 7000, shape, ns, bias)
            before = routes.stats["gather:library_gemms"], routes.stats["gather:cublaslt"]
            lt_outs = _op(a, ws, cs, gdim, ret)
            lt_ran = routes.stats["gather:cublaslt"] - before[1]
            with config.patch(experiments=frozenset({"gather_gemm_ex"})):
                ex_outs = _op(a, ws, cs, gdim, ret)
            with config.patch(experiments=frozenset({"gather_torch_gemms"})):
                torch_outs = _op(a, ws, cs, gdim, ret)
            torch.cuda.synchronize()
            routes.check()
            contiguous = schedule.geometry(list(a.shape), gdim, 2).contiguous_shards
            ran = routes.stats["gather:library_gemms"] - before[0]
            assert ran == 2 * int(contiguous) and lt_ran == int(contiguous), (shape, gdim, ran, lt_ran)
            took, skipped = took + ran // 2, skipped + (1 - ran // 2)
            for i, (x, y) in enumerate(zip(ex_outs, torch_outs, strict=True)):
                assert torch.equal(x, y), (shape, gdim, ns, i, "cublasGemmEx's results differ from torch.mm's")
            _check(lt_outs, a, ws, cs, gdim, ret, f"library GEMMs {shape} dim {gdim} N={ns}")
            _check(ex_outs, a, ws, cs, gdim, ret, f"library GEMMs (cublasGemmEx) {shape} dim {gdim} N={ns}")
            if contiguous:
                same = all(torch.equal(x, y) for x, y in zip(lt_outs, torch_outs, strict=True))
                lt_equal, lt_differ = lt_equal + int(same), lt_differ + int(not same)
    print(f"cuBLASLt plans: {lt_equal} cases equal to torch.mm bit for bit, {lt_differ} within the fp64 check only",
          flush=True)
    return {"took": took, "skipped": skipped, "lt_equal": lt_equal, "lt_differ": lt_differ}


def test_gather_library_gemms_equal_torch_mm(pool):
    per_rank = pool.run(library_gemms_task)
    assert all(r["took"] > 0 and r["skipped"] > 0 for r in per_rank), per_rank
    print(f"cuBLASLt against torch.mm per rank: {per_rank}")


def _pending() -> bool:
    """Whether this rank's gather fault block has reached the host (its pinned mirror; read without clearing)."""
    import torch.distributed as dist

    from flashoverlap_inductor.routes import gather_peer

    return gather_peer.flags(dist.group.WORLD, torch.device("cuda", 0)).fault.pending()


def _expect_timeout(fn) -> str:
    from flashoverlap_inductor import errors

    try:
        fn()
    except errors.FlashOverlapTimeout as exc:
        return "raised: " + str(exc)[:200]
    return "no error"


CASE = ((256, 512), 0, [384, 128], True, True)  # shape, gather_dim, N, bias, return_gathered
LIB_CASE = ((256, 512), 0, [384, 128], False, True)  # no bias: the call and its GEMMs in one library call
FAULT_CASES = {"python GEMMs": CASE, "one library call": LIB_CASE}


def late_rank_task(start: str, case: tuple = CASE) -> dict:
    """The last rank comes STALL_S late to one call: the others' waits give up at the bound, every rank's outputs
    of that call are NaN and every rank raises; the next call resynchronizes the group (every rank raised) and is
    correct, with no reset."""
    import torch.distributed as dist

    from flashoverlap_inductor import config, routes

    rank, world = dist.get_rank(), dist.get_world_size()
    late = rank == world - 1
    shape, gdim, ns, bias, ret = case
    routes.reset()
    out: dict = {"late": late}
    with config.patch(wait_timeout_ms=SHORT_MS, **_start(start)):
        a, ws, cs = _inputs(1, shape, ns, bias)  # both ranks: the shape's agreement, buffers and flags exist
        _check(_op(a, ws, cs, gdim, ret), a, ws, cs, gdim, ret, "warm-up")
        routes.check()
        dist.barrier()
        if late:
            time.sleep(STALL_S)
        t0 = time.monotonic()
        a, ws, cs = _inputs(2, shape, ns, bias)
        outs = _op(a, ws, cs, gdim, ret)
        torch.cuda.synchronize()
        out["elapsed_s"] = time.monotonic() - t0
        out["pending"] = _pending()  # the host sees it now: the next eager call or routes.check() raises
        out["poisoned"] = all(bool(torch.isnan(y).all()) for y in outs)
        out["routed"] = routes.stats["route:gather_peer"]
        dist.barrier()  # every rank's timed-out waits have recorded their faults (so none lands after a clear)
        out["error"] = _expect_timeout(routes.check)
        dist.barrier()
        a, ws, cs = _inputs(3, shape, ns, bias)
        _check(_op(a, ws, cs, gdim, ret), a, ws, cs, gdim, ret, "the call after the fault")
        routes.check()
    out["after"] = routes.stats["route:gather_peer"]
    out["resyncs"] = routes.stats["resync"]
    out["library"] = routes.stats["gather:library_gemms"]
    return out


@pytest.mark.parametrize("case", FAULT_CASES)
@pytest.mark.parametrize("start", STARTS)
def test_gather_peer_late_rank_poisons_and_raises_everywhere(pool, start, case):
    per_rank = pool.run(late_rank_task, start, FAULT_CASES[case])
    for r in per_rank:
        assert r["library"] == (r["after"] if FAULT_CASES[case] is LIB_CASE else 0), per_rank
        assert r["pending"] and r["poisoned"], per_rank
        assert r["error"].startswith("raised") and "gather_peer" in r["error"], per_rank
        assert r["routed"] == 2 and r["after"] == 3 and r["resyncs"] == 1, per_rank
        if not r["late"]:
            assert r["elapsed_s"] < SHORT_MS / 1e3 + SLACK_S, per_rank


def missing_rank_task(start: str, case: tuple = CASE) -> dict:
    """The last rank skips a call: the others' waits give up at the bound, their outputs are NaN and they raise; the
    skipper raises too, in ``routes.check()`` (their waits wrote the fault into its block). The flags are a call
    apart then (a skipped call consumes no epoch), and nobody resets: every rank's next call first resynchronizes
    the group (the same collective on every rank, marked by the fault each raised), then it and the one after are
    correct on every rank."""
    import torch.distributed as dist

    from flashoverlap_inductor import config, routes
    from flashoverlap_inductor.runtime import faults

    rank, world = dist.get_rank(), dist.get_world_size()
    shape, gdim, ns, bias, ret = case
    routes.reset()
    out: dict = {"skips": rank == world - 1}
    with config.patch(wait_timeout_ms=SHORT_MS, **_start(start)):
        a, ws, cs = _inputs(1, shape, ns, bias)
        _check(_op(a, ws, cs, gdim, ret), a, ws, cs, gdim, ret, "warm-up")
        routes.check()
        dist.barrier()
        if not out["skips"]:
            t0 = time.monotonic()
            a, ws, cs = _inputs(2, shape, ns, bias)
            outs = _op(a, ws, cs, gdim, ret)
            torch.cuda.synchronize()
            out["elapsed_s"] = time.monotonic() - t0
            out["poisoned"] = all(bool(torch.isnan(y).all()) for y in outs)
        dist.barrier()  # every rank's timed-out waits have recorded their faults, in every rank's block
        out["error"] = _expect_timeout(routes.check)  # every rank, the skipper too
        out["marked"] = faults.resync_due(0, dist.group.WORLD.group_name)
        dist.barrier()
        for seed in (3, 4):  # no reset: the first resynchronizes the group before it runs
            a, ws, cs = _inputs(seed, shape, ns, bias)
            _check(_op(a, ws, cs, gdim, ret), a, ws, cs, gdim, ret, f"call {seed - 2} after the fault")
            routes.check()
    out["after"] = routes.stats["route:gather_peer"]
    out["resyncs"] = routes.stats["resync"]
    out["marked_after"] = bool(faults.marked())
    out["library"] = routes.stats["gather:library_gemms"]
    return out


@pytest.mark.parametrize("case", FAULT_CASES)
@pytest.mark.parametrize("start", STARTS)
def test_gather_peer_missing_rank_times_out(pool, start, case):
    per_rank = pool.run(missing_rank_task, start, FAULT_CASES[case])
    for r in per_rank:
        assert r["library"] == (r["after"] if FAULT_CASES[case] is LIB_CASE else 0), per_rank
        assert r["error"].startswith("raised") and "gather_peer" in r["error"], per_rank  # every rank raised
        assert r["marked"] and r["resyncs"] == 1 and not r["marked_after"], per_rank
        assert r["after"] == (3 if r["skips"] else 4), per_rank  # both calls after the fault took the route
        if not r["skips"]:
            assert r["poisoned"], per_rank
            assert r["elapsed_s"] < SHORT_MS / 1e3 + SLACK_S, per_rank
