"""Rows, summary, table, chart and JSON of ``examples/bench_ops.py`` (no GPU needed: tests and ``tune fit`` read
these files on the CPU). Times in ms; speedups are ``T_seq / T``; a row is one (shape, op)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from flashoverlap_inductor.bench.output import _jsonable  # JSON-safe: non-finite floats -> null, keys -> str
from flashoverlap_inductor.runtime import kernel_select
from flashoverlap_inductor.tune import measure as tm
from flashoverlap_inductor.tune.rows import BENCH_RING_ROUNDS, route_of_launch

OPS = ("all_reduce", "reduce_scatter", "all_to_all")
TARGETS = {  # (world, op): geomean speedup over T_seq the issue asks for
    (4, "all_reduce"): 1.25, (4, "reduce_scatter"): 1.15, (4, "all_to_all"): 1.10, (2, "all_reduce"): 1.12,
}


# The peer route's settings in a spec's rows field, joined by "+": "wait" (peer_route.GATE), "cpull" / "cpush"
# (peer_route.PARTIAL).
PEER_ROWS = ("wait", "cpull", "cpush", *(f"ring{r}" for r in BENCH_RING_ROUNDS))  # ringR: the ring in <= R rounds


def _ran(relerr) -> bool:
    """Whether a variant's error was measured: a number, inf included (a NaN output), where a variant not run has
    NaN, or None once read back from JSON."""
    return relerr is not None and not math.isnan(relerr)


def parse_spec(spec: str) -> tuple[str, str, str, str, tuple[int, int | None] | None, str]:
    """``"<grid>/<nccl>[/<host>[/<kernel>[/<ctas>[/<rows>]]]]"`` -> (grid, nccl, host, kernel, (max_ctas, min_ctas)
    or None, rows); ``ctas`` is ``max`` or ``min-max``; ``rows`` the row order of reduce_scatter / all_to_all
    layouts (``schedule|stage|gather``, "" = the runtime's); see ``bench_ops.with_mode``. Raises ValueError on a
    malformed spec."""
    parts = spec.split("/")
    grid, mode, host, kernel, ctas, rows = (parts + [""] * 6)[:6]
    host = host or "c"
    bad_ctas = bool(ctas) and not ctas.replace("-", "", 1).isdigit()
    config, _, signal = kernel.partition("+")
    bad_kernel = ("@" in config and not config.partition("@")[2].isdigit()) or \
        ("+" in kernel and signal not in ("immediate", "deferred"))
    flags = rows.split("+")
    peer_rows = bool(rows) and set(flags) <= set(PEER_ROWS) and len(set(flags)) == len(flags) \
        and not {"cpull", "cpush"} <= set(flags) and sum(f.startswith("ring") for f in flags) <= 1
    bad_rows = (rows not in ("", "schedule", "stage", "gather") and not peer_rows) or (peer_rows and mode != "peer")
    bad_grid = grid not in kernel_select.GEMM_GRIDS
    if not 2 <= len(parts) <= 6 or bad_grid or mode not in ("direct", "torch", "peer") \
            or host not in ("c", "python", "gemm", "ce") or (host == "ce" and mode != "peer") \
            or bad_ctas or bad_kernel or bad_rows:
        raise ValueError(f"{spec!r} is not <persistent|tiles>/<direct|torch|peer>[/<c|python|gemm>[/<kernel>"
                         "[/<max_ctas>|<min_ctas>-<max_ctas>[/<schedule|stage|gather>]]]]; kernel = "
                         "[<configuration>][@<swizzle>][+<immediate|deferred>]; peer only: host ce, rows "
                         f"{'+'.join(PEER_ROWS)} (any of them)")
    lo, _, hi = ctas.rpartition("-")
    return grid, mode, host, kernel, (int(hi), int(lo) if lo else None) if ctas else None, rows


def is_diagnostic(spec: str) -> bool:
    """A fused variant whose output is not a result (host field ``gemm``: the fused GEMM without its collectives)."""
    return parse_spec(spec)[2] == "gemm"


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """Speedups over T_seq, overlap efficiency and cost-model errors of a row (in place; returned)."""
    seq = row["seq_ms"]
    row["speedup"] = tm.speedup(seq, row["fused_ms"])
    row["ideal_speedup"] = tm.speedup(seq, row["ideal_ms"])
    row["chunked_speedup"] = tm.speedup(seq, row["chunked_ms"])
    row["asynctp_speedup"] = tm.speedup(seq, row["asynctp_ms"])
    row["concurrent_speedup"] = tm.speedup(seq, row.get("concurrent_ms", math.nan))
    row["graph_speedup"] = tm.speedup(row.get("seq_graph_ms", math.nan), row.get("fused_graph_ms", math.nan))
    row["auto_speedup"] = tm.speedup(seq, row["auto_ms"])
    row["efficiency"] = tm.overlap_efficiency(seq, row["fused_ms"], row["ideal_ms"])
    # An error only where the prediction is of the route that ran (``launch`` says "peer route" / "ring route").
    ran = route_of_launch(row.get("launch", ""))
    ran = "pull" if ran == "push" else ran  # one model prices both pull-route schedules (cost_model/pull.py)
    same_route = row.get("fused_path") and row.get("pred_route", "nccl") == ran
    row["err_fused"] = tm.rel_error(row.get("pred_fused_ms"), row["fused_ms"]) if same_route else math.nan
    row["err_seq"] = tm.rel_error(row.get("pred_seq_ms"), seq)
    rel = row.get("relerr_fused", math.nan)
    row["correct"] = bool(rel <= 2e-2) if isinstance(rel, float) and not math.isnan(rel) else None
    return row


# --------------------------------------------------------------------------------------------- summary


def summarize(rows: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Per-op aggregates and the issue's target checks (each ``{"value", "target", "pass"}``)."""
    out: dict[str, Any] = {"world": world, "ops": {}, "checks": {}}
    for op in OPS:
        rs = [r for r in rows if r["op"] == op]
        if not rs:
            continue
        at = [r for r in rs if (r["m"], r["n"], r["k"]) == (8192, 8192, 8192)]
        agg = {
            "shapes": len(rs),
            "geomean_speedup": tm.geomean(r["speedup"] for r in rs),
            "min_speedup": min(tm.finite(r["speedup"] for r in rs), default=math.nan),
            "geomean_ideal_speedup": tm.geomean(r["ideal_speedup"] for r in rs),
            "geomean_chunked_speedup": tm.geomean(r["chunked_speedup"] for r in rs),
            "geomean_asynctp_speedup": tm.geomean(r["asynctp_speedup"] for r in rs),
            "geomean_auto_speedup": tm.geomean(r["auto_speedup"] for r in rs),
            "geomean_concurrent_speedup": tm.geomean(r.get("concurrent_speedup", math.nan) for r in rs),
            "geomean_graph_speedup": tm.geomean(r.get("graph_speedup", math.nan) for r in rs),
            "speedup_8192": at[0]["speedup"] if at else math.nan,
            "median_efficiency": tm.median(tm.finite(r["efficiency"] for r in rs)),
            "worst_auto_ratio": max(tm.finite(r["auto_ms"] / r["seq_ms"] for r in rs if r["seq_ms"] > 0),
                                    default=math.nan),
            "median_err_fused": tm.median(tm.finite(r["err_fused"] for r in rs)),
            "median_err_seq": tm.median(tm.finite(r["err_seq"] for r in rs)),
            "wrong": [f"{r['m']}x{r['n']}x{r['k']}" for r in rs if r["correct"] is False],
            "unfused": [f"{r['m']}x{r['n']}x{r['k']}" for r in rs if not r["fused_path"]],
        }
        specs = sorted({spec for r in rs for spec in r.get("variants", {})})
        agg["variants"] = {spec: {"geomean_speedup": tm.geomean(r["variants"][spec]["speedup"] for r in rs),
                                  "wrong": [f"{r['m']}x{r['n']}x{r['k']}" for r in rs  # where it ran
                                            if _ran(r["variants"][spec]["relerr"])
                                            and not r["variants"][spec]["relerr"] <= 2e-2
                                            and not is_diagnostic(spec)]}
                           for spec in specs}
        if op == "reduce_scatter":
            both = [r for r in rs if math.isfinite(r["asynctp_ms"]) and math.isfinite(r["fused_ms"])]
            agg["faster_than_asynctp"] = f"{sum(r['fused_ms'] < r['asynctp_ms'] for r in both)}/{len(both)}"
            agg["all_faster_than_asynctp"] = bool(both) and all(r["fused_ms"] < r["asynctp_ms"] for r in both)
        out["ops"][op] = agg
        target = TARGETS.get((world, op))
        if target is not None:
            out["checks"][f"{op} geomean speedup"] = _check(agg["geomean_speedup"], f">= {target}",
                                                            agg["geomean_speedup"] >= target)
        if world == 4 and op == "all_reduce" and at:
            out["checks"]["all_reduce 8192^3 speedup"] = _check(agg["speedup_8192"], ">= 1.35",
                                                                agg["speedup_8192"] >= 1.35)
        if world == 4 and op == "reduce_scatter" and "all_faster_than_asynctp" in agg:
            out["checks"]["reduce_scatter faster than async-TP"] = _check(agg["faster_than_asynctp"], "every shape",
                                                                          agg["all_faster_than_asynctp"])
        out["checks"][f"{op} auto never > 1.02 x T_seq"] = _check(agg["worst_auto_ratio"], "<= 1.02",
                                                                 agg["worst_auto_ratio"] <= 1.02)
        out["checks"][f"{op} results correct"] = _check(len(agg["wrong"]), "0 wrong", not agg["wrong"])
    errs = tm.finite(r["err_fused"] for r in rows)
    out["median_err_fused"] = tm.median(errs)
    out["checks"]["cost model median |pred-meas|/meas"] = _check(out["median_err_fused"], "<= 0.10",
                                                                 out["median_err_fused"] <= 0.10)
    return out


def _check(value: Any, target: str, ok: bool) -> dict[str, Any]:
    return {"value": value, "target": target, "pass": bool(ok)}


def _f(x: Any, fmt: str = "7.3f") -> str:
    """``x`` formatted, or a right-aligned "-" of the same width for missing values."""
    if isinstance(x, (int, float)) and math.isfinite(x):
        return format(x, fmt)
    return "-".rjust(int(fmt.split(".")[0]))


def format_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The printed report: one table per op, then the aggregates and target checks."""
    lines = []
    head = (f"{'shape':>18} {'gemm':>7} {'comm':>7} {'seq':>7} {'chunk':>7} {'asyTP':>7} {'fused':>7} {'ideal':>7} "
            f"{'spd':>6} {'ideal':>6} {'eff':>6} {'pred':>7} {'err':>6} {'auto':>7} {'G':>3} note")
    for op in OPS:
        rs = [r for r in rows if r["op"] == op]
        if not rs:
            continue
        lines.append(f"== {op} (world {rs[0]['world']}; times in ms, max over ranks of medians)")
        lines.append(head)
        for r in rs:
            note = ([] if "peer route" not in r.get("launch", "") else ["peer"]) if r["fused_path"] \
                else ["UNFUSED " + ",".join(r["fallback"])]
            if r["correct"] is False:
                note.append(f"WRONG relerr={r['relerr_fused']:.3g}")
            note += [f"{key}: {v[:60]}" for key, v in r["errors"].items()]
            lines.append(f"{r['m']:>6}x{r['n']:>5}x{r['k']:>5} {_f(r['gemm_ms'])} {_f(r['comm_ms'])} "
                         f"{_f(r['seq_ms'])} {_f(r['chunked_ms'])} {_f(r['asynctp_ms'])} {_f(r['fused_ms'])} "
                         f"{_f(r['ideal_ms'])} {_f(r['speedup'], '6.3f')} {_f(r['ideal_speedup'], '6.3f')} "
                         f"{_f(r['efficiency'], '6.2f')} {_f(r['pred_fused_ms'])} {_f(r['err_fused'], '6.1%')} "
                         f"{_f(r['auto_ms'])} {r['groups']:>3} {'; '.join(note)}")
        agg = summary["ops"][op]
        for spec in sorted(rs[0].get("variants", {})):
            lines.append(f"   variant {spec:18s}: " + " ".join(
                f"{_f(r['variants'][spec]['ms'])}" for r in rs) + f" | geomean speedup "
                f"{agg['variants'][spec]['geomean_speedup']:.3f} wrong {agg['variants'][spec]['wrong']}")
        lines.append(f"   geomean speedup {agg['geomean_speedup']:.3f} (ideal {agg['geomean_ideal_speedup']:.3f}, "
                     f"chunked {agg['geomean_chunked_speedup']:.3f}, async-TP {agg['geomean_asynctp_speedup']:.3f}, "
                     f"auto {agg['geomean_auto_speedup']:.3f}, GEMM || comm "
                     f"{agg['geomean_concurrent_speedup']:.3f}, graphs fused/seq "
                     f"{agg['geomean_graph_speedup']:.3f}); "
                     f"min {agg['min_speedup']:.3f}; worst auto/seq {agg['worst_auto_ratio']:.3f}; cost model "
                     f"median err fused {agg['median_err_fused']:.1%} seq {agg['median_err_seq']:.1%}")
    lines.append("== target checks")
    for name, c in summary["checks"].items():
        value = f"{c['value']:.3f}" if isinstance(c["value"], float) else str(c["value"])
        lines.append(f"   [{'PASS' if c['pass'] else 'FAIL'}] {name}: {value} (target {c['target']})")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, world: int) -> str:
    """Speedup over T_seq per shape and op (fused, chunked, async-TP bars; the ideal as a marker)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no PNG: {exc}"
    ops_here = [op for op in OPS if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(len(ops_here), 1, figsize=(14, 3.6 * len(ops_here)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops_here, strict=True):
        rs = [r for r in rows if r["op"] == op]
        x = list(range(len(rs)))
        series = [("fused", "speedup", "tab:blue"), ("chunked (best of 2/4/8)", "chunked_speedup", "tab:gray")]
        if op == "reduce_scatter":
            series.append(("async-TP", "asynctp_speedup", "tab:orange"))
        width = 0.8 / len(series)
        for i, (label, key, color) in enumerate(series):
            ax.bar([v + (i - (len(series) - 1) / 2) * width for v in x],
                   [r[key] if math.isfinite(r[key]) else 0 for r in rs], width, label=label, color=color)
        ax.scatter(x, [r["ideal_speedup"] for r in rs], marker="_", s=400, color="black", label="ideal", zorder=3)
        ax.scatter(x, [r["auto_speedup"] for r in rs], marker=".", s=60, color="tab:green", label="auto", zorder=3)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, [f"{r['m']}x{r['n']}x{r['k']}" for r in rs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup over T_seq")
        ax.set_title(f"GEMM + {op}, {world} GPUs")
        ax.legend(fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


def write_json(path: str | None, meta: dict[str, Any], rows: list[dict[str, Any]], world: int) -> dict[str, Any]:
    summary = summarize(rows, world)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(_jsonable({"meta": meta, "rows": rows, "summary": summary}), indent=1))
    return summary
