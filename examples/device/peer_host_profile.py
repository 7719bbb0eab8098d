"""Diagnostic: the host time of one fused op on the peer route (2 ranks; run with torchrun --nproc_per_node=2).

    torchrun --nproc_per_node=2 examples/device/peer_host_profile.py [--shape 2048x4096x4096] [--calls 400]
    torchrun --nproc_per_node=2 examples/device/peer_host_profile.py --backend gloo   # both ranks on one GPU
    torchrun --nproc_per_node=4 examples/device/peer_host_profile.py --backend gloo --ring   # the ring, 4 ranks

With ``--backend gloo`` the ranks may share one GPU (rank r on GPU r % count; torch's symmetric memory with
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``): the host columns hold, the back-to-back times do not (the ranks
time-slice the GPU), and the rows that need NCCL are left out.

Prints, per op, the mean host time per call (microseconds) with the GPU kept busy by a spin kernel (so the host
never waits for it), next to ``torch.mm`` + the NCCL collective, then the steady-state time per call of back-to-back
calls without a spin (what the benchmark measures when the host is the limit), then a cProfile of rank 0's fused
calls sorted by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch
import torch.distributed as dist

from flashoverlap_inductor import ops, routes  # noqa: F401  (ops registers torch.ops.flashoverlap.*)
from flashoverlap_inductor.tune import measure as tm


def layers(a: torch.Tensor, b: torch.Tensor) -> dict:
    """reduce_scatter calls at each layer of the peer route: ``routes.dispatch`` (what the op calls), the peer
    route's ``execute`` with the (launch, context) the dispatcher passed on one recorded call, and the C call
    ``fo_peer_call`` alone with the argument struct of that call (repeated calls reuse one workspace set: the
    results are wrong, the host time is not)."""
    import ctypes

    from flashoverlap_inductor.native import kernels

    route = routes.peer.ROUTE
    seen: dict = {}
    exec0, library0 = route.execute, kernels.library
    real_lib = library0()
    group, shape = dist.group.WORLD, [a.shape[0], b.shape[1]]

    class Spy:
        def __getattr__(self, name):
            return getattr(real_lib, name)

        def fo_peer_call(self, ref):
            seen["args"] = routes.peer.PeerArgs.from_buffer_copy(ref._obj)
            return real_lib.fo_peer_call(ref)

    def spy_exec(*args):
        seen["exec"] = args
        return exec0(*args)

    spy = Spy()
    route.execute, kernels.library = spy_exec, lambda: spy  # an instance attribute shadows the method
    try:
        routes.dispatch("reduce_scatter", a, b, None, group, "auto", "", shape)
        torch.cuda.synchronize()
    finally:
        del route.execute
        kernels.library = library0
    if "args" not in seen:
        print(f"peer_host_profile: the call did not take the peer route ({dict(routes.stats)}); layers left out",
              flush=True)
        return {}
    p = seen["args"]
    keep = torch.empty(max(1, p.workspace_bytes), dtype=torch.uint8, device="cuda")  # the recorded one was freed
    p.workspace = keep.data_ptr() if p.workspace_bytes else None
    return {"_keep": keep,
            "routes.dispatch": lambda: routes.dispatch("reduce_scatter", a, b, None, group, "auto", "", shape),
            "routes.peer execute": lambda: exec0(*seen["exec"]),
            "fo_peer_call (C) alone": lambda: real_lib.fo_peer_call(ctypes.byref(p))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x4096x4096")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--ring", action="store_true", help="the ring route (config.patch(ring='all')), any world size")
    ap.add_argument("--no-gemm-cache", action="store_true", help="the library's GEMM launch cache off (a baseline)")
    args = ap.parse_args()
    if args.no_gemm_cache:
        from flashoverlap_inductor.native import kernels

        kernels.gemm_cache_enable(False)
    from flashoverlap_inductor import config

    with config.patch(ring="all" if args.ring else "off", scatter_route="peer",  # not the default pull route
                      wait_timeout_ms=60000.0 if args.ring else None):
        return run(args)


def run(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if args.backend == "gloo":
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=device)
    dist.all_reduce(torch.ones(1, device="cuda" if args.backend == "nccl" else "cpu"))
    m, n, k = (int(x) for x in args.shape.split("x"))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    name = dist.group.WORLD.group_name
    out_rs = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
    fo = torch.ops.flashoverlap
    fns = {
        "fused all_reduce": lambda: fo.gemm_all_reduce(a, b, None, "sum", name, "auto"),
        "fused reduce_scatter": lambda: fo.gemm_reduce_scatter(a, b, None, "sum", world, name, "auto"),
        "mm + all_reduce": lambda: dist.all_reduce(torch.mm(a, b)),
        "mm + reduce_scatter": lambda: dist.reduce_scatter_tensor(out_rs, torch.mm(a, b)),
        "mm alone": lambda: torch.mm(a, b),
    }
    if args.backend == "gloo":
        fns = {label: fn for label, fn in fns.items() if not label.startswith("mm +")}

    def host_us(fn) -> float:
        return tm.host_us(fn, args.calls, spin_ms=20.0, sync=dist.barrier)

    def steady_us(fn) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 50 * 1e3

    for label, fn in fns.items():
        h, s = host_us(fn), steady_us(fn)
        if rank == 0:
            print(f"{args.shape} {label:28s} host {h:7.1f} us/call   back-to-back {s:7.1f} us/call   (world {world}"
                  f"{', ring' if args.ring else ''}{', GEMM cache off' if args.no_gemm_cache else ''}; routes "
                  f"{dict(routes.stats)})", flush=True)
    for label, fn in ({} if args.ring else layers(a, b)).items():  # the layers below the op, each with what the
        # one above passed
        if label.startswith("_"):
            continue
        h = host_us(fn)
        if rank == 0:
            off = "   (GEMM cache off)" if args.no_gemm_cache else ""
            print(f"{args.shape} {label:28s} host {h:7.1f} us/call{off}", flush=True)
    prof = cProfile.Profile()
    tm.spin(20.0)
    prof.enable()
    for _ in range(100):
        fns["fused reduce_scatter"]()
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        print(dict(routes.stats))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
