"""The e2e harness's ``bound`` backend: the same Inductor-compiled step with every collective replaced by a local op
of the right shape and no communication: the time of a step whose communication is entirely hidden (or free).

``NoCommPass`` (an Inductor ``post_grad_custom_pre_pass``, so forward and backward graphs alike) replaces each
``_c10d_functional`` collective and its ``wait_tensor``:

* ``all_reduce(x)`` -> ``x`` (the input itself);
* ``reduce_scatter_tensor(x, op, P)`` -> ``x[: rows / P]`` (a view of the first rows);
* ``all_gather_into_tensor(x, P)`` -> ``x.repeat(P, 1, ...)`` (the local shard P times);
* ``all_to_all_single(x, out, in)`` -> ``x`` with even splits (``None``) or equal static ones (MoE's count exchange,
  whose values decide the sizes after it), else ``x.new_zeros([sum(out), ...])``.

Values that depend on the input, never a constant: with the gathered rows replaced by zeros, the sequence-parallel
prefill's bound ran in 4.99 ms on 2 H200s (2026-11-26, torch 2.11), below the time of its GEMMs alone (about 7 TFLOP
per rank, >= 10 ms): a constant lets Inductor drop work that only it feeds. A repeat of the shard holds only values
the rank has (valid indices where it held indices) and costs one local copy of the output. Only an all_to_all with
uneven splits, whose output rows cannot come from the input one for one, gets zeros (MoE routing may index with
them); a memset is its cost.

Results are meaningless (the harness never compares them, and says so); shapes, dtypes and every GEMM, norm and
kernel of the step are those of the Inductor row. ``hidden`` of a row is then ``(T_inductor - T_row) /
(T_inductor - T_bound)``: the share of the communication time that row hid (``e2e.add_hidden``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor import _inductor_compat as compat

aten = torch.ops.aten
NOTE = "no communication (collectives replaced by local ops of their shape): the time bound; results meaningless"


def _arg(node: Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def replace_collectives(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place (module docstring); returns how many collectives were replaced."""
    c10d = compat.c10d
    n = 0
    for wait in list(graph.find_nodes(op="call_function", target=c10d.wait_tensor.default)):
        coll = wait.args[0]
        if not isinstance(coll, Node) or len(coll.users) != 1:
            continue
        x = coll.args[0]
        with graph.inserting_before(wait):
            if coll.target is c10d.all_reduce.default:
                local = x
            elif coll.target is c10d.reduce_scatter_tensor.default:
                rows = x.meta["val"].shape[0] // _arg(coll, 2, "group_size")
                local = graph.call_function(aten.slice.Tensor, (x, 0, 0, rows))
            elif coll.target is c10d.all_gather_into_tensor.default:
                ndim = x.meta["val"].dim()
                local = graph.call_function(aten.repeat.default, (x, [_arg(coll, 1, "group_size")] + [1] * (ndim - 1)))
            elif coll.target is c10d.all_to_all_single.default:
                out, inp = _arg(coll, 1, "output_split_sizes"), _arg(coll, 2, "input_split_sizes")
                if out is None or _same_static(out, inp):  # e.g. MoE's count exchange: its values set later sizes
                    local = x
                else:
                    total = out[0]
                    for s in out[1:]:
                        total = graph.call_function(operator.add, (total, s))
                    local = _zeros(graph, x, [total, *list(x.meta["val"].shape[1:])])
            else:
                continue
        if isinstance(local, Node) and local is not x:
            local.meta["val"] = wait.meta.get("val")
        wait.replace_all_uses_with(local)
        graph.erase_node(wait)
        graph.erase_node(coll)
        n += 1
    return n


def _zeros(graph: torch.fx.Graph, like: Node, shape: list) -> Node:
    """A node of ``aten.full(shape, 0)`` with ``like``'s dtype and device (``new_zeros`` is decomposed by then)."""
    v = like.meta["val"]
    return graph.call_function(aten.full.default, (shape, 0), {"dtype": v.dtype, "layout": torch.strided,
                                                             "device": v.device, "pin_memory": False})


def _same_static(a: Any, b: Any) -> bool:
    """Both split lists static ints and equal: every rank sends what it receives, so ``x`` itself is a valid
    result (its values may decide later sizes)."""
    return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)
            and all(isinstance(v, int) for v in a))


class NoCommPass(compat.CustomGraphPass):
    """``replace_collectives`` as an Inductor custom pass (its ``uuid`` keys the FX graph cache apart from
    Inductor's own graphs)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        replace_collectives(graph)

    def uuid(self) -> str:
        return compat.hash_files([__file__])
