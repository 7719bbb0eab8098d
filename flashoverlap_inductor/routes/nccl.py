"""The NCCL route (wave groups): a signal-GEMM on the caller's stream and, per wave group of output tiles, a bounded
wait then a plain NCCL collective on a side stream, joined back before the op returns. Any world size.

Per call shape (``make_launch``, memoized by the dispatcher): the schedule (``schedule.steps``: the same layout and
per-group transfers as the CPU route), the kernel configuration (the plan's, else the best compiled one for the
plan's tile), the tile-row order (``schedule.row_order``: "schedule" keeps A and the output in natural rows and runs
tile-rows in group order; "gather" copies A's rows into buffer order), the tile -> group map, the C steps and the
GEMM workspace size. Per call (``execute``): one host call into the library (``fo_fused_call``) enqueues the epoch
resync, the stream fork, the GEMM, every group's wait and NCCL call(s) on the process group's own communicator
(``nccl_direct``) on the side stream, and the join.

Declines (``unsupported`` / ``make_launch`` / ``execute`` reasons, the same on every rank): no library or sm90 GPU,
operands the kernels cannot take (``kernel_select.normalize_operands``), a plan of one group (nothing to overlap),
more groups than counters, no configuration compiled for the dtype, not every rank with the group's NCCL
communicator and the library bound to its NCCL (agreed once per group by a collective: ``agreed_communicator``), no
counter slot left.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels, nccl_direct
from flashoverlap_inductor.runtime import faults, nccl_watch, streams
from flashoverlap_inductor.runtime.kernel_select import (
    KernelChoice,
    a_is_kernel_ready,
    choose_kernel,
    gather_rows,
    gemm_grid,
    grid_ctas,
    nccl_max_ctas,
    sm_reserve,
)

from .. import _inductor_compat as compat
from ..cost_model import launch as model_launch
from ..schedule import plan as planlib
from ..schedule import row_order
from ..schedule import steps as schedule
from .base import note

log = logging.getLogger("flashoverlap")

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")  # GEMM -> collective: the signal-GEMM's
RASTER = kernels.RASTERS["along_n"]  # row-major tile order: tile-rows, hence groups, complete in order
SIGNAL_DEFERRED = kernels.SIGNAL_MODES["deferred"]


def kernel_infos() -> tuple[Any, ...]:
    """The plain configurations of the library the current settings name (memoized per library path)."""
    return _kernel_infos(str(kernels.library_path()))


@functools.lru_cache(maxsize=8)
def _kernel_infos(path: str) -> tuple[Any, ...]:
    return tuple(kernels.configs())


def unsupported_operands(call, settings: config.Settings) -> str | None:
    """The reasons every kernel route shares: no library or sm90 GPU, operands the kernels cannot take."""
    if call.dtype not in kernels.DTYPES:
        return f"dtype: {call.dtype} (the kernels are bf16/fp16)"
    if not kernels.available():  # never raises: a broken library means no kernel route
        return "library: the kernel library or an sm90 GPU is missing"
    if call.operand_issue is not None:  # (never set at compile time: the operands are not known yet)
        return f"{call.operand_issue[0]}: {call.operand_issue[1]}"
    return None


@dataclass(frozen=True)
class Launch:
    """Everything one call shape needs on the device."""

    collective: str
    kernel: KernelChoice
    index: int  # configuration index in the library
    gmap: torch.Tensor | None  # int32 [tile-rows]: group of each tile-row (None when this rank has no rows)
    gather: torch.Tensor | None  # int64 [rows]: source row of each buffer row (None = identity or "schedule")
    order: torch.Tensor | None  # int32 [tile-rows]: the scheduler's tile-row order (None = natural)
    rows_route: str  # "natural" (identity layout), "schedule" or "gather" (``row_order``)
    workspace_bytes: int
    sm_count: int
    swizzle: int
    description: str
    csteps: CSteps  # the steps as fo_fused_call takes them
    timeout_ns: int  # the bound of the call's waits (the settings', else the group's timeout)
    launch_id: int  # ``faults.launch_id``: names this shape in a fault


@dataclass(frozen=True)
class CSteps:
    """A call shape's steps as the C structures (kept alive by the launch that owns them)."""

    steps: ctypes.Array
    p2p: ctypes.Array | None
    groups: int

    @property
    def steps_ptr(self) -> int:
        return ctypes.addressof(self.steps)

    @property
    def p2p_ptr(self) -> int | None:
        return ctypes.addressof(self.p2p) if self.p2p is not None else None


