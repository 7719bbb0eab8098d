"""Cost model of flashoverlap-inductor: bandwidth curves + a GEMM wave model + FlashOverlap's pipeline
recurrence choose the wave groups of a fused GEMM + collective at compile time, and decline fusion where it
would not pay.

Public API (the contract with the pass and the ops)::

    from flashoverlap_inductor.cost_model import decide, Decision
    d = decide("all_reduce", m, n, k, "bfloat16", world_size, device_name=torch.cuda.get_device_name())
    d.fuse, d.plan.to_str(), d.predicted_fused_ms, d.predicted_seq_ms, d.reason

Modules: ``bandwidth`` (NCCL curves, bytes -> ms), ``gemm`` (wave model, ms), ``pipeline`` (recurrence),
``search`` (partitions), ``decide``, ``gather`` (all_gather -> GEMMs: ``decide_gather``), ``gain`` (the one gain
rule every verdict uses), ``registry`` (data files by GPU name), ``schema`` (JSON validation), ``launch`` (the
data's SM reserve, grid and tuned kernels, which the routes pass to ``runtime.kernel_select``). Turning
``tools/anchor_bench.py`` output into data files is ``flashoverlap_inductor.tune.import_anchor``.
"""

from . import gain
from .bandwidth import BandwidthCurve, SampledCurve
from .decide import Decision, call_plan, clear_caches, copy_ms, decide, decide_cache_info
from .gather import GatherDecision, decide_gather
from .gemm import GemmModel
from .pipeline import CostModel, PipelineResult, pipeline
from .registry import DEFAULT_GPU, data_dir, model_for, normalize_gpu_name
from .schema import ConfigError
from .search import SearchResult, exhaustive_search, predictive_search

__all__ = [
    "DEFAULT_GPU", "BandwidthCurve", "gain", "ConfigError", "CostModel", "Decision", "GatherDecision", "GemmModel",
    "PipelineResult", "SampledCurve", "SearchResult", "call_plan", "clear_caches", "copy_ms", "data_dir", "decide",
    "decide_cache_info", "decide_gather", "exhaustive_search", "model_for", "normalize_gpu_name", "pipeline",
    "predictive_search",
]
