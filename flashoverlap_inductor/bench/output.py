"""Output of the end-to-end benchmark: the header, the table (stdout, rank 0), the JSON and the PNG chart.

Units: ``ms`` per step (median, max over ranks), ``tokens_per_s`` for the whole group, ``peak_bytes`` (CUDA, max
over ranks; shown in GiB), ``compile_s`` (first call, s), ``rel_err`` (relative, against the reference backend).
"""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

import torch

SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_to_all": "A2A"}


def meta(args: Any, env: Any) -> dict[str, Any]:
    """The run's settings and environment (JSON ``meta``)."""
    import transformers

    from .runner import flashoverlap_backend

    gpu = torch.cuda.get_device_name(env.device) if env.cuda else None
    lib = None
    if env.cuda:
        try:
            from flashoverlap_inductor.native import kernels

            lib = bool(kernels.available())
        except Exception:  # noqa: BLE001 - reported as unknown
            lib = None
    return {"world": env.world, "device": env.device.type, "gpu": gpu, "dtype": args.dtype,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if env.cuda else None,
            "fused_library": lib, "fuse": args.fuse, "cache": args.cache, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup, "lr": args.lr, "seed": args.seed, "backends": args.backends,
            "interleave": getattr(args, "interleave", 0), "turn_lead": getattr(args, "turn_lead", 0),
            "time_budget_s": getattr(args, "time_budget_s", None),
            "timing": "CUDA events per step, median, max over ranks" if env.cuda else
                      "perf_counter per step after a barrier, median, max over ranks",
            "models": [spec.describe() for spec in args.specs],
            "replicated": "embedding and lm_head weights are replicated on every rank (sp/ep: the final norm runs on "
                          "the sequence shards, lm_head's input is gathered)",
            "shared_gpu": bool(getattr(args, "share_gpu", False)) and env.cuda,
            "flashoverlap_backend": "entry point 'flashoverlap'" if flashoverlap_backend() == "flashoverlap"
            else "the backend function (the torch_dynamo_backends entry point is not installed)"}


def header(m: dict[str, Any], args: Any) -> str:
    lines = [f"e2e: {m['world']} rank(s) on {m['gpu'] or 'CPU (gloo)'}, {m['dtype']}, torch {m['torch']}, "
             f"transformers {m['transformers']}; fuse={m['fuse']}, cache={m['cache']}; batch {m['batch']}, "
             f"{m['warmup']} warm-up + {m['steps']} measured steps"
             + (f" in turns of {m['interleave']}, each after {m['turn_lead']} unmeasured"
                if m.get("interleave") else "")
             + f"; {m['timing']}"]
    lines += [f"  model: {d}" for d in m["models"]]
    lines.append(f"  {m['replicated']}; tokens/s counts the whole group's tokens (batch x seq per step)")
    if m.get("shared_gpu"):
        lines.append("  --share-gpu: every rank on one GPU over gloo: a correctness run; its timings mean nothing")
    if m["device"] == "cpu":
        lines.append("  CPU: fp32 unless --dtype bf16; timings only show the harness works (the fused ops' CPU route "
                     "runs the GPU schedule with torch ops)")
        if m["fuse"] == "auto":
            lines.append("  note: under fuse=auto the cost model (fitted on H200s) declines every fusion on CPU: "
                         "--fuse always fuses")
    if m["device"] == "cuda" and m["fused_library"] is False:
        lines.append("  WARNING: the CUDA kernel library is not built (python -m flashoverlap_inductor.build): every "
                     "fused op runs unfused (cuBLAS then NCCL)")
    return "\n".join(lines)


# the MoE calls' settle and transfer counters printed beside the routes (how many settled without a host read, how
# many transfer steps went straight into NCCL, over peer memory or were spilled)
RAN_MOE = ("moe:deferred", "moe:nccl_direct", "moe:moe_peer", "moe_peer:spill")


