"""The all_reduce pull route (``routes/reduce_pull.py``) on the CPU, with the library faked.

Which calls it takes (pure: the same at compile time, so the pass predicts it): under ``all_reduce_route="pull"``
every 2-rank bf16 all_reduce with at least as many rows as pieces, under ``"peer"`` (the default) none, under
``"auto"`` where ``cost_model.pull.prefers_pull`` says so for all_reduce (host floors counted where the settings count
them: only the largest GEMMs eagerly; nearly every shape without them); the registry then prefers it to the peer
route. ``make_launch`` declines a bias, a batched or strided weight and a receive buffer past ``gather_push_max_mb``.
For both ranks of a simulated pair, ``execute`` must hand ``fo_scatter_run`` the protocol's struct (``a`` = the
output, the push option, the slot sets alternating, the output for the poison) and the GEMM struct with ``all_reduce
= 1`` and every field set (the halves, the pieces and their cuts, the weight's layout, ``a``, no ``part``, ``out``,
the cuBLAS handle, the workspace), and return what the library wrote (the fake writes the fp32 all_reduce of both
ranks' GEMMs). A failed call raises with the library's message; a finish that could not join records the call's
tensors on the copy stream; torch's matmul settings forbidding the library's GEMMs decline the call."""

from __future__ import annotations

import ctypes
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_scatter_run_cpu import ROWS, K, N
from test_scatter_run_cpu import _setup as scatter_setup

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.cost_model import pull
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.routes import gather_gemms, gather_start, reduce_pull
from flashoverlap_inductor.tune import rows


def _setup(monkeypatch):
    """``test_scatter_run_cpu``'s fakes (the group check, streams, cuBLAS bound with cuBLASLt, the push workspace of
    ``ROWS`` x ``N`` outputs), and the library available; returns cuBLASLt's workspace."""
    monkeypatch.setattr(reduce_pull.kernels, "available", lambda: True)
    return scatter_setup(monkeypatch, True)


def _call(rank=0, dtype=torch.bfloat16, rows=ROWS, world=2, collective="all_reduce", compile_time=False):
    return routes.Call(collective, rows, N, K, dtype, world, rank, "cuda", None, "auto", group_name="g",
                       compile_time=compile_time)


def _launch(rank, a, w, settings, bias=None):
    ctx = SimpleNamespace(a=a, b=w, bias=bias, group=SimpleNamespace(group_name="g"), y_shape=[ROWS, N],
                          out_shape=[ROWS, N], capturing=False, probe=None, settings=settings)
    return reduce_pull.make_launch(_call(rank), settings, ctx), ctx


def test_which_calls_it_takes(monkeypatch):
    monkeypatch.setattr(reduce_pull.kernels, "available", lambda: True)
    on = config.current().replace(all_reduce_route="pull", transport="peer")
    assert config.current().tuning.all_reduce_route == "peer" and config.current().tuning.all_reduce_pieces == 4
    assert reduce_pull.unsupported(_call(), on.replace(all_reduce_route="peer")) == "all_reduce_route is 'peer'"
    assert reduce_pull.unsupported(_call(), on) is None
    assert reduce_pull.unsupported(_call(compile_time=True), on) is None
    assert "reduce_scatter" in reduce_pull.unsupported(_call(collective="reduce_scatter"), on)
    assert "world size 4" in reduce_pull.unsupported(_call(world=4), on)
    assert "rows" in reduce_pull.unsupported(_call(rows=7), on)
    assert "rows" in reduce_pull.unsupported(_call(rows=2), on)  # fewer rows than pieces
    assert "dtype" in reduce_pull.unsupported(_call(dtype=torch.float16), on)
    assert "nccl" in reduce_pull.unsupported(_call(), on.replace(transport="nccl"))
    assert routes.select(_call(), on).name == "reduce_pull"
    assert routes.cost_args(_call(compile_time=True), on)["pull"] is True
    monkeypatch.setattr(reduce_pull.kernels, "available", lambda: False)
    assert "library" in reduce_pull.unsupported(_call(), on)
    for bad in (0, 9):
        with pytest.raises(Exception, match="all_reduce_pieces"):
            on.replace(all_reduce_pieces=bad)


