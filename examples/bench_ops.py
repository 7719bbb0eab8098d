"""Op-level benchmark of the fused GEMM + collective ops against every baseline, on W GPUs of one host.

    torchrun --nproc_per_node=4 examples/bench_ops.py --json bench_w4.json --png bench_w4.png
        [--ops all_reduce,reduce_scatter,all_to_all] [--shapes grid|MxNxK,...] [--rounds 5] [--target-ms 8]
        [--fuse always|auto] [--sm-reserve N] [--time-budget-s 420] [--call op|runtime] [--graphs]
        [--fused-variants tiles/direct,persistent/direct//@8,tiles/direct/c//8,tiles/peer////ring2,...]
        [--experiments NAME,...] [--scatter-start handshake|push]

Per shape (A [M,K] and B = W.t() with W [N,K] a Linear weight; bf16, fresh random data per rank) and per op, all
variants are timed side by side in one interleaved run (``flashoverlap_inductor.tune.measure.Timer``: CUDA events
around every call, back-to-back calls behind a short spin, rounds in alternating order, medians, max over ranks):

* ``gemm``: cuBLAS ``torch.mm``; ``comm``: the collective alone on an [M,N] tensor; ``seq``: cuBLAS then the
  collective on one stream (the unfused graph); ``chunked{2,4,8}``: the rows cut into c groups of the same
  layout, each group's cuBLAS GEMM then its collective on a side stream (``T_chunked`` = the best c);
* ``concurrent``: the cuBLAS GEMM while the collective of an unrelated tensor runs on a side stream (no
  dependency): the floor that overlapping SM-based NCCL with a GEMM can reach on this machine;
* ``asynctp`` (reduce_scatter only): ``torch.ops.symm_mem.fused_matmul_reduce_scatter``;
* ``fused``: ``torch.ops.flashoverlap.gemm_<op>`` (``--call op``, through the dispatcher) or the route registry
  directly (``routes.dispatch``, ``--call runtime``), with the plan of ``cost_model.decide``.

``--graphs`` adds ``seq`` and ``fused`` replayed from CUDA graphs (``graph_speedup``: their ratio, the host cost
removed from both). ``--fused-variants`` times the fused op under other settings side by side (``with_mode``:
``config.patch`` of the GEMM grid, swizzle, row order, transport, ring rounds and peer kernel).

Derived per row: ``ideal = max(T_gemm, T_comm)``, ``speedup = T_seq / T_fused``, overlap efficiency
``(T_seq - T_fused) / (T_seq - ideal)``, ``auto`` = what ``FLASHOVERLAP_FUSE=auto`` runs (fused where ``decide``
says fuse, else the sequential graph; ``--fuse auto`` skips timing the fused op elsewhere), and the cost model's
predictions (fused, sequential, GEMM, collective) with their relative errors. Correctness: the fused and async-TP
outputs are compared with the sequential output on every (shape, op). The JSON is rewritten after every shape (a
cut run keeps its rows); the PNG (matplotlib) and the table come at the end.
"""

from __future__ import annotations

import argparse
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
from flashoverlap_inductor import config, ops, routes  # noqa: E402
from flashoverlap_inductor.native import kernels  # noqa: E402
from flashoverlap_inductor.routes import cpu as cpu_route  # noqa: E402
from flashoverlap_inductor.runtime import kernel_select  # noqa: E402
from flashoverlap_inductor.schedule import plan as planlib  # noqa: E402
from flashoverlap_inductor.schedule import steps as schedule  # noqa: E402
from flashoverlap_inductor.tools.tune import GRID, init_distributed, parse_shapes  # noqa: E402
from flashoverlap_inductor.tune import measure as tm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_report, beside this file
# derive, format_table, summarize, parse_spec, _jsonable: re-exported for the tests
from bench_report import (OPS, PEER_ROWS, _jsonable, derive, format_table, is_diagnostic, parse_spec, plot,  # noqa
                          summarize, write_json)

DEVICE = "cuda"  # "cpu" only for the CPU dry run of tests/test_tune_cpu.py (gloo, fake CUDA timing)
SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_to_all": "A2A"}
CHUNKS = (2, 4, 8)


