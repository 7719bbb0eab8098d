"""The fused MoE combine at run time (``flashoverlap::gemm_unpermute_all_to_all``, ``ops``): the unfused reference,
the point-to-point (P2P) route, which runs on gloo (CPU tensors) and NCCL (CUDA tensors) alike, and the op's
dispatcher.

Semantics (the contract of every route; rows and split sizes count rows of ``[*, N]`` tensors)::

    y = cat([a[e] @ b[e] for e])                          # offs None: the per-expert loop
      | sum(_grouped_mm(a[t], b[t], offs) for t)          # offs given: grouped GEMM(s) sharing the expert offsets
    send = zeros([sum(input_split_sizes), N]); send.index_put_((index,), y, accumulate)   # the un-permutation
    return all_to_all_single(send, output_split_sizes, input_split_sizes, group)

Rows of ``y`` past the last offset (which ``_grouped_mm`` leaves undefined) and send rows that ``index`` does not
name (which the graph's ``empty`` leaves undefined) are 0 here.

Routes. **p2p** (``run_p2p``; geometry in ``schedule/combine.py``, shared pieces in ``routes/moe_p2p.py``): the send
buffer is cut into units (block j: the rows for rank j; ``plan`` ``"blocks:c=N"`` cuts each block into N chunks).
Per ring step ``s = 1 .. W - 1`` (destination ``(r + s) % W``, source ``(r - s) % W``) and chunk, the rank computes
the unit's rows alone (grouped form: the unit's rows of ``a`` gathered in expert order, one ``torch._grouped_mm``
per term over them in bf16, one ``mm`` per expert run and term in fp16 / fp32, whose ``_grouped_mm`` would sync the
host on CUDA, ``moe_p2p.grouped_kernel``; loop form: one ``mm`` per expert run into a unit buffer), writes them to
their un-permuted places (``index_put_``), then issues the step's send and receive in one ``batch_isend_irecv`` and
goes on to the next unit while that transfer runs (on CUDA: on NCCL's stream, which waits for this unit's GEMM only).
Its own block comes last, by a local copy. Host syncs per call: one copy of the per-(unit, expert) row counts (cut
on the device) and ``offs`` to the host, the failure exchange.
**unfused**: ``reference`` (one GEMM, one ``index_put``, one ``all_to_all_single``): the tests' oracle and every call
the P2P route does not take (``moe_p2p.unsupported``: CUDA without the experiment ``moe_p2p_cuda``, a CUDA-graph
capture, a dtype other than bf16/fp16/fp32, a non-NCCL group for CUDA tensors, ...), counted ``fallback:<reason>``
and logged once per reason.

Failure contract (as ``routes/cpu.py``): every rank issues every ring step whatever happens; a rank whose routing
data, GEMM or transfer raises fills its units not yet sent with NaN, and every call ends with the failure exchange
(``moe_p2p.settle``, on the send buffer's device: the group's NCCL device on CUDA): the failing rank re-raises,
every other rank raises ``errors.PeerFailure``; no rank returns the output of a call in which a rank failed, and the
next call needs no reset. Errors that depend only on what every rank shares (operand ranks, dtypes, a bad plan) are
raised by every rank before any transfer. Ranks agree or fail together: before a group's first call of a kind
(form, N, K, dtype, settings, route) the ranks exchange digests (``agree.check_once``). Statistics
(``moe_p2p.count_route`` / ``count_fallback``): ``combine:p2p`` and ``route:cpu`` (CPU) or ``route:moe_p2p`` and
``fused:all_to_all_combine`` (CUDA); ``combine:unfused``, ``unfused`` and ``fallback:<reason>``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedule.combine import chunk_sizes, cuts_by_expert, group_ends, offsets, parse_plan, plan_units, ring_steps
from . import moe_fast, moe_p2p, shadow
from .cpu import _poison, _wait_all

TAG = moe_p2p.COMBINE_TAG


class ExpertGemm:
    """The op's GEMM. ``rows``: rows of ``y``; ``ends``: the experts' end rows (``schedule.combine.group_ends``, from
    ``offs_host`` when given: no device read); ``starts``: their first rows; ``n``: columns. ``whole()`` computes all
    of ``y`` with the graph's roundings (each GEMM rounded to the dtype, then the grouped terms summed)."""

    def __init__(self, a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None,
                 offs_host: torch.Tensor | None = None) -> None:
        self.a, self.b, self.offs = a, b, offs
        self.n = int(b[0].shape[-1])
        if offs is None:
            self.rows = sum(int(x.shape[0]) for x in a)
            self.ends = group_ends([int(x.shape[0]) for x in a], self.rows, cumulative=False)
        else:
            self.rows = int(a[0].shape[0])
            self.ends = group_ends(offs if offs_host is None else offs_host, self.rows, cumulative=True)
        self.starts = [0, *self.ends[:-1]]

    def whole(self) -> torch.Tensor:
        if self.offs is None:
            return torch.cat([torch.mm(x, w) for x, w in zip(self.a, self.b, strict=True)])
        y = None
        for x, w in zip(self.a, self.b, strict=True):
            t = torch._grouped_mm(x, w, offs=self.offs)
            y = t if y is None else y + t
        y[self.ends[-1]:] = 0  # undefined in _grouped_mm: rows in no expert group
        return y


