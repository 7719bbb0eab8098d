"""Op-level benchmark of the fused GEMM + collective ops against every baseline, on W GPUs of one host.

    torchrun --nproc_per_node=4 examples/bench_ops.py --json bench_w4.json --png bench_w4.png
        [--ops all_reduce,reduce_scatter,all_to_all] [--shapes grid|MxNxK,...] [--rounds 5] [--target-ms 8]
        [--fuse always|auto] [--sm-reserve N] [--time-budget-s 420] [--call op|runtime] [--graphs]
        [--fused-variants tiles/direct,tiles/direct/gemm,tiles/direct/c//8,...]

Per shape (A [M,K] and B = W.t() with W [N,K] a Linear weight; bf16, fresh random data per rank) and per op, all
variants are timed side by side in one interleaved run (``flashoverlap_inductor.tune_measure.Timer``: CUDA events
around every call, back-to-back calls behind a short spin, rounds in alternating order, medians, max over ranks):

* ``gemm``: cuBLAS ``torch.mm``; ``comm``: the collective alone on an [M,N] tensor; ``seq``: cuBLAS then the
  collective on one stream (the unfused graph); ``chunked{2,4,8}``: the rows cut into c groups of the same
  layout, each group's cuBLAS GEMM then its collective on a side stream (``T_chunked`` = the best c);
* ``concurrent``: the cuBLAS GEMM while the collective of an unrelated tensor runs on a side stream (no
  dependency): the floor that overlapping SM-based NCCL with a GEMM can reach on this machine;
* ``asynctp`` (reduce_scatter only): ``torch.ops.symm_mem.fused_matmul_reduce_scatter``;
* ``fused``: ``torch.ops.flashoverlap.gemm_<op>`` (``--call op``, through the dispatcher, the ops routed to
  ``runtime_gpu``) or ``runtime_gpu`` directly (``--call runtime``), with the plan of ``cost_model.decide``.

``--graphs`` adds ``seq`` and ``fused`` replayed from CUDA graphs (``graph_speedup``: their ratio, the host cost
removed from both). ``--fused-variants`` times the fused op in other modes side by side (``with_mode``).

Derived per row: ``ideal = max(T_gemm, T_comm)``, ``speedup = T_seq / T_fused``, overlap efficiency
``(T_seq - T_fused) / (T_seq - ideal)``, ``auto`` = what ``FLASHOVERLAP_FUSE=auto`` runs (fused where ``decide``
says fuse, else the sequential graph; ``--fuse auto`` skips timing the fused op elsewhere), and the cost model's
predictions (fused, sequential, GEMM, collective) with their relative errors. Correctness: the fused and async-TP
outputs are compared with the sequential output on every (shape, op). The JSON is rewritten after every shape (a
cut run keeps its rows); the PNG (matplotlib) and the table come at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    import flashoverlap_inductor  # noqa: F401  (installed, or on PYTHONPATH: then its subpackages resolve too)
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashoverlap_inductor import fused_launch, nccl_direct, ops, runtime_cpu, runtime_gpu  # noqa: E402
from flashoverlap_inductor import plan as planlib  # noqa: E402
from flashoverlap_inductor import tune_measure as tm  # noqa: E402
from flashoverlap_inductor.tune import GRID, init_distributed, parse_shapes  # noqa: E402

DEVICE = "cuda"  # "cpu" only for the CPU dry run of tests/test_tune_cpu.py (gloo, fake CUDA timing)
OPS = ("all_reduce", "reduce_scatter", "all_to_all")
SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_to_all": "A2A"}
CHUNKS = (2, 4, 8)
TARGETS = {  # (world, op): geomean speedup over T_seq the issue asks for
    (4, "all_reduce"): 1.25, (4, "reduce_scatter"): 1.15, (4, "all_to_all"): 1.10, (2, "all_reduce"): 1.12,
}


# --------------------------------------------------------------------------------------------- variants


def route_ops_to_gpu_runtime() -> str:
    """Make ``torch.ops.flashoverlap.*`` on CUDA run ``runtime_gpu`` (until ``ops._runtime`` does so itself)."""
    probe = torch.empty(1, device=DEVICE)
    if ops._runtime(probe) is runtime_gpu:
        return "native"
    original = ops._runtime
    ops._runtime = lambda a: runtime_gpu if a.device.type == probe.device.type else original(a)
    return "patched"


# The process group of the fused path (``--fused-max-ctas``: a group whose NCCL config caps its CTAs, as a user
# would configure their TP group); the baselines always use the default WORLD group with NCCL's default config.
FUSED_GROUP: dist.ProcessGroup | None = None
_CAPPED: dict[tuple[int, int | None], dist.ProcessGroup] = {}


def make_capped_group(max_ctas: int, min_ctas: int | None = None) -> dist.ProcessGroup:
    """A new NCCL group over all ranks with ``config.max_ctas = max_ctas`` (and ``min_ctas``), one per setting;
    its communicator is created at once, so the direct NCCL route finds it from the first fused call."""
    key = (max_ctas, min_ctas)
    if key not in _CAPPED:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = max_ctas
        if min_ctas is not None:
            opts.config.min_ctas = min_ctas
        group = dist.new_group(backend="nccl", pg_options=opts)
        dist.all_reduce(torch.ones(1, device=DEVICE), group=group)
        _CAPPED[key] = group
    return _CAPPED[key]


def fused_call(op: str, a: torch.Tensor, b: torch.Tensor, plan: str, world: int, call: str,
               group: dist.ProcessGroup | None = None):
    group = group or FUSED_GROUP or dist.group.WORLD
    name = group.group_name
    fo = torch.ops.flashoverlap
    if call == "runtime":
        return {"all_reduce": lambda: runtime_gpu.gemm_all_reduce(a, b, None, group, plan),
                "reduce_scatter": lambda: runtime_gpu.gemm_reduce_scatter(a, b, None, group, plan),
                "all_to_all": lambda: runtime_gpu.gemm_all_to_all(a, b, None, None, None, group, plan)}[op]
    return {"all_reduce": lambda: fo.gemm_all_reduce(a, b, None, "sum", name, plan),
            "reduce_scatter": lambda: fo.gemm_reduce_scatter(a, b, None, "sum", world, name, plan),
            "all_to_all": lambda: fo.gemm_all_to_all(a, b, None, None, None, name, plan)}[op]


def parse_spec(spec: str) -> tuple[str, str, str, str, tuple[int, int | None] | None]:
    """``"<grid>/<nccl>[/<host>[/<kernel>[/<ctas>]]]"`` -> (grid, nccl, host, kernel, (max_ctas, min_ctas) or None);
    ``ctas`` is ``max`` or ``min-max``; see ``with_mode``. Raises ValueError on a malformed spec."""
    parts = spec.split("/")
    grid, mode, host, kernel, ctas = (parts + [""] * 5)[:5]
    host = host or "c"
    bad_ctas = bool(ctas) and not ctas.replace("-", "", 1).isdigit()
    bad_kernel = "@" in kernel and not kernel.partition("@")[2].isdigit()
    if not 2 <= len(parts) <= 5 or grid not in ("persistent", "tiles") or mode not in ("direct", "torch") \
            or host not in ("c", "python", "gemm") or bad_ctas or bad_kernel:
        raise ValueError(f"{spec!r} is not <persistent|tiles>/<direct|torch>[/<c|python|gemm>[/<kernel>"
                         "[/<max_ctas>|<min_ctas>-<max_ctas>]]]; kernel = [<configuration>][@<swizzle>]")
    lo, _, hi = ctas.rpartition("-")
    return grid, mode, host, kernel, (int(hi), int(lo) if lo else None) if ctas else None


def with_mode(spec: str, fn):
    """``fn`` run with the fused path in the mode ``spec`` = ``"<grid>/<nccl>[/<host>[/<kernel>[/<ctas>]]]"``:

    * grid ``persistent|tiles``: ``runtime_gpu.GEMM_GRID``; nccl ``direct|torch``: ``nccl_direct.MODE``;
    * host ``c`` (default) or ``python``: ``fused_launch.HOST_LOOP``; ``gemm``: the diagnostic
      ``runtime_gpu.GEMM_ONLY`` (the fused path without its collectives, in the Python loop: a time split, not a
      result);
    * kernel ``[<configuration>][@<swizzle>]``: ``runtime_gpu.KERNEL`` (default the plan's), ``runtime_gpu.SWIZZLE``;
    * ctas ``<max>`` or ``<min>-<max>``: the caller builds ``fn`` on ``make_capped_group(max_ctas, min_ctas)``."""
    grid, mode, host, kernel, _ = parse_spec(spec)
    kernel, _, swizzle = kernel.partition("@")

    def run():
        old = (runtime_gpu.GEMM_GRID, nccl_direct.MODE, fused_launch.HOST_LOOP, runtime_gpu.KERNEL,
               runtime_gpu.GEMM_ONLY, runtime_gpu.SWIZZLE)
        runtime_gpu.GEMM_GRID, nccl_direct.MODE = grid, mode
        fused_launch.HOST_LOOP = "python" if host == "gemm" else host
        runtime_gpu.KERNEL, runtime_gpu.GEMM_ONLY = kernel or None, host == "gemm"
        runtime_gpu.SWIZZLE = int(swizzle) if swizzle else runtime_gpu.SWIZZLE
        try:
            return fn()
        finally:
            (runtime_gpu.GEMM_GRID, nccl_direct.MODE, fused_launch.HOST_LOOP, runtime_gpu.KERNEL,
             runtime_gpu.GEMM_ONLY, runtime_gpu.SWIZZLE) = old
    return run


def graphed(fn):
    """``fn`` captured once into a CUDA graph (after one eager warm-up call); returns the graph's replay. The
    variant then costs its GPU work only, as under ``torch.compile(mode="reduce-overhead")``."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def collective_into(op: str, src: torch.Tensor, out: torch.Tensor):
    """The whole-tensor collective of ``op`` from ``src`` (all_reduce: in place) into ``out``."""
    if op == "all_reduce":
        return lambda: (dist.all_reduce(src), src)[1]
    if op == "reduce_scatter":
        return lambda: (ops.reduce_scatter_into(out, src), out)[1]
    return lambda: (dist.all_to_all_single(out, src), out)[1]


def concurrent_call(op: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, src: torch.Tensor,
                    out: torch.Tensor, side: torch.cuda.Stream):
    """cuBLAS GEMM into ``c`` while the op's collective of an unrelated tensor ``src`` of the same size runs on
    ``side`` (no dependency between them): what GEMM and NCCL cost when they share the GPU, the floor an overlap
    of one into the other can reach with SM-based NCCL kernels (``gemm_plus_concurrent_ar_ms`` of the anchors)."""
    coll = collective_into(op, src, out)

    def run() -> torch.Tensor:
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            coll()
        torch.mm(a, b, out=c)
        cur.wait_stream(side)
        return c
    return run


def chunked_call(op: str, a: torch.Tensor, b: torch.Tensor, chunks: int, world: int, rank: int,
                 side: torch.cuda.Stream):
    """c groups of the op's buffer layout (``plan.uniform_plan``): per group a cuBLAS GEMM on the current stream,
    then the group's collective on ``side`` (the decomposition a user can write without a custom kernel)."""
    m, k = a.shape
    n = b.shape[1]
    plan = planlib.uniform_plan(m, n, 128, 128, chunks, align=1 if op == "all_reduce" else world).to_str()
    sched = ops.resolve_schedule(op, plan, m, n, k, "bfloat16", world)
    steps = runtime_cpu.schedule_steps(op, plan, m, n, k, "bfloat16", world, rank)
    rows = runtime_gpu.gather_rows(sched.layout)
    index = torch.tensor(rows, dtype=torch.int64, device=a.device) if rows is not None else None
    peers = tuple(dist.get_global_rank(dist.group.WORLD, j) for j in range(world))
    out_rows = m // world if op == "reduce_scatter" else m

    def run() -> torch.Tensor:
        cur = torch.cuda.current_stream()
        a_in = a.index_select(0, index) if index is not None else a
        buf = torch.empty(m, n, dtype=a.dtype, device=a.device)
        out = buf if op == "all_reduce" else torch.empty(out_rows, n, dtype=a.dtype, device=a.device)
        for g, step in enumerate(steps):
            if step.hi > step.lo:
                torch.mm(a_in[step.lo:step.hi], b, out=buf[step.lo:step.hi])
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                runtime_gpu.group_collective(op, peers, g, step, buf, out, dist.group.WORLD)
        cur.wait_stream(side)
        return out
    return run


def asynctp_call(a: torch.Tensor, b: torch.Tensor) -> tuple[Any, str]:
    """PyTorch async-TP's fused matmul + reduce_scatter, or (None, why not)."""
    name = dist.group.WORLD.group_name
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (and unnecessary) on newer torch
            enable_symm_mem_for_group(name)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        return None, repr(exc)[:200]
    return (lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, name)), ""


