"""The fused MoE dispatch at run time (``flashoverlap::all_to_all_permute_gemm``, ``ops``): the unfused reference, the
point-to-point (P2P) route, which runs on gloo (CPU tensors) and NCCL (CUDA tensors) alike, and the op's dispatcher.

Semantics (the contract of every route; rows and split sizes count rows of ``[*, K]`` tensors)::

    recv = all_to_all_single(x, output_split_sizes, input_split_sizes, group)     # [sum(output_split_sizes), K]
    p    = recv[index]                                    # the permutation by expert: [len(index), K]
    y[e] = p[s_e:s_e + sizes[e]] @ b[e]                   # offs None: the per-expert loop, s_e = sum(sizes[:e])
         | _grouped_mm(p, b[t], offs)                     # offs given: one grouped GEMM per b[t] ([E, K, N_t])
    return [p, *y]

Rows of a grouped ``y[t]`` past the last offset (which ``_grouped_mm`` leaves undefined) are 0 here; rows of ``p``
past ``sum(sizes)`` are in no loop piece.

Routes. **p2p** (``run_p2p``; geometry in ``schedule/combine.py``, shared pieces in ``routes/moe_p2p.py``): the
receive buffer is cut into units (block i: the rows from rank i; ``plan`` ``"blocks:c=N"`` cuts each block into N
chunks; ``"experts:c=N"`` too, and cuts the experts into N pieces where ``routes/moe_expert_cut.py`` takes the
call). ``x`` needs no compute, so the rank first issues every ring step's batch (step ``s = 1 .. W - 1``: send block
``(r + s) % W`` of ``x``, receive block ``(r - s) % W``, one ``batch_isend_irecv`` per chunk, the same order on every
rank); then copies its own block locally and runs its GEMMs; then per step waits for that step's transfers only and
runs the GEMMs of the unit that landed: its rows of ``p`` gathered from the receive buffer (``index`` restricted to
the unit), one ``torch._grouped_mm`` per term over them (grouped form in bf16; in fp16 / fp32 one ``mm`` per expert
run and term, ``moe_p2p.grouped_kernel``) or one ``mm`` per expert run (loop form),
scattered into ``p`` and ``y``. All batches go out before any GEMM is enqueued: on CUDA NCCL's stream waits for the
caller's stream at each issue, so a batch issued after a GEMM would wait for it. Host syncs per call: one copy of
the per-(unit, expert) row counts (cut on the device) and ``offs`` to the host (after the transfers were issued), the
failure exchange. **unfused**: ``reference``
(one all_to_all, one ``index``, the GEMMs): the tests' oracle and every call the P2P route does not take
(``moe_p2p.unsupported``), counted ``fallback:<reason>`` and logged once per reason.

Failure contract (as ``routes/cpu.py`` and ``routes/combine.py``): every rank issues every ring step whatever happens
(a rank that failed before a send sends a NaN block instead of its rows); a rank whose routing data, GEMM or
transfer raises stops computing but waits for every transfer, and every call ends with the failure exchange
(``moe_p2p.settle``): the failing rank re-raises, every other rank raises ``errors.PeerFailure``; no rank returns the
output of a call in which a rank failed, and the next call needs no reset. Errors that depend only on what every
rank shares (operand ranks, dtypes, a bad plan) are raised by every rank before any transfer (``ops``). Ranks agree
or fail together: before a group's first call of a kind (form, K, N, dtype, settings, route) the ranks exchange
digests (``agree.check_once``). Statistics (``moe_p2p``): ``dispatch:p2p`` and ``route:cpu`` (CPU) or
``route:moe_p2p`` and ``fused:all_to_all_dispatch`` (CUDA); ``dispatch:unfused``, ``unfused`` and
``fallback:<reason>``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedule.combine import chunk_sizes, cuts_by_expert, group_ends, offsets, parse_plan, plan_units
from . import moe_expert_cut, moe_fast, moe_p2p, shadow
from .cpu import _wait_all


def check_operands(x: torch.Tensor, index: torch.Tensor, b: list, sizes: list | None,
                   offs: torch.Tensor | None) -> list[list]:
    """Validate an ``all_to_all_permute_gemm`` call's operands (ranks, dtypes, devices, K; row counts are per rank
    and checked by the route); returns the output shapes ``[p, *y]``. Raises ``ValueError`` with the reason."""
    if x.dim() != 2 or not b:
        raise ValueError(f"flashoverlap: the dispatch needs rows x [R, K] and one or more b, got x{list(x.shape)} "
                         f"and {len(b)} b")
    if any(t.dtype != x.dtype or t.device != x.device for t in b):
        raise ValueError("flashoverlap: the dispatch's x and b must share one dtype and one device")
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"flashoverlap: the dispatch's index must be a 1-D int64/int32 tensor, got "
                         f"{index.dtype}{list(index.shape)}")
    loop = offs is None
    if loop != (sizes is not None) or (loop and len(sizes) != len(b)):
        raise ValueError("flashoverlap: the dispatch needs one expert size per b (loop) or offs without sizes "
                         f"(grouped), got {None if sizes is None else len(sizes)} sizes for {len(b)} b")
    if any(w.dim() != (2 if loop else 3) for w in b):
        raise ValueError(f"flashoverlap: the dispatch needs b of {2 if loop else 3} dims, got "
                         f"{[list(w.shape) for w in b]}")
    if not loop and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise ValueError(f"flashoverlap: the dispatch's offs must be a 1-D int32 tensor, got {offs.dtype}"
                         f"{list(offs.shape)}")
    rows = index.shape[0]
    for w in b:
        torch._check(w.shape[-2] == x.shape[1], lambda w=w: f"flashoverlap: dispatch inner sizes differ "
                     f"{list(x.shape)} @ {list(w.shape)}")
        if not loop:
            torch._check(w.shape[0] == offs.shape[0], lambda: "flashoverlap: one offset per expert of b")
    ys = [[s, w.shape[-1]] for s, w in zip(sizes, b, strict=True)] if loop else [[rows, w.shape[-1]] for w in b]
    return [[rows, x.shape[1]], *ys]


class FirstGemms:
    """The op's GEMMs' geometry on ``p``'s ``rows``: ``sizes`` (loop) or ``offs`` (grouped; ``offs_host``, when given,
    is read instead: no device read) cut them into experts (``ends``: ``schedule.combine.group_ends``; ``starts``:
    their first rows); ``outputs()`` allocates ``y`` (grouped rows in no expert are 0)."""

    def __init__(self, rows: int, b: list[torch.Tensor], sizes: list[int] | None, offs: torch.Tensor | None,
                 offs_host: torch.Tensor | None = None) -> None:
        self.b, self.offs, self.rows = b, offs, rows
        if offs is None:
            if sum(sizes) > rows or any(s < 0 for s in sizes):
                raise ValueError(f"flashoverlap: the dispatch's expert pieces {sizes} do not fit its {rows} rows")
            self.ends = group_ends(sizes, rows, cumulative=False)
        else:
            self.ends = group_ends(offs if offs_host is None else offs_host, rows, cumulative=True)
        self.starts = [0, *self.ends[:-1]]

    def outputs(self, like: torch.Tensor) -> list[torch.Tensor]:
        if self.offs is None:
            return [like.new_empty(e - s, w.shape[-1]) for s, e, w in zip(self.starts, self.ends, self.b, strict=True)]
        return [like.new_zeros(self.rows, w.shape[-1]) for w in self.b]


def reference(x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], sizes: list[int] | None,
              offs: torch.Tensor | None, outs: list[int], ins: list[int], group: dist.ProcessGroup) -> list:
    """The op unfused (module docstring): the fallback and the tests' oracle."""
    recv = x.new_empty(sum(outs), x.shape[1])
    dist.all_to_all_single(recv, x.contiguous(), list(outs), list(ins), group=group)
    p = recv[index]
    gemms = FirstGemms(p.shape[0], b, sizes, offs)
    if offs is None:
        y = [p[s:e] @ w for s, e, w in zip(gemms.starts, gemms.ends, b, strict=True)]
    else:
        y = [torch._grouped_mm(p, w, offs=offs) for w in b]
        for t in y:
            t[gemms.ends[-1]:] = 0  # undefined in _grouped_mm: rows in no expert group
    return [p, *y]


