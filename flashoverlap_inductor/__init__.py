"""flashoverlap-inductor: a torch.compile backend that overlaps tensor-parallel GEMMs with their collectives.

``torch.compile(model, backend="flashoverlap")`` finds the backend through the ``torch_dynamo_backends`` entry
point; importing this package is not needed for that. ``import flashoverlap_inductor`` registers the fused ops
(``torch.ops.flashoverlap.*``, ``ops.py``), as every torch op library does, so eager calls, benchmarks and graphs
loaded from a cache find them. The one exception: without torch installed (``python -m flashoverlap_inductor.build``
on a machine with nvcc only) the package imports without them. ``fusion_report()``: what was fused, skipped and run
(``reporting.py``); logs: ``TORCH_LOGS="flashoverlap"`` (``+flashoverlap`` for debug).
"""

import importlib.util as _util

__version__ = "0.1.0"

if _util.find_spec("torch") is not None:
    from . import ops  # noqa: F401  (registers torch.ops.flashoverlap.*)


def fusion_report():  # noqa: ANN201
    """What the backend fused (per compiled graph, cached ones included) and what the fused ops ran: a
    ``reporting.FusionReport``."""
    from .reporting import fusion_report as _report

    return _report()


def model_coverage(module, *args, **kwargs):  # noqa: ANN001, ANN201 - lazy: see bench/model_coverage.py
    """Compile ``module`` with this backend, run it once and return what the pass fused, declined (with its reason)
    and missed, per graph (``bench.model_coverage.Coverage``; ``print()`` it). Nothing is timed."""
    from .bench.model_coverage import model_coverage as _coverage

    return _coverage(module, *args, **kwargs)


def reset_fusion_report() -> None:
    """Forget what ``fusion_report()`` has gathered so far."""
    from .reporting import reset_fusion_report as _reset

    _reset()
