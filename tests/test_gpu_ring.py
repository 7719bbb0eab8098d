"""GPU tests of the ring route (``routes.ring``: partial sums travel around the ranks, added in the GEMM steps'
epilogues) on 2 GPUs, where the pool runs it in place of the peer route (``FLASHOVERLAP_RING=all``).

Skipped unless 2 CUDA devices, an sm90 GPU and a library with ``_addc`` configurations are present. Every check
compares with an fp64 reference built from all ranks' inputs, next to eager PyTorch's own error, on fresh random
data, into NaN-filled outputs. Covered: both ops over ragged shapes (pieces that are not tile multiples), 1, 2 and 4
rounds; shapes the ring cannot cut taking the NCCL route; 40 queued calls
that grow the workspace; CUDA graphs replayed between eager calls; ops in flight on two streams; a compiled TP block
under ``mode="reduce-overhead"``; a rank that skips a call (a bounded wait, then ``FlashOverlapTimeout`` on both
ranks; the next call resynchronizes the ring with no reset and is correct). More than
two ranks: ``examples/device/ring_probe4.py`` (4 processes on 2 GPUs, for correctness only).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import DistPool
from test_gpu_ops import IN_FLIGHT, WORLD, _call, _check, _eager, _operands, _reference, _route_ops, _y64
from test_gpu_peer import (
    _peer_ready,
    fresh_reduce_overhead_task,
    missing_peer_task,
    peer_graph_task,
    peer_in_flight_task,
    queued_calls_task,
)

pytestmark = pytest.mark.skipif(not _peer_ready(), reason="needs >= 2 sm90 GPUs and a library with _addc configs")


@pytest.fixture(scope="module")
def pool():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "FLASHOVERLAP_TRANSPORT": "peer", "FLASHOVERLAP_RING": "all",
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    p = DistPool(WORLD, env, timeout_s=150.0, backend="nccl", setup=_route_ops)
    yield p
    p.close()


# (rows, n, k): the ring takes every one but the last (40 rows cut into pieces of fewer than 128 rows)
SHAPES = [(4096, 1024, 512), (1000, 776, 328), (512, 264, 64), (2048, 2048, 1024), (40, 264, 64)]


def ring_match_task(op: str, rounds: int) -> dict[str, int]:
    """Each shape with and without bias, then fp16 (no _addc configuration here) and B row-major; every result
    checked against the reference. Runs under ``config.patch(ring_rounds=rounds)``."""
    import torch.distributed as dist

    from flashoverlap_inductor import config, routes

    assert config.current().ring == "all"
    rank = dist.get_rank()
    routes.reset()
    torch.use_deterministic_algorithms(True)
    try:
        with config.patch(ring_rounds=rounds):
            for i, (rows, n, k) in enumerate(SHAPES):
                for bias in (False, True):
                    args = [_operands(71 + 5 * i + bias, r, "2d", rows, n, k, torch.bfloat16, "nk", bias)
                            for r in range(WORLD)]
                    a, b, c = args[rank]
                    _check(_call(op, a, b, c, "auto"), _reference(op, [_y64(*x) for x in args], rank),
                           _eager(op, a, b, c), f"ring {op} {rows}x{n}x{k} bias={bias} rounds={rounds}")
            ring_calls = routes.stats["route:ring"]
            for dtype, layout in ((torch.float16, "nk"), (torch.bfloat16, "kn")):
                args = [_operands(9, r, "2d", 1024, 512, 256, dtype, layout, False) for r in range(WORLD)]
                a, b, c = args[rank]
                _check(_call(op, a, b, c, "auto"), _reference(op, [_y64(*x) for x in args], rank),
                       _eager(op, a, b, c), f"after {op} {dtype} {layout}")
        rounds_used = sorted({launch.rounds for e in list(routes._memo.values())
                              for launch in e.launches.values() if isinstance(launch, routes.ring.RingLaunch)})
    finally:
        torch.use_deterministic_algorithms(False)
    routes.check()
    return {"ring": ring_calls, "peer": routes.stats["route:peer"], "nccl": routes.stats["route:nccl"],
            "unfused": sum(v for key, v in routes.stats.items() if key.startswith("fallback:")),
            "rounds": rounds_used}


@pytest.mark.parametrize("op,rounds", [("all_reduce", 2), ("all_reduce", 1), ("all_reduce", 4),
                                       ("reduce_scatter", 1)])
def test_ring_route_matches_eager(pool, op, rounds):
    per_rank = pool.run(ring_match_task, op, rounds)
    for r in per_rank:
        assert r["ring"] == 2 * (len(SHAPES) - 1) and r["peer"] == 0, per_rank  # never the two-rank peer route
        # 40 rows (twice: one group, nothing to overlap, so unfused) and fp16 (no _addc configuration: NCCL route)
        assert r["nccl"] >= 1 and r["nccl"] + r["unfused"] >= 3, per_rank
        # all_reduce: the most rounds up to the setting that cut equal pieces of >= 128 rows (with 4: 1000 and 512
        # rows in 2 rounds, the others in 4)
        assert r["rounds"] == {("all_reduce", 2): [2], ("all_reduce", 4): [2, 4]}.get((op, rounds), [1]), r


def test_ring_route_queued_calls_and_growth(pool):
    assert pool.run(queued_calls_task, 40, "push") == [40] * WORLD


def test_ring_route_cuda_graphs_between_eager_calls(pool):
    per_rank = pool.run(peer_graph_task, "push")
    assert per_rank == [{"captured": 3, "grown": 1, "peer": 10}] * WORLD, per_rank


def test_ring_route_ops_in_flight(pool):
    ring_calls = 4 * sum(op in ("all_reduce", "reduce_scatter") for op, *_ in IN_FLIGHT)
    nccl_calls = 4 * sum(op == "all_to_all" for op, *_ in IN_FLIGHT)  # all_to_all has no ring route
    assert pool.run(peer_in_flight_task) == [{"calls": 9, "peer": ring_calls, "nccl": nccl_calls}] * WORLD


def test_ring_route_compiled_reduce_overhead(pool):
    per_rank = pool.run(fresh_reduce_overhead_task, timeout_s=200.0)
    assert all(r.get("route:ring", 0) >= 1 and r.get("captured:ring", 0) >= 1 for r in per_rank), per_rank


def test_ring_route_missing_peer_times_out(pool):
    per_rank = pool.run(missing_peer_task)
    assert all(r["outcome"].startswith("timeout") and r["resyncs"] == 1 for r in per_rank), per_rank
