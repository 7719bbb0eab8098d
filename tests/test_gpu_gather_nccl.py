"""The NCCL route of ``all_gather_gemm`` (``routes/gather_nccl.py``) on >= 2 GPUs, one rank per GPU: results
against eager ``all_gather`` + ``torch.mm`` on fresh random bf16 data (gather dim 0 and 1, 1 and 3 weights, bias,
the gathered tensor), the route counted (so the test cannot pass on the unfused route), outputs pre-poisoned by
the caching allocator (NaN-filled blocks freed just before), a compiled sequence-parallel MLP block whose gathers
the pass fused, and the failure contract (rank 1's first, or last, shard GEMM raises, or it cannot prepare the call:
every rank raises in that call or the next, no rank returns a wrong tensor, the next call is exact) (2 GPUs); and on
one GPU, the route's stream schedule with simulated ring steps, and its failure exchange with a simulated peer
(streams, pinned mirror, a captured call)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import DistPool, cuda_gpus

TIMEOUT_S = 150.0


two_gpus = pytest.mark.skipif(cuda_gpus() < 2, reason="needs >= 2 CUDA GPUs")


@pytest.mark.skipif(cuda_gpus() < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("world,gather_dim", [(2, 0), (4, 1), (8, 1)])
def test_stream_schedule_on_one_gpu(world, gather_dim):
    """The route's stream schedule (``gather_ring.run_streams``) on one GPU, its ring steps simulated by copies on
    the side stream (after a sleep, so a GEMM that did not wait for its shard's event reads garbage): every result
    and the gathered tensor as eager's, for world sizes 2, 4 and 8."""
    import types

    from flashoverlap_inductor.routes import gather_ring
    from flashoverlap_inductor.schedule import gather as schedule

    dev = torch.device("cuda")
    torch.manual_seed(world)
    shape = (1024 // world, 512) if gather_dim == 0 else (2, 2048 // world, 512)
    shards = [torch.randn(shape, device=dev).bfloat16() for _ in range(world)]
    b = [torch.randn(512, 384, device=dev).bfloat16(), torch.randn(256, 512, device=dev).bfloat16().t()]
    bias = [torch.randn(384, device=dev).bfloat16(), None]
    rank = world - 1
    group = types.SimpleNamespace(size=lambda: world, rank=lambda: rank)
    ctx = types.SimpleNamespace(a=shards[rank], group=group, gather_dim=gather_dim, b=b, bias=bias,
                                y_shape=schedule.gathered_shape(shape, gather_dim, world), return_gathered=True)
    call = gather_ring.GatherCall(ctx)
    call.staging.fill_(float("nan"))

    def issue(step: int) -> list:  # on the side stream (run_streams issues there): a late copy of the shard
        torch.cuda._sleep(2_000_000)
        j = call.source(step)
        call.staging[j].copy_(shards[j].reshape(call.geo.shard_rows, call.geo.k))
        return []

    call.issue = issue
    gather_ring.run_streams(call)
    got = call.result()
    g = torch.cat(shards, gather_dim)
    flat = g.reshape(-1, 512)
    want = [torch.addmm(bias[0], flat, b[0]), flat @ b[1]]
    for y, ref in zip(got, want, strict=False):
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(got[-1], g)


@pytest.mark.skipif(cuda_gpus() < 1, reason="needs a CUDA GPU")
def test_failure_exchange_on_one_gpu(monkeypatch):
    """The route's call (``gather_nccl.run_call``) on one GPU with its CUDA streams, as rank 0 of 2: the ring step
    simulated by a late copy on the side stream, the failure exchange by a device-side max with a simulated peer
    count. A peer's failure raises ``PeerFailure`` at the end of the call or the next one (the check of the first
    call's outputs waits for its exchange), once; this rank's GEMM failure reaches its slot of the counts and the
    pinned mirror; a call captured into a CUDA graph runs no exchange and replays exactly; nothing is aborted."""
    import types

    import torch.distributed as dist

    from flashoverlap_inductor import _inductor_compat as compat
    from flashoverlap_inductor import errors
    from flashoverlap_inductor.routes import gather_nccl, gather_ring
    from flashoverlap_inductor.schedule import gather as schedule

    dev = torch.device("cuda", torch.cuda.current_device())
    group = types.SimpleNamespace(group_name="simulated", size=lambda: 2, rank=lambda: 0)
    torch.manual_seed(0)
    a, peer = (torch.randn(256, 512, device=dev).bfloat16() for _ in range(2))
    b = [torch.randn(512, 384, device=dev).bfloat16()]
    want = torch.cat([a, peer]) @ b[0]
    peer_count = torch.zeros(1, dtype=torch.int32, device=dev)
    exchanges = []

    def ring_step(g, peers, step, sent, received):
        torch.cuda._sleep(1_000_000)
        received.copy_(peer)
        return []

    def all_reduce(t, op=None, group=None, async_op=False):
        exchanges.append(torch.cuda.current_stream(dev))
        t[1:2].copy_(torch.maximum(t[1:2], peer_count))

    monkeypatch.setattr(gather_ring, "ring_step", ring_step)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_global_rank", lambda g, r: r)
    monkeypatch.setattr(compat, "abort_group", lambda g: pytest.fail("the group was aborted"))
    gather_nccl.ROUTE.reset()

    def call(capturing: bool = False) -> torch.Tensor:
        ctx = types.SimpleNamespace(a=a, b=b, bias=[None], group=group, gather_dim=0, y_shape=[512, 512],
                                    return_gathered=False, capturing=capturing)
        return gather_nccl.run_call(ctx, gather_ring.CudaStreams(dev))[0]

    try:
        torch.testing.assert_close(call(), want, rtol=2e-2, atol=2e-2)
        assert exchanges and exchanges[-1] == gather_ring._side_stream(dev)
        peer_count.fill_(1)
        outcomes = []
        for _ in range(3):
            try:
                torch.testing.assert_close(call(), want, rtol=2e-2, atol=2e-2)
                outcomes.append("exact")
            except errors.PeerFailure as exc:
                assert "rank 1" in str(exc), exc
                outcomes.append("peer")
        assert outcomes in (["exact", "peer", "exact"], ["peer", "exact", "exact"]), outcomes

        def broken(*args, **kwargs):
            raise RuntimeError("injected GEMM failure")

        with monkeypatch.context() as m:
            m.setattr(schedule, "shard_gemm", broken)
            with pytest.raises(RuntimeError, match="injected GEMM failure"):
                call()
        torch.cuda.synchronize()
        st = gather_nccl.status_for(group, dev)
        assert st.counts.tolist() == [1, 1] and st.mirror.tolist() == [1, 1] and st.mirror.is_pinned()
        torch.testing.assert_close(call(), want, rtol=2e-2, atol=2e-2)

        before = len(exchanges)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(capturing=True)
        assert len(exchanges) == before
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    finally:
        torch.cuda.synchronize()
        gather_nccl.ROUTE.reset()


@pytest.fixture(scope="module")
def pool():
    p = DistPool(2, backend="nccl", timeout_s=TIMEOUT_S,
                 env={"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "FLASHOVERLAP_TRANSPORT": "nccl"})
    yield p
    p.close()


def gather_worker(seed: int) -> list[str]:
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    rank, world, dev = dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    gname = dist.group.WORLD.group_name
    gen = torch.Generator(device=dev).manual_seed(seed * 10 + rank)
    wgen = torch.Generator(device=dev).manual_seed(seed)
    bad = []
    for gather_dim, shape in ((0, (1024, 512)), (1, (2, 256, 512))):
        for nw in (1, 3):
            a = torch.randn(shape, generator=gen, device=dev).bfloat16()
            b = [torch.randn(512, 256 * (i + 1), generator=wgen, device=dev).bfloat16() for i in range(nw)]
            bias = [torch.randn(w.shape[1], generator=wgen, device=dev).bfloat16() if i == 0 else None
                    for i, w in enumerate(b)]
            parts = [torch.empty_like(a) for _ in range(world)]
            dist.all_gather(parts, a)
            g = torch.cat(parts, gather_dim)
            flat = g.reshape(-1, 512)
            want = [flat @ w if c is None else torch.addmm(c, flat, w) for w, c in zip(b, bias, strict=True)]
            poison = torch.full((64 << 20,), float("nan"), device=dev)  # freed: the outputs' blocks hold NaN
            del poison
            before = routes.stats["route:gather_nccl"]
            got = torch.ops.flashoverlap.all_gather_gemm(a, b, bias, gather_dim, world, gname, "ring", True)
            torch.cuda.synchronize()
            if routes.stats["route:gather_nccl"] != before + 1:
                bad.append(f"dim {gather_dim} x{nw}: not the gather_nccl route: {dict(routes.stats)}")
            for i, (y, ref) in enumerate(zip(got, want, strict=False)):
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    bad.append(f"dim {gather_dim} x{nw}: y{i} rel err {err:.3g}")
            if not torch.equal(got[-1], g):
                bad.append(f"dim {gather_dim} x{nw}: the gathered tensor differs")
    return bad


def compiled_block_worker(batch: int) -> list[str]:
    """A sequence-parallel MLP (gather along the sequence dim, gate/up, SiLU, down, reduce_scatter) compiled with
    fuse='always': both collectives fused, the result as eager's. The gather in the form DTensor emits (torch 2.11
    breaks the graph inside ``funcol.all_gather_tensor(x, 1)``): a dim-0 gather, then split/cat along the sequence
    dim, or at batch 1 a reshape (``torch._utils._maybe_view_chunk_cat``)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from flashoverlap_inductor import fusion_report, reset_fusion_report
    from flashoverlap_inductor.backend import flashoverlap_backend

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = dist.group.WORLD
    torch.manual_seed(0)
    wg, wu = (torch.randn(1024, 1536, device=dev).bfloat16() * 0.03 for _ in range(2))
    wd = torch.randn(1536, 1024, device=dev).bfloat16() * 0.03
    torch.manual_seed(1 + rank)
    x = torch.randn(batch, 512, 1024, device=dev).bfloat16()
    world = dist.get_world_size()

    def block(x):
        full = funcol.all_gather_tensor(x, 0, g)
        if batch == 1:
            full = full.reshape(1, 512 * world, 1024)
        else:
            full = torch.cat(full.chunk(world, 0), dim=1)
        full = full.reshape(-1, 1024)
        h = torch.nn.functional.silu(full @ wg) * (full @ wu)
        return funcol.reduce_scatter_tensor((h @ wd).view(batch, -1, 1024), "sum", 1, g)

    torch._dynamo.reset()
    reset_fusion_report()
    want = block(x)
    got = torch.compile(block, backend=flashoverlap_backend, options={"flashoverlap.fuse": "always"})(x)
    torch.cuda.synchronize()
    bad = []
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    if not err < 2e-2:
        bad.append(f"compiled block rel err {err:.3g}")
    counts = fusion_report().compile
    if counts.get("fused:all_gather", 0) != 1 or counts.get("fused:reduce_scatter", 0) != 1:
        bad.append(f"fused: {dict(counts)}")
    return bad


def _blocks(y: torch.Tensor, ref: torch.Tensor, world: int) -> list[str]:
    """Per shard's rows (gather dim 0): exact (relative error < 1e-2, no NaN), nan (all NaN) or WRONG."""
    out = []
    for yb, rb in zip(y.float().chunk(world), ref.float().chunk(world), strict=True):
        if bool(yb.isnan().all()):
            out.append("nan")
        elif not bool(yb.isnan().any()) and ((yb - rb).norm() / rb.norm()).item() < 1e-2:
            out.append("exact")
        else:
            out.append("WRONG")
    return out


def failure_worker(mode: str) -> list[str]:
    """Three calls of the NCCL route; rank 1 fails in the first: its first shard GEMM raises ("first"), its last one
    ("last"), or it cannot prepare the call ("prepare": ``GatherCall`` raises, so its ring steps go out from
    ``VoidRing``). Per call: "own" (rank 1's injected error), "peer" (``PeerFailure`` naming rank 1), "exact" (every
    output and the gathered tensor exact, on the route), "nan-rows" (exact but rank 1's rows NaN), or what went
    wrong; then what ``routes.check()`` raised. Outputs pre-poisoned by the caching allocator. (Also run on gloo
    ranks with the route's CUDA parts simulated: ``tests/test_gather_nccl_contract.py``.)"""
    import contextlib
    from unittest import mock

    import torch.distributed as dist

    from flashoverlap_inductor import errors, routes
    from flashoverlap_inductor.routes import gather_nccl
    from flashoverlap_inductor.schedule import gather as schedule

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gname = dist.group.WORLD.group_name
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    wgen = torch.Generator(device=dev).manual_seed(100)
    a = torch.randn(1024, 512, generator=gen, device=dev).bfloat16()
    b = [torch.randn(512, 256, generator=wgen, device=dev).bfloat16(),
         torch.randn(512, 384, generator=wgen, device=dev).bfloat16()]
    bias = [torch.randn(256, generator=wgen, device=dev).bfloat16(), None]
    parts = [torch.empty_like(a) for _ in range(world)]
    dist.all_gather(parts, a)
    g = torch.cat(parts)
    want = [torch.addmm(bias[0], g, b[0]), g @ b[1], g]
    real_gemm, count = schedule.shard_gemm, [0]

    def failing_gemm(*args, **kwargs):
        count[0] += 1
        if count[0] - 1 == (0 if mode == "first" else world * len(b) - 1):
            raise RuntimeError("injected GEMM failure")
        return real_gemm(*args, **kwargs)

    def no_memory(*args, **kwargs):
        raise RuntimeError("injected: CUDA out of memory")

    seen = []
    for i in range(3):
        patch = contextlib.nullcontext()
        if i == 0 and rank == 1:
            patch = mock.patch.object(gather_nccl, "GatherCall", no_memory) if mode == "prepare" else \
                mock.patch.object(schedule, "shard_gemm", failing_gemm)
        poison = torch.full((64 << 20 if dev.type == "cuda" else 1,), float("nan"), device=dev)
        del poison  # freed: the outputs' blocks hold NaN
        before = routes.stats["route:gather_nccl"]
        try:
            with patch:
                got = torch.ops.flashoverlap.all_gather_gemm(a, b, bias, 0, world, gname, "ring", True)
        except errors.PeerFailure as exc:
            seen.append("peer" if "rank 1 (" in str(exc) else f"peer, not naming rank 1: {exc}")
            continue
        except RuntimeError as exc:
            seen.append("own" if "injected" in str(exc) else f"other: {exc}")
            continue
        blocks = [_blocks(y, ref, world) for y, ref in zip(got, want, strict=True)]
        lost = ["exact" if j != 1 else "nan" for j in range(world)]
        if routes.stats["route:gather_nccl"] != before + 1:
            seen.append(f"not the gather_nccl route: {dict(routes.stats)}")
        elif all(bl == ["exact"] * world for bl in blocks):
            seen.append("exact")
        elif all(bl == lost for bl in blocks):
            seen.append("nan-rows")
        else:
            seen.append(f"WRONG: {blocks}")
    try:
        routes.check()
        seen.append("check: none")
    except errors.FlashOverlapError as exc:
        seen.append(f"check: {exc}")
    return seen


@two_gpus
@pytest.mark.parametrize("mode", ["first", "last", "prepare"])
def test_one_rank_failing_reaches_every_rank(pool, mode):
    """Rank 1 raises its cause in the failed call; rank 0 returns exact outputs there (NaN in rank 1's rows when rank
    1 could not prepare: never other data) and raises ``PeerFailure`` naming rank 1 at the end of the next call (its
    check of the first call's outputs waited for that call's failure exchange), or in the failed call itself; the
    call after is exact on both, and ``routes.check()`` has nothing left, with no reset."""
    results = pool.run(failure_worker, mode)
    assert results[1] == ["own", "exact", "exact", "check: none"], results
    first = "nan-rows" if mode == "prepare" else "exact"
    assert results[0] in ([first, "peer", "exact", "check: none"], ["peer", "exact", "exact", "check: none"]), results


@two_gpus
def test_gather_nccl_route_matches_eager(pool):
    assert pool.run(gather_worker, 1) == [[], []]


@two_gpus
@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_sequence_parallel_block(pool, batch):
    assert pool.run(compiled_block_worker, batch) == [[], []]
