"""The NCCL route of ``all_gather_gemm`` (``routes/gather_nccl.py``) on >= 2 GPUs, one rank per GPU: results
against eager ``all_gather`` + ``torch.mm`` on fresh random bf16 data (gather dim 0 and 1, 1 and 3 weights, bias,
the gathered tensor), the route counted (so the test cannot pass on the unfused route), outputs pre-poisoned by
the caching allocator (NaN-filled blocks freed just before), and a compiled sequence-parallel MLP block whose
gathers the pass fused (2 GPUs); and on one GPU, the route's stream schedule with simulated ring steps."""

from __future__ import annotations

import pytest
import torch
from dist_utils import DistPool

TIMEOUT_S = 150.0


def _gpus() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - any failure to probe means: skip
        return 0


two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs >= 2 CUDA GPUs")


@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
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


@two_gpus
def test_gather_nccl_route_matches_eager(pool):
    assert pool.run(gather_worker, 1) == [[], []]


@two_gpus
@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_sequence_parallel_block(pool, batch):
    assert pool.run(compiled_block_worker, batch) == [[], []]
