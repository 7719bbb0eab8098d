"""Where the time of one fused MoE call goes on 2 GPUs (a diagnostic for ``examples/bench_moe.py``): per op and shape,
the host time of a call, its wall time with a sync, a torch profiler table (top ops by device and host time) and,
with ``--cprofile N``, the Python functions that hold the host longest over N calls (rank 0, cProfile's own time),
and with ``--sections N`` the host time of each step of a fused call (inclusive, microseconds per call over N
back-to-back calls, no profiler: ``SECTIONS`` wrapped in timers; rank 0).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 examples/device/moe_profile.py [--shapes qwen3:4096]
        [--plans blocks,blocks+deferred] [--trace DIR] [--cprofile 20] [--sections 50] [--steps-too]

``--backend gloo``: every rank on GPU 0 (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), for the peer transfers'
plans (``+peer``) on one GPU: their host steps' time (``--sections``; the settle's exchange goes through the host
there, so host and wall times per call are not the 2-GPU ones), never a speed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_moe as bm  # noqa: E402

from flashoverlap_inductor import config  # noqa: E402
from flashoverlap_inductor.native import grouped  # noqa: E402
from flashoverlap_inductor.routes import (  # noqa: E402
    agree,
    combine,
    moe_combine_lib,
    moe_cut_lib,
    moe_deferred,
    moe_dispatch,
    moe_expert_cut,
    moe_fast,
    moe_nccl,
    moe_p2p,
    moe_peer,
    moe_plan_kernel,
    moe_plan_lib,
)
from flashoverlap_inductor.runtime import triton_launch  # noqa: E402

# (module, attribute): the steps of a fused call timed by --sections (inclusive: a step's time holds its callees')
SECTIONS = [(moe_p2p, "run_call"), (agree, "check_once"), (moe_p2p, "issue_dispatch"), (moe_p2p, "exchange"),
            (moe_nccl, "transfer"), (moe_plan_kernel, "build"), (moe_p2p, "copy_rows"), (torch, "_grouped_mm"),
            (moe_fast, "_block_gemm"), (moe_p2p, "end_call"), (moe_deferred, "settle_later"),
            (moe_nccl, "gather_status"), (moe_deferred, "poison_if_bad"), (moe_deferred, "raise_pending"),
            (moe_p2p, "settle"), (moe_plan_kernel, "_launch"), (triton_launch.Launcher, "__call__"),
            (moe_expert_cut, "run_dispatch"), (moe_fast, "pieces_with_torch"), (grouped, "grouped_mm"),
            (moe_plan_lib, "move_rows"), (moe_p2p, "upload"), (moe_fast, "BlockPlan"), (moe_cut_lib, "run"),
            (moe_combine_lib, "run"), (moe_peer, "begin"), (moe_peer.PeerCall, "send"), (moe_peer.PeerCall, "finish"),
            (moe_nccl, "exchange_blocks")]
# with --fine, the small steps too (what the Python around the library calls costs)
FINE = [(moe_dispatch, "run_p2p"), (moe_dispatch, "dispatch"), (combine, "run_p2p"), (combine, "dispatch"),
        (moe_p2p, "unsupported"), (moe_expert_cut, "takes"), (moe_expert_cut, "eligible"), (moe_plan_lib, "usable"),
        (moe_cut_lib, "should_run"), (moe_plan_lib, "plan_args"), (grouped, "call_args"),
        (moe_plan_lib, "should_poison"), (moe_plan_lib, "poison"), (moe_deferred, "_mirror"), (config, "from_key"),
        (moe_p2p, "count_route"), (moe_fast, "run_combine"), (moe_fast, "run_dispatch"), (moe_deferred, "defers"),
        (moe_deferred, "enter_call"), (moe_p2p, "lock"), (moe_fast, "_block_gemm")]


def python_steps(f):
    """``f`` with the one library calls off (``moe_cut_lib``'s dispatch cut, ``moe_combine_lib``'s combine): their
    Python steps, for comparison."""
    def run():
        saved = [(lib, lib._refused[:]) for lib in (moe_cut_lib, moe_combine_lib)]
        for lib, _ in saved:
            lib._refused[:] = ["moe_profile: the Python steps"]
        try:
            return f()
        finally:
            for lib, old in saved:
                lib._refused[:] = old
    return run


def _name(owner) -> str:
    return owner.__name__.rsplit(".", 1)[-1]


def timed_sections(calls: int, f, fine: bool = False) -> tuple[float, dict[str, tuple[float, int]]]:
    """Host ms per call of ``calls`` back-to-back calls of ``f``, and per ``SECTIONS`` entry (and ``FINE``'s where
    ``fine``; us per call, entries per call), with each entry wrapped in a timer for the calls' duration."""
    sections = SECTIONS + (FINE if fine else [])
    spent: dict[str, list[float]] = {f"{_name(m)}.{a}": [0.0, 0] for m, a in sections}
    saved = [(m, a, getattr(m, a)) for m, a in sections]

    def timer(name, fn):
        def wrapped(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[name][0] += time.perf_counter() - t0
                spent[name][1] += 1
        return wrapped

    for m, a, fn in saved:
        setattr(m, a, timer(f"{_name(m)}.{a}", fn))
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        host = (time.perf_counter() - t0) * 1e3 / calls
        torch.cuda.synchronize()
    finally:
        for m, a, fn in saved:
            setattr(m, a, fn)
    return host, {k: (v[0] * 1e6 / calls, v[1] / calls) for k, v in spent.items() if v[1]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3:4096,mixtral:4096")
    p.add_argument("--plans", default="blocks", help="comma-separated bench_moe plans (e.g. blocks+deferred)")
    p.add_argument("--cprofile", type=int, default=0, help="calls of each fused variant under cProfile (rank 0)")
    p.add_argument("--sections", type=int, default=0, help="back-to-back calls of each fused variant with its steps "
                   "timed (rank 0 prints)")
    p.add_argument("--trace", default=None)
    p.add_argument("--fine", action="store_true", help="with --sections: the small steps too (FINE)")
    p.add_argument("--steps-too", action="store_true", help="also time the dispatch cut by expert and the combine "
                   "on their Python steps (the one library calls of moe_cut_lib and moe_combine_lib off)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="gloo: every rank on GPU 0, for the +peer plans' host steps (module docstring)")
    args = p.parse_args()
    torch.cuda.set_device(0 if args.backend == "gloo" else dist.get_node_local_rank(fallback_rank=0))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(args.backend, device_id=dev if args.backend == "nccl" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    with config.patch(experiments={"moe_p2p_cuda"}):
        for preset, tokens in bm.shapes_of(args.shapes):
            shape = bm.PRESETS[preset]
            r = bm.routing(shape["experts"], shape["top_k"], tokens, world, rank, dev)
            for op in ("dispatch", "combine"):
                plans = args.plans.split(",")
                variants, seq = bm._variants(op, shape, r, plans, dev)
                timed = [("seq", seq), *((plan, variants[f"fused[{plan}]"]) for plan in plans)]
                if args.steps_too:  # the Python steps beside the one library call (the cut's, the combine's)
                    timed += [(f"{plan}/steps", python_steps(variants[f"fused[{plan}]"])) for plan in plans
                              if plan.startswith("experts" if op == "dispatch" else "blocks")]
                for name, f in timed:
                    for _ in range(5):
                        f()
                    torch.cuda.synchronize()
                    host, wall = [], []
                    for _ in range(10):
                        dist.barrier()
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        f()
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        host.append((t1 - t0) * 1e3)
                        wall.append((t2 - t0) * 1e3)
                    if rank == 0:
                        print(f"== {op} {preset}:{tokens} {name}: host {statistics.median(host):.3f} ms, "
                              f"wall {statistics.median(wall):.3f} ms", flush=True)
                    if args.sections and name != "seq":
                        dist.barrier()
                        direct = triton_launch.counts["direct"]
                        host_ms, steps = timed_sections(args.sections, f, args.fine)
                        if rank == 0:
                            print(f"-- steps of {op} {preset}:{tokens} {name}: host {host_ms:.3f} ms per call back to "
                                  f"back, {(triton_launch.counts['direct'] - direct) / args.sections:.1f} direct "
                                  "Triton launches per call; us per call (calls per call), inclusive:")
                            for k, (us, n) in sorted(steps.items(), key=lambda kv: -kv[1][0]):
                                print(f"   {k:<32} {us:8.1f} us  ({n:g})", flush=True)
                    if args.cprofile and name != "seq":
                        prof = cProfile.Profile()
                        dist.barrier()
                        torch.cuda.synchronize()
                        prof.enable()
                        for _ in range(args.cprofile):
                            f()
                        prof.disable()
                        torch.cuda.synchronize()
                        if rank == 0:
                            text = io.StringIO()
                            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
                            print(f"-- cProfile, {args.cprofile} calls of {op} {preset}:{tokens} {name} (tottime)")
                            print("\n".join(line[:170] for line in text.getvalue().splitlines()[:40]), flush=True)
                fused = variants[f"fused[{plans[0]}]"]
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(3):
                        fused()
                    torch.cuda.synchronize()
                if rank == 0:
                    ka = prof.key_averages()
                    print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
                    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
                    if args.trace:
                        prof.export_chrome_trace(os.path.join(args.trace, f"moe_{op}_{preset}_{tokens}.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
