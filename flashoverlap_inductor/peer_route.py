"""The peer route of the fused reduce_scatter / all_reduce on two GPUs: the reduction inside the GEMM's epilogue.

Rank r owns rows ``[r * M/2, (r + 1) * M/2)`` of the ``[M, N]`` result (reduce_scatter's own chunk). Per call
(``fo_peer_call``, ``csrc/peer_call.cu``, one host call):

1. GEMM 1: A's rows that the *peer* owns -> a ``partial`` region of symmetric memory: by default the peer's, its
   tiles stored by TMA over NVLink (``PARTIAL = "push"``); or this rank's own (``"pull"``).
2. Tell the peer (a system-scope flag in its memory); wait until the peer's GEMM 1 is done (bounded).
3. GEMM 2 (an ``_addc`` configuration): A's own rows, with the peer's ``partial`` of them added in the epilogue as
   CUTLASS's C operand, loaded by TMA: from local memory where the peer pushed it, or straight from the peer's
   memory over NVLink (pull). reduce_scatter: into the output, then one flag each way (the peer's GEMM 2, which
   read what this rank's GEMM 1 wrote, is done).
4. all_reduce, by push (the default where an ``_addc_aux`` / ``_addc_auxr`` configuration is compiled): GEMM 2
   writes the output's own rows and stores the same tiles into the peer's ``own`` (landing) buffer; after it, one
   flag each way, and a copy (on SMs, ``FINAL_COPY``, or by copy engine) moves this rank's landing buffer into the
   output's other half. By pull: GEMM
   2 writes the symmetric ``own`` buffer, signalling wave groups, and per group the copy engine pulls the peer's
   ``own`` rows into the output and copies this rank's own rows there (no SMs taken from the GEMM, no NCCL).

The sum is rounded as NCCL rounds it for two ranks: both partials are rounded to the output dtype, then added in
fp32 and rounded once, and every element's final value is computed once and copied to the other rank.

Why: NCCL's kernels beside the GEMM take SMs and end after it (``examples/RESULTS.md``); here the only work beside
the GEMM is TMA loads of C and stores to the peer. Not a NCCL collective: a transport of its own, the default where
it applies (``TRANSPORT``; ``$FLASHOVERLAP_TRANSPORT=nccl`` turns it off): two ranks on one NVLink host, torch's
symmetric memory and the library's ``_addc`` configurations. Calls from several streams are serialized
(``order_after_last``). Every other call keeps the NCCL route.

Symmetric memory of one (device, group): a flag page (``FLAG_BYTES``, made once) and workspaces of two regions,
``[partial | own]``, each ``capacity`` bytes. Every call of a shape uses the same regions, so a call replayed from a
CUDA graph needs no host state: each call ends with a flag exchange after GEMM 2 that proves the peer has read what
the next call overwrites (the argument is in ``csrc/flashoverlap_sm90.h``). Flag epochs live on the device
(``Flags.expected``), advanced by the calls' wait kernels, so eager calls and graph replays interleave freely on one
stream. A call that needs more room than every workspace has makes a larger one (collectively: every rank makes it
at the same call, as every decision here depends on shapes and call history all ranks share); none is freed before
``reset`` (``workspace``). Under capture the route runs only with a workspace that already has room (no collective
allocation inside a capture); otherwise the call takes the NCCL route. Graphs that hold peer calls must be replayed
on the stream that runs the group's eager peer calls (torch.compile's CUDA graphs replay on the caller's current
stream), never beside it, and ``runtime_gpu.check()`` after replays raises a timeout they recorded.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from . import kernels, streams
from . import plan as planlib
from .cost_model.schema import ROUTE_COLLECTIVES

log = logging.getLogger("flashoverlap")
T = TypeVar("T")

# "peer" (default): calls that can take the peer route do (``unsupported``), the others the NCCL route; "nccl": all
# take the NCCL route.
TRANSPORT: str = os.environ.get("FLASHOVERLAP_TRANSPORT", "peer")
# The _addc configuration of GEMM 2 (None: the first compiled one whose tile matches GEMM 1's).
ADD_KERNEL: str | None = os.environ.get("FLASHOVERLAP_PEER_KERNEL") or None
# GEMM 2's configuration when ADD_KERNEL names none, by measurement (examples/RESULTS.md, ninth session):
# reduce_scatter with a 128x64 epilogue subtile (three mainloop stages beat four with 128x32 subtiles), all_reduce
# by push with the aux tile stored by TMA.
PREFERRED = ("coop_128x256x64_c2x1_e128x64_addc", "coop_128x256x64_c2x1_e128x32_addc_aux")
MAX_GROUPS = 64  # FO_PEER_MAX_GROUPS of csrc/flashoverlap_sm90.h
GROUPS = int(os.environ.get("FLASHOVERLAP_PEER_GROUPS", "8"))  # all_reduce: copy groups of GEMM 2's rows (at most)
# all_reduce by push: the final landing -> output copy on SMs ("sm": GEMM 2 has freed them) or by copy engine ("ce")
FINAL_COPY: str = os.environ.get("FLASHOVERLAP_PEER_COPY", "sm")
# Between the GEMMs: "kernel" (GEMM 2's epilogue waits for the peer's GEMM 1 before each C load) or "wait" (a
# bounded wait kernel on the stream, then GEMM 2)
GATE: str = os.environ.get("FLASHOVERLAP_PEER_GATE", "kernel")
# GEMM 1's result: stored into the peer's memory ("push": NVLink carries it during GEMM 1, and GEMM 2 loads C locally)
# or read by the peer's GEMM 2 ("pull": NVLink carries it during GEMM 2, beside all_reduce's own push).
PARTIAL: str = os.environ.get("FLASHOVERLAP_PEER_PARTIAL", "push")
FLAG_BYTES = 4096
COLLECTIVES = ROUTE_COLLECTIVES
_CHOICES = {"TRANSPORT": ("peer", "nccl"), "FINAL_COPY": ("sm", "ce"), "GATE": ("kernel", "wait"),
            "PARTIAL": ("push", "pull")}


def check_settings() -> None:
    """Raise ValueError for a setting (or its environment variable) outside its choices: ranks that read a typo
    differently must not run mismatched routes."""
    for name, allowed in _CHOICES.items():
        if globals()[name] not in allowed:
            raise ValueError(f"flashoverlap: peer_route.{name} = {globals()[name]!r}; expected one of {allowed} "
                             f"(environment FLASHOVERLAP_{'PEER_' if name != 'TRANSPORT' else ''}"
                             f"{'COPY' if name == 'FINAL_COPY' else name})")


check_settings()


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
                ("error_record", ctypes.c_void_p), ("cur_stream", ctypes.c_void_p), ("side_stream", ctypes.c_void_p),
                ("pull_stream", ctypes.c_void_p), ("push", ctypes.c_int32), ("copy_on_sms", ctypes.c_int32),
                ("gate_in_kernel", ctypes.c_int32)]


@dataclass
class Flags:
    """The flag page of one (device, group): this rank's flags, the peer's mapped here, the device epochs."""

    buf: torch.Tensor  # uint8 [FLAG_BYTES], symmetric
    hdl: object
    peer_base: int  # the peer's flag page, mapped here
    peer_view: torch.Tensor  # keeps the peer's mapping alive
    expected: torch.Tensor  # int32 [1 + 2 * MAX_GROUPS]: flag epochs, then counter targets (csrc contract)
    pull: torch.cuda.Stream  # all_reduce by pull: the copy stream of the peer's rows


@dataclass
class Workspace:
    """The symmetric regions of one (device, group) and the peer's mapping of its own (bytes)."""

    capacity: int  # bytes per region (partial, own)
    buf: torch.Tensor  # uint8 [2 * capacity], symmetric
    hdl: object
    peer_base: int  # the peer's workspace, mapped here
    peer_view: torch.Tensor  # keeps the peer's mapping alive
    flags: Flags

    def regions(self) -> tuple[int, int, int, int]:
        """(partial, own, peer's partial, peer's own) pointers; the same for every call."""
        base = self.buf.data_ptr()
        return base, base + self.capacity, self.peer_base, self.peer_base + self.capacity


