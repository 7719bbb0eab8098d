"""``tune fit``: calibrate the cost model's fused-path parameters to measured benchmark rows (CPU only).

    python -m flashoverlap_inductor.tune fit --bench bench_w4.json bench_w2.json [--variant tiles/direct]
                                             [--records search_w2.json ...] [--grid tiles] [--gemm] [--write]

Input: the JSON of ``examples/bench_ops.py`` (each row holds the plan it ran and T_fused; ``--variant`` takes the
times of one ``--fused-variants`` entry instead of the default fused column). The model's GEMM rate and the NCCL
curves stay as shipped (cuBLAS and NCCL alone were fitted elsewhere); only what describes GEMM and NCCL *running
together* is fitted, by an exhaustive grid search that minimizes the median of |predicted - measured| / measured
of T_fused over the rows:

* ``kernel_efficiency``: the signal GEMM's rate relative to the fitted cuBLAS rate;
* ``gemm_slowdown``: extra GEMM ms per ms of concurrent NCCL;
* ``comm_slowdown``: NCCL runs ``1 + comm_slowdown`` times slower beside the GEMM;
* ``group_overhead_ms``: a fixed cost per group (its wait's release and NCCL launch latency).

``--records`` (files of ``tune search --record``) makes the plan *ranking* the first goal: per searched shape,
the candidate the model predicts fastest should measure within ``--tolerance`` (3%) of the measured best, which
is what the predictive search relies on; the error above then breaks ties, and must stay within 10%.

``--peer`` fits the peer route's model instead (``cost_model/peer.py``: per collective ``gemm_factor`` and
``fixed_ms``, least relative error) to the rows that ran on the peer route, and ``--write`` stores it
in the ``peer`` section; ``--host-floor all_reduce=MS,reduce_scatter=MS`` sets each collective's ``host_floor_ms``
(the back-to-back time per call of ``examples/device/peer_host_profile.py``; kept from the data file otherwise).
The fused-path fit above uses only rows that ran on the NCCL route.

``--sequential`` fits the sequential baseline's skew instead (``tune.fit_seq``, the ``sequential`` section);
``--ring`` the ring route's model (``tune.fit_ring``, the ``ring`` section).

``--gemm`` first refits the cuBLAS wave model (``peak_tflops``, ``launch_ms``; what T_seq is predicted with) to the
rows' T_gemm. ``--grid`` names the GEMM grid the rows ran with (default: the variant's, else the model's; ``tiles``:
``nccl_sms`` = 0, every SM to the GEMM). ``--write``
stores the result, with the grid, the fit's error and its inputs, in the ``fused`` section of the GPU's
``flashoverlap.gemm/1`` file (``routes.nccl`` then launches the grid the model assumes).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from flashoverlap_inductor.cost_model.pipeline import GroupParts
from flashoverlap_inductor.cost_model.schema import ROUTE_COLLECTIVES
from flashoverlap_inductor.schedule.plan import GroupPlan, chunks_for
from flashoverlap_inductor.tools import cli_util as cli
from flashoverlap_inductor.tune.measure import Progress
from flashoverlap_inductor.tune.rows import above_floor, route_fit, route_of_row, write_section
from flashoverlap_inductor.tune.schemas import read_records

EFFICIENCIES = tuple(round(0.75 + 0.025 * i, 3) for i in range(12))  # 0.75 .. 1.025
GEMM_SLOWDOWNS = tuple(round(0.05 * i, 2) for i in range(9))  # 0 .. 0.40
COMM_SLOWDOWNS = tuple(round(0.1 * i, 1) for i in range(13))  # 0 .. 1.2
GROUP_OVERHEADS_MS = (0.0, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1)


PEER_COLLECTIVES = ROUTE_COLLECTIVES  # what the peer route runs (routes.peer.COLLECTIVES), 2 ranks


def load_rows(paths: list[str], variant: str | None, peer: bool = False) -> tuple[list[dict[str, Any]], str]:
    """Rows with a measured fused time and a plan: ``(op, m, n, k, world, plan, fused_ms)``; and the GPU name.
    Only the rows that ran on the NCCL route (``peer``: only those on the peer route; ``tune.rows.route_of_row``).
    A file that is missing or not a benchmark JSON raises ``cli_util.CliError`` (``cli_util.read_bench``)."""
    rows, gpu, route = [], "", "peer" if peer else "nccl"
    for path in paths:
        doc = cli.read_bench(path)
        gpu = gpu or doc["meta"]["gpu"]
        for r in doc["rows"]:
            v = (r.get("variants") or {}).get(variant) if variant else None
            ms = (v.get("ms") if isinstance(v, dict) else None) if variant else r.get("fused_ms")
            if (variant is None and not r.get("fused_path")) or "plan" not in r or route_of_row(r, variant) != route:
                continue
            if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
                continue
            rows.append({"op": r["op"], "m": r["m"], "n": r["n"], "k": r["k"], "world": r["world"],
                         "plan": r["plan"], "fused_ms": float(ms)})
    return rows, gpu


def predict(model: Any, row: dict[str, Any]) -> float:
    plan = GroupPlan.from_str(row["plan"])
    chunks = chunks_for(row["op"], row["m"], row["world"])
    return model.fused(plan, row["op"], chunks, row["k"], "bfloat16", row["world"]).total_ms


def prepare(model: Any, op: str, m: int, k: int, world: int, plan_str: str) -> GroupParts:
    """``model.fused``'s parts of one plan (``CostModel.parts``), computed once."""
    return model.parts(GroupPlan.from_str(plan_str), op, chunks_for(op, m, world), k, "bfloat16", world)


