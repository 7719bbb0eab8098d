"""The Triton kernels of ``moe_plan_kernel`` (imported only where Triton imports: ``moe_plan_kernel.should_use``).
Lane ``i`` of ``scatter`` is expert row i; lane ``r`` of ``judge`` is buffer row r; both take the 8 block ends as 7
scalars plus ``rows`` and their pointers unspecialized (they change per call, alignment included: one compile per
model) and the experts as compile-time constants (per model)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ends(e0, e1, e2, e3, e4, e5, e6, rows):
    """The blocks' end rows as an 8-lane vector (lanes past the last block: ``rows``)."""
    j = tl.arange(0, 8)
    return tl.where(j == 0, e0, tl.where(j == 1, e1, tl.where(j == 2, e2, tl.where(
        j == 3, e3, tl.where(j == 4, e4, tl.where(j == 5, e5, tl.where(j == 6, e6, rows))))))).to(tl.int64)


@triton.jit
def _starts(e0, e1, e2, e3, e4, e5, e6):
    """The blocks' first rows as an 8-lane vector (block j starts where block j - 1 ends)."""
    j = tl.arange(0, 8)
    return tl.where(j == 0, 0, tl.where(j == 1, e0, tl.where(j == 2, e1, tl.where(
        j == 3, e2, tl.where(j == 4, e3, tl.where(j == 5, e4, tl.where(j == 6, e5, e6))))))).to(tl.int64)


@triton.jit
def _group(pos, offs_ptr, EXPERTS: tl.constexpr, EP: tl.constexpr):
    """The expert group of each expert row ``pos``: how many offsets are at most it (``searchsorted(right=True)`` on
    sorted offsets; in ``[0, EXPERTS]`` whatever the offsets)."""
    e = tl.arange(0, EP)
    offs = tl.load(offs_ptr + e, mask=e < EXPERTS, other=0).to(tl.int64)
    hit = (offs[None, :] <= pos[:, None]) & (e[None, :] < EXPERTS)
    return tl.sum(hit.to(tl.int64), axis=1)


@triton.jit
def _block(pos, ends):
    """The block of each buffer row ``pos`` (< rows): how many block ends are at most it."""
    return tl.sum((ends[None, :] <= pos[:, None]).to(tl.int64), axis=1)


_SCALARS = ["rows", "e0", "e1", "e2", "e3", "e4", "e5", "e6"]  # change per call: never specialized on
_POINTERS = ["index_ptr", "offs_ptr", "idx_ptr", "inv_ptr", "hits_ptr", "count_ptr", "facts_ptr", "table_ptr"]


