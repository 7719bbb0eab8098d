"""The NCCL route's host watchdog (runtime/nccl_watch.py) on the CPU: fake events, a fake clock, a recording
give-up action. The GPU side (the fault mark, the abort releasing a stuck NCCL kernel) runs in
``examples/device/fault_probe_nccl.py`` (the refused case)."""

from __future__ import annotations

import threading
import time

from flashoverlap_inductor.runtime import nccl_watch


class Event:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make():
    clock, gone = Clock(), []
    return nccl_watch.Watchdog(give_up=gone.append, clock=clock), clock, gone


def test_completed_calls_are_forgotten_and_overdue_ones_given_up_once():
    w, clock, gone = make()
    w.items.append(nccl_watch.Watched(Event(True), 101.0, "g", None, "done"))
    w.items.append(nccl_watch.Watched(Event(False), clock.now + 2 * 0.5 + nccl_watch.GRACE_S, "g", None, "stuck"))
    assert w.poll() == 2.0 and [i.description for i in w.items] == ["stuck"]  # the head waits for its deadline
    clock.now += 2.5
    assert w.poll() is None
    assert [i.description for i in gone] == ["stuck"] and w.given_up == 1
    assert w.poll() is None and len(gone) == 1  # given up once


def test_later_calls_of_an_aborted_group_are_given_up_at_once_others_wait():
    w, clock, gone = make()
    w.items.extend([nccl_watch.Watched(Event(False), clock.now - 1, "g1", None, "a"),
                    nccl_watch.Watched(Event(False), clock.now + 50, "g1", None, "b"),
                    nccl_watch.Watched(Event(False), clock.now + 60, "g2", None, "c")])
    assert w.poll() == 60.0
    assert [i.description for i in gone] == ["a", "b"] and [i.description for i in w.items] == ["c"]


def test_deadline_is_twice_the_bound_plus_grace_from_the_enqueue():
    w, clock, _ = make()
    w.thread = threading.current_thread()  # no thread: poll by hand
    w.watch(Event(False), 0.25, "g", None, "x")
    assert w.items[0].deadline == clock.now + 0.5 + nccl_watch.GRACE_S


def test_give_up_errors_are_logged_and_the_watchdog_goes_on(caplog):
    clock = Clock()

    def boom(item):
        raise RuntimeError("no device")

    w = nccl_watch.Watchdog(give_up=boom, clock=clock)
    w.items.extend([nccl_watch.Watched(Event(False), 0.0, "g", None, "x"),
                    nccl_watch.Watched(Event(True), 0.0, "h", None, "y")])
    assert w.poll() is None and w.given_up == 1
    assert "could not give up x" in caplog.text


def test_the_thread_gives_up_a_stuck_call_and_sleeps_when_idle():
    gone = []
    w = nccl_watch.Watchdog(give_up=gone.append)
    ok = Event(False)
    w.watch(ok, 0.0, "g1", None, "finishes")
    ok.done = True
    w.watch(Event(False), 0.0, "g2", None, "stuck")  # deadline: GRACE_S from now
    until = time.monotonic() + nccl_watch.GRACE_S + 2.0
    while not gone and time.monotonic() < until:
        time.sleep(0.02)
    assert [i.description for i in gone] == ["stuck"] and w.pending() == 0
    assert w.thread is not None and w.thread.daemon


def test_a_new_group_is_not_taken_for_an_aborted_one():
    w, clock, gone = make()

    class Group:
        pass

    old = Group()
    w.items.append(nccl_watch.Watched(Event(False), clock.now - 1, old, None, "old"))
    assert w.poll() is None and [i.description for i in gone] == ["old"]
    del old
    w.items.append(nccl_watch.Watched(Event(False), clock.now + 5, Group(), None, "new"))
    assert w.poll() == 5.0 and len(gone) == 1