def predict_prepared(gemm: Any, p: GroupParts, overhead_ms: float) -> float:
    """``CostModel.fused(...).total_ms`` for prepared parts with GEMM model ``gemm`` and the per-group overhead (ms)."""
    return p.evaluate(gemm, overhead_ms).total_ms


def load_records(paths: list[str]) -> list[dict[str, Any]]:
    """Shapes searched with ``tune search --record``: per shape its candidates with their measured time (the refined
    one where the search re-measured it) and whether it was refined."""
    out = []
    for path in paths:
        recs = read_records(Path(path))
        cli.check_records(path, recs)
        for rec in recs:
            cands = [(c["plan"], float(c.get("refined_ms") or c["measured_ms"]), bool(c.get("refined_ms")))
                     for c in rec["candidates"] if c.get("measured_ms")]
            if len(cands) >= 2:
                out.append({"op": rec["collective"], "m": rec["m"], "n": rec["n"], "k": rec["k"],
                            "world": rec["world_size"], "candidates": cands})
    return out


def regret(times_pred: list[float], times_meas: list[float], refined: list[bool] | None = None) -> float:
    """How much slower the predicted-best candidate measured than the best (0 = the model's pick won). With
    ``refined`` flags, the best is the fastest re-measured candidate (as ``tune search`` reports it: the minimum of
    many one-round times is biased low), and a pick that was not re-measured counts no less than 0."""
    pick = min(range(len(times_pred)), key=times_pred.__getitem__)
    pool = [t for t, r in zip(times_meas, refined, strict=True) if r] if refined and any(refined) else times_meas
    return max(0.0, times_meas[pick] / min(pool) - 1.0)


