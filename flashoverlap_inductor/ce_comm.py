"""Copy-engine (CE) communication for the fused ops: each group's data crosses NVLink as ``cudaMemcpyAsync``
pushes and pulls between symmetric-memory buffers (``torch.distributed._symmetric_memory``), so the transfers take
no SMs. Only the reduction (an elementwise add over 1/W of each group) and one-block signal kernels run on SMs.

Why: with SM-based NCCL the GEMM and the collective share SMs; measured on 2 H200s (``examples/device/ce_probe.py``),
the CE all-reduce of 128 MiB takes 0.438 ms against NCCL's 0.518 ms, with no SMs held while data moves.

Opt-in route (``runtime_gpu.COMM = "ce"`` / ``$FLASHOVERLAP_COMM=ce``), all_reduce and reduce_scatter; all_to_all
keeps NCCL. Per call the GEMM writes into this rank's symmetric ``data`` region instead of a private buffer.

Buffer of one (device, group, dtype): ``[data | slot 0 | ... | slot W-2]``, each ``capacity`` elements. Slot ``s``
of rank ``me`` receives the partial sums of rank ``src`` (``s = src if src < me else src - 1``) at the same row
offsets as in ``data``.

Per group, rows ``[lo, hi)`` of ``data`` (all_reduce: split into W row chunks, chunk p owned by rank p;
reduce_scatter: W blocks, block p reduced on rank p), on the side stream after the group's GEMM wait:

1. push: for every peer p, chunk p of ``data`` -> p's slot for us (CE);
2. signal channel 0 to every peer, wait for every peer's (the pushes into our slots have landed);
3. reduce: all_reduce ``data[chunk me] += slots[chunk me]`` then ``out[chunk me] := data[chunk me]``;
   reduce_scatter ``out[group's rows] := data[block me] + slots[block me]``;
4. all_reduce only: signal / wait channel 1 (every owner has reduced its chunk), then pull every peer's reduced
   chunk from its ``data`` into ``out`` (CE).

After the last group, ``finish``: signal / wait channel 2 (no peer still reads our ``data`` or writes our slots), so
the next call's GEMM and pushes cannot overwrite what a peer is still using.

Limits: the signal kernels are torch's (``put_signal`` / ``wait_signal`` with a timeout); a timeout there traps the
CUDA context instead of raising ``kernels.FlashOverlapTimeout``. Growing the buffer is a rendezvous (collective):
every rank grows at the same call, because every decision depends on shapes all ranks share. Not under CUDA-graph
capture (the runtime falls back to NCCL there).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .runtime_cpu import GroupStep

log = logging.getLogger("flashoverlap")

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
CH_PUSHED, CH_REDUCED, CH_DONE = 0, 1, 2
# CTAs of the reduction kernel (Triton, persistent); 0 = torch's elementwise add (one CTA per few KiB: under a running
# GEMM its CTAs trickle onto SMs as tiles finish). Few CTAs get their SMs sooner.
ADD_CTAS: int = 0
# Diagnostics (examples/device/ce_timeline.py): when a list, every phase appends (label, CUDA event) recorded on the
# stream it ran on; "start" is recorded on the caller's stream before the GEMM.
TRACE: list[tuple[str, torch.cuda.Event]] | None = None


def mark(label: str) -> None:
    if TRACE is not None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        TRACE.append((label, e))


@dataclass
class Workspace:
    """The symmetric buffer of one (device, group, dtype) and its peers' views (elements, row-major)."""

    group_name: str
    rank: int
    world: int
    capacity: int  # elements per region
    buf: torch.Tensor
    hdl: object
    peer_bufs: dict[int, torch.Tensor] = field(default_factory=dict)

    def data(self, rows: int, n: int) -> torch.Tensor:
        return self.buf[:rows * n].view(rows, n)

    def slot(self, src: int, me: int) -> int:
        return src if src < me else src - 1

    def region(self, t: torch.Tensor, index: int, rows: int, n: int) -> torch.Tensor:
        """Region ``index`` (0 = data, 1 + s = slot s) of a buffer view ``t``, as [rows, n]."""
        start = index * self.capacity
        return t[start:start + rows * n].view(rows, n)


_workspaces: dict[tuple[int, str, torch.dtype], Workspace] = {}


def supported(collective: str, dtype: torch.dtype) -> bool:
    return collective in COLLECTIVES and dtype in (torch.bfloat16, torch.float16, torch.float32)


def workspace(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, elements: int) -> Workspace:
    """The cached workspace with room for ``elements`` per region (grown by a rendezvous on every rank)."""
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    key = (device.index, name, dtype)
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
    ws = _workspaces[key] = Workspace(name, rank, world, capacity, buf, hdl, peers)
    log.info("flashoverlap ce: symmetric workspace %d x %d %s elements on %s, group %s", world, capacity, dtype,
             device, name)
    return ws


def _signal_all(ws: Workspace, channel: int, timeout_ms: int) -> None:
    for p in ws.peer_bufs:
        ws.hdl.put_signal(p, channel, timeout_ms)
    for p in ws.peer_bufs:
        ws.hdl.wait_signal(p, channel, timeout_ms)


