"""GPU tests of the overlapped fused ops on the NCCL route (``routes.nccl``) on 2 ranks with NCCL.

Skipped unless 2 CUDA devices, an sm90 GPU and the built library are present. Two spawned ranks (one NCCL process
group, reused by every test of this module, ``FLASHOVERLAP_TRANSPORT=nccl``) run each check; the route registry
(``routes.dispatch``) runs ``torch.ops.flashoverlap.*``. Every numeric check compares with an fp64
reference built from *all* ranks' inputs (each rank regenerates the others' from their seeds), next to eager
PyTorch's own error, on fresh random data; ``torch.use_deterministic_algorithms`` fills fresh outputs with NaN, so
rows the schedule never writes or receives fail. Covered: each op (bf16/fp16, ragged and tiny shapes, 3D and
expanded-bmm operands, both B layouts, bias, explicit/auto/stale plans), both GEMM grids (persistent, one CTA per
tile), both row orders of reduce_scatter / all_to_all layouts ("schedule", "gather"), uneven all_to_all with an
empty rank, the unfused fallbacks, 1000 repeated calls, ops in flight on one and on two streams, CUDA-graph
capture and replay, the timeout record, and compiled TP models (forward + backward, and ``mode="reduce-overhead"``).
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch
from dist_utils import DistPool

from flashoverlap_inductor import ops
from flashoverlap_inductor.native import kernels

WORLD = 2
TIMEOUT_S = 150.0  # per pool.run; the device script gives the whole file 210 s
DEVICE = "cuda"  # "cpu" only for the CPU dry run of these tasks in tests/test_tune_cpu.py (simulated kernels)


def _gpus_ready() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() >= WORLD and kernels.available()
    except Exception:  # noqa: BLE001 - any failure to probe means: skip
        return False


pytestmark = pytest.mark.skipif(not _gpus_ready(), reason="needs >= 2 CUDA GPUs (sm90) and the built library")


@pytest.fixture(scope="module")
def pool():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "FLASHOVERLAP_TRANSPORT": "nccl",  # this module tests the NCCL route; test_gpu_peer.py the peer route
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    p = DistPool(WORLD, env, timeout_s=TIMEOUT_S, backend="nccl", setup=_route_ops)
    yield p
    p.close()


# ----------------------------------------------------------------------------------------------- rank helpers


def _route_ops() -> None:
    """Each rank's setup: register ``torch.ops.flashoverlap.*`` (the route registry dispatches them)."""
    from flashoverlap_inductor import ops  # noqa: F401  (registers the ops)


