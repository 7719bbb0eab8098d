"""The fused MoE combine at run time (``flashoverlap::gemm_unpermute_all_to_all``, ``ops``): the unfused reference,
the CPU route and the op's dispatcher.

Semantics (the contract of every route; rows and split sizes count rows of ``[*, N]`` tensors)::

    y = cat([a[e] @ b[e] for e])                          # offs None: the per-expert loop
      | sum(_grouped_mm(a[t], b[t], offs) for t)          # offs given: grouped GEMM(s) sharing the expert offsets
    send = zeros([sum(input_split_sizes), N]); send.index_put_((index,), y, accumulate)   # the un-permutation
    return all_to_all_single(send, output_split_sizes, input_split_sizes, group)

Rows of ``y`` past the last offset (which ``_grouped_mm`` leaves undefined) and send rows that ``index`` does not
name (which the graph's ``empty`` leaves undefined) are 0 here.

Routes. **cpu** (gloo): the pipelined schedule of ``schedule/combine.py``: every receive is posted first; then per
send block, in ``block_order`` (the peers' blocks first, this rank's own last), the block's rows of every expert are
computed alone (row-slice GEMMs), written to their places in the block (``index_put_``) and the block is sent
(``isend``; the own block is a local copy) while the next block computes. **unfused**: ``reference`` (one GEMM, one
``index_put``, one ``all_to_all_single``); every other device, CUDA included (no fused GPU route yet: the design of
the NCCL and peer routes is in ``docs/design.md``), and the oracle of the tests.

Failure contract (CPU route; as ``routes/cpu.py``): every rank posts every receive and issues every block's send
whatever happens; a rank whose GEMM, index or transfer raises fills its blocks not yet sent with NaN, and every call
ends with the one-int failure exchange (``cpu._settle``): the failing rank re-raises, every other rank raises
``errors.PeerFailure``; no rank returns the output of a call in which a rank failed, and the next call needs no reset.
Errors that depend only on what every rank shares (operand ranks, dtypes, a bad plan) are raised by every rank
before any transfer. Ranks agree or fail together: before a group's first call of a kind (form, N, K, dtype,
settings, route) the ranks exchange digests (``agree.check``): a difference raises ``errors.RankMismatch`` on every
rank. Statistics: ``stats["combine:<route>"]`` per call, plus ``route:cpu`` or ``unfused`` and
``fallback:no_combine_route`` as the other ops count them.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from flashoverlap_inductor import config

from .. import _inductor_compat as compat
from ..schedule.combine import Block, block_order, group_ends, normalize_index, offsets, plan_blocks
from . import agree
from .base import stats
from .cpu import _poison, _settle, _wait_all

PLANS = ("blocks", "auto")  # "auto": the route's own schedule (on CPU: "blocks")
TAG = 3083  # the P2P tag of the combine's block transfers (no other transfer of the package uses it)
_locks: dict[int, threading.RLock] = {}
_locks_lock = threading.Lock()


class ExpertGemm:
    """The op's GEMM by rows. ``rows``: rows of ``y``; ``ends``: the experts' end rows (``schedule.combine``);
    ``n``: columns. ``segment(seg)`` computes the rows of one ``schedule.combine.Segment`` ([count, N]) with the same
    roundings as the graph (each GEMM rounded to the dtype, then the grouped terms summed); ``whole()`` all of ``y``."""

    def __init__(self, a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None) -> None:
        self.a, self.b, self.offs = a, b, offs
        self.n = int(b[0].shape[-1])
        if offs is None:
            self.rows = sum(int(x.shape[0]) for x in a)
            self.ends = group_ends([int(x.shape[0]) for x in a], self.rows, cumulative=False)
        else:
            self.rows = int(a[0].shape[0])
            self.ends = group_ends(offs, self.rows, cumulative=True)
        self.starts = [0, *self.ends[:-1]]

    def segment(self, seg) -> torch.Tensor:
        g = seg.group
        if self.offs is None:
            return torch.mm(_rows(self.a[g], seg, self.starts[g]), self.b[g])
        out = None
        for x, w in zip(self.a, self.b, strict=True):
            y = torch.mm(_rows(x, seg, 0), w[g])
            out = y if out is None else out.add_(y)
        return out

    def whole(self) -> torch.Tensor:
        if self.offs is None:
            return torch.cat([torch.mm(x, w) for x, w in zip(self.a, self.b, strict=True)])
        y = None
        for x, w in zip(self.a, self.b, strict=True):
            t = torch._grouped_mm(x, w, offs=self.offs)
            y = t if y is None else y + t
        y[self.ends[-1]:] = 0  # undefined in _grouped_mm: rows in no expert group
        return y


def _rows(x: torch.Tensor, seg, base: int) -> torch.Tensor:
    """The rows of ``x`` that ``seg`` names, ``base`` being the row of ``y`` where ``x`` starts (a view when they are
    contiguous)."""
    if seg.rows is None:
        return x[seg.first - base:seg.first - base + seg.count]
    return x.index_select(0, seg.rows - base)


def reference(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None, index: torch.Tensor,
              accumulate: bool, outs: list[int], ins: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The op unfused (module docstring): the CUDA route and the tests' oracle."""
    gemm = ExpertGemm(a, b, offs)
    y = gemm.whole()
    send = y.new_zeros(sum(ins), gemm.n)
    send.index_put_((index,), y, accumulate)
    out = y.new_empty(sum(outs), gemm.n)
    dist.all_to_all_single(out, send, list(outs), list(ins), group=group)
    return out


