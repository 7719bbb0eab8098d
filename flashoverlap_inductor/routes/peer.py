"""The peer route of the fused reduce_scatter / all_reduce on two GPUs of one NVLink host: the reduction inside the
GEMM's epilogue.

Rank r owns rows ``[r * M/2, (r + 1) * M/2)`` of the ``[M, N]`` result (reduce_scatter's own chunk). Per call
(``fo_peer_call``, ``csrc/peer_call.cu``, one host call):

1. GEMM 1: A's rows that the *peer* owns, its tiles stored by TMA over NVLink straight into the peer's ``partial``
   region of symmetric memory.
2. Tell the peer (a system-scope flag in its memory).
3. GEMM 2 (an ``_addc`` configuration): A's own rows, with the peer's partial of them added in the epilogue as
   CUTLASS's C operand, loaded by TMA from local memory; each tile first waits (bounded) for the peer's flag.
   reduce_scatter: into the output, then one flag each way (the peer's GEMM 2, which read what this rank's GEMM 1
   wrote, is done).
4. all_reduce, by push (where an ``_addc_aux`` / ``_addc_auxr`` configuration is compiled): GEMM 2 writes the
   output's own rows and stores the same tiles into the peer's ``own`` (landing) buffer; after it, one flag each
   way, and a copy on the SMs GEMM 2 has freed moves this rank's landing buffer into the output's other half. By
   pull (where only plain ``_addc`` configurations are compiled, or ``peer_kernel`` names one): GEMM 2 writes the
   symmetric ``own`` buffer, signalling wave groups, and per group the copy engine pulls the peer's rows.

The sum is rounded as NCCL rounds it for two ranks: both partials are rounded to the output dtype, then added in
fp32 and rounded once, and every element's final value is computed once and copied to the other rank.

Symmetric memory of one (device, group): a flag page (``FLAG_BYTES``, made once) and workspaces of two regions,
``[partial | own]``, each ``capacity`` bytes (``symmetric.smallest_with_room``). Every call of a shape uses the same
regions and ends with a flag exchange that proves the peer has read what the next call overwrites (the argument is in
``csrc/flashoverlap_sm90.h``), so a call replayed from a CUDA graph needs no host state; flag epochs live on the
device (``Flags.expected``), so eager calls and graph replays interleave freely on one stream.

Per call shape and workspace, the launch holds the whole ``fo_peer_args`` but the operands', the output's and the
stream's pointers (``PeerLaunch.args``), and a GEMM workspace of its own: the per-call path copies that struct,
fills five pointers and makes one library call. A call with a probe (``Context.probe``: the timeline tool's,
``python -m flashoverlap_inductor.bench timeline --op reduce_scatter``) also gets timing events at its points
(``probe_points``, ``fo_peer_args.probe_events``), null again after it; every other call's are null.

Variants measured and removed (docs/results.md): GEMM 2 pulling the peer's partial over NVLink, a wait kernel between
the GEMMs instead of the epilogue's gate, the final copy by copy engine.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import faults, streams

from .. import _inductor_compat as compat
from ..cost_model.schema import ROUTE_COLLECTIVES
from ..schedule import plan as planlib
from . import nccl, symmetric

log = logging.getLogger("flashoverlap")

# GEMM 2's configuration when ``peer_kernel`` names none, by measurement (docs/results.md, ninth session):
# reduce_scatter with a 128x64 epilogue subtile, all_reduce by push with the aux tile stored by TMA.
PREFERRED = ("coop_128x256x64_c2x1_e128x64_addc", "coop_128x256x64_c2x1_e128x32_addc_aux")
MAX_GROUPS = 64  # FO_PEER_MAX_GROUPS of csrc/flashoverlap_sm90.h
PULL_GROUPS = 8  # all_reduce by pull: copy groups of GEMM 2's rows (at most)
FLAG_BYTES = 4096
FAULT_OFFSET = 2048  # the group's fo_fault block in the flag page (bytes; the flags use the first 1 + 64 ints)
COLLECTIVES = ROUTE_COLLECTIVES
# fo_peer_args.probe_events (FO_PEER_PROBE_*): the timeline probe's points on cur, then per copy group g (g <
# PROBE_GROUPS) the pull stream's (PROBE_PULL + g) and the side stream's (PROBE_SIDE + g)
PROBE_CUR = {"gemm1": 0, "notify": 1, "gemm2": 2, "exchange": 3, "copy": 4}
PROBE_PULL, PROBE_GROUPS = 8, 8
PROBE_SIDE = PROBE_PULL + PROBE_GROUPS
PROBE_EVENTS = PROBE_SIDE + PROBE_GROUPS


class PeerArgs(ctypes.Structure):
    """``fo_peer_args`` of ``csrc/flashoverlap_sm90.h`` (pointers as ints; sizes in elements)."""

    _fields_ = [("config_partial", ctypes.c_int32), ("config_add", ctypes.c_int32), ("a", ctypes.c_void_p),
                ("lda", ctypes.c_int64), ("b", ctypes.c_void_p), ("ldb", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("rows", ctypes.c_int32), ("own_row", ctypes.c_int32),
                ("peer_row", ctypes.c_int32), ("num_groups", ctypes.c_int32), ("partial", ctypes.c_void_p),
                ("peer_partial", ctypes.c_void_p), ("own_dst", ctypes.c_void_p), ("ld_own", ctypes.c_int64),
                ("flags", ctypes.c_void_p), ("peer_flags", ctypes.c_void_p), ("expected", ctypes.c_void_p),
                ("group_rows", ctypes.c_void_p), ("group_tiles", ctypes.c_void_p), ("counters", ctypes.c_void_p),
                ("group_of_tile_row", ctypes.c_void_p), ("peer_own", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("ld_out", ctypes.c_int64), ("elem_bytes", ctypes.c_int32), ("signal_mode", ctypes.c_int32),
                ("sm_count", ctypes.c_int32), ("raster", ctypes.c_int32), ("swizzle", ctypes.c_int32),
                ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_size_t), ("timeout_ns", ctypes.c_int64),
                ("fault", ctypes.c_void_p), ("cur_stream", ctypes.c_void_p), ("side_stream", ctypes.c_void_p),
                ("pull_stream", ctypes.c_void_p), ("push", ctypes.c_int32), ("copy_on_sms", ctypes.c_int32),
                ("gate_in_kernel", ctypes.c_int32), ("mirror", ctypes.c_void_p), ("launch_id", ctypes.c_int32),
                ("probe_events", ctypes.c_void_p * PROBE_EVENTS)]


@dataclass
class Flags:
    """The flag page of one (device, group): this rank's flags, the peer's mapped here, the device epochs."""

    buf: torch.Tensor  # uint8 [FLAG_BYTES], symmetric
    hdl: object
    peer_base: int  # the peer's flag page, mapped here
    peer_view: torch.Tensor  # keeps the peer's mapping alive
    expected: torch.Tensor  # int32 [1 + 2 * MAX_GROUPS]: flag epochs, then counter targets (csrc contract)
    pull: torch.cuda.Stream  # all_reduce by pull: the copy stream of the peer's rows
    fault: faults.FaultDomain  # the group's fault block (in ``buf``), which the peer's waits also write


@dataclass
class Workspace:
    """The symmetric regions of one (device, group) and the peer's mapping of its own (bytes)."""

    capacity: int  # bytes per region (partial, own)
    buf: torch.Tensor  # uint8 [2 * capacity], symmetric
    hdl: object
    peer_base: int  # the peer's workspace, mapped here
    peer_view: torch.Tensor  # keeps the peer's mapping alive
    flags: Flags
    serial: int = 0  # ``symmetric.next_serial()``: the key of the argument structs made for it

    def regions(self) -> tuple[int, int, int, int]:
        """(partial, own, peer's partial, peer's own) pointers; the same for every call."""
        base = self.buf.data_ptr()
        return base, base + self.capacity, self.peer_base, self.peer_base + self.capacity


