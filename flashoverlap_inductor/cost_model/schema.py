"""Versioned JSON schemas of the cost model's shipped data, validated on load with clear errors.

Three kinds of document live in the config directory (``configs/`` of the package, or ``config.config_dir``):

``flashoverlap.bandwidth/1`` (``configs/*.json``): measured NCCL times of one GPU model and interconnect::

    {"schema": "flashoverlap.bandwidth/1", "gpu": "NVIDIA H200", "sm_count": 132,
     "source": "...", "date": "YYYY-MM-DD",
     "curves": {"<world_size>": {"all_reduce": [[bytes, ms], ...], "reduce_scatter": [...],
                                  "all_to_all": [...]}, ...}}

  ``bytes`` is the collective's *input* tensor size in bytes (strictly increasing within a list), ``ms`` the
  median time of one call in milliseconds (positive). Every world size (>= 2) lists all three collectives.

``flashoverlap.gemm/1`` (``configs/*.json``): the GEMM wave model of one GPU model (see ``gemm.py``)::

    {"schema": "flashoverlap.gemm/1", "gpu": "NVIDIA H200", "sm_count": 132, "source": "...", "date": "...",
     "model": {"tile": [128, 256], "peak_tflops": 739.0, "launch_ms": 0.016, "wave_overhead_ms": 0.0},
     "dtype_scale": {"bfloat16": 1.0, "float16": 1.0, "float32": 0.068},
     "fused": {"nccl_sms": 16, "kernel_efficiency": 1.0, "grid": "persistent"},
     "interference": {"gemm_slowdown_per_comm_ms": 0.31},
     "anchor_rows": [{"m": ..., "n": ..., "k": ..., "dtype": "bfloat16", "world": 2, "gemm_ms": ..., ...}]}

  ``fused.grid`` (optional, default ``"persistent"``): how the fused GEMM is launched, one persistent CTA per
  SM on ``sm_count - nccl_sms`` SMs, or ``"tiles"``, one CTA per tile on every SM (NCCL then takes SMs as
  tiles finish; ``nccl_sms`` is 0); ``routes.nccl`` launches what the model assumes. ``fused.group_overhead_ms``
  (optional, default 0): a fixed cost added to each group's collective (its wait and NCCL launch). ``peer``
  (optional): the peer route's time model, ``{"world_size": 2, "collectives": {"<collective>": {"gemm_factor":
  > 0, "fixed_ms": >= 0, "host_floor_ms": >= 0, "link_efficiency": (0, 1] (both optional)}}, "fit": {...},
  "note": "..."}`` (``peer.py``). ``sequential`` (optional): ``{"skew_fraction": {"<world size>": {"<collective>":
  0 .. 0.5}}, "fit": {...}, "note": "..."}``, the sequential baseline's time after its GEMM beyond the collective's
  own, as a fraction of the GEMM time (``GemmModel.seq_skew_fraction``; ``tune fit --sequential``). ``ring``
  (optional): the ring route's time model, ``{"worlds": {"<world size >= 2>": {"<collective>": terms as peer's}},
  "fit": {...}, "note": "..."}`` (``ring.py``; ``tune fit --ring``). ``gather_peer`` (optional): the all_gather
  peer route's terms, ``{"gemm_factor": > 0, "fixed_ms": >= 0, "link_efficiency": (0, 1], "fit": {...}, "note":
  "..."}`` (``gather.py``). ``scatter_pull`` (optional): the reduce_scatter pull route's terms, ``{"gemm_factor": > 0,
  "fixed_ms": >= 0, "add_factor": >= 0, "host_floor_ms": >= 0 (optional), "fit": {...}, "note": "..."}``
  (``pull.py``); ``all_reduce_pull`` (optional): the all_reduce pull route's, in the same form. ``moe`` (optional):
  the MoE ops' terms, ``{"dispatch" | "combine": {"factor": > 0,
  "host_floor_ms": >= 0, "moves_bytes_per_ms": > 0, "unfused_bytes_per_ms": > 0, "model_error": [0, 0.5)}, "fit":
  {...}, "note": "..."}`` (``moe.py``).

``flashoverlap.plans/1`` (``configs/plans/*.json``): tuned plans that override the search::

    {"schema": "flashoverlap.plans/1", "gpu": "NVIDIA H200", "sm_count": 132, "source": "...", "date": "...",
     "entries": [{"world_size": 4, "collective": "all_reduce", "dtype": "bfloat16", "m": 8192, "n": 8192,
                  "k": 8192, "plan": "<GroupPlan.to_str()>", "measured_fused_ms": 1.9,
                  "measured_seq_ms": 2.1}]}

  ``measured_*_ms`` are optional; when both are present they decide the verdict instead of the model.

Validation is plain Python (no jsonschema dependency); a violation raises :class:`ConfigError` naming the file
and the JSON path.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from flashoverlap_inductor.schedule.plan import COLLECTIVES, GroupPlan

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class GemmTimes(Protocol):
    """What the route models (``peer``, ``ring``) need of the GEMM wave model (``gemm.GemmModel``), in ms; an
    interface, so that the model that holds them need not be imported by them."""

    sm_count: int

    def gemm_ms(self, m: int, n: int, k: int, dtype: str, tile_m: int, tile_n: int, sms: int,
                efficiency: float = 1.0) -> float: ...

    def reference_ms(self, m: int, n: int, k: int, dtype: str) -> float: ...


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (torch name without prefix)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known {sorted(DTYPE_BYTES)}") from None

GEMM_GRIDS = ("persistent", "tiles")

BANDWIDTH_SCHEMA = "flashoverlap.bandwidth/1"
GEMM_SCHEMA = "flashoverlap.gemm/1"
PLANS_SCHEMA = "flashoverlap.plans/1"
KNOWN_KINDS = {"flashoverlap.bandwidth": BANDWIDTH_SCHEMA, "flashoverlap.gemm": GEMM_SCHEMA,
               "flashoverlap.plans": PLANS_SCHEMA}


class ConfigError(ValueError):
    """A shipped or user-supplied cost-model data file is malformed."""


def _fail(where: str, path: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {path}: {msg}")


def _require(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, path: str = "") -> Any:
    if not isinstance(doc, dict):
        raise _fail(where, path or "<root>", f"expected an object, got {type(doc).__name__}")
    if key not in doc:
        raise _fail(where, f"{path}.{key}" if path else key, "missing")
    value = doc[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise _fail(where, f"{path}.{key}" if path else key, f"expected {names}, got {value!r}")
    return value


def _positive(value: Any, where: str, path: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(where, path, f"expected a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise _fail(where, path, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def schema_kind(doc: Any) -> str | None:
    """The document's kind (``"flashoverlap.bandwidth"`` ...), or None for files that are not ours."""
    if not isinstance(doc, dict) or not isinstance(doc.get("schema"), str):
        return None
    kind = doc["schema"].split("/", 1)[0]
    return kind if kind in KNOWN_KINDS else None


