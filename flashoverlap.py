"""The logging name of flashoverlap-inductor: ``TORCH_LOGS="flashoverlap"`` (INFO: what each compiled graph fused
and skipped, and why) or ``TORCH_LOGS="+flashoverlap"`` (DEBUG).

torch reads ``TORCH_LOGS`` when it is imported, before this package is, and accepts a name there only when it is a
registered log or an importable module: this module is that name (it imports nothing). The package itself is
``flashoverlap_inductor``.
"""
