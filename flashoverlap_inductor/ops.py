"""The fused GEMM + collective custom ops (``torch.ops.flashoverlap.*``), their fake (meta) implementations,
input validation and plan resolution.

Semantics (the contract every runtime implements): ``y = a @ b (+ bias)`` exactly like aten ``mm``/``addmm``/
``bmm`` (``a`` [M,K] or [B,M,K]; ``b`` [K,N] or [B,K,N]; any strides; ``bias`` broadcast like ``addmm`` and
added on every rank *before* the reduction), then a collective over ``y`` along dim 0:

* ``gemm_all_reduce``: sum over the group; same shape as ``y``.
* ``gemm_reduce_scatter``: rank r's contiguous shard ``y.shape[0] / group_size`` of the sum along dim 0.
* ``gemm_all_to_all``: like ``all_to_all_single(y, output_split_sizes, input_split_sizes)`` (None = even).
* ``gemm_unpermute_all_to_all`` (the MoE combine): the experts' GEMM ``y = cat(a[e] @ b[e])`` (per-expert loop;
  ``offs`` None) or ``y = sum_t _grouped_mm(a[t], b[t], offs)`` (``b[t]`` [E, K_t, N]), then the un-permutation
  ``send = zeros([sum(input_split_sizes), N]).index_put_((index,), y, accumulate)``, then
  ``all_to_all_single(send, output_split_sizes, input_split_sizes)`` (row counts). Rows the graph leaves undefined
  (past the last offset, send rows no index names) are 0. Runtime: ``routes/combine.py``.
* ``all_to_all_permute_gemm`` (the MoE dispatch, the combine's mirror): ``p = all_to_all_single(x,
  output_split_sizes, input_split_sizes)[index]`` (the permutation by expert), then the experts' first GEMM(s):
  ``y[e] = p[s_e:s_e + sizes[e]] @ b[e]`` (per-expert loop, ``offs`` None, ``s_e = sum(sizes[:e])``) or
  ``y[t] = _grouped_mm(p, b[t], offs)`` (``b[t]`` [E, K, N_t]; rows past the last offset 0). Returns ``[p, *y]``
  (``p`` feeds the weight gradients and is saved for backward; under the plan suffix ``"+no_rows"``, which the
  pass adds where the graph reads only ``y``, ``p`` is returned as ``[0, K]``). Runtime: ``routes/moe_dispatch.py``.

And the other way round, a collective *before* the GEMMs:

* ``all_gather_gemm``: ``g = cat(shards of a over the group, gather_dim)``, then ``y_i = g.reshape(-1, K) @ b[i]
  (+ bias[i])`` for each ``b[i]`` [K, N_i] (several GEMMs sharing one gather: q/k/v, gate/up). Returns ``[y_0, ...,
  y_{n-1}]`` ([rows, N_i] each, rows = g's flattened rows), then ``g`` itself when ``return_gathered`` (the backward
  saves it). Row geometry and order: ``schedule.gather``.

Results are contiguous. The runtimes work on the *flattened rows* of ``y`` (``[rows, N]`` with ``rows =
prod(y.shape[:-1])``); one dim-0 element of a 3D ``y`` is ``unit = y.shape[1]`` flattened rows, so dim-0 split
sizes become row counts by multiplying with ``unit``. A call whose ``y`` is empty on every rank (any zero size
for all_reduce / reduce_scatter, whose ranks hold equal shapes; for all_to_all a zero size after dim 0, e.g. N = 0,
or no rows with even splits) returns its empty result here, before any route: no GEMM, no collective on any rank.

``plan`` is a ``GroupPlan.to_str()`` or ``"auto"`` (a memoized cost-model plan per call shape; ``schedule.steps``);
for the MoE combine and dispatch ``"blocks"`` (one transfer per peer and ring step, ``schedule.combine``),
``"blocks:c=N"`` (each peer's block in N chunks, 1 <= N <= 16), ``"experts:c=N"`` (``"experts"``: N = 2; the
dispatch's experts in N pieces, each GEMM'd once all its rows arrived: ``routes/moe_expert_cut.py``; for the combine
``"blocks"``) or ``"auto"`` (for now ``"blocks"``).
``settings`` is a ``config.Settings.key()`` string (the pass passes the settings it compiled under; "" = the
process's current settings). Which implementation runs is decided by the route registry (``routes.dispatch``).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from . import _inductor_compat as compat
from . import routes
from .routes import combine as combine_route
from .routes import moe_dispatch as dispatch_route
from .routes.unfused import reduce_scatter_into  # noqa: F401  (the version shim tools import from here)
from .schedule import gather as gather_schedule
from .schedule.combine import rows_kept
from .schedule.steps import all_to_all_splits, even_splits

log = logging.getLogger("flashoverlap")

NAMESPACE = "flashoverlap"

_SCHEMAS = {
    "gemm_all_reduce": "(Tensor a, Tensor b, Tensor? bias, str reduce_op, str group_name, str plan, "
                       "str settings=\"\") -> Tensor",
    "gemm_reduce_scatter": "(Tensor a, Tensor b, Tensor? bias, str reduce_op, int group_size, str group_name, "
                           "str plan, str settings=\"\") -> Tensor",
    "gemm_all_to_all": "(Tensor a, Tensor b, Tensor? bias, SymInt[]? output_split_sizes, "
                       "SymInt[]? input_split_sizes, str group_name, str plan, str settings=\"\") -> Tensor",
    "all_gather_gemm": "(Tensor a, Tensor[] b, Tensor?[] bias, int gather_dim, int group_size, str group_name, "
                       "str plan, bool return_gathered, str settings=\"\") -> Tensor[]",
    "gemm_unpermute_all_to_all": "(Tensor[] a, Tensor[] b, Tensor? offs, Tensor index, bool accumulate, "
                                 "SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name, str plan, "
                                 "str settings=\"\") -> Tensor",
    "all_to_all_permute_gemm": "(Tensor x, Tensor index, Tensor[] b, SymInt[]? sizes, Tensor? offs, "
                               "SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name, str plan, "
                               "str settings=\"\") -> Tensor[]",
}

# ----------------------------------------------------------------------------------------------- validation


def gemm_output_shape(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> list:
    """Shape of ``y = a @ b (+ bias)``; raises ``ValueError`` for anything aten mm/addmm/bmm would reject.

    Accepted: [M,K]@[K,N] (mm), [B,M,K]@[B,K,N] (bmm), [B,M,K]@[K,N] (matmul of a batch with one matrix).
    """
    if a.dtype != b.dtype or (bias is not None and bias.dtype != a.dtype):
        raise ValueError(f"flashoverlap: a, b and bias must share a dtype, got {a.dtype}, {b.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if a.device != b.device or (bias is not None and bias.device != a.device):
        raise ValueError("flashoverlap: a, b and bias must be on one device")
    if (a.dim(), b.dim()) == (2, 2):
        shape = [a.shape[0], b.shape[1]]
    elif (a.dim(), b.dim()) == (3, 3):
        torch._check(a.shape[0] == b.shape[0], lambda: f"flashoverlap: bmm batch mismatch {a.shape} @ {b.shape}")
        shape = [a.shape[0], a.shape[1], b.shape[2]]
    elif (a.dim(), b.dim()) == (3, 2):
        shape = [a.shape[0], a.shape[1], b.shape[1]]
    else:
        raise ValueError(f"flashoverlap: unsupported GEMM operand ranks a{tuple(a.shape)} @ b{tuple(b.shape)}")
    torch._check(a.shape[-1] == b.shape[-2], lambda: f"flashoverlap: inner sizes differ {a.shape} @ {b.shape}")
    if bias is not None:
        if bias.dim() > len(shape):
            raise ValueError(f"flashoverlap: bias{tuple(bias.shape)} has more dims than the output {shape}")
        msg = f"flashoverlap: bias {tuple(bias.shape)} does not broadcast to the output {shape}"
        for bs, ys in zip(reversed(bias.shape), reversed(shape), strict=False):
            torch._check(bs == 1 or bs == ys, lambda: msg)
    return shape


def check_reduce_op(reduce_op: str) -> None:
    if reduce_op.lower() != "sum":
        raise ValueError(f"flashoverlap: reduce_op must be 'sum', got {reduce_op!r}")


def resolve_group(group_name: str) -> dist.ProcessGroup:
    return compat.resolve_group(group_name)


# ----------------------------------------------------------------------------------------------- ops


def _new_output(a: torch.Tensor, shape: list) -> torch.Tensor:
    return torch.empty(shape, dtype=a.dtype, device=a.device)


def _gemm_all_reduce(a, b, bias, reduce_op, group_name, plan, settings=""):
    check_reduce_op(reduce_op)
    shape = gemm_output_shape(a, b, bias)
    group = resolve_group(group_name)
    if math.prod(shape) == 0:  # every rank's y is empty (all_reduce: equal shapes): nothing to compute or move
        return _new_output(a, shape)
    return routes.dispatch("all_reduce", a, b, bias, group, plan, settings, shape)


gemm_all_reduce = torch.library.custom_op(f"{NAMESPACE}::gemm_all_reduce", mutates_args=(),
                                          schema=_SCHEMAS["gemm_all_reduce"])(_gemm_all_reduce)


@gemm_all_reduce.register_fake
def _(a, b, bias, reduce_op, group_name, plan, settings=""):
    check_reduce_op(reduce_op)
    return _new_output(a, gemm_output_shape(a, b, bias))


def _gemm_reduce_scatter(a, b, bias, reduce_op, group_size, group_name, plan, settings=""):
    check_reduce_op(reduce_op)
    shape = gemm_output_shape(a, b, bias)
    group = resolve_group(group_name)
    if group_size != group.size():
        raise ValueError(f"flashoverlap: group_size {group_size} != size {group.size()} of group {group_name!r}")
    even_splits(shape[0], group_size, "reduce_scatter")
    if math.prod(shape) == 0:  # every rank's y is empty (reduce_scatter: equal shapes): nothing to compute or move
        return _new_output(a, [shape[0] // group_size, *shape[1:]])
    return routes.dispatch("reduce_scatter", a, b, bias, group, plan, settings, shape)


gemm_reduce_scatter = torch.library.custom_op(f"{NAMESPACE}::gemm_reduce_scatter", mutates_args=(),
                                              schema=_SCHEMAS["gemm_reduce_scatter"])(_gemm_reduce_scatter)


@gemm_reduce_scatter.register_fake
def _(a, b, bias, reduce_op, group_size, group_name, plan, settings=""):
    check_reduce_op(reduce_op)
    shape = gemm_output_shape(a, b, bias)
    torch._check(group_size > 0 and shape[0] % group_size == 0,
                 lambda: f"flashoverlap: reduce_scatter dim 0 {shape[0]} does not divide by {group_size}")
    return _new_output(a, [shape[0] // group_size, *shape[1:]])


def _gemm_all_to_all(a, b, bias, output_split_sizes, input_split_sizes, group_name, plan, settings=""):
    shape = gemm_output_shape(a, b, bias)
    group = resolve_group(group_name)
    outs, ins = all_to_all_splits(shape[0], group.size(), output_split_sizes, input_split_sizes)
    if outs[group.rank()] != ins[group.rank()]:
        raise ValueError(f"flashoverlap: all_to_all rank {group.rank()} sends itself {ins[group.rank()]} rows but "
                         f"expects {outs[group.rank()]} (input_split_sizes {ins}, output_split_sizes {outs})")
    # Nothing moves on any rank: the ranks share y's trailing sizes; even splits of no rows on one rank are even
    # splits of no rows on all (a rank with rows would send this one some).
    if 0 in shape[1:] or (shape[0] == 0 and output_split_sizes is None and input_split_sizes is None):
        return _new_output(a, [sum(outs), *shape[1:]])
    return routes.dispatch("all_to_all", a, b, bias, group, plan, settings, shape, output_split_sizes,
                           input_split_sizes)


gemm_all_to_all = torch.library.custom_op(f"{NAMESPACE}::gemm_all_to_all", mutates_args=(),
                                          schema=_SCHEMAS["gemm_all_to_all"])(_gemm_all_to_all)


@gemm_all_to_all.register_fake
def _(a, b, bias, output_split_sizes, input_split_sizes, group_name, plan, settings=""):
    shape = gemm_output_shape(a, b, bias)
    if input_split_sizes is not None:
        torch._check(sum(input_split_sizes) == shape[0],
                     lambda: f"flashoverlap: input_split_sizes must sum to dim 0 = {shape[0]}")
    rows = sum(output_split_sizes) if output_split_sizes is not None else shape[0]
    return _new_output(a, [rows, *shape[1:]])


def check_gather(a: torch.Tensor, b: list, bias: list, gather_dim: int, group_size: int) -> list[list[int]]:
    """Validate an ``all_gather_gemm`` call; returns the output shapes (``[rows, N_i]`` per GEMM, then the gathered
    shape). Raises ``ValueError`` with the reason."""
    if a.dim() < 2:
        raise ValueError(f"flashoverlap: all_gather_gemm needs a shard of at least 2 dims, got a{tuple(a.shape)}")
    if not 0 <= gather_dim < a.dim() - 1:
        raise ValueError(f"flashoverlap: gather_dim {gather_dim} must be a row dim of a{tuple(a.shape)} (0 .. "
                         f"{a.dim() - 2}; the last dim is K)")
    if group_size < 1:
        raise ValueError(f"flashoverlap: group_size {group_size} < 1")
    if not b or len(bias) != len(b):
        raise ValueError(f"flashoverlap: all_gather_gemm needs one or more b and one bias (or None) per b, got "
                         f"{len(b)} b and {len(bias)} bias")
    gathered = gather_schedule.gathered_shape(a.shape, gather_dim, group_size)
    rows = math.prod(gathered[:-1])
    shapes = []
    for i, (w, c) in enumerate(zip(b, bias, strict=True)):
        if w.dim() != 2:
            raise ValueError(f"flashoverlap: all_gather_gemm b[{i}] must be [K, N], got {tuple(w.shape)}")
        if c is not None and (c.dim() > 2 or (c.dim() == 2 and c.shape[0] != 1)):
            raise ValueError(f"flashoverlap: all_gather_gemm bias[{i}] must be [N] or [1, N] (the same for every "
                             f"row), got {tuple(c.shape)}")
        shapes.append(gemm_output_shape(a.reshape(-1, a.shape[-1]) if a.dim() > 2 else a, w, c))
        shapes[-1][0] = rows
    return [*shapes, gathered]


_checked_gathers: dict[tuple, list[list[int]]] = {}  # call metadata -> check_gather's shapes (see checked_gather)
MAX_CHECKED = 512


def checked_gather(a: torch.Tensor, b: list, bias: list, gather_dim: int, group_size: int) -> list[list[int]]:
    """``check_gather`` of a run-time call, memoized by everything it reads (each operand's shape, dtype and device,
    ``gather_dim``, ``group_size``): a call shape is validated once, and a call that fails validation is never
    memoized (it raises every time). Fresh lists each call. Saves ~10 us of host time per call (a reshape view and
    the checks per GEMM)."""
    key = (a.shape, a.dtype, a.device, gather_dim, group_size, tuple((w.shape, w.dtype, w.device) for w in b),
           tuple(None if c is None else (c.shape, c.dtype, c.device) for c in bias))
    shapes = _checked_gathers.get(key)
    if shapes is None:
        shapes = check_gather(a, b, bias, gather_dim, group_size)
        if len(_checked_gathers) >= MAX_CHECKED:
            _checked_gathers.clear()
        _checked_gathers[key] = shapes
    return [list(s) for s in shapes]


def _all_gather_gemm(a, b, bias, gather_dim, group_size, group_name, plan, return_gathered, settings=""):
    shapes = checked_gather(a, b, bias, gather_dim, group_size)
    group = resolve_group(group_name)
    if group_size != group.size():
        raise ValueError(f"flashoverlap: group_size {group_size} != size {group.size()} of group {group_name!r}")
    if math.prod(shapes[-1]) == 0:  # every rank's shard is empty alike (all_gather: equal shapes)
        # K = 0: each GEMM sums nothing (y = bias, or 0); no rows: empty results
        outs = [a.new_zeros(s) if c is None else c.expand(s).contiguous()
                for s, c in zip(shapes[:-1], bias, strict=True)]
        return [*outs, a.new_empty(shapes[-1])] if return_gathered else outs
    return routes.dispatch("all_gather", a, list(b), list(bias), group, plan, settings, shapes[-1],
                           gather_dim=gather_dim, return_gathered=return_gathered)


all_gather_gemm = torch.library.custom_op(f"{NAMESPACE}::all_gather_gemm", mutates_args=(),
                                          schema=_SCHEMAS["all_gather_gemm"])(_all_gather_gemm)


@all_gather_gemm.register_fake
def _(a, b, bias, gather_dim, group_size, group_name, plan, return_gathered, settings=""):
    shapes = check_gather(a, b, bias, gather_dim, group_size)
    return [_new_output(a, s) for s in (shapes if return_gathered else shapes[:-1])]


def check_combine(a: list, b: list, offs: torch.Tensor | None, index: torch.Tensor) -> int:
    """Validate a ``gemm_unpermute_all_to_all`` call's operands (ranks, dtypes, devices, K and N; row counts are per
    rank and checked by the route); returns N. Raises ``ValueError`` with the reason."""
    if not a or len(a) != len(b):
        raise ValueError(f"flashoverlap: the combine needs one or more a and one b per a, got {len(a)} a, {len(b)} b")
    if any(t.dtype != a[0].dtype or t.device != a[0].device for t in (*a, *b)):
        raise ValueError("flashoverlap: the combine's a and b must share one dtype and one device")
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"flashoverlap: the combine's index must be a 1-D int64/int32 tensor, got "
                         f"{index.dtype}{list(index.shape)}")
    want_b = 2 if offs is None else 3
    if any(x.dim() != 2 for x in a) or any(w.dim() != want_b for w in b):
        raise ValueError(f"flashoverlap: the combine needs a [M, K] and b of {want_b} dims, got a "
                         f"{[list(x.shape) for x in a]}, b {[list(w.shape) for w in b]}")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise ValueError(f"flashoverlap: the combine's offs must be a 1-D int32 tensor, got {offs.dtype}"
                         f"{list(offs.shape)}")
    n = b[0].shape[-1]
    for x, w in zip(a, b, strict=True):
        msg = f"flashoverlap: combine inner sizes differ {list(x.shape)} @ {list(w.shape)}"
        torch._check(x.shape[1] == w.shape[-2], lambda msg=msg: msg)
        torch._check(w.shape[-1] == n, lambda: "flashoverlap: the combine's GEMMs must share N")
        if offs is not None:
            torch._check(w.shape[0] == offs.shape[0], lambda: "flashoverlap: one offset per expert of b")
            torch._check(x.shape[0] == a[0].shape[0], lambda: "flashoverlap: the grouped terms must share their rows")
    return n


def _gemm_unpermute_all_to_all(a, b, offs, index, accumulate, output_split_sizes, input_split_sizes, group_name, plan,
                               settings=""):
    n = check_combine(a, b, offs, index)
    group = resolve_group(group_name)
    outs, ins = [int(x) for x in output_split_sizes], [int(x) for x in input_split_sizes]
    world, rank = group.size(), group.rank()
    if len(outs) != world or len(ins) != world:
        raise ValueError(f"flashoverlap: the combine needs {world} split sizes each, got {outs} and {ins}")
    if outs[rank] != ins[rank]:
        raise ValueError(f"flashoverlap: combine rank {rank} sends itself {ins[rank]} rows but expects {outs[rank]}")
    if n == 0:  # nothing moves on any rank (N is the ranks' shared weight size)
        return _new_output(a[0], [sum(outs), 0])
    return combine_route.dispatch(list(a), list(b), offs, index, accumulate, outs, ins, group, plan, settings)


gemm_unpermute_all_to_all = torch.library.custom_op(
    f"{NAMESPACE}::gemm_unpermute_all_to_all", mutates_args=(),
    schema=_SCHEMAS["gemm_unpermute_all_to_all"])(_gemm_unpermute_all_to_all)


@gemm_unpermute_all_to_all.register_fake
def _(a, b, offs, index, accumulate, output_split_sizes, input_split_sizes, group_name, plan, settings=""):
    n = check_combine(a, b, offs, index)
    torch._check(len(output_split_sizes) == len(input_split_sizes),
                 lambda: "flashoverlap: the combine needs one output and one input split size per rank")
    return _new_output(a[0], [sum(output_split_sizes), n])


def _dispatch_shapes(x, index, b, sizes, offs, plan) -> tuple[list[list], str, bool]:
    """The dispatch's output shapes ``[p, *y]`` (``p`` [0, K] under the plan suffix ``NO_ROWS``), its plan without
    the suffix, and whether ``p`` is returned."""
    shapes = dispatch_route.check_operands(x, index, b, sizes, offs)
    base, keep = rows_kept(plan)
    if not keep:
        shapes[0] = [0, shapes[0][1]]
    return shapes, base, keep


def _all_to_all_permute_gemm(x, index, b, sizes, offs, output_split_sizes, input_split_sizes, group_name, plan,
                             settings=""):
    shapes, plan, keep = _dispatch_shapes(x, index, b, sizes, offs, plan)
    group = resolve_group(group_name)
    outs, ins = [int(v) for v in output_split_sizes], [int(v) for v in input_split_sizes]
    world, rank = group.size(), group.rank()
    if len(outs) != world or len(ins) != world:
        raise ValueError(f"flashoverlap: the dispatch needs {world} split sizes each, got {outs} and {ins}")
    if outs[rank] != ins[rank]:
        raise ValueError(f"flashoverlap: dispatch rank {rank} sends itself {ins[rank]} rows but expects {outs[rank]}")
    if x.shape[1] == 0:  # nothing moves on any rank (K is the ranks' shared hidden size)
        return [x.new_zeros(s) for s in shapes]
    return dispatch_route.dispatch(x, index, list(b), None if sizes is None else [int(s) for s in sizes], offs, outs,
                                   ins, group, plan, settings, keep)


all_to_all_permute_gemm = torch.library.custom_op(
    f"{NAMESPACE}::all_to_all_permute_gemm", mutates_args=(),
    schema=_SCHEMAS["all_to_all_permute_gemm"])(_all_to_all_permute_gemm)


@all_to_all_permute_gemm.register_fake
def _(x, index, b, sizes, offs, output_split_sizes, input_split_sizes, group_name, plan, settings=""):
    torch._check(len(output_split_sizes) == len(input_split_sizes),
                 lambda: "flashoverlap: the dispatch needs one output and one input split size per rank")
    return [_new_output(x, s) for s in _dispatch_shapes(x, index, b, sizes, offs, plan)[0]]


# The CUDA fast path. custom_op's own layers (autograd wrapper, dynamo guard, aliasing check) cost ~130 us of host
# time per call on torch 2.11 (examples/device/host_profile.py). Two plain kernels replace them for CUDA tensors:
# on AutogradCUDA, a check (the ops have no autograd formula: the pass inserts them after autograd; with grad
# enabled and an input that requires grad it raises), then the implementation itself where the next key below autograd
# is CUDA (plain CUDA tensors: one dispatcher hop less), else a redispatch below autograd, so fake and functional
# tensors still reach the fake implementation; on CUDA, the implementation itself.
_fast_lib = torch.library.Library(NAMESPACE, "IMPL")
_AFTER_AUTOGRAD = compat.AFTER_AUTOGRAD_KEYSET
_CUDA_KEY = compat.CUDA_DISPATCH_KEY


def _requires_grad(x) -> bool:
    """A tensor argument (or a list of them: all_gather_gemm's weights) that requires grad."""
    if isinstance(x, (list, tuple)):
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in x)
    return isinstance(x, torch.Tensor) and x.requires_grad


