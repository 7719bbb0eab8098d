"""NCCL bandwidth curves: bytes -> milliseconds per collective call, per world size, for one GPU model.

A curve is a list of measured ``(bytes, ms)`` points of one collective at one world size (``bytes`` = the
collective's input tensor size; ``ms`` = one call's median time). Lookup rules, for ``b`` bytes:

* The measured times are first made non-decreasing in ``bytes`` by isotonic regression on ``log(ms)`` (pool
  adjacent violators): measurement noise can make a larger message look faster (the H200 4-GPU all_reduce
  times 0.104, 0.101, 0.092 ms at 256 KiB, 1 MiB, 4 MiB), which would make a model prefer *more* bytes.
  Already monotone data is unchanged, so the curve passes exactly through its samples.
* Between samples: linear interpolation of ``log(ms)`` against ``log(bytes)`` (a power law per segment).
* Below the smallest sample: the *latency floor* ``ms[0]``; no call is ever predicted faster than it. (This is
  the per-call launch/latency cost that FlashOverlap's linear-in-size model drops for small groups.)
* Above the largest sample: constant bandwidth at the marginal rate of the last segment, i.e. time linear in
  bytes: ``ms[-1] + (b - bytes[-1]) * slope``.
* World sizes without a measured curve use the nearest measured world ``w0`` (ties: the larger), scaled by the
  ring-algorithm traffic factor ``f(w) / f(w0)`` with ``f = 2 (w - 1) / w`` for all_reduce and ``(w - 1) / w``
  for reduce_scatter and all_to_all (the whole time is scaled, latency included: an approximation).
  World size 1 costs 0 ms (no communication).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flashoverlap_inductor.schedule.plan import COLLECTIVES

from .schema import validate_bandwidth

log = logging.getLogger("flashoverlap")


def ring_traffic_factor(collective: str, world_size: int) -> float:
    """Bytes each rank moves per input byte in a ring: ``2 (w-1)/w`` (all_reduce), ``(w-1)/w`` otherwise."""
    if collective not in (*COLLECTIVES, "all_gather"):
        raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES} or 'all_gather'")
    frac = (world_size - 1) / world_size
    return 2.0 * frac if collective == "all_reduce" else frac


def _isotonic_log(times: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit of ``log(times)`` (pool adjacent violators), returned in ms. Values
    that need no pooling are returned bit for bit."""
    blocks: list[tuple[float, int, float]] = []  # (sum of logs, count, value)
    for t in times:
        blocks.append((math.log(t), 1, t))
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, c2, _ = blocks.pop()
            s1, c1, _ = blocks.pop()
            blocks.append((s1 + s2, c1 + c2, math.exp((s1 + s2) / (c1 + c2))))
    return [value for _, count, value in blocks for _ in range(count)]


