"""The MoE P2P route's settle without a host read (the experiment ``moe_settle_deferred``): the call's status
exchange as in ``moe_settle.settle`` (one all_gather of every rank's ``SETTLE_LEN`` vector), judged on the device, its
outputs poisoned with NaN there where any rank's vector is bad, and judged on the host later, as the NCCL all_gather
route's exchange is (``routes/gather_nccl.py``). Measured as a bound before it was built (the all_gather without any
read, ``examples/device/moe_settle_cost.py``, 2 H200s): the combine 0.78x -> 1.50x of unfused at qwen3 4096 tokens.

When a call defers (``defers``): under the experiment, on a group where ``HELD_BEFORE_DEFERRING`` calls settled on
the host in a row found a rank on the whole-block path (rows > 0) and every rank with good data and the premise held
(``moe_settle.note_settled``: calls of the general path on every rank not counted, a failure starting the count
again). The count comes from the gathered vectors, read and counted on every rank before any rank raises, so every
rank defers from the same call on, and it never goes back: every rank settles each call the same way, and no rank
redoes a call unfused while another does not.

The contract, as ``gather_nccl``'s: a rank whose own call failed raises in that call (after the exchange); every
rank's outputs of a call whose vectors show a failure, bad routing data or a failed premise on any rank are NaN
(never other values: a premise failure cannot be redone here, only poisoned), and every other rank raises
``errors.PoisonedResult`` (its cause chained: the exception the host settle would have raised) at the end of the
next call on the group (its status waited for there: one call behind, so the host runs at most one call ahead, and
the same call on every rank), or in ``routes.check()`` (``raise_pending(sync=True)``). That next call's collectives
were all issued before it raises, so a program that goes on calling stays paired; its outputs are dropped. A program
that unwinds on the first exception (a step, a compiled graph) leaves the failing rank one call ahead of its peers:
as after any collective error, call ``routes.check()`` on every rank and restart the step.

Judged per graph (the experiment ``moe_judge_per_graph``): inside a run of a compiled graph with fused MoE ops
(``graph_run``: the backend wraps every run of such a graph, forward, backward or inference) a call judges none of
the earlier calls (the host may run the whole graph ahead of the GPU). At the end of the run, for each group with a
call in it (registered before the call, ``enter_call``: a call that raises counts too), the calls pending at the
end of that group's previous such run are judged (waited for), so a failure raises ``errors.PoisonedResult`` at the
end of the group's next graph run, after its outputs were computed (and dropped). Every member of a group makes the
same MoE calls in the same graphs, so every rank judges the same calls at the same points; beyond ``MAX_PENDING``
calls pending on a group a call judges the excess oldest. One host thread per group (as the routes' locks assume
for the calls' order): another thread's run ending may judge this thread's calls. A run that raises judges nothing;
after it, ``routes.check()`` on every rank.

Over peer transfers (``moe_peer``): a call's vector also carries its fault block's code (a bounded wait that gave up:
``moe_settle.local_vector``), and its judgement, waited for at the same call on every rank (never a query:
``raise_pending(sync=False)`` leaves such calls), reads the block and raises ``errors.PoisonedResult`` with the fault
chained on every rank, a rank that raised its own failure in the call included; the block held the fault until then,
so the group's later pending calls (poisoned too) are dropped with it, and the group resynchronizes at its next call.
These judgements also teach the group's rows bound (``moe_settle.learn_rows``), which sizes the peer slots.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import errors
from ..runtime import faults
from . import moe_nccl, moe_plan_kernel, moe_plan_lib, moe_settle
from .base import stats
from .cpu import _raise_unless_exchanged

EXPERIMENT = "moe_settle_deferred"
TWO_BEHIND = "moe_judge_two_behind"  # the judgement two calls behind (``judged_now``)
PER_GRAPH = "moe_judge_per_graph"  # the judgement at the end of the next compiled graph's run (``graph_run``)
MAX_PENDING = 256  # under PER_GRAPH, a group's calls left unjudged inside a graph run, at most
MOE_OPS = ("gemm_unpermute_all_to_all", "all_to_all_permute_gemm")  # the fused MoE ops (a graph with one: graph_run)
HELD_BEFORE_DEFERRING = moe_settle.HELD_BEFORE_DEFERRING
# keyed by the group's name (the same on every rank, never reused, where an id may be after a group is destroyed)
_pending: dict[str, list[Pending]] = {}  # group -> deferred calls not judged on the host yet, oldest first
_marks: dict[str, Pending | None] = {}  # PER_GRAPH group -> its newest pending call at the end of the last graph run
_run = threading.local()  # depth: graph runs entered and not left; groups: those with a call in the run (this thread)
MAX_FREE_MIRRORS = 8  # pinned status mirrors (and their events) kept per size for later calls
_free_mirrors: dict[tuple[int, int], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}  # (device, numel) -> free


@dataclass
class Pending:
    """A deferred call's status: every rank's vector (a pinned host copy on CUDA, written when ``done`` completes)."""

    vectors: torch.Tensor
    done: torch.cuda.Event | None
    what: str
    group: dist.ProcessGroup
    device: int = -1  # the CUDA device of ``done`` (a pinned mirror's), else -1
    fault: faults.FaultDomain | None = None  # the call's peer transfers' fault domain (``moe_peer``), else None


def defers(group: dist.ProcessGroup, experiments: frozenset[str]) -> bool:
    """Whether this call on ``group`` settles without a host read (module docstring); the same on every rank."""
    return EXPERIMENT in experiments and moe_settle.held(group) >= HELD_BEFORE_DEFERRING


def settle_later(failure: BaseException | None, facts: torch.Tensor | None, outputs: list[torch.Tensor], what: str,
                 device: torch.device, group: dist.ProcessGroup, device_fault: torch.Tensor | None = None,
                 fault: faults.FaultDomain | None = None) -> None:
    """End a deferred call: the exchange, this rank's own failure raised, the outputs poisoned on the device where
    any rank's vector is bad, the vectors copied to the host for ``raise_pending``; no host read, no wait.
    ``device_fault`` / ``fault``: the peer transfers' fault block code on the device (folded into this rank's
    vector) and its domain, whose fault the judgement raises on every rank (``_judge``)."""
    world, rank = group.size(), group.rank()
    local = moe_settle.local_vector(failure, facts, device, rank, device_fault)
    every, lost = local, None
    if world > 1:
        every = local.new_full((world * moe_settle.SETTLE_LEN,), moe_settle.UNSENT)  # bad unless exchanged
        try:
            moe_nccl.gather_status(every, local, group, what)
        except Exception as exc:  # noqa: BLE001 - the group itself broke: raised below
            lost = exc
    poison_error = None
    if lost is None:  # judged later on every rank, the failing one included (its own cause is not raised twice)
        host, done = every, None
        if device.type == "cuda":
            try:  # a pinned mirror and an event: read with no sync; else the device copy, read with one
                host, done = _mirror(every)
            except Exception:  # noqa: BLE001 - no pinned memory: the plain read below works too
                host, done = every, None
        mirrored = False
        try:  # the outputs poisoned first (a failing rank's too: never returned), the vectors mirrored by the kernel
            mirrored = poison_if_bad(outputs, every, world, host if done is not None else None)
        except BaseException as exc:  # noqa: BLE001 - raised below, after this rank's own failure
            poison_error = exc
        try:  # whatever the poison did, the status reaches the host behind the event before any rank raises
            if done is not None:
                if not mirrored:
                    host.copy_(every, non_blocking=True)
                done.record(torch.cuda.current_stream(device))
        finally:
            _pending.setdefault(group.group_name, []).append(Pending(host, done, what, group,
                                                                     -1 if done is None else device.index, fault))
    _raise_unless_exchanged(failure, lost, what, group)  # this rank's own failure first
    if poison_error is not None:
        raise poison_error
    stats["moe:deferred"] += 1


def _mirror(every: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """A pinned host mirror for ``every`` and an event (the caller fills the one and records the other): a free pair
    of an earlier call's (``_recycle``: its copy was complete when it was judged), else a new one."""
    free = _free_mirrors.get((every.device.index, every.numel()))
    return free.pop() if free else (torch.empty(every.shape, dtype=every.dtype, pin_memory=True), torch.cuda.Event())


def _recycle(p: Pending) -> None:
    """Keep a judged call's pinned mirror and event for a later call (at most ``MAX_FREE_MIRRORS`` per size)."""
    if p.done is not None and p.device >= 0:
        free = _free_mirrors.setdefault((p.device, p.vectors.numel()), [])
        if len(free) < MAX_FREE_MIRRORS:
            free.append((p.vectors, p.done))


def bad(vectors: torch.Tensor, world: int) -> torch.Tensor:
    """Whether any rank's vector shows a failure, bad routing data or a failed premise (``moe_settle.verdicts``, on the
    device: a 0-dim bool tensor)."""
    v = vectors.view(world, moe_settle.SETTLE_LEN)
    rows, last = v[:, moe_settle.ROWS], v[:, moe_settle.OFFS_LAST]
    out_of_range = (rows > 0) & ((v[:, moe_settle.IDX_MAX] >= rows) | (v[:, moe_settle.IDX_MIN] < -rows))
    return ((v[:, moe_settle.FAIL] != 0) | out_of_range | (v[:, moe_settle.OFFS_STEP] < 0) | (last != rows)
            | (v[:, moe_settle.UNNAMED] > 0) | (v[:, moe_settle.KEY_STEP] < 0)).any()


def poison_if_bad(outputs: list[torch.Tensor], vectors: torch.Tensor, world: int,
                  mirror: torch.Tensor | None = None) -> bool:
    """Every tensor of ``outputs`` filled with NaN where ``bad(vectors)``, on the device (no host read): on CUDA one
    library call (``moe_plan_lib``; not under the experiment ``moe_plan_triton``) or one Triton launch per
    ``POISON_SLOTS`` contiguous outputs that writes nothing when every vector is good
    (``moe_plan_triton.poison_if_bad``), else ``bad`` and a masked fill per output. Returns whether the library's
    kernel also copied ``vectors`` into ``mirror`` (pinned host memory; the caller copies them otherwise)."""
    rest = [out for out in outputs if out.numel()]
    mirrored = False
    if moe_plan_lib.should_poison(rest, world):
        before = len(rest)
        rest = moe_plan_lib.poison(rest, vectors, world, mirror)
        mirrored = mirror is not None and len(rest) < before and moe_plan_lib.mirrors()  # the first launch wrote it
    kernel = _poison_kernel() if rest and all(o.is_cuda and o.is_contiguous() for o in rest) and world <= 8 else None
    while rest and kernel is not None and moe_plan_kernel.run_or_fall_back(
            lambda part=rest[:POISON_SLOTS]: poison_with_kernel(kernel, part, vectors, world),
            "the deferred settle's poison") is not None:
        rest = rest[POISON_SLOTS:]
    if rest:
        verdict = bad(vectors, world)
        for out in rest:
            out.masked_fill_(verdict, float("nan"))
    return mirrored


