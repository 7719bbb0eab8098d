"""The NVLink peer route of all_gather -> GEMMs: the shards travel by copy engine, the GEMMs stay cuBLAS's.

One host, 2-8 ranks (``torch.distributed._symmetric_memory``; any backend of the group: a gloo group whose ranks
share one GPU works too, under ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``). Per call (``fo_gather_call`` and
``fo_gather_finish``, ``csrc/gather_call.cu``; the protocol is stated in ``csrc/flashoverlap_sm90.h``):

- on the group's copy stream, forked from the caller's: begin the call (its deadline, its epoch ``e``), wait until
  every peer finished reading this rank's shard of call ``e - 1``, copy the shard into this rank's symmetric buffer,
  tell every peer; then per peer ``j`` in arrival order (``schedule.gather.arrival_order``: ``rank - 1, rank - 2,
  ...``) wait for ``j``'s shard of call ``e``, pull it from ``j``'s buffer mapped here into ``staging[j]``
  (``cudaMemcpyAsync``: the copy engine, no SM) and record ``j``'s event; tell ``j`` its buffer is read;
- on the caller's stream, meanwhile: the local shard's GEMMs (cuBLAS, ``schedule.gather.shard_gemm`` into
  ``shard_view``), then each pulled shard's after its event; where ``gather_gemms`` takes the call, all of them in
  the library (torch's cuBLAS and handle, cuBLASLt with plans kept per shape outside captures), and the call with
  its GEMMs and its finish is one library call (``fo_gather_run``);
- ``fo_gather_finish``: the caller's stream joins the copy stream, and one kernel fills every output (each ``y_i``
  and, when returned, the gathered rows) with NaN while the group's fault block holds a fault.

``gather_start="push"`` (``FO_GATHER_PUSH``; what the default ``"auto"`` takes on 2 ranks: the choice per call and the
push's buffer size are ``routes/gather_start.py``'s, shared with the pull route): no handshake and no copy of the own
shard into symmetric memory. On the caller's stream one short kernel begins the call and waits until every peer read the
slots it overwrites, then the local GEMMs run; the copy stream pushes ``a`` into slot ``rank`` of set ``b`` of every
peer's receive buffer (``SLOT_SETS`` sets of ``world`` slots, set ``b`` at ``b * set_bytes(ws)`` whatever the shard
size, a workspace list of its own), tells every peer after the last push (the experiment ``gather_copy_notify``: on 3+
ranks each right after its push, by copy engine; 4 H200s: correct, no faster), waits for each peer's shard in slot ``j``
here and records ``j``'s event; slot ``j``'s GEMMs follow it; ``fo_gather_finish`` joins, tells every peer its slot here
is read, and poisons. The set alternates per call (``next_slot_set``: alike on every rank; a captured call keeps its
set), so the first wait concerns the peers' call ``e - 2``; per set the flags and this rank's pushes and reads are
counters, so a rank on another set than its peers waits out its bound: a fault, never a stale slot (``docs/design.md``
gives the measurements behind each choice).

Invariants (units: bytes for buffers and shards, flattened rows for the GEMMs, as ``schedule.gather``):

- Memory of one (device, group): a flag page of ``FLAG_BYTES`` (zeroed once; ``ready[j]`` at int ``j`` and
  ``done[j]`` at int ``MAX_WORLD + j``, each added to only by rank ``j``, once per call; the push's per-set counters;
  the group's ``fo_fault`` block at ``FAULT_OFFSET``), a device epoch (calls begun; graph-replay safe: the first
  kernel of a call advances it), the copy stream, one event per source rank; and workspaces of ``capacity`` bytes
  (``symmetric.smallest_with_room``: a call of ``shard_bytes = shard_rows * K * itemsize`` uses the smallest with
  room, never grows one inside a capture), every rank's mapped here. ``staging`` ([world, shard_rows, K], the dim-0
  all_gather's layout) and the outputs are the call's own fresh tensors.
- A buffer (push: a set's slots) is rewritten only after every peer said it read what is there; the flags count
  calls, not shapes, so calls of any shape share one page and buffer set, and run in order on the group's copy
  stream (eager calls from another caller stream first wait for the last, ``order_after_last``). Push: set ``b`` of
  a workspace is its fixed byte range ``[b, b + 1) * set_bytes(ws)`` whatever a call's shard size, so a set's waits
  guard every byte a call of that set writes (docs/design.md: offsets by shard size let calls of two sizes overlap).
- Every wait is bounded by the call's deadline (``Settings.timeout_ns``: ``wait_timeout_ms`` or the group's
  timeout). A wait that gives up records the fault in this rank's block and every peer's; the call still notifies
  every flag once and every wait consumes its epoch, so the next call is in step again (a late rank is caught up).
  The fault poisons the outputs of every call that finishes while the block holds it; the host raises it at the
  next call (``faults.raise_pending``) or in ``routes.check()``, on every rank of the group, and clears it. With 3
  or more ranks, another rank's record of the same stall may land after this rank cleared its block: the next call
  is then poisoned and raises too (never a wrong value).
- A rank that skips a call altogether leaves the epochs one call apart; its peers' waits give up and write the
  fault into its block too, so it raises in ``routes.check()`` as they do, and every rank's next call on the group
  first resynchronizes it (``symmetric.resync``: the flag page and the epoch zeroed in place on every rank, the
  buffers kept), with no reset. That resynchronization also drops the late records above.
- Beside the GEMMs: copy engines only; the protocol's one-thread kernels need an SM slot, which cuBLAS's persistent
  sm90 GEMMs free only at their end (so none may gate a transfer).

Declines (pure; alike on every rank): another collective, ``transport="nccl"``, 1 or more than ``MAX_WORLD`` ranks, a
dtype other than bf16 / fp16 / fp32, a plan other than ``gather_nccl.PLANS``, no library or sm90 GPU; in
``make_launch`` (after one collective per group) a group across hosts or without symmetric memory, or more than
``MAX_OUTPUTS`` outputs.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import faults, streams

from .. import _inductor_compat as compat
from ..schedule import gather as schedule
from . import gather_gemms, gather_nccl, symmetric
from .gather_protocol import (
    FAULT_OFFSET,
    FLAG_BYTES,
    MAX_OUTPUTS,
    MAX_WORLD,
    GatherArgs,
    GatherFlags,
    finish,
    new_args,
    probe_events,
    put_events,
    slot_views,
    unjoined,
)
from .gather_start import PUSH, SLOT_SETS, resolve_start

log = logging.getLogger("flashoverlap")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NAME = "gather_peer"
# What a timeout on a group's flag page names: the routes that share its protocol
FAULT_LABEL = "gather_peer / scatter_pull / reduce_pull / moe_peer"


_flags: dict[tuple[int, str], GatherFlags] = {}
# (device, group) or (device, group, "push") -> the shard buffers by capacity
_workspaces: dict[tuple, list[symmetric.SymmetricBuffer]] = {}
_groups: dict[str, str | None] = {}  # group name -> why its ranks cannot share symmetric memory (None: they can)
_push_calls: dict[tuple[int, str], int] = {}  # (device, group) -> push calls issued (the next one's set: % SLOT_SETS)
_reset_hooks: list[Callable[[], None]] = []  # run by this route's ``reset`` (``on_reset``)


def on_reset(hook: Callable[[], None]) -> None:
    """Run ``hook`` at this route's ``reset``, after its workspaces and flag pages were dropped: for the modules
    that build on them (``moe_peer``)."""
    if hook not in _reset_hooks:
        _reset_hooks.append(hook)


def flags(group: dist.ProcessGroup, device: torch.device) -> GatherFlags:
    """The cached flag page of (device, group); made (collectively, zeroed) on first use, never inside a capture."""
    key = (device.index, group.group_name)
    f = _flags.get(key)
    if f is None:
        world, rank = group.size(), group.rank()
        buf, hdl, views = symmetric.symmetric(FLAG_BYTES, group, device, True, list(range(world)))
        epoch = streams.persistent(device.index, lambda: torch.zeros(1, dtype=torch.int32, device=device))
        events = [torch.cuda.Event() for _ in range(world)]
        for ev in events:  # created now (torch makes an event at its first record); the library re-records them
            ev.record(torch.cuda.current_stream(device))
        dom = symmetric.fault_domain(NAME, group, device, buf, FAULT_OFFSET,
                                     [v.data_ptr() for r, v in enumerate(views) if r != rank], FAULT_LABEL)
        f = _flags[key] = GatherFlags(buf, hdl, views, epoch, torch.cuda.Stream(device=device, priority=-100),
                                      events, dom)
    return f


def workspaces(device: torch.device, group: dist.ProcessGroup, tag: str) -> list[symmetric.SymmetricBuffer]:
    """The workspace list of (device, group) kept under ``tag`` (another route's buffers on this flag page, e.g.
    ``moe_peer``'s receive slots), dropped with this route's ``reset``."""
    return _workspaces.setdefault((device.index, group.group_name, tag), [])


def workspace(group: dist.ProcessGroup, device: torch.device, need: int,
              capturing: bool = False, push: bool = False) -> symmetric.SymmetricBuffer | None:
    """The smallest shard buffer of (device, group) with ``need`` bytes (``symmetric.smallest_with_room``: None
    inside a capture when none has room); ``push``: from the push schedule's own list (its slots are written by the
    peers, so no buffer serves both schedules)."""

    def make(capacity: int) -> symmetric.SymmetricBuffer:
        f = flags(group, device)
        buf, hdl, views = symmetric.symmetric(capacity, group, device, False, list(range(group.size())))
        log.info("flashoverlap gather_peer: symmetric shard buffer of %d MiB on %s, group %s", capacity >> 20,
                 device, group.group_name)
        return symmetric.SymmetricBuffer(capacity, buf, hdl, views, f, symmetric.next_serial())

    key = (device.index, group.group_name) + (("push",) if push else ())
    return symmetric.smallest_with_room(_workspaces.setdefault(key, []), need, capturing, make)


def unsupported(call, settings: config.Settings) -> str | None:
    """Why ``call`` cannot take this route (None: it can). Pure; depends only on what all ranks share."""
    if call.collective != "all_gather":
        return f"{call.collective} is not an all_gather"
    if settings.transport != "peer":
        return "transport is 'nccl'"
    if call.world < 2:
        return "one rank: nothing to gather"
    if call.world > MAX_WORLD:
        return f"world size {call.world} (the gather peer route takes 2-{MAX_WORLD} ranks of one host)"
    if call.dtype not in DTYPES:
        return f"dtype: {call.dtype} (bf16, fp16 or fp32)"
    why = gather_nccl.unsupported_plan(call.plan)
    if why is not None:
        return why
    if not kernels.available():  # never raises
        return "library: the kernel library or an sm90 GPU is missing"
    return None


def group_issue(group: dist.ProcessGroup) -> str | None:
    """Why the group's ranks cannot share symmetric memory (None: they can): one ``all_gather_object`` of the host
    name and torch's symmetric memory per group, so every rank gets the same answer."""
    key = group.group_name
    if key not in _groups:
        mine = (socket.gethostname(), importlib.util.find_spec("torch.distributed._symmetric_memory") is not None)
        got: list = [None] * group.size()
        dist.all_gather_object(got, mine, group=group)
        hosts = {host for host, _ in got}
        if len(hosts) > 1:
            _groups[key] = f"hosts: the group spans {len(hosts)} hosts (symmetric memory is one host's)"
        elif not all(ok for _, ok in got):
            _groups[key] = "symmetric: torch.distributed._symmetric_memory is missing on a rank"
        else:
            _groups[key] = None
    return _groups[key]


