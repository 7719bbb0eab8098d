"""flashoverlap-inductor: a torch.compile backend that overlaps tensor-parallel GEMMs with their collectives.

``torch.compile(model, backend="flashoverlap")`` finds the backend through the ``torch_dynamo_backends`` entry
point; importing this package is not needed for that. ``import flashoverlap_inductor.ops`` registers the fused
ops (the backend and the pass import it). ``fusion_report()``: what was fused, skipped and run (``reporting.py``);
logs: ``TORCH_LOGS="flashoverlap"`` (``+flashoverlap`` for debug).
"""

__version__ = "0.1.0"


def fusion_report():  # noqa: ANN201 - lazy: importing the package stays free of torch
    """What the backend fused (per compiled graph, cached ones included) and what the fused ops ran: a
    ``reporting.FusionReport``."""
    from .reporting import fusion_report as _report

    return _report()


def reset_fusion_report() -> None:
    """Forget what ``fusion_report()`` has gathered so far."""
    from .reporting import reset_fusion_report as _reset

    _reset()
