"""Finding and loading the cost model's data: bandwidth curves, GEMM models and tuned plans, by GPU name.

Data directory: the settings' ``config_dir`` if set (``data_dir(settings)``), else the installed package
``flashoverlap_inductor.configs`` (located with ``importlib.resources``). ``*.json`` files there whose
``schema`` is ``flashoverlap.bandwidth/*`` or ``flashoverlap.gemm/*`` are loaded and validated; tuned plans are
``plans/*.json`` (``flashoverlap.plans/*``). Other JSON files are ignored. A malformed file raises
``ConfigError`` naming it.

GPU names are matched after normalisation (lower case, the vendor word "nvidia" and punctuation dropped,
whitespace collapsed: "NVIDIA H200" -> "h200"):

1. exact normalised match;
2. family match: the known name's words are a prefix of the requested name's ("h200" for "NVIDIA H200 NVL") or
   the reverse; the longest such known name wins; a warning is logged once;
3. otherwise the default GPU (``DEFAULT_GPU``, "NVIDIA H200"), with a warning logged once.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from flashoverlap_inductor import config
from flashoverlap_inductor.schedule.plan import GroupPlan

from . import bandwidth
from .bandwidth import BandwidthCurve, warn_once
from .gemm import GemmModel
from .pipeline import CostModel
from .schema import ConfigError, schema_kind, validate_plans

log = logging.getLogger("flashoverlap")
DEFAULT_GPU = "NVIDIA H200"
T = TypeVar("T")


def normalize_gpu_name(name: str) -> str:
    """``"NVIDIA H200 NVL"`` -> ``"h200 nvl"``; the key every lookup by GPU name uses."""
    words = re.sub(r"[^a-z0-9.]+", " ", name.lower()).split()
    return " ".join(w for w in words if w != "nvidia")


def data_dir(settings: config.Settings | None = None) -> Path:
    """The directory the data is read from: ``settings.config_dir`` or the package's ``configs/`` (``settings``:
    the caller's; None: ``config.current()``, for callers outside a compilation or a fused call)."""
    config_dir = (settings or config.current()).config_dir
    if config_dir:
        return Path(os.path.expanduser(config_dir))
    return _package_data_dir()


@functools.lru_cache(maxsize=1)
def _package_data_dir() -> Path:
    return Path(str(importlib.resources.files("flashoverlap_inductor.configs")))


@dataclass(frozen=True)
class TunedPlan:
    """One entry of a plan table (times in ms; ``None`` where not measured)."""

    plan: GroupPlan
    measured_fused_ms: float | None
    measured_seq_ms: float | None
    source: str


@dataclass(frozen=True)
class DataSet:
    """Everything loaded from one data directory, indexed by normalised GPU name."""

    directory: Path
    curves: dict[str, BandwidthCurve]
    gemms: dict[str, GemmModel]
    plans: dict[tuple, TunedPlan]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


def _add(index: dict[str, T], item: T, gpu: str, path: Path, what: str) -> None:
    key = normalize_gpu_name(gpu)
    if key in index:
        raise ConfigError(f"{path}: a second {what} for GPU {gpu!r} (normalised {key!r}); keep one per GPU")
    index[key] = item


