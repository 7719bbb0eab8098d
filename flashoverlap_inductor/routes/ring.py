"""The ring route of the fused reduce_scatter / all_reduce on any number of GPUs of one NVLink host: the reduction
in the GEMMs' epilogues as partial sums travel around the ranks.

The two-rank peer route (``routes.peer``) generalised. The ``[M, N]`` result is cut into ``world * rounds`` pieces
of ``rows = M / (world * rounds)`` rows; piece ``(c, t)`` holds rows ``c * M / world + t * rows`` onwards, so chunk
``c`` is what rank ``c`` owns after the reduce_scatter. Per round ``t``, rank ``r`` runs ``world`` GEMM steps
(``fo_ring_call``, ``csrc/ring_call.cu``, one host call per fused op); step ``s`` computes piece
``((r + s + 1) % world, t)``:

- step 0, a plain GEMM, stores its tiles into a slot of rank ``r - 1``'s workspace (TMA over NVLink);
- each later step (an ``_addc`` configuration) adds, as the epilogue's C operand, what rank ``r + 1`` pushed into
  this rank's slot at its previous step, and pushes the sum on to rank ``r - 1``;
- the last step (``s = world - 1``, piece ``(r, t)``) holds every rank's partial: it writes the reduce_scatter's
  output, or, for all_reduce, this rank's symmetric ``own`` piece, which every other rank's copy engine then pulls
  (while the next round computes; hence ``rounds`` > 1 for all_reduce).

Every step waits for the push it adds (a flag per step, acquired before each tile's C load), so the ring runs at
the pace of its slowest rank. As in the peer route, one set
of buffers serves every call (a call replayed from a CUDA graph needs no host state): flags at the end of each call
prove that every reader is done -- for all_reduce a barrier of all ranks, so a call of another shape may lay its
pieces out differently in the same workspace (the argument is in ``csrc/flashoverlap_sm90.h``). Sums are rounded
to the output dtype after every step, as NCCL's ring rounds after every hop.

Status: measured on 2 GPUs (where it runs with ``ring="all"``; the default there is the peer route) and once on
4 H200s (twenty-fifth session, the grid's shapes that ``auto`` fused; correct on all): reduce_scatter 1.04-1.17x of
sequential (the NCCL route 1.00-1.06x, PyTorch async-TP 1.14-1.32x on the same shapes), all_reduce 0.87-1.03x (the
NCCL route 1.05-1.26x). Off by default (``Settings.ring = "off"``); ``"wide"`` turns it on for groups of 3 or more
ranks. The cost model predicts it (``cost_model/ring.py``, ``rounds``) where its data file has ring terms for the
world size (``tune fit --ring``: the H200 file has world 4, fitted to that run); elsewhere ``auto`` predicts the
NCCL route.

Symmetric memory of one (device, group): a ring flag area (``FLAG_BYTES``, made once, zeroed) and workspaces of
``capacity`` bytes (``symmetric.smallest_with_room``), each mapped from every rank. Calls are ordered like the peer
route's (``symmetric.order_after_last``, one host thread at a time); under capture only shapes that ran before and
fit a workspace run here. As on the peer route, the launch memoizes the whole
``fo_ring_args`` per workspace but the call's own pointers, and keeps a GEMM workspace of its own.
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
from ..cost_model import ring as ring_model
from . import nccl, peer, symmetric

log = logging.getLogger("flashoverlap")

MAX_WORLD = 8  # FO_RING_MAX_WORLD
FLAG_INTS = 256  # FO_RING_FLAGS
FAULT_OFFSET = 4 * FLAG_INTS  # the group's fo_fault block, after the flags (bytes)
FLAG_BYTES = FAULT_OFFSET + 128
MIN_PIECE_ROWS = ring_model.MIN_PIECE_ROWS


class RingArgs(ctypes.Structure):
    """``fo_ring_args`` of ``csrc/flashoverlap_sm90.h`` (pointers as ints; sizes in elements)."""

    _fields_ = [("config_first", ctypes.c_int32), ("config_add", ctypes.c_int32), ("a", ctypes.c_void_p),
                ("lda", ctypes.c_int64), ("b", ctypes.c_void_p), ("ldb", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("rows", ctypes.c_int32), ("rounds", ctypes.c_int32),
                ("world", ctypes.c_int32), ("rank", ctypes.c_int32), ("all_reduce", ctypes.c_int32),
                ("buffers", ctypes.c_void_p * MAX_WORLD), ("flags", ctypes.c_void_p * MAX_WORLD),
                ("expected", ctypes.c_void_p), ("out", ctypes.c_void_p), ("ld_out", ctypes.c_int64),
                ("elem_bytes", ctypes.c_int32), ("signal_mode", ctypes.c_int32), ("sm_count", ctypes.c_int32),
                ("raster", ctypes.c_int32), ("swizzle", ctypes.c_int32), ("gate_in_kernel", ctypes.c_int32),
                ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_size_t), ("timeout_ns", ctypes.c_int64),
                ("fault", ctypes.c_void_p), ("cur_stream", ctypes.c_void_p), ("side_stream", ctypes.c_void_p),
                ("pull_streams", ctypes.c_void_p * MAX_WORLD), ("mirror", ctypes.c_void_p),
                ("launch_id", ctypes.c_int32)]


def flag_count(world: int, rounds: int) -> int:
    """Ints of the ring flag area one call shape uses (``FlagIndex::count`` of ``csrc/ring_call.cu``)."""
    return rounds * (world - 1) + 1 + rounds * world + 1


@dataclass
class RingFlags:
    """The ring flag area of one (device, group): every rank's, mapped here; this rank's epochs; pull streams."""

    buf: torch.Tensor  # uint8 [FLAG_BYTES], symmetric, zeroed once
    hdl: object
    views: list[torch.Tensor]  # every rank's flag area mapped here (keeps the mappings alive)
    expected: torch.Tensor  # int32 [FLAG_INTS]: this rank's epoch of each flag
    pulls: list[torch.cuda.Stream]  # all_reduce: [d - 1] pulls from rank (rank + d) % world
    fault: faults.FaultDomain  # the group's fault block (in ``buf``), which the other ranks' waits also write


_flags: dict[tuple[int, str], RingFlags] = {}
_workspaces: dict[tuple[int, str], list[symmetric.SymmetricBuffer]] = {}


def flags(group: dist.ProcessGroup, device: torch.device) -> RingFlags:
    """The cached ring flag area of (device, group); made (collectively, zeroed) on first use."""
    key = (device.index, group.group_name)
    f = _flags.get(key)
    if f is None:
        world = group.size()
        buf, hdl, views = symmetric.symmetric(FLAG_BYTES, group, device, True, list(range(world)))
        expected = streams.persistent(device.index,
                                      lambda: torch.zeros(FLAG_INTS, dtype=torch.int32, device=device))
        pulls = [torch.cuda.Stream(device=device, priority=-100) for _ in range(world - 1)]
        dom = symmetric.fault_domain("ring", group, device, buf, FAULT_OFFSET,
                                     [v.data_ptr() for r, v in enumerate(views) if r != group.rank()])
        f = _flags[key] = RingFlags(buf, hdl, views, expected, pulls, dom)
    return f


def workspace(group: dist.ProcessGroup, device: torch.device, need: int,
              capturing: bool = False) -> symmetric.SymmetricBuffer | None:
    """The smallest ring workspace of (device, group) with ``need`` bytes (``symmetric.smallest_with_room``: None
    inside a capture when none has room)."""

    def make(capacity: int) -> symmetric.SymmetricBuffer:
        f = flags(group, device)
        buf, hdl, views = symmetric.symmetric(capacity, group, device, False, list(range(group.size())))
        log.info("flashoverlap ring: symmetric workspace of %d MiB on %s, group %s", capacity >> 20, device,
                 group.group_name)
        return symmetric.SymmetricBuffer(capacity, buf, hdl, views, f, symmetric.next_serial())

    return symmetric.smallest_with_room(_workspaces.setdefault((device.index, group.group_name), []), need,
                                        capturing, make)


def enabled(world: int, ring: str) -> bool:
    """Whether groups of ``world`` ranks take the ring under ``Settings.ring``, before the shape checks."""
    return (ring == "all" and world >= 2) or (ring == "wide" and world >= 3)


def rounds_for(collective: str, rows_total: int, world: int, max_rounds: int) -> int | None:
    """Rounds of a call: reduce_scatter 1; all_reduce the most rounds up to ``max_rounds`` that cut ``rows_total``
    into ``world * rounds`` equal pieces of at least ``MIN_PIECE_ROWS`` rows (None: not even one round does;
    ``cost_model.ring.rounds_for``, which the cost model uses too)."""
    return ring_model.rounds_for(collective, rows_total, world, max_rounds)


def unsupported(call, settings: config.Settings) -> str | None:
    """Why ``call`` cannot take the ring (None: it can). Pure; depends only on what all ranks share."""
    if settings.transport != "peer":
        return "transport is 'nccl'"
    if call.collective not in peer.COLLECTIVES:
        return f"{call.collective} has no ring route"
    if not enabled(call.world, settings.ring):
        return f"the ring is off for {call.world} ranks (ring={settings.ring!r})"
    if call.world > MAX_WORLD:
        return f"world size {call.world} > {MAX_WORLD}"
    if rounds_for(call.collective, call.rows, call.world, settings.tuning.ring_rounds) is None:
        return f"{call.rows} rows do not split into {call.world} equal pieces of at least {MIN_PIECE_ROWS} rows"
    why = nccl.unsupported_operands(call, settings)
    return why if why is not None else peer.missing_addc(call)


def rounds(call, settings: config.Settings) -> int:
    """The rounds ``call`` takes on the ring (what the cost model predicts; ``unsupported`` must be None)."""
    return rounds_for(call.collective, call.rows, call.world, settings.tuning.ring_rounds) or 0


@dataclass
class RingLaunch:
    """What one call shape needs: the shape's ``fo_ring_args`` (``template``) and, per workspace, the args with
    every pointer but the call's own (``args``)."""

    collective: str
    kernel: nccl.KernelChoice  # the runtime's plain choice (B's layout)
    rows: int  # rows per piece
    rounds: int
    world: int
    need: int  # workspace bytes per rank
    gemm_workspace: torch.Tensor | None
    description: str
    template: RingArgs
    args: dict[int, RingArgs] = field(default_factory=dict)


