"""GPU tests of the GEMM -> all_reduce pull route (``routes.reduce_pull``, ``all_reduce_route="pull"``: one
``fo_scatter_run`` per call, cuBLAS pieces, each rank's partial pushed by copy engine through the all_gather peer
route's protocol, one add per piece) with 2 ranks sharing one GPU (a gloo group,
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``): correctness and the shared protocol, not speed
(``examples/device/scatter_pull_bench.py --op all_reduce`` times it on 2 GPUs).

Skipped unless CUDA, an sm90 GPU and the library are present. Every call runs on fresh random bf16 data and is compared
with an fp64 reference of the sum of every rank's ``a @ b`` and with eager PyTorch's bf16 result (every rank's ``mm``,
summed); both ranks must hold the same bits; every call must count ``route:reduce_pull``. Covered: 2-D and 3-D ``a``,
1, 3 and 8 pieces (even cuts, cuts off 64 rows, and pieces shrinking towards the last), rows of 272 bytes (N 136:
pieces off a 256-byte boundary take the library's ``cublasGemmEx`` fallback), a receive buffer that grows, and the
same calls queued with no synchronization between them, interleaved with reduce_scatters on the pull route that share
the protocol's flags and slot sets.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import DistPool, gather_library_ready, gpu0_setup

LONG_MS = 60000.0

pytestmark = pytest.mark.skipif(not gather_library_ready(), reason="needs a CUDA sm90 GPU and the built library")


@pytest.fixture(scope="module")
def pool():
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "FLASHOVERLAP_TRANSPORT": "peer"}
    p = DistPool(2, env, timeout_s=300.0, backend="gloo", setup=gpu0_setup)
    yield p
    p.close()


# (a's shape on each rank, N): the fifth's output is 4 MiB of bf16 (the receive buffer grows); the sixth (64 MiB of
# output, K 4096) is cut into shrinking pieces at 2 pieces and more (cost_model.pull.piece_cuts), the rest evenly
SHAPES = [((256, 128), 384), ((4, 64, 256), 128), ((256, 128), 136), ((1024, 512), 1024), ((2048, 256), 1024),
          ((8192, 4096), 4096), ((256, 128), 384)]
UNEVEN = 5


def _inputs(seed: int, shape, n: int):
    import torch.distributed as dist

    gen = torch.Generator(device="cuda").manual_seed(seed * 100 + dist.get_rank())
    k = shape[-1]
    a = torch.randn(shape, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16().t()
    return a, w


def _check(out, a, w, what: str) -> None:
    """``out`` against the fp64 sum of every rank's ``a @ w`` and against eager bf16; both ranks' bits equal."""
    import torch.distributed as dist

    world = dist.get_world_size()
    flat = a.reshape(-1, a.shape[-1])
    both = torch.stack([(flat.double() @ w.double()).float().cpu(), torch.mm(flat, w).float().cpu()])
    parts = [torch.empty_like(both) for _ in range(world)]
    dist.all_gather(parts, both)
    ref, eager = (sum(p[i] for p in parts) for i in range(2))
    got = out.reshape(ref.shape).float().cpu()
    assert out.dtype == a.dtype and list(out.shape) == [*a.shape[:-1], w.shape[1]], (what, out.shape)
    assert bool(torch.isfinite(got).all()), (what, "not finite")
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    eager_err = ((eager.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1.5e-2 and err <= 2 * eager_err + 2e-3, (what, err, eager_err)
    outs = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(outs, got)
    assert all(torch.equal(o, outs[0]) for o in outs), (what, "the ranks' results differ")


def match_task(pieces: int) -> dict[str, int]:
    from flashoverlap_inductor import config, routes
    from flashoverlap_inductor.routes import reduce_pull

    routes.reset()
    g = torch.distributed.group.WORLD
    op = torch.ops.flashoverlap.gemm_all_reduce
    library_before = routes.stats["reduce:library"]
    with config.patch(wait_timeout_ms=LONG_MS, all_reduce_route="pull", all_reduce_pieces=pieces,
                      scatter_route="pull"):
        for seed, (shape, n) in enumerate(SHAPES):
            before = routes.stats["route:reduce_pull"]
            a, w = _inputs(seed, shape, n)
            out = op(a, w, None, "sum", g.group_name, "auto")
            torch.cuda.synchronize()
            routes.check()
            assert routes.stats["route:reduce_pull"] == before + 1, (shape, dict(routes.stats))
            if seed == UNEVEN and pieces == 3:  # the launch names its cuts: shrinking ones (8: even, a wave each)
                call = routes.Call("all_reduce", shape[0], n, shape[1], torch.bfloat16, 2, g.rank())
                cuts = reduce_pull.cuts_for(call, config.current())
                assert f"rows {cuts}" in routes.last_launch.description, routes.last_launch.description
                sizes = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
                assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] + 64, cuts
            _check(out, a, w, f"{shape} N={n} pieces={pieces}")
        synced = routes.stats["route:reduce_pull"]
        queued, scattered = [], []
        for i, (shape, n) in enumerate(SHAPES):  # queued, with pull-route reduce_scatters between them
            a, w = _inputs(1000 + i, shape, n)
            queued.append((a, w, op(a, w, None, "sum", g.group_name, "auto")))
            if i % 2 == 0:
                x, wt = _inputs(2000 + i, (128 + 64 * i, 256), 192)
                scattered.append((x, wt, torch.ops.flashoverlap.gemm_reduce_scatter(
                    x, wt, None, "sum", g.size(), g.group_name, "auto")))
        torch.cuda.synchronize()
        routes.check()
        for i, (a, w, out) in enumerate(queued):
            _check(out, a, w, f"queued case {i}")
        for x, wt, out in scattered:  # this rank's half of the summed rows
            full = [torch.empty(x.shape[0], wt.shape[1]) for _ in range(2)]
            torch.distributed.all_gather(full, (x.double() @ wt.double()).float().cpu())
            ref = sum(full)[g.rank() * out.shape[0]:(g.rank() + 1) * out.shape[0]]
            err = ((out.float().cpu() - ref).norm() / ref.norm()).item()
            assert err < 1.5e-2, ("reduce_scatter between", err)
    return {"synced": synced, "total": routes.stats["route:reduce_pull"],
            "library": routes.stats["reduce:library"] - library_before,
            "scatter": routes.stats["route:scatter_pull"]}


@pytest.mark.parametrize("pieces", [1, 3, 8])
def test_reduce_pull_matches_reference(pool, pieces):
    n = len(SHAPES)
    for r in pool.run(match_task, pieces):
        assert r["synced"] == n and r["total"] == 2 * n and r["library"] == 2 * n, r
        assert r["scatter"] == (n + 1) // 2, r


def off_task() -> list[str]:
    """``all_reduce_route="peer"`` and a call with a bias (under ``"pull"``): not this route."""
    from flashoverlap_inductor import config, routes

    routes.reset()
    g = torch.distributed.group.WORLD
    ran = []
    for route, bias in (("peer", False), ("pull", True)):
        a, w = _inputs(3000 + int(bias), (256, 128), 384)
        c = torch.zeros(384, device="cuda", dtype=torch.bfloat16) if bias else None
        before = dict(routes.stats)
        with config.patch(wait_timeout_ms=LONG_MS, all_reduce_route=route):
            torch.ops.flashoverlap.gemm_all_reduce(a, w, c, "sum", g.group_name, "auto")
        torch.cuda.synchronize()
        routes.check()
        ran += [k for k, v in routes.stats.items() if k.startswith("route:") and v > before.get(k, 0)]
    return ran


def test_off_and_bias_take_another_route(pool):
    for r in pool.run(off_task):
        assert "route:reduce_pull" not in r and len(r) == 2, r
