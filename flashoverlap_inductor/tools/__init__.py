"""Command-line tools and their helpers, outside the runtime: the tuner's CLI (``tune``; ``python -m
flashoverlap_inductor.tune``), the demo (``demo``, ``demo_report``; ``python -m flashoverlap_inductor.demo``), the CLIs'
shared checks (``cli_util``) and a test and benchmark helper that calls the kernels directly (``kernel_calls``)."""
