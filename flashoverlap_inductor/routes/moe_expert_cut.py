"""The MoE dispatch cut by expert (plan ``"experts"`` / ``"experts:c=N"``: N pieces, 2 by default), on the P2P route.

Why: the whole-block path (``moe_fast``) runs the experts' grouped GEMM once per source block (its own rows at once,
each peer's as they land), so every expert's weight is read once per block and every expert's rows fill a last,
partial tile per block. Measured on one H200 (``examples/device/moe_gemm_probe.py``; docs/results.md, forty-fourth
session), at Qwen3-MoE shapes on 2 ranks that costs 15-76% more GEMM time than one grouped GEMM (1024-8192 tokens
per rank), and the fused dispatch then moves the GEMM's results into expert order too. Cut by expert, each piece is
one grouped GEMM over a range of experts with all of their rows (every source's), so each weight is read once:
the library's grouped GEMM (``native.grouped``) over 2 expert pieces ran 0.91-1.12x of torch's one uncut call there.

Schedule, every rank (W ranks, N pieces):

1. every peer's block requested in N chunks (``moe_p2p.issue_dispatch``: the transfers of plan ``"blocks:c=N"``, so
   a rank that cannot take this path runs the general path with the same transfers and settle, and they pair up);
2. the plan (``moe_fast.BlockPlan``: each buffer row's expert row ``inv``, each block's expert offsets, the settle's
   routing facts; no host read), the own block's rows moved into expert order at once (``p[inv[r]] = x[r]``);
3. the pieces' expert bounds on the device (``BlockPlan.pieces``: the plan's library call writes them, else
   ``moe_fast.pieces_with_torch``): piece q covers experts ``[e_q, e_{q+1})``, where ``e_{q+1}`` is the fewest experts
   whose rows lie, in every block, within that block's first q + 1 chunks (the own block: all of them), and
   ``e_N = E``;
4. per piece q: every peer's chunk q waited for (on CUDA the stream waits, not the host) and moved into ``p``, then
   each GEMM term's grouped GEMM of ``p``'s rows of the piece's experts into the same rows of ``y_t`` (expert order:
   no move of the results). The first piece waits for the first chunks' transfer; the later transfers run beside
   the earlier pieces' GEMMs.

On CUDA steps 2-4 are one library call where ``moe_cut_lib.should_run`` allows (``fo_moe_dispatch_cut``: the same
kernels in the same order, the landing events waited for by the stream; on one H200 0.21-0.26 ms less host time
per call at Qwen3-MoE 2048-4096 tokens, forty-fifth session), else the Python steps.

The outputs are the op's (``p = recv[index]``, ``y_t = grouped_mm(p, b_t, offs)``), the premise and its settle the
whole-block path's (``moe_fast``: where any rank's premise fails every rank redoes the call unfused). On the CPU the
GEMMs are ``native.grouped.reference`` (each row as the unfused graph's ``torch._grouped_mm`` rounds it: bit for bit
with the reference, which the gloo tests check). Taken (``eligible``) where the whole-block path would be, with
every term's weights in a layout the library reads (``grouped.b_layout_of``) and, on CUDA, the library loading.
Never run on two GPUs yet (forty-fourth and forty-fifth sessions: one GPU lent); on one H200 through the op at one
rank (results equal to the unfused op's), the grouped GEMM's device-side piece bounds and both weight layouts
(``tests/test_grouped_gemm.py``) and the one call's waits for late chunks (``tests/test_moe_cut_lib.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..native import grouped
from ..schedule.combine import ring_steps
from . import moe_cut_lib, moe_fast, moe_p2p, moe_plan_lib
from .base import stats
from .cpu import _wait_all


def takes(x: torch.Tensor, b: list[torch.Tensor], offs: torch.Tensor) -> bool:
    """Whether the cut can take calls of these operands at all: bf16 rows of a multiple of 8 columns, every term's
    weights a layout of the library's (the forward's Linear weights, the backward's down projection as stored) on
    16 bytes, contiguous offsets, on the CPU or a CUDA device. It reads only the graph's operands' dtypes, shapes and
    layouts, the same on every rank by construction; where it fails every rank runs the plan as ``"blocks"`` (whole
    blocks, one chunk each). Per-rank conditions (the library loading, the whole-block premise) are ``eligible``'s: a
    rank outside them runs the general path on the same chunked transfers."""
    return (moe_p2p.grouped_kernel(x.dtype) and x.shape[1] % 8 == 0 and offs.is_contiguous()
            and x.device.type in ("cpu", "cuda")
            and all(grouped.op_weight_fits(w) and w.data_ptr() % 16 == 0 for w in b))


def eligible(x: torch.Tensor, index_rows: int, buffer_rows: int) -> bool:
    """Whether this rank runs a call that ``takes`` allows (asked first, once) on this path (module docstring): the
    library loading on the current CUDA device (or the CPU) and the whole-block premise's host part, per rank like
    ``moe_fast.eligible``."""
    if not moe_fast.eligible(True, x.dtype, 1, index_rows, buffer_rows):
        return False
    if x.device.type == "cpu":
        return True
    return x.device.index == torch.cuda.current_device() and moe_plan_lib.library_on(x.device.index)


def run_dispatch(x: torch.Tensor, index: torch.Tensor, b: list[torch.Tensor], offs: torch.Tensor, outs: list[int],
                 ins: list[int], group: dist.ProcessGroup, pieces: int, what: str, reference,
                 deferred: bool = False) -> list[torch.Tensor]:
    """The dispatch cut by expert into ``pieces`` (module docstring); returns ``[p, y_1, ...]``."""
    world, rank = group.size(), group.rank()
    moves_lib = moe_plan_lib.usable(x)
    sent = moe_p2p.issue_dispatch(x, outs, ins, pieces, group, deferred)  # unit j * pieces + q: chunk q of block j
    x, recv, send_off, recv_off, failure = sent.x, sent.recv, sent.send_off, sent.recv_off, sent.failure
    weights = [w.transpose(-2, -1) for w in b]  # each expert's Linear weight [N, K]
    plan, result, bounds, facts = None, None, None, None

    def move(u: int, rows: torch.Tensor) -> None:
        """Unit u's buffer rows ``rows`` into ``p`` (expert order)."""
        if not rows.shape[0]:
            return
        inv = plan.inv[recv_off[u]:recv_off[u + 1]]
        if not (moves_lib and moe_plan_lib.should_move(inv, [(result[0], rows)])
                and moe_plan_lib.move_rows(inv, [(result[0], rows)])):
            moe_p2p.copy_rows(result[0], inv, rows)

    try:
        if failure is None:
            if ins[rank] != outs[rank]:
                raise ValueError(f"flashoverlap: the dispatch sends {ins[rank]} rows to its own rank and receives "
                                 f"{outs[rank]} from it (input_split_sizes {list(ins)}, output {list(outs)})")
            cuts = [[outs[j] if j == rank else recv_off[j * pieces + q + 1] - recv_off[j * pieces]
                     for q in range(pieces)] for j in range(world)]
            rows = recv_off[-1]
            result = [x.new_empty(rows, x.shape[1]), *(x.new_empty(rows, int(w.shape[1])) for w in weights)]
            if moves_lib and rows and moe_cut_lib.should_run(x, index, offs, world, pieces, len(weights),
                                                             sent.landing):
                facts = moe_cut_lib.run(x, recv, index, offs, list(outs), cuts, list(zip(weights, result[1:],
                                                                                         strict=True)),
                                        result[0], send_off, recv_off, sent.landing,
                                        [src for _dst, src in ring_steps(world, rank)], rank, pieces)
            if facts is None:  # the Python steps (module docstring)
                plan = moe_fast.BlockPlan(index.to(x.device), offs, list(outs), cuts)  # its pieces: step 3
                facts = plan.facts
                for q in range(pieces):  # the own block: its rows as they lie in x
                    u = rank * pieces + q
                    move(u, x[send_off[u]:send_off[u + 1]])
                bounds = plan.pieces
    except BaseException as exc:  # noqa: BLE001 - the transfers are still waited for
        failure = failure or exc
    landing = dict(sent.landing)
    for q in range(pieces):
        for _dst, src in ring_steps(world, rank):
            u = src * pieces + q
            failure = _wait_all(landing.get(u, []), failure)  # after the library call: its stream waited already
            if failure is None and plan is not None:
                try:
                    move(u, recv[recv_off[u]:recv_off[u + 1]])
                except BaseException as exc:  # noqa: BLE001 - as above
                    failure = exc
        if failure is None and plan is not None and result[0].shape[0]:
            try:
                for t, w in enumerate(weights):
                    grouped.grouped_mm(result[0], w, offs, out=result[1 + t], within=bounds[q:q + 2])
            except BaseException as exc:  # noqa: BLE001 - as above
                failure = exc
    if moe_p2p.end_call(failure, facts, result or [], what, x.device, group, deferred, sent.peer):
        del recv, result, plan, sent  # the redo's memory
        return moe_p2p.redo("dispatch", reference)
    stats["dispatch:experts"] += 1
    del sent
    return result
