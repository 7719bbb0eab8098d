"""Correctness of the ring route (and of the two-rank peer route) with more ranks than GPUs: ``--world`` processes
(default 4) share the visible GPUs (rank r on GPU r % count; one GPU serves), joined by a gloo group; torch's
symmetric memory maps every rank's buffers into every process (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``). Ranks
on one GPU time-slice it, so the flags between their GEMM steps cross contexts and timings mean nothing here: this
checks the schedule, the slots and the flags of a ring of any size (which chunk each step computes, where it pushes,
which flags it waits on), not speed.

Stage 1: each case runs ``torch.ops.flashoverlap`` three times on fresh random data (the flags' epochs advance
between calls), synchronizing after each, and compares with the fp64 sum of all ranks' GEMMs. Stage 2 ("queued"):
``--queued`` passes over every case back to back with no synchronization between calls, so calls of different
shapes, collectives and rounds lay their pieces out differently in one workspace while earlier calls may
still be read by other ranks; checked after one synchronization per pass. ``--route ring`` (default) runs under
``config.patch(ring="all")``; ``--route peer`` with it off (the two-rank peer route; ``--world 2``).

    python examples/device/ring_probe4.py [--world 4] [--route ring|peer] [--queued 2] [--out DIR]

Prints one line per case and rank; exits 1 on any mismatch, timeout or error.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

# (collective, rows at 4 ranks, n, k, rounds, bias): pieces of 128 .. 1024 rows, ragged n. With ``world`` ranks a
# case runs rows * world / 4 rows: the same pieces.
CASES_W4 = [("reduce_scatter", 2048, 1024, 512, 1, False), ("all_reduce", 2048, 1024, 512, 2, True),
            ("all_reduce", 4096, 776, 328, 4, False), ("reduce_scatter", 1024, 264, 128, 1, True),
            ("all_reduce", 1024, 512, 256, 2, False), ("all_reduce", 8192, 1024, 256, 2, False)]


def cases(world: int) -> list[tuple]:
    """``CASES_W4`` for ``world`` ranks: rows scaled so every case cuts into the same pieces."""
    return [(op, rows * world // 4, *rest) for op, rows, *rest in CASES_W4]


def _inputs(seed: int, rank: int, rows: int, n: int, k: int, bias: bool, device: torch.device):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    a = torch.randn(rows, k, generator=gen).bfloat16().to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().to(device)
    c = torch.randn(n, generator=gen).bfloat16().to(device) if bias else None
    return a, w.t(), c


def _reference(seed: int, rank: int, world: int, op: str, rows: int, n: int, k: int, bias: bool,
               device: torch.device) -> torch.Tensor:
    """What ``rank``'s output must be: the fp64 sum over ranks of A @ B (+ bias); reduce_scatter's chunk of it."""
    ys = []
    for r in range(world):
        ar, br, cr = _inputs(seed, r, rows, n, k, bias, device)
        y = ar.double() @ br.double()
        ys.append(y + cr.double() if cr is not None else y)
    return sum(ys) if op == "all_reduce" else sum(ys).chunk(world)[rank]


def _call(op: str, a, b, c, world: int, name: str) -> torch.Tensor:
    import flashoverlap_inductor.ops  # noqa: F401  (registers torch.ops.flashoverlap.*)

    if op == "all_reduce":
        return torch.ops.flashoverlap.gemm_all_reduce(a, b, c, "sum", name, "auto")
    return torch.ops.flashoverlap.gemm_reduce_scatter(a, b, c, "sum", world, name, "auto")


def _settings(route: str, rounds: int):
    """The settings of one case: the ring on (``--route ring``) or off, its rounds, and a long wait bound
    (time-sliced GPUs: a flag may wait for another context's turn)."""
    from flashoverlap_inductor import config

    return config.patch(ring="all" if route == "ring" else "off", ring_rounds=rounds, wait_timeout_ms=60000.0,
                        scatter_route="peer")  # reduce_scatter on the peer route, not the default pull route


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def worker(rank: int, world: int, port: int, out_dir: str, route: str, queued: int) -> None:
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    import torch.distributed as dist

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from flashoverlap_inductor import routes

    results, ok = [], True
    name = dist.group.WORLD.group_name
    counter = f"route:{route}"
    for i, (op, rows, n, k, rounds, bias) in enumerate(cases(world)):
        routes.reset()
        for call in range(3):
            seed = 1000 * i + call
            try:
                a, b, c = _inputs(seed, rank, rows, n, k, bias, device)
                with _settings(route, rounds):
                    out = _call(op, a, b, c, world, name)
                torch.cuda.synchronize()
                routes.check()
                err = _rel_err(out, _reference(seed, rank, world, op, rows, n, k, bias, device))
                good = bool(torch.isfinite(out).all()) and err < 1.5e-2 and routes.stats[counter] == call + 1
                line = {"case": i, "call": call, "op": op, "shape": [rows, n, k], "rounds": rounds,
                        "rank": rank, "rel_err": err, "route_calls": routes.stats[counter], "ok": good}
            except Exception:  # noqa: BLE001 - reported per case
                line = {"case": i, "call": call, "op": op, "rank": rank, "ok": False, "error": traceback.format_exc()}
                good = False
                routes.reset()
            ok &= good
            results.append(line)
            print(json.dumps(line), flush=True)
            dist.barrier()
    ok &= _queued(rank, world, name, device, counter, queued, results)
    with open(os.path.join(out_dir, f"ring_probe4_{route}{world}_rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "results": results}, f, indent=1)
    dist.barrier()
    routes.reset()
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def _queued(rank: int, world: int, name: str, device: torch.device, counter: str, passes: int,
            results: list) -> bool:
    """Stage 2: ``passes`` passes over every case, the calls of a pass queued back to back (no synchronization, no
    reset: each call of another shape reuses the workspace with another layout), checked after the pass."""
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    route = counter.split(":", 1)[1]
    ok = True
    for p in range(passes):
        before = routes.stats[counter]
        outs = []
        try:
            for i, (op, rows, n, k, rounds, bias) in enumerate(cases(world)):
                seed = 50000 + 100 * p + i
                with _settings(route, rounds):
                    outs.append((i, op, rows, n, k, bias, seed,
                                 _call(op, *_inputs(seed, rank, rows, n, k, bias, device), world, name)))
            torch.cuda.synchronize()
            routes.check()
            routed = routes.stats[counter] - before
            for i, op, rows, n, k, bias, seed, out in outs:
                err = _rel_err(out, _reference(seed, rank, world, op, rows, n, k, bias, device))
                good = bool(torch.isfinite(out).all()) and err < 1.5e-2 and routed == len(CASES_W4)
                line = {"queued_pass": p, "case": i, "op": op, "shape": [rows, n, k], "rank": rank, "rel_err": err,
                        "routed": routed, "ok": good}
                ok &= good
                results.append(line)
                print(json.dumps(line), flush=True)
        except Exception:  # noqa: BLE001 - reported per pass
            line = {"queued_pass": p, "rank": rank, "ok": False, "error": traceback.format_exc()}
            ok = False
            results.append(line)
            print(json.dumps(line), flush=True)
            routes.reset()
        dist.barrier()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--route", choices=("ring", "peer"), default="ring")
    ap.add_argument("--queued", type=int, default=2, help="passes of stage 2 (0: none)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.route == "peer" and args.world != 2:
        ap.error("--route peer needs --world 2")
    ctx = mp.spawn(worker, args=(args.world, port, args.out, args.route, args.queued), nprocs=args.world, join=False)
    try:
        while not ctx.join():
            pass
    except Exception as exc:  # noqa: BLE001 - a failed rank
        print(f"ring_probe4: {exc}", flush=True)
        sys.exit(1)
    print("ring_probe4: all cases matched", flush=True)


if __name__ == "__main__":
    main()
