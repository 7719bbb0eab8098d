"""``e2e --time-budget-s S``: a run that ends within ``S`` seconds and still reports what it measured.

A device call has a hard wall-clock limit; an e2e run killed at it prints nothing (an interleaved run prints its
rows at its end). Under a budget the run instead stops starting work it may not finish:

* a backend is built (compiled and warmed) only while the time left exceeds the longest build so far plus the
  share kept for measuring (``MEASURE_SHARE`` of ``S``); one not built shows ``n/a (time budget: ...)``;
* interleaved, a round of turns (one turn of every backend) starts only while the time left exceeds the longest
  round so far plus the share kept for the end (``FINISH_SHARE``: the values, traces and table), and always at
  least one round runs; rows that stopped early say how many steps they took. Rounds are whole, so every backend
  has run the same steps and the losses still compare step for step;
* one backend after another, a backend starts only while the time left exceeds the longest backend so far plus
  ``FINISH_SHARE``;
* interleaved, each backend's profiler trace (``--trace``) is taken only while the time left exceeds the longest trace
  so far.

The budget counts from ``--budget-start-unix`` when given (the wall-clock time the caller launched the run, e.g. the
suite's ``date +%s`` before ``torchrun``: the ranks' start, imports and process group come out of it), else from
the argument check. It is an estimate from the work seen so far: the first build and the first round always run.

Invariant: every verdict is one all_reduce (max) of the ranks' own verdicts, taken at the same point by every rank,
so the ranks stop together and their collectives stay paired. Without a budget no collective is added. Times in s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

MEASURE_SHARE = 0.3  # of the budget: kept for the measured rounds when deciding whether to build another backend
FINISH_SHARE = 0.1  # of the budget: kept for the values, traces and the table when deciding on another round


@dataclass
class Budget:
    """A deadline ``seconds`` after ``start`` (wall clock, ``time.time``); ``seconds`` None: no deadline."""

    seconds: float | None
    start: float = field(default_factory=lambda: time.time())
    longest: dict[str, float] = field(default_factory=dict)  # kind of work -> its longest run so far (s)

    def left(self) -> float:
        """Seconds left (inf without a deadline; may be negative)."""
        return float("inf") if self.seconds is None else self.seconds - (time.time() - self.start)

    @staticmethod
    def now() -> float:
        """The clock of ``timed`` (s)."""
        return time.time()

    def allows(self, env: Any, kind: str, keep_share: float = 0.0) -> bool:
        """Whether every rank has time for one more ``kind`` of work (its longest so far, 0 before the first) and
        ``keep_share`` of the budget after it. One all_reduce over ``env``'s ranks when there is a deadline."""
        if self.seconds is None:
            return True
        short = float(self.left() < self.longest.get(kind, 0.0) + keep_share * self.seconds)
        return env.reduce_max([short])[0] == 0.0

    def timed(self, kind: str, seconds: float) -> None:
        """Record that one ``kind`` of work took ``seconds``."""
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)

    def skipped(self, what: str) -> str:
        """The note of work not started."""
        return f"n/a (time budget: {self.seconds:g} s; {what} not started)"