def step_configs(plain: kernels.KernelInfo, dname: str, layout: str, rows: int, n: int, sms: int,
                 peer_kernel: str | None = None) -> tuple[kernels.KernelInfo, kernels.KernelInfo]:
    """(step 0's configuration, the later steps' ``_addc`` one) for pieces of ``rows x n`` on ``sms`` SMs.
    ``peer_kernel`` names the ``_addc`` one where set (step 0 then ``plain``, the runtime's choice). Otherwise one
    ``_addc`` configuration per tile (``peer.PREFERRED``'s reduce_scatter one first), the tile by
    ``cost_model.ring.step_tile``, and step 0 in ``plain`` where its tile is that one, else in a compiled plain
    configuration of that tile (of ``plain``'s cluster where one is)."""
    cands = [c for c in kernels.configs(add_c=1) if (dname, layout) in c.variants]
    named = [c for c in cands if c.name == peer_kernel]
    if named:
        return plain, named[0]
    if not cands:
        raise ValueError(f"ring route: no _addc configuration compiled for {dname} with B as {layout}")
    by_tile: dict[tuple[int, int], kernels.KernelInfo] = {}
    for c in sorted(cands, key=lambda c: (c.name not in peer.PREFERRED,
                                          (c.tile_m, c.tile_n) != (plain.tile_m, plain.tile_n))):
        by_tile.setdefault((c.tile_m, c.tile_n), c)
    order = [t for t in ring_model.STEP_TILES if t in by_tile] + [t for t in by_tile if t not in ring_model.STEP_TILES]
    tile = ring_model.step_tile(rows, n, sms, order)
    pick = by_tile[tile]
    if (plain.tile_m, plain.tile_n) == tile:
        return plain, pick
    same = [c for c in kernels.configs() if (c.tile_m, c.tile_n) == tile and (dname, layout) in c.variants]
    same.sort(key=lambda c: (c.cluster_m, c.cluster_n) != (plain.cluster_m, plain.cluster_n))
    return (same[0] if same else plain), pick


