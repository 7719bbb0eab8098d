"""The one gain rule: whether a predicted (or measured) fused time pays against the sequential one.

Fuse iff the call has at least ``min_rows`` output rows (smaller GEMMs are latency-bound: the signals and the extra
launches cost more than they hide) and ``fused_ms <= (1 - min_gain) * seq_ms`` (``config.Settings.min_gain_fraction``:
a gain too small to trust the model with is no gain). Every verdict of the cost model and of the pass goes through
``verdict``, so the rule and its wording live here alone.
"""

from __future__ import annotations


def pays(fused_ms: float, seq_ms: float, min_gain: float) -> bool:
    """``fused_ms <= (1 - min_gain) * seq_ms`` (times in ms; ``min_gain`` a fraction in [0, 1))."""
    return fused_ms <= (1.0 - min_gain) * seq_ms


def verdict(fused_ms: float, seq_ms: float, rows: int, min_gain: float, min_rows: int,
            summary: str) -> tuple[bool, str]:
    """(fuse, reason): the rule of the module docstring; ``summary`` says what was predicted (it ends the reason)."""
    if rows < min_rows:
        return False, f"declined: M={rows} rows < min_rows={min_rows}; {summary}"
    if pays(fused_ms, seq_ms, min_gain):
        return True, summary
    return False, f"declined: gain below min_gain_fraction={min_gain:g}; {summary}"
