"""The fused GEMM + collective custom ops (``torch.ops.flashoverlap.*``), their fake (meta) implementations,
input validation and plan resolution.

Semantics (the contract every runtime implements): ``y = a @ b (+ bias)`` exactly like aten ``mm``/``addmm``/
``bmm`` (``a`` [M,K] or [B,M,K]; ``b`` [K,N] or [B,K,N]; any strides; ``bias`` broadcast like ``addmm`` and
added on every rank *before* the reduction), then a collective over ``y`` along dim 0:

* ``gemm_all_reduce``: sum over the group; same shape as ``y``.
* ``gemm_reduce_scatter``: rank r's contiguous shard ``y.shape[0] / group_size`` of the sum along dim 0.
* ``gemm_all_to_all``: like ``all_to_all_single(y, output_split_sizes, input_split_sizes)`` (None = even).

Results are contiguous. The runtimes work on the *flattened rows* of ``y`` (``[rows, N]`` with ``rows =
prod(y.shape[:-1])``); one dim-0 element of a 3D ``y`` is ``unit = y.shape[1]`` flattened rows, so dim-0 split
sizes become row counts by multiplying with ``unit``.

``plan`` is a ``GroupPlan.to_str()`` or ``"auto"`` (a memoized cost-model plan per call shape). A plan that does
not fit the call (stale rows/N) falls back to a uniform plan with a one-time warning. all_to_all with explicit
split sizes always uses ``config.all_to_all_default_groups`` uniform *fractions*, because ranks may hold
different row counts and every sender/receiver pair must cut its chunk identically (see ``chunk_pieces``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import config
from . import plan as planlib

log = logging.getLogger("flashoverlap")

# torch >= 2.13 renamed dist.reduce_scatter_tensor -> reduce_scatter_single (the old name warns); 2.11 has only the
# old one. ``reduce_scatter_into(out, inp, group=...)``: the one version shim every runtime and tool uses.
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

NAMESPACE = "flashoverlap"
# Tile shape and group count of the fallback plan when "auto" cannot ask the cost model or a plan is stale.
FALLBACK_TILE = (128, 128)
FALLBACK_GROUPS = 4

_SCHEMAS = {
    "gemm_all_reduce": "(Tensor a, Tensor b, Tensor? bias, str reduce_op, str group_name, str plan) -> Tensor",
    "gemm_reduce_scatter": "(Tensor a, Tensor b, Tensor? bias, str reduce_op, int group_size, str group_name, "
                           "str plan) -> Tensor",
    "gemm_all_to_all": "(Tensor a, Tensor b, Tensor? bias, SymInt[]? output_split_sizes, "
                       "SymInt[]? input_split_sizes, str group_name, str plan) -> Tensor",
}

_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


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


def even_splits(dim0: int, world: int, what: str) -> list[int]:
    if dim0 % world:
        raise ValueError(f"flashoverlap: {what}: dim 0 size {dim0} does not divide by world size {world}")
    return [dim0 // world] * world


def all_to_all_splits(dim0: int, world: int, output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """(output, input) split sizes in dim-0 units, with None replaced by even splits; validated."""
    ins = [int(x) for x in input_split_sizes] if input_split_sizes is not None else even_splits(dim0, world, "input")
    outs = [int(x) for x in output_split_sizes] if output_split_sizes is not None else even_splits(dim0, world,
                                                                                                    "output")
    if len(ins) != world or len(outs) != world:
        raise ValueError(f"flashoverlap: all_to_all needs {world} split sizes, got input {ins}, output {outs}")
    if sum(ins) != dim0 or min(ins + outs) < 0:
        raise ValueError(f"flashoverlap: all_to_all input_split_sizes {ins} must be >= 0 and sum to dim 0 = {dim0}")
    return outs, ins


def resolve_group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


# ----------------------------------------------------------------------------------------------- plans


class _FractionPlan(NamedTuple):
    """Rank-independent uniform fractions ``g / G`` for ``plan.buffer_layout``: its cuts
    ``floor(L * row_bounds[g] / row_bounds[-1])`` then depend only on each chunk's length ``L``."""

    m: int
    row_bounds: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """Everything a runtime needs for one call shape (memoized).

    ``layout``: the buffer layout of this rank's GEMM output. ``recv_pieces[g][j]``: rows (flattened) this rank
    receives from rank j in group g (all_to_all only; ``()`` otherwise). ``plan``: the GroupPlan used (None for
    fraction plans). ``description``: for logs.
    """

    layout: planlib.BufferLayout
    recv_pieces: tuple[tuple[int, ...], ...]
    plan: planlib.GroupPlan | None
    description: str

    @property
    def num_groups(self) -> int:
        return len(self.layout.group_bounds) - 1


