"""The fused MoE dispatch at run time (``flashoverlap::all_to_all_permute_gemm``, ``ops``): the unfused reference, the
CPU route and the op's dispatcher.

Semantics (the contract of every route; rows and split sizes count rows of ``[*, K]`` tensors)::

    recv = all_to_all_single(x, output_split_sizes, input_split_sizes, group)     # [sum(output_split_sizes), K]
    p    = recv[index]                                    # the permutation by expert: [len(index), K]
    y[e] = p[s_e:s_e + sizes[e]] @ b[e]                   # offs None: the per-expert loop, s_e = sum(sizes[:e])
         | _grouped_mm(p, b[t], offs)                     # offs given: one grouped GEMM per b[t] ([E, K, N_t])
    return [p, *y]

Rows of a grouped ``y[t]`` past the last offset (which ``_grouped_mm`` leaves undefined) are 0 here; rows of ``p``
past ``sum(sizes)`` are in no loop piece.

Routes. **cpu** (gloo): every receive is posted and every send block of ``x`` issued first (``x`` needs no compute);
then, per source block in ``arrival order`` (this rank's own block first, by a local copy, then each peer's as its
receive completes), the block's rows of ``p`` are gathered (``recv[index]`` restricted to the rows that come from
that block; ``schedule.combine.plan_blocks`` cuts them per expert) and the experts' GEMMs run on those rows alone
(row-slice ``mm``s), so the GEMMs overlap the transfers still in flight. **unfused**: ``reference`` (one NCCL/gloo
all_to_all, one ``index``, the GEMMs); every other device, CUDA included (no fused GPU route yet), and the tests'
oracle.

Failure contract (CPU route; as ``routes/cpu.py`` and ``routes/combine.py``): every rank posts every receive and
issues every block's send whatever happens (a rank that failed before a send sends a NaN block instead of its rows);
a rank whose index, GEMM or transfer raises stops computing, and every call ends with the one-int failure exchange
(``cpu._settle``): the failing rank re-raises, every other rank raises ``errors.PeerFailure``; no rank returns the
output of a call in which a rank failed, and the next call needs no reset. Errors that depend only on what every
rank shares (operand ranks, dtypes, a bad plan) are raised by every rank before any transfer (``ops``). Ranks agree
or fail together: before a group's first call of a kind (form, K, N, dtype, settings, route) the ranks exchange
digests (``agree.check_once``). Statistics: ``stats["dispatch:<route>"]`` per call, plus ``route:cpu`` or
``unfused`` and ``fallback:no_dispatch_route``.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from flashoverlap_inductor import config

from .. import _inductor_compat as compat
from ..schedule.combine import Block, group_ends, normalize_index, offsets, plan_blocks
from . import agree
from .base import stats
from .cpu import _poison, _settle, _wait_all

PLANS = ("blocks", "auto")  # "auto": the route's own schedule (on CPU: "blocks")
TAG = 3084  # the P2P tag of the dispatch's block transfers (no other transfer of the package uses it)
_locks: dict[int, threading.RLock] = {}
_locks_lock = threading.Lock()


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


def arrival_order(world: int, rank: int) -> list[int]:
    """The source blocks in the order a rank expects them: its own (a local copy) first, then ``rank - 1, rank - 2,
    ...`` (mod ``world``), the ring order in which the peers' first sends reach it. A permutation of
    ``range(world)``; the CPU route takes a later block first when it has landed already."""
    return [(rank - s) % world for s in range(world)]


class FirstGemms:
    """The op's GEMMs on ``p`` by rows. ``sizes`` (loop) or ``offs`` (grouped) cut ``p``'s ``rows`` into experts
    (``ends``: ``schedule.combine.group_ends``); ``outputs()`` allocates ``y`` (grouped rows in no expert are 0);
    ``segment(p, seg, y)`` writes the rows of one ``schedule.combine.Segment`` of every term."""

    def __init__(self, rows: int, b: list[torch.Tensor], sizes: list[int] | None, offs: torch.Tensor | None) -> None:
        self.b, self.offs, self.rows = b, offs, rows
        if offs is None:
            if sum(sizes) > rows or any(s < 0 for s in sizes):
                raise ValueError(f"flashoverlap: the dispatch's expert pieces {sizes} do not fit its {rows} rows")
            self.ends = group_ends(sizes, rows, cumulative=False)
        else:
            self.ends = group_ends(offs, rows, cumulative=True)
        self.starts = [0, *self.ends[:-1]]

    def outputs(self, like: torch.Tensor) -> list[torch.Tensor]:
        if self.offs is None:
            return [like.new_empty(e - s, w.shape[-1]) for s, e, w in zip(self.starts, self.ends, self.b, strict=True)]
        return [like.new_zeros(self.rows, w.shape[-1]) for w in self.b]

    def segment(self, p: torch.Tensor, seg, y: list[torch.Tensor]) -> None:
        g, rows = seg.group, seg.row_ids()
        a = p[seg.first:seg.first + seg.count] if seg.rows is None else p.index_select(0, rows)
        if self.offs is None:
            _put(y[g], rows - self.starts[g], seg, torch.mm(a, self.b[g]), self.starts[g])
            return
        for out, w in zip(y, self.b, strict=True):
            _put(out, rows, seg, torch.mm(a, w[g]), 0)


def _put(out: torch.Tensor, rows: torch.Tensor, seg, values: torch.Tensor, base: int) -> None:
    """``out[rows] = values`` (a slice copy when the segment's rows are contiguous)."""
    if seg.rows is None:
        out[seg.first - base:seg.first - base + seg.count].copy_(values)
    else:
        out.index_copy_(0, rows, values)


def reference(x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], sizes: list[int] | None,
              offs: torch.Tensor | None, outs: list[int], ins: list[int], group: dist.ProcessGroup) -> list:
    """The op unfused (module docstring): the CUDA route and the tests' oracle."""
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