# --------------------------------------------------------------------------------------------- one shape


def bench_shape(m: int, n: int, k: int, args: argparse.Namespace, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    from flashoverlap_inductor.cost_model import decide

    rank, world, gpu, model = ctx["rank"], ctx["world"], ctx["gpu"], ctx["model"]
    a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / math.sqrt(k)).to(torch.bfloat16)
    b = w.t()
    c = torch.empty(m, n, device=DEVICE, dtype=torch.bfloat16)
    src = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    out_rs = torch.empty(m // world, n, device=DEVICE, dtype=torch.bfloat16)
    out_a2a = torch.empty(m, n, device=DEVICE, dtype=torch.bfloat16)
    outs = {"all_reduce": c, "reduce_scatter": out_rs, "all_to_all": out_a2a}
    variants: dict[str, Any] = {"gemm": lambda: torch.mm(a, b, out=c)}
    info: dict[str, dict[str, Any]] = {}
    for op in args.ops:
        d = decide(op, m, n, k, "bfloat16", world, device_name=gpu)
        info[op] = {"decision": d, "plan": d.plan.to_str()}
        variants[f"{op}:comm"] = collective_into(op, src, out_a2a if op == "all_to_all" else out_rs)

        def seq(op=op):
            torch.mm(a, b, out=c)
            return collective_into(op, c, outs[op])()
        variants[f"{op}:seq"] = seq
        variants[f"{op}:concurrent"] = concurrent_call(op, a, b, c, src, out_a2a if op == "all_to_all" else out_rs,
                                                       ctx["side"])
        for ch in CHUNKS:
            variants[f"{op}:chunked{ch}"] = chunked_call(op, a, b, ch, world, rank, ctx["side"])
        if op == "reduce_scatter":
            fn, why = asynctp_call(a, b)
            info[op]["asynctp_error"] = why
            if fn is not None:
                variants[f"{op}:asynctp"] = fn
        if args.fuse == "always" or d.fuse:
            variants[f"{op}:fused"] = fused_call(op, a, b, info[op]["plan"], world, args.call)
            for spec in args.fused_variants:
                ctas = parse_spec(spec)[4]
                group = make_capped_group(*ctas) if ctas else None
                variants[f"{op}:fused@{spec}"] = with_mode(spec, fused_call(op, a, b, info[op]["plan"], world,
                                                                           args.call, group))

    # probe: every variant once on every rank; a variant failing anywhere is dropped everywhere
    errors: dict[str, str] = {}
    for name, fn in variants.items():
        try:
            before = runtime_gpu.stats.copy()
            fn()
            if name.endswith(":fused"):
                op = name.split(":")[0]
                info[op]["fused_path"] = runtime_gpu.stats[f"fused:{op}"] > before[f"fused:{op}"]
                info[op]["fallback"] = [key for key in runtime_gpu.stats if runtime_gpu.stats[key] > before[key]
                                        and key.startswith("fallback:")]
                info[op]["launch"] = runtime_gpu.last_launch.description if info[op]["fused_path"] else ""
        except Exception as exc:  # noqa: BLE001 - reported
            errors[name] = repr(exc)[:300]
    torch.cuda.synchronize()
    keep = tm.agree([name not in errors for name in variants])
    for (name, _), ok in zip(list(variants.items()), keep, strict=True):
        if not ok:
            errors.setdefault(name, "failed on another rank")
            variants.pop(name)

    # correctness of the fused op (and async-TP) against the sequential graph, on fresh outputs; worst rank
    found = []
    for op in args.ops:
        ref = variants[f"{op}:seq"]().clone() if f"{op}:seq" in variants else None
        for kind in ("fused", "asynctp", *(f"fused@{spec}" for spec in args.fused_variants
                                           if parse_spec(spec)[2] != "gemm")):
            if ref is not None and f"{op}:{kind}" in variants:
                got = variants[f"{op}:{kind}"]()
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                found.append((op, kind, err if math.isfinite(err) else 1e30))
        info[op]["host_ms"] = _host_ms(variants.get(f"{op}:fused"))
    for (op, kind, _), err in zip(found, tm.reduce_max([e for _, _, e in found]), strict=True):
        info[op][f"relerr_{kind}"] = err if err < 1e30 else math.inf
    torch.cuda.synchronize()
    if args.graphs:  # the unfused graph and the fused op, each replayed from a CUDA graph (no host cost)
        captured: dict[str, Any] = {}
        for op in args.ops:
            for kind in ("seq", "fused"):
                if f"{op}:{kind}" in variants:
                    try:
                        captured[f"{op}:{kind}@graph"] = graphed(variants[f"{op}:{kind}"])
                    except Exception as exc:  # noqa: BLE001 - reported
                        errors[f"{op}:{kind}@graph"] = repr(exc)[:300]
                        captured[f"{op}:{kind}@graph"] = None
        keep = tm.agree([fn is not None for fn in captured.values()])
        variants.update({name: fn for (name, fn), ok in zip(captured.items(), keep, strict=True) if ok})

    times = ctx["timer"].measure(variants)
    ms = {name: t.ms for name, t in times.items()}
    rows = []
    for op in args.ops:
        row = make_row(op, m, n, k, world, ms, info[op], errors, model)
        row["variants"] = {spec: {"ms": ms.get(f"{op}:fused@{spec}", math.nan),
                                  "speedup": tm.speedup(row["seq_ms"], ms.get(f"{op}:fused@{spec}", math.nan)),
                                  "relerr": info[op].get(f"relerr_fused@{spec}", math.nan)}
                           for spec in args.fused_variants}
        rows.append(row)
    return rows


def _host_ms(fn) -> float:
    """Median host (CPU) time of one call, ms (the GPU is kept busy so the host never waits)."""
    if fn is None:
        return math.nan
    ts = []
    for _ in range(5):
        tm.spin(1.0)
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return tm.median(ts)


def make_row(op: str, m: int, n: int, k: int, world: int, ms: dict[str, float], info: dict[str, Any],
             errors: dict[str, str], model: Any) -> dict[str, Any]:
    """One result row (times in ms) with the derived quantities (see the module docstring)."""
    d = info["decision"]
    row: dict[str, Any] = {"op": op, "m": m, "n": n, "k": k, "world": world}
    row["gemm_ms"] = ms.get("gemm", math.nan)
    row["comm_ms"] = ms.get(f"{op}:comm", math.nan)
    row["seq_ms"] = ms.get(f"{op}:seq", math.nan)
    row["chunked"] = {str(c): ms[f"{op}:chunked{c}"] for c in CHUNKS if f"{op}:chunked{c}" in ms}
    row["chunked_ms"] = min(row["chunked"].values(), default=math.nan)
    row["asynctp_ms"] = ms.get(f"{op}:asynctp", math.nan)
    row["concurrent_ms"] = ms.get(f"{op}:concurrent", math.nan)
    row["seq_graph_ms"] = ms.get(f"{op}:seq@graph", math.nan)
    row["fused_graph_ms"] = ms.get(f"{op}:fused@graph", math.nan)
    row["fused_ms"] = ms.get(f"{op}:fused", math.nan)
    row["ideal_ms"] = max(row["gemm_ms"], row["comm_ms"])
    row["auto_fuse"] = bool(d.fuse)
    row["auto_ms"] = row["fused_ms"] if d.fuse else row["seq_ms"]
    row["plan"] = info["plan"]
    row["groups"] = d.plan.num_groups
    row["decision"] = d.reason
    row["fused_path"] = bool(info.get("fused_path", False))
    row["fallback"] = info.get("fallback", [])
    row["launch"] = info.get("launch", "")
    row["relerr_fused"] = info.get("relerr_fused", math.nan)
    row["relerr_asynctp"] = info.get("relerr_asynctp", math.nan)
    row["host_ms_fused"] = info.get("host_ms", math.nan)
    row["pred_fused_ms"] = d.predicted_fused_ms
    row["pred_seq_ms"] = d.predicted_seq_ms
    if model is not None:
        row["pred_gemm_ms"] = model.gemm.reference_ms(m, n, k, "bfloat16")
        row["pred_comm_ms"] = model.curve.comm_ms(op, world, m * n * 2)
    row["errors"] = {key: v for key, v in errors.items() if key.startswith(f"{op}:") or key == "gemm"}
    if info.get("asynctp_error"):
        row["errors"][f"{op}:asynctp"] = info["asynctp_error"]
    return derive(row)


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """Speedups over T_seq, overlap efficiency and cost-model errors of a row (in place; returned)."""
    seq = row["seq_ms"]
    row["speedup"] = tm.speedup(seq, row["fused_ms"])
    row["ideal_speedup"] = tm.speedup(seq, row["ideal_ms"])
    row["chunked_speedup"] = tm.speedup(seq, row["chunked_ms"])
    row["asynctp_speedup"] = tm.speedup(seq, row["asynctp_ms"])
    row["concurrent_speedup"] = tm.speedup(seq, row.get("concurrent_ms", math.nan))
    row["graph_speedup"] = tm.speedup(row.get("seq_graph_ms", math.nan), row.get("fused_graph_ms", math.nan))
    row["auto_speedup"] = tm.speedup(seq, row["auto_ms"])
    row["efficiency"] = tm.overlap_efficiency(seq, row["fused_ms"], row["ideal_ms"])
    row["err_fused"] = tm.rel_error(row.get("pred_fused_ms"), row["fused_ms"]) if row.get("fused_path") else math.nan
    row["err_seq"] = tm.rel_error(row.get("pred_seq_ms"), seq)
    rel = row.get("relerr_fused", math.nan)
    row["correct"] = bool(rel <= 2e-2) if isinstance(rel, float) and not math.isnan(rel) else None
    return row


# --------------------------------------------------------------------------------------------- summary


def summarize(rows: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Per-op aggregates and the issue's target checks (each ``{"value", "target", "pass"}``)."""
    out: dict[str, Any] = {"world": world, "ops": {}, "checks": {}}
    for op in OPS:
        rs = [r for r in rows if r["op"] == op]
        if not rs:
            continue
        at = [r for r in rs if (r["m"], r["n"], r["k"]) == (8192, 8192, 8192)]
        agg = {
            "shapes": len(rs),
            "geomean_speedup": tm.geomean(r["speedup"] for r in rs),
            "min_speedup": min(tm.finite(r["speedup"] for r in rs), default=math.nan),
            "geomean_ideal_speedup": tm.geomean(r["ideal_speedup"] for r in rs),
            "geomean_chunked_speedup": tm.geomean(r["chunked_speedup"] for r in rs),
            "geomean_asynctp_speedup": tm.geomean(r["asynctp_speedup"] for r in rs),
            "geomean_auto_speedup": tm.geomean(r["auto_speedup"] for r in rs),
            "geomean_concurrent_speedup": tm.geomean(r.get("concurrent_speedup", math.nan) for r in rs),
            "geomean_graph_speedup": tm.geomean(r.get("graph_speedup", math.nan) for r in rs),
            "speedup_8192": at[0]["speedup"] if at else math.nan,
            "median_efficiency": tm.median(tm.finite(r["efficiency"] for r in rs)),
            "worst_auto_ratio": max(tm.finite(r["auto_ms"] / r["seq_ms"] for r in rs if r["seq_ms"] > 0),
                                    default=math.nan),
            "median_err_fused": tm.median(tm.finite(r["err_fused"] for r in rs)),
            "median_err_seq": tm.median(tm.finite(r["err_seq"] for r in rs)),
            "wrong": [f"{r['m']}x{r['n']}x{r['k']}" for r in rs if r["correct"] is False],
            "unfused": [f"{r['m']}x{r['n']}x{r['k']}" for r in rs if not r["fused_path"]],
        }
        specs = sorted({spec for r in rs for spec in r.get("variants", {})})
        agg["variants"] = {spec: {"geomean_speedup": tm.geomean(r["variants"][spec]["speedup"] for r in rs),
                                  "wrong": [f"{r['m']}x{r['n']}x{r['k']}" for r in rs
                                            if not r["variants"][spec]["relerr"] <= 2e-2
                                            and parse_spec(spec)[2] != "gemm"]}
                           for spec in specs}
        if op == "reduce_scatter":
            both = [r for r in rs if math.isfinite(r["asynctp_ms"]) and math.isfinite(r["fused_ms"])]
            agg["faster_than_asynctp"] = f"{sum(r['fused_ms'] < r['asynctp_ms'] for r in both)}/{len(both)}"
            agg["all_faster_than_asynctp"] = bool(both) and all(r["fused_ms"] < r["asynctp_ms"] for r in both)
        out["ops"][op] = agg
        target = TARGETS.get((world, op))
        if target is not None:
            out["checks"][f"{op} geomean speedup"] = _check(agg["geomean_speedup"], f">= {target}",
                                                            agg["geomean_speedup"] >= target)
        if world == 4 and op == "all_reduce" and at:
            out["checks"]["all_reduce 8192^3 speedup"] = _check(agg["speedup_8192"], ">= 1.35",
                                                                agg["speedup_8192"] >= 1.35)
        if world == 4 and op == "reduce_scatter" and "all_faster_than_asynctp" in agg:
            out["checks"]["reduce_scatter faster than async-TP"] = _check(agg["faster_than_asynctp"], "every shape",
                                                                          agg["all_faster_than_asynctp"])
        out["checks"][f"{op} auto never > 1.02 x T_seq"] = _check(agg["worst_auto_ratio"], "<= 1.02",
                                                                 agg["worst_auto_ratio"] <= 1.02)
        out["checks"][f"{op} results correct"] = _check(len(agg["wrong"]), "0 wrong", not agg["wrong"])
    errs = tm.finite(r["err_fused"] for r in rows)
    out["median_err_fused"] = tm.median(errs)
    out["checks"]["cost model median |pred-meas|/meas"] = _check(out["median_err_fused"], "<= 0.10",
                                                                 out["median_err_fused"] <= 0.10)
    return out


def _check(value: Any, target: str, ok: bool) -> dict[str, Any]:
    return {"value": value, "target": target, "pass": bool(ok)}


def _f(x: Any, fmt: str = "7.3f") -> str:
    """``x`` formatted, or a right-aligned "-" of the same width for missing values."""
    if isinstance(x, (int, float)) and math.isfinite(x):
        return format(x, fmt)
    return "-".rjust(int(fmt.split(".")[0]))


def format_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The printed report: one table per op, then the aggregates and target checks."""
    lines = []
    head = (f"{'shape':>18} {'gemm':>7} {'comm':>7} {'seq':>7} {'chunk':>7} {'asyTP':>7} {'fused':>7} {'ideal':>7} "
            f"{'spd':>6} {'ideal':>6} {'eff':>6} {'pred':>7} {'err':>6} {'auto':>7} {'G':>3} note")
    for op in OPS:
        rs = [r for r in rows if r["op"] == op]
        if not rs:
            continue
        lines.append(f"== {op} (world {rs[0]['world']}; times in ms, max over ranks of medians)")
        lines.append(head)
        for r in rs:
            note = [] if r["fused_path"] else ["UNFUSED " + ",".join(r["fallback"])]
            if r["correct"] is False:
                note.append(f"WRONG relerr={r['relerr_fused']:.3g}")
            note += [f"{key}: {v[:60]}" for key, v in r["errors"].items()]
            lines.append(f"{r['m']:>6}x{r['n']:>5}x{r['k']:>5} {_f(r['gemm_ms'])} {_f(r['comm_ms'])} "
                         f"{_f(r['seq_ms'])} {_f(r['chunked_ms'])} {_f(r['asynctp_ms'])} {_f(r['fused_ms'])} "
                         f"{_f(r['ideal_ms'])} {_f(r['speedup'], '6.3f')} {_f(r['ideal_speedup'], '6.3f')} "
                         f"{_f(r['efficiency'], '6.2f')} {_f(r['pred_fused_ms'])} {_f(r['err_fused'], '6.1%')} "
                         f"{_f(r['auto_ms'])} {r['groups']:>3} {'; '.join(note)}")
        agg = summary["ops"][op]
        for spec in sorted(rs[0].get("variants", {})):
            lines.append(f"   variant {spec:18s}: " + " ".join(
                f"{_f(r['variants'][spec]['ms'])}" for r in rs) + f" | geomean speedup "
                f"{agg['variants'][spec]['geomean_speedup']:.3f} wrong {agg['variants'][spec]['wrong']}")
        lines.append(f"   geomean speedup {agg['geomean_speedup']:.3f} (ideal {agg['geomean_ideal_speedup']:.3f}, "
                     f"chunked {agg['geomean_chunked_speedup']:.3f}, async-TP {agg['geomean_asynctp_speedup']:.3f}, "
                     f"auto {agg['geomean_auto_speedup']:.3f}, GEMM || comm "
                     f"{agg['geomean_concurrent_speedup']:.3f}, graphs fused/seq "
                     f"{agg['geomean_graph_speedup']:.3f}); "
                     f"min {agg['min_speedup']:.3f}; worst auto/seq {agg['worst_auto_ratio']:.3f}; cost model "
                     f"median err fused {agg['median_err_fused']:.1%} seq {agg['median_err_seq']:.1%}")
    lines.append("== target checks")
    for name, c in summary["checks"].items():
        value = f"{c['value']:.3f}" if isinstance(c["value"], float) else str(c["value"])
        lines.append(f"   [{'PASS' if c['pass'] else 'FAIL'}] {name}: {value} (target {c['target']})")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, world: int) -> str:
    """Speedup over T_seq per shape and op (fused, chunked, async-TP bars; the ideal as a marker)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no PNG: {exc}"
    ops_here = [op for op in OPS if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(len(ops_here), 1, figsize=(14, 3.6 * len(ops_here)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops_here, strict=True):
        rs = [r for r in rows if r["op"] == op]
        x = list(range(len(rs)))
        series = [("fused", "speedup", "tab:blue"), ("chunked (best of 2/4/8)", "chunked_speedup", "tab:gray")]
        if op == "reduce_scatter":
            series.append(("async-TP", "asynctp_speedup", "tab:orange"))
        width = 0.8 / len(series)
        for i, (label, key, color) in enumerate(series):
            ax.bar([v + (i - (len(series) - 1) / 2) * width for v in x],
                   [r[key] if math.isfinite(r[key]) else 0 for r in rs], width, label=label, color=color)
        ax.scatter(x, [r["ideal_speedup"] for r in rs], marker="_", s=400, color="black", label="ideal", zorder=3)
        ax.scatter(x, [r["auto_speedup"] for r in rs], marker=".", s=60, color="tab:green", label="auto", zorder=3)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, [f"{r['m']}x{r['n']}x{r['k']}" for r in rs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup over T_seq")
        ax.set_title(f"GEMM + {op}, {world} GPUs")
        ax.legend(fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--shapes", default="grid", help="grid or MxNxK,...")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=8.0, help="timed ms per variant and round")
    p.add_argument("--fuse", default="always", choices=("always", "auto"))
    p.add_argument("--call", default="op", choices=("op", "runtime"))
    p.add_argument("--sm-reserve", type=int, default=None, help="SMs the fused GEMM leaves to NCCL")
    p.add_argument("--fused-max-ctas", type=int, default=None,
                   help="run the fused path on a group whose NCCL config has this max_ctas (baselines: defaults)")
    p.add_argument("--gemm-grid", choices=("persistent", "tiles"), default=None,
                   help="the fused GEMM's grid (runtime_gpu.GEMM_GRID; default: the runtime's)")
    p.add_argument("--nccl", choices=("direct", "torch"), default=None,
                   help="per-group collectives: direct NCCL calls or torch.distributed (default: the runtime's)")
    p.add_argument("--fused-variants", default="",
                   help="extra fused variants timed side by side, e.g. persistent/torch,tiles/direct/python")
    p.add_argument("--graphs", action="store_true",
                   help="also time the sequential graph and the fused op replayed from CUDA graphs")
    p.add_argument("--time-budget-s", type=float, default=420.0, help="no new shape starts after this")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    args.ops = [x for x in args.ops.split(",") if x]
    args.fused_variants = [x for x in args.fused_variants.split(",") if x]
    for spec in args.fused_variants:
        try:
            parse_spec(spec)
        except ValueError as exc:
            p.error(f"--fused-variants: {exc}")
    unknown = set(args.ops) - set(OPS)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    owns_group = not dist.is_initialized()
    rank, world = init_distributed()
    if world < 2:
        print("bench_ops: run under torchrun with >= 2 ranks", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    if args.sm_reserve is not None:
        runtime_gpu.SM_RESERVE = args.sm_reserve
    if args.gemm_grid:
        runtime_gpu.GEMM_GRID = args.gemm_grid
    if args.nccl:
        nccl_direct.MODE = args.nccl
    global FUSED_GROUP
    if args.fused_max_ctas:
        FUSED_GROUP = make_capped_group(args.fused_max_ctas)
    routing = route_ops_to_gpu_runtime() if args.call == "op" else "direct"
    try:
        from flashoverlap_inductor.cost_model import model_for

        model = model_for(gpu)[0]
    except Exception as exc:  # noqa: BLE001 - predictions are then missing, measurements are not
        print(f"bench_ops: no cost model ({exc!r})", file=sys.stderr)
        model = None
    shapes = parse_shapes(args.shapes) if args.shapes != "grid" else list(GRID)
    ctx = {"rank": rank, "world": world, "gpu": gpu, "model": model, "side": torch.cuda.Stream(),
           "timer": tm.Timer(rounds=args.rounds, target_ms=args.target_ms, min_iters=2, max_iters=40, spin_ms=0.3)}
    meta = {"world": world, "gpu": gpu, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "available": runtime_gpu.available(),
            "routing": routing, "call": args.call, "fuse": args.fuse, "rounds": args.rounds,
            "target_ms": args.target_ms, "sm_reserve": args.sm_reserve, "fused_max_ctas": args.fused_max_ctas,
            "gemm_grid": runtime_gpu.GEMM_GRID or "model", "nccl_route": nccl_direct.MODE,
            "host_loop": fused_launch.HOST_LOOP,
            "fused_variants": args.fused_variants,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "FLASHOVERLAP_SM_RESERVE", "FLASHOVERLAP_SIGNAL_MODE",
                                                   "FLASHOVERLAP_GEMM_GRID", "FLASHOVERLAP_NCCL")}}
    if rank == 0:
        print(f"bench_ops: {gpu} x{world}, {len(shapes)} shapes, ops {args.ops}, overlapped path "
              f"{'on' if meta['available'] else 'OFF'} ({routing})", flush=True)
    rows: list[dict[str, Any]] = []
    bar = tm.Progress(len(shapes), f"bench w{world}", enabled=rank == 0, every_s=0.0)
    for m, n, k in shapes:
        if tm.reduce_max([float(time.monotonic() - t0 > args.time_budget_s)])[0] > 0:
            meta["cut"] = f"time budget {args.time_budget_s} s reached before {m}x{n}x{k}"
            if rank == 0:
                print(f"bench_ops: {meta['cut']}", flush=True)
            break
        new = bench_shape(m, n, k, args, ctx)
        torch.cuda.empty_cache()  # the shape's tensors died with bench_shape's frame
        rows += new
        bar.update(note=f"{m}x{n}x{k}: " + " ".join(f"{SHORT[r['op']]} {r['speedup']:.2f}x" for r in new))
        if rank == 0 and args.json:
            _write(args.json, meta, rows, world)
    bar.close()
    runtime_gpu.check()
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    meta["stats"] = dict(runtime_gpu.stats)
    if rank == 0:
        summary = _write(args.json, meta, rows, world) if args.json else summarize(rows, world)
        if args.png and rows:
            print(plot(rows, args.png, world), flush=True)
        print(format_table(rows, summary), flush=True)
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()
    return 0


def _write(path: str | None, meta: dict[str, Any], rows: list[dict[str, Any]], world: int) -> dict[str, Any]:
    summary = summarize(rows, world)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(_jsonable({"meta": meta, "rows": rows, "summary": summary}), indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(main())
