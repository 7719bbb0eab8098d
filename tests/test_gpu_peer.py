"""GPU tests of the peer route (``routes.peer``: the two-rank reduction inside GEMM 2's epilogue).

Skipped unless 2 CUDA devices, an sm90 GPU and a library with ``_addc`` configurations are present. Every check
compares with an fp64 reference built from both ranks' inputs, next to eager PyTorch's own error, on fresh random
data; fresh outputs are NaN-filled (``torch.use_deterministic_algorithms``), so rows never written fail. Covered:
the ``_addc`` GEMM alone, both ops on ragged and tiny shapes with and without bias, long queues of calls that reuse
the one workspace and grow it, calls that cannot take the route (fp16, B row-major, odd rows) taking the NCCL route
instead, ops in flight on one and on two streams (ordered one after another), CUDA graphs holding peer calls replayed
between eager calls and after the workspace grew, a compiled TP block forward and backward, the same under
``mode="reduce-overhead"``, and a peer that skips a call (a bounded wait, then ``FlashOverlapTimeout`` on both
ranks; with no reset, the next call resynchronizes the group and is correct).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import DistPool
from test_gpu_ops import (
    IN_FLIGHT,
    WORLD,
    _call,
    _check,
    _eager,
    _operands,
    _reference,
    _rel,
    _route_ops,
    _y64,
    compiled_cudagraph_task,
    compiled_training_task,
    in_flight_task,
)

from flashoverlap_inductor.native import kernels


def _peer_ready() -> bool:
    try:
        return (torch.cuda.is_available() and torch.cuda.device_count() >= WORLD and kernels.available()
                and bool(kernels.configs(add_c=1)))
    except Exception:  # noqa: BLE001 - any failure to probe means: skip
        return False


pytestmark = pytest.mark.skipif(not _peer_ready(), reason="needs >= 2 sm90 GPUs and a library with _addc configs")


@pytest.fixture(scope="module")
def pool():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "FLASHOVERLAP_TRANSPORT": "peer", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "FLASHOVERLAP_SCATTER_ROUTE": "peer"}  # reduce_scatter on the peer route (auto: mostly the pull route)
    p = DistPool(WORLD, env, timeout_s=150.0, backend="nccl", setup=_route_ops)
    yield p
    p.close()


SHAPES = [(4096, 1024, 512), (1000, 776, 328), (256, 264, 64), (40, 264, 64), (2048, 2048, 1024)]


def peer_match_task(op: str, how: str = "default") -> dict[str, int]:
    """Each shape with and without bias, then calls that cannot take the route; every result checked. ``how``:
    GEMM 2's configuration for all_reduce: "default" (by push where compiled), "pull" (the first ``_addc``, through
    ``config.patch(peer_kernel=...)``), or "auxr" (push, aux stored from registers)."""
    import torch.distributed as dist

    from flashoverlap_inductor import config, routes

    assert config.current().transport == "peer"
    rank = dist.get_rank()
    level = {"default": None, "pull": 1, "auxr": 3}[how]
    routes.reset()
    torch.use_deterministic_algorithms(True)
    try:
        with config.patch(peer_kernel=kernels.configs(add_c=level)[0].name if level else None):
            for i, (rows, n, k) in enumerate(SHAPES):
                for bias in (False, True):
                    args = [_operands(31 + 7 * i + bias, r, "2d", rows, n, k, torch.bfloat16, "nk", bias)
                            for r in range(WORLD)]
                    a, b, c = args[rank]
                    out = _call(op, a, b, c, "auto")
                    _check(out, _reference(op, [_y64(*x) for x in args], rank), _eager(op, a, b, c),
                           f"peer {op} {rows}x{n}x{k} bias={bias}")
            peer_calls = routes.stats["route:peer"]
            pushes = sum(launch.push for e in list(routes._memo.values()) for launch in e.launches.values()
                         if isinstance(launch, routes.peer.PeerLaunch))
            for rows, dtype, layout in ((1024, torch.float16, "nk"), (1024, torch.bfloat16, "kn"),
                                        (1001, torch.bfloat16, "nk")):
                if op == "reduce_scatter" and rows % 2:
                    continue
                args = [_operands(5, r, "2d", rows, 512, 256, dtype, layout, False) for r in range(WORLD)]
                a, b, c = args[rank]
                out = _call(op, a, b, c, "auto")
                _check(out, _reference(op, [_y64(*x) for x in args], rank), _eager(op, a, b, c),
                       f"nccl route {op} {rows} {dtype} {layout}")
    finally:
        torch.use_deterministic_algorithms(False)
    routes.check()
    return {"push": pushes,  # launches by push among the shapes above (the calls after may add their own)
            "peer": peer_calls, "after": routes.stats["route:peer"], "nccl": routes.stats["route:nccl"]}


def _route_settings(how: str):
    """The settings of ``how`` (a context manager): "push" (the defaults) or "arpull" (all_reduce by copy groups
    instead of GEMM 2's aux push: ``peer_kernel`` names the first plain ``_addc`` configuration)."""
    from flashoverlap_inductor import config

    return config.patch(peer_kernel=kernels.configs(add_c=1)[0].name if how == "arpull" else None)


def queued_calls_task(calls: int, how: str) -> int:
    """``calls`` calls without a sync, fresh data each, both ops, a small and a large shape (a larger workspace is
    made mid-way): each result checked after the last call (a call overwriting what the peer still reads would show
    here). ``how``: ``_route_settings``."""
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    rank = dist.get_rank()
    routes.reset()
    pending = []
    with _route_settings(how):
        for i in range(calls):
            op = ("all_reduce", "reduce_scatter")[i % 2]
            rows, n, k = (512, 1024, 256) if i < calls // 2 else (2048, 4096, 512)
            args = [_operands(1000 + i, r, "2d", rows, n, k, torch.bfloat16, "nk", i % 3 == 0) for r in range(WORLD)]
            a, b, c = args[rank]
            pending.append((op, args, _call(op, a, b, c, "auto")))
    routes.check()
    for i, (op, args, out) in enumerate(pending):
        a, b, c = args[rank]
        _check(out, _reference(op, [_y64(*x) for x in args], rank), _eager(op, a, b, c), f"call {i} {op}")
    return _route_calls()


def _route_calls() -> int:
    """Calls on the peer or the ring route so far (a pool started with ``FLASHOVERLAP_RING=all`` runs the ring)."""
    from flashoverlap_inductor import routes

    return routes.stats["route:peer"] + routes.stats["route:ring"]


def _captured() -> int:
    """Calls on the peer or the ring route captured into CUDA graphs so far."""
    from flashoverlap_inductor import routes

    return routes.stats["captured:peer"] + routes.stats["captured:ring"]


def _workspaces_made() -> int:
    """Workspaces of the peer and the ring route made so far (none is freed before ``routes.reset``)."""
    from flashoverlap_inductor import routes

    return sum(map(len, routes.peer._workspaces.values())) + sum(map(len, routes.ring._workspaces.values()))


def peer_graph_task(how: str) -> dict[str, int]:
    """CUDA graphs holding peer calls: one with a single reduce_scatter (an odd number of calls per replay), one with
    an all_reduce then a reduce_scatter. Replayed back to back and between eager calls of the same ops, fresh data
    before every replay, nothing synchronized until the end; then an eager call needs a larger workspace and both
    graphs replay once more (on the workspace they captured). Every output is checked after the last call. ``how``:
    ``_route_settings``."""
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    rank = dist.get_rank()
    routes.reset()
    shapes = {"rs": ("reduce_scatter", 1024, 512, 256, True), "ar": ("all_reduce", 768, 1024, 256, False),
              "rs2": ("reduce_scatter", 512, 512, 128, False), "big": ("all_reduce", 4096, 4096, 256, True)}
    seeds = iter(range(5000, 6000))

    def operands(name):
        _, rows, n, k, bias = shapes[name]
        return [_operands(next(seeds), r, "2d", rows, n, k, torch.bfloat16, "nk", bias) for r in range(WORLD)]

    with _route_settings(how):
        init = {name: operands(name) for name in ("rs", "ar", "rs2")}
        static = {name: [x.clone() if x is not None else None for x in args[rank]] for name, args in init.items()}
        for name in static:  # eager first: the launches and the workspace exist before the capture
            _call(shapes[name][0], *static[name], "auto")
        torch.cuda.synchronize()
        before = _captured()
        graphs = {"g1": (torch.cuda.CUDAGraph(), ["rs"]), "g2": (torch.cuda.CUDAGraph(), ["ar", "rs2"])}
        outs = {}
        for graph, names in graphs.values():
            with torch.cuda.graph(graph):
                for name in names:
                    outs[name] = _call(shapes[name][0], *static[name], "auto")
        captured = _captured() - before
        made = _workspaces_made()
        schedule = ["g1", "g1", "rs", "g2", "g1", "ar", "g2", "g2", "g1", "big", "g1", "g2", "rs2"]
        fresh = [{name: operands(name) for name in (graphs[s][1] if s in graphs else [s])} for s in schedule]
        pending = []
        for step, data in zip(schedule, fresh, strict=True):
            if step in graphs:
                for name, args in data.items():
                    static[name][0].copy_(args[rank][0])
                graphs[step][0].replay()
                for name, args in data.items():
                    used = [(args[r][0], *init[name][r][1:]) for r in range(WORLD)]  # fresh a, captured b and bias
                    pending.append((f"{step}:{name}", shapes[name][0], used, outs[name].clone()))
            else:
                args = data[step]
                pending.append((f"eager:{step}", shapes[step][0], args, _call(shapes[step][0], *args[rank], "auto")))
        torch.cuda.synchronize()
        routes.check()
        for where, op, args, out in pending:
            _check(out, _reference(op, [_y64(*x) for x in args], rank), _eager(op, *args[rank]), where)
        return {"captured": captured, "grown": _workspaces_made() - made, "peer": _route_calls()}


def fresh_reduce_overhead_task() -> dict:
    """``compiled_cudagraph_task`` in a process whose peer route starts afresh: the flag page and the workspace are
    made inside torch.compile's CUDA-graph warm-up (symmetric memory must stay out of the graph's pool)."""
    from flashoverlap_inductor import routes

    torch.cuda.synchronize()
    routes.reset()
    return compiled_cudagraph_task()


def missing_peer_task() -> dict:
    """Rank 1 skips a call: rank 0's bounded wait gives up, and both ranks' checks raise (rank 0's wait wrote the
    fault into rank 1's block too). The flags are a call apart then, and nobody resets: the next call resynchronizes
    the group first on both ranks, then it and the one after are correct."""
    import torch.distributed as dist

    from flashoverlap_inductor import config, routes

    rank = dist.get_rank()
    routes.reset()
    a, b, c = _operands(3, rank, "2d", 512, 512, 256, torch.bfloat16, "nk", False)
    # Both ranks, under the short timeout: the workspace exists, the ranks agreed on this call shape and settings
    # (the agreement is a collective, made once per shape: a rank alone with a new shape would wait in it), and
    # both are in step.
    with config.patch(wait_timeout_ms=200.0):
        _call("all_reduce", a, b, c, "auto")
    routes.check()
    dist.barrier()
    if rank == 0:
        with config.patch(wait_timeout_ms=200.0):  # the same launch, now without the peer
            _call("all_reduce", a, b, c, "auto")
    torch.cuda.synchronize()
    dist.barrier()  # rank 0's wait gave up and recorded the fault in both blocks
    outcome = "no timeout"
    try:
        routes.check()
    except kernels.FlashOverlapTimeout as exc:
        outcome = "timeout: " + str(exc)[:40]
    dist.barrier()
    ys = [_y64(*_operands(3, r, "2d", 512, 512, 256, torch.bfloat16, "nk", False)) for r in range(WORLD)]
    for _ in range(2):  # no reset: the first call resynchronizes the group before it runs
        out = _call("all_reduce", a, b, c, "auto")
        routes.check()
        assert _rel(out, _reference("all_reduce", ys, rank)) < 1.5e-2
    return {"outcome": outcome, "resyncs": routes.stats["resync"]}


@pytest.mark.parametrize("op,how", [("all_reduce", "default"), ("all_reduce", "pull"), ("all_reduce", "auxr"),
                                    ("reduce_scatter", "default")])
def test_peer_route_matches_eager(pool, op, how):
    if how == "auxr" and not kernels.configs(add_c=3):
        pytest.skip("no _addc_auxr configuration compiled")
    per_rank = pool.run(peer_match_task, op, how)
    # one launch per shape and bias (the memo keys on the bias), each by push where an _addc_aux configuration exists
    pushes = 2 * len(SHAPES) if op == "all_reduce" and how != "pull" and (kernels.configs(add_c=2) or
                                                                          kernels.configs(add_c=3)) else 0
    for r in per_rank:
        assert r["peer"] == 2 * len(SHAPES), per_rank  # every shape took the peer route
        # fp16 (no _addc kernel) and odd rows take the NCCL route; B row-major takes the peer route only where an
        # _addc configuration is compiled for it
        assert r["after"] >= r["peer"] and r["nccl"] >= 1, per_rank
        assert r["push"] == pushes, per_rank


@pytest.mark.parametrize("how", ["push", "arpull"])
def test_peer_route_queued_calls_and_growth(pool, how):
    assert pool.run(queued_calls_task, 40, how) == [40] * WORLD


@pytest.mark.parametrize("how", ["push", "arpull"])
def test_peer_route_cuda_graphs_between_eager_calls(pool, how):
    per_rank = pool.run(peer_graph_task, how)
    # on the route: 3 eager calls before the capture, 3 captured, 4 eager between the replays (a replay runs no host
    # code, so it counts nothing); one larger workspace made after the capture
    assert per_rank == [{"captured": 3, "grown": 1, "peer": 10}] * WORLD, per_rank


def test_peer_route_compiled_reduce_overhead(pool):
    per_rank = pool.run(fresh_reduce_overhead_task, timeout_s=200.0)
    assert all(r.get("captured:peer", 0) >= 1 and not r.get("captured", 0) > r.get("captured:peer", 0)
               for r in per_rank), per_rank


def test_peer_route_missing_peer_times_out(pool):
    per_rank = pool.run(missing_peer_task)
    assert all(r["outcome"].startswith("timeout") and r["resyncs"] == 1 for r in per_rank), per_rank


def peer_in_flight_task() -> dict[str, int]:
    """``in_flight_task`` (three ops queued, then the same on two streams, three times over) from fresh counters."""
    from flashoverlap_inductor import routes

    routes.reset()
    calls = in_flight_task()
    return {"calls": calls, "peer": _route_calls(), "nccl": routes.stats["route:nccl"]}


def test_peer_route_ops_in_flight(pool):
    # every all_reduce / reduce_scatter call takes the peer route, the two-stream ones too (ordered, not skipped);
    # only all_to_all (no peer route) takes the NCCL route
    peer_calls = 4 * sum(op in ("all_reduce", "reduce_scatter") for op, *_ in IN_FLIGHT)
    nccl_calls = 4 * sum(op == "all_to_all" for op, *_ in IN_FLIGHT)
    assert pool.run(peer_in_flight_task) == [{"calls": 9, "peer": peer_calls, "nccl": nccl_calls}] * WORLD


def test_peer_route_compiled_tp_block_forward_and_backward(pool):
    per_rank = pool.run(compiled_training_task, timeout_s=200.0)
    # the forward's mm -> all_reduce takes the peer route (B = W.t()); the backward's grad @ W has B row-major, which
    # takes it too where an _addc configuration is compiled for that layout (else the NCCL route)
    assert all(r["fused"] >= 2 and r["runtime"].get("route:peer", 0) >= 1 for r in per_rank), per_rank
