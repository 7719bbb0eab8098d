"""Host time per fused call: this package against an older one, in the same process, interleaved (a before/after
that machine noise between processes cannot skew).

    python3 examples/device/host_ab.py --old fo_old --old-lib OLD.so            # NCCL route, 1 rank
    torchrun --nproc_per_node=2 examples/device/host_ab.py --old fo_old --old-lib OLD.so --backend gloo  # peer route

The older package must be importable as module ``--old`` with its ops registered as ``torch.ops.<old>.*`` (a renamed
copy of an older checkout: ``examples/device/one_gpu_session.sh`` makes one from ``FO_OLD``), and it reads its
library from ``$FLASHOVERLAP_LIB`` at every call (as the old runtime did): this script sets that to ``--old-lib``
after this package has read its own settings (``Settings.library``, from ``$FLASHOVERLAP_LIB`` at start).

Each round keeps the GPU busy (a spin), then times ``--calls`` back-to-back calls of every variant in turn: the op
(``torch.ops.<ns>.gemm_*``) and the layer below it (``routes.dispatch`` / the old ``runtime_gpu.gemm_*``) of both
packages, and ``torch.mm`` (+ the NCCL collective on the NCCL route). Prints medians over rounds in microseconds per
call (rank 0; with ``--backend gloo`` the ranks share the GPU: host columns hold, GPU times do not).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="module name of the older package (renamed copy)")
    ap.add_argument("--old-lib", required=True, help="the older package's kernel library")
    ap.add_argument("--shape", default="2048x4096x4096")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    args = ap.parse_args()
    from flashoverlap_inductor import config, ops, routes  # noqa: F401  (ops registers torch.ops.flashoverlap.*)
    from flashoverlap_inductor.schedule import plan as planlib
    from flashoverlap_inductor.tune import measure as tm

    config.current()  # this package's settings (its library) are read now, before the variable changes
    os.environ["FLASHOVERLAP_LIB"] = os.path.abspath(args.old_lib)
    old = importlib.import_module(args.old)
    importlib.import_module(f"{args.old}.ops")
    old_rt = importlib.import_module(f"{args.old}.runtime_gpu")
    old_routes = importlib.import_module(f"{args.old}.routes") if importlib.util.find_spec(f"{args.old}.routes") \
        else None  # a package after the route redesign: its dispatcher, as this one's

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29641")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if args.backend == "gloo":
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        dist.all_reduce(torch.ones(1, device="cuda"))
    group, name = dist.group.WORLD, dist.group.WORLD.group_name
    m, n, k = (int(x) for x in args.shape.split("x"))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    plan = "auto" if args.backend == "gloo" else planlib.uniform_plan(m, n, 128, 256, 2).to_str()
    new_ns, old_ns = torch.ops.flashoverlap, getattr(torch.ops, args.old)
    variants = {}
    shape = [m, n]
    for coll in ("all_reduce", "reduce_scatter") if world > 1 else ("all_reduce",):
        if coll == "all_reduce":
            variants[f"new op {coll}"] = lambda: new_ns.gemm_all_reduce(a, b, None, "sum", name, plan)
            variants[f"old op {coll}"] = lambda: old_ns.gemm_all_reduce(a, b, None, "sum", name, plan)
            variants[f"new routes.dispatch {coll}"] = lambda c=coll: routes.dispatch(c, a, b, None, group, plan, "",
                                                                                     shape)
            variants[f"old runtime_gpu {coll}"] = (
                (lambda c=coll: old_routes.dispatch(c, a, b, None, group, plan, "", shape)) if old_routes else
                (lambda: old_rt.gemm_all_reduce(a, b, None, group, plan)))
        else:
            variants[f"new op {coll}"] = lambda: new_ns.gemm_reduce_scatter(a, b, None, "sum", world, name, plan)
            variants[f"old op {coll}"] = lambda: old_ns.gemm_reduce_scatter(a, b, None, "sum", world, name, plan)
            variants[f"new routes.dispatch {coll}"] = lambda c=coll: routes.dispatch(c, a, b, None, group, plan, "",
                                                                                     shape)
            variants[f"old runtime_gpu {coll}"] = (
                (lambda c=coll: old_routes.dispatch(c, a, b, None, group, plan, "", shape)) if old_routes else
                (lambda: old_rt.gemm_reduce_scatter(a, b, None, group, plan)))
    variants["torch.mm"] = lambda: torch.mm(a, b)
    if args.backend == "nccl":
        variants["torch.mm + all_reduce"] = lambda: dist.all_reduce(torch.mm(a, b))
    for fn in variants.values():  # warm-up: launches made, workspaces grown, libraries loaded
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    times: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(args.rounds):
        for label, fn in variants.items():
            tm.spin(3.0 * max(1, args.calls // 10))
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[label].append((time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
            dist.barrier()
    if rank == 0:
        print(f"host us per call, {args.shape}, world {world} ({args.backend}), median of {args.rounds} interleaved "
              f"rounds of {args.calls} calls; old package {old.__name__}; routes now {dict(routes.stats)}", flush=True)
        for label, ts in times.items():
            print(f"  {label:34s} {statistics.median(ts):8.1f}   (min {min(ts):.1f})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