def _fill(buf: torch.Tensor, block: Block, gemm: ExpertGemm, values: torch.Tensor | None, accumulate: bool) -> None:
    """Write one send block ``buf`` (its rows of the send buffer): each expert's rows for it, then ``index_put_``."""
    for seg in block.segments:
        rows = gemm.segment(seg) if values is None else values.index_select(0, seg.row_ids())
        buf.index_put_((seg.dest,), rows, accumulate)


def run_cpu(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None, index: torch.Tensor,
            accumulate: bool, outs: list[int], ins: list[int], group: dist.ProcessGroup, plan: str) -> torch.Tensor:
    """The CPU route (module docstring). Transfers per call on every rank: one receive per peer with rows for it, one
    send per peer it has rows for, then the failure exchange."""
    world, rank = group.size(), group.rank()
    n, like = int(b[0].shape[-1]), a[0]
    send = like.new_zeros(sum(ins), n)
    out = like.new_empty(sum(outs), n)
    send_off, recv_off = offsets(ins), offsets(outs)
    works: list = []
    failure: BaseException | None = None
    try:
        for i in range(world):
            if i != rank and outs[i]:
                works.append(dist.irecv(out[recv_off[i]:recv_off[i + 1]], src=dist.get_global_rank(group, i),
                                        group=group, tag=TAG))
    except BaseException as exc:  # noqa: BLE001 - settled below, after every send was issued
        failure = exc
    gemm, values, blocks = None, None, None
    try:
        gemm = ExpertGemm(a, b, offs)
        idx = normalize_index(index, send.shape[0])
        if idx.shape[0] == gemm.rows:
            blocks = plan_blocks(idx, gemm.ends, ins)
        elif gemm.rows == 1:  # index_put broadcasts one value row to every index
            values = gemm.whole().expand(idx.shape[0], n)
            blocks = plan_blocks(idx, [idx.shape[0]], ins)
        else:
            raise ValueError(f"flashoverlap: index_put of {gemm.rows} GEMM rows at {idx.shape[0]} indices: shape "
                             "mismatch")
    except BaseException as exc:  # noqa: BLE001 - as above
        failure = failure or exc
    for j in block_order(world, rank):
        lo, hi = send_off[j], send_off[j + 1]
        if failure is None:
            try:
                _fill(send[lo:hi], blocks[j], gemm, values, accumulate)
            except BaseException as exc:  # noqa: BLE001 - as above
                failure = exc
        if failure is not None:
            _poison(send[lo:hi])  # not sent yet: what the peer receives is never mistaken for data
        try:
            if j == rank:
                out[recv_off[j]:recv_off[j + 1]].copy_(send[lo:hi])
            elif hi > lo:
                works.append(dist.isend(send[lo:hi], dst=dist.get_global_rank(group, j), group=group, tag=TAG))
        except BaseException as exc:  # noqa: BLE001 - as above
            failure = failure or exc
    failure = _wait_all(works, failure)
    _settle(failure, "all_to_all combine", [send.shape[0], n], send, group, plan)
    return out


def _lock(group: dist.ProcessGroup) -> threading.RLock:
    """One lock per process group: a group's combine calls run one at a time (their transfers share one tag)."""
    with _locks_lock:
        return _locks.setdefault(id(group), threading.RLock())


def _items(route: str, a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None, accumulate: bool,
           plan: str, group: dist.ProcessGroup, settings: config.Settings) -> dict[str, str]:
    """What decides the call's transfers, as ``agree.ITEMS`` (rows and split sizes are per rank by design)."""
    form = ("loop", len(a)) if offs is None else ("grouped", len(a), int(offs.shape[0]))
    call = ("combine", form, int(b[0].shape[-1]), [int(w.shape[-2]) for w in b], str(a[0].dtype), accumulate, plan,
            group.size(), a[0].device.type)
    return {"call": repr(call), "rows": "per rank", "settings": settings.replace(library=None, config_dir=None).key(),
            "routes": route, "library": "-", "data": agree.data_digest(settings.config_dir),
            "gpu": a[0].device.type}


def dispatch(a: list[torch.Tensor], b: list[torch.Tensor], offs: torch.Tensor | None, index: torch.Tensor,
             accumulate: bool, outs: list[int], ins: list[int], group: dist.ProcessGroup, plan: str,
             settings_key: str) -> torch.Tensor:
    """Run one call on its route (module docstring), under the settings it was compiled with."""
    if plan not in PLANS:
        raise ValueError(f"flashoverlap: unknown combine plan {plan!r} (expected one of {PLANS})")
    settings = config.from_key(settings_key)
    route = "cpu" if a[0].device.type == "cpu" else "unfused"
    capturing = a[0].is_cuda and compat.is_capturing()
    with config.using(settings), _lock(group):
        found = _items(route, a, b, offs, accumulate, plan, group, settings)
        if not capturing:
            agree.check_once(found, group, f"a fused MoE combine of {len(a)} x {list(a[0].shape)} rows @ "
                             f"{list(b[0].shape)} ({a[0].dtype})")
        if route == "cpu":
            out = run_cpu(a, b, offs, index, accumulate, outs, ins, group, plan)
            stats["route:cpu"] += 1
        else:
            out = reference(a, b, offs, index, accumulate, outs, ins, group)
            stats["unfused"] += 1
            stats["fallback:no_combine_route"] += 1
        stats[f"combine:{route}"] += 1
        return out
