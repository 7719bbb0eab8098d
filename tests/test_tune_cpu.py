"""CPU tests of the tuner, the benchmark's aggregation and the GPU runtime's pure helpers (no GPU needed).

The tuner's search runs with fake timing functions; its documents are validated by the cost model's schema and
read back through the cost model's registry (a tuned plan must change ``decide``'s answer). The benchmark's
derived quantities are checked against hand-computed values.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from flashoverlap_inductor import config, ops, routes
from flashoverlap_inductor.cost_model import clear_caches, decide, launch, model_for, registry, schema
from flashoverlap_inductor.cost_model.bandwidth import BandwidthCurve
from flashoverlap_inductor.cost_model.gemm import GemmModel
from flashoverlap_inductor.cost_model.search import DEFAULT_TILE, predictive_search
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.runtime import kernel_select
from flashoverlap_inductor.schedule import plan as planlib
from flashoverlap_inductor.tools import tune
from flashoverlap_inductor.tune import measure as tune_measure
from flashoverlap_inductor.tune import schemas as tune_docs

ROOT = Path(__file__).resolve().parent.parent
GPU = "NVIDIA H200"


@pytest.fixture
def data_copy(tmp_path):
    """A private data directory holding copies of the shipped bandwidth and GEMM files."""
    for path in registry.data_dir().glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    clear_caches()
    launch.preferred_kernels.cache_clear()
    with config.patch(config_dir=str(tmp_path)):
        yield tmp_path
    clear_caches()
    launch.preferred_kernels.cache_clear()


# --------------------------------------------------------------------------------------------- bandwidth


def test_bandwidth_sizes_cover_64k_to_1g_at_4_per_octave():
    sizes = tune_docs.bandwidth_sizes(world_size=4)
    assert sizes[0] == 64 * 1024 and sizes[-1] == 1 << 30
    assert len(sizes) == 14 * 4 + 1
    assert all(b > a for a, b in zip(sizes, sizes[1:], strict=False))
    assert all(s % (4 * 128 * 2) == 0 for s in sizes)
    ratios = [b / a for a, b in zip(sizes, sizes[1:], strict=False)]
    assert max(abs(r - 2 ** 0.25) for r in ratios) < 0.01
    odd = tune_docs.bandwidth_sizes(world_size=3)  # rounding to the world never makes two sizes equal
    assert len(odd) == len(set(odd)) and odd[-1] <= 1 << 30


def test_merge_bandwidth_replaces_one_world_and_validates():
    base = tune_docs.read_json(tune_docs.bandwidth_path(registry.data_dir(), GPU))
    fake = {c: [[b, 0.01 + b / 1e8] for b in tune_docs.bandwidth_sizes(world_size=4)]
            for c in ("all_reduce", "reduce_scatter", "all_to_all")}
    doc = tune_docs.merge_bandwidth(base, GPU, 132, 4, fake, "unit test", date="2026-12-01")
    assert doc["curves"]["2"] == base["curves"]["2"]  # other worlds untouched
    got = doc["curves"]["4"]["all_reduce"][5]
    assert got == [fake["all_reduce"][5][0], pytest.approx(fake["all_reduce"][5][1], rel=1e-5)]
    assert "world 4: unit test (2026-12-01)" in doc["source"] and doc["date"] == "2026-12-01"
    curve = BandwidthCurve.from_json(doc, "merged")
    b = fake["all_reduce"][20][0]
    assert curve.comm_ms("all_reduce", 4, b) == pytest.approx(0.01 + b / 1e8, rel=1e-5)
    with pytest.raises(schema.ConfigError, match="missing"):  # a new world must list every collective
        tune_docs.merge_bandwidth(base, GPU, 132, 8, {"all_reduce": fake["all_reduce"]}, "partial")
    with pytest.raises(ValueError, match="H200"):
        tune_docs.merge_bandwidth(base, "NVIDIA B200", 148, 4, fake, "wrong gpu")


# --------------------------------------------------------------------------------------------- gemm


def _fake_samples(model: GemmModel, effs: dict[str, tuple[int, int, float]], sms_list: list[int]):
    out = []
    for (m, n, k) in ((4096, 8192, 8192), (8192, 8192, 7168), (2048, 4096, 4096)):
        for name, (tm, tn, eff) in effs.items():
            for sms in sms_list:
                waves = math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / sms)
                ms = model.launch_ms + waves * model.wave_ms(k, "bfloat16", tm, tn, eff)
                out.append(tune_docs.GemmSample(name, tm, tn, m, n, k, sms, ms))
    return out


def test_update_gemm_doc_recovers_efficiency_and_best_kernels(data_copy):
    doc = tune_docs.read_json(tune_docs.gemm_path(data_copy, GPU))
    model = GemmModel.from_json(doc)
    effs = {"coop_128x256x64_c2x1": (128, 256, 0.8), "coop_128x256x64_c1x1": (128, 256, 0.7),
            "pp_128x128x64_c2x1": (128, 128, 0.9)}
    samples = _fake_samples(model, effs, [132, 116, 100])
    new = tune_docs.update_gemm_doc(doc, samples, 132, DEFAULT_TILE, "unit test", cublas=[(1, 2, 3, 0.5)])
    schema.validate_gemm(new, "test")
    assert new["fused"]["kernel_efficiency"] == pytest.approx(0.8, abs=1e-3)
    tk = new["tuned_kernels"]
    assert tk["best_by_tile"] == {"128x256": "coop_128x256x64_c2x1", "128x128": "pp_128x128x64_c2x1"}
    assert tk["per_config"]["coop_128x256x64_c1x1"] == pytest.approx(0.7, abs=1e-3)
    assert tk["fused_sms"] == 132 - model.nccl_sms and len(tk["samples"]) == len(samples)
    assert set(tk["sm_scaling"]["128x256"]) == {"0", "16", "32"} and tk["sm_scaling"]["128x256"]["0"] == 1.0
    assert 0 < tk["sm_scaling"]["128x256"]["32"] <= 1.0
    assert GemmModel.from_json(new).kernel_efficiency == pytest.approx(0.8, abs=1e-3)
    # the runtime picks its preferred kernels from the written file
    tune_docs.write_json(tune_docs.gemm_path(data_copy, GPU), new)
    clear_caches()
    launch.preferred_kernels.cache_clear()
    assert launch.preferred_kernels(GPU) == tk["best_by_tile"]


# --------------------------------------------------------------------------------------------- search


def test_compositions_and_candidates():
    comps = tune_docs.compositions(4)
    assert len(comps) == 8 and all(sum(c) == 4 for c in comps) and len(set(comps)) == 8
    plans = tune_docs.candidate_plans("reduce_scatter", 8192, 8192, 4, DEFAULT_TILE, 6)
    assert len(plans) == 2 ** 5 and len(set(plans)) == len(plans)
    for p in plans:
        assert p.m == 8192 and p.row_bounds[-1] == 8192
        assert all(b % 128 == 0 and b % 4 == 0 for b in p.row_bounds)
        planlib.buffer_layout(p, planlib.chunks_for("reduce_scatter", 8192, 4))  # a valid layout
    assert {p.num_groups for p in plans} == set(range(1, 7))


def _setup_search(collective="all_reduce", m=8192, n=8192, k=8192, world=4, units=6):
    model = model_for(GPU)[0]
    chunks = planlib.chunks_for(collective, m, world)

    def predict(p):
        return model.fused(p, collective, chunks, k, "bfloat16", world).total_ms

    candidates = tune_docs.candidate_plans(collective, m, n, world, DEFAULT_TILE, units)
    predictive = predictive_search(model, collective, m, n, k, "bfloat16", world, chunks, max_units=units).plan
    return candidates, predictive, predict


def test_search_with_the_model_as_the_clock_finds_the_model_optimum():
    candidates, predictive, predict = _setup_search()
    calls = []

    def measure(plans, rounds):
        calls.append((len(plans), rounds))
        return [predict(p) for p in plans]

    report = tune_docs.search(candidates, measure, predict=predict, predictive=predictive, refine_top=3,
                              refine_rounds=4)
    assert calls[0] == (len(set(candidates) | {predictive}), 1) and calls[1][1] == 4 and calls[1][0] <= 4
    assert report.best_ms == pytest.approx(min(predict(p) for p in candidates))
    assert report.relative_performance == pytest.approx(1.0)
    assert max(report.model_errors) == pytest.approx(0.0, abs=1e-12)
    rec = json.loads(json.dumps(report.record(world_size=4, m=candidates[0].m)))  # JSON-safe
    assert rec["world_size"] == 4 and rec["best"] == report.best.to_str()
    assert {c["plan"] for c in rec["candidates"]} == {p.to_str() for p in set(candidates) | {predictive}}
    for c in rec["candidates"]:
        plan = planlib.GroupPlan.from_str(c["plan"])
        assert c["measured_ms"] == pytest.approx(predict(plan)) and c["predicted_ms"] == pytest.approx(predict(plan))
        assert (c["refined_ms"] is not None) == (c["plan"] in report.refined)


def test_search_confirms_the_verdict_in_a_batch_of_its_own():
    """A plan that only looked fastest in the refinement (noise) is still chosen, but the verdict on the model's
    pick comes from the confirmation batch, where both are timed again."""
    candidates, predictive, predict = _setup_search()
    lucky = min((p for p in candidates if p != predictive), key=predict)  # a finalist: refined, then confirmed
    calls = []

    def measure(plans, rounds):
        calls.append(([p.to_str() for p in plans], rounds))
        return [predict(p) * (0.8 if len(calls) == 2 and p == lucky else 1.0) for p in plans]

    report = tune_docs.search(candidates, measure, predict=predict, predictive=predictive, refine_top=3,
                              refine_rounds=4, confirm_rounds=6)
    assert report.best == lucky and len(calls) == 3
    assert sorted(calls[2][0]) == sorted([lucky.to_str(), predictive.to_str()]) and calls[2][1] == 6
    assert report.refined_relative_performance < 1.0
    assert report.relative_performance == pytest.approx(predict(lucky) / predict(predictive))
    assert report.relative_performance >= 1.0  # the model's pick is the true optimum
    rec = report.record()
    assert {c["plan"] for c in rec["candidates"] if c["confirmed_ms"] is not None} == {lucky.to_str(),
                                                                                      predictive.to_str()}
    same = tune_docs.search(candidates, lambda plans, rounds: [predict(p) for p in plans], predict=predict,
                            predictive=predictive, confirm_rounds=6)
    assert same.best == predictive and not same.confirmed and same.relative_performance == 1.0


def test_search_prefers_measurements_over_predictions():
    candidates, predictive, predict = _setup_search()

    def measure(plans, rounds):  # the real machine punishes many groups (per-call costs the model lacks)
        return [predict(p) + 0.2 * max(0, p.num_groups - 2) for p in plans]

    report = tune_docs.search(candidates, measure, predict=predict, predictive=predictive)
    assert report.best.num_groups <= 2
    assert report.best_ms == pytest.approx(min(measure([p], 1)[0] for p in candidates))
    if predictive.num_groups > 2:
        assert report.relative_performance < 1.0
    assert tune_measure.median(report.model_errors) > 0


def test_tuned_plan_file_changes_decide(data_copy):
    coll, m, n, k, world = "reduce_scatter", 8192, 8192, 7168, 4
    before = decide(coll, m, n, k, "bfloat16", world, device_name=GPU)
    plan = planlib.GroupPlan(m, n, 128, 256, (0, 2048, 4096, 8192))
    assert plan != before.plan
    entry = {"world_size": world, "collective": coll, "dtype": "bfloat16", "m": m, "n": n, "k": k,
             "plan": plan.to_str(), "measured_fused_ms": 1.30, "measured_seq_ms": 1.64, "mode": "both"}
    path = tune_docs.plans_path(data_copy, GPU, world)
    doc = tune_docs.merge_plans(None, GPU, 132, [entry], "unit test")
    doc = tune_docs.merge_plans(doc, GPU, 132, [dict(entry, measured_fused_ms=1.25)], "unit test")
    assert len(doc["entries"]) == 1 and doc["entries"][0]["measured_fused_ms"] == 1.25
    tune_docs.write_json(path, doc)
    clear_caches()
    after = decide(coll, m, n, k, "bfloat16", world, device_name=GPU)
    assert after.plan == plan and after.fuse and "measured" in after.reason
    with pytest.raises(ValueError, match="SMs"):
        tune_docs.merge_plans(doc, GPU, 114, [entry], "other machine")


# --------------------------------------------------------------------------------------------- statistics


def test_statistics():
    assert tune_measure.geomean([1.0, 4.0, float("nan"), None]) == pytest.approx(2.0)
    assert math.isnan(tune_measure.geomean([]))
    assert tune_measure.speedup(2.0, 1.0) == 2.0 and math.isnan(tune_measure.speedup(2.0, float("nan")))
    eff = tune_measure.overlap_efficiency
    assert eff(2.1, 1.45, 1.45) == pytest.approx(1.0)
    assert eff(2.1, 2.1, 1.45) == pytest.approx(0.0)
    assert eff(2.1, 2.3, 1.45) < 0
    assert eff(2.1, 1.775, 1.45) == pytest.approx(0.5)
    assert math.isnan(eff(1.0, 0.9, 1.0))
    assert tune_measure.rel_error(1.1, 1.0) == pytest.approx(0.1)
    assert tune_measure.agree([True, False]) == [True, False]  # no process group: this rank decides
    assert tune_measure.reduce_max([1.0, 2.0]) == [1.0, 2.0]


def test_timer_iteration_counts():
    timer = tune_measure.Timer(target_ms=10.0, min_iters=2, max_iters=40)
    assert timer.iterations([0.1, 1.0, 8.0, 100.0, float("nan"), 0.0]) == [40, 10, 2, 2, 40, 40]


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    bar = tune_measure.Progress(3, "demo", every_s=0.0)
    for i in range(3):
        bar.update(note=f"step {i}")
    bar.close()
    out = capsys.readouterr().out
    assert "demo: 3/3 (100%)" in out and "step 2" in out
    silent = tune_measure.Progress(3, "quiet", enabled=False)
    silent.update()
    assert "quiet" not in capsys.readouterr().out


def test_cli_parsing():
    p = tune.build_parser()
    bw = p.parse_args(["bandwidth", "--quick", "--out", "x.json"])
    assert bw.command == "bandwidth" and bw.points_per_octave == 4 and bw.max_bytes == 1 << 30
    se = p.parse_args(["search", "--collective", "all_to_all", "--shape", "4096x4096x4096", "--mode", "predictive"])
    assert se.max_units == 8 and se.mode == "predictive"
    assert tune.parse_shapes("8192x8192x14336,2048x4096x4096") == [(8192, 8192, 14336), (2048, 4096, 4096)]
    assert tune.parse_shapes("grid") == tune.GRID and len(tune.GRID) == 16
    with pytest.raises(SystemExit):
        p.parse_args(["search", "--collective", "broadcast", "--shape", "1x1x1"])


# --------------------------------------------------------------------------------------------- benchmark


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ops", ROOT / "examples" / "bench_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_experiments_argument(bench):
    """``--experiments`` names the run's experiments (checked against ``config.EXPERIMENTS``: a typo stops the run);
    ``--scatter-start`` the pull route's schedule (one of ``config.SCATTER_STARTS``)."""
    assert bench.parse_args(["--experiments", "scatter_pull,gather_torch_gemms"]).experiments == frozenset(
        {"scatter_pull", "gather_torch_gemms"})
    assert bench.parse_args([]).experiments == frozenset()
    assert bench.parse_args(["--scatter-start", "push"]).scatter_start == "push"
    assert bench.parse_args([]).scatter_start is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--scatter-start", "pull"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--experiments", "scatter_pul"])