_flags: dict[tuple[int, str], Flags] = {}
_workspaces: dict[tuple[int, str], list[Workspace]] = {}  # ascending capacity; kept until ``reset``


def symmetric(nbytes: int, group: dist.ProcessGroup, device: torch.device, zero: bool,
              ranks: list[int]) -> tuple:
    """A symmetric uint8 buffer, its handle and the mappings of ``ranks``' buffers here (collective). Made on the
    allocation thread of ``streams.persistent``: inside torch.compile's CUDA-graph warm-up the calling thread's
    allocations would land in the graph's pool."""

    def make() -> tuple:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        if zero:
            buf.zero_()  # before the rendezvous: no peer can notify us before it has our address
            torch.cuda.synchronize(device)
        hdl = symm_mem.rendezvous(buf, group.group_name)
        return buf, hdl, [hdl.get_buffer(r, (nbytes,), torch.uint8) for r in ranks]

    return streams.persistent(device.index, make)


def _symmetric(nbytes: int, group: dist.ProcessGroup, device: torch.device, zero: bool) -> tuple:
    """``symmetric`` with the one peer of a two-rank group: (buffer, handle, the peer's mapping)."""
    buf, hdl, views = symmetric(nbytes, group, device, zero, [1 - group.rank()])
    return buf, hdl, views[0]


