"""What the FlashOverlap pass fused, deferred and skipped, and why: one record that survives Inductor's caches.

Every event of the pass goes through ``record`` (``record_fused`` / ``record_deferred`` / ``record_skip`` /
``record_near_miss``), which writes it three ways:

1. the live ``counters`` (a ``collections.Counter``, never rebound, so ``flashoverlap_inductor.passes.counters``
   stays the live object): ``fused:<collective>`` per rewrite decided at compile time, ``per_call:<collective>``
   per rewrite whose plan is decided at each call (symbolic sizes: the call may still run unfused; the run-time
   counters say what ran), ``skip:<slug>`` per match left alone (``SKIP_REASONS``), ``near_miss:<op>`` per
   collective fed by a GEMM through an op the pass does not see through; ``rewrite:<name>`` per collective a
   graph rewrite before the fusions replaced (``tp_sequence``: an all_reduce made reduce_scatter + all_gather);
2. Inductor's ``counters["inductor"]``, under ``flashoverlap|<counter>|<detail>``. Inductor stores what a
   compilation added there with the compiled graph and adds it again on every FX-graph or AOTAutograd cache hit,
   so a graph served from a cache reports what the pass did when it was compiled;
3. the logger ``flashoverlap`` (``TORCH_LOGS="flashoverlap"``): INFO for each event, DEBUG for collectives with
   no GEMM in reach.

``GraphWatch`` (the backend wraps each graph's compilation in one) turns those Inductor counts into one
``GraphReport`` per compiled graph, fresh or cached, logs its one-line INFO summary, and adds to ``counters`` what a
cache hit replayed. ``flashoverlap_inductor.fusion_report()`` returns them with the run-time counters.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from flashoverlap_inductor import _inductor_compat as compat

log = logging.getLogger("flashoverlap")
compat.register_log_name("flashoverlap")  # torch._logging.set_logs(flashoverlap=logging.INFO) works too

counters: Counter[str] = Counter()

KEY_PREFIX = "flashoverlap|"  # keys of our events in Inductor's counters: flashoverlap|<counter>|<detail>
MAX_GRAPHS = 1000  # graph reports kept (oldest dropped first)

# Every skip slug the pass can emit, with what it means (the reason string in the log adds the specifics).
SKIP_REASONS = {
    "fuse_never": "fuse mode is 'never' (counted once per graph)",
    "collective_disabled": "the collective is not in config.collectives",
    "multiple_users": "a node on the GEMM -> collective chain has another user",
    "unused_result": "the collective's result is never used",
    "reduce_op": "the reduction is not a sum",
    "dtype": "the GEMM output dtype is not in config.dtypes",
    "dtype_mismatch": "the GEMM's operands, or the collective's result, differ in dtype from the GEMM's output",
    "addmm_scale": "addmm with beta/alpha != 1",
    "view_shape": "the views are not a pure row flatten/unflatten of the GEMM output",
    "scatter_dim": "reduce_scatter along a dim the fused op cannot express",
    "bias_shape": "the bias varies along the rows that the rewrite reorders",
    "indivisible": "rows do not divide by the group size",
    "unknown_group": "the process group of the collective cannot be resolved",
    "no_meta": "a node lacks meta['val'] (shapes unknown)",
    "shape_mismatch": "the rewrite would not reproduce the collective's output shape (internal check)",
    "too_small": "under 'auto': fewer GEMM output rows than config.min_rows",
    "cost_model": "under 'auto': the cost model predicts no gain",
    "cost_model_error": "under 'auto': the cost model failed",
    "all_to_all_auto": "under 'auto': all_to_all is fused only under 'always' (ranks may hold different rows, so a "
                       "per-rank verdict could differ between ranks)",
    "no_gemm_consumer": "all_gather: no GEMM reads the gathered rows (as the A operand of mm/addmm)",
    "gemm_taken": "all_gather: the GEMM reading the gathered rows is already fused with the collective after it (one "
                  "GEMM between two collectives: one of them fuses)",
    "row_subset": "all_gather: the GEMMs read only a slice of the gathered rows (lm_head's last position in "
                  "prefill): too small a GEMM to hide the gather",
    "weight_reads_gathered": "all_gather: a GEMM's weight or bias is computed from the gathered rows",
    "inputs_after_use": "all_gather: a GEMM's weight is computed after the gathered rows are first used, by ops "
                        "that cannot move",
    "combine_auto": "MoE combine, under 'auto': the group's verdict for the op declines it (the cost model at the "
                    "rows of the compilation that first decided it, agreed through the group's store; the message "
                    "says which rows and whether this rank's own verdict differs)",
    "combine_gemm": "MoE combine: the experts' GEMM is not plain mm pieces of a row cat, nor torch._grouped_mm terms "
                    "sharing one int32 offsets tensor (a bias, another output dtype, batched GEMMs)",
    "combine_base": "MoE combine: the un-permutation writes into something other than a fresh empty or zero-filled "
                    "[rows, N] buffer",
    "combine_index": "MoE combine: the un-permutation is not one 1-D integer index along dim 0",
    "dispatch_auto": "MoE dispatch, under 'auto': the group's verdict for the op declines it (as for combine_auto)",
    "dispatch_gemm": "MoE dispatch: the experts' GEMMs are not plain mm of row pieces, nor torch._grouped_mm terms "
                     "sharing one int32 offsets tensor (a bias, another output dtype, batched GEMMs, mixed forms)",
    "dispatch_pieces": "MoE dispatch: the permuted rows are not cut into consecutive row pieces from row 0, each "
                       "feeding one GEMM",
    "dispatch_index": "MoE dispatch: the permutation is not one 1-D integer index along dim 0",
    "internal_error": "the checks raised (a bug in the pass; logged with its traceback)",
}

_lock = threading.Lock()
_journal: Counter[str] = Counter()  # the Inductor keys this process's pass recorded itself (not replayed)


def reset_counters() -> None:
    """Clear the compile-time counters (in place) and the graph reports."""
    with _lock:
        counters.clear()
        graphs.clear()


def record(counter: str, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
    """One event: ``counters[counter] += 1``, the same under Inductor's replayed counters, and a log line."""
    detail = (msg % args) if args else msg
    key = f"{KEY_PREFIX}{counter}|{detail}"
    with _lock:
        counters[counter] += 1
        _journal[key] += 1
        compat.inductor_counters()[key] += 1
    log.log(level, "flashoverlap: %s: %s", counter, detail, exc_info=exc_info)


