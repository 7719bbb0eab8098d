"""The experiment ``shadow_check``: each call a fused route ran is run again unfused, on the same inputs, right
after it on the caller's stream, and the two results compared on the device; ``collect`` reads the comparisons.

What it is for: a silent mismatch seen only in a whole model (a row of ``bench e2e`` off its reference, now and
then) names the op, the call and the rows. It changes nothing the fused call does: the reference runs after the
fused call returned (its own torch collective, on every rank at the same call, as the fused call's), and the
comparison is queued on the device, so the host still runs ahead as it would without it. Timings taken under it
mean nothing (every call's GEMMs and transfers twice).

Per compared output (the fused op's outputs and the reference's, in order; an empty fused output, as the
dispatch's ``p`` under ``+no_rows``, is not compared): the norm-wise relative error ``||got - ref|| / ||ref||``
(inf where ``got`` is not finite or the shapes differ) and the rows whose largest difference exceeds ``ROW_SHARE``
of the reference row's largest magnitude (per block of rows where the caller gives block bounds: the combine's
source ranks). A call is bad where an error exceeds ``TOLERANCE`` of its dtype (two roundings of one GEMM output;
the fused GEMMs accumulate in another order).

Records are kept for the last ``MAX_RECORDS`` calls; ``collect`` reads them in one host sync, counts
``shadow:<op>`` and ``shadow:<op>:bad`` in ``stats``, logs each bad call (its op, number, detail and rows) and
forgets them.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Sequence

import torch

from flashoverlap_inductor import config

from .base import stats

log = logging.getLogger("flashoverlap")

EXPERIMENT = "shadow_check"
TOLERANCE = {torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps, torch.float16: 4 * torch.finfo(torch.float16).eps,
             torch.float32: 1e-5, torch.float64: 1e-12}
ROW_SHARE = 0.1  # a row is off where its largest difference exceeds this share of the reference row's largest value
MAX_RECORDS = 16384
_records: collections.deque = collections.deque(maxlen=MAX_RECORDS)  # (op, number, detail, tolerance, values)
_numbers: collections.Counter = collections.Counter()  # calls compared per op in this process


def on(settings: config.Settings | None = None) -> bool:
    """Whether the calls under ``settings`` (default: the current ones) are compared."""
    return EXPERIMENT in (settings or config.current()).experiments


def _outputs(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def compare(op: str, out: object, reference: Callable[[], object], detail: Callable[[], str],
            blocks: Sequence[int] | None = None) -> None:
    """Queue the comparison of a fused call's result ``out`` (a tensor or a list of them) with ``reference()`` (run
    now, unfused, on the same inputs: a collective, so every rank of the group calls this at the same call).
    ``detail()``: the call in words (split sizes, path), asked now and kept for the log; ``blocks``: the first
    output's rows per block (the combine's output split sizes: its rows by source rank), its off rows counted per
    block too."""
    got, want = _outputs(out), _outputs(reference())
    values, tol, said = [], 0.0, detail()
    for i, (g, r) in enumerate(zip(got, want, strict=False)):
        if g.numel() == 0 and r.numel():  # not returned by the fused op (the dispatch's p under +no_rows)
            continue
        tol = max(tol, TOLERANCE.get(r.dtype, 1e-2))
        if g.shape != r.shape:
            values.append(torch.tensor([float("inf"), float(max(int(r.shape[0]) if r.dim() else 1, 1))]))
            continue
        d = (g.double() - r.double()).reshape(g.shape[0] if g.dim() else 1, -1)
        ref = r.double().reshape(d.shape)
        err = d.norm() / ref.norm().clamp_min(1e-30)
        err = torch.where(torch.isfinite(g).all(), err, torch.full_like(err, float("inf")))
        off = (d.abs().amax(1) > ROW_SHARE * ref.abs().amax(1).clamp_min(1e-6)) | ~torch.isfinite(d).all(1) \
            if d.numel() else torch.zeros(d.shape[0], dtype=torch.bool, device=d.device)
        parts = [err.reshape(1), off.sum().double().reshape(1)]
        if i == 0 and blocks is not None and len(blocks) > 1 and sum(blocks) == off.shape[0]:
            bounds = torch.tensor([0, *itertools.accumulate(int(n) for n in blocks)], device=off.device)
            upto = torch.cat([off.new_zeros(1, dtype=torch.int64), off.long().cumsum(0)])
            parts.append((upto[bounds[1:]] - upto[bounds[:-1]]).double())
        values.append(torch.cat(parts))
    _numbers[op] += 1
    _records.append((op, _numbers[op], said, tol, values))
    stats["shadow:queued"] += 1


def collect() -> list[str]:
    """Read every queued comparison (one host sync), count ``shadow:<op>`` and ``shadow:<op>:bad``, log and return
    one line per bad call, and forget them."""
    records = list(_records)
    _records.clear()
    bad = []
    for op, number, detail, tol, values in records:
        read = [v.cpu().tolist() for v in values]
        stats[f"shadow:{op}"] += 1
        if not any(v[0] > tol for v in read):
            continue
        stats[f"shadow:{op}:bad"] += 1
        outs = "; ".join(f"output {i}: rel err {v[0]:.3g}, {int(v[1])} rows off"
                         + (f" (by block {[int(x) for x in v[2:]]})" if len(v) > 2 else "")
                         for i, v in enumerate(read))
        bad.append(f"{op} call {number} ({detail}): {outs}")
    for line in bad[:20]:
        log.warning("flashoverlap: shadow check: %s", line)
    return bad