def smallest_with_room(made: list, need: int, capturing: bool, make: Callable[[int], T]) -> T | None:
    """The workspace policy of the peer and ring routes: the first of ``made`` (ascending ``capacity``) with at
    least ``need`` bytes; else, unless ``capturing`` (None: no collective allocation inside a capture), a new one of
    ``make(capacity)``, a power of two of at least 1 MiB, appended. Never freed before the route's ``reset``: a
    graph may hold any of them, and a call shape maps to the same one for good (made ones only get larger), so a
    replay on one rank and the same call run eagerly on another use the same regions. All of them together are
    less than twice the largest."""
    for ws in made:
        if ws.capacity >= need:
            return ws
    if capturing:
        return None
    ws = make(max(1 << 20, 1 << (need - 1).bit_length()))
    made.append(ws)
    return ws


def flags(group: dist.ProcessGroup, device: torch.device) -> Flags:
    """The cached flag page of (device, group); made (collectively, zeroed) on first use."""
    key = (device.index, group.group_name)
    f = _flags.get(key)
    if f is None:
        buf, hdl, peer_view = _symmetric(FLAG_BYTES, group, device, zero=True)
        expected = streams.persistent(device.index,
                                      lambda: torch.zeros(1 + 2 * MAX_GROUPS, dtype=torch.int32, device=device))
        f = _flags[key] = Flags(buf, hdl, peer_view.data_ptr(), peer_view, expected,
                                torch.cuda.Stream(device=device, priority=-100))
    return f


def workspace(group: dist.ProcessGroup, device: torch.device, region_bytes: int,
              capturing: bool = False) -> Workspace | None:
    """The smallest workspace of (device, group) with at least ``region_bytes`` per region; a larger one is made
    (collectively) when none has room, and None returned instead when ``capturing`` (the call then takes the NCCL
    route). Never freed before ``reset`` (``smallest_with_room``)."""

    def make(capacity: int) -> Workspace:
        f = flags(group, device)
        buf, hdl, peer_view = _symmetric(2 * capacity, group, device, zero=False)
        log.info("flashoverlap peer: symmetric workspace of 2 x %d MiB on %s, group %s", capacity >> 20, device,
                 group.group_name)
        return Workspace(capacity, buf, hdl, peer_view.data_ptr(), peer_view, f)

    return smallest_with_room(_workspaces.setdefault((device.index, group.group_name), []), region_bytes,
                              capturing, make)


def reset() -> None:
    """Drop every workspace and flag page, the ring route's too (after synchronizing its device): the next call
    makes fresh ones, collectively, with zeroed flags. For tests and after a timeout, when the ranks' flags are out
    of step. CUDA graphs captured before must not be replayed after it."""
    from . import ring_route  # it imports this module

    for index, _ in list(_flags):
        torch.cuda.synchronize(index)
    _workspaces.clear()
    _flags.clear()
    _last_stream.clear()
    ring_route.reset()


@dataclass(frozen=True)
class PeerLaunch:
    """What one call shape needs (memoized by the runtime like its NCCL launches)."""

    collective: str
    config_partial: int
    config_add: int
    rows: int  # rows per rank (M / 2)
    own_row: int
    peer_row: int
    groups: int  # all_reduce copy groups (0 for reduce_scatter)
    group_rows: ctypes.Array
    group_tiles: ctypes.Array
    gmap: torch.Tensor | None
    sm_count: int
    workspace_bytes: int
    description: str
    push: bool  # all_reduce by push (GEMM 2 also stores into the peer's landing buffer)
    partial: str  # PARTIAL when the launch was made: "push" (GEMM 1 stores into the peer) or "pull"
    template: PeerArgs  # the fields fixed by the call shape; ``execute`` copies it and fills in the pointers


