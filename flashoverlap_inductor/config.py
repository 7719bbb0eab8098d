"""The settings of flashoverlap-inductor: one frozen, typed ``Settings`` object, and the only module that reads the
environment.

Sources, strongest first:

1. ``torch.compile(m, backend="flashoverlap", options={"flashoverlap.<name>": value})``;
2. ``with flashoverlap_inductor.config.patch(<name>=value): ...`` (or ``config.<name> = value``, kept for
   compatibility);
3. the documented environment variables (``ENV``), read once per process;
4. the defaults below.

Names are flat: a ``Tuning`` field (``swizzle``, ``ring_rounds``, ...) is set by its own name too. ``current()``
resolves all sources into one ``Settings``; the backend captures it once per compilation, the pass hashes it whole
into its ``uuid()`` (``Settings.key()``) and hands it to every fused op it emits as a string argument, so a compiled
graph runs with the settings it was compiled under, and a new setting can never serve a stale cached graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("flashoverlap")

MAX_WAIT_TIMEOUT_MS = 7 * 24 * 3600 * 1000.0  # 7 days
DEFAULT_WAIT_TIMEOUT_MS = 600_000.0  # when a group's timeout cannot be read: torch's NCCL default (10 min)
FUSE_MODES = ("auto", "always", "never")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
TRANSPORTS = ("peer", "nccl")
RING_MODES = ("off", "wide", "all")
GEMM_GRIDS = ("tiles", "persistent")
ROW_ORDERS = ("schedule", "gather")
OPTION_PREFIX = "flashoverlap."
# Experimental variants still under study: each name turns one on (``Settings.experiments``).
EXPERIMENTS = {
    "single_group": "run a one-group plan fused (it overlaps nothing; for tests of the fused path on tiny shapes)",
}


@dataclass(frozen=True)
class Tuning:
    """Knobs of the GPU routes that the GPU's data files or measurements decide; ``None`` = that default."""

    gemm_grid: str | None = None  # "tiles" (one CTA per tile) | "persistent" (one per SM); None: data file
    sm_reserve: int | None = None  # persistent grid: SMs left to NCCL; None: data file / NCCL_MAX_CTAS + 2
    swizzle: int = 4  # tile-rows per band of the GEMM's tile scheduler
    row_order: str | None = None  # "schedule" | "gather"; None: measured default (``schedule.row_order.route``)
    ring_rounds: int = 2  # ring all_reduce: at most this many rounds (1 .. 16)
    peer_kernel: str | None = None  # peer/ring routes: the _addc GEMM configuration; None: preferred

    def __post_init__(self) -> None:
        _choice("gemm_grid", self.gemm_grid, GEMM_GRIDS, optional=True)
        _choice("row_order", self.row_order, ROW_ORDERS, optional=True)
        if self.sm_reserve is not None and not (_is_int(self.sm_reserve) and self.sm_reserve >= 0):
            raise ValueError(f"flashoverlap: sm_reserve must be an int >= 0 or None, got {self.sm_reserve!r}")
        if not (_is_int(self.swizzle) and self.swizzle >= 1):
            raise ValueError(f"flashoverlap: swizzle must be an int >= 1, got {self.swizzle!r}")
        if not (_is_int(self.ring_rounds) and 1 <= self.ring_rounds <= 16):
            raise ValueError(f"flashoverlap: ring_rounds must be an int in 1 .. 16, got {self.ring_rounds!r}")
        if self.peer_kernel is not None and not isinstance(self.peer_kernel, str):
            raise ValueError(f"flashoverlap: peer_kernel must be a configuration name or None, got "
                             f"{self.peer_kernel!r}")


