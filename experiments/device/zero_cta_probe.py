# ruff: noqa: B023
"""Probe: NCCL's zero-CTA (copy-engine) all-to-all beside a GEMM.

torchrun --nproc_per_node=W experiments/device/zero_cta_probe.py --json OUT.json   (run once with NCCL_CTA_POLICY=2)

NCCL >= 2.28 can run AlltoAll / AllGather on copy engines (no CTAs) when the communicator's CTA policy is
NCCL_CTA_POLICY_ZERO and the buffers are symmetric windows. If so, a reduce_scatter done as an all-to-all of the
partial rows plus one local sum (PyTorch async-TP's split, with NCCL moving the bytes) would leave the GEMM all its
SMs. Per size (bf16 [M, 8192]), sustained timing (``tune_measure.Timer``), max over ranks of medians (ms):
  a2a_<buf>      ncclAlltoAll alone; buf = reg (torch's allocator) or win (symmetric windows)
  gemm           cuBLAS 8192 x 8192 x 8192
  conc_<buf>     gemm || a2a_<buf> (no dependency)
The all-to-all result is checked against torch.distributed.all_to_all_single. NCCL_NVLS_ENABLE must be 0.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch
import torch.distributed as dist

from flashoverlap_inductor.native import nccl_direct
from flashoverlap_inductor.tune import measure as tune_measure

sys.path.insert(0, os.path.dirname(__file__))
import probe_setup  # noqa: E402
from window_probe import Window  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rank, device, comm = probe_setup.start()
    w = comm.size
    lib = comm.lib.lib
    has_a2a = hasattr(lib, "ncclAlltoAll")
    p, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    if has_a2a:
        lib.ncclAlltoAll.argtypes = [p, p, sz, i, p, p]
    side = torch.cuda.Stream(device=device, priority=-1)
    timer = tune_measure.Timer(rounds=5, target_ms=8.0, min_iters=2, max_iters=40, spin_ms=0.3)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) / 90.0
    c = torch.empty(8192, 8192, device=device, dtype=torch.bfloat16)
    out: dict = {"world": w, "nccl": comm.lib.version, "has_ncclAlltoAll": has_a2a,
                 "cta_policy_env": os.environ.get("NCCL_CTA_POLICY"), "rows": []}
    wins = [Window(comm, 8192 * 8192 * 2, device) for _ in range(2)]
    reg = [torch.empty(8192 * 8192, device=device, dtype=torch.bfloat16) for _ in range(2)]
    for m in (2048, 8192):
        count = m * 8192 // w  # elements to each peer
        bufs = {"reg": [t[: m * 8192] for t in reg], "win": [x.tensor[: m * 8192] for x in wins]}

        def a2a(kind: str, stream: torch.cuda.Stream) -> None:
            s, r = bufs[kind]
            if has_a2a:
                comm.lib.check(lib.ncclAlltoAll(s.data_ptr(), r.data_ptr(), count, nccl_direct.NCCL_DTYPES[s.dtype],
                                                comm.comm, stream.cuda_stream), "ncclAlltoAll", comm.comm)
            else:
                eb = s.element_size()
                comm.send_recv([(q, s.data_ptr() + q * count * eb, count) for q in range(w)],
                               [(q, r.data_ptr() + q * count * eb, count) for q in range(w)], s.dtype,
                               stream.cuda_stream)

        def conc(kind: str) -> None:
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            torch.mm(a, b, out=c)
            a2a(kind, side)
            cur.wait_stream(side)

        errs = {}
        for kind in ("reg", "win"):
            s, r = bufs[kind]
            s.copy_(torch.randn(m * 8192, device=device, dtype=torch.bfloat16))
            r.fill_(float("nan"))
            a2a(kind, torch.cuda.current_stream())
            ref = torch.empty_like(r)
            dist.all_to_all_single(ref, s)
            torch.cuda.synchronize()
            errs[kind] = float((r.float() - ref.float()).abs().max())
        variants = {"gemm": lambda: torch.mm(a, b, out=c)}
        for kind in ("reg", "win"):
            variants[f"a2a_{kind}"] = lambda kind=kind: a2a(kind, torch.cuda.current_stream())
            variants[f"conc_{kind}"] = lambda kind=kind: conc(kind)
        t = timer.measure(variants)
        row = {"m": m, "maxerr": errs, **{k: round(v.ms, 4) for k, v in t.items()}}
        for kind in ("reg", "win"):
            row[f"seq_over_conc_{kind}"] = round((row["gemm"] + row[f"a2a_{kind}"]) / row[f"conc_{kind}"], 4)
        probe_setup.emit(rank, out["rows"], row)
    for x in wins:
        x.close()
    probe_setup.finish(rank, args.json, out)


if __name__ == "__main__":
    main()
