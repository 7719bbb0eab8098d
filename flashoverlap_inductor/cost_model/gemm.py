"""GEMM wave model: how long a GEMM takes and when each wave group's tiles are in memory.

The output ``[M, N]`` is cut into ``tiles = ceil(M / tile_m) * ceil(N / tile_n)`` tiles, processed in
row-major tile order (the order of ``plan.py``) by ``sms`` persistent CTAs, one tile per SM per *wave*: tile
number ``t`` (linear, row-major) completes at the end of wave ``floor(t / sms)``. Times, in ms::

    wave_ms(k)  = 2 * tile_m * tile_n * k / (peak_tflops * 1e9 * dtype_scale / sm_count) / efficiency
                  + wave_overhead_ms
    T_gemm      = launch_ms + ceil(tiles / sms) * wave_ms(k)

The small-shape efficiency model is the fixed ``launch_ms`` plus wave quantization (a last, partly filled wave
costs a full wave). ``peak_tflops``, ``launch_ms`` and ``wave_overhead_ms`` are fitted (``import_anchor``) to
cuBLAS ``torch.mm`` times on all SMs with the model's reference tile (``tile``); other tiles scale the per-wave
time by their area. So ``reference_ms`` predicts the *sequential baseline's* GEMM (cuBLAS on all SMs).

The *fused* GEMM runs on ``sm_count - nccl_sms`` SMs (the CTAs it leaves to NCCL) at ``kernel_efficiency`` times
the fitted rate (1.0 = a kernel as fast as cuBLAS per SM). ``interference`` is the measured extra GEMM time per
ms of a concurrent all_reduce when the GEMM uses every SM (anchor ``gemm_plus_concurrent_ar_ms``); part of it is
the SMs NCCL takes, which the fused kernel already leaves free, so the pipeline uses
``effective_interference = max(0, interference - nccl_sms / (sm_count - nccl_sms))``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashoverlap_inductor.schedule.plan import tiles_per_group

from .moe_terms import MoeTerms
from .peer import PeerModel, PeerTerms, PullTerms
from .ring import RingModel
from .schema import validate_gemm


@dataclass(frozen=True)
class GemmModel:
    """Wave model of one GPU model's GEMMs (see the module docstring for the formulas and units)."""

    gpu: str
    sm_count: int
    tile: tuple[int, int]
    peak_tflops: float
    launch_ms: float
    wave_overhead_ms: float
    dtype_scale: Mapping[str, float]
    nccl_sms: int = 16
    kernel_efficiency: float = 1.0
    interference: float = 0.0
    fused_gemm_slowdown: float | None = None  # measured on the fused path (overrides the cuBLAS-derived value)
    comm_slowdown: float = 0.0  # NCCL runs (1 + this) times slower while the fused GEMM occupies its SMs
    grid: str = "persistent"  # how the fused GEMM is launched ("persistent" or "tiles"; schema.py)
    group_overhead_ms: float = 0.0  # fixed cost of each group's wait + collective launch (CostModel.call_overhead_ms)
    peer: PeerModel | None = None  # the peer route's time model (cost_model/peer.py), where the data file has one
    ring: RingModel | None = None  # the ring route's (cost_model/ring.py), likewise
    gather_peer: PeerTerms | None = None  # the all_gather peer route's terms (cost_model/gather.py), likewise
    scatter_pull: PullTerms | None = None  # the reduce_scatter pull route's terms (cost_model/pull.py), likewise
    all_reduce_pull: PullTerms | None = None  # the all_reduce pull route's (cost_model/pull.py), likewise
    moe: Mapping[str, MoeTerms] | None = None  # the MoE ops' terms per op (cost_model/moe.py), likewise
    # the sequential baseline's collective ends this fraction of the GEMM time later than GEMM + collective alone,
    # per world size and collective (data file section "sequential"; 0 where absent)
    seq_skew: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    anchor_rows: tuple[Mapping[str, Any], ...] = field(default=(), repr=False)
    source: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.nccl_sms < self.sm_count:
            raise ValueError(f"GemmModel: nccl_sms={self.nccl_sms} must be in [0, sm_count={self.sm_count})")
        if self.peak_tflops <= 0 or self.kernel_efficiency <= 0:
            raise ValueError("GemmModel: peak_tflops and kernel_efficiency must be positive")

    @staticmethod
    def from_json(doc: dict, where: str = "<gemm json>") -> GemmModel:
        """Build from a validated ``flashoverlap.gemm/1`` document (raises ConfigError if malformed)."""
        validate_gemm(doc, where)
        model, fused = doc["model"], doc["fused"]
        return GemmModel(
            gpu=doc["gpu"], sm_count=int(doc["sm_count"]), tile=(int(model["tile"][0]), int(model["tile"][1])),
            peak_tflops=float(model["peak_tflops"]), launch_ms=float(model["launch_ms"]),
            wave_overhead_ms=float(model["wave_overhead_ms"]),
            dtype_scale={k: float(v) for k, v in doc["dtype_scale"].items()},
            nccl_sms=int(fused["nccl_sms"]), kernel_efficiency=float(fused["kernel_efficiency"]),
            interference=float(doc["interference"]["gemm_slowdown_per_comm_ms"]),
            fused_gemm_slowdown=None if fused.get("gemm_slowdown") is None else float(fused["gemm_slowdown"]),
            comm_slowdown=float(fused.get("comm_slowdown", 0.0)), grid=str(fused.get("grid", "persistent")),
            group_overhead_ms=float(fused.get("group_overhead_ms", 0.0)),
            peer=PeerModel.from_json(doc["peer"]) if "peer" in doc else None,
            ring=RingModel.from_json(doc["ring"]) if "ring" in doc else None,
            gather_peer=None if "gather_peer" not in doc else PeerTerms(
                float(doc["gather_peer"]["gemm_factor"]), float(doc["gather_peer"]["fixed_ms"]),
                float(doc["gather_peer"].get("host_floor_ms", 0.0)),
                float(doc["gather_peer"].get("link_efficiency", 1.0))),
            scatter_pull=PullTerms.from_json(doc.get("scatter_pull")),
            all_reduce_pull=PullTerms.from_json(doc.get("all_reduce_pull")),
            moe=None if "moe" not in doc else {
                op: MoeTerms(float(t["factor"]), float(t["host_floor_ms"]), float(t["moves_bytes_per_ms"]),
                             float(t["unfused_bytes_per_ms"]), float(t.get("model_error", 0.0)))
                for op, t in doc["moe"].items() if op not in ("fit", "note")},
            seq_skew={int(w): {op: float(f) for op, f in per.items()}
                      for w, per in doc.get("sequential", {}).get("skew_fraction", {}).items()},
            anchor_rows=tuple(doc.get("anchor_rows", ())), source=f"{where}: {doc['source']}")

    def supports(self, dtype: str) -> bool:
        return dtype in self.dtype_scale

    @property
    def fused_sms(self) -> int:
        """SMs the fused GEMM runs on (the rest are left to NCCL)."""
        return self.sm_count - self.nccl_sms

    @property
    def effective_interference(self) -> float:
        """Extra fused-GEMM ms per ms of concurrent NCCL, beyond the SMs already left to NCCL (>= 0): the
        measured ``fused.gemm_slowdown`` when the data has it, else derived from the cuBLAS anchor rows."""
        if self.fused_gemm_slowdown is not None:
            return self.fused_gemm_slowdown
        return max(0.0, self.interference - self.nccl_sms / (self.sm_count - self.nccl_sms))

    def wave_ms(self, k: int, dtype: str, tile_m: int, tile_n: int, efficiency: float = 1.0) -> float:
        """Time of one wave (every SM computes one ``tile_m x tile_n`` tile over depth ``k``), in ms."""
        if dtype not in self.dtype_scale:
            raise ValueError(f"GemmModel({self.gpu}): no rate for dtype {dtype!r}; known {sorted(self.dtype_scale)}")
        flop_per_ms_per_sm = self.peak_tflops * 1e9 * self.dtype_scale[dtype] / self.sm_count
        return 2.0 * tile_m * tile_n * k / flop_per_ms_per_sm / efficiency + self.wave_overhead_ms

    def gemm_ms(self, m: int, n: int, k: int, dtype: str, tile_m: int, tile_n: int, sms: int,
                efficiency: float = 1.0) -> float:
        """Whole-GEMM time on ``sms`` SMs with the given tile, in ms."""
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
        return self.launch_ms + math.ceil(tiles / sms) * self.wave_ms(k, dtype, tile_m, tile_n, efficiency)

    def reference_ms(self, m: int, n: int, k: int, dtype: str) -> float:
        """The sequential baseline's GEMM (cuBLAS on all SMs, as fitted), in ms."""
        return self.gemm_ms(m, n, k, dtype, self.tile[0], self.tile[1], self.sm_count)

    def pull_terms(self, collective: str) -> PullTerms | None:
        """The pull route's terms for ``collective`` (``scatter_pull``: reduce_scatter, ``all_reduce_pull``:
        all_reduce), or None."""
        return {"reduce_scatter": self.scatter_pull, "all_reduce": self.all_reduce_pull}.get(collective)

    def wave_rows(self, n: int) -> int:
        """Rows whose ``[rows, n]`` output fills one wave of tiles (one per SM): a GEMM of fewer leaves SMs idle."""
        return -(-self.sm_count * self.tile[0] * self.tile[1] // max(n, 1))

    def seq_skew_fraction(self, collective: str, world_size: int) -> float:
        """The sequential baseline's extra time after its GEMM, as a fraction of the GEMM time (0 without data):
        its collective cannot end before the rank whose GEMM ends last, so it ends later than the GEMM and the
        collective timed apart."""
        return self.seq_skew.get(world_size, {}).get(collective, 0.0)

    def fused_ms(self, m: int, n: int, k: int, dtype: str, tile_m: int, tile_n: int) -> float:
        """The fused kernel's GEMM alone (``fused_sms`` SMs, ``kernel_efficiency``), in ms."""
        return self.gemm_ms(m, n, k, dtype, tile_m, tile_n, self.fused_sms, self.kernel_efficiency)

    def group_completion_ms(self, group_bounds: Sequence[int], n: int, k: int, dtype: str, tile_m: int,
                            tile_n: int, sms: int | None = None, efficiency: float | None = None) -> list[float]:
        """When every tile of each group is in memory, in ms from the GEMM's launch (no NCCL interference).

        ``group_bounds`` are buffer-row bounds (``BufferLayout.group_bounds``); the tile -> group mapping is
        ``plan.tiles_per_group``; ``completion_ms`` turns the tile counts into times.
        Defaults: the fused kernel's SMs and efficiency. The last value is the whole GEMM's time.
        """
        counts = tiles_per_group(group_bounds, tile_m, tile_n, n)
        return self.completion_ms(counts, k, dtype, tile_m, tile_n, sms, efficiency)

    def completion_ms(self, tiles_of_groups: Sequence[int], k: int, dtype: str, tile_m: int, tile_n: int,
                      sms: int | None = None, efficiency: float | None = None) -> list[float]:
        """Group completion times (ms from launch) from each group's tile count, groups in release order.
        Groups are contiguous in row-major tile order, so group g's last tile is linear tile ``P_{g+1} - 1``
        (``P`` = prefix sums of tiles per group), done at the end of wave ``floor((P_{g+1} - 1) / sms)``. A group
        that owns no tile is ready with the group before it."""
        sms = self.fused_sms if sms is None else sms
        efficiency = self.kernel_efficiency if efficiency is None else efficiency
        wave = self.wave_ms(k, dtype, tile_m, tile_n, efficiency)
        out, done, ready = [], 0, self.launch_ms
        for count in tiles_of_groups:
            done += count
            if count:
                ready = self.launch_ms + math.ceil(done / sms) * wave
            out.append(ready)
        return out