def fusion_summary(row: dict[str, Any]) -> str:
    """``rewrite tp_sequence 4; fused AR 4 RS 2; skip cost_model 3; near add 2`` from a fusing row's compile
    counters (a rewrite: the collectives a graph rewrite replaced before the fusions)."""
    c = row.get("fusion")
    if c is None:
        return ""
    parts = []
    for prefix, label in (("rewrite:", "rewrite"), ("fused:", "fused"), ("per_call:", "per-call"), ("skip:", "skip"),
                          ("near_miss:", "near")):
        got = {k[len(prefix):]: n for k, n in c.items() if k.startswith(prefix)}
        if got:
            parts.append(label + " " + " ".join(f"{SHORT.get(k, k)} {n}" for k, n in sorted(got.items())))
    ran = {k: n for k, n in row.get("runtime", {}).items()
           if k.startswith(("route:", "fallback:", "shadow:")) or k.endswith((":fast", ":redo")) or k in RAN_MOE}
    if ran:
        parts.append("ran " + " ".join(f"{k} {n}" for k, n in sorted(ran.items())))
    return "; ".join(parts) or "nothing to fuse"


def _fmt(x: Any, spec: str, none: str = "-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def hidden_cell(r: dict[str, Any]) -> str:
    """``58%``, or with the steps' spread (``e2e.add_hidden``) ``58% (44..71)``: the lowest and highest step."""
    if r.get("hidden") is None:
        return "-"
    steps = r.get("hidden_steps")
    spread = f" ({100 * min(steps):.0f}..{100 * max(steps):.0f})" if steps else ""
    return f"{100 * r['hidden']:.0f}%{spread}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("model", "plan", "workload", "seq", "backend", "status", "ms/step", "tokens/s", "speedup", "hidden",
            "peak GiB", "compile s", "rel.err", "fusion / note")
    out = [head]
    for r in rows:
        peak = r.get("peak_bytes")
        out.append((r["model"], r["plan"], r["workload"], str(r["seq"]), r["backend"], r["status"],
                    _fmt(r.get("ms"), ".3f"), _fmt(r.get("tokens_per_s"), ",.0f"),
                    _fmt(r.get("speedup"), ".3f") + ("x" if r.get("speedup") is not None else ""),
                    hidden_cell(r),
                    _fmt(peak / 2**30 if peak is not None else None, ".2f"), _fmt(r.get("compile_s"), ".1f"),
                    _fmt(r.get("rel_err"), ".1e"),
                    "; ".join(x for x in (fusion_summary(r), r.get("note", "")) if x)))
    widths = [max(len(row[i]) for row in out) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in out]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


HOST_PACED = 0.9  # a row whose host time per step is at least this share of its step time: host-paced


