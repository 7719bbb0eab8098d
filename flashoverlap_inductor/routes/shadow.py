"""The experiment ``shadow_check``: each call a fused route ran is run again unfused, on the same inputs, right
after it on the caller's stream, and the two results compared on the device; ``collect`` reads the comparisons.

What it is for: a silent mismatch seen only in a whole model (a row of ``bench e2e`` off its reference) names the
op, the call and the rows. It changes nothing the fused call does: the reference runs after the fused call returned
(its own torch collective, on every rank at the same call, as the fused call's), and the comparison is queued on the
device with no host read, so the host still runs ahead as it would without it. Timings taken under it mean nothing
(every call's GEMMs and transfers twice). Calls made while a CUDA graph is captured are not compared (counted
``shadow:capture_skipped``).

Per compared output (the fused op's outputs and the reference's, by index; ``Spec.skip`` names outputs the fused op
does not return, as the dispatch's ``p`` under ``+no_rows``): the norm-wise relative error ``||got - ref|| /
||ref||`` in float32 (inf where either is not finite or the shapes differ) and the rows whose largest difference
exceeds ``ROW_SHARE`` of the reference row's largest magnitude (per block of rows where ``Spec.blocks`` gives the
first output's rows per block: the combine's source ranks). A call is bad where an output's error exceeds its dtype's
``TOLERANCE`` (two roundings of one GEMM output; the fused GEMMs accumulate in another order), where any row is off,
where the outputs' counts differ, or where the comparison itself raised (recorded, never raised: every rank goes on
to the same collectives).

Records are kept for the last ``MAX_RECORDS`` calls; ``collect`` reads them in one host copy, counts ``shadow:<op>``
and ``shadow:<op>:bad`` in ``stats``, logs each bad call (its op, number, detail and rows) and forgets them.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flashoverlap_inductor import config

from .base import stats

log = logging.getLogger("flashoverlap")

EXPERIMENT = "shadow_check"
TOLERANCE = {torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps, torch.float16: 4 * torch.finfo(torch.float16).eps,
             torch.float32: 1e-5, torch.float64: 1e-12}
ROW_SHARE = 0.1  # a row is off where its largest difference exceeds this share of the reference row's largest value
MAX_RECORDS = 16384
_records: collections.deque = collections.deque(maxlen=MAX_RECORDS)  # _Record per compared call, oldest first
_numbers: collections.Counter = collections.Counter()  # calls compared per op in this process


@dataclass(frozen=True)
class Spec:
    """How to read one call's outputs: ``detail()`` names the call (split sizes, plan; asked once, at the call),
    ``blocks`` the first output's rows per block (counted apart), ``skip`` the outputs the fused op does not
    return."""

    detail: Callable[[], str] = str
    blocks: Sequence[int] | None = None
    skip: tuple[int, ...] = ()


@dataclass
class _Record:
    op: str
    number: int
    detail: str
    parts: list[tuple[int, float, int]]  # per compared output: (index, tolerance, values' length)
    values: torch.Tensor | None  # every part's [error, rows off, rows off per block...], one flat float32 tensor
    problem: str = ""  # what went wrong before any value (counts differ, the comparison raised)


def on(settings: config.Settings | None = None) -> bool:
    """Whether the calls under ``settings`` (default: the current ones) are compared."""
    return EXPERIMENT in (settings or config.current()).experiments


def skip_capture() -> None:
    """Count a call not compared because a CUDA graph is being captured."""
    stats["shadow:capture_skipped"] += 1


def _outputs(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _part(g: torch.Tensor, r: torch.Tensor, blocks: Sequence[int] | None) -> torch.Tensor:
    """One output's ``[error, rows off, rows off per block...]`` on ``r``'s device, float32, no host read."""
    rows = int(r.shape[0]) if r.dim() else 1
    width = 1 + (len(blocks) if blocks is not None and len(blocks) > 1 and sum(blocks) == rows else 0)
    if g.shape != r.shape:
        return torch.tensor([float("inf"), float(rows), *[0.0] * (width - 1)], device=r.device)
    if r.numel() == 0:
        return torch.zeros(1 + width, device=r.device)
    wide = torch.promote_types(r.dtype, torch.float32)
    ref = r.to(wide).reshape(rows, -1)
    d = g.to(wide).reshape(rows, -1) - ref
    finite = torch.isfinite(g).all() & torch.isfinite(r).all()
    err = torch.where(finite, d.norm() / ref.norm().clamp_min(1e-30), torch.full((), float("inf"), device=r.device))
    off = (d.abs().amax(1) > ROW_SHARE * ref.abs().amax(1).clamp_min(1e-6)) | ~torch.isfinite(d).all(1)
    parts = [err.reshape(1), off.sum().reshape(1)]
    if width > 1:
        parts.append(torch.stack([s.sum() for s in off.split([int(n) for n in blocks])]))
    return torch.cat([p.float() for p in parts])


def compare(op: str, out: object, reference: Callable[[], object], spec: Spec) -> None:
    """Queue the comparison of a fused call's result ``out`` (a tensor or a list of them) with ``reference()`` (run
    now, unfused, on the same inputs: a collective, so every rank of the group calls this at the same call; its
    exceptions propagate as the unfused op's would)."""
    want = _outputs(reference())
    _numbers[op] += 1
    record = _Record(op, _numbers[op], spec.detail(), [], None)
    try:
        got = _outputs(out)
        if len(got) != len(want):
            record.problem = f"{len(got)} outputs, the reference {len(want)}"
        values = []
        for i, (g, r) in enumerate(zip(got, want, strict=False)):
            if i in spec.skip:
                continue
            v = _part(g, r, spec.blocks if i == 0 else None)
            record.parts.append((i, TOLERANCE.get(r.dtype, 1e-2), int(v.shape[0])))
            values.append(v)
        record.values = torch.cat([v.to(values[0].device) for v in values]) if values else None
    except Exception as exc:  # noqa: BLE001 - recorded: the ranks go on to the same collectives
        record.problem = record.problem or f"the comparison raised {type(exc).__name__}: {exc}"
    _records.append(record)
    stats["shadow:queued"] += 1


def collect() -> list[str]:
    """Read every queued comparison (one host copy), count ``shadow:<op>`` and ``shadow:<op>:bad``, log and return
    one line per bad call, and forget them."""
    records = list(_records)
    _records.clear()
    flat = [r.values for r in records if r.values is not None]
    host = torch.cat([v.to(flat[0].device) for v in flat]).cpu().tolist() if flat else []
    bad, at = [], 0
    for r in records:
        stats[f"shadow:{r.op}"] += 1
        said = []
        for i, tol, n in r.parts:
            v, at = host[at:at + n], at + n
            if not v[0] <= tol or v[1] > 0:
                said.append(f"output {i}: rel err {v[0]:.3g}, {int(v[1])} rows off"
                            + (f" (by block {[int(x) for x in v[2:]]})" if n > 2 else ""))
        if r.problem or said:
            stats[f"shadow:{r.op}:bad"] += 1
            bad.append(f"{r.op} call {r.number} ({r.detail}): " + "; ".join(x for x in (r.problem, *said) if x))
    for line in bad[:20]:
        log.warning("flashoverlap: shadow check: %s", line)
    return bad