_flags: dict[tuple[int, str], Flags] = {}
_workspaces: dict[tuple[int, str], list[Workspace]] = {}  # ascending capacity; kept until ``reset``


def flags(group: dist.ProcessGroup, device: torch.device) -> Flags:
    """The cached flag page of (device, group); made (collectively, zeroed) on first use."""
    key = (device.index, group.group_name)
    f = _flags.get(key)
    if f is None:
        buf, hdl, views = symmetric.symmetric(FLAG_BYTES, group, device, True, [1 - group.rank()])
        expected = streams.persistent(device.index,
                                      lambda: torch.zeros(1 + 2 * MAX_GROUPS, dtype=torch.int32, device=device))
        dom = symmetric.fault_domain("peer", group, device, buf, FAULT_OFFSET, [views[0].data_ptr()])
        f = _flags[key] = Flags(buf, hdl, views[0].data_ptr(), views[0], expected,
                                torch.cuda.Stream(device=device, priority=-100), dom)
    return f


def workspace(group: dist.ProcessGroup, device: torch.device, region_bytes: int,
              capturing: bool = False) -> Workspace | None:
    """The smallest workspace of (device, group) with at least ``region_bytes`` per region (made collectively when
    none has room; None instead inside a capture)."""

    def make(capacity: int) -> Workspace:
        f = flags(group, device)
        buf, hdl, views = symmetric.symmetric(2 * capacity, group, device, False, [1 - group.rank()])
        log.info("flashoverlap peer: symmetric workspace of 2 x %d MiB on %s, group %s", capacity >> 20, device,
                 group.group_name)
        return Workspace(capacity, buf, hdl, views[0].data_ptr(), views[0], f, symmetric.next_serial())

    return symmetric.smallest_with_room(_workspaces.setdefault((device.index, group.group_name), []), region_bytes,
                                        capturing, make)