def _check_header(doc: dict[str, Any], expected: str, where: str) -> None:
    schema = _require(doc, "schema", str, where)
    if schema != expected:
        raise _fail(where, "schema", f"unsupported version {schema!r}; this build reads {expected!r}")
    if not _require(doc, "gpu", str, where).strip():
        raise _fail(where, "gpu", "must not be empty")
    if _require(doc, "sm_count", int, where) < 1:
        raise _fail(where, "sm_count", "must be >= 1")
    _require(doc, "source", str, where)
    _require(doc, "date", str, where)


def validate_curve_points(points: Any, where: str, path: str) -> list[tuple[float, float]]:
    """``[[bytes, ms], ...]`` with bytes strictly increasing and both positive; returns float pairs."""
    if not isinstance(points, list) or not points:
        raise _fail(where, path, "expected a non-empty list of [bytes, ms] pairs")
    out: list[tuple[float, float]] = []
    for i, pair in enumerate(points):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _fail(where, f"{path}[{i}]", f"expected [bytes, ms], got {pair!r}")
        nbytes = _positive(pair[0], where, f"{path}[{i}][0] (bytes)")
        ms = _positive(pair[1], where, f"{path}[{i}][1] (ms)")
        if out and nbytes <= out[-1][0]:
            raise _fail(where, f"{path}[{i}][0]", f"bytes must increase strictly ({nbytes:g} after {out[-1][0]:g})")
        out.append((nbytes, ms))
    return out


