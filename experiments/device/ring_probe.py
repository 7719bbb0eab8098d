# ruff: noqa: B023  (closures are called within the iteration that defines them)
"""Probe: all_reduce as a ring reduce-scatter whose sums ride in the GEMM (cuBLAS ``beta = 1``), then an
all-gather, moving data only with NCCL send/recv -- against cuBLAS then NCCL all_reduce and the fused op.

torchrun --nproc_per_node=2 experiments/device/ring_probe.py --json OUT.json

NCCL's all_reduce kernels do the reduction on SMs (24 CTAs on 2 H200s) beside the GEMM. Here the reduction is the
GEMM's own epilogue: rank r computes the row blocks in the order b_s = (r + s + 1) mod W, s = 0..W-1; step s > 0
adds the partial sum that rank r + 1 sent after its step s - 1 (``torch.addmm``: C = the received partial); after
step s < W - 1 the block goes to rank r - 1; step W - 1 is block r with every rank's term: the reduce-scatter is
done. Each final chunk is then sent to every peer (all-gather). Each block is cut into ``chunks`` row chunks,
pipelined: chunk c's send/recv runs on a side stream while chunk c + 1 multiplies. NCCL only moves bytes
(grouped ncclSend/ncclRecv on the process group's communicator, ``nccl_direct``).

Variants (sustained interleaved timing, ``tune_measure.Timer``, max over ranks of medians, ms): gemm (cuBLAS),
comm (NCCL all_reduce), seq (gemm then comm), chunked<c> (c row chunks: cuBLAS then all_reduce per chunk on a
side stream), ring<c> (above), fused (``torch.ops.flashoverlap.gemm_all_reduce`` with the cost model's plan).
ring and fused are checked against seq on fresh random data.
"""

from __future__ import annotations

import argparse
import json
import math

import probe_setup  # experiments/device (the script's folder)
import torch
import torch.distributed as dist

from flashoverlap_inductor.cost_model import decide
from flashoverlap_inductor.native import nccl_direct
from flashoverlap_inductor.tune import measure as tune_measure

SHAPES = ["2048x8192x8192", "4096x8192x8192", "8192x8192x8192", "16384x8192x8192", "8192x8192x14336",
          "8192x4096x4096", "16384x4096x4096", "4096x4096x4096"]