def record_fused(collective: str, msg: str, *args: object) -> None:
    record(f"fused:{collective}", logging.INFO, msg, *args)


def record_deferred(collective: str, msg: str, *args: object) -> None:
    """A rewrite whose plan is "auto": the op decides at each call whether it runs fused."""
    record(f"per_call:{collective}", logging.INFO, msg, *args)


def record_rewrite(name: str, msg: str, *args: object) -> None:
    """A collective that the graph rewrite ``name`` replaced before the fusions (e.g. ``tp_sequence``)."""
    record(f"rewrite:{name}", logging.INFO, msg, *args)


def record_skip(slug: str, msg: str, *args: object, level: int = logging.INFO, exc_info: bool = False) -> None:
    """Count ``skip:<slug>`` and log ``msg`` (``slug`` must be one of ``SKIP_REASONS``)."""
    if slug not in SKIP_REASONS:
        raise KeyError(f"unknown skip reason {slug!r}")
    record(f"skip:{slug}", level, msg, *args, exc_info=exc_info)


def record_near_miss(op: str, msg: str, *args: object) -> None:
    """A collective fed by a GEMM through ``op``, which the pass does not see through (INFO: users ask why)."""
    record(f"near_miss:{op}", logging.INFO, msg, *args)


# ---------------------------------------------------------------------------------------------- per graph


