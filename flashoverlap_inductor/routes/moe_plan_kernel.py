"""The whole-block path's routing plan (``moe_fast.BlockPlan``) in two Triton kernels on CUDA, in place of ~28 small
torch ops whose launches bound a fused MoE call's host time (measured on 2 H200s: ~1 ms of host time per call for
the plan alone, where the whole unfused call takes 0.7-0.8 ms). Same outputs as the torch ops
(``moe_fast.plan_with_torch``, the reference semantics; ``tests/test_moe_plan_kernel.py`` compares them bit for bit,
the table where the data are good and the premise holds):

* ``idx`` (int64, ``rows``): the index reduced modulo the rows (``torch.remainder``; entries beyond +-(2^62 - 1),
  out of bounds either way, are clamped first);
* ``inv`` (int64, ``rows``): the expert row of each buffer row (0 where none names it; the last where several do);
* ``table`` (int32 ``[blocks, E rounded up to 4]``): row j = block j's cumulative expert offsets, each at most the
  block's rows; the padding columns 0;
* ``facts`` (int64, ``moe_settle.SETTLE_LEN``): the settle's vector (``moe_settle.verdicts``).

Kernel 1 (one lane per expert row i): ``idx[i]``, ``inv[idx[i]] = i``, a hit on buffer row ``idx[i]``, the count of
(block of ``idx[i]``, expert group of i), the index's extremes (each entry clamped to +-(2^62 - 1), then kept as the
atomic maxima of ``raw + 2^62`` and ``2^62 - raw``, so that zeroed slots start below any value). Kernel 2 (one lane per
buffer row r): rows no expert row names (``UNNAMED``), the (block, group) key steps between neighbouring rows
(``KEY_STEP``, clipped at 0 as in ``BlockPlan``); its program 0 also turns the counts into the table (a cumulative sum
per block, clamped to the block's rows) and writes the scalar facts. Under the premise the counts by expert row equal
the counts by buffer row, so the table is the one ``BlockPlan``'s searches give; where the premise fails the settle
redoes the call and only the bounds matter (every offset within its block).

Used (``should_use``) on CUDA tensors with Triton importable, 1-8 blocks, 1 to 2^31 - 1 rows and at most 1024
experts; the torch ops everywhere else (CPU, no Triton, more ranks) and as the tests' reference.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..runtime import triton_launch
from . import moe_plan_lib, moe_settle
from .base import note

MAX_BLOCKS = 8  # the kernels take the block ends as 7 scalars (unused ones = rows)
MAX_EXPERTS = 1024
_SHIFT = 1 << 62  # the index's extremes are kept as atomic maxima of (raw + SHIFT) and (SHIFT - raw), raw clamped
_LIMIT = (1 << 62) - 1  # |raw| clamped to this first (beyond it every verdict is the same: out of bounds)
_failed: list[str] = []  # the kernels' compile or launch failure, once (then the torch ops for good)


@functools.cache
def _kernels():
    """``moe_plan_triton``'s kernels (``scatter``, ``judge``, ``poison_if_bad``), each launched through its compiled
    form (``runtime.triton_launch``), or None where Triton does not import."""
    try:
        from . import moe_plan_triton
    except Exception as exc:  # noqa: BLE001 - no Triton, or one that does not import: the torch ops
        if not isinstance(exc, ImportError):
            _failed.append(repr(exc))
            note("moe:plan_kernel", logging.WARNING, "flashoverlap: Triton does not import (%r); the MoE routing "
                 "plan is built with torch ops", exc)
        return None
    return tuple(triton_launch.Launcher(k) for k in (moe_plan_triton.scatter, moe_plan_triton.judge,
                                                     moe_plan_triton.poison_if_bad))


def should_use(index: torch.Tensor, offs: torch.Tensor, blocks: int) -> bool:
    """Whether the plan of a call with this index, offsets and blocks is built by kernels (``build``): the library's
    (``moe_plan_lib.should_plan``) or the Triton ones (``should_use_triton``)."""
    in_limits = fits(index, offs, blocks)
    return (in_limits and moe_plan_lib.should_plan(index, offs)) or should_use_triton(index, offs, blocks)


def should_use_triton(index: torch.Tensor, offs: torch.Tensor, blocks: int) -> bool:
    """Whether the Triton kernels can build this plan (module docstring)."""
    return (fits(index, offs, blocks) and index.is_cuda and offs.device == index.device
            and index.device.index == torch.cuda.current_device() and not _failed and _kernels() is not None)


def fits(index: torch.Tensor, offs: torch.Tensor, blocks: int) -> bool:
    """The kernels' limits, on any device: 1-D contiguous int32/int64 index and offsets, 1 to 2^31 - 1 rows, 1 to
    ``MAX_EXPERTS`` experts, 1 to ``MAX_BLOCKS`` blocks."""
    return (index.dim() == 1 and offs.dim() == 1 and 0 < index.shape[0] < 2 ** 31
            and 1 <= offs.shape[0] <= MAX_EXPERTS and 1 <= blocks <= MAX_BLOCKS
            and index.dtype in (torch.int32, torch.int64) and offs.dtype in (torch.int32, torch.int64)
            and index.is_contiguous() and offs.is_contiguous())


def build(index: torch.Tensor, offs: torch.Tensor, bounds: list[int],
          cuts: list[list[int]] | None = None) -> tuple[torch.Tensor, ...] | None:
    """``(idx, inv, table, facts)`` of ``BlockPlan`` for ``index`` (rows = ``bounds[-1]``), ``offs`` (E int32 or
    int64) and the blocks' row bounds (``bounds[0] == 0``, ``len(bounds) - 1`` blocks); ``should_use`` holds. One
    library call (``moe_plan_lib``; not under the experiment ``moe_plan_triton``), else (and where the library
    refused the call) two Triton launches and one zeroed workspace; no host read. None where Triton fails to compile
    or launch them (logged once; ``should_use`` is False after it): the caller builds the plan with torch ops (the
    same plan, so ranks may differ here without changing any collective). ``cuts``: the library also writes the
    expert pieces' bounds (``moe_plan_lib.plan``'s fifth entry); the Triton kernels do not (four entries)."""
    if bounds[0] != 0 or bounds[-1] != int(index.shape[0]):
        raise ValueError(f"flashoverlap: the blocks' bounds {bounds} do not cover the index's {index.shape[0]} rows")
    if fits(index, offs, len(bounds) - 1) and moe_plan_lib.should_plan(index, offs):
        built = moe_plan_lib.plan(index, offs, bounds, cuts)
        if built is not None:
            return built
    return run_or_fall_back(lambda: _launch(index, offs, bounds), "the MoE routing plan's")


def run_or_fall_back(launch, whose: str):
    """``launch()`` (a Triton kernel launch of this module's or ``moe_plan_triton``'s); None where Triton fails to
    compile or launch it: recorded in ``_failed`` (the kernels are not used again: ``should_use``) and logged once.
    Out of memory and the device's own errors (CUDA errors) are raised."""
    try:
        return launch()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a compile or launch failure of the kernels, not of the data
        if "CUDA error" in str(exc) or "Triton Error [CUDA]" in str(exc):  # the device's, not the kernels': raised
            raise
        _failed.append(repr(exc))
        note("moe:plan_kernel", logging.WARNING, "flashoverlap: %s Triton kernel failed (%r); torch ops from now on",
             whose, exc)
        return None


