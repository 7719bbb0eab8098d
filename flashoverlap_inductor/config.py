"""Configuration of the flashoverlap backend, patchable like ``torch._inductor.config``.

Three sources, strongest first: ``torch.compile(..., options={"flashoverlap.fuse": "always"})`` (keys with the
``flashoverlap.`` prefix; the backend removes them before Inductor sees the rest), this module's attributes
(``flashoverlap_inductor.config.fuse = "never"`` or ``with config.patch(fuse="never"):``), and the environment
variable ``FLASHOVERLAP_FUSE``. ``snapshot()`` is what the pass hashes into its ``uuid()``, so every setting
that changes the rewrite also changes the FX-graph-cache key.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

FUSE_MODES = ("auto", "always", "never")
OPTION_PREFIX = "flashoverlap."

# "auto" (cost model decides), "always" (fuse every supported match), "never" (leave graphs alone).
# None means: read FLASHOVERLAP_FUSE, default "auto".
fuse: str | None = None
# Collectives the pass may fuse.
collectives: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_to_all")
# Under "auto", fuse only when predicted fused time <= (1 - margin) * predicted sequential time. 0.03 is the smallest
# margin at which no all_reduce / reduce_scatter shape the cost model fuses ran more than 2% slower than
# sequential in the calibration benchmark (2026-11-22, 2 and 4 H200s, 16 shapes each, the fitted model of
# configs/gemm_h200.json; checked again out of sample in examples/RESULTS.md).
min_gain_fraction: float = 0.03
# Under "auto", never fuse GEMMs whose output has fewer rows than this (latency-bound; nothing to overlap).
min_rows: int = 256
# Dtypes the fused ops accept (others are skipped with a logged reason).
dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
# Groups used by all_to_all when ranks may hold different row counts (fractions must agree across ranks).
all_to_all_default_groups: int = 4
# Upper bound of any GPU spin-wait, in milliseconds; a timeout raises instead of hanging.
wait_timeout_ms: float = 30_000.0
# Directory of shipped data (bandwidth curves, tuned plans); None = the package's configs/.
config_dir: str | None = None

_KEYS = ("fuse", "collectives", "min_gain_fraction", "min_rows", "dtypes", "all_to_all_default_groups",
         "wait_timeout_ms", "config_dir")


def fuse_mode() -> str:
    """The effective fuse mode: the attribute if set, else ``FLASHOVERLAP_FUSE``, else ``auto``."""
    mode = fuse if fuse is not None else os.environ.get("FLASHOVERLAP_FUSE", "auto")
    mode = mode.strip().lower()
    if mode not in FUSE_MODES:
        raise ValueError(f"flashoverlap: fuse mode must be one of {FUSE_MODES}, got {mode!r}")
    return mode


def snapshot() -> dict[str, Any]:
    """Every setting, with ``fuse`` resolved: the input of the pass's cache key."""
    out = {k: globals()[k] for k in _KEYS}
    out["fuse"] = fuse_mode()
    return out


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[None]:
    """Temporarily set attributes of this module: ``with config.patch(fuse="always"): ...``."""
    unknown = set(changes) - set(_KEYS)
    if unknown:
        raise AttributeError(f"flashoverlap.config has no setting(s) {sorted(unknown)}")
    old = {k: globals()[k] for k in changes}
    globals().update(changes)
    try:
        fuse_mode()  # validate early
        yield
    finally:
        globals().update(old)


def split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``torch.compile`` options into (ours, without prefix) and (the rest, for Inductor)."""
    ours, rest = {}, {}
    for key, value in (options or {}).items():
        if key.startswith(OPTION_PREFIX):
            name = key[len(OPTION_PREFIX):]
            if name not in _KEYS:
                raise ValueError(f"unknown option {key!r}; known: {[OPTION_PREFIX + k for k in _KEYS]}")
            ours[name] = value
        else:
            rest[key] = value
    return ours, rest
