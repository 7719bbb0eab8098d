"""One MoE call's peer transfers (``routes/moe_peer.py``, which chooses and begins them): ``PeerCall`` sends every
block (pushed by copy engine into its slot, written there by the combine's GEMM, or spilled past its slot by one
direct exchange of the pair's rows, ``moe_nccl.exchange_blocks``), then finishes the call (the copy stream joined,
the spills waited for, "read" to every peer, NaN into the outputs while the group's fault block holds a fault).

Invariants: a call's spills are planned in ``begin`` from the split sizes, which both ends of a pair share
(``spill_plan``), and are exchanged once per call whatever fails (``finish`` sends NaN rows where ``send`` never ran),
so the pairs' exchanges always match; every tensor the copy stream or the exchange touches is recorded on its stream
and kept until the join; ``finish`` releases the device's call lock that ``begin`` took.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels

from . import gather_protocol, moe_nccl, symmetric
from .base import note, stats

NAME = "moe_peer"
PUSH_EXPERIMENT = "moe_peer_push"  # the combine's blocks pushed by copy engine, not written by its GEMM into the slots
SPILL_TAG = 30870  # the P2P tag of blocks past their slots where torch's point-to-point ops carry them
open_calls: dict[tuple[int, str], PeerCall] = {}  # (device, group) -> the call begun and not finished (``abandon``)


def spill_plan(ins: Sequence[int], outs: Sequence[int], rank: int, row_bytes: int, slot_bytes: int
               ) -> tuple[dict[int, int], dict[int, int]]:
    """The blocks a call spills (``PeerCall.spill_out``, ``spill_in``: peer -> rows), those past ``slot_bytes``:
    this rank's ``ins[j]`` rows to each peer ``j`` and its ``outs[j]`` rows from it (bytes: rows x ``row_bytes``).
    The peer computes the same pair from its own split sizes (``ins[j]`` here is ``outs[rank]`` there)."""
    return ({j: int(n) for j, n in enumerate(ins) if j != rank and int(n) * row_bytes > slot_bytes},
            {j: int(n) for j, n in enumerate(outs) if j != rank and int(n) * row_bytes > slot_bytes})


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
    row_bytes: int = 0  # bytes of one row of the call's blocks
    dtype: torch.dtype = torch.bfloat16  # the blocks' elements
    spill_out: dict = field(default_factory=dict)  # peer -> rows of this rank's block to it, past its slot there
    spill_in: dict = field(default_factory=dict)  # peer -> rows of its block to this rank, past its slot here
    spill_steps: list = field(default_factory=list)  # the spill exchange's steps, waited for by ``finish``
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
        the block. A block past its slot (``spill_out`` / ``spill_in``, from the split sizes that both ends of a pair
        share) is *spilled*: it travels by one exchange of every such block of this rank
        (``moe_nccl.exchange_blocks``), straight between the caller's rows, counted ``moe_peer:spill``; a block
        missing or of another size than planned travels as NaN rows and fails the call, so the pair stays matched."""
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
            if j in self.spill_out:
                planned = self._planned(block, self.spill_out[j], True)
                spill_out.append((j, planned, ev if planned is block else None))  # NaN rows: written now
            elif block is not None and block.numel():
                block = self._pushable(block, True)
            if j in self.spill_in:
                spill_in.append((j, self._planned(rows, self.spill_in[j], False)))
            elif rows is not None and rows.numel():
                rows = self._pushable(rows, False)
            for t, ptrs, sizes, planned in ((block, p.blocks, p.block_bytes, self.spill_out),
                                            (rows, p.recv, p.recv_bytes, self.spill_in)):
                if j not in planned and t is not None and t.numel():
                    ptrs[j], sizes[j] = t.data_ptr(), t.numel() * t.element_size()
                    t.record_stream(copy)  # never reused before the copy stream is done with it, whatever exits
                    self.keep.append(t)
            if self.begun and p.block_bytes[j] and ev is None:
                ev = torch.cuda.Event()  # phase 2's fork was before the block was written: it waits for now
                ev.record(torch.cuda.current_stream(self.device))
            p.block_events[j] = None if ev is None or j in self.spill_out else ev.cuda_event
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
                got, self.spill_steps = moe_nccl.exchange_blocks(spill_out, spill_in, self.group,
                                                                 f"a MoE block past its slot ({NAME})", SPILL_TAG)
                landed.update(got)
            except BaseException as exc:  # noqa: BLE001 - settled by the caller, after the finish
                self.failure = self.failure or exc
        return [((rank - d) % world, landed[(rank - d) % world]) for d in range(1, world)]

    def _planned(self, t: torch.Tensor | None, rows: int, out: bool) -> torch.Tensor:
        """``t`` where it is the planned spill of ``rows`` rows, contiguous; else NaN rows of that size (a block to
        send) or scratch rows (to receive into), and the call failed: the exchange stays what both ends planned."""
        if t is not None and t.numel() * t.element_size() == rows * self.row_bytes and t.is_contiguous():
            return t
        if t is not None:
            self.failure = self.failure or ValueError(f"flashoverlap: {NAME}: rows of {tuple(t.shape)} where the split "
                                                      f"sizes planned {rows} contiguous rows")
        scratch = torch.empty(rows, self.row_bytes // self.dtype.itemsize, dtype=self.dtype, device=self.device)
        if out:
            scratch.fill_(float("nan"))  # what the peer receives is never mistaken for data
        return scratch

    def _pushable(self, t: torch.Tensor, out: bool) -> torch.Tensor | None:
        """``t`` where the slot holds it (a block to send made contiguous; rows to receive into must be); else None
        (nothing pushed, nothing read) and the call failed."""
        why = None
        if t.numel() * t.element_size() > self.slot_bytes:  # (never: the split sizes planned no spill for it)
            why = f"{tuple(t.shape)} rows past the slot that the split sizes did not plan to spill"
        elif not (out or t.is_contiguous()):
            why = "receive rows must be contiguous"
        if why is not None:
            self.failure = self.failure or ValueError(f"flashoverlap: {NAME}: {why}")
            return None
        return t if t.is_contiguous() else t.contiguous()

    def finish(self, outputs: Sequence[torch.Tensor], failure: BaseException | None) -> BaseException | None:
        """Join the copy stream, tell the peers their slots here were read, poison ``outputs`` while the group's
        fault block holds a fault; returns the call's first failure (``failure``, else this route's)."""
        try:
            if not self.sent:  # every flag and every planned spill once per call, whatever failed before
                self.send([None] * self.group.size(), [None] * self.group.size())
            for step in self.spill_steps:  # the spilled rows landed and left before the outputs may be poisoned
                step.wait()
            p = self.p
            live = [t for t in outputs if t is not None and t.numel()][:gather_protocol.MAX_OUTPUTS]
            p.num_outputs = len(live)  # at most 1 + 7 GEMM terms: the MoE ops have 1 + 1-3
            for i, t in enumerate(live):
                p.outputs[i], p.output_numel[i] = t.data_ptr(), t.numel()
            rc = gather_protocol.finish(kernels.library(), p, self.ws, tuple(self.keep), NAME)
        finally:
            self.keep, self.finished = [], True
            open_calls.pop((self.device.index, self.group.group_name), None)
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
            if j != rank and j not in self.spill_out:
                out[j] = self.ws.views[j][start:start + rows * n * itemsize].view(dtype).view(rows, n)
            elif j != rank:
                out[j] = torch.empty(rows, n, dtype=dtype, device=self.device)
        return out

    def to_push(self, targets: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``targets``' blocks that ``send`` still moves (the spilled ones): the others are in their slots."""
        return [t if j in self.spill_out else None for j, t in enumerate(targets)]

    @property
    def direct(self) -> frozenset[int]:
        """The peers whose block ``targets`` has the combine's GEMM write straight into their slot: every peer whose
        block is not spilled."""
        return frozenset(range(self.group.size())) - {self.group.rank(), *self.spill_out}

    def slots(self, rows: Sequence[int], n: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """This rank's receive slots as ``[rows[j], n]`` ``dtype`` views (the own entry and a block past its slot
        None): where each peer's block lands when ``send`` is given no receive rows for it. Read only between its
        landing's wait and ``finish`` (after the finish's "read", the peer may write the slot again)."""
        rank, itemsize = self.group.rank(), dtype.itemsize
        mine = self.ws.views[rank]
        stats[f"{NAME}:in_slots"] += 1
        return [None if j == rank or j in self.spill_in else
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