def _launch(index: torch.Tensor, offs: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, ...]:
    scatter, judge, _ = _kernels()
    rows, experts, blocks = int(index.shape[0]), int(offs.shape[0]), len(bounds) - 1
    ep = max(16, 1 << (experts - 1).bit_length())
    lanes = max(16, min(256, 8192 // ep))
    table_cols = -(-experts // 4) * 4
    dev = index.device
    head = 8 * ep + moe_settle.SETTLE_LEN  # count and facts first; inv and hits each from a 16-byte boundary
    padded = rows + (rows & 1)
    work = torch.zeros(head + 2 * padded, dtype=torch.int64, device=dev)
    count, facts = work[:8 * ep], work[8 * ep:head]
    inv, hits = work[head:head + rows], work[head + padded:head + padded + rows]
    idx = torch.empty(rows, dtype=torch.int64, device=dev)
    table = torch.empty(blocks, table_cols, dtype=torch.int32, device=dev)
    ends = [*bounds[1:-1], *([rows] * (MAX_BLOCKS - blocks))]
    grid = (-(-rows // lanes),)
    scatter[grid](index, offs, idx, inv, hits, count, facts, rows, *ends, EXPERTS=experts, EP=ep, BLOCK=lanes,
                  SHIFT=_SHIFT, LIMIT=_LIMIT, IDX_MAX=moe_settle.IDX_MAX, IDX_MIN=moe_settle.IDX_MIN)
    judge[grid](offs, inv, hits, count, facts, table, rows, *ends, BLOCKS=blocks, EXPERTS=experts, EP=ep,
                TABLE_COLS=table_cols, BLOCK=lanes, SHIFT=_SHIFT, ROWS=moe_settle.ROWS, IDX_MAX=moe_settle.IDX_MAX,
                IDX_MIN=moe_settle.IDX_MIN, OFFS_STEP=moe_settle.OFFS_STEP, UNNAMED=moe_settle.UNNAMED,
                OFFS_LAST=moe_settle.OFFS_LAST, KEY_STEP=moe_settle.KEY_STEP)
    return idx, inv, table, facts
