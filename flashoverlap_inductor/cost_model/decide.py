"""``decide``: should one GEMM + collective be fused, and with which wave groups?

Order of sources for the plan: a tuned plan from ``configs/plans/*.json`` for exactly this
``(GPU, SM count, world size, collective, dtype, m, n, k)`` (never for all_to_all with ``input_split_sizes``,
whose ``m`` may differ between ranks); else, for all_to_all with ``input_split_sizes``,
``config.all_to_all_default_groups`` equal fractions (every rank must cut at the same fractions, and ranks may
hold different rows, so nothing rank-specific may choose them); else the predictive search (``search.py``).

Verdict (``fuse``): the plan has >= 2 groups, ``m >= config.min_rows``, and
``fused <= (1 - config.min_gain_fraction - e) * sequential``, where both times are measured ones from the plan
table when it has them and the model's predictions otherwise; ``e`` = ``gain.model_error`` (all_to_all's NCCL route
errs most, and its measured times vary between runs; more so on another GPU's data). ``plan`` is returned even
when ``fuse`` is False (fuse mode "always" uses it).

``peer=True`` says the call will take the peer route (``flashoverlap_inductor.routes.select`` picks it): where the
data has a peer model for it (``peer.py``), ``fused`` is that model's time and the verdict needs no groups
(``route`` "peer"); the plan is still the NCCL route's, for a call that falls back to it at run time. ``pull=True``
likewise for the pull routes of reduce_scatter and all_reduce on 2 ranks (``pull.py``; route "pull").
``ring_rounds=R`` > 0 says the call will take the ring route in ``R`` rounds (``routes.select`` picks it,
``routes.ring.rounds``) and works the same way with the data's ring model (``ring.py``; ``route`` "ring").

``decide`` never raises for positive sizes and a known collective: problems it cannot fuse (indivisible rows,
a dtype without data, a world of one rank) come back as ``fuse=False`` with the reason; times it cannot predict
are ``nan`` (unknown dtype) or ``inf`` (a fused layout that cannot exist). Results are memoized on every input,
including the config settings they depend on; ``clear_caches`` resets them.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flashoverlap_inductor import config
from flashoverlap_inductor.schedule import steps
from flashoverlap_inductor.schedule.plan import COLLECTIVES, GroupPlan, chunks_for

from . import gain, registry
from .pipeline import DTYPE_BYTES, CostModel
from .ring import rounds_for
from .search import DEFAULT_TILE, predictive_search

log = logging.getLogger("flashoverlap")


@dataclass(frozen=True)
class Decision:
    """The cost model's answer for one GEMM + collective (times in ms)."""

    fuse: bool  # the "auto" verdict
    plan: GroupPlan  # best plan of >= 2 groups where the rows allow (fuse mode "always" runs it regardless)
    predicted_fused_ms: float
    predicted_seq_ms: float
    reason: str  # human-readable
    route: str = "nccl"  # the fused path predicted_fused_ms is for: "nccl" (wave groups + NCCL), "peer", "ring", "pull"
    error_allowance: float = 0.0  # gain.model_error's fraction the verdict added to min_gain_fraction


