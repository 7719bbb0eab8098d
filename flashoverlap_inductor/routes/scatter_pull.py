"""The copy-engine pull route of GEMM -> reduce_scatter on 2 ranks of one NVLink host: the GEMMs stay cuBLAS's.

Which calls it takes (``config.Tuning.scatter_route``): under ``"auto"`` (the default) every 2-rank reduce_scatter whose
predicted cost, its GPU time plus its host floor (unless ``host_floors`` leaves it out), is within
``cost_model.pull.TOLERANCE`` of the peer route's
(``cost_model.pull.prefers_pull``; not with ``ring="all"``, which asks for the ring route; 2 H200s, 27 Nov: 0.93-1.03x
of the peer route's GPU time on 23 shapes; its host time, ~0.33 ms per eager call against the peer route's ~0.11,
keeps all but the largest outputs on the peer route where the floors count: docs/results.md), the rest going on to
the peer route;
``"pull"`` every one, ``"peer"`` none. Under the experiment ``scatter_pull`` it also takes the calls whose bias has
the output's shape (the pass's pull staging of a sum of GEMMs; the peer route cannot take such a bias), whatever
``scatter_route`` says.
The peer route (``routes/peer.py``) stores GEMM 1's tiles into the peer over NVLink from its epilogue, which costs its
CUTLASS GEMMs time that cuBLAS's GEMM does not spend (docs/design.md, "Host cost of a fused call", last paragraph), and
it takes no row-varying addend.

Per call (rank ``r``, peer ``p = 1 - r``; the output rows in halves, half ``h`` being rank ``h``'s result; ``M`` rows,
``N`` columns), under ``scatter_start="push"`` (the default, where ``SLOT_SETS`` x 2 halves fit ``gather_push_max_mb``):

- on the caller's stream: ``part = a[half p] @ b (+ bias[half p])`` (cuBLAS: ``mm`` / ``addmm``, a fresh ``[M/2, N]``);
- ``fo_gather_call`` with ``part`` as the shard and the all_gather peer route's push schedule (``FO_GATHER_PUSH``;
  its protocol, flag page, epoch, copy stream and symmetric buffers: ``routes/gather_peer.py``; one call of that
  protocol per call of this route, in the same order on every rank): the copy stream pushes ``part`` into slot
  ``rank`` of the call's slot set in the peer's receive buffer, and tells the peer; the caller's stream waits only
  for the protocol's begin (the peer's reads of that set, two calls back, done);
- on the caller's stream meanwhile: ``out = a[half r] @ b (+ bias[half r])``, then, after the event of the peer's
  part landing in this rank's slot ``p`` of that set, ``out += slot`` (one add over ``M/2 x N``);
- ``fo_gather_finish``: the caller's stream joins the copy stream, and ``out`` is NaN while the group's fault block
  holds a fault (raised at the next call on every rank, as the gather route's).

The notification and the wait for the peer's part run on the copy stream when the own GEMM frees an SM, which is when
the add needs them. The slot sets alternate per push call of the group (``gather_peer.next_slot_set``, shared with
the gather route's push calls), so a slot is rewritten only after the peer finished reading it two calls before.
Under ``scatter_start="handshake"`` (also where the push's buffer would pass ``gather_push_max_mb``) the
copy stream copies ``part`` into this rank's symmetric buffer and shakes hands with the peer (the caller's stream waits
for that) before the own half's GEMM, then pulls the peer's part into ``staging`` by copy engine (the protocol's slot
``p``; the library writes no other slot, so only that one is allocated): a buffer of one half, ~12 us at 4096 x 4096 and
~0.1 ms at 16384 x 8192 with the SMs idle (2 H200s). On 2 H200s push ran the 16-shape op grid 1.158x over sequential
against the handshake's 1.126x (36th session) and ``scatter_pull_bench`` 1.226x against 1.182x (37th); end to end,
in the steady state, Llama-3-8B sp prefill 1.115x over Inductor against 1.058x (67% of the communication hidden
against 36%, 38th) and training 0.3% ahead (37th); the 36th session's eager medians that put it behind counted each
interleaved turn's slow first step (``bench/interleave.py``).

Eager bf16 calls without bias on the push schedule (``library_args``) run as one library call instead,
``fo_scatter_run`` (``run_library``; ``scatter_pieces``, default 1: this schedule, its GEMMs by cuBLASLt, the wait a
bounded kernel on the caller's stream, one add; 2 H200s, 42nd session: bit for bit as the Python path, 0.77x its
host time per call); 2-8 pieces add the received rows as the own GEMMs' addend instead (no faster: docs/design.md).

Invariants: the failure contract, the buffer reuse rule and the resynchronization are the gather route's (its
docstring), since every wait, flag and buffer is its own; a fault raised here names ``gather_peer``. ``part``,
``staging`` and ``a`` stay referenced until after the join (and are recorded on the copy stream where the join failed).
The sum order is ``own + peer`` on both ranks' halves (the reference ``reduce_scatter`` of the unfused op adds rank 0's
then rank 1's rows: results agree to bf16 rounding, not bit for bit).

Declines (pure): another collective than reduce_scatter, ``transport="nccl"``, a world size other than 2, rows that
do not halve, a dtype other than bf16 / fp16 / fp32, no kernel library or sm90 GPU, and a call that neither
``scatter_route`` nor the experiment gives it. At compile time the same rule holds, so the pass predicts the route that
runs (``cost_model.pull``), and the calls the pass stages are predicted by their own verdict. ``make_launch`` also
declines a batched ``b`` (bmm), a bias that is neither one row ``[N]`` nor the output's full shape, a bias of neither
form when ``scatter_route`` does not give the call this route (a call the experiment alone brought here), and what
the gather route's group check declines (hosts, symmetric memory).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import torch

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import faults

from .. import _inductor_compat as compat
from ..cost_model import pull, registry
from . import gather_gemms, gather_peer, gather_protocol, gather_start, peer, symmetric
from .base import note, stats

log = logging.getLogger("flashoverlap")

NAME = "scatter_pull"
EXPERIMENT = "scatter_pull"  # calls with a bias of the output's shape (the pass's pull staging of a sum of GEMMs)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def unsupported(call, settings: config.Settings) -> str | None:
    """Why ``call`` cannot take this route (None: it can). Pure; depends only on what all ranks share (the shapes,
    the settings, the cost data), and the same at compile time as at run time."""
    staged = EXPERIMENT in settings.experiments
    if settings.tuning.scatter_route == "peer" and not staged:
        return "scatter_route is 'peer'"
    if call.collective != "reduce_scatter":
        return f"{call.collective} is not a reduce_scatter"
    if settings.transport != "peer":
        return "transport is 'nccl'"
    if call.world != 2:
        return f"world size {call.world} (the pull route is for 2 ranks)"
    if call.rows % 2 or call.rows < 2:
        return f"{call.rows} rows do not split into two equal halves"
    if call.dtype not in DTYPES:
        return f"dtype: {call.dtype} (bf16, fp16 or fp32)"
    if not kernels.available():  # never raises
        return "library: the kernel library or an sm90 GPU is missing"
    # the experiment brings the calls with a staged sum's bias (make_launch tells them apart); at compile time the call
    # has no bias, so the rule alone says where a plain GEMM will run
    if (not staged or call.compile_time) and not takes_plain(call, settings):
        return "the cost model predicts the peer route faster (scatter_route 'auto')"
    return None


def takes_plain(call, settings: config.Settings) -> bool:
    """Whether ``scatter_route`` gives this route ``call`` whatever its bias (``"pull"``, or ``"auto"`` for bf16 where
    the peer route cannot take the call or ``cost_model.pull.prefers_pull``); else only a staged sum's bias of the
    output's shape brings it here. A cost-model failure answers False (the peer route, as before this route was a
    default), logged once: the same on every rank, and never an error of the call. At run time the peer route also
    declines a B whose strides none of its kernels reads, which compile time cannot see: such a call runs here,
    whatever the models say, where the pass predicted the peer route (both fused: the same collectives run)."""
    route = settings.tuning.scatter_route
    if route != "auto":
        return route == "pull"
    if call.dtype != torch.bfloat16:  # the dtype it was measured in (and fitted to); fp16 stays where it ran before
        return False
    return model_prefers_pull(call, settings)


def model_prefers_pull(call, settings: config.Settings) -> bool:
    """The ``"auto"`` rule of both pull routes (this one's ``scatter_route``, the all_reduce pull route's
    ``all_reduce_route``) after their own declines: not with ``ring="all"`` (the user asked for the ring route on 2
    ranks); where the peer route cannot take the call (no peer route to compare with), the pull route; else
    ``cost_model.pull.prefers_pull`` for the call's collective (host floors where ``counts_host()``). A cost-model
    failure answers False (the peer route), logged once: the same on every rank, never the call's error."""
    if settings.ring == "all":
        return False
    if peer.ROUTE.unsupported(call, settings) is not None:
        return True
    dtype = str(call.dtype).removeprefix("torch.")
    try:
        return pull.prefers_pull(call.rows, call.n, call.k, dtype, device_name(call), registry.data_dir(settings),
                                 settings.counts_host(), call.collective)
    except Exception as exc:  # noqa: BLE001 - a cost-model bug must not break the op
        note(f"pull_model_failed:{type(exc).__name__}", logging.WARNING,
             "flashoverlap: the pull route's cost model failed (%r): %s on the peer route", exc, call.collective)
        return False


