# ruff: noqa: B023  (closures are called within the iteration that defines them)
"""Probe: does copy-engine (CE) communication escape the SM-sharing floor of NCCL beside a GEMM?

torchrun --nproc_per_node=2 experiments/device/ce_probe.py --json OUT.json

Per shape (bf16, y = a @ b, [M,K] @ [K,N]), side by side in one run, medians of CUDA-event times (ms):
  gemm        cuBLAS alone
  nccl_ar     NCCL all_reduce of y alone
  ce_ar       all_reduce of y by copy-engine pushes over NVLink into peers' symmetric memory + a local add
  seq         gemm then nccl_ar
  conc_nccl   gemm || nccl_ar of an unrelated tensor (no dependency): the floor with SM-based NCCL
  conc_ce     gemm || ce_ar of an unrelated tensor: the floor with CE communication
  chunk<c>_ce c row chunks: cuBLAS per chunk, then that chunk's ce_ar on a side stream (real dependency)
The ce_ar result is checked against NCCL's on fresh random data.

``--interference``: the GEMM's own time (events on its stream) while a side stream keeps one kind of traffic
running for the whole GEMM, each next to the GEMM alone: ``nccl`` (back-to-back NCCL all_reduces), ``ce_peer``
(back-to-back copy-engine pushes to the peer over NVLink: no SMs), ``ce_local`` (local device-to-device copies
by copy engine: HBM only, no SMs). Sample clocks and power beside it with nvidia-smi.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

SHAPES = [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 4096, 4096), (2048, 4096, 4096),
          (8192, 8192, 14336)]


def timed(fn, iters: int = 15, warm: int = 3) -> float:
    ts = []
    for i in range(warm + iters):
        torch.cuda.synchronize()
        dist.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        if i >= warm:
            ts.append(s.elapsed_time(e))
    t = torch.tensor([statistics.median(ts)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class CEAllReduce:
    """All-reduce of a flat bf16 tensor living in symmetric memory: reduce-scatter by CE pushes of each peer's
    chunk into its staging area, barrier, local add of the staged chunks into the owned chunk, then CE pushes of
    the owned (reduced) chunk into every peer's copy, barrier."""

    def __init__(self, numel: int, dtype: torch.dtype, group_name: str) -> None:
        self.w, self.r = dist.get_world_size(), dist.get_rank()
        self.numel = numel
        # layout: [0, numel) the data, then (w-1) staging chunks of numel // w
        self.chunk = numel // self.w
        self.buf = symm_mem.empty(numel + (self.w - 1) * self.chunk, dtype=dtype, device="cuda")
        self.hdl = symm_mem.rendezvous(self.buf, group_name)
        self.data = self.buf[:numel]
        self.peer = {p: self.hdl.get_buffer(p, (self.buf.numel(),), dtype) for p in range(self.w) if p != self.r}

    def slot(self, src: int, me: int) -> int:
        """Staging slot index (0..w-2) on rank ``me`` for data from rank ``src``."""
        return src if src < me else src - 1

    def __call__(self, lo: int = 0, hi: int | None = None) -> None:
        """All-reduce data[lo:hi] (hi - lo divisible by w); staging reuses the same relative offsets."""
        hi = self.numel if hi is None else hi
        c = (hi - lo) // self.w
        base = self.numel
        for p, pb in self.peer.items():  # push chunk p of my partial into p's staging slot for me
            off = base + self.slot(self.r, p) * self.chunk + lo // self.w
            pb[off:off + c].copy_(self.data[lo + p * c: lo + (p + 1) * c])
        self.hdl.barrier(channel=0)
        own = self.data[lo + self.r * c: lo + (self.r + 1) * c]
        for s in range(self.w - 1):
            off = base + s * self.chunk + lo // self.w
            own.add_(self.buf[off:off + c])
        for pb in self.peer.values():
            pb[lo + self.r * c: lo + (self.r + 1) * c].copy_(own)
        self.hdl.barrier(channel=0)