def decide(collective: str, m: int, n: int, k: int, dtype: str, world_size: int, *,
           device_name: str | None = None, input_split_sizes: Sequence[int] | None = None,
           peer: bool = False, ring_rounds: int = 0, pull: bool = False, cuda_graphs: bool = False,
           settings: config.Settings | None = None) -> Decision:
    """Decide fusion of ``[m, k] @ [k, n]`` followed by ``collective`` over ``world_size`` ranks, under
    ``settings`` (the caller's: the pass's or the fused call's; None: ``config.current()``, for direct callers).

    ``dtype``: torch dtype name without prefix ("bfloat16"). ``device_name``: ``torch.cuda.get_device_name()``
    (None = the default GPU, "NVIDIA H200"). ``input_split_sizes``: all_to_all's per-destination rows of this
    rank (None = even splits; ignored for the other collectives). ``peer``: the call takes the peer route;
    ``ring_rounds``: the rounds it takes the ring in (0: not the ring; see the module docstring); ``pull``: the call
    takes the reduce_scatter pull route (``pull.py``; route "pull"). ``cuda_graphs``: the peer, ring and pull routes'
    host floors do not apply: the call is replayed from a CUDA graph (if the graph is not made after all, the call
    runs eagerly and may be host-bound), or the settings leave the floors out (``config.Settings.host_floors``).
    Raises ``ValueError`` only for an unknown collective or non-positive sizes (and ``ConfigError`` for malformed
    data files).
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
    for name, value in (("m", m), ("n", n), ("k", k), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"decide: {name} must be a positive int, got {value!r}")
    splits = None
    if collective == "all_to_all" and input_split_sizes is not None:
        splits = tuple(int(x) for x in input_split_sizes)
    s = settings or config.current()
    return _decide(collective, m, n, k, dtype, world_size, device_name, splits, registry.data_dir(s),
                   float(s.min_gain_fraction), int(s.min_rows), int(s.all_to_all_default_groups),
                   bool(peer), int(ring_rounds), bool(pull), bool(cuda_graphs))


def _ratio(fused: float, seq: float) -> str:
    return f"{seq / fused:.2f}x" if fused > 0 and math.isfinite(fused) else "n/a"


@functools.lru_cache(maxsize=4096)
def _decide(collective: str, m: int, n: int, k: int, dtype: str, world_size: int, device_name: str | None,
            splits: tuple[int, ...] | None, directory: Path, min_gain: float, min_rows: int,
            a2a_groups: int, peer: bool, ring_rounds: int, pull: bool, cuda_graphs: bool) -> Decision:
    tile_m, tile_n = DEFAULT_TILE
    single = GroupPlan(m, n, tile_m, tile_n, (0, m))
    model, how = registry.model_for(device_name, directory)
    data_note = "" if how == "exact" else f" [{how} match: using data of {model.gemm.gpu}]"
    nan, inf = float("nan"), float("inf")
    if dtype not in DTYPE_BYTES or not model.gemm.supports(dtype):
        return Decision(False, single, nan, nan, f"declined: no cost data for dtype {dtype!r}{data_note}")
    seq = model.seq_ms(collective, m, n, k, dtype, world_size)
    if world_size == 1:
        return Decision(False, single, seq, seq, f"declined: world size 1, nothing to communicate{data_note}")
    if splits is not None and (len(splits) != world_size or sum(splits) != m or min(splits) < 0):
        return Decision(False, single, inf, seq, f"declined: input_split_sizes {list(splits)} do not split "
                        f"{m} rows among {world_size} ranks{data_note}")
    try:
        chunks = chunks_for(collective, m, world_size, splits)
    except ValueError as exc:
        return Decision(False, single, inf, seq, f"declined: {exc}{data_note}")

    # not for all_to_all with input_split_sizes: ranks may hold different rows, and a plan keyed by this rank's
    # rows could then differ from its peers' (other group cuts, mismatched collectives)
    tuned = None if splits is not None else registry.tuned_plan(device_name, model.gemm.sm_count, world_size,
                                                                 collective, dtype, m, n, k, directory)
    plan, source = _choose_plan(model, tuned, collective, m, n, k, dtype, world_size, chunks, splits, a2a_groups)
    route = "ring" if ring_rounds > 0 else "pull" if pull else "peer" if peer else None
    if route == "ring" and rounds_for(collective, m, world_size, ring_rounds) != ring_rounds:
        data_note += (f" [ring_rounds={ring_rounds} does not cut {m} rows into pieces of the ring: predicting the NCCL "
                      "route]")
        route = None
    if route == "ring":
        route_fused = model.ring_ms(collective, m, n, k, dtype, world_size, ring_rounds, host_bound=not cuda_graphs)
    elif route == "peer":
        route_fused = model.peer_ms(collective, m, n, k, dtype, world_size, host_bound=not cuda_graphs)
    elif route == "pull" and world_size == 2 and model.gemm.pull_terms(collective) is not None:
        route_fused = model.gemm.pull_terms(collective).predict_ms(  # pull.py's T_pull
            model.gemm, m, n, k, dtype, copy_ms(m * n * DTYPE_BYTES[dtype], device_name), host_bound=not cuda_graphs)
    else:
        route_fused = None
    if route_fused is not None:
        return _route_verdict(route, route_fused, seq, m, plan, min_gain, min_rows, data_note)
    if route is not None:
        data_note += f" [no {route}-route model in the data: predicting the NCCL route]"
    fused = model.fused(plan, collective, chunks, k, dtype, world_size).total_ms
    verdict_fused, verdict_seq, what = fused, seq, "predicted"
    if tuned is not None and plan is tuned.plan and tuned.measured_fused_ms and tuned.measured_seq_ms:
        verdict_fused, verdict_seq, what = tuned.measured_fused_ms, tuned.measured_seq_ms, "measured"
    groups = f"{plan.num_groups} group{'s' if plan.num_groups > 1 else ''}"
    summary = (f"{what} {verdict_fused:.3f} ms fused ({groups}, {source}) vs "
               f"{verdict_seq:.3f} ms sequential ({_ratio(verdict_fused, verdict_seq)}){data_note}")
    if plan.num_groups < 2:
        return Decision(False, plan, fused, seq, f"declined: too few rows for two groups; {summary}")
    error = gain.model_error(collective, None, how in ("exact", "family"), measured=what == "measured")
    fuse, reason = gain.verdict(verdict_fused, verdict_seq, m, min_gain, min_rows, summary, error)
    return Decision(fuse, plan, fused, seq, reason, error_allowance=error)


def _route_verdict(route: str, fused: float, seq: float, m: int, plan: GroupPlan, min_gain: float, min_rows: int,
                   data_note: str) -> Decision:
    """The verdict for a call on the peer or ring route (no wave groups to check)."""
    summary = (f"predicted {fused:.3f} ms fused ({route} route) vs {seq:.3f} ms sequential ({_ratio(fused, seq)})"
               f"{data_note}")
    fuse, reason = gain.verdict(fused, seq, m, min_gain, min_rows, summary)
    return Decision(fuse, plan, fused, seq, reason, route)


def _choose_plan(model: CostModel, tuned: registry.TunedPlan | None, collective: str, m: int, n: int, k: int,
                 dtype: str, world_size: int, chunks: list[int], splits: tuple[int, ...] | None,
                 a2a_groups: int) -> tuple[GroupPlan, str]:
    """The plan and a short word on where it came from."""
    tile_m, tile_n = DEFAULT_TILE
    if tuned is not None:
        try:
            model.fused(tuned.plan, collective, chunks, k, dtype, world_size)
            return tuned.plan, f"tuned, {tuned.source}"
        except ValueError as exc:
            registry.warn_once(f"ignoring tuned plan from {tuned.source} for {collective} m={m}: {exc}")
    if splits is not None:  # the op cuts every chunk k at floor(L_k * g / G); these bounds give that layout
        groups = max(1, a2a_groups)  # exactly when G divides m, and approximately (for the model) otherwise
        bounds = tuple(dict.fromkeys(m * g // groups for g in range(groups + 1)))
        return GroupPlan(m, n, tile_m, tile_n, bounds), f"{len(bounds) - 1} equal fractions"
    result = predictive_search(model, collective, m, n, k, dtype, world_size, chunks, tile_m=tile_m, tile_n=tile_n)
    if result.plan.num_groups == 1:  # nothing to overlap: offer the best overlapping plan (fuse mode "always")
        result = predictive_search(model, collective, m, n, k, dtype, world_size, chunks, tile_m=tile_m,
                                   tile_n=tile_n, min_groups=2)
        return result.plan, "searched, >= 2 groups"
    return result.plan, "searched"


def decide_cache_info() -> functools._CacheInfo:
    """Hit/miss counters of ``decide``'s memo."""
    return _decide.cache_info()


