"""The MoE ops' whole-block path on the P2P route (``routes/combine.py``, ``routes/moe_dispatch.py``): no routing
sync, ~15 launches per call on CUDA (the plan: one library call, else two Triton kernels, ``moe_plan_kernel``), no
scatter. The general path (``CombineUnits``, ``DispatchUnits``) cuts the expert rows by unit on the device and reads
the cut on the host before its first GEMM (a sync, then ~100 small ops per call: measured on 2 H100s at 2.6-2.9 ms of
host time per call where the unfused ops take 0.8 ms); this path needs neither, where the routing data have the form
the MoE layers give them (measured on 2 H200s: 1.2-1.3 ms of host time per call, the settle's read included;
docs/results.md).

**The premise** (a property of each rank's routing data, checked on the device in every call):

1. the index names every row of the blocked buffer once (``len(index)`` == the buffer's rows, checked on the host;
   no row named twice, checked on the device);
2. every expert row is in an expert group (``offs[-1] == len(index)``; past it the offsets are bad data: raised);
3. within each block, the buffer's rows belong to non-decreasing expert groups (each rank sends its rows for a peer
   sorted by that peer's local expert: torchtitan's and the e2e ``ep`` block's dispatch do).

Under it, block j's rows of the buffer, in buffer order, *are* its expert rows in expert order, so each block's
GEMMs run on rows as they lie, with per-block expert offsets counted on the device (``BlockPlan``):

* dispatch: ``Y_j = grouped_mm(recv[block j], w, offs_j)`` for the own block at once, then for each block as its
  transfer lands (the own block on ``x``'s rows, never copied); each block's rows and ``Y_j`` moved into expert
  order at once (``p[inv[r]] = row r``, ``y[inv[r]] = Y_j[r]``: ``p = recv[index]``, ``y = cat_j(Y_j)[index]``);
* combine: ``Y_j = grouped_mm(a[inv[block j]], w, offs_j)`` (``inv``: the expert row of each send row) *is* send
  block j, sent as soon as computed; no send buffer, no scatter.

The call's one host sync is the settle (``moe_p2p.settle``; none under the experiment ``moe_settle_deferred``:
``moe_deferred``): one all_gather of an 8-int vector per rank (failure,
the routing facts: index extremes, offsets' smallest step, unnamed rows, ...), judged on the host alike on every
rank. Where any rank's premise failed, every rank redoes the call with the unfused reference (the same answer on
every rank, from the gathered vectors; ``moe_p2p.redo``, counted ``<op>:redo``). A rank may take this path while its
peer takes the general one (the premise's host part is per rank): both issue the same transfers in the same order
and the same settle. Where the premise fails the kernels still run on in-range rows: the index is reduced modulo the
buffer's rows, unnamed rows read row 0, and every block's offsets are clamped to its rows.

Taken (``eligible``) for the grouped form with a ``torch._grouped_mm`` kernel (bf16; ``moe_p2p.grouped_kernel``),
plan ``"blocks"`` (one unit per block), and a per-rank index as long as the buffer; bf16 rows whose byte offsets are
not 16-byte multiples are copied first (the grouped GEMM's alignment).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..schedule.combine import offsets, ring_steps
from . import moe_combine_lib, moe_nccl, moe_p2p, moe_peer, moe_plan_kernel, moe_plan_lib
from .base import stats
from .cpu import _poison, _wait_all


def eligible(grouped: bool, dtype: torch.dtype, chunks: int, index_rows: int, buffer_rows: int) -> bool:
    """Whether a call takes the whole-block path (module docstring); per rank (the paths interoperate)."""
    return grouped and moe_p2p.grouped_kernel(dtype) and chunks == 1 and index_rows == buffer_rows


class BlockPlan:
    """The premise's checks and each block's expert offsets, on the index's device, with no host read. ``index``:
    the op's (one entry per expert row; ``len(index)`` == ``sum(sizes)``, the buffer's rows); ``offs``: the experts'
    cumulative row offsets (int32, E entries); ``sizes``: the blocks' rows (host ints). ``idx``: the index reduced
    modulo the buffer's rows; ``inv``: the expert row of each buffer row (0 where none names it, the last where
    several do; the index is a permutation iff ``idx[inv]`` is ``arange``); ``table`` (int32 ``[blocks, E rounded
    up to 4]``): row j holds block j's cumulative expert offsets (16-byte aligned rows), each clamped to the block's
    rows; ``facts``: the settle's vector of routing facts (``moe_p2p.SETTLE_LEN`` int64; verdicts on the host,
    ``moe_p2p.verdicts``). Built by the library (``moe_plan_lib``) or two Triton kernels where
    ``moe_plan_kernel.should_use`` says so (CUDA), else by
    ``plan_with_torch``: the same tensors (the table where the data are good and the premise holds). ``cuts``
    (``cuts[j][q]``: block j's rows in its first q + 1 chunks; the dispatch cut by expert, ``moe_expert_cut``):
    ``pieces`` holds the expert pieces' bounds (int32, pieces + 1; the library's plan call writes them, else
    ``pieces_with_torch``), else None."""

    def __init__(self, index: torch.Tensor, offs: torch.Tensor, sizes: list[int],
                 cuts: list[list[int]] | None = None) -> None:
        experts, bounds = int(offs.shape[0]), offsets(sizes)
        built = moe_plan_kernel.build(index, offs, bounds, cuts) \
            if moe_plan_kernel.should_use(index, offs, len(sizes)) else None
        built = built or plan_with_torch(index, offs, bounds)
        self.idx, self.inv, self.table, self.facts = built[:4]
        self.experts, self.bounds = experts, bounds
        # the expert pieces' bounds where ``cuts`` asked (routes/moe_expert_cut.py): the library's, else torch's
        self.pieces = None if cuts is None else built[4] if len(built) > 4 else \
            pieces_with_torch(self.table, cuts, experts, index.device)

    def offs(self, j: int) -> torch.Tensor:
        """Block j's cumulative expert offsets (int32, E entries, a 16-byte-aligned view)."""
        return self.table[j, :self.experts]