@functools.lru_cache(maxsize=1)
def _triton_add():
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(x_ptr, y_ptr, o1_ptr, o2_ptr, n, BLOCK: tl.constexpr, TWO: tl.constexpr):
        pid, progs = tl.program_id(0), tl.num_programs(0)
        for blk in range(pid, tl.cdiv(n, BLOCK), progs):
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            v = tl.load(x_ptr + offs, mask=mask).to(tl.float32) + tl.load(y_ptr + offs, mask=mask).to(tl.float32)
            v = v.to(o1_ptr.dtype.element_ty)
            tl.store(o1_ptr + offs, v, mask=mask)
            if TWO:
                tl.store(o2_ptr + offs, v, mask=mask)

    return add_kernel


def add_into(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, out2: torch.Tensor | None = None) -> None:
    """``out = x + y`` (fp32 sum rounded to the dtype; also into ``out2`` when given); contiguous equal shapes."""
    if ADD_CTAS <= 0:
        torch.add(x, y, out=out)
        if out2 is not None:
            out2.copy_(out)
        return
    _triton_add()[(ADD_CTAS,)](x, y, out, out2 if out2 is not None else out, out.numel(), BLOCK=4096,
                               TWO=out2 is not None, num_warps=8)


def _split(lo: int, hi: int, world: int) -> list[tuple[int, int]]:
    """Row chunks of ``[lo, hi)``, one per rank (the first ones one row larger when uneven)."""
    bounds = [lo + (hi - lo) * p // world for p in range(world + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def issue_all_to_all(ws: Workspace, step: GroupStep, peer_sends: dict[int, tuple[int, int]], rows: int, n: int,
                     out_flat: torch.Tensor, timeout_ms: int) -> None:
    """One all_to_all group (equal splits: every rank has ``rows``): push each peer's rows into its slot for us at
    our buffer rows, signal / wait, then copy every source's rows from our slot for it into the output (CE).
    ``peer_sends[j]``: the buffer rows ``[lo, hi)`` that rank j sends us in this group."""
    me = ws.rank
    data = ws.region(ws.buf, 0, rows, n)
    mark("released")
    for p, lo, hi in step.sends:
        if hi > lo:
            ws.region(ws.peer_bufs[p], 1 + ws.slot(me, p), rows, n)[lo:hi].copy_(data[lo:hi])
    if step.local is not None:
        b_lo, o_lo, count = step.local
        out_flat[o_lo:o_lo + count].copy_(data[b_lo:b_lo + count])
    mark("pushed")
    _signal_all(ws, CH_PUSHED, timeout_ms)
    mark("signalled")
    for j, o_lo, o_hi in step.recvs:
        lo, hi = peer_sends[j]
        if o_hi > o_lo:
            out_flat[o_lo:o_hi].copy_(ws.region(ws.buf, 1 + ws.slot(j, me), rows, n)[lo:hi])
    mark("pulled")


def issue_group(ws: Workspace, collective: str, step: GroupStep, rows: int, n: int, out_flat: torch.Tensor,
                timeout_ms: int) -> None:
    """Steps 1-4 of the module docstring for one group, on the current (side) stream."""
    if step.hi <= step.lo:
        return
    me = ws.rank
    data = ws.region(ws.buf, 0, rows, n)
    if collective == "all_reduce":
        parts = _split(step.lo, step.hi, ws.world)
    else:  # reduce_scatter: W equal blocks, block p -> rank p's output rows step.out
        c = step.out[1] - step.out[0]
        parts = [(step.lo + p * c, step.lo + (p + 1) * c) for p in range(ws.world)]
    mark("released")
    for p, pb in ws.peer_bufs.items():
        a, b = parts[p]
        if b > a:
            ws.region(pb, 1 + ws.slot(me, p), rows, n)[a:b].copy_(data[a:b])
    mark("pushed")
    _signal_all(ws, CH_PUSHED, timeout_ms)
    mark("signalled")
    a, b = parts[me]
    slots = [ws.region(ws.buf, 1 + s, rows, n)[a:b] for s in range(ws.world - 1)]
    if collective == "all_reduce":
        if b > a:
            own = data[a:b]
            for s in slots[:-1]:
                add_into(own, s, own)
            add_into(own, slots[-1], own, out_flat[a:b])
        mark("reduced")
        _signal_all(ws, CH_REDUCED, timeout_ms)
        mark("signalled2")
        for p, pb in ws.peer_bufs.items():
            pa, pz = parts[p]
            if pz > pa:
                out_flat[pa:pz].copy_(ws.region(pb, 0, rows, n)[pa:pz])
        mark("pulled")
    else:
        o = out_flat[step.out[0]:step.out[1]]
        if b > a:
            add_into(data[a:b], slots[0], o)
            for s in slots[1:]:
                add_into(o, s, o)


def finish(ws: Workspace, timeout_ms: int) -> None:
    """The end-of-call handshake (module docstring), on the current (side) stream."""
    _signal_all(ws, CH_DONE, timeout_ms)
    mark("finished")