def clear_caches() -> None:
    """Forget memoized decisions and loaded data (after changing data files)."""
    from . import gather, moe

    registry.clear_caches((_decide.cache_clear, gather.decide_cache_clear, moe.decide_cache_clear,
                           _call_plan.cache_clear))


# Device-memory copy rates (bytes per ms, each byte counted once whether read or written): about 80% of the HBM peak
# (H200: 4.8 TB/s, H100 SXM: 3.35 TB/s). For the pass's extra copies (the cats of a sum of GEMMs); the default
# GPU's rate for other names.
COPY_BYTES_PER_MS = {"h200": 3.8e9, "h100": 2.7e9}


def copy_ms(nbytes: int, device_name: str | None = None) -> float:
    """Time (ms) to move ``nbytes`` through device memory on ``device_name`` (None: the default GPU)."""
    from .registry import DEFAULT_GPU, normalize_gpu_name

    name = normalize_gpu_name(device_name or DEFAULT_GPU)
    rate = next((r for key, r in COPY_BYTES_PER_MS.items() if key in name.split()), COPY_BYTES_PER_MS["h200"])
    return nbytes / rate


_warned: set[str] = set()


@functools.lru_cache(maxsize=4096)
def _call_plan(collective: str, m: int, n: int, k: int, dtype: str, world: int, device_name: str | None,
               settings: config.Settings) -> str:
    try:
        d = decide(collective, m, n, k, dtype, world, device_name=device_name, settings=settings)
    except Exception as exc:  # noqa: BLE001 - a cost-model bug must not break the op: a uniform plan is always correct
        key = type(exc).__name__
        if key not in _warned:
            _warned.add(key)
            log.warning("flashoverlap: cost model failed (%r); using a uniform plan", exc)
        return steps.fallback_plan(m, n).to_str()
    log.debug("flashoverlap: auto plan %s m=%d n=%d k=%d: %s", collective, m, n, k, d.reason)
    return d.plan.to_str()


def call_plan(collective: str, m: int, n: int, k: int, dtype: str, world: int, device_name: str | None,
              settings: config.Settings) -> str:
    """The plan string a fused call whose plan is "auto" runs (its sizes were symbolic at compile time): the cost
    model's plan for this call shape with even chunks under ``settings`` (memoized), or a uniform plan of
    ``schedule.steps.FALLBACK_GROUPS`` groups if the cost model fails. The dispatcher resolves "auto" with it once
    per call shape, so the schedule (``schedule.steps``) only ever sees concrete plans."""
    return _call_plan(collective, m, n, k, dtype, world, device_name, settings)
