"""``MoeTerms``: one MoE op's numbers in a GPU data file's ``moe`` section (``moe.py`` says what each term does;
``schema.py`` validates them; ``gemm.GemmModel.moe`` holds them per op)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeTerms:
    """``factor``: the fused call's GPU time over its pipeline model; ``host_floor_ms``: a fused call's host time
    (ms); ``moves_bytes_per_ms`` / ``unfused_bytes_per_ms``: the rates of the fused moves and of the unfused
    permutation (bytes per ms); ``model_error``: the fit's typical relative error, added to the verdict's margin."""

    factor: float
    host_floor_ms: float
    moves_bytes_per_ms: float
    unfused_bytes_per_ms: float
    model_error: float = 0.0
