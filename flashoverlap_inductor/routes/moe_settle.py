"""The status exchange that ends every call of the MoE P2P route (``routes/moe_p2p.py``), on either path: every rank's
vector of ``SETTLE_LEN`` int64 (its failure, then the whole-block path's routing facts), gathered and judged alike
on every rank (``settle``: on the host in the call; ``moe_deferred``: one call later), and the count that lets a
group settle without a host read (``note_settled``, ``held``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import errors
from . import moe_nccl
from .cpu import _group_name, _raise_unless_exchanged, _rank_name

# The settle's vector per rank (int64): FAIL (rank + 1 where this rank failed, else 0), then the whole-block path's
# routing facts (``moe_fast.BlockPlan.facts``; all 0 on the general path, which they then pass): ROWS (the index's
# entries, = the buffer's rows), IDX_MAX / IDX_MIN (the index's extremes; on CUDA each entry clamped to +-(2^62 - 1)
# first), OFFS_STEP (the smallest step of the expert offsets from 0), UNNAMED (buffer rows the index does not name),
# OFFS_LAST (the last expert offset), KEY_STEP (the smallest step of the buffer rows' (block, expert group) keys,
# clipped at 0: only its sign is judged).
FAIL, ROWS, IDX_MAX, IDX_MIN, OFFS_STEP, UNNAMED, OFFS_LAST, KEY_STEP = range(8)
SETTLE_LEN = 8
UNSENT = -1  # every entry of the gathered vectors before the exchange: FAIL == UNSENT means a status never arrived
HELD_BEFORE_DEFERRING = 4  # host-settled calls that qualify a group to settle without a host read (moe_deferred)
# keyed by the group's name (the same on every rank, never reused, where an id may be after a group is destroyed)
_held: dict[str, int] = {}
_rows: dict[str, int] = {}  # group -> the rows bound of its peer transfers (``moe_peer``), learned alike on every rank


def rows_bound(group: dist.ProcessGroup) -> int | None:
    """The largest block rows the group's settles showed so far (``ROWS`` of every rank's vector; None before the
    peer transfers' first call set it): the same on every rank."""
    return _rows.get(group.group_name)


def raise_rows_bound(group: dist.ProcessGroup, rows: int) -> int:
    """Raise the group's rows bound to ``rows`` (a value every rank has); returns it."""
    bound = _rows[group.group_name] = max(_rows.get(group.group_name, 0), int(rows))
    return bound


def learn_rows(group: dist.ProcessGroup, vectors: list[list[int]]) -> None:
    """Raise the group's rows bound (where its peer transfers set one) to the most ``ROWS`` of every rank's vector
    (a whole-block call's buffer rows: at least every block of the call, in either op), at one point on every rank
    (a settle on the host; the deferred settle's judgement)."""
    if group.group_name in _rows:
        raise_rows_bound(group, max(v[ROWS] for v in vectors))


def local_vector(failure: BaseException | None, facts: torch.Tensor | None, device: torch.device, rank: int,
                 device_fault: torch.Tensor | None) -> torch.Tensor:
    """This rank's settle vector (no host read): ``facts`` (zeros without), ``FAIL`` = rank + 1 where ``failure``
    is set or ``device_fault`` (a fault block's code on the device: ``moe_peer``) is not 0."""
    local = torch.zeros(SETTLE_LEN, dtype=torch.int64, device=device) if facts is None else facts
    if failure is not None:
        local[FAIL:FAIL + 1].fill_(rank + 1)  # a fill on the device (an item assignment would copy: a sync)
    elif device_fault is not None:
        local[FAIL:FAIL + 1] = torch.where(device_fault.to(torch.int64) != 0, rank + 1, local[FAIL:FAIL + 1])
    return local


def held(group: dist.ProcessGroup) -> int:
    """How many calls in a row qualified ``group`` so far (``note_settled``); the same on every rank."""
    return _held.get(group.group_name, 0)


def note_settled(group: dist.ProcessGroup, vectors: list[list[int]]) -> None:
    """Count a call settled on the host where some rank took the whole-block path (rows > 0) and every rank's vector
    shows no failure, good data and the premise held (``verdicts``); a call with a failure, bad data or a failed
    premise sets the count back to 0; a call of the general path on every rank (zeros) leaves it. Nothing changes
    once the count reaches ``HELD_BEFORE_DEFERRING``."""
    count = held(group)
    if count >= HELD_BEFORE_DEFERRING:
        return
    if any(v[FAIL] or any(verdicts(v)) for v in vectors):
        _held[group.group_name] = 0
    elif any(v[ROWS] > 0 for v in vectors):
        _held[group.group_name] = count + 1


def forget() -> None:
    _held.clear()
    _rows.clear()


