"""The NCCL route's host watchdog (runtime/nccl_watch.py) on the CPU: fake events, a fake clock, a recording
give-up action. The GPU side (the fault mark, the abort releasing a stuck NCCL kernel) runs in
``examples/device/fault_probe_nccl.py`` (the refused case)."""

from __future__ import annotations

import threading
import time
import types

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


def item(done: bool, deadline: float | None, group, desc: str, started=None) -> nccl_watch.Watched:
    """A watched call whose deadline is already set (``started`` None: started when watched)."""
    return nccl_watch.Watched(started, Event(done), 0.0, group, None, desc, deadline)


def test_completed_calls_are_forgotten_and_overdue_ones_given_up_once():
    w, clock, gone = make()
    w.items.append(item(True, 101.0, "g", "done"))
    w.items.append(item(False, clock.now + 2 * 0.5 + nccl_watch.GRACE_S, "g", "stuck"))
    assert w.poll() == 2.0 and [i.description for i in w.items] == ["stuck"]
    clock.now += 2.5
    assert w.poll() is None
    assert [i.description for i in gone] == ["stuck"] and w.given_up == 1
    assert w.poll() is None and len(gone) == 1  # given up once


def test_later_calls_of_an_aborted_group_are_dropped_unmarked_others_wait():
    w, clock, gone = make()
    w.items.extend([item(False, clock.now - 1, "g1", "a"), item(False, clock.now + 50, "g1", "b"),
                    item(False, clock.now + 60, "g2", "c")])
    w.poll()
    assert w.poll() == 60.0  # "b" dropped on the next pass, "c" waits for its own deadline
    assert [i.description for i in gone] == ["a"] and w.dropped == 1
    assert [i.description for i in w.items] == ["c"]


def test_the_deadline_starts_when_the_call_starts_on_the_device_not_at_the_enqueue():
    w, clock, gone = make()
    w.thread = threading.current_thread()  # no thread: poll by hand
    started = Event(False)
    w.watch(started, Event(False), 0.25, "g", None, "queued behind a long step")
    assert w.items[0].deadline is None and w.poll() == nccl_watch.POLL_S
    clock.now += 3600.0  # the host ran an hour ahead of the device: not overdue while the call has not started
    assert w.poll() == nccl_watch.POLL_S and gone == []
    started.done = True
    assert w.poll() == 0.5 + nccl_watch.GRACE_S
    assert w.items[0].deadline == clock.now + 0.5 + nccl_watch.GRACE_S
    clock.now += 0.5 + nccl_watch.GRACE_S
    assert w.poll() is None and [i.description for i in gone] == ["queued behind a long step"]


def test_give_up_errors_are_logged_and_the_watchdog_goes_on(caplog):
    clock = Clock()

    def boom(item):
        raise RuntimeError("no device")

    w = nccl_watch.Watchdog(give_up=boom, clock=clock)
    w.items.extend([item(False, 0.0, "g", "x"), item(True, 0.0, "h", "y")])
    assert w.poll() is None and w.given_up == 1
    assert "could not give up x" in caplog.text


def test_the_thread_gives_up_a_stuck_call_and_sleeps_when_idle():
    gone = []
    w = nccl_watch.Watchdog(give_up=gone.append)
    ok = Event(False)
    w.watch(None, ok, 0.0, "g1", None, "finishes")
    ok.done = True
    w.watch(Event(True), Event(False), 0.0, "g2", None, "stuck")  # deadline: GRACE_S after its start is seen
    until = time.monotonic() + nccl_watch.GRACE_S + 2.0
    while not gone and time.monotonic() < until:
        time.sleep(0.02)
    assert [i.description for i in gone] == ["stuck"] and w.pending() == 0
    assert w.thread is not None and w.thread.daemon