@dataclass
class GatherLaunch:
    """One call shape: its geometry, shard bytes, wait bound and, per workspace it ran with, the args with every
    pointer but the call's own."""

    geo: schedule.GatherGeometry
    rank: int
    dtype: torch.dtype
    shard_bytes: int
    timeout_ns: int
    description: str
    options: int = 0  # fo_gather_args.options
    buffer_bytes: int = 0  # the workspace a call needs per rank: push ``SLOT_SETS * world`` shards, else one
    gemms: gather_gemms.GatherGemmArgs | None = None  # the GEMMs in one library call (None: the Python loop)
    launch_id: int = 0  # ``faults.launch_id``
    args: dict[int, GatherArgs] = field(default_factory=dict)  # workspace serial -> args
    slots: dict[int, tuple] = field(default_factory=dict)  # workspace serial -> receive_slots' views (push)


def make_launch(call, settings: config.Settings, ctx) -> GatherLaunch | str:
    why = group_issue(ctx.group)  # a collective, once per group: every rank gets here with the same call
    if why is not None:
        return why
    outputs = len(ctx.b) + int(ctx.return_gathered)
    if outputs > MAX_OUTPUTS:
        return f"outputs: {outputs} outputs (at most {MAX_OUTPUTS})"
    geo = schedule.geometry(list(ctx.a.shape), ctx.gather_dim, call.world)
    shard_bytes = geo.shard_rows * geo.k * call.dtype.itemsize
    desc = (f"all_gather of {geo.shard_rows} x {geo.k} {call.dtype_name} shards over {call.world} ranks, then "
            f"{len(ctx.b)} GEMM(s) N={[w.shape[-1] for w in ctx.b]}: gather_peer route, {shard_bytes} B per shard "
            "by copy engine")
    options, buffer_bytes, desc = resolve_start(settings, call.world, shard_bytes, desc)
    log.info("flashoverlap: launch %s", desc)
    return GatherLaunch(geo, call.rank, call.dtype, shard_bytes,
                        settings.timeout_ns(compat.group_timeout_ms(ctx.group)), desc, options, buffer_bytes,
                        gather_gemms.static_args(ctx, geo, call.rank), faults.launch_id(desc))


