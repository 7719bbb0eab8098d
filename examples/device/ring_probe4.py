"""Correctness of the ring route with more ranks than GPUs: ``--world`` processes (default 4) share the visible GPUs
(rank r on GPU r % count), joined by a gloo group; torch's symmetric memory maps every rank's buffers into every
process (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``). Ranks on one GPU time-slice it, so the flags between their
GEMM steps cross contexts and timings mean nothing here: this checks the schedule, the slots and the flags of a
4-rank ring (which chunk each step computes, where it pushes, which flags it waits on), not speed.

Each case runs ``torch.ops.flashoverlap`` with ``FLASHOVERLAP_RING=all`` three times on fresh random data (the
flags' epochs advance between calls) into NaN-filled outputs and compares with the fp64 sum of all ranks' GEMMs.

    python examples/device/ring_probe4.py [--world 4] [--out DIR]

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

# (collective, rows, n, k, rounds, gate, bias): pieces of 128 .. 1024 rows, ragged n, both waits
CASES = [("reduce_scatter", 2048, 1024, 512, 1, "kernel", False), ("all_reduce", 2048, 1024, 512, 2, "kernel", True),
         ("all_reduce", 4096, 776, 328, 4, "kernel", False), ("reduce_scatter", 1024, 264, 128, 1, "wait", True),
         ("all_reduce", 1024, 512, 256, 2, "wait", False), ("all_reduce", 8192, 1024, 256, 2, "kernel", False)]


def _inputs(seed: int, rank: int, rows: int, n: int, k: int, bias: bool, device: torch.device):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    a = torch.randn(rows, k, generator=gen).bfloat16().to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().to(device)
    c = torch.randn(n, generator=gen).bfloat16().to(device) if bias else None
    return a, w.t(), c


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    os.environ["FLASHOVERLAP_RING"] = "all"
    import torch.distributed as dist

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from flashoverlap_inductor import config, ops, peer_route, ring_route, runtime_gpu

    ops._runtime = lambda a: runtime_gpu  # every call here is on CUDA
    config.wait_timeout_ms = 60000.0  # time-sliced GPUs: a flag may wait for another context's turn
    results, ok = [], True
    name = dist.group.WORLD.group_name
    for i, (op, rows, n, k, rounds, gate, bias) in enumerate(CASES):
        ring_route.ROUNDS, peer_route.GATE = rounds, gate
        runtime_gpu.reset()
        for call in range(3):
            seed = 1000 * i + call
            try:
                a, b, c = _inputs(seed, rank, rows, n, k, bias, device)
                if op == "all_reduce":
                    out = torch.ops.flashoverlap.gemm_all_reduce(a, b, c, "sum", name, "auto")
                else:
                    out = torch.ops.flashoverlap.gemm_reduce_scatter(a, b, c, "sum", world, name, "auto")
                torch.cuda.synchronize()
                runtime_gpu.check()
                ys = []
                for r in range(world):
                    ar, br, cr = _inputs(seed, r, rows, n, k, bias, device)
                    y = ar.double() @ br.double()
                    ys.append(y + cr.double() if cr is not None else y)
                ref = sum(ys) if op == "all_reduce" else sum(ys).chunk(world)[rank]
                err = ((out.double() - ref).norm() / ref.norm()).item()
                good = bool(torch.isfinite(out).all()) and err < 1.5e-2 and runtime_gpu.stats["route:ring"] == call + 1
                line = {"case": i, "call": call, "op": op, "shape": [rows, n, k], "rounds": rounds, "gate": gate,
                        "rank": rank, "rel_err": err, "ring_calls": runtime_gpu.stats["route:ring"], "ok": good}
            except Exception:  # noqa: BLE001 - reported per case
                line = {"case": i, "call": call, "op": op, "rank": rank, "ok": False, "error": traceback.format_exc()}
                good = False
                peer_route.reset()
            ok &= good
            results.append(line)
            print(json.dumps(line), flush=True)
            dist.barrier()
    with open(os.path.join(out_dir, f"ring_probe4_rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "results": results}, f, indent=1)
    dist.barrier()
    peer_route.reset()
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.spawn(worker, args=(args.world, port, args.out), nprocs=args.world, join=False)
    try:
        while not ctx.join():
            pass
    except Exception as exc:  # noqa: BLE001 - a failed rank
        print(f"ring_probe4: {exc}", flush=True)
        sys.exit(1)
    print("ring_probe4: all cases matched", flush=True)


if __name__ == "__main__":
    main()
