"""The sequential baseline's skew term (``GemmModel.seq_skew_fraction``, data section ``sequential``): its schema,
``CostModel.seq_ms``, what ``decide`` makes of it, and ``tune fit --sequential`` (median of (T_seq - T_gemm -
T_comm) / T_gemm over benchmark rows, merged per world size and collective)."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import shutil

import pytest

from flashoverlap_inductor import config
from flashoverlap_inductor.cost_model import clear_caches, decide, model_for, registry
from flashoverlap_inductor.cost_model.schema import ConfigError, validate_gemm
from flashoverlap_inductor.tools import tune
from flashoverlap_inductor.tune import fit_seq as tune_fit_seq


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_caches()
    yield
    clear_caches()


def _shipped() -> dict:
    return json.loads((registry.data_dir() / "gemm_h200.json").read_text())


def test_seq_ms_scales_the_gemm_by_the_skew_of_its_world_and_collective():
    model = model_for("NVIDIA H200")[0]
    bare = dataclasses.replace(model, gemm=dataclasses.replace(model.gemm, seq_skew={}))
    skewed = dataclasses.replace(model, gemm=dataclasses.replace(
        model.gemm, seq_skew={2: {"reduce_scatter": 0.05}, 4: {"all_reduce": 0.01}}))
    m, n, k = 8192, 8192, 8192
    gemm = model.gemm.reference_ms(m, n, k, "bfloat16")
    for op, world, frac in (("reduce_scatter", 2, 0.05), ("all_reduce", 4, 0.01), ("all_reduce", 2, 0.0),
                            ("reduce_scatter", 4, 0.0), ("all_to_all", 2, 0.0)):
        want = bare.seq_ms(op, m, n, k, "bfloat16", world) + frac * gemm
        assert skewed.seq_ms(op, m, n, k, "bfloat16", world) == pytest.approx(want)


def test_shipped_skew_is_read_and_raises_the_sequential_prediction():
    doc = _shipped()
    model = model_for("NVIDIA H200")[0]
    for world, per in doc["sequential"]["skew_fraction"].items():
        for op, frac in per.items():
            assert model.gemm.seq_skew_fraction(op, int(world)) == frac
            assert 0 < frac < 0.2  # measured: the collective ends a few percent of the GEMM later
    m, n, k = 8192, 8192, 14336
    bare = dataclasses.replace(model, gemm=dataclasses.replace(model.gemm, seq_skew={}))
    assert model.seq_ms("reduce_scatter", m, n, k, "bfloat16", 2) > bare.seq_ms("reduce_scatter", m, n, k,
                                                                                "bfloat16", 2)
    d = decide("reduce_scatter", m, n, k, "bfloat16", 2)
    assert d.predicted_seq_ms == pytest.approx(model.seq_ms("reduce_scatter", m, n, k, "bfloat16", 2))


@pytest.mark.parametrize("mutate", [
    lambda s: s.update(skew_fraction={"1": {"all_reduce": 0.01}}),  # world size 1 has no collective
    lambda s: s.update(skew_fraction={"two": {"all_reduce": 0.01}}),
    lambda s: s["skew_fraction"]["2"].update(all_gather=0.01),
    lambda s: s["skew_fraction"]["2"].update(all_reduce=0.7),
    lambda s: s["skew_fraction"]["2"].update(all_reduce=-0.01),
    lambda s: s["skew_fraction"]["2"].update(all_reduce="0.01"),
    lambda s: s.pop("skew_fraction"),
    lambda s: s.update(fit=[]),
])
def test_schema_rejects_malformed_sequential_sections(mutate):
    doc = _shipped()
    validate_gemm(doc, "ok.json")
    bad = copy.deepcopy(doc)
    mutate(bad["sequential"])
    with pytest.raises(ConfigError, match="sequential"):
        validate_gemm(bad, "bad.json")
    del bad["sequential"]  # the section is optional
    validate_gemm(bad, "none.json")


def _bench(world: int, skews: dict[str, float], seed: int) -> dict:
    """Rows whose T_seq = T_gemm * (1 + skew + noise) + T_comm, with some rows lacking a time."""
    rng = random.Random(seed)
    rows = []
    for op, skew in skews.items():
        for i in range(15):
            gemm, comm = rng.uniform(0.2, 6.0), rng.uniform(0.05, 0.7)
            rows.append({"op": op, "m": 2048 * (1 + i % 4), "n": 8192, "k": 8192, "world": world, "gemm_ms": gemm,
                         "comm_ms": comm, "seq_ms": gemm * (1 + skew + rng.uniform(-0.01, 0.01)) + comm})
        rows.append({"op": op, "m": 1, "n": 8, "k": 8, "world": world, "gemm_ms": float("nan"), "comm_ms": 0.1,
                     "seq_ms": 0.3})
    return {"meta": {"gpu": "NVIDIA H200"}, "rows": rows}


def test_tune_fit_sequential_writes_and_merges_the_section(tmp_path, monkeypatch):
    data = shutil.copytree(registry.data_dir(), tmp_path / "configs")  # --write goes into this copy
    b2, b4 = tmp_path / "w2.json", tmp_path / "w4.json"
    b2.write_text(json.dumps(_bench(2, {"all_reduce": 0.02, "reduce_scatter": 0.05}, 1)))
    b4.write_text(json.dumps(_bench(4, {"all_to_all": 0.03}, 2)))
    result, gpu = tune_fit_seq.fit_sequential([str(b2)])
    assert gpu == "NVIDIA H200" and result["fit"]["rows"] == {"2": {"all_reduce": 15, "reduce_scatter": 15}}
    assert result["skew_fraction"]["2"]["all_reduce"] == pytest.approx(0.02, abs=0.006)
    assert result["skew_fraction"]["2"]["reduce_scatter"] == pytest.approx(0.05, abs=0.006)
    monkeypatch.setitem(config._overrides, "config_dir", str(data))  # as config.patch
    registry.clear_caches()
    assert tune.main(["fit", "--sequential", "--bench", str(b2), str(b4), "--write"]) == 0
    registry.clear_caches()
    gemm = model_for("NVIDIA H200")[0].gemm
    assert gemm.seq_skew_fraction("reduce_scatter", 2) == pytest.approx(0.05, abs=0.006)
    assert gemm.seq_skew_fraction("all_to_all", 4) == pytest.approx(0.03, abs=0.006)
    # a refit of one world size and collective keeps every other entry
    b2rs = tmp_path / "w2rs.json"
    b2rs.write_text(json.dumps(_bench(2, {"reduce_scatter": 0.1}, 3)))
    assert tune.main(["fit", "--sequential", "--bench", str(b2rs), "--write"]) == 0
    registry.clear_caches()
    gemm = model_for("NVIDIA H200")[0].gemm
    assert gemm.seq_skew_fraction("reduce_scatter", 2) == pytest.approx(0.1, abs=0.006)
    assert gemm.seq_skew_fraction("all_reduce", 2) == pytest.approx(0.02, abs=0.006)
    assert gemm.seq_skew_fraction("all_to_all", 4) == pytest.approx(0.03, abs=0.006)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200"}, "rows": []}))
    assert tune.main(["fit", "--sequential", "--bench", str(empty)]) == 2
    assert tune.main(["fit", "--sequential", "--peer", "--bench", str(b2)]) == 2  # one section at a time
