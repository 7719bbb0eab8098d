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
  slot (routing data change per call) is *spilled*: both ends of the pair plan it from the split sizes they share
  (``moe_peer_call.spill_plan``), so both move it by one direct exchange of the call's such blocks
  (``moe_nccl.exchange_blocks``); nothing is redone, so either settle takes it. The next settles teach the group
  the rows (a general-path call's vector has none). Split sizes that a pair does not share (``ins[j]`` here not
  ``outs[rank]`` there: a caller's error, as for ``all_to_all_single``) can mismatch that exchange, which NCCL's
  watchdog then ends by aborting the group.
- **Failure contract**: every wait is bounded by the call's deadline (the group's wait bound); a wait that gives up
  records the fault in every rank's block, the finish poisons the outputs, and the fault code is folded into the
  rank's settle vector. On the host settle every rank raises it in the call that met it (``raise_faults``); under
  the deferred settle every rank raises it at that call's judgement (``errors.PoisonedResult``, the fault chained:
  ``moe_deferred._raise_peer_fault``), never at a call's start, whose timing differs per rank
  (``faults.judged_later``); either raise marks the group, whose next call resynchronizes it (``begin``; a skipped
  call is recovered so too, once ``routes.check()`` or a judgement raised). ``send`` and the finish run whatever
  fails before them (``abandon`` where an exception escapes), so every rank notifies every flag and makes its
  planned spills once per call; every tensor the copy stream touches is recorded on it. A call holds the device's
  call lock (``routes.device_lock``) from begin to finish: it shares the flag page, copy stream and structs with
  the dispatcher's symmetric routes.
- **Overlap**: each push waits only for its block's event, but peers learn of the pushes by one notification after
  the last one (the push schedule's), and the copies out of this rank's slots (where made) queue behind its pushes
  on its one copy stream: on 3+ ranks a block is consumed after its sender's last block.

Checked with 2-3 ranks sharing one GPU (``tests/test_gpu_moe_peer.py``) and between 2 H200s (``tests/test_gpu_moe.py``);
measured there in docs/results.md (forty-eighth session)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import faults

from .. import _inductor_compat as compat
from . import gather_peer, gather_protocol, moe_nccl, moe_settle, symmetric
from .base import note, stats
from .gather_start import PUSH
from .moe_peer_call import NAME, PUSH_EXPERIMENT, Landed, PeerCall, open_calls, spill_plan  # noqa: F401 - theirs
from .nccl import is_nccl_group

log = logging.getLogger("flashoverlap")

EXPERIMENT = "moe_peer"
BLOCKS = 8  # fo_gather_args.options bit FO_GATHER_BLOCKS
SLOT_ALIGN = 256  # bytes: every slot starts on this boundary
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_args: dict[tuple, gather_protocol.GatherArgs] = {}  # (device, group, workspace serial, dtype) -> the memoized struct
_launch_ids: dict[tuple[int, str], int] = {}


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
    call = PeerCall(p, ws, group, device, slot_bytes, row_bytes, like.dtype,
                    *spill_plan(ins, outs, rank, row_bytes, slot_bytes))
    stats[f"moe:{NAME}"] += 1
    open_calls[(device.index, group.group_name)] = call
    if phase1:
        call.begun = True  # set first: a failed phase 1 still owes its peers the rest (``finish``)
        call._enqueue(1)
    return call


def abandon(group: dist.ProcessGroup, device: torch.device, exc: BaseException) -> None:
    """The call of (device, group) that an exception left begun and not finished (``moe_p2p.run_call``): finished
    now, its outputs none, so the copy stream is joined, every peer notified and the lock released; a failure of
    the finish itself is logged (``exc`` propagates)."""
    call = open_calls.get((device.index, group.group_name)) if device.type == "cuda" else None
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