def interference(rows: list[dict], side: torch.cuda.Stream) -> None:
    """The ``--interference`` table (module docstring)."""
    r, dt = dist.get_rank(), torch.bfloat16
    gname = dist.group.WORLD.group_name
    for m, n, k in [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 8192, 14336)]:
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt)
        y = torch.empty(m, n, device="cuda", dtype=dt)
        chunk = 32 << 20  # elements per transfer (64 MiB)
        src = torch.randn(chunk, device="cuda", dtype=dt)
        dst = torch.empty(chunk, device="cuda", dtype=dt)
        sym = symm_mem.empty(chunk, dtype=dt, device="cuda")
        hdl = symm_mem.rendezvous(sym, gname)
        peer = hdl.get_buffer(1 - r, (chunk,), dt)
        traffic = {"nccl": (40, lambda: dist.all_reduce(src)), "ce_peer": (60, lambda: peer.copy_(src)),
                   "ce_local": (300, lambda: dst.copy_(src))}  # (transfers that outlast the GEMM, transfer)
        row = {"m": m, "n": n, "k": k}
        for rep in range(2):
            for name, (count, fn) in [("alone", (0, None)), *traffic.items()]:
                ts = []
                for _ in range(12):
                    torch.cuda.synchronize()
                    dist.barrier()
                    if fn is not None:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            for _ in range(count):
                                fn()
                        torch.cuda._sleep(2_000_000)  # ~1 ms: the GEMM starts once the traffic runs
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    torch.mm(a, b, out=y)
                    e.record()
                    torch.cuda.synchronize()
                    ts.append(s.elapsed_time(e))
                row[f"{name}{rep}"] = statistics.median(ts[2:])
        rows.append(row)
        if r == 0:
            print(f"{m}x{n}x{k} GEMM ms: " + " ".join(f"{key} {v:.3f}" for key, v in row.items()
                                                      if isinstance(v, float)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--interference", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    r = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", r)))
    if args.interference:
        rows: list[dict] = []
        interference(rows, torch.cuda.Stream(priority=-1))
        if r == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        dist.destroy_process_group()
        return
    gname = dist.group.WORLD.group_name
    dt = torch.bfloat16
    side = torch.cuda.Stream(priority=-1)
    rows = []
    for m, n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(1234 + r)
        a = torch.randn(m, k, device="cuda", dtype=dt, generator=g) / k**0.25
        b = torch.randn(k, n, device="cuda", dtype=dt, generator=g) / k**0.25
        y = torch.empty(m, n, device="cuda", dtype=dt)
        other = torch.randn(m * n, device="cuda", dtype=dt, generator=g)
        ce = CEAllReduce(m * n, dt, gname)
        ce_other = CEAllReduce(m * n, dt, gname)
        ce_other.data.copy_(other)
        # correctness of ce_ar vs NCCL
        x = torch.randn(m * n, device="cuda", dtype=dt, generator=g)
        ce.data.copy_(x)
        ref = x.clone()
        dist.all_reduce(ref)
        ce()
        torch.cuda.synchronize()
        err = (ce.data.float() - ref.float()).abs().max().item()

        def gemm():
            torch.mm(a, b, out=y)

        def nccl_ar():
            dist.all_reduce(y)

        def seq():
            torch.mm(a, b, out=y)
            dist.all_reduce(y)

        def conc(comm):
            def f():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    comm()
                torch.mm(a, b, out=y)
                torch.cuda.current_stream().wait_stream(side)
            return f

        def chunked_ce(c):
            yv = ce.data.view(m, n)
            step = m // c

            def f():
                for i in range(c):
                    torch.mm(a[i * step:(i + 1) * step], b, out=yv[i * step:(i + 1) * step])
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        ce(i * step * n, (i + 1) * step * n)
                torch.cuda.current_stream().wait_stream(side)
            return f

        row = {"m": m, "n": n, "k": k, "ce_maxerr": err}
        row["gemm"] = timed(gemm)
        row["nccl_ar"] = timed(nccl_ar)
        row["ce_ar"] = timed(lambda: ce())
        row["seq"] = timed(seq)
        row["conc_nccl"] = timed(conc(lambda: dist.all_reduce(other)))
        row["conc_ce"] = timed(conc(lambda: ce_other()))
        for c in (2, 4, 8):
            row[f"chunk{c}_ce"] = timed(chunked_ce(c))
        # check the chunked result against eager
        chunked_ce(4)()
        torch.cuda.synchronize()
        yref = a @ b
        dist.all_reduce(yref)
        row["chunk_maxrel"] = ((ce.data.view(m, n).float() - yref.float()).abs().max() /
                               yref.float().abs().max()).item()
        rows.append(row)
        if r == 0:
            s = row["seq"]
            print(f"{m}x{n}x{k}: gemm {row['gemm']:.3f} nccl {row['nccl_ar']:.3f} ce {row['ce_ar']:.3f} "
                  f"seq {s:.3f} | speedup conc_nccl {s / row['conc_nccl']:.3f} conc_ce {s / row['conc_ce']:.3f} "
                  f"chunk2/4/8_ce {s / row['chunk2_ce']:.3f}/{s / row['chunk4_ce']:.3f}/{s / row['chunk8_ce']:.3f}"
                  f" ideal {s / max(row['gemm'], row['nccl_ar']):.3f} | err {err:.3g} rel {row['chunk_maxrel']:.3g}",
                  flush=True)
        torch.cuda.synchronize()
    if r == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
