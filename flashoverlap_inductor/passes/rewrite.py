"""The replace step: swap a checked ``gemm -> ... -> collective -> wait`` chain for one fused op.

Emitted before the collective node (every input of the new nodes is defined there)::

    [reshape(a, [..., G, chunk, ..., -1]) -> permute -> reshape([-1, K])]   # reduce_scatter over dim > 0 only
    [mul(split, scale) ...]                                                  # all_to_all over 3D views only
    out = flashoverlap.gemm_<collective>(a, b, bias, ..., group, plan, settings)
    [reshape(out, <the wait's shape>)]                                       # if the shapes differ

Each new node gets ``meta["val"]`` by running its (fake) implementation on the inputs' values; the final value
must have the wait's shape and dtype, otherwise the new nodes are removed again and the match is skipped
(``skip:shape_mismatch`` or ``skip:dtype_mismatch``, a WARNING: it means a bug in the checks). Only then are the
wait's users redirected and the old chain erased.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch.fx import Node
from torch.fx.node import map_arg

import flashoverlap_inductor.ops  # noqa: F401  (registers torch.ops.flashoverlap.*)
from flashoverlap_inductor import _inductor_compat as compat

from .fx_forms import known_eq, val
from .matching import Fusion
from .report import record_skip

aten = torch.ops.aten

FUSED_OP = {
    "all_reduce": torch.ops.flashoverlap.gemm_all_reduce.default,
    "reduce_scatter": torch.ops.flashoverlap.gemm_reduce_scatter.default,
    "all_to_all": torch.ops.flashoverlap.gemm_all_to_all.default,
}
# Node meta worth keeping on the replacement (provenance for logs, profiles and Inductor's kernel names).
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "original_aten", "seq_nr")


class _Builder:
    """Creates call_function nodes with ``meta["val"]``, and can remove them again."""

    def __init__(self, graph: torch.fx.Graph, origin: Node) -> None:
        self.graph = graph
        self.origin = origin
        self.created: list[Node] = []
        self.fake_mode = compat.fake_mode_for([val(n) for n in origin.all_input_nodes])

    def call(self, target: Any, args: tuple) -> Node:
        node = self.graph.call_function(target, args)
        self.created.append(node)
        for key in _KEPT_META:
            if key in self.origin.meta:
                node.meta[key] = self.origin.meta[key]
        values = map_arg(args, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*values)
        return node

    def rollback(self) -> None:
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created.clear()


def replace(graph: torch.fx.Graph, f: Fusion) -> bool:
    """Rewrite ``f.match`` in ``graph``; False (after recording ``skip:shape_mismatch``) if it cannot."""
    m = f.match
    build = _Builder(graph, m.gemm)
    slug = "shape_mismatch"
    try:
        with graph.inserting_before(m.coll):
            out = _emit(build, f)
        want, got = val(m.wait), val(out)
        if want.dtype != got.dtype:
            slug = "dtype_mismatch"
            raise ValueError(f"result dtype {got.dtype} != collective's {want.dtype}")
        if not (want.dim() == got.dim() and all(known_eq(x, y) for x, y in zip(want.shape, got.shape, strict=True))):
            raise ValueError(f"result shape {list(got.shape)} != collective's {list(want.shape)}")
    except Exception as exc:
        build.rollback()
        record_skip(slug, "%s: %s", m.describe(), exc, level=logging.WARNING)
        return False
    m.wait.replace_all_uses_with(out)
    for node in reversed(m.chain()):
        graph.erase_node(node)
    return True


def _emit(build: _Builder, f: Fusion) -> Node:
    m = f.match
    a: Node = f.a
    bias = f.bias
    if f.row_perm is not None:
        shape, perm = f.row_perm
        a = build.call(aten.reshape.default, (a, shape))
        a = build.call(aten.permute.default, (a, perm))
        k = int(f.k) if compat.is_static_int(f.k) else build.call(aten.sym_size.int, (f.a, val(f.a).dim() - 1))
        a = build.call(aten.reshape.default, (a, [-1, k]))
        if bias is not None and val(bias).dim() == 2 and not known_eq(val(bias).shape[0], 1):
            # a bias of the GEMM output's rows (a staged sum's partial): its rows reordered as a's
            n = int(f.n) if compat.is_static_int(f.n) else build.call(aten.sym_size.int, (bias, 1))
            bias = build.call(aten.reshape.default, (bias, shape))
            bias = build.call(aten.permute.default, (bias, perm))
            bias = build.call(aten.reshape.default, (bias, [-1, n]))
    head = (a, f.b, bias)
    if m.collective == "all_reduce":
        args = (*head, str(m.args["reduce_op"]).lower(), f.group_name, f.plan, f.settings)
    elif m.collective == "reduce_scatter":
        args = (*head, str(m.args["reduce_op"]).lower(), f.group_size, f.group_name, f.plan, f.settings)
    else:
        memo: dict[Node, Node] = {}
        outs = [_scaled(build, x, f.split_scale, memo) for x in m.args["output_split_sizes"]]
        ins = [_scaled(build, x, f.split_scale, memo) for x in m.args["input_split_sizes"]]
        args = (*head, outs, ins, f.group_name, f.plan, f.settings)
    out = build.call(FUSED_OP[m.collective], args)
    if f.out_shape is not None and not _is_shape(val(out).shape, f.out_shape):
        out = build.call(aten.reshape.default, (out, f.out_shape))
    return out


def _scaled(build: _Builder, size: Any, scale: int, memo: dict[Node, Node]) -> Any:
    """``size * scale`` as a graph argument: an int, or a SymInt node (one per distinct ``size`` node; never a
    raw SymInt)."""
    if scale == 1:
        return size
    if isinstance(size, int):
        return size * scale
    if size not in memo:
        memo[size] = build.call(operator.mul, (size, scale))
    return memo[size]


def _is_shape(shape: Any, args: list) -> bool:
    """True if ``args`` are all ints and equal ``shape`` (then no reshape is needed)."""
    return all(isinstance(x, int) for x in args) and list(shape) == list(args)
