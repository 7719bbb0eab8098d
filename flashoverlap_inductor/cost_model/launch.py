"""What the cost model's data says about launching the fused GEMM: the SMs its model leaves to NCCL, the grid its
predictions assume, and the kernel configurations ``tune gemm`` measured best per tile.

The routes read these (``routes/nccl.py``: ``grid_for``, ``make_launch``) and hand them to ``runtime.kernel_select``,
which decides from its arguments alone and never imports the cost model. Each function answers for the GPU's data
in the current settings' data folder (``registry.data_dir``) and never raises: missing or unreadable data gives its
documented default, logged.
"""

from __future__ import annotations

import functools
import json
import logging

from . import registry

log = logging.getLogger("flashoverlap")

DEFAULT_NCCL_SMS = 16  # ``GemmModel.nccl_sms``'s default
DEFAULT_GRID = "persistent"  # ``GemmModel.grid``'s default


def fused_nccl_sms(device_name: str) -> int:
    """The data file's ``fused.nccl_sms`` for ``device_name`` (the SMs the model leaves to NCCL), else
    ``DEFAULT_NCCL_SMS`` with a warning."""
    try:
        return int(registry.model_for(device_name)[0].gemm.nccl_sms)
    except Exception as exc:  # the cost model's data missing: its documented default
        log.warning("flashoverlap: no cost-model SM reserve (%r); leaving %d SMs", exc, DEFAULT_NCCL_SMS)
        return DEFAULT_NCCL_SMS


def fused_grid(device_name: str) -> str:
    """The data file's ``fused.grid`` for ``device_name`` (the grid its predictions assume), else ``DEFAULT_GRID``.
    Not validated here: ``kernel_select.gemm_grid`` checks every grid it is given."""
    try:
        return registry.model_for(device_name)[0].gemm.grid
    except Exception as exc:  # the cost model's data missing
        log.debug("flashoverlap: no cost-model GEMM grid (%r); %s", exc, DEFAULT_GRID)
        return DEFAULT_GRID


@functools.lru_cache(maxsize=8)
def preferred_kernels(device_name: str, config_dir: str | None = None) -> dict[str, str]:
    """``"<tm>x<tn>" -> configuration`` measured best by ``tune gemm`` (``tuned_kernels.best_by_tile`` of the
    GPU's ``flashoverlap.gemm`` data file in the current settings' data folder, which ``config_dir`` names for the
    memo); empty when not tuned. Memoized: ``cache_clear()`` after writing a data file (``routes.nccl`` does on
    reset)."""
    try:
        want = registry.normalize_gpu_name(device_name)
        for path in sorted(registry.data_dir().glob("*.json")):
            doc = json.loads(path.read_text())
            if (isinstance(doc, dict) and str(doc.get("schema", "")).startswith("flashoverlap.gemm/")
                    and registry.normalize_gpu_name(str(doc.get("gpu", ""))) == want):
                return dict(doc.get("tuned_kernels", {}).get("best_by_tile", {}))
    except Exception as exc:  # tuning data is optional
        log.debug("flashoverlap: no tuned kernel preferences: %r", exc)
    return {}
