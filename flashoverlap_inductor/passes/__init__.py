"""FX graph passes of flashoverlap-inductor (installed as ``flashoverlap_inductor.passes``).

``FlashOverlapPass`` fuses GEMM -> collective chains into ``torch.ops.flashoverlap.*`` ops; ``counters`` and
``reset_counters()`` expose what it fused and skipped (see ``report.py``), logger ``flashoverlap``.
"""

from .gemm_collective import FlashOverlapPass
from .matching import Fusion, GemmCollectiveMatch, find_matches
from .report import SKIP_REASONS, counters, log, reset_counters

__all__ = ["FlashOverlapPass", "Fusion", "GemmCollectiveMatch", "find_matches", "SKIP_REASONS", "counters", "log",
           "reset_counters"]
