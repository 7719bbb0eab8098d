"""``e2e --interleave N``: a case's backends timed in turns instead of one after another.

Every backend is built and warmed first (``runner.build``, ``runner.warm``: its first call and ``warmup`` steps,
each in a fresh Inductor cache under ``--cache fresh``), and all of them stay alive; then the measured steps are
taken in turns of ``N`` steps of one backend (``runner.timed``: a sync and a barrier before each turn, CUDA events
around each step, no sync between the steps of a turn), the backends' order rotating by one every round. A drift
of the host or the GPU during the run (clocks, the allocator, a neighbour) then touches every backend alike, where
one after another it lands on whichever ran last (2 H200s, qwen3-moe prefill: the same row read 0.79x and 0.47x of
Inductor in two runs). Each backend runs the same inputs in the same order as without ``--interleave``, so its
values (losses, logits) are the same, unless ``--turn-lead``.

A turn's first step, right after another backend ran, is slower than the rest: it starts from an idle host (the host
runs ahead within a turn only) after another model used the GPU and the allocator (2 H200s, Llama-3-8B sp, 37th
session: +4-5 ms on an 18 ms prefill step, +6-10 ms on a 100 ms train step, every backend, the bound too). A user
running one model never pays it, yet with turns of 2 steps it is half the samples and moves each row's median by
the spread between rows. So each turn begins with ``--turn-lead L`` unmeasured steps (default 1 under
``--interleave``; its inputs: the turn's own inputs again from its first, cycling where ``L`` exceeds the turn),
then its ``N`` measured ones: the rows time the steady state. The lead steps are the same for every backend, so rows
still compare value for value; with ``L`` > 0 a train row takes (N + L) / N times the optimizer steps of a run
without ``--interleave``, its turn's first inputs trained on twice, so its losses drift further from Inductor's
(``--turn-lead 0``: exactly the same values).

Costs: every backend's model, gradients and optimizer state in memory at once (``peak_bytes`` is not reported:
the backends share the peak). Under ``--time-budget-s`` (``bench/budget.py``) a backend is built, and a
round of turns started, only while the time left allows it.

A fusing backend's row keeps its own compile report (taken after its warm-up) and the runtime counts of its own
calls (the counters' growth over its turns, lead steps included, added to what its warm-up counted).
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import reporting as fo

from . import coverage
from .budget import FINISH_SHARE, MEASURE_SHARE
from .runner import (
    FUSING,
    Built,
    Case,
    Env,
    _progress,
    build,
    finish,
    more_values,
    shadow_calls,
    timed,
    trace,
    variant,
    warm,
)


@dataclass
class _Live:
    """One built, warmed backend and what its turns measured."""

    backend: str
    built: Built
    capture: coverage.GraphCapture
    first_s: float
    compiled: Any  # its fusion report after the warm-up (fusing backends), else None
    runtime: dict[str, int]
    times: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)  # each turn's first measured step's host time (ms; CUDA)
    shadowed: list[str] = field(default_factory=list)  # bad calls under the experiment shadow_check (this rank's)
    outs: list[Any] = field(default_factory=list)


def run_interleaved(backends: list[str], case: Case, template: Any, data: list, env: Env,
                    args: Any) -> list[dict[str, Any]]:
    """The rows of ``backends`` (each available here) on ``case`` (``runner.run_backend``'s, ``peak_bytes`` None),
    measured in turns of ``args.interleave`` steps (module docstring); a backend that fails is an error row. Dynamo's
    recompile limit is raised for the run (each backend holds a cache entry of the same ``forward``)."""
    with compat.recompile_limit(2 * len(backends) + 8):
        return _run(backends, case, template, data, env, args)


def _run(backends: list[str], case: Case, template: Any, data: list, env: Env, args: Any) -> list[dict[str, Any]]:
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    live: list[_Live] = []
    rows: dict[str, dict[str, Any]] = {}
    budget = args.budget
    for backend in backends:
        if not budget.allows(env, "build", MEASURE_SHARE):
            rows[backend] = {"backend": backend, "status": "n/a", "note": budget.skipped("its build")}
            continue
        kind, extra = variant(backend)
        capture = coverage.GraphCapture()
        shadow_calls()  # an earlier backend's, left where it raised
        fo.reset_fusion_report()
        bar = _progress(env, 1 + args.warmup, f"{case.label()} {backend} (build)")
        started = budget.now()
        try:
            with fresh_cache() if args.cache == "fresh" else contextlib.nullcontext():
                built = build(kind, case, template, data, env, args, capture,
                              tuple(dict.fromkeys((*args.experiments, *extra))))
                first_s = warm(built.step, args.warmup, env, bar)
            shadowed = shadow_calls()  # its warm-up's, before the report is read
            report = fo.fusion_report() if kind in FUSING else None
            live.append(_Live(backend, built, capture, first_s, report, dict(report.runtime) if report else {},
                              shadowed=shadowed))
        except Exception as exc:  # noqa: BLE001 - reported in the row; the exit status becomes 1
            rows[backend] = _error(backend, exc, env)
        finally:
            bar.close()
            budget.timed("build", budget.now() - started)
    first = 1 + args.warmup
    indices = list(range(first, first + args.steps))
    turns = [indices[i:i + args.interleave] for i in range(0, len(indices), args.interleave)]
    lead = args.turn_lead  # unmeasured steps at the start of each turn (module docstring)
    bar = _progress(env, (len(indices) + lead * len(turns)) * len(live),
                    f"{case.label()} interleaved, {len(live)} backends")
    measured = 0  # steps each backend took: whole rounds only, so the losses still compare step for step
    try:
        for t, turn in enumerate(turns):
            if t and not budget.allows(env, "round", FINISH_SHARE):
                break
            started = budget.now()
            for one in live[t % len(live):] + live[:t % len(live)] if live else []:
                if one.backend in rows:  # failed in an earlier turn
                    continue
                before = fo.fusion_report().runtime
                try:
                    host: list[float] = []
                    times, outs = timed(one.built.step, [turn[i % len(turn)] for i in range(lead)] + turn, env, bar,
                                        host, host_at=lead)
                    times, outs = times[lead:], outs[lead:]
                    one.host += host  # the turn's first measured step: behind its lead steps only
                except Exception as exc:  # noqa: BLE001 - reported in the row
                    rows[one.backend] = _error(one.backend, exc, env)
                    continue
                one.times += times
                one.outs += outs
                one.shadowed += shadow_calls()
                _add(one.runtime, before)
            budget.timed("round", budget.now() - started)
            measured += len(turn)
    finally:
        bar.close()
    for one in live:
        if one.backend in rows:
            continue
        try:
            before = fo.fusion_report().runtime
            values = one.built.values(one.outs)
            more = more_values(one.built, one.outs, case, args)
            traced = None
            if args.trace and budget.allows(env, "trace"):  # a verdict per backend, on every rank alike
                started = budget.now()
                traced = trace(args, case, one.backend, env, one.built.step)
                budget.timed("trace", budget.now() - started)
            one.shadowed += shadow_calls()
            _add(one.runtime, before)  # the calls of the values and the trace, as runner.run_backend counts them
            rows[one.backend] = finish(one.backend, case, env, one.times, one.first_s, None, one.capture,
                                       one.compiled, one.runtime, traced, values, one.host, one.shadowed)
            rows[one.backend]["_more_values"] = more
            said = f"interleaved, {args.interleave} step(s) per turn" + (
                f" after {lead} unmeasured" if lead else "") + (
                f"; time budget: {measured} of {len(indices)} steps" if measured < len(indices) else "")
            rows[one.backend]["note"] = "; ".join(x for x in (said, rows[one.backend]["note"]) if x)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            rows[one.backend] = _error(one.backend, exc, env)
    return [rows[b] for b in backends]


def _add(runtime: dict[str, int], before: dict[str, int]) -> None:
    """Add to ``runtime`` how much each run-time counter grew since ``before`` (a snapshot)."""
    for key, count in fo.fusion_report().runtime.items():
        runtime[key] = runtime.get(key, 0) + count - before.get(key, 0)


def _error(backend: str, exc: BaseException, env: Env) -> dict[str, Any]:
    if env.rank == 0:
        traceback.print_exc()
    return {"backend": backend, "status": "error", "note": f"{type(exc).__name__}: {exc}"[:300]}