def _autograd_cuda_kernel(name: str, impl):
    op = getattr(torch.ops.flashoverlap, name).default

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and any(_requires_grad(x) for x in args):
            raise RuntimeError(f"{NAMESPACE}::{name} has no autograd formula; it is meant for graphs after autograd "
                               "(torch.compile with backend='flashoverlap' inserts it there)")
        below = keyset & _AFTER_AUTOGRAD
        if below.highestPriorityTypeId() == _CUDA_KEY:  # the redispatch would land on ``impl``
            return impl(*args)
        return op.redispatch(below, *args)
    return kernel


for _name, _impl in (("gemm_all_reduce", _gemm_all_reduce), ("gemm_reduce_scatter", _gemm_reduce_scatter),
                     ("gemm_all_to_all", _gemm_all_to_all), ("all_gather_gemm", _all_gather_gemm),
                     ("gemm_unpermute_all_to_all", _gemm_unpermute_all_to_all),
                     ("all_to_all_permute_gemm", _all_to_all_permute_gemm)):
    _fast_lib.impl(_name, _autograd_cuda_kernel(_name, _impl), "AutogradCUDA", with_keyset=True)
    _fast_lib.impl(_name, _impl, "CUDA")

FUSED_OPS = (
    torch.ops.flashoverlap.gemm_all_reduce.default,
    torch.ops.flashoverlap.gemm_reduce_scatter.default,
    torch.ops.flashoverlap.gemm_all_to_all.default,
    torch.ops.flashoverlap.all_gather_gemm.default,
    torch.ops.flashoverlap.gemm_unpermute_all_to_all.default,
    torch.ops.flashoverlap.all_to_all_permute_gemm.default,
)
# Every rank must run its collectives: never let DCE drop a fused op whose output looks unused.
for _op in FUSED_OPS:
    torch.fx.node.has_side_effect(_op)
