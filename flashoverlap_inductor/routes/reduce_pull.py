"""The copy-engine pull route of GEMM -> all_reduce on 2 ranks of one NVLink host: the GEMMs stay cuBLAS's.

Which calls it takes (``config.Tuning.all_reduce_route``): under ``"peer"`` (the default) none; under ``"pull"`` every
2-rank bf16 all_reduce; under ``"auto"`` those whose predicted cost, GPU time plus host floor where the floors count,
is within ``cost_model.pull.TOLERANCE`` of the peer route's (``prefers``, as ``scatter_route`` for the reduce_scatter
pull route); the rows cut into ``all_reduce_pieces`` pieces (default 4) that shrink towards the last
(``cost_model.pull.piece_cuts``: the last push, the call's tail, short; each push within the next piece's GEMM).
Measured on 2 H200s (43rd session, docs/results.md): ahead of the peer route in its own bench (1.163x over sequential
against 1.136x), level on the op grid, behind under CUDA graphs and in TP training (its ~0.36 ms of host per call);
so not the default.
The peer route (``routes/peer.py``) sums in GEMM 2's epilogue, whose CUTLASS GEMMs ran 6-20% below cuBLAS's rate on
the 2-H200 grid (docs/results.md, 42nd session: 4096 x 8192 x 14336 fused 1.474 ms against cuBLAS's 1.249 and 0.275
of all_reduce); this route keeps cuBLAS's rate and moves the partials by copy engine, which takes no SM.

Per call (rank ``r``, peer ``p = 1 - r``; ``M`` rows cut into ``P`` pieces alike on both ranks), one library call,
``fo_scatter_run`` with ``all_reduce = 1`` (``csrc/scatter_run.cu``; its steps in ``csrc/flashoverlap_sm90.h``):

- on the caller's stream, per piece ``i``: ``out[i] = a[i] @ w`` (cuBLASLt: this rank's partial of those rows);
- on the gather protocol's copy stream after it: ``out[i]`` into the same rows of the call's slot set in the peer's
  receive buffer, then a 4-byte copy-engine write telling the peer (no SM, so no GEMM delays it);
- on the caller's stream once piece ``i + 1`` is issued: a bounded wait for the peer's piece ``i`` and for this
  rank's push of it, then ``out[i] += received[i]`` (one add kernel: fp32 sums rounded once, so both ranks hold the
  same bits; the reference all_reduce sums rank 0's then rank 1's partial: results agree to bf16 rounding);
- the protocol's finish: join, done to the peer, ``out`` poisoned while the group's fault block holds a fault.

Traffic per rank: ``M x N`` elements each way over NVLink (as NCCL's 2-rank all_reduce), and the adds' ``3 x M x
N`` elements of HBM. The tail after the last GEMM: the last piece's push (``M x N x 2 / P`` bytes) and its add.

Invariants: the protocol's (``routes/gather_peer.py``): every wait bounded, a fault recorded in both ranks' blocks and
raised at the next call on every rank, the slot sets alternating per push call of the group
(``gather_peer.next_slot_set``, shared with the gather and reduce_scatter pull routes). ``a`` stays referenced until
after the join. Every rank takes the same route: ``unsupported`` and ``make_launch`` read the shapes, strides,
settings and cost data only; ``execute`` declines (to the next candidate route) where the receive buffer would have
to grow inside a CUDA-graph capture (the call history's, the same on every rank) and where torch's matmul settings
forbid the library's cuBLAS GEMMs (``gather_gemms.usable``): process-wide settings that the ranks of one job share,
as the reduce_scatter pull route assumes (a rank that differed would time out its waits: a fault on both ranks,
never a wrong result).

Declines (pure): another collective, ``transport="nccl"``, a world size other than 2, odd rows, another dtype than
bf16, fewer rows than pieces, no kernel library or sm90 GPU. ``make_launch`` also declines a batched ``b``, a bias, a
weight neither a Linear's ``W.t()`` nor a contiguous ``[K, N]``, sizes past cuBLAS's ints, a receive buffer past
``gather_push_max_mb`` and what the gather route's group check declines (hosts, symmetric memory).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import faults

from .. import _inductor_compat as compat
from ..cost_model import pull, registry
from . import gather_gemms, gather_peer, gather_protocol, gather_start, scatter_pull, symmetric
from .base import note
from .scatter_pull import ScatterGemmArgs

log = logging.getLogger("flashoverlap")

NAME = "reduce_pull"
EVEN_PIECES = "reduce_even_pieces"  # the experiment: pieces of equal rows (the first schedule, for comparison)


def unsupported(call, settings: config.Settings) -> str | None:
    """Why ``call`` cannot take this route (None: it can). Pure, and the same at compile time as at run time."""
    pieces, route = settings.tuning.all_reduce_pieces, settings.tuning.all_reduce_route
    if route == "peer":
        return "all_reduce_route is 'peer'"
    if call.collective != "all_reduce":
        return f"{call.collective} is not an all_reduce"
    if settings.transport != "peer":
        return "transport is 'nccl'"
    if call.world != 2:
        return f"world size {call.world} (the pull route is for 2 ranks)"
    if call.rows % 2 or call.rows < pieces:
        return f"{call.rows} rows: odd, or fewer than {pieces} pieces"
    if call.dtype not in gather_gemms.ELEM_TYPES:
        return f"dtype: {call.dtype} (bf16)"
    if not kernels.available():  # never raises
        return "library: the kernel library or an sm90 GPU is missing"
    if route == "auto" and not scatter_pull.model_prefers_pull(call, settings):
        return "the cost model predicts the peer route faster (all_reduce_route 'auto')"
    return None


@dataclass
class ReduceLaunch:
    """One call shape: ``rows`` x ``n`` outputs in the library's pieces, the protocol's shard (half the output, bytes),
    the receive buffer per rank (bytes: ``SLOT_SETS`` sets of the whole output), the wait bound, and per gather
    workspace it ran with the protocol's argument struct."""

    rank: int
    rows: int
    n: int
    k: int
    dtype: torch.dtype
    shard_bytes: int
    buffer_bytes: int
    timeout_ns: int
    description: str
    gemm: ScatterGemmArgs
    launch_id: int = 0
    options: int = gather_start.PUSH  # the protocol's options: the push schedule (``scatter_pull.args_for``)
    args: dict[int, gather_protocol.GatherArgs] = field(default_factory=dict)  # workspace serial -> args


