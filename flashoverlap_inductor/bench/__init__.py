"""Benchmarks of the flashoverlap backend on whole models.

``python -m flashoverlap_inductor.bench e2e --help``: the end-to-end benchmark (``e2e.py``): HuggingFace models
(``models.py``) parallelized with DTensor plans (``plans.py``, ``moe.py``), trained or prefilled under eager,
Inductor, Inductor + async-TP and flashoverlap side by side (``runner.py``), with what the pass fused in every
graph (``coverage.py``) and a table, JSON and PNG (``output.py``). How to run it: ``docs/e2e.md``.
"""
