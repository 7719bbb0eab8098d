"""Cost-model data: JSON schemas, the shipped H200 files, GPU lookup, config_dir, tuned plans, import_anchor."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest

from flashoverlap_inductor import config
from flashoverlap_inductor.cost_model import (
    BandwidthCurve,
    ConfigError,
    GemmModel,
    clear_caches,
    data_dir,
    decide,
    model_for,
    normalize_gpu_name,
)
from flashoverlap_inductor.schedule.plan import COLLECTIVES, GroupPlan, uniform_plan
from flashoverlap_inductor.tune.import_anchor import convert, fit_gemm, main

SHARED_DATA = Path("/work/shared/data")


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_caches()
    yield
    clear_caches()


def _shipped(kind: str) -> dict:
    return json.loads((data_dir() / f"{kind}_h200.json").read_text())


@pytest.fixture
def data_copy(tmp_path):
    """A config dir holding copies of the shipped H200 files, made the active one."""
    for kind in ("bandwidth", "gemm"):
        shutil.copy(data_dir() / f"{kind}_h200.json", tmp_path)
    with config.patch(config_dir=str(tmp_path)):
        yield tmp_path


# ---------------------------------------------------------------- schema validation

def _broken(kind: str, edit) -> dict:
    doc = copy.deepcopy(_shipped(kind))
    edit(doc)
    return doc


BAD_BANDWIDTH = [
    (lambda d: d.pop("schema"), "schema: missing"),
    (lambda d: d.update(schema="flashoverlap.bandwidth/9"), "unsupported version"),
    (lambda d: d.update(sm_count=0), "sm_count"),
    (lambda d: d["curves"]["2"].pop("all_to_all"), "curves['2'].all_to_all: missing"),
    (lambda d: d["curves"]["2"]["all_reduce"].__setitem__(3, [1, 0.1]), "bytes must increase strictly"),
    (lambda d: d["curves"]["4"]["reduce_scatter"].__setitem__(0, [65536, -1.0]), "(ms): must be > 0"),
    (lambda d: d["curves"]["4"]["reduce_scatter"].__setitem__(0, [65536]), "expected [bytes, ms]"),
    (lambda d: d["curves"].update({"1": d["curves"]["2"]}), "world sizes >= 2"),
    (lambda d: d["curves"]["2"].update(broadcast=[[1, 1.0]]), "unknown collective"),
]


@pytest.mark.parametrize("edit,message", BAD_BANDWIDTH)
def test_bandwidth_schema_errors(edit, message):
    with pytest.raises(ConfigError, match="bw.json") as info:
        BandwidthCurve.from_json(_broken("bandwidth", edit), "bw.json")
    assert message in str(info.value)


BAD_GEMM = [
    (lambda d: d["model"].update(tile=[128]), "model.tile"),
    (lambda d: d["model"].update(peak_tflops=0), "model.peak_tflops"),
    (lambda d: d["fused"].update(nccl_sms=132), "fused.nccl_sms"),
    (lambda d: d["fused"].update(kernel_efficiency="fast"), "fused.kernel_efficiency"),
    (lambda d: d.pop("interference"), "interference: missing"),
    (lambda d: d["dtype_scale"].update(bfloat16=-1), "dtype_scale.bfloat16"),
    (lambda d: d["anchor_rows"][0].pop("gemm_ms"), "anchor_rows[0].gemm_ms"),
]


@pytest.mark.parametrize("edit,message", BAD_GEMM)
def test_gemm_schema_errors(edit, message):
    with pytest.raises(ConfigError, match="g.json") as info:
        GemmModel.from_json(_broken("gemm", edit), "g.json")
    assert message in str(info.value)


def test_bad_file_in_config_dir_is_reported(data_copy):
    (data_copy / "bandwidth_h200.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bandwidth_h200.json: not valid JSON"):
        decide("all_reduce", 8192, 8192, 8192, "bfloat16", 4)
    clear_caches()
    (data_copy / "bandwidth_h200.json").unlink()
    with pytest.raises(ConfigError, match="at least one bandwidth curve"):
        model_for(None)


# ---------------------------------------------------------------- shipped data and lookup

def test_shipped_data_states_source_and_date():
    for kind in ("bandwidth", "gemm"):
        doc = _shipped(kind)
        assert doc["gpu"] == "NVIDIA H200" and doc["sm_count"] == 132
        assert doc["date"] == "2026-11-22" and "anchor_bench.py" in doc["source"]
    assert set(_shipped("bandwidth")["curves"]) == {"2", "4"}


def test_gpu_name_normalisation_and_fallback(caplog):
    assert normalize_gpu_name("NVIDIA H200") == "h200"
    assert normalize_gpu_name("  nvidia   h200 NVL ") == "h200 nvl"
    assert normalize_gpu_name("NVIDIA A100-SXM4-80GB") == "a100 sxm4 80gb"
    default, how = model_for(None)
    assert how == "exact" and default.curve.gpu == "NVIDIA H200"
    assert model_for("nvidia h200")[1] == "exact"
    with caplog.at_level(logging.WARNING, logger="flashoverlap"):
        nvl, how = model_for("NVIDIA H200 NVL")
        assert how == "family" and nvl.curve.gpu == "NVIDIA H200"
        other, how = model_for("NVIDIA GeForce RTX 4090")
        assert how == "default" and other.curve.gpu == "NVIDIA H200"
    assert "same family" in caplog.text and "falling back to 'h200'" in caplog.text
    d = decide("all_reduce", 8192, 8192, 8192, "bfloat16", 4, device_name="NVIDIA GeForce RTX 4090")
    assert "default match" in d.reason


def test_config_dir_is_honoured(data_copy):
    base = decide("all_reduce", 8192, 8192, 8192, "bfloat16", 4)
    doc = json.loads((data_copy / "bandwidth_h200.json").read_text())
    for per in doc["curves"].values():
        for points in per.values():
            for p in points:
                p[1] *= 10  # a 10x slower network
    (data_copy / "bandwidth_h200.json").write_text(json.dumps(doc))
    clear_caches()
    slow = decide("all_reduce", 8192, 8192, 8192, "bfloat16", 4)
    assert slow.predicted_seq_ms > base.predicted_seq_ms + 5
    assert data_dir() == data_copy


# ---------------------------------------------------------------- tuned plans

def _plans_doc(entries: list[dict]) -> dict:
    return {"schema": "flashoverlap.plans/1", "gpu": "NVIDIA H200", "sm_count": 132, "source": "test",
            "date": "2026-11-22", "entries": entries}


def _entry(plan: GroupPlan, **extra) -> dict:
    return {"world_size": 4, "collective": "all_reduce", "dtype": "bfloat16", "m": plan.m, "n": plan.n,
            "k": 8192, "plan": plan.to_str(), **extra}


def test_tuned_plan_overrides_search(data_copy):
    tuned = uniform_plan(8192, 8192, 128, 256, 2)
    (data_copy / "plans").mkdir()
    (data_copy / "plans" / "h200.json").write_text(json.dumps(_plans_doc(
        [_entry(tuned, measured_fused_ms=2.0, measured_seq_ms=2.5)])))
    d = decide("all_reduce", 8192, 8192, 8192, "bfloat16", 4)
    assert d.plan == tuned and d.fuse and "tuned" in d.reason and "measured 2.000 ms" in d.reason
    other = decide("all_reduce", 8192, 8192, 7168, "bfloat16", 4)  # no entry for this k: searched
    assert "searched" in other.reason


def test_tuned_plan_measured_times_decide_the_verdict(data_copy):
    tuned = uniform_plan(8192, 8192, 128, 256, 4)
    (data_copy / "plans").mkdir()
    (data_copy / "plans" / "h200.json").write_text(json.dumps(_plans_doc(
        [_entry(tuned, measured_fused_ms=2.2, measured_seq_ms=2.1)])))
    d = decide("all_reduce", 8192, 8192, 8192, "bfloat16", 4)
    assert d.plan == tuned and not d.fuse and "measured" in d.reason


@pytest.mark.parametrize("edit,message", [
    (lambda e: e.update(collective="all_gather"), "collective"),
    (lambda e: e.update(plan="v2;nonsense"), "not a valid GroupPlan"),
    (lambda e: e.update(m=4096), "plan is for m=8192"),
    (lambda e: e.update(measured_seq_ms=0), "measured_seq_ms"),
    (lambda e: e.pop("dtype"), "dtype: missing"),
])
def test_plan_table_schema_errors(data_copy, edit, message):
    entry = _entry(uniform_plan(8192, 8192, 128, 256, 2))
    edit(entry)
    (data_copy / "plans").mkdir()
    (data_copy / "plans" / "bad.json").write_text(json.dumps(_plans_doc([entry])))
    with pytest.raises(ConfigError, match="plans/bad.json") as info:
        decide("all_reduce", 8192, 8192, 8192, "bfloat16", 4)
    assert message in str(info.value)


# ---------------------------------------------------------------- import_anchor

def _synthetic_anchor(world: int) -> dict:
    def gemm_ms(m, n, k):  # the wave model itself: launch 0.01 ms, 700 TFLOP/s, 132 SMs, 128x256 tiles
        waves = -(-(-(-m // 128) * -(-n // 256)) // 132)
        return 0.01 + waves * 2 * 128 * 256 * k * 132 / 700e9

    rows = [{"m": m, "n": n, "k": k, "gemm_ms": gemm_ms(m, n, k), "ar_ms": 0.1 * world, "rs_ms": 0.05,
             "a2a_ms": 0.05, "gemm_plus_concurrent_ar_ms": gemm_ms(m, n, k) + 0.03 * world}
            for m, n, k in [(1024, 4096, 4096), (4096, 8192, 8192), (8192, 8192, 2048), (16384, 4096, 8192)]]
    bw = [{"bytes": b, "ar_ms": 0.02 + b / 3e8, "rs_ms": 0.02 + b / 4e8, "a2a_ms": 0.02 + b / 5e8}
          for b in (1 << 16, 1 << 20, 1 << 24, 1 << 28)]
    return {"world": world, "gpu": "NVIDIA H200", "torch": "x", "nccl": "y", "rows": rows, "bw": bw}


def test_fit_gemm_recovers_model_parameters():
    rows = _synthetic_anchor(2)["rows"]
    fit = fit_gemm([(r["m"], r["n"], r["k"], r["gemm_ms"]) for r in rows], 132)
    assert fit["peak_tflops"] == pytest.approx(700, rel=1e-3)
    assert fit["launch_ms"] == pytest.approx(0.01, abs=1e-9)
    assert fit["max_abs_log_error"] < 1e-3


def test_convert_and_load_synthetic_anchors(tmp_path):
    assert main([*map(str, _write_anchors(tmp_path)), "--out-dir", str(tmp_path / "out"),
                 "--measured", "2030-01-01"]) == 0
    bandwidth = json.loads((tmp_path / "out" / "bandwidth_h200.json").read_text())
    assert bandwidth["date"] == "2030-01-01" and set(bandwidth["curves"]) == {"2", "8"}
    # the rows' lone collectives join the sweep at 2*M*N bytes (median where a size repeats)
    assert [b for b, _ in bandwidth["curves"]["8"]["all_reduce"]][:3] == [1 << 16, 1 << 20, 2 * 1024 * 4096]
    with config.patch(config_dir=str(tmp_path / "out")):
        model, how = model_for("NVIDIA H200")
        assert how == "exact" and model.curve.world_sizes == (2, 8)
        assert model.gemm.interference == pytest.approx(0.03 * 2 / (0.1 * 2))  # median over both worlds
        assert decide("all_reduce", 8192, 8192, 8192, "bfloat16", 8).plan.m == 8192


def _write_anchors(tmp_path: Path) -> list[Path]:
    paths = []
    for world in (2, 8):
        path = tmp_path / f"anchor_{world}.json"
        path.write_text(json.dumps(_synthetic_anchor(world)))
        paths.append(path)
    return paths


def test_convert_rejects_mixed_gpus():
    a, b = _synthetic_anchor(2), _synthetic_anchor(4)
    b["gpu"] = "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError, match="one GPU model"):
        convert([a, b], ["a", "b"], measured="2030-01-01")


@pytest.mark.skipif(not (SHARED_DATA / "h200_nvlink_tp2_anchor.json").exists(), reason="shared anchors absent")
def test_shipped_files_derive_from_the_anchors_and_the_tuner():
    """configs/: the GEMM file keeps the anchors' conversion (dtype scales, interference, rows) with the cuBLAS
    model either converted or refitted by ``tune fit --gemm`` (then with its samples) and a fused section fitted by
    ``tune fit``; the bandwidth file holds ``tune bandwidth`` curves (4 points per octave, 64 KiB .. 1 GiB) for
    worlds 2 and 4, which agree with the anchors' own points of >= 64 MiB within 35% (a different harness)."""
    anchors = [json.loads((SHARED_DATA / f"h200_nvlink_tp{w}_anchor.json").read_text()) for w in (2, 4)]
    bandwidth, gemm = convert(anchors, ["tp2", "tp4"], measured="2026-11-22")
    shipped = _shipped("gemm")
    assert set(shipped["fused"]["fit"]) >= {"inputs", "median_rel_error", "rows"}
    assert shipped["fused"]["grid"] in ("persistent", "tiles")
    for key in ("dtype_scale", "interference", "anchor_rows"):
        assert gemm[key] == shipped[key], key
    assert shipped["model"] == gemm["model"] or len(shipped["model"]["samples"]) >= 8
    tuned = _shipped("bandwidth")
    assert "tune bandwidth" in tuned["source"]
    for world in ("2", "4"):
        assert set(COLLECTIVES) == set(tuned["curves"][world])
        for coll in COLLECTIVES:
            points = tuned["curves"][world][coll]
            assert points[0][0] <= 64 * 1024 and points[-1][0] >= 1 << 30 and len(points) >= 4 * 14
            curve = dict(points)
            for nbytes, ms in bandwidth["curves"][world][coll]:
                if nbytes in curve and nbytes >= 64 << 20:  # latency-bound sizes differ most between harnesses
                    assert curve[nbytes] == pytest.approx(ms, rel=0.35), (world, coll, nbytes)
