"""Coverage: which GEMM -> collective pairs the traced graphs hold, and which the FlashOverlap pass fused.

``GraphCapture`` is installed as Inductor's ``post_grad_custom_post_pass`` for every compiled backend. It runs
after the post-grad passes (ours, under ``backend="flashoverlap"``, and async-TP's micro-pipeline pass), so per
graph it sees what is left: fused ops (``flashoverlap.gemm_*``, ``symm_mem.fused_*``) and the remaining
collectives. For each remaining collective it walks back from the collective's input through views (and funcol's
split/cat form of a reduce_scatter along dim > 0) and classifies what feeds it:

* ``gemm``: an ``mm`` / ``addmm`` / ``bmm`` directly: a pair the pass could fuse and did not (the fusion report
  says why: ``skip:<reason>``);
* ``via <op>``: a GEMM (also ``_grouped_mm``) within ``HOPS`` producers, behind ``<op>`` (e.g. the ``add`` of
  the q/k/v input gradients, the ``index_put`` of an MoE un-permutation): a near miss;
* ``other``: no GEMM in reach (the all_gathers of sequence parallelism, gradient all_reduces of replicated
  weights, the MoE's count exchange and dispatch).

A graph is ``backward`` when it has ``tangents_*`` inputs, ``forward`` when it has ``primals_*``, else
``inference``. ``uuid()`` is None, so Inductor bypasses its FX-graph cache for these compilations and the capture
always runs (the benchmark compiles every backend in a fresh cache anyway).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

HOPS = 3
VIEWS = ("view", "reshape", "_unsafe_view")
GEMMS = ("mm", "addmm", "bmm", "_grouped_mm")
COLLECTIVES = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
               "all_to_all_single": "all_to_all", "all_gather_into_tensor": "all_gather"}
FUSED_PREFIX = {"flashoverlap": "flashoverlap", "symm_mem": "async-tp"}


def _name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.__name__.split(".")[0]
    return getattr(target, "__name__", str(target))


def _namespace(node: torch.fx.Node) -> str:
    target = node.target
    return target.namespace if isinstance(target, torch._ops.OpOverload) else ""


def graph_kind(graph: torch.fx.Graph) -> str:
    names = [n.name for n in graph.find_nodes(op="placeholder")]
    if any(n.startswith("tangents") for n in names):
        return "backward"
    if any(n.startswith("primals") for n in names):
        return "forward"
    return "inference"


def _through_views(x: Any) -> Any:
    """The producer of ``x`` past views and funcol's split/cat form of a reduce_scatter."""
    while isinstance(x, torch.fx.Node):
        name = _name(x)
        if name in VIEWS:
            x = x.args[0]
        elif name == "cat" and isinstance(x.args[0], (list, tuple)) and x.args[0]:
            first = x.args[0][0]  # getitem(split(source, ...), 0), or slice(source, ...)
            src = first.args[0] if isinstance(first, torch.fx.Node) and first.args else None
            if isinstance(src, torch.fx.Node) and _name(first) == "getitem" and _name(src).startswith("split"):
                x = src.args[0]
            elif isinstance(first, torch.fx.Node) and _name(first) == "slice":
                x = first.args[0]
            else:
                return x
        else:
            return x
    return x


def _gemm_behind(x: torch.fx.Node) -> torch.fx.Node | None:
    """The nearest GEMM (``GEMMS``, ``_grouped_mm`` included) among the producers of ``x``, ``HOPS`` deep."""
    from flashoverlap_inductor.passes.matching import nearest_producer

    return nearest_producer(x, lambda n: _name(n) in GEMMS, HOPS)


def classify(coll: torch.fx.Node) -> str:
    """``gemm``, ``via <op>`` or ``other`` for the collective node ``coll`` (see the module docstring)."""
    x = _through_views(coll.args[0]) if coll.args else None
    if not isinstance(x, torch.fx.Node):
        return "other"
    if _name(x) in GEMMS:
        return "gemm" if _name(x) != "_grouped_mm" else "via _grouped_mm (not matched: the pass takes mm/addmm/bmm)"
    gemm = _gemm_behind(x)
    if gemm is None:
        return "other"
    return f"via {_name(x)}" + (" (from _grouped_mm)" if _name(gemm) == "_grouped_mm" else "")


def summarize_graph(graph: torch.fx.Graph) -> dict[str, Any]:
    """``{"kind", "fused": {op: n}, "collectives": {"<collective> <- <feed>": n}}`` of one post-grad graph."""
    fused: Counter[str] = Counter()
    found: Counter[str] = Counter()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        ns, name = _namespace(node), _name(node)
        if ns in FUSED_PREFIX:
            fused[f"{FUSED_PREFIX[ns]}:{name}"] += 1
        elif ns == "_c10d_functional" and name in COLLECTIVES:
            found[f"{COLLECTIVES[name]} <- {classify(node)}"] += 1
    return {"kind": graph_kind(graph), "fused": dict(fused), "collectives": dict(found)}


class GraphCapture(CustomGraphPass):
    """Records ``summarize_graph`` of every graph it sees, in order (see the module docstring)."""

    def __init__(self) -> None:
        self.graphs: list[dict[str, Any]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        try:
            self.graphs.append(summarize_graph(graph))
        except Exception as exc:  # noqa: BLE001 - coverage must never break a compile; the row says so
            self.graphs.append({"kind": graph_kind(graph), "error": repr(exc)[:200], "fused": {}, "collectives": {}})

    def uuid(self) -> None:  # no cache key: the FX-graph cache is bypassed and this pass always runs
        return None


def merge(graphs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """Per graph kind, the summed ``fused`` and ``collectives`` counts."""
    out: dict[str, dict[str, Counter]] = {}
    for g in graphs:
        slot = out.setdefault(g["kind"], {"fused": Counter(), "collectives": Counter()})
        slot["fused"].update(g["fused"])
        slot["collectives"].update(g["collectives"])
    return {k: {"fused": dict(v["fused"]), "collectives": dict(v["collectives"])} for k, v in out.items()}


def report_events(report: Any) -> dict[str, dict[str, list[str]]]:
    """The fusion report's events per graph kind: ``{kind: {counter: [detail, ...]}}`` (``rewrite:``, ``fused:``,
    ``per_call:``, ``skip:``, ``near_miss:``)."""
    out: dict[str, dict[str, list[str]]] = {}
    for g in report.graphs:
        slot = out.setdefault(g.kind, {})
        for counter, details in g.events.items():
            slot.setdefault(counter, []).extend(details)
    return out


def coverage_lines(entry: dict[str, Any]) -> list[str]:
    """Human-readable lines for one (model, plan, workload) coverage entry (``e2e.coverage_entry``)."""
    lines = [f"{entry['model']} / {entry['plan']} / {entry['workload']} (graphs of {entry['source']}):"]
    if not entry["graphs"]:
        lines.append("  no graphs captured")
    for kind, g in sorted(entry["graphs"].items()):
        fused = ", ".join(f"{k} {n}" for k, n in sorted(g["fused"].items())) or "none"
        lines.append(f"  {kind}: fused ops {fused}")
        for key, n in sorted(g["collectives"].items()):
            lines.append(f"    left: {n} x {key}")
        if not g["collectives"] and not g["fused"]:
            lines.append("    no collectives")
        events = entry["events"].get(kind, {})
        for counter in sorted(events):
            if counter.startswith(("rewrite:", "skip:", "near_miss:")):
                detail = events[counter][0]
                lines.append(f"    {counter} x{len(events[counter])}: {detail[:150]}")
    for note in entry.get("notes", []):
        lines.append(f"  note: {note}")
    return lines