class DispatchUnits:
    """The P2P route's permutation and GEMMs by receive unit. Built once per call: the unit cut on the device
    (``plan_units``: one host copy of the small per-(unit, expert) table, ``offs`` and the index check; ``moe_p2p``'s
    pinned upload of the unit bounds); allocates ``p`` and ``y``; ``compute(v, recv)`` gathers unit v's rows of ``p``
    from the receive buffer ``recv`` (its rows must have landed) and writes them and their GEMM rows of every ``y``,
    nothing else. ``unit_sizes``: ``chunk_sizes`` of the output split sizes. Raises ``IndexError`` / ``ValueError``
    for routing data that does not fit (before any GEMM)."""

    def __init__(self, x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], sizes: list[int] | None,
                 offs: torch.Tensor | None, unit_sizes: list[int], recv_rows: int) -> None:
        rows = int(index.shape[0])
        host_ends = None if offs is None else []
        if offs is None:
            host_ends = FirstGemms(rows, b, sizes, None).ends  # checks the pieces
        small = moe_p2p.upload([torch.tensor(offsets(unit_sizes)), torch.tensor(host_ends, dtype=torch.int64)],
                               x.device)
        ends = small[1] if offs is None else offs.to(torch.int64).clamp(max=rows)
        # every row of p is planned: the rows past the last expert are the last group (their rows of p, no GEMM)
        self.plan, offs_host = plan_units(index.to(x.device), ends, small[0], recv_rows, offs)
        self.gemms = FirstGemms(rows, b, sizes, offs, offs_host)  # checks the offsets (host copy)
        self.p = x.new_empty(rows, x.shape[1])
        self.y = self.gemms.outputs(x)
        self.experts = len(self.gemms.ends)
        grouped = offs is not None and moe_p2p.grouped_kernel(x.dtype)
        self.offs = self.plan.expert_offsets() if grouped else None  # else one mm per (expert run, term)

    def compute(self, v: int, recv: torch.Tensor) -> None:
        lo, hi = self.plan.starts[v], self.plan.starts[v + 1]
        if hi == lo:
            return
        rows = self.plan.order[lo:hi]
        a = recv.index_select(0, self.plan.target[lo:hi])  # unit v's rows of p, in p's (expert) order
        moe_p2p.copy_rows(self.p, rows, a)
        if self.offs is not None:
            grouped = self.plan.grouped_rows(v)  # its rows in an expert: the first ones
            if grouped:
                for out, w in zip(self.y, self.gemms.b, strict=True):
                    moe_p2p.copy_rows(out, rows[:grouped], torch._grouped_mm(a[:grouped], w,
                                                                             offs=self.offs[v, :self.experts]))
            return
        # the loop form, or the grouped form without a _grouped_mm kernel (moe_p2p.grouped_kernel)
        for g, pos, count, row0 in self.plan.segments(v):
            piece = a[pos - lo:pos - lo + count]
            targets = [(self.y[g], self.gemms.b[g], self.gemms.starts[g])] if self.gemms.offs is None else \
                [(out, w[g], 0) for out, w in zip(self.y, self.gemms.b, strict=True)]
            for out, w, base in targets:
                if row0 is not None:
                    torch.mm(piece, w, out=out[row0 - base:row0 - base + count])
                else:
                    moe_p2p.copy_rows(out, self.plan.order[pos:pos + count] - base, torch.mm(piece, w))


