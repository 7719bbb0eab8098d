"""Turn ``tools/anchor_bench.py`` output into the cost model's data files (bandwidth curve + GEMM model).

    python -m flashoverlap_inductor.tune.import_anchor anchor_2.json anchor_4.json \\
        --out-dir configs --measured 2026-11-22 [--sm-count 132] [--nccl-sms 16] [--kernel-efficiency 1.0]

All inputs must come from one GPU model (one world size each). It writes ``bandwidth_<gpu>.json``
(``flashoverlap.bandwidth/1``) and ``gemm_<gpu>.json`` (``flashoverlap.gemm/1``):

* Curves: every ``(bytes, ms)`` the anchor measured for a collective at its world size: the ``bw[]`` sweep plus
  each row's lone collective on its ``[M, N]`` bf16 output (``ar_ms``/``rs_ms``/``a2a_ms`` at ``2 M N`` bytes);
  sizes measured more than once keep the median. Raw medians, not smoothed (the loader makes them monotone).
* GEMM model: ``fit_gemm`` fits ``launch_ms`` and ``peak_tflops`` of the wave model (``gemm.py``, reference
  tile 128x256, all SMs) to the rows' cuBLAS ``gemm_ms`` by minimising the largest ``|log(pred / measured)|``
  (``wave_overhead_ms`` = 0: an unconstrained least-squares fit drives it negative, i.e. the data cannot
  separate it from the rate).
* Interference: ``fit_interference`` = median over rows of ``(gemm_plus_concurrent_ar_ms - gemm_ms) / ar_ms``,
  rows with ``gemm_ms >= 0.3`` ms and ``ar_ms < gemm_ms`` only (shorter runs are dominated by launch and stream
  synchronisation: the 2048x4096x4096 rows took longer concurrently than sequentially).
* ``dtype_scale``: bfloat16 measured (1.0); float16 assumed equal (same tensor-core rate); float32 the
  spec-sheet ratio FP32 / BF16-dense of H100/H200 SXM (67 / 989 TFLOP/s; ``--fp32-scale``), not measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashoverlap_inductor.cost_model.registry import normalize_gpu_name
from flashoverlap_inductor.cost_model.schema import BANDWIDTH_SCHEMA, GEMM_SCHEMA, validate_bandwidth, validate_gemm

REFERENCE_TILE = (128, 256)
KNOWN_SM_COUNTS = {"h200": 132, "h100 80gb hbm3": 132}
FP32_SPEC_SCALE = 67.0 / 989.0
_COLL_KEYS = {"all_reduce": "ar_ms", "reduce_scatter": "rs_ms", "all_to_all": "a2a_ms"}
_ROW_KEYS = ("m", "n", "k", "gemm_ms", "ar_ms", "rs_ms", "a2a_ms", "seq_ar_ms", "seq_rs_ms",
             "gemm_plus_concurrent_ar_ms", "ideal_ar_ms", "ideal_rs_ms")


def _sig(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


def fit_gemm(samples: Sequence[tuple[int, int, int, float]], sm_count: int,
             tile: tuple[int, int] = REFERENCE_TILE) -> dict[str, float]:
    """Minimax fit (in log ratio) of ``T = launch_ms + waves * 2 tm tn k / (peak * 1e9 / sm_count)`` to
    ``(m, n, k, ms)`` samples. Returns ``peak_tflops``, ``launch_ms``, ``wave_overhead_ms`` (0) and
    ``max_abs_log_error``. ``launch_ms`` on a 0.5 us grid in [0, 50 us); the rate by bisection (for a fixed
    launch time, the largest error minus the smallest rises with 1/peak)."""
    if not samples:
        raise ValueError("fit_gemm: no samples")
    tm, tn = tile
    terms = [(math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / sm_count) * 2.0 * tm * tn * k * sm_count / 1e9, t)
             for m, n, k, t in samples]  # (waves * flop-per-wave / 1e9, measured ms): pred = L + a * x, x = 1/peak
    best: tuple[float, float, float] | None = None
    for step in range(100):
        launch = step * 0.0005
        if launch >= min(t for _, t in terms):
            break

        def errors(x: float, launch: float = launch) -> list[float]:
            return [math.log((launch + a * x) / t) for a, t in terms]

        lo, hi = 1e-7, 1.0  # 1/peak in 1/(TFLOP/s): peak between 1 and 1e7 TFLOP/s
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            e = errors(mid)
            lo, hi = (lo, mid) if max(e) + min(e) > 0 else (mid, hi)
        worst = max(abs(v) for v in errors(math.sqrt(lo * hi)))
        if best is None or worst < best[0] - 1e-12:
            best = (worst, launch, 1.0 / math.sqrt(lo * hi))
    assert best is not None
    return {"peak_tflops": _sig(best[2]), "launch_ms": _sig(best[1]), "wave_overhead_ms": 0.0,
            "max_abs_log_error": _sig(best[0], 4)}


def fit_interference(rows: Sequence[dict[str, Any]], min_gemm_ms: float = 0.3) -> tuple[float, int]:
    """Median extra GEMM ms per ms of concurrent all_reduce, and how many rows it used (see module doc)."""
    ratios = [(r["gemm_plus_concurrent_ar_ms"] - r["gemm_ms"]) / r["ar_ms"] for r in rows
              if "gemm_plus_concurrent_ar_ms" in r and r["gemm_ms"] >= min_gemm_ms and r["ar_ms"] < r["gemm_ms"]]
    if not ratios:
        return 0.0, 0
    return max(0.0, _sig(statistics.median(ratios), 4)), len(ratios)


def convert(anchors: Sequence[dict[str, Any]], names: Sequence[str], *, measured: str, sm_count: int | None = None,
            nccl_sms: int = 16, kernel_efficiency: float = 1.0, fp32_scale: float = FP32_SPEC_SCALE,
            converted: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (bandwidth, gemm) documents for anchors of one GPU model; ``names`` label the inputs in ``source``."""
    gpus = {a["gpu"] for a in anchors}
    if len(gpus) != 1:
        raise ValueError(f"all anchors must be from one GPU model, got {sorted(gpus)}")
    gpu = gpus.pop()
    if sm_count is None:
        sm_count = KNOWN_SM_COUNTS.get(normalize_gpu_name(gpu))
        if sm_count is None:
            raise ValueError(f"SM count of {gpu!r} unknown; pass --sm-count")
    worlds = [int(a["world"]) for a in anchors]
    if len(set(worlds)) != len(worlds):
        raise ValueError(f"one anchor per world size, got world sizes {worlds}")
    converted = converted or datetime.date.today().isoformat()
    software = sorted({f"torch {a.get('torch', '?')}, NCCL {a.get('nccl', '?')}" for a in anchors})
    source = (f"tools/anchor_bench.py on {gpu} ({'; '.join(software)}), medians of CUDA-event timings, max over "
              f"ranks; inputs: {', '.join(names)}; converted {converted} by tune.import_anchor")
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for anchor in anchors:
        per: dict[str, list[list[float]]] = {}
        for coll, key in _COLL_KEYS.items():
            samples: dict[int, list[float]] = {}
            for point in anchor.get("bw", []):
                samples.setdefault(int(point["bytes"]), []).append(float(point[key]))
            for row in anchor.get("rows", []):
                if key in row:  # the row's collective on its bf16 [M, N] output
                    samples.setdefault(2 * int(row["m"]) * int(row["n"]), []).append(float(row[key]))
            per[coll] = [[b, _sig(statistics.median(ts))] for b, ts in sorted(samples.items())]
        curves[str(anchor["world"])] = per
    bandwidth = {"schema": BANDWIDTH_SCHEMA, "gpu": gpu, "sm_count": sm_count, "date": measured,
                 "source": source, "curves": curves}
    rows = [{"world": int(a["world"]), "dtype": "bfloat16",
             **{k: (_sig(r[k]) if isinstance(r[k], float) else r[k]) for k in _ROW_KEYS if k in r}}
            for a in anchors for r in a.get("rows", [])]
    model = fit_gemm([(r["m"], r["n"], r["k"], r["gemm_ms"]) for r in rows], sm_count)
    alpha, used = fit_interference(rows)
    gemm = {
        "schema": GEMM_SCHEMA, "gpu": gpu, "sm_count": sm_count, "date": measured, "source": source,
        "model": {"tile": list(REFERENCE_TILE), **model,
                  "note": "fitted to the anchor rows' cuBLAS gemm_ms (minimax log error), all SMs"},
        "dtype_scale": {"bfloat16": 1.0, "float16": 1.0, "float32": _sig(fp32_scale, 4)},
        "dtype_scale_note": "bfloat16 measured; float16 assumed equal; float32 = spec FP32/BF16-dense ratio",
        "fused": {"nccl_sms": nccl_sms, "kernel_efficiency": kernel_efficiency,
                  "note": "SMs the fused GEMM leaves to NCCL; its rate relative to the fitted cuBLAS rate "
                          "(1.0 = as fast; the untuned CUTLASS 128x256 probe kernel reached ~0.85)"},
        "interference": {"gemm_slowdown_per_comm_ms": alpha, "rows_used": used,
                         "note": "median (gemm_plus_concurrent_ar_ms - gemm_ms) / ar_ms over rows with "
                                 "gemm_ms >= 0.3 and ar_ms < gemm_ms; cuBLAS on all SMs"},
        "anchor_rows": rows,
    }
    validate_bandwidth(bandwidth, "converted bandwidth")
    validate_gemm(gemm, "converted gemm")
    return bandwidth, gemm


