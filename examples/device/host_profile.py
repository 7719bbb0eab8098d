"""Diagnostic: where the host time of one fused op goes (one GPU, an NCCL group of one rank).

    python3 examples/device/host_profile.py [--shape 2048x4096x4096] [--groups 2] [--calls 400]

Prints the mean host time per call of ``torch.ops.flashoverlap.gemm_all_reduce`` (the GPU kept ahead by a spin
kernel, so the host never waits) for each host loop, next to ``torch.mm`` + ``dist.all_reduce``, then a cProfile
of the C-loop calls sorted by own time. Times in microseconds.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch
import torch.distributed as dist

from flashoverlap_inductor import fused_launch, ops, runtime_gpu
from flashoverlap_inductor import plan as planlib
from flashoverlap_inductor import tune_measure as tm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x4096x4096")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    dist.all_reduce(torch.ones(1, device="cuda"))
    m, n, k = (int(x) for x in args.shape.split("x"))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    plan = planlib.uniform_plan(m, n, 128, 256, args.groups).to_str()
    name = dist.group.WORLD.group_name
    if ops._runtime(a) is not runtime_gpu:
        print("ops do not dispatch to runtime_gpu")

    def fused():
        return torch.ops.flashoverlap.gemm_all_reduce(a, b, None, "sum", name, plan)

    def seq():
        y = torch.mm(a, b)
        dist.all_reduce(y)
        return y

    def direct():
        return runtime_gpu.gemm_all_reduce(a, b, None, dist.group.WORLD, plan)

    def host_us(fn, loop: str = "c") -> float:
        fused_launch.HOST_LOOP = loop
        return tm.host_us(fn, args.calls)

    print(f"host us per call ({args.shape}, {args.groups} groups): fused C loop {host_us(fused, 'c'):.1f}, "
          f"fused Python loop {host_us(fused, 'python'):.1f}, mm + all_reduce {host_us(seq):.1f}, "
          f"runtime_gpu directly {host_us(direct):.1f}", flush=True)
    fused_launch.HOST_LOOP = "c"
    prof = cProfile.Profile()
    tm.spin(5.0)
    prof.enable()
    for _ in range(200):
        fused()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(dict(runtime_gpu.stats))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