def test_a_new_group_is_not_taken_for_an_aborted_one():
    # the give-up action keeps no reference to the old group (the watchdog alone may), so a group remembered by
    # id() could be freed and its id given to the new one (CPython reuses the freed memory of an equal-sized object)
    clock, gone = Clock(), []
    w = nccl_watch.Watchdog(give_up=lambda it: gone.append(it.description), clock=clock)

    class Group:
        pass

    old = Group()
    old_id = id(old)
    w.items.append(item(False, clock.now - 1, old, "old"))
    assert w.poll() is None and gone == ["old"]
    del old
    fresh = [Group() for _ in range(64)]
    new = next((g for g in fresh if id(g) == old_id), fresh[0])
    w.items.append(item(False, clock.now + 5, new, "new"))
    assert w.poll() == 5.0 and gone == ["old"]


def test_an_overdue_call_behind_a_later_deadline_is_given_up():
    # a call of a group with a long bound at the head must not shield a later call of a group with a short one
    w, clock, gone = make()
    w.items.extend([item(False, clock.now + 600, "slow", "long bound"),
                    item(True, clock.now - 1, "fast", "done late in the list"),
                    item(False, clock.now + 2, "fast", "short bound")])
    assert w.poll() == 2.0 and gone == []
    clock.now += 3
    assert w.poll() == 597.0
    assert [i.description for i in gone] == ["short bound"]
    assert [i.description for i in w.items] == ["long bound"]


def test_the_route_watches_the_side_stream_not_the_callers(monkeypatch):
    """``NcclRoute.execute`` watches a start event on the caller's stream (before the call) and an end event on the
    side stream (after the call's NCCL kernels): the caller's stream also holds this rank's GEMM, which the wait
    bound does not cover, so a late GEMM (the injected stall) must not get a healthy group aborted. Not under a
    capture."""
    import torch

    from flashoverlap_inductor.routes import nccl

    recorded, watched = [], []

    class FakeEvent:
        def record(self, stream=None):
            recorded.append(stream)

    class Recorder:
        def watch(self, started, done, timeout_s, group, domain, description):
            watched.append((started, done, timeout_s, group, domain, description))

    group = types.SimpleNamespace(group_name="g7", rank=lambda: 0)
    side = types.SimpleNamespace(cuda_stream=42)
    monkeypatch.setattr(nccl.nccl_direct, "communicator", lambda g, d: types.SimpleNamespace(comm=1))
    monkeypatch.setattr(nccl.compat, "current_raw_stream", lambda index: 7)
    monkeypatch.setattr(nccl, "slot_domain", lambda res, slot: "dom")
    monkeypatch.setattr(nccl, "kernel_b", lambda b, choice: (b, b.stride(0)))
    monkeypatch.setattr(nccl, "fused_call", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: "the caller's stream")
    monkeypatch.setattr(nccl_watch, "watchdog", lambda: Recorder())
    a, b = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    res = types.SimpleNamespace(slot=lambda cur, dedicated: 0, counters=[torch.zeros(4, dtype=torch.int32)],
                                expected=[torch.zeros(4, dtype=torch.int32)], side=side)
    launch = types.SimpleNamespace(collective="all_reduce", gather=None, kernel=None, workspace_bytes=0, index=0,
                                   gmap=None, order=None, sm_count=1, swizzle=1, csteps=None, timeout_ns=500_000_000,
                                   launch_id=1, description="all_reduce rows=256")
    for capturing in (False, True):
        ctx = types.SimpleNamespace(opnd=types.SimpleNamespace(a=a, b=b, bias=None), res=res, group=group,
                                    capturing=capturing, out_shape=(256, 128))
        nccl.ROUTE.execute(launch, ctx)
    assert recorded == ["the caller's stream", side]  # the start on the caller's stream, the end on the side
    assert [w[2:] for w in watched] == [(0.5, group, "dom", "all_reduce rows=256")]
    assert all(isinstance(e, FakeEvent) for e in watched[0][:2])