def unsupported(collective: str, rows: int, n: int, k: int, dtype: torch.dtype, world: int, layout: str | None,
                add_kernels: list[kernels.KernelInfo]) -> str | None:
    """Why this call cannot take the peer route (None: it can). Depends only on what all ranks share."""
    if collective not in COLLECTIVES:
        return f"{collective} has no peer route"
    if world != 2:
        return f"world size {world} (the peer route is for 2 ranks)"
    if rows % 2 or rows < 2:
        return f"{rows} rows do not split into two equal halves"
    dname = str(dtype).removeprefix("torch.")
    if not any((dname, layout) in c.variants for c in add_kernels):
        return f"no _addc configuration compiled for {dname} with B as {layout}"
    return None


def takes(collective: str, rows: int, n: int, k: int, dtype: torch.dtype, world: int) -> bool:
    """Whether a CUDA call of this shape will take the peer route: ``TRANSPORT`` is "peer", the kernel library is
    loadable and ``unsupported`` finds nothing for some B layout. What the cost model should predict
    (``decide(..., peer=...)``); inside a CUDA-graph capture a call shape that never ran before the capture still
    takes the NCCL route (``runtime_peer``). False (never raises) where the library cannot be read."""
    from . import ring_route  # it imports this module

    if TRANSPORT != "peer" or collective not in COLLECTIVES or world != 2 or ring_route.enabled(world):
        return False  # the ring route (ring_route.takes) or the NCCL route
    try:
        add = kernels.configs(add_c=True)
    except Exception:  # no library or no GPU: the runtime falls back to the NCCL route (or cuBLAS + NCCL) anyway
        return False
    return any(unsupported(collective, rows, n, k, dtype, world, layout, add) is None for layout in ("nk", "kn"))


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