@dataclass(frozen=True)
class Settings:
    """Every setting of the backend. Frozen and hashable; equal settings give equal ``key()`` strings."""

    fuse: str = "auto"  # "auto" (cost model decides) | "always" | "never"
    collectives: tuple[str, ...] = COLLECTIVES  # collectives the pass may fuse
    # Under "auto", fuse only when predicted fused time <= (1 - margin) * predicted sequential time. 0.03 is the
    # smallest margin at which no shape the cost model fused ran more than 2% slower than sequential in the
    # calibration benchmark (2026-11-22, 2 and 4 H200s; docs/results.md).
    min_gain_fraction: float = 0.03
    min_rows: int = 256  # under "auto": never fuse GEMMs with fewer output rows (latency-bound)
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")  # dtypes the pass may fuse
    all_to_all_default_groups: int = 4  # all_to_all with explicit split sizes: uniform fractions 1/groups
    # Bound of a fused call's GPU waits (ms; the call's waits share one deadline); None: the process group's own
    # timeout (torch's default: 10 min for NCCL), so a straggler that torch tolerates never trips it.
    wait_timeout_ms: float | None = None
    config_dir: str | None = None  # data folder (curves, plans); None: the package's configs/
    transport: str = "peer"  # "peer": peer / ring routes where they apply; "nccl": always the NCCL route
    ring: str = "off"  # "off" | "wide" (groups of 3-8 ranks) | "all" (2-rank groups too, instead of the peer route)
    library: str | None = None  # the CUDA kernel library; None: build/libflashoverlap_sm90.so
    tuning: Tuning = field(default_factory=Tuning)
    experiments: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _choice("fuse", self.fuse, FUSE_MODES)
        _choice("transport", self.transport, TRANSPORTS)
        _choice("ring", self.ring, RING_MODES)
        if isinstance(self.collectives, str) or not all(c in COLLECTIVES for c in self.collectives):
            raise ValueError(f"flashoverlap: collectives must be a sequence of {COLLECTIVES}, got "
                             f"{self.collectives!r}")
        if isinstance(self.dtypes, str) or not all(isinstance(d, str) for d in self.dtypes):
            raise ValueError(f"flashoverlap: dtypes must be a sequence of dtype names, got {self.dtypes!r}")
        for name in ("min_gain_fraction", "wait_timeout_ms"):
            value = getattr(self, name)
            if value is None and name == "wait_timeout_ms":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"flashoverlap: {name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))  # one type per field: equal settings, equal keys
        if self.wait_timeout_ms is not None and not 0 < self.wait_timeout_ms <= MAX_WAIT_TIMEOUT_MS:
            raise ValueError(f"flashoverlap: wait_timeout_ms must be > 0 and <= {MAX_WAIT_TIMEOUT_MS:.0f} (7 days), or "
                             f"None (the process group's timeout), got {self.wait_timeout_ms!r}")
        for name in ("min_rows", "all_to_all_default_groups"):
            value = getattr(self, name)
            if not _is_int(value) or value < (1 if "groups" in name else 0):
                raise ValueError(f"flashoverlap: {name} must be an int, got {value!r}")
        for name in ("config_dir", "library"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"flashoverlap: {name} must be a path string or None, got {getattr(self, name)!r}")
        unknown = set(self.experiments) - set(EXPERIMENTS)
        if unknown:
            raise ValueError(f"flashoverlap: unknown experiments {sorted(unknown)}; known: {sorted(EXPERIMENTS)}")
        object.__setattr__(self, "_key", repr(_canonical(self)))  # computed once: the per-call path reads it

    def key(self) -> str:
        """A canonical string of every field: the pass's cache key and the fused ops' ``settings`` argument."""
        return self._key  # type: ignore[attr-defined]

    def timeout_ns(self, group_timeout_ms: float | None = None) -> int:
        """The bound of a call's waits in ns: ``wait_timeout_ms``, else the group's timeout (``group_timeout_ms``),
        else ``DEFAULT_WAIT_TIMEOUT_MS``; at most ``MAX_WAIT_TIMEOUT_MS`` (the device's int64 clock never wraps)."""
        ms = self.wait_timeout_ms if self.wait_timeout_ms is not None else (group_timeout_ms or DEFAULT_WAIT_TIMEOUT_MS)
        return max(1, int(min(ms, MAX_WAIT_TIMEOUT_MS) * 1e6))

    def replace(self, **changes: Any) -> Settings:
        """A copy with flat ``changes`` (``Settings`` or ``Tuning`` field names), validated."""
        return _apply(self, changes)


_TOP = {f.name for f in dataclasses.fields(Settings)} - {"tuning"}
_TUNING = {f.name for f in dataclasses.fields(Tuning)}
NAMES = tuple(sorted(_TOP | _TUNING))

