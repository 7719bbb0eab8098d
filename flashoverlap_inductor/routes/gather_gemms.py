"""The gather peer route's GEMMs in one library call (``fo_gather_gemms``, ``csrc/gather_gemms.cu``) instead of one
``torch.mm`` per (shard, weight) from Python: cuBLAS through the library torch loaded, on torch's handle of this
thread, device and stream (with torch's workspace), with torch's arguments, so every result rounds bit for bit as
``schedule.gather.shard_gemm``'s ``torch.mm`` (``tests/test_gpu_gather.py`` checks it against ``torch.mm``). It saves
the host time of 2 x weights torch calls, their shard views and the Python stream (2 H200s: 6 ``torch.mm`` held the
host ~95 us of a ~420 us call, cProfile, ``examples/device/gather_host_profile.py``).

Taken (``static_args``, ``usable``) where that is provably the same computation: contiguous shards
(``lead == 1``), no bias, bf16, rows, K and every N in [2, 2^31) (torch adjusts leading dimensions below 2; cuBLAS
takes ints), every weight a Linear's ``W.t()``, torch's cuBLAS preferred (not cuBLASLt), neither
deterministic-algorithms mode (torch then checks the workspace configuration) nor TunableOp (it picks other
algorithms), bf16's reduced-precision reduction allowed (torch's default, math mode ``CUBLAS_DEFAULT_MATH``; torch
2.13's split-K setting can be off only where it is off), one cuBLAS mapped and bound (``bind``), no timeline probe
(its marks sit between the GEMMs: ``bench timeline`` draws the ``torch.mm`` loop), and not under the experiment
``gather_torch_gemms``. Everywhere else the Python loop (``schedule.gather.shard_gemm``), which is also the reference
semantics. The library also takes fp16 and row-major ``[K, N]`` weights; neither has run on a GPU, so neither is
taken.

Outside CUDA-graph captures, where the cuBLASLt torch loaded is bound too (``bind``), each GEMM is one
``cublasLtMatmul`` with the shape's descriptors and heuristic algorithm made once in the library and kept, on a
persistent workspace of ``WORKSPACE_BYTES`` per device (``workspace``; the route's calls on a device run in stream
order, ``symmetric.order_after_last``): ``cublasGemmEx`` runs that heuristic on every call. The same product in the
same compute and scale type; ``tests/test_gpu_gather.py`` compares it with ``torch.mm`` (bit for bit where the
heuristic picks cuBLAS's algorithm, else within bf16's rounding); a GEMM with an operand off a 256-byte boundary (the
heuristic's assumption) takes ``cublasGemmEx`` inside the library. The experiment ``gather_gemm_ex`` keeps
``cublasGemmEx``. Inside a capture ``cublasGemmEx`` always (a replay's host time is nil; no workspace shared with
eager calls). With the GEMMs in the library, the call is one library call: ``fo_gather_run`` (the protocol's call,
the GEMMs, the finish; ``run_call``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterable

import torch

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import streams

from .base import stats
from .gather_protocol import MAX_OUTPUTS, MAX_WORLD

log = logging.getLogger("flashoverlap")

EXPERIMENT = "gather_torch_gemms"
GEMM_EX_EXPERIMENT = "gather_gemm_ex"
WORKSPACE_BYTES = 32 << 20  # cuBLASLt's workspace per device (cuBLAS's own on Hopper: 32 MiB)
MAX_WEIGHTS = MAX_OUTPUTS  # FO_GATHER_MAX_OUTPUTS: the GEMMs' outputs
# cudaDataType_t of the dtypes taken: bf16 only, the one run on a GPU (the library also takes fp16, 2: never run)
ELEM_TYPES = {torch.bfloat16: 14}
_REDUCTION_ALLOWED = {torch.bfloat16: "allow_bf16_reduced_precision_reduction"}
INT_MAX = 2 ** 31 - 1  # cuBLAS's int sizes
_bound: list[bool] = []  # [whether fo_cublas_bind succeeded, whether fo_cublaslt_bind did], once per process
_workspaces: dict[int, torch.Tensor] = {}  # device index -> cuBLASLt's workspace (uint8 [WORKSPACE_BYTES])
_bind_lock = threading.Lock()


class GatherGemmArgs(ctypes.Structure):
    """``fo_gather_gemm_args`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("world", ctypes.c_int32), ("rank", ctypes.c_int32), ("rows", ctypes.c_int64),
                ("k", ctypes.c_int64), ("a", ctypes.c_void_p), ("staging", ctypes.c_void_p),
                ("shard_events", ctypes.c_void_p * MAX_WORLD), ("cur_stream", ctypes.c_void_p),
                ("handle", ctypes.c_void_p), ("elem_type", ctypes.c_int32), ("math_mode", ctypes.c_int32),
                ("num_weights", ctypes.c_int32), ("weight_transposed", ctypes.c_int32 * MAX_WEIGHTS),
                ("weights", ctypes.c_void_p * MAX_WEIGHTS), ("n", ctypes.c_int64 * MAX_WEIGHTS),
                ("outputs", ctypes.c_void_p * MAX_WEIGHTS), ("workspace", ctypes.c_void_p),
                ("workspace_bytes", ctypes.c_int64)]


def bind() -> bool:
    """Whether the library can call cuBLAS: ``fo_cublas_bind`` with the cuBLAS torch loaded (from
    ``/proc/self/maps`` after torch's handle exists), once per process; declined (logged once) where no cuBLAS or
    more than one is mapped (another might not be the one torch's handle belongs to). The cuBLASLt beside it is bound
    the same way (``lt_bound``); without it the GEMMs run through ``cublasGemmEx``."""
    with _bind_lock:
        if not _bound:
            torch.cuda.current_blas_handle()  # torch loads cuBLAS (and with it cuBLASLt) lazily
            try:
                with open("/proc/self/maps") as maps:
                    lines = maps.readlines()
            except OSError:
                lines = []
            paths, lt_paths = mapped_libraries(lines, "libcublas.so"), mapped_libraries(lines, "libcublasLt.so")
            lib = kernels.library()
            ok = len(paths) == 1 and lib.fo_cublas_bind(paths[0].encode()) == 0
            if not ok:
                log.info("flashoverlap: the gather route's GEMMs stay torch.mm calls: %s",
                         lib.fo_last_error().decode() if len(paths) == 1 else
                         f"{len(paths)} cuBLAS libraries mapped in this process ({paths})")
            lt = ok and len(lt_paths) == 1 and lib.fo_cublaslt_bind(lt_paths[0].encode()) == 0
            if ok and not lt:
                log.info("flashoverlap: the gather route's GEMMs run through cublasGemmEx: %s",
                         lib.fo_last_error().decode() if len(lt_paths) == 1 else
                         f"{len(lt_paths)} cuBLASLt libraries mapped in this process ({lt_paths})")
            _bound.extend((ok, lt))
    return _bound[0]


def lt_bound() -> bool:
    """Whether ``bind`` bound cuBLASLt too (False before ``bind`` ran)."""
    return len(_bound) > 1 and _bound[1]


def mapped_libraries(maps: Iterable[str], prefix: str) -> list[str]:
    """The distinct libraries whose file name starts with ``prefix`` (``libcublas.so``: cuBLAS, not cuBLASLt;
    ``libcublasLt.so``) among ``/proc/self/maps`` lines (the path is the sixth field; a deleted file's
    ``(deleted)`` mark is a seventh), sorted."""
    paths = set()
    for line in maps:
        fields = line.split()
        if len(fields) >= 6 and fields[5].rsplit("/", 1)[-1].startswith(prefix):
            paths.add(fields[5])
    return sorted(paths)


def workspace(device: torch.device, experiments: frozenset[str], capturing: bool) -> torch.Tensor | None:
    """cuBLASLt's workspace on ``device`` (made once, outside any graph pool), or None where the GEMMs take
    ``cublasGemmEx``: inside a capture, under the experiment ``gather_gemm_ex``, or without cuBLASLt bound."""
    if capturing or GEMM_EX_EXPERIMENT in experiments or not lt_bound():
        return None
    ws = _workspaces.get(device.index)
    if ws is None:
        ws = _workspaces[device.index] = streams.persistent(  # outside any CUDA-graph pool
            device.index, lambda: torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device))
    return ws


def _tunable_on() -> bool:
    """Whether TunableOp may pick torch's GEMM algorithms (then ``torch.mm`` is not cuBLAS's default choice)."""
    try:
        return bool(torch.cuda.tunable.is_enabled())
    except (AttributeError, RuntimeError):  # a torch without TunableOp (CPU builds)
        return False


def weight_layout(w: torch.Tensor, k: int, row_major: bool = False) -> int | None:
    """1 for a Linear's ``W.t()`` ([K, N], strides (1, K)); with ``row_major``, 0 for a contiguous [K, N] (the
    scatter route's library call, run on GPUs; the gather route's GEMMs also take it, never run there, so it passes
    False); else None."""
    if w.dim() != 2 or w.shape[0] != k:
        return None
    if w.stride() == (1, k):
        return 1
    return 0 if row_major and w.stride() == (w.shape[1], 1) else None


def static_args(ctx, geo, rank: int) -> GatherGemmArgs | None:
    """The part of a call shape's ``fo_gather_gemm_args`` fixed by its shapes, strides and dtypes (memoized with its
    launch: the route registry keys launches by those), or None where the call shape needs the Python loop."""
    dtype = ctx.a.dtype
    if (not geo.contiguous_shards or dtype not in ELEM_TYPES or any(c is not None for c in ctx.bias)
            or not 0 < len(ctx.b) <= MAX_WEIGHTS or not 2 <= geo.shard_rows <= INT_MAX or not 2 <= geo.k <= INT_MAX
            or geo.world > MAX_WORLD or any(not 2 <= w.shape[-1] <= INT_MAX or w.dtype != dtype for w in ctx.b)):
        return None
    layouts = [weight_layout(w, geo.k) for w in ctx.b]
    if None in layouts:
        return None
    p = GatherGemmArgs()
    p.world, p.rank, p.rows, p.k = geo.world, rank, geo.shard_rows, geo.k
    p.elem_type, p.math_mode, p.num_weights = ELEM_TYPES[dtype], 0, len(ctx.b)
    for i, (w, layout) in enumerate(zip(ctx.b, layouts, strict=True)):
        p.weight_transposed[i], p.n[i] = layout, w.shape[-1]
    return p


def usable(dtype: torch.dtype, experiments: frozenset[str], probe) -> bool:
    """The per-call part (module docstring): torch's matmul settings as they are now, the experiment, the probe,
    cuBLAS bound."""
    return (EXPERIMENT not in experiments and probe is None and compat.cublas_preferred()
            and not torch.are_deterministic_algorithms_enabled() and not _tunable_on()
            and getattr(torch.backends.cuda.matmul, _REDUCTION_ALLOWED[dtype], None) is True
            and not getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False) and bind())


def fill(p: GatherGemmArgs, weights: list[torch.Tensor], a: torch.Tensor, events: list, outs: list[torch.Tensor],
         cur: int, ws: torch.Tensor | None) -> None:
    """Every per-call field of ``p`` but ``staging`` (the shards' tensor, known once the call's slot set is): the
    pointers, torch's cuBLAS handle of this thread bound to ``cur`` (as ``torch.mm`` gets it), the pull events, the
    workspace (None: ``cublasGemmEx``)."""
    p.a, p.cur_stream = a.data_ptr(), cur
    p.handle = torch.cuda.current_blas_handle()
    for r in range(p.world):
        p.shard_events[r] = events[r].cuda_event if r != p.rank else None
    for i, (w, out) in enumerate(zip(weights, outs, strict=True)):
        p.weights[i], p.outputs[i] = w.data_ptr(), out.data_ptr()
    p.workspace, p.workspace_bytes = (None, 0) if ws is None else (ws.data_ptr(), ws.numel())


def run_call(lib, call: ctypes.Structure, p: GatherGemmArgs, shards: torch.Tensor) -> tuple[int, int]:
    """One call of the gather protocol with its GEMMs (``fo_gather_run``): ``call``'s and ``p``'s fields all set but
    ``p.staging`` (set here from ``shards``); returns (the call's or the GEMMs' status, the finish's status), counted
    ``gather:library_gemms`` (and ``gather:cublaslt`` where the GEMMs had a workspace)."""
    p.staging = shards.data_ptr()
    finish_rc = ctypes.c_int32(0)
    rc = lib.fo_gather_run(ctypes.byref(call), ctypes.byref(p), ctypes.byref(finish_rc))
    stats["gather:library_gemms"] += 1
    if p.workspace:
        stats["gather:cublaslt"] += 1
    return rc, finish_rc.value