def make_launch(collective: str, rows_total: int, n: int, k: int, dtype: torch.dtype, rank: int, plain: int,
                tile: tuple[int, int], res: streams.DeviceResources, grid_ctas, swizzle: int, raster: int,
                layout: str, device: torch.device) -> PeerLaunch:
    """The launch of one call shape: GEMM 1 with library configuration ``plain`` (tile ``tile``), GEMM 2 with the
    matching ``_addc`` configuration, the copy groups (all_reduce) and the grid (``grid_ctas(tiles) -> CTAs``)."""
    check_settings()
    lib = streams.kernel_lib()
    dname = str(dtype).removeprefix("torch.")
    pull = [c for c in kernels.configs(add_c=1) if (dname, layout) in c.variants]
    pushing = [c for level in (2, 3) for c in kernels.configs(add_c=level) if (dname, layout) in c.variants]
    if collective == "all_reduce" and pushing and not any(c.name == ADD_KERNEL for c in pull):
        cands = pushing  # all_reduce by push unless ADD_KERNEL names a pull configuration
    else:
        cands = pull
    named = [c for c in cands if c.name == ADD_KERNEL]
    preferred = [c for name in PREFERRED for c in cands if c.name == name]
    same = [c for c in cands if (c.tile_m, c.tile_n) == tuple(tile)]
    pick = (named or preferred or same or cands)[0]
    push = pick in pushing
    add = lib.config_index(pick.name, dtype, layout)
    half = rows_total // 2
    own_row, peer_row = rank * half, (1 - rank) * half
    tiles = -(-half // pick.tile_m) * -(-n // pick.tile_n)
    sm_count = grid_ctas(tiles)
    copies = collective == "all_reduce" and not push
    bounds = group_bounds(half, pick.tile_m, swizzle, GROUPS) if copies else [0, half]
    groups = len(bounds) - 1 if copies else 0
    group_rows = (ctypes.c_int32 * len(bounds))(*bounds)
    group_tiles = (ctypes.c_int32 * max(1, groups))(*planlib.tiles_per_group(bounds, pick.tile_m, pick.tile_n, n)) \
        if groups else (ctypes.c_int32 * 1)()
    gmap = streams.persistent(res.index, lambda: torch.tensor(planlib.group_of_tile_row(bounds, pick.tile_m),
                                                              dtype=torch.int32, device=device)) if groups else None
    ws = max(lib.workspace_bytes(plain, half, n, k, sm_count, raster, swizzle),
             lib.workspace_bytes(add, half, n, k, sm_count, raster, swizzle))
    how = "push" if push else (f"{groups} copy groups {bounds}" if groups else "reduce_scatter")
    desc = (f"{collective} rows={rows_total} n={n} k={k} {dname}: peer route, GEMM 1 partial by {PARTIAL}, GEMM 2 "
            f"{pick.name}, {how}, {sm_count} CTAs")
    log.info("flashoverlap: launch %s", desc)
    t = PeerArgs()
    t.config_partial, t.config_add = plain, add
    t.n, t.k, t.rows, t.own_row, t.peer_row, t.num_groups = n, k, half, own_row, peer_row, groups
    t.group_rows, t.group_tiles = ctypes.addressof(group_rows), ctypes.addressof(group_tiles)
    t.group_of_tile_row = gmap.data_ptr() if gmap is not None else None
    t.push, t.elem_bytes, t.sm_count, t.workspace_bytes = int(push), dtype.itemsize, sm_count, ws
    return PeerLaunch(collective, plain, add, half, own_row, peer_row, groups, group_rows, group_tiles, gmap,
                      sm_count, ws, desc, push, PARTIAL, t)


def order_after_last(group: dist.ProcessGroup, device: torch.device, stream: torch.cuda.Stream) -> None:
    """Order an eager call on ``stream`` after every peer call of ``group`` on ``device`` queued so far: the calls
    share one set of flags and buffers, so a call from another stream than the last one first waits (an event) for
    everything that stream has queued. Not under capture: a graph replays on the stream current at replay time,
    which must be the one that runs the group's eager calls (torch.compile's CUDA graphs warm up on a stream of
    their own, ordered here, and replay on the caller's)."""
    key = (device.index, group.group_name)
    last = _last_stream.get(key)
    if last is not None and last.cuda_stream != stream.cuda_stream:
        stream.wait_stream(last)
    _last_stream[key] = stream


_last_stream: dict[tuple[int, str], torch.cuda.Stream] = {}


def region_bytes(launch: PeerLaunch, n: int, elem_bytes: int) -> int:
    """Bytes per workspace region that ``launch`` needs: GEMM 1's partial (and all_reduce's own rows)."""
    return launch.rows * n * elem_bytes


def execute(launch: PeerLaunch, ws: Workspace, a: torch.Tensor, b: torch.Tensor, ldb: int, bias: torch.Tensor | None,
            out: torch.Tensor, res: streams.DeviceResources, slot: int, cur: torch.cuda.Stream, signal_mode: int,
            raster: int, swizzle: int, timeout_ns: int) -> torch.Tensor:
    """One call (``fo_peer_call``) with ``ws`` (``workspace``, at least ``region_bytes`` per region); ``out``: the
    op's output, [M, N] (all_reduce) or [M/2, N] (reduce_scatter)."""
    n = b.shape[1]
    partial, own, peer_partial, peer_own = ws.regions()
    workspace_t = torch.empty(launch.workspace_bytes, dtype=torch.uint8, device=a.device) \
        if launch.workspace_bytes else None
    out2 = out.view(-1, n)
    ar = launch.collective == "all_reduce"
    p = PeerArgs.from_buffer_copy(launch.template)  # the shape's fields; this call's pointers and settings below
    p.a, p.lda, p.b, p.ldb = a.data_ptr(), a.stride(0), b.data_ptr(), ldb
    p.bias = bias.data_ptr() if bias is not None else None
    # fo_peer_call's partial = GEMM 1's destination, peer_partial = GEMM 2's C (see PARTIAL)
    p.partial, p.peer_partial = (peer_partial, partial) if launch.partial == "push" else (partial, peer_partial)
    p.own_dst, p.ld_own = (own, n) if ar else (out2.data_ptr(), out2.stride(0))  # push: own = the landing buffer
    f = ws.flags
    p.flags, p.peer_flags, p.expected = f.buf.data_ptr(), f.peer_base, f.expected.data_ptr()
    p.counters = res.counters[slot].data_ptr() if launch.groups else None
    p.peer_own = peer_own if ar else None
    p.copy_on_sms = int(FINAL_COPY == "sm")
    p.gate_in_kernel = int(GATE == "kernel")
    p.out, p.ld_out = out2.data_ptr(), out2.stride(0)
    p.signal_mode, p.raster, p.swizzle = signal_mode, raster, swizzle
    p.workspace = workspace_t.data_ptr() if workspace_t is not None else None
    p.timeout_ns, p.error_record = timeout_ns, res.record.data_ptr()
    p.cur_stream, p.side_stream, p.pull_stream = cur.cuda_stream, res.side.cuda_stream, f.pull.cuda_stream
    lib = streams.kernel_lib()
    lib.check(lib.lib.fo_peer_call(ctypes.byref(p)), "fo_peer_call")
    return out