# The environment variables read (here only), name -> setting.
ENV = {
    "FLASHOVERLAP_FUSE": "fuse",
    "FLASHOVERLAP_TRANSPORT": "transport",
    "FLASHOVERLAP_RING": "ring",
    "FLASHOVERLAP_RING_ROUNDS": "ring_rounds",
    "FLASHOVERLAP_LIB": "library",
}
# Still read for one release, with a warning: set these through options or config.patch.
DEPRECATED_ENV = {
    "FLASHOVERLAP_GEMM_GRID": "gemm_grid",
    "FLASHOVERLAP_SM_RESERVE": "sm_reserve",
    "FLASHOVERLAP_SWIZZLE": "swizzle",
    "FLASHOVERLAP_ROW_ORDER": "row_order",
    "FLASHOVERLAP_PEER_KERNEL": "peer_kernel",
}
# Variants measured and not kept (docs/results.md): setting them only logs that they are ignored.
REMOVED_ENV = ("FLASHOVERLAP_HOST_LOOP", "FLASHOVERLAP_NCCL", "FLASHOVERLAP_SIGNAL_MODE", "FLASHOVERLAP_KERNEL",
               "FLASHOVERLAP_PEER_GATE", "FLASHOVERLAP_PEER_COPY", "FLASHOVERLAP_PEER_PARTIAL",
               "FLASHOVERLAP_PEER_GROUPS")
_INT_FIELDS = {"ring_rounds", "sm_reserve", "swizzle", "min_rows", "all_to_all_default_groups"}
_FLOAT_FIELDS = {"min_gain_fraction", "wait_timeout_ms"}
_TUPLE_FIELDS = {"collectives", "dtypes"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice(name: str, value: Any, allowed: tuple[str, ...], optional: bool = False) -> None:
    if (value is None and optional) or value in allowed:
        return
    raise ValueError(f"flashoverlap: {name} must be one of {allowed}{' or None' if optional else ''}, got {value!r}")


def _canonical(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return tuple((f.name, _canonical(getattr(obj, f.name))) for f in dataclasses.fields(obj))
    if isinstance(obj, (frozenset, set)):
        return tuple(sorted(obj))
    return obj


def _coerce(name: str, value: Any) -> Any:
    """A user's value in the field's type: lists become tuples, a comma-separated string a tuple of names,
    numbers given as strings (environment) numbers; anything else is left to the dataclass checks."""
    if name in _TUPLE_FIELDS:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return tuple(value) if isinstance(value, (list, tuple)) else value
    if name == "experiments":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return frozenset(value) if isinstance(value, (list, tuple, set, frozenset)) else value
    if isinstance(value, str):
        text = value.strip()
        if name in _INT_FIELDS:
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"flashoverlap: {name} must be an int, got {value!r}") from None
        if name == "wait_timeout_ms" and text.lower() in ("", "none", "group"):
            return None
        if name in _FLOAT_FIELDS:
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"flashoverlap: {name} must be a number, got {value!r}") from None
        if name in ("fuse", "transport", "ring", "gemm_grid", "row_order"):
            return text.lower()
    return value


def _apply(base: Settings, changes: dict[str, Any]) -> Settings:
    unknown = set(changes) - set(NAMES)
    if unknown:
        raise ValueError(f"flashoverlap: unknown setting(s) {sorted(unknown)}; known: {list(NAMES)}")
    top = {k: _coerce(k, v) for k, v in changes.items() if k in _TOP}
    tune = {k: _coerce(k, v) for k, v in changes.items() if k in _TUNING}
    if "tuning" in changes:
        raise ValueError("flashoverlap: set tuning fields by name (e.g. swizzle=8), not 'tuning'")
    if tune:
        top["tuning"] = dataclasses.replace(base.tuning, **tune)
    return dataclasses.replace(base, **top)


@functools.lru_cache(maxsize=1)
def _from_env() -> dict[str, Any]:
    """The environment's settings (read once per process)."""
    out: dict[str, Any] = {}
    for var, name in ENV.items():
        if os.environ.get(var):
            out[name] = os.environ[var]
    for var, name in DEPRECATED_ENV.items():
        if os.environ.get(var) and name == "row_order" and os.environ[var].strip().lower() == "stage":
            log.warning("flashoverlap: %s=stage is ignored: that row order was measured and removed "
                        "(docs/results.md)", var)
            continue
        if os.environ.get(var):
            log.warning("flashoverlap: %s is deprecated (read for one more release); set %r through "
                        "options={'flashoverlap.%s': ...} or config.patch(%s=...)", var, name, name, name)
            out[name] = os.environ[var]
    for var in REMOVED_ENV:
        if os.environ.get(var):
            log.warning("flashoverlap: %s is ignored: that variant was measured and removed (docs/results.md)", var)
    return out


