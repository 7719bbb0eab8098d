"""Measurement helpers shared by ``tune`` and ``examples/bench_ops.py``: CUDA-event timing of interleaved variants
with iteration counts agreed across ranks, the max over ranks, summary statistics and progress lines.

Timing method (all times in ms). ``Timer.measure({name: fn})``:

1. warm-up: every variant runs twice, then the devices synchronize;
2. estimate: one timed call per variant; the estimates are maxed over ranks (one all_reduce), so every rank runs
   the same number of calls -- a collective inside a variant must be entered equally often by all ranks;
   ``iters = clamp(round(target_ms / estimate), min_iters, max_iters)``;
3. ``rounds`` rounds; in each, every variant (in turn, the order reversed every other round) gets a short spin
   kernel (so that the host enqueues ahead and host launch gaps do not show) and then ``iters`` back-to-back
   calls, each between two CUDA events on the current stream;
4. a variant's time on one rank is the median of all its calls; the reported time is the max over ranks.

The pure statistics (``median``, ``geomean``, ``speedup``, ``overlap_efficiency``, ``rel_error``) run anywhere.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flashoverlap_inductor.tools import cli_util

# --------------------------------------------------------------------------------------------- statistics


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def geomean(xs: Iterable[float]) -> float:
    """Geometric mean of positive finite values (nan if there are none)."""
    vals = [x for x in xs if x is not None and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in vals) / len(vals)) if vals else math.nan


def speedup(baseline_ms: float, ms: float) -> float:
    """``baseline / ms`` (> 1 means faster than the baseline); nan when undefined."""
    if ms is None or baseline_ms is None or not ms > 0 or not math.isfinite(baseline_ms):
        return math.nan
    return baseline_ms / ms


def overlap_efficiency(seq_ms: float, fused_ms: float, ideal_ms: float) -> float:
    """``(T_seq - T_fused) / (T_seq - ideal)``: 1 = perfect overlap, 0 = no gain, < 0 = slower than sequential;
    nan when the ideal leaves nothing to gain (``T_seq <= ideal``)."""
    if any(x is None or not math.isfinite(x) for x in (seq_ms, fused_ms, ideal_ms)) or seq_ms - ideal_ms <= 1e-9:
        return math.nan
    return (seq_ms - fused_ms) / (seq_ms - ideal_ms)


def rel_error(predicted: float, measured: float) -> float:
    """``|predicted - measured| / measured`` (nan when undefined)."""
    if predicted is None or measured is None or not measured > 0 or not math.isfinite(predicted):
        return math.nan
    return abs(predicted - measured) / measured


def finite(xs: Iterable[Any]) -> list[float]:
    return [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


# --------------------------------------------------------------------------------------------- progress


class Progress:
    """Progress of a long loop as plain lines (flushed; the same in a terminal and a CI log): one when ``every_s``
    seconds have passed since the start or the last line, and the last step's once any was shown (a loop quicker
    than ``every_s`` stays silent): ``"<desc>: k/N (p%) [elapsed 1m05s, ETA 3m20s] <note>"``, the ETA from the
    mean time per unit so far (``cli_util.eta_s``). ``update(n)`` counts ``n`` units (a caller may weight its
    steps, e.g. by rounds); ``file``: where the lines go (default stdout)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, every_s: float = 5.0, file: Any = None) -> None:
        self.total, self.desc, self.enabled, self.every_s, self.file = max(1, total), desc, enabled, every_s, file
        self.done, self.t0, self.printed = 0, time.monotonic(), -1
        self.last = self.t0

    def line(self, note: str = "") -> str:
        elapsed = time.monotonic() - self.t0
        done = min(self.done, self.total)
        eta = cli_util.eta_s(done, self.total, elapsed / self.done if self.done else None)
        return (f"{self.desc}: {done}/{self.total} ({100.0 * done / self.total:.0f}%) [elapsed "
                f"{cli_util.duration(elapsed)}, ETA {cli_util.duration(eta)}]" + (f" {note}" if note else ""))

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last >= self.every_s or (self.done >= self.total and self.printed >= 0):
            self.last, self.printed = now, self.done
            print(self.line(note), file=self.file or sys.stdout, flush=True)

    def close(self) -> None:
        """A last line when the last step was not shown (``total`` may have been an upper bound: it ends at what
        was done)."""
        if self.enabled and self.printed >= 0 and self.printed != self.done:
            self.total = max(1, min(self.total, self.done))
            print(self.line("done"), file=self.file or sys.stdout, flush=True)
        (self.file or sys.stdout).flush()


# --------------------------------------------------------------------------------------------- distributed


def world() -> tuple[int, int]:
    """(rank, world size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def reduce_max(values: Sequence[float], group: Any = None) -> list[float]:
    """Element-wise max over the ranks of ``values`` (one all_reduce; identity without a process group)."""
    if not values or world()[1] == 1:
        return [float(v) for v in values]
    device = "cpu" if dist.get_backend(group) == "gloo" else "cuda"
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.tolist()]


def agree(flags: Sequence[bool], group: Any = None) -> list[bool]:
    """True where every rank says True (one all_reduce)."""
    return [v > 0.5 for v in [-x for x in reduce_max([-float(bool(f)) for f in flags], group)]]


def on_rank0(rank: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 (e.g. reading the data files a command merges into), its ``cli_util.CliError`` raised on
    every rank: agreed (one all_reduce), so that no rank waits in a collective for one that gave up."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except cli_util.CliError as exc:
            error = exc
    if not agree([error is None])[0]:
        raise error or cli_util.CliError("rank 0 cannot use its data files")
    return result


# --------------------------------------------------------------------------------------------- timing


def spin(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` (so the host gets ahead of the GPU)."""
    if ms > 0:
        torch.cuda._sleep(int(ms * 1.5e6))


