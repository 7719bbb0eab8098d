"""The overlapped CUDA path of the fused ops: a signal-GEMM on the caller's stream, and per wave group a bounded
wait then a plain NCCL collective on a side stream, joined back before the op returns.

Same entry points and semantics as ``runtime_cpu``/``runtime_cuda`` (see ``ops``). Per call, on ``a``'s device:

1. Operands: ``y = a @ b (+ bias)`` as ``[rows, K] @ [K, N] (+ [N])``: a 3D ``a`` is flattened; a bmm whose ``b`` is
   one expanded (stride-0) matrix uses that matrix; ``b`` as a Linear weight view ([N,K] storage, the kernel's
   "nk") or row-major [K,N] ("kn"), other strides are copied.
2. Launch (memoized per call shape): the schedule of ``ops.resolve_schedule`` and ``runtime_cpu.schedule_steps``
   (the same layout and per-group collectives as the CPU path), the kernel configuration (the plan's, else the
   best compiled one for the plan's tile), ``plan.group_of_tile_row`` / ``plan.tiles_per_group`` with the kernel's
   tile, the row index that gathers A's rows in buffer order (reduce_scatter / all_to_all layouts), the workspace.
3. Caller's stream: ``expected := counters`` (epoch resync, see ``streams``), fork to the side stream, signal-GEMM
   into the buffer: one CTA per tile on every SM (grid "tiles", the H200 default: SMs freed by finished tiles go
   to NCCL's higher-priority kernels first) or one persistent CTA per SM on ``sm_count - sm_reserve`` SMs
   (``kernel_select.grid_ctas``).
4. Side stream, per group: the wait for the group's tiles, then its collective on the group's contiguous rows:
   all_reduce in place, reduce_scatter into this rank's output rows, all_to_all as grouped send/recv straight into
   the output plus a local copy. The collectives are direct NCCL calls on the process group's own communicator
   (``nccl_direct``), else ``torch.distributed`` calls.
5. The caller's stream waits for the side stream.

With the direct route, steps 3-5 are one host call into the library (``fused_launch``, ``fo_fused_call``).
With ``peer_route.TRANSPORT == "peer"``, a call tries ``runtime_peer.run`` first (None: the NCCL route).

Unfused fallback (``runtime_cuda``; logged once per reason, counted in ``stats["fallback:<reason>"]``): the library
or an sm90 GPU missing, fp32, N or K not multiples of 8, a batch of distinct ``b`` matrices, a bias varying along
rows, empty sizes, a plan of one group, no compiled configuration, a new call shape first seen while capturing.
Every such decision depends only on what all ranks share (shapes -- except all_to_all's rows, which never decide
--, dtype, strides, plan, call history), so all ranks issue the same collectives.

Timeouts: a wait that gives up records it; the next call on the device (or ``check()``) raises
``kernels.FlashOverlapTimeout``.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import config, fused_launch, kernels, nccl_direct, ops, peer_route, row_order, runtime_cpu, runtime_cuda, streams
from . import plan as planlib
from .group_comm import group_collective
from .kernel_select import (
    KernelChoice,
    Operands,
    a_is_kernel_ready,
    b_layout,
    choose_kernel,
    gather_rows,
    gemm_grid,
    grid_ctas,
    nccl_max_ctas,
    normalize_operands,
    preferred_kernels,
    sm_reserve,
)
from .runtime_peer import launches as _peer_launches  # the same dict (tests read it here; reset() clears it)
from .runtime_peer import run as run_peer

log = logging.getLogger("flashoverlap")

# SMs the GEMM leaves to NCCL; None = $FLASHOVERLAP_SM_RESERVE, else the cost model's ``fused.nccl_sms``.
SM_RESERVE: int | None = None
SIGNAL_MODE: str = os.environ.get("FLASHOVERLAP_SIGNAL_MODE", "deferred")  # or "immediate"
SWIZZLE: int = int(os.environ.get("FLASHOVERLAP_SWIZZLE", str(kernels.DEFAULT_SWIZZLE)))
RASTER = "along_n"  # row-major tile order: tile-rows, hence groups, complete in order
# The fused GEMM's grid ("persistent" | "tiles", ``kernel_select.gemm_grid``); None = $FLASHOVERLAP_GEMM_GRID, else
# the cost model's ``fused.grid``.
GEMM_GRID: str | None = None
# reduce_scatter / all_to_all layouts: "schedule" (tile-row order in the GEMM's scheduler, A and the output in
# natural row order), "stage" (the same with reduce_scatter staged by copies) or "gather" (A's rows copied into
# buffer order first); None = $FLASHOVERLAP_ROW_ORDER, else the measured default (``row_order.route``).
ROW_ORDER: str | None = None
# A kernel configuration every fused GEMM uses instead of the plan's (experiments; None = the plan's / preferred).
KERNEL: str | None = os.environ.get("FLASHOVERLAP_KERNEL") or None
# Diagnostics only (``examples/bench_ops.py`` host field "gemm"): run the fused path's GEMM (gather, signal GEMM,
# fork/join) without the waits and collectives, to split T_fused into GEMM and communication. Results are not
# reduced: never set it outside a benchmark.
GEMM_ONLY: bool = False
FUSE_SINGLE_GROUP = False  # a one-group plan overlaps nothing: cuBLAS then NCCL is faster
MAX_LAUNCHES = 512


stats: collections.Counter = collections.Counter()
last_launch: Launch | peer_route.PeerLaunch | None = None
_launches: collections.OrderedDict[tuple, Launch | tuple[str, str]] = collections.OrderedDict()  # LRU order
_captured: set[tuple] = set()  # keys of launches captured into CUDA graphs (never evicted)
_noted: set[str] = set()
_ready: list[bool] = []


# ----------------------------------------------------------------------------------------------- entry points


def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
                    plan: str) -> torch.Tensor:
    return _run("all_reduce", a, b, bias, group, plan)


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
                        plan: str) -> torch.Tensor:
    return _run("reduce_scatter", a, b, bias, group, plan)


def gemm_all_to_all(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                    output_split_sizes: Sequence[int] | None, input_split_sizes: Sequence[int] | None,
                    group: dist.ProcessGroup, plan: str) -> torch.Tensor:
    return _run("all_to_all", a, b, bias, group, plan, output_split_sizes, input_split_sizes)


def check(sync: bool = True) -> None:
    """Raise ``kernels.FlashOverlapTimeout`` if a wait kernel timed out (after synchronizing, when ``sync``)."""
    for res in streams.existing():
        if sync:
            torch.cuda.synchronize(res.index)
        if res.timed_out():
            res.raise_if_timed_out()


def reset() -> None:
    """Forget memoized launches, statistics and logged notes (tests; after changing settings). Synchronizes the
    devices first: calls in flight may still read the launches' index tensors. CUDA graphs captured before a
    reset hold pointers into the forgotten launches and must not be replayed after it."""
    global last_launch
    for res in streams.existing():
        torch.cuda.synchronize(res.index)
    _launches.clear()
    _peer_launches.clear()
    _captured.clear()
    _kernel_infos.cache_clear()
    preferred_kernels.cache_clear()
    stats.clear()
    _noted.clear()
    _ready.clear()
    last_launch = None


def available() -> bool:
    """Whether the overlapped path can run here (sm90 GPU and the library); memoized, logged once."""
    if not _ready:
        ok = kernels.available()
        _ready.append(ok)
        if not ok:
            _note("library", logging.WARNING, "flashoverlap: the overlapped CUDA path is off (needs an sm90 GPU and "
                  "%s; build it with `python -m flashoverlap_inductor.build`)", kernels.library_path())
    return _ready[0]


# ----------------------------------------------------------------------------------------------- launches


@functools.lru_cache(maxsize=1)
def _kernel_infos() -> tuple[Any, ...]:
    return tuple(kernels.configs())


@dataclass(frozen=True)
class Launch:
    """Everything one call shape needs on the device (memoized; built outside CUDA-graph capture)."""

    collective: str
    steps: tuple[runtime_cpu.GroupStep, ...]
    tiles: tuple[int, ...]  # tiles the GEMM signals per group
    kernel: KernelChoice
    index: int  # configuration index in the library
    gmap: torch.Tensor | None  # int32 [tile-rows]: group of each tile-row (None when this rank has no rows)
    gather: torch.Tensor | None  # int64 [rows]: source row of each buffer row (None = identity or "schedule")
    order: torch.Tensor | None  # int32 [tile-rows]: the scheduler's tile-row order (None = natural)
    stage: tuple[row_order.StageCopy | None, ...] | None  # per group: copy d -> buf before its collective
    rows: str  # "natural" (identity layout), "schedule", "stage" or "gather" (``row_order``)
    workspace_bytes: int
    sm_count: int
    peers: tuple[int, ...]  # global rank of every group rank (all_to_all)
    description: str
    csteps: fused_launch.CSteps  # the steps as fo_fused_call takes them


def _make_launch(collective: str, plan: str, rows: int, n: int, k: int, dtype: torch.dtype, world: int, rank: int,
                 send_rows: tuple[int, ...] | None, recv_rows: tuple[int, ...] | None, layout: str | None,
                 res: streams.DeviceResources, group: dist.ProcessGroup,
                 device: torch.device) -> Launch | tuple[str, str]:
    dname = str(dtype).removeprefix("torch.")
    sched = ops.resolve_schedule(collective, plan, rows, n, k, dname, world, send_rows, recv_rows)
    steps = runtime_cpu.schedule_steps(collective, plan, rows, n, k, dname, world, rank, send_rows, recv_rows)
    bounds = sched.layout.group_bounds
    if [(s.lo, s.hi) for s in steps] != list(zip(bounds, bounds[1:], strict=False)):
        raise AssertionError(f"flashoverlap: CPU schedule and buffer layout disagree: {steps} vs {bounds}")
    groups = len(steps)
    if groups > streams.MAX_GROUPS:
        return "too_many_groups", f"{groups} groups > {streams.MAX_GROUPS}"
    if groups < 2 and not FUSE_SINGLE_GROUP:
        return "single_group", "the plan has one group: nothing to overlap"
    tile = (sched.plan.tile_m, sched.plan.tile_n) if sched.plan is not None else None
    plan_kernel = KERNEL or (sched.plan.kernel if sched.plan is not None else "")
    choice = choose_kernel(_kernel_infos(), plan_kernel, tile, dname, layout, preferred_kernels(res.name))
    if choice is None:
        return "no_config", f"no configuration compiled for {dname}"
    if choice.convert_b:
        _note(f"convert_b:{choice.name}:{layout}", logging.WARNING, "flashoverlap: B with layout %s is copied into "
              "layout %s on every call (configuration %s is compiled only for that)", layout or "strided",
              choice.b_layout, choice.name)
    lib = streams.kernel_lib()
    index = lib.config_index(choice.name, dtype, choice.b_layout)
    grid = gemm_grid(res.name, GEMM_GRID)
    reserve = sm_reserve(res.name, SM_RESERVE, nccl_max_ctas(group)) if grid == "persistent" else 0
    sm_count = grid_ctas(grid, res.sm_count, -(-rows // choice.tile_m) * -(-n // choice.tile_n), reserve)
    gmap = gather = order = stage = None
    tiles = (0,) * groups
    workspace = 0
    route = "natural"
    rows_route = row_order.route(ROW_ORDER, collective, world)
    if rows and not sched.layout.is_identity and rows_route != "gather":
        nat = row_order.natural_order(collective, sched.layout, steps, choice.tile_m, choice.tile_n, n,
                                      dtype.itemsize, stage=rows_route == "stage")
        if isinstance(nat, str):
            _note(f"gather:{nat}", logging.INFO, "flashoverlap: %s gathers A's rows: %s", collective, nat)
        else:
            route, tiles, steps, stage = rows_route, nat.tiles, list(nat.steps), nat.stage
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
    if rows:
        workspace = lib.workspace_bytes(index, rows, n, k, sm_count, kernels.RASTERS[RASTER], SWIZZLE)
    peers = tuple(dist.get_global_rank(group, j) for j in range(world)) if collective == "all_to_all" else ()
    desc = (f"{collective} rows={rows} n={n} k={k} {dname}: {groups} groups, tiles {list(tiles)}, kernel "
            f"{choice.name} ({choice.b_layout}), {_grid_text(sm_count, res.sm_count)}, rows {route}, "
            f"{sched.description}")
    log.info("flashoverlap: launch %s", desc)
    return Launch(collective, tuple(steps), tiles, choice, index, gmap, gather, order, stage, route, workspace,
                  sm_count, peers, desc, fused_launch.group_steps(collective, steps, tiles, n, stage))


def _run(collective: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
         plan: str, output_split_sizes: Sequence[int] | None = None,
         input_split_sizes: Sequence[int] | None = None) -> torch.Tensor:
    global last_launch
    call = (collective, a, b, bias, group, plan, output_split_sizes, input_split_sizes)
    if a.is_cuda and a.device.index != torch.cuda.current_device():  # library launches need a's device current
        with torch.cuda.device(a.device):
            return _run(*call)
    if not available():
        return _fallback("library", "the library or an sm90 GPU is missing", call)
    opnd = normalize_operands(a, b, bias, collective)
    if isinstance(opnd, tuple):
        return _fallback(*opnd, call)
    y_shape = ops.gemm_output_shape(a, b, bias)
    rows, k = opnd.a.shape
    n = opnd.b.shape[1]
    world, rank = group.size(), group.rank()
    send_rows = recv_rows = None
    if collective == "all_reduce":
        out_shape = list(y_shape)
    elif collective == "reduce_scatter":
        out_shape = [y_shape[0] // world, *y_shape[1:]]
    else:
        outs, ins = ops.all_to_all_splits(y_shape[0], world, output_split_sizes, input_split_sizes)
        unit = math.prod(y_shape[1:-1])  # flattened rows per dim-0 element
        if output_split_sizes is not None or input_split_sizes is not None:
            send_rows, recv_rows = tuple(s * unit for s in ins), tuple(s * unit for s in outs)
        out_shape = [sum(outs), *y_shape[1:]]
    if rows == 0 and send_rows is None:  # every rank has the same rows here
        return _fallback("degenerate", "no rows", call)
    res = streams.resources(a.device.index)
    if res is None:
        return _fallback("capturing", "the first call on this device is inside a CUDA-graph capture", call)
    if res.timed_out():
        res.raise_if_timed_out()
    layout = b_layout(opnd.b)
    key = (collective, plan, rows, n, k, a.dtype, world, rank, send_rows, recv_rows, res.index, layout,
           getattr(group, "group_name", id(group)), SIGNAL_MODE, SWIZZLE, RASTER, SM_RESERVE, GEMM_GRID, KERNEL,
           ROW_ORDER)
    capturing = torch.cuda.is_current_stream_capturing()
    if peer_route.TRANSPORT == "peer":
        out = run_peer(collective, opnd, out_shape, group, res, key, layout, capturing)  # None: the NCCL route
        if out is not None:
            return out
    launch = _launches.get(key)
    if launch is None:
        if capturing:
            return _fallback("capturing", "a new call shape first seen inside a CUDA-graph capture", call)
        if len(_launches) >= MAX_LAUNCHES:  # evict the least recently used launch that no captured graph uses
            victim = next((k for k in _launches if k not in _captured), None)
            if victim is not None:
                _note("evict", logging.INFO, "flashoverlap: more than %d call shapes; evicting the least recently "
                      "used (with a device sync each time)", MAX_LAUNCHES)
                torch.cuda.synchronize(a.device)  # calls in flight may still read its index tensors
                del _launches[victim]
        launch = _launches[key] = _make_launch(collective, plan, rows, n, k, a.dtype, world, rank, send_rows,
                                               recv_rows, layout, res, group, a.device)
    _launches.move_to_end(key)
    if isinstance(launch, tuple):
        return _fallback(*launch, call)
    if capturing:  # a graph keeps raw pointers to this launch's tensors: never evict it
        _captured.add(key)
    cur = torch.cuda.current_stream(a.device)
    slot = res.slot(cur, dedicated=capturing)
    if slot is None:
        return _fallback("slots", f"more than {streams.MAX_SLOTS} caller streams on one device", call)
    out = _execute(launch, opnd, out_shape, group, res, cur, slot)
    last_launch = launch
    stats[f"fused:{collective}"] += 1
    stats[f"rows:{launch.rows}"] += 1
    if torch.cuda.is_current_stream_capturing():
        stats["captured"] += 1
    return out


def _execute(launch: Launch, opnd: Operands, out_shape: list[int], group: dist.ProcessGroup,
             res: streams.DeviceResources, cur: torch.cuda.Stream, slot: int) -> torch.Tensor:
    """Steps 3-5 of the module docstring."""
    a, b = opnd.a, opnd.b
    rows, k, n = a.shape[0], a.shape[1], b.shape[1]
    device = a.device
    out = torch.empty(out_shape, dtype=a.dtype, device=device)
    out_flat = out.view(-1, n)
    # d: the GEMM's output; buf: what the collectives read (reduce_scatter's staging buffer on the "schedule" route)
    d = out_flat if launch.collective == "all_reduce" else torch.empty(rows, n, dtype=a.dtype, device=device)
    buf = torch.empty(rows, n, dtype=a.dtype, device=device) if launch.stage else d
    lib = streams.kernel_lib()
    counters, expected = res.counters[slot], res.expected[slot]
    c_ptr, e_ptr = counters.data_ptr(), expected.data_ptr()
    side = res.side
    a_in = b_in = workspace = None
    ldb = 0
    if rows:
        a_in = a.index_select(0, launch.gather) if launch.gather is not None else _row_major(a)
        b_in, ldb = _kernel_b(b, launch.kernel)
        workspace = torch.empty(launch.workspace_bytes, dtype=torch.uint8, device=device) \
            if launch.workspace_bytes else None
    timeout_ns = max(1, int(config.wait_timeout_ms * 1e6))
    record = res.record.data_ptr()
    comm = nccl_direct.communicator(group, device) if a.dtype in nccl_direct.NCCL_DTYPES else None
    stats["nccl:direct" if comm is not None else "nccl:torch"] += 1
    if fused_launch.ready(comm) and not GEMM_ONLY:  # the whole op in one host call
        stats["host:c"] += 1
        lib.fused_call(launch.index, a_in, b_in, ldb, opnd.bias, d, buf, rows, k, launch.gmap, launch.order,
                       kernels.SIGNAL_MODES[SIGNAL_MODE], launch.sm_count, kernels.RASTERS[RASTER], SWIZZLE, workspace,
                       c_ptr, e_ptr, launch.csteps, out_flat, nccl_direct.NCCL_DTYPES[a.dtype], comm.comm, timeout_ns,
                       record, cur.cuda_stream, side.cuda_stream)
        return out
    stats["host:python"] += 1
    if rows:
        expected.copy_(counters)  # epoch resync; every earlier user of this slot was joined into `cur`
    side.wait_stream(cur)  # inputs, fresh buffers and the resync are ordered before the side stream's work
    if rows:
        lib.gemm(launch.index, a_in, b_in, ldb, opnd.bias, d, c_ptr, launch.gmap, launch.order,
                 kernels.SIGNAL_MODES[SIGNAL_MODE], launch.sm_count, kernels.RASTERS[RASTER], SWIZZLE, workspace,
                 cur.cuda_stream)
    with torch.cuda.stream(side):
        for g, step in enumerate(launch.steps if not GEMM_ONLY else ()):
            if launch.tiles[g]:
                lib.wait(c_ptr + 4 * g, e_ptr + 4 * g, launch.tiles[g], timeout_ns, record, g, side.cuda_stream)
            if launch.stage and launch.stage[g] is not None:
                launch.stage[g].apply(d, buf)
            if comm is not None:
                nccl_direct.issue_group(comm, launch.collective, step, buf, out_flat, side.cuda_stream)
            else:
                group_collective(launch.collective, launch.peers, g, step, buf, out_flat, group)
    cur.wait_stream(side)  # the output (and the buffers freed on return) are ready in the caller's stream order
    return out


def _grid_text(sm_count: int, total: int) -> str:
    return f"{sm_count}/{total} SMs" if sm_count <= total else f"{sm_count} CTAs (one per tile) on {total} SMs"


def _row_major(a: torch.Tensor) -> torch.Tensor:
    return a if a_is_kernel_ready(a) else a.clone(memory_format=torch.contiguous_format)


def _kernel_b(b: torch.Tensor, choice: KernelChoice) -> tuple[torch.Tensor, int]:
    """B in the layout the kernel reads, and its leading dimension (elements)."""
    if choice.convert_b:
        if choice.b_layout == "nk":
            b = b.t().clone(memory_format=torch.contiguous_format).t()
        else:
            b = b.clone(memory_format=torch.contiguous_format)
    return b, (b.stride(1) if choice.b_layout == "nk" else b.stride(0))


def _fallback(reason: str, detail: str, call: tuple) -> torch.Tensor:
    collective, a, b, bias, group, plan, outs, ins = call
    stats[f"fallback:{reason}"] += 1
    level = logging.INFO if reason in ("single_group", "degenerate") else logging.WARNING
    _note(reason, level, "flashoverlap: %s runs unfused (cuBLAS then NCCL): %s", collective, detail)
    if collective == "all_reduce":
        return runtime_cuda.gemm_all_reduce(a, b, bias, group, plan)
    if collective == "reduce_scatter":
        return runtime_cuda.gemm_reduce_scatter(a, b, bias, group, plan)
    return runtime_cuda.gemm_all_to_all(a, b, bias, outs, ins, group, plan)


def _note(key: str, level: int, msg: str, *args: object) -> None:
    if key not in _noted:
        _noted.add(key)
        log.log(level, msg, *args)