def nccl_max_ctas_env() -> int | None:
    """``$NCCL_MAX_CTAS`` (NCCL's own variable: it caps the CTAs of NCCL's kernels), or None."""
    env = os.environ.get("NCCL_MAX_CTAS")
    return int(env) if env and env.isdigit() and int(env) > 0 else None


def reload_environment() -> None:
    """Read the environment again at the next ``current()`` (it is read once per process otherwise)."""
    _from_env.cache_clear()
    _resolved.clear()


_overrides: dict[str, Any] = {}  # set by patch() / config.<name> = value
_resolved: dict[str, Settings] = {}  # repr of the overrides (types included: 1, 1.0 and True differ) -> Settings


_pinned: list[Settings] = []  # using(): a compilation's captured settings, while its pass runs


def current() -> Settings:
    """The effective settings now: defaults < environment < ``patch``/attribute overrides; inside ``using(s)``,
    exactly ``s``."""
    if _pinned:
        return _pinned[-1]
    key = repr(sorted(_overrides.items()))
    settings = _resolved.get(key)
    if settings is None:
        settings = _resolved[key] = _resolve(dict(_overrides))
    return settings


class using:  # noqa: N801  (used like a function: ``with config.using(s):``)
    """``with config.using(settings):`` makes ``current()`` return ``settings`` (the pass under the settings its
    compilation captured, the dispatcher under a fused op's: the library, data files and cost model read them through
    ``current()``). A plain class, not a generator: the dispatcher enters one on every fused call."""

    __slots__ = ("settings",)

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def __enter__(self) -> Settings:
        _pinned.append(self.settings)
        return self.settings

    def __exit__(self, *exc: object) -> None:
        _pinned.pop()


def _resolve(overrides: dict[str, Any]) -> Settings:
    base = Settings()
    env = _from_env()
    try:
        base = _apply(base, env)
    except ValueError as exc:
        raise ValueError(f"{exc} (from the environment: {sorted(env)})") from None
    return _apply(base, overrides)


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[Settings]:
    """Temporarily override settings: ``with config.patch(fuse="always", swizzle=8) as s: ...`` (validated on
    entry; yields the effective ``Settings``)."""
    _apply(current(), changes)  # validate before changing anything
    old = dict(_overrides)
    _overrides.update(changes)
    try:
        yield current()
    finally:
        _overrides.clear()
        _overrides.update(old)


def from_key(key: str) -> Settings:
    """The ``Settings`` whose ``key()`` is ``key`` ("" = ``current()``); memoized, so a fused op pays one dict
    lookup per call."""
    return current() if not key else _from_key(key)


@functools.lru_cache(maxsize=256)
def _from_key(key: str) -> Settings:
    import ast

    fields = dict(ast.literal_eval(key))
    tuning = Tuning(**dict(fields.pop("tuning")))
    fields["experiments"] = frozenset(fields["experiments"])
    settings = Settings(**fields, tuning=tuning)
    if settings.key() != key:
        raise ValueError(f"flashoverlap: settings string {key!r} does not round-trip (made by another version?)")
    return settings


def split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``torch.compile`` options into (ours, without the prefix) and (the rest, for Inductor)."""
    ours, rest = {}, {}
    for key, value in (options or {}).items():
        if key.startswith(OPTION_PREFIX):
            name = key[len(OPTION_PREFIX):]
            if name not in NAMES:
                raise ValueError(f"unknown option {key!r}; known: {[OPTION_PREFIX + k for k in NAMES]}")
            ours[name] = value
        else:
            rest[key] = value
    return ours, rest


class _ConfigModule(types.ModuleType):
    """``config.<name>`` reads the effective setting; ``config.<name> = value`` overrides it for the process
    (compatibility with earlier releases; prefer ``patch``)."""

    def __getattr__(self, name: str) -> Any:
        if name in _TOP:
            return getattr(current(), name)
        if name in _TUNING:
            return getattr(current().tuning, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _TOP or name in _TUNING:
            if value is None and name in ("fuse",):
                _overrides.pop(name, None)
                return
            _apply(current(), {name: value})
            _overrides[name] = value
            return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in _TOP or name in _TUNING:  # ``del config.<name>``: back to the environment / default
            _overrides.pop(name, None)
            return
        super().__delattr__(name)


sys.modules[__name__].__class__ = _ConfigModule
