"""Where a fused all_gather -> GEMM call's host time goes (2+ GPUs, torchrun): the peer route's op at one shape,
its host time per call with the GPU kept busy (``tune.measure.host_us``), beside the unfused ops'
(``all_gather_into_tensor`` + ``mm`` per weight), then ``cProfile`` over the same batched calls: the functions
with the most own time and the most inclusive time per call (us; cProfile's own overhead inflates both, so
compare rows, not totals). ``--op reduce_scatter``: the same for GEMM -> reduce_scatter (``gemm_reduce_scatter``,
plan ``auto``, ``[M, K/world] @ [K/world, N]`` per rank, against ``mm`` + ``reduce_scatter_tensor``).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 examples/device/gather_host_profile.py [--shape 4096x6144x4096]
        [--weights 3] [--calls 400] [--op all_gather|reduce_scatter] [--gather-start push|handshake]
        [--scatter-route auto|peer|pull] [--graph-call] [--lines] [--rounds 5]

``--gather-start``: the gather's ``gather_start``; ``--scatter-route``: the reduce_scatter's ``scatter_route``
(default: the settings' own). ``--graph-call``: call the ops as a compiled graph does (the ``.default`` overload,
gradients off) rather than through the op packet with gradients on. ``--lines``: host us per call spent on each line
of the per-call path's functions (``sys.settrace`` line events in those functions only; the tracer's own cost, a
few us per line, inflates every line alike: compare lines, not totals). The variants timed first, interleaved in
``--rounds`` rounds (medians): the fused op as configured, its library GEMMs through ``cublasGemmEx`` (the
experiment ``gather_gemm_ex``), its GEMMs as ``torch.mm`` from Python (``gather_torch_gemms``), the unfused ops, and
the fused op with Python's garbage collector off.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.tune import measure as tm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4096x6144x4096")
    p.add_argument("--weights", type=int, default=3, help="GEMMs over the gathered rows (q/k/v: 3)")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--op", choices=("all_gather", "reduce_scatter"), default="all_gather")
    p.add_argument("--gather-start", dest="start", choices=("push", "handshake", "eager"), default=None)
    p.add_argument("--scatter-route", choices=("auto", "peer", "pull"), default=None)
    p.add_argument("--graph-call", action="store_true")
    p.add_argument("--lines", action="store_true")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every variant (medians reported)")
    args = p.parse_args()
    torch.cuda.set_device(dist.get_node_local_rank(fallback_rank=0))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, world, name = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
    m, n, k = (int(x) for x in args.shape.split("x"))
    a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
    ws = [(torch.randn(n // world // args.weights, k, device="cuda") / math.sqrt(k)).bfloat16().t()
          for _ in range(args.weights)]
    gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    base = config.current().replace(transport="peer")
    if args.start is not None:
        base = base.replace(gather_start=args.start)
    if args.scatter_route is not None:
        base = base.replace(scatter_route=args.scatter_route)
    op, key = torch.ops.flashoverlap.all_gather_gemm, base.key()
    if args.graph_call:
        op = op.default
        torch.set_grad_enabled(False)

    def fused():
        return op(a, ws, [None] * len(ws), 0, world, name, "ring", False, key)

    torch_key = base.replace(experiments=frozenset({"gather_torch_gemms"})).key()

    def fused_torch_mm():
        return op(a, ws, [None] * len(ws), 0, world, name, "ring", False, torch_key)

    def unfused():
        dist.all_gather_into_tensor(gathered, a)
        return [gathered @ w for w in ws]

    if args.op == "reduce_scatter":  # y = x @ w over K split across the ranks, then reduce_scatter of y's rows
        x = torch.randn(m, k // world, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, k // world, device="cuda") / math.sqrt(k)).bfloat16().t()
        rs_op = torch.ops.flashoverlap.gemm_reduce_scatter
        rs_op = rs_op.default if args.graph_call else rs_op
        scattered = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)

        def fused():
            return rs_op(x, w, None, "sum", world, name, "auto", key)

        def unfused():
            dist.reduce_scatter_tensor(scattered, x @ w)
            return scattered

    before = dict(routes.stats)
    fused()
    torch.cuda.synchronize()
    took = sorted(k for k, c in routes.stats.items() if k.startswith("route:") and c > before.get(k, 0))
    gemm_ex_key = base.replace(experiments=frozenset({"gather_gemm_ex"})).key()

    def fused_gemm_ex():  # the library's GEMMs through cublasGemmEx
        return op(a, ws, [None] * len(ws), 0, world, name, "ring", False, gemm_ex_key)

    def no_gc(fn):  # is part of a call's host time Python's garbage collector? (the same calls, collector off)
        def measured(calls, **kw):
            gc.disable()
            try:
                return tm.host_us(fn, calls, **kw)
            finally:
                gc.enable()
        return measured

    variants = {"fused": fused, "fused, GEMMs by cublasGemmEx": fused_gemm_ex,
                "fused, torch.mm GEMMs": fused_torch_mm, "unfused": unfused}
    if args.op == "reduce_scatter":  # its GEMMs have no library or torch.mm variant
        del variants["fused, GEMMs by cublasGemmEx"], variants["fused, torch.mm GEMMs"]
    timers = {name: (lambda calls, fn=fn, **kw: tm.host_us(fn, calls, **kw)) for name, fn in variants.items()}
    timers["fused, garbage collector off"] = no_gc(fused)
    per_round = max(40, args.calls // args.rounds)
    rounds: dict[str, list[float]] = defaultdict(list)
    for r in range(args.rounds):  # the variants interleaved, in a rotated order per round
        order = list(timers)  # (not ``name``: the group's name, which the variants read)
        for variant in order[r % len(order):] + order[:r % len(order)]:
            rounds[variant].append(timers[variant](per_round, batch=20, sync=dist.barrier))
    medians = tm.reduce_max([statistics.median(rounds[variant]) for variant in timers])
    lib_us = library_calls_us(fused, args.calls)
    stage_us = stages_us(fused, args.calls)
    line_us = lines_us(fused, args.calls) if args.lines else {}
    prof = cProfile.Profile()
    prof.enable()
    tm.host_us(fused, args.calls, batch=20, sync=dist.barrier)
    prof.disable()
    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x {world}, op {args.op}, start {args.start}, shape {args.shape}, "
              f"{args.weights} weights, route {took}; library GEMMs {routes.stats['gather:library_gemms']} calls, "
              f"through cuBLASLt {routes.stats['gather:cublaslt']}; Python threads: "
              f"{sorted(t.name for t in threading.enumerate())}")
        print(f"host us per call (median of {args.rounds} interleaved rounds of {per_round} calls, max over ranks): "
              + ", ".join(f"{variant} {us:.1f}" for variant, us in zip(timers, medians, strict=True)))
        print("library calls, host us per fused call (rank 0): "
              + ", ".join(f"{name} {us:.1f}" for name, us in sorted(lib_us.items(), key=lambda kv: -kv[1])))
        print("stages, host us per fused call, each without the stages inside it (rank 0, no profiler): "
              + ", ".join(f"{name} {us:.1f}" for name, us in stage_us.items()))
        if line_us:
            print("--- lines: host us per fused call on each line (rank 0, line tracer on; >= 2 us)")
            for (file, line), us in sorted(line_us.items(), key=lambda kv: -kv[1]):
                if us >= 2.0:
                    print(f"{us:9.1f}  {file}:{line}")
        calls = args.calls + 20  # host_us's warm-up calls are profiled too
        for order in ("tottime", "cumulative"):
            stats = pstats.Stats(prof, stream=io.StringIO())
            print(f"--- by {order}: us per fused call (ncalls / {calls})")
            for func, (_, nc, tt, ct, _) in sorted(stats.stats.items(),
                                                     key=lambda kv: -kv[1][2 if order == "tottime" else 3])[:args.rows]:
                file, line, fn = func
                print(f"{tt / calls * 1e6:9.1f} own {ct / calls * 1e6:9.1f} incl {nc / calls:6.2f}/call  "
                      f"{file.split('site-packages/')[-1].split('flashoverlap_inductor/')[-1]}:{line} {fn}")
    dist.destroy_process_group()


class _TimedLibrary:
    """The loaded library with every ``fo_*`` call's host time summed by name (ctypes calls are invisible to
    ``cProfile``: their time lands in the caller's own time)."""

    def __init__(self, lib, totals: dict) -> None:
        self._lib, self._totals = lib, totals

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)
        if not name.startswith("fo_"):
            return fn
        totals = self._totals

        def timed(*a):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a)
            finally:
                totals[name] += time.perf_counter_ns() - t0
        return timed