def test_auto_weighs_the_host_floors(monkeypatch):
    """``"auto"`` on H200 data: eagerly (host floors counted) a small output stays on the peer route and the largest
    GEMM takes this one; without the floors (CUDA-graph replays: ``host_floors="off"``) both take it. With no peer
    route to compare with, this one; with ``ring="all"``, never."""
    monkeypatch.setattr(reduce_pull.kernels, "available", lambda: True)
    monkeypatch.setattr(reduce_pull.scatter_pull.peer.ROUTE, "unsupported", lambda call, settings: None)
    monkeypatch.setattr(reduce_pull.scatter_pull, "device_name", lambda call: "NVIDIA H200")
    auto = config.current().replace(transport="peer", all_reduce_route="auto")
    small = routes.Call("all_reduce", 4096, 4096, 4096, torch.bfloat16, 2, 0, "cuda")
    large = routes.Call("all_reduce", 16384, 8192, 14336, torch.bfloat16, 2, 0, "cuda")
    assert "peer route faster" in reduce_pull.unsupported(small, auto)
    assert reduce_pull.unsupported(large, auto) is None
    graphs = auto.replace(host_floors="off")
    assert reduce_pull.unsupported(small, graphs) is None and reduce_pull.unsupported(large, graphs) is None
    assert reduce_pull.unsupported(large, auto.replace(ring="all")) is not None
    monkeypatch.setattr(reduce_pull.scatter_pull.peer.ROUTE, "unsupported", lambda call, settings: "no peer route")
    assert reduce_pull.unsupported(small, auto) is None


def test_make_launch_declines(monkeypatch):
    _setup(monkeypatch)
    a, w = torch.zeros(ROWS, K).bfloat16(), torch.zeros(N, K).bfloat16().t()
    on = config.current().replace(all_reduce_route="pull", all_reduce_pieces=2)
    launch = _launch(0, a, w, on)[0]
    assert isinstance(launch, reduce_pull.ReduceLaunch) and rows.route_of_launch(launch.description) == "pull"
    assert _launch(0, a, w, on, bias=torch.zeros(N).bfloat16())[0].startswith("bias")
    assert _launch(0, a, torch.zeros(K, 2 * N).bfloat16()[:, :N], on)[0].startswith("weight")
    assert _launch(0, a, torch.zeros(2, K, N).bfloat16(), on)[0].startswith("bmm")
    monkeypatch.setattr(gather_start, "push_fits", lambda settings, world, shard: False)
    assert _launch(0, a, w, on)[0].startswith("buffer")


