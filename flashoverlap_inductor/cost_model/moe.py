"""``decide_moe``: should a MoE dispatch or combine be fused (ms throughout, bytes for sizes)?

One rank's call of ``rows`` expert rows and GEMM terms ``[rows, k_t] @ [k_t, n_t]`` (``gemms``: the (k, n) of each;
the dispatch's terms share k, the rows moved; the combine's share n, the rows sent and summed), its all_to_all over
``world`` ranks with routing assumed even (each rank sends and receives ``rows``, ``rows / world`` per block):

* sequential: the experts' GEMMs (``GemmModel.reference_ms`` of each term: a grouped GEMM over enough rows per
  expert runs as the dense one), the all_to_all of ``rows x width`` elements on the data's ``all_to_all`` curve
  (width: the shared k for the dispatch, the shared n for the combine), and the unfused permutation's memory
  traffic at ``unfused_bytes_per_ms`` (dispatch: the gather of the received rows into expert order, read and write;
  combine: the ``index_put`` un-permutation of the GEMM's output, an element-wise scatter, far slower per byte);
* fused (``routes/moe_fast.py``, the whole-block path): the blocks' pipeline, the own block's GEMMs at once and each
  peer's block after its transfer landed (dispatch; block ``s`` at ``s * comm / (world - 1)``) or each block's
  GEMMs before its transfer (combine; the transfers one after another), plus the rows' moves into expert order at
  ``moves_bytes_per_ms``, all ``factor`` times slower (split grouped GEMMs, transfers sharing HBM), and never under
  ``host_floor_ms``: a fused call holds the host that long (the settle, the plan, the transfers' issue, the moves),
  so a call whose GPU work is shorter is host-bound there.

Verdict (``gain.verdict``): fuse iff ``rows >= min_rows`` and ``fused <= (1 - min_gain_fraction - error) *
sequential``; ``error`` is the data file's ``model_error`` (the fit's typical error on the measured shapes), times
``gain.FOREIGN_DATA_FACTOR`` when the GPU has no data of its own. The terms are per op and GPU (data file section
``moe``); without them the verdict declines. Pure in its arguments. Its callers:
``examples/bench_moe.py`` (the verdict beside the measured speedup) and the pass under ``auto``, where it is this rank's
offer for the group's one verdict (``passes/moe_verdict.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flashoverlap_inductor import config

from . import gain, registry
from .moe_terms import MoeTerms
from .pipeline import DTYPE_BYTES

OPS = ("dispatch", "combine")


@dataclass(frozen=True)
class MoeDecision:
    """The cost model's answer for one MoE op (ms)."""

    fuse: bool
    predicted_fused_ms: float
    predicted_seq_ms: float
    reason: str


def decide_moe(op: str, rows: int, gemms: Sequence[tuple[int, int]], dtype: str, world_size: int, *,
               device_name: str | None = None, settings: config.Settings | None = None) -> MoeDecision:
    """Decide fusion of MoE ``op`` ("dispatch" or "combine") of ``rows`` expert rows per rank with GEMM terms
    ``gemms`` ((k, n) each) over ``world_size`` ranks. ``settings``: the caller's (None: ``config.current()``)."""
    if op not in OPS:
        raise ValueError(f"decide_moe: op must be one of {OPS}, got {op!r}")
    if not gemms:
        raise ValueError("decide_moe: no GEMM terms")
    s = settings or config.current()
    return _decide(op, int(rows), tuple((int(k), int(n)) for k, n in gemms), dtype, int(world_size), device_name,
                   registry.data_dir(s), s.min_gain_fraction, s.min_rows)


@functools.lru_cache(maxsize=1024)
def _decide(op: str, rows: int, gemms: tuple[tuple[int, int], ...], dtype: str, world: int, device_name: str | None,
            directory: Path, min_gain: float, min_rows: int) -> MoeDecision:
    model, how = registry.model_for(device_name, directory)
    note = "" if how == "exact" else f" [{how} match: using data of {model.gemm.gpu}]"
    nan = float("nan")
    terms = (model.gemm.moe or {}).get(op)
    if terms is None:
        return MoeDecision(False, nan, nan, f"declined: no MoE {op} terms in the GPU's data file{note}")
    if dtype not in DTYPE_BYTES or not model.gemm.supports(dtype):
        return MoeDecision(False, nan, nan, f"declined: no cost data for dtype {dtype!r}{note}")
    if world < 2 or rows < world:
        return MoeDecision(False, nan, nan, f"declined: {rows} rows over {world} rank(s){note}")
    fused, seq = moe_times(model, terms, op, rows, gemms, dtype, world)
    summary = (f"predicted {fused:.3f} ms fused vs {seq:.3f} ms sequential ({seq / fused:.3f}x; MoE {op}, {rows} "
               f"rows per rank, GEMMs (k, n) {list(gemms)}, host floor {terms.host_floor_ms:g} ms){note}")
    error = terms.model_error * (1.0 if how == "exact" else gain.FOREIGN_DATA_FACTOR)
    fuse, reason = gain.verdict(fused, seq, rows, min_gain, min_rows, summary, error)
    return MoeDecision(fuse, fused, seq, reason)


def moe_times(model, terms: MoeTerms, op: str, rows: int, gemms: Sequence[tuple[int, int]], dtype: str,
              world: int) -> tuple[float, float]:
    """(fused, sequential) ms of the module docstring."""
    size = DTYPE_BYTES[dtype]
    gemm = sum(model.gemm.reference_ms(rows, n, k, dtype) for k, n in gemms)
    width = gemms[0][0] if op == "dispatch" else gemms[0][1]
    comm = model.curve.comm_ms("all_to_all", world, rows * width * size)
    step, block = comm / (world - 1), gemm / world
    if op == "dispatch":  # own block at once; block s lands at s * step
        t = block
        for s in range(1, world):
            t = max(t, s * step) + block
        moves = rows * (width + sum(n for _, n in gemms)) * size * 2  # rows and results into expert order (r + w)
        unfused = rows * width * size * 2  # the gather of the received rows into expert order
    else:  # each peer's block computed, then sent after the previous send; the own block last
        computed = sent = 0.0
        for _ in range(1, world):
            computed += block
            sent = max(sent, computed) + step
        t = max(sent, computed + block)
        moves = rows * sum(k for k, _ in gemms) * size * 2  # the GEMMs' input rows gathered by block (r + w)
        unfused = rows * width * size  # the index_put un-permutation of the output
    fused = max(terms.host_floor_ms, terms.factor * (t + moves / terms.moves_bytes_per_ms))
    return fused, gemm + comm + unfused / terms.unfused_bytes_per_ms


def decide_cache_clear() -> None:
    _decide.cache_clear()