def args_for(launch: GatherLaunch, ws: symmetric.SymmetricBuffer) -> GatherArgs:
    """The launch's args (``new_args``), memoized per workspace: a call shape maps to one workspace for good."""
    p = launch.args.get(ws.serial)
    if p is None:
        p = launch.args[ws.serial] = new_args(ws, launch.geo.world, launch.rank, launch.shard_bytes, launch.dtype,
                                              launch.launch_id, launch.timeout_ns, launch.options)
    return p


def receive_slots(launch: GatherLaunch, ws: symmetric.SymmetricBuffer, dtype: torch.dtype) -> tuple:
    """The push schedule's per-set ``[world, shard_rows, K]`` views of this rank's receive buffer in ``ws`` (set
    ``b``'s slot ``j``: rank ``j``'s shard of a set-``b`` call), made once per workspace and kept with the launch."""
    views = launch.slots.get(ws.serial)
    if views is None:
        geo = launch.geo
        views = launch.slots[ws.serial] = slot_views(ws, launch.rank, dtype, (geo.world, geo.shard_rows, geo.k))
    return views


def next_slot_set(group: dist.ProcessGroup, device: torch.device) -> int:
    """The set of the group's next push call on ``device``: its push calls so far modulo ``SLOT_SETS``."""
    key = (device.index, group.group_name)
    n = _push_calls.get(key, 0)
    _push_calls[key] = n + 1
    return n % SLOT_SETS


