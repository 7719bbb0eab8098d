"""``grouped_mm``: the experts' grouped GEMM of a MoE layer as one library call whose row offsets stay on the device
(``fo_grouped_gemm``, ``csrc/grouped_gemm.cu``).

For each expert ``e`` of a range, the rows ``[offs[e - 1], offs[e])`` of ``a`` (``offs[-1]`` read as 0) times the
expert's Linear weight ``w[e]`` ([n, k]) land in the same rows of ``out``; other rows of ``out`` are not written.
Over every expert that is ``torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)``; what it adds is the range and the
given output: a caller can run the experts in pieces (``experts=(0, E // 2)``, then ``(E // 2, E)``) on rows that
lie anywhere in one buffer and collect every piece's results, in expert order, in one tensor, with no host read of
the offsets and no copy (``torch._grouped_mm`` returns a fresh tensor per call). That is the MoE dispatch's cut by
expert: measured on one H200 (``examples/device/moe_gemm_probe.py``; docs/results.md, forty-fourth session), cutting
the grouped GEMM by source block as the fused dispatch does today costs 15-76% more GEMM time at Qwen3-MoE shapes
(2 ranks, 1024-8192 tokens per rank), cutting it by expert halves 2-16%.

The weights are each expert's Linear weight ``[n, k]`` (k contiguous) or that matrix stored transposed (n contiguous:
the MoE backward's dispatch multiplies by the down projection as stored); one kernel per layout.
Offsets out of order or past the rows are clamped (each expert's rows run from the largest offset before it to the
largest up to it, at most the rows: an expert gets fewer rows, never another's or rows outside ``a`` or ``out``).
bf16 only; ``n``, ``k`` and the row strides multiples of 8. One workspace per (device,
stream), grown as needed: calls on one stream run in order, so they may share it.
"""

from __future__ import annotations

import ctypes

import torch

from .. import _inductor_compat as compat
from . import kernels