@triton.jit(do_not_specialize=_SCALARS, do_not_specialize_on_alignment=_POINTERS[:7])
def scatter(index_ptr, offs_ptr, idx_ptr, inv_ptr, hits_ptr, count_ptr, facts_ptr, rows, e0, e1, e2, e3, e4, e5, e6,
            EXPERTS: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr, SHIFT: tl.constexpr, LIMIT: tl.constexpr,
            IDX_MAX: tl.constexpr, IDX_MIN: tl.constexpr):
    """Per expert row: ``idx``, ``inv[idx] = i``, a hit on row ``idx``, the (block, group) count, the extremes."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < rows
    raw = tl.load(index_ptr + i, mask=m, other=0).to(tl.int64)
    raw = tl.minimum(tl.maximum(raw, -LIMIT), LIMIT)
    idx = raw % rows
    idx = tl.where(idx < 0, idx + rows, idx)  # Python's modulo whichever sign rule the hardware's has
    tl.store(idx_ptr + i, idx, mask=m)
    tl.atomic_max(inv_ptr + idx, i, mask=m)  # the last expert row naming a row: the same on every run
    tl.atomic_add(hits_ptr + idx, 1, mask=m)
    group = _group(i, offs_ptr, EXPERTS, EP)
    block = _block(idx, _ends(e0, e1, e2, e3, e4, e5, e6, rows))
    tl.atomic_add(count_ptr + block * EP + group, 1, mask=m & (group < EXPERTS))
    tl.atomic_max(facts_ptr + IDX_MAX, tl.max(tl.where(m, raw + SHIFT, 0), axis=0))
    tl.atomic_max(facts_ptr + IDX_MIN, tl.max(tl.where(m, SHIFT - raw, 0), axis=0))


@triton.jit(do_not_specialize=_SCALARS, do_not_specialize_on_alignment=_POINTERS[1:2] + _POINTERS[3:])
def judge(offs_ptr, inv_ptr, hits_ptr, count_ptr, facts_ptr, table_ptr, rows, e0, e1, e2, e3, e4, e5, e6,
          BLOCKS: tl.constexpr, EXPERTS: tl.constexpr, EP: tl.constexpr, TABLE_COLS: tl.constexpr,
          BLOCK: tl.constexpr, SHIFT: tl.constexpr, ROWS: tl.constexpr, IDX_MAX: tl.constexpr, IDX_MIN: tl.constexpr,
          OFFS_STEP: tl.constexpr, UNNAMED: tl.constexpr, OFFS_LAST: tl.constexpr, KEY_STEP: tl.constexpr):
    """Per buffer row: unnamed rows, the key steps (clipped at 0); program 0: the table and the scalar facts."""
    pid = tl.program_id(0)
    ends = _ends(e0, e1, e2, e3, e4, e5, e6, rows)
    r = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < rows
    hits = tl.load(hits_ptr + r, mask=m, other=1)
    tl.atomic_add(facts_ptr + UNNAMED, tl.sum((hits == 0).to(tl.int64), axis=0))
    key = _group(tl.load(inv_ptr + r, mask=m, other=0), offs_ptr, EXPERTS, EP) + \
        _block(tl.where(m, r, 0), ends) * (EXPERTS + 1)
    r1 = r + 1
    m1 = r1 < rows
    key1 = _group(tl.load(inv_ptr + r1, mask=m1, other=0), offs_ptr, EXPERTS, EP) + \
        _block(tl.where(m1, r1, 0), ends) * (EXPERTS + 1)
    tl.atomic_min(facts_ptr + KEY_STEP, tl.min(tl.where(m1, key1 - key, 0), axis=0))
    if pid == 0:
        j = tl.arange(0, 8)
        e = tl.arange(0, EP)
        sizes = ends - _starts(e0, e1, e2, e3, e4, e5, e6)
        count = tl.load(count_ptr + j[:, None] * EP + e[None, :])
        cum = tl.minimum(tl.cumsum(count, axis=1), sizes[:, None])
        cum = tl.where(e[None, :] < EXPERTS, cum, 0)
        tl.store(table_ptr + j[:, None] * TABLE_COLS + e[None, :], cum.to(tl.int32),
                 mask=(j[:, None] < BLOCKS) & (e[None, :] < TABLE_COLS))
        offs = tl.load(offs_ptr + e, mask=e < EXPERTS, other=0).to(tl.int64)
        prev = tl.load(offs_ptr + e - 1, mask=(e >= 1) & (e < EXPERTS), other=0).to(tl.int64)
        tl.store(facts_ptr + OFFS_STEP, tl.min(tl.where(e < EXPERTS, offs - prev, SHIFT), axis=0))
        tl.store(facts_ptr + OFFS_LAST, tl.sum(tl.where(e == EXPERTS - 1, offs, 0), axis=0))
        tl.store(facts_ptr + ROWS, rows.to(tl.int64))
        tl.store(facts_ptr + IDX_MAX, tl.load(facts_ptr + IDX_MAX) - SHIFT)
        tl.store(facts_ptr + IDX_MIN, SHIFT - tl.load(facts_ptr + IDX_MIN))


@triton.jit
def _field(v, f, k: tl.constexpr):
    """Field ``k`` of every rank's settle vector (``v``: [8 ranks, 16 fields])."""
    return tl.sum(tl.where(f == k, v, 0), axis=1)


@triton.jit
def _nan_block(out_ptr, numel, BLOCK: tl.constexpr):
    """Program 0-axis block of ``out`` (``numel`` elements) set to NaN."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    nan = tl.full([BLOCK], float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, nan, mask=offs < numel)


@triton.jit(do_not_specialize=["world", "n0", "n1", "n2", "n3"],
            do_not_specialize_on_alignment=["every_ptr", "out0", "out1", "out2", "out3"])
def poison_if_bad(every_ptr, world, out0, n0, out1, n1, out2, n2, out3, n3, LEN: tl.constexpr, FAIL: tl.constexpr,
                  ROWS: tl.constexpr, IDX_MAX: tl.constexpr, IDX_MIN: tl.constexpr, OFFS_STEP: tl.constexpr,
                  UNNAMED: tl.constexpr, OFFS_LAST: tl.constexpr, KEY_STEP: tl.constexpr, BLOCK: tl.constexpr):
    """Outputs ``out0``..``out3`` (``n0``..``n3`` elements each; 0: an unused slot) NaN where any rank's settle vector
    is bad (``moe_deferred.bad``): program (i, k) judges the vectors and writes block i of output k only then
    (nothing written when every vector is good). One launch for all of a call's outputs."""
    tl.static_assert(LEN <= 16)
    r = tl.arange(0, 8)[:, None]
    f = tl.arange(0, 16)[None, :]
    v = tl.load(every_ptr + r * LEN + f, mask=(r < world) & (f < LEN), other=0)
    rows, last = _field(v, f, ROWS), _field(v, f, OFFS_LAST)
    out_of_range = (rows > 0) & ((_field(v, f, IDX_MAX) >= rows) | (_field(v, f, IDX_MIN) < -rows))
    bad = (_field(v, f, FAIL) != 0) | out_of_range | (_field(v, f, OFFS_STEP) < 0) | (last != rows) | \
        (_field(v, f, UNNAMED) > 0) | (_field(v, f, KEY_STEP) < 0)
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        k = tl.program_id(1)
        if k == 0:
            _nan_block(out0, n0, BLOCK)
        elif k == 1:
            _nan_block(out1, n1, BLOCK)
        elif k == 2:
            _nan_block(out2, n2, BLOCK)
        else:
            _nan_block(out3, n3, BLOCK)