def make_launch(call, settings: config.Settings, ctx) -> ReduceLaunch | str:
    b = ctx.b
    if not isinstance(b, torch.Tensor) or b.dim() != 2:
        return "bmm: a batched b"
    if ctx.bias is not None:
        return "bias: the pull all_reduce takes none"
    transposed = gather_gemms.weight_layout(b, call.k, row_major=True)
    if transposed is None or b.dtype != call.dtype:
        return f"weight: strides {tuple(b.stride())} are neither W.t() nor a contiguous [K, N] of the call's dtype"
    if max(call.rows, call.n, call.k) > gather_gemms.INT_MAX or min(call.n, call.k) < 2:
        return "sizes: past cuBLAS's ints, or N or K below 2"
    half = call.rows // 2
    shard_bytes = half * call.n * call.dtype.itemsize
    if not gather_start.push_fits(settings, 2, shard_bytes):
        return "buffer: the receive buffer would pass gather_push_max_mb"
    why = gather_peer.group_issue(ctx.group)  # a collective, once per group: every rank gets here with this call
    if why is not None:
        return why
    g = ScatterGemmArgs()
    g.half_rows, g.n, g.k, g.pieces, g.weight_transposed = half, call.n, call.k, settings.tuning.all_reduce_pieces, \
        transposed
    g.elem_type, g.math_mode, g.all_reduce = gather_gemms.ELEM_TYPES[call.dtype], 0, 1
    cuts = cuts_for(call, settings)
    for i, c in enumerate(cuts):
        g.cuts[i] = c
    desc = (f"GEMM {call.rows}x{call.n}x{call.k} {call.dtype_name} then all_reduce over 2 ranks: reduce_pull route "
            f"(cuBLAS in {g.pieces} pieces, rows {cuts}, each partial pushed by copy engine into the peer's receive "
            "slot, one add per piece; one library call)")
    log.info("flashoverlap: launch %s", desc)
    return ReduceLaunch(call.rank, call.rows, call.n, call.k, call.dtype, shard_bytes,
                        gather_start.push_bytes(2, shard_bytes),
                        settings.timeout_ns(compat.group_timeout_ms(ctx.group)), desc, g, faults.launch_id(desc))