def group_steps(collective: str, steps: Sequence[schedule.GroupStep], tiles: Sequence[int], n: int) -> CSteps:
    """``fo_group_step``/``fo_p2p_step`` arrays for ``steps`` (``schedule.schedule_steps``, or their natural-row form
    from ``row_order``) with the GEMM's ``tiles`` per group; offsets and counts in elements of the row-major
    [rows, N] buffer and output. all_to_all peers are group ranks (= the communicator's)."""
    arr = (kernels.GroupStep * len(steps))()
    p2p: list[tuple[int, int, int, int]] = []
    for g, step in enumerate(steps):
        s = arr[g]
        s.tiles = int(tiles[g])
        if collective == "all_reduce":
            s.kind = kernels.STEP_KINDS["all_reduce"] if step.hi > step.lo else kernels.STEP_KINDS["none"]
            s.buf_offset, s.count = step.lo * n, (step.hi - step.lo) * n
        elif collective == "reduce_scatter" and step.sends:  # natural rows: one ncclReduce per piece (row_order)
            s.kind, s.out_offset, s.first_p2p = kernels.STEP_KINDS["reduce_pieces"], step.out[0] * n, len(p2p)
            p2p += [(0, j, lo * n, (hi - lo) * n) for j, lo, hi in step.sends if hi > lo]
            s.num_p2p = len(p2p) - s.first_p2p
        elif collective == "reduce_scatter":
            s.kind = kernels.STEP_KINDS["reduce_scatter"] if step.hi > step.lo else kernels.STEP_KINDS["none"]
            s.buf_offset, s.out_offset = step.lo * n, step.out[0] * n
            s.count = (step.out[1] - step.out[0]) * n
        else:
            s.kind = kernels.STEP_KINDS["all_to_all"]
            s.first_p2p = len(p2p)
            p2p += [(0, j, lo * n, (hi - lo) * n) for j, lo, hi in step.sends if hi > lo]
            p2p += [(1, j, lo * n, (hi - lo) * n) for j, lo, hi in step.recvs if hi > lo]
            s.num_p2p = len(p2p) - s.first_p2p
            if step.local is not None:
                b_lo, o_lo, count = step.local
                s.local_buf, s.local_out, s.local_count = b_lo * n, o_lo * n, count * n
    p2p_arr = None
    if p2p:
        p2p_arr = (kernels.P2PStep * len(p2p))()
        for i, (recv, peer, offset, count) in enumerate(p2p):
            p2p_arr[i].recv, p2p_arr[i].peer, p2p_arr[i].offset, p2p_arr[i].count = recv, peer, offset, count
    return CSteps(arr, p2p_arr, len(steps))


_agreed: dict[tuple[int, int], tuple[dist.ProcessGroup, bool]] = {}