def device_name(call) -> str | None:
    """The GPU model the cost data is looked up for: the call's CUDA device's (``call.device_index``; the current
    device where it is None), None without CUDA (the data's default GPU). The ranks agree on it (``routes.agree``)."""
    if not torch.cuda.is_available():
        return None
    index = getattr(call, "device_index", None)
    return torch.cuda.get_device_name(index if index is not None else torch.cuda.current_device())


class ScatterGemmArgs(ctypes.Structure):
    """``fo_scatter_gemm_args`` of ``csrc/flashoverlap_sm90.h`` (rows, N, K in elements; pointers as ints;
    ``all_reduce`` 1: the all_reduce pull route's call, ``routes/reduce_pull.py``)."""

    _fields_ = [("half_rows", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("pieces", ctypes.c_int32), ("weight_transposed", ctypes.c_int32), ("a", ctypes.c_void_p),
                ("weight", ctypes.c_void_p), ("part", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("handle", ctypes.c_void_p), ("elem_type", ctypes.c_int32), ("math_mode", ctypes.c_int32),
                ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_int64), ("all_reduce", ctypes.c_int32),
                ("cuts", ctypes.c_int64 * (gather_protocol.MAX_PIECES + 1))]


def library_args(call, settings: config.Settings, ctx, options: int, half: int) -> ScatterGemmArgs | None:
    """The shape part of ``fo_scatter_run``'s GEMM struct, or None where the call keeps the Python path: the push
    schedule, ``scatter_pieces`` > 0 and at most the half's rows, bf16 (the dtype run on GPUs), no bias, a weight
    that is a Linear's ``W.t()`` or a contiguous ``[K, N]``, sizes in cuBLAS's ints. Shapes, strides and settings
    only (the ranks agree); the per-call conditions are ``gather_gemms.usable``'s, a contiguous ``a`` and no
    CUDA-graph capture: a replay's host time is nil, and inside graphs the Python path ran faster (Llama-3-8B TP
    prefill under graphs, 2 H200s, 42nd session: 16.915 ms per step against 17.158 with the library call, whose
    GEMMs are ``cublasGemmEx``'s inside a capture and whose waits are kernels on the caller's stream)."""
    pieces, b = settings.tuning.scatter_pieces, ctx.b
    if (not options & gather_start.PUSH or pieces < 1 or half < pieces or ctx.bias is not None
            or call.dtype not in gather_gemms.ELEM_TYPES or b.dim() != 2 or b.dtype != call.dtype
            or max(2 * half, call.n, call.k) > gather_gemms.INT_MAX or min(call.n, call.k) < 2):
        return None
    transposed = gather_gemms.weight_layout(b, call.k, row_major=True)
    if transposed is None:
        return None
    g = ScatterGemmArgs()
    g.half_rows, g.n, g.k, g.pieces, g.weight_transposed = half, call.n, call.k, pieces, transposed
    g.elem_type, g.math_mode = gather_gemms.ELEM_TYPES[call.dtype], 0
    return g


@dataclass
class ScatterLaunch:
    """One call shape: halves of ``half_rows`` rows of ``n`` columns, the shard bytes, the bias form (``None``,
    ``"row"``: one ``[N]`` row for every row, ``"full"``: the output's own shape), the wait bound, the protocol's
    options (``gather_start.GEMM_AFTER_HANDSHAKE`` or ``PUSH``) and workspace bytes per rank (one shard; push:
    ``SLOT_SETS`` x 2), and per gather workspace it ran with, the protocol's argument struct (and push: the receive
    slots' views)."""

    rank: int
    half_rows: int
    n: int
    k: int
    dtype: torch.dtype
    bias: str | None
    shard_bytes: int
    timeout_ns: int
    description: str
    launch_id: int = 0
    options: int = gather_start.GEMM_AFTER_HANDSHAKE
    buffer_bytes: int = 0
    args: dict[int, gather_protocol.GatherArgs] = field(default_factory=dict)  # workspace serial -> args
    slots: dict[int, tuple] = field(default_factory=dict)  # push: workspace serial -> per set [2, half, n]
    gemm: ScatterGemmArgs | None = None  # the call's shape in fo_scatter_run's terms (None: the Python path)


def bias_form(bias: torch.Tensor | None, y_shape: list[int]) -> str | None:
    """``None``, ``"row"`` or ``"full"`` (see ``ScatterLaunch``); ``"other"`` for any other broadcast."""
    if bias is None:
        return None
    if bias.numel() == 1 or (bias.dim() >= 1 and bias.numel() == y_shape[-1] and bias.shape[-1] == y_shape[-1]):
        return "row"
    if list(bias.shape) == list(y_shape):
        return "full"
    return "other"


def make_launch(call, settings: config.Settings, ctx) -> ScatterLaunch | str:
    if ctx.b.dim() != 2:
        return "bmm: a batched b"
    form = bias_form(ctx.bias, ctx.y_shape)
    if form == "other":
        return f"bias: {tuple(ctx.bias.shape)} is neither one row [N] nor the output's shape {ctx.y_shape}"
    if form != "full" and not takes_plain(call, settings):  # the experiment alone brought it here
        return "bias: not of the output's shape (scatter_route does not give this call the pull route)"
    why = gather_peer.group_issue(ctx.group)  # a collective, once per group: every rank gets here with this call
    if why is not None:
        return why
    half = call.rows // 2
    shard_bytes = half * call.n * call.dtype.itemsize
    options, buffer_bytes, moved = gather_start.GEMM_AFTER_HANDSHAKE, shard_bytes, "pulled by copy engine"
    note_ = ""
    if settings.tuning.scatter_start == "push":
        if gather_start.push_fits(settings, 2, shard_bytes):
            options, buffer_bytes = gather_start.PUSH, gather_start.push_bytes(2, shard_bytes)
            # tune.rows.route_of_launch tells this schedule's launches by "pushed by copy engine"
            moved = "pushed by copy engine into the peer's receive slot"
        else:
            note_ = "; handshake schedule (the push's receive buffer would pass gather_push_max_mb)"
    desc = (f"GEMM {call.rows}x{call.n}x{call.k} {call.dtype_name} then reduce_scatter over 2 ranks: scatter_pull "
            f"route (cuBLAS halves, {shard_bytes} B {moved}, bias {form}){note_}")
    gemm = library_args(call, settings, ctx, options, half)
    if gemm is not None:
        desc += f"; one library call, {gemm.pieces} pieces"
    log.info("flashoverlap: launch %s", desc)
    return ScatterLaunch(call.rank, half, call.n, call.k, call.dtype, form, shard_bytes,
                         settings.timeout_ns(compat.group_timeout_ms(ctx.group)), desc, faults.launch_id(desc),
                         options, buffer_bytes, gemm=gemm)


def args_for(launch, ws: symmetric.SymmetricBuffer) -> gather_protocol.GatherArgs:
    """The protocol's struct (``gather_protocol.new_args``: 2 ranks, one output, no own copy), memoized per
    workspace; ``launch``: this route's ``ScatterLaunch`` or the all_reduce pull route's ``ReduceLaunch`` (both
    carry rank, shard_bytes, dtype, launch_id, timeout_ns, options and the ``args`` memo)."""
    p = launch.args.get(ws.serial)
    if p is None:
        p = launch.args[ws.serial] = gather_protocol.new_args(ws, 2, launch.rank, launch.shard_bytes, launch.dtype,
                                                              launch.launch_id, launch.timeout_ns, launch.options)
        p.copy_own, p.num_outputs = 0, 1
    return p


def receive_buffer(launch: ScatterLaunch, ws: symmetric.SymmetricBuffer) -> tuple:
    """Push: this rank's receive slots, one ``[2, half_rows, n]`` view per set (at ``gather_protocol.set_bytes`` apart);
    ``[b][j]`` is where rank ``j``'s part of this rank's rows lands in a set-``b`` call (made once per workspace and
    kept with the launch)."""
    views = launch.slots.get(ws.serial)
    if views is None:
        views = launch.slots[ws.serial] = gather_protocol.slot_views(ws, launch.rank, launch.dtype,
                                                                     (2, launch.half_rows, launch.n))
    return views


def half_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """``a @ b (+ bias)`` by cuBLAS (``mm`` / ``addmm``), into ``out`` when given."""
    if bias is None:
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b) if out is None else torch.addmm(bias, a, b, out=out)


