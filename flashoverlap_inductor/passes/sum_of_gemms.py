"""A sum of GEMMs that share their rows, feeding a collective, as one GEMM over the concatenated K.

In backward, the input gradient of a block whose projections are separate Linears (q/k/v; gate/up) is
``g_q @ Wq + g_k @ Wk + g_v @ Wv``, an add tree of ``mm`` nodes, and goes into all_reduce (tensor parallel) or
reduce_scatter (sequence parallel). It equals ``cat([g_q, g_k, g_v], 1) @ cat([Wq, Wk, Wv], 0)``: one GEMM, which
the pass can then fuse with the collective like any other.

``find(wait)`` recognizes the form behind a collective's wait (through the same views the main match accepts);
``SumOfGemms.stage(graph)`` inserts the two cats and the GEMM and points the chain at it, so the ordinary match,
checks and cost model see one ``mm``; ``unstage()`` puts the graph back exactly (a declined fusion leaves no
trace); ``erase_terms()`` removes the old add tree once the fused op replaced the chain.

Cost (``adjust``): the cats copy ``2 * (M*K + K*N)`` elements (read + write) that the sum did not, and the sum
read and wrote ``3 * (terms - 1) * M * N`` elements for its adds that the single GEMM does not; both at the GPU's
copy rate (``cost_model.copy_ms``). Invariants: every term is a 2-D ``mm`` with one user, every add an
``add.Tensor`` (alpha 1) with one user, all terms share ``[M, N]`` and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from .matching import VIEW_OPS, known_eq, node_arg, val

aten = torch.ops.aten


@dataclass
class SumOfGemms:
    """The add tree ``root`` (its adds, then its ``terms``, in graph order) and the node consuming it."""

    root: Node
    adds: list[Node]
    terms: list[Node]
    consumer: Node
    staged: list[Node] | None = None  # cat(a), cat(b), mm, once staged

    @property
    def gemm(self) -> Node:
        assert self.staged is not None
        return self.staged[-1]

    def k_sizes(self) -> list[Any]:
        return [val(t.args[0]).shape[1] for t in self.terms]

    def describe(self) -> str:
        return f"sum of {len(self.terms)} mm over K = {' + '.join(str(k) for k in self.k_sizes())}"

    def copy_elements(self) -> tuple[Any, Any]:
        """(elements the cats move, elements the adds moved), each counted read + write."""
        m, n = val(self.root).shape
        k = sum(self.k_sizes())
        return 2 * (m * k + k * n), 3 * (len(self.terms) - 1) * m * n

    def stage(self, graph: torch.fx.Graph) -> Node:
        """Insert ``mm(cat(a_i, 1), cat(b_i, 0))`` before the root and make the consumer read it."""
        from .rewrite import _Builder

        build = _Builder(graph, self.terms[0])
        with graph.inserting_before(self.root):
            cat_a = build.call(aten.cat.default, ([t.args[0] for t in self.terms], 1))
            cat_b = build.call(aten.cat.default, ([t.args[1] for t in self.terms], 0))
            mm = build.call(aten.mm.default, (cat_a, cat_b))
        self.consumer.replace_input_with(self.root, mm)
        self.staged = [cat_a, cat_b, mm]
        return mm

    def unstage(self, graph: torch.fx.Graph) -> None:
        """Undo ``stage`` (the chain still ends in the staged ``mm``: nothing fused it)."""
        assert self.staged is not None
        cat_a, cat_b, mm = self.staged
        self.consumer.replace_input_with(mm, self.root)
        for node in (mm, cat_b, cat_a):
            graph.erase_node(node)
        self.staged = None

    def erase_terms(self, graph: torch.fx.Graph) -> None:
        """After the fused op replaced the chain: remove the old adds and terms (now unused)."""
        for node in [*self.adds, *reversed(self.terms)]:
            graph.erase_node(node)


def find(wait: Node, coll_ops: Any) -> SumOfGemms | None:
    """The sum-of-GEMMs form behind ``wait``'s collective (one of ``coll_ops``), or None."""
    coll = wait.args[0] if wait.args else None
    if not isinstance(coll, Node) or coll.target not in coll_ops:
        return None
    consumer, x = coll, coll.args[0]
    while isinstance(x, Node) and x.target in VIEW_OPS and len(x.users) == 1:
        consumer, x = x, x.args[0]
    if not (isinstance(x, Node) and _is_plain_add(x) and len(x.users) == 1):
        return None
    adds, terms = [], []
    if not _collect(x, adds, terms) or len(terms) < 2:
        return None
    y = val(x)
    shapes_ok = all(isinstance(val(t), torch.Tensor) and val(t).dim() == 2 and val(t).dtype == y.dtype and
                    known_eq(val(t).shape[0], y.shape[0]) and known_eq(val(t).shape[1], y.shape[1]) for t in terms)
    if not shapes_ok or y.dim() != 2:
        return None
    return SumOfGemms(x, adds, terms, consumer)


def _is_plain_add(node: Node) -> bool:
    return (node.target is aten.add.Tensor and len(node.args) >= 2 and node_arg(node, 2, "alpha", 1) == 1
            and all(isinstance(a, Node) for a in node.args[:2]))


def _collect(node: Node, adds: list[Node], terms: list[Node]) -> bool:
    """Walk the add tree under ``node`` (root first): True iff every leaf is a one-user 2-D ``mm``."""
    if node.target is aten.mm.default:
        terms.append(node)
        return len(node.users) == 1
    if not _is_plain_add(node):
        return False
    adds.append(node)
    return all(len(arg.users) == 1 and _collect(arg, adds, terms) for arg in node.args[:2])


def adjust(decision: Any, s: SumOfGemms, dtype: str, device_name: str | None, min_gain: float) -> tuple[bool, str]:
    """The "auto" verdict for a staged sum: ``decision`` (the cost model's, for the one GEMM over the concatenated
    K) with the cats' copies added to the fused time and the adds' traffic to the sequential time (ms)."""
    from flashoverlap_inductor import cost_model

    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    cat_elems, add_elems = s.copy_elements()
    fused = decision.predicted_fused_ms + cost_model.copy_ms(int(cat_elems) * itemsize, device_name)
    seq = decision.predicted_seq_ms + cost_model.copy_ms(int(add_elems) * itemsize, device_name)
    verdict = fused <= (1.0 - min_gain) * seq
    return verdict, (f"{s.describe()}: fused {fused:.4f} ms incl. the cats' copies vs sequential {seq:.4f} ms "
                     f"incl. the adds ({'fusing' if verdict else 'declined'}); {decision.reason}")
