"""The ring route of the fused reduce_scatter / all_reduce on any number of GPUs of one NVLink host: the reduction
in the GEMMs' epilogues as partial sums travel around the ranks.

The two-rank peer route (``peer_route``) generalised. The ``[M, N]`` result is cut into ``world * rounds`` pieces
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

Every step waits for the push it adds (a flag per step, acquired before each tile's C load, or by a wait kernel
with ``peer_route.GATE = "wait"``), so the ring runs at the pace of its slowest rank. As in the peer route, one set
of buffers serves every call (a call replayed from a CUDA graph needs no host state): flags at the end of each call
prove that every reader is done -- for all_reduce a barrier of all ranks, so a call of another shape may lay its
pieces out differently in the same workspace (the argument is in ``csrc/flashoverlap_sm90.h``). Sums are rounded
to the output dtype after every step, as NCCL's ring rounds after every hop.

Status: measured on 2 GPUs only (where it runs as ``FLASHOVERLAP_RING=all``; the default there is the peer route).
Not measured on 4 or more GPUs, for want of a machine: off by default (``RING = "off"``); ``"wide"`` turns it on for
groups of 3 or more ranks. The cost model predicts it (``cost_model/ring.py``, ``takes``) where its data file has
ring terms for the world size (``tune fit --ring``); elsewhere ``auto`` predicts the NCCL route for these calls.

Symmetric memory of one (device, group): a ring flag area (``FLAG_BYTES``, made once, zeroed) and workspaces of
``capacity`` bytes (``peer_route.smallest_with_room``), each mapped from every rank. Calls are ordered like the peer
route's (``peer_route.order_after_last``, one host thread at a time); under capture only shapes that ran before and
fit a workspace run here.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import kernels, peer_route, streams
from .cost_model import ring as ring_model

log = logging.getLogger("flashoverlap")

# "off" (default until measured on 4 GPUs), "wide": groups of 3 or more ranks take the ring, "all": every group of
# 2 or more (on 2 ranks instead of the peer route; for tests and comparisons)
RING: str = os.environ.get("FLASHOVERLAP_RING", "off")
# all_reduce: rounds (at most), so that each round's gather overlaps the next round's GEMMs; reduce_scatter: 1
ROUNDS: int = int(os.environ.get("FLASHOVERLAP_RING_ROUNDS", "2"))
MAX_WORLD = 8  # FO_RING_MAX_WORLD
MAX_ROUNDS = 16
FLAG_INTS = 256  # FO_RING_FLAGS
FLAG_BYTES = 4 * FLAG_INTS
MIN_PIECE_ROWS = ring_model.MIN_PIECE_ROWS
_CHOICES = {"RING": ("off", "wide", "all")}


def check_settings() -> None:
    """Raise ValueError for a setting outside its choices (ranks must not run mismatched routes)."""
    if RING not in _CHOICES["RING"]:
        raise ValueError(f"flashoverlap: ring_route.RING = {RING!r}; expected one of {_CHOICES['RING']} "
                         "(environment FLASHOVERLAP_RING)")
    if not 1 <= ROUNDS <= MAX_ROUNDS:
        raise ValueError(f"flashoverlap: ring_route.ROUNDS = {ROUNDS}; expected 1 .. {MAX_ROUNDS} "
                         "(environment FLASHOVERLAP_RING_ROUNDS)")


check_settings()


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
                ("error_record", ctypes.c_void_p), ("cur_stream", ctypes.c_void_p), ("side_stream", ctypes.c_void_p),
                ("pull_streams", ctypes.c_void_p * MAX_WORLD)]


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


@dataclass
class RingWorkspace:
    """A symmetric workspace of ``capacity`` bytes per rank, every rank's mapped here."""

    capacity: int
    buf: torch.Tensor
    hdl: object
    views: list[torch.Tensor]
    flags: RingFlags


_flags: dict[tuple[int, str], RingFlags] = {}
_workspaces: dict[tuple[int, str], list[RingWorkspace]] = {}


def flags(group: dist.ProcessGroup, device: torch.device) -> RingFlags:
    """The cached ring flag area of (device, group); made (collectively, zeroed) on first use."""
    key = (device.index, group.group_name)
    f = _flags.get(key)
    if f is None:
        world = group.size()
        buf, hdl, views = peer_route.symmetric(FLAG_BYTES, group, device, True, list(range(world)))
        expected = streams.persistent(device.index,
                                      lambda: torch.zeros(FLAG_INTS, dtype=torch.int32, device=device))
        pulls = [torch.cuda.Stream(device=device, priority=-100) for _ in range(world - 1)]
        f = _flags[key] = RingFlags(buf, hdl, views, expected, pulls)
    return f


