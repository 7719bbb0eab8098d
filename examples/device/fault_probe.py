"""The failure contract on one GPU: faults injected into the peer / ring routes (ranks as processes sharing the GPU,
a gloo group, torch's symmetric memory) and into the NCCL route (an NCCL group of one rank), checked end to end.

Per route (``--route peer --world 2``, ``--route ring --world 3``, ``--route scatter_pull --world 2``: the
reduce_scatter pull route under ``scatter_route="pull"``, whose waits are the all_gather peer route's
protocol; ``--route reduce_pull --world 2``: the all_reduce pull route under ``all_reduce_route="pull"``), every rank:

1. stall: a short wait bound (``--timeout-ms``); after a correct warm-up call, the last rank sleeps past the bound
   before its call. Every rank's output of that call must be NaN (poisoned) or correct, never a finite wrong
   value; ``routes.check()`` must raise ``FlashOverlapTimeout`` on every rank; the next call (fresh data) must be
   correct with no reset.
2. replay: the same call captured in a CUDA graph (after an eager warm-up of the shape), replayed with the last
   rank stalled: the same three checks, the next replay correct.
``--nccl-world 2``: the NCCL routes on 2 GPUs, one rank each, with faults injected into one rank (``ncclInProgress``,
a stalled GEMM, a GEMM that raises on the gather route, a refused NCCL call): ``fault_probe_nccl.py``; skipped
(exit 0) when fewer than 2 GPUs are visible.
``--nccl``: one process, an NCCL group of one rank, ``transport="nccl"``: a bound of 1 us that the GEMM cannot meet
(the wait for its tiles gives up): the output must be NaN, the next call must raise ``FlashOverlapTimeout``, and
the call after it, with a normal bound, must be correct.

Prints one line per case and rank, then ``fault probe: faults injected N, wrong results W, hangs H, clear errors
C`` (W and H must be 0, C must equal N). Exits 1 otherwise. Timings mean nothing here (ranks time-slice one GPU).

    python examples/device/fault_probe.py --route peer --world 2
    python examples/device/fault_probe.py --route ring --world 3
    python examples/device/fault_probe.py --route scatter_pull --world 2 [--scatter-start handshake]
    python examples/device/fault_probe.py --route reduce_pull --world 2
    python examples/device/fault_probe.py --nccl
    python examples/device/fault_probe.py --nccl-world 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

ROWS, N, K = 1536, 512, 256  # rows cut into 2 or 3 ranks x 2 rounds of whole tile-rows


def _inputs(seed: int, rank: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    a = torch.randn(ROWS, K, generator=gen).bfloat16().to(device)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).bfloat16().to(device)
    return a, w.t()


def _reference(seed: int, world: int, rank: int, op: str, device: torch.device) -> torch.Tensor:
    total = sum(a.double() @ b.double() for a, b in (_inputs(seed, r, device) for r in range(world)))
    return total if op == "all_reduce" else total.chunk(world)[rank]


def _verdict(out: torch.Tensor, ref: torch.Tensor) -> str:
    """"poisoned" (all NaN), "correct", or "WRONG" (anything else: a finite value off the reference, or a partial
    poison that leaves wrong finite values)."""
    if bool(torch.isnan(out).all()):
        return "poisoned"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    return "correct" if bool(torch.isfinite(out).all()) and err < 1.5e-2 else "WRONG"


def _op(op: str, a, b, world: int, name: str) -> torch.Tensor:
    import flashoverlap_inductor.ops  # noqa: F401

    if op == "all_reduce":
        return torch.ops.flashoverlap.gemm_all_reduce(a, b, None, "sum", name, "auto")
    return torch.ops.flashoverlap.gemm_reduce_scatter(a, b, None, "sum", world, name, "auto")


def _ran(route: str, before: dict, key: str = "route") -> dict:
    """The routes that ran since ``before`` (a copy of ``routes.stats``), and ``wrong`` where the probed route did
    not (the case then tested another); ``key`` "captured": the calls captured into a CUDA graph. ``launch``: the
    last fused call's launch description (which schedule ran, e.g. the pull route's push or handshake)."""
    from flashoverlap_inductor import routes

    ran = {k: v - before.get(k, 0) for k, v in routes.stats.items()
           if k.startswith(("route:", "captured:")) and v > before.get(k, 0)}
    out = {"routes": ran, "launch": getattr(routes.last_launch, "description", "")[-90:]}
    return out if ran.get(f"{key}:{route}", 0) else {**out, "wrong": f"{key}:{route} never ran"}


def _expect_timeout(fn) -> str:
    from flashoverlap_inductor import errors

    try:
        fn()
    except errors.FlashOverlapTimeout as exc:
        return f"raised: {str(exc)[:160]}"
    return "NO ERROR"


def worker(rank: int, world: int, port: int, out_dir: str, route: str, timeout_ms: float, stall_s: float,
           experiments: tuple[str, ...] = (), scatter_start: str | None = None) -> None:
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    import torch.distributed as dist

    from flashoverlap_inductor import config, routes

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    name = dist.group.WORLD.group_name
    stalls = rank == world - 1
    lines = []
    start = {} if scatter_start is None else {"scatter_start": scatter_start}  # None: the settings' default

    def settings():  # a fresh context manager per use
        return config.patch(ring="all" if route == "ring" else "off", wait_timeout_ms=timeout_ms,
                            scatter_route="pull" if route == "scatter_pull" else "peer",
                            all_reduce_route="pull" if route == "reduce_pull" else "peer",
                            experiments=frozenset(experiments), **start)

    def record(case: str, **kw) -> None:
        line = {"case": case, "rank": rank, **kw}
        lines.append(line)
        print(json.dumps(line), flush=True)

    ops = {"scatter_pull": ("reduce_scatter",), "reduce_pull": ("all_reduce",)}.get(route, ("reduce_scatter",
                                                                                          "all_reduce"))
    for op in ops:
        try:
            before = dict(routes.stats)
            with settings():  # stall, eager
                out = _op(op, *_inputs(1, rank, device), world, name)
                torch.cuda.synchronize()
                warm = _verdict(out, _reference(1, world, rank, op, device))
                dist.barrier()
                if stalls:
                    time.sleep(stall_s)
                out = _op(op, *_inputs(2, rank, device), world, name)
                torch.cuda.synchronize()
                got = _verdict(out, _reference(2, world, rank, op, device))
                err = _expect_timeout(routes.check)
                dist.barrier()
                nxt = _verdict(_op(op, *_inputs(3, rank, device), world, name), _reference(3, world, rank, op, device))
                torch.cuda.synchronize()
                routes.check()
            record(f"stall/{op}", warm=warm, stalled_call=got, error=err, next_call=nxt, **_ran(route, before))
            before = dict(routes.stats)
            # replay: capture the shape (warmed up above), replay with the last rank stalled
            with settings():
                a, b = _inputs(4, rank, device)
                _op(op, a, b, world, name)
                torch.cuda.synchronize()
                dist.barrier()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    gout = _op(op, a, b, world, name)
                torch.cuda.synchronize()
                dist.barrier()
                fresh_a, fresh_b = _inputs(5, rank, device)
                a.copy_(fresh_a)
                b.copy_(fresh_b)
                if stalls:
                    time.sleep(stall_s)
                graph.replay()
                torch.cuda.synchronize()
                got = _verdict(gout, _reference(5, world, rank, op, device))
                err = _expect_timeout(routes.check)
                dist.barrier()
                fresh_a, fresh_b = _inputs(6, rank, device)
                a.copy_(fresh_a)
                b.copy_(fresh_b)
                graph.replay()
                torch.cuda.synchronize()
                nxt = _verdict(gout, _reference(6, world, rank, op, device))
                routes.check()
                del graph
            record(f"replay/{op}", stalled_call=got, error=err, next_call=nxt, **_ran(route, before, "captured"))
        except Exception:  # noqa: BLE001 - reported
            record(f"{op}", error="EXCEPTION " + traceback.format_exc()[-600:])
        dist.barrier()
        routes.reset()
    with open(os.path.join(out_dir, f"fault_probe_{route}{world}_rank{rank}.json"), "w") as f:
        json.dump(lines, f)
    dist.barrier()
    dist.destroy_process_group()


def nccl_case(out_dir: str) -> None:
    import torch.distributed as dist

    from flashoverlap_inductor import config, routes

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init = tempfile.mktemp()
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1, device_id=device)
    name = dist.group.WORLD.group_name
    lines = []
    for op in ("all_reduce", "reduce_scatter"):
        try:
            big = torch.randn(8192, 4096, device=device).bfloat16(), torch.randn(4096, 4096, device=device).bfloat16()
            # one rank: the plan has one group, which the route runs only under the "single_group" experiment
            with config.patch(transport="nccl", experiments=["single_group"]):
                _op(op, *big, 1, name)  # warm-up: the launch and the communicator
                torch.cuda.synchronize()
                with config.patch(wait_timeout_ms=0.001):
                    out = _op(op, *big, 1, name)
                    torch.cuda.synchronize()
                poisoned = bool(torch.isnan(out).all())
                err = _expect_timeout(lambda op=op, big=big: _op(op, *big, 1, name))
                a, b = _inputs(7, 0, device)
                nxt = _verdict(_op(op, a, b, 1, name), _reference(7, 1, 0, op, device))
                torch.cuda.synchronize()
                routes.check()
            ran = routes.stats.get("route:nccl", 0)
            lines.append({"case": f"nccl/{op}", "rank": 0, "stalled_call": "poisoned" if poisoned and ran else "WRONG",
                          "error": err, "next_call": nxt, "route": dict(routes.stats)})
        except Exception:  # noqa: BLE001
            lines.append({"case": f"nccl/{op}", "rank": 0, "error": "EXCEPTION " + traceback.format_exc()[-600:]})
        print(json.dumps(lines[-1]), flush=True)
        routes.reset()
    with open(os.path.join(out_dir, "fault_probe_nccl_rank0.json"), "w") as f:
        json.dump(lines, f)
    dist.destroy_process_group()


def summarize(out_dir: str, hangs: int) -> int:
    """Count every case line of every rank's file: a fault each; wrong when a verdict says WRONG or the line says
    ``wrong``; a hang per ``hang`` line (plus ``hangs``: ranks killed at the deadline); clear when the line says
    ``clear`` (the NCCL-world cases), else when it raised and the next call was correct."""
    faults = wrong = clear = 0
    for fname in sorted(os.listdir(out_dir)):
        if not fname.startswith("fault_probe_"):
            continue
        for line in json.load(open(os.path.join(out_dir, fname))):
            faults += 1
            if "WRONG" in (line.get("stalled_call"), line.get("next_call"), line.get("warm"), line.get("call")) \
                    or line.get("wrong"):
                wrong += 1
            hangs += bool(line.get("hang"))
            if "clear" in line:
                clear += line["clear"] is True
            elif str(line.get("error", "")).startswith("raised") and line.get("next_call") == "correct":
                clear += 1
    print(f"fault probe: faults injected {faults}, wrong results {wrong}, hangs {hangs}, clear errors {clear}")
    return 0 if faults and wrong == 0 and hangs == 0 and clear == faults else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--route", choices=("peer", "ring", "scatter_pull", "reduce_pull"), default="peer")
    p.add_argument("--experiments", default="", help="comma-separated experiments the probed calls run under")
    p.add_argument("--scatter-start", choices=("push", "handshake"), default=None,
                   help="--route scatter_pull: the route's schedule (the setting scatter_start; default: the "
                        "settings')")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--nccl", action="store_true", help="the NCCL route's case instead (one process)")
    p.add_argument("--nccl-world", type=int, choices=(2,), help="the NCCL routes on 2 GPUs (fault_probe_nccl.py)")
    p.add_argument("--case-s", type=float, default=15.0, help="--nccl-world: how long a case's outputs may take")
    p.add_argument("--timeout-ms", type=float, default=1500.0)
    p.add_argument("--stall-s", type=float, default=4.0)
    p.add_argument("--limit-s", type=float, default=200.0, help="a run past this counts as a hang")
    p.add_argument("--out", default="/tmp/fo_fault_probe")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.out):
        if f.startswith("fault_probe_"):
            os.remove(os.path.join(args.out, f))
    if args.nccl_world:
        import fault_probe_nccl

        sys.exit(fault_probe_nccl.main(args.out, args.timeout_ms, args.stall_s * 1000, args.case_s, args.limit_s))
    if args.nccl:
        nccl_case(args.out)
        sys.exit(summarize(args.out, 0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    experiments = tuple(x for x in args.experiments.split(",") if x)
    ctx = mp.spawn(worker, args=(args.world, port, args.out, args.route, args.timeout_ms, args.stall_s, experiments,
                                 args.scatter_start), nprocs=args.world, join=False)
    end, hangs = time.monotonic() + args.limit_s, 0
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > end:
                hangs = 1
                for proc in ctx.processes:
                    proc.kill()
                break
    except Exception:  # noqa: BLE001 - a rank died: its cases are missing from the files
        traceback.print_exc()
    sys.exit(summarize(args.out, hangs))


if __name__ == "__main__":
    main()
