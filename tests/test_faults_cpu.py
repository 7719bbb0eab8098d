"""The fault-injection suite (``tests/fault_suite.py``) under pytest: on 2- and 3-rank gloo worlds, every injected
fault must end as a clear error on every rank, with no wrong result and no hang, and the next call must work."""

from __future__ import annotations

import fault_suite


def test_fault_suite_cpu():
    summary = fault_suite.run_suite()
    report = "\n".join([*summary.notes, summary.figure()])
    assert summary.faults > 0
    assert summary.wrong == 0, report
    assert summary.hangs == 0, report
    assert summary.clear == summary.faults, report
