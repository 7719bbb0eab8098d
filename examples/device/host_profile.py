"""Diagnostic: where the host time of one fused op goes (one GPU, an NCCL group of one rank).

    python3 examples/device/host_profile.py [--shape 2048x4096x4096] [--groups 2] [--calls 400]

Prints the mean host time per call of ``torch.ops.flashoverlap.gemm_all_reduce`` (the GPU kept ahead by a spin
kernel, so the host never waits), next to ``routes.dispatch`` called directly and ``torch.mm`` +
``dist.all_reduce``, then a cProfile of the op's calls sorted by own time. Times in microseconds.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch
import torch.distributed as dist

from flashoverlap_inductor import ops, routes  # noqa: F401  (ops registers torch.ops.flashoverlap.*)
from flashoverlap_inductor.schedule import plan as planlib
from flashoverlap_inductor.tune import measure as tm


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

    def fused():
        return torch.ops.flashoverlap.gemm_all_reduce(a, b, None, "sum", name, plan)

    def seq():
        y = torch.mm(a, b)
        dist.all_reduce(y)
        return y

    def direct():
        return routes.dispatch("all_reduce", a, b, None, dist.group.WORLD, plan, "", [m, n])

    def host_us(fn) -> float:
        return tm.host_us(fn, args.calls)

    print(f"host us per call ({args.shape}, {args.groups} groups): fused op {host_us(fused):.1f}, "
          f"routes.dispatch directly {host_us(direct):.1f}, mm + all_reduce {host_us(seq):.1f}", flush=True)
    prof = cProfile.Profile()
    tm.spin(5.0)
    prof.enable()
    for _ in range(200):
        fused()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(dict(routes.stats))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
