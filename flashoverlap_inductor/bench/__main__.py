"""``python -m flashoverlap_inductor.bench <command> [options]``; ``<command> --help`` lists its options.

Commands: ``e2e``, the end-to-end benchmark (``flashoverlap_inductor/bench/e2e.py``, ``docs/e2e.md``);
``coverage``, what the pass fuses in a model's graphs, nothing timed (``cli_coverage.py``); ``timeline``, where the
time of one fused all_gather -> GEMM call (or, ``--op all_reduce|reduce_scatter``, GEMM -> collective call on the
peer route) goes (``timeline.py``, ``timeline_peer.py``).
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = {"e2e": "end-to-end train / prefill of a TP / SP / EP HuggingFace model under eager, Inductor, "
                   "Inductor + async-TP and flashoverlap, side by side",
            "timeline": "where the time of one fused all_gather -> GEMM call goes, per rank: handshake, GEMMs, "
                        "pulls, waits, tail against the ideal; --op all_reduce|reduce_scatter: GEMM -> collective "
                        "on the peer route (GEMM 1, wait, GEMM 2, exchange, copy); text and PNG Gantt charts "
                        "(torchrun, >= 2 GPUs)",
            "coverage": "what the flashoverlap pass fuses, declines (and why) and misses in a model's graphs: a "
                        "preset under a plan, or your own model (--model MODULE:FUNCTION); nothing timed"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m flashoverlap_inductor.bench",
                                     description="Benchmarks of the flashoverlap torch.compile backend.",
                                     epilog="\n".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    parser.add_argument("command", choices=sorted(COMMANDS), help="the benchmark to run (then its options)")
    parser.parse_args(argv[:1])
    if argv[0] == "e2e":
        from .e2e import run

        return run(argv[1:])
    if argv[0] == "timeline":
        from .timeline import run as run_timeline

        return run_timeline(argv[1:])
    if argv[0] == "coverage":
        from .cli_coverage import run as run_coverage

        return run_coverage(argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