def _row(bench, op, m, seq, fused, gemm, comm, asynctp=math.nan, auto_fuse=True, pred=None, rel=1e-3):
    row = {"op": op, "m": m, "n": 8192, "k": 8192, "world": 4, "gemm_ms": gemm, "comm_ms": comm, "seq_ms": seq,
           "chunked": {"2": seq * 0.99}, "chunked_ms": seq * 0.99, "asynctp_ms": asynctp, "fused_ms": fused,
           "ideal_ms": max(gemm, comm), "auto_fuse": auto_fuse, "auto_ms": fused if auto_fuse else seq,
           "plan": "", "groups": 4, "decision": "", "fused_path": True, "fallback": [], "launch": "",
           "relerr_fused": rel, "relerr_asynctp": math.nan, "host_ms_fused": 0.1,
           "pred_fused_ms": pred if pred is not None else fused, "pred_seq_ms": seq, "errors": {}}
    return bench.derive(row)


def test_bench_derive_and_summary(bench):
    r = _row(bench, "all_reduce", 8192, seq=2.13, fused=1.60, gemm=1.45, comm=0.72, pred=1.76)
    assert r["speedup"] == pytest.approx(2.13 / 1.60) and r["ideal_speedup"] == pytest.approx(2.13 / 1.45)
    assert r["efficiency"] == pytest.approx((2.13 - 1.60) / (2.13 - 1.45))
    assert r["err_fused"] == pytest.approx(0.1) and r["correct"] is True
    rows = [r, _row(bench, "all_reduce", 4096, seq=1.07, fused=0.90, gemm=0.69, comm=0.37),
            _row(bench, "reduce_scatter", 8192, seq=1.87, fused=1.55, gemm=1.45, comm=0.40, asynctp=1.86),
            _row(bench, "reduce_scatter", 4096, seq=0.94, fused=1.10, gemm=0.69, comm=0.24, asynctp=1.03,
                 auto_fuse=False),
            _row(bench, "all_to_all", 8192, seq=1.86, fused=1.70, gemm=1.45, comm=0.42, rel=0.5)]
    s = bench.summarize(rows, 4)
    ar = s["ops"]["all_reduce"]
    assert ar["geomean_speedup"] == pytest.approx(math.sqrt((2.13 / 1.60) * (1.07 / 0.90)))
    assert ar["speedup_8192"] == pytest.approx(2.13 / 1.60)
    assert s["checks"]["all_reduce geomean speedup"]["pass"] is True
    assert s["checks"]["all_reduce 8192^3 speedup"]["pass"] is False  # 1.33 < 1.35
    rs = s["ops"]["reduce_scatter"]
    assert rs["faster_than_asynctp"] == "1/2" and rs["all_faster_than_asynctp"] is False
    assert rs["worst_auto_ratio"] == pytest.approx(1.0)  # auto declined the slow shape
    assert s["checks"]["reduce_scatter auto never > 1.02 x T_seq"]["pass"] is True
    assert s["ops"]["all_to_all"]["wrong"] == ["8192x8192x8192"]
    assert s["checks"]["all_to_all results correct"]["pass"] is False
    table = bench.format_table(rows, s)
    assert "[FAIL] all_reduce 8192^3 speedup" in table and "WRONG" in table and "== reduce_scatter" in table
    text = json.dumps(bench._jsonable({"rows": rows, "summary": s}))
    assert "NaN" not in text and "Infinity" not in text