def host_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per case, each timed CUDA row's host time per step (``host_ms``: the median time its host took to issue a
    step onto a launch queue holding at most the turn's lead steps, each turn's first measured step; max over ranks)
    beside its step time, rows at ``HOST_PACED`` or more of it named: there the GPU waits for the host (a slower
    host, or more host work per step, moves the step; CUDA graphs, the -ro backends, take it away). Where the
    ``bound`` row (no communication, no fused call) is at that share too, the line says so: a step that waits for
    the GPU inside it (Llama-3-8B training on 2 H200s: every row's host time equal to its step time) looks
    host-paced whatever paces it, and the label does not tell rows apart there."""
    cases: dict[tuple, list[str]] = {}
    waits: set[tuple] = set()
    for r in rows:
        if r.get("host_ms") is None or not r.get("ms"):
            continue
        key = (r.get("model"), r.get("plan"), r.get("workload"), r.get("seq"))
        paced = r["host_ms"] >= HOST_PACED * r["ms"]
        if paced and r["backend"].startswith("bound"):
            waits.add(key)
        cases.setdefault(key, []).append(f"{r['backend']} {r['host_ms']:.3f} / {r['ms']:.3f}"
                                         + (" host-paced" if paced else ""))
    note = (" (the bound row too: the step may wait for the GPU inside it, so host time does not tell the rows' "
            "pacing apart)")
    return [f"{' '.join(map(str, key))}: host ms per step / step ms (median, max over ranks): {'; '.join(cells)}"
            + (note if key in waits else "") for key, cells in cases.items()]


def trace_lines(rows: list[dict[str, Any]]) -> str:
    """Per traced row (``--trace``), rank 0's trace (``trace_summary.describe``: a line, then the GPU's): is the
    step host-bound, and what do the fused ops cost on the host."""
    from .trace_summary import describe

    lines = ["traces (--trace: 2 steps each, rank 0, under the profiler; a GPU idle for much of the span means a "
             "host-bound step, where CUDA graphs, the -ro backends, help):"]
    for r in rows:
        if r.get("trace"):
            lines.append(f"  {r['model']} {r['plan']} {r['workload']} {r['seq']} {r['backend']}: "
                         f"{describe(r['trace'])}")
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(path: str, m: dict[str, Any], rows: list[dict[str, Any]], entries: list[dict[str, Any]]) -> None:
    """``{"meta", "rows", "coverage", "failed"}``; ``failed`` counts rows with status MISMATCH or error."""
    failed = sum(r["status"] in ("MISMATCH", "error") for r in rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_jsonable({"meta": m, "rows": rows, "coverage": entries, "failed": failed}),
                                     indent=1))


def plot(rows: list[dict[str, Any]], path: str, where: str = "") -> str:
    """Speedup over the reference per (model, plan, workload, seq) group and backend; returns a one-line note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib)"
    groups = list(dict.fromkeys((r["model"], r["plan"], r["workload"], r["seq"]) for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows if r.get("speedup") is not None))
    if not groups or not backends:
        return "no PNG: no backend ran"
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(backends)) / 2), 4.2))
    width = 0.8 / len(backends)
    for i, backend in enumerate(backends):
        ys = []
        for g in groups:
            r = next((r for r in rows if (r["model"], r["plan"], r["workload"], r["seq"]) == g
                      and r["backend"] == backend), None)
            ys.append(r["speedup"] if r and r.get("speedup") is not None else math.nan)  # n/a, error: no bar
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(groups))]
        bars = ax.bar(xs, ys, width, label=backend)
        ax.bar_label(bars, labels=[f"{y:.2f}" if math.isfinite(y) else "" for y in ys], fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{m}\n{p} {w} s{s}" for m, p, w, s in groups], fontsize=7)
    ref = next((r.get("reference") for r in rows if r.get("reference")), "reference")
    ax.set_ylabel(f"speedup over {ref} (step time)")
    world = rows[0].get("world")
    ax.set_title(f"end-to-end speedup, {world} rank(s), {rows[0].get('dtype')}" + (f", {where}" if where else ""))
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def moe_combine_note(entry: dict[str, Any]) -> str:
    """Whether the MoE combine (the experts' GEMM [-> un-permutation] -> all_to_all) was fused, and if not why."""
    fwd = entry["graphs"].get("forward") or entry["graphs"].get("inference") or {}
    ops = fwd.get("fused", {})
    fused = {k: n for k, n in ops.items() if k.endswith("all_to_all")}
    dispatch = sum(n for k, n in ops.items() if k.endswith("all_to_all_permute_gemm"))
    left = {k: n for k, n in fwd.get("collectives", {}).items() if k.startswith("all_to_all")}
    if fused:
        through = " with the un-permutation" if any("unpermute" in k for k in fused) else ""
        also = f"the dispatch (all_to_all -> permutation -> GEMMs) too ({dispatch} x)" if dispatch else \
            "the dispatch is not"
        return (f"MoE combine: the experts' GEMM{through} -> all_to_all is fused in the forward graph "
                f"({sum(fused.values())} x); {also}")
    direct = {k: n for k, n in left.items() if k.endswith("<- gemm")}
    via = sorted({k.split("<- via ", 1)[1] for k in left if "<- via " in k})
    skips = sorted(k for k in entry["events"].get("forward", entry["events"].get("inference", {}))
                   if k.startswith("skip:"))
    if direct:
        return (f"MoE combine: matched (GEMM -> all_to_all) but not fused; skips in that graph: "
                f"{', '.join(skips) or 'none recorded'}")
    declined = [k for k in skips if k.startswith("skip:combine")]
    if via and declined:
        return (f"MoE combine: recognized (experts' GEMM -> {'; '.join(via)} -> all_to_all) but not fused: "
                f"{', '.join(declined)}")
    if via:
        return (f"MoE combine: not matched: {'; '.join(via)} stands between the experts' GEMM and the all_to_all "
                "(one expert per rank, e.g. --experts equal to the world size, removes the un-permutation)")
    return "MoE combine: no all_to_all fed by a GEMM in the forward graph"
