"""all_gather -> GEMMs: find each gather whose rows feed GEMMs and replace them with ``flashoverlap::all_gather_gemm``.

Recognized (post-grad graphs of torch 2.11 and 2.13, DTensor and funcol alike)::

    ag = _c10d_functional.all_gather_into_tensor(shard, group_size, group_name); w = wait_tensor(ag)
    gathered = w                                                   # gather along dim 0
    gathered = cat([getitem(split(w, shard.shape[0]), i) ...], d)  # along dim d > 0 (funcol's form; DTensor's
                                                                   # sequence dim of [batch, seq, hidden])
    gathered = cat([slice(w, 0, i * n0, (i + 1) * n0) ...], d)     # the same in funcol's backward
    mm(gathered | rows(gathered), W)  /  addmm(bias, ..., W)      # one or more GEMMs: q/k/v, gate/up

``rows(x)`` is any chain of ``view | reshape | _unsafe_view`` that keeps the last dim K: such a chain only merges
or splits the leading dims, so the flattened ``[rows, K]`` rows keep their order. This covers the batch-1 form,
where funcol gathers a ``[1, S/P, H]`` shard along the sequence dim as ``reshape(wait, [1, S, H])`` (chunks of a
batch-1 tensor are consecutive in memory, ``torch._utils._maybe_view_chunk_cat``), then ``reshape(.., [S, H])``.
Every GEMM whose A operand is the gathered rows (flattened to [rows, K]) joins the op (one gather feeding
several GEMMs fuses once); any other use of the gathered tensor or of a view on the way (saved for backward, the
weight gradient's ``permute(x) @ dy``, a norm) reads the op's gathered result (``return_gathered``) through the
same views, so the graph keeps its meaning. A GEMM that reads only a subset of the rows (``x[:, -1:]`` before
``lm_head`` in prefill) is no candidate: ``skip:row_subset``.
The op goes in front of the first user of the gathered tensor; weights defined later than that (a ``permute`` of a
parameter next to its GEMM) are moved up with their pure producers. Decisions: fuse mode "always" fuses every
match; "auto" asks ``cost_model.decide_gather`` for static sizes and defers to each call (plan "auto") for symbolic
ones. Every skip is counted under a ``report.SKIP_REASONS`` slug.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import config

from .fx_forms import gpu_name, known_eq, node_arg, op_name, val
from .gather_match import GatherMatch, match_gather, row_subset_gemm
from .matching import GEMM_OPS
from .report import log, record_deferred, record_fused, record_near_miss, record_skip
from .rewrite import _Builder

aten = torch.ops.aten
FUSED_OP = torch.ops.flashoverlap.all_gather_gemm.default


# ------------------------------------------------------------------------------------------------ check, decide


@dataclass
class GatherFusion:
    match: GatherMatch
    weights: list[Node]
    biases: list[Node | None]
    rows: Any
    k: Any
    ns: list[Any]
    dtype: str
    group_name: str
    group_size: int
    plan: str = "auto"


def check(m: GatherMatch, settings: config.Settings) -> GatherFusion | None:
    """The static conditions; None after recording the first that fails."""
    desc = m.describe()
    if "all_gather" not in settings.collectives:
        return _skip("collective_disabled", "%s: all_gather not in config.collectives %s", desc, settings.collectives)
    if not m.gemms:
        taken = nearest_consumer(m.gathered, accept=lambda n: str(n.target).startswith("flashoverlap."))
        if taken is not None:
            return _skip("gemm_taken", "%s: the GEMM reading the gathered rows is already fused with the collective "
                         "after it (%s)", desc, taken[0].name)
        subset = row_subset_gemm(m)
        if subset is not None:
            return _skip("row_subset", "%s: GEMM %s reads only some of the gathered rows (through %s): nothing of "
                         "its size to overlap", desc, subset[0].name, op_name(subset[1]))
        near = nearest_consumer(m.gathered)
        if near is not None:
            record_near_miss(op_name(near[1]), "%s (all_gather) feeds GEMM %s through %s, which the pass does not "
                             "see through", m.coll.name, near[0].name, op_name(near[1]))
            return None
        return _skip("no_gemm_consumer", "%s: no GEMM reads the gathered rows", desc)
    shard = val(m.shard)
    if m.gather_dim >= shard.dim() - 1:
        return _skip("scatter_dim", "%s: gather dim %d is the K dim", desc, m.gather_dim)
    dtype = str(shard.dtype).removeprefix("torch.")
    if dtype not in settings.dtypes:
        return _skip("dtype", "%s: dtype %s not in config.dtypes %s", desc, dtype, settings.dtypes)
    weights, biases = [], []
    for gemm, _ in m.gemms:
        if gemm.target is aten.addmm.default:
            if node_arg(gemm, 3, "beta", 1) != 1 or node_arg(gemm, 4, "alpha", 1) != 1:
                return _skip("addmm_scale", "%s: %s has beta/alpha != 1", desc, gemm.name)
            bias, w = gemm.args[0], gemm.args[2]
            bv = val(bias)
            if not isinstance(bv, torch.Tensor) or bv.dim() > 2 or (bv.dim() == 2 and not known_eq(bv.shape[0], 1)):
                return _skip("bias_shape", "%s: %s's bias %s varies along the rows", desc, gemm.name,
                             None if bv is None else list(bv.shape))
        elif gemm.target is aten.mm.default:
            bias, w = None, gemm.args[1]
        else:
            return _skip("view_shape", "%s: %s is a batched GEMM", desc, gemm.name)
        mixed = [x.name for x in (w, bias) if isinstance(x, Node) and val(x).dtype != shard.dtype]
        if mixed or not isinstance(w, Node):
            return _skip("dtype_mismatch", "%s: %s differ in dtype from the shard's %s", desc, mixed, dtype)
        weights.append(w)
        biases.append(bias)
    after = _downstream(m.wait) | {m.wait}
    late = [x.name for x in (*weights, *biases) if isinstance(x, Node) and x in after]
    if late:
        return _skip("weight_reads_gathered", "%s: %s computed from the gathered rows", desc, late)
    group_name = m.group_name if isinstance(m.group_name, str) else getattr(m.group_name, "group_name", None)
    if group_name is None or not isinstance(m.group_size, int) or m.group_size < 1:
        return _skip("unknown_group", "%s: group %r (size %s) cannot be resolved", desc, m.group_name, m.group_size)
    rows = math.prod(val(m.gathered).shape[:-1])
    return GatherFusion(m, weights, biases, rows, shard.shape[-1], [val(w).shape[-1] for w in weights], dtype,
                        group_name, m.group_size)


def _downstream(node: Node) -> set[Node]:
    """Every node that depends on ``node`` (its forward closure)."""
    seen: set[Node] = set()
    stack = list(node.users)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.users)
    return seen


def nearest_consumer(gathered: Node, hops: int = 3, accept: Any = None) -> tuple[Node, Node] | None:
    """(the nearest node ``accept`` takes (default: a GEMM) reading ``gathered`` through other ops, the first op on
    the way), within ``hops``."""
    direct = accept is not None  # a GEMM reading it directly is not "through other ops"; a fused op is
    accept = accept or (lambda n: n.target in GEMM_OPS)
    for first in gathered.users:
        if accept(first):
            if direct:
                return first, first
            continue
        frontier = [first]
        for _ in range(hops):
            nxt = []
            for node in frontier:
                for user in node.users:
                    if accept(user):
                        return user, first
                    nxt.append(user)
            frontier = nxt
    return None


def choose_plan(f: GatherFusion, settings: config.Settings) -> str | None:
    """"ring" (static sizes: the cost model's verdict under "auto"), "auto" (symbolic sizes: decided per call), or
    None after recording a skip."""
    desc = f.match.describe()
    sizes = [f.rows, f.k, *f.ns]
    if not all(compat.is_static_int(x) for x in sizes):
        log.info("flashoverlap: %s: symbolic sizes (rows=%s): plan 'auto' (decided per call)", desc, f.rows)
        return "auto"
    rows = int(f.rows)
    if settings.fuse == "always":
        return "ring"
    if rows < settings.min_rows:
        return _skip("too_small", "%s: %d rows < config.min_rows=%d", desc, rows, settings.min_rows)
    try:
        from flashoverlap_inductor import cost_model

        shard = val(f.match.shard)
        d = cost_model.decide_gather(rows, [int(n) for n in f.ns], int(f.k), f.dtype, f.group_size,
                                     device_name=gpu_name(shard), route=_route_of(f, settings, shard),
                                     settings=settings)
    except Exception as exc:  # noqa: BLE001 - a cost-model bug costs this fusion, never the compilation
        return _skip("cost_model_error", "%s: cost model failed: %r", desc, exc, level=logging.WARNING)
    if not d.fuse:
        return _skip("cost_model", "%s: %s", desc, d.reason)
    log.info("flashoverlap: %s: fusing: %s", desc, d.reason)
    return d.plan


def _route_of(f: GatherFusion, settings: config.Settings, shard: torch.Tensor) -> str:
    """"peer" when the route registry would run the call on the copy-engine route, else "nccl"."""
    if shard.device.type != "cuda":
        return "nccl"
    from flashoverlap_inductor import routes

    call = routes.Call("all_gather", int(f.rows), sum(int(n) for n in f.ns), int(f.k), shard.dtype, f.group_size,
                       device="cuda", plan="ring", compile_time=True)
    return "peer" if routes.select(call, settings).name == "gather_peer" else "nccl"


def _skip(slug: str, msg: str, *args: Any, level: int = logging.INFO) -> None:
    record_skip(slug, msg, *args, level=level)
    return None


# ------------------------------------------------------------------------------------------------ rewrite


def replace(graph: torch.fx.Graph, f: GatherFusion, settings_key: str) -> bool:
    """Rewrite ``f`` in ``graph``; False (after recording a skip) if the inputs cannot be placed before the first
    use of the gathered tensor."""
    m = f.match
    gemm_nodes = {g for g, _ in m.gemms}
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min((u for u in m.gathered.users), key=order.__getitem__)
    if not _place_before(anchor, [m.shard, *f.weights, *(b for b in f.biases if b is not None)], order, m):
        return bool(_skip("inputs_after_use", "%s: a weight is computed after the gathered rows are first used",
                          m.describe()))
    need_gathered = _needs_gathered(m, gemm_nodes)
    build = _Builder(graph, m.gemms[0][0])
    with graph.inserting_before(anchor):
        op = build.call(FUSED_OP, (m.shard, list(f.weights), list(f.biases), m.gather_dim, f.group_size,
                                   f.group_name, f.plan, need_gathered, settings_key))
        outs = [build.call(operator.getitem, (op, i)) for i in range(len(f.weights) + need_gathered)]
    for (gemm, _), y in zip(m.gemms, outs, strict=False):
        want, got = val(gemm).shape, val(y).shape
        if len(want) != len(got) or not all(known_eq(p, q) for p, q in zip(got, want, strict=True)):
            build.rollback()
            return bool(_skip("shape_mismatch", "%s: %s's result %s != %s", m.describe(), gemm.name, list(got),
                              list(want), level=logging.WARNING))
    for (gemm, _), y in zip(m.gemms, outs, strict=False):
        gemm.replace_all_uses_with(y)
    for gemm in gemm_nodes:
        graph.erase_node(gemm)
    for v in reversed(m.row_views):  # consumers first: a chain's views become dead one after the other
        if not v.users:
            graph.erase_node(v)
    if need_gathered:
        m.gathered.replace_all_uses_with(outs[-1])
    for node in reversed([m.coll, m.wait, *m.form]):
        graph.erase_node(node)
    return True


def _needs_gathered(m: GatherMatch, fused: set[Node]) -> bool:
    """Whether anything but the fused GEMMs reads the gathered tensor, directly or through ``m.row_views``."""
    views = set(m.row_views)
    live: set[Node] = set()
    for v in reversed(m.row_views):
        if any(u not in fused and (u not in views or u in live) for u in v.users):
            live.add(v)
    return any(u not in fused and (u not in views or u in live) for u in m.gathered.users)


def _place_before(anchor: Node, inputs: list[Node], order: dict[Node, int], m: GatherMatch) -> bool:
    """Make every node of ``inputs`` precede ``anchor``: those after it are moved up with their producers after
    it, which must be pure (no collective, no side effect, nothing of the gather itself)."""
    at = order[anchor]
    late: set[Node] = set()
    stack = [x for x in inputs if isinstance(x, Node) and order[x] >= at]
    while stack:
        node = stack.pop()
        if node in late:
            continue
        if node.op != "call_function" or node.is_impure() or node in (m.coll, m.wait, *m.form) or \
                getattr(node.target, "namespace", None) in ("_c10d_functional", "c10d", "flashoverlap"):
            return False  # never move a collective (or one of our ops) across others
        late.add(node)
        stack += [x for x in node.all_input_nodes if order[x] >= at]
    for node in sorted(late, key=order.__getitem__):
        anchor.prepend(node)
    return True


def fuse_gathers(graph: torch.fx.Graph, settings: config.Settings) -> int:
    """Match, check, decide and rewrite every all_gather of ``graph``; returns how many were fused."""
    fused = 0
    for coll in list(graph.find_nodes(op="call_function", target=compat.c10d.all_gather_into_tensor.default)):
        if getattr(coll, "_erased", False):  # erased by an earlier rewrite
            continue
        m = match_gather(coll)  # matched now: an earlier rewrite may have changed what it reads or feeds
        if m is None:
            continue
        try:
            f = check(m, settings)
            plan = choose_plan(f, settings) if f is not None else None
        except Exception as exc:  # noqa: BLE001 - a bug here must cost a fusion, never the compilation
            record_skip("internal_error", "%s: %r", m.describe(), exc, level=logging.WARNING, exc_info=True)
            continue
        if f is None or plan is None:
            continue
        f.plan = plan
        if replace(graph, f, settings.key()):
            fused += 1
            record = record_deferred if plan == "auto" else record_fused
            record("all_gather", "%s (rows=%s k=%s n=%s %s, group %r x%d, plan %s)", m.describe(), f.rows, f.k,
                   f.ns, f.dtype, f.group_name, f.group_size, plan)
    return fused
