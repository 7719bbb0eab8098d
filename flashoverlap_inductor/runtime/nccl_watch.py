"""The host watchdog of the NCCL route's calls: the bound that the NCCL kernels themselves do not have.

Every wait of ours on the GPU is bounded (``csrc/device_wait.hpp``), but an NCCL kernel waits for its peers without
a bound: when NCCL refuses one rank's call (``routes/nccl.py``: that rank aborts its group and raises), the peers'
matching kernels wait forever. This watchdog bounds them, as torch's own NCCL watchdog does for the collectives
torch issues (it does not see the library's direct NCCL calls).

Invariants:

- Each eager NCCL-route call with rows is *watched* (``watch``): an event recorded on the caller's stream after the
  call (after its join, i.e. after every NCCL kernel of the call) and a deadline in host seconds, measured from the
  enqueue as torch measures its collectives': ``enqueue + 2 x wait bound + GRACE_S`` (the call's own waits give up
  after one bound from their start; the second bound and the grace cover a queue ahead of the call). Calls inside a
  CUDA-graph capture are not watched (their replays have no host enqueue to measure from).
- One daemon thread per process, started on the first watched call, sleeps while nothing is watched; while calls
  are in flight it polls the oldest (``event.query()``, no sync) at most every ``POLL_S`` and forgets completed ones.
- A call past its deadline is *given up* once: (1) the device fault block of the call's domain gets code 5 from a
  one-thread kernel on the watchdog's own stream (``fo_fault_mark``: it runs beside the stuck NCCL kernel), so the
  call's last kernel (after the join, on the caller's stream) poisons the output (NaN) and mirrors the fault to the
  host; (2) the group is aborted (``_inductor_compat.abort_group``), which makes the stuck NCCL kernels return.
  The rank's next eager call or ``routes.check()`` raises ``FlashOverlapTimeout`` naming the call. The aborted group
  is unusable afterwards (NCCL's rule): the job creates a new one, as after any NCCL abort. Every later call watched
  on that group is given up at once (its kernels were aborted too).
- The thread never raises: a failure of the mark or the abort is logged; the clock and the give-up action are
  injectable (``Watchdog(clock=..., give_up=...)``) for the CPU tests.
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


@dataclass
class Watched:
    """One watched call: ``event`` (``query()`` -> bool), ``deadline`` (host s), the ``group`` to abort, the fault
    ``domain`` to mark (``runtime.faults.FaultDomain``; None in tests) and the call's ``description``."""

    event: Any
    deadline: float
    group: Any
    domain: Any
    description: str


class Watchdog:
    """The watch list and its thread (module docstring). ``give_up(item)`` is called once per overdue call, from
    the thread; ``clock()`` gives host seconds."""

    def __init__(self, give_up: Callable[[Watched], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.give_up = give_up or give_up_call
        self.clock = clock
        self.items: collections.deque[Watched] = collections.deque()
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        # groups given up (their later calls are given up at once); the objects, not their id()s, which a new group
        # could reuse once an aborted one is freed
        self.aborted: list[Any] = []
        self.given_up = 0

    def watch(self, event: Any, timeout_s: float, group: Any, domain: Any, description: str) -> None:
        """Watch one call enqueued now whose waits are bounded by ``timeout_s``."""
        item = Watched(event, self.clock() + 2.0 * timeout_s + GRACE_S, group, domain, description)
        with self.cond:
            self.items.append(item)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="flashoverlap-nccl-watchdog", daemon=True)
                self.thread.start()
            self.cond.notify()

    def poll(self) -> float | None:
        """One pass: forget the completed calls at the head, give up the overdue ones; the seconds until the next
        deadline (None: nothing watched). Called by the thread; tests call it directly."""
        while True:
            with self.cond:
                if not self.items:
                    return None
                item = self.items[0]
                if _done(item.event):
                    self.items.popleft()
                    continue
                now = self.clock()
                if now < item.deadline and not any(g is item.group for g in self.aborted):
                    return item.deadline - now
                self.items.popleft()
                if not any(g is item.group for g in self.aborted):
                    self.aborted.append(item.group)
                self.given_up += 1
            try:
                self.give_up(item)
            except Exception:  # noqa: BLE001 - the watchdog thread never dies; the rank's next call raises
                log.exception("flashoverlap: the NCCL watchdog could not give up %s", item.description)

    def _run(self) -> None:
        while True:
            wait = self.poll()
            with self.cond:
                if wait is None and not self.items:
                    self.cond.wait()
                else:
                    self.cond.wait(timeout=min(POLL_S, max(wait or 0.0, 0.001)))

    def pending(self) -> int:
        with self.cond:
            return len(self.items)


def _done(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:  # noqa: BLE001 - an event of a broken context: nothing left to watch
        return True


def give_up_call(item: Watched) -> None:
    """Mark the call's fault block (code 5, on a stream of the watchdog's own) and abort its group."""
    import torch

    from flashoverlap_inductor import _inductor_compat as compat
    from flashoverlap_inductor.native import kernels

    dom = item.domain
    log.error("flashoverlap: an NCCL call did not finish within its bound (%s); poisoning it and aborting its "
              "process group %s", item.description, getattr(item.group, "group_name", "?"))
    if dom is not None:
        with torch.cuda.device(dom.device):
            stream = torch.cuda.Stream(dom.device)
            kernels.check(kernels.library().fo_fault_mark(dom.block_ptr, CODE_WATCHDOG, 0, stream.cuda_stream),
                          "fo_fault_mark")
            stream.synchronize()  # the record is in the block before the aborted kernels let the call finish
    compat.abort_group(item.group)


_watchdog: Watchdog | None = None
_lock = threading.Lock()


def watchdog() -> Watchdog:
    """The process's watchdog (made on first use)."""
    global _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = Watchdog()
        return _watchdog
