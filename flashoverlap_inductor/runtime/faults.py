"""The host side of the failure contract: fault blocks, their pinned mirrors, and the exceptions they raise.

A *fault domain* is one ``fo_fault`` block (``csrc/flashoverlap_sm90.h``): per (device, group) for the peer and ring
routes (inside the group's symmetric flag page, so a rank whose wait gives up also writes its peers' blocks), per
(device, caller stream) for the NCCL route (the ranks learn of each other's faults by the one-int all-reduce in the
call's last NCCL group). Invariants:

- A call whose rank, or any rank it exchanged data with, saw a wait give up returns NaN (the route's last kernel
  fills the output while the block holds a fault); no stale sum leaves a call.
- The host learns of a fault from the pinned mirror, without a device sync: every eager fused call reads the mirrors
  of its device first (``raise_pending``), the compiled wrapper after each run (``backend``), and ``routes.check()``
  after synchronizing. It then synchronizes the device, clears the block and the mirror, and raises
  ``errors.FlashOverlapTimeout`` (or ``errors.PeerFailure``) naming the route, the wait, the rank whose wait gave up and
  the call's shape. Every rank of the group raises: each one's own block holds the fault.
- A late rank needs nothing reset: every rank notifies each flag once per call and every wait consumes one epoch
  whether or not it timed out, so epochs stay aligned, and each call sets its own deadline (a fault never makes a
  later call skip its waits). A rank that skips a call altogether leaves its epochs one call behind its peers', so
  a fault of a symmetric-memory domain (peer, ring, gather_peer: ``FaultDomain.resync``) also marks its (device,
  group) *to resynchronize* when it is raised (``resync_due``): every rank of the group raises it (the recording
  rank's wait wrote every peer's block), so every rank's next call on the group first runs the same collective
  resynchronization (``routes.symmetric.resync``), which clears the mark (``resynced``).
- A rank learns of a peer's record in its block from its mirror, which only its own calls write, or from
  ``raise_pending(deep=True)`` (``routes.check()``, after its device sync), which reads the blocks themselves: a
  rank that skipped the faulted call ran nothing that would copy its block, so ``routes.check()`` is where it
  raises (and is marked) before its next call, as its peers are.
- A group whose MoE calls over peer transfers settle without a host read (``judged_later``) has its
  symmetric-memory faults raised by those calls' judgement (one point on every rank) or ``routes.check()``, never at a
  call's start or a compiled run's end; that includes what other routes sharing its flag page record (the
  all_gather's on that group), whose later calls return NaN until then.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass, field

import torch

from flashoverlap_inductor import errors
from flashoverlap_inductor.native import kernels

MAX_PEERS = 8  # FO_FAULT_MAX_PEERS
BLOCK_BYTES = 128
MIRROR_INTS = 8
CODES = {1: "a wait of this rank", 2: "a wait of rank {origin}", 3: "a wait of rank {origin}",
         4: "rank {origin} could not enqueue part of the call",
         5: "the NCCL transfers of rank {origin}"}  # 5: given up by the host watchdog (runtime/nccl_watch.py)


class FaultBlock(ctypes.Structure):
    """``fo_fault`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("code", ctypes.c_int32), ("tag", ctypes.c_int32), ("seen", ctypes.c_int32),
                ("target", ctypes.c_int32), ("origin", ctypes.c_int32), ("fault_call", ctypes.c_int32),
                ("launch", ctypes.c_int32), ("rank", ctypes.c_int32), ("deadline_ns", ctypes.c_int64),
                ("call_counter", ctypes.c_int32), ("current_launch", ctypes.c_int32), ("npeers", ctypes.c_int32),
                ("exchange", ctypes.c_int32), ("peers", ctypes.c_void_p * MAX_PEERS), ("reserved", ctypes.c_int64)]


_launch_ids = itertools.count(1)
_launches: dict[int, str] = {}
_lock = threading.Lock()


def launch_id(description: str) -> int:
    """A small id for a launch (``fo_fault.current_launch``), so a fault names the call's shape."""
    with _lock:
        i = next(_launch_ids) & 0x7FFFFFFF
        _launches[i] = description
        return i


def describe_wait(tag: int) -> str:
    """The wait a tag names (the tags of csrc/peer_call.cu, ring_call.cu, gather_call.cu and fused_call.cu; the
    copy-engine protocol's, 3000-3299, serve the all_gather and both pull routes alike)."""
    if 1000 <= tag < 1100:
        return "the peer's GEMM 1 (its partial of this rank's rows)"
    if 1100 <= tag < 1200:
        return f"this rank's GEMM 2, copy group {tag - 1100}"
    if 1200 <= tag < 1300:
        return f"the peer's GEMM 2, group {tag - 1200}"
    if 2000 <= tag < 2400:
        return f"the next rank's push of round {(tag - 2000) // 16}, step {(tag - 2000) % 16}"
    if 2400 <= tag < 2800:
        return f"rank {(tag - 2400) % 16}'s reduced piece of round {(tag - 2400) // 16}"
    if tag == 2800:
        return "the other ranks' end-of-call barrier"
    if 3000 <= tag < 3100:
        return f"rank {tag - 3000}'s rows of this call (the copy-engine protocol's ready flag)"
    if 3100 <= tag < 3200:
        return f"rank {tag - 3100} finished reading this rank's previous rows (the copy-engine protocol)"
    if 3200 <= tag < 3300:
        return f"a part of the call this rank could not enqueue (copy-engine protocol step {tag - 3200})"
    if tag < 0:
        return "another rank (the fault exchange)"
    return f"the GEMM's tiles of wave group {tag}"


@dataclass
class FaultDomain:
    """One fault block (``block``: its device tensor, 128 bytes) and its pinned mirror ``int32[8]``."""

    device: int
    route: str
    group: str
    block: torch.Tensor
    mirror: torch.Tensor
    peers: list[int] = field(default_factory=list)
    resync: bool = False  # a symmetric-memory domain: raising its fault marks (device, group) to resynchronize
    rank: int = 0  # this rank in the group (``setup``)
    label: str = ""  # the routes a fault names (default ``route``; a flag page several routes share names them all)

    def __post_init__(self) -> None:  # addresses read on every call: taken once
        self.block_ptr: int = self.block.data_ptr()
        self.mirror_ptr: int = self.mirror.data_ptr()
        self._code = ctypes.c_int32.from_address(self.mirror_ptr)  # a view of mirror[0]

    def setup(self, rank: int, peer_blocks: list[int]) -> None:
        """Write this rank and the peers' block addresses (mapped here) into the block (zeroed before)."""
        img = FaultBlock()
        img.rank, img.npeers, img.origin = rank, len(peer_blocks), -1
        for i, p in enumerate(peer_blocks[:MAX_PEERS]):
            img.peers[i] = p
        host = torch.frombuffer(bytearray(bytes(img)), dtype=torch.uint8)
        self.block.view(torch.uint8).copy_(host)
        torch.cuda.synchronize(self.device)
        self.peers, self.rank = list(peer_blocks), rank

    def reinit(self) -> None:
        """Write the block afresh (every field zero but rank and the peers) and zero the mirror: after its flag page
        was zeroed (``routes.symmetric.resync``)."""
        self.mirror.zero_()
        if not self.block.is_cuda:  # a CPU simulation
            self.block.zero_()
            self.block.view(torch.int32)[7] = self.rank
            return
        self.setup(self.rank, self.peers)

    def refresh(self) -> None:
        """Copy the block's record into the mirror when the mirror holds none (a device read: after a sync only).
        A peer's timed-out wait writes this rank's block, but only this rank's own calls copy the block to the
        mirror: a rank that ran no call since (it skipped the faulted call) learns of the record here."""
        if self._code.value:
            return
        ints = self.block.view(torch.int32)[:MIRROR_INTS].cpu()
        if int(ints[0]):
            self.mirror.copy_(ints)

    def clear(self) -> None:
        """Zero the block's fault fields and the mirror (``fo_fault_clear``; on the host for a CPU simulation)."""
        if not self.block.is_cuda:
            ints = self.block.view(torch.int32)
            ints[:7] = 0
            ints[13] = 0  # exchange
            self.mirror.zero_()
            return
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device).cuda_stream
            kernels.check(kernels.library().fo_fault_clear(self.block_ptr, self.mirror_ptr, stream), "fo_fault_clear")
        torch.cuda.synchronize(self.device)

    def pending(self) -> bool:
        """Whether the mirror holds a fault (a host load of pinned memory; no device sync)."""
        return self._code.value != 0

    def raise_fault(self) -> None:
        """Synchronize the device, clear the block and the mirror, mark (device, group) to resynchronize when this
        is a symmetric-memory domain (``resync``), and raise the recorded fault."""
        torch.cuda.synchronize(self.device)
        vals = [int(v) for v in self.mirror.tolist()]
        code, tag, seen, target, origin, _call, launch, rank = vals
        if code == 0:
            return
        self.clear()
        if self.resync:
            _resync.add((self.device, self.group))
        who = CODES.get(code, "a wait").format(origin=origin)
        shape = _launches.get(launch, "a call whose shape is no longer known")
        route = self.label or self.route
        if code == 4:
            raise errors.PeerFailure(f"flashoverlap: {who} ({route} route, group {self.group}, cuda:{self.device},"
                                     f" rank {rank}): {shape}. Its outputs were poisoned (NaN). {AFTER[self.resync]}")
        if code == 5:
            raise errors.FlashOverlapTimeout(
                f"flashoverlap: {who} did not finish within the host watchdog's bound on the {route} route, "
                f"group {self.group} (cuda:{self.device}, this is rank {rank}), during {shape}: a peer never made "
                "its matching NCCL call (it failed or refused it). Its outputs were poisoned (NaN); the process "
                "group was aborted so that no kernel waits forever, and is unusable now (NCCL's rule): create a "
                "new group.")
        detail = "" if code == 3 else f" for {describe_wait(tag)} (saw {seen}, waited for {target})"
        raise errors.FlashOverlapTimeout(
            f"flashoverlap: {who} timed out{detail} on the {route} route, group {self.group} (cuda:{self.device}, "
            f"this is rank {rank}), during {shape}. Rank {origin} gave up waiting (for a rank that stalled, failed "
            "or skipped the call). Every rank of the group "
            "raises this; the outputs of the calls it concerned were poisoned (NaN), never returned with stale data. "
            f"{AFTER[self.resync]} Raise wait_timeout_ms if the stall was expected.")


_domains: dict[tuple, FaultDomain] = {}
_resync: set[tuple[int, str]] = set()  # (device, group name) whose next call resynchronizes the group first
_judged_later: set[str] = set()  # groups whose symmetric-memory faults the MoE judgement raises (``judged_later``)
AFTER = {False: "The next call runs normally (no reset needed).",
         True: "The group's next call first resynchronizes its ranks (collectively; no reset needed)."}


def new_mirror() -> torch.Tensor:
    """A zeroed host mirror int32[8]: pinned (the device writes it) where CUDA exists; plain for CPU simulations."""
    return torch.zeros(MIRROR_INTS, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def domain(key: tuple, make) -> FaultDomain:
    """The fault domain of ``key`` (``make()`` builds it on first use)."""
    d = _domains.get(key)
    if d is None:
        d = _domains[key] = make()
    return d


def raise_pending(device: int | None = None, deep: bool = False) -> None:
    """Raise the first recorded fault of ``device``'s domains (every device when None); a host read per domain.
    ``deep``: read the symmetric-memory domains' blocks too, which peers write (``FaultDomain.refresh``; the caller
    synchronized the devices). Without ``deep``, not the symmetric-memory domains of the groups ``judged_later``
    named: their mirrors reach the ranks' hosts at different calls."""
    for d in tuple(_domains.values()):
        if (device is not None and d.device != device) or (d.resync and not deep and d.group in _judged_later):
            continue
        if deep and d.resync:
            d.refresh()
        if d._code.value:
            d.raise_fault()


def judged_later(group: str) -> None:
    """From now on the symmetric-memory faults of ``group`` are raised where every rank judges a call's status at
    one point (``routes.moe_deferred``'s judgement of a MoE call with peer transfers, settled without a host read),
    or by ``raise_pending(deep=True)`` (``routes.check()``), never at a call's start or a compiled run's end."""
    _judged_later.add(group)


def resync_due(device: int, group: str) -> bool:
    """Whether a raised fault marked (``device``, ``group``) to resynchronize before its next call (a set lookup)."""
    return bool(_resync) and (device, group) in _resync


def marked() -> list[tuple[int, str]]:
    """The (device, group) pairs marked to resynchronize, in one order on every rank."""
    return sorted(_resync)


def resynced(device: int, group: str) -> None:
    """The mark of (``device``, ``group``) is done with: its ranks resynchronized."""
    _resync.discard((device, group))


def forget(route: str | None = None) -> None:
    """Drop the domains (of ``route``; all, and every resynchronization mark, when None): after the route's state
    was reset."""
    for key in [k for k, d in _domains.items() if route is None or d.route == route]:
        del _domains[key]
    if route is None:
        _resync.clear()
        _judged_later.clear()