class GatherPeerRoute(symmetric.SymmetricRoute):
    name = NAME
    collectives = ("all_gather",)
    epoch_field = "epoch"

    unsupported = staticmethod(unsupported)
    make_launch = staticmethod(make_launch)

    def execute(self, launch: GatherLaunch, ctx) -> list[torch.Tensor] | str:
        device, geo = ctx.a.device, launch.geo
        push = bool(launch.options & PUSH)
        ws = workspace(ctx.group, device, launch.buffer_bytes, ctx.capturing, push)
        if ws is None:
            return "capture-grow: its shard buffer would have to grow inside a CUDA-graph capture"
        cur = compat.current_raw_stream(device.index)
        if not ctx.capturing:
            symmetric.order_after_last(ctx.group, device, cur)
        a = ctx.a.reshape(geo.shard_rows, geo.k).contiguous()  # read on the copy stream; alive until the join
        # the gathered rows (pull: the pulls land here; push: copied out of the slots when returned)
        staging = a.new_empty(geo.world, geo.shard_rows, geo.k) if not push or ctx.return_gathered else None
        outs = [a.new_empty(geo.rows, w.shape[-1]) for w in ctx.b]
        bias = [None if c is None else c.reshape(-1) for c in ctx.bias]
        # the memoized struct itself: every per-call field is set here, and the library reads it only during the
        # call (the dispatcher's lock keeps host threads out of each other's way)
        p = args_for(launch, ws)
        p.a, p.copy_own, p.cur_stream = a.data_ptr(), int(ctx.return_gathered), cur
        p.staging = staging.data_ptr() if staging is not None else None
        poisoned = [*outs, staging] if ctx.return_gathered else outs
        p.num_outputs = len(poisoned)
        for i, t in enumerate(poisoned):
            p.outputs[i], p.output_numel[i] = t.data_ptr(), t.numel()
        lib = kernels.library()
        events, probe = ws.flags.events, ctx.probe
        native = launch.gemms if launch.gemms is not None and gather_gemms.usable(
            a.dtype, ctx.settings.experiments, probe) else None
        stream = torch.cuda.current_stream(device) if native is None else None
        if native is not None:  # the call, its GEMMs and its finish in one library call (routes/gather_gemms.py)
            gather_gemms.fill(native, ctx.b, a, events, outs, cur,
                              gather_gemms.workspace(device, ctx.settings.experiments, ctx.capturing))
        if probe is not None:  # the timeline tool's call: its own timing events for the pulls, marks on cur
            events = probe_events(probe, p, launch.rank, geo.world)
            probe.mark("start", stream)
        # the set counted last, right before the library: nothing this rank alone may fail at comes between (a rank
        # that still ends up on another set than its peers waits out its bound: a fault, never a stale slot)
        slots = receive_slots(launch, ws, a.dtype) if push else None
        p.slot_set = next_slot_set(ctx.group, device) if push else 0
        shards = slots[p.slot_set] if push else staging  # what the GEMMs read shard j from
        if native is not None:
            rc, rc_finish = gather_gemms.run_call(lib, p, native, shards)
            if rc_finish != 0:
                unjoined(ws, (a, staging))
        else:
            rc = lib.fo_gather_call(ctypes.byref(p))
            try:
                if rc == 0:  # the GEMMs: the local shard's now, each pulled shard's after its event
                    if probe is not None:
                        probe.mark("gemm_start", stream)  # after cur's wait for the handshake, if any
                    for step, j in enumerate(schedule.arrival_order(launch.rank, geo.world)):
                        x = a
                        if step:
                            stream.wait_event(events[j])
                            x = shards[j]
                        for w, c, out in zip(ctx.b, bias, outs, strict=True):
                            schedule.shard_gemm(x, w, c, schedule.shard_view(out, geo, j))
                        if probe is not None:
                            probe.mark(f"gemm_done:{j}", stream)
            finally:  # joined and poisoned whatever happened above: the copy stream never outlives the call's tensors
                rc_finish = finish(lib, p, ws, (a, staging), NAME)
                if probe is not None:
                    probe.mark("end", stream)
                    put_events(p, ws.flags.events, launch.rank, geo.world)  # the memoized struct: the flags' again
        kernels.check(rc, "fo_gather_call" if native is None else "fo_gather_run")
        kernels.check(rc_finish, "fo_gather_finish")
        if not ctx.return_gathered:
            return outs
        return [*outs, schedule.assemble(staging, geo, list(ctx.y_shape))]

    def state(self) -> tuple[dict, dict]:
        return _flags, _workspaces

    def zero_state(self, key: tuple[int, str]) -> None:
        super().zero_state(key)
        _push_calls.pop(key, None)  # the sets' counters on the device are zero again: set 0 next, on every rank

    def reset(self) -> None:
        super().reset()
        _groups.clear()
        _push_calls.clear()
        for hook in _reset_hooks:  # e.g. moe_peer's structs, which point into what was dropped above
            hook()


ROUTE = GatherPeerRoute()
