"""``fusion_report()``: what the backend fused when it compiled (per graph, cached graphs included) and what the
fused ops actually ran, as data.

Compile time (``passes.report``): per compiled graph, each fused collective (``fused`` when the plan was decided at
compile time, ``per_call`` when the op decides at each call because sizes are symbolic), each skipped match with
its reason, each near miss (a GEMM feeding a collective through an op the pass does not see through). A graph served
from Inductor's FX-graph or AOTAutograd cache reports what the pass did when it was compiled.

Run time (``routes.stats``): per call of a fused op, the route that ran it (``route:<name>``: peer, ring, nccl on a
GPU; cpu), or the reason it ran unfused (``fallback:<reason>``); ``fused:<collective>`` counts calls that ran fused
on a GPU route.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class FusionReport:
    """A snapshot. ``graphs``: one ``passes.report.GraphReport`` per compiled graph, oldest first. ``compile``:
    the compile-time counters summed over them (``fused:<collective>``, ``per_call:<collective>``,
    ``skip:<reason>``, ``near_miss:<op>``, ``rewrite:tp_sequence``). ``runtime``: the run-time counters (see the
    module docstring)."""

    graphs: list = field(default_factory=list)
    compile: dict[str, int] = field(default_factory=dict)
    runtime: dict[str, int] = field(default_factory=dict)

    def skip_reasons(self) -> dict[str, list[str]]:
        """Every skip and near miss, by counter, with the detail line of each."""
        out: dict[str, list[str]] = {}
        for g in self.graphs:
            for counter, details in g.events.items():
                if counter.startswith(("skip:", "near_miss:")):
                    out.setdefault(counter, []).extend(details)
        return out

    def __str__(self) -> str:
        lines = [f"flashoverlap: {len(self.graphs)} graph(s)"]
        lines += [f"  {g.summary()}" for g in self.graphs]
        ran = Counter({k: v for k, v in self.runtime.items() if k.startswith(("route:", "fallback:"))})
        lines.append("  calls: " + (", ".join(f"{k} {v}" for k, v in sorted(ran.items())) or "none yet"))
        return "\n".join(lines)


def fusion_report() -> FusionReport:
    """The report so far (this process)."""
    from .passes import report
    from .routes import stats

    with report._lock:
        graphs = list(report.graphs)
        compiled = dict(report.counters)
    return FusionReport(graphs, compiled, dict(stats))


def reset_fusion_report() -> None:
    """Forget the graph reports and both counters (the compiled graphs and their fused ops are untouched)."""
    from .passes import report
    from .routes import stats

    report.reset_counters()
    stats.clear()
