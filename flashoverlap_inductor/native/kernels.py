"""ctypes binding of the sm90 signal-GEMM library (``build/libflashoverlap_sm90.so``, or ``Settings.library``).

The library is torch-independent (a C ABI on raw pointers and ``cudaStream_t``), so one build serves every
Python and torch version. This module is the one binding of that ABI: it loads and declares the library, lists its
configurations, and checks return codes; the routes call it with raw pointers, ``kernel_calls`` on torch tensors.

Invariants:
- A GEMM computes ``out = a @ b (+ bias)`` (fp32 accumulation, output in the input dtype). With
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
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from flashoverlap_inductor import config, errors

# 10: fo_fault_mark (the NCCL watchdog); 11: fo_peer_args.probe_events; 12: the fo_moe_* calls; 13: fo_gather_gemms;
# 14: fo_gather_args.slot_set; 15: the options bit FO_GATHER_COPY_NOTIFY; 16: fo_gather_args.set_bytes;
# 17: fo_cublaslt_bind, fo_gather_run, fo_gather_gemm_args.workspace; 18: fo_scatter_run, FO_GATHER_FLAG_INTS 9 x 8;
# 19: fo_scatter_gemm_args.all_reduce and .cuts (the all_reduce pull route); 20: fo_grouped_gemm;
# 21: fo_moe_dispatch_cut; 22: fo_moe_poison_args.mirror; 23: fo_moe_combine_blocks
ABI_VERSION = 24
LIB_ENV = "FLASHOVERLAP_LIB"
DEFAULT_LIB = Path(__file__).resolve().parents[2] / "build" / "libflashoverlap_sm90.so"
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


FlashOverlapTimeout = errors.FlashOverlapTimeout  # where it has always been importable from


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
    return Path(_library_path_str())


def _library_path_str() -> str:
    return _path_str(config.current().library)


@functools.lru_cache(maxsize=16)
def _path_str(setting: str | None) -> str:
    return str(Path(setting or DEFAULT_LIB))


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
        "fo_gather_call": (c_int, [c_p]),
        "fo_gather_finish": (c_int, [c_p]),
        "fo_cublas_bind": (c_int, [ctypes.c_char_p]),
        "fo_cublaslt_bind": (c_int, [ctypes.c_char_p]),
        "fo_gather_gemms": (c_int, [c_p]),
        "fo_gather_run": (c_int, [c_p, c_p, ctypes.POINTER(ctypes.c_int32)]),
        "fo_scatter_run": (c_int, [c_p, c_p, ctypes.POINTER(ctypes.c_int32)]),
        "fo_wait_counter": (c_int, [c_p, c_p, c_int, c_i64, c_p, c_int, c_p]),
        "fo_stream_wait_value": (c_int, [c_p, c_p, c_int]),
        "fo_nccl_bind": (c_int, [ctypes.c_char_p]),
        "fo_gemm_cache_enable": (c_int, [c_int]),
        "fo_gemm_cache_stats": (c_int, [ctypes.POINTER(c_i64), ctypes.POINTER(c_i64)]),
        "fo_fused_call": (c_int, [c_int, c_p, c_i64, c_p, c_i64, c_p, c_p, c_p, c_i64, c_int, c_int, c_int, c_p,
                                  c_p, c_int, c_int, c_int, c_int, c_p, c_sz, c_p, c_p, c_int, c_p, c_p, c_p, c_int,
                                  c_int, c_p, c_i64, c_p, c_p, c_int, c_i64, c_int, c_p, c_p]),
        "fo_fault_clear": (c_int, [c_p, c_p, c_p]),
        "fo_fault_mark": (c_int, [c_p, c_int, c_int, c_p]),
        "fo_moe_plan": (c_int, [c_p]),
        "fo_moe_poison": (c_int, [c_p]),
        "fo_moe_move_rows": (c_int, [c_p]),
        "fo_grouped_gemm_workspace": (c_int, [c_p, ctypes.POINTER(c_i64)]),
        "fo_grouped_gemm": (c_int, [c_p]),
        "fo_moe_dispatch_cut": (c_int, [c_p]),
        "fo_moe_combine_blocks": (c_int, [c_p]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def gemm_cache_stats() -> tuple[int, int]:
    """(hits, misses) of the library's GEMM launch cache since it was loaded, over all configurations."""
    hits, misses = ctypes.c_int64(0), ctypes.c_int64(0)
    library().fo_gemm_cache_stats(ctypes.byref(hits), ctypes.byref(misses))
    return hits.value, misses.value


def gemm_cache_enable(enabled: bool) -> bool:
    """Turn the library's GEMM launch cache on or off (a diagnostic: off, every launch builds its parameters);
    returns the previous state."""
    return bool(library().fo_gemm_cache_enable(int(enabled)))


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


