"""``decide_gather``: should an all_gather and the GEMMs that consume the gathered rows be fused (ms throughout)?

Sequential: the all_gather of the whole gathered tensor (``rows x k`` elements) on the bandwidth curve, then each
GEMM ``rows x k @ k x n_i`` as cuBLAS runs it (``GemmModel.reference_ms``).

Fused (the ring of ``schedule.gather``, both routes): shard j lands at ``s * step`` (s = its ring step, 1 ..
world-1), where ``step`` is one ring step's transfer: the all_gather's time over ``world - 1`` steps plus
``call_overhead_ms`` (each step is a call of its own). The GEMMs run shard by shard:
the local shard at once, then each shard when it has landed and the previous shard's GEMMs are done; every shard's
GEMMs take ``reference_ms(shard_rows, n_i, k)`` (cuBLAS at the smaller M: wave
quantization counted), slowed by ``GemmModel.effective_interference`` for the part of them that runs while NCCL
still moves shards (``route="nccl"``; the peer route's copy engine takes no SMs: no slowdown).

The peer route, where the GPU's data file has a ``gather_peer`` section (``PeerTerms``: ``gemm_factor``, ``fixed_ms``,
``link_efficiency``), is modelled as it runs under ``gather_start="handshake"`` (``routes.gather_peer``; its terms
were fitted there: under "push" (the default on 2 ranks), which starts the GEMMs without the handshake, the model
overstates the fused time by about ``fixed_ms``, so it errs towards declining): one handshake (``fixed_ms``), then
the local shard's GEMMs at once while the copy engine pulls the peers' shards back to back, shard ``s`` landing at
``s * shard_bytes / (link_efficiency * link)`` after the handshake (``link``: the NVLink rate of
``CostModel.link_bytes_per_ms``); each shard's GEMMs after it landed and the previous shard's are done. A shard's
GEMMs take ``1 / world`` of the whole gathered GEMMs' reference time (not the wave model at the shard's rows, whose
partial-wave cost overstates split GEMMs: measured, cuBLAS loses little by splitting M), all of it ``gemm_factor``
times slower (the split and the pulls' share of HBM). Without the section: the ring model above.

The all_gather's curve is the data's ``all_gather`` curve where it has one, else its ``reduce_scatter`` curve on the
same byte count: a ring moves ``(w-1)/w`` of the buffer per rank in both (``bandwidth.ring_traffic_factor``);
the reduction's arithmetic makes the proxy slightly pessimistic for the sequential baseline and the fused path
alike. Verdict: fuse iff ``rows >= min_rows`` and ``fused <= (1 - min_gain_fraction) * sequential``; the plan is
``"ring"`` either way (fuse mode "always" runs it regardless).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flashoverlap_inductor import config

from . import gain, registry
from .pipeline import DTYPE_BYTES

PLAN = "ring"


@dataclass(frozen=True)
class GatherDecision:
    """The cost model's answer for one all_gather -> GEMMs (times in ms)."""

    fuse: bool
    plan: str
    predicted_fused_ms: float
    predicted_seq_ms: float
    reason: str
    route: str = "nccl"


def decide_gather(rows: int, ns: Sequence[int], k: int, dtype: str, world_size: int, *,
                  device_name: str | None = None, route: str = "nccl",
                  settings: config.Settings | None = None) -> GatherDecision:
    """Decide fusion of an all_gather of ``rows x k`` gathered elements over ``world_size`` ranks with the GEMMs
    ``[rows, k] @ [k, n_i]``. ``route``: "nccl" (ring over NCCL, SMs shared) or "peer" (copy-engine pulls).
    ``settings``: the caller's (None: ``config.current()``)."""
    s = settings or config.current()
    return _decide(int(rows), tuple(int(n) for n in ns), int(k), dtype, int(world_size), device_name, route,
                   registry.data_dir(s), s.min_gain_fraction, s.min_rows)


