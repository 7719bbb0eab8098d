"""FlashOverlap's two-stage pipeline recurrence, with our corrections, and the sequential baseline.

For groups ``g = 0..G-1`` of one fused GEMM + collective (all times in ms from the GEMM's launch):

* ``D_g``: when group g's tiles are done if the GEMM ran alone (``GemmModel.group_completion_ms``);
  ``W_g = D_g - D_{g-1}`` (``D_{-1} = 0``) is the GEMM work between two group completions.
* ``T_g = curve(bytes_g) + call_overhead_ms``: group g's collective. The curve's latency floor makes every call
  cost at least the smallest measured call (per-call launch/latency cost); ``call_overhead_ms`` (default 0) is
  any extra per-group cost the curve does not contain.
* Recurrence (FlashOverlap, ``tune/search.py::predict_lat``)::

      E_comp_g = E_comp_{g-1} + W_g                       (no interference)
      E_comm_g = max(E_comp_g, E_comm_{g-1}) + T_g,       E_comp_{-1} = E_comm_{-1} = 0
      T_fused  = E_comm_{G-1}

* Interference: while a collective runs, the GEMM progresses ``1 + a`` times slower
  (``a = GemmModel.effective_interference``). After group g's compute ends, the comm stream is busy exactly on
  ``[E_comp_g, E_comm_g]`` (comm g starts no earlier than E_comp_g and the ones before it run back to back or
  have ended), so the state ``(E_comp, E_comm)`` suffices::

      overlap   = max(0, E_comm_{g-1} - E_comp_{g-1})
      E_comp_g  = E_comp_{g-1} + W_g (1 + a)                   if W_g (1 + a) <= overlap
                = E_comp_{g-1} + overlap + W_g - overlap/(1+a)  otherwise

  With ``a = 0`` this is FlashOverlap's recurrence.

* NCCL slowdown (measured on H200: NCCL on the SMs the persistent GEMM leaves free runs about 2x slower than
  alone, while the GEMM barely slows): until the GEMM ends (``D_{G-1}``), a collective progresses
  ``1 + c`` times slower (``c = GemmModel.comm_slowdown``); ``advance_comm`` gives its end.

* Sequential baseline: ``T_seq = T_gemm (cuBLAS, all SMs) + T_comm(all bytes)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from flashoverlap_inductor.schedule.plan import GroupPlan, buffer_layout, tiles_per_group

from .bandwidth import BandwidthCurve, ring_traffic_factor
from .gemm import GemmModel
from .schema import DTYPE_BYTES, dtype_bytes  # noqa: F401  (re-exported: the names tools import)


def advance_compute(e_comp: float, e_comm: float, work_ms: float, slowdown: float) -> float:
    """When ``work_ms`` of GEMM work (at full speed) started at ``e_comp`` ends, if the comm stream is busy until
    ``e_comm`` and slows the GEMM by ``1 + slowdown`` meanwhile (ms)."""
    overlap = max(0.0, e_comm - e_comp)
    slow = work_ms * (1.0 + slowdown)
    if slow <= overlap:
        return e_comp + slow
    return e_comp + overlap + work_ms - overlap / (1.0 + slowdown)


def advance_comm(start: float, comm_ms: float, gemm_end: float, slowdown: float) -> float:
    """When a collective of ``comm_ms`` (alone) started at ``start`` ends, if it runs ``1 + slowdown`` times
    slower until ``gemm_end`` (ms)."""
    if start >= gemm_end or slowdown <= 0.0:
        return start + comm_ms
    slow = comm_ms * (1.0 + slowdown)
    if start + slow <= gemm_end:
        return start + slow
    return gemm_end + comm_ms - (gemm_end - start) / (1.0 + slowdown)


@dataclass(frozen=True)
class PipelineResult:
    """Per-group compute and communication end times of one fused call, in ms from the GEMM's launch."""

    compute_end_ms: tuple[float, ...]
    comm_end_ms: tuple[float, ...]

    @property
    def total_ms(self) -> float:
        return self.comm_end_ms[-1]


def pipeline(done_ms: Sequence[float], comm_ms: Sequence[float], slowdown: float = 0.0,
             comm_slowdown: float = 0.0) -> PipelineResult:
    """The recurrence above: ``done_ms[g]`` = ``D_g`` (non-decreasing), ``comm_ms[g]`` = ``T_g``."""
    if len(done_ms) != len(comm_ms) or not done_ms:
        raise ValueError("pipeline: need one completion time and one comm time per group (>= 1 group)")
    e_comp = e_comm = prev_done = 0.0
    comps, comms = [], []
    for done, t_comm in zip(done_ms, comm_ms, strict=True):
        e_comp = advance_compute(e_comp, e_comm, done - prev_done, slowdown)
        e_comm = advance_comm(max(e_comp, e_comm), t_comm, done_ms[-1], comm_slowdown)
        prev_done = done
        comps.append(e_comp)
        comms.append(e_comm)
    return PipelineResult(tuple(comps), tuple(comms))