_last_library: tuple = (None, None)  # (settings, library): library()'s last answer, reused for the same settings


def library() -> ctypes.CDLL:
    """The loaded library (raises ``KernelLibraryError`` with the build command when it is missing). Memoized on the
    current ``Settings`` object (immutable; a fused call runs under one), a few us of host time per fused call."""
    global _last_library
    settings = config.current()
    last = _last_library
    if last[0] is settings:
        return last[1]
    lib = _load(_path_str(settings.library))
    _last_library = (settings, lib)
    return lib


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
        check(lib.fo_preload(), "fo_preload")
    return lib


def ready(device: torch.device | int | None = None) -> ctypes.CDLL:
    """Load the library and all its kernels on ``device`` (default: current); idempotent."""
    if device is None:
        index = torch.cuda.current_device()
    else:
        index = device if isinstance(device, int) else (device.index if device.index is not None
                                                         else torch.cuda.current_device())
    return _ready(str(library_path()), index)


def last_error() -> str:
    """The library's message for its last failed call (``fo_last_error``)."""
    return library().fo_last_error().decode(errors="replace")


def refusal(rc: int, what: str) -> str:
    """For a call that may refuse its arguments before any launch (rc 1-99: nothing enqueued): "" for rc 0, the
    library's message for a refusal; a failure after a launch (rc >= 100) raises as ``check``."""
    if rc >= 100:
        check(rc, what)
    return last_error() if rc else ""


def check(rc: int, what: str) -> None:
    """Raise ``KernelLibraryError`` with the library's message for a nonzero return code of ``what``."""
    if rc != 0:
        msg = last_error()
        exc = KernelLibraryError(f"{what} failed (code {rc}): {msg}")
        exc.code = rc  # 300 + ncclResult_t: NCCL refused a call (the caller aborts the communicator)
        raise exc



@functools.cache
def _entries(path: str) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    lib = _load(path)
    out = []
    for i in range(lib.fo_num_configs()):
        name = ctypes.create_string_buffer(128)
        ints = (ctypes.c_int * 12)()
        check(lib.fo_config_info(i, name, 128, ints), "fo_config_info")
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


def config_index(name: str, dtype: torch.dtype, b_layout: str) -> int:
    """The library index of configuration ``name`` compiled for ``dtype`` and B layout ``"nk"``/``"kn"``."""
    return _lookup(str(library_path()), name, dtype, b_layout)[0]


def workspace_bytes(index: int, m: int, n: int, k: int, sm_count: int, raster: int, swizzle: int) -> int:
    """Bytes of GEMM workspace configuration ``index`` needs for ``[m, k] @ [k, n]`` on ``sm_count`` CTAs."""
    return _workspace_bytes(str(library_path()), index, m, n, k, sm_count, raster, swizzle)


def gemm(index: int, a: torch.Tensor, b: torch.Tensor, ldb: int, bias: torch.Tensor | None, out: torch.Tensor,
         counters_ptr: int, gmap: torch.Tensor, order: torch.Tensor | None, signal_mode: int, sm_count: int,
         raster: int, swizzle: int, workspace: torch.Tensor | None, stream_ptr: int) -> None:
    """``fo_gemm`` with a configuration index (no checks: the tuner's timing loop): ``out[M, N] = a[M, K] @ b (+
    bias)`` on ``stream_ptr``, signalling ``counters[gmap[tile_row]]``, tile-rows in ``order`` (None: natural)."""
    m, k = a.shape
    check(library().fo_gemm(index, a.data_ptr(), a.stride(0), b.data_ptr(), ldb,
                            bias.data_ptr() if bias is not None else None, None, 0, out.data_ptr(), out.stride(0), m,
                            out.shape[1], k, counters_ptr, gmap.data_ptr(),
                            order.data_ptr() if order is not None else None, signal_mode, sm_count, raster, swizzle,
                            workspace.data_ptr() if workspace is not None else None,
                            workspace.numel() if workspace is not None else 0, stream_ptr), "fo_gemm")


@functools.lru_cache(maxsize=1024)
def _workspace_bytes(path: str, idx: int, m: int, n: int, k: int, sm_count: int, raster: int, swizzle: int) -> int:
    size = ctypes.c_size_t(0)
    check(_load(path).fo_gemm_workspace_size(idx, m, n, k, sm_count, raster, swizzle, ctypes.byref(size)),
         "fo_gemm_workspace_size")
    return size.value


@functools.cache
def _error_record(device_index: int) -> torch.Tensor:
    """Pinned host int32[4] {code, tag, seen, target} the wait kernel writes on timeout (same address on the
    device under unified addressing)."""
    return torch.zeros(4, dtype=torch.int32, pin_memory=True)