@dataclass
class PeerLaunch:
    """What one call shape needs: the shape's fields of ``fo_peer_args`` (``template``) and, per workspace it ran
    with, the args with every pointer but the call's own filled in (``args``)."""

    collective: str
    kernel: nccl.KernelChoice  # GEMM 1's configuration (B's layout)
    rows: int  # rows per rank (M / 2)
    groups: int  # all_reduce copy groups (0: reduce_scatter or all_reduce by push)
    group_rows: ctypes.Array
    group_tiles: ctypes.Array
    gmap: torch.Tensor | None
    gemm_workspace: torch.Tensor | None  # the GEMMs' workspace, reused: a group's routed calls run one at a time
    region_bytes: int  # bytes per symmetric workspace region
    description: str
    push: bool  # all_reduce by push (GEMM 2 also stores into the peer's landing buffer)
    template: PeerArgs
    args: dict[tuple[int, int], PeerArgs] = field(default_factory=dict)  # (workspace serial, slot) -> args
    launch_id: int = 0  # ``faults.launch_id``


def unsupported(call, settings: config.Settings) -> str | None:
    """Why ``call`` cannot take the peer route (None: it can). Pure; depends only on what all ranks share."""
    if settings.transport != "peer":
        return "transport is 'nccl'"
    if call.collective not in COLLECTIVES:
        return f"{call.collective} has no peer route"
    if call.world != 2:
        return f"world size {call.world} (the peer route is for 2 ranks)"
    if settings.ring == "all":
        return "ring='all' puts 2-rank groups on the ring"
    if call.rows % 2 or call.rows < 2:
        return f"{call.rows} rows do not split into two equal halves"
    why = nccl.unsupported_operands(call, settings)
    if why is not None:
        return why
    return missing_addc(call)


def missing_addc(call) -> str | None:
    """Why no ``_addc`` configuration fits ``call``'s dtype and B layout (any layout at compile time)."""
    layouts = ("nk", "kn") if call.compile_time or call.b_layout is None else (call.b_layout,)
    try:
        add = kernels.configs(add_c=True)
    except Exception as exc:  # no library: the NCCL route declines too
        return f"the kernel library cannot be read ({exc!r})"
    if not any((call.dtype_name, lay) in c.variants for c in add for lay in layouts):
        return f"no _addc configuration compiled for {call.dtype_name} with B as {call.b_layout}"
    if not call.compile_time and call.b_layout is None:
        return "B's strides are not a layout the _addc kernels read"
    return None


