"""The MoE ops' transfers over one host's peer memory (experiment ``moe_peer``): each all_to_all block pushed by copy
engine into its destination rank's symmetric receive slot, in place of NCCL's send/recv (``moe_nccl``); the
combine's library call (``moe_combine_lib``) writes its peer blocks straight into their slots instead (over NVLink
from the GEMM's epilogue: no send buffer, no push; ``PeerCall.targets``; the experiment ``moe_peer_push`` keeps the
push). No SM moves a byte outside the GEMMs, and no NCCL kernel competes with them for SMs.

The protocol is the all_gather push schedule's with blocks of their own size per peer (``csrc/gather_call.cu``,
``FO_GATHER_BLOCKS``), on the group's gather flag page (``gather_peer.flags``: its counters, fault block, copy stream
and resynchronization): per call rank ``r`` pushes its block for rank ``j`` into slot ``r`` of ``j``'s receive
buffer as soon as the block exists (its ready event: the combine's blocks travel while later blocks compute), tells
``j``, waits for each peer's push into its own slot ``j`` and copies it into the call's receive rows (copy engine;
the whole-block dispatch reads the slot where it lies instead: ``PeerCall.slots``), then records ``j``'s event,
which the GEMMs of that block wait for. The finish joins the copy stream, tells every peer
its slot here was read, and fills the call's outputs with NaN while the group's fault block holds a fault.

Invariants (units: bytes for slots and buffers, rows for the bound):

- **One choice on every rank** (``begin``): the experiment, CUDA, 2-``MAX_WORLD`` ranks, the dtype, the library,
  no capture, one host with torch's symmetric memory (``gather_peer.group_issue``, one collective per group), and
  the group's rows bound (``moe_settle.rows_bound``), which every rank learns alike: at the group's first call one
  ``all_gather_object`` of the most rows each rank sends or receives in all, afterwards from the ``ROWS`` of every
  settle's gathered vectors (a whole-block call's buffer rows, at least its every block), on the host or in the
  deferred settle's judgement (``moe_settle.learn_rows``). Either settle takes them. A rank's routing path
  (whole-block or general) does not change its transfers: every path of both ops calls ``begin`` once per call.
- **Slots**: one set (``slot_set`` 0) of ``world`` slots of ``slot_bytes`` per rank (256-byte multiples) covering
  the bound's rows; the workspace only grows (collectively: the bound is the same on every rank). A block past its
  slot (routing data change per call) is *spilled*: both ends of the pair know its rows, so both move it by one
  direct exchange of the call's such blocks (``moe_nccl.exchange_blocks``); nothing is redone, so either settle
  takes it. The next settles teach the group the rows (a general-path call's vector has none).
- **Failure contract**: every wait is bounded by the call's deadline (the group's wait bound); a wait that gives up
  records the fault in every rank's block, the finish poisons the outputs, and the fault code is folded into the
  rank's settle vector. On the host settle every rank raises it in the call that met it (``raise_faults``); under
  the deferred settle every rank raises it at that call's judgement (``errors.PoisonedResult``, the fault chained:
  ``moe_deferred._raise_peer_fault``), never at a call's start, whose timing differs per rank
  (``faults.judged_later``); a skipped call is recovered by ``symmetric.resync`` at the next call (``begin``).
  Phase 1 (the begin, on the caller's stream, before the combine's GEMMs) is always followed by the pushes and
  the finish, whatever fails in between (``abandon`` where an exception escapes), so every rank notifies every flag
  once per call; every tensor the copy stream touches is recorded on it. A call holds the device's call lock
  (``routes.device_lock``) from begin to finish: it shares the flag page, copy stream and structs with the
  dispatcher's symmetric routes.
- **Overlap**: each push waits only for its block's event, but peers learn of the pushes by one notification after
  the last one (the push schedule's), and the copies out of this rank's slots (where made) queue behind its pushes
  on its one copy stream: on 3+ ranks a block is consumed after its sender's last block.

Never run on 2 GPUs yet: checked with 2-3 ranks sharing one GPU (``tests/test_gpu_moe_peer.py``)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import faults

from .. import _inductor_compat as compat
from . import gather_peer, gather_protocol, moe_nccl, moe_settle, symmetric
from .base import note, stats
from .gather_start import PUSH
from .nccl import is_nccl_group

log = logging.getLogger("flashoverlap")

EXPERIMENT = "moe_peer"
PUSH_EXPERIMENT = "moe_peer_push"  # the combine's blocks pushed by copy engine, not written by its GEMM into the slots
NAME = "moe_peer"
BLOCKS = 8  # fo_gather_args.options bit FO_GATHER_BLOCKS
SPILL_TAG = 30870  # the P2P tag of blocks past their slots where torch's point-to-point ops carry them
SLOT_ALIGN = 256  # bytes: every slot starts on this boundary
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_args: dict[tuple, gather_protocol.GatherArgs] = {}  # (device, group, workspace serial, dtype) -> the memoized struct
_launch_ids: dict[tuple[int, str], int] = {}
_open: dict[tuple[int, str], PeerCall] = {}  # (device, group) -> the call begun and not finished (``abandon``)


def static_issue(x: torch.Tensor, group: dist.ProcessGroup, experiments: frozenset[str]) -> str | None:
    """Why the peer transfers cannot carry calls like ``x`` on ``group`` for reasons every rank shares without a
    collective (None: they can, subject to ``begin``'s group check)."""
    if EXPERIMENT not in experiments:
        return f"experiment: peer transfers run only under experiments={{'{EXPERIMENT}'}}"
    if x.device.type != "cuda":
        return f"device: {x.device.type}"
    if not 2 <= group.size() <= gather_protocol.MAX_WORLD:
        return f"world: {group.size()} ranks (2-{gather_protocol.MAX_WORLD})"
    if x.dtype not in DTYPES:
        return f"dtype: {x.dtype}"
    if compat.is_capturing():
        return "capture: the route syncs the host"
    if not kernels.available():
        return "library: the kernel library or an sm90 GPU is missing"
    return None


def gloo_issue(x: torch.Tensor, group: dist.ProcessGroup, experiments: frozenset[str]) -> str | None:
    """Why a non-NCCL group (gloo: ranks sharing one GPU, the tests') cannot run the P2P route on CUDA tensors: only
    the peer transfers carry them there (None: they carry every call). The group check is a collective, once per
    group, at the same call on every rank."""
    why = static_issue(x, group, experiments) or gather_peer.group_issue(group)
    return None if why is None else f"a {dist.get_backend(group)!r} group moves CUDA rows only by peer transfers: {why}"


@dataclass
class Landed:
    """Peer ``src``'s block in the receive rows: ``wait()`` makes the caller's stream wait for it, ``done`` the event
    recorded when it landed (as ``moe_nccl.Transfer``'s, which the library's one calls wait for)."""

    done: torch.cuda.Event
    device: torch.device

    def wait(self) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        return True


@dataclass
class PeerCall:
    """One call's transfers (``begin``): ``send`` once (phase 2 after ``begin``'s phase 1, else the whole call),
    then ``finish`` once, before the settle."""

    p: gather_protocol.GatherArgs
    ws: symmetric.SymmetricBuffer
    group: dist.ProcessGroup
    device: torch.device
    slot_bytes: int
    direct: frozenset = frozenset()  # peers whose block the combine's GEMM wrote straight into their slot (targets)
    lock: object = None  # the device's call lock, held from ``begin`` to ``finish``
    begun: bool = False  # phase 1 was enqueued
    sent: bool = False
    finished: bool = False
    failure: BaseException | None = None
    keep: list = field(default_factory=list)  # tensors the copy stream reads or writes until the join

    def _enqueue(self, phase: int) -> None:
        self.p.phase = phase
        rc = kernels.library().fo_gather_call(ctypes.byref(self.p))
        if rc != 0 and self.failure is None:
            try:
                kernels.check(rc, "fo_gather_call (moe_peer)")
            except BaseException as exc:  # noqa: BLE001 - raised by the settle on this rank, after every flag
                self.failure = exc

    def send(self, blocks: Sequence[torch.Tensor | None], recv: Sequence[torch.Tensor | None],
             events: Sequence[torch.cuda.Event | None] | None = None) -> list[tuple[int, object]]:
        """Push ``blocks[j]`` (contiguous rows; None or empty: nothing) to each peer ``j``, after ``events[j]`` where
        given (recorded already), and copy each peer's block into ``recv[j]``; returns ``(src, landed)`` in the
        library's arrival order (``rank - 1, rank - 2, ...``), ``landed.wait()`` making the caller's stream wait for
        the block and ``landed.done`` its event. A block past the slot (both ends of the pair know its rows) is
        *spilled*: it travels by one exchange of every such block of this rank (``moe_nccl.exchange_blocks``),
        straight between the caller's rows, counted ``moe_peer:spill``."""
        p, world, rank = self.p, self.group.size(), self.group.rank()
        for j in range(world):
            p.blocks[j], p.block_bytes[j], p.block_events[j], p.recv[j], p.recv_bytes[j] = None, 0, None, None, 0
        copy, spill_out, spill_in = self.ws.flags.copy, [], []
        for j in range(world):
            if j == rank:
                continue
            ev = None if events is None else events[j]
            ev = ev if ev is not None and ev.cuda_event else None  # unrecorded: the rows exist now
            block, rows = blocks[j], recv[j]
            if block is not None and not block.is_contiguous():
                block = block.contiguous()  # (never: the callers' blocks are) where the pushes read it
            if rows is not None and rows.numel() and not rows.is_contiguous():  # (never) received, then the call fails:
                self.failure = self.failure or ValueError(f"flashoverlap: {NAME}: receive rows must be contiguous")
                rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)  # the pair's choice is its size's
            for t, ptrs, sizes, spill in ((block, p.blocks, p.block_bytes, spill_out),
                                          (rows, p.recv, p.recv_bytes, spill_in)):
                nbytes = 0 if t is None else t.numel() * t.element_size()
                if nbytes > self.slot_bytes:  # both ends of the pair know it: both spill
                    spill.append((j, t, ev) if spill is spill_out else (j, t))
                elif nbytes:
                    ptrs[j], sizes[j] = t.data_ptr(), nbytes
                    t.record_stream(copy)  # never reused before the copy stream is done with it, whatever exits
                    self.keep.append(t)
            if self.begun and p.block_bytes[j] and ev is None:
                ev = torch.cuda.Event()  # phase 2's fork was before the block was written: it waits for now
                ev.record(torch.cuda.current_stream(self.device))
            p.block_events[j] = None if ev is None else ev.cuda_event
        self._enqueue(2 if self.begun else 0)
        self.sent = True
        f = self.ws.flags
        landed: dict[int, object] = {(rank - d) % world: Landed(f.events[(rank - d) % world], self.device)
                                     for d in range(1, world)}
        if spill_out or spill_in:
            stats[f"{NAME}:spill"] += 1
            note(f"{NAME}:spill", logging.INFO, "flashoverlap: %s: a MoE block outgrew its slot (%d B): it travels "
                 "by a direct exchange until the slots grow", NAME, self.slot_bytes)
            try:
                landed.update(moe_nccl.exchange_blocks(spill_out, spill_in, self.group, f"a MoE block past its "
                                                       f"slot ({NAME})", SPILL_TAG))
            except BaseException as exc:  # noqa: BLE001 - settled by the caller, after the finish
                self.failure = self.failure or exc
        return [((rank - d) % world, landed[(rank - d) % world]) for d in range(1, world)]

    def finish(self, outputs: Sequence[torch.Tensor], failure: BaseException | None) -> BaseException | None:
        """Join the copy stream, tell the peers their slots here were read, poison ``outputs`` while the group's
        fault block holds a fault; returns the call's first failure (``failure``, else this route's)."""
        try:
            if self.begun and not self.sent:  # every flag once per call, whatever failed after the begin
                self.send([None] * self.group.size(), [None] * self.group.size())
            p = self.p
            live = [t for t in outputs if t is not None and t.numel()][:gather_protocol.MAX_OUTPUTS]
            p.num_outputs = len(live)  # at most 1 + 7 GEMM terms: the MoE ops have 1 + 1-3
            for i, t in enumerate(live):
                p.outputs[i], p.output_numel[i] = t.data_ptr(), t.numel()
            rc = gather_protocol.finish(kernels.library(), p, self.ws, tuple(self.keep), NAME)
        finally:
            self.keep, self.finished = [], True
            _open.pop((self.device.index, self.group.group_name), None)
            self.lock.release()
        failure = failure or self.failure
        if rc != 0 and failure is None:
            try:
                kernels.check(rc, "fo_gather_finish (moe_peer)")
            except BaseException as exc:  # noqa: BLE001 - settled by the caller
                failure = exc
        return failure

    def targets(self, ins: Sequence[int], n: int, dtype: torch.dtype) -> list[torch.Tensor | None] | None:
        """Where the combine's GEMM writes each peer block: straight into its destination's receive slot (its
        ``ins[j]`` rows of ``n`` ``dtype`` elements at slot ``rank`` of rank ``j``'s buffer, mapped here; ``j`` then
        in ``direct``), or, for a block past the slot, into rows of its own that ``send`` spills; the own block's
        entry None: what ``moe_combine_lib.run`` takes as ``targets``. None under the experiment ``moe_peer_push``
        (the blocks pushed by copy engine instead). Safe to write once phase 1 ran: its begin waited, before the
        GEMMs, until every peer read its slot's last call."""
        if not self.begun or PUSH_EXPERIMENT in config.current().experiments:
            return None
        world, rank, itemsize = self.group.size(), self.group.rank(), dtype.itemsize
        start = rank * self.slot_bytes
        stats[f"{NAME}:direct"] += 1
        out: list[torch.Tensor | None] = [None] * world
        for j in range(world):
            rows = int(ins[j])
            if j != rank and rows * n * itemsize <= self.slot_bytes:
                out[j] = self.ws.views[j][start:start + rows * n * itemsize].view(dtype).view(rows, n)
            elif j != rank:
                out[j] = torch.empty(rows, n, dtype=dtype, device=self.device)
        self.direct = frozenset(j for j in range(world) if j != rank and int(ins[j]) * n * itemsize <= self.slot_bytes)
        return out

    def to_push(self, targets: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``targets``' blocks that ``send`` still moves (the spilled ones): the others are in their slots."""
        return [None if j in self.direct else t for j, t in enumerate(targets)]

    def slots(self, rows: Sequence[int], n: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """This rank's receive slots as ``[rows[j], n]`` ``dtype`` views (the own entry and a block past its slot
        None): where each peer's block lands when ``send`` is given no receive rows for it. Read only between its
        landing's wait and ``finish`` (after the finish's "read", the peer may write the slot again)."""
        rank, itemsize = self.group.rank(), dtype.itemsize
        mine = self.ws.views[rank]
        stats[f"{NAME}:in_slots"] += 1
        return [None if j == rank or int(rows[j]) * n * itemsize > self.slot_bytes else
                mine[j * self.slot_bytes:j * self.slot_bytes + int(rows[j]) * n * itemsize].view(dtype)
                .view(int(rows[j]), n) for j in range(len(rows))]

    def fault_code(self) -> torch.Tensor:
        """This rank's fault block code on the device (int32 [1]; read in the caller's stream order, after the
        finish): not 0 where a wait of the call gave up here or a peer's record reached this block."""
        return self.ws.flags.fault.block.view(torch.int32)[:1]

    def raise_faults(self, deep: bool) -> None:
        """After the settle's host sync: the fault of the group's block raised (``FlashOverlapTimeout``; the group
        marked to resynchronize). Where the settle found a rank's fault (``deep``) the block itself is read too: a
        peer's record may have landed after this rank's finish mirrored it, but always before the recorder's status
        reached this rank; else the mirror only (a host load)."""
        domain = self.ws.flags.fault
        if deep:
            domain.refresh()
        if domain.pending():
            domain.raise_fault()


def _prepare(group: dist.ProcessGroup, device: torch.device, settings: config.Settings, deferred: bool) -> None:
    """A fault an earlier call recorded raised, and a group its raise marked resynchronized, before this call; once
    the group settles without a host read not the group's own (its mirror reaches the ranks' hosts at different
    calls: the judgement of the faulted call raises it on every rank at one point, ``moe_deferred``)."""
    if deferred:
        faults.judged_later(group.group_name)
    faults.raise_pending(device.index)
    if faults.resync_due(device.index, group.group_name):
        registry().resync_group(group, device.index, settings, f"a MoE call ({NAME})")


def _bound(group: dist.ProcessGroup, rows: int) -> int:
    """The group's rows bound: at its first call the most rows any rank sends or receives in all (``rows``, one
    ``all_gather_object``, the same call on every rank; what the settles' ``ROWS`` teach later, so the slots need not
    grow at the second call), afterwards what the settles taught (``moe_settle.rows_bound``)."""
    bound = moe_settle.rows_bound(group)
    if bound is None:
        got: list = [None] * group.size()
        dist.all_gather_object(got, int(rows), group=group)
        bound = moe_settle.raise_rows_bound(group, max(int(v) for v in got))
    return bound


def _workspace(group: dist.ProcessGroup, device: torch.device, need: int) -> symmetric.SymmetricBuffer:
    """The smallest receive buffer of (device, group) with ``need`` bytes, made collectively where none has room
    (kept in ``gather_peer``'s workspaces, so its route's ``reset`` drops it)."""
    flags = gather_peer.flags(group, device)

    def make(capacity: int) -> symmetric.SymmetricBuffer:
        buf, hdl, views = symmetric.symmetric(capacity, group, device, False, list(range(group.size())))
        log.info("flashoverlap %s: symmetric receive buffer of %d MiB on %s, group %s", NAME, capacity >> 20, device,
                 group.group_name)
        return symmetric.SymmetricBuffer(capacity, buf, hdl, views, flags, symmetric.next_serial())

    made = gather_peer.workspaces(device, group, NAME)
    return symmetric.smallest_with_room(made, need, False, make)


def begin(like: torch.Tensor, row_bytes: int, ins: Sequence[int], outs: Sequence[int], group: dist.ProcessGroup,
          deferred: bool, phase1: bool) -> PeerCall | None:
    """This call's peer transfers (None: NCCL's), the choice the same on every rank (module docstring); ``phase1``:
    the begin enqueued now on the caller's stream (the combine, before its GEMMs write the blocks). ``row_bytes``:
    the bytes of one row of the blocks; ``ins`` / ``outs``: the rows this rank sends to / receives from each rank."""
    if like.device.type != "cuda":  # CPU rows travel by gloo
        return None
    settings = config.current()
    why = static_issue(like, group, settings.experiments)
    if why is None:
        why = gather_peer.group_issue(group)  # a collective, once per group, at the same call on every rank
    if why is not None:
        if not is_nccl_group(group):
            raise RuntimeError(f"flashoverlap: {NAME}: a {dist.get_backend(group)!r} group moves CUDA rows only by "
                               f"peer transfers, which cannot run here: {why}")
        if EXPERIMENT in settings.experiments:
            note(f"{NAME}:{why}", logging.INFO, "flashoverlap: %s declined (NCCL transfers): %s", NAME, why)
        return None
    lock = registry().device_lock(like.device.index)
    lock.acquire()  # released by the call's finish (or here, where the call is not made)
    try:
        call = _begin(like, row_bytes, ins, outs, group, settings, phase1, deferred)
    except BaseException:
        lock.release()
        raise
    call.lock = lock
    return call


def _begin(like: torch.Tensor, row_bytes: int, ins: Sequence[int], outs: Sequence[int], group: dist.ProcessGroup,
           settings: config.Settings, phase1: bool, deferred: bool) -> PeerCall:
    device, world, rank = like.device, group.size(), group.rank()
    _prepare(group, device, settings, deferred)
    bound = _bound(group, max(sum(int(n) for n in ins), sum(int(n) for n in outs)))
    slot_need = max(SLOT_ALIGN, -(-bound * row_bytes // SLOT_ALIGN) * SLOT_ALIGN)
    ws = _workspace(group, device, world * slot_need)
    slot_bytes = ws.capacity // world // SLOT_ALIGN * SLOT_ALIGN
    key = (device.index, group.group_name, ws.serial, like.dtype)
    p = _args.get(key)
    if p is None:
        p = _args[key] = gather_protocol.new_args(ws, world, rank, slot_bytes, like.dtype,
                                                  _launch_id(group, world), 1, PUSH | BLOCKS)
        p.set_bytes, p.slot_bytes, p.slot_set = ws.capacity, slot_bytes, 0
    cur = compat.current_raw_stream(device.index)
    symmetric.order_after_last(group, device, cur)
    p.cur_stream, p.timeout_ns = cur, int(moe_nccl.bound_s(group) * 1e9)
    call = PeerCall(p, ws, group, device, slot_bytes)
    stats[f"moe:{NAME}"] += 1
    _open[(device.index, group.group_name)] = call
    if phase1:
        call.begun = True  # set first: a failed phase 1 still owes its peers the rest (``finish``)
        call._enqueue(1)
    return call


def abandon(group: dist.ProcessGroup, device: torch.device, exc: BaseException) -> None:
    """The call of (device, group) that an exception left begun and not finished (``moe_p2p.run_call``): finished
    now, its outputs none, so the copy stream is joined, every peer notified and the lock released; a failure of
    the finish itself is logged (``exc`` propagates)."""
    call = _open.get((device.index, group.group_name)) if device.type == "cuda" else None
    if call is None or call.finished:
        return
    try:
        call.finish([], exc)
    except Exception:  # noqa: BLE001 - the caller re-raises exc
        log.exception("flashoverlap %s: finishing a call abandoned by %r failed", NAME, exc)


def registry():
    """The route registry (``flashoverlap_inductor.routes``), which imports this module's importers."""
    from flashoverlap_inductor import routes

    return routes


def _launch_id(group: dist.ProcessGroup, world: int) -> int:
    key = (world, group.group_name)
    if key not in _launch_ids:
        _launch_ids[key] = faults.launch_id(f"a MoE all_to_all over {world} ranks ({NAME}: copy-engine pushes)")
    return _launch_ids[key]


def forget() -> None:
    """Drop the memoized structs (with ``gather_peer``'s reset, which drops the workspaces they point into)."""
    _args.clear()


gather_peer.on_reset(forget)