# --------------------------------------------------------------------------------------------- variants


ROUTING = "registry"  # the ops dispatch through the route registry (``routes.dispatch``): nothing to patch


def route_args(op: str, m: int, n: int, k: int, world: int) -> dict[str, Any]:
    """``decide``'s route arguments from the route registry (``routes.select``, as the pass asks it): whether the call
    takes the peer route, the ring in how many rounds, or the reduce_scatter pull route, under the current settings."""
    if DEVICE != "cuda":
        return dict(routes.NO_ROUTE_ARGS)
    call = routes.Call(op, m, n, k, torch.bfloat16, world, device=DEVICE, compile_time=True)
    try:
        return routes.cost_args(call, config.current())
    except Exception:  # noqa: BLE001 - no route: the runtime runs it unfused; predict the NCCL route
        return dict(routes.NO_ROUTE_ARGS)


# NCCL groups whose config limits their CTAs (``--fused-max-ctas``, a variant's ctas field), as a user would configure
# a TP group; the baselines always use the default WORLD group with NCCL's default config.
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
    group = group or dist.group.WORLD
    name = group.group_name
    fo = torch.ops.flashoverlap
    if call == "runtime":
        shape = [a.shape[0], b.shape[1]]
        return lambda: routes.dispatch(op, a, b, None, group, plan, "", shape)
    return {"all_reduce": lambda: fo.gemm_all_reduce(a, b, None, "sum", name, plan),
            "reduce_scatter": lambda: fo.gemm_reduce_scatter(a, b, None, "sum", world, name, plan),
            "all_to_all": lambda: fo.gemm_all_to_all(a, b, None, None, None, name, plan)}[op]


RING_FLAGS = tuple(f for f in PEER_ROWS if f.startswith("ring"))


def check_variant(spec: str) -> tuple[str, str, str, tuple[int, int | None] | None, str]:
    """``spec`` = ``"<grid>/<direct|peer>[/c[/<kernel>[/<ctas>[/<rows>]]]]"`` (``bench_report.parse_spec``'s syntax,
    less the variants measured and removed: ``torch`` NCCL calls, the host loops ``python|gemm|ce``, kernel and
    signal overrides, row order ``stage`` and the peer flags ``wait|cpull|cpush``) -> (grid, mode, kernel, ctas,
    rows); ValueError where it names a removed variant."""
    grid, mode, host, kernel, ctas, rows = parse_spec(spec)
    config_name, _, _ = kernel.partition("@")
    peer = mode == "peer"
    why = ("NCCL through torch.distributed ('torch') was removed" if mode == "torch" else
           f"host field {host!r} was removed (only 'c')" if host != "c" else
           "signal overrides were removed" if "+" in kernel else
           f"kernel {config_name!r}: only an _addc configuration of the peer / ring routes (peer_kernel)"
           if config_name and not (peer and "_addc" in config_name) else
           "the ctas field of peer variants (copy groups) was removed" if peer and ctas else
           "row order 'stage' was removed" if rows == "stage" else
           f"peer flags {rows!r}: only one of {'/'.join(RING_FLAGS)}" if peer and rows and rows not in RING_FLAGS
           else None)
    if why:
        raise ValueError(f"{spec!r}: {why}")
    return grid, mode, kernel, ctas, rows


def variant_settings(spec: str) -> dict[str, Any]:
    """The ``config.patch`` arguments of a fused variant ``spec`` (``check_variant``):

    * grid ``persistent|tiles``: ``gemm_grid``; mode ``direct``: ``transport="nccl"`` (the NCCL route), ``peer``:
      ``transport="peer"`` (2 ranks: the peer route, ``scatter_route="peer"``; other calls the NCCL route);
    * kernel ``[<_addc configuration>][@<swizzle>]``: ``peer_kernel`` (peer only; GEMM 2's / the ring steps'
      configuration) and ``swizzle``;
    * ctas ``<max>`` or ``<min>-<max>`` (NCCL route): the caller builds the call on
      ``make_capped_group(max_ctas, min_ctas)``;
    * rows ``schedule|gather`` (NCCL route): ``row_order`` of reduce_scatter / all_to_all layouts; ``ring1`` /
      ``ring2`` / ``ring4`` (peer): the ring route instead (``ring="all"``) in at most that many rounds
      (``ring_rounds``)."""
    grid, mode, kernel, _, rows = check_variant(spec)
    config_name, _, swizzle = kernel.partition("@")
    peer = mode == "peer"
    out: dict[str, Any] = {"gemm_grid": grid, "transport": "peer" if peer else "nccl", "ring": "off",
                           "scatter_route": "peer"}  # a variant times the peer route's kernels, not the pull route
    if config_name:
        out["peer_kernel"] = config_name
    if swizzle:
        out["swizzle"] = int(swizzle)
    if peer and rows:
        out["ring"], out["ring_rounds"] = "all", int(rows[4:])
    elif rows:
        out["row_order"] = rows
    return out