@dataclass
class GraphReport:
    """What the pass did to one compiled graph. ``source``: "compiled" (the pass ran now) or "cache" (served from
    Inductor's FX-graph or AOTAutograd cache: the counts recorded when it was compiled). ``events``: counter ->
    the detail line of each event."""

    kind: str  # "forward" | "backward" | "inference" | "cached" (graphs the AOTAutograd cache served at once)
    source: str
    events: dict[str, list[str]] = field(default_factory=dict)

    def count(self, prefix: str) -> Counter[str]:
        """Counts of the events whose counter starts with ``prefix`` (e.g. "skip:"), keyed by the rest."""
        return Counter({k.removeprefix(prefix): len(v) for k, v in self.events.items() if k.startswith(prefix)})

    def summary(self) -> str:
        parts = []
        for prefix, label in (("rewrite:", "rewritten first"), ("fused:", "fused"), ("per_call:", "fused, decided "
                              "per call"), ("skip:", "skipped"), ("near_miss:", "near misses")):
            c = self.count(prefix)
            if c:
                parts.append(f"{label} {sum(c.values())} ({', '.join(f'{k} {n}' for k, n in sorted(c.items()))})")
        what = "; ".join(parts) or "no GEMM -> collective candidates"
        if self.kind == "cached":
            return f"graphs from the AOTAutograd cache (as compiled then): {what}"
        return f"{self.kind} graph ({'from cache, as compiled then' if self.source == 'cache' else 'compiled'}): {what}"


graphs: collections.deque[GraphReport] = collections.deque(maxlen=MAX_GRAPHS)
_claimed = threading.local()  # per thread: the Inductor deltas inner windows already reported (``GraphWatch``)


def _ours(c: Counter[str]) -> Counter[str]:
    return Counter({k: n for k, n in c.items() if k.startswith(KEY_PREFIX)})


class GraphWatch:
    """Around the compilation (or cache load) of graphs: reports what the pass did to them (``GraphReport``).

    ``inner=True`` wraps one graph (Inductor's ``inner_compile``: a forward, backward or inference graph, compiled
    or from the FX-graph cache). The outer watch (around ``compile_fx``) reports only what no inner watch claimed:
    graphs the AOTAutograd cache served without calling ``inner_compile``."""

    def __init__(self, kind: str, inner: bool) -> None:
        self.kind, self.inner = kind, inner

    def __enter__(self) -> GraphWatch:
        self.start = _ours(compat.inductor_counters())
        self.start_hits = compat.inductor_counters()["fxgraph_cache_hit"]
        self.start_journal = Counter(_journal)
        if not hasattr(_claimed, "stack"):
            _claimed.stack = []
        _claimed.stack.append(Counter())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        claimed = _claimed.stack.pop()
        if exc_type is not None:
            return
        delta = _ours(compat.inductor_counters()) - self.start
        if _claimed.stack:  # an outer watch: these are reported here
            _claimed.stack[-1].update(delta)
        delta -= claimed
        if not delta and not self.inner:
            return
        live = Counter(_journal) - self.start_journal
        replayed = delta - live
        events: dict[str, list[str]] = {}
        for key, n in sorted(delta.items()):
            counter, detail = key[len(KEY_PREFIX):].split("|", 1)
            events.setdefault(counter, []).extend([detail] * n)
        with _lock:
            for key, n in replayed.items():  # a cache hit: the pass did not run, Inductor replayed its counts
                counters[key[len(KEY_PREFIX):].split("|", 1)[0]] += n
            hit = compat.inductor_counters()["fxgraph_cache_hit"] > self.start_hits
            report = GraphReport(self.kind, "cache" if replayed or hit or not self.inner else "compiled", events)
            graphs.append(report)
        log.info("flashoverlap: %s", report.summary())