def is_nccl_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` has an NCCL backend (``"nccl"`` or ``"cpu:gloo,cuda:nccl"``)."""
    return "nccl" in str(dist.get_backend(group)).lower()


def agreed_communicator(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether every rank of ``group`` has its NCCL communicator and the library bound to that NCCL: agreed once
    per (group, device) by two collectives (the first also makes torch create the communicator, which it does at
    a group's first collective), so every rank takes or declines the route alike. Outside captures only."""
    key = (id(group), device.index)
    known = _agreed.get(key)
    if known is not None and known[0] is group:  # the group itself is kept alive: its id is not reused
        return known[1]
    if not is_nccl_group(group):  # a property of the group: the same on every rank
        _agreed[key] = (group, False)
        return False
    flag = torch.ones(1, dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    comm = nccl_direct.communicator(group, device)
    flag.fill_(int(comm is not None and nccl_direct.bind_library(comm)))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    ok = bool(flag.item())
    _agreed[key] = (group, ok)
    return ok


def grid_for(res: streams.DeviceResources, tuning: config.Tuning, group: dist.ProcessGroup, tiles: int) -> int:
    """CTAs of a GEMM of ``tiles`` tiles: the tuning's grid (else the data file's) on the device's SMs, less the
    reserve a persistent grid leaves to NCCL (the tuning's, else the group's NCCL cap + 2, else the data file's)."""
    grid = gemm_grid(tuning.gemm_grid, lambda: model_launch.fused_grid(res.name))
    reserve = sm_reserve(tuning.sm_reserve, nccl_max_ctas(group),
                         lambda: model_launch.fused_nccl_sms(res.name)) if grid == "persistent" else 0
    return grid_ctas(grid, res.sm_count, tiles, reserve)


class NcclRoute:
    name = "nccl"
    devices = ("cuda",)
    collectives = COLLECTIVES
    last_resort = False

    def unsupported(self, call, settings: config.Settings) -> str | None:
        if call.collective not in COLLECTIVES:
            return f"{call.collective} has no wave-group route"
        if call.dtype not in nccl_direct.NCCL_DTYPES:
            return f"dtype: no NCCL type for {call.dtype}"
        return unsupported_operands(call, settings)

    def make_launch(self, call, settings: config.Settings, ctx) -> Launch | str:
        tuning, res, group, n = settings.tuning, ctx.res, ctx.group, call.n
        dname, rows, k, world = call.dtype_name, call.rows, call.k, call.world
        a2a = settings.all_to_all_default_groups
        sched = schedule.resolve_schedule(call.collective, call.plan, rows, n, k, dname, world, call.send_rows,
                                          call.recv_rows, a2a)
        steps = schedule.schedule_steps(call.collective, call.plan, rows, n, k, dname, world, call.rank,
                                        call.send_rows, call.recv_rows, a2a)
        groups = len(steps)
        if groups > streams.MAX_GROUPS:
            return f"too_many_groups: {groups} groups > {streams.MAX_GROUPS}"
        if groups < 2 and "single_group" not in settings.experiments:
            return "single_group: the plan has one group: nothing to overlap"
        tile = (sched.plan.tile_m, sched.plan.tile_n) if sched.plan is not None else None
        plan_kernel = sched.plan.kernel if sched.plan is not None else ""
        choice = choose_kernel(kernel_infos(), plan_kernel, tile, dname, call.b_layout,
                               model_launch.preferred_kernels(res.name, settings.config_dir))
        if choice is None:
            return f"no_config: no configuration compiled for {dname}"
        if choice.convert_b:
            note(f"convert_b:{choice.name}:{call.b_layout}", logging.WARNING, "flashoverlap: B with layout %s is "
                 "copied into layout %s on every call (configuration %s is compiled only for that)",
                 call.b_layout or "strided", choice.b_layout, choice.name)
        index = kernels.config_index(choice.name, call.dtype, choice.b_layout)
        sm_count = grid_for(res, tuning, group, -(-rows // choice.tile_m) * -(-n // choice.tile_n))
        device = ctx.a.device
        gmap = gather = order = None
        tiles = (0,) * groups
        route = "natural"
        bounds = sched.layout.group_bounds
        rows_route = row_order.route(tuning.row_order, call.collective, world)
        if rows and not sched.layout.is_identity and rows_route != "gather":
            nat = row_order.natural_order(call.collective, sched.layout, steps, choice.tile_m, choice.tile_n, n)
            if isinstance(nat, str):
                log.info("flashoverlap: %s gathers A's rows: %s", call.collective, nat)
            else:
                route, tiles, steps = rows_route, nat.tiles, nat.steps
                gmap, order = streams.persistent(res.index, lambda: (
                    torch.tensor(nat.group_of_row, dtype=torch.int32, device=device),
                    torch.tensor(nat.order, dtype=torch.int32, device=device)))
        if rows and route == "natural":
            tiles = tuple(planlib.tiles_per_group(bounds, choice.tile_m, choice.tile_n, n))
            src = gather_rows(sched.layout)
            route = "gather" if src is not None else route
            gmap, gather = streams.persistent(res.index, lambda: (
                torch.tensor(planlib.group_of_tile_row(bounds, choice.tile_m), dtype=torch.int32, device=device),
                torch.tensor(src, dtype=torch.int64, device=device) if src is not None else None))
        workspace = kernels.workspace_bytes(index, rows, n, k, sm_count, RASTER, tuning.swizzle) if rows else 0
        desc = (f"{call.collective} rows={rows} n={n} k={k} {dname}: {groups} groups, tiles {list(tiles)}, kernel "
                f"{choice.name} ({choice.b_layout}), {sm_count} CTAs on {res.sm_count} SMs, rows {route}, "
                f"{sched.description}")
        if not agreed_communicator(group, ctx.a.device):
            return "no_communicator: not every rank has the group's NCCL communicator and the library bound to it"
        log.info("flashoverlap: launch %s", desc)
        return Launch(call.collective, choice, index, gmap, gather, order, route, workspace, sm_count,
                      tuning.swizzle, desc, group_steps(call.collective, steps, tiles, n),
                      settings.timeout_ns(compat.group_timeout_ms(group)), faults.launch_id(desc))

    def execute(self, launch: Launch, ctx) -> torch.Tensor | str:
        opnd, res, group = ctx.opnd, ctx.res, ctx.group
        a, b = opnd.a, opnd.b
        comm = nccl_direct.communicator(group, a.device)
        if comm is None:  # the ranks agreed it exists (make_launch): declining here alone would hang the others
            raise RuntimeError(f"flashoverlap: the NCCL communicator of group {getattr(group, 'group_name', group)} "
                               "disappeared after every rank agreed to use it")
        cur = compat.current_raw_stream(a.device.index)
        slot = res.slot(cur, dedicated=ctx.capturing)
        if slot is None:
            return f"slots: more than {streams.MAX_SLOTS} caller streams on one device"
        rows, k, n = a.shape[0], a.shape[1], b.shape[1]
        out = torch.empty(ctx.out_shape, dtype=a.dtype, device=a.device)
        out_flat = out.view(-1, n)
        d = out_flat if launch.collective == "all_reduce" else torch.empty(rows, n, dtype=a.dtype, device=a.device)
        a_in = b_in = workspace = None
        ldb = 0
        if rows:
            a_in = a.index_select(0, launch.gather) if launch.gather is not None else row_major(a)
            b_in, ldb = kernel_b(b, launch.kernel)
            workspace = torch.empty(launch.workspace_bytes, dtype=torch.uint8, device=a.device) \
                if launch.workspace_bytes else None
        dom = slot_domain(res, slot)
        started = None
        if not ctx.capturing:  # the host watchdog's start: the device has reached this call
            started = torch.cuda.Event()
            started.record(torch.cuda.current_stream(a.device))
        try:
            fused_call(launch.index, a_in, b_in, ldb, opnd.bias, d, d, rows, k, launch.gmap, launch.order,
                       SIGNAL_DEFERRED, launch.sm_count, RASTER, launch.swizzle, workspace,
                       res.counters[slot].data_ptr(), res.expected[slot].data_ptr(), launch.csteps, out_flat,
                       nccl_direct.NCCL_DTYPES[a.dtype], comm.comm, launch.timeout_ns, dom, launch.launch_id,
                       group.rank(), cur, res.side.cuda_stream)
        except kernels.KernelLibraryError as exc:
            if 300 <= getattr(exc, "code", 0) < 400:  # NCCL refused a call: peers may wait on it; abort the group
                aborted = nccl_direct.abort(group)
                raise kernels.KernelLibraryError(
                    f"flashoverlap: NCCL failed inside a fused {launch.collective} ({launch.description}); the "
                    f"process group {getattr(group, 'group_name', '?')} was {'aborted' if aborted else 'NOT aborted'}"
                    f" so that no rank waits forever: {exc}") from exc
            raise
        if not ctx.capturing:  # NCCL's kernels have no bound of ours: the host watchdog gives the call one
            # on the side stream, after the call's NCCL kernels: the caller's stream also holds this rank's GEMM,
            # which the wait bound does not cover (a late GEMM would get a healthy group aborted)
            done = torch.cuda.Event()
            done.record(res.side)
            nccl_watch.watchdog().watch(started, done, launch.timeout_ns * 1e-9, group, dom, launch.description)
        return out

    def reset(self) -> None:
        _agreed.clear()
        _kernel_infos.cache_clear()
        model_launch.preferred_kernels.cache_clear()


def slot_domain(res: streams.DeviceResources, slot: int) -> faults.FaultDomain:
    """The NCCL route's fault domain of a counter slot (its block in ``res.faults``)."""
    return faults.domain(("nccl", res.index, slot), lambda: faults.FaultDomain(
        res.index, "nccl", f"(caller stream slot {slot})", res.faults[slot], res.mirrors[slot]))


def fused_call(index: int, a: torch.Tensor | None, b: torch.Tensor | None, ldb: int, bias: torch.Tensor | None,
               d: torch.Tensor, buf: torch.Tensor, rows: int, k: int, gmap: torch.Tensor | None,
               order: torch.Tensor | None, signal_mode: int, sm_count: int, raster: int, swizzle: int,
               workspace: torch.Tensor | None, counters_ptr: int, expected_ptr: int, csteps: CSteps,
               out: torch.Tensor, nccl_dtype: int, comm: int, timeout_ns: int, dom: faults.FaultDomain,
               launch_id: int, rank: int, cur_ptr: int, side_ptr: int) -> None:
    """The whole fused op (``fo_fused_call``): GEMM ``d = a @ b (+ bias)`` on ``cur_ptr`` (skipped when ``rows`` is
    0; tile-rows in ``order``), every group's wait and NCCL call(s) on ``side_ptr``, the fault exchange and the
    fault kernel (``dom``), then the join. Sizes in elements, ``timeout_ns`` in ns."""
    rc = kernels.library().fo_fused_call(
        index, a.data_ptr() if a is not None else None, a.stride(0) if a is not None else 0,
        b.data_ptr() if b is not None else None, ldb, bias.data_ptr() if bias is not None else None,
        d.data_ptr(), buf.data_ptr(), d.stride(0), rows, d.shape[1], k,
        gmap.data_ptr() if gmap is not None else None, order.data_ptr() if order is not None else None,
        signal_mode, sm_count, raster, swizzle, workspace.data_ptr() if workspace is not None else None,
        workspace.numel() if workspace is not None else 0, counters_ptr, expected_ptr, csteps.groups,
        csteps.steps_ptr, csteps.p2p_ptr, out.data_ptr(), buf.element_size(), nccl_dtype, comm, timeout_ns,
        dom.block_ptr, dom.mirror_ptr, launch_id, out.numel(), rank, cur_ptr, side_ptr)
    kernels.check(rc, "fo_fused_call")


def row_major(a: torch.Tensor) -> torch.Tensor:
    return a if a_is_kernel_ready(a) else a.clone(memory_format=torch.contiguous_format)


def kernel_b(b: torch.Tensor, choice: KernelChoice) -> tuple[torch.Tensor, int]:
    """B in the layout the kernel reads, and its leading dimension (elements); copied where the launch converts
    its layout or its pointer is not 16-byte aligned (TMA's base alignment)."""
    if choice.convert_b or b.data_ptr() % 16:
        if choice.b_layout == "nk":
            b = b.t().clone(memory_format=torch.contiguous_format).t()
        else:
            b = b.clone(memory_format=torch.contiguous_format)
    return b, (b.stride(1) if choice.b_layout == "nk" else b.stride(0))


ROUTE = NcclRoute()
