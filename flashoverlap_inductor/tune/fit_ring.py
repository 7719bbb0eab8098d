"""``tune fit --ring``: the ring route's model (``cost_model/ring.py``) fitted to the benchmark's ring variants (CPU).

    python -m flashoverlap_inductor.tune fit --ring --bench bench_w4.json [--variant tiles/peer////ring2]
                                             [--host-floor all_reduce=MS,reduce_scatter=MS] [--write]

Rows: every ``examples/bench_ops.py`` row timed under a ring variant the model describes (a ``--fused-variants``
spec of the peer mode whose rows field is exactly ``ringR``, the ring in at most R rounds, with no kernel named:
``tune.rows.modelled_ring_variant``) that the ring runs (all_reduce / reduce_scatter whose rows cut into pieces,
``tune.rows.route_of_row``); ``--variant`` keeps one spec. The rounds of each row follow
from R, so the variants of several R fit one set of terms. Per world size and collective: ``gemm_factor``,
``fixed_ms`` and ``link_efficiency`` (least relative error, ``ring.fit_terms``); rows within 10% of the host floor
measured the host and are left out of the fit (not of its error); a (world size, collective) with fewer than 2
such rows keeps its terms, with a note. ``--write`` stores the ``ring`` section of the
GPU's ``flashoverlap.gemm/1`` file, keeping the world sizes and collectives these rows do not cover.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from flashoverlap_inductor.cost_model.ring import fit_terms, relative_errors, rounds_for
from flashoverlap_inductor.tools import cli_util as cli
from flashoverlap_inductor.tune.rows import above_floor, modelled_ring_variant, route_fit, route_of_row, write_section


def load_ring_rows(paths: list[str], variant: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """Rows ``{op, m, n, k, world, rounds, fused_ms, variant}`` timed on the ring (see the module docstring), and
    the GPU name. A file that is missing or not a benchmark JSON raises ``cli_util.CliError``."""
    rows, gpu = [], ""
    for path in paths:
        doc = cli.read_bench(path)
        gpu = gpu or doc["meta"]["gpu"]
        for r in doc["rows"]:
            for spec, v in r.get("variants", {}).items():
                most = modelled_ring_variant(spec)
                if not most or (variant and spec != variant) or route_of_row(r, spec) != "ring":
                    continue
                rounds = rounds_for(r["op"], r["m"], r["world"], most)
                ms = v.get("ms") if isinstance(v, dict) else None
                if rounds is None or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
                    continue
                rows.append({"op": r["op"], "m": r["m"], "n": r["n"], "k": r["k"], "world": r["world"],
                             "rounds": rounds, "fused_ms": float(ms), "variant": spec})
    return rows, gpu


def fit_ring(model: Any, rows: list[dict[str, Any]], host_floor: dict[str, float] | None = None) -> dict[str, Any]:
    """The ring section fitted to ``rows`` of ``load_ring_rows``: ``{"worlds": {w: {op: terms}}, "fit": {w: {op:
    {rows, median_rel_error, max_rel_error}}}}``. ``host_floor``: ``host_floor_ms`` per collective (default: the
    model's current ones)."""
    worlds: dict[str, dict[str, Any]] = {}
    info: dict[str, dict[str, Any]] = {}
    for world in sorted({r["world"] for r in rows}):
        link = model.link_bytes_per_ms(world)
        old = model.gemm.ring.terms.get(world, {}) if model.gemm.ring is not None else {}
        for op in sorted({r["op"] for r in rows if r["world"] == world}):
            pts = [(r["m"], r["n"], r["k"], r["rounds"], r["fused_ms"]) for r in rows
                   if r["world"] == world and r["op"] == op]
            floor = (host_floor or {}).get(op, old[op].host_floor_ms if op in old else 0.0)
            gpu_bound = above_floor(pts, floor)
            if len(gpu_bound) < 2:
                print(f"tune fit --ring: {world} ranks, {op}: {len(gpu_bound)} row(s) above the host floor; its terms "
                      "stay as they are")
                continue
            terms = dataclasses.replace(fit_terms(model.gemm, op, world, gpu_bound, link_bytes_per_ms=link),
                                        host_floor_ms=floor)
            errs = relative_errors(model.gemm, op, world, terms, pts, link_bytes_per_ms=link)
            entry = {"gemm_factor": round(terms.gemm_factor, 4), "fixed_ms": round(terms.fixed_ms, 4),
                     "link_efficiency": terms.link_efficiency}
            if floor:
                entry["host_floor_ms"] = floor
            worlds.setdefault(str(world), {})[op] = entry
            info.setdefault(str(world), {})[op] = {"rows": len(pts),
                                                   "median_rel_error": round(statistics.median(errs), 4),
                                                   "max_rel_error": round(max(errs), 4)}
    return {"worlds": worlds, "fit": info}


def cmd_fit_ring(args: argparse.Namespace) -> int:

    rows, gpu = load_ring_rows(args.bench, args.variant)
    result = route_fit("--ring", rows, gpu, fit_ring, args.host_floor,
                       "no rows ran on the ring (variants tiles/peer////ringR)")
    if result is None:
        return 2
    if not result["worlds"]:
        print("tune fit --ring: nothing fitted")
        return 2
    print(json.dumps({"ring": result}, indent=1))
    if not args.write:
        return 0
    inputs = sorted({Path(p).name for p in args.bench})
    variants = sorted({r["variant"] for r in rows})
    for per in result["fit"].values():
        for op_info in per.values():
            op_info.update(inputs=inputs, variants=variants)
    note = ("fitted by tune fit --ring to the benchmark's ring variants: gemm_factor * (the rounds' GEMM steps, each "
            "bounded by its NVLink push, each round by what the rank receives, + all_reduce's last gather) + fixed_ms "
            "(cost_model/ring.py)")

    def merge(doc: dict[str, Any]) -> None:  # world sizes and collectives absent from these rows keep their terms
        old = doc.get("ring") if isinstance(doc.get("ring"), dict) else {}
        worlds = {w: dict(per) for w, per in old.get("worlds", {}).items()}
        fit = {w: dict(per) for w, per in old.get("fit", {}).items()}
        for w, per in result["worlds"].items():
            worlds.setdefault(w, {}).update(per)
            fit.setdefault(w, {}).update(result["fit"][w])
        doc["ring"] = {"worlds": worlds, "fit": fit, "note": note}

    return write_section(gpu, merge, "ring section")
