"""Structural matching of ``GEMM -> views -> [split/cat] -> collective -> wait`` in a post-grad FX graph.

This module only *recognizes* the shape of the subgraph (which nodes, which arguments); whether the match may
be fused (users, dtypes, shapes, cost) is decided in ``gemm_collective.py``. A wait whose collective is not fed
by a GEMM through views is not a match at all (DEBUG log, no counter): e.g. the all_reduce of a gradient.

Recognized forms (torch 2.11 and 2.13 post-grad graphs, see torch_compile.md §3):

* ``mm | addmm | bmm`` then any chain of ``view | reshape | _unsafe_view`` then
  ``_c10d_functional.all_reduce | reduce_scatter_tensor | all_to_all_single`` then ``wait_tensor``;
* reduce_scatter along ``scatter_dim > 0``: funcol rewrites it as ``cat([pieces of x along dim d], 0)`` with the
  pieces from ``split``/``split_with_sizes`` + ``getitem`` (or, with unbacked sizes, ``slice``), then a dim-0
  reduce_scatter (as Inductor's ``micro_pipeline_tp.find_reduce_scatter_patterns`` also matches). That form is
  recognised by ``fx_forms.match_chunk_cat``, which ``gather_match`` shares for the all_gather side.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor._inductor_compat import c10d

from .combine_match import match_combine
from .fx_forms import ChunkCat, known_eq, match_chunk_cat, node_arg, op_name, val

log = logging.getLogger("flashoverlap")
aten = torch.ops.aten

GEMM_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
COLLECTIVE_OPS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
}
# Positional order of each collective's arguments after the input tensor (schemas identical in 2.11 and 2.13).
COLLECTIVE_ARGS = {
    "all_reduce": ("reduce_op", "group_name"),
    "reduce_scatter": ("reduce_op", "group_size", "group_name"),
    "all_to_all": ("output_split_sizes", "input_split_sizes", "group_name"),
}


@dataclass
class GemmCollectiveMatch:
    """One candidate: ``gemm -> views -> [scatter] -> coll -> wait``. ``views`` are in graph order (the first
    consumes the GEMM output); ``rows_node`` is the tensor the collective (or the scatter form) consumes."""

    collective: str
    gemm: Node
    views: list[Node]
    coll: Node
    wait: Node
    scatter: ChunkCat | None = None  # funcol's reduce_scatter over dim > 0 (``match_scatter_cat``)
    args: dict[str, Any] = field(default_factory=dict)
    label: str = ""  # what ``gemm`` stands for when the pass made it (a sum of GEMMs); "" = the GEMM's op name

    @property
    def rows_node(self) -> Node:
        return self.views[-1] if self.views else self.gemm

    def chain(self) -> list[Node]:
        """Every node the rewrite removes, in graph order."""
        return [self.gemm, *self.views, *(self.scatter.nodes() if self.scatter else []), self.coll, self.wait]

    def describe(self) -> str:
        parts = [self.label or op_name(self.gemm), *(op_name(v) for v in self.views)]
        if self.scatter is not None:
            parts.append(f"split/cat(dim={self.scatter.dim})")
        parts += [op_name(self.coll), op_name(self.wait)]
        return f"{' -> '.join(parts)} at {self.gemm.name}"


def find_matches(graph: torch.fx.Graph) -> list[GemmCollectiveMatch]:
    """All structural candidates in ``graph``, in graph order."""
    out = []
    for wait in graph.find_nodes(op="call_function", target=c10d.wait_tensor.default):
        match = match_at_wait(wait)
        if match is not None:
            out.append(match)
    return out


def match_at_wait(wait: Node) -> GemmCollectiveMatch | None:
    """Walk back from ``wait`` through the collective, an optional split/cat and views to a GEMM."""
    coll = wait.args[0] if wait.args else None
    if not isinstance(coll, Node) or coll.target not in COLLECTIVE_OPS:
        return None
    collective = COLLECTIVE_OPS[coll.target]
    args = {name: node_arg(coll, i + 1, name) for i, name in enumerate(COLLECTIVE_ARGS[collective])}
    x = coll.args[0]
    scatter = None
    if collective == "reduce_scatter" and isinstance(x, Node) and x.target is aten.cat.default:
        scatter = match_scatter_cat(x)
        if scatter is None:
            _no_match(coll, x, "its input is a cat that is not funcol's split/cat form of a reduce_scatter")
            return None
        x = scatter.source
    x, views = behind_views(x)
    if not isinstance(x, Node) or x.target not in GEMM_OPS:
        if find_sum(wait) is not None:  # the pass stages it as one GEMM (``run``)
            log.debug("flashoverlap: %s: a sum of GEMMs, staged as one", coll.name)
            return None
        if match_combine(wait) is not None:  # an MoE combine the combine sub-pass declined, with its skip reason
            log.debug("flashoverlap: %s: an MoE combine (passes/combine.py)", coll.name)
            return None
        what = op_name(x) if isinstance(x, Node) else type(x).__name__
        _no_match(coll, x, f"its input comes from {what}, not mm/addmm/bmm or a view of one")
        return None
    views.reverse()
    return GemmCollectiveMatch(collective, x, views, coll, wait, scatter, args)


def behind_views(x: Any) -> tuple[Any, list[Node]]:
    """``x`` past the chain of views (``VIEW_OPS``) it is, and those views, nearest first."""
    views: list[Node] = []
    while isinstance(x, Node) and x.target in VIEW_OPS:
        views.append(x)
        x = x.args[0]
    return x, views


NEAR_MISS_HOPS = 3  # how far behind a collective's input a GEMM still makes a near miss (nodes)


def _no_match(coll: Node, x: Any, why: str) -> None:
    """Log why the collective ``coll`` (input ``x``) is no candidate: a near miss (INFO, counted) when a GEMM's
    output reaches ``x`` within ``NEAR_MISS_HOPS`` nodes (the fusion a user expected, blocked by the op between),
    else DEBUG."""
    from .report import record_near_miss

    gemm = _gemm_behind(x) if isinstance(x, Node) else None
    if gemm is None:
        log.debug("flashoverlap: no match at %s: %s", coll.name, why)
        return
    record_near_miss(op_name(x), "%s (%s) is fed by GEMM %s through %s, which the pass does not see through: %s",
                     coll.name, op_name(coll), gemm.name, op_name(x), why)


def _gemm_behind(x: Node) -> Node | None:
    """The nearest mm/addmm/bmm among the producers of ``x`` (``nearest_producer``), or None."""
    return nearest_producer(x, lambda n: n.target in GEMM_OPS)


def nearest_producer(x: Node, accept: Any, hops: int = NEAR_MISS_HOPS) -> Node | None:
    """The nearest producer of ``x`` that ``accept(node)`` takes (breadth first, ``hops`` nodes deep), or None."""
    frontier, seen = [x], {x}
    for _ in range(hops):
        nxt = []
        for node in frontier:
            for src in node.all_input_nodes:
                if accept(src):
                    return src
                if src not in seen:
                    seen.add(src)
                    nxt.append(src)
        frontier = nxt
    return None


def match_scatter_cat(cat: Node) -> ChunkCat | None:
    """``cat`` as funcol's reduce_scatter over ``dim > 0``: the chunk/cat form (``fx_forms.match_chunk_cat``) with
    ``cat_dim`` 0, an int cut dim (returned normalised to ``0 <= dim < source.dim()``) and, in the slice form, a
    first slice from 0; or None. ``chunk`` must equal each piece's size along ``dim``: sizes are checked in
    ``FlashOverlapPass._check_scatter``, the users of its nodes in ``_unexpected_user``."""
    form = match_chunk_cat(cat)
    if form is None or form.cat_dim != 0:
        return None
    if form.split is None and node_arg(form.pieces[0], 2, "start", 0) != 0:
        return None
    src_val = val(form.source)
    if src_val is None or not isinstance(form.dim, int):
        return None
    return dataclasses.replace(form, dim=form.dim % src_val.dim())


@dataclass
class Fusion:
    """A checked match and everything the rewrite needs. Sizes are ints or SymInts (``rows``: flattened GEMM
    output rows; ``n``, ``k``: GEMM sizes). ``out_shape``: graph args of the final reshape (None: the op's
    output already has the wait's shape). ``row_perm``: (reshape args, permutation) that reorders ``a``'s rows
    for a reduce_scatter over dim > 0. ``split_scale``: all_to_all split sizes are multiplied by it to count
    elements of the op output's dim 0. ``rows_per_split_unit``: rows per collective split unit (for the cost
    model)."""

    match: GemmCollectiveMatch
    a: Node
    b: Node
    bias: Node | None
    rows: Any
    n: Any
    k: Any
    dtype: str
    group_name: str
    group_size: int
    out_shape: list | None = None
    row_perm: tuple[list, list[int]] | None = None
    split_scale: int = 1
    rows_per_split_unit: Any = 1
    plan: str | None = "auto"
    settings: str = ""  # ``Settings.key()`` the fused op runs under
    sum_form: Any = None  # ``sum_of_gemms.SumOfGemms`` when ``match.gemm`` stands for a staged sum of GEMMs


@dataclass
class SumOfGemms:
    """The add tree ``root`` (its ``adds`` root first, then its ``terms``: ``mm`` nodes, each maybe behind one
    row-regrouping view in ``term_views``), whose every user is on the chain to the collective."""

    root: Node
    adds: list[Node]
    terms: list[Node]
    term_views: list[Node | None]
    staged: list[Node] | None = None  # cat(a), cat(b), mm[, view to the root's shape], once staged
    pull: bool = False  # staged for the pull route (``sum_of_gemms.stage_pull``): mm, addmm ...[, view]
    pull_verdict: tuple | None = None  # ``cost_model.pull.sum_verdict``'s answer, when staged for the pull route

    def k_sizes(self) -> list[Any]:
        return [val(t.args[0]).shape[1] for t in self.terms]

    def describe(self) -> str:
        return f"sum of {len(self.terms)} mm over K = {' + '.join(str(k) for k in self.k_sizes())}"

    def copy_elements(self) -> tuple[Any, Any]:
        """(elements the cats move, elements the adds moved), each counted read + write."""
        m, n = val(self.terms[0]).shape
        k = sum(self.k_sizes())
        return 2 * (m * k + k * n), 3 * (len(self.terms) - 1) * m * n


def find_sum(wait: Node) -> SumOfGemms | None:
    """The sum-of-GEMMs form behind ``wait``'s collective (``passes/sum_of_gemms.py``): through views and, for a
    reduce_scatter, funcol's split/cat form, as the main match accepts them; or None."""
    coll = wait.args[0] if wait.args else None
    if not isinstance(coll, Node) or coll.target not in COLLECTIVE_OPS:
        return None
    x = coll.args[0]
    if COLLECTIVE_OPS[coll.target] == "reduce_scatter" and isinstance(x, Node) and x.target is aten.cat.default:
        scatter = match_scatter_cat(x)
        x = scatter.source if scatter is not None else None
    while isinstance(x, Node) and x.target in VIEW_OPS and len(x.users) == 1:
        x = x.args[0]
    if not (isinstance(x, Node) and _is_plain_add(x)):
        return None
    adds, terms, views = [], [], []
    if not _collect(x, adds, terms, views) or len(terms) < 2:
        return None
    y, m, n = val(x), val(terms[0]).shape[0], val(terms[0]).shape[1]
    if not all(isinstance(val(t), torch.Tensor) and val(t).dim() == 2 and val(t).dtype == y.dtype and
               known_eq(val(t).shape[0], m) and known_eq(val(t).shape[1], n) for t in terms):
        return None
    if not (known_eq(y.shape[-1], n) and known_eq(math.prod(y.shape[:-1]), m)):  # the sum only regroups rows
        return None
    if any(v is not None and list(val(v).shape) != list(y.shape) for v in views):
        return None
    return SumOfGemms(x, adds, terms, views)


def _is_plain_add(node: Node) -> bool:
    return (node.target is aten.add.Tensor and len(node.args) >= 2 and node_arg(node, 2, "alpha", 1) == 1
            and all(isinstance(a, Node) for a in node.args[:2]))


def _collect(node: Node, adds: list[Node], terms: list[Node], views: list[Node | None]) -> bool:
    """Walk the add tree under ``node`` (root first): True iff every leaf is a one-user ``mm``, directly or behind
    one one-user view, and every inner node a one-user plain add."""
    view = None
    if node.target in VIEW_OPS and isinstance(node.args[0], Node) and node.args[0].target is aten.mm.default:
        view, node = node, node.args[0]
    if node.target is aten.mm.default:
        terms.append(node)
        views.append(view)
        return len(node.users) == 1
    if not _is_plain_add(node):
        return False
    adds.append(node)
    return all(len(arg.users) == 1 and _collect(arg, adds, terms, views) for arg in node.args[:2])