POISON_SLOTS = moe_plan_lib.POISON_SLOTS  # outputs per launch of moe_plan_triton.poison_if_bad (as the library's)


def poison_with_kernel(kernel, outputs: list[torch.Tensor], vectors: torch.Tensor, world: int,
                       block: int = 4096) -> list[torch.Tensor]:
    """Launch ``moe_plan_triton.poison_if_bad`` over ``outputs`` (1 to ``POISON_SLOTS`` contiguous tensors; ``world``
    <= 8): grid (blocks of the largest, outputs); unused slots repeat the first output with 0 elements. Returns
    ``outputs``."""
    slots = []
    for k in range(POISON_SLOTS):
        out = outputs[k] if k < len(outputs) else outputs[0]
        slots += [out, out.numel() if k < len(outputs) else 0]
    most = max(o.numel() for o in outputs)
    kernel[(-(-most // block), len(outputs))](
        vectors, world, *slots, LEN=moe_settle.SETTLE_LEN, FAIL=moe_settle.FAIL, ROWS=moe_settle.ROWS,
        IDX_MAX=moe_settle.IDX_MAX, IDX_MIN=moe_settle.IDX_MIN, OFFS_STEP=moe_settle.OFFS_STEP,
        UNNAMED=moe_settle.UNNAMED, OFFS_LAST=moe_settle.OFFS_LAST, KEY_STEP=moe_settle.KEY_STEP, BLOCK=block)
    return outputs


def _poison_kernel():
    """``moe_plan_triton.poison_if_bad`` (through its compiled form) where the plan's kernels are in use
    (``moe_plan_kernel``), else None."""
    kernels = None if moe_plan_kernel._failed else moe_plan_kernel._kernels()
    return None if kernels is None else kernels[2]


def judged_now(earlier: int, experiments: frozenset[str]) -> int:
    """How many of the ``earlier`` deferred calls pending before a call are judged (waited for) at its end: all of
    them (one call behind), under the experiment ``moe_judge_two_behind`` all but the newest (two calls behind: the
    host may run two calls ahead), under ``moe_judge_per_graph`` inside a graph run none but those beyond
    ``MAX_PENDING``. A function of the call count and the graph runs alone: every rank judges the same calls."""
    if PER_GRAPH in experiments and getattr(_run, "depth", 0):
        return max(earlier - MAX_PENDING, 0)
    return max(earlier - 1, 0) if TWO_BEHIND in experiments else earlier


def enter_call(group: dist.ProcessGroup, experiments: frozenset[str]) -> None:
    """Before a MoE call's transfers on ``group``: under ``moe_judge_per_graph`` inside a graph run, the group is
    judged at the run's end (``graph_run``), whether the call returns or raises."""
    if PER_GRAPH in experiments and getattr(_run, "depth", 0):
        _run.groups.add(group.group_name)


@contextlib.contextmanager
def graph_run() -> Iterator[None]:
    """Around one run of a compiled graph with fused MoE ops (module docstring). On leaving the outermost one
    normally, each group with a call in it (``enter_call``) has its calls judged that were pending at the end of its
    previous run (waited for; ``errors.PoisonedResult`` for a bad one), its newest pending call marked for the next.
    Not on an exception (the run's own error propagates; the calls wait for the next run or ``routes.check()``)."""
    depth = getattr(_run, "depth", 0)
    if depth == 0:
        _run.groups = set()
        stats["moe:graph_run"] += 1
    _run.depth = depth + 1
    try:
        yield
    finally:
        _run.depth = depth
    if depth == 0 and _run.groups:
        _judge_marked(sorted(_run.groups))  # sorted: the same order on every rank


def _judge_marked(groups: list[str]) -> None:
    """The end of a graph run: per group, the calls up to its mark judged, the mark moved to its newest pending call
    first (a raise leaves the later groups' calls to their next run's end)."""
    due = {}
    for name in groups:
        queue, mark = _pending.get(name, []), _marks.get(name)
        due[name] = next((i + 1 for i, p in enumerate(queue) if p is mark), 0)  # 0: judged since, or no mark
        _marks[name] = queue[-1] if queue else None
    for name, count in due.items():
        queue = _pending.get(name, [])
        if count and queue:
            raise_pending(queue[0].group, sync=True, limit=count)


def pending(group: dist.ProcessGroup) -> int:
    """How many deferred calls of ``group`` were not judged on the host yet."""
    return len(_pending.get(group.group_name, ()))


def raise_pending(group: dist.ProcessGroup | None = None, sync: bool = False, limit: int | None = None) -> None:
    """Judge the deferred calls of ``group`` (every group when None) whose status reached the host (all of them when
    ``sync``: waited for; at most the ``limit`` oldest), oldest first, and raise ``errors.PoisonedResult`` for the
    first bad one (after dropping it and every older one); a rank whose own failure is the only cause does not raise
    again."""
    for gid in [group.group_name] if group is not None else list(_pending):
        queue = _pending.get(gid, [])
        for _ in range(len(queue) if limit is None else min(limit, len(queue))):
            p = queue[0]
            if not sync and p.fault is not None:
                break  # a call over peer transfers: judged only where every rank judges it (``_judge``'s shared)
            if p.done is not None:
                if sync:
                    p.done.synchronize()
                elif not p.done.query():
                    break  # the older ones first: this one (and the later) at a later call
            queue.pop(0)
            if p.done is not None:
                try:
                    moe_nccl.check_not_given_up(p.group, p.what)
                except errors.FlashOverlapTimeout as cause:
                    raise errors.PoisonedResult(f"flashoverlap: {p.what}, settled without a host read, lost its "
                                                "exchange (the cause below); its outputs may not have been "
                                                "poisoned (a status never arrived): discard them") from cause
            vectors = p.vectors.tolist()
            _recycle(p)  # its copy is complete (waited for or queried above) and read
            _judge([vectors[r * moe_settle.SETTLE_LEN:(r + 1) * moe_settle.SETTLE_LEN] for r in range(p.group.size())],
                   p, sync)


def _judge(vectors: list[list[int]], p: Pending, shared: bool) -> None:
    """One deferred call's vectors judged; ``shared``: at a point every rank shares (waited for, not queried), the
    only judgements that may teach the rows bound or raise the peer transfers' fault (both change what every rank
    does next: the slots' collective growth, the group's resynchronization; a call over peer transfers is never
    judged otherwise: ``raise_pending``)."""
    rank = p.group.rank()
    if shared:
        moe_settle.learn_rows(p.group, vectors)
        if p.fault is not None and any(v[moe_settle.FAIL] for v in vectors):
            _raise_peer_fault(p)
    others_bad = any(v[moe_settle.FAIL] or any(moe_settle.verdicts(v)) for r, v in enumerate(vectors) if r != rank)
    if vectors[rank][moe_settle.FAIL] > 0 and not others_bad:  # this rank raised its own failure in that call
        return
    try:
        premise = moe_settle.judge(vectors, p.what, p.group)
    except Exception as cause:  # noqa: BLE001 - what the host settle would have raised: chained
        raise errors.PoisonedResult(f"flashoverlap: {p.what}, settled without a host read, failed on some rank (the "
                                    "cause below); its outputs were NaN on every rank") from cause
    if premise:
        raise errors.PoisonedResult(f"flashoverlap: {p.what}, settled without a host read, found some rank's routing "
                                    "data not in the whole-block form (routes/moe_fast.py), which only a host settle "
                                    "can redo; its outputs were NaN on every rank (turn the experiment "
                                    f"{EXPERIMENT!r} off for such routing)")


def _raise_peer_fault(p: Pending) -> None:
    """A bad call's peer transfers' fault (a wait that gave up wrote every rank's block), raised on every rank at
    this judgement as ``errors.PoisonedResult`` with the fault chained; raising it clears the block and marks the
    group to resynchronize at its next call (``faults.FaultDomain.raise_fault``). The block held the fault until
    now, so every later call of the group was poisoned too: the raise covers them, and their pending statuses are
    dropped (the same calls on every rank). Nothing where the block holds no fault (the call failed otherwise, or
    ``routes.check()`` raised it)."""
    torch.cuda.synchronize(p.fault.device)
    p.fault.refresh()
    if not p.fault.pending():
        return
    later = _pending.get(p.group.group_name, [])
    for q in later:
        _recycle(q)  # complete: the device was synchronized
    later.clear()
    try:
        p.fault.raise_fault()
    except errors.FlashOverlapError as cause:
        raise errors.PoisonedResult(f"flashoverlap: {p.what}, settled without a host read, met a fault of its peer "
                                    "transfers (the cause below); its outputs were NaN on every rank") from cause


def forget() -> None:
    """Forget the counts and the pending calls (``routes.reset``)."""
    moe_settle.forget()
    _pending.clear()
    _marks.clear()
