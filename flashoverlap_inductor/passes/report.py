"""Logging and counters of the FlashOverlap pass: the one record of what the pass fused or skipped, and why.

Logger ``flashoverlap``: INFO for every fused match and every skipped match (with its reason), DEBUG for
near-misses that are not GEMM -> collective pairs at all. Counters (a ``collections.Counter``, never rebound, so
``flashoverlap_inductor.passes.counters`` stays the live object): ``fused:<collective>`` per rewrite and
``skip:<slug>`` per skipped match (``skip:fuse_never`` once per graph under fuse mode "never").
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("flashoverlap")

counters: Counter[str] = Counter()

# Every skip slug the pass can emit, with what it means (the reason string in the log adds the specifics).
SKIP_REASONS = {
    "fuse_never": "fuse mode is 'never' (counted once per graph)",
    "collective_disabled": "the collective is not in config.collectives",
    "multiple_users": "a node on the GEMM -> collective chain has another user",
    "unused_result": "the collective's result is never used",
    "reduce_op": "the reduction is not a sum",
    "dtype": "the GEMM output dtype is not in config.dtypes",
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
    "internal_error": "the checks raised (a bug in the pass; logged with its traceback)",
}


def reset_counters() -> None:
    """Clear all counters (in place)."""
    counters.clear()


def record_fused(collective: str, msg: str, *args: object) -> None:
    counters[f"fused:{collective}"] += 1
    log.info("flashoverlap: fused " + msg, *args)


def record_skip(slug: str, msg: str, *args: object, level: int = logging.INFO, exc_info: bool = False) -> None:
    """Count ``skip:<slug>`` and log ``msg`` (``slug`` must be one of ``SKIP_REASONS``)."""
    if slug not in SKIP_REASONS:
        raise KeyError(f"unknown skip reason {slug!r}")
    counters[f"skip:{slug}"] += 1
    log.log(level, f"flashoverlap: skip:{slug}: " + msg, *args, exc_info=exc_info)