def _compute_block(block: Block, recv: torch.Tensor, lo: int, p: torch.Tensor, gemms: FirstGemms,
                   y: list[torch.Tensor]) -> None:
    """Gather block ``block``'s rows of ``p`` from its received rows ``recv[lo:...]`` and run their GEMMs."""
    for seg in block.segments:
        if seg.rows is None:
            p[seg.first:seg.first + seg.count] = recv[lo + seg.dest]
        else:
            p.index_copy_(0, seg.rows, recv[lo + seg.dest])
        if seg.group < len(gemms.ends):
            gemms.segment(p, seg, y)


def run_cpu(x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], sizes: list[int] | None,
            offs: torch.Tensor | None, outs: list[int], ins: list[int], group: dist.ProcessGroup,
            plan: str) -> list:
    """The CPU route (module docstring). Transfers per call on every rank: one receive per peer with rows for it, one
    send per peer it has rows for, then the failure exchange."""
    world, rank = group.size(), group.rank()
    k = int(x.shape[1])
    recv = x.new_empty(sum(outs), k)
    send_off, recv_off = offsets(ins), offsets(outs)
    works: dict[int, object] = {}
    sends: list = []
    failure: BaseException | None = None
    try:
        x = x.contiguous()
        for i in range(world):
            if i != rank and outs[i]:
                works[i] = dist.irecv(recv[recv_off[i]:recv_off[i + 1]], src=dist.get_global_rank(group, i),
                                      group=group, tag=TAG)
    except BaseException as exc:  # noqa: BLE001 - settled below, after every send was issued
        failure = exc
    for j in range(world):
        lo, hi = send_off[j], send_off[j + 1]
        if j == rank or hi == lo:
            continue
        try:
            if failure is None and x.shape[0] != send_off[-1]:
                failure = ValueError(f"flashoverlap: the dispatch's input_split_sizes {ins} do not sum to its "
                                     f"{x.shape[0]} rows")
            block = x[lo:hi]
            if failure is not None:
                block = x.new_empty(hi - lo, k)
                _poison(block)  # what the peer receives is never mistaken for data
            sends.append(dist.isend(block, dst=dist.get_global_rank(group, j), group=group, tag=TAG))
        except BaseException as exc:  # noqa: BLE001 - as above
            failure = failure or exc
    p, y, blocks, gemms = None, [], None, None
    try:
        if failure is not None:
            raise failure
        recv[recv_off[rank]:recv_off[rank + 1]].copy_(x[send_off[rank]:send_off[rank + 1]])
        idx = normalize_index(index, recv.shape[0])
        p = x.new_empty(idx.shape[0], k)
        gemms = FirstGemms(p.shape[0], b, sizes, offs)
        y = gemms.outputs(x)
        # the rows of p by source block: p[r] = recv[idx[r]] (plan_blocks' "destination rows" are source rows here);
        # rows past the last expert form one more group, so that p is complete
        ends = [*gemms.ends, p.shape[0]] if gemms.ends[-1] < p.shape[0] else gemms.ends
        blocks = plan_blocks(idx, ends, outs)
    except BaseException as exc:  # noqa: BLE001 - as above
        failure = failure or exc
    pending = arrival_order(world, rank)
    while pending:
        i = next((s for s in pending if s not in works or works[s].is_completed()), pending[0])
        pending.remove(i)
        try:
            if i in works:
                works.pop(i).wait()
            if failure is None:
                _compute_block(blocks[i], recv, recv_off[i], p, gemms, y)
        except BaseException as exc:  # noqa: BLE001 - as above: the other receives are still waited for
            failure = failure or exc
    failure = _wait_all([*works.values(), *sends], failure)
    _settle(failure, "all_to_all dispatch", [recv.shape[0], k], recv, group, plan)
    return [p, *y]


