"""CPU tests of ``tune fit`` (``flashoverlap_inductor.tune.fit``): the fused-path parameters it fits are the ones
that generated the rows, and ``--write`` stores them where the cost model reads them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flashoverlap_inductor.cost_model import model_for, registry
from flashoverlap_inductor.schedule.plan import uniform_plan
from flashoverlap_inductor.tools import tune
from flashoverlap_inductor.tune import fit as tune_fit

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

    monkeypatch.setitem(config._overrides, "config_dir", str(data))  # as config.patch
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


def test_prepared_prediction_equals_the_full_evaluation():
    """``predict_prepared`` (what the fit's grid search evaluates) is ``CostModel.fused`` on every op and world."""
    from flashoverlap_inductor.tune import schemas as tune_docs

    model = model_for("NVIDIA H200")[0]
    for op in ("all_reduce", "reduce_scatter", "all_to_all"):
        for world in (2, 4):
            for m, n, k in [(2048, 4096, 4096), *SHAPES]:
                for plan in tune_docs.candidate_plans(op, m, n, world, (128, 256), 4):
                    row = {"op": op, "m": m, "n": n, "k": k, "world": world, "plan": plan.to_str()}
                    fast = tune_fit.predict_prepared(model.gemm, tune_fit.prepare(model, op, m, k, world, row["plan"]),
                                                     model.call_overhead_ms)
                    assert fast == tune_fit.predict(model, row), row


def _records_doc(truth, noise: dict[str, float]) -> dict:
    """Search records of 4 all_reduce shapes measured by ``truth`` (times scaled by ``noise[plan]`` if given)."""
    from flashoverlap_inductor.tune import schemas as tune_docs

    recs = []
    for m, n, k in [(4096, 8192, 14336), (8192, 8192, 8192), (16384, 8192, 7168), (4096, 8192, 8192)]:
        cands = []
        for plan in tune_docs.candidate_plans("all_reduce", m, n, 2, (128, 256), 5):
            row = {"op": "all_reduce", "m": m, "n": n, "k": k, "world": 2, "plan": plan.to_str()}
            ms = tune_fit.predict(truth, row) * noise.get(plan.to_str(), 1.0)
            cands.append({"plan": plan.to_str(), "measured_ms": ms, "refined_ms": None, "predicted_ms": None})
        recs.append({"gpu": "NVIDIA H200", "world_size": 2, "collective": "all_reduce", "dtype": "bfloat16",
                     "m": m, "n": n, "k": k, "candidates": cands})
    return tune_docs.records_doc(recs)


def test_fit_with_records_ranks_the_searched_plans(tmp_path):
    """Records measured by a model the shipped one ranks badly: the ranking fit ends with no shape whose
    predicted-best plan is more than 3% slower than its best, while an error-only fit to those times may not."""
    base = model_for("NVIDIA H200")[0]
    truth = dataclasses.replace(base, gemm=dataclasses.replace(
        base.gemm, nccl_sms=0, kernel_efficiency=0.95, fused_gemm_slowdown=0.0, comm_slowdown=1.2, grid="tiles"),
        call_overhead_ms=0.1)
    path = tmp_path / "records.json"
    path.write_text(json.dumps(_records_doc(truth, {})))
    records = tune_fit.load_records([str(path)])
    assert len(records) == 4 and all(len(r["candidates"]) == 16 for r in records)
    got = tune_fit.fit(base, [], "tiles", records)
    assert got["ranking_misses"] == 0 and max(got["regrets"]) <= 0.03, got
    assert got["records"] == 4 and got["median_rel_error"] <= 0.10
    assert got["ranking_misses_before"] >= 2 and len(got["regrets_before"]) == 4  # the shipped model misses


def test_regret_is_the_predicted_picks_loss():
    assert tune_fit.regret([3.0, 1.0, 2.0], [1.0, 1.1, 1.05]) == pytest.approx(0.1)
    assert tune_fit.regret([1.0, 2.0], [1.0, 1.2]) == 0.0
    # against the fastest re-measured candidate; a one-round time below it does not make the regret negative
    assert tune_fit.regret([3.0, 1.0, 2.0], [0.9, 1.1, 1.0], [False, False, True]) == pytest.approx(0.1)
    assert tune_fit.regret([1.0, 2.0, 3.0], [0.9, 1.1, 1.0], [False, False, True]) == 0.0


def test_read_records_accepts_a_bare_record(tmp_path):
    from flashoverlap_inductor.tune import schemas as tune_docs

    bare = {"collective": "all_reduce", "candidates": []}
    (tmp_path / "one.json").write_text(json.dumps(bare))
    assert tune_docs.read_records(tmp_path / "one.json") == [bare]
    (tmp_path / "bad.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="record file"):
        tune_docs.read_records(tmp_path / "bad.json")