def _fallback_plan(rows: int, n: int) -> planlib.GroupPlan:
    return planlib.uniform_plan(rows, n, FALLBACK_TILE[0], FALLBACK_TILE[1], FALLBACK_GROUPS)


@functools.lru_cache(maxsize=4096)
def auto_plan(collective: str, m: int, n: int, k: int, dtype: str, world: int,
              device_name: str | None = None) -> planlib.GroupPlan:
    """The cost model's plan for one call shape with even chunks (memoized); the fallback plan if the cost model
    is missing or fails. (all_to_all with explicit split sizes never gets here: see ``resolve_schedule``.)"""
    try:
        from flashoverlap_inductor.cost_model import decide
    except Exception as exc:  # missing or broken cost model: a uniform plan is always correct
        _warn_once("no_cost_model", "flashoverlap: cost model unavailable (%r); 'auto' plans are uniform", exc)
        return _fallback_plan(m, n)
    try:
        decision = decide(collective, m, n, k, dtype, world, device_name=device_name)
    except Exception as exc:  # a cost-model bug must not break the op: a uniform plan is always correct
        _warn_once(f"decide:{type(exc).__name__}", "flashoverlap: cost model failed (%r); using a uniform plan", exc)
        return _fallback_plan(m, n)
    log.debug("flashoverlap: auto plan %s m=%d n=%d k=%d: %s", collective, m, n, k, decision.reason)
    return decision.plan


@functools.lru_cache(maxsize=4096)
def resolve_schedule(collective: str, plan_str: str, rows: int, n: int, k: int, dtype: str, world: int,
                     send_rows: tuple[int, ...] | None = None, recv_rows: tuple[int, ...] | None = None,
                     device_name: str | None = None) -> Schedule:
    """The schedule of one call: ``rows``/``n``/``k`` are the flattened GEMM sizes; ``send_rows``/``recv_rows``
    the all_to_all split sizes in flattened rows (None = even splits, which implies equal rows on every rank)."""
    if collective == "all_to_all" and (send_rows is not None or recv_rows is not None):
        groups = max(1, int(config.all_to_all_default_groups))
        send = list(send_rows) if send_rows is not None else planlib.chunks_for("all_to_all", rows, world)
        recv = list(recv_rows) if recv_rows is not None else send
        frac = _FractionPlan(rows, tuple(range(groups + 1)))
        layout = planlib.buffer_layout(frac, send)  # type: ignore[arg-type]  # duck-typed: m + row_bounds
        recv_pieces = planlib.chunk_pieces(recv, frac.row_bounds)
        if plan_str != "auto":
            log.debug("flashoverlap: all_to_all with explicit split sizes: plan %s replaced by uniform fractions "
                      "1/%d (ranks may hold different rows; only rank-independent fractions agree)", plan_str, groups)
        return Schedule(layout, tuple(map(tuple, recv_pieces)), None, f"uniform fractions 1/{groups}")
    if plan_str == "auto":
        plan = auto_plan(collective, rows, n, k, dtype, world, device_name)
    else:
        try:
            plan = planlib.GroupPlan.from_str(plan_str)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"flashoverlap: bad plan string {plan_str!r}: {exc}") from exc
    if plan.m != rows or plan.n != n:
        _warn_once(f"stale:{plan_str}:{rows}:{n}", "flashoverlap: plan %s does not fit a %s call with %d rows x %d "
                   "cols; using a uniform plan", plan_str, collective, rows, n)
        plan = planlib.uniform_plan(rows, n, plan.tile_m, plan.tile_n, plan.num_groups)
    chunks = planlib.chunks_for(collective, rows, world)
    layout = planlib.buffer_layout(plan, chunks)
    recv_pieces: tuple[tuple[int, ...], ...] = ()
    if collective == "all_to_all":  # even splits: every rank has this plan, so it receives what it sends
        recv_pieces = tuple(map(tuple, planlib.chunk_pieces(chunks, plan.row_bounds)))
    return Schedule(layout, recv_pieces, plan, plan.to_str())


# ----------------------------------------------------------------------------------------------- ops


def _runtime(a: torch.Tensor):
    """CUDA tensors go to the overlapped GPU runtime (which falls back to cuBLAS then NCCL, logged, where the
    kernel library or the inputs do not fit); everything else to the CPU (gloo) wave-group schedule."""
    if a.device.type == "cuda":
        from . import runtime_gpu
        return runtime_gpu
    from . import runtime_cpu
    return runtime_cpu


def _new_output(a: torch.Tensor, shape: list) -> torch.Tensor:
    return torch.empty(shape, dtype=a.dtype, device=a.device)


def _gemm_all_reduce(a, b, bias, reduce_op, group_name, plan):
    check_reduce_op(reduce_op)
    gemm_output_shape(a, b, bias)
    return _runtime(a).gemm_all_reduce(a, b, bias, resolve_group(group_name), plan)


