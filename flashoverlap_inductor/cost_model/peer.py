"""Time model of the peer route (``flashoverlap_inductor.routes.peer``): two ranks, the reduction in GEMM 2's epilogue.

The route runs two GEMMs of half the rows each on every SM -- the rows the peer owns (stored into the peer's
memory), then this rank's own rows with the peer's partial added as the epilogue's C operand -- and, for
all_reduce, a flag each way and a copy of the half the peer computed. No NCCL runs beside the GEMMs, so the
communication shows only as a slower GEMM and a fixed tail. Per collective, in ms::

    T_peer = max(host_floor_ms,
                 gemm_factor * (max(T_ref(ceil(m / 2)), B / L) + max(T_ref(floor(m / 2)), s * B / L)) + fixed_ms)
    L      = link_efficiency * link

``T_ref(rows)`` is ``GemmModel.reference_ms(rows, n, k)`` (the fitted cuBLAS wave model on all SMs, as T_seq uses
it). ``B`` is the bytes of one half of the output, which each GEMM stores over NVLink (GEMM 1 its result, all_reduce's
GEMM 2 its aux copy; ``s`` = 1 for all_reduce, 0 for reduce_scatter), and ``link`` the one-direction NVLink rate in
bytes per ms (``CostModel.peer_ms`` takes NCCL's all_reduce rate from the bandwidth curve's tail): a GEMM cannot end
before its stores have crossed the link. ``gemm_factor`` (> 0; about 1.05 on H200) holds the GEMM's split in two
and its remote stores; ``fixed_ms`` (>= 0) the gate, the flags and, for all_reduce, the final copy;
``link_efficiency`` (0 .. 1, optional, default 1) the fraction of ``link`` the stores reach beside the GEMM;
``host_floor_ms`` (>= 0, optional) the time per call when the host is the limit: back-to-back calls of a small
shape cannot go faster than the host issues them (``examples/device/peer_host_profile.py`` measures it;
``tune fit --peer --host-floor`` stores it; calls replayed from a CUDA graph have none). ``fit_terms`` fits
``gemm_factor``, ``fixed_ms`` and ``link_efficiency`` to measured T_fused rows that ran on the route (least relative
error); ``tune fit --peer`` runs it on benchmark JSON and writes the ``peer`` section of the GPU's
``flashoverlap.gemm/1`` file::

    "peer": {"world_size": 2,
             "collectives": {"all_reduce": {"gemm_factor": 1.08, "fixed_ms": 0.063}, "reduce_scatter": {...}},
             "fit": {...}, "note": "..."}

The model describes the route as it runs by default (``PARTIAL = "push"``, all_reduce by GEMM 2's aux push); the
other settings of the peer route run variants it was not fitted to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .schema import GemmTimes, dtype_bytes


@dataclass(frozen=True)
class PeerTerms:
    """One collective's numbers (see the module docstring)."""

    gemm_factor: float
    fixed_ms: float
    host_floor_ms: float = 0.0
    link_efficiency: float = 1.0  # the fraction of ``link`` the GEMMs' NVLink stores reach


@dataclass(frozen=True)
class PullTerms:
    """A pull route's numbers (``pull.py``; the data file's ``scatter_pull`` section for reduce_scatter, its
    ``all_reduce_pull`` section for all_reduce)."""

    gemm_factor: float  # times the full GEMM's reference time: the cuBLAS GEMMs beside the copy engine's moves
    fixed_ms: float  # the handshake, the flags and the launches' gaps
    add_factor: float  # times copy(rows * n * itemsize): the adds and the moves' share of HBM (and the tail)
    host_floor_ms: float = 0.0  # back-to-back eager calls cannot go faster (CUDA graphs: none)

    @staticmethod
    def from_json(section: dict | None) -> PullTerms | None:
        """The terms of a validated section (None: no section)."""
        if section is None:
            return None
        return PullTerms(*(float(section[key]) for key in ("gemm_factor", "fixed_ms", "add_factor")),
                         float(section.get("host_floor_ms", 0.0)))

    def predict_ms(self, gemm: GemmTimes, rows: int, n: int, k: int, dtype: str, copy_output_ms: float,
                   host_bound: bool = True) -> float:
        """``T_pull`` (``pull.py``) in ms of ``[rows, k] @ [k, n]`` then the terms' collective on 2 ranks;
        ``copy_output_ms``:
        the time to move ``rows * n * itemsize`` bytes through device memory (``cost_model.copy_ms``).
        ``host_bound=False``: replayed from a CUDA graph (no ``host_floor_ms``), the GPU's time alone."""
        gpu = self.fixed_ms + self.gemm_factor * gemm.reference_ms(rows, n, k, dtype) + self.add_factor * copy_output_ms
        return max(gpu, self.host_floor_ms) if host_bound else gpu