@functools.lru_cache(maxsize=8)
def load_dataset(directory: Path) -> DataSet:
    """Load and validate every data file of ``directory`` (cached per directory; ``clear_caches`` resets)."""
    if not directory.is_dir():
        raise ConfigError(f"cost-model data directory {directory} does not exist")
    curves: dict[str, BandwidthCurve] = {}
    gemms: dict[str, GemmModel] = {}
    for path in sorted(directory.glob("*.json")):
        doc = _read_json(path)
        kind = schema_kind(doc)
        if kind == "flashoverlap.bandwidth":
            _add(curves, BandwidthCurve.from_json(doc, path.name), doc["gpu"], path, "bandwidth curve")
        elif kind == "flashoverlap.gemm":
            _add(gemms, GemmModel.from_json(doc, path.name), doc["gpu"], path, "GEMM model")
        else:
            log.debug("flashoverlap cost model: ignoring %s (not a cost-model data file)", path)
    plans: dict[tuple, TunedPlan] = {}
    for path in sorted((directory / "plans").glob("*.json")):
        doc = _read_json(path)
        if schema_kind(doc) != "flashoverlap.plans":
            raise ConfigError(f"{path}: files in plans/ must have schema 'flashoverlap.plans/1'")
        for e in validate_plans(doc, f"plans/{path.name}"):
            key = plan_key(doc["gpu"], int(doc["sm_count"]), e["world_size"], e["collective"], e["dtype"],
                           e["m"], e["n"], e["k"])
            if key in plans:
                raise ConfigError(f"{path}: duplicate tuned plan for {key}")
            plans[key] = TunedPlan(e["group_plan"], e.get("measured_fused_ms"), e.get("measured_seq_ms"),
                                   f"plans/{path.name}")
    if not curves or not gemms:
        raise ConfigError(f"{directory}: needs at least one bandwidth curve and one GEMM model "
                          f"(found {len(curves)} and {len(gemms)})")
    return DataSet(directory, curves, gemms, plans)


def plan_key(gpu: str, sm_count: int, world_size: int, collective: str, dtype: str, m: int, n: int,
             k: int) -> tuple:
    """Key of the tuned-plan table."""
    return (normalize_gpu_name(gpu), sm_count, world_size, collective, dtype, m, n, k)


def _resolve(index: dict[str, T], name: str, what: str) -> tuple[T, str]:
    """Look ``name`` up in ``index`` (exact, family, default); returns the item and how it matched."""
    key = normalize_gpu_name(name)
    if key in index:
        return index[key], "exact"
    words = key.split()
    family = [k for k in index if _is_word_prefix(k.split(), words) or _is_word_prefix(words, k.split())]
    if family:
        best = max(family, key=lambda k: (len(k.split()), k))
        warn_once(f"no {what} for GPU {name!r}; using the one of the same family ({best!r})")
        return index[best], "family"
    default = normalize_gpu_name(DEFAULT_GPU)
    fallback = default if default in index else sorted(index)[0]
    warn_once(f"no {what} for GPU {name!r}; falling back to {fallback!r} (predictions may be off; "
               "measure a curve with tools/anchor_bench.py and import it with python -m "
               "flashoverlap_inductor.tune.import_anchor)")
    return index[fallback], "default"


def _is_word_prefix(short: list[str], long: list[str]) -> bool:
    return bool(short) and len(short) <= len(long) and long[: len(short)] == short


@functools.lru_cache(maxsize=64)
def _model_for(directory: Path, name: str) -> tuple[CostModel, str]:
    data = load_dataset(directory)
    curve, how_c = _resolve(data.curves, name, "bandwidth curve")
    gemm, how_g = _resolve(data.gemms, name, "GEMM model")
    how = how_c if how_c == how_g else f"curve {how_c}, GEMM {how_g}"
    return CostModel(curve, gemm, call_overhead_ms=gemm.group_overhead_ms), how


def model_for(device_name: str | None, directory: Path | None = None) -> tuple[CostModel, str]:
    """The cost model of ``device_name`` (None = ``DEFAULT_GPU``) in ``directory`` (None: ``data_dir()``) and how it
    matched ("exact", "family", "default")."""
    return _model_for(directory or data_dir(), device_name or DEFAULT_GPU)


def tuned_plan(device_name: str | None, sm_count: int, world_size: int, collective: str, dtype: str, m: int,
               n: int, k: int, directory: Path | None = None) -> TunedPlan | None:
    """The tuned plan for this exact problem in ``directory`` (None: ``data_dir()``), if a plan table has one."""
    data = load_dataset(directory or data_dir())
    return data.plans.get(plan_key(device_name or DEFAULT_GPU, sm_count, world_size, collective, dtype, m, n, k))


def clear_caches(extra: Iterable[Callable[[], None]] = ()) -> None:
    """Forget loaded data and warnings (tests; after writing new data files)."""
    load_dataset.cache_clear()
    _model_for.cache_clear()
    bandwidth._warned.clear()
    for fn in extra:
        fn()