def run_p2p(x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], sizes: list[int] | None,
            offs: torch.Tensor | None, outs: list[int], ins: list[int], group: dist.ProcessGroup,
            plan: str, deferred: bool = False, keep_rows: bool = True) -> list:
    """The P2P route (module docstring). Transfers per call on every rank: per ring step and chunk one batch (a send
    and a receive, either left out when its rows are 0, on both sides alike), then the failure exchange (settled on
    the host, or without a host read when ``deferred``: ``moe_deferred``). ``keep_rows`` False: the whole-block path
    never writes ``p`` (the caller drops it; the other paths compute it, as their GEMMs read it)."""
    rank = group.rank()
    chunks = parse_plan(plan, "dispatch")
    what = f"a fused all_to_all dispatch of {list(x.shape)} rows (plan {plan!r})"
    redo = lambda: reference(x, index, b, sizes, offs, outs, ins, group)  # noqa: E731
    if offs is not None and cuts_by_expert(plan):
        if not moe_expert_cut.takes(x, b, offs):
            chunks = 1  # the same on every rank: the plan runs as "blocks"
        elif moe_expert_cut.eligible(x, int(index.shape[0]), sum(outs)):
            return moe_expert_cut.run_dispatch(x, index, b, offs, outs, ins, group, chunks, what, redo, deferred)
    if offs is not None and moe_fast.eligible(True, x.dtype, chunks, int(index.shape[0]), sum(outs)):
        return moe_fast.run_dispatch(x, index, b, offs, outs, ins, group, what, redo, deferred, keep_rows)
    sent = moe_p2p.issue_dispatch(x, outs, ins, chunks, group, deferred)
    x, recv, send_off, recv_off, failure = sent.x, sent.recv, sent.send_off, sent.recv_off, sent.failure
    recv_sizes = chunk_sizes(outs, chunks)
    units = None
    try:
        if failure is None:
            own = slice(recv_off[rank * chunks], recv_off[(rank + 1) * chunks])
            recv[own].copy_(x[send_off[rank * chunks]:send_off[(rank + 1) * chunks]])
            units = DispatchUnits(x, index, b, sizes, offs, recv_sizes, recv.shape[0])
            for q in range(chunks):
                units.compute(rank * chunks + q, recv)
    except BaseException as exc:  # noqa: BLE001 - as above: the transfers are still waited for
        failure = failure or exc
    for v, works in sent.landing:
        failure = _wait_all(works, failure)  # this unit's transfers only (on CUDA: the stream waits, not the host)
        if failure is None:
            try:
                units.compute(v, recv)
            except BaseException as exc:  # noqa: BLE001 - as above
                failure = exc
    outputs = [] if units is None else [units.p, *units.y]
    if moe_p2p.end_call(failure, None, outputs, what, recv.device, group, deferred, sent.peer):  # redo
        del sent, recv, units, outputs
        return moe_p2p.redo("dispatch", redo)
    del sent
    return [units.p, *units.y]