# Curves a bandwidth file may have (bytes = the gathered buffer's): ``cost_model.gather`` uses reduce_scatter's
# on the same bytes where one is missing.
OPTIONAL_CURVES = ("all_gather",)


def validate_bandwidth(doc: Any, where: str) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """Check a ``flashoverlap.bandwidth/1`` document; returns ``{world: {collective: [(bytes, ms)]}}``."""
    if not isinstance(doc, dict):
        raise _fail(where, "<root>", "expected a JSON object")
    _check_header(doc, BANDWIDTH_SCHEMA, where)
    curves = _require(doc, "curves", dict, where)
    if not curves:
        raise _fail(where, "curves", "no world sizes")
    out: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for world_key, per_coll in curves.items():
        if not str(world_key).isdigit() or int(world_key) < 2:
            raise _fail(where, f"curves[{world_key!r}]", "keys must be world sizes >= 2 written as strings")
        if not isinstance(per_coll, dict):
            raise _fail(where, f"curves[{world_key!r}]", "expected an object of collectives")
        extra = set(per_coll) - set(COLLECTIVES) - set(OPTIONAL_CURVES)
        if extra:
            raise _fail(where, f"curves[{world_key!r}]", f"unknown collective(s) {sorted(extra)}")
        out[int(world_key)] = {}
        for coll in COLLECTIVES:
            if coll not in per_coll:
                raise _fail(where, f"curves[{world_key!r}].{coll}", "missing")
            out[int(world_key)][coll] = validate_curve_points(per_coll[coll], where, f"curves[{world_key!r}].{coll}")
        for coll in OPTIONAL_CURVES:
            if coll in per_coll:
                out[int(world_key)][coll] = validate_curve_points(per_coll[coll], where,
                                                                  f"curves[{world_key!r}].{coll}")
    return out


def validate_gemm(doc: Any, where: str) -> dict[str, Any]:
    """Check a ``flashoverlap.gemm/1`` document; returns it unchanged."""
    if not isinstance(doc, dict):
        raise _fail(where, "<root>", "expected a JSON object")
    _check_header(doc, GEMM_SCHEMA, where)
    model = _require(doc, "model", dict, where)
    tile = _require(model, "tile", list, where, "model")
    if len(tile) != 2 or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tile):
        raise _fail(where, "model.tile", f"expected [tile_m, tile_n] positive ints, got {tile!r}")
    _positive(_require(model, "peak_tflops", (int, float), where, "model"), where, "model.peak_tflops")
    for key in ("launch_ms", "wave_overhead_ms"):
        _positive(_require(model, key, (int, float), where, "model"), where, f"model.{key}", allow_zero=True)
    scales = _require(doc, "dtype_scale", dict, where)
    if not scales:
        raise _fail(where, "dtype_scale", "no dtypes")
    for name, value in scales.items():
        _positive(value, where, f"dtype_scale.{name}")
    fused = _require(doc, "fused", dict, where)
    nccl_sms = _require(fused, "nccl_sms", int, where, "fused")
    if not 0 <= nccl_sms < doc["sm_count"]:
        raise _fail(where, "fused.nccl_sms", f"must be in [0, sm_count={doc['sm_count']}), got {nccl_sms}")
    if fused.get("grid", "persistent") not in GEMM_GRIDS:
        raise _fail(where, "fused.grid", f"must be one of {GEMM_GRIDS}, got {fused.get('grid')!r}")
    if "group_overhead_ms" in fused:
        _positive(fused["group_overhead_ms"], where, "fused.group_overhead_ms", allow_zero=True)
    eff = _positive(_require(fused, "kernel_efficiency", (int, float), where, "fused"), where,
                    "fused.kernel_efficiency")
    if eff > 2:
        raise _fail(where, "fused.kernel_efficiency", f"implausible value {eff} (ratio to the fitted GEMM rate)")
    inter = _require(doc, "interference", dict, where)
    _positive(_require(inter, "gemm_slowdown_per_comm_ms", (int, float), where, "interference"), where,
              "interference.gemm_slowdown_per_comm_ms", allow_zero=True)
    if "peer" in doc:
        _validate_peer(doc["peer"], where)
    if "sequential" in doc:
        _validate_sequential(doc["sequential"], where)
    if "ring" in doc:
        _validate_ring(doc["ring"], where)
    if "gather_peer" in doc:
        section = doc["gather_peer"]
        if not isinstance(section, dict):
            raise _fail(where, "gather_peer", "expected a JSON object")
        _validate_terms(section, where, "gather_peer")
    for name in ("scatter_pull", "all_reduce_pull"):
        if name not in doc:
            continue
        section = doc[name]
        if not isinstance(section, dict):
            raise _fail(where, name, "expected a JSON object")
        _positive(_require(section, "gemm_factor", (int, float), where, name), where, f"{name}.gemm_factor")
        for key in ("fixed_ms", "add_factor"):
            _positive(_require(section, key, (int, float), where, name), where, f"{name}.{key}", allow_zero=True)
        _positive(section.get("host_floor_ms", 0.0), where, f"{name}.host_floor_ms", allow_zero=True)
    if "moe" in doc:
        _validate_moe(doc["moe"], where)
    rows = doc.get("anchor_rows", [])
    if not isinstance(rows, list):
        raise _fail(where, "anchor_rows", "expected a list")
    for i, row in enumerate(rows):
        for key in ("m", "n", "k"):
            if _require(row, key, int, where, f"anchor_rows[{i}]") < 1:
                raise _fail(where, f"anchor_rows[{i}].{key}", "must be >= 1")
        _positive(_require(row, "gemm_ms", (int, float), where, f"anchor_rows[{i}]"), where,
                  f"anchor_rows[{i}].gemm_ms")
    return doc


