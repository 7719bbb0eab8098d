"""One GPU: what splitting an expert-parallel rank's grouped GEMM costs (the MoE dispatch's and combine's GEMMs).

On 2 ranks a fused dispatch that starts on its own rows before the peer's arrive runs the experts' grouped GEMM
twice, once per source block (``routes/moe_fast.py``); each expert's weight is then read twice and each expert's
rows fill its last tile twice. The other way to cut is by expert: a grouped GEMM over the first half of the local
experts (all their rows, from both sources) while the rows of the second half still travel. This probe times, on one
GPU, at the ``bench_moe`` presets (received rows = tokens x top-k, from 2 sources, uniform routing, bf16):

* ``one``: one ``torch._grouped_mm`` over the rows in expert order (the unfused path's GEMM);
* ``by_source``: one per source block (each block's rows in expert order: today's fused dispatch / combine);
* ``by_expert<P>``: P calls, each over 1/P of the experts (all their rows);
* ``perm``: the unfused path's permutation (``rows[perm]``, [rows, K]); ``ymove``: the fused dispatch's move of the
  GEMM's output into expert order ([rows, N]);
* where the library loads: ``lib_one``, the library's grouped GEMM with device offsets (``native/grouped.py``) over
  every expert, and ``lib_expert<P>``, P calls of it over 1/P of the experts each, all into one output (checked
  against ``torch._grouped_mm`` first); ``lib_within2``: the 2 pieces' bounds on the device instead (each call over
  every expert, those outside its bounds empty: the MoE dispatch's cut by expert).

Each for the gate/up GEMM (K hidden, N 2 x inter) and the down GEMM (K inter, N hidden). Timing: ``--reps``
repetitions, the variants in a fresh random order each, each ``--iters`` back-to-back calls between CUDA events,
every repetition enqueued before one sync; medians in ms per call. Timings of one GPU hold (no peer shares it).

    python examples/device/moe_gemm_probe.py [--shapes qwen3:2048,qwen3:4096,qwen3:8192,mixtral:4096]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from flashoverlap_inductor.native import grouped, kernels

PRESETS = {"qwen3": {"hidden": 2048, "inter": 768, "experts": 64, "top_k": 8},
           "mixtral": {"hidden": 4096, "inter": 14336, "experts": 4, "top_k": 2}}
SOURCES = 2


def counts_of(experts: int, top_k: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per (source, local expert) [SOURCES, experts]: each source's tokens pick top-k of SOURCES x experts
    experts uniformly; this rank holds the first ``experts``."""
    out = []
    for _ in range(SOURCES):
        picks = torch.rand(tokens, SOURCES * experts, generator=gen).topk(top_k, dim=1).indices.flatten()
        out.append(torch.bincount(picks, minlength=SOURCES * experts)[:experts])
    return torch.stack(out)


def offs_of(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0).to(torch.int32).cuda()