def test_bench_arguments(bench):
    args = bench.parse_args(["--ops", "all_reduce,reduce_scatter", "--fuse", "auto", "--shapes", "8192x8192x8192"])
    assert args.ops == ["all_reduce", "reduce_scatter"] and args.fuse == "auto" and args.call == "op"
    with pytest.raises(SystemExit):
        bench.parse_args(["--ops", "all_gather"])
    assert bench.parse_args(["--graphs", "--fused-variants", "tiles/direct,tiles/direct/c//8"]).graphs
    for removed in ("tiles/direct/gemm", "tiles/torch", "tiles/direct/python", "tiles/direct/c/@4+immediate",
                    "tiles/direct////stage", "tiles/peer////wait", "tiles/peer/ce"):
        with pytest.raises(ValueError, match="removed|only"):
            bench.check_variant(removed)
    with pytest.raises(SystemExit):
        bench.parse_args(["--fused-variants", "tiles/nccl"])


def test_bench_variant_specs(bench):
    assert bench.parse_spec("tiles/direct") == ("tiles", "direct", "c", "", None, "")
    assert bench.parse_spec("tiles/direct/gemm///gather")[2:] == ("gemm", "", None, "gather")
    assert bench.parse_spec("persistent/torch/python/coop_128x128x64_c2x1") == (
        "persistent", "torch", "python", "coop_128x128x64_c2x1", None, "")
    assert bench.parse_spec("tiles/direct/gemm/@8") == ("tiles", "direct", "gemm", "@8", None, "")
    assert bench.parse_spec("tiles/direct/c//8")[4] == (8, None)
    assert bench.parse_spec("tiles/direct///32-64")[4] == (64, 32)
    assert bench.parse_spec("tiles/direct/c/pp_128x128x64_c1x1@4+immediate")[:4] == (
        "tiles", "direct", "c", "pp_128x128x64_c1x1@4+immediate")
    assert bench.parse_spec("tiles/peer") == ("tiles", "peer", "c", "", None, "")
    assert bench.parse_spec("tiles/peer/ce//4/wait") == ("tiles", "peer", "ce", "", (4, None), "wait")
    assert bench.parse_spec("tiles/peer/c///wait+cpull")[5] == "wait+cpull"
    for bad in ("tiles", "tiles/x", "grid/direct", "tiles/direct/fast", "tiles/direct/c/k/8/9", "tiles/direct/c/k/8/x/",
                "tiles/direct/c/k/a", "tiles/direct/c/@x", "tiles/direct/c//-3-4", "tiles2/direct",
                "tiles/direct/c/k+soon", "tiles/direct/c/k+", "tiles/direct/ce", "tiles/direct////wait",
                "tiles/direct////cpull", "tiles/peer////cpull+x", "tiles/peer////cpull+cpush",
                "tiles/peer////wait+wait"):
        with pytest.raises(ValueError):
            bench.parse_spec(bad)


