"""Copy route for the fused reduce_scatter: partial sums cross NVLink by copy engine, one reduction at the end.

Opt-in (``runtime_gpu.COMM = "copy"`` / ``$FLASHOVERLAP_COMM=copy``); the default route is NCCL. Why: SM-based
NCCL kernels beside the GEMM cost more than the transfers themselves (``examples/RESULTS.md``), while
``cudaMemcpyAsync`` into a peer's memory runs on copy engines and slows the GEMM by 1-3%. An earlier copy route
reduced every group as it arrived, on SMs under the running GEMM, and lost (fourth session); this one defers the
whole reduction to one sum after the GEMM, as PyTorch's async-TP does.

Workspace of one (device, group, dtype, counter slot): a symmetric buffer (``torch.distributed._symmetric_memory``)
of ``world`` slots, each ``capacity`` elements; slot ``s`` of rank ``r`` receives rank ``s``'s partial sums of rank
``r``'s output block (slot ``r``: its own). Per call, on the side stream:

1. ``begin``: signal every peer and wait for every peer's signal (channel 0): each peer has finished the previous
   call's sum over its slots, so they may be written again;
2. per group, after its wait (``push``): the group's piece for rank p (``pieces``: natural rows on the
   "schedule" route, the default here, so A is not gathered) is copied into p's slot for us, at its output rows;
   our own piece into our own slot;
3. ``finish``: signal / wait channel 1 (every peer's pushes into our slots have landed), then
   ``out = sum of the slots`` (one kernel, fp32 accumulation, rounded once).

Invariants: all ranks take the route for the same calls (a global setting and shapes all ranks share) and grow the
workspace together (a rendezvous). Not under CUDA-graph capture (``workspace`` returns None; the call uses NCCL).
The signal kernels are torch's, bounded by ``config.wait_timeout_ms``; a timeout there is a device-side trap (the
CUDA context is lost), not ``kernels.FlashOverlapTimeout``. Sizes are in elements.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .runtime_cpu import GroupStep

log = logging.getLogger("flashoverlap")

CH_FREE, CH_PUSHED = 0, 1


@dataclass
class Workspace:
    """The symmetric buffer of one (device, group, dtype, slot) and the peers' views of theirs (flat, elements)."""

    rank: int
    world: int
    capacity: int  # elements per slot
    buf: torch.Tensor
    hdl: object
    peer_bufs: dict[int, torch.Tensor] = field(default_factory=dict)

    def slot(self, t: torch.Tensor, src: int, rows: int, n: int) -> torch.Tensor:
        """Slot ``src`` of the buffer view ``t`` as [rows, n]."""
        return t[src * self.capacity:src * self.capacity + rows * n].view(rows, n)

    def slots(self, rows: int, n: int) -> torch.Tensor:
        """Every slot of our buffer as [world, rows * n] (slots are ``capacity`` apart)."""
        return self.buf.view(self.world, self.capacity)[:, :rows * n]


_workspaces: dict[tuple[int | None, str, torch.dtype, int], Workspace] = {}


def workspace(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, elements: int,
              slot: int) -> Workspace | None:
    """The cached workspace with ``elements`` per slot, grown by a rendezvous on every rank; None inside a CUDA-graph
    capture (it cannot grow there, and torch's signal kernels are not captured)."""
    if torch.cuda.is_current_stream_capturing():
        return None
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    key = (device.index, name, dtype, slot)
    ws = _workspaces.get(key)
    if ws is not None and ws.capacity >= elements:
        return ws
    world, rank = group.size(), group.rank()
    capacity = max(elements, 2 * ws.capacity if ws is not None else 0)
    if ws is not None:
        torch.cuda.synchronize(device)  # calls in flight may still use the old buffer
    buf = symm_mem.empty(world * capacity, dtype=dtype, device=device)
    hdl = symm_mem.rendezvous(buf, name)
    peers = {p: hdl.get_buffer(p, (world * capacity,), dtype) for p in range(world) if p != rank}
    ws = _workspaces[key] = Workspace(rank, world, capacity, buf, hdl, peers)
    log.info("flashoverlap copy route: symmetric workspace %d x %d %s elements on %s, group %s, slot %d", world,
             capacity, dtype, device, name, slot)
    return ws


def _signal_all(ws: Workspace, channel: int, timeout_ms: float) -> None:
    t = max(1, int(timeout_ms))
    for p in ws.peer_bufs:
        ws.hdl.put_signal(p, channel, t)
    for p in ws.peer_bufs:
        ws.hdl.wait_signal(p, channel, t)


def begin(ws: Workspace, timeout_ms: float) -> None:
    """Step 1 of the module docstring, on the current (side) stream."""
    _signal_all(ws, CH_FREE, timeout_ms)


def pieces(step: GroupStep, world: int, block_rows: int) -> list[tuple[int, int, int, int]]:
    """The group's ``(rank, lo, hi, row)``: GEMM output rows ``[lo, hi)`` go to ``rank``'s slot at output row
    ``row``. The "schedule" route (``step.sends`` in natural rows: rank j's block starts at ``j * block_rows``) or
    the "gather" layout (``world`` equal pieces of the group's buffer rows, each at the group's output rows)."""
    if step.sends:
        return [(j, lo, hi, lo - j * block_rows) for j, lo, hi in step.sends if hi > lo]
    c = step.out[1] - step.out[0]
    return [(p, step.lo + p * c, step.lo + (p + 1) * c, step.out[0]) for p in range(world)] if c > 0 else []


def fits(steps: tuple[GroupStep, ...] | list[GroupStep], world: int, block_rows: int) -> bool:
    """Whether every piece lies inside its rank's block (schedule route) or every group's buffer rows are ``world``
    equal pieces of its output rows (gather layout), as ``pieces`` assumes."""
    for s in steps:
        if not s.sends and s.hi - s.lo != world * (s.out[1] - s.out[0]):
            return False
        if any(not 0 <= row <= row + hi - lo <= block_rows for _, lo, hi, row in pieces(s, world, block_rows)):
            return False
    return True


def push(ws: Workspace, step: GroupStep, buf: torch.Tensor, block_rows: int) -> None:
    """Step 2 for one group: ``buf`` is the GEMM output [rows, N]; ``block_rows`` each rank's output rows. Copies
    only (copy engine), on the current (side) stream."""
    n = buf.shape[1]
    for p, lo, hi, row in pieces(step, ws.world, block_rows):
        dst = ws.peer_bufs[p] if p != ws.rank else ws.buf
        ws.slot(dst, ws.rank, block_rows, n)[row:row + hi - lo].copy_(buf[lo:hi])


def finish(ws: Workspace, out: torch.Tensor, timeout_ms: float) -> None:
    """Step 3: ``out`` [block_rows, N] := the sum over the slots, on the current (side) stream."""
    _signal_all(ws, CH_PUSHED, timeout_ms)
    rows, n = out.shape
    torch.sum(ws.slots(rows, n), dim=0, out=out.view(-1))