def variants(k: int, n: int, counts: torch.Tensor, pieces: tuple[int, ...], lib: bool) -> dict:
    """The timed calls of one GEMM (rows [R, k] @ per-expert [k, n]); ``counts`` [SOURCES, E]."""
    experts = counts.shape[1]
    per_expert = counts.sum(0)
    rows = int(per_expert.sum())
    x = torch.randn(rows, k, device="cuda").bfloat16()
    w = (torch.randn(experts, n, k, device="cuda") / k ** 0.5).bfloat16()  # a Linear weight per expert
    wt = w.transpose(-2, -1)
    perm = torch.randperm(rows, device="cuda")
    y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    offs = offs_of(per_expert)  # every variant's offsets made before timing (a host-to-device copy per call stalls)
    v = {"one": lambda: torch._grouped_mm(x, wt, offs=offs)}
    blocks, start = [], 0
    for s in range(SOURCES):
        r = int(counts[s].sum())
        blocks.append((x[start:start + r], offs_of(counts[s])))
        start += r
    v["by_source"] = lambda: [torch._grouped_mm(xb, wt, offs=ob) for xb, ob in blocks]
    for p in pieces:
        cuts = [experts * i // p for i in range(p + 1)]
        parts, start = [], 0
        for lo, hi in zip(cuts, cuts[1:]):
            r = int(per_expert[lo:hi].sum())
            parts.append((x[start:start + r], wt[lo:hi], offs_of(per_expert[lo:hi])))
            start += r
        v[f"by_expert{p}"] = lambda parts=parts: [torch._grouped_mm(xp, wp, offs=op) for xp, wp, op in parts]
    v["perm"] = lambda: x[perm]
    v["ymove"] = lambda: y[perm]
    if lib:  # the library's grouped GEMM (native/grouped.py): every piece into one output, offsets on the device
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        v["lib_one"] = lambda: grouped.grouped_mm(x, w, offs, out=out)
        for p in pieces:
            cuts = [experts * i // p for i in range(p + 1)]
            v[f"lib_expert{p}"] = lambda cuts=cuts: [grouped.grouped_mm(x, w, offs, out=out, experts=(lo, hi))
                                                     for lo, hi in zip(cuts, cuts[1:])]
        bounds = torch.tensor([experts * i // 2 for i in range(3)], device="cuda", dtype=torch.int32)
        v["lib_within2"] = lambda: [grouped.grouped_mm(x, w, offs, out=out, within=bounds[q:q + 2]) for q in range(2)]
        got, want = grouped.grouped_mm(x, w, offs, out=out), torch._grouped_mm(x, wt, offs=offs)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        assert err < 4 * torch.finfo(torch.bfloat16).eps, f"library grouped GEMM differs from torch's: {err}"
    return v


def time_all(v: dict, reps: int, iters: int) -> dict[str, float]:
    for fn in v.values():
        fn()
        fn()
    torch.cuda.synchronize()
    rng, marks = random.Random(0), []
    torch.cuda._sleep(1_000_000)
    for _ in range(reps):
        names = list(v)
        rng.shuffle(names)
        for name in names:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                v[name]()
            b.record()
            marks.append((name, a, b))
    torch.cuda.synchronize()
    got: dict[str, list[float]] = {name: [] for name in v}
    for name, a, b in marks:
        got[name].append(a.elapsed_time(b) / iters)
    return {name: statistics.median(t) for name, t in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3:2048,qwen3:4096,qwen3:8192,mixtral:2048,mixtral:8192")
    ap.add_argument("--pieces", default="2,4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-library", action="store_true", help="leave out the library's grouped GEMM (lib_* columns)")
    args = ap.parse_args()
    pieces = tuple(int(p) for p in args.pieces.split(","))
    lib = kernels.available() and not args.no_library
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; ms per call, medians of {args.reps}")
    cols = None
    for item in args.shapes.split(","):
        preset, tokens = item.split(":")
        s = PRESETS[preset]
        counts = counts_of(s["experts"], s["top_k"], int(tokens), torch.Generator().manual_seed(int(tokens)))
        for gemm, (k, n) in (("gate_up", (s["hidden"], 2 * s["inter"])), ("down", (s["inter"], s["hidden"]))):
            t = time_all(variants(k, n, counts, pieces, lib), args.reps, args.iters)
            if cols is None:
                cols = list(t)
                print("preset | tokens/rank | rows | gemm | " + " | ".join(cols) + " | by_source/one | "
                      + " | ".join(f"by_expert{p}/one" for p in pieces)
                      + (" | lib_one/one | " + " | ".join(f"lib_expert{p}/one" for p in pieces) if lib else ""))
            ratios = [t["by_source"] / t["one"]] + [t[f"by_expert{p}"] / t["one"] for p in pieces] \
                + ([t["lib_one"] / t["one"]] + [t[f"lib_expert{p}"] / t["one"] for p in pieces] if lib else [])
            print(f"{preset} | {tokens} | {int(counts.sum())} | {gemm} | "
                  + " | ".join(f"{t[c]:.4f}" for c in cols) + " | " + " | ".join(f"{r:.3f}" for r in ratios),
                  flush=True)


if __name__ == "__main__":
    main()