def with_mode(spec: str, fn):
    """``fn`` run under the settings of the fused variant ``spec`` (``variant_settings``)."""
    changes = variant_settings(spec)

    def run():
        with config.patch(**changes):
            return fn()
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
    sched = schedule.resolve_schedule(op, plan, m, n, k, "bfloat16", world)
    steps = schedule.schedule_steps(op, plan, m, n, k, "bfloat16", world, rank)
    rows = kernel_select.gather_rows(sched.layout)
    index = torch.tensor(rows, dtype=torch.int64, device=a.device) if rows is not None else None
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
                if step.hi > step.lo or step.recvs:  # as the CPU route: a group with nothing to move is skipped
                    cpu_route.issue_group(op, g, step, buf, out, dist.group.WORLD)
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
        d = decide(op, m, n, k, "bfloat16", world, device_name=gpu, **route_args(op, m, n, k, world),
                   cuda_graphs=not config.current().counts_host())
        info[op] = {"decision": d, "plan": d.plan.to_str()}
        coll_out = out_a2a if op == "all_to_all" else out_rs
        variants[f"{op}:comm"] = collective_into(op, src, coll_out)

        def seq(op=op):
            torch.mm(a, b, out=c)
            return collective_into(op, c, outs[op])()
        variants[f"{op}:seq"] = seq
        variants[f"{op}:concurrent"] = concurrent_call(op, a, b, c, src, coll_out, ctx["side"])
        for ch in CHUNKS:
            variants[f"{op}:chunked{ch}"] = chunked_call(op, a, b, ch, world, rank, ctx["side"])
        if op == "reduce_scatter":
            fn, why = asynctp_call(a, b)
            info[op]["asynctp_error"] = why
            if fn is not None:
                variants[f"{op}:asynctp"] = fn
        if args.fuse == "always" or d.fuse:
            variants[f"{op}:fused"] = fused_call(op, a, b, info[op]["plan"], world, args.call, ctx["fused_group"])
            for spec in args.fused_variants:
                _, mode, _, ctas, _ = check_variant(spec)
                group = make_capped_group(*ctas) if ctas and mode != "peer" else None
                variants[f"{op}:fused@{spec}"] = with_mode(spec, fused_call(op, a, b, info[op]["plan"], world,
                                                                           args.call, group))

    # probe: every variant once on every rank; a variant failing anywhere is dropped everywhere
    errors: dict[str, str] = {}
    for name, fn in variants.items():
        try:
            before = routes.stats.copy()
            fn()
            if name.endswith(":fused"):
                op = name.split(":")[0]
                info[op]["fused_path"] = routes.stats[f"fused:{op}"] > before[f"fused:{op}"]
                info[op]["fallback"] = [key for key in routes.stats if routes.stats[key] > before[key]
                                        and (key.startswith("skip:") or key == "unfused")]
                launch = routes.last_launch
                info[op]["launch"] = getattr(launch, "description", "") if info[op]["fused_path"] else ""
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
                                           if not is_diagnostic(spec))):
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
    row["pred_route"] = d.route
    if model is not None:
        row["pred_gemm_ms"] = model.gemm.reference_ms(m, n, k, "bfloat16")
        row["pred_comm_ms"] = model.curve.comm_ms(op, world, m * n * 2)
    row["errors"] = {key: v for key, v in errors.items() if key.startswith(f"{op}:") or key == "gemm"}
    if info.get("asynctp_error"):
        row["errors"][f"{op}:asynctp"] = info["asynctp_error"]
    return derive(row)


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
    p.add_argument("--gemm-grid", choices=kernel_select.GEMM_GRIDS, default=None,
                   help="the fused GEMM's grid (config gemm_grid; default: the settings')")
    p.add_argument("--fused-variants", default="",
                   help="extra fused variants timed side by side (config.patch), e.g. persistent/direct,"
                        "tiles/direct//@8,tiles/direct////gather,tiles/peer////ring2")
    p.add_argument("--graphs", action="store_true",
                   help="also time the sequential graph and the fused op replayed from CUDA graphs")
    p.add_argument("--experiments", default="",
                   help="flashoverlap's experiments setting for the whole run, comma-separated names of "
                        "config.EXPERIMENTS")
    p.add_argument("--scatter-start", choices=config.SCATTER_STARTS, default=None,
                   help="the reduce_scatter pull route's schedule for the whole run (the setting scatter_start; "
                        "default: the setting's, push)")
    p.add_argument("--time-budget-s", type=float, default=420.0, help="no new shape starts after this")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    args.ops = [x for x in args.ops.split(",") if x]
    args.fused_variants = [x for x in args.fused_variants.split(",") if x]
    for spec in args.fused_variants:
        try:
            check_variant(spec)
        except ValueError as exc:
            p.error(f"--fused-variants: {exc}")
    unknown = set(args.ops) - set(OPS)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}")
    args.experiments = frozenset(x for x in args.experiments.split(",") if x)
    if args.experiments - set(config.EXPERIMENTS):
        p.error(f"--experiments: unknown {sorted(args.experiments - set(config.EXPERIMENTS))}; known: "
                f"{', '.join(config.EXPERIMENTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    changes: dict[str, Any] = {}
    if args.sm_reserve is not None:
        changes["sm_reserve"] = args.sm_reserve
    if args.gemm_grid:
        changes["gemm_grid"] = args.gemm_grid
    if args.experiments:
        changes["experiments"] = args.experiments
    if args.scatter_start:
        changes["scatter_start"] = args.scatter_start
    with config.patch(**changes):  # the whole run (the fused variants patch on top)
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    owns_group = not dist.is_initialized()
    rank, world = init_distributed()
    if world < 2:
        print("bench_ops: run under torchrun with >= 2 ranks", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    routing = ROUTING if args.call == "op" else "direct"
    settings = config.current()
    try:
        from flashoverlap_inductor.cost_model import model_for

        model = model_for(gpu)[0]
    except Exception as exc:  # noqa: BLE001 - predictions are then missing, measurements are not
        print(f"bench_ops: no cost model ({exc!r})", file=sys.stderr)
        model = None
    shapes = parse_shapes(args.shapes) if args.shapes != "grid" else list(GRID)
    ctx = {"rank": rank, "world": world, "gpu": gpu, "model": model, "side": torch.cuda.Stream(),
           "fused_group": make_capped_group(args.fused_max_ctas) if args.fused_max_ctas else None,
           "timer": tm.Timer(rounds=args.rounds, target_ms=args.target_ms, min_iters=2, max_iters=40, spin_ms=0.3)}
    meta = {"world": world, "gpu": gpu, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "available": kernels.available(),
            "routing": routing, "call": args.call, "fuse": args.fuse, "rounds": args.rounds,
            "target_ms": args.target_ms, "sm_reserve": args.sm_reserve, "fused_max_ctas": args.fused_max_ctas,
            "gemm_grid": settings.tuning.gemm_grid or "model", "transport": settings.transport,
            "ring": settings.ring, "settings": settings.key(),
            "fused_variants": args.fused_variants,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "FLASHOVERLAP_TRANSPORT", "FLASHOVERLAP_RING")}}
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
            write_json(args.json, meta, rows, world)
    bar.close()
    if DEVICE == "cuda":
        routes.check()
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    meta["stats"] = dict(routes.stats)
    if rank == 0:
        summary = write_json(args.json, meta, rows, world) if args.json else summarize(rows, world)
        if args.png and rows:
            print(plot(rows, args.png, world), flush=True)
        print(format_table(rows, summary), flush=True)
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
