"""all_gather -> GEMMs, the matching half: which all_gather of a post-grad graph feeds which GEMMs, through which
form (dim 0, funcol's split/cat or slice/cat forms along dim d > 0, and any chain of row-preserving views). The
recognized forms are listed in ``all_gather.py``'s docstring; this module only recognizes, ``all_gather.py``
checks, decides and rewrites.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor import _inductor_compat as compat

from .fx_forms import SPLIT_OPS, known_eq, match_chunk_cat, node_arg, val
from .matching import GEMM_OPS, VIEW_OPS

aten = torch.ops.aten


@dataclass
class GatherMatch:
    """One all_gather and the GEMMs that consume its rows. ``form``: the split/getitem/cat nodes of a gather along
    ``gather_dim > 0`` (empty along dim 0); ``gathered``: the node holding the gathered tensor (the wait or the
    cat); ``gemms``: (GEMM node, its A operand node: ``gathered`` or a 2-D node of ``row_views``); ``row_views``:
    the row-preserving views reachable from ``gathered`` (module docstring), in graph order."""

    coll: Node
    wait: Node
    shard: Node
    group_size: Any
    group_name: Any
    gather_dim: int
    form: list[Node]
    gathered: Node
    gemms: list[tuple[Node, Node]] = field(default_factory=list)
    row_views: list[Node] = field(default_factory=list)

    def describe(self) -> str:
        names = "+".join(g.name for g, _ in self.gemms) or "no GEMM"
        how = f"cat(dim={self.gather_dim})" if self.form else "dim 0"
        return f"all_gather({self.shard.name}, {how}) -> {names}"


def find_gathers(graph: torch.fx.Graph) -> list[GatherMatch]:
    """Every all_gather of the graph in its recognized form (module docstring), GEMMs or not (a snapshot: a rewrite
    invalidates the matches after it; ``fuse_gathers`` matches each one just before deciding it)."""
    out = []
    for coll in graph.find_nodes(op="call_function", target=compat.c10d.all_gather_into_tensor.default):
        m = match_gather(coll)
        if m is not None:
            out.append(m)
    return out


def match_gather(coll: Node) -> GatherMatch | None:
    users = list(coll.users)
    if len(users) != 1 or users[0].target is not compat.c10d.wait_tensor.default:
        return None
    wait, shard = users[0], coll.args[0]
    if not isinstance(shard, Node) or not isinstance(val(shard), torch.Tensor):
        return None
    m = GatherMatch(coll, wait, shard, node_arg(coll, 1, "group_size"), node_arg(coll, 2, "group_name"), 0, [], wait)
    form = _split_cat(wait, val(shard))
    if form is not None:
        m.form, m.gathered, m.gather_dim = form[0], form[1], form[2]
    m.row_views = row_views(m.gathered, val(shard).shape[-1])
    for x in (m.gathered, *m.row_views):
        if isinstance(val(x), torch.Tensor) and val(x).dim() == 2:
            m.gemms += [(g, x) for g in x.users if g.target in GEMM_OPS and _a_operand(g) is x]
    return m


def _a_operand(gemm: Node) -> Any:
    return gemm.args[1] if gemm.target is aten.addmm.default else gemm.args[0]


def row_views(root: Node, k: Any) -> list[Node]:
    """Every node reachable from ``root`` through ``VIEW_OPS`` whose result keeps the last dim ``k`` (a regrouping
    of the leading dims: the flattened rows keep their order), in graph order (producers first)."""
    out, stack = [], [root]
    while stack:
        for user in stack.pop().users:
            v = val(user)
            if user.target in VIEW_OPS and isinstance(v, torch.Tensor) and v.dim() >= 1 and \
                    known_eq(v.shape[-1], k) and user not in out:
                out.append(user)
                stack.append(user)
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    return sorted(out, key=order.__getitem__)


def row_subset_gemm(m: GatherMatch) -> tuple[Node, Node] | None:
    """(a GEMM, the ``slice``/``select`` it reads through) when a GEMM reads only some of the gathered rows
    (within two more views), else None."""
    for x in (m.gathered, *m.row_views):
        for user in x.users:
            if user.target not in (aten.slice.Tensor, aten.select.int):
                continue
            dim = node_arg(user, 1, "dim", 0)
            if isinstance(dim, int) and dim % val(x).dim() == val(x).dim() - 1:
                continue  # a slice of K, not of the rows
            frontier = [user]
            for _ in range(3):
                gemm = next((u for f in frontier for u in f.users if u.target in GEMM_OPS), None)
                if gemm is not None:
                    return gemm, user
                frontier = [u for f in frontier for u in f.users if u.target in VIEW_OPS]
    return None


def _split_cat(wait: Node, shard: torch.Tensor) -> tuple[list[Node], Node, int] | None:
    """funcol's gather along dim d > 0: ``cat([getitem(split(w, n0), i) for i], d)``, or (its backward) ``cat([slice(w,
    0, i * n0, (i + 1) * n0) for i], d)``, with n0 = the shard's dim 0: the ranks' pieces in rank order (the chunk/cat
    form of ``fx_forms.match_chunk_cat`` cutting ``w`` along dim 0). Returns (split if any, pieces, cat), the cat and
    d normalised, or None. Every use of ``w`` goes into the form (its only user is the split, or all its users are
    the pieces, and the split's users are the pieces) and each piece's only user is the cat."""
    users = list(wait.users)
    heads = list(users[0].users) if len(users) == 1 and users[0].target in SPLIT_OPS else users
    if not heads or any(len(p.users) != 1 for p in heads):
        return None
    form = match_chunk_cat(next(iter(heads[0].users)))
    if form is None or form.source is not wait or form.dim != 0 or len(form.pieces) != len(heads) or \
            set(form.pieces) != set(heads):
        return None
    n0 = shard.shape[0]
    if form.split is not None:
        if not known_eq(val(form.chunk) if isinstance(form.chunk, Node) else form.chunk, n0):
            return None
    elif not all(known_eq(_int(node_arg(p, 2, "start", 0)), i * n0) and known_eq(val(p).shape[0], n0)
                 for i, p in enumerate(form.pieces)):
        return None
    dim = form.cat_dim
    if not isinstance(dim, int) or dim % shard.dim() == 0:
        return None
    return form.nodes(), form.cat, dim % shard.dim()


def _int(x: Any) -> Any:
    """A slice bound as a value (a node's ``meta["val"]``, else itself)."""
    return val(x) if isinstance(x, Node) else x
