"""A sum of GEMMs that share their rows, feeding a collective, as one GEMM over the concatenated K.

In backward, the input gradient of a block whose projections are separate Linears (q/k/v; gate/up) is
``g_q @ Wq + g_k @ Wk + g_v @ Wv``, an add tree of ``mm`` nodes, and goes into all_reduce (tensor parallel) or
reduce_scatter (sequence parallel). It equals ``cat([g_q, g_k, g_v], 1) @ cat([Wq, Wk, Wv], 0)``: one GEMM, which
the pass can then fuse with the collective like any other.

``matching.find_sum(wait)`` recognizes the form behind a collective's wait (through the same views the main match
accepts);
``stage(form, graph)`` inserts the two cats and the GEMM and points the chain at it, so the ordinary match,
checks and cost model see one ``mm``; ``unstage(form, graph)`` puts the graph back exactly (a declined fusion leaves no
trace); ``erase_terms(form, graph)`` removes the old add tree once the fused op replaced the chain.

Under the experiment ``scatter_pull``, a sum feeding a reduce_scatter over 2 ranks is staged for the pull route
instead where its cost model (``cost_model.pull.sum_verdict``) says it pays (``stage_pull``): the first terms unfused
(``mm``, then ``addmm`` onto the partial sum: no copies), the last as ``addmm(partial, a_t, b_t)``, which the match
sees as one GEMM with a bias of the output's shape; the pull route takes that bias (``routes/scatter_pull.py``).

Cost (``adjust``): the cats copy ``2 * (M*K + K*N)`` elements (read + write) that the sum did not, and the sum
read and wrote ``3 * (terms - 1) * M * N`` elements for its adds that the single GEMM does not; both at the GPU's
copy rate (``cost_model.copy_ms``). Invariants: every term is a 2-D ``mm`` with one user, every add an
``add.Tensor`` (alpha 1) with one user, all terms share ``[M, N]`` and dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor import _inductor_compat as compat

from .fx_forms import node_arg, val
from .matching import COLLECTIVE_OPS, SumOfGemms
from .rewrite import _Builder

aten = torch.ops.aten


def stage(form: SumOfGemms, graph: torch.fx.Graph) -> Node:
    """Insert ``mm(cat(a_i, 1), cat(b_i, 0))`` (viewed as the root, when the terms were viewed) before the root and
    make the root's users read it."""
    build = _Builder(graph, form.terms[0])
    with graph.inserting_before(form.root):
        cat_a = build.call(aten.cat.default, ([t.args[0] for t in form.terms], 1))
        cat_b = build.call(aten.cat.default, ([t.args[1] for t in form.terms], 0))
        out = mm = build.call(aten.mm.default, (cat_a, cat_b))
        form.staged = [cat_a, cat_b, mm]
        view = next((v for v in form.term_views if v is not None), None)
        if view is not None:  # the terms' own view arguments (defined before the root) give the root's shape
            out = build.call(view.target, (mm, *view.args[1:]))
            form.staged.append(out)
    form.root.replace_all_uses_with(out)
    return mm


def pull_applies(form: SumOfGemms, wait: Node, settings: Any) -> tuple[int, int, list[int], str] | None:
    """``(m, n, ks, dtype)`` of a sum the pull route could take (the experiment on, a reduce_scatter over 2 ranks,
    ``transport="peer"``, bf16 / fp16 / fp32, static sizes), else None. (On CPU tensors the CPU route runs the staged
    op, whose bias of the output's shape it takes too.)"""
    coll = wait.args[0]
    if "scatter_pull" not in settings.experiments or COLLECTIVE_OPS.get(coll.target) != "reduce_scatter":
        return None
    if node_arg(coll, 2, "group_size", None) != 2 or settings.transport != "peer":
        return None
    y = val(form.terms[0])
    if y.dtype not in (torch.bfloat16, torch.float16, torch.float32):  # the pull route's (routes/scatter_pull.py)
        return None
    sizes = [*y.shape, *form.k_sizes()]
    if not all(compat.is_static_int(x) for x in sizes):
        return None
    return int(y.shape[0]), int(y.shape[1]), [int(k) for k in form.k_sizes()], str(y.dtype).removeprefix("torch.")


def stage_pull(form: SumOfGemms, graph: torch.fx.Graph) -> Node:
    """Insert ``p = mm(a_1, b_1)``, ``p = addmm(p, a_i, b_i)`` for the middle terms and ``addmm(p, a_t, b_t)`` (viewed
    as the root, when the terms were viewed) before the root, and make the root's users read it; returns the last
    ``addmm`` (the GEMM the match sees, its bias the partial sum)."""
    build = _Builder(graph, form.terms[0])
    with graph.inserting_before(form.root):
        staged = [build.call(aten.mm.default, tuple(form.terms[0].args[:2]))]
        for t in form.terms[1:]:
            staged.append(build.call(aten.addmm.default, (staged[-1], *t.args[:2])))
        out = gemm = staged[-1]
        view = next((v for v in form.term_views if v is not None), None)
        if view is not None:
            out = build.call(view.target, (gemm, *view.args[1:]))
            staged.append(out)
    form.staged, form.pull = staged, True
    form.root.replace_all_uses_with(out)
    return gemm


def unstage(form: SumOfGemms, graph: torch.fx.Graph) -> None:
    """Undo ``stage`` (the chain still ends in the staged nodes: nothing fused them)."""
    assert form.staged is not None
    form.staged[-1].replace_all_uses_with(form.root)
    for node in reversed(form.staged):
        graph.erase_node(node)
    form.staged, form.pull = None, False


def erase_terms(form: SumOfGemms, graph: torch.fx.Graph) -> None:
    """After the fused op replaced the chain: remove the old adds, views and terms (now unused)."""
    for node in [*form.adds, *(v for v in reversed(form.term_views) if v is not None), *reversed(form.terms)]:
        graph.erase_node(node)


def adjust(decision: Any, s: SumOfGemms, dtype: str, device_name: str | None, min_gain: float) -> tuple[bool, str]:
    """The "auto" verdict for a staged sum: ``decision`` (the cost model's, for the one GEMM over the concatenated
    K) with the cats' copies added to the fused time and the adds' traffic to the sequential time (ms); the gain
    needed is the decision's (``min_gain`` plus its ``error_allowance``)."""
    from flashoverlap_inductor import cost_model

    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    cat_elems, add_elems = s.copy_elements()
    fused = decision.predicted_fused_ms + cost_model.copy_ms(int(cat_elems) * itemsize, device_name)
    seq = decision.predicted_seq_ms + cost_model.copy_ms(int(add_elems) * itemsize, device_name)
    verdict = cost_model.gain.pays(fused, seq, min(min_gain + getattr(decision, "error_allowance", 0.0), 0.99))
    return verdict, (f"{s.describe()}: fused {fused:.4f} ms incl. the cats' copies vs sequential {seq:.4f} ms "
                     f"incl. the adds ({'fusing' if verdict else 'declined'}); {decision.reason}")
