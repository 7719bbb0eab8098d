"""Structure of an MoE combine in a post-grad graph: the experts' GEMM, the un-permutation, then an all_to_all.

Recognized (torch 2.13 post-grad graphs of the e2e harness's expert-parallel block ``bench/moe.py``, loop and grouped,
and of torchtitan's ``AllToAllTokenDispatcher`` + ``GroupedExperts``; forward and backward)::

    y = cat([mm(a_0, b_0), ..., mm(a_{E-1}, b_{E-1})])  # per-expert loop (forward: the down projection; backward:
      | mm(a, b)                                          #   the input gradient of gate_up), one expert
      | _grouped_mm(a, b, offs)                           # torch._grouped_mm, b [E, K, N], int32 cumulative offsets
      | add(_grouped_mm(a1, b1, offs), _grouped_mm(a3, b3, offs))   # torchtitan's backward: w1's and w3's input
                                                                    #   gradients, a tree of adds, one offs node
    buf = empty.memory_format([R, N]) | full([R, N], 0)  # ``new_empty`` (forward); the zeros of the backward
    send = index_put(buf, [perm], y[, accumulate])       # the un-permutation: ``index_copy`` / ``x[perm] = y``
    out = wait_tensor(all_to_all_single(send, output_split_sizes, input_split_sizes, group))

``match_combine(wait)`` recognizes the structure only (which nodes, which arguments): a ``CombineMatch`` when the
all_to_all's input is an ``index_put`` whose values come straight from GEMM nodes as above (maybe with unsupported
details, e.g. an ``addmm`` piece, which ``passes/combine.py`` declines with a skip reason), else None. Whether it may be
fused (users, dtypes, sizes, fuse mode) is ``passes/combine.py``'s to decide. The match owns its rewrite:
``replace_with(out)`` hands the wait's users, and the size queries of every node it removes, to the fused op's
result, then erases the chain.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor._inductor_compat import c10d, is_static_int

from .fx_forms import node_arg, op_name, val

aten = torch.ops.aten

PIECE_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default)  # what a loop's pieces may be (mm fuses)
GROUPED_OP = aten._grouped_mm.default
BASE_OPS = (aten.empty.memory_format, aten.full.default, aten.zeros.default)
SIZE_OP = aten.sym_size.int


@dataclass
class CombineMatch:
    """One candidate (module docstring). ``form``: "loop" (``gemms`` are the pieces in cat order; ``cat`` None for a
    single ``mm``) or "grouped" (``gemms`` are the ``_grouped_mm`` terms, ``adds`` the add tree summing them).
    ``values``: the ``index_put``'s values node (the cat, the GEMM or the root add)."""

    form: str
    gemms: list[Node]
    values: Node
    base: Node
    index_put: Node
    coll: Node
    wait: Node
    cat: Node | None = None
    adds: list[Node] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def index(self) -> Any:
        indices = self.index_put.args[1]
        return indices[0] if isinstance(indices, (list, tuple)) and len(indices) == 1 else indices

    @property
    def accumulate(self) -> Any:
        return node_arg(self.index_put, 3, "accumulate", False)

    def chain(self) -> list[Node]:
        """Every node the rewrite removes, producers first."""
        inner = [*self.gemms, *reversed(self.adds)] + ([self.cat] if self.cat is not None else [])
        return [*inner, self.base, self.index_put, self.coll, self.wait]

    def steps(self) -> list[tuple[Node, set[Node]]]:
        """(node, the users it may have besides size queries) along the chain."""
        out: list[tuple[Node, set[Node]]] = []
        if self.cat is not None:
            out += [(g, {self.cat}) for g in self.gemms]
        parent = {arg: add for add in self.adds for arg in add.args[:2] if isinstance(arg, Node)}
        if self.adds:
            out += [(g, {parent[g]}) for g in self.gemms]
            out += [(a, {parent[a]}) for a in self.adds[1:]]
        out += [(self.values, {self.index_put}), (self.base, {self.index_put}), (self.index_put, {self.coll}),
                (self.coll, {self.wait})]
        return out

    def describe(self) -> str:
        what = f"{len(self.gemms)} x mm -> cat" if self.cat is not None else (
            f"{len(self.gemms)} x _grouped_mm -> add" if self.adds else op_name(self.gemms[0]))
        return f"{what} -> index_put -> {op_name(self.coll)} -> {op_name(self.wait)} at {self.gemms[0].name}"

    # ------------------------------------------------------------------------------------------------ rewrite

    def replace_with(self, out: Node, build: Any) -> None:
        """Hand the wait's users to ``out`` (the fused op's result, inserted before the all_to_all) and every size
        query of a chain node to an equal size of what stays (``build``: ``rewrite._Builder``), then erase the
        chain. ``out`` must already have the wait's shape and dtype."""
        graph = out.graph
        self.wait.replace_all_uses_with(out)
        for node in self.chain():
            for user in [u for u in node.users if u.target is SIZE_OP]:
                with graph.inserting_before(user):
                    user.replace_all_uses_with(self._size(node, int(user.args[1]), out, build))
                graph.erase_node(user)
        self.erase()

    def erase(self) -> None:
        """Erase the chain, consumers first (each node has no user left by then)."""
        for node in reversed(self.chain()):
            node.graph.erase_node(node)

    def _size(self, node: Node, dim: int, out: Node, build: Any) -> Any:
        """A graph argument (int or SymInt node) equal to ``node.shape[dim]``, made from nodes that stay."""
        size = val(node).shape[dim]
        if is_static_int(size):
            return int(size)
        dim %= val(node).dim()
        if node in (self.coll, self.wait):
            return build.call(SIZE_OP, (out, dim))
        if node in (self.base, self.index_put):
            return self.base.args[0][dim]  # the buffer's own shape argument
        if dim == 1:
            return build.call(SIZE_OP, (self.gemms[0].args[1], -1))
        if self.form == "grouped" or node is not self.values:
            src = self.gemms[0] if node is self.values or self.form == "grouped" else node
            return build.call(SIZE_OP, (src.args[0], 0))
        total = None
        for g in self.gemms:
            rows = build.call(SIZE_OP, (g.args[0], 0))
            total = rows if total is None else build.call(operator.add, (total, rows))
        return total


