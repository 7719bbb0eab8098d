"""ctypes binding of the sm90 signal-GEMM library (``build/libflashoverlap_sm90.so``, or ``Settings.library``).

The library is torch-independent (a C ABI on raw pointers and ``cudaStream_t``), so one build serves every
Python and torch version; this module turns torch tensors into those pointers and checks every return code.

Invariants:
- ``signal_gemm`` computes ``out = a @ b (+ bias)`` (fp32 accumulation, output in the input dtype). With
  ``counters``, every finished output tile of tile-row ``t`` adds 1 to ``counters[group_of_tile_row[t]]`` (or
  ``counters[t]`` without a map) after its stores are complete and visible at GPU scope, so one GEMM adds
  exactly ``plan.tiles_per_group(...)[g]`` to counter ``g``. Counters are never reset: waiters use epoch
  targets, compared cyclically in int32.
- Every wait is bounded (``timeout_ms``); a timeout is recorded in pinned host memory and turned into
  ``FlashOverlapTimeout`` by ``raise_if_timed_out()``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ABI_VERSION = 7
LIB_ENV = "FLASHOVERLAP_LIB"
DEFAULT_LIB = Path(__file__).resolve().parent.parent / "build" / "libflashoverlap_sm90.so"
DTYPES = {torch.bfloat16: 0, torch.float16: 1}
B_LAYOUTS = ("nk", "kn")  # B given as [N,K] (K contiguous: a Linear weight, b = W.t()) or as [K,N] (N contiguous)
SCHEDULES = ("coop", "pp")
RASTERS = {"heuristic": 0, "along_m": 1, "along_n": 2}
SIGNAL_MODES = {"immediate": 0, "deferred": 1}
# Defaults when the caller names none (docs/results.md): the configuration that is good in both H200 regimes (power-
# capped sustained: 0.985x cuBLAS geomean; cool GPU: 0.99-1.00x at 8192^3), and a swizzle of 4 tile-rows per
# band (swizzle 1 loses up to 25% on some configurations; 8 is a little faster but makes wave groups coarser:
# the tiles of a band finish together).
DEFAULT_CONFIG = "coop_128x256x64_c2x1_e128x64"
DEFAULT_SWIZZLE = 4


def _cutlass_log_swizzle(tiles_m: int, tiles_n: int, swizzle: int) -> int:
    """The log2 swizzle CUTLASS's sm90 persistent scheduler takes for a maximum of ``swizzle``
    (``get_log_swizzle_size``, given the tile counts already rounded up to the cluster shape: 8 needs >= 6 along
    both dimensions, 4 needs 3, 2 needs 2)."""
    least = min(tiles_m, tiles_n)
    for log, need in ((3, 6), (2, 3), (1, 2)):
        if swizzle >= 1 << log and least >= need:
            return log
    return 0


def unpadded_swizzle(m: int, n: int, tile_m: int, tile_n: int, cluster_m: int, cluster_n: int, swizzle: int) -> int:
    """The largest power of two <= ``swizzle`` at which CUTLASS's persistent scheduler pads the grid of tiles no
    further than the cluster shape already does. It rounds the tiles along M up to a multiple of swizzle x
    cluster_m (along N: swizzle x cluster_n) and runs the padded tiles too: a GEMM of 512 rows in 128-row tiles
    and 2x1 clusters at swizzle 4 (4 tile-rows padded to 8) took twice cuBLAS's time, one of 1024 rows the same
    (docs/results.md, twelfth session). Matters for GEMMs of few tile-rows (the ring route's steps)."""
    tm, tn = -(-m // tile_m), -(-n // tile_n)

    def padded(tiles: int, multiple: int) -> int:
        return -(-tiles // multiple) * multiple

    s = max(1, swizzle)
    while s > 1:
        unit = 1 << _cutlass_log_swizzle(padded(tm, cluster_m), padded(tn, cluster_n), s)
        if padded(tm, unit * cluster_m) == padded(tm, cluster_m) and padded(tn, unit * cluster_n) == padded(tn,
                                                                                                         cluster_n):
            break
        s //= 2
    return s


class KernelLibraryError(RuntimeError):
    """The CUDA library is missing, stale, or a call into it failed."""


class FlashOverlapTimeout(RuntimeError):
    """A bounded GPU wait gave up: the counter never reached its target (a hung or missing producer)."""


@dataclass(frozen=True)
class KernelInfo:
    """One compiled configuration (tiles in output elements; ``stages``/``epi`` 0 = chosen by CUTLASS)."""

    name: str
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int
    cluster_n: int
    schedule: str
    stages: int
    epi_m: int
    epi_n: int
    variants: tuple[tuple[str, str], ...]  # (dtype name, B layout) pairs compiled


class GroupStep(ctypes.Structure):
    """``fo_group_step`` of ``csrc/flashoverlap_sm90.h`` (offsets and counts in elements)."""

    _fields_ = [("tiles", ctypes.c_int32), ("kind", ctypes.c_int32), ("buf_offset", ctypes.c_int64),
                ("out_offset", ctypes.c_int64), ("count", ctypes.c_int64), ("first_p2p", ctypes.c_int32),
                ("num_p2p", ctypes.c_int32), ("local_buf", ctypes.c_int64), ("local_out", ctypes.c_int64),
                ("local_count", ctypes.c_int64), ("copy_src", ctypes.c_int64), ("copy_dst", ctypes.c_int64),
                ("copy_width", ctypes.c_int64), ("copy_height", ctypes.c_int64), ("copy_src_pitch", ctypes.c_int64),
                ("copy_dst_pitch", ctypes.c_int64)]


class P2PStep(ctypes.Structure):
    """``fo_p2p_step`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("recv", ctypes.c_int32), ("peer", ctypes.c_int32), ("offset", ctypes.c_int64),
                ("count", ctypes.c_int64)]


# fo_group_step.kind; "reduce_pieces": reduce_scatter from natural rows, one ncclReduce per chunk piece
STEP_KINDS = {"all_reduce": 0, "reduce_scatter": 1, "all_to_all": 2, "none": 3, "reduce_pieces": 4}


def library_path() -> Path:
    """``Settings.library`` (``$FLASHOVERLAP_LIB``), else ``build/libflashoverlap_sm90.so`` of the checkout."""
    from . import config

    return Path(config.current().library or DEFAULT_LIB)


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_i64, c_p, c_sz = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
    sig = {
        "fo_abi_version": (c_int, []),
        "fo_last_error": (ctypes.c_char_p, []),
        "fo_preload": (c_int, []),
        "fo_num_configs": (c_int, []),
        "fo_config_info": (c_int, [c_int, ctypes.c_char_p, c_int, ctypes.POINTER(c_int)]),
        "fo_gemm_workspace_size": (c_int, [c_int] * 7 + [ctypes.POINTER(c_sz)]),
        "fo_gemm": (c_int, [c_int, c_p, c_i64, c_p, c_i64, c_p, c_p, c_i64, c_p, c_i64, c_int, c_int, c_int, c_p,
                            c_p, c_p, c_int, c_int, c_int, c_int, c_p, c_sz, c_p]),
        "fo_notify": (c_int, [c_p, c_p]),
        "fo_peer_call": (c_int, [c_p]),
        "fo_ring_call": (c_int, [c_p]),
        "fo_wait_counter": (c_int, [c_p, c_p, c_int, c_i64, c_p, c_int, c_p]),
        "fo_stream_wait_value": (c_int, [c_p, c_p, c_int]),
        "fo_nccl_bind": (c_int, [ctypes.c_char_p]),
        "fo_fused_call": (c_int, [c_int, c_p, c_i64, c_p, c_i64, c_p, c_p, c_p, c_i64, c_int, c_int, c_int, c_p,
                                  c_p, c_int, c_int, c_int, c_int, c_p, c_sz, c_p, c_p, c_int, c_p, c_p, c_p, c_int,
                                  c_int, c_p, c_i64, c_p, c_p, c_p]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    if not os.path.isfile(path):
        raise KernelLibraryError(f"CUDA library not found at {path}: build it with `python -m "
                                 f"flashoverlap_inductor.build` (needs nvcc) or point ${LIB_ENV} at a built copy")
    try:
        lib = ctypes.CDLL(path)
        _declare(lib)
    except (OSError, AttributeError) as e:
        raise KernelLibraryError(f"cannot load {path}: {e}") from e
    if lib.fo_abi_version() != ABI_VERSION:
        raise KernelLibraryError(f"{path} has ABI {lib.fo_abi_version()}, this module needs {ABI_VERSION}: rebuild")
    return lib


def library() -> ctypes.CDLL:
    """The loaded library (raises ``KernelLibraryError`` with the build command when it is missing)."""
    return _load(str(library_path()))


def available() -> bool:
    """True when a Hopper (sm90) GPU is visible and the library loads."""
    try:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            return False
        library()
        return True
    except (KernelLibraryError, RuntimeError):
        return False


@functools.cache
def _ready(path: str, device_index: int) -> ctypes.CDLL:
    """The library with every kernel loaded on ``device_index``. Lazy loading would load a kernel at its first
    launch, which can synchronize the context and deadlock against a wait kernel that spins for it."""
    lib = _load(path)
    with torch.cuda.device(device_index):
        _check(lib.fo_preload(), "fo_preload")
    return lib


def ready(device: torch.device | int | None = None) -> ctypes.CDLL:
    """Load the library and all its kernels on ``device`` (default: current); idempotent."""
    if device is None:
        index = torch.cuda.current_device()
    else:
        index = device if isinstance(device, int) else (device.index if device.index is not None
                                                         else torch.cuda.current_device())
    return _ready(str(library_path()), index)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = library().fo_last_error().decode(errors="replace")
        raise KernelLibraryError(f"{what} failed (code {rc}): {msg}")


@functools.cache
def _entries(path: str) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    lib = _load(path)
    out = []
    for i in range(lib.fo_num_configs()):
        name = ctypes.create_string_buffer(128)
        ints = (ctypes.c_int * 12)()
        _check(lib.fo_config_info(i, name, 128, ints), "fo_config_info")
        out.append((name.value.decode(), tuple(ints), i))
    return tuple(out)


def configs(add_c: int = 0) -> list[KernelInfo]:
    """The compiled configurations, one entry per name with the (dtype, B layout) variants it was built for.
    ``add_c`` (``fo_config_info`` ints[11]): 1 the ``_addc`` configurations instead (their epilogue adds a C
    operand: the peer route's second GEMM), 2 / 3 those that also store D to an aux tensor (``_addc_aux`` /
    ``_addc_auxr``: all_reduce by push); none of them is ever among the plain ones."""
    by_name: dict[str, tuple[tuple[int, ...], list[tuple[str, str]]]] = {}
    dtype_names = {v: str(k).removeprefix("torch.") for k, v in DTYPES.items()}
    for name, ints, _ in _entries(str(library_path())):
        if ints[11] != int(add_c):
            continue
        by_name.setdefault(name, (ints, []))[1].append((dtype_names[ints[9]], B_LAYOUTS[ints[10]]))
    return [KernelInfo(name, *ints[:5], SCHEDULES[ints[5]], ints[6], ints[7], ints[8], tuple(sorted(v)))
            for name, (ints, v) in sorted(by_name.items())]


def config_info(name: str) -> KernelInfo:
    for c in configs() + configs(1) + configs(2) + configs(3):
        if c.name == name:
            return c
    raise KeyError(f"no compiled GEMM configuration {name!r}; compiled: {[c.name for c in configs()]}")


@functools.lru_cache(maxsize=256)
def _lookup(path: str, name: str, dtype: torch.dtype, b_layout: str) -> tuple[int, int]:
    """(library index, tile_m) of a configuration variant."""
    for cname, ints, idx in _entries(path):
        if cname == name and ints[9] == DTYPES[dtype] and B_LAYOUTS[ints[10]] == b_layout:
            return idx, ints[0]
    have = [(n, B_LAYOUTS[i[10]], i[9]) for n, i, _ in _entries(path) if n == name]
    raise KeyError(f"configuration {name!r} is not compiled for {dtype} with B as {b_layout} "
                   f"(compiled variants: {have or 'none'})")


@functools.lru_cache(maxsize=1024)
def _workspace_bytes(path: str, idx: int, m: int, n: int, k: int, sm_count: int, raster: int, swizzle: int) -> int:
    size = ctypes.c_size_t(0)
    _check(_load(path).fo_gemm_workspace_size(idx, m, n, k, sm_count, raster, swizzle, ctypes.byref(size)),
           "fo_gemm_workspace_size")
    return size.value


def _aligned(t: torch.Tensor, row_stride: int) -> bool:
    return t.data_ptr() % 16 == 0 and row_stride % 8 == 0


def _prepare_a(a: torch.Tensor) -> torch.Tensor:
    """A as row-major [M,K] with a 16-byte aligned row stride; other strides are copied (documented cost)."""
    if a.stride(1) == 1 and a.stride(0) >= a.shape[1] and _aligned(a, a.stride(0)):
        return a
    return a.clone(memory_format=torch.contiguous_format)


def _prepare_b(b: torch.Tensor) -> tuple[torch.Tensor, str, int]:
    """B [K,N] as either the [N,K] weight form (stride(0) == 1) or row-major [K,N]; else a contiguous copy."""
    k, n = b.shape
    if b.stride(0) == 1 and b.stride(1) >= k and _aligned(b, b.stride(1)):
        return b, "nk", b.stride(1)
    if b.stride(1) == 1 and b.stride(0) >= n and _aligned(b, b.stride(0)):
        return b, "kn", b.stride(0)
    b = b.clone(memory_format=torch.contiguous_format)
    return b, "kn", b.stride(0)


@functools.lru_cache(maxsize=64)
def _device_map(groups: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(groups, dtype=torch.int32, device=device)


def signal_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                *, config: str | None = None, counters: torch.Tensor | None = None,
                group_of_tile_row: torch.Tensor | list[int] | tuple[int, ...] | None = None, sm_count: int = 0,
                raster: str = "along_n", swizzle: int = DEFAULT_SWIZZLE, signal_mode: str = "deferred",
                tile_row_order: Sequence[int] | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    """``out[M,N] = a[M,K] @ b[K,N] (+ bias[N])`` on the current stream, signalling tile completion.

    ``a``: bf16/fp16, row-major (any 16-byte aligned row stride; other layouts are copied). ``b``: same dtype,
    either a transposed Linear weight (``W.t()``, W [N,K] contiguous) or row-major [K,N]. ``out``: row-major
    [M,N] (allocated when None). ``counters``: int32 CUDA tensor, one counter per group (None = no signals);
    ``group_of_tile_row``: ``plan.group_of_tile_row(bounds, tile_m)`` of this configuration's ``tile_m`` (list
    or int32 CUDA tensor; None = one counter per tile-row). ``sm_count``: SMs the GEMM may use (0 = all).
    ``raster``/``swizzle``: the persistent scheduler's tile order (correctness never depends on it): "along_n"
    walks each band of ``swizzle`` tile-rows column by column, so tile-rows finish band by band, in order.
    ``signal_mode``: "deferred" (signal each tile at the issuing warp's next epilogue; no store-drain stall) or
    "immediate" (drain and signal at the end of every tile). ``tile_row_order``: a permutation of the tile-rows
    (``plan.scheduled_tile_rows``): the scheduler computes tile-row ``tile_row_order[s]`` where it would compute
    tile-row ``s`` (None = natural order); the values in ``out`` never depend on it. ``addend``: a row-major [M,N]
    tensor of a's dtype, for the ``_addc`` configurations only (the default then is the first of them): ``out =
    round(a @ b (+ bias)) + addend``, summed in fp32 and rounded once.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"signal_gemm: need a [M,K] and b [K,N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise ValueError(f"signal_gemm: a and b must both be bfloat16 or float16, got {a.dtype} and {b.dtype}")
    if not (a.is_cuda and b.is_cuda and a.device == b.device):
        raise ValueError("signal_gemm: a and b must be CUDA tensors on one device")
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        raise ValueError(f"signal_gemm: empty problem M={m} N={n} K={k}")
    if k % 8 or n % 8:
        raise ValueError(f"signal_gemm: K={k} and N={n} must be multiples of 8 (16-byte TMA rows)")
    name = config or (DEFAULT_CONFIG if addend is None else next((c.name for c in configs(add_c=1)), "?"))
    if addend is not None and (addend.shape != (m, n) or addend.dtype != a.dtype or addend.device != a.device
                               or addend.stride(1) != 1 or not _aligned(addend, addend.stride(0))):
        raise ValueError("signal_gemm: addend must be a row-major [M,N] tensor of a's dtype on a's device with a "
                         "16-byte aligned row stride")
    a = _prepare_a(a)
    b, b_layout, ldb = _prepare_b(b)
    path = str(library_path())
    idx, tile_m = _lookup(path, name, a.dtype, b_layout)
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"signal_gemm: bias must have shape ({n},), got {tuple(bias.shape)}")
        bias = bias.to(device=a.device, dtype=a.dtype).contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif (out.shape != (m, n) or out.dtype != a.dtype or out.device != a.device or out.stride(1) != 1
          or not _aligned(out, out.stride(0))):
        raise ValueError("signal_gemm: out must be a row-major [M,N] tensor of a's dtype with a 16-byte aligned "
                         "row stride")
    gmap = None
    if counters is not None:
        if counters.dtype != torch.int32 or counters.device != a.device or not counters.is_contiguous():
            raise ValueError("signal_gemm: counters must be a contiguous int32 tensor on a's device")
        tile_rows = math.ceil(m / tile_m)
        if group_of_tile_row is None:
            if counters.numel() < tile_rows:
                raise ValueError(f"signal_gemm: {tile_rows} tile-rows need {tile_rows} counters without a map")
        elif isinstance(group_of_tile_row, torch.Tensor):
            gmap = group_of_tile_row
            if gmap.dtype != torch.int32 or gmap.device != a.device or gmap.numel() != tile_rows:
                raise ValueError(f"signal_gemm: group_of_tile_row must be {tile_rows} int32 values on a's device")
        else:
            groups = tuple(int(g) for g in group_of_tile_row)
            if len(groups) != tile_rows or min(groups) < 0 or max(groups) >= counters.numel():
                raise ValueError(f"signal_gemm: group_of_tile_row needs {tile_rows} entries in "
                                 f"[0, {counters.numel()}), got {len(groups)}")
            gmap = _device_map(groups, a.device)
    order = None
    if tile_row_order is not None:
        perm = tuple(int(t) for t in tile_row_order)
        if sorted(perm) != list(range(math.ceil(m / tile_m))):
            raise ValueError(f"signal_gemm: tile_row_order must be a permutation of the {math.ceil(m / tile_m)} "
                             f"tile-rows, got {len(perm)} values")
        order = _device_map(perm, a.device)
    lib = ready(a.device)
    with torch.cuda.device(a.device):
        stream = torch.cuda.current_stream(a.device).cuda_stream
        raster_id, mode = RASTERS[raster], SIGNAL_MODES[signal_mode]
        ws_bytes = _workspace_bytes(path, idx, m, n, k, sm_count, raster_id, swizzle)
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=a.device) if ws_bytes else None
        _check(lib.fo_gemm(idx, a.data_ptr(), a.stride(0), b.data_ptr(), ldb,
                           bias.data_ptr() if bias is not None else None,
                           addend.data_ptr() if addend is not None else None,
                           addend.stride(0) if addend is not None else 0, out.data_ptr(), out.stride(0), m, n, k,
                           counters.data_ptr() if counters is not None else None,
                           gmap.data_ptr() if gmap is not None else None,
                           order.data_ptr() if order is not None else None, mode, sm_count, raster_id, swizzle,
                           ws.data_ptr() if ws is not None else None, ws_bytes, stream), f"fo_gemm[{name}]")
    return out


@functools.cache
def _error_record(device_index: int) -> torch.Tensor:
    """Pinned host int32[4] {code, tag, seen, target} the wait kernel writes on timeout (same address on the
    device under unified addressing)."""
    return torch.zeros(4, dtype=torch.int32, pin_memory=True)


def _timeout_ns(timeout_ms: float | None) -> int:
    if timeout_ms is None:
        from flashoverlap_inductor import config

        timeout_ms = config.wait_timeout_ms
    return max(1, int(timeout_ms * 1e6))


def _stream_ptr(t: torch.Tensor, stream: torch.cuda.Stream | None) -> Any:
    return (stream or torch.cuda.current_stream(t.device)).cuda_stream


def wait_group(counters: torch.Tensor, group: int, target: int, *, stream: torch.cuda.Stream | None = None,
               timeout_ms: float | None = None) -> None:
    """Hold ``stream`` until ``counters[group]`` reaches ``target`` (cyclic int32 >=; ``target = epoch *
    tiles_in_group``). Bounded by ``timeout_ms`` (default ``config.wait_timeout_ms``); on timeout the kernel
    exits and records the error: call ``raise_if_timed_out()`` after synchronizing."""
    record = _error_record(counters.device.index or 0)
    lib = ready(counters.device)
    _check(lib.fo_wait_counter(counters.data_ptr() + 4 * group, None, _wrap32(target), _timeout_ns(timeout_ms),
                               record.data_ptr(), group, _stream_ptr(counters, stream)), "fo_wait_counter")


def wait_group_epoch(counters: torch.Tensor, expected: torch.Tensor, group: int, tiles: int, *,
                     stream: torch.cuda.Stream | None = None, timeout_ms: float | None = None) -> None:
    """CUDA-graph-safe form: the target lives on the device. Waits until ``counters[group] >= expected[group] +
    tiles`` and stores that target back into ``expected[group]`` (int32 CUDA tensor, zero-initialized with the
    counters), so every call -- or graph replay -- waits for one more GEMM's worth of tiles."""
    record = _error_record(counters.device.index or 0)
    lib = ready(counters.device)
    _check(lib.fo_wait_counter(counters.data_ptr() + 4 * group, expected.data_ptr() + 4 * group, int(tiles),
                               _timeout_ns(timeout_ms), record.data_ptr(), group, _stream_ptr(counters, stream)),
           "fo_wait_counter")


def stream_wait_value(counters: torch.Tensor, group: int, target: int, *,
                      stream: torch.cuda.Stream | None = None) -> None:
    """``cuStreamWaitValue32(GEQ)`` on ``counters[group]``: no kernel, no SM, but NOT bounded (no timeout)."""
    _check(ready(counters.device).fo_stream_wait_value(_stream_ptr(counters, stream), counters.data_ptr() + 4 * group,
                                          _wrap32(target)), "fo_stream_wait_value")


def raise_if_timed_out(device: int | None = None) -> None:
    """Raise ``FlashOverlapTimeout`` if a wait on ``device`` timed out since the last check (then clear it).
    The record is host memory: synchronize first to see waits still in flight."""
    record = _error_record(torch.cuda.current_device() if device is None else device)
    code, tag, seen, target = (int(x) for x in record.tolist())
    if code:
        record.zero_()
        raise FlashOverlapTimeout(f"GPU wait for group {tag} timed out: counter at {seen}, target {target}; the "
                                  "signalling GEMM did not finish (hung, failed, or launched with other counters)")


def _wrap32(x: int) -> int:
    """Python int -> the int32 with the same low 32 bits (targets are compared cyclically)."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x