def _wait(device: torch.device, event) -> None:
    """The caller's stream waits for ``event`` (the pull's)."""
    torch.cuda.current_stream(device).wait_event(event)


def run_library(launch: ScatterLaunch, ctx, ws: symmetric.SymmetricBuffer, cur: int) -> torch.Tensor:
    """One call as ``fo_scatter_run`` (``csrc/scatter_run.cu``): the peer's half in ``launch.gemm.pieces`` pieces
    pushed as each is computed, the own half's pieces adding the received rows in their GEMMs, the finish (join,
    done, poison) in the same host call. ``part`` and ``a`` stay referenced until after the join (recorded on the copy
    stream where it failed). Counts ``scatter:library``."""
    device, half = ctx.a.device, launch.half_rows
    part = torch.empty(half, launch.n, dtype=launch.dtype, device=device)
    out = torch.empty(ctx.out_shape, dtype=launch.dtype, device=device)
    p = args_for(launch, ws)  # the memoized structs: every per-call field set here (the dispatcher's lock)
    p.a, p.cur_stream, p.staging = part.data_ptr(), cur, None
    p.outputs[0], p.output_numel[0] = out.data_ptr(), out.numel()
    p.slot_set = gather_peer.next_slot_set(ctx.group, device)
    g = launch.gemm
    g.a, g.weight, g.part, g.out = ctx.a.data_ptr(), ctx.b.data_ptr(), part.data_ptr(), out.data_ptr()
    call_library(p, g, ws, ctx, (part, ctx.a), "scatter:library")
    del part
    return out