def reference(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None, index: torch.Tensor,
              accumulate: bool, outs: list[int], ins: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The op unfused (module docstring): the fallback and the tests' oracle."""
    gemm = ExpertGemm(a, b, offs)
    y = gemm.whole()
    send = y.new_zeros(sum(ins), gemm.n)
    send.index_put_((index,), y, accumulate)
    out = y.new_empty(sum(outs), gemm.n)
    dist.all_to_all_single(out, send, list(outs), list(ins), group=group)
    return out


class CombineUnits:
    """The P2P route's GEMM by send unit. Built once per call: the unit cut on the device (``plan_units``: one host
    copy of the small per-(unit, expert) table, ``offs`` and the index check; ``moe_p2p``'s pinned upload of the unit
    bounds); ``fill(u, send)`` writes unit u's rows of the send buffer ``send`` ([sum(input_split_sizes), N]) and
    nothing else. ``unit_sizes``: ``schedule.combine.chunk_sizes`` of the input split sizes. Raises ``IndexError`` /
    ``ValueError`` for routing data that does not fit (before any GEMM)."""

    def __init__(self, a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None, index: torch.Tensor,
                 accumulate: bool, unit_sizes: list[int], send_rows: int) -> None:
        dev, entries = a[0].device, int(index.shape[0])
        rows = sum(int(x.shape[0]) for x in a) if offs is None else int(a[0].shape[0])
        if entries != rows and rows != 1:
            raise ValueError(f"flashoverlap: index_put of {rows} GEMM rows at {entries} indices: shape mismatch")
        broadcast = entries != rows  # index_put broadcasting one GEMM row to every index entry
        host_ends = [entries] if broadcast else \
            group_ends([int(x.shape[0]) for x in a], rows, cumulative=False) if offs is None else None
        small = moe_p2p.upload([torch.tensor(offsets(unit_sizes)), torch.tensor(host_ends or [], dtype=torch.int64)],
                               dev)
        ends = small[1] if host_ends is not None else offs.to(torch.int64).clamp(max=rows)
        self.plan, offs_host = plan_units(index.to(dev), ends, small[0], send_rows, offs)
        self.gemm = ExpertGemm(a, b, offs, offs_host)  # checks the offsets (host copy)
        self.accumulate = accumulate
        self.values = self.gemm.whole() if broadcast else None
        grouped = offs is not None and not broadcast and moe_p2p.grouped_kernel(a[0].dtype)
        self.offs = self.plan.expert_offsets() if grouped else None  # else one mm per (expert run, term)
        self.experts = len(self.gemm.ends)

    def fill(self, u: int, send: torch.Tensor) -> None:
        lo = self.plan.starts[u]
        hi = lo + self.plan.grouped_rows(u)  # the unit's rows in no expert group (last) write nothing
        if hi == lo:
            return
        gemm = self.gemm
        if self.values is not None:
            y = self.values.expand(hi - lo, gemm.n)
        elif self.offs is not None:
            rows, y = self.plan.order[lo:hi], None
            for x, w in zip(gemm.a, gemm.b, strict=True):
                t = torch._grouped_mm(x.index_select(0, rows), w, offs=self.offs[u, :self.experts])
                y = t if y is None else y.add_(t)
        else:  # the loop form, or the grouped form without a _grouped_mm kernel (moe_p2p.grouped_kernel)
            y = send.new_empty(hi - lo, gemm.n)
            for g, pos, count, row0 in self.plan.segments(u):
                out = y[pos - lo:pos - lo + count]
                terms = [(gemm.a[g], gemm.b[g], gemm.starts[g])] if gemm.offs is None else \
                    [(x, w[g], 0) for x, w in zip(gemm.a, gemm.b, strict=True)]
                for i, (x, w, base) in enumerate(terms):
                    rows = x[row0 - base:row0 - base + count] if row0 is not None else \
                        x.index_select(0, self.plan.order[pos:pos + count] - base)
                    if i == 0:
                        torch.mm(rows, w, out=out)
                    else:  # the grouped terms summed as the graph rounds them
                        out.add_(torch.mm(rows, w))
        if self.accumulate:
            send.index_put_((self.plan.target[lo:hi],), y, True)
        else:  # the unit's targets are distinct rows of its own block
            moe_p2p.copy_rows(send, self.plan.target[lo:hi], y.contiguous())


def run_p2p(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None, index: torch.Tensor,
            accumulate: bool, outs: list[int], ins: list[int], group: dist.ProcessGroup, plan: str,
            deferred: bool = False) -> torch.Tensor:
    """The P2P route (module docstring). Transfers per call on every rank: per ring step and chunk one batch (a send
    and a receive, either left out when its rows are 0, on both sides alike), then the failure exchange (settled on
    the host, or without a host read when ``deferred``: ``moe_deferred``)."""
    world, rank = group.size(), group.rank()
    chunks = parse_plan(plan, "combine")
    if cuts_by_expert(plan):  # no expert cut here: whole blocks (the same on every rank, each sees the same plan)
        chunks = 1
    n, like = int(b[0].shape[-1]), a[0]
    what = f"a fused all_to_all combine of {list(a[0].shape)} rows (plan {plan!r})"
    redo = lambda: reference(a, b, offs, index, accumulate, outs, ins, group)  # noqa: E731
    entries = int(index.shape[0])
    if offs is not None and all(int(x.shape[0]) == entries for x in a) and \
            moe_fast.eligible(True, like.dtype, chunks, entries, sum(ins)):
        return moe_fast.run_combine(a, b, offs, index, outs, ins, group, what, redo, deferred)
    send_sizes, recv_sizes = chunk_sizes(ins, chunks), chunk_sizes(outs, chunks)
    send_off, recv_off = offsets(send_sizes), offsets(recv_sizes)
    send = like.new_zeros(send_off[-1], n)
    out = like.new_empty(recv_off[-1], n)
    peer = moe_p2p.moe_peer.begin(like, n * like.element_size(), ins, outs, group, deferred, False)
    works: list = []
    failure: BaseException | None = None
    units = None
    try:
        units = CombineUnits(a, b, offs, index, accumulate, send_sizes, send.shape[0])
    except BaseException as exc:  # noqa: BLE001 - settled below, after every ring step was issued
        failure = exc
    for dst, src in [*ring_steps(world, rank), (rank, rank)]:  # the own block last: a local copy
        for q in range(chunks):
            u, v = dst * chunks + q, src * chunks + q
            block, into = send[send_off[u]:send_off[u + 1]], out[recv_off[v]:recv_off[v + 1]]
            if failure is None:
                try:
                    units.fill(u, send)
                except BaseException as exc:  # noqa: BLE001 - as above
                    failure = exc
            if failure is not None:
                _poison(block)  # not sent yet: what the peer receives is never mistaken for data
            try:
                if dst == rank:
                    into.copy_(block)
                elif peer is None:
                    works += moe_p2p.exchange(block, into, dst, src, group, TAG + q)
            except BaseException as exc:  # noqa: BLE001 - as above
                failure = failure or exc
    if peer is not None:  # every whole block in one push call, after the units above (the fork)
        cut = [slice(send_off[j * chunks], send_off[(j + 1) * chunks]) for j in range(world)]
        into = [slice(recv_off[j * chunks], recv_off[(j + 1) * chunks]) for j in range(world)]
        works = [w for _, w in peer.send([send[c] for c in cut], [out[c] for c in into])]
    failure = _wait_all(works, failure)
    if moe_p2p.end_call(failure, None, [out], what, send.device, group, deferred, peer):  # a peer's premise failed
        del send, out
        return moe_p2p.redo("combine", redo)
    return out


def dispatch(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None, index: torch.Tensor,
             accumulate: bool, outs: list[int], ins: list[int], group: dist.ProcessGroup, plan: str,
             settings_key: str) -> torch.Tensor:
    """Run one call on its route (module docstring), under the settings it was compiled with."""
    form = ("loop", len(a)) if offs is None else ("grouped", len(a), int(offs.shape[0]))
    call = ("combine", form, int(b[0].shape[-1]), [int(w.shape[-2]) for w in b], str(a[0].dtype), accumulate, plan,
            group.size(), a[0].device.type)
    return moe_p2p.run_call(
        "combine", a[0], group, len(outs), plan, settings_key, call,
        f"a fused MoE combine of {len(a)} x {list(a[0].shape)} rows @ {list(b[0].shape)} ({a[0].dtype})",
        lambda deferred: run_p2p(a, b, offs, index, accumulate, outs, ins, group, plan, deferred),
        lambda: reference(a, b, offs, index, accumulate, outs, ins, group),
        lambda: shadow.Spec(lambda: f"input_split_sizes {ins}, output_split_sizes {outs}, plan {plan}", outs))
