"""The wave-group schedule on CPU (or any device whose backend has async collectives, e.g. gloo).

For each group g of the plan's buffer layout: compute the group's buffer rows (the input rows named by
``layout.group_segments(g)`` times ``b``, plus bias), start the group's collective with ``async_op=True`` and go
on to the next group while it runs; wait for all of them at the end. This is the GPU kernel's schedule with the
GEMM tiles replaced by row-slice GEMMs: the same layout functions decide what each group holds, so the CPU
path checks the layout end to end against eager.

Per collective (rows are flattened rows of ``y``, see ``ops``; the steps come from ``schedule.steps``):

* all_reduce: the buffer is the output; each group is reduced in place.
* reduce_scatter: group g's buffer slice holds the piece ``pieces[g][k]`` of every shard k; a reduce_scatter of
  that slice lands this rank's piece at rows ``output_offsets(g)[rank]`` of the output shard.
* all_to_all: group g sends its piece of chunk k to rank k and receives, from every rank j, j's group-g piece
  of j's chunk for us (``steps.Schedule.recv_pieces``) straight into its rows of the natural output (P2P ops into
  contiguous views: no staging copy; the piece for ourselves is copied locally).

Invariant: the result equals ``collective(a @ b + bias)`` of eager PyTorch, up to GEMM rounding.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import config
from ..schedule.steps import GroupStep, schedule_steps
from .base import LastResortRoute
from .unfused import reduce_scatter_into

log = logging.getLogger("flashoverlap")



class _RowGemm:
    """Computes rows ``[src, src + rows)`` of the flattened ``y = a @ b (+ bias)`` into a ``[rows, N]`` view.

    A 3D ``a`` is handled batch element by batch element (a row range may span several), so bmm operands,
    expanded (stride-0) ``b`` and any strides work without copying the inputs.
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, y_shape: list[int]):
        self.a, self.b = a, b
        self.unit = a.shape[1] if a.dim() == 3 else a.shape[0]
        self.bias = bias.expand(y_shape) if bias is not None else None

    def __call__(self, src: int, rows: int, out: torch.Tensor) -> None:
        a, b, bias = self.a, self.b, self.bias
        if a.dim() == 2:
            self._mm(a[src:src + rows], b, None if bias is None else bias[src:src + rows], out)
            return
        done = 0
        while done < rows:
            r = src + done
            bi, m0 = divmod(r, self.unit)
            m1 = min(self.unit, m0 + rows - done)
            self._mm(a[bi, m0:m1], b[bi] if b.dim() == 3 else b, None if bias is None else bias[bi, m0:m1],
                     out[done:done + m1 - m0])
            done += m1 - m0

    @staticmethod
    def _mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        if bias is None:
            torch.mm(x, w, out=out)
        else:
            torch.addmm(bias, x, w, out=out)


def _run(collective: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, y_shape: list[int],
         group: dist.ProcessGroup, plan: str, out: torch.Tensor, buf: torch.Tensor, send_rows=None,
         recv_rows=None, a2a_groups: int = 4, config_dir: str | None = None) -> torch.Tensor:
    """Compute group by group into ``buf`` ([rows, N]) and overlap each group's collective with the next GEMM."""
    rows, n = buf.shape
    dtype = str(a.dtype).removeprefix("torch.")
    world, rank = group.size(), group.rank()
    if n == 0 or (rows == 0 and send_rows is None):  # nothing to compute or move on any rank
        return out
    steps = schedule_steps(collective, plan, rows, n, a.shape[-1], dtype, world, rank, send_rows, recv_rows,
                           a2a_groups, config_dir)
    gemm = _RowGemm(a, b, bias, y_shape)
    out_flat = out.view(-1, n)
    works = []
    for g, step in enumerate(steps):
        for buf_row, src_row, count in step.segments:
            gemm(src_row, count, buf[buf_row:buf_row + count])
        if step.hi == step.lo and not step.recvs:
            continue
        works += issue_group(collective, g, step, buf, out_flat, group, async_op=True)
    for work in works:
        work.wait()
    return out


def issue_group(collective: str, g: int, step: GroupStep, buf: torch.Tensor, out_flat: torch.Tensor,
                group: dist.ProcessGroup, async_op: bool = False) -> list:
    """Group ``g``'s collective through ``torch.distributed`` on the current stream: ``buf`` is the [rows, N] GEMM
    buffer, ``out_flat`` the [rows_out, N] output. all_reduce in place; reduce_scatter into this rank's output rows;
    all_to_all as grouped send/recv straight into the output plus the local copy. Returns the works to wait on
    (``async_op``; otherwise every transfer is complete, or queued on the stream, when it returns)."""
    works: list = []
    if collective == "all_reduce":
        works.append(dist.all_reduce(buf[step.lo:step.hi], group=group, async_op=async_op))
    elif collective == "reduce_scatter":
        works.append(reduce_scatter_into(out_flat[step.out[0]:step.out[1]], buf[step.lo:step.hi], group=group,
                                         async_op=async_op))
    else:
        p2p = [dist.P2POp(dist.isend, buf[lo:hi], dist.get_global_rank(group, j), group, tag=g)
               for j, lo, hi in step.sends]
        p2p += [dist.P2POp(dist.irecv, out_flat[lo:hi], dist.get_global_rank(group, j), group, tag=g)
                for j, lo, hi in step.recvs]
        if p2p:
            works.extend(dist.batch_isend_irecv(p2p) or ())
        if step.local is not None:
            b_lo, o_lo, count = step.local
            out_flat[o_lo:o_lo + count].copy_(buf[b_lo:b_lo + count])
    if not async_op:
        for work in works:
            if work is not None:
                work.wait()
        works = []
    return [w for w in works if w is not None]


class CpuRoute(LastResortRoute):
    """The route of every non-CUDA call (gloo): the schedule above, always."""

    name = "cpu"
    devices = ("cpu",)

    def make_launch(self, call, settings: config.Settings, ctx) -> tuple:
        return (call,)  # its all_to_all rows (``routes.make_call``: the one place that works them out)

    def execute(self, launch: tuple, ctx) -> torch.Tensor:
        call, a, y_shape = launch[0], ctx.a, ctx.y_shape
        out = torch.empty(ctx.out_shape, dtype=a.dtype, device=a.device)
        buf = out.view(-1, y_shape[-1]) if call.collective == "all_reduce" else \
            torch.empty(call.rows, y_shape[-1], dtype=a.dtype, device=a.device)
        return _run(call.collective, a, ctx.b, ctx.bias, y_shape, ctx.group, ctx.plan, out, buf, call.send_rows,
                    call.recv_rows, ctx.settings.all_to_all_default_groups, ctx.settings.config_dir)


ROUTE = CpuRoute()