def call_library(p: gather_protocol.GatherArgs, g: ScatterGemmArgs, ws: symmetric.SymmetricBuffer, ctx, used: tuple,
                 stat: str) -> None:
    """``fo_scatter_run(p, g)`` once every pointer of both structs is set but the cuBLAS handle and workspace (set
    here: torch's handle of this thread, cuBLASLt's workspace outside captures); counts ``stat``; raises the call's
    or the finish's failure, ``used``'s tensors recorded on the copy stream where the finish could not join (this
    route's and the all_reduce pull route's, ``routes/reduce_pull.py``)."""
    g.handle = torch.cuda.current_blas_handle()
    lt = gather_gemms.workspace(ctx.a.device, ctx.settings.experiments, ctx.capturing)
    g.workspace, g.workspace_bytes = (None, 0) if lt is None else (lt.data_ptr(), lt.numel())
    lib, finish_rc = kernels.library(), ctypes.c_int32(0)
    rc = lib.fo_scatter_run(ctypes.byref(p), ctypes.byref(g), ctypes.byref(finish_rc))
    if finish_rc.value != 0:
        gather_protocol.unjoined(ws, used)
    stats[stat] += 1
    kernels.check(rc, "fo_scatter_run")
    kernels.check(finish_rc.value, "fo_gather_finish")