def dispatch(x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], sizes: list[int] | None,
             offs: torch.Tensor | None, outs: list[int], ins: list[int], group: dist.ProcessGroup, plan: str,
             settings_key: str, keep_rows: bool = True) -> list:
    """Run one call on its route (module docstring), under the settings it was compiled with; ``keep_rows`` False
    (the plan suffix ``NO_ROWS``, taken off by ``ops``): ``p`` is returned as ``[0, K]`` whatever the route."""
    form = ("loop", len(sizes)) if offs is None else ("grouped", len(b), int(offs.shape[0]))
    call = ("dispatch", form, int(x.shape[1]), [int(w.shape[-1]) for w in b], str(x.dtype), plan, keep_rows,
            group.size(), x.device.type)
    out = moe_p2p.run_call(
        "dispatch", x, group, len(outs), plan, settings_key, call,
        f"a fused MoE dispatch of {list(x.shape)} rows into {len(b)} GEMM(s) {list(b[0].shape)} ({x.dtype})",
        lambda deferred: run_p2p(x, index, b, sizes, offs, outs, ins, group, plan, deferred, keep_rows),
        lambda: reference(x, index, b, sizes, offs, outs, ins, group),
        lambda: shadow.Spec(lambda: f"input_split_sizes {ins}, output_split_sizes {outs}, plan {plan}",
                            skip=() if keep_rows else (0,)))
    if not keep_rows and out[0].shape[0]:
        out = [x.new_empty(0, x.shape[1]), *out[1:]]
    return out
