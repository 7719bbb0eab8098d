"""``e2e --time-budget-s``: the run stops starting work it may not finish, the ranks decide together, and the rows
measured by then are reported (``bench/budget.py``), checked with a fake clock and fake backends (no compiles)."""

from __future__ import annotations

import argparse

import pytest

from flashoverlap_inductor.bench import budget as budget_mod
from flashoverlap_inductor.bench import cli, interleave
from flashoverlap_inductor.bench.runner import Built


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Env:
    """One rank; counts the verdict collectives."""

    rank, world, cuda, quiet = 0, 1, False, True

    def __init__(self) -> None:
        self.collectives = 0

    def reduce_max(self, values):
        self.collectives += 1
        return list(values)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(budget_mod.time, "time", c)  # the module's time is the stdlib's: one clock for all
    return c


def test_no_budget_allows_everything_without_a_collective(clock):
    b, env = budget_mod.Budget(None), Env()
    clock.now += 1e9
    assert b.allows(env, "build", 0.9) and b.left() == float("inf") and env.collectives == 0


def test_budget_keeps_the_longest_work_and_a_share(clock):
    b, env = budget_mod.Budget(100.0), Env()
    assert b.allows(env, "build", 0.3)  # nothing timed yet: 100 s left >= 0 + 30
    b.timed("build", 40.0)
    b.timed("build", 20.0)  # the longest stays
    assert b.longest["build"] == 40.0
    clock.now += 25.0  # 75 s left >= 40 + 30
    assert b.allows(env, "build", 0.3)
    clock.now += 10.0  # 65 s left < 70
    assert not b.allows(env, "build", 0.3)
    assert b.allows(env, "round")  # another kind, never timed
    assert env.collectives == 4
    assert "time budget: 100 s" in b.skipped("its build")


def test_resolve_checks_and_creates_the_budget(clock):
    args = cli.build_parser().parse_args(["--preset", "tiny-llama", "--plan", "sp", "--time-budget-s", "30"])
    assert cli.resolve(args, "cpu", 2).budget.seconds == 30.0 and args.budget.start == clock.now
    args = cli.build_parser().parse_args(["--preset", "tiny-llama", "--plan", "sp", "--time-budget-s", "30",
                                          "--budget-start-unix", str(clock.now - 20)])
    assert cli.resolve(args, "cpu", 2).budget.left() == 10.0  # counted from the launch, not from here
    args = cli.build_parser().parse_args(["--preset", "tiny-llama", "--plan", "sp"])
    assert cli.resolve(args, "cpu", 2).budget.seconds is None
    args = cli.build_parser().parse_args(["--preset", "tiny-llama", "--plan", "sp", "--time-budget-s", "0"])
    with pytest.raises(cli.UsageError, match="time-budget-s"):
        cli.resolve(args, "cpu", 2)


def _fake_run(clock, monkeypatch, backends, budget_s, steps, per_turn, turn_lead):
    """``interleave._run`` over fake backends (builds of 20 s, steps of 5 s on ``clock``): the rows by backend, the
    inputs each backend's step ran, the env."""
    steps_run: dict[str, list[int]] = {}

    def build(kind, case, template, data, env, args, capture, experiments):
        steps_run[kind] = []
        return Built(lambda i, k=kind: steps_run[k].append(i), lambda outs: list(outs))

    def warm(step, n_warm, env, bar):
        clock.now += 20.0
        return 20.0

    def timed(step, indices, env, bar, host=None, host_at=0):
        for i in indices:
            step(i)
            clock.now += 5.0
        return [5.0 + 0.1 * n for n in range(len(indices))], list(indices)

    def finish(backend, case, env, times, first_s, peak, capture, compiled, runtime, traced, values, host=None,
               shadowed=None):
        return {"backend": backend, "status": "ok", "step_ms": times, "values": values, "note": ""}

    for name, fn in (("build", build), ("warm", warm), ("timed", timed), ("finish", finish),
                     ("trace", lambda *a: None)):
        monkeypatch.setattr(interleave, name, fn)
    args = argparse.Namespace(budget=budget_mod.Budget(budget_s), warmup=0, steps=steps, interleave=per_turn,
                              cache="keep", experiments=[], trace=None, turn_lead=turn_lead)

    class Case:
        def label(self):
            return "fake"

    env = Env()
    rows = {r["backend"]: r for r in interleave._run(backends, Case(), None, [], env, args)}
    return rows, steps_run, env


def test_interleaved_run_stops_between_builds_and_rounds(clock, monkeypatch):
    """Builds of 20 s and steps of 5 s under a 100 s budget, 4 backends, 4 turns of 1 step: three backends are built
    (the fourth would leave less than its build plus 30%), two whole rounds run (a third would leave less than a
    round plus 10%), and every built row holds the same 2 steps, noted."""
    backends = ["inductor", "inductor-ro", "bound", "eager"]
    rows, _, env = _fake_run(clock, monkeypatch, backends, 100.0, 4, 1, 0)
    assert rows["eager"]["status"] == "n/a" and "its build not started" in rows["eager"]["note"]
    for name in backends[:3]:
        row = rows[name]
        assert row["status"] == "ok" and row["step_ms"] == [5.0, 5.0] and row["values"] == [1, 2], row
        assert "time budget: 2 of 4 steps" in row["note"], row
    assert env.collectives == 4 + 2  # a verdict per build and per round after the first, on every rank alike


def test_each_turn_starts_with_unmeasured_lead_steps(clock, monkeypatch):
    """``--turn-lead 1`` with turns of 2 steps: each turn first runs its first input once more, untimed, then the 2
    measured steps; a row's times and values are those of the measured steps only (4 of 6 steps run), the same
    inputs for every backend, and the note says so."""
    rows, steps_run, _ = _fake_run(clock, monkeypatch, ["inductor", "bound"], None, 4, 2, 1)
    for name in ("inductor", "bound"):
        assert steps_run[name] == [1, 1, 2, 3, 3, 4], steps_run
        row = rows[name]
        assert row["values"] == [1, 2, 3, 4] and row["step_ms"] == pytest.approx([5.1, 5.2] * 2), row
        assert "2 step(s) per turn after 1 unmeasured" in row["note"], row


def test_a_lead_longer_than_its_turn_cycles_through_the_turn(clock, monkeypatch):
    """Steps 5 in turns of 2 with 3 lead steps: the lead cycles through each turn's own inputs, the short last turn
    included; only the 5 measured steps are a row's."""
    rows, steps_run, _ = _fake_run(clock, monkeypatch, ["inductor"], None, 5, 2, 3)
    assert steps_run["inductor"] == [1, 2, 1, 1, 2, 3, 4, 3, 3, 4, 5, 5, 5, 5], steps_run
    assert rows["inductor"]["values"] == [1, 2, 3, 4, 5], rows


@pytest.mark.parametrize("extra, lead", [([], 0), (["--interleave", "2"], 1), (["--interleave", "2", "--turn-lead",
                                                                                  "0"], 0)])
def test_turn_lead_defaults_to_one_under_interleave(extra, lead):
    args = cli.build_parser().parse_args(["--preset", "tiny-llama", "--plan", "sp", *extra])
    assert cli.resolve(args, "cpu", 2).turn_lead == lead
    args = cli.build_parser().parse_args(["--preset", "tiny-llama", "--plan", "sp", "--turn-lead", "1"])
    with pytest.raises(cli.UsageError, match="turn-lead"):
        cli.resolve(args, "cpu", 2)
