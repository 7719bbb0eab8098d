"""Fitting the cost model to a machine: measuring (``measure``), the measured rows (``rows``), the data files'
schemas (``schemas``), the fits (``fit``, ``fit_seq``, ``fit_ring``) and importing external anchors
(``import_anchor``). The command line, ``python -m flashoverlap_inductor.tune``, is ``tools/tune.py``."""