def _lock(group: dist.ProcessGroup) -> threading.RLock:
    """One lock per process group: a group's dispatch calls run one at a time (their transfers share one tag)."""
    with _locks_lock:
        return _locks.setdefault(id(group), threading.RLock())


def _items(route: str, x: torch.Tensor, b: list[torch.Tensor], sizes: list[int] | None, offs: torch.Tensor | None,
           plan: str, group: dist.ProcessGroup, settings: config.Settings) -> dict[str, str]:
    """What decides the call's transfers, as ``agree.ITEMS`` (rows, split sizes and expert sizes are per rank)."""
    form = ("loop", len(sizes)) if offs is None else ("grouped", len(b), int(offs.shape[0]))
    call = ("dispatch", form, int(x.shape[1]), [int(w.shape[-1]) for w in b], str(x.dtype), plan, group.size(),
            x.device.type)
    return {"call": repr(call), "rows": "per rank", "settings": settings.replace(library=None, config_dir=None).key(),
            "routes": route, "library": "-", "data": agree.data_digest(settings.config_dir), "gpu": x.device.type}


def dispatch(x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], sizes: list[int] | None,
             offs: torch.Tensor | None, outs: list[int], ins: list[int], group: dist.ProcessGroup, plan: str,
             settings_key: str) -> list:
    """Run one call on its route (module docstring), under the settings it was compiled with."""
    if plan not in PLANS:
        raise ValueError(f"flashoverlap: unknown dispatch plan {plan!r} (expected one of {PLANS})")
    settings = config.from_key(settings_key)
    route = "cpu" if x.device.type == "cpu" else "unfused"
    capturing = x.is_cuda and compat.is_capturing()
    with config.using(settings), _lock(group):
        found = _items(route, x, b, sizes, offs, plan, group, settings)
        if not capturing:
            agree.check_once(found, group, f"a fused MoE dispatch of {list(x.shape)} rows into {len(b)} GEMM(s) "
                             f"{list(b[0].shape)} ({x.dtype})")
        if route == "cpu":
            out = run_cpu(x, index, b, sizes, offs, outs, ins, group, plan)
            stats["route:cpu"] += 1
        else:
            out = reference(x, index, b, sizes, offs, outs, ins, group)
            stats["unfused"] += 1
            stats["fallback:no_dispatch_route"] += 1
        stats[f"dispatch:{route}"] += 1
        return out