@pytest.mark.parametrize("layout", ["linear", "row_major"])
@pytest.mark.parametrize("pieces", [1, 3, 8])
def test_one_library_call_per_all_reduce(monkeypatch, layout, pieces):
    lt_ws = _setup(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    a = [torch.randn(ROWS, K, generator=gen).bfloat16() for _ in range(2)]
    if layout == "linear":
        w = [torch.randn(N, K, generator=gen).bfloat16().t() for _ in range(2)]
    else:
        w = [torch.randn(K, N, generator=gen).bfloat16() for _ in range(2)]
    full = sum(x.float() @ y.float() for x, y in zip(a, w, strict=True)).bfloat16()
    settings = config.current().replace(all_reduce_route="pull", all_reduce_pieces=pieces)
    for rank in range(2):
        launch, ctx = _launch(rank, a[rank], w[rank], settings)
        assert f"in {pieces} pieces" in launch.description
        assert launch.buffer_bytes == gather_start.SLOT_SETS * ROWS * N * 2  # two sets of the whole output
        seen = []

        def run(pcall, pgemm, finish_rc, rank=rank, seen=seen):
            c, g = pcall._obj, pgemm._obj
            assert c.a == g.out and c.options == gather_start.PUSH and c.staging is None and c.cur_stream == 77
            assert c.shard_bytes == ROWS // 2 * N * 2 and c.world == 2 and c.rank == rank
            assert c.slot_set == len(seen) % gather_start.SLOT_SETS and c.num_outputs == 1
            assert c.outputs[0] == g.out and c.output_numel[0] == ROWS * N
            assert (g.half_rows, g.n, g.k, g.pieces, g.all_reduce) == (ROWS // 2, N, K, pieces, 1)
            assert g.weight_transposed == int(layout == "linear") and g.weight == w[rank].data_ptr()
            assert g.a == a[rank].data_ptr() and g.part is None and g.handle == 4242 and g.elem_type == 14
            assert g.workspace == lt_ws.data_ptr() and g.workspace_bytes == lt_ws.numel()
            assert list(g.cuts)[:pieces + 1] == reduce_pull.cuts_for(_call(rank), settings)
            ctypes.memmove(g.out, full.data_ptr(), full.numel() * 2)
            finish_rc._obj.value = 0
            seen.append(1)
            return 0

        lib = SimpleNamespace(fo_scatter_run=run, fo_last_error=lambda: b"")
        monkeypatch.setattr(reduce_pull.kernels, "library", lambda lib=lib: lib)
        before = routes.stats["reduce:library"]
        for _ in range(2):  # two calls: the slot sets alternate
            assert torch.equal(reduce_pull.ROUTE.execute(launch, ctx), full)
        assert seen == [1, 1] and routes.stats["reduce:library"] == before + 2


@pytest.mark.parametrize("rc, finish", [(7, 0), (0, 5), (9, 5)])
def test_failures_raise_and_unjoined_tensors_stay_recorded(monkeypatch, rc, finish):
    _setup(monkeypatch)
    a, w = torch.zeros(ROWS, K).bfloat16(), torch.zeros(N, K).bfloat16().t()
    launch, ctx = _launch(0, a, w, config.current().replace(all_reduce_route="pull", all_reduce_pieces=2))
    recorded = []
    monkeypatch.setattr(reduce_pull.gather_protocol, "unjoined", lambda ws, used: recorded.append(used))

    def run(pcall, pgemm, finish_rc):
        finish_rc._obj.value = finish
        return rc

    lib = SimpleNamespace(fo_scatter_run=run, fo_last_error=lambda: b"the library's reason")
    monkeypatch.setattr(reduce_pull.kernels, "library", lambda lib=lib: lib)
    with pytest.raises(kernels.KernelLibraryError, match="the library's reason") as got:
        reduce_pull.ROUTE.execute(launch, ctx)
    assert ("fo_scatter_run" if rc else "fo_gather_finish") in str(got.value)
    assert len(recorded) == int(finish != 0)
    if recorded:
        assert recorded[0][0].data_ptr() == a.data_ptr()


def test_matmul_settings_that_forbid_the_library_decline(monkeypatch):
    _setup(monkeypatch)
    a, w = torch.zeros(ROWS, K).bfloat16(), torch.zeros(N, K).bfloat16().t()
    launch, ctx = _launch(0, a, w, config.current().replace(all_reduce_route="pull", all_reduce_pieces=2))
    monkeypatch.setattr(gather_gemms, "usable", lambda dtype, experiments, probe: False)
    lib = SimpleNamespace(fo_scatter_run=lambda *args: pytest.fail("the library call"))
    monkeypatch.setattr(reduce_pull.kernels, "library", lambda lib=lib: lib)
    assert reduce_pull.ROUTE.execute(launch, ctx).startswith("matmul settings")


def test_piece_cuts_shrink_where_the_gemm_outlasts_the_pushes():
    """Compute-bound (the pushes far shorter than the GEMM): pieces halving, on 64 rows, the last the smallest;
    push-bound: even pieces; pieces below ``min_rows`` (one wave of tiles) are avoided, else even pieces."""
    rows, n = 16384, 8192
    push_ms = rows * n * 2 / pull.PUSH_BYTES_PER_MS
    cuts = pull.piece_cuts(rows, n, 10 * push_ms, 4, 528)
    sizes = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    assert cuts[0] == 0 and cuts[-1] == rows and all(c % pull.CUT_ALIGN == 0 for c in cuts)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < rows // 8, sizes
    assert abs(sizes[0] / sizes[1] - 2) < 0.1  # q = 0.5
    assert pull.piece_cuts(rows, n, push_ms, 4) == [0, 4096, 8192, 12288, 16384]  # q = 1: even
    assert pull.piece_cuts(2048, n, 10 * push_ms, 4, 528) == [0, 512, 1024, 1536, 2048]  # no cut fills a wave
    tight = pull.piece_cuts(rows, n, 10 * push_ms, 4, 3000)
    assert min(b - a for a, b in zip(tight, tight[1:], strict=False)) >= 3000 and tight != cuts  # q raised


def test_the_cuts_follow_the_h200_gemm_model():
    """Both ranks cut alike from the shape and the data (``cuts_for``); an 8192 x 4096 output at K 4096 per rank
    (the GPU test's uneven shape) shrinks, the experiment ``reduce_even_pieces`` keeps pieces even."""
    on = config.current().replace(all_reduce_route="pull", all_reduce_pieces=3)
    call = routes.Call("all_reduce", 8192, 4096, 4096, torch.bfloat16, 2, 0, "cuda", None, "auto")
    cuts = reduce_pull.cuts_for(call, on)
    sizes = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    assert cuts[0] == 0 and cuts[-1] == 8192 and sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] + 64
    assert cuts == reduce_pull.cuts_for(dataclasses.replace(call, rank=1), on)
    even = on.replace(experiments=frozenset({reduce_pull.EVEN_PIECES}))
    assert reduce_pull.cuts_for(call, even) == [0, 2730, 5461, 8192]


def test_a_failing_cost_model_cuts_evenly(monkeypatch):
    """The cuts' cost model raising: even pieces (the same on every rank), never the call's error."""
    def broken(*args, **kw):
        raise RuntimeError("no data")

    monkeypatch.setattr(reduce_pull.registry, "model_for", broken)
    call = routes.Call("all_reduce", 8192, 4096, 4096, torch.bfloat16, 2, 0, "cuda", None, "auto")
    on = config.current().replace(all_reduce_route="pull", all_reduce_pieces=4)
    assert reduce_pull.cuts_for(call, on) == [0, 2048, 4096, 6144, 8192]
