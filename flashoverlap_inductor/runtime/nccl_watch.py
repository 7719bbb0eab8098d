"""The host watchdog of the NCCL route's calls: the bound that the NCCL kernels themselves do not have.

Every wait of ours on the GPU is bounded (``csrc/device_wait.hpp``), but an NCCL kernel waits for its peers without
a bound: when NCCL refuses one rank's call (``routes/nccl.py``: that rank aborts its group and raises), the peers'
matching kernels wait forever. This watchdog bounds them, as torch's own NCCL watchdog does for the collectives
torch issues (it does not see the library's direct NCCL calls).

Invariants:

- Each eager NCCL-route call (with rows or not) is *watched* (``watch``) by two events: ``started``, recorded on the
  caller's stream just before the call (it completes when the device reaches the call), and ``done``, recorded on
  the device's side stream after the call's last NCCL kernel (not on the caller's stream, whose own GEMM the wait
  bound does not cover: a rank whose GEMM starts late, e.g. the injected stall, must not have its healthy group
  aborted). The deadline is ``start + 2 x wait bound + GRACE_S`` in host seconds, from when the watchdog first sees
  ``started`` complete (within ``POLL_S``): not from the host's enqueue, which may run far ahead of the device; the
  call's own waits give up within one bound from their start, NCCL's transfers take the rest. Calls inside a
  CUDA-graph capture are not watched.
- One daemon thread per process, started on the first watched call, sleeps while nothing is watched; while calls
  are in flight it polls them at most every ``POLL_S`` (``event.query()``, no sync): it forgets the completed ones,
  starts the deadlines of the started ones and gives up every overdue one wherever it stands in the list (deadlines
  are not in enqueue order: groups have bounds of their own).
- The first overdue call of a group is *given up*: (1) the device fault block of the call's domain gets code 5 from
  a one-thread kernel on the watchdog's own stream (``fo_fault_mark``, preloaded: it runs beside the stuck NCCL
  kernel), so the call's last kernel (after the join, on the caller's stream) poisons the output (NaN) and mirrors
  the fault to the host; (2) the group is aborted (``nccl_direct.abort``), which makes the stuck NCCL
  kernels return. The rank's next eager call or ``routes.check()`` raises ``FlashOverlapTimeout`` naming the call.
  The aborted group is unusable afterwards (NCCL's rule): the job creates a new one. The group's later watched calls
  are dropped, not marked again: their kernels return aborted, and their last kernels still see the code, which
  the host clears only after a device sync (``FaultDomain.raise_fault``), so they are poisoned too; a second mark
  could land after that clear and poison a healthy later call.
- The thread never raises: a failure of the mark or the abort is logged (the abort runs even when the mark
  failed or did not run within ``MARK_WAIT_S``); its current device is the watched calls' (no context on device 0
  of another rank's GPU); the clock and the give-up action are injectable (``Watchdog(clock=..., give_up=...)``)
  for the CPU tests.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

GRACE_S = 1.0  # seconds added to twice the wait bound
POLL_S = 0.02  # the thread's longest sleep while calls are in flight (s)
CODE_WATCHDOG = 5  # the fault code of a call the watchdog gave up on (runtime/faults.py CODES)
MARK_WAIT_S = 2.0  # the longest wait for the fault mark before the abort (s)


@dataclass
class Watched:
    """One watched call: ``started`` and ``done`` events (``query()`` -> bool; ``started`` None: started when
    watched), ``span`` (s: the deadline after the start), the ``group`` to abort, the fault ``domain`` to mark
    (``runtime.faults.FaultDomain``; None in tests), the call's ``description`` and its ``deadline`` (host s; None
    until the start is seen)."""

    started: Any
    done: Any
    span: float
    group: Any
    domain: Any
    description: str
    deadline: float | None = None


class Watchdog:
    """The watch list and its thread (module docstring). ``give_up(item)`` is called once per aborted group, from
    the thread; ``clock()`` gives host seconds."""

    def __init__(self, give_up: Callable[[Watched], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.give_up = give_up or give_up_call
        self.clock = clock
        self.items: collections.deque[Watched] = collections.deque()
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        # the groups given up, as objects (a new group could reuse a freed one's id()); held for the process's life
        self.aborted: list[Any] = []
        self.given_up = 0  # calls given up (one per group)
        self.dropped = 0  # later calls of a given-up group, dropped unmarked

    def watch(self, started: Any, done: Any, timeout_s: float, group: Any, domain: Any, description: str) -> None:
        """Watch one call whose waits are bounded by ``timeout_s`` (s)."""
        item = Watched(started, done, 2.0 * timeout_s + GRACE_S, group, domain, description)
        with self.cond:
            idle = not self.items  # the thread sleeps untimed only with nothing watched
            self.items.append(item)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="flashoverlap-nccl-watchdog", daemon=True)
                self.thread.start()
            if idle:  # else its next poll (within POLL_S) sees the item: a wake-up per call would take the GIL
                self.cond.notify()  # from the caller's thread each time (measured: ~0.2 ms per watched MoE transfer)

    def poll(self) -> float | None:
        """One pass over the list (module docstring); the seconds until the next check is due (None: nothing is
        watched). Called by the thread; tests call it directly."""
        while True:
            overdue = None
            with self.cond:
                now, wait = self.clock(), None
                for cand in list(self.items):
                    if _done(cand.done):
                        self.items.remove(cand)
                    elif self._is_aborted(cand.group):
                        self.items.remove(cand)
                        self.dropped += 1
                    elif cand.deadline is None and cand.started is not None and not _done(cand.started):
                        wait = POLL_S if wait is None else min(wait, POLL_S)
                    else:
                        if cand.deadline is None:
                            cand.deadline = now + cand.span
                        if now < cand.deadline:
                            left = cand.deadline - now
                            wait = left if wait is None else min(wait, left)
                        elif overdue is None:
                            overdue = cand
                if overdue is None:
                    return wait if self.items else None
                self.items.remove(overdue)
                self.aborted.append(overdue.group)
                self.given_up += 1
            try:
                self.give_up(overdue)
            except Exception:  # noqa: BLE001 - the watchdog thread never dies; the rank's next call raises
                log.exception("flashoverlap: the NCCL watchdog could not give up %s", overdue.description)

    def _is_aborted(self, group: Any) -> bool:
        return any(g is group for g in self.aborted)

    def gave_up(self, group: Any) -> bool:
        """Whether a watched call of ``group`` was given up (the group is then aborted): set before the abort, so a
        host that waited for the call's kernels sees it once they return."""
        with self.cond:
            return self._is_aborted(group)

    def _run(self) -> None:
        bound = False
        while True:
            bound = bound or self._bind_device()
            wait = self.poll()
            with self.cond:
                if wait is None and not self.items:
                    self.cond.wait()
                else:
                    self.cond.wait(timeout=min(POLL_S, max(wait or 0.0, 0.001)))

    def _bind_device(self) -> bool:
        """Make this thread's current CUDA device the device of the watched calls (the first one's ``done``
        event): a CUDA call from a thread whose device was never set creates a context on device 0, on every rank
        of a host. True once bound (never for the CPU tests' stand-in events)."""
        with self.cond:
            event = self.items[0].done if self.items else None
        index = getattr(getattr(event, "device", None), "index", None)
        if not isinstance(index, int):
            return False
        try:
            import torch

            torch.cuda.set_device(index)
        except Exception:  # noqa: BLE001 - only the context's placement is at stake
            log.warning("flashoverlap: the NCCL watchdog could not set its thread's device to cuda:%d", index)
        return True

    def pending(self) -> int:
        with self.cond:
            return len(self.items)