def cuts_for(call, settings: config.Settings) -> list[int]:
    """The pieces' rows (``cost_model.pull.piece_cuts`` from the GEMM's modelled time; even under the experiment
    ``EVEN_PIECES``, or where the cost model fails, logged once); shapes, settings and cost data only, which the
    ranks agree on (``routes.agree``), so both ranks cut alike."""
    pieces = settings.tuning.all_reduce_pieces
    even = pull.even_cuts(call.rows, pieces)
    if EVEN_PIECES in settings.experiments:
        return even
    try:
        model, _ = registry.model_for(scatter_pull.device_name(call), registry.data_dir(settings))
        dtype = str(call.dtype).removeprefix("torch.")
        return pull.piece_cuts(call.rows, call.n, model.gemm.reference_ms(call.rows, call.n, call.k, dtype), pieces,
                               model.gemm.wave_rows(call.n), call.dtype.itemsize)
    except Exception as exc:  # noqa: BLE001 - a cost-model bug must not break the op
        note(f"pull_cuts_failed:{type(exc).__name__}", logging.WARNING,
             "flashoverlap: the all_reduce pull route's piece cuts failed (%r): even pieces", exc)
        return even


class ReducePullRoute:
    name = NAME
    devices = ("cuda",)
    collectives = ("all_reduce",)
    last_resort = False

    unsupported = staticmethod(unsupported)
    make_launch = staticmethod(make_launch)

    def execute(self, launch: ReduceLaunch, ctx) -> torch.Tensor | str:
        """One call as ``fo_scatter_run`` (module docstring); counts ``reduce:library``."""
        device = ctx.a.device
        if not gather_gemms.usable(launch.dtype, ctx.settings.experiments, ctx.probe):
            return "matmul settings: torch's current ones forbid the library's cuBLAS GEMMs"
        ws = gather_peer.workspace(ctx.group, device, launch.buffer_bytes, ctx.capturing, True)
        if ws is None:
            return "capture-grow: its receive buffer would have to grow inside a CUDA-graph capture"
        cur = compat.current_raw_stream(device.index)
        if not ctx.capturing:
            symmetric.order_after_last(ctx.group, device, cur)
        a = ctx.a.reshape(launch.rows, launch.k).contiguous()
        out = torch.empty(ctx.out_shape, dtype=launch.dtype, device=device)
        p = scatter_pull.args_for(launch, ws)  # memoized: every per-call field set here (the dispatcher's lock)
        p.a, p.cur_stream, p.staging = out.data_ptr(), cur, None
        p.outputs[0], p.output_numel[0] = out.data_ptr(), out.numel()
        p.slot_set = gather_peer.next_slot_set(ctx.group, device)
        g = launch.gemm
        g.a, g.weight, g.part, g.out = a.data_ptr(), ctx.b.data_ptr(), None, out.data_ptr()
        scatter_pull.call_library(p, g, ws, ctx, (a, out), "reduce:library")
        return out

    def reset(self) -> None:
        """Nothing of its own: its flags, buffers and streams are the gather route's (``gather_peer.ROUTE.reset``)."""


ROUTE = ReducePullRoute()