SKEW_FRACTION_MAX = 0.5  # the largest skew_fraction of a "sequential" section (more is a measurement gone wrong)


def _validate_sequential(seq: Any, where: str) -> None:
    """The optional ``sequential`` section: per world size (a string of an int >= 2) and collective, a skew
    fraction in [0, ``SKEW_FRACTION_MAX``]."""
    if not isinstance(seq, dict) or not isinstance(seq.get("fit", {}), dict):
        raise _fail(where, "sequential", "expected a JSON object (with an object 'fit', if any)")
    for world, per in _require(seq, "skew_fraction", dict, where, "sequential").items():
        if not (isinstance(world, str) and world.isdigit() and int(world) >= 2) or not isinstance(per, dict):
            raise _fail(where, f"sequential.skew_fraction.{world}", "expected a world size >= 2 -> {collective: x}")
        for name, frac in per.items():
            path = f"sequential.skew_fraction.{world}.{name}"
            if name not in COLLECTIVES:
                raise _fail(where, path, f"unknown collective; expected one of {COLLECTIVES}")
            if _positive(frac, where, path, allow_zero=True) > SKEW_FRACTION_MAX:
                raise _fail(where, path, f"must be <= {SKEW_FRACTION_MAX}")


def _validate_peer(peer: Any, where: str) -> None:
    """The optional ``peer`` section (``cost_model/peer.py``): world_size >= 2 and, per collective, gemm_factor > 0,
    fixed_ms >= 0 and, if present, host_floor_ms >= 0 and 0 < link_efficiency <= 1."""
    if not isinstance(peer, dict):
        raise _fail(where, "peer", "expected a JSON object")
    if _require(peer, "world_size", int, where, "peer") < 2:
        raise _fail(where, "peer.world_size", "must be >= 2")
    if not isinstance(peer.get("fit", {}), dict):
        raise _fail(where, "peer.fit", "expected a JSON object")
    _validate_route_terms(_require(peer, "collectives", dict, where, "peer"), where, "peer.collectives")


def _validate_ring(ring: Any, where: str) -> None:
    """The optional ``ring`` section (``cost_model/ring.py``): per world size >= 2 and collective, terms as the peer
    section's."""
    if not isinstance(ring, dict):
        raise _fail(where, "ring", "expected a JSON object")
    if not isinstance(ring.get("fit", {}), dict):
        raise _fail(where, "ring.fit", "expected a JSON object")
    for w, colls in _require(ring, "worlds", dict, where, "ring").items():
        if not str(w).isdigit() or int(w) < 2:
            raise _fail(where, f"ring.worlds.{w}", "world sizes are integers >= 2")
        if not isinstance(colls, dict):
            raise _fail(where, f"ring.worlds.{w}", "expected a JSON object")
        _validate_route_terms(colls, where, f"ring.worlds.{w}")


ROUTE_COLLECTIVES = ("all_reduce", "reduce_scatter")  # what the peer and ring routes run


