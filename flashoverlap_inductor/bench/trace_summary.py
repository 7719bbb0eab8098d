"""Where a traced step's time goes, from a Chrome trace of ``torch.profiler`` (``bench e2e --trace DIR`` writes one
per case, backend and rank, and prints this summary of rank 0's under the table): the traced span (first to last
event, the profiler's own whole-window event left out), the GPU's busy time (the union of its kernel and copy
intervals over all streams) and the host thread's time inside each fused op (``flashoverlap::*`` CPU ops: the
durations of the op's host calls, its waits included: a host sync or a blocking collective inside the op counts). A
step whose GPU idles for much of its span is host-bound: there a fused op's host time costs the step as much as its
overlap saves, and CUDA graphs (the ``-ro`` backends, ``mode="reduce-overhead"``) take that time away. Caveats: the
profiler inflates host times; a communication kernel that spins while it waits for a peer counts as busy, so the
busy share overstates the GPU's useful work.

    python -m flashoverlap_inductor.bench.trace_summary DIR/*.json

It also lists where the GPU idled (``idle_gaps``): each gap of >= 20 us charged to what the host was doing when it
began (the innermost CPU op and CUDA runtime call), the largest totals first, and how much of the communication ran
beside compute (``trace_overlap``: exposed communication, kernel time per class); and, for each case whose traces of
every rank are given (``<case>_rank<r>.json``), how long each rank's communication waited for a later rank
(``trace_skew``): exposed communication that is really another rank arriving late.
"""

from __future__ import annotations

import bisect
import json
import sys
from collections import defaultdict
from typing import Any

from . import trace_overlap


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start_us, end_us)`` intervals, in ms."""
    return trace_overlap.length(trace_overlap.union(intervals)) / 1e3


def summarize(path: str) -> dict[str, Any]:
    """``{"span_ms", "gpu_busy_ms", "fused": {op: [calls, host_ms]}, "overlap": trace_overlap.overlap(...)}`` of the
    trace at ``path`` (span 0 when it has no complete events)."""
    with open(path) as f:  # "Trace": the profiler's event spanning its whole window (not a step's work)
        events = [e for e in json.load(f).get("traceEvents", [])
                  if e.get("ph") == "X" and "dur" in e and e.get("cat") != "Trace"]
    if not events:
        return {"span_ms": 0.0, "gpu_busy_ms": 0.0, "fused": {}}
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    gpu = [e for e in events if e.get("cat") in trace_overlap.GPU_CATEGORIES]
    busy = busy_ms([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    fused: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cpu_op" and e["name"].startswith("flashoverlap::"):
            fused[e["name"].removeprefix("flashoverlap::")][0] += 1
            fused[e["name"].removeprefix("flashoverlap::")][1] += e["dur"] / 1e3
    return {"span_ms": round(span, 4), "gpu_busy_ms": round(busy, 4),
            "fused": {k: [n, round(ms, 4)] for k, (n, ms) in sorted(fused.items(), key=lambda kv: -kv[1][1])},
            "overlap": trace_overlap.overlap(gpu)}


def describe(s: dict[str, Any]) -> str:
    """``summarize``'s result: a line of span, GPU busy share and host time per fused op, then
    ``trace_overlap.describe``'s lines."""
    span, busy = s["span_ms"], s["gpu_busy_ms"]
    if span <= 0:
        return "no events"
    text = f"span {span:.3f} ms, GPU busy {busy:.3f} ms ({busy / span:.0%}), idle {span - busy:.3f} ms"
    ops = [f"{op} {n} x {ms / n:.3f} ms" for op, (n, ms) in s["fused"].items() if n]
    text += "; host thread in fused ops (waits included): " + ", ".join(ops) if ops else ""
    return text + ("\n    GPU: " + trace_overlap.describe(s["overlap"]) if s.get("overlap") else "")


def idle_gaps(path: str, min_us: float = 20.0, top: int = 12) -> list[tuple[str, int, float]]:
    """Where the GPU idles in the trace at ``path``: every gap of at least ``min_us`` between the union of its kernel
    and copy intervals, charged to the host's innermost CPU op (``cpu_op``) and CUDA runtime call (``cuda_runtime``,
    e.g. a ``cudaStreamSynchronize``) running on the host when the gap began. Returns ``(what, gaps, ms)``, the
    ``top`` largest by total ms; ``what`` is ``op | runtime call`` (``-`` where none ran)."""
    with open(path) as f:
        events = [e for e in json.load(f).get("traceEvents", [])
                  if e.get("ph") == "X" and "dur" in e and e.get("cat") != "Trace"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in trace_overlap.GPU_CATEGORIES)
    gaps, end = [], None
    for s, e in gpu:
        if end is not None and s - end >= min_us:
            gaps.append((end, s))
        end = e if end is None else max(end, e)

    by_cat = {cat: sorted((e for e in events if e.get("cat") == cat), key=lambda e: e["ts"])
              for cat in ("cpu_op", "cuda_runtime")}
    starts = {cat: [e["ts"] for e in evs] for cat, evs in by_cat.items()}

    def innermost(cat: str, t: float) -> str:
        """The latest-starting ``cat`` event that covers ``t`` (the innermost of nested ones)."""
        evs, i = by_cat[cat], bisect.bisect_right(starts[cat], t)
        for e in reversed(evs[max(0, i - 4000):i]):
            if e["ts"] + e["dur"] > t:
                return e["name"]
        return "-"

    charged: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for s, e in gaps:
        key = f"{innermost('cpu_op', s)} | {innermost('cuda_runtime', s)}"
        charged[key][0] += 1
        charged[key][1] += (e - s) / 1e3
    ranked = sorted(charged.items(), key=lambda kv: -kv[1][1])[:top]
    return [(what, n, round(ms, 4)) for what, (n, ms) in ranked]


if __name__ == "__main__":
    from . import trace_skew

    for p in sys.argv[1:]:
        print(f"{p}: {describe(summarize(p))}")
        for what, n, ms in idle_gaps(p):
            print(f"  GPU idle {ms:.3f} ms in {n} gap(s) while the host ran {what}")
    for case, group in trace_skew.rank_groups(sys.argv[1:]).items():
        try:
            print(f"{case}: {trace_skew.describe(trace_skew.skew(group))}")
        except ValueError as exc:  # a trace without its clock base: no skew for this case
            print(f"{case}: rank skew not computed: {exc}")