def verdicts(v: list[int]) -> tuple[bool, bool, bool]:
    """One rank's settle vector judged: (an index entry out of ``[-rows, rows)``, expert offsets decreasing or past
    the rows, the whole-block premise violated: a row unnamed or named twice, a row in no expert group, or a block's
    rows not expert-sorted). The general path's zeros pass all three."""
    rows = v[ROWS]
    bounds = rows > 0 and (v[IDX_MAX] >= rows or v[IDX_MIN] < -rows)
    offsets_bad = v[OFFS_STEP] < 0 or v[OFFS_LAST] > rows  # past the rows: the unfused _grouped_mm would fault
    return bounds, offsets_bad, v[UNNAMED] > 0 or v[OFFS_LAST] != rows or v[KEY_STEP] < 0


def settle(failure: BaseException | None, facts: torch.Tensor | None, what: str, device: torch.device,
           group: dist.ProcessGroup, device_fault: torch.Tensor | None = None) -> bool:
    """The exchange that ends every call of both MoE ops on the P2P route, on either path (the same collective on
    every rank: one all_gather of the ``SETTLE_LEN`` int64 vector; none in a group of one rank), and the call's one
    host read; every rank judges every rank's vector alike (``verdicts``). ``facts``: this rank's routing facts
    (``moe_fast``), None on the general path; ``device_fault``: this rank's fault block code on the device
    (``moe_peer``: a timed-out wait of the call, or a peer's record), judged as this rank's failure. Raises
    ``failure`` on a failed rank; ``IndexError`` / ``ValueError`` on
    a rank whose index or offsets are bad; ``errors.PeerFailure`` on the others when any rank failed or had bad
    routing data. Returns whether any rank's premise failed: then every rank redoes the call with the unfused
    reference."""
    world, rank = group.size(), group.rank()
    local = local_vector(failure, facts, device, rank, device_fault)
    lost: Exception | None = None
    every = local
    if world > 1:
        every = local.new_full((world * SETTLE_LEN,), UNSENT)  # what an exchange that never ran leaves: bad
        try:
            moe_nccl.gather_status(every, local, group, what)
        except Exception as exc:  # noqa: BLE001 - the group itself broke: raised below
            lost = exc
    vectors = None
    if lost is None:  # read and counted on every rank, the failing one included, before anything raises
        if every.is_cuda:  # the host sync, waited for without the GIL: the NCCL watchdog's thread must run meanwhile
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            try:
                moe_nccl.check_not_given_up(group, what)
            except errors.FlashOverlapTimeout as timeout:
                if failure is not None:  # this rank's own cause first, the lost exchange chained
                    raise failure from timeout
                raise
        flat = every.tolist()
        vectors = [flat[r * SETTLE_LEN:(r + 1) * SETTLE_LEN] for r in range(world)]
        note_settled(group, vectors)
        learn_rows(group, vectors)
    _raise_unless_exchanged(failure, lost, what, group)
    return judge(vectors, what, group)


def judge(vectors: list[list[int]], what: str, group: dist.ProcessGroup) -> bool:
    """Every rank's settle vector judged alike (``settle``'s raises; also ``moe_deferred``'s, one call later):
    whether any rank's premise failed."""
    world, rank = group.size(), group.rank()
    unsent = [r for r in range(world) if vectors[r][FAIL] == UNSENT]
    if unsent:
        raise errors.PeerFailure(f"flashoverlap: {what}: the status of {_rank_name(group, unsent[0])} never arrived "
                                 f"(group {_group_name(group)} aborted, e.g. by the NCCL watchdog after a transfer "
                                 f"outlived its bound); rank {rank} does not return its output")
    judged = [verdicts(v) for v in vectors]
    bounds, offs_bad, _ = judged[rank]
    if bounds:
        raise IndexError(f"flashoverlap: {what}: an index entry is out of bounds for its buffer of "
                         f"{vectors[rank][ROWS]} rows (extremes {vectors[rank][IDX_MIN]}, {vectors[rank][IDX_MAX]}), "
                         "as index_put / index would raise")
    if offs_bad:
        raise ValueError(f"flashoverlap: {what}: the expert group offsets must be non-negative, non-decreasing and "
                         f"at most the {vectors[rank][ROWS]} rows (the last is {vectors[rank][OFFS_LAST]})")
    bad = [r for r in range(world) if vectors[r][FAIL] or judged[r][0] or judged[r][1]]
    if bad:
        raise errors.PeerFailure(f"flashoverlap: {_rank_name(group, bad[0])} of group {_group_name(group)} failed in "
                                 f"the middle of {what} (or had bad routing data); rank {rank} completed its "
                                 "collectives but does not return its output (the failing rank raises the cause)")
    return any(j[2] for j in judged)