def pieces_with_torch(table: torch.Tensor, cuts: list[list[int]], experts: int,
                      device: torch.device) -> torch.Tensor:
    """The expert pieces' bounds ``[0, e_1, ..., e_{N-1}, E]`` (int32, N + 1) from ``BlockPlan.table``: ``e_{q+1}`` the
    fewest experts whose rows in every block j end within ``cuts[j][q]`` (block j's rows in its first q + 1 chunks),
    at least ``e_q`` (``fo_moe_plan``'s, with torch ops: the CPU's and the Triton path's)."""
    host = torch.tensor(cuts, dtype=torch.int64)
    ends, = moe_p2p.upload([torch.cat([host.reshape(-1), torch.tensor([0, experts])])], device)
    cut = ends[:-2].view(host.shape)
    done = (table[:, :experts].to(torch.int64).unsqueeze(1) <= cut.unsqueeze(2)).sum(2)  # [blocks, N]
    inner = done.amin(0)[:-1].cummax(0).values  # at least the previous bound
    return torch.cat([ends[-2:-1], inner, ends[-1:]]).to(torch.int32)


def plan_with_torch(index: torch.Tensor, offs: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, ...]:
    """``BlockPlan``'s ``(idx, inv, table, facts)`` in ~28 torch ops (the reference semantics of
    ``moe_plan_kernel.build``; taken on CPU, without Triton and past its limits). ``bounds``: the blocks' row bounds."""
    dev, rows, experts = index.device, int(index.shape[0]), int(offs.shape[0])
    blocks = len(bounds) - 1
    # host ints in one upload: the blocks' first and end rows and sizes, the (block, group) keys to search, 0, rows
    starts, ends, sizes_d, queries, scalars = moe_p2p.upload([
        torch.tensor(bounds[:-1], dtype=torch.int64), torch.tensor(bounds[1:], dtype=torch.int64),
        torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.int64),
        torch.arange(blocks * (experts + 1)), torch.tensor([0, rows])], dev)
    raw = index.to(torch.int64)
    idx = torch.remainder(raw, max(rows, 1))
    arange = torch.arange(rows, device=dev)
    offs64 = offs.to(torch.int64)
    group = torch.searchsorted(offs64, arange, right=True)  # each expert row's group; E: in none
    # the last expert row naming each row (amax: deterministic where several do, as the kernels' atomic maximum)
    inv = torch.zeros(rows, dtype=torch.int64, device=dev).scatter_reduce_(0, idx, arange, "amax")
    key = group.index_select(0, inv)  # each buffer row's expert group
    key.add_(torch.searchsorted(ends, arange, right=True), alpha=experts + 1)  # + its block: (block, group)
    found = torch.searchsorted(key, queries, right=True).view(blocks, experts + 1)[:, :experts]
    per_block = torch.minimum((found - starts[:, None]).clamp_(min=0), sizes_d[:, None])  # within each block
    if experts % 4 == 0:  # each block's row of offsets starts 16-byte aligned, as the grouped GEMM needs
        table = per_block.to(torch.int32)
    else:
        table = torch.zeros(blocks, -(-experts // 4) * 4, dtype=torch.int32, device=dev)
        table[:, :experts] = per_block
    zero = scalars[0]
    offs_step = torch.diff(offs64, prepend=zero.view(1)).amin()  # checked with no rows too
    if rows:
        lo_hi = torch.aminmax(raw)
        facts = torch.stack([
            zero, scalars[1], lo_hi.max, lo_hi.min, offs_step,
            (idx.index_select(0, inv) != arange).sum(),  # the rows no entry names: 0 iff a permutation
            offs64[-1], torch.diff(key).amin().clamp(max=0) if rows > 1 else zero])
    else:
        facts = torch.stack([zero, zero, zero, zero, offs_step, zero, offs64[-1], zero])
    return idx, inv, table, facts


def _aligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the grouped GEMM reads them: a copy where the data do not start on 16 bytes."""
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


def _block_gemm(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor) -> torch.Tensor:
    """``sum_t grouped_mm(a[t], b[t], offs)`` rounded as the graph rounds it (each term in the dtype, then summed)."""
    y = None
    for x, w in zip(a, b, strict=True):
        t = torch._grouped_mm(_aligned(x), w, offs=offs)
        y = t if y is None else y.add_(t)
    return y


def run_combine(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor, index: torch.Tensor,
                outs: list[int], ins: list[int], group: dist.ProcessGroup, what: str, reference,
                deferred: bool = False) -> torch.Tensor:
    """The combine on the whole-block path: per ring step, block ``dst``'s rows (its expert rows gathered by
    ``inv``, one grouped GEMM per term) sent to ``dst`` while the next block computes; the own block last, copied."""
    world, rank = group.size(), group.rank()
    n, like = int(b[0].shape[-1]), a[0]
    recv_off = offsets(outs)
    out = like.new_empty(recv_off[-1], n)
    received = [out[recv_off[j]:recv_off[j + 1]] for j in range(world)]
    # peer transfers: the call begun before the GEMMs, so that each block's push waits only for its own event
    peer = moe_peer.begin(like, n * like.element_size(), ins, outs, group, deferred, True)
    one_call = _one_call(a, b, offs, index, ins, received[rank], group, peer)
    if one_call is not None:
        keep, failure, facts = one_call
        blocks, ready, _ = keep
        works = []
        if peer is not None:  # after a failure: the poisoned rows, written behind the fork, once they are
            if failure is not None:
                ready = [torch.cuda.Event()] * world
                ready[0].record()
            works = [w for _, w in peer.send(blocks, received, ready)]
        for dst, src in ring_steps(world, rank) if peer is None else ():
            try:
                works += moe_p2p.exchange(blocks[dst], received[src], dst, src, group,
                                          moe_p2p.COMBINE_TAG, None if failure else ready[dst])
            except BaseException as exc:  # noqa: BLE001 - as below
                failure = failure or exc
        return _end_combine(works, keep, failure, facts, out, what, like, group, deferred, reference, peer)
    works, keep, failure, plan = [], [], None, None
    blocks, ready = [None] * world, [None] * world
    try:
        plan = BlockPlan(index.to(like.device), offs, list(ins))
    except BaseException as exc:  # noqa: BLE001 - settled below, after every ring step was issued
        failure = exc
    for dst, src in [*ring_steps(world, rank), (rank, rank)]:
        into = out[recv_off[src]:recv_off[src + 1]]
        rows = int(ins[dst])
        block = None
        if failure is None and rows:
            try:
                lo = plan.bounds[dst]
                block = _block_gemm([x.index_select(0, plan.inv[lo:lo + rows]) for x in a], b, plan.offs(dst))
                block = block.contiguous()  # _grouped_mm pads its rows to 16 bytes: N % 8 != 0 in bf16 is strided
            except BaseException as exc:  # noqa: BLE001 - as above
                failure = exc
        if block is None:
            block = like.new_empty(rows, n)
            _poison(block)  # a failed rank's block: never mistaken for data
        keep.append(block)  # alive until its transfer completed
        try:
            if dst == rank:
                into.copy_(block)
            elif peer is not None:  # pushed by the copy engine once it exists (``send`` below)
                blocks[dst], ready[dst] = block, torch.cuda.Event()
                ready[dst].record()
            else:
                works += moe_p2p.exchange(block, into, dst, src, group, moe_p2p.COMBINE_TAG)
        except BaseException as exc:  # noqa: BLE001 - as above
            failure = failure or exc
    if peer is not None:
        works = [w for _, w in peer.send(blocks, received, ready)]
    return _end_combine(works, keep, failure, None if plan is None else plan.facts, out, what, like, group, deferred,
                        reference, peer)


def _one_call(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor, index: torch.Tensor, ins: list[int],
              own: torch.Tensor, group: dist.ProcessGroup, peer: moe_peer.PeerCall | None) -> tuple | None:
    """The combine's compute as one library call (``moe_combine_lib``) where it takes the call: ``(keep, failure,
    facts)`` with ``keep`` = (each peer block's send rows, their ready events, the send buffer), the own
    block already in ``own``; None where it does not (nothing enqueued). ``peer``: the call's transfers are peer
    pushes (``moe_peer``), which wait for the block events as NCCL's direct transfers do; under its ``targets``
    each peer block is written straight into its destination's slot (no send buffer, nothing left to push: the
    block kept is None), a block past its slot into rows of its own, spilled by ``send``. A failure after its first
    launch poisons what it wrote to (the send buffer or the slots, and ``own``: what leaves this rank is never
    mistaken for data) and is settled by the caller."""
    world, rank, like = group.size(), group.rank(), a[0]
    if not (like.is_cuda and moe_plan_lib.usable(like) and int(own.shape[0]) == int(ins[rank])
            and (peer is not None or moe_nccl.communicator(group, like.device) is not None)
            and moe_combine_lib.should_run(a, b, offs, index, world)):
        return None
    bounds, n = offsets(ins), int(b[0].shape[-1])
    targets = None if peer is None else peer.targets(ins, n, like.dtype)
    send = like.new_empty(bounds[-1], n) if targets is None else None
    ready = [None if j == rank or not ins[j] else torch.cuda.Event() for j in range(world)]
    order = [dst for dst, _ in ring_steps(world, rank)] + [rank]
    failure, facts = None, None
    try:
        facts = moe_combine_lib.run(a, b, offs, index.to(like.device), list(ins), order, send, own, rank, ready,
                                    targets)
        if facts is None:
            return None
    except BaseException as exc:  # noqa: BLE001 - settled by the caller, after every ring step was issued
        failure = exc
        for t in [send, own] if targets is None else [*targets, own]:
            if t is not None:
                _poison(t)
    blocks = peer.to_push(targets) if targets is not None else [send[bounds[j]:bounds[j + 1]] for j in range(world)]
    return (blocks, ready, send), failure, facts


def _end_combine(works: list, keep: object, failure: BaseException | None, facts: torch.Tensor | None,
                 out: torch.Tensor, what: str, like: torch.Tensor, group: dist.ProcessGroup, deferred: bool,
                 reference, peer: moe_peer.PeerCall | None) -> torch.Tensor:
    """The combine's end on either path: every step waited for, the settle, the redo where a rank's premise failed."""
    failure = _wait_all(works, failure)
    if moe_p2p.end_call(failure, facts, [out], what, like.device, group, deferred, peer):
        del keep, out  # the redo's memory
        return moe_p2p.redo("combine", reference)
    stats["combine:fast"] += 1
    del keep
    return out


def run_dispatch(x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], offs: torch.Tensor, outs: list[int],
                 ins: list[int], group: dist.ProcessGroup, what: str, reference,
                 deferred: bool = False, keep_rows: bool = True) -> list[torch.Tensor]:
    """The dispatch on the whole-block path: every ring step's transfer issued first, the own block's GEMMs on its
    rows as they lie in ``x`` (never copied into the receive buffer), then each block's as it lands. Each block's
    rows and GEMM results are moved into expert order as soon as they exist (``p[inv[r]] = row r``, ``y[inv[r]] =
    Y_j[r]``: under the premise ``inv`` inverts the index, so this is ``p = recv[index]``, ``y = cat_j(Y_j)[index]``
    bit for bit), so the own block's moves run while the peers' rows travel and no ``cat`` of the blocks' results
    is made; where the premise fails the outputs are the settle's to discard (redo) or poison (deferred).
    ``keep_rows`` False: ``p`` is not written (returned as ``[0, K]``; its rows are read where they lie)."""
    rank = group.rank()
    library = moe_plan_lib.usable(x)  # asked once per call; its kernels loaded before any transfer is in flight
    # one unit per block (unit j is block j); peer transfers: each peer block read where it landed, in its slot
    sent = moe_p2p.issue_dispatch(x, outs, ins, 1, group, deferred, in_slots=True)
    x, recv, send_off, recv_off, failure = sent.x, sent.recv, sent.send_off, sent.recv_off, sent.failure
    plan, result = None, None

    def compute(j: int, rows: torch.Tensor) -> None:
        if not rows.shape[0]:
            return
        inv = plan.inv[recv_off[j]:recv_off[j + 1]]
        # (dst, src) in order: p's rows where kept, then each GEMM's result (made lazily: moved, then freed)
        moves = zip(result if keep_rows else result[1:], itertools.chain(
            [rows] if keep_rows else [], (torch._grouped_mm(_aligned(rows), w, offs=plan.offs(j)) for w in b)),
            strict=True)
        if library:  # every move of the block in one library call where it takes them
            moves = list(moves)
            if moe_plan_lib.should_move(inv, moves) and moe_plan_lib.move_rows(inv, moves):
                return
        for dst, src in moves:
            moe_p2p.copy_rows(dst, inv, src)

    try:
        if failure is None:
            if ins[rank] != outs[rank]:
                raise ValueError(f"flashoverlap: the dispatch sends {ins[rank]} rows to its own rank and receives "
                                 f"{outs[rank]} from it (input_split_sizes {list(ins)}, output {list(outs)})")
            plan = BlockPlan(index.to(x.device), offs, list(outs))
            rows = recv_off[-1]
            result = [x.new_empty(rows if keep_rows else 0, x.shape[1]), *(x.new_empty(rows, w.shape[-1]) for w in b)]
            compute(rank, x[send_off[rank]:send_off[rank + 1]])
    except BaseException as exc:  # noqa: BLE001 - the transfers are still waited for
        failure = failure or exc
    for src, works in sent.landing:
        failure = _wait_all(works, failure)
        if failure is None:
            try:
                compute(src, recv[recv_off[src]:recv_off[src + 1]] if sent.slots is None else sent.slots[src])
            except BaseException as exc:  # noqa: BLE001 - as above
                failure = exc
    facts = None if plan is None else plan.facts
    if moe_p2p.end_call(failure, facts, result or [], what, x.device, group, deferred, sent.peer):
        del recv, result, plan, sent  # the redo's memory
        return moe_p2p.redo("dispatch", reference)
    stats["dispatch:fast"] += 1
    del sent
    return result
