"""What a fused call runs on the GPU, decided from its operands alone (pure functions, tested on CPU): the
operand form the kernel takes, B's layout, the kernel configuration, the SMs left to NCCL and the row gather of
reduce_scatter / all_to_all layouts. The routes memoize the results per call shape.

Never imports the cost model: what the cost model's data says (the SM reserve, the grid, the tuned kernel per tile:
``cost_model/launch.py``) comes in as arguments from the routes.

Units: rows/columns in elements; strides in elements; tiles ``tile_m x tile_n`` output elements.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import config
from flashoverlap_inductor.config import GEMM_GRIDS
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.schedule import plan as planlib

log = logging.getLogger("flashoverlap")

_DTYPES = (torch.bfloat16, torch.float16)
INT_MAX = 2**31 - 1  # m, n, k reach the C library as C int (32-bit), so would wrap; leading dimensions held to it too


@dataclass(frozen=True)
class Operands:
    """``y = a @ b (+ bias)`` as the kernel sees it: ``a`` [rows, K], ``b`` [K, N], ``bias`` contiguous [N]."""

    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None


def normalize_operands(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                       collective: str = "all_reduce") -> Operands | tuple[str, str]:
    """The kernel's operands, or ``(reason, detail)`` when the call must run unfused (shapes were validated by
    ``ops``). Every rank must reach the same answer: all_reduce/reduce_scatter ranks hold equal shapes, but
    all_to_all ranks may hold different batch sizes, so there a batched ``b`` always runs unfused (whether it is
    one expanded matrix cannot be told from a batch of one). ``int_range``: rows, N, K or a leading dimension
    (the row stride of ``a`` [rows, K] or of B, elements) above ``INT_MAX``; checked from shapes and strides alone,
    before ``a`` is flattened (meta and expanded tensors work, nothing is copied)."""
    if a.dtype not in _DTYPES:
        return "dtype", f"dtype {a.dtype} (the kernels are bf16/fp16)"
    if b.dim() == 3:
        if collective == "all_to_all":
            return "bmm", "all_to_all after a batched b (bmm)"
        if b.shape[0] > 1 and b.stride(0) != 0:
            return "bmm", "a batch of distinct b matrices (bmm)"
        if b.shape[0] == 0:
            return "degenerate", "empty batch"
        b = b[0]
    rows, (k, n) = a.shape[:-1].numel(), b.shape
    sizes = {"rows": rows, "N": n, "K": k, "lda": a.stride(-2), "ldb": max(b.stride())}
    big = ", ".join(f"{name}={v}" for name, v in sizes.items() if v > INT_MAX)
    if big:
        return "int_range", f"{big} above the C library's 32-bit int range ({INT_MAX})"
    if n == 0 or k == 0:
        return "degenerate", f"empty GEMM N={n} K={k}"
    if n % 8 or k % 8:
        return "alignment", f"N={n} and K={k} must be multiples of 8 (16-byte TMA rows)"
    if a.dim() == 3:
        a = a.reshape(rows, k)
    if bias is not None:
        if bias.numel() == 1:
            bias = bias.reshape(1).expand(n)
        elif bias.numel() != n or bias.shape[-1] != n:
            return "bias_rows", f"bias {tuple(bias.shape)} varies along the rows"
        bias = bias.reshape(n)
        if not bias.is_contiguous() or bias.data_ptr() % 16:
            bias = bias.clone(memory_format=torch.contiguous_format)
    return Operands(a, b, bias)


def b_layout(b: torch.Tensor) -> str | None:
    """``"nk"`` for a Linear weight view (``b.stride() == (1, ldb)``), ``"kn"`` for row-major [K,N], None for
    other strides (16-byte aligned row strides required). From the strides alone, never the pointer: every rank
    takes the same route for the same call (a misaligned pointer is copied per call, ``routes.nccl.kernel_b``)."""
    k, n = b.shape
    if b.stride(0) == 1 and b.stride(1) >= k and b.stride(1) % 8 == 0:
        return "nk"
    if b.stride(1) == 1 and b.stride(0) >= n and b.stride(0) % 8 == 0:
        return "kn"
    return None


def a_is_kernel_ready(a: torch.Tensor) -> bool:
    """Row-major with a 16-byte aligned row stride (else the runtime copies it)."""
    return a.stride(1) == 1 and a.stride(0) >= a.shape[1] and a.stride(0) % 8 == 0 and a.data_ptr() % 16 == 0


@dataclass(frozen=True)
class KernelChoice:
    """The configuration a launch uses; ``b_layout`` is the layout it reads, ``convert_b`` means B is copied
    into that layout on every call (logged once)."""

    name: str
    tile_m: int
    tile_n: int
    b_layout: str
    convert_b: bool


def choose_kernel(infos: Sequence[Any], plan_kernel: str, tile: tuple[int, int] | None, dtype_name: str,
                  layout: str | None, preferred: dict[str, str] | None = None) -> KernelChoice | None:
    """The configuration for a call: among those compiled for (dtype, B layout) -- the operand's own layout
    first, the other one (B copied) only if none is --: the plan's ``kernel``; else, for the plan's tile, the tuned
    best (``preferred["<tm>x<tn>"]``), ``kernels.DEFAULT_CONFIG``, or the first by name; else the default config,
    else the first by name. ``infos``: ``kernels.configs()`` entries. None when nothing is compiled for the dtype."""
    preferred = preferred or {}
    layouts = ([layout] if layout else []) + [x for x in kernels.B_LAYOUTS if x != layout]
    for lay in layouts:
        have = {i.name: i for i in infos if (dtype_name, lay) in i.variants}
        if not have:
            continue
        pick = have.get(plan_kernel)
        if pick is None:
            same = sorted((i for i in have.values() if tile and (i.tile_m, i.tile_n) == tuple(tile)),
                          key=lambda i: i.name)
            names = [preferred.get(f"{tile[0]}x{tile[1]}") if tile else None, kernels.DEFAULT_CONFIG]
            pick = next((have[x] for x in names if x in have and have[x] in same), None)
            pick = pick or (same[0] if same else have.get(kernels.DEFAULT_CONFIG) or have[sorted(have)[0]])
        return KernelChoice(pick.name, pick.tile_m, pick.tile_n, lay, lay != layout)
    return None


def gather_rows(layout: planlib.BufferLayout) -> list[int] | None:
    """Source row of every buffer row (``layout.segments`` expanded), or None for the identity layout."""
    if layout.is_identity:
        return None
    rows: list[int] = []
    for buf_row, src, count in sorted(layout.segments):
        if buf_row != len(rows):
            raise AssertionError(f"buffer layout segments leave a gap at row {len(rows)}: {layout.segments}")
        rows.extend(range(src, src + count))
    return rows


def sm_reserve(override: int | None, group_max_ctas: int | None, model_reserve: Callable[[], int]) -> int:
    """SMs the fused GEMM leaves to NCCL and the wait kernel: ``override`` (``Settings.tuning.sm_reserve``), else
    ``group_max_ctas + 2`` when the process group's NCCL config caps its CTAs
    (NCCL's CTAs must all be resident beside the persistent GEMM, or the collective waits for the GEMM to end),
    else ``model_reserve()`` (the cost model's ``fused.nccl_sms``: ``cost_model.launch.fused_nccl_sms``), called
    only then."""
    if override is not None:
        return int(override)
    if group_max_ctas:
        return int(group_max_ctas) + 2
    return int(model_reserve())


def gemm_grid(override: str | None, model_grid: Callable[[], str]) -> str:
    """How the fused GEMM is launched: ``override`` (``Settings.tuning.gemm_grid``), else ``model_grid()`` (the
    cost model's ``fused.grid``, what its predictions assume: ``cost_model.launch.fused_grid``), called only then.
    Either must be one of ``GEMM_GRIDS`` (else ValueError).
    ``"persistent"``: one CTA per SM on the SMs ``sm_reserve`` does not leave to NCCL; ``"tiles"``: one CTA per
    tile on every SM, so SMs freed by finished tiles go to NCCL's kernels on the highest-priority side stream."""
    value = override or model_grid()
    if value not in GEMM_GRIDS:
        raise ValueError(f"flashoverlap: GEMM grid must be 'persistent' or 'tiles', got {value!r}")
    return value


def grid_ctas(grid: str, sms: int, tiles: int, reserve: int) -> int:
    """CTAs the fused GEMM launches (the kernel's ``sm_count``) for ``tiles`` output tiles on ``sms`` SMs:
    ``"persistent"``: ``sms - reserve`` (at least 1); ``"tiles"``: one per tile, never fewer than ``sms`` (more CTAs
    than SMs make the kernel non-persistent; at most ``sms`` walk the tiles in persistent waves)."""
    if grid == "persistent":
        return max(1, sms - reserve)
    if grid == "tiles":
        return max(sms, tiles)
    raise ValueError(f"flashoverlap: GEMM grid must be 'persistent' or 'tiles', got {grid!r}")


def nccl_max_ctas(group: object) -> int | None:
    """``max_ctas`` of the NCCL config of ``group`` (``ProcessGroupNCCL.Options().config.max_ctas``), or of
    ``$NCCL_MAX_CTAS``; None when neither caps NCCL's CTAs (or the group is not NCCL)."""
    try:
        backend = compat.group_backend(group, torch.device("cuda"))
        value = int(backend.options.config.max_ctas)
        if 0 < value <= 64:  # NCCL's "unset" is INT_MIN
            return value
    except Exception:  # not NCCL, or a torch without these bindings
        pass
    return config.nccl_max_ctas_env()
