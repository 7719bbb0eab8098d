"""Which rank a traced step's collectives waited for, from the traces of every rank of one traced case (``bench e2e
--trace DIR`` writes one per case, backend and rank; ``trace_summary`` prints this under each case's lines).

A communication kernel that starts before its peers have come spins until they do, and ``trace_overlap`` counts that
spin as the step's exposed communication: a rank whose host falls behind (a host-bound stretch, a slower core) shows
up as exposed communication on the *other* ranks. This module separates the two. The ranks' traces carry one clock
(``baseTimeNanoseconds`` + ``ts``: Kineto's absolute time; the ranks of one host share it). Per full kernel name of
the communication classes (``trace_overlap.COMM_CLASSES``: NCCL kernels, our protocol kernels, peer copies), the
i-th such kernel of every rank is taken to be one collective step (every rank issues its collectives in one order);
names whose counts differ between ranks are left out and named (``unmatched``); copies are left out too (a copy's
own time is never waiting, and local copies are no steps between ranks). For each matched step, the latest start
among the ranks is when the last rank came; each other rank's kernel time before that instant is waiting, charged
to that last rank. The traces' windows must cover the same steps (the e2e harness syncs the ranks around them).

Result (ms over the traced steps): ``waited_ms[r]`` (rank r's GPU waited for later ranks), ``late_ms[r]`` (the other
ranks' GPUs waited for rank r), ``by_kernel`` (waiting per short kernel name and rank, the largest first), the
matched step count. A rank with a large ``late_ms`` is the one to profile (its host: ``trace_summary.idle_gaps``).

    python -m flashoverlap_inductor.bench.trace_summary DIR/*.json   # groups the ranks of each case
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from . import trace_overlap

RANK_SUFFIX = re.compile(r"_rank(\d+)(\.json)$")


def comm_kernels(path: str) -> tuple[int, dict[str, list[tuple[float, float]]]]:
    """``(base_ns, kernels)`` of the trace at ``path``: its ``baseTimeNanoseconds`` (the clock its ``ts`` count from;
    ValueError where it has none: its times could not be set beside another rank's) and its communication events
    by full name, ``(start_us, end_us)`` in its own ``ts``, in start order (copies included)."""
    with open(path) as f:
        doc = json.load(f)
    if "baseTimeNanoseconds" not in doc:
        raise ValueError(f"{path}: no baseTimeNanoseconds, so its times cannot be set beside another trace's")
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in doc.get("traceEvents", []):
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in trace_overlap.GPU_CATEGORIES and \
                trace_overlap.classify(e.get("name", ""), e["cat"]) in trace_overlap.COMM_CLASSES:
            out[e["name"]].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    for spans in out.values():
        spans.sort()
    return int(doc["baseTimeNanoseconds"]), dict(out)


def skew(paths: list[str], top: int = 6) -> dict[str, Any]:
    """The waiting of the ranks whose traces are ``paths`` (index = position in ``paths``; module docstring)."""
    ranks = len(paths)
    loaded = [comm_kernels(p) for p in paths]
    first = min(base for base, _ in loaded)  # the bases' differences in integer ns first: us-exact at 1e15 us
    per = [{name: [(s + (base - first) / 1e3, e + (base - first) / 1e3) for s, e in spans]
            for name, spans in kernels.items()} for base, kernels in loaded]
    waited, late = [0.0] * ranks, [0.0] * ranks
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0] * ranks)
    matched, unmatched = 0, []
    for name in sorted(set().union(*per)):
        lists = [k.get(name, []) for k in per]
        if len({len(x) for x in lists}) != 1:
            unmatched.append(name)
            continue
        copy = trace_overlap.classify(name, "kernel") == "copy"
        if copy:  # a copy's own time is never waiting (and local copies are not steps between ranks)
            continue
        for i in range(len(lists[0])):
            matched += 1
            starts = [x[i][0] for x in lists]
            last = max(range(ranks), key=lambda r: starts[r])
            for r in range(ranks):
                start, end = lists[r][i]
                wait = 0.0 if copy or r == last else max(0.0, min(end, starts[last]) - start) / 1e3
                waited[r] += wait
                late[last] += wait
                by_kernel[trace_overlap.short_name(name)][r] += wait
    ranked = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"ranks": ranks, "matched": matched, "waited_ms": [round(x, 4) for x in waited],
            "late_ms": [round(x, 4) for x in late],
            "by_kernel": [(k, [round(x, 4) for x in v]) for k, v in ranked if sum(v) > 0],
            "unmatched": sorted({trace_overlap.short_name(n) for n in unmatched})}


def describe(s: dict[str, Any]) -> str:
    """``skew``'s result in one line per rank."""
    lines = [f"rank skew over {s['matched']} matched communication step(s)"
             + (f" ({len(s['unmatched'])} kernel name(s) unmatched)" if s["unmatched"] else "") + ":"]
    for r in range(s["ranks"]):
        parts = [f"{k} {v[r]:.3f}" for k, v in s["by_kernel"] if v[r] > 0]
        lines.append(f"  rank {r} waited {s['waited_ms'][r]:.3f} ms for later ranks"
                     + (f" ({', '.join(parts)})" if parts else "") + f"; others waited {s['late_ms'][r]:.3f} ms for it")
    return "\n".join(lines)


def rank_groups(paths: list[str]) -> dict[str, list[str]]:
    """``paths`` of traces named ``<case>_rank<r>.json`` grouped by case, each group's paths in rank order; a case
    with one rank's trace only is left out (nothing to compare)."""
    groups: dict[str, dict[int, str]] = defaultdict(dict)
    for p in paths:
        m = RANK_SUFFIX.search(p)
        if m:
            groups[p[:m.start()]][int(m.group(1))] = p
    return {case: [by_rank[r] for r in sorted(by_rank)] for case, by_rank in groups.items()
            if len(by_rank) > 1 and sorted(by_rank) == list(range(len(by_rank)))}
