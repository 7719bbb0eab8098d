"""``python -m flashoverlap_inductor.demo``: the demo's entry point; its runner is ``tools/demo.py`` and what it
reports ``tools/demo_report.py``."""