@dataclass(frozen=True)
class CostModel:
    """Bandwidth curve + GEMM model of one GPU model: predicts fused and sequential times (ms)."""

    curve: BandwidthCurve
    gemm: GemmModel
    call_overhead_ms: float = 0.0

    def group_curve_ms(self, collective: str, world_size: int, rows: int, n: int, dtype: str) -> float | None:
        """One group's collective on ``rows x n`` elements on the NCCL curve alone, in ms (None without rows)."""
        if rows <= 0:
            return None
        return self.curve.comm_ms(collective, world_size, rows * n * dtype_bytes(dtype))

    def group_comm_ms(self, collective: str, world_size: int, rows: int, n: int, dtype: str) -> float:
        """One group's collective on ``rows x n`` elements, plus the per-call overhead, in ms (0 without rows)."""
        curve = self.group_curve_ms(collective, world_size, rows, n, dtype)
        return 0.0 if curve is None else curve + self.call_overhead_ms

    def seq_ms(self, collective: str, m: int, n: int, k: int, dtype: str, world_size: int) -> float:
        """Sequential baseline: cuBLAS GEMM on all SMs, then one collective on the whole output, in ms; the GEMM
        time scaled by ``1 + GemmModel.seq_skew_fraction`` (the collective waits for the last rank's GEMM)."""
        comm = self.curve.comm_ms(collective, world_size, m * n * dtype_bytes(dtype))
        skew = self.gemm.seq_skew_fraction(collective, world_size)
        return self.gemm.reference_ms(m, n, k, dtype) * (1.0 + skew) + comm

    def peer_ms(self, collective: str, m: int, n: int, k: int, dtype: str, world_size: int,
                host_bound: bool = True) -> float | None:
        """The peer route's time (``peer.py``), in ms; None where the data has no peer model for this call.
        ``host_bound=False``: replayed from a CUDA graph (no host floor)."""
        peer = self.gemm.peer
        if peer is None or not peer.covers(collective, world_size, m):
            return None
        return peer.predict_ms(self.gemm, collective, m, n, k, dtype, self.link_bytes_per_ms(world_size), host_bound)

    def ring_ms(self, collective: str, m: int, n: int, k: int, dtype: str, world_size: int, rounds: int,
                host_bound: bool = True) -> float | None:
        """The ring route's time (``ring.py``) in ``rounds`` rounds, in ms; None where the data has no ring terms for
        this call. ``host_bound=False``: replayed from a CUDA graph (no host floor)."""
        ring = self.gemm.ring
        if ring is None or not ring.covers(collective, world_size):
            return None
        return ring.predict_ms(self.gemm, collective, m, n, k, dtype, world_size, rounds,
                               self.link_bytes_per_ms(world_size), host_bound)

    def link_bytes_per_ms(self, world_size: int) -> float:
        """One direction's NVLink rate between two ranks, in bytes per ms: what NCCL's all_reduce moves per rank
        (``ring_traffic_factor`` bytes per input byte) at the curve's tail rate."""
        curve, scale = self.curve.curve("all_reduce", world_size)
        return ring_traffic_factor("all_reduce", world_size) / (curve.tail_ms_per_byte * scale)

    def parts(self, plan: GroupPlan, collective: str, chunks: Sequence[int], k: int, dtype: str,
              world_size: int) -> GroupParts:
        """What ``fused`` derives from ``plan`` before any fused-path parameter enters: its buffer layout
        (``plan.buffer_layout``), each group's tiles and each group's collective on the curve."""
        bounds = buffer_layout(plan, chunks).group_bounds
        return GroupParts(k, dtype, (plan.tile_m, plan.tile_n),
                          tuple(tiles_per_group(bounds, plan.tile_m, plan.tile_n, plan.n)),
                          tuple(self.group_curve_ms(collective, world_size, hi - lo, plan.n, dtype)
                                for lo, hi in itertools.pairwise(bounds)))

    def fused(self, plan: GroupPlan, collective: str, chunks: Sequence[int], k: int, dtype: str,
              world_size: int) -> PipelineResult:
        """The reference evaluation of ``plan``: ``parts``, the GEMM's group completion times, each group's
        collective with the per-call overhead, and the recurrence."""
        return self.parts(plan, collective, chunks, k, dtype, world_size).evaluate(self.gemm, self.call_overhead_ms)


@dataclass(frozen=True)
class GroupParts:
    """A plan's groups as the recurrence needs them: each group's tile count and its collective's time on the NCCL
    curve (ms, without the per-call overhead; None for a group without rows, whose collective costs nothing).
    ``tune fit`` computes these once per plan and evaluates them under many GEMM parameters."""

    k: int
    dtype: str
    tile: tuple[int, int]
    tiles_of_groups: tuple[int, ...]
    curve_ms: tuple[float | None, ...]

    def evaluate(self, gemm: GemmModel, overhead_ms: float) -> PipelineResult:
        """The recurrence with GEMM model ``gemm`` and ``overhead_ms`` added to every group's collective."""
        done = gemm.completion_ms(self.tiles_of_groups, self.k, self.dtype, *self.tile)
        comm = [0.0 if c is None else c + overhead_ms for c in self.curve_ms]
        return pipeline(done, comm, gemm.effective_interference, gemm.comm_slowdown)