@dataclass(frozen=True)
class SampledCurve:
    """One collective at one world size: monotone piecewise power law through ``(bytes, ms)`` samples."""

    nbytes: tuple[float, ...]
    ms: tuple[float, ...]
    _log_b: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _log_t: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.nbytes) != len(self.ms) or not self.nbytes:
            raise ValueError("SampledCurve: need as many (>= 1) byte sizes as times")
        if any(b <= 0 for b in self.nbytes) or any(t <= 0 for t in self.ms):
            raise ValueError("SampledCurve: bytes and ms must be positive")
        if any(x >= y for x, y in itertools.pairwise(self.nbytes)):
            raise ValueError("SampledCurve: bytes must increase strictly")
        object.__setattr__(self, "ms", tuple(_isotonic_log(self.ms)))
        object.__setattr__(self, "_log_b", tuple(math.log(b) for b in self.nbytes))
        object.__setattr__(self, "_log_t", tuple(math.log(t) for t in self.ms))

    @staticmethod
    def from_points(points: Sequence[Sequence[float]]) -> SampledCurve:
        return SampledCurve(tuple(float(p[0]) for p in points), tuple(float(p[1]) for p in points))

    @property
    def floor_ms(self) -> float:
        """The latency floor: the smallest sample's (monotone-fitted) time, in ms."""
        return self.ms[0]

    @property
    def tail_ms_per_byte(self) -> float:
        """Marginal time per byte above the largest sample (ms/byte); the last segment's slope, or the
        average rate of the last sample when the last segment is flat or there is one sample."""
        if len(self.nbytes) >= 2 and self.ms[-1] > self.ms[-2]:
            return (self.ms[-1] - self.ms[-2]) / (self.nbytes[-1] - self.nbytes[-2])
        return self.ms[-1] / self.nbytes[-1]

    def ms_for(self, nbytes: float) -> float:
        """Time of one call on ``nbytes`` input bytes, in ms (see the module docstring)."""
        if nbytes <= self.nbytes[0]:
            return self.ms[0]
        if nbytes >= self.nbytes[-1]:
            return self.ms[-1] + (nbytes - self.nbytes[-1]) * self.tail_ms_per_byte
        i = bisect.bisect_right(self.nbytes, nbytes) - 1
        lb = math.log(nbytes)
        frac = (lb - self._log_b[i]) / (self._log_b[i + 1] - self._log_b[i])
        return math.exp(self._log_t[i] + frac * (self._log_t[i + 1] - self._log_t[i]))

    def is_subadditive(self) -> bool:
        """True if ``ms(a) + ms(b) >= ms(a + b)`` for all sizes, shown via ``ms(x) / x`` non-increasing: the floor
        region is constant, every log-log segment slope is <= 1 and the linear tail has a non-negative
        intercept. The search's pruning bound relies on it (one call on all bytes is never slower than
        several calls on parts of them)."""
        for i in range(len(self.nbytes) - 1):
            slope = (self._log_t[i + 1] - self._log_t[i]) / (self._log_b[i + 1] - self._log_b[i])
            if slope > 1.0 + 1e-12:
                return False
        return self.ms[-1] - self.tail_ms_per_byte * self.nbytes[-1] >= -1e-12


@dataclass(frozen=True)
class BandwidthCurve:
    """All measured collectives of one GPU model (name ``gpu``, ``sm_count`` SMs) by world size."""

    gpu: str
    sm_count: int
    curves: Mapping[int, Mapping[str, SampledCurve]]
    source: str = ""

    @staticmethod
    def from_json(doc: dict, where: str = "<bandwidth json>") -> BandwidthCurve:
        """Build from a validated ``flashoverlap.bandwidth/1`` document (raises ConfigError if malformed)."""
        raw = validate_bandwidth(doc, where)
        curves = {w: {c: SampledCurve.from_points(pts) for c, pts in per.items()} for w, per in raw.items()}
        return BandwidthCurve(doc["gpu"], int(doc["sm_count"]), curves, f"{where}: {doc['source']}")

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.curves))

    def nearest_world(self, world_size: int) -> int:
        """The measured world size used for ``world_size`` (itself if measured; ties go to the larger)."""
        return min(self.curves, key=lambda w: (abs(w - world_size), -w))

    def curve(self, collective: str, world_size: int) -> tuple[SampledCurve, float]:
        """The sampled curve used for ``(collective, world_size)`` and the factor its times are scaled by."""
        w0 = self.nearest_world(world_size)
        scale = 1.0
        if w0 != world_size:
            scale = ring_traffic_factor(collective, world_size) / ring_traffic_factor(collective, w0)
            warn_once(f"{self.gpu}: no measured {collective} curve for world size {world_size}; scaling the "
                       f"world-{w0} curve by the ring factor {scale:.3f}")
        return self.curves[w0][collective], scale

    def comm_ms(self, collective: str, world_size: int, nbytes: float) -> float:
        """Time of one ``collective`` call over ``world_size`` ranks on ``nbytes`` input bytes, in ms.
        0.0 for a world of one rank or an empty message."""
        if world_size <= 1 or nbytes <= 0:
            return 0.0
        curve, scale = self.curve(collective, world_size)
        return curve.ms_for(nbytes) * scale

    def floor_ms(self, collective: str, world_size: int) -> float:
        """Per-call latency floor of ``collective`` at ``world_size``, in ms."""
        if world_size <= 1:
            return 0.0
        curve, scale = self.curve(collective, world_size)
        return curve.floor_ms * scale

    def is_subadditive(self, collective: str, world_size: int) -> bool:
        return world_size <= 1 or self.curve(collective, world_size)[0].is_subadditive()


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning on the ``flashoverlap`` logger, once per process (``registry.clear_caches``
    forgets what was logged)."""
    if message not in _warned:
        _warned.add(message)
        log.warning("flashoverlap cost model: %s", message)
