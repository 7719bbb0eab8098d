"""The tuner's pure parts: measurement grids, the wave-group search over measured candidates, and building the
cost model's data documents (schemas and writers of ``cost_model.schema`` / ``tune.import_anchor``; no
second schema). Nothing here touches a GPU, so all of it is tested on CPU with fake timings.

Files (in a data directory laid out like ``configs/``; ``slug`` = ``registry.normalize_gpu_name`` with "_"):
``bandwidth_<slug>.json`` (``flashoverlap.bandwidth/1``), ``gemm_<slug>.json`` (``flashoverlap.gemm/1``; the tuner
adds the optional ``tuned_kernels`` section), ``plans/<slug>_w<world>.json`` (``flashoverlap.plans/1``; one file per
world size, so files never hold the same plan key twice).
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashoverlap_inductor.cost_model import schema
from flashoverlap_inductor.cost_model.gemm import GemmModel
from flashoverlap_inductor.cost_model.registry import normalize_gpu_name, plan_key
from flashoverlap_inductor.cost_model.search import candidate_bounds, unit_bounds
from flashoverlap_inductor.schedule.plan import GroupPlan
from flashoverlap_inductor.tools import cli_util as cli
from flashoverlap_inductor.tune.import_anchor import dumps

KIB, GIB = 1 << 10, 1 << 30


def today() -> str:
    return datetime.date.today().isoformat()


def slug(gpu: str) -> str:
    return normalize_gpu_name(gpu).replace(" ", "_")


def bandwidth_path(directory: Path, gpu: str) -> Path:
    return Path(directory) / f"bandwidth_{slug(gpu)}.json"


def gemm_path(directory: Path, gpu: str) -> Path:
    return Path(directory) / f"gemm_{slug(gpu)}.json"


def plans_path(directory: Path, gpu: str, world_size: int) -> Path:
    return Path(directory) / "plans" / f"{slug(gpu)}_w{world_size}.json"


def read_json(path: Path) -> dict[str, Any] | None:
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, doc: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(doc))
    return path


def schema_checked(doc: dict[str, Any] | None, path: Path, option: str, kind: tuple[str, str],
                   check: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
    """``doc`` after ``check(doc)`` passed (the merge a tuner command does at its end, tried before it measures);
    ``cli_util.CliError`` naming the file otherwise."""
    if doc is not None:
        try:
            check(doc)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise cli.malformed(path, option, kind, f"schema check: {exc}") from None
    return doc


def _existing(out: str | None, default: Path) -> tuple[Path, str]:
    return (Path(out), "--out") if out and Path(out).exists() else (default, "")


def bandwidth_base(directory: Path, out: str | None, gpu: str, sm_count: int, world_size: int
                   ) -> dict[str, Any] | None:
    """The bandwidth document ``tune bandwidth`` merges its curves into (None: a new one): ``out`` if it exists,
    else the data directory's; one of another GPU is not merged into. ``CliError`` when it is malformed."""
    path, option = _existing(out, bandwidth_path(directory, gpu))
    base = cli.read_data_file(path, option, cli.BANDWIDTH_FILE)
    if base is not None and normalize_gpu_name(str(base.get("gpu", ""))) != normalize_gpu_name(gpu):
        return None
    return schema_checked(base, path, option, cli.BANDWIDTH_FILE,
                          lambda d: merge_bandwidth(d, gpu, sm_count, world_size, {}, "check"))


def gemm_base(directory: Path, out: str | None, gpu: str) -> tuple[Path, dict[str, Any]]:
    """Where ``tune gemm`` writes (``out``, else the data directory's file) and the GEMM model it updates (``out``
    if it exists, else the data directory's); ``CliError`` when there is none or it fails the schema."""
    default = gemm_path(directory, gpu)
    path, option = _existing(out, default)
    base = cli.read_data_file(path, option, cli.GEMM_FILE)
    if base is None:
        raise cli.CliError(f"no GEMM model for {gpu} to update: {default} does not exist; write one with "
                           f"{cli.GEMM_FILE[1].split(',')[0]}")
    return Path(out) if out else default, schema_checked(base, path, option, cli.GEMM_FILE,
                                                          lambda d: schema.validate_gemm(d, str(path)))