def _validate_route_terms(colls: dict[str, Any], where: str, path: str) -> None:
    """Per collective of ``ROUTE_COLLECTIVES``: gemm_factor > 0, fixed_ms >= 0 and, if present, host_floor_ms >= 0
    and 0 < link_efficiency <= 1 (``peer.PeerTerms``)."""
    for name, terms in colls.items():
        here = f"{path}.{name}"
        if name not in ROUTE_COLLECTIVES:
            raise _fail(where, here, f"not a collective of the route; expected one of {ROUTE_COLLECTIVES}")
        if not isinstance(terms, dict):
            raise _fail(where, here, "expected a JSON object")
        _validate_terms(terms, where, here)


def _validate_terms(terms: dict[str, Any], where: str, here: str) -> None:
    """One route's terms (``peer.PeerTerms``): gemm_factor > 0, fixed_ms >= 0 and, if present, host_floor_ms >= 0
    and 0 < link_efficiency <= 1."""
    _positive(_require(terms, "gemm_factor", (int, float), where, here), where, f"{here}.gemm_factor")
    _positive(_require(terms, "fixed_ms", (int, float), where, here), where, f"{here}.fixed_ms", allow_zero=True)
    if "host_floor_ms" in terms:
        _positive(terms["host_floor_ms"], where, f"{here}.host_floor_ms", allow_zero=True)
    if "link_efficiency" in terms and _positive(terms["link_efficiency"], where, f"{here}.link_efficiency") > 1:
        raise _fail(where, f"{here}.link_efficiency", "must be <= 1")


def _validate_moe(section: Any, where: str) -> None:
    """The ``moe`` section (``moe.MoeTerms`` per op)."""
    if not isinstance(section, dict):
        raise _fail(where, "moe", "expected a JSON object")
    for op, terms in section.items():
        if op in ("fit", "note"):
            continue
        here = f"moe.{op}"
        if op not in ("dispatch", "combine") or not isinstance(terms, dict):
            raise _fail(where, here, "expected 'dispatch' or 'combine' with a JSON object of terms")
        for key in ("factor", "moves_bytes_per_ms", "unfused_bytes_per_ms"):
            _positive(_require(terms, key, (int, float), where, here), where, f"{here}.{key}")
        _positive(_require(terms, "host_floor_ms", (int, float), where, here), where, f"{here}.host_floor_ms",
                  allow_zero=True)
        if _positive(terms.get("model_error", 0.0), where, f"{here}.model_error", allow_zero=True) >= 0.5:
            raise _fail(where, f"{here}.model_error", "must be in [0, 0.5)")


def validate_plans(doc: Any, where: str) -> list[dict[str, Any]]:
    """Check a ``flashoverlap.plans/1`` document; returns its entries, each with a parsed ``GroupPlan``
    under ``"group_plan"``."""
    if not isinstance(doc, dict):
        raise _fail(where, "<root>", "expected a JSON object")
    _check_header(doc, PLANS_SCHEMA, where)
    entries = _require(doc, "entries", list, where)
    out = []
    for i, entry in enumerate(entries):
        path = f"entries[{i}]"
        for key in ("world_size", "m", "n", "k"):
            if _require(entry, key, int, where, path) < 1:
                raise _fail(where, f"{path}.{key}", "must be >= 1")
        if _require(entry, "collective", str, where, path) not in COLLECTIVES:
            raise _fail(where, f"{path}.collective", f"must be one of {COLLECTIVES}, got {entry['collective']!r}")
        _require(entry, "dtype", str, where, path)
        text = _require(entry, "plan", str, where, path)
        try:
            plan = GroupPlan.from_str(text)
        except (ValueError, KeyError) as exc:
            raise _fail(where, f"{path}.plan", f"not a valid GroupPlan string ({exc})") from None
        if (plan.m, plan.n) != (entry["m"], entry["n"]):
            raise _fail(where, f"{path}.plan", f"plan is for m={plan.m}, n={plan.n}, entry says "
                        f"m={entry['m']}, n={entry['n']}")
        for key in ("measured_fused_ms", "measured_seq_ms"):
            if key in entry:
                _positive(entry[key], where, f"{path}.{key}")
        out.append({**entry, "group_plan": plan})
    return out