# --------------------------------------------------------------------------------------------- runtime helpers


def test_normalize_operands():
    bf = torch.bfloat16
    a, w = torch.randn(64, 32).to(bf), torch.randn(48, 32).to(bf)
    got = kernel_select.normalize_operands(a, w.t(), torch.randn(1, 48).to(bf))
    assert isinstance(got, kernel_select.Operands) and got.bias.shape == (48,) and got.b.stride() == (1, 32)
    assert kernel_select.normalize_operands(a.float(), w.t().float(), None)[0] == "dtype"
    a3 = torch.randn(16, 4, 32).to(bf).permute(1, 0, 2)
    got = kernel_select.normalize_operands(a3, w.t().expand(4, 32, 48), None)  # x.transpose(0,1) @ w as bmm
    assert got.a.shape == (64, 32) and got.b.shape == (32, 48) and got.b.stride(1) == 32
    assert torch.equal(got.a, a3.reshape(64, 32))
    assert kernel_select.normalize_operands(a3, torch.randn(4, 32, 48).to(bf), None)[0] == "bmm"
    assert kernel_select.normalize_operands(a, w.t(), torch.randn(64, 48).to(bf))[0] == "bias_rows"
    assert kernel_select.normalize_operands(a[:, :30], w[:, :30].t(), None)[0] == "alignment"
    assert kernel_select.normalize_operands(a, torch.randn(32, 0).to(bf), None)[0] == "degenerate"
    scalar = kernel_select.normalize_operands(a, w.t(), torch.tensor(2.0).to(bf))
    assert scalar.bias.shape == (48,) and torch.all(scalar.bias == 2)


def test_b_layout():
    w = torch.randn(48, 32)
    assert kernel_select.b_layout(w.t()) == "nk" and kernel_select.b_layout(w.t().contiguous()) == "kn"
    assert kernel_select.b_layout(torch.randn(32, 96)[:, ::2]) is None
    assert kernel_select.a_is_kernel_ready(torch.randn(8, 32))
    assert not kernel_select.a_is_kernel_ready(torch.randn(32, 8).t())


class _Info:
    def __init__(self, name, tm, tn, variants):
        self.name, self.tile_m, self.tile_n, self.variants = name, tm, tn, tuple(variants)


def test_choose_kernel():
    full = [("bfloat16", "nk"), ("bfloat16", "kn"), ("float16", "nk"), ("float16", "kn")]
    infos = [_Info(kernels.DEFAULT_CONFIG, 128, 256, full), _Info("coop_128x128x64_c1x1", 128, 128, full),
             _Info("pp_64x256x64_c1x1", 64, 256, [("bfloat16", "nk")]),
             _Info("pp_64x256x64_c2x1", 64, 256, [("bfloat16", "nk")])]
    pick = kernel_select.choose_kernel
    assert pick(infos, "", (128, 256), "bfloat16", "nk").name == kernels.DEFAULT_CONFIG
    assert pick(infos, "", (128, 128), "float16", "kn").name == "coop_128x128x64_c1x1"
    assert pick(infos, "", (64, 256), "bfloat16", "nk").name == "pp_64x256x64_c1x1"
    assert pick(infos, "", (64, 256), "bfloat16", "nk", {"64x256": "pp_64x256x64_c2x1"}).name == "pp_64x256x64_c2x1"
    assert pick(infos, "", (64, 256), "float16", "nk").name == kernels.DEFAULT_CONFIG  # tile not compiled for fp16
    assert pick(infos, "pp_64x256x64_c2x1", (128, 256), "bfloat16", "nk").name == "pp_64x256x64_c2x1"
    assert pick(infos, "", None, "bfloat16", "kn").name == kernels.DEFAULT_CONFIG
    only_nk = [_Info("x", 128, 256, [("bfloat16", "nk")])]
    c = pick(only_nk, "", (128, 256), "bfloat16", "kn")
    assert (c.name, c.b_layout, c.convert_b) == ("x", "nk", True)
    c = pick(only_nk, "", (128, 256), "bfloat16", None)  # strided B: copied
    assert c.b_layout == "nk" and c.convert_b
    assert pick(only_nk, "", (128, 256), "float16", "nk") is None