def workspace(group: dist.ProcessGroup, device: torch.device, need: int,
              capturing: bool = False) -> RingWorkspace | None:
    """The smallest ring workspace of (device, group) with ``need`` bytes (``peer_route.smallest_with_room``:
    None inside a capture when none has room)."""

    def make(capacity: int) -> RingWorkspace:
        f = flags(group, device)
        buf, hdl, views = peer_route.symmetric(capacity, group, device, False, list(range(group.size())))
        log.info("flashoverlap ring: symmetric workspace of %d MiB on %s, group %s", capacity >> 20, device,
                 group.group_name)
        return RingWorkspace(capacity, buf, hdl, views, f)

    return peer_route.smallest_with_room(_workspaces.setdefault((device.index, group.group_name), []), need,
                                         capturing, make)


def reset() -> None:
    """Drop every ring workspace and flag area (after synchronizing its device), as ``peer_route.reset``."""
    for index, _ in list(_flags):
        torch.cuda.synchronize(index)
    _workspaces.clear()
    _flags.clear()


def enabled(world: int) -> bool:
    """Whether groups of ``world`` ranks take the ring (``RING``), before ``unsupported``'s shape checks."""
    return (RING == "all" and world >= 2) or (RING == "wide" and world >= 3)


def rounds_for(collective: str, rows_total: int, world: int) -> int | None:
    """Rounds of a call: reduce_scatter 1; all_reduce the most rounds up to ``ROUNDS`` that cut ``rows_total`` into
    ``world * rounds`` equal pieces of at least ``MIN_PIECE_ROWS`` rows (None: not even one round does;
    ``cost_model.ring.rounds_for``, which the cost model uses too)."""
    return ring_model.rounds_for(collective, rows_total, world, ROUNDS)


def takes(collective: str, rows: int, n: int, k: int, dtype: torch.dtype, world: int) -> int:
    """The rounds a CUDA call of this shape will take the ring in (0: it will not): ``peer_route.TRANSPORT`` is
    "peer", the ring is on for ``world`` ranks, the kernel library is loadable and ``unsupported`` finds nothing for
    some B layout. What the cost model should predict (``decide(..., ring_rounds=...)``); as for the peer route, a
    call shape first seen inside a CUDA-graph capture takes the NCCL route. 0 (never raises) where the library
    cannot be read."""
    if peer_route.TRANSPORT != "peer" or collective not in peer_route.COLLECTIVES or not enabled(world):
        return 0
    try:
        add = kernels.configs(add_c=True)
    except Exception:  # no library or no GPU: the runtime falls back to the NCCL route (or cuBLAS + NCCL) anyway
        return 0
    if any(unsupported(collective, rows, world, dtype, layout, add) is None for layout in ("nk", "kn")):
        return rounds_for(collective, rows, world) or 0
    return 0


def unsupported(collective: str, rows: int, world: int, dtype: torch.dtype, layout: str | None,
                add_kernels: list[kernels.KernelInfo]) -> str | None:
    """Why this call cannot take the ring (None: it can). Depends only on what all ranks share."""
    if collective not in peer_route.COLLECTIVES:
        return f"{collective} has no ring route"
    if not enabled(world):
        return f"the ring is off for {world} ranks (FLASHOVERLAP_RING={RING})"
    if world > MAX_WORLD:
        return f"world size {world} > {MAX_WORLD}"
    if rounds_for(collective, rows, world) is None:
        return f"{rows} rows do not split into {world} equal pieces of at least {MIN_PIECE_ROWS} rows"
    dname = str(dtype).removeprefix("torch.")
    if not any((dname, layout) in c.variants for c in add_kernels):
        return f"no _addc configuration compiled for {dname} with B as {layout}"
    return None


@dataclass(frozen=True)
class RingLaunch:
    """What one call shape needs (memoized by ``runtime_peer``)."""

    collective: str
    rows: int  # rows per piece
    rounds: int
    world: int
    swizzle: int  # the steps' swizzle (``kernels.unpadded_swizzle`` of the runtime's at the piece's rows)
    raster: int  # the steps' raster (the workspace size was computed for it)
    need: int  # workspace bytes per rank
    sm_count: int
    workspace_bytes: int
    description: str
    template: RingArgs