def group_bounds(rows: int, tile_m: int, swizzle: int, groups: int) -> list[int]:
    """Row boundaries of the all_reduce copy groups over GEMM 2's ``rows``: whole bands of ``swizzle`` tile-rows
    (the scheduler completes a band's tiles together), at most ``groups`` of them, the larger ones first."""
    unit = tile_m * max(1, swizzle)
    units = -(-rows // unit)
    g = max(1, min(groups, units, MAX_GROUPS))
    sizes = [units // g + (1 if i < units % g else 0) for i in range(g)]
    bounds = [0]
    for s in sizes:
        bounds.append(min(rows, bounds[-1] + s * unit))
    return bounds


def plain_choice(call) -> nccl.KernelChoice | str:
    """GEMM 1's configuration: the runtime's choice for the call's dtype and B layout, never a B copy."""
    choice = nccl.choose_kernel(nccl.kernel_infos(), "", None, call.dtype_name, call.b_layout, {})
    if choice is None or choice.convert_b:
        return f"no_config: no plain configuration compiled for {call.dtype_name} with B as {call.b_layout}"
    return choice


def make_launch(call, settings: config.Settings, ctx) -> PeerLaunch | str:
    """The launch of one call shape: GEMM 1 in the runtime's plain configuration, GEMM 2 in the matching ``_addc``
    one (``peer_kernel``, else ``PREFERRED``, else the same tile), the copy groups (all_reduce by pull), the grid."""
    choice = plain_choice(call)
    if isinstance(choice, str):
        return choice
    res, tuning = ctx.res, settings.tuning
    dtype, dname, layout, n, k = call.dtype, call.dtype_name, choice.b_layout, call.n, call.k
    plain = kernels.config_index(choice.name, dtype, layout)
    pull = [c for c in kernels.configs(add_c=1) if (dname, layout) in c.variants]
    pushing = [c for level in (2, 3) for c in kernels.configs(add_c=level) if (dname, layout) in c.variants]
    if call.collective == "all_reduce" and pushing and not any(c.name == tuning.peer_kernel for c in pull):
        cands = pushing  # all_reduce by push unless peer_kernel names a pull configuration
    else:
        cands = pull
    named = [c for c in cands if c.name == tuning.peer_kernel]
    preferred = [c for name in PREFERRED for c in cands if c.name == name]
    same = [c for c in cands if (c.tile_m, c.tile_n) == (choice.tile_m, choice.tile_n)]
    pick = (named or preferred or same or cands)[0]
    push = pick in pushing
    add = kernels.config_index(pick.name, dtype, layout)
    half = call.rows // 2
    own_row, peer_row = call.rank * half, (1 - call.rank) * half
    sm_count = nccl.grid_for(res, tuning, ctx.group, -(-half // pick.tile_m) * -(-n // pick.tile_n))
    copies = call.collective == "all_reduce" and not push
    bounds = group_bounds(half, pick.tile_m, tuning.swizzle, PULL_GROUPS) if copies else [0, half]
    groups = len(bounds) - 1 if copies else 0
    group_rows = (ctypes.c_int32 * len(bounds))(*bounds)
    group_tiles = (ctypes.c_int32 * max(1, groups))(*planlib.tiles_per_group(bounds, pick.tile_m, pick.tile_n, n)) \
        if groups else (ctypes.c_int32 * 1)()
    device = ctx.a.device
    gmap = streams.persistent(res.index, lambda: torch.tensor(planlib.group_of_tile_row(bounds, pick.tile_m),
                                                              dtype=torch.int32, device=device)) if groups else None
    ws = max(kernels.workspace_bytes(plain, half, n, k, sm_count, nccl.RASTER, tuning.swizzle),
             kernels.workspace_bytes(add, half, n, k, sm_count, nccl.RASTER, tuning.swizzle))
    gemm_ws = streams.persistent(res.index, lambda: torch.empty(ws, dtype=torch.uint8, device=device)) if ws else None
    how = "push" if push else f"{groups} copy groups {bounds}"
    desc = (f"{call.collective} rows={call.rows} n={n} k={k} {dname}: peer route, GEMM 2 {pick.name}, "
            f"{how if call.collective == 'all_reduce' else 'reduce_scatter'}, {sm_count} CTAs")
    log.info("flashoverlap: launch %s", desc)
    t = PeerArgs()
    t.config_partial, t.config_add = plain, add
    t.n, t.k, t.rows, t.own_row, t.peer_row, t.num_groups = n, k, half, own_row, peer_row, groups
    t.group_rows, t.group_tiles = ctypes.addressof(group_rows), ctypes.addressof(group_tiles)
    t.group_of_tile_row = gmap.data_ptr() if gmap is not None else None
    t.push, t.elem_bytes, t.sm_count, t.workspace_bytes = int(push), dtype.itemsize, sm_count, ws
    t.workspace = gemm_ws.data_ptr() if gemm_ws is not None else None
    t.signal_mode, t.raster, t.swizzle = nccl.SIGNAL_DEFERRED, nccl.RASTER, tuning.swizzle
    t.copy_on_sms, t.gate_in_kernel = 1, 1
    t.timeout_ns = settings.timeout_ns(compat.group_timeout_ms(ctx.group))
    t.launch_id = faults.launch_id(desc)
    t.side_stream = res.side.cuda_stream
    return PeerLaunch(call.collective, choice, half, groups, group_rows, group_tiles, gmap, gemm_ws,
                      half * n * dtype.itemsize, desc, push, t, launch_id=t.launch_id)


def args_for(launch: PeerLaunch, ws: Workspace, res: streams.DeviceResources, slot: int) -> PeerArgs:
    """The launch's args with the workspace's, the flags' and the counter slot's pointers (memoized per workspace:
    a call shape maps to one workspace for good)."""
    key = (ws.serial, slot)
    p = launch.args.get(key)
    if p is None:
        p = PeerArgs.from_buffer_copy(launch.template)
        partial, own, peer_partial, peer_own = ws.regions()
        p.partial, p.peer_partial = peer_partial, partial  # GEMM 1 pushes into the peer; GEMM 2 adds its own region
        ar = launch.collective == "all_reduce"
        if ar:
            p.own_dst, p.ld_own, p.peer_own = own, launch.template.n, peer_own  # own: the landing buffer
        f = ws.flags
        p.flags, p.peer_flags, p.expected = f.buf.data_ptr(), f.peer_base, f.expected.data_ptr()
        p.fault, p.mirror = f.fault.block_ptr, f.fault.mirror_ptr
        p.counters = res.counters[slot].data_ptr() if launch.groups else None
        p.pull_stream = f.pull.cuda_stream
        launch.args[key] = p
    return p


def probe_points(launch: PeerLaunch) -> list[tuple[int, str, str]]:
    """The timeline probe's points that a call of ``launch`` records: (``probe_events`` index, mark name, lane).
    On ``compute`` (cur) ``gemm1``, ``notify``, ``gemm2``, then ``exchange`` (reduce_scatter, push: after the flag
    exchange) or ``join`` (pull: cur joined the side and pull streams), and ``copy`` (push: the final copy); by pull
    per copy group g < ``PROBE_GROUPS`` ``pull:<g>`` (lane ``pull``) and ``side:<g>`` (lane ``side``)."""
    out = [(PROBE_CUR[name], name, "compute") for name in ("gemm1", "notify", "gemm2")]
    out.append((PROBE_CUR["exchange"], "join" if launch.groups else "exchange", "compute"))
    if launch.push:
        out.append((PROBE_CUR["copy"], "copy", "compute"))
    for g in range(min(launch.groups, PROBE_GROUPS)):
        out += [(PROBE_PULL + g, f"pull:{g}", "pull"), (PROBE_SIDE + g, f"side:{g}", "side")]
    return out


class PeerRoute(symmetric.SymmetricRoute):
    name = "peer"
    c_function = "fo_peer_call"

    unsupported = staticmethod(unsupported)
    make_launch = staticmethod(make_launch)

    def workspace_for(self, launch: PeerLaunch, ctx) -> Workspace | None:
        return workspace(ctx.group, ctx.a.device, launch.region_bytes, ctx.capturing)

    def args_for(self, launch: PeerLaunch, ws: Workspace, res, slot: int) -> PeerArgs:
        return args_for(launch, ws, res, slot)

    def slot_needed(self, launch: PeerLaunch) -> bool:
        return bool(launch.groups)  # all_reduce by pull signals copy groups

    def finish(self, p: PeerArgs, launch: PeerLaunch) -> None:
        if launch.collective != "all_reduce":  # reduce_scatter: GEMM 2 writes the output
            p.own_dst, p.ld_own = p.out, p.ld_out

    def probe_events(self, probe, p: PeerArgs, launch: PeerLaunch) -> None:
        """The probe's timing events (``probe.events_for``) at this call's points (``probe_points``); every slot
        null when ``probe`` is None."""
        for i in range(PROBE_EVENTS):
            p.probe_events[i] = None
        if probe is None:
            return
        points = probe_points(launch)
        for lane in dict.fromkeys(lane for _, _, lane in points):
            mine = [(i, name) for i, name, la in points if la == lane]
            for (i, _), ev in zip(mine, probe.events_for([name for _, name in mine], lane), strict=True):
                p.probe_events[i] = ev.cuda_event

    def state(self) -> tuple[dict, dict]:
        return _flags, _workspaces


ROUTE = PeerRoute()