def _nccl_launches() -> list:
    """The NCCL route's launches made so far (``routes.nccl.Launch``), one per call shape."""
    from flashoverlap_inductor import routes

    return [e.launches["nccl"] for e in list(routes._memo.values())
            if isinstance(e.launches.get("nccl"), routes.nccl.Launch)]


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _operands(seed: int, rank: int, form: str, rows: int, n: int, k: int, dtype: torch.dtype, layout: str,
              bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s (a, b, bias) for ``form``: "2d" a [rows,K]; "3d" a [4, rows/4, K]; "bmm_expand" the graph of
    ``x.transpose(0,1) @ w`` (permuted a, stride-0 expanded b). ``layout``: b as W.t() ("nk") or row-major ("kn")."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    if form == "2d":
        a = _rand(gen, rows, k, dtype=dtype)
    elif form == "3d":
        a = _rand(gen, 4, rows // 4, k, dtype=dtype)
    else:
        a = _rand(gen, rows // 4, 4, k, dtype=dtype).permute(1, 0, 2)
    w = (_rand(gen, n, k, dtype=dtype) / k ** 0.5).to(dtype)  # a Linear weight [N, K]
    b = w.t() if layout == "nk" else w.t().contiguous()  # b.stride() == (1, K), or row-major [K, N]
    if form == "bmm_expand":
        b = b.expand(4, k, n)
    c = _rand(gen, n, dtype=dtype) if bias else None
    return a, b, c


def _y64(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ b + bias`` in fp64 as flattened rows [rows, N]."""
    y = torch.matmul(a.double(), b.double())
    if bias is not None:
        y = y + bias.double()
    return y.reshape(-1, y.shape[-1])


def _eager(op: str, a, b, bias, outs=None, ins=None) -> torch.Tensor:
    """Eager PyTorch: aten GEMM then the dist collective (flattened rows; all_to_all splits count dim-0 elements of
    ``a``, i.e. ``a.shape[1]`` rows each for a 3D ``a``)."""
    import torch.distributed as dist

    y = (torch.matmul(a, b) if bias is None else torch.matmul(a, b) + bias).reshape(-1, b.shape[-1]).contiguous()
    world = dist.get_world_size()
    if op == "all_reduce":
        dist.all_reduce(y)
        return y
    if op == "reduce_scatter":
        out = y.new_empty(y.shape[0] // world, y.shape[1])
        ops.reduce_scatter_into(out, y)
        return out
    unit = a.shape[1] if a.dim() == 3 else 1
    out = y.new_empty(sum(outs) * unit if outs is not None else y.shape[0], y.shape[1])
    dist.all_to_all_single(out, y, None if outs is None else [x * unit for x in outs],
                           None if ins is None else [x * unit for x in ins])
    return out


def _reference(op: str, ys: list[torch.Tensor], rank: int, sends: list[list[int]] | None = None) -> torch.Tensor:
    """The collective in fp64 from every rank's flattened ``y``; ``sends[r][j]``: rows rank r sends to j."""
    if op == "all_reduce":
        return sum(ys)
    if op == "reduce_scatter":
        return sum(ys).chunk(len(ys))[rank]
    if sends is None:
        return torch.cat([y.chunk(len(ys))[rank] for y in ys])
    return torch.cat([ys[j][sum(sends[j][:rank]):sum(sends[j][:rank + 1])] for j in range(len(ys))])


def _call(op: str, a, b, bias, plan: str, outs=None, ins=None) -> torch.Tensor:
    import torch.distributed as dist

    name, fo = dist.group.WORLD.group_name, torch.ops.flashoverlap
    if op == "all_reduce":
        return fo.gemm_all_reduce(a, b, bias, "sum", name, plan)
    if op == "reduce_scatter":
        return fo.gemm_reduce_scatter(a, b, bias, "sum", dist.get_world_size(), name, plan)
    return fo.gemm_all_to_all(a, b, bias, outs, ins, name, plan)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double().reshape(ref.shape) - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(out: torch.Tensor, ref: torch.Tensor, eager: torch.Tensor, where: str) -> None:
    assert out.is_contiguous() and out.numel() == ref.numel(), f"{where}: shape {tuple(out.shape)}"
    if not torch.isfinite(out).all():  # poisoned by a recorded fault, or rows never written: say which
        from flashoverlap_inductor import routes

        bad = (~torch.isfinite(out.reshape(out.shape[0], -1))).any(dim=1).nonzero().flatten().tolist()
        try:
            routes.check()
            fault = "no fault recorded: rows never written or received"
        except Exception as exc:  # noqa: BLE001 - reported in the assertion
            fault = f"{type(exc).__name__}: {exc}"
        raise AssertionError(f"{where}: {len(bad)} of {out.shape[0]} rows non-finite (first {bad[:3]}, last "
                             f"{bad[-3:]}); {fault}")
    err, eager_err = _rel(out, ref), _rel(eager, ref)
    assert err < 1.5e-2 and err <= 2 * eager_err + 3e-3, f"{where}: rel err {err:.3g} (eager {eager_err:.3g})"


def _plan(kind: str, rows: int, n: int, op: str) -> str:
    from flashoverlap_inductor.schedule import plan as planlib

    align = 1 if op == "all_reduce" else WORLD
    if kind == "auto":
        return "auto"
    if kind == "multi":
        return planlib.uniform_plan(rows, n, 128, 256, 4, align=align).to_str()
    if kind == "tiles":  # uneven groups of whole tile-rows
        return planlib.plan_from_tile_row_counts(rows, n, 64, 256, [1, 3, 2, 5, 1]).to_str()
    return planlib.uniform_plan(rows + 256, n, 128, 256, 3).to_str()  # stale: ops falls back to a uniform plan


# ----------------------------------------------------------------------------------------------- rank tasks

SHAPES = [("2d", 1000, 776, 328), ("2d", 4096, 1024, 512), ("2d", 256, 264, 64), ("2d", 40, 264, 64),
          ("3d", 1000, 512, 256), ("bmm_expand", 1024, 512, 256)]


def match_eager_task(op: str, dtype_name: str) -> dict[str, int]:
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    rank, dtype = dist.get_rank(), getattr(torch, dtype_name)
    routes.reset()
    cases = fused_expected = 0
    torch.use_deterministic_algorithms(True)  # fresh outputs are NaN-filled
    try:
        for si, (form, rows, n, k) in enumerate(SHAPES):
            for layout in ("nk", "kn"):
                for kind, bias in (("multi", False), ("auto", True), ("tiles", True), ("stale", False)):
                    seed = zlib.crc32(repr((op, dtype_name, si, layout, kind)).encode()) % 10_000
                    args = [_operands(seed, r, form, rows, n, k, dtype, layout, bias) for r in range(WORLD)]
                    a, b, c = args[rank]
                    ref = _reference(op, [_y64(*x) for x in args], rank)
                    before = routes.stats[f"fused:{op}"]
                    out = _call(op, a, b, c, _plan(kind, rows, n, op))
                    fused = routes.stats[f"fused:{op}"] > before
                    where = f"{op} {dtype_name} {form} {rows}x{n}x{k} b={layout} bias={bias} plan={kind}"
                    _check(out, ref, _eager(op, a, b, c), where)
                    batched_a2a = op == "all_to_all" and b.dim() == 3  # runs unfused by design (rank-safe)
                    if kind == "multi" and rows >= 256:
                        assert fused != batched_a2a, f"{where}: fused={fused}, stats {dict(routes.stats)}"
                        fused_expected += 1
                    cases += 1
    finally:
        torch.use_deterministic_algorithms(False)
    routes.check()
    return {"cases": cases, "fused_expected": fused_expected, "fused": routes.stats[f"fused:{op}"]}


def route_task(op: str, grid: str, rows: str = "schedule") -> dict[str, int]:
    """``match_eager_task`` (bf16) under ``config.patch(gemm_grid=grid, row_order=rows)`` (the GEMM grid and the row
    order of reduce_scatter / all_to_all layouts); returns its counts plus how many NCCL-route launches (call
    shapes) took each row order ("natural": identity layout) and how many calls ran on the NCCL route."""
    from flashoverlap_inductor import config, routes

    routes.reset()
    try:
        with config.patch(gemm_grid=grid, row_order=rows):
            out = match_eager_task(op, "bfloat16")
            launches = _nccl_launches()
        out.update({r: sum(x.rows_route == r for x in launches) for r in ("natural", "schedule", "gather")})
        out["nccl"] = routes.stats["route:nccl"]
        return out
    finally:
        routes.reset()


def uneven_all_to_all_task() -> int:
    """Ranks with different rows, one with none; 2D and 3D; both B layouts; explicit and "auto" plans."""
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    rank = dist.get_rank()
    cases = 0
    torch.use_deterministic_algorithms(True)
    try:
        for ins_all in ([[384, 616], [700, 132]], [[256, 768], [0, 0]], [[0, 512], [512, 0]]):
            outs = [ins_all[j][rank] for j in range(WORLD)]
            for form in ("2d", "3d"):
                for layout in ("nk", "kn"):
                    unit = 4 if form == "3d" else 1  # 3d: a [dim0, 4, K]; splits count dim-0 elements
                    args = []
                    for r in range(WORLD):
                        gen = torch.Generator().manual_seed(700 + 10 * r + cases)
                        rows = sum(ins_all[r])
                        a = _rand(gen, rows, unit, 256, dtype=torch.bfloat16)
                        a = a.reshape(rows, 256) if form == "2d" else a
                        w = (_rand(gen, 512, 256, dtype=torch.bfloat16) / 16).to(torch.bfloat16)
                        args.append((a, w.t() if layout == "nk" else w.t().contiguous(), None))
                    a, b, _ = args[rank]
                    sends = [[s * unit for s in ins_all[r]] for r in range(WORLD)]
                    ref = _reference("all_to_all", [_y64(*x) for x in args], rank, sends)
                    ins = ins_all[rank]
                    out = _call("all_to_all", a, b, None, "auto", outs, ins)
                    _check(out, ref, _eager("all_to_all", a, b, None, outs, ins), f"a2a {ins_all} {form} {layout}")
                    cases += 1
    finally:
        torch.use_deterministic_algorithms(False)
    routes.check()
    assert routes.stats["fused:all_to_all"] > 0, dict(routes.stats)
    return cases


def fallback_task() -> dict[str, int]:
    """Unsupported calls run unfused (``routes.unfused``), correctly."""
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    rank = dist.get_rank()
    routes.reset()
    plan = _plan("multi", 512, 256, "all_reduce")
    cases = []
    args = [_operands(5, r, "2d", 512, 256, 128, torch.float32, "nk", True) for r in range(WORLD)]
    cases.append(("dtype", args, None))
    gens = [torch.Generator().manual_seed(9 + r) for r in range(WORLD)]
    bmm = [(_rand(g, 4, 128, 64, dtype=torch.bfloat16), _rand(g, 4, 64, 256, dtype=torch.bfloat16) / 8, None)
           for g in gens]
    cases.append(("bmm", bmm, None))
    full_bias = [(a, b, _rand(g, 512, 256, dtype=torch.bfloat16)) for (a, b, _), g in
                 zip([_operands(6, r, "2d", 512, 256, 128, torch.bfloat16, "nk", False) for r in range(WORLD)], gens,
                     strict=True)]
    cases.append(("bias_rows", full_bias, None))
    odd = [(_rand(g, 512, 100, dtype=torch.bfloat16), _rand(g, 100, 260, dtype=torch.bfloat16) / 10, None)
           for g in gens]
    cases.append(("alignment", odd, None))
    for reason, per_rank, _ in cases:
        a, b, c = per_rank[rank]
        ref = _reference("all_reduce", [_y64(*x) for x in per_rank], rank)
        before = routes.stats["unfused"], routes.stats["fused:all_reduce"]
        out = _call("all_reduce", a, b, c, plan if b.shape[-1] == 256 else "auto")
        _check(out, ref, _eager("all_reduce", a, b, c), reason)
        after = routes.stats["unfused"], routes.stats["fused:all_reduce"]
        assert after == (before[0] + 1, before[1]), (reason, dict(routes.stats))
        assert routes.stats[f"fallback:{reason}"] >= 1, (reason, dict(routes.stats))
    return dict(routes.stats)


def repeated_calls_task(calls: int) -> dict[str, int]:
    """``calls`` back-to-back calls of each op reuse one launch and one counter slot; results stay exact."""
    import torch.distributed as dist

    from flashoverlap_inductor import routes
    from flashoverlap_inductor.runtime import streams

    rank = dist.get_rank()
    routes.reset()
    out = {}
    for op in ("all_reduce", "reduce_scatter", "all_to_all"):
        args = [_operands(11, r, "2d", 512, 1024, 256, torch.bfloat16, "nk", True) for r in range(WORLD)]
        a, b, c = args[rank]
        plan = _plan("multi", 512, 1024, op)
        first = _call(op, a, b, c, plan).clone()
        for _ in range(calls - 1):
            last = _call(op, a, b, c, plan)
        routes.check()
        assert _rel(last, first.double()) < 1e-3, f"{op}: call {calls} differs from call 1"
        _check(last, _reference(op, [_y64(*x) for x in args], rank), first, f"{op} after {calls} calls")
        out[op] = routes.stats[f"fused:{op}"]
    res = streams.resources(torch.cuda.current_device())
    assert len(_nccl_launches()) == 3 and len(res.slots) >= 1
    return out


IN_FLIGHT = [("all_reduce", 1024, 512, 256), ("reduce_scatter", 2048, 1024, 512), ("all_to_all", 1536, 768, 256)]


def in_flight_task() -> int:
    """Three fused ops queued without a sync in between, then two at once on two user streams."""
    import torch.distributed as dist

    rank = dist.get_rank()
    data = []
    for i, (op, rows, n, k) in enumerate(IN_FLIGHT):
        args = [_operands(20 + i, r, "2d", rows, n, k, torch.bfloat16, "nk", i == 1) for r in range(WORLD)]
        data.append((op, args, _plan("multi", rows, n, op), _reference(op, [_y64(*x) for x in args], rank)))
    outs = [_call(op, *args[rank], plan) for op, args, plan, _ in data]  # queued back to back
    torch.cuda.synchronize()
    for (op, args, _, ref), out in zip(data, outs, strict=True):
        _check(out, ref, _eager(op, *args[rank]), f"{op} in flight")
    cur = torch.cuda.current_stream()
    streams_ = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams_:
        s.wait_stream(cur)
    results = []
    for rep in range(3):
        for j, (op, args, plan, _) in enumerate(data):
            with torch.cuda.stream(streams_[(j + rep) % 2]):
                results.append((j, _call(op, *args[rank], plan)))
    for s in streams_:
        cur.wait_stream(s)
    torch.cuda.synchronize()
    for j, out in results:
        op, args, _, ref = data[j]
        _check(out, ref, _eager(op, *args[rank]), f"{op} on two streams")
    from flashoverlap_inductor import routes

    routes.check()
    return len(results)


def graph_task(op: str) -> int:
    """Capture one fused call in a CUDA graph, replay it on new data (copied into the static inputs)."""
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    rank = dist.get_rank()
    plan = _plan("multi", 1024, 512, op)
    args = [_operands(30, r, "2d", 1024, 512, 256, torch.bfloat16, "nk", True) for r in range(WORLD)]
    a, b, c = (x.clone() for x in args[rank])
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(2):
            _call(op, a, b, c, plan)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    captured = routes.stats["captured"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(op, a, b, c, plan)
    assert routes.stats["captured"] == captured + 1, "the capture took the unfused path"
    for rep in range(3):
        fresh = [_operands(31 + rep, r, "2d", 1024, 512, 256, torch.bfloat16, "nk", True) for r in range(WORLD)]
        a.copy_(fresh[rank][0])
        graph.replay()
        torch.cuda.synchronize()
        routes.check()
        ref = _reference(op, [_y64(x[0], args[r][1], args[r][2]) for r, x in enumerate(fresh)], rank)
        eager = _eager(op, fresh[rank][0], b, c)
        _check(out, ref, eager, f"{op} graph replay {rep}")
    return 3


def timeout_record_task() -> str:
    """A recorded fault (the slot's mirror) makes the next call raise (before any communication), then clears."""
    from flashoverlap_inductor import routes
    from flashoverlap_inductor.runtime import streams

    a, b, c = _operands(40, 0, "2d", 512, 256, 128, torch.bfloat16, "nk", False)
    plan = _plan("multi", 512, 256, "all_reduce")
    _call("all_reduce", a, b, c, plan)
    torch.cuda.synchronize()
    from flashoverlap_inductor.runtime import faults

    streams.resources(torch.cuda.current_device())
    dom = next(d for d in faults._domains.values() if d.route == "nccl")  # the slot the call ran on
    dom.mirror[0], dom.mirror[1], dom.mirror[3] = 1, 2, 99  # as the fault kernel mirrors a timed-out wait
    with pytest.raises(kernels.FlashOverlapTimeout, match="wave group 2 .saw 0, waited for 99"):
        _call("all_reduce", a, b, c, plan)
    assert not dom.pending()  # cleared: the next call runs
    out = _call("all_reduce", a, b, c, plan)
    torch.cuda.synchronize()
    routes.check()
    return f"ok {tuple(out.shape)}"


def _force_plans(groups: int):
    """Patch ``cost_model.decide`` so the pass fuses with ``groups`` uniform groups (small test shapes would get
    one group, i.e. the unfused path); returns the original."""
    import dataclasses

    import torch.distributed as dist

    from flashoverlap_inductor import cost_model
    from flashoverlap_inductor.schedule import plan as planlib

    real = cost_model.decide

    def decide(collective, m, n, k, dtype, world_size, **kw):
        d = real(collective, m, n, k, dtype, world_size, **kw)
        align = 1 if collective == "all_reduce" else dist.get_world_size()
        return dataclasses.replace(d, fuse=True, plan=planlib.uniform_plan(m, n, 128, 256, groups, align=align))
    cost_model.decide = decide
    return real


def compiled_training_task() -> dict[str, Any]:
    """A TP block compiled with the flashoverlap backend, forward and backward, against eager: the forward's
    mm -> all_reduce and the backward's grad mm -> all_reduce are both fused and run overlapped."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from flashoverlap_inductor import cost_model, routes
    from flashoverlap_inductor.backend import flashoverlap_backend
    from flashoverlap_inductor.passes import counters, reset_counters

    rank, group = dist.get_rank(), dist.group.WORLD
    torch._dynamo.reset()
    reset_counters()
    routes.reset()

    def block(x0, w):
        x = funcol.all_reduce(x0 * 0.5, "sum", group)  # backward: an all_reduce of the input gradient
        return funcol.all_reduce(x @ w.t(), "sum", group)

    gen = torch.Generator().manual_seed(50 + rank)
    x0 = _rand(gen, 4, 128, 256, dtype=torch.bfloat16)
    w = (_rand(gen, 512, 256, dtype=torch.bfloat16) / 16).to(torch.bfloat16)
    seed = _rand(gen, 4, 128, 512, dtype=torch.bfloat16)
    real = _force_plans(4)
    try:
        compiled = torch.compile(block, backend=flashoverlap_backend, options={"flashoverlap.fuse": "always"})
        results = []
        for fn in (block, compiled):
            xg, wg = x0.clone().requires_grad_(), w.clone().requires_grad_()
            out = fn(xg, wg)
            out = out.wait() if hasattr(out, "wait") else out
            (out.float() * seed.float()).sum().backward()
            results.append((out.detach(), xg.grad, wg.grad))
    finally:
        cost_model.decide = real
    torch.cuda.synchronize()
    routes.check()
    for name, got, ref in zip(("out", "x.grad", "w.grad"), results[1], results[0], strict=True):
        err = _rel(got, ref.double())
        assert torch.isfinite(got).all() and err < 2e-2, f"compiled {name}: rel err {err:.3g} vs eager"
    fused = counters["fused:all_reduce"]
    assert fused >= 2, f"expected the forward and backward all_reduce fused, counters {dict(counters)}"
    assert routes.stats["fused:all_reduce"] >= 2, dict(routes.stats)
    return {"fused": fused, "runtime": dict(routes.stats)}


def compiled_cudagraph_task() -> dict[str, Any]:
    """``mode="reduce-overhead"``: the fused op is captured into Inductor's CUDA graphs and replays correctly."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from flashoverlap_inductor import cost_model, routes
    from flashoverlap_inductor.backend import flashoverlap_backend
    from flashoverlap_inductor.passes import counters, reset_counters

    rank, group = dist.get_rank(), dist.group.WORLD
    torch._dynamo.reset()
    reset_counters()
    routes.reset()

    def layer(x, w):
        return torch.relu(funcol.all_reduce(x @ w.t(), "sum", group)) + 1.0

    gen = torch.Generator().manual_seed(60 + rank)
    w = (_rand(gen, 512, 256, dtype=torch.bfloat16) / 16).to(torch.bfloat16)
    real = _force_plans(4)
    try:
        compiled = torch.compile(layer, backend=flashoverlap_backend, mode="reduce-overhead")
        with torch.no_grad():
            for step in range(4):
                x = _rand(torch.Generator().manual_seed(70 + 10 * step + rank), 1024, 256, dtype=torch.bfloat16)
                got = compiled(x, w).clone()
                ref = layer(x, w)
                ref = ref.wait() if hasattr(ref, "wait") else ref
                torch.cuda.synchronize()
                err = _rel(got, ref.double())
                assert torch.isfinite(got).all() and err < 2e-2, f"step {step}: rel err {err:.3g}"
    finally:
        cost_model.decide = real
    routes.check()
    assert counters["fused:all_reduce"] >= 1, dict(counters)
    assert routes.stats["captured"] >= 1, f"the fused op was never captured: {dict(routes.stats)}"
    return dict(routes.stats)


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_to_all"])
def test_ops_match_eager(pool, op, dtype_name):
    per_rank = pool.run(match_eager_task, op, dtype_name)
    expected = len(SHAPES) * 2 * 4
    assert [r["cases"] for r in per_rank] == [expected] * WORLD
    assert all(r["fused"] >= r["fused_expected"] > 0 for r in per_rank), per_rank


@pytest.mark.parametrize("grid", ["persistent", "tiles"])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_to_all"])
def test_gemm_grids_match_eager(pool, op, grid):
    per_rank = pool.run(route_task, op, grid)
    assert all(r["fused"] >= r["fused_expected"] > 0 for r in per_rank), per_rank
    for r in per_rank:
        assert r["nccl"] == r["fused"], per_rank  # FLASHOVERLAP_TRANSPORT=nccl: every fused call on the NCCL route
        assert r["gather"] == 0 and (r["schedule"] > 0) == (op != "all_reduce"), per_rank


@pytest.mark.parametrize("op", ["reduce_scatter", "all_to_all"])
def test_gather_row_order_matches_eager(pool, op):
    per_rank = pool.run(route_task, op, "tiles", "gather")
    assert all(r["fused"] >= r["fused_expected"] > 0 for r in per_rank), per_rank
    assert all(r["schedule"] == 0 and r["gather"] > 0 for r in per_rank), per_rank


def test_uneven_all_to_all(pool):
    assert pool.run(uneven_all_to_all_task) == [12] * WORLD


def test_unsupported_calls_fall_back_correctly(pool):
    pool.run(fallback_task)


def test_1000_repeated_calls(pool):
    per_rank = pool.run(repeated_calls_task, 1000)
    assert all(v >= 1000 for r in per_rank for v in r.values()), per_rank


def test_ops_in_flight(pool):
    assert pool.run(in_flight_task) == [9] * WORLD


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_to_all"])
def test_cuda_graph_capture_and_replay(pool, op):
    assert pool.run(graph_task, op) == [3] * WORLD


def test_timeout_record_raises_on_next_call(pool):
    pool.run(timeout_record_task)


def test_compiled_tp_block_forward_and_backward(pool):
    per_rank = pool.run(compiled_training_task, timeout_s=200.0)
    assert all(r["fused"] >= 2 for r in per_rank), per_rank


def test_compiled_reduce_overhead_cudagraphs(pool):
    pool.run(compiled_cudagraph_task, timeout_s=200.0)
