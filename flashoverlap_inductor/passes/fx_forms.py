"""FX helpers shared by the two matchers (``matching.py``: GEMM -> collective; ``gather_match.py``: all_gather ->
GEMMs): argument access, fake values, guard-free size comparisons, and the one recogniser of funcol's chunk/cat form.

funcol moves the dim of a collective with ``torch._utils._chunk_or_narrow_cat(x, G, narrow_dim, cat_dim)`` (what
``_maybe_view_chunk_cat`` falls back to where a view will not do): cut ``x`` into pieces along ``narrow_dim``, then
concatenate them along ``cat_dim``. In a post-grad graph (torch 2.11 and 2.13) that is one of::

    cat([getitem(split(x, c, narrow_dim), 0), ..., getitem(.., G-1)], cat_dim)     # split / split_with_sizes
    cat([slice(x, narrow_dim, s0, e0), slice(x, narrow_dim, s1, e1), ...], cat_dim)  # unbacked sizes; backward

reduce_scatter over d > 0 cuts its input along d and cats on 0 (``matching.match_scatter_cat``); all_gather along
d > 0 cuts the gathered tensor along 0 and cats on d (``gather_match``). ``match_chunk_cat`` recognises the structure
only; the dims, the piece count, the starts and sizes and who else uses the nodes are each caller's to check (the
two check different things).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor._inductor_compat import statically_known_true

aten = torch.ops.aten

SPLIT_OPS = (aten.split.Tensor, aten.split.sizes, aten.split_with_sizes.default)


def node_arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` of ``node`` (positional), else keyword ``name``, else ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def val(arg: Any) -> Any:
    """The (fake) value of a graph argument: ``meta["val"]`` for a Node, the argument itself otherwise."""
    return arg.meta.get("val") if isinstance(arg, Node) else arg


def known_true(expr: Any) -> bool:
    """True iff ``expr`` (bool or SymBool) is provably true without adding a guard."""
    return bool(expr) if isinstance(expr, bool) else statically_known_true(expr)


def known_eq(a: Any, b: Any) -> bool:
    return known_true(a == b)


def gpu_name(t: torch.Tensor) -> str | None:
    """The name of the GPU a (fake) tensor lives on, for the cost model's data (None: off CUDA, its default GPU)."""
    if t.device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(t.device)
    return None


def op_name(node: Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.__name__.split(".")[0]
    return getattr(target, "__name__", str(target))


@dataclass
class ChunkCat:
    """``cat = cat(pieces, cat_dim)`` where the pieces cut ``source`` along ``dim``, in this order: either
    ``getitem(split, i)`` for i = 0, 1, .. of one ``SPLIT_OPS`` node ``split`` of ``source`` (``chunk``: the split's
    size, its first size for ``split_with_sizes``), or step-1 ``slice``s of ``source`` along ``dim`` (``split`` None;
    ``chunk``: the first slice's end). ``dim`` and ``cat_dim`` are the graph's arguments as written (maybe negative,
    maybe not ints); ``pieces`` is never empty."""

    source: Node
    dim: Any
    cat_dim: Any
    chunk: Any
    pieces: list[Node]
    split: Node | None
    cat: Node

    def nodes(self) -> list[Node]:
        """The nodes of the form in graph order (split, pieces, cat)."""
        return ([self.split] if self.split is not None else []) + self.pieces + [self.cat]


def match_chunk_cat(cat: Node) -> ChunkCat | None:
    """``cat`` as funcol's chunk/cat form (module docstring), or None. Walks back from the cat only: it does not look
    at the other users of the source, the split or the pieces."""
    pieces = cat.args[0] if cat.target is aten.cat.default and cat.args else None
    if not isinstance(pieces, (list, tuple)) or len(pieces) < 1 or not all(isinstance(p, Node) for p in pieces):
        return None
    first = pieces[0]
    if first.target is operator.getitem:
        split = first.args[0]
        if not isinstance(split, Node) or split.target not in SPLIT_OPS:
            return None
        if any(p.target is not operator.getitem or p.args[0] is not split or p.args[1] != i
               for i, p in enumerate(pieces)):
            return None
        sizes = split.args[1]
        chunk = sizes[0] if isinstance(sizes, (list, tuple)) else sizes
        source, dim = split.args[0], node_arg(split, 2, "dim", 0)
    elif first.target is aten.slice.Tensor:
        split, source, dim = None, first.args[0], node_arg(first, 1, "dim", 0)
        for p in pieces:
            if p.target is not aten.slice.Tensor or p.args[0] is not source or node_arg(p, 1, "dim", 0) != dim:
                return None
            if node_arg(p, 4, "step", 1) != 1:
                return None
        chunk = node_arg(first, 3, "end")
    else:
        return None
    if not isinstance(source, Node):
        return None
    return ChunkCat(source, dim, node_arg(cat, 1, "dim", 0), chunk, list(pieces), split, cat)
