"""The MoE combine sub-pass: experts' GEMM -> un-permutation -> all_to_all becomes one
``flashoverlap::gemm_unpermute_all_to_all`` (``ops``; run by ``routes/combine.py``).

Flow per candidate (each ``wait_tensor`` of an ``all_to_all_single`` whose input is an ``index_put``):

    find    (``combine_match.match_combine``)  the structure: GEMM(s) -> [cat | add] -> index_put -> all_to_all
    check   (``check``)   users, GEMM form, buffer, index, dtypes, sizes, group; every skip under a
                          ``report.SKIP_REASONS`` slug (``combine_*`` and the shared ones)
    decide  (``moe_pass.decide``)  the fuse mode
    fuse    (``fuse_combines``, ``moe_pass.fuse_each``)  emit the op before the all_to_all; the match hands its users
                                                       over and erases itself

Rank agreement. A rank never fuses where another does not: every condition above reads only the graph's structure,
dtypes, the weights' sizes (N, K, experts) and the settings, which every rank shares (the split sizes, which are per
rank, are never read); then ``always`` fuses every match and ``auto`` takes the group's verdict for the op, agreed
through the group's store (``moe_pass.decide``, ``moe_verdict``; declined: ``skip:combine_auto``). The graphs' manifests
(``passes/manifest.py``) list the op with its rows "per rank".

Invariants of a rewrite: the wait's users see a tensor of the wait's shape and dtype; every size query of a removed
node reads an equal size of a node that stays; no raw SymInt enters a node argument.
"""

from __future__ import annotations

import logging

import torch
from torch.fx import Node

from flashoverlap_inductor import config

from .combine_match import SIZE_OP, CombineMatch, match_combine
from .fx_forms import known_eq, node_arg, val
from .moe_pass import MoeProblem, fuse_each, group_of, grouped_gemm_problem, problem_of, skip
from .report import record_fused
from .rewrite import _Builder

aten = torch.ops.aten
FUSED_OP = torch.ops.flashoverlap.gemm_unpermute_all_to_all.default


def check(m: CombineMatch, settings: config.Settings) -> str | None:
    """The static conditions (module docstring); returns the group name, or None after recording the first that
    fails."""
    desc = m.describe()
    if "all_to_all" not in settings.collectives:
        return skip("collective_disabled", "%s: all_to_all not in config.collectives %s", desc, settings.collectives)
    for node, allowed in m.steps():
        extra = [u.name for u in node.users if u not in allowed and u.target is not SIZE_OP]
        if extra or not any(u in allowed for u in node.users):
            return skip("multiple_users", "%s: %s has users %s", desc, node.name, [u.name for u in node.users])
    if not m.wait.users:
        return skip("unused_result", "%s: the all_to_all's result is unused", desc)
    nodes = [*m.gemms, m.values, m.base, m.wait, *(x for g in m.gemms for x in g.all_input_nodes)]
    if any(not isinstance(val(x), (torch.Tensor, torch.SymInt, int)) for x in nodes):
        return skip("no_meta", "%s: missing meta['val']", desc)
    why = _gemm_problem(m)
    if why:
        return skip("combine_gemm", "%s: %s", desc, why)
    why = _buffer_problem(m)
    if why:
        return skip("combine_base", "%s: %s", desc, why)
    index = m.index
    iv = val(index) if isinstance(index, Node) else None
    if not isinstance(iv, torch.Tensor) or iv.dim() != 1 or iv.dtype not in (torch.int64, torch.int32) or \
            not isinstance(m.accumulate, bool):
        return skip("combine_index", "%s: indices %s are not one 1-D integer index along dim 0", desc,
                     m.index_put.args[1])
    y = val(m.values)
    dtype = str(y.dtype).removeprefix("torch.")
    if dtype not in settings.dtypes:
        return skip("dtype", "%s: dtype %s not in config.dtypes %s", desc, dtype, settings.dtypes)
    operands = [x for g in m.gemms for x in g.args[:2]] + [m.base, m.wait]
    mixed = [x.name for x in operands if val(x).dtype != y.dtype]
    if mixed:
        return skip("dtype_mismatch", "%s: %s differ in dtype from the GEMM's %s output", desc, mixed, dtype)
    n = y.shape[-1]
    shapes_ok = y.dim() == 2 and val(m.base).dim() == 2 and known_eq(val(m.base).shape[1], n)
    shapes_ok = shapes_ok and all(known_eq(val(g.args[1]).shape[-1], n) for g in m.gemms)
    if not shapes_ok:
        return skip("view_shape", "%s: the GEMM output %s and the buffer %s are not [rows, N] alike", desc,
                     list(y.shape), list(val(m.base).shape))
    return group_of(m.args, desc)


