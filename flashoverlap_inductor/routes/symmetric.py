"""What the peer and ring routes share: symmetric-memory buffers, the workspace policy and the call ordering.

Invariants:

- Buffers are made collectively (every rank at the same call: every decision that makes one depends only on call
  shapes and history that all ranks share), on the allocation thread of ``streams.persistent`` (inside
  torch.compile's CUDA-graph warm-up the calling thread's allocations would land in the graph's pool).
- Workspaces only grow: a call uses the smallest with room, a larger one is made when none has room, none is freed
  before the route's ``reset``; inside a capture nothing is made (``smallest_with_room`` returns None and the call
  takes the next route). Sizes are powers of two of at least 1 MiB, so all together are less than twice the largest.
- The routed calls of a group on a device share one set of flags and buffers, so they run one after another: an
  eager call from another stream than the last one first waits for it (``order_after_last``); host threads issue
  them one at a time (the dispatcher's lock).
- A skipped call is recovered by ``resync``, never by a reset: a rank that skips a call altogether leaves its
  epochs one call behind its peers', whose waits then give up and record the fault in every rank's block. Every
  rank raises it (the skipper at ``routes.check()``, which reads the blocks after its sync; ``faults``), and
  raising it marks (device, group); so every rank's next call on the group (the dispatcher's, or the compiled
  wrapper's before a run of CUDA-graph replays) first runs ``resync``, the same collective on every rank: once
  every rank's device is idle, each zeroes its flag pages and epochs in place (the state they were made in; the
  buffers and the pointers captured graphs hold stay valid), and no rank goes on before every rank has. Inside a
  capture it raises instead (no collective there). A barrier that a rank does not reach within the bound raises on
  the ranks that came, and their next call tries again; the ranks compare the calls they resynchronized at and
  raise ``errors.RankMismatch`` when these differ (their programs are out of step). A skipping rank whose next call
  comes before its peers' waits gave up pairs that call with the skipped one: no device can tell two calls of one
  shape apart (as with NCCL, whose collectives pair by order).
"""

from __future__ import annotations

import ctypes
import datetime
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from flashoverlap_inductor import errors
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import faults, streams

from .. import _inductor_compat as compat
from . import nccl

T = TypeVar("T")
MIN_CAPACITY = 1 << 20  # bytes
RESYNC_MIN_S = 5.0  # the least ``resync`` waits for the other ranks (host time between their calls)
_serials = itertools.count(1)
_resyncs: dict[tuple[int, str], int] = {}  # (device, group) -> resynchronizations that passed their first barrier


def next_serial() -> int:
    """A number no workspace of this process had before (memoized argument structs are keyed by it, never by
    ``id()``, which a new workspace may reuse after a reset)."""
    return next(_serials)


def symmetric(nbytes: int, group: dist.ProcessGroup, device: torch.device, zero: bool,
              ranks: list[int]) -> tuple:
    """A symmetric uint8 buffer of ``nbytes``, its handle and the mappings of ``ranks``' buffers here (collective).
    ``zero``: zeroed before the rendezvous, so no peer can notify us before it has our address."""

    def make() -> tuple:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        if zero:
            buf.zero_()
            torch.cuda.synchronize(device)
        hdl = symm_mem.rendezvous(buf, group.group_name)
        return buf, hdl, [hdl.get_buffer(r, (nbytes,), torch.uint8) for r in ranks]

    return streams.persistent(device.index, make)


def fault_domain(route: str, group: dist.ProcessGroup, device: torch.device, page: torch.Tensor, offset: int,
                 peer_pages: list[int], label: str = "") -> faults.FaultDomain:
    """The group's fault block: ``offset`` bytes into its symmetric flag ``page``; every peer's at the same offset of
    its page (``peer_pages``: their addresses mapped here), which a timed-out wait of this rank also writes.
    ``label``: the routes a fault names (default ``route``; a page several routes share names them all)."""
    dom = faults.domain((route, device.index, group.group_name), lambda: faults.FaultDomain(
        device.index, route, group.group_name, page[offset:offset + faults.BLOCK_BYTES], faults.new_mirror(),
        resync=True, label=label))
    dom.setup(group.rank(), [base + offset for base in peer_pages])
    return dom


def smallest_with_room(made: list, need: int, capturing: bool, make: Callable[[int], T]) -> T | None:
    """The first of ``made`` (ascending ``capacity``) with at least ``need`` bytes; else, unless ``capturing``
    (None: no collective allocation inside a capture), a new one of ``make(capacity)``, a power of two of at least
    ``MIN_CAPACITY``, appended. A call shape maps to the same workspace for good (made ones only get larger), so a
    replay on one rank and the same call run eagerly on another use the same workspace (the gather's push start
    picks a slot set inside it per call: alike on every rank that runs the same calls, and checked by its per-set
    counters where not: ``gather_peer``)."""
    for ws in made:
        if ws.capacity >= need:
            return ws
    if capturing:
        return None
    ws = make(max(MIN_CAPACITY, 1 << (need - 1).bit_length()))
    made.append(ws)
    return ws


