"""The gather peer route's one-library-call path (``fo_gather_run``: the protocol's call, the GEMMs, the finish) on
the CPU, with the library faked: for every rank of a simulated 2-rank group (handshake start, bf16, the Linear
weights ``W.t()``), the route must hand the library the GEMM struct with every per-call field set (the shard, the
shards' tensor, each weight and its output, the pull events, the cuBLAS handle, the workspace where cuBLASLt is
bound, none under ``gather_gemm_ex`` or inside a capture), and return what the library wrote. The fake plays the
peers' pulls and computes each output in fp32 from the gathered rows. A failed call or GEMM raises with the
library's message; a finish that could not join records the call's tensors on the copy stream and raises."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.routes import gather_gemms, gather_peer, gather_start

WORLD, ROWS, K, NS = 2, 6, 16, (24, 8)


def _bytes_to(t: torch.Tensor, ptr: int) -> None:
    ctypes.memmove(ptr, t.contiguous().data_ptr(), t.numel() * t.element_size())


def _setup(monkeypatch, lt: bool):
    monkeypatch.setattr(gather_peer, "group_issue", lambda g: None)
    monkeypatch.setattr(gather_peer.compat, "group_timeout_ms", lambda g: 1000.0)
    monkeypatch.setattr(gather_peer.compat, "current_raw_stream", lambda i: 77)
    monkeypatch.setattr(gather_peer.symmetric, "order_after_last", lambda g, d, s: None)
    monkeypatch.setattr(gather_gemms, "usable", lambda dtype, experiments, probe: True)
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: 4242)
    monkeypatch.setattr(gather_gemms, "_bound", [True, lt])
    ws_tensor = torch.zeros(64, dtype=torch.uint8)
    monkeypatch.setattr(gather_gemms, "_workspaces", {None: ws_tensor})  # a CPU tensor's device index is None
    flags = SimpleNamespace(views=[torch.zeros(4) for _ in range(WORLD)],
                            events=[SimpleNamespace(cuda_event=100 + r) for r in range(WORLD)],
                            epoch=torch.zeros(1), fault=SimpleNamespace(block_ptr=None, mirror_ptr=None),
                            copy=SimpleNamespace(cuda_stream=None))
    buffers = [torch.zeros(WORLD * ROWS * K * 2, dtype=torch.uint8) for _ in range(WORLD)]
    ws = SimpleNamespace(flags=flags, views=buffers, serial=-1, capacity=buffers[0].numel())
    monkeypatch.setattr(gather_peer, "workspace", lambda group, device, need, capturing=False, push=False: ws)
    return ws_tensor


def _call(rank, shards, weights, settings, capturing=False):
    call = routes.Call("all_gather", WORLD * ROWS, sum(NS), K, torch.bfloat16, WORLD, rank, "cuda", None, "auto",
                       group_name="g")
    ctx = SimpleNamespace(a=shards[rank], b=weights, bias=[None] * len(NS), group=SimpleNamespace(group_name="g"),
                          y_shape=[WORLD * ROWS, K], gather_dim=0, return_gathered=True, capturing=capturing,
                          probe=None, settings=settings)
    launch = gather_peer.make_launch(call, settings, ctx)
    assert launch.gemms is not None and not launch.options & gather_start.PUSH  # bf16 W.t(): the library GEMMs
    return launch, ctx


@pytest.mark.parametrize("lt, experiments, capturing, expect_ws", [
    (True, frozenset(), False, True),
    (True, frozenset({"gather_gemm_ex"}), False, False),
    (True, frozenset(), True, False),
    (False, frozenset(), False, False),
])
def test_one_library_call_per_gather(monkeypatch, lt, experiments, capturing, expect_ws):
    ws_tensor = _setup(monkeypatch, lt)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(n, K, generator=gen).bfloat16().t() for n in NS]
    shards = [torch.randn(ROWS, K, generator=gen).bfloat16() for _ in range(WORLD)]
    gathered = torch.cat(shards)
    settings = config.current().replace(gather_start="handshake", experiments=experiments)
    for rank in range(WORLD):
        launch, ctx = _call(rank, shards, weights, settings, capturing)
        seen = []

        def run(pcall, pgemms, finish_rc, rank=rank, seen=seen):
            c, g = pcall._obj, pgemms._obj
            assert g.a == c.a == shards[rank].data_ptr() and g.staging == c.staging and g.cur_stream == 77
            assert g.handle == 4242 and g.rank == rank and g.num_weights == len(NS)
            assert [g.shard_events[r] for r in range(WORLD)] == [None if r == rank else 100 + r
                                                                 for r in range(WORLD)]
            assert [g.weights[i] for i in range(len(NS))] == [w.data_ptr() for w in weights]
            assert (g.workspace == ws_tensor.data_ptr()) if expect_ws else g.workspace is None
            assert g.workspace_bytes == (ws_tensor.numel() if expect_ws else 0)
            _bytes_to(gathered, c.staging)  # the pulls (and the own shard, copy_own) land in staging
            for i, w in enumerate(weights):
                _bytes_to((gathered.float() @ w.float()).bfloat16(), g.outputs[i])
            finish_rc._obj.value = 0
            seen.append(1)
            return 0

        lib = SimpleNamespace(fo_gather_run=run, fo_last_error=lambda: b"")
        monkeypatch.setattr(gather_peer.kernels, "library", lambda lib=lib: lib)
        before = dict(routes.stats)
        outs = gather_peer.ROUTE.execute(launch, ctx)
        assert seen == [1]
        assert routes.stats["gather:library_gemms"] == before.get("gather:library_gemms", 0) + 1
        assert routes.stats["gather:cublaslt"] == before.get("gather:cublaslt", 0) + int(expect_ws)
        for w, y in zip(weights, outs[:-1], strict=True):
            assert torch.equal(y, (gathered.float() @ w.float()).bfloat16())
        assert torch.equal(outs[-1], gathered)


@pytest.mark.parametrize("rc, finish", [(7, 0), (0, 5), (9, 5)])
def test_failures_raise_and_unjoined_tensors_stay_recorded(monkeypatch, rc, finish):
    _setup(monkeypatch, True)
    weights = [torch.zeros(n, K).bfloat16().t() for n in NS]
    shards = [torch.zeros(ROWS, K).bfloat16() for _ in range(WORLD)]
    launch, ctx = _call(0, shards, weights, config.current().replace(gather_start="handshake"))
    recorded = []
    monkeypatch.setattr(gather_peer, "unjoined", lambda ws, used: recorded.append(used))

    def run(pcall, pgemms, finish_rc):
        finish_rc._obj.value = finish
        return rc

    lib = SimpleNamespace(fo_gather_run=run, fo_last_error=lambda: b"the library's reason")
    monkeypatch.setattr(gather_peer.kernels, "library", lambda lib=lib: lib)
    with pytest.raises(kernels.KernelLibraryError, match="the library's reason") as got:
        gather_peer.ROUTE.execute(launch, ctx)
    assert ("fo_gather_run" if rc else "fo_gather_finish") in str(got.value)
    assert len(recorded) == int(finish != 0)
    if recorded:
        assert recorded[0][0] is not None and recorded[0][0].data_ptr() == shards[0].data_ptr()