def fit(model: Any, rows: list[dict[str, Any]], grid: str, records: list[dict[str, Any]] | None = None,
        tolerance: float = 0.03, max_error: float = 0.10) -> dict[str, Any]:
    """The best (kernel_efficiency, gemm_slowdown, comm_slowdown, group_overhead_ms) by exhaustive grid search.

    Without ``records``: the smallest median (then mean) |predicted - measured| / measured of T_fused over ``rows``.
    With ``records`` (``load_records``): the ranking first -- the fewest shapes whose predicted-best candidate
    measured more than ``tolerance`` slower than their measured best, then the smallest mean regret -- among the
    parameters whose median error over ``rows`` (over the records' candidates when there are no rows) stays within
    ``max_error``; then the error as above."""
    records = records or []
    nccl_sms = 0 if grid == "tiles" else model.gemm.nccl_sms
    unique: dict[tuple, int] = {}  # each distinct (op, shape, world, plan) is predicted once per parameter set

    def index(op: str, m: int, k: int, world: int, plan: str) -> int:
        return unique.setdefault((op, m, k, world, plan), len(unique))

    prepared = [(index(r["op"], r["m"], r["k"], r["world"], r["plan"]), r["fused_ms"]) for r in rows]
    ranked = [([index(r["op"], r["m"], r["k"], r["world"], plan) for plan, _, _ in r["candidates"]],
               [ms for _, ms, _ in r["candidates"]], [ref for _, _, ref in r["candidates"]]) for r in records]
    plans_once = [prepare(model, *key) for key in unique]

    def evaluate(eff: float, gs: float, cs: float, oh: float) -> tuple[list[float], list[float]]:
        gemm = dataclasses.replace(model.gemm, nccl_sms=nccl_sms, kernel_efficiency=eff, fused_gemm_slowdown=gs,
                                   comm_slowdown=cs, grid=grid, group_overhead_ms=oh)
        times = [predict_prepared(gemm, p, oh) for p in plans_once]
        errs = [abs(times[i] - ms) / ms for i, ms in prepared]
        regrets = []
        for idx, meas, refined in ranked:
            pred = [times[i] for i in idx]
            regrets.append(regret(pred, meas, refined))
            if not rows:
                errs += [abs(x - ms) / ms for x, ms in zip(pred, meas, strict=True)]
        return errs, regrets

    def key(errs: list[float], regrets: list[float]) -> tuple[float, ...]:
        med = statistics.median(errs) if errs else 0.0
        mean = sum(errs) / len(errs) if errs else 0.0
        if not records:
            return (med, mean)
        misses = sum(r > tolerance for r in regrets)
        return (med > max_error, misses, round(sum(regrets) / len(regrets), 4), med, mean)

    before_errs, before_regrets = evaluate(model.gemm.kernel_efficiency, model.gemm.effective_interference,
                                           model.gemm.comm_slowdown, model.call_overhead_ms)
    best: tuple[tuple[float, ...], tuple[float, float, float, float], list[float], list[float]] | None = None
    grid_size = len(EFFICIENCIES) * len(GEMM_SLOWDOWNS) * len(COMM_SLOWDOWNS) * len(GROUP_OVERHEADS_MS)
    bar = Progress(grid_size, f"tune fit: {len(unique)} plans x {grid_size} parameter sets", file=sys.stderr)
    for params in itertools.product(EFFICIENCIES, GEMM_SLOWDOWNS, COMM_SLOWDOWNS, GROUP_OVERHEADS_MS):
        errs, regrets = evaluate(*params)
        k = key(errs, regrets)
        if best is None or k < best[0]:
            best = (k, params, errs, regrets)
        bar.update()
    bar.close()
    assert best is not None
    (eff, gs, cs, oh), errs, regrets = best[1], best[2], best[3]
    out = {"grid": grid, "nccl_sms": nccl_sms, "kernel_efficiency": eff, "gemm_slowdown": gs, "comm_slowdown": cs,
           "group_overhead_ms": oh,
           "median_rel_error": round(statistics.median(errs), 4) if errs else None,
           "mean_rel_error": round(sum(errs) / len(errs), 4) if errs else None,
           "median_rel_error_before": round(statistics.median(before_errs), 4) if before_errs else None,
           "rows": len(rows)}
    if records:
        out.update({"records": len(records), "tolerance": tolerance,
                    "ranking_misses": sum(r > tolerance for r in regrets),
                    "ranking_misses_before": sum(r > tolerance for r in before_regrets),
                    "regrets": [round(r, 4) for r in regrets],
                    "regrets_before": [round(r, 4) for r in before_regrets]})
    return out


