"""Diagnostic: the phases of the copy-engine route (``ce_comm``) per wave group, in ms since the fused call's start.

torchrun --nproc_per_node=2 examples/device/ce_timeline.py

8192^3 bf16 all_reduce with the plan's groups and with 4 / 8 / 16 equal groups, reductions by torch or by a
Triton kernel on few CTAs (``ce_comm.ADD_CTAS``); prints rank 0's median over 10 calls of
each phase's end (``ce_comm.TRACE`` events), and T_fused with NCCL and with CE communication.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from flashoverlap_inductor import ce_comm, runtime_gpu
from flashoverlap_inductor import plan as P


def main() -> None:
    dist.init_process_group("nccl")
    r = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", r)))
    group = dist.group.WORLD
    m = n = k = 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    dist.all_reduce(torch.ones(1, device="cuda"))
    runtime_gpu.COMM = "ce"
    for groups, ctas in (("auto", 0), (4, 0), (8, 0), ("auto", 16), (4, 16), (8, 16), (8, 32), (8, 8), (16, 16)):
        ce_comm.ADD_CTAS = ctas
        plan = "auto" if groups == "auto" else P.uniform_plan(m, n, 128, 256, groups).to_str()
        for _ in range(3):  # warm-up (launch, workspace)
            runtime_gpu.gemm_all_reduce(a, b, None, group, plan)
        traces = []
        for _ in range(10):
            torch.cuda.synchronize()
            dist.barrier()
            ce_comm.TRACE = []
            runtime_gpu.gemm_all_reduce(a, b, None, group, plan)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            tr, ce_comm.TRACE = ce_comm.TRACE, None
            start = tr[0][1]
            traces.append([(label, start.elapsed_time(e)) for label, e in tr] + [("end", start.elapsed_time(end))])
        times = {}
        for comm in ("nccl", "ce"):
            runtime_gpu.COMM = comm
            ts = []
            for _ in range(10):
                torch.cuda.synchronize()
                dist.barrier()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                runtime_gpu.gemm_all_reduce(a, b, None, group, plan)
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e))
            times[comm] = statistics.median(ts)
        runtime_gpu.COMM = "ce"
        if r == 0:
            print(f"== 8192^3 all_reduce, plan {groups}, add CTAs {ctas or 'torch'}: "
                  f"{runtime_gpu.last_launch.description}")
            print(f"   T_fused ms: NCCL {times['nccl']:.3f}, CE {times['ce']:.3f}")
            labels = [lab for lab, _ in traces[0]]
            meds = [statistics.median(t[i][1] for t in traces) for i in range(len(labels))]
            print("   " + "  ".join(f"{lab} {t:.3f}" for lab, t in zip(labels, meds, strict=True)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