def step_configs(plain: kernels.KernelInfo, dname: str, layout: str, rows: int, n: int,
                 sms: int) -> tuple[kernels.KernelInfo, kernels.KernelInfo]:
    """(step 0's configuration, the later steps' ``_addc`` one) for pieces of ``rows x n`` on ``sms`` SMs.
    ``peer_route.ADD_KERNEL`` names the ``_addc`` one where set (step 0 then ``plain``, the runtime's choice).
    Otherwise one ``_addc`` configuration per tile (``peer_route.PREFERRED``'s reduce_scatter one first), the tile
    by ``cost_model.ring.step_tile``, and step 0 in ``plain`` where its tile is that one, else in a compiled plain
    configuration of that tile (of ``plain``'s cluster where one is)."""
    cands = [c for c in kernels.configs(add_c=1) if (dname, layout) in c.variants]
    named = [c for c in cands if c.name == peer_route.ADD_KERNEL]
    if named:
        return plain, named[0]
    if not cands:
        raise ValueError(f"ring route: no _addc configuration compiled for {dname} with B as {layout}")
    by_tile: dict[tuple[int, int], kernels.KernelInfo] = {}
    for c in sorted(cands, key=lambda c: (c.name not in peer_route.PREFERRED,
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


def make_launch(collective: str, rows_total: int, n: int, k: int, dtype: torch.dtype, rank: int, world: int,
                plain: kernels.KernelInfo, grid_ctas, swizzle: int, raster: int, layout: str) -> RingLaunch:
    """The launch of one call shape: the steps' configurations by ``step_configs`` (``plain``: the runtime's choice
    for the call), both at the largest swizzle up to ``swizzle`` that does not pad the pieces' tile grid
    (``kernels.unpadded_swizzle``); ``grid_ctas(tiles) -> CTAs``."""
    check_settings()
    lib = streams.kernel_lib()
    dname = str(dtype).removeprefix("torch.")
    rounds = rounds_for(collective, rows_total, world)
    assert rounds is not None, "make_launch needs a call that unsupported() accepts"
    rows = rows_total // (world * rounds)
    plain, pick = step_configs(plain, dname, layout, rows, n, grid_ctas(0))
    add = lib.config_index(pick.name, dtype, layout)
    first = lib.config_index(plain.name, dtype, layout)
    swizzle = min(kernels.unpadded_swizzle(rows, n, c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, swizzle)
                  for c in (plain, pick))
    tiles = -(-rows // pick.tile_m) * -(-n // pick.tile_n)
    sm_count = grid_ctas(tiles)
    ws = max(lib.workspace_bytes(first, rows, n, k, sm_count, raster, swizzle),
             lib.workspace_bytes(add, rows, n, k, sm_count, raster, swizzle))
    pieces = rounds * (world - 1) + (rounds if collective == "all_reduce" else 0)
    need = pieces * rows * n * dtype.itemsize
    desc = (f"{collective} rows={rows_total} n={n} k={k} {dname}: ring route, {world} ranks x {rounds} rounds of "
            f"{rows} rows, GEMM steps {plain.name} / {pick.name} at swizzle {swizzle}, {sm_count} CTAs")
    log.info("flashoverlap: launch %s", desc)
    t = RingArgs()
    t.config_first, t.config_add = first, add
    t.n, t.k, t.rows, t.rounds, t.world, t.rank = n, k, rows, rounds, world, rank
    t.all_reduce, t.elem_bytes, t.sm_count = int(collective == "all_reduce"), dtype.itemsize, sm_count
    return RingLaunch(collective, rows, rounds, world, swizzle, raster, need, sm_count, ws, desc, t)


def execute(launch: RingLaunch, ws: RingWorkspace, a: torch.Tensor, b: torch.Tensor, ldb: int,
            bias: torch.Tensor | None, out: torch.Tensor, res: streams.DeviceResources, cur: torch.cuda.Stream,
            signal_mode: int, raster: int, swizzle: int, timeout_ns: int) -> torch.Tensor:
    """One call (``fo_ring_call``) with ``ws`` (at least ``launch.need`` bytes); ``out``: the op's output, [M, N]
    (all_reduce) or [M / world, N] (reduce_scatter)."""
    n = b.shape[1]
    workspace_t = torch.empty(launch.workspace_bytes, dtype=torch.uint8, device=a.device) \
        if launch.workspace_bytes else None
    out2 = out.view(-1, n)
    f = ws.flags
    p = RingArgs.from_buffer_copy(launch.template)
    p.a, p.lda, p.b, p.ldb = a.data_ptr(), a.stride(0), b.data_ptr(), ldb
    p.bias = bias.data_ptr() if bias is not None else None
    for r in range(launch.world):
        p.buffers[r] = ws.views[r].data_ptr()
        p.flags[r] = f.views[r].data_ptr()
    for d, s in enumerate(f.pulls):
        p.pull_streams[d] = s.cuda_stream
    p.expected, p.out, p.ld_out = f.expected.data_ptr(), out2.data_ptr(), out2.stride(0)
    p.signal_mode, p.raster, p.swizzle = signal_mode, launch.raster, launch.swizzle  # the launch's, not the args'

    p.gate_in_kernel = int(peer_route.GATE == "kernel")
    p.workspace = workspace_t.data_ptr() if workspace_t is not None else None
    p.workspace_bytes = launch.workspace_bytes
    p.timeout_ns, p.error_record = timeout_ns, res.record.data_ptr()
    p.cur_stream, p.side_stream = cur.cuda_stream, res.side.cuda_stream
    lib = streams.kernel_lib()
    lib.check(lib.lib.fo_ring_call(ctypes.byref(p)), "fo_ring_call")
    return out