@dataclass(frozen=True)
class PeerModel:
    """The ``peer`` section of a GEMM data file: terms per collective, for ``world_size`` ranks only."""

    world_size: int
    terms: Mapping[str, PeerTerms]
    fit: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @staticmethod
    def from_json(section: Mapping[str, Any]) -> PeerModel:
        """From a ``peer`` section already checked by ``schema.validate_gemm``."""
        terms = {name: PeerTerms(float(t["gemm_factor"]), float(t["fixed_ms"]), float(t.get("host_floor_ms", 0.0)),
                                 float(t.get("link_efficiency", 1.0)))
                 for name, t in section["collectives"].items()}
        return PeerModel(int(section["world_size"]), terms, dict(section.get("fit", {})))

    def covers(self, collective: str, world_size: int, m: int) -> bool:
        """Whether this model predicts the call (the route itself also needs even rows)."""
        return collective in self.terms and world_size == self.world_size and m >= 2 and m % 2 == 0

    def predict_ms(self, gemm: GemmTimes, collective: str, m: int, n: int, k: int, dtype: str,
                   link_bytes_per_ms: float = math.inf, host_bound: bool = True) -> float:
        """T_peer in ms (raises ValueError for a collective without terms). ``host_bound=False``: calls replayed
        from a CUDA graph, which the host does not issue one by one (no ``host_floor_ms``)."""
        if collective not in self.terms:
            raise ValueError(f"peer model: no terms for {collective!r}; has {sorted(self.terms)}")
        t = self.terms[collective]
        link = link_bytes_per_ms * t.link_efficiency
        floor = t.host_floor_ms if host_bound else 0.0
        return max(floor, t.gemm_factor * gemms_ms(gemm, collective, m, n, k, dtype, link) + t.fixed_ms)


def gemms_ms(gemm: GemmTimes, collective: str, m: int, n: int, k: int, dtype: str,
             link_bytes_per_ms: float = math.inf) -> float:
    """The route's two GEMMs (ms): each half's reference time, or its NVLink stores' time where longer. The model's
    one regressor."""

    half = -(-m // 2) * n * dtype_bytes(dtype) / link_bytes_per_ms
    first = max(gemm.reference_ms(-(-m // 2), n, k, dtype), half)
    second = gemm.reference_ms(m // 2, n, k, dtype)
    return first + (max(second, half) if collective == "all_reduce" else second)


def fit_terms(gemm: GemmTimes, collective: str, rows: Sequence[tuple[int, int, int, float]], dtype: str = "bfloat16",
              link_bytes_per_ms: float = math.inf) -> PeerTerms:
    """``gemm_factor``, ``fixed_ms`` (both >= 0) and ``link_efficiency`` (0.5 .. 1 by 0.05) that minimize the mean
    |predicted - measured| / measured over ``rows`` of ``(m, n, k, measured_ms)`` of one collective (without the
    host floor; ``fit_linear``)."""
    rows = [(m, n, k, ms) for m, n, k, ms in rows if ms > 0 and math.isfinite(ms)]
    if len(rows) < 2:
        raise ValueError(f"peer fit: need >= 2 measured rows, got {len(rows)}")
    factor, fixed, eff = fit_linear(
        lambda eff: [(gemms_ms(gemm, collective, m, n, k, dtype, link_bytes_per_ms * eff), ms) for m, n, k, ms in rows],
        math.isfinite(link_bytes_per_ms))
    return PeerTerms(factor, fixed, 0.0, eff)


def fit_linear(points_at: Callable[[float], list[tuple[float, float]]], link_matters: bool = True
               ) -> tuple[float, float, float]:
    """``(factor, fixed, link_efficiency)`` minimizing the mean |factor * x + fixed - y| / y over
    ``points_at(link_efficiency)`` = ``[(x, y), ...]`` (regressor and measured ms): least absolute error, so one
    disturbed row does not move the fit. Link efficiencies 1.0 .. 0.5 by 0.05 (only 1.0 unless ``link_matters``);
    for each, every factor on a 0.002 grid over [0.5, 2], the best ``fixed`` (>= 0) a weighted median of
    ``y - factor * x`` (weights 1 / y). The route models' (peer, ring) one fitting procedure."""
    best: tuple[float, tuple[float, float, float]] | None = None
    for eff in [1.0 - 0.05 * i for i in range(11)] if link_matters else [1.0]:
        pts = points_at(eff)
        for step in range(250, 1001):
            factor = step / 500
            fixed = max(0.0, _weighted_median([(y - factor * x, 1.0 / y) for x, y in pts]))
            cost = sum(abs(factor * x + fixed - y) / y for x, y in pts)
            if best is None or cost < best[0] - 1e-12:
                best = (cost, (factor, fixed, round(eff, 2)))
    assert best is not None
    return best[1]


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    """The value v minimizing sum(w * |x - v|) over ``(x, w)`` pairs."""
    pairs = sorted(pairs)
    half, acc = sum(w for _, w in pairs) / 2, 0.0
    for x, w in pairs:
        acc += w
        if acc >= half:
            return x
    return pairs[-1][0]


def relative_errors(gemm: GemmTimes, collective: str, terms: PeerTerms, rows: Sequence[tuple[int, int, int, float]],
                    dtype: str = "bfloat16", link_bytes_per_ms: float = math.inf) -> list[float]:
    """|predicted - measured| / measured per row."""
    model = PeerModel(2, {collective: terms})
    return [abs(model.predict_ms(gemm, collective, m, n, k, dtype, link_bytes_per_ms) - ms) / ms
            for m, n, k, ms in rows]