def dumps(doc: dict[str, Any]) -> str:
    """JSON text with one ``[bytes, ms]`` pair per line."""
    text = json.dumps(doc, indent=1)
    return re.sub(r"\[\s+([-\d.e+]+),\s+([-\d.e+]+)\s+\]", r"[\1, \2]", text) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashoverlap_inductor.tune.import_anchor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("anchors", nargs="+", type=Path, help="anchor_bench.py JSON files (one per world size)")
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="where to write the two files")
    parser.add_argument("--measured", required=True, help="date of the measurement (YYYY-MM-DD)")
    parser.add_argument("--sm-count", type=int, default=None, help="SMs of the GPU (known: H200)")
    parser.add_argument("--nccl-sms", type=int, default=16, help="SMs the fused GEMM leaves to NCCL")
    parser.add_argument("--kernel-efficiency", type=float, default=1.0, help="fused GEMM rate / cuBLAS rate")
    parser.add_argument("--fp32-scale", type=float, default=FP32_SPEC_SCALE, help="float32 rate / bf16 rate")
    args = parser.parse_args(argv)
    docs = [json.loads(p.read_text()) for p in args.anchors]
    bandwidth, gemm = convert(docs, [p.name for p in args.anchors], measured=args.measured, sm_count=args.sm_count,
                              nccl_sms=args.nccl_sms, kernel_efficiency=args.kernel_efficiency,
                              fp32_scale=args.fp32_scale)
    slug = normalize_gpu_name(bandwidth["gpu"]).replace(" ", "_")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for kind, doc in (("bandwidth", bandwidth), ("gemm", gemm)):
        path = args.out_dir / f"{kind}_{slug}.json"
        path.write_text(dumps(doc))
        print(f"wrote {path}")
    m = gemm["model"]
    print(f"GEMM fit: peak {m['peak_tflops']} TFLOP/s, launch {m['launch_ms']} ms, max |log error| "
          f"{m['max_abs_log_error']}; interference {gemm['interference']['gemm_slowdown_per_comm_ms']} "
          f"({gemm['interference']['rows_used']} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
