"""``tune fit --sequential``: the sequential baseline's skew after its GEMM (``GemmModel.seq_skew_fraction``; CPU).

    python -m flashoverlap_inductor.tune fit --sequential --bench bench_w2.json ... [--write]

Per world size and collective, the median over the benchmark rows of (T_seq - T_gemm - T_comm) / T_gemm, each row's
three times measured side by side: the sequential baseline's collective cannot end before the rank whose GEMM ends
last, so it ends later than GEMM and collective timed apart. ``--write`` merges the result into the ``sequential``
section of the GPU's ``flashoverlap.gemm/1`` file (entries absent from the rows keep their values).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from flashoverlap_inductor.cost_model.schema import SKEW_FRACTION_MAX
from flashoverlap_inductor.tune.rows import write_section


def fit_sequential(paths: list[str]) -> tuple[dict[str, Any], str]:
    """The ``sequential`` section's ``skew_fraction`` and ``fit`` (rows per entry) from benchmark JSON files, and the
    GPU name: per world size and collective, the median of (T_seq - T_gemm - T_comm) / T_gemm over the rows with all
    three measured, clamped to the schema's range [0, ``SKEW_FRACTION_MAX``]."""
    per: dict[tuple[str, str], list[float]] = {}
    gpu = ""
    for path in paths:
        doc = json.loads(Path(path).read_text())
        gpu = gpu or doc["meta"]["gpu"]
        for r in doc["rows"]:
            seq, gemm, comm = (r.get(key) for key in ("seq_ms", "gemm_ms", "comm_ms"))
            if all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in (seq, gemm, comm)):
                per.setdefault((str(r["world"]), r["op"]), []).append((seq - gemm - comm) / gemm)
    if not per:
        raise ValueError("no row has T_seq, T_gemm and T_comm")
    frac: dict[str, dict[str, float]] = {}
    info: dict[str, dict[str, int]] = {}
    for (world, op), xs in sorted(per.items()):
        frac.setdefault(world, {})[op] = round(min(SKEW_FRACTION_MAX, max(0.0, statistics.median(xs))), 4)
        info.setdefault(world, {})[op] = len(xs)
    return {"skew_fraction": frac, "fit": {"rows": info}}, gpu


def cmd_fit_sequential(args: argparse.Namespace) -> int:
    try:
        result, gpu = fit_sequential(args.bench)
    except (ValueError, KeyError) as exc:
        print(f"tune fit --sequential: {exc!r}")
        return 2
    print(json.dumps({"sequential": result}, indent=1))
    if not args.write:
        return 0

    def merge(doc: dict[str, Any]) -> None:  # world sizes and collectives absent from these rows keep their values
        old = doc.get("sequential", {})
        frac = {w: dict(v) for w, v in old.get("skew_fraction", {}).items()}
        for world, per in result["skew_fraction"].items():
            frac.setdefault(world, {}).update(per)
        inputs = ["/".join(Path(p).parts[-3:]) for p in args.bench]  # the run folders tell same-named files apart
        doc["sequential"] = {"skew_fraction": frac, "fit": {**result["fit"], "inputs": inputs},
                             "note": "fitted by tune fit --sequential: median of (T_seq - T_gemm - T_comm) / T_gemm "
                                     "over the op benchmark's rows (GemmModel.seq_skew_fraction)"}

    return write_section(gpu, merge, "sequential section")
