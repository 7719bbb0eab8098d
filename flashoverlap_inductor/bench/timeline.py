"""``python -m flashoverlap_inductor.bench timeline``: where the time of one fused call goes, per rank.

    torchrun --nproc_per_node=2 -m flashoverlap_inductor.bench timeline [--shapes 4096x6144x4096] [--png DIR]
    torchrun --nproc_per_node=2 -m flashoverlap_inductor.bench timeline --op reduce_scatter \\
        [--shapes 4096x8192x8192] [--gate epilogue,kernel] [--png DIR] [--json FILE]
    torchrun --nproc_per_node=2 -m flashoverlap_inductor.bench timeline --op reduce_scatter_pull \\
        [--scatter-schedule push,handshake] [--lead 2] [--png DIR]
    FO_PART=B FO_TIMELINE_ARGS="--op reduce_scatter" bash examples/device/two_gpu_suite.sh   # (its timeline step)

``--op all_gather`` (the default): all_gather -> GEMM on the gather_peer route, below. ``--op all_reduce`` /
``--op reduce_scatter`` (a comma-separated list runs each): GEMM -> collective on the peer route of 2 ranks
(``bench.timeline_peer``: GEMM 1, the wait or gate, GEMM 2 beyond a GEMM of its rows alone, the flag exchange, the
copy and the tail against the ideal, ms). ``--op reduce_scatter_pull``: the reduce_scatter pull route of 2 ranks, the
default 2-rank route for most bf16 shapes (``bench.timeline_pull``: each half's GEMM, the protocol's kernels, the
wait for the peer's part, the add and the tail against the ideal, under its handshake and push schedules).

all_gather: under ``torchrun --nproc_per_node=W`` (NCCL, one GPU per rank, one host). Per shape (``M x N x K``: M
gathered rows, N before the split over ranks, as ``examples/bench_gather.py``) and GEMM start (``gather_start``),
the gather_peer route runs ``--iters`` probed calls (``runtime.probe.CallProbe``: CUDA events at the call's start,
after the handshake, at each pull's landing on the copy stream, after each shard's GEMM and at the end; the probed
calls issue their GEMMs as ``torch.mm`` calls, not in one library call as the route does, since the marks sit
between them: the same kernels, more host time) after ``--warmup`` plain ones; every mark's median over the calls
gives the timeline of each rank. Before each probed call the GPU spins ``--spin-ms`` (default 1 ms) so the host has
enqueued the whole call before it starts: the marks time the device alone (``--spin-ms 0``: the call as issued from an
idle GPU, host gaps included; the first run on 2 H200s, without the spin, counted up to 0.08 ms of host enqueue time as
"handshake"). ``--lead N`` queues N plain calls of the shape between the spin and each probed call, so the probed call
runs back to back behind them (2 H200s: a lone push call showed no handshake where back-to-back ones ran 0-7% slower
than the handshake start's; this shows the difference stage by stage). ``--host-gap-us G`` busy-waits G us on the host
before each lead and probed call (``--skew-us S``: S more per call on rank 1, a slower host), which with ``--spin-ms 0``
emulates a host-paced caller and a late rank (every op). In the same run, ``gemm`` (cuBLAS on the whole gathered tensor)
and ``comm`` (``all_gather_into_tensor``) alone give the ideal ``max(gemm, comm)``.

Prints per rank the breakdown of the gap to the ideal (``bench.gantt.gather_breakdown``: handshake, the shard GEMMs'
time beyond the GEMM alone, GEMM waits for pulls, tail) and the host time per call, draws the timelines as text and,
with ``--png DIR``, one PNG per shape and start (every rank's compute and copy lanes on one axis), and writes
``--json``. What it cannot show yet: inside the fused GEMM kernels (their per-tile signals need device timestamps in
the kernels), and the all_to_all and ring routes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.routes import gather_peer
from flashoverlap_inductor.routes.base import Context
from flashoverlap_inductor.schedule import gather as gather_schedule

from . import gantt, timeline_peer, timeline_pull
from .timeline_peer import median_ms, probed_calls

GATHER_SHAPES = "4096x6144x4096,16384x28672x4096"  # the default --shapes of all_gather
OPS = ("all_gather", *timeline_peer.OPS, *timeline_pull.OPS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flashoverlap_inductor.bench timeline",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="all_gather",
                   help="all_gather (all_gather -> GEMM, gather_peer route), all_reduce or reduce_scatter (GEMM -> "
                        "collective, peer route, 2 ranks), reduce_scatter_pull (the pull route, 2 ranks); "
                        "comma-separated: each in turn")
    p.add_argument("--shapes", default=None,
                   help=f"MxNxK,...; all_gather: M gathered rows, N before the split (default {GATHER_SHAPES}); "
                        f"all_reduce / reduce_scatter: A [M, K] per rank, B [K, N] (default {timeline_peer.SHAPES}); "
                        f"reduce_scatter_pull: the same (default {timeline_pull.SHAPES})")
    p.add_argument("--gather-start", "--start", dest="start", default="push,handshake",
                   help="all_gather: gather_start values to compare (comma-separated; under torchrun write "
                        "--gather-start: torchrun takes --start for its --start-method)")
    p.add_argument("--experiments", default="",
                   help="all_gather: experiments on for every probed call (comma-separated, e.g. gather_copy_notify)")
    p.add_argument("--gate", default="epilogue",
                   help="all_reduce / reduce_scatter: GEMM 2's wait for the peer's GEMM 1 to compare (comma-separated):"
                        " epilogue (the route's, before each tile's C load), kernel (a wait kernel between the GEMMs)")
    p.add_argument("--scatter-schedule", default="push,handshake",
                   help="reduce_scatter_pull: the pull route's schedules to compare (comma-separated values of the "
                        "setting scatter_start: push, the default, or handshake)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--spin-ms", type=float, default=1.0,
                   help="GPU spin before each probed call, so the host has enqueued the whole call before it starts "
                        "(the marks then time the device alone); 0: the call as issued (host gaps included)")
    p.add_argument("--lead", type=int, default=0,
                   help="plain calls of the same shape queued right before each probed call (after the spin, no "
                        "sync between): the probed call then starts behind them, as in a back-to-back benchmark "
                        "or a model, where a schedule's waits for the peers' previous call show")
    p.add_argument("--host-gap-us", type=float, default=0.0,
                   help="host busy-wait before each lead and probed call (us): with --spin-ms 0, a host-paced caller "
                        "whose GPU waits for it, as in a host-bound eager step")
    p.add_argument("--skew-us", type=float, default=0.0,
                   help="rank 1's extra host wait before each lead and probed call (us): a slower host, (lead + 1) x "
                        "skew behind by the probed call")
    p.add_argument("--png", default=None, help="folder for one Gantt PNG per shape and start (or op, shape and gate)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.host_gap_us < 0 or args.skew_us < 0:
        p.error("--host-gap-us and --skew-us are waits: >= 0")
    bad = [op for op in args.op.split(",") if op not in OPS]
    if bad:
        p.error(f"--op {','.join(bad)}: one of {', '.join(OPS)}")
    return args


def probe_shape(m: int, n: int, k: int, start: str, args: argparse.Namespace) -> dict:
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1000 + rank)
    a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n // world, k, device="cuda") / math.sqrt(k)).bfloat16().t()
    gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    extra = frozenset(x for x in args.experiments.split(",") if x)
    settings = config.current().replace(gather_start=start, transport="peer",
                                        experiments=config.current().experiments | extra)
    call, _, _ = routes.make_call("all_gather", a, [b], [None], group, "ring", None, None, [m, k], True)
    why = gather_peer.unsupported(call, settings)
    ctx = Context(a=a, b=[b], bias=[None], group=group, y_shape=[m, k], out_shape=[m, k], plan="ring",
                  settings=settings, gather_dim=0)
    launch = why or gather_peer.make_launch(call, settings, ctx)
    if isinstance(launch, str):
        return {"m": m, "n": n, "k": k, "start": start, "declined": launch}
    probed = probed_calls(lambda: gather_peer.ROUTE.execute(launch, ctx), ctx, args)
    if isinstance(probed, str):
        return {"m": m, "n": n, "k": k, "start": start, "declined": probed}
    t, host_ms = probed
    gemm_ms = median_ms(lambda: gathered @ b, args.iters)
    comm_ms = median_ms(lambda: dist.all_gather_into_tensor(gathered, a), args.iters)
    order = gather_schedule.arrival_order(rank, world)
    breakdown, lanes = gantt.gather_breakdown(t, rank, order, gemm_ms, comm_ms)
    breakdown.update(gemm=gemm_ms, comm=comm_ms, host_ms=host_ms)
    return {"m": m, "n": n, "k": k, "start": start, "rank": rank, "breakdown": breakdown, "lanes": lanes}


def report(rows: list[list[dict]], png_dir: str | None) -> None:
    """Rank 0: per shape and start, each rank's breakdown, then the text Gantt (and the PNG)."""
    cols = ("total", "ideal", "gap", "handshake", "gemm_extra", "waits", "tail", "gemm", "comm", "host_ms")
    print("gather_peer call timeline, ms (medians of probed calls); gap = total - ideal = handshake + gemm_extra + "
          "waits + tail when the GEMM is the longer side")
    for per_rank in rows:
        head = per_rank[0]
        title = f"{head['m']}x{head['n']}x{head['k']} gather_start={head['start']}"
        if "declined" in head:
            print(f"== {title}: declined: {head['declined']}")
            continue
        print(f"== {title}\n   rank | " + " | ".join(cols))
        for r in per_rank:
            print(f"   {r['rank']:>4} | " + " | ".join(f"{r['breakdown'][c]:.3f}" for c in cols))
        timeline = {r["rank"]: r["lanes"] for r in per_rank}
        print(gantt.text(timeline))
        if png_dir:
            path = f"{png_dir}/timeline_{head['m']}x{head['n']}x{head['k']}_{head['start']}.png"
            gantt.png(timeline, path)
            print(f"   wrote {path}")


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.cuda.set_device(dist.get_node_local_rank(fallback_rank=0) if dist.is_torchelastic_launched() else 0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    if dist.get_world_size() < 2:
        print("timeline: run under torchrun with >= 2 ranks", file=sys.stderr)
        return 2
    rows, peer_rows, pull_rows = [], [], []
    for op in args.op.split(","):
        if op in timeline_pull.OPS:
            pull_rows += timeline_pull.collect(args.shapes, args)
            continue
        if op != "all_gather":
            peer_rows += timeline_peer.collect(op, args.shapes, args)
            continue
        rows += timeline_peer.sweep(args.shapes or GATHER_SHAPES, args.start.split(","),
                                    lambda m, n, k, start: probe_shape(m, n, k, start, args))
    if dist.get_rank() == 0:
        if args.png:
            os.makedirs(args.png, exist_ok=True)
        if rows:
            report(rows, args.png)
        if peer_rows:
            timeline_peer.report(peer_rows, args.png)
        if pull_rows:
            timeline_pull.report(pull_rows, args.png)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                           "peer_rows": peer_rows, "pull_rows": pull_rows}, f, indent=1)
    dist.destroy_process_group()
    return 0
