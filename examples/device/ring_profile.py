"""Diagnostic: where a ring-route call spends its GPU time (2 ranks; run with torchrun --nproc_per_node=2).

    torchrun --nproc_per_node=2 examples/device/ring_profile.py [--shape 2048x8192x14336] [--op all_reduce]
    python examples/device/ring_profile.py --steps-only [--shape ...]     # one GPU: the steps alone

For the peer route and the ring in 1, 2 and 4 rounds: the time per call of 20 calls back to back (CUDA events,
median of 5 samples), then on rank 0 a torch.profiler table of the GPU kernels and copies of 10 calls. Then each
GEMM step alone next to torch.mm, on one GPU: at the pieces' row counts, every compiled ``_addc`` configuration at
its unpadded swizzle, and the pair ``routes.ring.step_configs`` picks (step 0's plain configuration, then the
``_addc`` one).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, ops, routes  # noqa: F401  (ops registers torch.ops.flashoverlap.*)
from flashoverlap_inductor.build import CONFIGS
from flashoverlap_inductor.native import kernels  # noqa: F401  (ops registers torch.ops.flashoverlap.*)
from flashoverlap_inductor.tools import kernel_calls  # noqa: F401  (ops registers torch.ops.flashoverlap.*)


def _time(fn, calls: int = 20, samples: int = 5, collective: bool = True) -> float:
    """ms per call, median over samples of ``calls`` back-to-back calls (``collective``: every rank calls, each
    sample starts after a barrier; else one rank times a local kernel, after 3 warm-up calls)."""
    out = []
    if not collective:
        for _ in range(3):
            fn()
    for _ in range(samples):
        if collective:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / calls)
    return statistics.median(out)


def steps(a: torch.Tensor, w: torch.Tensor) -> None:
    """Each step GEMM alone at the pieces' row counts (see the module docstring); prints one line per row count."""
    n, k = w.shape
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    adds = [c for c in kernels.configs(add_c=1) if ("bfloat16", "nk") in c.variants]
    runtime_choice = kernels.config_info(CONFIGS[0].name)  # the default plain configuration (as the runtime picks)
    for rows in (256, 512, 1024, 2048):
        x = a[:rows]
        c = torch.randn(rows, n, device="cuda").bfloat16()
        cols = [f"torch.mm {_time(lambda x=x: torch.mm(x, w.t()), collective=False):.3f}"]
        for info in adds:
            s = kernels.unpadded_swizzle(rows, n, info.tile_m, info.tile_n, info.cluster_m, info.cluster_n,
                                         kernels.DEFAULT_SWIZZLE)
            t = _time(lambda x=x, c=c, s=s, name=info.name: kernel_calls.signal_gemm(x, w.t(), config=name, addend=c,
                                                                               swizzle=s), collective=False)
            cols.append(f"{info.name}@{s} {t:.3f}")
        first, add = routes.ring.step_configs(runtime_choice, "bfloat16", "nk", rows, n, sms)
        s = min(kernels.unpadded_swizzle(rows, n, i.tile_m, i.tile_n, i.cluster_m, i.cluster_n,
                                         kernels.DEFAULT_SWIZZLE) for i in (first, add))
        t0 = _time(lambda x=x, s=s, f=first.name: kernel_calls.signal_gemm(x, w.t(), config=f, swizzle=s),
                   collective=False)
        t1 = _time(lambda x=x, c=c, s=s, g=add.name: kernel_calls.signal_gemm(x, w.t(), config=g, addend=c, swizzle=s),
                   collective=False)
        print(f"step {rows}x{n}x{k} ms: {'  '.join(cols)}  | picked {first.name} {t0:.3f} / {add.name} {t1:.3f} "
              f"at swizzle {s}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x8192x14336")
    ap.add_argument("--op", default="all_reduce")
    ap.add_argument("--steps-only", action="store_true", help="one GPU, no process group: the steps alone")
    args = ap.parse_args()
    m, n, k = (int(x) for x in args.shape.split("x"))
    if args.steps_only:
        torch.cuda.set_device(0)
        gen = torch.Generator().manual_seed(0)
        steps(torch.randn(max(m, 2048), k, generator=gen).bfloat16().cuda(),
              (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().cuda())
        return
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    gen = torch.Generator().manual_seed(rank)
    a = torch.randn(m, k, generator=gen).bfloat16().cuda()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().cuda()
    name = dist.group.WORLD.group_name
    fo = torch.ops.flashoverlap

    def call():
        if args.op == "all_reduce":
            return fo.gemm_all_reduce(a, w.t(), None, "sum", name, "auto")
        return fo.gemm_reduce_scatter(a, w.t(), None, "sum", 2, name, "auto")

    for label, ring, rounds in (("peer", "off", 2), ("ring1", "all", 1), ("ring2", "all", 2), ("ring4", "all", 4)):
        with config.patch(ring=ring, ring_rounds=rounds, scatter_route="peer"):  # not the default pull route
            for _ in range(5):
                call()
            ms = _time(call)
            launch = routes.last_launch
            if rank == 0:
                print(f"== {label}: {ms:.3f} ms per call; {getattr(launch, 'description', launch)}", flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call()
                torch.cuda.synchronize()
        if rank == 0:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70),
                  flush=True)
    routes.reset()
    if rank == 0:
        steps(a, w)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
