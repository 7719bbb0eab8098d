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

Failure contract (``docs/design.md``, ``errors``): a fault on one rank reaches every rank of the group as an
exception, no rank returns the output of a call in which any rank failed, and the next call needs no reset. Every
rank issues exactly its plan's collectives, in order, whatever happens: if computing or issuing group g raises (a
GEMM error, a ``KeyboardInterrupt``), this rank fills the buffer rows of the groups not yet issued with NaN (its
in-flight groups are left alone), still issues every remaining group's collective and waits for all of them. Every
call then ends with one tiny extra collective (in groups of two or more ranks): an ``all_reduce`` (MAX) over the
call's group of one int64, ``rank + 1`` on a rank that failed and 0 elsewhere, so every rank learns of a failure in
the same call. A failed rank re-raises its own exception (``KeyboardInterrupt`` too); every other rank raises
``errors.PeerFailure`` naming the failing rank (the highest, when several failed), the collective and the shapes.
Cost: that exchange adds one 8-byte collective and one host sync to every CPU-route call. An error raised before
the first collective that depends only on what the ranks share (a bad plan string) is raised by every rank alike
(``routes.agree`` checks that they share it).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import config, errors
from ..schedule.steps import GroupStep, schedule_steps
from .base import LastResortRoute
from .gather_nccl import unsupported_plan
from .gather_ring import GatherCall, run_host
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
         recv_rows=None, a2a_groups: int = 4) -> torch.Tensor:
    """Compute group by group into ``buf`` ([rows, N]) and overlap each group's collective with the next GEMM.

    Returns ``out`` only when no rank of ``group`` failed in this call; otherwise raises (module docstring,
    "Failure contract"). Collectives issued per call on every rank: the plan's groups (the same ones whether or not
    anything failed), then the failure exchange."""
    rows, n = buf.shape
    dtype = str(a.dtype).removeprefix("torch.")
    world, rank = group.size(), group.rank()
    if n == 0 or (rows == 0 and send_rows is None):  # nothing to compute or move on any rank
        _settle(None, collective, y_shape, buf, group, plan)
        return out
    steps = schedule_steps(collective, plan, rows, n, a.shape[-1], dtype, world, rank, send_rows, recv_rows,
                           a2a_groups)
    out_flat = out.view(-1, n)
    failure: BaseException | None = None
    works: list = []
    try:
        gemm = _RowGemm(a, b, bias, y_shape)
    except BaseException as exc:  # noqa: BLE001 - settled below, after every collective of the plan was issued
        failure = exc
    for g, step in enumerate(steps):
        if failure is None:
            try:
                for buf_row, src_row, count in step.segments:
                    gemm(src_row, count, buf[buf_row:buf_row + count])
            except BaseException as exc:  # noqa: BLE001 - as above
                failure = exc
        if failure is not None:
            _poison(buf[step.lo:step.hi])  # not issued yet: no transfer reads these rows now
        if step.hi == step.lo and not step.recvs:
            continue
        try:
            works += issue_group(collective, g, step, buf, out_flat, group, async_op=True)
        except BaseException as exc:  # noqa: BLE001 - g counts as issued (c10d may have started it); go on
            failure = failure or exc
    failure = _wait_all(works, failure)
    _settle(failure, collective, y_shape, buf, group, plan)
    return out


def _poison(rows: torch.Tensor) -> None:
    """Fill a failed rank's not-yet-issued buffer rows with NaN (floating dtypes; others are left as they are), so
    that what its peers receive from it is never mistaken for data."""
    if rows.numel() and (rows.is_floating_point() or rows.is_complex()):
        rows.fill_(float("nan"))


def _wait_all(works: list, failure: BaseException | None) -> BaseException | None:
    """Wait for every issued transfer whatever fails; returns ``failure``, else the first wait's exception."""
    for work in works:
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - wait for the others, then settle
            failure = failure or exc
    return failure


