"""Structure of an MoE dispatch in a post-grad graph: an all_to_all, the permutation by expert, the experts' first
GEMM(s). The mirror of ``combine_match``.

Recognized (torch 2.13 post-grad graphs of the e2e harness's expert-parallel block ``bench/moe.py``, loop and grouped,
and of torchtitan's ``AllToAllTokenDispatcher`` + ``GroupedExperts``; forward and backward, where the gradient of
the combine has this form)::

    recv = wait_tensor(all_to_all_single(x, output_split_sizes, input_split_sizes, group))   # unbacked split sizes
    p    = index(recv, [perm])                         # the permutation by expert (``rows[perm]``)
    q    = p | expand(p, [R, K])                       # the backward's no-op expand
    y_e  = mm(getitem(split_with_sizes(q, sizes), e), w_e)       # loop, forward (the gate_up GEMM per expert)
         | mm(slice(q, 0, start_e, end_e), w_e)                  # loop, backward (the down GEMMs' input gradients)
    y_t  = _grouped_mm(q, w_t, offs)                   # grouped: one term, or torchtitan's w1 and w3 sharing q

``p``, ``q`` and the pieces may have other users (saved for backward, the weight gradients' ``permute``); the
rewrite keeps them, reading the fused op's ``p``. ``match_dispatch(wait)`` recognizes the structure only: a
``DispatchMatch`` when the wait's one user is an ``index`` of it and a GEMM reads its rows as above (maybe with
unsupported details, which ``passes/dispatch.py`` declines with a skip reason), else None. The match owns its
rewrite: ``replace_with(outs)`` hands the GEMMs' users to the op's results, ``p``'s users to its ``p``, and every
size query of a node it removes to an equal size of what stays, then erases the chain (``erase``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor._inductor_compat import c10d, is_static_int

from .combine_match import GROUPED_OP
from .fx_forms import known_eq, node_arg, op_name, val

aten = torch.ops.aten

PIECE_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default)  # what may read a piece (mm fuses)
SPLIT_OPS = (aten.split_with_sizes.default, aten.split.sizes)
SIZE_OP = aten.sym_size.int


@dataclass
class DispatchMatch:
    """One candidate (module docstring). ``form``: "loop" (``pieces[e]`` read by ``gemms[e]``, in row order; ``split``
    the split node, or None for slices) or "grouped" (``gemms`` read ``q`` whole); ``rows``: ``p`` and its no-op
    expands (``q``); ``problem``: why the structure is not one the op runs ("" when it is; ``slug`` names it)."""

    form: str
    gemms: list[Node]
    coll: Node
    wait: Node
    permuted: Node
    rows: list[Node]
    pieces: list[Node] = field(default_factory=list)
    split: Node | None = None
    args: dict[str, Any] = field(default_factory=dict)
    slug: str = ""
    problem: str = ""

    @property
    def perm(self) -> Any:
        indices = self.permuted.args[1]
        return indices[0] if isinstance(indices, (list, tuple)) and len(indices) == 1 else indices

    def chain(self) -> list[Node]:
        """The nodes the rewrite removes, producers first (the pieces and ``p``'s other users stay)."""
        return [self.coll, self.wait, self.permuted, *self.gemms]

    def describe(self) -> str:
        what = f"split -> {len(self.gemms)} x mm" if self.split is not None else (
            f"{len(self.gemms)} x slice -> mm" if self.form == "loop" else f"{len(self.gemms)} x _grouped_mm")
        return f"{op_name(self.coll)} -> {op_name(self.wait)} -> index -> {what} at {self.coll.name}"

    def sizes(self, build: Any) -> list[Any] | None:
        """The loop pieces' row counts as graph arguments (ints or SymInt nodes of the graph, or built with ``build``
        at the insertion point), None for the grouped form."""
        if self.form != "loop":
            return None
        if self.split is not None:
            return list(self.split.args[1])
        out = []
        for piece in self.pieces:
            start, end = node_arg(piece, 2, "start", 0), node_arg(piece, 3, "end")
            if is_static_int(val(piece).shape[0]):
                out.append(int(val(piece).shape[0]))
                continue
            if is_static_int(val(end)) and int(val(end)) >= 2 ** 62:  # ``p[s:]``: INT64_MAX, clamped to p's rows
                rows = val(self.perm).shape[0]  # p = recv[perm]: one row per index entry
                end = int(rows) if is_static_int(rows) else build.call(SIZE_OP, (self.perm, 0))
            out.append(end if is_static_int(val(start)) and int(val(start)) == 0 else
                       build.call(operator.sub, (end, start)))
        return out

    # ------------------------------------------------------------------------------------------------ rewrite

    def replace_with(self, outs: list[Node], build: Any) -> None:
        """Hand ``p``'s users to ``outs[0]`` and each GEMM's users to ``outs[1 + t]`` (the op's results, checked to
        have their shapes), every size query of the collective and the wait to the sum of the output split sizes
        (``build``: ``rewrite._Builder``), then erase the chain."""
        graph = outs[0].graph
        for node in (self.coll, self.wait):
            for user in [u for u in node.users if u.target is SIZE_OP]:
                with graph.inserting_before(user):
                    user.replace_all_uses_with(self._size(node, int(user.args[1]), build))
                graph.erase_node(user)
        self.permuted.replace_all_uses_with(outs[0])
        for gemm, y in zip(self.gemms, outs[1:], strict=True):
            gemm.replace_all_uses_with(y)
        self.erase()

    def erase(self) -> None:
        """Erase the chain, consumers first (each node has no user left by then)."""
        for node in reversed(self.chain()):
            node.graph.erase_node(node)

    def _size(self, node: Node, dim: int, build: Any) -> Any:
        """A graph argument equal to ``node.shape[dim]`` (the received rows, or K), made from nodes that stay."""
        size = val(node).shape[dim]
        if is_static_int(size):
            return int(size)
        if dim % 2 == 1:
            return build.call(SIZE_OP, (self.coll.args[0], 1))
        total = None
        for part in self.args["output_split_sizes"]:
            total = part if total is None else build.call(operator.add, (total, part))
        return total


def match_dispatch(wait: Node) -> DispatchMatch | None:
    """The dispatch starting at ``wait`` (module docstring), or None."""
    coll = wait.args[0] if wait.args else None
    if not isinstance(coll, Node) or coll.target is not c10d.all_to_all_single.default:
        return None
    users = [u for u in wait.users if u.target is not SIZE_OP]
    if len(users) != 1 or users[0].target is not aten.index.Tensor or users[0].args[0] is not wait:
        return None
    permuted = users[0]
    rows = _row_views(permuted)
    grouped, pieces, splits, slices = [], [], [], []
    for src in rows:
        for u in src.users:
            if u.target is GROUPED_OP and u.args[0] is src or _reads_as_a(u, src):
                grouped.append(u)
            elif u.target in SPLIT_OPS and u.args[0] is src:
                splits.append(u)
            elif u.target is aten.slice.Tensor and u.args[0] is src:
                slices.append(u)
    for s in splits:
        pieces += sorted((g for g in s.users if g.target is operator.getitem), key=lambda g: g.args[1])
    pieces += slices
    readers = {pc: [u for u in pc.users if _reads_as_a(u, pc)] for pc in pieces}
    if not grouped and not any(readers.values()):
        return None
    args = {name: node_arg(coll, i + 1, name) for i, name in
            enumerate(("output_split_sizes", "input_split_sizes", "group_name"))}
    common = {"coll": coll, "wait": wait, "permuted": permuted, "rows": rows, "args": args}
    if grouped:
        m = DispatchMatch("grouped", grouped, **common)
        if any(readers.values()):
            m.slug, m.problem = "dispatch_gemm", "the rows feed whole-row GEMMs and GEMMs of pieces at once"
        elif any(g.target is not GROUPED_OP for g in grouped):
            m.slug, m.problem = "dispatch_gemm", f"{[g.name for g in grouped]} are not all _grouped_mm"
        return m
    m = DispatchMatch("loop", [], split=splits[0] if len(splits) == 1 and not slices else None, **common)
    m.pieces = pieces if splits else _chain(slices)
    if len(splits) + (1 if slices else 0) != 1:
        m.slug, m.problem = "dispatch_pieces", "the rows are cut more than one way"
    elif any(len(readers[pc]) != 1 for pc in m.pieces):
        m.slug, m.problem = "dispatch_pieces", f"not every piece feeds exactly one GEMM " \
                                               f"({ {pc.name: len(readers[pc]) for pc in m.pieces} })"
    else:
        m.gemms = [readers[pc][0] for pc in m.pieces]
        m.problem = _pieces_problem(m)
        m.slug = "dispatch_pieces" if m.problem else ""
    return m


def _reads_as_a(user: Node, rows: Node) -> bool:
    """Whether ``user`` is a GEMM of ``PIECE_OPS`` whose A operand is ``rows`` (``addmm``'s is its second argument)."""
    if user.target not in PIECE_OPS:
        return False
    return (user.args[1] if user.target is aten.addmm.default else user.args[0]) is rows


def _row_views(permuted: Node) -> list[Node]:
    """``p`` and every no-op ``expand`` of it (same shape), transitively."""
    out, stack = [], [permuted]
    while stack:
        node = stack.pop()
        out.append(node)
        for u in node.users:
            if u.target is aten.expand.default and u.args[0] is node and val(u) is not None and \
                    val(u).dim() == val(node).dim() and \
                    all(known_eq(a, b) for a, b in zip(val(u).shape, val(node).shape, strict=True)):
                stack.append(u)
    return out


def _chain(slices: list[Node]) -> list[Node]:
    """The slices in row order: the one starting at 0, then the one starting where it ends, ...; those that fit no
    chain last (``_pieces_problem`` reports them)."""
    left, out, at = list(slices), [], 0
    while left:
        nxt = next((s for s in left if val(node_arg(s, 2, "start", 0)) is not None and
                    known_eq(val(node_arg(s, 2, "start", 0)), at)), None)
        if nxt is None:
            return out + left
        left.remove(nxt)
        out.append(nxt)
        at = val(node_arg(nxt, 3, "end"))
    return out


def _pieces_problem(m: DispatchMatch) -> str:
    """Why the loop's pieces are not consecutive row ranges of ``p`` from row 0 ("" when they are)."""
    if m.split is not None:
        dim = node_arg(m.split, 2, "dim", 0)
        got = [int(pc.args[1]) for pc in m.pieces]
        if dim not in (0, -2) or got != list(range(len(m.split.args[1]))):
            return f"the split along dim {dim} does not hand every piece to a GEMM in order"
        return ""
    at = 0
    for pc in m.pieces:
        start, end = val(node_arg(pc, 2, "start", 0)), val(node_arg(pc, 3, "end"))
        if node_arg(pc, 1, "dim", 0) not in (0, -2) or node_arg(pc, 4, "step", 1) != 1:
            return f"{pc.name} is not a step-1 slice of the rows"
        if is_static_int(end) and int(end) >= 2 ** 62:  # ``p[s:]``: the end is INT64_MAX, clamped to the rows
            end = val(m.permuted).shape[0]
        if start is None or end is None or not known_eq(start, at) or not known_eq(val(pc).shape[0], end - start):
            return f"the slices are not consecutive row ranges from row 0 ({pc.name} starts at {start})"
        at = end
    return ""