def make_launch(call, settings: config.Settings, ctx) -> RingLaunch | str:
    """The launch of one call shape: the steps' configurations by ``step_configs``, both at the largest swizzle up
    to ``tuning.swizzle`` that does not pad the pieces' tile grid (``kernels.unpadded_swizzle``)."""
    choice = peer.plain_choice(call)
    if isinstance(choice, str):
        return choice
    res, tuning = ctx.res, settings.tuning
    dtype, dname, layout, n, k, world = call.dtype, call.dtype_name, choice.b_layout, call.n, call.k, call.world
    nrounds = rounds(call, settings)
    rows = call.rows // (world * nrounds)
    plain, pick = step_configs(kernels.config_info(choice.name), dname, layout, rows, n,
                               nccl.grid_for(res, tuning, ctx.group, 0), tuning.peer_kernel)
    add = kernels.config_index(pick.name, dtype, layout)
    first = kernels.config_index(plain.name, dtype, layout)
    swizzle = min(kernels.unpadded_swizzle(rows, n, c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, tuning.swizzle)
                  for c in (plain, pick))
    tiles = -(-rows // pick.tile_m) * -(-n // pick.tile_n)
    sm_count = nccl.grid_for(res, tuning, ctx.group, tiles)
    ws = max(kernels.workspace_bytes(first, rows, n, k, sm_count, nccl.RASTER, swizzle),
             kernels.workspace_bytes(add, rows, n, k, sm_count, nccl.RASTER, swizzle))
    device = ctx.a.device
    gemm_ws = streams.persistent(res.index, lambda: torch.empty(ws, dtype=torch.uint8, device=device)) if ws else None
    pieces = nrounds * (world - 1) + (nrounds if call.collective == "all_reduce" else 0)
    need = pieces * rows * n * dtype.itemsize
    desc = (f"{call.collective} rows={call.rows} n={n} k={k} {dname}: ring route, {world} ranks x {nrounds} rounds "
            f"of {rows} rows, GEMM steps {plain.name} / {pick.name} at swizzle {swizzle}, {sm_count} CTAs")
    log.info("flashoverlap: launch %s", desc)
    t = RingArgs()
    t.config_first, t.config_add = first, add
    t.n, t.k, t.rows, t.rounds, t.world, t.rank = n, k, rows, nrounds, world, call.rank
    t.all_reduce, t.elem_bytes, t.sm_count = int(call.collective == "all_reduce"), dtype.itemsize, sm_count
    t.signal_mode, t.raster, t.swizzle, t.gate_in_kernel = nccl.SIGNAL_DEFERRED, nccl.RASTER, swizzle, 1
    t.workspace, t.workspace_bytes = (gemm_ws.data_ptr() if gemm_ws is not None else None), ws
    t.timeout_ns = settings.timeout_ns(compat.group_timeout_ms(ctx.group))
    t.launch_id = faults.launch_id(desc)
    t.side_stream = res.side.cuda_stream
    return RingLaunch(call.collective, choice, rows, nrounds, world, need, gemm_ws, desc, t)


def args_for(launch: RingLaunch, ws: symmetric.SymmetricBuffer) -> RingArgs:
    """The launch's args with the workspace's and flags' pointers and the pull streams (memoized per workspace)."""
    p = launch.args.get(ws.serial)
    if p is None:
        p = RingArgs.from_buffer_copy(launch.template)
        f = ws.flags
        for r in range(launch.world):
            p.buffers[r] = ws.views[r].data_ptr()
            p.flags[r] = f.views[r].data_ptr()
        for d, s in enumerate(f.pulls):
            p.pull_streams[d] = s.cuda_stream
        p.expected = f.expected.data_ptr()
        p.fault, p.mirror = f.fault.block_ptr, f.fault.mirror_ptr
        launch.args[ws.serial] = p
    return p


class RingRoute(symmetric.SymmetricRoute):
    name = "ring"
    c_function = "fo_ring_call"

    unsupported = staticmethod(unsupported)
    make_launch = staticmethod(make_launch)

    def workspace_for(self, launch: RingLaunch, ctx) -> symmetric.SymmetricBuffer | None:
        return workspace(ctx.group, ctx.a.device, launch.need, ctx.capturing)

    def args_for(self, launch: RingLaunch, ws: symmetric.SymmetricBuffer, res, slot: int) -> RingArgs:
        return args_for(launch, ws)

    def state(self) -> tuple[dict, dict]:
        return _flags, _workspaces


ROUTE = RingRoute()