def library_calls_us(fn, calls: int) -> dict[str, float]:
    """Host us per call of ``fn`` inside each library entry point (``kernels.library`` wrapped for ``calls`` calls,
    the GPU kept busy by ``tm.host_us``)."""
    totals: dict[str, int] = defaultdict(int)
    real = kernels.library
    wrapped = _TimedLibrary(real(), totals)
    kernels.library = lambda: wrapped
    try:
        tm.host_us(fn, calls, batch=20, sync=dist.barrier)
    finally:
        kernels.library = real
    return {name: ns / 1e3 / (calls + 20) for name, ns in totals.items()}


def stages_us(fn, calls: int) -> dict[str, float]:
    """Host us per call of ``fn`` in each stage of a fused call, without the stages nested in it and without a
    profiler: ``op`` (the call as the caller sees it: the dispatcher and ``ops``' own checks), ``dispatch``
    (``routes.dispatch``: the settings), ``_dispatch`` (the memo, locks, faults), ``execute`` (the route),
    ``library`` (``gather_gemms.run_call``: the protocol's call, the GEMMs and the finish in one library call),
    ``finish`` (``gather_protocol.finish``: the Python loop's); each found by wrapping it for ``calls``
    calls (the wrappers' own cost, ~0.3 us each, lands in the enclosing stage)."""
    from flashoverlap_inductor.routes import gather_gemms, gather_peer, gather_protocol, scatter_pull

    totals: dict[str, int] = defaultdict(int)
    stack: list[list[int]] = []  # per open stage: [start ns, ns spent in stages nested in it]

    def timed(name, real):
        def wrapper(*a, **kw):
            stack.append([time.perf_counter_ns(), 0])
            try:
                return real(*a, **kw)
            finally:
                start, inner = stack.pop()
                took = time.perf_counter_ns() - start
                totals[name] += took - inner
                if stack:
                    stack[-1][1] += took
        return wrapper

    patches = [(routes, "dispatch"), (routes, "_dispatch"), (gather_peer.GatherPeerRoute, "execute"),
               (scatter_pull.ScatterPullRoute, "execute"), (gather_gemms, "run_call"), (gather_peer, "finish"),
               (gather_protocol, "finish")]  # the gather route's name for it and the pull route's
    saved = [(obj, name, obj.__dict__[name]) for obj, name in patches]
    for obj, name, real in saved:
        setattr(obj, name, timed(name if name != "run_call" else "library", real))
    op = timed("op", fn)
    try:
        tm.host_us(op, calls, batch=20, sync=dist.barrier)
    finally:
        for obj, name, real in saved:
            setattr(obj, name, real)
    return {name: ns / 1e3 / (calls + 20) for name, ns in totals.items()}


