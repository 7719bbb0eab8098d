"""What keys a compiled graph in Inductor's FX graph cache, besides the graph: the pass's ``uuid()`` inputs.

Everything whose content changes what the pass emits: its code, the ops, the settings, the schedule, the route
registry and routes (which route the cost model predicts), the cost model and its data files; the GPUs; the sizes of
the process groups (names repeat between worlds of different sizes).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import config


def uuid_for(settings: config.Settings) -> str:
    """The pass's ``uuid()`` under ``settings``: a digest of ``source_files`` plus the settings' key, the GPUs,
    the library's configurations and the process groups' sizes; and this rank where the pass writes it into the
    graph (``rank_part``)."""
    from flashoverlap_inductor.native import kernels

    try:  # the library's configurations decide which route the cost model predicts (``_route_of``)
        lib = ",".join(c.name for level in (0, 1, 2, 3) for c in kernels.configs(add_c=level))
    except Exception:  # noqa: BLE001 - no library: the NCCL-free unfused route everywhere
        lib = ""
    extra = f"{settings.key()}|{device_names()}|{lib}|{compat.process_group_layout()}{rank_part(settings)}"
    return compat.hash_files(source_files(settings), extra=extra)


def rank_part(settings: config.Settings) -> str:
    """``|rank:<r>`` (the global rank) where the graphs the pass emits may depend on the rank, else "". Under the
    setting ``tp_sequence`` (not "off") an inference graph slices this rank's rows (``passes/tp_sequence.py``) out of an
    input graph that is the same on every rank, and the ranks of one host share Inductor's FX graph cache: without the
    rank in the key, one rank would load another's graph and compute with its rows. The graph embeds its rank within
    the group, so the key names this process's rank in each group too (two runs whose groups have other members)."""
    import torch.distributed as dist

    from .tp_sequence import rewrites

    if not rewrites(settings) or not (dist.is_available() and dist.is_initialized()):
        return ""
    return f"|rank:{dist.get_rank()}|group_ranks:{compat.process_group_ranks()}"


def device_names() -> str:
    ready = torch.cuda.is_available() and torch.cuda.is_initialized()
    return ",".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if ready else ""


def source_files(settings: config.Settings) -> list[str]:
    """Everything whose content changes what the pass emits: its code, the ops, the settings, the schedule, the
    route registry and routes (which route the cost model predicts), the cost model and its data files."""
    pkg = Path(__file__).resolve().parent.parent  # the package folder
    files = [pkg / name for name in ("ops.py", "config.py", "_inductor_compat.py")]
    files += sorted(Path(__file__).parent.glob("*.py"))
    files += sorted((pkg / "schedule").glob("*.py")) + sorted((pkg / "routes").glob("*.py"))
    for loc in _package_dirs("flashoverlap_inductor.cost_model"):
        files += sorted(Path(loc).rglob("*.py"))
    data = settings.config_dir
    for loc in [data] if data is not None else _package_dirs("flashoverlap_inductor.configs"):
        files += sorted(Path(loc).rglob("*.json"))
    return [str(p) for p in files if p.is_file()]


def _package_dirs(name: str) -> list[str]:
    """The directories of package ``name`` without importing it (an imported one: its ``__path__``)."""
    module = sys.modules.get(name)
    if module is not None:
        return list(getattr(module, "__path__", []))
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []
