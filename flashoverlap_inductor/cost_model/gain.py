"""The one gain rule: whether a predicted (or measured) fused time pays against the sequential one.

Fuse iff the call has at least ``min_rows`` output rows (smaller GEMMs are latency-bound: the signals and the extra
launches cost more than they hide) and ``fused_ms <= (1 - min_gain) * seq_ms`` (``config.Settings.min_gain_fraction``:
a gain too small to trust the model with is no gain). Every verdict of the cost model and of the pass goes through
``verdict``, so the rule and its wording live here alone.

A time known to err more asks for more: ``model_error`` gives the extra gain a verdict must show, per collective on
the NCCL (wave-group) route: the model's measured error for a prediction, the spread between runs for a tuned plan's
measured times.
"""

from __future__ import annotations

# Median |predicted - measured| / measured of the NCCL route's fused time, per collective, where it exceeds the
# others': all_to_all 6.7% on the GPU of the data (five 2-GPU H200 runs, two sessions; all_reduce 1.4%,
# reduce_scatter 4.7%, covered by min_gain_fraction), and 9.0% on another GPU's (the H200 data on 2 H100s, 16-shape
# grid, 21st session: every all_to_all that auto fused on a prediction of <= 0.95x ran 0.96-1.10x of sequential).
_NCCL_ROUTE_ERROR = {"all_to_all": 0.067}
# The spread of a tuned plan's measured all_to_all gain between runs: 4096x8192x7168 on 2 H200s gave 1.03x in the
# tuning run, 0.96x and 0.975x in two later ones. With 0.03 (6% in all), the 21st session's H200 grid fuses 7 of 16
# shapes, each faster than sequential (worst 0.978x; without it 9, worst 1.025x).
_NCCL_ROUTE_SPREAD = {"all_to_all": 0.03}
FOREIGN_DATA_FACTOR = 2.0  # the allowance on another GPU's data (a fallback match: not this GPU nor its family)


def model_error(collective: str, route: str | None, exact_data: bool, measured: bool = False) -> float:
    """The extra gain fraction a fused time must show for ``collective`` on ``route`` (None or "nccl": the wave-group
    route; the peer, ring and gather routes' models err <= 2.2% and need none): the route's median prediction error,
    or for a tuned plan's measured times (``measured``) their spread between runs; doubled when the data is another
    GPU's (``exact_data`` False)."""
    if route not in (None, "nccl"):
        return 0.0
    err = (_NCCL_ROUTE_SPREAD if measured else _NCCL_ROUTE_ERROR).get(collective, 0.0)
    return err if exact_data else FOREIGN_DATA_FACTOR * err


def pays(fused_ms: float, seq_ms: float, min_gain: float) -> bool:
    """``fused_ms <= (1 - min_gain) * seq_ms`` (times in ms; ``min_gain`` a fraction in [0, 1))."""
    return fused_ms <= (1.0 - min_gain) * seq_ms


def verdict(fused_ms: float, seq_ms: float, rows: int, min_gain: float, min_rows: int,
            summary: str, error: float = 0.0) -> tuple[bool, str]:
    """(fuse, reason): the rule of the module docstring; ``summary`` says what was predicted (it ends the reason);
    ``error``: ``model_error``'s allowance, added to ``min_gain`` (< 1 in all)."""
    if rows < min_rows:
        return False, f"declined: M={rows} rows < min_rows={min_rows}; {summary}"
    if pays(fused_ms, seq_ms, min(min_gain + error, 0.99)):
        return True, summary
    extra = f" + the model's error allowance {error:g}" if error else ""
    return False, f"declined: gain below min_gain_fraction={min_gain:g}{extra}; {summary}"
