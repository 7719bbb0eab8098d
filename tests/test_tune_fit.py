"""CPU tests of ``tune fit`` (``flashoverlap_inductor.tune_fit``): the fused-path parameters it fits are the ones
that generated the rows, and ``--write`` stores them where the cost model reads them."""

from __future__ import annotations

import dataclasses
import json

from flashoverlap_inductor import tune, tune_fit
from flashoverlap_inductor.cost_model import model_for, registry
from flashoverlap_inductor.plan import uniform_plan

SHAPES = [(8192, 8192, 8192), (16384, 8192, 7168)]


def _bench_doc(model, variant: str) -> dict:
    rows = []
    for op in ("all_reduce", "reduce_scatter"):
        for world in (2, 4):
            for m, n, k in SHAPES:
                for groups in (2, 5):
                    plan = uniform_plan(m, n, 128, 256, groups, align=1 if op == "all_reduce" else world)
                    row = {"op": op, "m": m, "n": n, "k": k, "world": world, "plan": plan.to_str(),
                           "fused_path": True, "fused_ms": 1.0, "variants": {}}
                    row["variants"][variant] = {"ms": tune_fit.predict(model, row)}
                    rows.append(row)
    return {"meta": {"gpu": model.gemm.gpu}, "rows": rows}


def test_fit_recovers_the_parameters_that_made_the_rows(tmp_path):
    base = model_for("NVIDIA H200")[0]
    truth = dataclasses.replace(base, gemm=dataclasses.replace(
        base.gemm, nccl_sms=0, kernel_efficiency=0.9, fused_gemm_slowdown=0.25, comm_slowdown=0.6, grid="tiles"),
        call_overhead_ms=0.02)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_bench_doc(truth, "tiles/direct")))
    rows, gpu = tune_fit.load_rows([str(path)], "tiles/direct")
    assert gpu == "NVIDIA H200" and len(rows) == 2 * 2 * len(SHAPES) * 2
    got = tune_fit.fit(base, rows, "tiles")
    assert (got["kernel_efficiency"], got["gemm_slowdown"], got["comm_slowdown"], got["group_overhead_ms"]) == \
        (0.9, 0.25, 0.6, 0.02), got
    assert got["median_rel_error"] < 1e-9 < got["median_rel_error_before"]


def test_fit_write_updates_the_gemm_model_file(tmp_path, monkeypatch):
    src = registry.data_dir()
    data = tmp_path / "configs"
    data.mkdir()
    for p in src.glob("*.json"):
        (data / p.name).write_text(p.read_text())
    base = model_for("NVIDIA H200")[0]
    truth = dataclasses.replace(base, gemm=dataclasses.replace(
        base.gemm, nccl_sms=0, kernel_efficiency=0.95, fused_gemm_slowdown=0.1, comm_slowdown=0.3, grid="tiles"))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_bench_doc(truth, "tiles/direct")))
    from flashoverlap_inductor import config

    monkeypatch.setattr(config, "config_dir", str(data))
    registry.clear_caches()
    try:
        assert tune.main(["fit", "--bench", str(bench), "--variant", "tiles/direct", "--write"]) == 0
        registry.clear_caches()
        gemm = model_for("NVIDIA H200")[0].gemm
        assert (gemm.grid, gemm.nccl_sms, gemm.kernel_efficiency, gemm.effective_interference,
                gemm.comm_slowdown) == ("tiles", 0, 0.95, 0.1, 0.3)
    finally:
        monkeypatch.undo()
        registry.clear_caches()
