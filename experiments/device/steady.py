"""Diagnostic: sustained (back-to-back) times of the fused all_reduce per kernel configuration and group count,
next to the same signal GEMM alone on the same SMs, cuBLAS alone and cuBLAS then NCCL, in one interleaved run.

Run under ``torchrun --nproc_per_node=W``; shapes via ``--shapes MxNxK,...``. Times: medians of back-to-back
calls between CUDA events, max over ranks (``tune_measure.Timer``), in ms.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from flashoverlap_inductor import kernels, runtime_gpu, streams
from flashoverlap_inductor import tune_measure as tm
from flashoverlap_inductor.schedule import plan as P

KERNELS = (("coop_128x256x64_c2x1_e128x64", 128, 256), ("pp_128x128x64_c1x1", 128, 128),
           ("coop_256x128x64_c1x1", 256, 128))


def variants_for(m: int, n: int, k: int, rank: int, sms: int, groups: list[int], group: dist.ProcessGroup) -> dict:
    torch.manual_seed(rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    variants = {"cublas": lambda: torch.mm(a, b, out=out), "seq": lambda: dist.all_reduce(torch.mm(a, b))}
    for name, tile_m, tile_n in KERNELS:
        variants[f"gemm {name} {sms}SM"] = (
            lambda name=name: kernels.signal_gemm(a, b, None, out, config=name, sm_count=sms))
        for g in groups:
            plan = P.uniform_plan(m, n, tile_m, tile_n, g, kernel=name).to_str()
            variants[f"fused {name} G={g}"] = lambda plan=plan: runtime_gpu.gemm_all_reduce(a, b, None, group, plan)
    return variants


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192x8192,16384x8192x8192")
    ap.add_argument("--groups", default="4,8")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    timer = tm.Timer(rounds=3, target_ms=10.0, min_iters=3, max_iters=30, spin_ms=0.3)
    sms = streams.resources(torch.cuda.current_device()).sm_count - 16
    groups = [int(x) for x in args.groups.split(",")]
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        try:
            times = timer.measure(variants_for(m, n, k, rank, sms, groups, dist.group.WORLD))
        except Exception as exc:  # a diagnostic: report and go on
            print(f"rank {rank}: {shape}: {exc!r}", flush=True)
            continue
        if rank == 0:
            print(f"== {shape} world {dist.get_world_size()} (ms, median back-to-back, max over ranks)")
            for key, t in times.items():
                print(f"  {key:48s} {t.ms:8.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