def match_combine(wait: Node) -> CombineMatch | None:
    """The combine ending at ``wait`` (module docstring), or None."""
    coll = wait.args[0] if wait.args else None
    if not isinstance(coll, Node) or coll.target is not c10d.all_to_all_single.default:
        return None
    ip = coll.args[0]
    if not isinstance(ip, Node) or ip.target is not aten.index_put.default or len(ip.args) < 3:
        return None
    base, values = ip.args[0], ip.args[2]
    if not isinstance(base, Node) or not isinstance(values, Node):
        return None
    args = {name: node_arg(coll, i + 1, name) for i, name in
            enumerate(("output_split_sizes", "input_split_sizes", "group_name"))}
    common = {"values": values, "base": base, "index_put": ip, "coll": coll, "wait": wait, "args": args}
    if values.target is aten.cat.default and isinstance(values.args[0], (list, tuple)) and values.args[0]:
        pieces = list(values.args[0])
        if all(isinstance(p, Node) and p.target in PIECE_OPS for p in pieces):
            return CombineMatch("loop", pieces, cat=values, **common)
        return None
    if values.target in PIECE_OPS:
        return CombineMatch("loop", [values], **common)
    if values.target is GROUPED_OP:
        return CombineMatch("grouped", [values], **common)
    adds: list[Node] = []
    terms: list[Node] = []
    if values.target is aten.add.Tensor and _add_tree(values, adds, terms):
        return CombineMatch("grouped", terms, adds=adds, **common)
    return None


def _add_tree(node: Node, adds: list[Node], terms: list[Node]) -> bool:
    """Collect a tree of plain adds (root first) whose leaves are all ``_grouped_mm`` nodes."""
    if node.target is GROUPED_OP:
        terms.append(node)
        return True
    if node.target is not aten.add.Tensor or node_arg(node, 2, "alpha", 1) != 1 or \
            not all(isinstance(x, Node) for x in node.args[:2]):
        return False
    adds.append(node)
    return all(_add_tree(x, adds, terms) for x in node.args[:2])