def host_us(fn: Callable[[], Any], calls: int, spin_ms: float = 10.0, batch: int = 20,
            sync: Callable[[], Any] | None = None) -> float:
    """Mean host time of one call of ``fn`` in microseconds, the GPU kept busy by a spin before each batch of
    ``batch`` calls so the host never waits for it (20 warm-up calls first; ``sync``, e.g. ``dist.barrier``, runs
    after each device sync so ranks start every batch together)."""
    for _ in range(batch):
        fn()
    torch.cuda.synchronize()
    if sync is not None:
        sync()
    total, batches = 0.0, max(1, calls // batch)
    for _ in range(batches):
        spin(spin_ms)
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        total += time.perf_counter() - t0
        torch.cuda.synchronize()
        if sync is not None:
            sync()
    return total / (batches * batch) * 1e6


@dataclass(frozen=True)
class Timing:
    """One variant's result: ``ms`` = max over ranks of the per-rank medians; ``min_ms``/``max_ms`` this rank's
    extremes; ``calls`` timed calls per rank."""

    ms: float
    min_ms: float
    max_ms: float
    calls: int


class Timer:
    """Interleaved CUDA-event timing of several variants (see the module docstring)."""

    def __init__(self, rounds: int = 5, target_ms: float = 10.0, min_iters: int = 2, max_iters: int = 50,
                 spin_ms: float = 0.3, group: Any = None, distributed: bool = True) -> None:
        """``distributed=False``: this rank measures alone (no all_reduce of estimates or results)."""
        self.rounds, self.target_ms, self.spin_ms, self.group = rounds, target_ms, spin_ms, group
        self.distributed = distributed
        self.min_iters, self.max_iters = min_iters, max_iters

    def iterations(self, estimates_ms: Sequence[float]) -> list[int]:
        """Calls per round for each variant from its (rank-maxed) single-call estimate."""
        out = []
        for est in estimates_ms:
            n = self.target_ms / est if est > 0 and math.isfinite(est) else self.max_iters
            out.append(int(min(self.max_iters, max(self.min_iters, round(n)))))
        return out

    def _max(self, values: list[float]) -> list[float]:
        return reduce_max(values, self.group) if self.distributed else values

    def measure(self, variants: dict[str, Callable[[], Any]]) -> dict[str, Timing]:
        names = list(variants)
        if not names:
            return {}
        for _ in range(2):
            for name in names:
                variants[name]()
        torch.cuda.synchronize()
        estimates = []
        for name in names:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            spin(self.spin_ms)
            start.record()
            variants[name]()
            end.record()
            end.synchronize()
            estimates.append(start.elapsed_time(end))
        iters = dict(zip(names, self.iterations(self._max(estimates)), strict=True))
        samples: dict[str, list[float]] = {name: [] for name in names}
        for r in range(self.rounds):
            pending = []
            for name in (names if r % 2 == 0 else names[::-1]):
                fn = variants[name]
                spin(self.spin_ms)
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(iters[name])]
                for start, end in events:
                    start.record()
                    fn()
                    end.record()
                pending.append((name, events))
            torch.cuda.synchronize()
            for name, events in pending:
                samples[name].extend(s.elapsed_time(e) for s, e in events)
        meds = self._max([median(samples[n]) for n in names])
        return {n: Timing(m, min(samples[n]), max(samples[n]), len(samples[n])) for n, m in zip(names, meds,
                                                                                                strict=True)}


def time_gemm_shape(m: int, n: int, k: int, infos: list, sm_counts: list[int], timer: Timer,
                    device: str = "cuda") -> dict[str, float]:
    """``tune gemm``: ms of cuBLAS and of every configuration on every SM count (``"<config>@<sms>"``) for one bf16
    shape (B as a Linear weight, 8 wave groups signalled)."""
    from flashoverlap_inductor.native import kernels
    from flashoverlap_inductor.schedule.plan import group_of_tile_row, uniform_plan

    stream = torch.cuda.current_stream()
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / math.sqrt(k)
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    variants = {"cublas": lambda: torch.mm(a, w.t(), out=out)}
    for info in infos:
        p = uniform_plan(m, n, info.tile_m, info.tile_n, 8)
        gmap = torch.tensor(group_of_tile_row(p.row_bounds, info.tile_m), dtype=torch.int32, device=device)
        counters = torch.zeros(p.num_groups, dtype=torch.int32, device=device)
        idx = kernels.config_index(info.name, torch.bfloat16, "nk")
        for use in sm_counts:
            ws_bytes = kernels.workspace_bytes(idx, m, n, k, use, kernels.RASTERS["along_n"], 1)
            ws = torch.empty(ws_bytes, dtype=torch.uint8, device=device) if ws_bytes else None

            def fn(idx=idx, use=use, ws=ws, gmap=gmap, counters=counters):
                kernels.gemm(idx, a, w.t(), k, None, out, counters.data_ptr(), gmap, None,
                             kernels.SIGNAL_MODES["deferred"], use, kernels.RASTERS["along_n"], 1, ws,
                             stream.cuda_stream)
            variants[f"{info.name}@{use}"] = fn
    return {name: t.ms for name, t in timer.measure(variants).items()}
