"""The collectives a compiled graph will issue, in graph order: what its ranks must agree on before it runs.

``graph_manifest(graph)`` lists every collective node after the pass (``_c10d_functional`` collectives, fused or
not, and every ``flashoverlap`` op) as ``(group_name, entry)``, where ``entry`` is the JSON of ``{"op", "args"}``:
tensors as dtype and shape (symbolic sizes by their expression), every other argument (plan, settings key, split
sizes, reduce op) by value; an all_to_all's split sizes, rows and plan are "per rank" (``PER_RANK``). Two ranks
whose graphs would pair unlike collectives have different manifests.

``record(manifest)`` stores it in Inductor's counters under ``MANIFEST_PREFIX``: Inductor replays a compilation's
counters on every FX-graph cache hit, so a graph loaded from the cache brings its manifest along, while the fusion
counters (``report.counters``) never see it. ``take(before)`` reads back what one compilation (or cache load) added.
The backend checks it on the graph's first run (``routes.agree.check_graph``).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor import _inductor_compat as compat

MANIFEST_PREFIX = "flashoverlap-manifest|"
NAMESPACES = ("_c10d_functional", "flashoverlap")
NOT_COLLECTIVES = ("wait_tensor",)
# all_to_all: each rank holds its own rows and split sizes by design, and the fused op's plan holds the rows; what
# the ranks must share is the op, the other sizes, the dtype and the settings
PER_RANK = {"all_to_all_single": ("output_split_sizes", "input_split_sizes"),
            "gemm_all_to_all": ("output_split_sizes", "input_split_sizes", "plan"),
            "gemm_unpermute_all_to_all": ("output_split_sizes", "input_split_sizes"),
            "all_to_all_permute_gemm": ("output_split_sizes", "input_split_sizes", "sizes")}


def _describe(arg: Any, rows_per_rank: bool = False) -> Any:
    if isinstance(arg, Node):
        v = arg.meta.get("val")
        if isinstance(v, torch.Tensor):
            shape = [str(d) for d in v.shape]
            if rows_per_rank and shape:
                shape[0] = "per rank"
            return f"{str(v.dtype).removeprefix('torch.')}[{', '.join(shape)}]"
        return str(v) if v is not None else arg.name
    if isinstance(arg, (list, tuple)):
        return [_describe(a, rows_per_rank) for a in arg]
    return arg if isinstance(arg, (int, float, str, bool, type(None))) else str(arg)


def graph_manifest(graph: torch.fx.Graph) -> list[tuple[str, str]]:
    """``[(group_name, entry)]`` of every collective of ``graph`` in graph order (module docstring)."""
    out = []
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace not in NAMESPACES or target.__name__.split(".")[0] in NOT_COLLECTIVES:
            continue
        names = [a.name for a in target._schema.arguments]
        args = dict(zip(names, node.args, strict=False))
        args.update(node.kwargs)
        group = args.get("group_name")
        group = group if isinstance(group, str) else getattr(group, "group_name", str(group))
        name = target.__name__.split(".")[0]
        per_rank = PER_RANK.get(name, ())
        described = {k: "per rank" if k in per_rank else _settings(v) if k == "settings" else
                     _describe(v, bool(per_rank)) for k, v in args.items() if k != "group_name"}
        out.append((group, json.dumps({"op": f"{target.namespace}.{name}", "args": described})))
    return out


def _settings(key: Any) -> Any:
    """A fused op's settings key without the paths a rank may hold differently (the library's, the data folder's:
    node-local paths; what they decide shows in the plan), as ``routes.agree.items`` compares settings."""
    from flashoverlap_inductor import config

    if not isinstance(key, str):
        return _describe(key)
    return config.from_key(key).replace(library=None, config_dir=None).key()


def per_rank(manifest: list[tuple[str, str]]) -> bool:
    """Whether any collective of ``manifest`` has per-rank sizes (an all_to_all with split sizes): such a graph's
    shapes may differ between ranks and recompile on one rank alone, so no first-run exchange may be paired."""
    return any('"per rank"' in entry for _, entry in manifest)


def record(manifest: list[tuple[str, str]]) -> None:
    """Store ``manifest`` with the graph being compiled (module docstring)."""
    if manifest:
        compat.inductor_counters()[MANIFEST_PREFIX + json.dumps(manifest)] += 1


def snapshot() -> Counter:
    """The manifests in Inductor's counters now (pass it to ``take`` after a compilation)."""
    return Counter({k: n for k, n in compat.inductor_counters().items() if k.startswith(MANIFEST_PREFIX)})


def take(before: Counter) -> list[tuple[str, str]]:
    """The manifest one compilation or cache load added since ``before`` ([] when its graph has no collective). A
    compilation that ran the pass on several graphs (subgraphs of ``cond``, ``invoke_subgraph``) added one each:
    their collectives are all listed, in the order they were recorded."""
    out: list[tuple[str, str]] = []
    for key in snapshot() - before:
        out += [tuple(e) for e in json.loads(key[len(MANIFEST_PREFIX):])]
    return out
