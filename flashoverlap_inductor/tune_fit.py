"""``tune fit``: calibrate the cost model's fused-path parameters to measured benchmark rows (CPU only).

    python -m flashoverlap_inductor.tune fit --bench bench_w4.json bench_w2.json [--variant tiles/direct]
                                             [--grid tiles] [--write]

Input: the JSON of ``examples/bench_ops.py`` (each row holds the plan it ran and T_fused; ``--variant`` takes the
times of one ``--fused-variants`` entry instead of the default fused column). The model's GEMM rate and the NCCL
curves stay as shipped (cuBLAS and NCCL alone were fitted elsewhere); only what describes GEMM and NCCL *running
together* is fitted, by an exhaustive grid search that minimizes the median of |predicted - measured| / measured
of T_fused over the rows:

* ``kernel_efficiency``: the signal GEMM's rate relative to the fitted cuBLAS rate;
* ``gemm_slowdown``: extra GEMM ms per ms of concurrent NCCL;
* ``comm_slowdown``: NCCL runs ``1 + comm_slowdown`` times slower beside the GEMM.

``--grid`` names the GEMM grid the rows ran with (``tiles``: ``nccl_sms`` = 0, every SM to the GEMM). ``--write``
stores the result, with the grid, the fit's error and its inputs, in the ``fused`` section of the GPU's
``flashoverlap.gemm/1`` file (``runtime_gpu`` then launches the grid the model assumes).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any

from flashoverlap_inductor.plan import GroupPlan, chunks_for

EFFICIENCIES = tuple(round(0.70 + 0.025 * i, 3) for i in range(15))  # 0.70 .. 1.05
GEMM_SLOWDOWNS = tuple(round(0.05 * i, 2) for i in range(13))  # 0 .. 0.60
COMM_SLOWDOWNS = tuple(round(0.1 * i, 1) for i in range(21))  # 0 .. 2.0


def load_rows(paths: list[str], variant: str | None) -> tuple[list[dict[str, Any]], str]:
    """Rows with a measured fused time and a plan: ``(op, m, n, k, world, plan, fused_ms)``; and the GPU name."""
    rows, gpu = [], ""
    for path in paths:
        doc = json.loads(Path(path).read_text())
        gpu = gpu or doc["meta"]["gpu"]
        for r in doc["rows"]:
            ms = r["variants"].get(variant, {}).get("ms") if variant else r.get("fused_ms")
            if variant is None and not r.get("fused_path"):
                continue
            if ms is None or not math.isfinite(ms) or ms <= 0:
                continue
            rows.append({"op": r["op"], "m": r["m"], "n": r["n"], "k": r["k"], "world": r["world"],
                         "plan": r["plan"], "fused_ms": float(ms)})
    return rows, gpu


def predict(model: Any, row: dict[str, Any]) -> float:
    plan = GroupPlan.from_str(row["plan"])
    chunks = chunks_for(row["op"], row["m"], row["world"])
    return model.fused(plan, row["op"], chunks, row["k"], "bfloat16", row["world"]).total_ms


def fit(model: Any, rows: list[dict[str, Any]], grid: str) -> dict[str, Any]:
    """The best (kernel_efficiency, gemm_slowdown, comm_slowdown) for ``rows`` and the errors before/after."""
    nccl_sms = 0 if grid == "tiles" else model.gemm.nccl_sms

    def errors(eff: float, gs: float, cs: float) -> list[float]:
        gemm = dataclasses.replace(model.gemm, nccl_sms=nccl_sms, kernel_efficiency=eff, fused_gemm_slowdown=gs,
                                   comm_slowdown=cs, grid=grid)
        m = dataclasses.replace(model, gemm=gemm)
        return [abs(predict(m, r) - r["fused_ms"]) / r["fused_ms"] for r in rows]

    before = errors(model.gemm.kernel_efficiency, model.gemm.effective_interference, model.gemm.comm_slowdown)
    best: tuple[float, float, tuple[float, float, float]] | None = None
    for eff, gs, cs in itertools.product(EFFICIENCIES, GEMM_SLOWDOWNS, COMM_SLOWDOWNS):
        errs = sorted(errors(eff, gs, cs))
        key = (errs[len(errs) // 2], sum(errs) / len(errs))
        if best is None or key < best[:2]:
            best = (*key, (eff, gs, cs))
    assert best is not None
    eff, gs, cs = best[2]
    return {"grid": grid, "nccl_sms": nccl_sms, "kernel_efficiency": eff, "gemm_slowdown": gs, "comm_slowdown": cs,
            "median_rel_error": round(best[0], 4), "mean_rel_error": round(best[1], 4),
            "median_rel_error_before": round(sorted(before)[len(before) // 2], 4), "rows": len(rows)}


def cmd_fit(args: argparse.Namespace) -> int:
    from flashoverlap_inductor.cost_model import model_for, registry

    rows, gpu = load_rows(args.bench, args.variant)
    if not rows:
        print("tune fit: no usable rows")
        return 2
    grid = args.grid or (args.variant.split("/")[0] if args.variant else "persistent")
    model = model_for(gpu)[0]
    result = fit(model, rows, grid)
    print(json.dumps(result, indent=1))
    if args.write:
        want = registry.normalize_gpu_name(gpu)
        for path in sorted(registry.data_dir().glob("*.json")):
            doc = json.loads(path.read_text())
            if str(doc.get("schema", "")).startswith("flashoverlap.gemm/") and \
                    registry.normalize_gpu_name(str(doc.get("gpu", ""))) == want:
                fused = doc["fused"]
                for key in ("grid", "nccl_sms", "kernel_efficiency", "gemm_slowdown", "comm_slowdown"):
                    fused[key] = result[key]
                fused["fit"] = {"inputs": [Path(p).name for p in args.bench], "variant": args.variant or "fused",
                                **{k: result[k] for k in ("median_rel_error", "mean_rel_error",
                                                          "median_rel_error_before", "rows")}}
                path.write_text(json.dumps(doc, indent=1) + "\n")
                print(f"tune fit: wrote the fused section of {path}")
                break
        else:
            print(f"tune fit: no GEMM model file for {gpu} in {registry.data_dir()}")
            return 2
    return 0


def add_parser(sub: Any) -> None:
    fi = sub.add_parser("fit", help="fit the fused-path parameters of the cost model to bench_ops JSON (CPU)")
    fi.add_argument("--bench", nargs="+", required=True, help="bench_ops JSON files")
    fi.add_argument("--variant", default=None, help="a --fused-variants entry (default: the fused column)")
    fi.add_argument("--grid", choices=("persistent", "tiles"), default=None,
                    help="the GEMM grid the rows ran with (default: the variant's, else persistent)")
    fi.add_argument("--write", action="store_true", help="store the result in the GPU's GEMM model file")