def ring_all_reduce(a: torch.Tensor, b: torch.Tensor, chunks: int, comm: nccl_direct.Communicator,
                    side: torch.cuda.Stream):
    """The ring variant as a closure (buffers allocated once; see the module docstring). Rows must divide by
    world * chunks."""
    m, n = a.shape[0], b.shape[1]
    w, r = comm.size, comm.rank
    blk, ch = m // w, m // w // chunks
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    part = [torch.empty(blk, n, dtype=a.dtype, device=a.device) for _ in range(2)]  # this step's partial sums
    recv = [torch.empty(blk, n, dtype=a.dtype, device=a.device) for _ in range(2)]  # the next step's terms
    left, right = (r - 1) % w, (r + 1) % w
    row_bytes = n * a.element_size()

    def ptr(t: torch.Tensor, c: int) -> int:
        return t.data_ptr() + c * ch * row_bytes

    def run() -> torch.Tensor:
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        arrived: list[torch.cuda.Event | None] = [None] * chunks
        for s in range(w):
            blkid = (r + s + 1) % w
            dst = out[blkid * blk:(blkid + 1) * blk] if s == w - 1 else part[s % 2]
            src = recv[(s - 1) % 2]
            for c in range(chunks):
                rows = slice(blkid * blk + c * ch, blkid * blk + (c + 1) * ch)
                if s == 0:
                    torch.mm(a[rows], b, out=dst[c * ch:(c + 1) * ch])
                else:
                    cur.wait_event(arrived[c])
                    torch.addmm(src[c * ch:(c + 1) * ch], a[rows], b, out=dst[c * ch:(c + 1) * ch])
                done = torch.cuda.Event()
                done.record(cur)
                side.wait_event(done)
                if s < w - 1:  # partial to the left, the next step's term from the right
                    comm.send_recv([(left, ptr(dst, c), ch * n)], [(right, ptr(recv[s % 2], c), ch * n)],
                                   a.dtype, side.cuda_stream)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    arrived[c] = ev
                else:  # all-gather: this final chunk to every peer, theirs into out
                    peers = [q for q in range(w) if q != r]
                    comm.send_recv([(q, ptr(dst, c), ch * n) for q in peers],
                                   [(q, out.data_ptr() + (q * blk + c * ch) * row_bytes, ch * n) for q in peers],
                                   a.dtype, side.cuda_stream)
        cur.wait_stream(side)
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rank, device, comm = probe_setup.start()
    world = comm.size
    side = torch.cuda.Stream(device=device, priority=-1)
    timer = tune_measure.Timer(rounds=args.rounds, target_ms=8.0, min_iters=2, max_iters=40, spin_ms=0.3)
    import flashoverlap_inductor.ops  # noqa: F401  (registers torch.ops.flashoverlap)

    name = dist.group.WORLD.group_name
    rows_out = []
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        torch.manual_seed(1000 + rank)
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = (torch.randn(n, k, device=device, dtype=torch.bfloat16) / math.sqrt(k)).t()
        c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        src = torch.randn(m, n, device=device, dtype=torch.bfloat16)

        def ar(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
            comm.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), t.dtype, stream.cuda_stream)

        def seq() -> torch.Tensor:
            torch.mm(a, b, out=c)
            ar(c, torch.cuda.current_stream())
            return c

        def chunked(parts: int):
            def run() -> torch.Tensor:
                cur = torch.cuda.current_stream()
                side.wait_stream(cur)
                h = m // parts
                for i in range(parts):
                    torch.mm(a[i * h:(i + 1) * h], b, out=c[i * h:(i + 1) * h])
                    ev = torch.cuda.Event()
                    ev.record(cur)
                    side.wait_event(ev)
                    ar(c[i * h:(i + 1) * h], side)
                cur.wait_stream(side)
                return c
            return run

        plan = decide("all_reduce", m, n, k, "bfloat16", world, device_name=torch.cuda.get_device_name()).plan
        variants = {"gemm": lambda: torch.mm(a, b, out=c), "comm": lambda: ar(src, torch.cuda.current_stream()),
                    "seq": seq, "chunked4": chunked(4),
                    "fused": lambda: torch.ops.flashoverlap.gemm_all_reduce(a, b, None, "sum", name, plan.to_str())}
        for parts in (1, 2, 4, 8):
            if m % (world * parts) == 0:
                variants[f"ring{parts}"] = ring_all_reduce(a, b, parts, comm, side)
        ref = seq().clone()
        errs = {}
        for v in [x for x in variants if x.startswith("ring") or x == "fused"]:
            got = variants[v]()
            torch.cuda.synchronize()
            errs[v] = float((got.float() - ref.float()).norm() / ref.float().norm())
        errs = dict(zip(errs, tune_measure.reduce_max(list(errs.values())), strict=True))
        times = timer.measure(variants)
        row = {"shape": shape, "plan": plan.to_str(), "relerr": errs}
        row.update({v: round(t.ms, 4) for v, t in times.items()})
        best_ring = min(row[v] for v in variants if v.startswith("ring"))
        row["speedup"] = {v: round(row["seq"] / row[v], 4) for v in variants if v not in ("gemm", "comm", "seq")}
        row["speedup"]["ring_best"] = round(row["seq"] / best_ring, 4)
        row["speedup"]["ideal"] = round(row["seq"] / max(row["gemm"], row["comm"]), 4)
        probe_setup.emit(rank, rows_out, row)
    geo: dict[str, float] = {}
    if rank == 0:
        for key in rows_out[0]["speedup"]:
            vals = [r["speedup"][key] for r in rows_out if key in r["speedup"]]
            geo[key] = round(math.exp(sum(math.log(v) for v in vals) / len(vals)), 4)
        print("geomean", json.dumps(geo), flush=True)
    probe_setup.finish(rank, args.json, {"world": world, "rows": rows_out, "geomean": geo})


if __name__ == "__main__":
    main()
