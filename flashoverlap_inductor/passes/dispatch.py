"""The MoE dispatch sub-pass: all_to_all -> permutation by expert -> the experts' first GEMM(s) becomes one
``flashoverlap::all_to_all_permute_gemm`` (``ops``; run by ``routes/moe_dispatch.py``). The mirror of ``combine.py``.

Flow per candidate (each ``wait_tensor`` of an ``all_to_all_single`` whose one user is an ``index`` of it):

    find    (``dispatch_match.match_dispatch``)  all_to_all -> index -> [expand] -> [split | slices] -> GEMM(s)
    check   (``check``)   users, the structure's problem, GEMM form, index, dtypes, sizes, group; every skip under a
                          ``report.SKIP_REASONS`` slug (``dispatch_*`` and the shared ones)
    decide  (``moe_pass.decide``)  the fuse mode
    fuse    (``fuse_dispatches``)  emit the op before the first use of the permuted rows (moving late weights up);
                                   the match hands its users over and erases itself

Rank agreement. As for the combine: every condition reads only the graph's structure, dtypes, the weights' sizes and
the settings (never the per-rank rows, split sizes or expert sizes); then ``always`` fuses every match and ``auto``
takes the group's verdict for the op, agreed through the group's store (``moe_pass.decide``, ``moe_verdict``;
declined: ``skip:dispatch_auto``).

Invariants of a rewrite: the permuted rows' users and each GEMM's users see tensors of the same shape and dtype (the
op's results, checked); every size query of a removed node reads an equal size of a node that stays; no raw SymInt
enters a node argument; the op's inputs all precede it (late weights move up with their pure producers).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import Node

from flashoverlap_inductor import config
from flashoverlap_inductor.schedule.combine import NO_ROWS

from .dispatch_match import SIZE_OP, DispatchMatch, match_dispatch
from .fx_forms import known_eq, node_arg, val
from .moe_pass import MoeProblem, fuse_each, group_of, grouped_gemm_problem, problem_of, skip
from .report import record_fused
from .rewrite import _Builder

aten = torch.ops.aten
FUSED_OP = torch.ops.flashoverlap.all_to_all_permute_gemm.default


def check(m: DispatchMatch, settings: config.Settings) -> str | None:
    """The static conditions (module docstring); returns the group name, or None after recording the first that
    fails."""
    desc = m.describe()
    if "all_to_all" not in settings.collectives:
        return skip("collective_disabled", "%s: all_to_all not in config.collectives %s", desc, settings.collectives)
    if [u for u in m.coll.users if u is not m.wait and u.target is not SIZE_OP]:
        return skip("multiple_users", "%s: %s has users %s", desc, m.coll.name, [u.name for u in m.coll.users])
    nodes = [m.coll, m.wait, m.permuted, *m.gemms, *(x for g in m.gemms for x in g.all_input_nodes)]
    if any(not isinstance(val(x), (torch.Tensor, torch.SymInt, int)) for x in nodes):
        return skip("no_meta", "%s: missing meta['val']", desc)
    if m.problem:
        return skip(m.slug, "%s: %s", desc, m.problem)
    why = _gemm_problem(m)
    if why:
        return skip("dispatch_gemm", "%s: %s", desc, why)
    perm, indices = m.perm, m.permuted.args[1]
    pv = val(perm) if isinstance(perm, Node) else None
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(pv, torch.Tensor) or \
            pv.dim() != 1 or pv.dtype not in (torch.int64, torch.int32):
        return skip("dispatch_index", "%s: indices %s are not one 1-D integer index along dim 0", desc, indices)
    x = val(m.coll.args[0])
    dtype = str(x.dtype).removeprefix("torch.")
    if dtype not in settings.dtypes:
        return skip("dtype", "%s: dtype %s not in config.dtypes %s", desc, dtype, settings.dtypes)
    mixed = [g.name for g in m.gemms if val(g).dtype != x.dtype or val(g.args[1]).dtype != x.dtype]
    if mixed:
        return skip("dtype_mismatch", "%s: %s differ in dtype from the rows' %s", desc, mixed, dtype)
    if x.dim() != 2 or not all(known_eq(val(g.args[1]).shape[-2], x.shape[1]) for g in m.gemms):
        return skip("view_shape", "%s: the rows %s are not [rows, K] for the GEMMs' K", desc, list(x.shape))
    return group_of(m.args, desc)


def _gemm_problem(m: DispatchMatch) -> str:
    """Why the GEMM form is not one the op runs ("" when it is)."""
    if m.form == "loop":
        bad = [g.name for g in m.gemms if g.target is not aten.mm.default]
        return f"{bad} are not plain mm (bias or batched GEMMs)" if bad else ""
    return grouped_gemm_problem(m.gemms)


def fuse_dispatches(graph: torch.fx.Graph, settings: config.Settings) -> int:
    """Find, check, decide and rewrite every dispatch of ``graph``; returns how many were fused."""
    return fuse_each(graph, settings, match_dispatch, check, "dispatch", _fuse, _problem)


def _problem(m: DispatchMatch) -> MoeProblem:
    """What the cost model is asked under ``auto``: the rows sent (this rank's token rows), each weight's (K, N)."""
    x = m.coll.args[0]
    return problem_of(x, [g.args[1] for g in m.gemms], m.form == "loop", val(x).dtype,
                      len(m.args["input_split_sizes"]))


def _fuse(m: DispatchMatch, group: str, plan: str, settings_key: str) -> bool:
    x, desc = val(m.coll.args[0]), m.describe()
    ns = [val(g.args[1]).shape[-1] for g in m.gemms]
    if not _rewrite(m, group, plan, settings_key):
        return False
    record_fused("all_to_all_dispatch", "%s (%s, %d GEMM(s), k=%s n=%s %s, group %r x%d, plan %s)", desc, m.form,
                 len(m.gemms), x.shape[-1], ns, str(x.dtype).removeprefix("torch."), group,
                 len(m.args["input_split_sizes"]), plan)
    return True


def _rewrite(m: DispatchMatch, group: str, plan: str, settings_key: str) -> bool:
    """Emit the op before the first use of the permuted rows and let the match hand over and erase; False (after
    recording a skip) if an input cannot be placed there or a result would not have its node's shape and dtype."""
    graph = m.wait.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min(m.permuted.users, key=order.__getitem__)
    b = [g.args[1] for g in m.gemms]
    offs = node_arg(m.gemms[0], 2, "offs") if m.form == "grouped" else None
    size_args = [a for pc in m.pieces for a in pc.args[2:4]] if m.split is None else list(m.split.args[1])
    inputs = [*b, offs, *size_args, m.coll.args[0], m.perm, *m.args["output_split_sizes"],
              *m.args["input_split_sizes"]]
    if not _place_before(anchor, [x for x in inputs if isinstance(x, Node)], order, m):
        return bool(skip("inputs_after_use", "%s: a weight is computed after the permuted rows are first used "
                          "by ops that cannot move", m.describe()))
    keep = rows_read_elsewhere(m)
    build = _Builder(graph, m.gemms[0])
    try:
        with graph.inserting_before(anchor):
            args = (m.coll.args[0], m.perm, b, m.sizes(build), offs, list(m.args["output_split_sizes"]),
                    list(m.args["input_split_sizes"]), group, plan if keep else plan + NO_ROWS, settings_key)
            op = build.call(FUSED_OP, args)
            outs = [build.call(operator.getitem, (op, i)) for i in range(1 + len(m.gemms))]
        for want, got in zip([m.permuted, *m.gemms][0 if keep else 1:], outs[0 if keep else 1:], strict=True):
            w, g = val(want), val(got)
            if w.dtype != g.dtype or w.dim() != g.dim() or \
                    not all(known_eq(p, q) for p, q in zip(w.shape, g.shape, strict=True)):
                raise ValueError(f"{want.name}: result {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}")
    except Exception as exc:  # noqa: BLE001
        build.rollback()
        return bool(skip("shape_mismatch", "%s: %s", m.describe(), exc, level=logging.WARNING))
    with graph.inserting_before(anchor):
        m.replace_with(outs, build)
    if not keep:  # the row views that fed the GEMMs are dead now, and with them the op's empty p
        dead = {*m.rows, *m.pieces, m.split, outs[0]}
        for node in reversed([n for n in graph.nodes if n in dead]):
            if not node.users:
                graph.erase_node(node)
    return True


def rows_read_elsewhere(m: DispatchMatch) -> bool:
    """Whether anything but the match's GEMMs reads the permuted rows ``p`` (through its no-op views and the pieces
    cut for the GEMMs): a training graph's saved ``p``, another op. Where nothing does (an inference graph), the op
    is told not to return ``p`` (the plan suffix ``NO_ROWS``: ``ops``)."""
    ours = {*m.gemms, *m.rows, *m.pieces, *([m.split] if m.split is not None else [])}
    return any(u not in ours for src in ours - set(m.gemms) for u in src.users)


def _place_before(anchor: Node, inputs: list[Node], order: dict[Node, int], m: DispatchMatch) -> bool:
    """Make every node of ``inputs`` precede ``anchor``: those after it move up with their producers after it, which
    must be pure (no collective, no side effect, nothing of the match)."""
    at = order[anchor]
    late: set[Node] = set()
    stack = [x for x in inputs if order[x] >= at]
    while stack:
        node = stack.pop()
        if node in late:
            continue
        if node.op != "call_function" or node.is_impure() or node in (*m.chain(), *m.rows, *m.pieces) or \
                getattr(node.target, "namespace", None) in ("_c10d_functional", "c10d", "flashoverlap"):
            return False
        late.add(node)
        stack += [x for x in node.all_input_nodes if order[x] >= at]
    for node in sorted(late, key=order.__getitem__):
        anchor.prepend(node)
    return True