class ScatterPullRoute:
    name = NAME
    devices = ("cuda",)
    collectives = ("reduce_scatter",)
    last_resort = False

    unsupported = staticmethod(unsupported)
    make_launch = staticmethod(make_launch)

    def execute(self, launch: ScatterLaunch, ctx) -> torch.Tensor | str:
        device, half, rank = ctx.a.device, launch.half_rows, launch.rank
        push = bool(launch.options & gather_start.PUSH)
        ws = gather_peer.workspace(ctx.group, device, launch.buffer_bytes, ctx.capturing, push)
        if ws is None:
            return "capture-grow: its shard buffer would have to grow inside a CUDA-graph capture"
        cur = compat.current_raw_stream(device.index)
        if not ctx.capturing:
            symmetric.order_after_last(ctx.group, device, cur)
        a = ctx.a.reshape(2 * half, launch.k)
        bias = [None, None]
        if launch.bias == "row":
            bias = [ctx.bias.reshape(-1).expand(launch.n)] * 2
        elif launch.bias == "full":
            full = ctx.bias.reshape(2 * half, launch.n)
            bias = [full[:half], full[half:]]
        if (launch.gemm is not None and not ctx.capturing and ctx.a.is_contiguous()
                and gather_gemms.usable(launch.dtype, ctx.settings.experiments, ctx.probe)):
            return run_library(launch, ctx, ws, cur)
        peer, probe = 1 - rank, ctx.probe
        stream = torch.cuda.current_stream(device) if probe is not None else None
        if probe is not None:  # the timeline tool's call (bench.timeline_pull): marks on cur, the arrival's event
            probe.mark("start", stream)
        part = half_gemm(a[peer * half:(peer + 1) * half], ctx.b, bias[peer]).contiguous()
        out = torch.empty(ctx.out_shape, dtype=part.dtype, device=device)
        p = args_for(launch, ws)  # the memoized struct: every per-call field set here (the dispatcher's lock)
        p.a, p.cur_stream = part.data_ptr(), cur
        p.outputs[0], p.output_numel[0] = out.data_ptr(), out.numel()
        lib = kernels.library()
        staging = None
        if push:  # the peer writes this rank's slot; the set counted last, right before the library (as the gather
            slots = receive_buffer(launch, ws)  # route's push calls)
            p.staging, p.slot_set = None, gather_peer.next_slot_set(ctx.group, device)
            received = slots[p.slot_set][peer]
        else:  # the pull's slot ``peer`` (the library writes no other slot)
            staging = received = part.new_empty(half, launch.n)
            p.staging = staging.data_ptr() - peer * launch.shard_bytes
        events = ws.flags.events
        if probe is not None:
            probe.mark("part", stream)  # the peer's half computed
            events = gather_protocol.probe_events(probe, p, rank, 2)  # "pull:<peer>": its part landed here
        rc = lib.fo_gather_call(ctypes.byref(p))
        try:
            if rc == 0:  # the own half now (after the handshake, if any), then the peer's part of it once arrived
                own = out.view(half, launch.n)
                if probe is not None:
                    probe.mark("own_start", stream)  # after the protocol's kernels on cur (handshake; push: begin)
                half_gemm(a[rank * half:(rank + 1) * half], ctx.b, bias[rank], out=own)
                if probe is not None:
                    probe.mark("own", stream)
                _wait(device, events[peer])
                if probe is not None:
                    probe.mark("arrived", stream)
                own.add_(received)
                if probe is not None:
                    probe.mark("add", stream)
        finally:  # joined and poisoned whatever happened above: the copy stream never outlives the call's tensors
            rc_finish = gather_protocol.finish(lib, p, ws, (part, staging), NAME)
            if probe is not None:
                gather_protocol.put_events(p, ws.flags.events, rank, 2)  # the memoized struct: the flags' again
                probe.mark("end", stream)
        kernels.check(rc, "fo_gather_call")
        kernels.check(rc_finish, "fo_gather_finish")
        del part, staging  # alive until here: read on the copy stream, which the finish joined
        return out

    def reset(self) -> None:
        """Nothing of its own: its flags, buffers and streams are the gather route's (``gather_peer.ROUTE.reset``)."""


ROUTE = ScatterPullRoute()
