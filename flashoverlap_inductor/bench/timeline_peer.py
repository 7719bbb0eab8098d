"""``python -m flashoverlap_inductor.bench timeline --op all_reduce|reduce_scatter``: where the time of one fused
GEMM -> all_reduce / reduce_scatter call on the peer route goes (2 ranks, one GPU each, NVLink).

    torchrun --nproc_per_node=2 -m flashoverlap_inductor.bench timeline --op reduce_scatter \\
        --shapes 4096x8192x8192,16384x8192x8192 [--gate epilogue,kernel] [--png DIR] [--json FILE]

Per shape (``M x N x K``: A ``[M, K]`` per rank, B = W.t() with W ``[N, K]``, bf16, as ``examples/bench_ops.py``)
and gate (``--gate``: ``epilogue``, the route's own, GEMM 2 waits for the peer's GEMM 1 before each tile's C load;
``kernel``, a wait kernel between the GEMMs, so the wait is a bar of its own), the peer route (``routes.peer``:
``make_launch``, then ``execute``, no dispatcher) runs ``--iters`` probed calls (``runtime.probe.CallProbe``: the
marks ``start`` / ``end`` on the caller's stream around the call, and the timing events ``fo_peer_call`` records at
its points, ``routes.peer.probe_points``: after GEMM 1, the notify / wait, GEMM 2, the flag exchange (by pull: the
join of the copy streams), the final copy (push), each copy group's copies (pull)) after ``--warmup`` plain ones,
each behind a ``--spin-ms`` GPU spin (``bench.timeline``). Every mark's median over the calls gives each rank's
timeline (ms since that rank's ``start``; ranks are not aligned with each other beyond the barrier and the spin).
In the same run: ``gemm`` (cuBLAS at the full M rows), ``half`` (cuBLAS at M / 2 rows: what one of the route's two
GEMMs would take alone), ``comm`` (NCCL ``all_reduce`` of ``[M, N]`` / ``reduce_scatter_tensor`` into
``[M / 2, N]``) and ``seq`` (the GEMM then the collective), so the ideal ``max(gemm, comm)`` and ``hidden`` =
(seq - total) / comm, the share of the collective the fused call hides (1: all of it).

Prints per rank the breakdown of the gap to the ideal (``bench.gantt.peer_breakdown``) and the host time per call,
draws the timelines as text and, with ``--png DIR``, one PNG per op, shape and gate. What events cannot show: the
per-tile timing inside the GEMMs (the gate's waits are inside ``gemm2`` with the epilogue gate: compare
``--gate kernel``), and the two ranks' clocks against each other.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.routes import peer
from flashoverlap_inductor.routes.base import Context
from flashoverlap_inductor.runtime import streams
from flashoverlap_inductor.runtime.probe import CallProbe
from flashoverlap_inductor.tune import measure

from . import gantt

OPS = ("all_reduce", "reduce_scatter")
SHAPES = "4096x8192x8192,16384x8192x8192"  # the default --shapes of these ops
GATES = ("epilogue", "kernel")
COLS = ("total", "ideal", "gap", "split", "gemm1_extra", "wait", "gemm2_extra", "exchange", "copy", "tail", "gemm",
        "half", "comm", "seq", "hidden", "host_ms")
HEADER = ("peer route call timeline, ms (medians of probed calls); gap = total - ideal = split + gemm1_extra + wait "
          "+ gemm2_extra + exchange + copy + tail when the GEMM is the longer side; split = 2 half - gemm; "
          "hidden = (seq - total) / comm (the collective's share hidden)")


def median_ms(fn, iters: int) -> float:
    """The median time of ``fn`` on the current stream over ``iters`` calls (ms, CUDA events; also the all_gather
    timeline's)."""
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def probed_calls(execute, ctx: Context, args: argparse.Namespace) -> tuple[dict[str, float], float] | str:
    """``args.warmup`` calls, then ``args.iters`` probed calls of ``execute()`` (each after a barrier, a device sync,
    ``args.spin_ms`` of GPU spin and ``args.lead`` plain calls queued behind the spin): the
    median of each probe mark (ms since ``start``) and the median host time per probed call (ms); or the reason a call
    returned instead of running (the route declined it, on every rank alike). Also the all_gather timeline's.
    ``args.host_gap_us`` (and on rank 1 ``args.skew_us`` more: a slower host, ``(lead + 1) x skew_us`` behind by the
    probed call) of host busy-wait before each lead and probed call emulates a host-paced caller (with ``--spin-ms 0``:
    the GPU waits for the host, as in a host-bound eager step)."""
    for _ in range(args.warmup):
        out = execute()
        if isinstance(out, str):
            return out
    marks: dict[str, list[float]] = {}
    host: list[float] = []
    gap_us, skew_us = getattr(args, "host_gap_us", 0.0), getattr(args, "skew_us", 0.0)
    if skew_us and dist.is_initialized() and dist.get_rank() == 1:
        gap_us += skew_us
    try:
        for _ in range(args.iters):
            ctx.probe = None
            dist.barrier()
            torch.cuda.synchronize()
            measure.spin(args.spin_ms)
            for _ in range(args.lead):  # back to back: plain calls queued behind the spin, before the probed call
                host_gap(gap_us)
                execute()
            host_gap(gap_us)
            ctx.probe = CallProbe()
            t0 = time.perf_counter()
            out = execute()
            host.append((time.perf_counter() - t0) * 1e3)
            if isinstance(out, str):  # declined before any mark: no timeline
                return out
            torch.cuda.synchronize()
            for name, ms in ctx.probe.times().items():
                marks.setdefault(name, []).append(ms)
    finally:
        ctx.probe = None
    return {name: statistics.median(v) for name, v in marks.items()}, statistics.median(host)


def host_gap(us: float) -> None:
    """Busy-waits ``us`` microseconds on the host (a caller's Python between calls; 0: returns at once)."""
    if us > 0:
        until = time.perf_counter() + us * 1e-6
        while time.perf_counter() < until:
            pass


def launch_for(route, op: str, a: torch.Tensor, b: torch.Tensor, settings: config.Settings) -> tuple[Any, Context]:
    """``route``'s launch (its module's ``make_launch``; or why it declines, from ``unsupported`` first) of the GEMM
    ``a @ b`` then ``op`` over the default group, no bias, under ``settings`` (inside ``config.using(settings)``),
    and the call's context: no dispatcher. Also the pull route's timeline's."""
    group, (m, n) = dist.group.WORLD, (a.shape[0], b.shape[1])
    call, opnd, out_shape = routes.make_call(op, a, b, None, group, "auto", None, None, [m, n], True)
    ctx = Context(a=a, b=b, bias=None, group=group, y_shape=[m, n], out_shape=out_shape, plan="auto",
                  settings=settings, opnd=opnd, res=streams.resources(torch.cuda.current_device()))
    why = route.unsupported(call, settings)
    return why or route.make_launch(call, settings, ctx), ctx


def baselines(op: str, a: torch.Tensor, b: torch.Tensor, iters: int) -> dict[str, float]:
    """The same run's references, ms medians: ``gemm`` (cuBLAS on all of ``a``'s rows), ``half`` (on half of them:
    one of a two-rank route's GEMMs alone), ``comm`` (NCCL's ``op`` alone on ``[M, N]``: all_reduce in place,
    reduce_scatter into ``[M / world, N]``) and ``seq`` (the GEMM then the collective). Also the pull route's."""
    m, n = a.shape[0], b.shape[1]
    full = torch.empty(m, n, device=a.device, dtype=a.dtype)
    part = torch.empty(m // dist.get_world_size(), n, device=a.device, dtype=a.dtype)

    def comm() -> None:
        if op == "all_reduce":
            dist.all_reduce(full)
        else:
            dist.reduce_scatter_tensor(part, full)

    return {"gemm": median_ms(lambda: torch.mm(a, b, out=full), iters),
            "half": median_ms(lambda: torch.mm(a[:m // 2], b), iters), "comm": median_ms(comm, iters),
            "seq": median_ms(lambda: (torch.mm(a, b, out=full), comm()), iters)}


def with_baselines(breakdown: dict[str, float], base: dict[str, float], host_ms: float) -> dict[str, float]:
    """``breakdown`` (a route's, ms, with its ``total``) with the same run's ``baselines``, the host ms per call and
    ``hidden`` = (seq - total) / comm (NaN without communication time); also the pull route's."""
    comm = base["comm"]
    breakdown.update(base, host_ms=host_ms, hidden=(base["seq"] - breakdown["total"]) / comm if comm > 0 else math.nan)
    return breakdown


def probe_shape(op: str, m: int, n: int, k: int, gate: str, args: argparse.Namespace) -> dict:
    """This rank's breakdown and lanes of the peer route's ``op`` at ``m x n x k`` with ``gate`` (a dict; with
    ``declined`` instead when the route does not take the call)."""
    rank = dist.get_rank()
    head = {"op": op, "m": m, "n": n, "k": k, "gate": gate, "rank": rank}
    if gate not in GATES:
        return {**head, "declined": f"--gate {gate!r}: one of {', '.join(GATES)}"}
    torch.manual_seed(1000 + rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda") / math.sqrt(k)).bfloat16().t()
    settings = config.current().replace(transport="peer", ring="off")
    with config.using(settings):
        launch, ctx = launch_for(peer, op, a, b, settings)
        if isinstance(launch, str):
            return {**head, "declined": launch}
        launch.template.gate_in_kernel = int(gate == "epilogue")  # before the first call: its args copy the template
        probed = probed_calls(lambda: peer.ROUTE.execute(launch, ctx), ctx, args)
        if isinstance(probed, str):
            return {**head, "declined": probed}
        t, host_ms = probed
        routes.check()  # a wait that gave up raises here, on both ranks
    base = baselines(op, a, b, args.iters)
    breakdown, lanes = gantt.peer_breakdown(t, base["gemm"], base["half"], base["comm"])
    return {**head, "how": launch.description, "breakdown": with_baselines(breakdown, base, host_ms), "lanes": lanes}


def title(head: dict) -> str:
    return f"{head['op']} {head['m']}x{head['n']}x{head['k']} gate={head['gate']}"


def format_rows(rows: list[list[dict]], header: str, cols: Sequence[str], title_of: Callable[[dict], str]) -> str:
    """The text report of every row (one result per rank): per rank the breakdown's ``cols`` (ms; ``hidden`` a
    fraction), then the text Gantt of every rank; a declined one in one line. Pure; also the pull route's."""
    lines = [header]
    for per_rank in rows:
        declined = [r for r in per_rank if "declined" in r]
        if declined:
            lines.append(f"== {title_of(per_rank[0])}: declined: {declined[0]['declined']}")
            continue
        lines += [f"== {title_of(per_rank[0])}: {per_rank[0]['how']}", "   rank | " + " | ".join(cols)]
        lines += [f"   {r['rank']:>4} | " + " | ".join(f"{r['breakdown'][c]:.3f}" for c in cols) for r in per_rank]
        lines.append(gantt.text({r["rank"]: r["lanes"] for r in per_rank}))
    return "\n".join(lines)


def write_pngs(rows: list[list[dict]], png_dir: str | None, path_of: Callable[[str, dict], str]) -> None:
    """With ``png_dir``, one Gantt PNG per row that ran on every rank (at ``path_of(png_dir, row's head)``)."""
    for per_rank in rows:
        if png_dir and not any("declined" in r for r in per_rank):
            path = path_of(png_dir, per_rank[0])
            gantt.png({r["rank"]: r["lanes"] for r in per_rank}, path)
            print(f"   wrote {path}")


def sweep(shapes: str, variants: Sequence[str], probe: Callable[[int, int, int, str], dict]) -> list[list[dict]]:
    """``probe(m, n, k, variant)`` per shape (``MxNxK,...``) and variant, every rank's result gathered per row (a
    collective: every rank calls it alike); also the all_gather and pull routes' timelines'."""
    rows = []
    for item in shapes.split(","):
        m, n, k = (int(x) for x in item.lower().split("x"))
        for variant in variants:
            got: list = [None] * dist.get_world_size()
            dist.all_gather_object(got, probe(m, n, k, variant))
            rows.append(got)
    return rows


def format_report(rows: list[list[dict]]) -> str:
    """The text report of every (op, shape, gate) (``format_rows``). Pure."""
    return format_rows(rows, HEADER, COLS, title)


def png_path(png_dir: str, head: dict) -> str:
    return f"{png_dir}/timeline_{head['op']}_{head['m']}x{head['n']}x{head['k']}_{head['gate']}.png"


def report(rows: list[list[dict]], png_dir: str | None) -> None:
    """Rank 0: ``format_report`` and, with ``png_dir``, one Gantt PNG per op, shape and gate."""
    print(format_report(rows))
    write_pngs(rows, png_dir, png_path)


def collect(op: str, shapes: str | None, args: argparse.Namespace) -> list[list[dict]]:
    """Every rank's result per shape and gate of ``op`` (a collective: every rank calls it alike)."""
    return sweep(shapes or SHAPES, args.gate.split(","), lambda m, n, k, gate: probe_shape(op, m, n, k, gate, args))
