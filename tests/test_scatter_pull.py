"""``routes/scatter_pull.py`` on the CPU: which calls it declines (pure, the experiment first), where the registry puts
it, the bias forms, and the halves' arithmetic (each rank's own half plus the peer's part of it is that half of the
reduce_scatter of every rank's ``a @ b (+ bias)``) with the route's own ``half_gemm``."""

from __future__ import annotations

import pytest
import torch

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.routes import scatter_pull


def _call(collective="reduce_scatter", rows=256, world=2, dtype=torch.bfloat16, device="cuda", compile_time=False):
    return routes.Call(collective, rows, 128, 64, dtype, world, 0, device, None, "auto", group_name="g",
                       compile_time=compile_time)


ON = config.current().replace(experiments=frozenset({"scatter_pull"}))


def test_declines_until_the_experiment_is_on(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert "experiments" in scatter_pull.unsupported(_call(), config.current())
    assert scatter_pull.unsupported(_call(), ON) is None
    assert scatter_pull.unsupported(_call(), config.current().replace(experiments=frozenset({"scatter_pull_all"}))) \
        is None
    assert "compile time" in scatter_pull.unsupported(_call(compile_time=True), ON)
    assert "all_reduce" in scatter_pull.unsupported(_call("all_reduce"), ON)
    assert "world size 3" in scatter_pull.unsupported(_call(world=3), ON)
    assert "halves" in scatter_pull.unsupported(_call(rows=255), ON)
    assert "dtype" in scatter_pull.unsupported(_call(dtype=torch.int8), ON)
    assert "nccl" in scatter_pull.unsupported(_call(), ON.replace(transport="nccl"))
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert "library" in scatter_pull.unsupported(_call(), ON)


def test_the_registry_prefers_it_only_under_the_experiment(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert routes.REGISTRY[0] is scatter_pull.ROUTE
    assert routes.select(_call(), ON).name == "scatter_pull"
    assert routes.select(_call(), config.current()).name != "scatter_pull"
    assert routes.select(_call(compile_time=True), ON).name == "peer"  # the pass predicts what runs without it
    assert routes.select(_call(device="cpu"), ON).name == "cpu"


def test_bias_forms():
    y = [4, 64, 128]
    assert scatter_pull.bias_form(None, y) is None
    assert scatter_pull.bias_form(torch.zeros(128), y) == "row"
    assert scatter_pull.bias_form(torch.zeros(1, 128), y) == "row"
    assert scatter_pull.bias_form(torch.zeros(4, 64, 128), y) == "full"
    assert scatter_pull.bias_form(torch.zeros(4, 1, 128), y) == "other"
    assert scatter_pull.bias_form(torch.zeros(()), y) == "row" and scatter_pull.bias_form(torch.zeros(1), y) == "row"
    assert scatter_pull.bias_form(torch.zeros(()), [4, 1]) == "row"  # a 0-d bias with N = 1


@pytest.mark.parametrize("form", [None, "row", "full"])
def test_halves_sum_to_the_reduce_scatter(form):
    gen = torch.Generator().manual_seed(3)
    rows, k, n = 16, 8, 12
    a = [torch.randn(rows, k, generator=gen, dtype=torch.float64) for _ in range(2)]
    b = [torch.randn(k, n, generator=gen, dtype=torch.float64) for _ in range(2)]
    c = [None if form is None else torch.randn(n if form == "row" else (rows, n), generator=gen,
                                               dtype=torch.float64) for _ in range(2)]
    full = sum(x @ w + (0 if cc is None else cc) for x, w, cc in zip(a, b, c, strict=True))
    half = rows // 2

    def bias_rows(cc, h):
        return None if cc is None else cc if form == "row" else cc[h * half:(h + 1) * half]

    for rank in range(2):
        peer = 1 - rank
        part_from_peer = scatter_pull.half_gemm(a[peer][rank * half:(rank + 1) * half], b[peer],
                                                bias_rows(c[peer], rank))
        out = torch.empty(half, n, dtype=torch.float64)
        scatter_pull.half_gemm(a[rank][rank * half:(rank + 1) * half], b[rank], bias_rows(c[rank], rank), out=out)
        out.add_(part_from_peer)
        torch.testing.assert_close(out, full[rank * half:(rank + 1) * half])