class GroupedGemmArgs(ctypes.Structure):
    """``fo_grouped_gemm_args`` of ``csrc/flashoverlap_sm90.h``."""

    _fields_ = [("a", ctypes.c_void_p), ("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("offs", ctypes.c_void_p),
                ("range", ctypes.c_void_p)] \
        + [(name, ctypes.c_int64) for name in ("rows", "n", "k", "lda", "ldd", "w_stride")] \
        + [(name, ctypes.c_int32) for name in ("experts", "first", "last", "offs_bytes")] \
        + [("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_int64), ("device", ctypes.c_int32),
           ("b_layout", ctypes.c_int32), ("stream", ctypes.c_void_p)]


_workspaces: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> its workspace (uint8, grown)
_needs: dict[tuple[int, int], int] = {}  # (device, groups) -> fo_grouped_gemm_workspace's bytes (the SMs' and groups')


def b_layout_of(w: torch.Tensor) -> int | None:
    """The kernel's ``b_layout`` for weights ``w`` ([E, n, k]): 0 where each expert's ``[n, k]`` has k contiguous (a
    Linear weight), 1 where n is (its transpose stored: ``[k, n]`` row-major), None for anything else (the experts
    16-byte aligned apart and not overlapping)."""
    if w.dim() != 3:
        return None
    n, k = int(w.shape[1]), int(w.shape[2])
    if w.stride(0) % 8 or w.stride(0) < n * k:
        return None
    if w.stride(2) == 1 and w.stride(1) == k:
        return 0
    if w.stride(1) == 1 and w.stride(2) == n:
        return 1
    return None


def op_weight_fits(w: torch.Tensor) -> bool:
    """``w`` (a term's ``[E, K, N]`` operand of ``torch._grouped_mm``) is laid out as the library reads it
    (``b_layout_of`` of its ``[E, N, K]`` transpose: K or N contiguous), N and K multiples of 8."""
    if w.dim() != 3:
        return False
    lw = w.transpose(-2, -1)
    return b_layout_of(lw) is not None and not lw.shape[1] % 8 and not lw.shape[2] % 8


def _check(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor | None) -> int:
    """Clear errors for what the kernel cannot take (before any device work); returns the weights' ``b_layout``."""
    if a.dim() != 2 or w.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"grouped_mm: need a [rows, k], w [experts, n, k] and offs [experts], got "
                         f"{tuple(a.shape)}, {tuple(w.shape)} and {tuple(offs.shape)}")
    if a.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"grouped_mm: bfloat16 only, got {a.dtype} and {w.dtype}")
    if offs.dtype not in (torch.int32, torch.int64) or offs.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_mm: offs must be int32 or int64 with one entry per expert ({w.shape[0]}), got "
                         f"{offs.dtype} {tuple(offs.shape)}")
    if a.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_mm: a has k={a.shape[1]}, the weights k={w.shape[2]}")
    n, k = w.shape[1], w.shape[2]
    layout = b_layout_of(w)
    if n % 8 or k % 8 or a.stride(1) != 1 or a.stride(0) % 8 or layout is None:
        raise ValueError("grouped_mm: n and k must be multiples of 8, a's rows contiguous with a 16-byte row stride, "
                         "each expert's weight [n, k] with k or n contiguous (a Linear weight or its transpose)")
    if out is not None and (out.shape != (a.shape[0], n) or out.dtype != a.dtype or out.device != a.device
                            or out.stride(1) != 1 or out.stride(0) % 8):
        raise ValueError(f"grouped_mm: out must be a bfloat16 [{a.shape[0]}, {n}] tensor on a's device with "
                         "contiguous 16-byte-aligned rows")
    if not offs.is_contiguous():
        raise ValueError("grouped_mm: offs must be contiguous")
    if not (w.device == a.device and offs.device == a.device):
        raise ValueError("grouped_mm: a, w and offs must be on one device")
    return layout


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, out: torch.Tensor | None = None,
               experts: tuple[int, int] | None = None, within: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` rows of each expert in ``experts`` (``(first, last)``, default every expert) = ``a``'s rows of it @
    ``w[e].T`` (module docstring), on the current stream; returns ``out`` (new and uninitialized outside those rows
    when None). ``within``: two int32 on ``a``'s device, ``[lo, hi)``: only the experts in it too (read by the
    kernels, never by the host). The operands' checks hold on every device; on the CPU the work is ``reference``'s."""
    layout = _check(a, w, offs, out)
    if a.device.type == "cpu":
        return reference(a, w, offs, out=out, experts=experts, within=within)
    if not a.is_cuda:
        raise ValueError(f"grouped_mm: CUDA or CPU tensors, got {a.device}")
    if within is not None and (within.dtype != torch.int32 or within.numel() != 2 or not within.is_contiguous()
                               or within.device != a.device):
        raise ValueError("grouped_mm: within must be two contiguous int32 on a's device")
    first, last = experts if experts is not None else (0, int(w.shape[0]))
    if not 0 <= first < last <= w.shape[0]:
        raise ValueError(f"grouped_mm: experts must be (first, last) with 0 <= first < last <= {w.shape[0]}, got "
                         f"{experts}")
    rows, n = int(a.shape[0]), int(w.shape[1])
    if out is None:
        out = a.new_empty(rows, n)
    if rows == 0:
        return out
    device = a.device.index
    if device != torch.cuda.current_device():  # the library launches on the current device
        with torch.cuda.device(device):
            return grouped_mm(a, w, offs, out=out, experts=experts, within=within)
    args = call_args(a, w, offs, out, layout, first, last, within)
    kernels.check(kernels.ready(device).fo_grouped_gemm(ctypes.byref(args)), "fo_grouped_gemm")
    return out


def call_args(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, layout: int, first: int,
              last: int, within: torch.Tensor | None = None, stream: int | None = None) -> GroupedGemmArgs:
    """``fo_grouped_gemm``'s arguments for operands ``_check`` accepted (``layout``: its answer), on the current CUDA
    device and stream, with this stream's workspace (grown to the call's need); a, w and out on 16 bytes (raised
    otherwise). ``routes/moe_cut_lib.py`` hands them to ``fo_moe_dispatch_cut``, which sets the range per piece.
    ``stream``: the current stream's handle where the caller has it."""
    for t in (a, w, out):
        if t.data_ptr() % 16:
            raise ValueError("grouped_mm: a, w and out must start on 16 bytes")
    device = a.device.index
    stream = compat.current_raw_stream(device) if stream is None else stream
    args = GroupedGemmArgs(a.data_ptr(), w.data_ptr(), out.data_ptr(), offs.data_ptr(),
                           None if within is None else within.data_ptr(), int(a.shape[0]), int(w.shape[1]),
                           int(w.shape[2]), int(a.stride(0)), int(out.stride(0)), int(w.stride(0)), int(w.shape[0]),
                           first, last, offs.element_size(), None, 0, device, layout, stream)
    need = _needs.get((device, last - first))
    if need is None:
        got = ctypes.c_int64(0)
        kernels.check(kernels.ready(device).fo_grouped_gemm_workspace(ctypes.byref(args), ctypes.byref(got)),
                      "fo_grouped_gemm_workspace")
        need = _needs[(device, last - first)] = got.value
    key = (device, stream)
    ws = _workspaces.get(key)
    if ws is None or ws.numel() < need:
        ws = _workspaces[key] = torch.empty(max(need, 1 << 16), dtype=torch.uint8, device=a.device)
    args.workspace, args.workspace_bytes = ws.data_ptr(), ws.numel()
    return args


def rows_of(offs: list[int], rows: int) -> list[tuple[int, int]]:
    """Each expert's rows ``(start, end)`` as the kernel takes them: running maxima of the offsets, at most ``rows``."""
    out, end = [], 0
    for v in offs:
        start, end = end, max(end, int(v))
        out.append((min(start, rows), min(end, rows)))
    return out


def reference(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, out: torch.Tensor | None = None,
              experts: tuple[int, int] | None = None, within: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_mm``'s semantics with torch ops (host reads of ``offs`` and ``within``; any dtype or device): every
    expert's rows by ``torch._grouped_mm`` over the whole of ``a`` (so each row rounds as in the unfused graph's one
    call), then the rows of the experts in range copied into ``out``. The CPU's path and the tests' oracle."""
    first, last = experts if experts is not None else (0, int(w.shape[0]))
    if within is not None:
        lo, hi = (int(v) for v in within.tolist())
        first, last = max(first, lo), min(last, hi)
    rows = int(a.shape[0])
    if out is None:
        out = a.new_empty(rows, int(w.shape[1]))
    every = rows_of(offs.tolist(), rows)
    spans = every[first:last] if last > first else []
    if not any(e > s for s, e in spans):
        return out
    clamped = torch.tensor([e for _, e in every], dtype=torch.int32, device=offs.device)  # offs where they are good
    full = torch._grouped_mm(a, w.transpose(-2, -1), offs=clamped)
    for s, e in spans:
        out[s:e] = full[s:e]
    return out