gemm_all_reduce = torch.library.custom_op(f"{NAMESPACE}::gemm_all_reduce", mutates_args=(),
                                          schema=_SCHEMAS["gemm_all_reduce"])(_gemm_all_reduce)


@gemm_all_reduce.register_fake
def _(a, b, bias, reduce_op, group_name, plan):
    check_reduce_op(reduce_op)
    return _new_output(a, gemm_output_shape(a, b, bias))


def _gemm_reduce_scatter(a, b, bias, reduce_op, group_size, group_name, plan):
    check_reduce_op(reduce_op)
    shape = gemm_output_shape(a, b, bias)
    group = resolve_group(group_name)
    if group_size != group.size():
        raise ValueError(f"flashoverlap: group_size {group_size} != size {group.size()} of group {group_name!r}")
    even_splits(shape[0], group_size, "reduce_scatter")
    return _runtime(a).gemm_reduce_scatter(a, b, bias, group, plan)


gemm_reduce_scatter = torch.library.custom_op(f"{NAMESPACE}::gemm_reduce_scatter", mutates_args=(),
                                              schema=_SCHEMAS["gemm_reduce_scatter"])(_gemm_reduce_scatter)


@gemm_reduce_scatter.register_fake
def _(a, b, bias, reduce_op, group_size, group_name, plan):
    check_reduce_op(reduce_op)
    shape = gemm_output_shape(a, b, bias)
    torch._check(group_size > 0 and shape[0] % group_size == 0,
                 lambda: f"flashoverlap: reduce_scatter dim 0 {shape[0]} does not divide by {group_size}")
    return _new_output(a, [shape[0] // group_size, *shape[1:]])


def _gemm_all_to_all(a, b, bias, output_split_sizes, input_split_sizes, group_name, plan):
    shape = gemm_output_shape(a, b, bias)
    group = resolve_group(group_name)
    outs, ins = all_to_all_splits(shape[0], group.size(), output_split_sizes, input_split_sizes)
    if outs[group.rank()] != ins[group.rank()]:
        raise ValueError(f"flashoverlap: all_to_all rank {group.rank()} sends itself {ins[group.rank()]} rows but "
                         f"expects {outs[group.rank()]} (input_split_sizes {ins}, output_split_sizes {outs})")
    return _runtime(a).gemm_all_to_all(a, b, bias, output_split_sizes, input_split_sizes, group, plan)


gemm_all_to_all = torch.library.custom_op(f"{NAMESPACE}::gemm_all_to_all", mutates_args=(),
                                          schema=_SCHEMAS["gemm_all_to_all"])(_gemm_all_to_all)


@gemm_all_to_all.register_fake
def _(a, b, bias, output_split_sizes, input_split_sizes, group_name, plan):
    shape = gemm_output_shape(a, b, bias)
    if input_split_sizes is not None:
        torch._check(sum(input_split_sizes) == shape[0],
                     lambda: f"flashoverlap: input_split_sizes must sum to dim 0 = {shape[0]}")
    rows = sum(output_split_sizes) if output_split_sizes is not None else shape[0]
    return _new_output(a, [rows, *shape[1:]])


# The CUDA fast path. custom_op's own layers (autograd wrapper, dynamo guard, aliasing check) cost ~130 us of host
# time per call on torch 2.11 (examples/device/host_profile.py). Two plain kernels replace them for CUDA tensors:
# on AutogradCUDA, a check (the ops have no autograd formula: the pass inserts them after autograd; with grad
# enabled and an input that requires grad it raises) and a redispatch below autograd, so fake and functional
# tensors still reach the fake implementation; on CUDA, the implementation itself.
_fast_lib = torch.library.Library(NAMESPACE, "IMPL")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def _autograd_cuda_kernel(name: str):
    op = getattr(torch.ops.flashoverlap, name).default

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in args):
            raise RuntimeError(f"{NAMESPACE}::{name} has no autograd formula; it is meant for graphs after autograd "
                               "(torch.compile with backend='flashoverlap' inserts it there)")
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)
    return kernel


for _name, _impl in (("gemm_all_reduce", _gemm_all_reduce), ("gemm_reduce_scatter", _gemm_reduce_scatter),
                     ("gemm_all_to_all", _gemm_all_to_all)):
    _fast_lib.impl(_name, _autograd_cuda_kernel(_name), "AutogradCUDA", with_keyset=True)
    _fast_lib.impl(_name, _impl, "CUDA")

FUSED_OPS = (
    torch.ops.flashoverlap.gemm_all_reduce.default,
    torch.ops.flashoverlap.gemm_reduce_scatter.default,
    torch.ops.flashoverlap.gemm_all_to_all.default,
)
# Every rank must run its collectives: never let DCE drop a fused op whose output looks unused.
for _op in FUSED_OPS:
    torch.fx.node.has_side_effect(_op)
