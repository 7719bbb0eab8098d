"""``python -m flashoverlap_inductor.bench timeline --op reduce_scatter_pull``: where the time of one fused GEMM ->
reduce_scatter call on the pull route goes (``routes.scatter_pull``, 2 ranks, one GPU each, NVLink).

    torchrun --nproc_per_node=2 -m flashoverlap_inductor.bench timeline --op reduce_scatter_pull \\
        --shapes 4096x4096x8192,16384x8192x14336 [--scatter-schedule push,handshake] [--lead 2] [--png DIR]

Per shape (``M x N x K``: A ``[M, K]`` per rank, B = W.t() with W ``[N, K]``, bf16, as ``examples/bench_ops.py``)
and schedule (``--scatter-schedule``, the setting ``scatter_start``: ``handshake``, the peer's half copied into the
rank's symmetric buffer and pulled by the peer after a handshake; ``push``, the default: pushed by copy engine into
the peer's receive slot), the route (``make_launch``, then ``execute``, no dispatcher) runs ``--iters``
probed calls (``runtime.probe.CallProbe``; the marks of ``gantt.pull_breakdown`` on the caller's stream and the
library's event of the part's landing on the copy stream) after ``--warmup`` plain ones, each behind a ``--spin-ms``
GPU spin and ``--lead`` plain calls (``timeline_peer.probed_calls``). In the same run: ``gemm`` (cuBLAS at the full M
rows), ``half`` (at M / 2), ``comm`` (NCCL ``reduce_scatter_tensor`` into ``[M / 2, N]``) and ``seq`` (the GEMM then
the collective), so the ideal ``max(gemm, comm)`` and ``hidden`` = (seq - total) / comm.

Prints per rank the breakdown of the gap to the ideal, the host time per call, the text Gantt and, with ``--png
DIR``, one PNG per shape and schedule. Ranks' clocks are not aligned beyond the barrier and the spin.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.routes import gather_start, scatter_pull

from . import gantt
from .timeline_peer import baselines, format_rows, launch_for, probed_calls, sweep, with_baselines, write_pngs

OPS = ("reduce_scatter_pull",)
SHAPES = "4096x4096x8192,16384x8192x14336"  # o_proj-like and down_proj-like (the pull route's default shapes)
SCHEDULES = config.SCATTER_STARTS  # the values of scatter_start this timeline compares
COLS = ("total", "ideal", "gap", "split", "peer_extra", "handshake", "own_extra", "wait", "add", "tail", "landed",
        "gemm", "half", "comm", "seq", "hidden", "host_ms")
HEADER = ("pull route call timeline, ms (medians of probed calls); gap = total - ideal = split + peer_extra + "
          "handshake + own_extra + wait + add + tail when the GEMM is the longer side; split = 2 half - gemm; "
          "landed: the peer's part here; hidden = (seq - total) / comm")


def probe_shape(m: int, n: int, k: int, schedule: str, args: argparse.Namespace) -> dict:
    """This rank's breakdown and lanes of the pull route at ``m x n x k`` under ``schedule`` (a dict; with
    ``declined`` instead when the route does not take the call: alike on every rank)."""
    rank = dist.get_rank()
    head = {"op": "reduce_scatter_pull", "m": m, "n": n, "k": k, "schedule": schedule, "rank": rank}
    if schedule not in SCHEDULES:
        return {**head, "declined": f"--scatter-schedule {schedule!r}: one of {', '.join(SCHEDULES)}"}
    if dist.get_world_size() != 2:
        return {**head, "declined": "the pull route runs on 2 ranks"}
    torch.manual_seed(1000 + rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda") / math.sqrt(k)).bfloat16().t()
    now = config.current()
    settings = now.replace(transport="peer", ring="off", scatter_route="pull", scatter_start=schedule)
    with config.using(settings):
        launch, ctx = launch_for(scatter_pull, "reduce_scatter", a, b, settings)
        if isinstance(launch, str):
            return {**head, "declined": launch}
        if bool(launch.options & gather_start.PUSH) != (schedule == "push"):  # e.g. past gather_push_max_mb
            return {**head, "declined": f"ran another schedule: {launch.description}"}
        probed = probed_calls(lambda: scatter_pull.ROUTE.execute(launch, ctx), ctx, args)
        if isinstance(probed, str):
            return {**head, "declined": probed}
        t, host_ms = probed
        routes.check()  # a wait that gave up raises here, on both ranks
    base = baselines("reduce_scatter", a, b, args.iters)
    breakdown, lanes = gantt.pull_breakdown(t, 1 - rank, base["gemm"], base["half"], base["comm"])
    return {**head, "how": launch.description, "breakdown": with_baselines(breakdown, base, host_ms), "lanes": lanes}


def title(head: dict) -> str:
    return f"{head['op']} {head['m']}x{head['n']}x{head['k']} schedule={head['schedule']}"


def format_report(rows: list[list[dict]]) -> str:
    """The text report of every (shape, schedule) (``timeline_peer.format_rows``). Pure."""
    return format_rows(rows, HEADER, COLS, title)


def png_path(png_dir: str, head: dict) -> str:
    return f"{png_dir}/timeline_pull_{head['m']}x{head['n']}x{head['k']}_{head['schedule']}.png"


def report(rows: list[list[dict]], png_dir: str | None) -> None:
    """Rank 0: ``format_report`` and, with ``png_dir``, one Gantt PNG per shape and schedule."""
    print(format_report(rows))
    write_pngs(rows, png_dir, png_path)


def collect(shapes: str | None, args: argparse.Namespace) -> list[list[dict]]:
    """Every rank's result per shape and schedule (a collective: every rank calls it alike)."""
    return sweep(shapes or SHAPES, args.scatter_schedule.split(","),
                 lambda m, n, k, schedule: probe_shape(m, n, k, schedule, args))