def test_give_up_call_aborts_the_group_even_when_the_mark_fails(monkeypatch, caplog):
    """The abort is what releases the stuck NCCL kernels: a mark that raises (no library, a launch error) is logged
    and the group is aborted all the same."""
    from flashoverlap_inductor import _inductor_compat as compat

    aborted = []

    def bad_mark(dom):
        raise RuntimeError("no library")

    monkeypatch.setattr(nccl_watch, "_mark", bad_mark)
    monkeypatch.setattr(compat, "abort_group", aborted.append)
    dom = types.SimpleNamespace(device=0)
    nccl_watch.give_up_call(nccl_watch.Watched(None, Event(False), 1.0, "g9", dom, "stuck call"))
    assert aborted == ["g9"]
    assert "could not mark the fault of stuck call" in caplog.text


def test_the_thread_binds_the_watched_calls_device(monkeypatch):
    """The thread's current device is the one of the first watched call's ``done`` event (a CUDA call from a thread
    with no device set would make a context on device 0); stand-in events without a device bind nothing."""
    import torch

    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    w = nccl_watch.Watchdog(give_up=lambda it: None)
    assert not w._bind_device()  # nothing watched
    w.items.append(nccl_watch.Watched(None, Event(False), 1.0, "g", None, "cpu stand-in"))
    assert not w._bind_device() and seen == []
    ev = Event(False)
    ev.device = types.SimpleNamespace(index=1)
    w.items.appendleft(nccl_watch.Watched(None, ev, 1.0, "g", None, "on cuda:1"))
    assert w._bind_device() and seen == [1]


def test_gave_up_names_the_aborted_group_only_and_a_busy_thread_is_not_woken():
    """``gave_up`` (read by the MoE route's settle after its host wait) is set for the group of a call given up;
    ``watch`` wakes the thread only when nothing was watched (a wake-up per call took the caller's GIL)."""
    w, clock, gone = make()
    notified = []
    w.thread = types.SimpleNamespace()  # no real thread: record the wake-ups
    real_notify = w.cond.notify
    w.cond.notify = lambda *a: (notified.append(1), real_notify(*a))
    w.watch(None, Event(False), 0.5, "g1", None, "first")
    w.watch(None, Event(False), 0.5, "g2", None, "second")
    assert len(notified) == 1
    assert not w.gave_up("g1") and not w.gave_up("g2")
    w.poll()  # both start now
    clock.now += 2 * 0.5 + nccl_watch.GRACE_S + 0.1
    w.poll()
    w.poll()
    assert w.gave_up("g1") and w.gave_up("g2") and [i.description for i in gone] == ["first", "second"]
    assert not w.gave_up("g3")


def test_an_aborted_group_never_hands_out_its_freed_communicator(monkeypatch):
    """Every abort of ours goes through ``nccl_direct.abort``: the group's cached communicator is forgotten,
    ``nccl_direct.communicator`` returns None for it and the MoE route's ``moe_nccl.communicator`` raises."""
    import pytest
    import torch

    from flashoverlap_inductor import _inductor_compat as compat
    from flashoverlap_inductor import errors
    from flashoverlap_inductor.native import nccl_direct
    from flashoverlap_inductor.routes import moe_nccl

    group, other, calls = types.SimpleNamespace(group_name="dead"), types.SimpleNamespace(group_name="alive"), []
    monkeypatch.setattr(compat, "abort_group", lambda g: calls.append(g) or True)
    monkeypatch.setitem(nccl_direct._by_group, (id(group), 0), (group, "stale communicator"))
    assert nccl_direct.communicator(group, torch.device("cuda", 0)) == "stale communicator"
    assert nccl_direct.abort(group) and calls == [group]
    assert nccl_direct.aborted(group) and not nccl_direct.aborted(other)
    assert (id(group), 0) not in nccl_direct._by_group
    assert nccl_direct.communicator(group, torch.device("cuda", 0)) is None
    with pytest.raises(errors.FlashOverlapTimeout, match="aborted"):
        moe_nccl.communicator(group, torch.device("cuda", 0))
    with pytest.raises(errors.FlashOverlapTimeout, match="aborted"):
        moe_nccl.check_not_given_up(group, "a call")
    assert moe_nccl.communicator(group, torch.device("cpu")) is None  # gloo tensors: torch's path
