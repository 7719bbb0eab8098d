"""flashoverlap-inductor: a torch.compile backend that overlaps tensor-parallel GEMMs with their collectives.

``torch.compile(model, backend="flashoverlap")`` finds the backend through the ``torch_dynamo_backends`` entry
point; importing this package is not needed for that. ``import flashoverlap_inductor.ops`` registers the fused
ops (the backend and the pass import it).
"""

__version__ = "0.1.0"
