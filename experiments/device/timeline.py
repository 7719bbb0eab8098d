"""Diagnostic: when does each wave group get released and its collective finish, relative to the GEMM?

Run under ``torchrun --nproc_per_node=2``. For an 8192^3 bf16 all_reduce it replays ``runtime_gpu``'s launch with
CUDA events after every wait (release) and every collective (done), for several SM reserves, with the real NCCL
call or a copy-engine memcpy of the group's rows in its place (which needs no SM). Reference: cuBLAS with a
concurrent whole-tensor all_reduce on a second stream. Prints ms since the GEMM started (rank 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap_inductor import kernels, runtime_gpu, streams
from flashoverlap_inductor.schedule import plan as P


def ev() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def timeline(launch, a, b, out, scratch, group, mode: str) -> tuple[float, list[float], list[float]]:
    res = streams.resources(a.device.index)
    cur = torch.cuda.current_stream()
    slot = res.slot(cur)
    counters, expected = res.counters[slot], res.expected[slot]
    lib = streams.kernel_lib()
    b_in, ldb = runtime_gpu._kernel_b(b, launch.kernel)
    workspace = torch.empty(launch.workspace_bytes, dtype=torch.uint8, device=a.device) \
        if launch.workspace_bytes else None
    expected.copy_(counters)
    side = res.side
    side.wait_stream(cur)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    e0, eg = ev(), ev()
    rel = [ev() for _ in launch.steps]
    done = [ev() for _ in launch.steps]
    e0.record(cur)
    lib.gemm(launch.index, a, b_in, ldb, None, out, counters.data_ptr(), launch.gmap, launch.order,
             kernels.SIGNAL_MODES[runtime_gpu.SIGNAL_MODE], launch.sm_count, kernels.RASTERS[runtime_gpu.RASTER],
             runtime_gpu.SWIZZLE, workspace, cur.cuda_stream)
    eg.record(cur)
    with torch.cuda.stream(side):
        for g, step in enumerate(launch.steps):
            if launch.tiles[g]:
                lib.wait(counters.data_ptr() + 4 * g, expected.data_ptr() + 4 * g, launch.tiles[g], 10**10,
                         res.record.data_ptr(), g, side.cuda_stream)
            rel[g].record(side)
            if mode == "nccl":
                runtime_gpu.group_collective("all_reduce", (), g, step, out, out, group)
            elif mode == "copy":
                scratch[step.lo:step.hi].copy_(out[step.lo:step.hi])
            done[g].record(side)
    cur.wait_stream(side)
    torch.cuda.synchronize()
    return e0.elapsed_time(eg), [e0.elapsed_time(r) for r in rel], [e0.elapsed_time(d) for d in done]


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    m = n = k = 8192
    torch.manual_seed(rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = w.t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    scratch = torch.empty_like(out)
    group = dist.group.WORLD
    side = torch.cuda.Stream()
    for _ in range(3):  # reference: cuBLAS + a concurrent all_reduce on another stream
        torch.cuda.synchronize()
        dist.barrier()
        e0, eg, ec = ev(), ev(), ev()
        e0.record()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(scratch)
            ec.record(side)
        torch.mm(a, b, out=out)
        eg.record()
        torch.cuda.synchronize()
    if rank == 0:
        print(f"cuBLAS {e0.elapsed_time(eg):.3f} ms with a concurrent all_reduce done at {e0.elapsed_time(ec):.3f}")
    for reserve in (16, 24, 32, 48):
        runtime_gpu.SM_RESERVE = reserve
        for groups in (4,):
            plan = P.uniform_plan(m, n, 128, 256, groups).to_str()
            for _ in range(3):
                runtime_gpu.gemm_all_reduce(a, b, None, group, plan)
            torch.cuda.synchronize()
            launch = runtime_gpu.last_launch
            for mode in ("none", "copy", "nccl", "nccl"):
                try:
                    tg, rel, done = timeline(launch, a, b, out, scratch, group, mode)
                except Exception as exc:  # a diagnostic: report and go on
                    print(f"rank {rank}: reserve {reserve} {mode}: {exc!r}", flush=True)
                    continue
                if rank == 0:
                    print(f"reserve {reserve:2d} ({launch.sm_count} SMs) G={groups} {mode:5s}: gemm {tg:.3f}; "
                          f"release {' '.join(f'{x:.3f}' for x in rel)}; done {' '.join(f'{x:.3f}' for x in done)}",
                          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
