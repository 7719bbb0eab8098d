"""The reduce_scatter pull route's one-library-call path (``fo_scatter_run``, ``scatter_pieces`` > 0) on the CPU, with
the library faked: for both ranks of a simulated pair (push schedule, bf16, the Linear weight ``W.t()`` or a
contiguous ``[K, N]``), the route must hand the library the protocol's struct (``a`` = the part buffer, the push
option, the slot sets alternating) and the GEMM struct with every field set (the halves, the pieces, the weight's
layout, ``a``, ``part``, ``out``, the cuBLAS handle, the workspace where cuBLASLt is bound), and return what the
library wrote; inside a CUDA-graph capture the Python path runs instead. The fake computes this rank's half of the
reduce_scatter in fp32. Calls with a bias, another dtype, ``scatter_pieces=0`` or more pieces than rows keep the
Python path. A failed call raises with the library's message; a finish that could not join records the call's
tensors on the copy stream."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.routes import gather_gemms, gather_peer, gather_start, scatter_pull

ROWS, K, N = 8, 16, 24


def _setup(monkeypatch, lt: bool):
    monkeypatch.setattr(gather_peer, "group_issue", lambda g: None)
    monkeypatch.setattr(gather_peer, "_push_calls", {})
    monkeypatch.setattr(scatter_pull.compat, "group_timeout_ms", lambda g: 1000.0)
    monkeypatch.setattr(scatter_pull.compat, "current_raw_stream", lambda i: 77)
    monkeypatch.setattr(scatter_pull.symmetric, "order_after_last", lambda g, d, s: None)
    monkeypatch.setattr(gather_gemms, "usable", lambda dtype, experiments, probe: True)
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: 4242)
    monkeypatch.setattr(gather_gemms, "_bound", [True, lt])
    lt_ws = torch.zeros(64, dtype=torch.uint8)
    monkeypatch.setattr(gather_gemms, "_workspaces", {None: lt_ws})  # a CPU tensor's device index is None
    flags = SimpleNamespace(views=[torch.zeros(4) for _ in range(2)],
                            events=[SimpleNamespace(cuda_event=100 + r) for r in range(2)],
                            epoch=torch.zeros(1), fault=SimpleNamespace(block_ptr=None, mirror_ptr=None),
                            copy=SimpleNamespace(cuda_stream=None))
    receive = [torch.zeros(gather_start.SLOT_SETS * ROWS * N * 2, dtype=torch.uint8) for _ in range(2)]
    ws = SimpleNamespace(flags=flags, views=receive, serial=-1, capacity=receive[0].numel())
    monkeypatch.setattr(gather_peer, "workspace", lambda *args, **kw: ws)
    return lt_ws


def _launch(rank, a, w, settings, bias=None, capturing=False, dtype=torch.bfloat16):
    call = routes.Call("reduce_scatter", ROWS, N, K, dtype, 2, rank, "cuda", None, "auto", group_name="g")
    ctx = SimpleNamespace(a=a, b=w, bias=bias, group=SimpleNamespace(group_name="g"), y_shape=[ROWS, N],
                          out_shape=[ROWS // 2, N], capturing=capturing, probe=None, settings=settings)
    return scatter_pull.make_launch(call, settings, ctx), ctx


@pytest.mark.parametrize("lt, expect_ws", [(True, True), (False, False)])
@pytest.mark.parametrize("layout", ["linear", "row_major"])
@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_one_library_call_per_reduce_scatter(monkeypatch, lt, expect_ws, layout, pieces):
    lt_ws = _setup(monkeypatch, lt)
    gen = torch.Generator().manual_seed(7)
    a = [torch.randn(ROWS, K, generator=gen).bfloat16() for _ in range(2)]
    if layout == "linear":
        w = [torch.randn(N, K, generator=gen).bfloat16().t() for _ in range(2)]
    else:
        w = [torch.randn(K, N, generator=gen).bfloat16() for _ in range(2)]
    full = sum(x.float() @ y.float() for x, y in zip(a, w, strict=True))
    settings = config.current().replace(scatter_route="pull", scatter_start="push", scatter_pieces=pieces)
    half = ROWS // 2
    for rank in range(2):
        launch, ctx = _launch(rank, a[rank], w[rank], settings)
        assert launch.gemm is not None and launch.options == gather_start.PUSH
        assert f"one library call, {pieces} pieces" in launch.description
        seen = []

        def run(pcall, pgemm, finish_rc, rank=rank, seen=seen):
            c, g = pcall._obj, pgemm._obj
            assert c.a == g.part and c.options == gather_start.PUSH and c.staging is None and c.cur_stream == 77
            assert c.slot_set == len(seen) % gather_start.SLOT_SETS and c.num_outputs == 1
            assert c.outputs[0] == g.out and c.output_numel[0] == half * N
            assert (g.half_rows, g.n, g.k, g.pieces) == (half, N, K, pieces)
            assert g.weight_transposed == int(layout == "linear") and g.weight == w[rank].data_ptr()
            assert g.a == a[rank].data_ptr() and g.handle == 4242 and g.elem_type == 14
            assert (g.workspace == lt_ws.data_ptr()) if expect_ws else g.workspace is None
            mine = full[rank * half:(rank + 1) * half].bfloat16().contiguous()
            ctypes.memmove(g.out, mine.data_ptr(), mine.numel() * 2)
            finish_rc._obj.value = 0
            seen.append(1)
            return 0

        lib = SimpleNamespace(fo_scatter_run=run, fo_last_error=lambda: b"")
        monkeypatch.setattr(scatter_pull.kernels, "library", lambda lib=lib: lib)
        before = routes.stats["scatter:library"]
        for _ in range(2):  # two calls: the slot sets alternate
            out = scatter_pull.ROUTE.execute(launch, ctx)
            assert torch.equal(out, full[rank * half:(rank + 1) * half].bfloat16())
        assert seen == [1, 1] and routes.stats["scatter:library"] == before + 2


def test_calls_the_library_path_does_not_take(monkeypatch):
    _setup(monkeypatch, True)
    a, w = torch.zeros(ROWS, K).bfloat16(), torch.zeros(N, K).bfloat16().t()
    on = config.current().replace(scatter_route="pull", scatter_start="push")
    assert on.tuning.scatter_pieces == 1  # the default
    assert _launch(0, a, w, on)[0].gemm is not None
    assert _launch(0, a, w, on.replace(scatter_pieces=0))[0].gemm is None
    assert _launch(0, a, w, on.replace(scatter_pieces=ROWS // 2 + 1))[0].gemm is None  # more pieces than rows
    assert _launch(0, a, w, on.replace(scatter_start="handshake"))[0].gemm is None
    with_bias = on.replace(experiments=frozenset({"scatter_pull"}))
    assert _launch(0, a, w, with_bias, bias=torch.zeros(N).bfloat16())[0].gemm is None
    assert _launch(0, a.float(), w.float(), on, dtype=torch.float32)[0].gemm is None
    assert _launch(0, a, torch.zeros(K, 2 * N).bfloat16()[:, :N], on)[0].gemm is None  # strided weight
    with pytest.raises(Exception, match="scatter_pieces"):
        on.replace(scatter_pieces=9)


@pytest.mark.parametrize("rc, finish", [(7, 0), (0, 5), (9, 5)])
def test_failures_raise_and_unjoined_tensors_stay_recorded(monkeypatch, rc, finish):
    _setup(monkeypatch, True)
    a, w = torch.zeros(ROWS, K).bfloat16(), torch.zeros(N, K).bfloat16().t()
    launch, ctx = _launch(0, a, w, config.current().replace(scatter_route="pull", scatter_start="push"))
    recorded = []
    monkeypatch.setattr(scatter_pull.gather_protocol, "unjoined", lambda ws, used: recorded.append(used))

    def run(pcall, pgemm, finish_rc):
        finish_rc._obj.value = finish
        return rc

    lib = SimpleNamespace(fo_scatter_run=run, fo_last_error=lambda: b"the library's reason")
    monkeypatch.setattr(scatter_pull.kernels, "library", lambda lib=lib: lib)
    with pytest.raises(kernels.KernelLibraryError, match="the library's reason") as got:
        scatter_pull.ROUTE.execute(launch, ctx)
    assert ("fo_scatter_run" if rc else "fo_gather_finish") in str(got.value)
    assert len(recorded) == int(finish != 0)
    if recorded:
        assert recorded[0][1] is a


def test_captured_calls_take_the_python_path(monkeypatch):
    _setup(monkeypatch, True)
    a, w = torch.zeros(ROWS, K).bfloat16(), torch.zeros(N, K).bfloat16().t()
    launch, ctx = _launch(0, a, w, config.current().replace(scatter_route="pull", scatter_start="push"),
                          capturing=True)
    python_path = []

    def half_gemm(*args, **kw):
        python_path.append(1)
        raise RuntimeError("the Python path")

    monkeypatch.setattr(scatter_pull, "half_gemm", half_gemm)
    lib = SimpleNamespace(fo_scatter_run=lambda *args: pytest.fail("the library call inside a capture"))
    monkeypatch.setattr(scatter_pull.kernels, "library", lambda lib=lib: lib)
    with pytest.raises(RuntimeError, match="the Python path"):
        scatter_pull.ROUTE.execute(launch, ctx)
    assert python_path == [1]
