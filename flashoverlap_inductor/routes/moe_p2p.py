"""What the MoE ops' point-to-point route shares (``routes/combine.py``, ``routes/moe_dispatch.py``): which calls it
takes, the ring step's transfer, the upload of host ints, the per-group lock.

One route for every device: the same Python schedule issues point-to-point ops on gloo (CPU tensors,
``torch.distributed``) and on NCCL (CUDA tensors: straight into NCCL on the group's communicator, ``moe_nccl``, without
``torch.distributed``'s Python layers and work objects; through ``torch.distributed`` until the communicator
exists). On CUDA the transfers run on a side stream, which waits for the caller's current stream at issue and which
the caller's stream waits for at ``wait()`` (no host wait): GEMMs enqueued on the current stream after a transfer was
issued overlap it. NCCL runs one communicator's point-to-point ops in issue order, so every rank issues the ring
steps in one order, each step's send and receive in one NCCL group (no deadlock whichever rank comes first).

Host syncs per call on CUDA, general path: one device-to-host copy of the routing data's small per-(unit, expert)
table, ``offs`` and the index check (``schedule.combine.plan_units``, which cuts the rows on the device), before the
first GEMM; the settle's read at the end (``settle``: both paths; the whole-block path, ``moe_fast``, has only it).
The unit bounds go to the device in one pinned, non-blocking copy (``upload``), which does not sync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from flashoverlap_inductor import config

from .. import _inductor_compat as compat
from ..schedule.combine import chunk_sizes, offsets, parse_plan, ring_steps
from . import agree, moe_deferred, moe_nccl, moe_peer, shadow
from .base import note, stats
from .cpu import _poison
from .moe_settle import (  # noqa: F401 - the status exchange's names, used through this module too
    FAIL,
    IDX_MAX,
    IDX_MIN,
    KEY_STEP,
    OFFS_LAST,
    OFFS_STEP,
    ROWS,
    SETTLE_LEN,
    UNNAMED,
    judge,
    settle,
    verdicts,
)
from .nccl import is_nccl_group

T = TypeVar("T")
COMBINE_TAG = 30830  # + chunk: the P2P tags of the combine's transfers (no other transfer of the package uses them)
DISPATCH_TAG = 30850  # + chunk: the dispatch's
CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_locks: dict[tuple[str, int], threading.RLock] = {}
_locks_lock = threading.Lock()


def grouped_kernel(dtype: torch.dtype) -> bool:
    """Whether the grouped form's units run ``torch._grouped_mm`` (bf16), else one ``mm`` per (expert run, term)
    from the plan's host counts. On CUDA (torch 2.10 / 2.11) ``_grouped_mm`` has a device-side kernel for bf16 only
    (sm90 / sm100); fp16 and fp32 take its fallback, which copies ``offs`` to the host (a host sync) on every call:
    once per unit and term here, against the route's one routing sync per call. The same choice on every device,
    so that the CPU tests run both."""
    return dtype == torch.bfloat16


def unsupported(x: torch.Tensor, group: dist.ProcessGroup, world: int, experiments: frozenset[str]) -> str | None:
    """Why the P2P route cannot take a call whose tensors are like ``x`` over ``group`` with ``world`` split sizes
    (``"slug: detail"``), or None. CPU tensors always go (gloo); CUDA ones only under the experiment
    ``moe_p2p_cuda`` (in ``experiments``, the settings': correct on 2 GPUs, but host-bound: on 2 H100s, with the
    settle deferred, the whole-block path's combine runs 0.95-1.62x and its dispatch 0.46-0.91x of the unfused ops,
    ~1 ms of host time per call, and EP steps are slower end to end; docs/results.md), when the dtype is
    bf16/fp16/fp32, the group's backend is NCCL (or, under ``moe_peer``, any whose CUDA rows the peer transfers
    carry: ``moe_peer.gloo_issue``), its size is ``world``, the tensors are on the current CUDA device
    (NCCL's) and no CUDA graph is being captured (the route syncs the host). Every condition is one that all ranks
    of a program share; ``agree.check_once`` compares the route the ranks chose."""
    if x.device.type == "cpu":
        return None
    if x.device.type != "cuda":
        return f"device: no P2P route for {x.device.type} tensors"
    if "moe_p2p_cuda" not in experiments:
        return ("experiment: the P2P route on CUDA runs only under experiments={'moe_p2p_cuda'} (slower than unfused "
                "on GPUs so far)")
    if compat.is_capturing():
        return "capture: the P2P route syncs the host (its routing data), which a CUDA-graph capture forbids"
    if x.dtype not in CUDA_DTYPES:
        return f"dtype: {x.dtype} (the P2P route takes bf16, fp16 and fp32)"
    if not is_nccl_group(group) and (why := moe_peer.gloo_issue(x, group, experiments)) is not None:
        return f"backend: the group's backend {dist.get_backend(group)!r} is not NCCL ({why})"
    if group.size() != world:
        return f"world: {world} split sizes for a group of {group.size()} ranks"
    if x.device.index != compat.current_device():
        return f"device: the tensors are on {x.device}, NCCL's current device is cuda:{compat.current_device()}"
    return None


def count_fallback(op: str, why: str) -> None:
    """Count and log (once per reason) a call that runs the unfused reference: ``stats["<op>:unfused"]``,
    ``stats["unfused"]`` and ``stats["fallback:<slug>"]``, as the other ops count theirs."""
    slug = why.split(":", 1)[0].strip() or "unsupported"
    stats[f"{op}:unfused"] += 1
    stats["unfused"] += 1
    stats[f"fallback:{slug}"] += 1
    note(f"moe:{op}:{why}", logging.INFO, "flashoverlap: the MoE %s runs unfused: %s", op, why)


def count_route(op: str, device: torch.device) -> None:
    """Count a call the P2P route ran: ``stats["<op>:p2p"]``, plus ``route:cpu`` on CPU (as the CPU routes count)
    or ``route:moe_p2p`` and ``fused:all_to_all_<op>`` on CUDA (as the GPU routes count)."""
    stats[f"{op}:p2p"] += 1
    if device.type == "cpu":
        stats["route:cpu"] += 1
    else:
        stats["route:moe_p2p"] += 1
        stats[f"fused:all_to_all_{op}"] += 1


def run_call(op: str, x: torch.Tensor, group: dist.ProcessGroup, splits: int, plan: str, settings_key: str,
             call: tuple, what: str, p2p: Callable[[bool], T], reference: Callable[[], T],
             shadow_spec: Callable[[], shadow.Spec] = shadow.Spec) -> T:
    """One call of MoE op ``op`` ("combine" or "dispatch"), its tensors like ``x``, ``splits`` split sizes: the plan
    checked (a bad one raises on every rank alike, before any transfer), the route chosen (``unsupported`` under
    the settings of ``settings_key``), the ranks' agreement on ``call`` (what decides its transfers; rows and split
    sizes are per rank by design) and the route once per group (``agree.check_once``; ``what`` names the call in a
    mismatch; not inside a capture), then ``p2p(deferred)`` (whether the call settles without a host read:
    ``moe_deferred.defers``) or ``reference()``, counted; then the group's earlier deferred calls whose status reached
    the host are judged (``moe_deferred.raise_pending``: after this call's collectives, so the ranks stay paired);
    one call per (op, group) at a time. Under the experiment ``shadow_check`` a fused call outside a capture is
    compared with ``reference()`` after it (``shadow.compare``, as ``shadow_spec()`` reads its outputs)."""
    parse_plan(plan, op)
    settings = config.from_key(settings_key)
    why = unsupported(x, group, splits, settings.experiments)
    with config.using(settings), lock(op, group):
        if not (x.is_cuda and compat.is_capturing()):
            route = "p2p" if why is None else f"unfused ({why.split(':', 1)[0]})"
            agree.check_once({"call": repr(call), "rows": "per rank",
                              "settings": agree.shared_settings_key(settings), "routes": route,
                              "library": "-", "data": agree.data_digest(settings.config_dir),
                              "gpu": x.device.type}, group, what)
        earlier = moe_deferred.pending(group)  # judged below: this call's own status is judged by a later call
        moe_deferred.enter_call(group, settings.experiments)
        if why is None:
            deferred = moe_deferred.defers(group, settings.experiments)
            try:
                out = p2p(deferred)
            except BaseException as exc:
                moe_peer.abandon(group, x.device, exc)  # peer transfers escaped before their finish: finished now
                raise
            count_route(op, x.device)
            if shadow.on(settings):
                if x.is_cuda and compat.is_capturing():
                    shadow.skip_capture()
                else:
                    spec = shadow_spec()
                    shadow.compare(op, out, reference, shadow.Spec(
                        lambda: f"{spec.detail()}, deferred {deferred}", spec.blocks, spec.skip))
        else:
            out = reference()
            count_fallback(op, why)
        moe_deferred.raise_pending(group, sync=True, limit=moe_deferred.judged_now(earlier, settings.experiments))
        return out


def end_call(failure: BaseException | None, facts: torch.Tensor | None, outputs: list[torch.Tensor], what: str,
             device: torch.device, group: dist.ProcessGroup, deferred: bool,
             peer: moe_peer.PeerCall | None = None) -> bool:
    """End a call on either path: the peer transfers finished first where the call took them (``outputs`` poisoned
    on a fault, whose code is folded into the settle vector), then ``settle`` on the host and the peer's fault
    raised, or when ``deferred`` ``moe_deferred.settle_later`` (which poisons ``outputs`` where any rank's status is
    bad; its judgement raises the peer's fault). Returns whether every rank redoes the call (``redo``)."""
    fault = None
    if peer is not None:
        failure = peer.finish(outputs, failure)
        fault = peer.fault_code()
    if deferred:
        moe_deferred.settle_later(failure, facts, outputs, what, device, group, fault,
                                  None if peer is None else peer.ws.flags.fault)
        return False
    try:
        again = settle(failure, facts, what, device, group, fault)
    except BaseException:
        if peer is not None:  # a rank's fault (folded into its vector): this rank's record raised, the first chained
            peer.raise_faults(deep=True)
        raise
    if peer is not None:
        peer.raise_faults(deep=False)
    return again


def redo(op: str, reference: Callable[[], T]) -> T:
    """A call some rank's whole-block premise refused (``settle`` said so on every rank): run ``reference`` (the
    unfused op: its collectives are the same on every rank), counted ``<op>:redo`` and logged once per op (a layout
    that always fails the premise pays the call about twice)."""
    stats[f"{op}:redo"] += 1
    note(f"moe:{op}:redo", logging.INFO, "flashoverlap: a fused MoE %s was redone unfused: some rank's routing data "
         "are not in the whole-block form (routes/moe_fast.py); counted %s:redo", op, op)
    return reference()


def lock(kind: str, group: dist.ProcessGroup) -> threading.RLock:
    """One lock per (op, group): an op's calls on a group run one at a time (their transfers share tags)."""
    with _locks_lock:
        return _locks.setdefault((kind, id(group)), threading.RLock())


def exchange(send: torch.Tensor | None, recv: torch.Tensor | None, dst: int, src: int, group: dist.ProcessGroup,
             tag: int, after: torch.cuda.Event | None = None) -> list:
    """One ring step's unit: send ``send`` (rows, contiguous) to group rank ``dst`` and receive ``recv`` from group
    rank ``src`` in one ``batch_isend_irecv``; an empty or None side is left out (its peer, whose split size is the
    same 0, leaves it out too), nothing is issued when both are. Returns the works to wait on. On CUDA, where the
    group's NCCL communicator is at hand, the step goes straight into NCCL instead (``moe_nccl``: none of
    ``batch_isend_irecv``'s Python layers and work objects; the same choice on every rank), waiting for ``after``
    where given (``moe_nccl.transfer``; only there: callers pass it only where the communicator is at hand)."""
    like = send if send is not None else recv
    comm = moe_nccl.communicator(group, like.device) if like is not None else None
    if comm is not None:
        op = "combine" if tag < DISPATCH_TAG else "dispatch"
        return moe_nccl.transfer(comm, send, recv, dst, src, group, f"a MoE {op} transfer "
                                 f"(to rank {dst}, from rank {src})", after)
    return moe_nccl.p2p_ops([(dst, send)] if send is not None and send.numel() else [],
                            [(src, recv)] if recv is not None and recv.numel() else [], group, tag)


_WIDE = (torch.complex128, torch.int64, torch.int32)  # 16-, 8- and 4-byte words, widest first
_no_kernel: set[tuple[str, torch.dtype]] = set()  # (device type, word) whose index_copy_ raised: not tried again


def copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)`` (row ``index[i]`` of ``dst`` = row i of ``src``; 2-D, rows contiguous),
    with each row moved as the widest words that divide it (16, 8 or 4 bytes: the same bits; a bf16 row of 1536
    elements is 192 16-byte words): torch's index_copy_ kernel moves one element per index step, so bf16 rows copy
    several times slower than a gather's vectorized rows (measured on H100: 94 us per 32768 x 1536 bf16 half).
    Falls back to the elements' own dtype when no word divides a row or a view is refused (alignment)."""
    if dst.dim() == 2 and dst.stride(1) == 1 and src.stride(1) == 1 and src.dtype == dst.dtype:
        row_bytes = dst.shape[1] * dst.element_size()
        for word in _WIDE:
            size = torch.empty((), dtype=word).element_size()
            if size <= dst.element_size() or row_bytes % size or (dst.device.type, word) in _no_kernel:
                continue
            try:
                wide_dst, wide_src = dst.view(word), src.view(word)
            except RuntimeError:  # the rows' offset or stride is not a whole number of words
                continue
            try:
                wide_dst.index_copy_(0, index, wide_src)
                return
            except (RuntimeError, NotImplementedError):  # no index_copy_ kernel for the word on this device
                _no_kernel.add((dst.device.type, word))
    dst.index_copy_(0, index, src)


@dataclass
class Issued:
    """The dispatch's transfers as ``issue_dispatch`` left them: ``recv`` (the receive buffer, cut by ``recv_off``
    into units, block i's chunks q at unit ``i * chunks + q``); ``send_off``: ``x``'s units likewise; ``landing``:
    (receive unit, its batch's works) in issue order; ``poisoned``: NaN blocks sent in place of ``x``'s rows (alive
    until every transfer was waited for); ``failure``: the first exception, settled at the call's end."""

    x: torch.Tensor
    recv: torch.Tensor
    send_off: list[int]
    recv_off: list[int]
    landing: list[tuple[int, list]] = field(default_factory=list)
    poisoned: list[torch.Tensor] = field(default_factory=list)
    failure: BaseException | None = None
    peer: moe_peer.PeerCall | None = None  # the call's peer transfers (``end_call`` finishes them), else NCCL's
    slots: list[torch.Tensor | None] | None = None  # ``in_slots``: block j's rows in this rank's receive slot j


def issue_dispatch(x: torch.Tensor, outs: list[int], ins: list[int], chunks: int, group: dist.ProcessGroup,
                   deferred: bool = False, in_slots: bool = False) -> Issued:
    """Both dispatch paths' transfers, issued before any GEMM (NCCL's stream waits for the caller's at each issue):
    per ring step and chunk one batch (send unit ``dst * chunks + q`` of ``x``, receive unit ``src * chunks + q``),
    tag ``DISPATCH_TAG + q``; every step issued whatever fails (a rank whose ``x`` does not fit its split sizes sends
    NaN blocks). Where the call takes peer transfers (``moe_peer.begin``), every whole block in one push call
    instead, each unit of block ``src`` landing with it: copied into ``recv``, or, with ``in_slots`` (a caller that
    reads each peer block once, before ``end_call``), left in this rank's receive slot (``Issued.slots``)."""
    world, rank, k = group.size(), group.rank(), int(x.shape[1])
    send_off, recv_off = offsets(chunk_sizes(ins, chunks)), offsets(chunk_sizes(outs, chunks))
    out = Issued(x, x.new_empty(recv_off[-1], k), send_off, recv_off)
    if x.shape[0] != send_off[-1]:
        out.failure = ValueError(f"flashoverlap: the dispatch's input_split_sizes {ins} do not sum to its "
                                 f"{x.shape[0]} rows")
    else:
        out.x = x.contiguous()
    out.peer = moe_peer.begin(x, k * x.element_size(), ins, outs, group, deferred, False)
    if out.peer is not None:
        _issue_peer(out, x, world, rank, chunks, in_slots)
        return out
    for dst, src in ring_steps(world, rank):
        for q in range(chunks):
            u, v = dst * chunks + q, src * chunks + q
            block = out.x[send_off[u]:send_off[u + 1]]
            if out.failure is not None:
                block = x.new_empty(send_off[u + 1] - send_off[u], k)
                _poison(block)  # what the peer receives is never mistaken for data
                out.poisoned.append(block)
            try:
                works = exchange(block, out.recv[recv_off[v]:recv_off[v + 1]], dst, src, group, DISPATCH_TAG + q)
            except BaseException as exc:  # noqa: BLE001 - settled at the call's end, after every step was issued
                out.failure, works = out.failure or exc, []
            out.landing.append((v, works))
    return out


def _issue_peer(out: Issued, x: torch.Tensor, world: int, rank: int, chunks: int, in_slots: bool) -> None:
    """``issue_dispatch`` by peer transfers: block ``j`` = units ``j * chunks .. (j + 1) * chunks`` (NaN where ``x``
    does not fit its split sizes), pushed at once; ``landing`` gets every unit of each source block, in arrival
    order; ``in_slots``: no copy out of the slots (``Issued.slots``)."""
    send, recv, blocks = out.send_off, out.recv_off, []
    for j in range(world):
        block = out.x[send[j * chunks]:send[(j + 1) * chunks]] if out.failure is None else None
        if block is None and j != rank:
            block = x.new_empty(send[(j + 1) * chunks] - send[j * chunks], int(x.shape[1]))
            _poison(block)
            out.poisoned.append(block)
        blocks.append(block)
    rows = [out.recv[recv[j * chunks]:recv[(j + 1) * chunks]] for j in range(world)]
    if in_slots:  # a block past its slot is spilled into its receive rows, read there
        slots = out.peer.slots([int(r.shape[0]) for r in rows], int(x.shape[1]), x.dtype)
        out.slots = [r if s is None else s for s, r in zip(slots, rows, strict=True)]
        rows = [r if s is None else None for s, r in zip(slots, rows, strict=True)]
    for src, landed in out.peer.send(blocks, rows):
        out.landing += [(src * chunks + q, [landed]) for q in range(chunks)]


def upload(host: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int64 tensors on ``device`` (views of one buffer): unchanged on the CPU; on CUDA one pinned,
    non-blocking host-to-device copy (the caching host allocator keeps the pinned buffer until the copy ran)."""
    if device.type == "cpu":
        return host
    flat = torch.cat([t.reshape(-1) for t in host]) if host else torch.zeros(0, dtype=torch.int64)
    flat = flat.pin_memory().to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in host]), host, strict=True)]