_last_stream: dict[tuple[int, str], tuple[int, torch.cuda.Stream]] = {}  # (cudaStream_t, the stream)


def order_after_last(group: dist.ProcessGroup, device: torch.device, stream: int) -> None:
    """Order an eager call on ``stream`` (the current one, a ``cudaStream_t`` as an int) after every routed call of
    ``group`` on ``device`` queued so far (an event wait when the last one came from another stream). Not under
    capture: a graph replays on the stream current at replay time, which must be the one that runs the group's eager
    calls (torch.compile's CUDA graphs warm up on a stream of their own, ordered here, and replay on the caller's)."""
    key = (device.index, group.group_name)
    last = _last_stream.get(key)
    if last is None or last[0] != stream:
        cur = torch.cuda.current_stream(device)
        if last is not None:
            cur.wait_stream(last[1])
        _last_stream[key] = (stream, cur)


def forget_streams() -> None:
    _last_stream.clear()


def resync(group: dist.ProcessGroup, index: int, routes: Sequence[SymmetricRoute], timeout_s: float,
           capturing: bool, call_id: str) -> None:
    """Bring the symmetric-memory state of (device ``index``, ``group``) back in step on every rank (collective:
    every rank of the group calls it at the same call, the one after they raised the group's fault; see the module
    docstring). ``call_id``: the call it runs before, in terms every rank shares (compared across the ranks);
    ``timeout_s``: the barriers' bound (at least ``RESYNC_MIN_S``). Records still in the blocks are dropped with
    the flags: they concern calls before this one, whose outputs were poisoned, and the fault was raised already.
    Clears the mark (``faults.resynced``) once every rank zeroed its state."""
    key = (index, group.group_name)
    if capturing:
        raise errors.FlashOverlapError(
            f"flashoverlap: group {group.group_name} (cuda:{index}) must resynchronize its ranks after a fault every "
            "rank raised, which takes a collective and cannot run inside a CUDA-graph capture: make one eager call "
            "on the group (or one run without capture) first")
    torch.cuda.synchronize(index)  # this rank's calls on the old epochs have ended (each within its bound)
    number = _resyncs.get(key, 0)
    store, world, rank = compat.group_store(group), group.size(), group.rank()
    name = f"flashoverlap/resync/{group.group_name}/{number}"
    timeout_s = max(timeout_s, RESYNC_MIN_S)
    store.set(f"{name}/call/{rank}", call_id)
    barrier(store, f"{name}/idle", world, timeout_s, group.group_name)  # every rank's device is idle on the group
    _resyncs[key] = number + 1  # a retry after a failed second barrier uses fresh keys, as every rank's does
    for route in routes:
        route.zero_state(key)
    torch.cuda.synchronize(index)
    barrier(store, f"{name}/zeroed", world, timeout_s, group.group_name)  # no notification lands before a zeroing
    faults.resynced(*key)
    calls = [store.get(f"{name}/call/{r}").decode() for r in range(world)]
    if len(set(calls)) > 1:
        per_rank = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
        raise errors.RankMismatch(
            f"flashoverlap: the ranks of group {group.group_name} resynchronized after a fault at different calls "
            f"({per_rank}): their programs are out of step (a rank skipped calls, or ran one before it learned of "
            "the fault; call routes.check() on every rank after a fault). Their state is fresh; their calls pair "
            "by order from here, as collectives do.")


def barrier(store: Any, key: str, world: int, timeout_s: float, group_name: str) -> None:
    """Wait until ``world`` ranks reached ``key`` on ``store`` (the group's), at most ``timeout_s``; every rank
    passes or none does: a rank that gives up withdraws its arrival first, unless the last rank had counted it
    (then it passes too), and raises ``errors.FlashOverlapTimeout``."""
    go = key + "/go"
    if store.add(key, 1) == world:
        store.set(go, "1")
    try:
        store.wait([go], datetime.timedelta(seconds=timeout_s))
        return
    except RuntimeError:  # DistStoreError: timed out
        others = store.add(key, -1)
        if others < world - 1:
            raise errors.FlashOverlapTimeout(
                f"flashoverlap: not all {world} ranks of group {group_name} came to resynchronize it within "
                f"{timeout_s:.1f} s after a fault every rank raised. A rank that skipped the faulted call "
                "learns of the fault in routes.check() (or at a later call): call it on every rank after a fault. "
                "The next call on the group tries again.") from None
    store.add(key, 1)  # the barrier had completed with this rank: its last rank sets ``go`` now
    store.wait([go], datetime.timedelta(seconds=timeout_s))


