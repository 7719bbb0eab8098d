"""CPU tests of the direct NCCL route (``nccl_direct``, ``fused_launch``).

The route's NCCL calls are checked against the ``torch.distributed`` route they replace: every call must cover
exactly the rows that ``nccl_reference.group_collective`` passes as tensor slices (same pointers, same element counts,
same peers), for real schedules of every collective. The GPU run of both routes against eager is in
``tests/test_gpu_ops.py``.
"""

from __future__ import annotations

import ctypes

import nccl_reference
import pytest
import torch

from flashoverlap_inductor.native import kernels, nccl_direct
from flashoverlap_inductor.routes import nccl as nccl_route
from flashoverlap_inductor.schedule import plan as planlib
from flashoverlap_inductor.schedule import steps as sched


class RecordingComm:
    """Stands in for ``nccl_direct.Communicator``: records (kind, args) instead of calling NCCL."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def all_reduce(self, send, recv, count, dtype, stream):
        self.calls.append(("all_reduce", send, recv, count, dtype, stream))

    def reduce_scatter(self, send, recv, recv_count, dtype, stream):
        self.calls.append(("reduce_scatter", send, recv, recv_count, dtype, stream))

    def send_recv(self, sends, recvs, dtype, stream):
        self.calls.append(("send_recv", tuple(sends), tuple(recvs), dtype, stream))

    def reduce_pieces(self, pieces, recv, dtype, stream):
        self.calls.append(("reduce_pieces", tuple(pieces), recv, dtype, stream))


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 3)])
def test_direct_calls_cover_the_same_rows_as_torch_calls(collective, world, rank):
    rows, n, k, groups = 1000 if collective == "all_reduce" else 1024, 264, 64, 3
    align = 1 if collective == "all_reduce" else world
    plan = planlib.uniform_plan(rows, n, 128, 128, groups, align=align).to_str()
    steps = sched.schedule_steps(collective, plan, rows, n, k, "bfloat16", world, rank)
    buf = torch.empty(rows, n, dtype=torch.bfloat16)
    out_rows = rows // world if collective == "reduce_scatter" else rows
    out_flat = buf if collective == "all_reduce" else torch.empty(out_rows, n, dtype=torch.bfloat16)
    covered = 0
    for step in steps:
        comm = RecordingComm()
        nccl_reference.issue_group(comm, collective, step, buf, out_flat, stream=1234)
        if collective == "all_reduce":
            ptr, count = _span(buf[step.lo:step.hi])
            assert comm.calls == [("all_reduce", ptr, ptr, count, torch.bfloat16, 1234)]
            covered += count
        elif collective == "reduce_scatter":
            send, _ = _span(buf[step.lo:step.hi])
            recv, count = _span(out_flat[step.out[0]:step.out[1]])
            assert count * world == (step.hi - step.lo) * n
            assert comm.calls == [("reduce_scatter", send, recv, count, torch.bfloat16, 1234)]
            covered += count
        else:
            sends = tuple((j, *_span(buf[lo:hi])) for j, lo, hi in step.sends if hi > lo)
            recvs = tuple((j, *_span(out_flat[lo:hi])) for j, lo, hi in step.recvs if hi > lo)
            assert comm.calls == ([("send_recv", sends, recvs, torch.bfloat16, 1234)] if sends or recvs else [])
            assert all(j != rank for j, _, _ in sends + recvs)  # our own rows go by the local copy
            covered += sum(c for _, _, c in recvs) + (step.local[2] * n if step.local else 0)
    assert covered == out_flat.numel()  # every output element is produced by exactly one call


def test_direct_all_to_all_local_rows_are_copied():
    world, rank, rows, n = 2, 1, 512, 128
    plan = planlib.uniform_plan(rows, n, 128, 128, 2, align=world).to_str()
    steps = sched.schedule_steps("all_to_all", plan, rows, n, 64, "float16", world, rank)
    buf = torch.randn(rows, n).to(torch.float16)
    out = torch.full((rows, n), float("nan"), dtype=torch.float16)
    for step in steps:
        nccl_reference.issue_group(RecordingComm(), "all_to_all", step, buf, out, stream=0)
        if step.local is not None:
            b_lo, o_lo, count = step.local
            assert torch.equal(out[o_lo:o_lo + count], buf[b_lo:b_lo + count])


def test_mapped_library_paths_and_versions(tmp_path, monkeypatch):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /site/nvidia/nccl/lib/libnccl.so.2\n"
        "7f04-7f05 r--p 00001000 08:01 2 /site/nvidia/nccl/lib/libnccl.so.2\n"
        "7f06-7f07 rw-p 00000000 00:00 0 [heap]\n"
        "7f08-7f09 rw-p 00000000 00:00 0\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **kw: real_open(maps if p == "/proc/self/maps" else p, *a, **kw))
    assert nccl_direct._mapped_nccl_paths() == ["/site/nvidia/nccl/lib/libnccl.so.2"]
    assert nccl_direct._version_code((2, 28, 9)) == 22809
    assert nccl_direct._version_code((2, 8, 4)) == 2804
    assert nccl_direct._version_code(22809) == 22809


def test_no_communicator_means_no_nccl_route():
    class NoNccl:  # a gloo-like group: no CUDA backend, no _comm_ptr
        def _get_backend(self, device):
            raise RuntimeError("no backend for cuda")

        def size(self):
            return 2

        def rank(self):
            return 0

    assert nccl_direct.communicator(NoNccl(), torch.device("cuda", 0)) is None


@pytest.mark.parametrize("world,rank", [(2, 1), (4, 2)])
def test_c_reduce_pieces_match_the_python_route(world, rank):
    """reduce_scatter on the "schedule" route (natural rows, ``row_order``): the C step (kind reduce_pieces) makes
    the same ncclReduce calls -- root, pointer, count, receive pointer -- as ``nccl_direct.issue_group``."""
    from flashoverlap_inductor.schedule import row_order

    rows, n, k = 1024, 264, 64
    plan = planlib.uniform_plan(rows, n, 128, 128, 3, align=world)
    layout = planlib.buffer_layout(plan, planlib.chunks_for("reduce_scatter", rows, world))
    steps = sched.schedule_steps("reduce_scatter", plan.to_str(), rows, n, k, "bfloat16", world, rank)
    nat = row_order.natural_order("reduce_scatter", layout, steps, 128, 128, n)
    c = nccl_route.group_steps("reduce_scatter", nat.steps, nat.tiles, n)
    d = torch.empty(rows, n, dtype=torch.bfloat16)
    out = torch.empty(rows // world, n, dtype=torch.bfloat16)
    b0, o0, es = d.data_ptr(), out.data_ptr(), d.element_size()
    for g, step in enumerate(nat.steps):
        comm = RecordingComm()
        nccl_reference.issue_group(comm, "reduce_scatter", step, d, out, stream=0)
        s = c.steps[g]
        assert s.kind == kernels.STEP_KINDS["reduce_pieces"] and s.num_p2p == world
        entries = [c.p2p[s.first_p2p + i] for i in range(s.num_p2p)]
        pieces = tuple((e.peer, b0 + e.offset * es, e.count) for e in entries)
        assert sorted(e.peer for e in entries) == list(range(world)) and not any(e.recv for e in entries)
        assert comm.calls == [("reduce_pieces", pieces, o0 + s.out_offset * es, torch.bfloat16, 0)]
        assert s.out_offset == step.out[0] * n and all(e.count == (step.out[1] - step.out[0]) * n for e in entries)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("world,rank", [(2, 1), (4, 2)])
def test_c_steps_match_the_python_route(collective, world, rank):
    """``nccl_route.group_steps`` (what ``fo_fused_call`` runs) describes the same NCCL calls, element for
    element, as ``nccl_direct.issue_group`` makes from Python, plus the GEMM's tiles per group."""
    rows, n, k = 1024, 264, 64
    plan = planlib.uniform_plan(rows, n, 128, 128, 3, align=1 if collective == "all_reduce" else world).to_str()
    steps = sched.schedule_steps(collective, plan, rows, n, k, "bfloat16", world, rank)
    tiles = [7 + g for g in range(len(steps))]
    c = nccl_route.group_steps(collective, steps, tiles, n)
    assert c.groups == len(steps) and c.steps_ptr == ctypes.addressof(c.steps)
    buf = torch.empty(rows, n, dtype=torch.bfloat16)
    out = buf if collective == "all_reduce" else torch.empty(rows // world if collective == "reduce_scatter"
                                                              else rows, n, dtype=torch.bfloat16)
    b0, o0, es = buf.data_ptr(), out.data_ptr(), buf.element_size()
    for g, step in enumerate(steps):
        comm = RecordingComm()
        nccl_reference.issue_group(comm, collective, step, buf, out, stream=0)
        s = c.steps[g]
        assert s.tiles == tiles[g]
        if collective == "all_reduce":
            assert comm.calls == ([("all_reduce", b0 + s.buf_offset * es, b0 + s.buf_offset * es, s.count,
                                    torch.bfloat16, 0)] if s.kind == 0 else [])
        elif collective == "reduce_scatter":
            assert comm.calls == ([("reduce_scatter", b0 + s.buf_offset * es, o0 + s.out_offset * es, s.count,
                                    torch.bfloat16, 0)] if s.kind == 1 else [])
        else:
            assert s.kind == 2
            entries = [c.p2p[s.first_p2p + i] for i in range(s.num_p2p)]
            sends = tuple((e.peer, b0 + e.offset * es, e.count) for e in entries if not e.recv)
            recvs = tuple((e.peer, o0 + e.offset * es, e.count) for e in entries if e.recv)
            assert comm.calls == ([("send_recv", sends, recvs, torch.bfloat16, 0)] if entries else [])
            local = (step.local[0] * n, step.local[1] * n, step.local[2] * n) if step.local else (0, 0, 0)
            assert (s.local_buf, s.local_out, s.local_count) == local