def fit_cublas(paths: list[str], sm_count: int, tile: tuple[int, int]) -> dict[str, float]:
    """``import_anchor.fit_gemm`` on the benchmark's cuBLAS times (``gemm_ms``; the median per shape over the
    files), with those ``samples`` ([m, n, k, ms]) kept in the result."""
    from flashoverlap_inductor.tune.import_anchor import fit_gemm

    per_shape: dict[tuple[int, int, int], list[float]] = {}
    for path in paths:
        for r in cli.read_bench(path)["rows"]:
            if isinstance(r.get("gemm_ms"), (int, float)) and r["gemm_ms"] > 0 and math.isfinite(r["gemm_ms"]):
                per_shape.setdefault((r["m"], r["n"], r["k"]), []).append(float(r["gemm_ms"]))
    samples = [(m, n, k, sorted(v)[len(v) // 2]) for (m, n, k), v in sorted(per_shape.items())]
    return {**fit_gemm(samples, sm_count, tile), "samples": [list(x) for x in samples]}


def fit_peer(model: Any, rows: list[dict[str, Any]], host_floor: dict[str, float] | None = None) -> dict[str, Any]:
    """The peer section (``cost_model/peer.py``) fitted to ``rows`` of ``load_rows(..., peer=True)``: terms per
    collective, and the fit's median / max relative error per collective. ``host_floor``: ``host_floor_ms`` per
    collective (default: the model's current ones)."""
    from flashoverlap_inductor.cost_model.peer import fit_terms, relative_errors

    worlds = {r["world"] for r in rows}
    if len(worlds) != 1:
        raise ValueError(f"peer fit: rows of one world size needed, got {sorted(worlds)}")
    collectives, fit_info = {}, {}
    world = next(iter(worlds))
    link = model.link_bytes_per_ms(world)
    for op in sorted({r["op"] for r in rows}):
        pts = [(r["m"], r["n"], r["k"], r["fused_ms"]) for r in rows if r["op"] == op]
        old = model.gemm.peer.terms.get(op) if model.gemm.peer is not None else None
        floor = (host_floor or {}).get(op, old.host_floor_ms if old is not None else 0.0)
        terms = dataclasses.replace(fit_terms(model.gemm, op, above_floor(pts, floor), link_bytes_per_ms=link),
                                    host_floor_ms=floor)
        errs = relative_errors(model.gemm, op, terms, pts, link_bytes_per_ms=link)
        collectives[op] = {"gemm_factor": round(terms.gemm_factor, 4), "fixed_ms": round(terms.fixed_ms, 4),
                           "link_efficiency": terms.link_efficiency}
        if floor:
            collectives[op]["host_floor_ms"] = floor
        fit_info[op] = {"rows": len(pts), "median_rel_error": round(statistics.median(errs), 4),
                        "max_rel_error": round(max(errs), 4)}
    return {"world_size": world, "collectives": collectives, "fit": fit_info}


def cmd_fit_peer(args: argparse.Namespace) -> int:
    rows, gpu = load_rows(args.bench, args.variant, peer=True)
    result = route_fit("--peer", rows, gpu, fit_peer, args.host_floor, "no rows ran on the peer route")
    if result is None:
        return 2
    print(json.dumps({"peer": result}, indent=1))
    if not args.write:
        return 0
    inputs = [Path(p).name for p in args.bench]
    result["fit"] = {op: {**info, "inputs": inputs, "variant": args.variant or "fused"}
                     for op, info in result["fit"].items()}
    result["note"] = ("fitted by tune fit --peer to T_fused of the rows that ran on the peer route: "
                      "gemm_factor * (GEMM 1 + GEMM 2) + fixed_ms, each GEMM the cuBLAS wave model's time of half "
                      "the rows or its NVLink stores' time at the all_reduce curve's tail rate, where longer "
                      "(cost_model/peer.py)")
    def merge(doc: dict[str, Any]) -> None:  # collectives absent from these rows keep their terms and fit
        old = doc.get("peer") if isinstance(doc.get("peer"), dict) else {}
        if old.get("world_size", result["world_size"]) != result["world_size"]:
            old = {}
        result["collectives"] = {**old.get("collectives", {}), **result["collectives"]}
        kept = {op: v for op, v in old.get("fit", {}).items() if op in PEER_COLLECTIVES}
        result["fit"] = {**kept, **result["fit"]}
        doc["peer"] = result

    return write_section(gpu, merge, "peer section")


def cmd_fit(args: argparse.Namespace) -> int:
    from flashoverlap_inductor.cost_model import model_for

    if args.peer + args.sequential + args.ring > 1:
        raise cli.CliError("--peer, --ring and --sequential fit different sections; give one")
    if not args.bench and not (args.records and not (args.peer or args.ring or args.sequential)):
        raise cli.CliError(f"nothing to fit: give --bench FILE... ({cli.BENCH_FILE[0]} of: {cli.BENCH_FILE[1]})"
                           + ("" if args.peer or args.ring or args.sequential else
                              f" or --records FILE... (of: {cli.RECORDS_FILE[1]})"))
    for path in args.bench:  # every input checked before any fit (the sections' loaders read them again)
        cli.read_bench(path)
    for path in args.records:
        cli.check_records(path, read_records(Path(path)))
    if args.peer:
        return cmd_fit_peer(args)
    if args.ring:
        from flashoverlap_inductor.tune.fit_ring import cmd_fit_ring
        return cmd_fit_ring(args)
    if args.sequential:
        from flashoverlap_inductor.tune.fit_seq import cmd_fit_sequential

        return cmd_fit_sequential(args)
    rows, gpu = load_rows(args.bench, args.variant)
    records = load_records(args.records)
    if not rows and not records:
        where = f"under --variant {args.variant}" if args.variant else "in the fused column (fused_path, plan)"
        raise cli.CliError(f"no usable rows: no row of {', '.join(args.bench)} has a positive time on the NCCL route "
                           f"{where}" + (", and no record has 2+ measured candidates" if args.records else ""))
    if not gpu and args.records:
        gpu = str(read_records(Path(args.records[0]))[0].get("gpu", ""))
    model = model_for(gpu)[0]
    grid = args.grid or (args.variant.split("/")[0] if args.variant else model.gemm.grid)
    refit = None
    if args.gemm:  # the sequential baseline's cuBLAS model first: the fused fit builds on its rate
        refit = fit_cublas(args.bench, model.gemm.sm_count, model.gemm.tile)
        model = dataclasses.replace(model, gemm=dataclasses.replace(
            model.gemm, peak_tflops=refit["peak_tflops"], launch_ms=refit["launch_ms"],
            wave_overhead_ms=refit["wave_overhead_ms"]))
        print(json.dumps({"cublas": refit}, indent=1))
    result = fit(model, rows, grid, records, tolerance=args.tolerance)
    print(json.dumps(result, indent=1))
    if not args.write:
        return 0

    def update(doc: dict[str, Any]) -> None:
        if refit is not None:
            doc["model"].update(refit)
            doc["model"]["note"] = (f"refitted by tune fit to the cuBLAS GEMM times of "
                                    f"{', '.join(Path(p).name for p in args.bench)} (minimax log error), all SMs")
        fused = doc["fused"]
        for key in ("grid", "nccl_sms", "kernel_efficiency", "gemm_slowdown", "comm_slowdown", "group_overhead_ms"):
            fused[key] = result[key]
        fused.pop("slowdown_note", None)
        fused["note"] = (f"fitted by tune fit to T_fused of the op benchmark ({grid} grid): GEMM rate "
                         f"(kernel_efficiency, relative to the cuBLAS model), GEMM slowdown per ms of "
                         f"concurrent NCCL, NCCL slowdown beside the GEMM, fixed cost per group")
        fused["fit"] = {"inputs": [Path(p).name for p in args.bench + args.records],
                        "variant": args.variant or "fused",
                        **{k: result[k] for k in ("median_rel_error", "mean_rel_error", "median_rel_error_before",
                                                  "rows", "records", "ranking_misses", "ranking_misses_before",
                                                  "tolerance") if k in result}}

    return write_section(gpu, update, "fused section")


def add_parser(sub: Any) -> None:
    fi = sub.add_parser("fit", help="fit the fused-path parameters of the cost model to bench_ops JSON (CPU)")
    fi.add_argument("--bench", nargs="*", default=[], metavar="FILE",
                    help="benchmark JSON files (examples/bench_ops.py --json FILE)")
    fi.add_argument("--records", nargs="*", default=[], metavar="FILE",
                    help="tune search --record files: fit the plan ranking first (see tune.fit.fit)")
    fi.add_argument("--tolerance", type=float, default=0.03,
                    help="a searched shape's predicted-best plan counts as a miss above this regret, a fraction of "
                    "the best time (default: %(default)s)")
    fi.add_argument("--variant", default=None, metavar="SPEC",
                    help="a --fused-variants entry of the benchmark, e.g. tiles/direct (default: the fused column)")
    fi.add_argument("--grid", choices=("persistent", "tiles"), default=None,
                    help="the GEMM grid the rows ran with (default: the variant's, else persistent)")
    fi.add_argument("--gemm", action="store_true",
                    help="also refit the cuBLAS model (peak rate, launch time) to the rows' T_gemm")
    fi.add_argument("--peer", action="store_true",
                    help="fit the peer route's model to the rows that ran on it (the peer section)")
    fi.add_argument("--ring", action="store_true",
                    help="fit the ring route's model to the rows of ring variants (the ring section; tune.fit_ring)")
    fi.add_argument("--sequential", action="store_true",
                    help="fit the sequential baseline's skew after its GEMM (sequential section; reads --bench only)")
    fi.add_argument("--host-floor", default="", metavar="OP=MS[,OP=MS]",
                    help="--peer / --ring: host_floor_ms per collective in ms, e.g. all_reduce=0.21,reduce_scatter="
                    "0.15 (default: the data file's)")
    fi.add_argument("--write", action="store_true", help="store the result in the GPU's GEMM model file")
