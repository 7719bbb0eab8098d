# ruff: noqa: B023  (closures are called within the iteration that defines them)
"""Probe: do NCCL's symmetric-window kernels leave more room for a GEMM beside them than its default kernels?

torchrun --nproc_per_node=2 experiments/device/window_probe.py --json OUT.json

NCCL >= 2.27 runs all_reduce on buffers registered with ``ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)``
(memory from ``ncclMemAlloc``) through its symmetric kernels: loads and stores straight into the peers' memory,
no FIFO through proxy buffers, fewer CTAs. If they take fewer SMs for the same bytes, a GEMM beside them slows
less: the SM-sharing floor the fused ops sit on (GEMM || NCCL ~ 1.05x over sequential on 2 H200s) would rise.

Per shape (bf16, y = a @ b, [M,K] @ [K,N]), sustained timing (each sample: ``--burst`` calls back to back between
two events; variants interleaved round by round), medians over rounds, max over ranks (ms per call):
  gemm              cuBLAS alone
  ar_<buf>          NCCL all_reduce of an [M,N] buffer alone; buf = reg (torch's allocator) or win (symmetric window)
  seq_<buf>         gemm into buf then its all_reduce
  conc_<buf>        gemm || all_reduce of another buffer of the same kind (no dependency)
  pipe<G>_<buf>     G row chunks: cuBLAS of a chunk into buf, then that chunk's all_reduce on a high-priority side
                    stream (the fused op's pattern with cuBLAS per chunk)
pipe<G>_win is checked against seq_reg on fresh random data. NCCL's multicast (NVLS) stays off: this refuses to
run unless NCCL_NVLS_ENABLE=0.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics

import probe_setup  # experiments/device (the script's folder)
import torch
import torch.distributed as dist

from flashoverlap_inductor.native import nccl_direct

SHAPES = [(2048, 8192, 8192), (4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192)]
WIN_SYMMETRIC = 0x01


class Window:
    """One ``ncclMemAlloc`` buffer registered as a symmetric NCCL window on ``comm`` (collective: every rank at
    once, same size), seen as a flat bf16 tensor."""

    def __init__(self, comm: nccl_direct.Communicator, nbytes: int, device: torch.device) -> None:
        lib = comm.lib.lib
        p, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.ncclMemAlloc.argtypes = [ctypes.POINTER(p), sz]
        lib.ncclCommWindowRegister.argtypes = [p, p, sz, ctypes.POINTER(p), ctypes.c_int]
        lib.ncclCommWindowDeregister.argtypes = [p, p]
        lib.ncclMemFree.argtypes = [p]
        self.comm, self.lib, self.nbytes = comm, comm.lib, nbytes
        self.ptr, self.win = p(), p()
        self.lib.check(lib.ncclMemAlloc(ctypes.byref(self.ptr), nbytes), "ncclMemAlloc")
        self.lib.check(lib.ncclCommWindowRegister(p(comm.comm), self.ptr, nbytes, ctypes.byref(self.win),
                                                  WIN_SYMMETRIC), "ncclCommWindowRegister", comm.comm)
        torch.cuda.synchronize()
        iface = {"shape": (nbytes // 2,), "typestr": "<i2", "data": (self.ptr.value, False), "version": 3}
        holder = type("Holder", (), {"__cuda_array_interface__": iface})()
        self.tensor = torch.as_tensor(holder, device=device).view(torch.bfloat16)

    def close(self) -> None:
        torch.cuda.synchronize()
        lib = self.lib.lib
        self.lib.check(lib.ncclCommWindowDeregister(ctypes.c_void_p(self.comm.comm), self.win), "WindowDeregister")
        self.lib.check(lib.ncclMemFree(self.ptr), "ncclMemFree")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--groups", default="2,4")
    ap.add_argument("--burst", type=int, default=4, help="calls back to back per timed sample")
    args = ap.parse_args()
    rank, device, comm = probe_setup.start()
    world = comm.size
    side = torch.cuda.Stream(device=device, priority=-1)
    main_stream = torch.cuda.current_stream(device)
    mmax = max(s[0] for s in SHAPES) * max(s[1] for s in SHAPES)
    bufs = {"reg": [torch.empty(mmax, dtype=torch.bfloat16, device=device) for _ in range(2)]}
    windows = [Window(comm, mmax * 2, device) for _ in range(2)]
    bufs["win"] = [w.tensor for w in windows]
    groups = [int(g) for g in args.groups.split(",")]
    results: dict = {"world": world, "nccl": comm.lib.version, "env": {k: v for k, v in os.environ.items()
                                                                      if k.startswith("NCCL_")}, "rows": []}
    stream_ptr = lambda s: s.cuda_stream  # noqa: E731

    def ar(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        comm.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), t.dtype, stream_ptr(stream))

    for m, n, k in SHAPES:
        g = torch.Generator(device=device).manual_seed(1234 + rank)
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=g) / k ** 0.5
        b = torch.randn(k, n, dtype=torch.bfloat16, device=device, generator=g)
        views = {kind: [x[: m * n].view(m, n) for x in pair] for kind, pair in bufs.items()}

        def gemm(out: torch.Tensor) -> None:
            torch.mm(a, b, out=out)

        def conc(kind: str) -> None:
            side.wait_stream(main_stream)
            gemm(views[kind][0])
            with torch.cuda.stream(side):
                ar(views[kind][1], side)
            main_stream.wait_stream(side)

        def pipe(kind: str, parts: int) -> None:
            out = views[kind][0]
            rows = m // parts
            side.wait_stream(main_stream)
            for i in range(parts):
                sl = out[i * rows:(i + 1) * rows]
                torch.mm(a[i * rows:(i + 1) * rows], b, out=sl)
                ev = torch.cuda.Event()
                ev.record(main_stream)
                side.wait_event(ev)
                ar(sl, side)
            main_stream.wait_stream(side)

        variants = {"gemm": lambda: gemm(views["reg"][0])}
        for kind in ("reg", "win"):
            variants[f"ar_{kind}"] = lambda kind=kind: ar(views[kind][1], main_stream)
            variants[f"seq_{kind}"] = lambda kind=kind: (gemm(views[kind][0]), ar(views[kind][0], main_stream))
            variants[f"conc_{kind}"] = lambda kind=kind: conc(kind)
            for parts in groups:
                variants[f"pipe{parts}_{kind}"] = lambda kind=kind, parts=parts: pipe(kind, parts)

        # correctness: the pipelined window result against the sequential regular one
        variants["seq_reg"]()
        torch.cuda.synchronize()
        ref = views["reg"][0].clone()
        views["win"][0].fill_(float("nan"))
        pipe("win", groups[-1])
        torch.cuda.synchronize()
        err = float((views["win"][0].float() - ref.float()).abs().max() / ref.float().abs().max())

        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        dist.barrier()
        for _ in range(args.rounds):
            for name, fn in variants.items():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(args.burst):
                    fn()
                e.record()
                e.synchronize()
                times[name].append(s.elapsed_time(e) / args.burst)
        med = torch.tensor([statistics.median(times[v]) for v in variants], device=device)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        row = {"m": m, "n": n, "k": k, "relerr_pipe_win": err}
        row.update({v: round(float(x), 4) for v, x in zip(variants, med.tolist())})
        for kind in ("reg", "win"):
            row[f"speedup_conc_{kind}"] = round(row[f"seq_{kind}"] / row[f"conc_{kind}"], 4)
            for parts in groups:
                row[f"speedup_pipe{parts}_{kind}"] = round(row["seq_reg"] / row[f"pipe{parts}_{kind}"], 4)
        probe_setup.emit(rank, results["rows"], row)
    for w in windows:
        w.close()
    probe_setup.finish(rank, args.json, results)


if __name__ == "__main__":
    main()