@pytest.mark.parametrize("world", [2, 4])
def test_gather_rows_follow_the_buffer_layout(world):
    rows = 48 * world
    p = planlib.uniform_plan(rows, 64, 8, 8, 3, align=world)
    layout = planlib.buffer_layout(p, planlib.chunks_for("reduce_scatter", rows, world))
    src = kernel_select.gather_rows(layout)
    assert sorted(src) == list(range(rows)) and src != list(range(rows))
    pieces = planlib.chunk_pieces([rows // world] * world, p.row_bounds)  # independent statement of the layout
    expect, done = [], [0] * world
    for per_chunk in pieces:
        for kk, count in enumerate(per_chunk):
            start = kk * rows // world + done[kk]
            expect += list(range(start, start + count))
            done[kk] += count
    assert src == expect
    ar = planlib.buffer_layout(p, [rows])
    assert kernel_select.gather_rows(ar) is None


def _unasked() -> None:
    raise AssertionError("the cost model's default was asked although a setting decides")


def test_sm_reserve_sources():
    assert launch.fused_nccl_sms(GPU) == model_for(GPU)[0].gemm.nccl_sms
    assert kernel_select.sm_reserve(None, None, lambda: launch.fused_nccl_sms(GPU)) == model_for(GPU)[0].gemm.nccl_sms
    assert kernel_select.sm_reserve(None, 22, _unasked) == 24  # the group's NCCL max_ctas + 2
    assert kernel_select.sm_reserve(8, 22, _unasked) == 8  # the tuning setting wins


def test_cost_model_launch_defaults_without_data(monkeypatch):
    """No readable data: the documented defaults (16 SMs, persistent), never an exception."""
    def broken(*args, **kwargs):
        raise registry.ConfigError("no data")

    monkeypatch.setattr(registry, "model_for", broken)
    assert launch.fused_nccl_sms(GPU) == launch.DEFAULT_NCCL_SMS == 16
    assert launch.fused_grid(GPU) == launch.DEFAULT_GRID == "persistent"


def test_gemm_grid_sources_and_ctas():
    assert kernel_select.gemm_grid(None, lambda: launch.fused_grid(GPU)) == model_for(GPU)[0].gemm.grid
    assert kernel_select.gemm_grid("persistent", _unasked) == "persistent"
    assert kernel_select.gemm_grid("tiles", _unasked) == "tiles"
    with pytest.raises(ValueError, match="'persistent' or 'tiles'"):
        kernel_select.gemm_grid("tiles2", _unasked)
    with pytest.raises(ValueError, match="'persistent' or 'tiles'"):
        kernel_select.gemm_grid(None, lambda: "waves")  # a data file's grid is checked too
    # 8192^3 at 128x256: 2048 tiles on 132 SMs
    assert kernel_select.grid_ctas("persistent", 132, 2048, 16) == 116
    assert kernel_select.grid_ctas("persistent", 132, 2048, 200) == 1
    assert kernel_select.grid_ctas("tiles", 132, 2048, 16) == 2048
    assert kernel_select.grid_ctas("tiles", 132, 64, 0) == 132  # fewer tiles than SMs: persistent waves
    with pytest.raises(ValueError):
        kernel_select.grid_ctas("waves", 132, 64, 0)


def test_without_the_library_calls_run_unfused(monkeypatch):
    """No sm90 GPU or library: every CUDA call's only candidate is the unfused route (the registry decides)."""
    monkeypatch.setattr(kernels, "available", lambda: False)  # also on a machine with sm90 GPUs and the library
    call = routes.Call("reduce_scatter", 8, 8, 16, torch.bfloat16, 2, device="cuda", b_layout="kn")
    assert [r.name for r in routes.candidates(call, config.Settings())] == ["unfused"]
    routes.check()  # nothing was set up: nothing to report


# --------------------------------------------------------------------------------------------- simulated GPU
# runtime_gpu's real per-call path (and the benchmark and tuner around it) on CPU tensors over 2 gloo ranks:
# torch.cuda's streams, events and sleeps and the C library are replaced by synchronous host fakes. The fake GEMM
# computes in fp32 and adds to the counters exactly what the kernel's contract says; every fake wait checks that
# its counter reached exactly the target the runtime asked for. What runs for real: operand normalization, the
# launch (schedule, layout, kernel choice, tile-row map, tiles per group, gather index), the epoch bookkeeping,
# buffers, every per-group collective, and the benchmark's and tuner's orchestration.


class _FakeStream:
    cuda_stream = 4242

    def wait_stream(self, other) -> None:
        pass


class _FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        import time

        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


class _FakeLib:
    def __init__(self, res, infos):
        self.res, self.infos = res, {i.name: i for i in infos}
        self.names = sorted(self.infos)
        self.waits = self.ordered = self.calls = 0

    def config_index(self, name, dtype, layout):
        return self.names.index(name)

    def workspace_bytes(self, *args):
        return 0

    def gemm(self, index, a, b, ldb, bias, out, counters_ptr, gmap, order, mode, sms, raster, swizzle, workspace,
             stream):
        info = self.infos[self.names[index]]
        if order is not None:  # the "schedule" route: a permutation of the tile-rows, by group
            assert sorted(order.tolist()) == list(range(math.ceil(a.shape[0] / info.tile_m)))
            assert [gmap.tolist()[t] for t in order.tolist()] == sorted(gmap.tolist())
            self.ordered += 1
        assert ldb == (b.stride(1) if b.stride(0) == 1 else b.stride(0)) and a.stride(1) == 1
        y = a.float() @ b.float() + (bias.float() if bias is not None else 0.0)
        out.copy_(y.to(out.dtype))
        assert gmap.numel() == math.ceil(a.shape[0] / info.tile_m)
        counters = self._slot(counters_ptr, "counters")
        if counters is not None:  # the tuner's GEMM timing signals into counters of its own
            for g in gmap.tolist():
                counters[g] += math.ceil(out.shape[1] / info.tile_n)

    def fused_call(self, index, a, b, ldb, bias, d, buf, rows, k, gmap, order, signal_mode, sms, raster, swizzle,
                   workspace, counters_ptr, expected_ptr, csteps, out, nccl_dtype, comm, timeout_ns, dom, launch_id,
                   rank, cur_ptr, side_ptr):
        """``fo_fused_call`` on CPU: the epoch resync, the GEMM (signalling), then per group its bounded wait and
        the collective(s) its C step describes, issued with torch.distributed on the same element ranges as the
        NCCL calls of ``csrc/fused_call.cu``."""
        import torch.distributed as dist

        counters, expected = self._slot(counters_ptr, "counters"), self._slot(expected_ptr, "expected")
        expected.copy_(counters)
        if rows:
            self.gemm(index, a, b, ldb, bias, d, counters_ptr, gmap, order, signal_mode, sms, raster, swizzle,
                      workspace, cur_ptr)
        assert d.data_ptr() == buf.data_ptr() and timeout_ns > 0 and comm == 0 and launch_id > 0
        assert rank == dist.get_rank() and dom.route == "nccl"  # the slot's fault domain
        bf, of = buf.view(-1), out.view(-1)
        world = dist.get_world_size()
        for g in range(csteps.groups):
            s = csteps.steps[g]
            if s.tiles:
                target = int(expected[g]) + s.tiles
                assert int(counters[g]) == target, f"group {g}: counter {int(counters[g])} != target {target}"
                expected[g] = target
                self.waits += 1
            p2p = [csteps.p2p[s.first_p2p + i] for i in range(s.num_p2p)]
            if s.kind == kernels.STEP_KINDS["all_reduce"] and s.count:
                dist.all_reduce(bf[s.buf_offset:s.buf_offset + s.count])
            elif s.kind == kernels.STEP_KINDS["reduce_scatter"] and s.count:
                ops.reduce_scatter_into(of[s.out_offset:s.out_offset + s.count],
                                        bf[s.buf_offset:s.buf_offset + s.count * world])
            elif s.kind == kernels.STEP_KINDS["reduce_pieces"]:
                for q in p2p:  # one ncclReduce per chunk piece: the root gets the sum at out_offset
                    piece = bf[q.offset:q.offset + q.count].clone()
                    dist.reduce(piece, q.peer)
                    if q.peer == dist.get_rank():
                        of[s.out_offset:s.out_offset + q.count].copy_(piece)
            elif s.kind == kernels.STEP_KINDS["all_to_all"]:
                ops_ = [dist.P2POp(dist.irecv if q.recv else dist.isend,
                                   (of if q.recv else bf)[q.offset:q.offset + q.count], q.peer, tag=g) for q in p2p]
                for work in (dist.batch_isend_irecv(ops_) if ops_ else []):
                    work.wait()
                if s.local_count:
                    of[s.local_out:s.local_out + s.local_count].copy_(bf[s.local_buf:s.local_buf + s.local_count])
        self.calls += 1

    def wait(self, counter_ptr, expected_ptr, tiles, timeout_ns, record_ptr, tag, stream):
        counters, g = self._slot(counter_ptr, "counters", element=True)
        expected, g2 = self._slot(expected_ptr, "expected", element=True)
        assert g == g2 == tag and timeout_ns > 0
        target = int(expected[g]) + tiles
        assert int(counters[g]) == target, f"group {g}: counter {int(counters[g])} != target {target}"
        expected[g] = target
        self.waits += 1

    def _slot(self, ptr, which, element=False):
        table = getattr(self.res, which)
        for row in range(table.shape[0]):
            base = table[row].data_ptr()
            if base <= ptr < base + 4 * table.shape[1]:
                return (table[row], (ptr - base) // 4) if element else table[row]
        assert not element, f"pointer {ptr:#x} is not in the {which} pool"
        return None


FULL = [("bfloat16", "nk"), ("bfloat16", "kn"), ("float16", "nk"), ("float16", "kn")]
SIM_INFOS = [_Info(kernels.DEFAULT_CONFIG, 8, 16, FULL), _Info("pp_4x8", 4, 8, [("bfloat16", "nk")])]


class _Props:
    """Every field of ``torch.cuda.get_device_properties`` that our code or torch's own checks read."""

    name, multi_processor_count, major, minor, total_memory = GPU, 132, 9, 0, 141 << 30


@contextlib.contextmanager
def simulated_gpu(force_groups: int | None = None):
    """Fake CUDA timing + fake kernel library around the CUDA routes (see above): CPU tensors take the CUDA routes
    (``routes._on_cuda``), the NCCL route's communicator is a stand-in and ``fo_fused_call`` runs on CPU;
    ``force_groups`` makes ``cost_model.decide`` fuse with that many uniform groups (small shapes would get one)."""
    import dataclasses

    import torch.distributed as dist

    from flashoverlap_inductor import cost_model
    from flashoverlap_inductor.native import nccl_direct
    from flashoverlap_inductor.routes import nccl as nccl_route
    from flashoverlap_inductor.routes import scatter_pull
    from flashoverlap_inductor.runtime import streams

    res = streams.DeviceResources(0, GPU, 132, _FakeStream(), torch.zeros(4, 16, dtype=torch.int32),
                                  torch.zeros(4, 16, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                                  torch.zeros(4, streams.FAULT_INTS, dtype=torch.int32),
                                  torch.zeros(4, 8, dtype=torch.int32))
    lib = _FakeLib(res, SIM_INFOS)
    cuda_fakes = {"Event": _FakeEvent, "synchronize": lambda *a: None, "_sleep": lambda cycles: None,
                  "Stream": lambda *a, **k: _FakeStream(), "current_stream": lambda *a: _FakeStream(),
                  "stream": lambda s: contextlib.nullcontext(), "get_device_name": lambda *a: GPU,
                  "empty_cache": lambda: None, "is_current_stream_capturing": lambda: False,
                  "get_device_properties": lambda *a: _Props(), "set_device": lambda *a: None,
                  "current_device": lambda: 0, "get_device_capability": lambda *a: (9, 0),
                  # A machine with GPUs must not see a CUDA runtime either: is_available() gates streams.persistent
                  # (and kernels.available, faked below) onto their CPU dry-run branch, and torch.cuda.device would
                  # lazily initialize the real runtime.
                  "is_available": lambda: False, "device": lambda *a: contextlib.nullcontext()}
    real_decide = cost_model.decide

    def decide(collective, m, n, k, dtype, world_size, **kw):
        d = real_decide(collective, m, n, k, dtype, world_size, **kw)
        align = 1 if collective == "all_reduce" else world_size
        return dataclasses.replace(d, fuse=True, plan=planlib.uniform_plan(m, n, 8, 16, force_groups, align=align))

    patches = [(torch.cuda, name, fn) for name, fn in cuda_fakes.items()]
    patches += [(torch.cuda.nccl, "version", lambda: (2, 28, 9)), (streams, "resources", lambda index: res),
                (kernels, "config_index", lib.config_index), (kernels, "workspace_bytes", lib.workspace_bytes),
                (kernels, "gemm", lib.gemm), (nccl_route, "fused_call", lib.fused_call),
                (kernels, "available", lambda: True),
                (kernels, "configs", lambda add_c=0: [] if add_c else list(SIM_INFOS)),  # no peer route
                (kernels, "ready", lambda *a: None), (routes, "_on_cuda", lambda a: True),
                (nccl_direct, "communicator", lambda group, device: types.SimpleNamespace(comm=0)),
                (nccl_direct, "bind_library", lambda comm: True), (nccl_route, "is_nccl_group", lambda group: True),
                # no pull route either: it needs symmetric memory, which CPU tensors lack
                (scatter_pull.ROUTE, "unsupported", lambda call, settings: "simulated: no symmetric memory")]
    if force_groups:
        patches.append((cost_model, "decide", decide))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    routes.reset()
    try:
        yield res, lib
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        routes.reset()  # the pool's ranks serve later tests: no GPU path there
        dist.barrier()


SIM_CASES = (("2d", 76, "nk", True, "multi"), ("2d", 76, "kn", False, "tiles"), ("3d", 80, "nk", False, "multi"),
             ("bmm", 80, "nk", True, "tiles"), ("2d", 96, None, True, "multi"), ("2d", 100, "nk", False, "auto"))


def simulated_gpu_worker() -> dict[str, int]:
    import torch.distributed as dist

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    bf, cases = torch.bfloat16, 0
    torch.use_deterministic_algorithms(True)  # fresh outputs are NaN: unwritten rows fail
    # "auto" gives these tiny shapes one group: run it fused anyway
    key = config.current().replace(experiments={"single_group"}).key()
    stats = routes.stats
    try:
        with simulated_gpu() as (res, lib):
            for coll in ("all_reduce", "reduce_scatter", "all_to_all"):
                for form, rows, layout, bias, plan_kind in SIM_CASES:
                    gen = torch.Generator().manual_seed(rows * 7 + rank + cases)
                    a = torch.randn(rows, 16, generator=gen).to(bf)
                    w = torch.randn(24, 16, generator=gen).to(bf)
                    strided = torch.randn(16, 48, generator=gen).to(bf)[:, ::2]
                    b = {"nk": w.t(), "kn": w.t().contiguous(), None: strided}[layout]
                    if form != "2d":
                        a = a.reshape(4, rows // 4, 16)
                    if form == "bmm":
                        a, b = a.transpose(0, 1).contiguous().transpose(0, 1), b.expand(4, 16, 24)
                    c = torch.randn(24, generator=gen).to(bf) if bias else None
                    align = 1 if coll == "all_reduce" else world
                    if plan_kind == "multi":
                        plan = planlib.uniform_plan(rows, 24, 8, 16, 4, align=align).to_str()
                    elif plan_kind == "tiles":
                        tile = (4, 8) if layout == "nk" else (8, 16)
                        plan = planlib.plan_from_tile_row_counts(rows, 24, *tile, [3, 1, 5, 2]).to_str()
                    else:
                        plan = "auto"
                    y = (torch.matmul(a.float(), b.float()) + (c.float() if bias else 0)).reshape(-1, 24).to(bf)
                    ref = _eager_collective(coll, y.contiguous(), world)
                    before = stats[f"fused:{coll}"]
                    name = group.group_name
                    if coll == "all_to_all":
                        out = torch.ops.flashoverlap.gemm_all_to_all(a, b, c, None, None, name, plan, key)
                    elif coll == "all_reduce":
                        out = torch.ops.flashoverlap.gemm_all_reduce(a, b, c, "sum", name, plan, key)
                    else:
                        out = torch.ops.flashoverlap.gemm_reduce_scatter(a, b, c, "sum", world, name, plan, key)
                    fused = stats[f"fused:{coll}"] - before
                    # all_to_all after a batched b runs unfused by design (ranks may hold different batch sizes)
                    assert fused == (0 if coll == "all_to_all" and b.dim() == 3 else 1), (coll, form, dict(stats))
                    torch.testing.assert_close(out.reshape(ref.shape).float(), ref.float(), rtol=2e-2, atol=5e-2)
                    cases += 1
            for ins_all in ([[30, 50], [10, 22]], [[0, 0], [40, 24]]):  # uneven all_to_all, one rank empty
                ins, outs = ins_all[rank], [ins_all[j][rank] for j in range(world)]
                gen = torch.Generator().manual_seed(99 + rank)
                a = torch.randn(sum(ins), 16, generator=gen).to(bf)
                b = torch.randn(24, 16, generator=gen).to(bf).t()
                y = (a.float() @ b.float()).to(bf)
                ref = y.new_empty(sum(outs), 24)
                dist.all_to_all_single(ref, y, outs, ins)
                out = torch.ops.flashoverlap.gemm_all_to_all(a, b, None, outs, ins, group.group_name, "auto", key)
                torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=5e-2)
                cases += 1
            launches = [e.launches["nccl"] for e in routes._memo.values() if "nccl" in e.launches]
            slots, waits, ordered = len(res.slots), lib.waits, lib.ordered
            rows_routes = collections.Counter(la.rows_route for la in launches)
            calls = lib.calls
            stats = collections.Counter(routes.stats)  # before the simulation's reset clears them
    finally:
        torch.use_deterministic_algorithms(False)
    # all_to_all after a batched b runs unfused by design (2 bmm cases x 4 all_to_all forms); nothing else does
    assert stats["fused:all_to_all"] >= 2 and stats["fused:all_to_all"] + stats["unfused"] == 8, dict(stats)
    assert stats["route:nccl"] == calls == cases - stats["unfused"] and not any(k.startswith("skip:") for k in stats)
    assert slots == 1 and waits > 0
    # every reduce_scatter / all_to_all launch with a reordering layout (> 1 group, rows here) took the "schedule"
    # route (tile-row order, natural rows); the others have the identity layout
    assert ordered == rows_routes["schedule"] >= stats["fused:reduce_scatter"] > 0 and not rows_routes["gather"], (
        ordered, rows_routes, dict(stats))
    return {"cases": cases, "waits": waits, "launches": len(launches)}


def _eager_collective(coll, y, world):
    import torch.distributed as dist

    if coll == "all_reduce":
        dist.all_reduce(y)
        return y
    if coll == "reduce_scatter":
        out = y.new_empty(y.shape[0] // world, y.shape[1])
        ops.reduce_scatter_into(out, y)
        return out
    out = torch.empty_like(y)
    dist.all_to_all_single(out, y)
    return out


def test_simulated_gpu_path_matches_eager():
    from dist_utils import get_pool

    results = get_pool(2).run(simulated_gpu_worker)
    assert [r["cases"] for r in results] == [20, 20], results
    # 20 cases; the all_to_all after a batched b runs unfused (no launch), so 19 launches
    assert all(r["waits"] > 40 and r["launches"] == 19 for r in results), results


def bench_dry_run_worker(json_path: str) -> int:
    spec = importlib.util.spec_from_file_location("bench_ops_dry", ROOT / "examples" / "bench_ops.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.DEVICE = "cpu"
    with simulated_gpu(force_groups=4):
        return bench.main(["--shapes", "256x64x64,512x128x32", "--rounds", "2", "--target-ms", "2", "--json",
                           json_path, "--png", json_path + ".png"])


def test_bench_dry_run_on_cpu(tmp_path):
    """examples/bench_ops.py end to end: probing and agreement, correctness checks, the interleaved timer, rows,
    summary and JSON; async-TP has no CPU kernel, so the probe must drop it on both ranks."""
    from dist_utils import get_pool

    path = str(tmp_path / "bench.json")
    assert get_pool(2).run(bench_dry_run_worker, path) == [0, 0]
    doc = json.loads(Path(path).read_text())
    assert doc["meta"]["world"] == 2 and doc["meta"]["available"] is True and doc["meta"]["routing"] == "registry"
    rows = doc["rows"]
    assert [(r["op"], r["m"]) for r in rows] == [(op, m) for m in (256, 512) for op in ("all_reduce", "reduce_scatter",
                                                                                        "all_to_all")]
    for r in rows:
        for key in ("gemm_ms", "comm_ms", "seq_ms", "chunked_ms", "fused_ms", "ideal_ms", "pred_fused_ms",
                    "concurrent_ms"):
            assert r[key] is not None and r[key] > 0, (r["op"], key, r[key])
        assert r["relerr_fused"] < 2e-2 and r["correct"] is True, r
        assert r["fused_path"] is True and r["groups"] == 4 and r["launch"].startswith(r["op"]), r
        assert r["speedup"] == pytest.approx(r["seq_ms"] / r["fused_ms"])
        assert r["auto_fuse"] is True and r["auto_ms"] == r["fused_ms"]
    rs = [r for r in rows if r["op"] == "reduce_scatter"]
    assert all("reduce_scatter:asynctp" in r["errors"] and r["asynctp_ms"] is None for r in rs)
    assert set(doc["summary"]["ops"]) == {"all_reduce", "reduce_scatter", "all_to_all"}
    assert "all_reduce geomean speedup" in doc["summary"]["checks"]  # world 2 has an all_reduce target


def tune_dry_run_worker(out_dir: str) -> list[int]:
    import torch.distributed as dist

    tune.DEVICE = "cpu"
    rcs = []
    with config.patch(experiments={"single_group"}):
        with simulated_gpu():
            rcs.append(tune.main(["bandwidth", "--quick", "--min-bytes", "65536", "--max-bytes", "1048576",
                                  "--out", f"{out_dir}/bandwidth.json"]))
            rcs.append(tune.main(["search", "--collective", "reduce_scatter", "--shape", "1024x64x32,512x64x32",
                                  "--max-units", "3", "--rounds", "2", "--refine", "2", "--out-dir", out_dir,
                                  "--record", f"{out_dir}/records.json"]))
            if dist.get_rank() == 0:
                rcs.append(tune.main(["gemm", "--shapes", "64x32x32,128x64x32", "--free", "0,16", "--rounds", "2",
                                      "--out", f"{out_dir}/gemm.json"]))
    return rcs


def test_tune_dry_run_on_cpu(tmp_path):
    """The tuner's three commands end to end; their files pass the cost model's schema and loader."""
    from dist_utils import get_pool

    assert get_pool(2).run(tune_dry_run_worker, str(tmp_path)) == [[0, 0, 0], [0, 0]]
    bw = json.loads((tmp_path / "bandwidth.json").read_text())
    assert set(bw["curves"]) >= {"2", "4"}  # the shipped world 4 kept, world 2 measured
    assert len(bw["curves"]["2"]["all_reduce"]) == 4 * 4 + 1 and "tune bandwidth" in bw["source"]
    BandwidthCurve.from_json(bw, "dry run")
    plans = json.loads(tune_docs.plans_path(tmp_path, GPU, 2).read_text())
    entries = sorted(schema.validate_plans(plans, "dry run"), key=lambda e: -e["m"])
    assert [(e["collective"], e["m"], e["world_size"], e["mode"]) for e in entries] == \
        [("reduce_scatter", 1024, 2, "both"), ("reduce_scatter", 512, 2, "both")]
    entry = entries[0]
    records = tune_docs.read_records(tmp_path / "records.json")  # both shapes, every candidate measured
    assert [(r["m"], r["max_units"]) for r in records] == [(1024, 3), (512, 3)]
    assert all(len(r["candidates"]) >= 2 and all(c["measured_ms"] > 0 for c in r["candidates"]) for r in records), \
        [[c["measured_ms"] for c in r["candidates"]] for r in records]
    assert entry["measured_fused_ms"] > 0 and entry["measured_seq_ms"] > 0 and entry["evaluated"] >= 4
    gemm = json.loads((tmp_path / "gemm.json").read_text())
    schema.validate_gemm(gemm, "dry run")
    assert set(gemm["tuned_kernels"]["best_by_tile"]) <= {"8x16", "4x8"} and gemm["tuned_kernels"]["samples"]


def gpu_tests_dry_run_worker() -> dict[str, object]:
    """The tasks of tests/test_gpu_ops.py that need no CUDA graph or Inductor, on the simulated GPU (bf16 only:
    gloo; smaller shapes: fp64 references on 2 cores)."""
    import test_gpu_ops as g

    g.DEVICE = "cpu"
    g.SHAPES = [("2d", 256, 776, 328), ("2d", 40, 264, 64), ("bmm_expand", 256, 128, 64)]
    g.IN_FLIGHT = [("all_reduce", 256, 64, 32), ("reduce_scatter", 512, 128, 32), ("all_to_all", 384, 96, 32)]
    out: dict[str, object] = {}
    with simulated_gpu():
        g._route_ops()
        for op in ("all_reduce", "reduce_scatter", "all_to_all"):
            out[op] = g.match_eager_task(op, "bfloat16")
        out["uneven"] = g.uneven_all_to_all_task()
        out["fallback"] = sorted(k for k in g.fallback_task() if k.startswith("fallback:"))
        out["repeated"] = g.repeated_calls_task(20)
        out["in_flight"] = g.in_flight_task()
        out["timeout"] = g.timeout_record_task()
    return out


def test_gpu_test_tasks_dry_run_on_cpu():
    from dist_utils import get_pool

    for r in get_pool(2).run(gpu_tests_dry_run_worker):
        for op in ("all_reduce", "reduce_scatter", "all_to_all"):
            assert r[op]["cases"] == 3 * 2 * 4 and r[op]["fused"] >= r[op]["fused_expected"] > 0, r[op]
        assert r["uneven"] == 12 and r["in_flight"] == 9 and r["timeout"].startswith("ok")
        assert r["fallback"] == ["fallback:alignment", "fallback:bias_rows", "fallback:bmm", "fallback:dtype"]
        assert all(v >= 20 for v in r["repeated"].values())


def test_a_variant_is_wrong_only_where_its_error_was_measured(bench):
    """A fused variant skipped on a shape (NaN error, None after JSON) is not counted wrong; an exact result (error
    0.0) is right; a NaN output (error inf) and a large error are wrong (the 4-GPU ring run counted skips as wrong)."""
    rows = []
    for m, rel in ((2048, math.nan), (4096, None), (8192, 0.0), (16384, math.inf), (32768, 0.5)):
        r = _row(bench, "reduce_scatter", m, seq=1.0, fused=0.9, gemm=0.8, comm=0.3)
        r["variants"] = {"tiles/peer////ring1": {"ms": 0.9 if rel is not None else None, "speedup": 1.1,
                                                 "relerr": rel}}
        rows.append(r)
    wrong = bench.summarize(rows, 4)["ops"]["reduce_scatter"]["variants"]["tiles/peer////ring1"]["wrong"]
    assert wrong == ["16384x8192x8192", "32768x8192x8192"]
