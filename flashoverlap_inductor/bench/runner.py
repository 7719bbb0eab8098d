"""One backend on one case (model, plan, workload, sequence length): compile, time, collect what was fused.

Timing (all times in ms): the first call (which compiles, for train the backward graph too) is timed alone, wall
clock, and reported as the compile time (s); then ``warmup`` unmeasured steps; then ``steps`` measured ones. On CUDA
each measured step lies between two CUDA events on the current stream, recorded back to back with no host sync
between steps (as a training or serving loop runs); on CPU each step starts after a barrier and is timed with
``time.perf_counter``. A backend's time is the median of its steps on each rank, then the max over ranks.

A train step is forward + cross-entropy (fp32) on random target ids + backward + ``AdamW.step`` + ``zero_grad``
(under the ``-ro`` backends' CUDA graphs, forward and backward graphed, the optimizer eager, each step marked),
on a fresh deep copy of the case's parallelized initial model with a fresh AdamW (so every backend starts from the
same weights and the same, empty, optimizer state) and the same batches in the same order. A prefill step is a
no-grad forward of the same ``[batch, seq]`` ids that returns the last position's logits (``logits_to_keep=1``,
as a server computes them); the logits compared are those of one extra call after the measured ones.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import coverage
from .models import ModelSpec
from .progress import Progress

FUSING = ("flashoverlap", "flashoverlap-ro")
GRAPHED = ("flashoverlap-ro", "inductor-ro", "bound-ro")
BOUNDS = ("bound", "bound-ro")  # the steps with every collective replaced by a local op (bench/bound.py)


def variant(backend: str) -> tuple[str, tuple[str, ...]]:
    """``"flashoverlap@moe_plan_triton+moe_settle_deferred"`` -> ``("flashoverlap", (the two names))``: a fusing
    backend's row with more experiments on than ``--experiments`` gives (an A/B of experiments in one run); an item
    ``name=value`` sets that flashoverlap setting instead (``flashoverlap@gather_start=handshake``; ``compile_for``
    tells them apart); a name without ``@`` -> ``(name, ())``."""
    kind, _, extra = backend.partition("@")
    return kind, tuple(x for x in extra.split("+") if x)


@dataclass
class Env:
    """The process's distributed setting. ``device``: this rank's device; ``dtype``: the model's."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    mesh: Any
    group_name: str
    quiet: bool = False
    symm_mem: set = field(default_factory=set)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise max over the ranks (one all_reduce; NaN counts as +inf)."""
        vals = [v if v == v else float("inf") for v in values]
        if self.world == 1 or not vals:
            return vals
        t = torch.tensor(vals, dtype=torch.float64, device=self.device if self.cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()


@dataclass
class Case:
    spec: ModelSpec
    plan: str
    workload: str
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        """Tokens per step, for the whole group (every rank of the TP/EP group works on the same batch)."""
        return self.batch * self.seq

    def label(self) -> str:
        return f"{self.spec.name}/{self.plan}/{self.workload}/s{self.seq}"


class TrainLoss(nn.Module):
    """``model(ids).logits`` -> fp32 cross-entropy against ``targets`` (a scalar, the same on every rank)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class Prefill(nn.Module):
    """The logits of the last position, ``[batch, vocab]`` (what a server needs from a prefill)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, logits_to_keep=1).logits[:, -1]


def unavailable(backend: str, case: Case, env: Env) -> str | None:
    """Why ``backend`` cannot run ``case`` here (shown as the row's status), or None."""
    if backend == "inductor+async-tp":
        if not env.cuda:
            return "n/a (needs CUDA symmetric memory)"
        if case.plan not in ("sp", "ep"):
            return "n/a (async-TP rewrites all_gather/reduce_scatter matmuls: use --plan sp)"
        if env.world == 1:
            return "n/a (world size 1: no collectives)"
    if backend in GRAPHED:
        if not env.cuda:
            return "n/a (CUDA graphs need CUDA)"
        if case.plan == "ep":
            return "n/a (the ep plan's data-dependent all_to_all splits cannot be captured in a CUDA graph)"
    if backend in BOUNDS and case.plan == "ep":
        return ("n/a (the ep plan's dispatch reads split sizes on the host between graphs: without the count "
                "exchange the ranks' eager all_to_alls would disagree)")
    return None


def compile_for(backend: str, module: nn.Module, env: Env, fuse: str, capture: coverage.GraphCapture,
                experiments: tuple[str, ...] = ()) -> Any:
    """``module`` as ``backend`` runs it (``eager``: unchanged). ``dynamic=False``: one static graph per shape.
    ``fuse`` and ``experiments``: flashoverlap's settings of those names (fusing backends only); an experiment
    ``name=value`` is the setting ``name`` (the option ``flashoverlap.<name>``, checked by ``config``)."""
    if backend == "eager":
        return module
    from torch._inductor import list_mode_options

    options: dict[str, Any] = {"post_grad_custom_post_pass": capture}
    if backend in GRAPHED:
        options.update(list_mode_options("reduce-overhead"))
    if backend == "inductor+async-tp":
        options["_micro_pipeline_tp"] = True
        if env.group_name not in env.symm_mem:
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated (and unnecessary) on newer torch
                enable_symm_mem_for_group(env.group_name)
            env.symm_mem.add(env.group_name)
    if backend in BOUNDS:
        from .bound import NoCommPass

        options["post_grad_custom_pre_pass"] = NoCommPass()
    if backend in FUSING:
        options["flashoverlap.fuse"] = fuse
        names, settings = split_experiments(experiments)
        if names:
            options["flashoverlap.experiments"] = frozenset(names)
        options.update(settings)
        return torch.compile(module, backend=flashoverlap_backend(), options=options, dynamic=False)
    return torch.compile(module, backend="inductor", options=options, dynamic=False)


def split_experiments(items: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """``items`` as (experiment names, in order; flashoverlap options ``flashoverlap.<name>`` of the items that are a
    setting ``name=value``, checked by ``config`` when compiled)."""
    items = list(items)
    names = list(dict.fromkeys(x for x in items if "=" not in x))
    return names, {"flashoverlap." + k: v for k, v in (x.split("=", 1) for x in items if "=" in x)}


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters, DTensor and plain ones in separate groups (same settings): the
    multi-tensor (foreach) kernels, the default on CUDA, refuse a group that mixes them."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if isinstance(p, DTensor)]},
              {"params": [p for p in params if not isinstance(p, DTensor)]}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def flashoverlap_backend() -> Any:
    """``"flashoverlap"`` when the ``torch_dynamo_backends`` entry point is installed (``pip install -e .``), else
    the backend function itself (a source checkout on ``PYTHONPATH``): the same compiler either way."""
    try:
        torch._dynamo.lookup_backend("flashoverlap")
        return "flashoverlap"
    except Exception:  # noqa: BLE001 - InvalidBackend; its module moved between torch versions
        from flashoverlap_inductor.backend import flashoverlap_backend as fn

        return fn


def make_data(case: Case, steps: int, seed: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (ids, targets) pairs ``[batch, seq]`` of random token ids, the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 1000003 + case.seq)
    vocab, shape = case.spec.vocab, (case.batch, case.seq)
    if case.workload == "prefill":  # one input, run every step
        ids = torch.randint(0, vocab, shape, generator=gen)
        return [(ids.to(device), ids.to(device))] * steps
    return [(torch.randint(0, vocab, shape, generator=gen).to(device),
             torch.randint(0, vocab, shape, generator=gen).to(device)) for _ in range(steps)]


def _progress(env: Env, total: int, desc: str) -> Progress:
    return Progress(total, desc, enabled=env.rank == 0 and not env.quiet)


def warm(step, n_warm: int, env: Env, bar: Progress) -> float:
    """The first call (timed alone, wall clock: it compiles; s), then ``n_warm`` unmeasured steps."""
    env.sync()
    dist.barrier()
    t0 = time.perf_counter()
    step(0)
    env.sync()
    first_s = time.perf_counter() - t0
    bar.update(note=f"first call {first_s:.1f} s")
    for i in range(1, 1 + n_warm):
        step(i)
        bar.update()
    return first_s


def timed(step, indices: list[int], env: Env, bar: Progress, host: list[float] | None = None,
          host_at: int = 0) -> tuple[list[float], list[Any]]:
    """(per-step ms, outputs) of the steps on inputs ``indices``, after a sync and a barrier; see the module
    docstring. On CUDA the host time of step ``host_at`` (ms from the call to its return, no sync) is appended to
    ``host`` where given: issued onto the empty queue the sync left, or behind ``host_at`` queued steps, it is what
    the host takes to issue a step (later steps may wait for a full launch queue)."""
    env.sync()
    dist.barrier()
    outs, times, events = [], [], []
    for i in indices:
        if env.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            outs.append(step(i))
            if host is not None and len(events) == host_at:
                host.append((time.perf_counter() - t) * 1e3)
            end.record()
            events.append((start, end))
        else:
            dist.barrier()
            t = time.perf_counter()
            outs.append(step(i))
            times.append((time.perf_counter() - t) * 1e3)
        bar.update()
    if env.cuda:
        torch.cuda.synchronize(env.device)
        times = [s.elapsed_time(e) for s, e in events]
    return times, outs


@dataclass
class Built:
    """A compiled backend ready to run: ``step(i)`` runs one step on input ``i`` (train: returns the loss;
    prefill: under ``no_grad``, returns None); ``values(outs)``: the row's values from the measured steps' outputs
    (train: their losses; prefill: one more call's logits)."""

    step: Any
    values: Any


def build(kind: str, case: Case, template: nn.Module, data: list, env: Env, args: Any,
          capture: coverage.GraphCapture, experiments: tuple[str, ...]) -> Built:
    """A fresh deep copy of ``template`` compiled for backend ``kind`` (a fresh AdamW for train)."""
    model = copy.deepcopy(template)
    if case.workload == "train":
        model.train()
        fn = compile_for(kind, TrainLoss(model), env, args.fuse, capture, experiments)
        opt = make_optimizer(model, args.lr)
        graphed = kind in GRAPHED

        def step(i: int) -> torch.Tensor:
            if graphed:  # a new iteration of the CUDA graphs: the last step's outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            loss = fn(*data[i])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach().clone() if graphed else loss.detach()  # a graph's output is reused next step

        return Built(step, lambda outs: torch.stack(outs).double().cpu())
    model.eval()
    fn = compile_for(kind, Prefill(model), env, args.fuse, capture, experiments)

    def forward(i: int) -> None:  # the logits are dropped: a CUDA graph's output is overwritten
        with torch.no_grad():
            fn(data[i][0])

    def values(outs: list) -> torch.Tensor:
        with torch.no_grad():
            out = fn(data[0][0]).double().cpu()  # one more call: a CUDA graph's output is reused
        env.sync()
        return out

    return Built(forward, values)


def run_backend(backend: str, case: Case, template: nn.Module, data: list, env: Env, args: Any) -> dict[str, Any]:
    """One row: ``ms`` (median step, max over ranks), ``compile_s``, ``peak_bytes``, fusion events, and under
    ``_values`` this rank's losses (train, every measured step) or last-position logits (prefill)."""
    from torch._inductor.utils import fresh_cache

    from flashoverlap_inductor import reporting as fo

    kind, extra = variant(backend)
    capture = coverage.GraphCapture()
    torch._dynamo.reset()
    shadow_calls()  # an earlier row's, left where it raised
    fo.reset_fusion_report()
    gc.collect()
    if env.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)
    n_warm, n_steps = args.warmup, args.steps
    bar = _progress(env, 1 + n_warm + n_steps, f"{case.label()} {backend}")
    cache = fresh_cache() if args.cache == "fresh" else contextlib.nullcontext()
    try:
        with cache:
            built = build(kind, case, template, data, env, args, capture,
                          tuple(dict.fromkeys((*args.experiments, *extra))))
            first_s = warm(built.step, n_warm, env, bar)
            host: list[float] = []
            times, outs = timed(built.step, list(range(1 + n_warm, 1 + n_warm + n_steps)), env, bar, host)
            values = built.values(outs)
            more = more_values(built, outs, case, args)
            traced = trace(args, case, backend, env, built.step)
    finally:
        bar.close()
    peak = int(env.reduce_max([torch.cuda.max_memory_allocated(env.device)])[0]) if env.cuda else None
    shadowed = shadow_calls()  # before the report is read: its counts go into the runtime counters
    runtime = fo.fusion_report() if kind in FUSING else None
    row = finish(backend, case, env, times, first_s, peak, capture, runtime, runtime, traced, values, host,
                 shadowed)
    row["_more_values"] = more
    return row


def more_values(built: Built, outs: list, case: Case, args: Any) -> list[torch.Tensor]:
    """Prefill under ``--value-calls N``: the values of N - 1 more calls on the first input (none otherwise)."""
    calls = getattr(args, "value_calls", 1)
    if calls <= 1 or case.workload != "prefill":
        return []
    return [built.values(outs) for _ in range(calls - 1)]


def shadow_calls() -> list[str]:
    """The bad calls the experiment ``shadow_check`` found since the last ask (``routes.shadow.collect``: this
    rank's; none where it is off)."""
    from flashoverlap_inductor.routes import shadow

    return shadow.collect()


def finish(backend: str, case: Case, env: Env, times: list[float], first_s: float, peak: int | None,
           capture: coverage.GraphCapture, compiled: Any, runtime: Any, traced: str | None,
           values: torch.Tensor, host: list[float] | None = None, shadowed: list[str] | None = None
           ) -> dict[str, Any]:
    """The row of a backend that ran: its times (ms: ``step_ms`` this rank's steps, ``step_ms_max`` each step's max
    over ranks, ``ms`` the median, max over ranks; a collective: every rank passes as many steps), compile time,
    ``peak`` bytes, the graphs ``capture`` saw, for a fusing backend the fusion report's compile part
    (``compiled``) and runtime counts (``runtime``), the trace's summary and ``_values``. ``host`` (CUDA: the host
    time of one step per ``timed`` call) gives ``host_ms``, the median, max over ranks (every rank passes as
    many, or none). ``shadowed``: this rank's bad calls under the experiment ``shadow_check`` (``shadow_calls``),
    kept under ``shadow_bad``; the note gives the most any rank had (in the times' all_reduce)."""
    row: dict[str, Any] = {"backend": backend, "status": "ok", "note": ""}
    row["step_ms"] = [round(t, 4) for t in times]
    host_median = [float(torch.tensor(host).median())] if host else []
    *step_max, ms, first_s, most = env.reduce_max([*host_median, *times, float(torch.tensor(times).median()),
                                                   first_s, float(len(shadowed or []))])
    if most:
        row["shadow_bad"] = shadowed or []
        first = f", this rank's first: {shadowed[0]}" if shadowed else ""
        row["note"] = f"shadow check: up to {int(most)} bad call(s) per rank (each rank's log names them){first}"[:600]
    if host_median:
        row["host_ms"], step_max = step_max[0], step_max[1:]
    row["step_ms_max"] = [round(t, 4) for t in step_max]  # per step, max over ranks (``e2e.add_hidden``'s spread)
    row["ms"], row["compile_s"] = ms, (first_s if backend != "eager" else None)
    row["first_call_s"] = first_s
    row["tokens_per_s"] = case.tokens / (ms / 1e3) if ms > 0 else None
    row["peak_bytes"] = peak
    row["graphs"] = capture.graphs
    if compiled is not None:
        row["fusion"] = {k: v for k, v in sorted(compiled.compile.items())}
        counts = runtime if isinstance(runtime, dict) else runtime.runtime
        row["runtime"] = {k: v for k, v in sorted(counts.items())}
        row["events"] = coverage.report_events(compiled)
    if traced and env.rank == 0:  # printed for rank 0 only
        from .trace_summary import summarize

        row["trace"] = {"path": traced, **summarize(traced)}
    row["_values"] = values
    return row


def trace(args: Any, case: Case, backend: str, env: Env, step: Any) -> str | None:
    """With ``--trace DIR``: two more steps (the first two inputs again) under ``torch.profiler``, exported as a
    Chrome trace ``DIR/<case>_<backend>_rank<r>.json``; its path, or None. Not timed, after the timed steps; the row
    keeps ``trace_summary.summarize``'s figures of it (printed under the table)."""
    if not getattr(args, "trace", None):
        return None
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    env.sync()
    with profile(activities=activities) as prof:
        for i in range(2):
            step(i)
        env.sync()
    name = f"{case.label()}_{backend}_rank{env.rank}.json".replace("/", "_").replace(" ", "_")
    path = Path(args.trace) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return str(path)


def release(env: Env) -> None:
    """Free what the last backend compiled and allocated (call after its ``run_backend`` returned)."""
    torch._dynamo.reset()
    gc.collect()
    if env.cuda:
        torch.cuda.empty_cache()


def rel_error(values: torch.Tensor, ref: torch.Tensor, workload: str) -> float:
    """Train: the max over measured steps of ``|loss - ref| / |ref|``. Prefill: the norm-wise relative error of the
    logits, ``||logits - ref||_2 / ||ref||_2`` (an element-wise max over a 128k vocabulary measures bf16's
    outliers, not the model). Inf when shapes differ or anything is not finite."""
    if values.shape != ref.shape or not bool(torch.isfinite(values).all()):
        return float("inf")
    if workload == "train":
        return float(((values - ref).abs() / ref.abs().clamp_min(1e-12)).max())
    return float((values - ref).norm() / ref.norm().clamp_min(1e-12))
