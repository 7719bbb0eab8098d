"""The library's GEMM and wait kernels called one at a time on torch tensors, with every argument checked: the kernel
tests, the GEMM benchmark and the ring's step profile use them (the routes make their own calls). Built on the one
binding, ``kernels``.

Invariants (see ``kernels``): ``signal_gemm`` computes ``out = a @ b (+ bias)`` and, with ``counters``, adds one per
finished output tile to its group's counter; every wait is bounded (``timeout_ms``), and a timeout is recorded in the
device's pinned record and raised by ``raise_if_timed_out()``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from flashoverlap_inductor.native.kernels import (
    DEFAULT_CONFIG,
    DEFAULT_SWIZZLE,
    DTYPES,
    RASTERS,
    SIGNAL_MODES,
    FlashOverlapTimeout,
    _error_record,
    _lookup,
    _workspace_bytes,
    check,
    configs,
    library_path,
    ready,
)


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
        check(lib.fo_gemm(idx, a.data_ptr(), a.stride(0), b.data_ptr(), ldb,
                          bias.data_ptr() if bias is not None else None,
                          addend.data_ptr() if addend is not None else None,
                          addend.stride(0) if addend is not None else 0, out.data_ptr(), out.stride(0), m, n, k,
                          counters.data_ptr() if counters is not None else None,
                          gmap.data_ptr() if gmap is not None else None,
                          order.data_ptr() if order is not None else None, mode, sm_count, raster_id, swizzle,
                          ws.data_ptr() if ws is not None else None, ws_bytes, stream), f"fo_gemm[{name}]")
    return out


def _timeout_ns(timeout_ms: float | None) -> int:
    if timeout_ms is None:
        from flashoverlap_inductor import config

        return config.current().timeout_ns()
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
    check(lib.fo_wait_counter(counters.data_ptr() + 4 * group, None, _wrap32(target), _timeout_ns(timeout_ms),
                              record.data_ptr(), group, _stream_ptr(counters, stream)), "fo_wait_counter")


def wait_group_epoch(counters: torch.Tensor, expected: torch.Tensor, group: int, tiles: int, *,
                     stream: torch.cuda.Stream | None = None, timeout_ms: float | None = None) -> None:
    """CUDA-graph-safe form: the target lives on the device. Waits until ``counters[group] >= expected[group] +
    tiles`` and stores that target back into ``expected[group]`` (int32 CUDA tensor, zero-initialized with the
    counters), so every call -- or graph replay -- waits for one more GEMM's worth of tiles."""
    record = _error_record(counters.device.index or 0)
    lib = ready(counters.device)
    check(lib.fo_wait_counter(counters.data_ptr() + 4 * group, expected.data_ptr() + 4 * group, int(tiles),
                              _timeout_ns(timeout_ms), record.data_ptr(), group, _stream_ptr(counters, stream)),
          "fo_wait_counter")


def stream_wait_value(counters: torch.Tensor, group: int, target: int, *,
                      stream: torch.cuda.Stream | None = None) -> None:
    """``cuStreamWaitValue32(GEQ)`` on ``counters[group]``: no kernel, no SM, but NOT bounded (no timeout)."""
    check(ready(counters.device).fo_stream_wait_value(_stream_ptr(counters, stream), counters.data_ptr() + 4 * group,
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
