"""Which route a benchmark row's fused time ran on, and the ``--host-floor`` option: shared by ``tune fit``
(``tune.fit``, ``tune.fit_ring``) and ``examples/bench_report.py``, so a fit never mixes routes.

A row of ``examples/bench_ops.py`` holds the default fused column (its ``launch`` names the route: "peer route",
"ring route", else the NCCL route) and ``variants``, each timed under a ``--fused-variants`` spec
(``"<grid>/<nccl>[/<host>[/<kernel>[/<ctas>[/<rows>]]]]"``, ``bench_ops.with_mode``) whose own launch is not
recorded: its route follows from the spec and from whether the route takes the call.
"""

from __future__ import annotations

import json
from typing import Any

from flashoverlap_inductor.cost_model.ring import rounds_for
from flashoverlap_inductor.cost_model.schema import ROUTE_COLLECTIVES
from flashoverlap_inductor.tools import cli_util as cli

BENCH_RING_ROUNDS = (1, 2, 4)  # the benchmark's ``ringR`` rows flags (examples/bench_report.PEER_ROWS)


def route_of_launch(launch: str) -> str:
    """"ring", "peer", "pull", "push" (the pull route on the push schedule, ``scatter_start="push"``) or "nccl"
    from a launch description (``RingLaunch`` / ``PeerLaunch`` / ``ScatterLaunch`` / NCCL-route launches); the
    all_reduce pull route's (``ReduceLaunch``) is "pull"."""
    if "reduce_pull route" in launch:
        return "pull"
    if "scatter_pull route" in launch:
        return "push" if "pushed by copy engine" in launch else "pull"
    return "ring" if "ring route" in launch else "peer" if "peer route" in launch else "nccl"


def _spec_parts(spec: str) -> list[str]:
    return (spec.split("/") + [""] * 6)[:6]


def ring_flag(spec: str) -> int:
    """R of a ``ringR`` flag among a peer-mode spec's rows flags (joined by "+"); 0 where there is none."""
    parts = _spec_parts(spec)
    if parts[1] != "peer":
        return 0
    return next((int(f[4:]) for f in parts[5].split("+") if f in {f"ring{r}" for r in BENCH_RING_ROUNDS}), 0)


def modelled_ring_variant(spec: str) -> int:
    """R where ``spec`` runs the ring as ``cost_model/ring.py`` describes it (rows field exactly ``ringR``, no
    kernel named: the steps' configurations ``routes.ring.step_configs`` picks, the in-kernel gate); else 0."""
    parts = _spec_parts(spec)
    r = ring_flag(spec)
    return r if r and parts[5] == f"ring{r}" and not parts[3] else 0


def route_of_row(row: dict[str, Any], variant: str | None = None) -> str:
    """The route the row's timed fused call ran on: the default column's launch, or for ``variant`` its spec (peer
    mode: the ring where a ``ringR`` flag is set and the rows cut into pieces, else the peer route for
    all_reduce / reduce_scatter on 2 ranks with even rows; otherwise the NCCL route)."""
    if not variant:
        return route_of_launch(row.get("launch", ""))
    if _spec_parts(variant)[1] != "peer" or row["op"] not in ROUTE_COLLECTIVES:
        return "nccl"
    r = ring_flag(variant)
    if r:
        return "ring" if rounds_for(row["op"], row["m"], row["world"], r) is not None else "nccl"
    return "peer" if row["world"] == 2 and row["m"] % 2 == 0 else "nccl"


def parse_host_floor(text: str) -> dict[str, float]:
    """``--host-floor`` ("all_reduce=MS,reduce_scatter=MS", each MS > 0) -> {collective: ms}; ValueError else."""
    floor = {}
    for item in (x for x in text.split(",") if x):
        op, sep, ms = item.partition("=")
        try:
            value = float(ms) if sep else float("nan")
        except ValueError:
            value = float("nan")
        if op not in ROUTE_COLLECTIVES or not value > 0:
            raise ValueError(f"--host-floor {text!r}: takes all_reduce=MS,reduce_scatter=MS with MS > 0")
        floor[op] = value
    return floor


def above_floor(points: list[tuple], floor: float) -> list[tuple]:
    """The points (measured ms last) more than 10% above the host floor: those near it measured the host, not the
    GPU, and stay out of a route's fit (not out of its error)."""
    return [p for p in points if p[-1] > 1.1 * floor]


def write_section(gpu: str, update: Any, what: str) -> int:
    """Apply ``update(doc)`` to the GPU's GEMM model file in the data directory and write it (a data file that is
    not JSON raises ``cli_util.CliError`` naming it)."""
    from flashoverlap_inductor.cost_model import registry

    want = registry.normalize_gpu_name(gpu)
    for path in sorted(registry.data_dir().glob("*.json")):
        doc = cli.read_json(path, "", ("a data file of the cost model", "the package's configs/, tune, import_anchor"))
        if isinstance(doc, dict) and str(doc.get("schema", "")).startswith("flashoverlap.gemm/") and \
                registry.normalize_gpu_name(str(doc.get("gpu", ""))) == want:
            update(doc)
            path.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"tune fit: wrote the {what} of {path}")
            return 0
    print(f"tune fit: no GEMM model file for {gpu} in {registry.data_dir()}")
    return 2


def route_fit(flag: str, rows: list[dict[str, Any]], gpu: str, fit: Any, host_floor: str,
              none_why: str) -> dict[str, Any] | None:
    """The common start of ``--peer`` and ``--ring``: ``fit(model, rows, host floors)`` with the GPU's model and the
    parsed ``--host-floor``; None (after saying why) without rows or on a ValueError."""
    from flashoverlap_inductor.cost_model import model_for

    if not rows:
        print(f"tune fit {flag}: {none_why}")
        return None
    try:
        return fit(model_for(gpu)[0], rows, parse_host_floor(host_floor))
    except ValueError as exc:
        print(f"tune fit {flag}: {exc}")
        return None