def plans_base(path: Path, gpu: str, sm_count: int) -> dict[str, Any] | None:
    """The plans file ``tune search`` adds its entries to (None: a new one); ``CliError`` when it is malformed or
    for another GPU or SM count."""
    doc = cli.read_data_file(path, "", cli.PLANS_FILE)
    return schema_checked(doc, path, "", cli.PLANS_FILE, lambda d: merge_plans(d, gpu, sm_count, [], "check"))


RECORDS_SCHEMA = "flashoverlap.search_records/1"


def records_doc(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``tune search --record`` file: one ``SearchReport.record`` per searched shape."""
    return {"schema": RECORDS_SCHEMA, "records": list(records)}


def read_records(path: Path, option: str = "--records") -> list[dict[str, Any]]:
    """The records of a ``--record`` file (a bare single record, as written before, is read as one);
    ``cli_util.CliError`` (a ``ValueError``) naming the file when it is missing, not JSON or not such a file."""
    doc = cli.read_json(path, option, cli.RECORDS_FILE)
    if isinstance(doc, dict) and doc.get("schema") == RECORDS_SCHEMA and isinstance(doc.get("records"), list):
        records = list(doc["records"])
    elif isinstance(doc, dict) and "candidates" in doc:
        records = [doc]
    else:
        raise cli.malformed(path, option, cli.RECORDS_FILE, f"no 'schema': {RECORDS_SCHEMA!r} with a 'records' list")
    return records


# --------------------------------------------------------------------------------------------- bandwidth


def bandwidth_sizes(min_bytes: int = 64 * KIB, max_bytes: int = GIB, per_octave: int = 4, world_size: int = 1,
                    elem_bytes: int = 2, align_elems: int = 128) -> list[int]:
    """Message sizes in bytes, ``per_octave`` points per doubling from ``min_bytes`` to ``max_bytes``, each a
    multiple of ``world_size * align_elems`` elements (reduce_scatter / all_to_all split it evenly); strictly
    increasing."""
    if min_bytes <= 0 or max_bytes < min_bytes or per_octave < 1:
        raise ValueError("bandwidth_sizes: need 0 < min_bytes <= max_bytes and per_octave >= 1")
    unit = world_size * align_elems * elem_bytes
    steps = round(math.log2(max_bytes / min_bytes) * per_octave)
    out: list[int] = []
    for i in range(steps + 1):
        nbytes = max(unit, int(min_bytes * 2 ** (i / per_octave)) // unit * unit)
        if not out or nbytes > out[-1]:
            out.append(nbytes)
    return out


def merge_bandwidth(existing: dict[str, Any] | None, gpu: str, sm_count: int, world_size: int,
                    curves: dict[str, list[list[float]]], note: str, date: str | None = None) -> dict[str, Any]:
    """``existing`` (or a new document) with world ``world_size``'s curves replaced by ``curves`` (``{collective:
    [[bytes, ms], ...]}``; collectives not measured keep their old points). Validated."""
    date = date or today()
    if existing is not None and normalize_gpu_name(existing.get("gpu", "")) != normalize_gpu_name(gpu):
        raise ValueError(f"bandwidth file is for {existing.get('gpu')!r}, measured on {gpu!r}")
    doc = copy.deepcopy(existing) if existing else {"schema": schema.BANDWIDTH_SCHEMA, "gpu": gpu,
                                                    "sm_count": sm_count, "date": date, "source": "", "curves": {}}
    per = dict(doc["curves"].get(str(world_size), {}))
    per.update({c: [[int(b), float(f"{ms:.6g}")] for b, ms in pts] for c, pts in curves.items()})
    doc["curves"][str(world_size)] = per
    doc["date"] = date
    doc["source"] = "; ".join(x for x in (doc.get("source", ""), f"world {world_size}: {note} ({date})") if x)
    schema.validate_bandwidth(doc, "tuned bandwidth")
    return doc


# --------------------------------------------------------------------------------------------- GEMM


@dataclass(frozen=True)
class GemmSample:
    """One measured GEMM: configuration ``config`` (tile ``tile_m x tile_n``) on ``sms`` SMs, ``ms`` median."""

    config: str
    tile_m: int
    tile_n: int
    m: int
    n: int
    k: int
    sms: int
    ms: float


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def kernel_efficiency(model: GemmModel, s: GemmSample, dtype: str = "bfloat16") -> float:
    """The ``efficiency`` at which the wave model reproduces ``s``: ideal wave time (rate of the fitted cuBLAS
    model) / measured wave time, waves = ceil(tiles / sms)."""
    waves = math.ceil(math.ceil(s.m / s.tile_m) * math.ceil(s.n / s.tile_n) / s.sms)
    ideal = model.wave_ms(s.k, dtype, s.tile_m, s.tile_n, 1.0) - model.wave_overhead_ms
    measured = (s.ms - model.launch_ms) / waves - model.wave_overhead_ms
    return ideal / measured if measured > 0 else math.nan


def update_gemm_doc(doc: dict[str, Any], samples: Sequence[GemmSample], sm_count: int, default_tile: tuple[int, int],
                    note: str, cublas: Sequence[tuple[int, int, int, float]] = (), date: str | None = None
                    ) -> dict[str, Any]:
    """The GEMM document with ``fused.kernel_efficiency`` refitted and a ``tuned_kernels`` section:

    * ``per_config``: median efficiency of every configuration over the shapes measured with ``fused.nccl_sms``
      SMs left free (all SMs when none was);
    * ``best_by_tile``: the configuration of highest median efficiency per tile (the runtime's default choice);
    * ``sm_scaling``: per SMs-left-free count, the median over shapes of time(all SMs) / time(that many free), for
      each tile's best configuration (1.0 = no loss; the proportional share is ``(sm_count - free) / sm_count``);
    * ``samples``: the raw measurements ``[config, m, n, k, sms, ms]`` and cuBLAS ``[m, n, k, ms]``.

    ``kernel_efficiency`` becomes the median efficiency of ``best_by_tile[default_tile]``. Validated.
    """
    out = copy.deepcopy(doc)
    model = GemmModel.from_json(doc, "gemm")
    reserve = int(doc["fused"]["nccl_sms"])
    used = {s.sms for s in samples}
    fused_sms = sm_count - reserve if sm_count - reserve in used else max(used)
    per_config: dict[str, list[float]] = {}
    tiles: dict[str, tuple[int, int]] = {}
    for s in samples:
        tiles[s.config] = (s.tile_m, s.tile_n)
        if s.sms == fused_sms:
            per_config.setdefault(s.config, []).append(kernel_efficiency(model, s))
    eff = {c: statistics.median([e for e in v if math.isfinite(e)] or [math.nan]) for c, v in per_config.items()}
    best: dict[str, str] = {}
    for c, e in sorted(eff.items()):
        key = f"{tiles[c][0]}x{tiles[c][1]}"
        if math.isfinite(e) and (key not in best or e > eff[best[key]]):
            best[key] = c
    scaling: dict[str, dict[str, float]] = {}
    by_key = {(s.config, s.m, s.n, s.k, s.sms): s.ms for s in samples}
    for key, c in best.items():
        full = {(m, n, k): ms for (cc, m, n, k, sms), ms in by_key.items() if cc == c and sms == sm_count}
        per_free: dict[str, float] = {}
        for free in sorted({sm_count - s.sms for s in samples if s.config == c}):
            ratios = [full[(m, n, k)] / ms for (cc, m, n, k, sms), ms in by_key.items()
                      if cc == c and sms == sm_count - free and (m, n, k) in full]
            if ratios:
                per_free[str(free)] = _sig(statistics.median(ratios))
        scaling[key] = per_free
    default_key = f"{default_tile[0]}x{default_tile[1]}"
    if default_key in best:
        out["fused"]["kernel_efficiency"] = _sig(eff[best[default_key]])
        out["fused"]["note"] = (f"kernel_efficiency = median measured efficiency of {best[default_key]} on "
                                f"{fused_sms} SMs over {len(per_config[best[default_key]])} shapes (tune gemm)")
    out["tuned_kernels"] = {
        "note": note, "date": date or today(), "fused_sms": fused_sms,
        "per_config": {c: _sig(e) for c, e in sorted(eff.items()) if math.isfinite(e)},
        "best_by_tile": best, "sm_scaling": scaling,
        "samples": [[s.config, s.m, s.n, s.k, s.sms, round(s.ms, 5)] for s in samples],
        "cublas": [[m, n, k, round(ms, 5)] for m, n, k, ms in cublas],
    }
    schema.validate_gemm(out, "tuned gemm")
    return out


# --------------------------------------------------------------------------------------------- plan search


def compositions(units: int) -> list[tuple[int, ...]]:
    """Every composition of ``units`` (ordered positive parts summing to it): 2^(units-1) of them."""
    out = []
    for cuts in itertools.product((False, True), repeat=max(0, units - 1)):
        parts, run = [], 1
        for cut in cuts:
            if cut:
                parts.append(run)
                run = 1
            else:
                run += 1
        out.append((*parts, run))
    return out


def candidate_plans(collective: str, m: int, n: int, world_size: int, tile: tuple[int, int], max_units: int,
                    kernel: str = "") -> list[GroupPlan]:
    """Every plan whose groups are runs of the search's units (``cost_model.search.unit_bounds`` of its
    ``candidate_bounds``): the exhaustive candidate set, in a fixed order (identical on every rank)."""
    ub = unit_bounds(candidate_bounds(collective, m, tile[0], world_size), max_units)
    plans = []
    for parts in compositions(len(ub) - 1):
        idx = list(itertools.accumulate(parts))
        plans.append(GroupPlan(m, n, tile[0], tile[1], (0, *(ub[i] for i in idx)), kernel))
    return plans


@dataclass
class SearchReport:
    """Outcome of one plan search (times in ms). ``measured``/``refined``/``confirmed``/``predicted`` map
    ``plan.to_str()`` to times; ``best`` is the plan of least refined time; ``predictive`` the model's own argmin
    (if given); ``confirmed`` holds ``best`` and ``predictive`` re-measured together in a batch of their own (empty
    when they are the same plan or no confirmation ran)."""

    best: GroupPlan
    best_ms: float
    predictive: GroupPlan | None
    measured: dict[str, float] = field(default_factory=dict)
    refined: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)
    confirmed: dict[str, float] = field(default_factory=dict)

    @property
    def predictive_ms(self) -> float:
        if self.predictive is None:
            return math.nan
        key = self.predictive.to_str()
        return self.refined.get(key, self.measured.get(key, math.nan))

    @property
    def refined_relative_performance(self) -> float:
        """best refined / refined time of the model's argmin, from the batch that chose the best (biased against
        the argmin: the best is the minimum of several noisy times)."""
        return self.best_ms / self.predictive_ms if self.predictive_ms > 0 else math.nan

    @property
    def relative_performance(self) -> float:
        """Time of the best plan / time of the model's argmin (1.0 = the model found the best plan), from the
        confirmation batch when there is one (times not used to choose the best), else from the refinement."""
        if self.predictive is not None and self.confirmed:
            best, pred = self.confirmed[self.best.to_str()], self.confirmed[self.predictive.to_str()]
            return best / pred if pred > 0 else math.nan
        return 1.0 if self.predictive == self.best else self.refined_relative_performance

    def record(self, **meta: Any) -> dict[str, Any]:
        """Every candidate's times (``tune search --record``): the cost model's ranking data for later fits.
        ``meta`` (GPU, world size, collective, shape, sequential time, ...) goes in as given."""
        return {**meta, "best": self.best.to_str(), "predictive": self.predictive.to_str() if self.predictive else None,
                "candidates": [{"plan": key, "measured_ms": ms, "refined_ms": self.refined.get(key),
                                "confirmed_ms": self.confirmed.get(key), "predicted_ms": self.predicted.get(key)}
                               for key, ms in self.measured.items()]}  # every refined plan was measured first

    @property
    def model_errors(self) -> list[float]:
        """``|predicted - measured| / measured`` of every measured candidate with a prediction."""
        out = []
        for key, ms in {**self.measured, **self.refined}.items():
            if key in self.predicted and ms > 0:
                out.append(abs(self.predicted[key] - ms) / ms)
        return out


def search(candidates: Sequence[GroupPlan], measure: Callable[[list[GroupPlan], int], list[float]], *,
           predict: Callable[[GroupPlan], float] | None = None, predictive: GroupPlan | None = None,
           refine_top: int = 5, refine_rounds: int = 5, first_rounds: int = 1,
           confirm_rounds: int = 0) -> SearchReport:
    """Measure every candidate (``measure(plans, rounds) -> ms``, one batch, ``first_rounds`` rounds), re-measure
    the ``refine_top`` fastest plus ``predictive`` together with ``refine_rounds`` rounds, and pick the fastest of
    those. With ``confirm_rounds`` and a ``predictive`` that is not the best, the two are measured once more in a
    batch of their own: the verdict on the model's pick then comes from times that did not choose the best (the
    minimum of several noisy times is biased low). ``predict`` (the cost model) only annotates the report."""
    plans = list(dict.fromkeys(list(candidates) + ([predictive] if predictive is not None else [])))
    if not plans:
        raise ValueError("search: no candidate plans")
    first = measure(plans, first_rounds)
    measured = {p.to_str(): t for p, t in zip(plans, first, strict=True)}
    order = sorted(range(len(plans)), key=lambda i: first[i])
    finalists = [plans[i] for i in order[:max(1, refine_top)]]
    if predictive is not None and predictive not in finalists:
        finalists.append(predictive)
    refined_ms = measure(finalists, refine_rounds) if refine_rounds > 0 else [measured[p.to_str()] for p in finalists]
    refined = {p.to_str(): t for p, t in zip(finalists, refined_ms, strict=True)}
    best = min(finalists, key=lambda p: refined[p.to_str()])
    predicted = {p.to_str(): predict(p) for p in plans} if predict is not None else {}
    confirmed: dict[str, float] = {}
    if confirm_rounds > 0 and predictive is not None and predictive != best:
        confirmed = dict(zip((best.to_str(), predictive.to_str()), measure([best, predictive], confirm_rounds),
                             strict=True))
    return SearchReport(best, refined[best.to_str()], predictive, measured, refined, predicted, confirmed)


def merge_plans(existing: dict[str, Any] | None, gpu: str, sm_count: int, entries: Sequence[dict[str, Any]],
                note: str, date: str | None = None) -> dict[str, Any]:
    """``existing`` (or a new ``flashoverlap.plans/1`` document) with ``entries`` added; an entry with the same
    plan key (GPU, SM count, world size, collective, dtype, m, n, k) replaces the old one. Validated."""
    date = date or today()
    if existing is not None and normalize_gpu_name(existing.get("gpu", "")) != normalize_gpu_name(gpu):
        raise ValueError(f"plans file is for {existing.get('gpu')!r}, tuned on {gpu!r}")
    if existing is not None and int(existing.get("sm_count", -1)) != sm_count:
        raise ValueError(f"plans file is for {existing.get('sm_count')} SMs, tuned on {sm_count}")
    doc = copy.deepcopy(existing) if existing else {"schema": schema.PLANS_SCHEMA, "gpu": gpu, "sm_count": sm_count,
                                                    "date": date, "source": "", "entries": []}

    def key(e: dict[str, Any]) -> tuple:
        return plan_key(gpu, sm_count, e["world_size"], e["collective"], e["dtype"], e["m"], e["n"], e["k"])

    new = {key(e): dict(e) for e in entries}
    doc["entries"] = [e for e in doc["entries"] if key(e) not in new] + list(new.values())
    doc["date"] = date
    if note not in doc.get("source", ""):
        doc["source"] = "; ".join(x for x in (doc.get("source", ""), note) if x)
    schema.validate_plans(doc, "tuned plans")
    return doc