@functools.lru_cache(maxsize=1024)
def _decide(rows: int, ns: tuple[int, ...], k: int, dtype: str, world: int, device_name: str | None, route: str,
            directory: Path, min_gain: float, min_rows: int) -> GatherDecision:
    model, how = registry.model_for(device_name, directory)
    note = "" if how == "exact" else f" [{how} match: using data of {model.gemm.gpu}]"
    nan = float("nan")
    if dtype not in DTYPE_BYTES or not model.gemm.supports(dtype):
        return GatherDecision(False, PLAN, nan, nan, f"declined: no cost data for dtype {dtype!r}{note}", route)
    gemm = model.gemm
    seq_gemms = sum(gemm.reference_ms(rows, n, k, dtype) for n in ns)
    if world <= 1:
        return GatherDecision(False, PLAN, seq_gemms, seq_gemms, f"declined: world size 1, nothing to gather{note}",
                              route)
    if rows % world:
        return GatherDecision(False, PLAN, nan, nan, f"declined: {rows} rows do not divide by {world}{note}", route)
    curve_name = "all_gather" if "all_gather" in model.curve.curves[model.curve.nearest_world(world)] \
        else "reduce_scatter"
    gather_ms = model.curve.comm_ms(curve_name, world, rows * k * DTYPE_BYTES[dtype])
    seq = gather_ms + seq_gemms
    fused = gather_fused_ms(model, rows // world, ns, k, dtype, world, gather_ms, route)
    summary = (f"predicted {fused:.3f} ms fused ({world - 1} ring steps, {route}) vs {seq:.3f} ms sequential "
               f"({seq / fused:.3f}x; all_gather {gather_ms:.3f} ms on the {curve_name} curve){note}")
    fuse, reason = gain.verdict(fused, seq, rows, min_gain, min_rows, summary)
    return GatherDecision(fuse, PLAN, fused, seq, reason, route)


def gather_fused_ms(model, shard_rows: int, ns: Sequence[int], k: int, dtype: str, world: int, gather_ms: float,
                    route: str) -> float:
    """The fused call's time (module docstring), in ms."""
    gemm = model.gemm
    terms = gemm.gather_peer if route == "peer" else None
    if terms is not None:
        return peer_fused_ms(model, terms, shard_rows, ns, k, dtype, world)
    step = gather_ms / (world - 1) + model.call_overhead_ms
    slowdown = gemm.effective_interference if route == "nccl" else 0.0
    shard_ms = sum(gemm.reference_ms(shard_rows, n, k, dtype) for n in ns)
    last = (world - 1) * step  # when the last shard has landed
    t = 0.0
    for s in range(world):  # s = 0: the local shard, no transfer to wait for
        start = t if s == 0 else max(t, s * step)
        t = start + shard_ms + slowdown * min(shard_ms, max(0.0, last - start))  # slowed while transfers run
    return t


def peer_fused_ms(model, terms, shard_rows: int, ns: Sequence[int], k: int, dtype: str, world: int) -> float:
    """The peer route's time in ms: ``fixed_ms + gemm_factor * x`` with ``x`` = ``peer_pipeline_ms``."""
    return terms.fixed_ms + terms.gemm_factor * peer_pipeline_ms(
        model, shard_rows, ns, k, dtype, world, terms.link_efficiency)


def peer_pipeline_ms(model, shard_rows: int, ns: Sequence[int], k: int, dtype: str, world: int,
                     link_efficiency: float) -> float:
    """The peer route's regressor (ms): shard GEMMs one after the other, each ``1 / world`` of the gathered GEMMs'
    reference time, shard ``s`` (1 .. world - 1) not before its pull landed at ``s * shard_bytes / (link_efficiency *
    link)``."""
    shard_ms = sum(model.gemm.reference_ms(shard_rows * world, n, k, dtype) for n in ns) / world
    pull_ms = shard_rows * k * DTYPE_BYTES[dtype] / (link_efficiency * model.link_bytes_per_ms(world))
    t = 0.0
    for s in range(world):
        t = max(t, s * pull_ms) + shard_ms
    return t


def decide_cache_clear() -> None:
    _decide.cache_clear()