def _settle(failure: BaseException | None, collective: str, y_shape: list[int], buf: torch.Tensor,
            group: dist.ProcessGroup, plan: str) -> None:
    """The failure exchange that ends every call (collective over ``group``; none in a group of one rank, which has
    no peer to tell): an all_reduce (MAX) of one int64, ``group.rank() + 1`` where ``failure`` is set, else 0.
    Raises ``failure`` on a failed rank and ``errors.PeerFailure`` on the others when any rank failed; returns when
    none did."""
    if group.size() == 1:
        if failure is not None:
            raise failure
        return
    # a fill, not torch.tensor(..., device=cuda): that copies from pageable memory, which syncs the host
    flag = torch.full((1,), 0 if failure is None else group.rank() + 1, dtype=torch.int64, device=buf.device)
    what = f"{collective} of a {list(y_shape)} GEMM output ({buf.shape[0]} x {buf.shape[1]} buffer rows, plan {plan!r})"
    lost: Exception | None = None
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    except Exception as exc:  # noqa: BLE001 - the group itself broke: raised below
        lost = exc
    _raise_unless_exchanged(failure, lost, f"a fused {what}", group)
    worst = int(flag.item())
    if worst:
        raise errors.PeerFailure(f"flashoverlap: {_rank_name(group, worst - 1)} of group {_group_name(group)} "
                                 f"failed in the middle of a fused {what}; rank {group.rank()} completed its "
                                 "collectives but does not return its output (the failing rank raises the cause)")


def _raise_unless_exchanged(failure: BaseException | None, lost: Exception | None, what: str,
                            group: dist.ProcessGroup) -> None:
    """After a failure exchange (``lost``: its own exception, if it raised): a failed rank re-raises its ``failure``
    (logging a lost exchange too); a rank whose exchange was lost raises ``errors.PeerFailure``; else nothing."""
    if failure is not None:
        if lost is not None:
            log.warning("flashoverlap: the failure exchange of %s failed too: %r", what, lost)
        raise failure
    if lost is not None:
        raise errors.PeerFailure(f"flashoverlap: the failure exchange after {what} failed on rank {group.rank()} of "
                                 f"group {_group_name(group)}; its output is not returned: {lost}") from lost


def _rank_name(group: dist.ProcessGroup, rank: int) -> str:
    """``"rank r (global rank g)"``, or ``"rank r"`` where this process cannot map the group rank."""
    try:
        return f"rank {rank} (global rank {dist.get_global_rank(group, rank)})"
    except Exception:  # noqa: BLE001 - a group this process cannot map: the group rank alone
        return f"rank {rank}"


def _group_name(group: dist.ProcessGroup) -> str:
    return getattr(group, "group_name", "?")


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


def _run_gather(ctx) -> list[torch.Tensor]:
    """all_gather -> GEMMs: the ring of ``gather_ring`` with host waits, then the failure exchange (as above: every
    rank raises when one failed)."""
    why = unsupported_plan(ctx.plan)
    if why is not None:
        raise ValueError(f"flashoverlap: {why}")
    call = GatherCall(ctx)
    failure = run_host(call)
    buf = call.outs[0]
    _settle(failure, "all_gather", list(ctx.y_shape), buf, ctx.group, ctx.plan)
    return call.result()


class CpuRoute(LastResortRoute):
    """The route of every non-CUDA call (gloo): the schedule above, always."""

    name = "cpu"
    devices = ("cpu",)

    def make_launch(self, call, settings: config.Settings, ctx) -> tuple:
        return (call,)  # its all_to_all rows (``routes.make_call``: the one place that works them out)

    def execute(self, launch: tuple, ctx) -> torch.Tensor:
        call, a, y_shape = launch[0], ctx.a, ctx.y_shape
        if call.collective == "all_gather":
            return _run_gather(ctx)
        out = torch.empty(ctx.out_shape, dtype=a.dtype, device=a.device)
        buf = out.view(-1, y_shape[-1]) if call.collective == "all_reduce" else \
            torch.empty(call.rows, y_shape[-1], dtype=a.dtype, device=a.device)
        return _run(call.collective, a, ctx.b, ctx.bias, y_shape, ctx.group, call.plan, out, buf, call.send_rows,
                    call.recv_rows, ctx.settings.all_to_all_default_groups)


ROUTE = CpuRoute()