def _gemm_problem(m: CombineMatch) -> str:
    """Why the GEMM form is not one the op runs ("" when it is)."""
    if m.form == "loop":
        if m.cat is not None and node_arg(m.cat, 1, "dim", 0) not in (0, -2):
            return f"the experts' outputs are concatenated along dim {node_arg(m.cat, 1, 'dim', 0)}, not the rows"
        bad = [g.name for g in m.gemms if g.target is not aten.mm.default]
        return f"{bad} are not plain mm (bias or batched GEMMs)" if bad else ""
    return grouped_gemm_problem(m.gemms)


def _buffer_problem(m: CombineMatch) -> str:
    """Why the un-permutation's buffer is not a fresh ``empty`` or zero-filled ``[rows, N]`` tensor ("" when it is)."""
    base = m.base
    if base.target not in (aten.empty.memory_format, aten.full.default, aten.zeros.default):
        return f"it writes into {base.name} ({base.target}), not a fresh empty or zero buffer"
    if base.target is aten.full.default and node_arg(base, 1, "fill_value") not in (0, 0.0, False):
        return f"the buffer is filled with {node_arg(base, 1, 'fill_value')!r}, not 0"
    if not isinstance(base.args[0], (list, tuple)) or len(base.args[0]) != 2:
        return f"the buffer's shape {base.args[0]} is not [rows, N]"
    return ""


def fuse_combines(graph: torch.fx.Graph, settings: config.Settings) -> int:
    """Find, check, decide and rewrite every combine of ``graph``; returns how many were fused."""
    return fuse_each(graph, settings, match_combine, check, "combine", _fuse, _problem)


def _problem(m: CombineMatch) -> MoeProblem:
    """What the cost model is asked under ``auto``: the rows received back (this rank's token rows), each term's
    (K, N)."""
    return problem_of(m.wait, [g.args[1] for g in m.gemms], m.form == "loop", val(m.values).dtype,
                      len(m.args["input_split_sizes"]))


def _fuse(m: CombineMatch, group: str, plan: str, settings_key: str) -> bool:
    y, desc, ks = val(m.values), m.describe(), [val(g.args[1]).shape[-2] for g in m.gemms]
    if not _rewrite(m, group, plan, settings_key):
        return False
    record_fused("all_to_all_combine", "%s (%s, %d GEMM(s), n=%s k=%s %s, accumulate=%s, group %r x%d, plan %s)",
                 desc, m.form, len(m.gemms), y.shape[-1], ks, str(y.dtype).removeprefix("torch."), m.accumulate,
                 group, len(m.args["input_split_sizes"]), plan)
    return True


def _rewrite(m: CombineMatch, group: str, plan: str, settings_key: str) -> bool:
    """Emit the op before the all_to_all and let the match hand over and erase; False (after recording a skip) if
    the op's result would not have the wait's shape and dtype."""
    graph = m.wait.graph
    build = _Builder(graph, m.gemms[0])
    if m.form == "loop":
        a, b, offs = [g.args[0] for g in m.gemms], [g.args[1] for g in m.gemms], None
    else:
        a, b, offs = [g.args[0] for g in m.gemms], [g.args[1] for g in m.gemms], node_arg(m.gemms[0], 2, "offs")
    args = (a, b, offs, m.index, bool(m.accumulate), list(m.args["output_split_sizes"]),
            list(m.args["input_split_sizes"]), group, plan, settings_key)
    try:
        with graph.inserting_before(m.coll):
            out = build.call(FUSED_OP, args)
        want, got = val(m.wait), val(out)
        if want.dtype != got.dtype or want.dim() != got.dim() or \
                not all(known_eq(x, y) for x, y in zip(want.shape, got.shape, strict=True)):
            raise ValueError(f"result {got.dtype}{list(got.shape)} != the all_to_all's {want.dtype}{list(want.shape)}")
    except Exception as exc:  # noqa: BLE001
        build.rollback()
        return bool(skip("shape_mismatch", "%s: %s", m.describe(), exc, level=logging.WARNING))
    m.replace_with(out, build)
    return True