def lines_us(fn, calls: int) -> dict[tuple[str, int], float]:
    """Host us per call of ``fn`` on each line of the per-call path's functions (the op's implementation, the
    dispatcher, the routes' ``execute``, the library call's ``run_call`` and ``fill``, the finish): from one line
    event to the next in the same frame (a line's time includes what it calls outside those functions)."""
    from flashoverlap_inductor import ops
    from flashoverlap_inductor.routes import gather_gemms, gather_peer, scatter_pull, symmetric

    codes = {f.__code__ for f in (ops._all_gather_gemm, ops._gemm_reduce_scatter, routes.dispatch, routes._dispatch,
                                  gather_peer.GatherPeerRoute.execute, scatter_pull.ScatterPullRoute.execute,
                                  symmetric.SymmetricRoute.execute, gather_gemms.run_call, gather_gemms.fill,
                                  gather_peer.finish)}
    totals: dict[tuple[str, int], int] = defaultdict(int)

    def local(frame, event, _arg):
        now = time.perf_counter_ns()
        last = local.last.get(id(frame))
        if last is not None:
            totals[(frame.f_code.co_filename.split("flashoverlap_inductor/")[-1], last[0])] += now - last[1]
        if event == "return":
            local.last.pop(id(frame), None)
        else:
            local.last[id(frame)] = (frame.f_lineno, time.perf_counter_ns())
        return local

    local.last = {}

    def tracer(frame, event, _arg):
        return local if event == "call" and frame.f_code in codes else None

    sys.settrace(tracer)
    try:
        tm.host_us(fn, calls, batch=20, sync=dist.barrier)
    finally:
        sys.settrace(None)
    return {key: ns / 1e3 / (calls + 20) for key, ns in totals.items()}


if __name__ == "__main__":
    main()