@dataclass
class SymmetricBuffer:
    """A symmetric buffer of ``capacity`` bytes per rank, every rank's mapped here (the ring route's workspace, the
    gather protocol's shard buffers), beside its route's flag page of the same (device, group)."""

    capacity: int
    buf: torch.Tensor
    hdl: object
    views: list[torch.Tensor]  # every rank's buffer mapped here (keeps the mappings alive)
    flags: Any  # the route's flag page (``ring.RingFlags``, ``gather_protocol.GatherFlags``)
    serial: int = 0  # ``next_serial()``: the key of the argument structs made for it


class SymmetricRoute:
    """What the peer and ring routes' ``execute`` and ``reset`` share. A subclass names its C function
    (``c_function``) and provides ``workspace_for(launch, ctx)`` (None: it would have to grow inside a capture),
    ``args_for(launch, ws, res, slot)`` (the launch's argument struct with every pointer but the call's own,
    memoized per workspace), ``slot_needed(launch)``, ``finish(p, launch)`` (route-specific pointers of the call)
    and its state dicts ``_flags`` / ``_workspaces``; optionally ``probe_events(probe, p, launch)`` (the timeline
    probe's events into the struct; ``probe`` None: none again), called only for a probed call (``ctx.probe``),
    which also gets the marks ``start`` and ``end`` on the caller's stream."""

    devices = ("cuda",)
    collectives: tuple[str, ...] = ("all_reduce", "reduce_scatter")
    last_resort = False
    c_function = ""
    epoch_field = "expected"  # the flags' device tensor of epochs (and targets), zeroed with their page

    def execute(self, launch: Any, ctx: Any) -> torch.Tensor | str:
        opnd, device = ctx.opnd, ctx.a.device
        ws = self.workspace_for(launch, ctx)
        if ws is None:
            return "capture-grow: its workspace would have to grow inside a CUDA-graph capture"
        cur = compat.current_raw_stream(device.index)
        slot = ctx.res.slot(cur, dedicated=ctx.capturing) if self.slot_needed(launch) else 0
        if slot is None:
            return "slots: no counter slot left"
        if not ctx.capturing:
            order_after_last(ctx.group, device, cur)
        a = nccl.row_major(opnd.a)
        out = torch.empty(ctx.out_shape, dtype=a.dtype, device=device)
        # the memoized struct itself: every per-call field is set below on every call, and the library reads the
        # struct only during the call (the dispatcher's lock keeps host threads out of each other's way)
        p = self.args_for(launch, ws, ctx.res, slot)
        b, ldb = nccl.kernel_b(opnd.b, launch.kernel)  # a copy (read on ``cur``, freed in its order) if misaligned
        p.a, p.lda, p.b, p.ldb = a.data_ptr(), a.stride(0), b.data_ptr(), ldb
        p.bias = opnd.bias.data_ptr() if opnd.bias is not None else None
        p.out, p.ld_out, p.cur_stream = out.data_ptr(), p.n, cur
        self.finish(p, launch)
        probe = ctx.probe
        if probe is None:  # every dispatched call
            kernels.check(getattr(kernels.library(), self.c_function)(ctypes.byref(p)), self.c_function)
            return out
        stream = torch.cuda.current_stream(device)  # the timeline tool's call: ``cur`` as a torch stream
        try:
            self.probe_events(probe, p, launch)
            probe.mark("start", stream)
            rc = getattr(kernels.library(), self.c_function)(ctypes.byref(p))
            probe.mark("end", stream)
        finally:  # the memoized struct records nothing in later calls, whatever raised (the probe's events die)
            self.probe_events(None, p, launch)
        kernels.check(rc, self.c_function)
        return out

    def probe_events(self, probe: Any, p: Any, launch: Any) -> None:
        pass

    def finish(self, p: Any, launch: Any) -> None:
        pass

    def slot_needed(self, launch: Any) -> bool:
        return False

    def zero_state(self, key: tuple[int, str]) -> None:
        """Zero the flag page and the epochs of ``key`` (device, group) and rewrite its fault block: the state they
        were made in (``resync``, while no rank's call uses them). Workspaces hold data only: they stay."""
        flags, _ = self.state()
        f = flags.get(key)
        if f is None:
            return
        f.buf.zero_()
        getattr(f, self.epoch_field).zero_()
        f.fault.reinit()

    def reset(self) -> None:
        """Drop every workspace and flag area (after synchronizing their devices): the next call makes fresh ones,
        collectively, with zeroed flags."""
        flags, workspaces = self.state()
        for index, _ in list(flags):
            torch.cuda.synchronize(index)
        workspaces.clear()
        flags.clear()
        forget_streams()
        faults.forget(self.name)
