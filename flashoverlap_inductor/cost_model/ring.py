"""Time model of the ring route (``flashoverlap_inductor.routes.ring``): partial sums passed around the ranks, the
reduction in the GEMM steps' epilogues.

The route cuts the ``[M, N]`` output into ``world * rounds`` pieces of ``p = M / (world * rounds)`` rows
(``rounds_for``). Per round every rank runs ``world`` GEMM steps of ``p`` rows on every SM; each step but the last
stores its piece into the previous rank's memory (rank ``r - 1``), and each later step waits for the piece it adds.
all_reduce then pulls the ``world - 1`` pieces the other ranks finished (copy engines, during the next round), and
ends with a barrier. Per collective and world size, in ms::

    T_ring = max(host_floor_ms, gemm_factor * x + fixed_ms)
    x      = sum over rounds t of max((world - 1) * max(T_ref(p), B / L) + T_ref(p), traffic_t * B / L)  +  tail
    traffic_t = (world - 1) pushes + (all_reduce and t > 0: world - 1 pulls of the round before)
    tail   = all_reduce: (world - 1) * B / L (the last round's pulls); reduce_scatter: 0
    L      = link_efficiency * link

``T_ref(p)`` is the fitted wave model's time of a step on all SMs in the tile ``step_tile`` picks
(``GemmModel.gemm_ms``; in the reference tile, 128x256, it is ``reference_ms``), ``B`` the bytes of one piece and
``link`` the NVLink rate per rank in bytes per ms (``CostModel.link_bytes_per_ms``): a step cannot end before its
push has crossed the link, nor a round before what the rank receives in it. ``gemm_factor`` (> 0) holds the steps'
split and their waits on the slowest rank, ``fixed_ms`` (>= 0) the flags, the barrier and the launches,
``link_efficiency`` (0 .. 1) the fraction of ``link`` reached beside the GEMMs, ``host_floor_ms`` (>= 0) the time
per call where the host is the limit (about ``4 * world * rounds`` launches; none from CUDA graphs). The terms are
the peer model's (``peer.PeerTerms``), fitted the same way (``peer.fit_linear``), per world size, to the benchmark's
ring variants (``tune fit --ring``); the data file's ``ring`` section::

    "ring": {"worlds": {"4": {"all_reduce": {"gemm_factor": 1.1, "fixed_ms": 0.05, "link_efficiency": 0.9},
                              "reduce_scatter": {...}}},
             "fit": {"4": {"all_reduce": {"rows": 32, "median_rel_error": 0.03, ...}}}, "note": "..."}

``rounds_for`` is the route's one rule for its rounds; ``flashoverlap_inductor.routes.ring`` calls it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .peer import PeerTerms, fit_linear
from .schema import ROUTE_COLLECTIVES, GemmTimes, dtype_bytes

MIN_PIECE_ROWS = 128  # a piece below one tile-row of the 128-row tiles wastes most of its GEMM
COLLECTIVES = ROUTE_COLLECTIVES
# The tiles of the steps' configurations the library compiles (flashoverlap_inductor/build.py), preferred first
STEP_TILES = ((128, 256), (128, 128))


def step_tile(rows: int, n: int, sm_count: int, tiles: Sequence[tuple[int, int]] = STEP_TILES) -> tuple[int, int]:
    """The tile of a ring step of ``rows x n`` on ``sm_count`` SMs: the first of ``tiles`` (the preferred), unless
    its tiles fill less than one wave; then the one with the least waves x tile area (a wave's time grows with its
    tiles' area), the first on ties. 128x256 tiles leave half of 132 SMs idle at 256 x 8192 (64 tiles, measured at
    1.7x ``torch.mm``'s time); 128x128 fill them in one wave of half the work. Steps of a full wave or more keep the
    preferred tile (the smaller one is not timed there). The runtime (``routes.ring.step_configs``) and the model
    both choose with it."""
    def count(tile: tuple[int, int]) -> int:
        return -(-rows // tile[0]) * -(-n // tile[1])

    if count(tiles[0]) >= sm_count:
        return tiles[0]
    return min(tiles, key=lambda t: -(-count(t) // sm_count) * t[0] * t[1])  # min keeps the first of equal costs


def rounds_for(collective: str, rows_total: int, world: int, max_rounds: int) -> int | None:
    """Rounds of a ring call: reduce_scatter 1; all_reduce the most rounds up to ``max_rounds`` that cut
    ``rows_total`` into ``world * rounds`` equal pieces of at least ``MIN_PIECE_ROWS`` rows (None: not even one
    round does)."""
    most = max_rounds if collective == "all_reduce" else 1
    for rounds in range(most, 0, -1):
        pieces = world * rounds
        if rows_total % pieces == 0 and rows_total // pieces >= MIN_PIECE_ROWS:
            return rounds
    return None


@dataclass(frozen=True)
class RingModel:
    """The ``ring`` section of a GEMM data file: terms per world size and collective."""

    terms: Mapping[int, Mapping[str, PeerTerms]]
    fit: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @staticmethod
    def from_json(section: Mapping[str, Any]) -> RingModel:
        """From a ``ring`` section already checked by ``schema.validate_gemm``."""
        terms = {int(w): {name: PeerTerms(float(t["gemm_factor"]), float(t["fixed_ms"]),
                                          float(t.get("host_floor_ms", 0.0)), float(t.get("link_efficiency", 1.0)))
                          for name, t in per.items()}
                 for w, per in section["worlds"].items()}
        return RingModel(terms, dict(section.get("fit", {})))

    def covers(self, collective: str, world_size: int) -> bool:
        """Whether this model has terms for the call."""
        return collective in self.terms.get(world_size, {})

    def predict_ms(self, gemm: GemmTimes, collective: str, m: int, n: int, k: int, dtype: str, world_size: int,
                   rounds: int, link_bytes_per_ms: float = math.inf, host_bound: bool = True) -> float:
        """T_ring in ms (raises ValueError where the model has no terms). ``host_bound=False``: calls replayed from
        a CUDA graph (no ``host_floor_ms``)."""
        if not self.covers(collective, world_size):
            raise ValueError(f"ring model: no terms for {collective!r} on {world_size} ranks")
        t = self.terms[world_size][collective]
        floor = t.host_floor_ms if host_bound else 0.0
        x = steps_ms(gemm, collective, m, n, k, dtype, world_size, rounds, link_bytes_per_ms * t.link_efficiency)
        return max(floor, t.gemm_factor * x + t.fixed_ms)


def steps_ms(gemm: GemmTimes, collective: str, m: int, n: int, k: int, dtype: str, world_size: int, rounds: int,
             link_bytes_per_ms: float = math.inf) -> float:
    """The regressor ``x`` of the module docstring (ms): the rounds' GEMM steps, each bounded by its push, each round
    by the pieces the rank receives in it, and all_reduce's last gather."""

    if world_size < 2 or rounds < 1:
        raise ValueError(f"ring model: world size {world_size} and rounds {rounds} (need >= 2 and >= 1)")
    p = m // (world_size * rounds)
    if p < 1:
        raise ValueError(f"ring model: {m} rows do not make {world_size * rounds} pieces")
    piece = p * n * dtype_bytes(dtype) / link_bytes_per_ms  # ms for one piece over the link
    gemm_ms = gemm.gemm_ms(p, n, k, dtype, *step_tile(p, n, gemm.sm_count), gemm.sm_count)
    step = max(gemm_ms, piece)
    ar = collective == "all_reduce"
    total = 0.0
    compute = (world_size - 1) * step + gemm_ms  # the last step pushes nothing
    for t in range(rounds):
        traffic = (world_size - 1) * (2 if ar and t > 0 else 1)
        total += max(compute, traffic * piece)
    return total + ((world_size - 1) * piece if ar else 0.0)


def fit_terms(gemm: GemmTimes, collective: str, world_size: int, rows: Sequence[tuple[int, int, int, int, float]],
              dtype: str = "bfloat16", link_bytes_per_ms: float = math.inf) -> PeerTerms:
    """``gemm_factor``, ``fixed_ms`` and ``link_efficiency`` minimizing the mean relative error over ``rows`` of
    ``(m, n, k, rounds, measured_ms)`` of one collective and world size (without the host floor;
    ``peer.fit_linear``)."""
    rows = [r for r in rows if r[4] > 0 and math.isfinite(r[4])]
    if len(rows) < 2:
        raise ValueError(f"ring fit: need >= 2 measured rows, got {len(rows)}")
    factor, fixed, eff = fit_linear(
        lambda eff: [(steps_ms(gemm, collective, m, n, k, dtype, world_size, q, link_bytes_per_ms * eff), ms)
                     for m, n, k, q, ms in rows],
        math.isfinite(link_bytes_per_ms))
    return PeerTerms(factor, fixed, 0.0, eff)


def relative_errors(gemm: GemmTimes, collective: str, world_size: int, terms: PeerTerms,
                    rows: Sequence[tuple[int, int, int, int, float]], dtype: str = "bfloat16",
                    link_bytes_per_ms: float = math.inf) -> list[float]:
    """|predicted - measured| / measured per row of ``(m, n, k, rounds, measured_ms)``."""
    model = RingModel({world_size: {collective: terms}})
    return [abs(model.predict_ms(gemm, collective, m, n, k, dtype, world_size, q, link_bytes_per_ms) - ms) / ms
            for m, n, k, q, ms in rows]