def _done(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:  # noqa: BLE001 - an event of a broken context: nothing left to watch
        return True


def give_up_call(item: Watched) -> None:
    """Mark the call's fault block (code 5, on a stream of the watchdog's own) and abort its group. The abort runs
    whatever became of the mark: it is what makes the stuck NCCL kernels return."""
    from flashoverlap_inductor.native import nccl_direct

    dom = item.domain
    log.error("flashoverlap: an NCCL call did not finish within its bound (%s); poisoning it and aborting its "
              "process group %s", item.description, getattr(item.group, "group_name", "?"))
    if dom is not None:
        try:
            _mark(dom)
        except Exception:  # noqa: BLE001 - the abort below must run: without it the peers' kernels never return
            log.exception("flashoverlap: the NCCL watchdog could not mark the fault of %s; aborting its group anyway",
                          item.description)
    nccl_direct.abort(item.group)


def _mark(dom: Any) -> None:
    """``fo_fault_mark`` into ``dom``'s block on a fresh stream of the watchdog's, waited for at most ``MARK_WAIT_S``:
    the stream comes from torch's pool, which may hand out a stream that the stuck call blocks (a caller's pool
    stream), and then the mark runs only after the abort (logged)."""
    import torch

    from flashoverlap_inductor.native import kernels

    with torch.cuda.device(dom.device):
        stream = torch.cuda.Stream(dom.device)
        kernels.check(kernels.library().fo_fault_mark(dom.block_ptr, CODE_WATCHDOG, 0, stream.cuda_stream),
                      "fo_fault_mark")
        until = time.monotonic() + MARK_WAIT_S
        while not stream.query():  # the record is in the block before the aborted kernels let the call finish
            if time.monotonic() > until:
                log.error("flashoverlap: the NCCL watchdog's fault mark did not run within %.1f s (its stream waits "
                          "behind the stuck call); aborting without it: the call's output may not be poisoned",
                          MARK_WAIT_S)
                return
            time.sleep(0.001)


_watchdog: Watchdog | None = None
_lock = threading.Lock()


def watchdog() -> Watchdog:
    """The process's watchdog (made on first use)."""
    global _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = Watchdog()
        return _watchdog
