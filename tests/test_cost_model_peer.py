"""The peer route's time model (``cost_model/peer.py``): formula, fit, data file section, ``decide(peer=True)``, the
benchmark's error column and ``tune fit --peer`` (CPU only, fast)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random

import pytest

from flashoverlap_inductor import config
from flashoverlap_inductor.cost_model import clear_caches, decide, model_for, registry
from flashoverlap_inductor.cost_model.peer import PeerModel, PeerTerms, fit_terms, gemms_ms, relative_errors
from flashoverlap_inductor.cost_model.schema import ConfigError, validate_gemm
from flashoverlap_inductor.tools import tune
from flashoverlap_inductor.tune import fit as tune_fit

GRID = [(m, n, k) for m in (2048, 4096, 8192, 16384) for n, k in ((8192, 8192), (8192, 7168), (4096, 4096),
                                                                  (8192, 14336))]


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_caches()
    yield
    clear_caches()


def _gemm():
    return model_for("NVIDIA H200")[0].gemm


def test_shipped_data_has_a_peer_model_for_two_ranks():
    peer = _gemm().peer
    assert peer is not None and peer.world_size == 2
    assert set(peer.terms) == {"all_reduce", "reduce_scatter"}
    for t in peer.terms.values():  # plausible: a little slower than the GEMM alone, a small fixed cost
        assert 0.9 < t.gemm_factor < 1.3 and 0 <= t.fixed_ms < 0.2


def test_prediction_is_the_formula():
    gemm = _gemm()
    model = PeerModel(2, {"reduce_scatter": PeerTerms(1.1, 0.03), "all_reduce": PeerTerms(1.0, 0.05)})
    m, n, k = 3000, 4096, 2048
    want = 1.1 * (gemm.reference_ms(1500, n, k, "bfloat16") * 2) + 0.03
    assert model.predict_ms(gemm, "reduce_scatter", m, n, k, "bfloat16") == pytest.approx(want)
    assert gemms_ms(gemm, "all_reduce", 3001, n, k, "bfloat16") == pytest.approx(  # odd rows: ceil and floor halves
        gemm.reference_ms(1501, n, k, "bfloat16") + gemm.reference_ms(1500, n, k, "bfloat16"))
    with pytest.raises(ValueError):
        PeerModel(2, {"reduce_scatter": PeerTerms(1.0, 0.0)}).predict_ms(gemm, "all_reduce", m, n, k, "bfloat16")


def test_a_gemm_is_no_faster_than_its_nvlink_stores():
    gemm = _gemm()
    m, n, k = 8192, 4096, 512  # a short K: half the output (32 MiB) takes longer on the link than to compute
    link = 3.0e8  # bytes per ms (300 GB/s)
    t_half, t_link = gemm.reference_ms(m // 2, n, k, "bfloat16"), (m // 2) * n * 2 / link
    assert t_link > t_half
    # reduce_scatter stores over the link in GEMM 1 only, all_reduce in both GEMMs
    assert gemms_ms(gemm, "reduce_scatter", m, n, k, "bfloat16", link) == pytest.approx(t_link + t_half)
    assert gemms_ms(gemm, "all_reduce", m, n, k, "bfloat16", link) == pytest.approx(2 * t_link)
    assert gemms_ms(gemm, "all_reduce", m, n, 8192, "bfloat16", link) == pytest.approx(  # a long K: compute-bound
        2 * gemm.reference_ms(m // 2, n, 8192, "bfloat16"))
    model = model_for("NVIDIA H200")[0]  # the shipped link rate: NCCL's all_reduce tail, 250..450 GB/s
    assert 2.5e8 < model.link_bytes_per_ms(2) < 4.5e8
    t = model.gemm.peer.terms["all_reduce"]
    assert 0.5 <= t.link_efficiency <= 1
    link = model.link_bytes_per_ms(2) * t.link_efficiency
    assert model.peer_ms("all_reduce", m, n, k, "bfloat16", 2) == pytest.approx(max(
        t.host_floor_ms, t.gemm_factor * gemms_ms(gemm, "all_reduce", m, n, k, "bfloat16", link) + t.fixed_ms))


def test_host_floor_and_link_efficiency():
    gemm, link = _gemm(), 3.0e8
    base = PeerTerms(1.0, 0.01)
    small, short_k = (256, 1024, 512), (8192, 4096, 512)
    assert PeerModel(2, {"all_reduce": base}).predict_ms(gemm, "all_reduce", *small, "bfloat16", link) < 0.1
    floored = PeerModel(2, {"all_reduce": PeerTerms(1.0, 0.01, host_floor_ms=0.2)})
    assert floored.predict_ms(gemm, "all_reduce", *small, "bfloat16", link) == 0.2  # the host is the limit
    assert floored.predict_ms(gemm, "all_reduce", *small, "bfloat16", link, host_bound=False) == pytest.approx(
        base.gemm_factor * gemms_ms(gemm, "all_reduce", *small, "bfloat16", link) + 0.01)  # CUDA-graph replays
    half = PeerModel(2, {"all_reduce": PeerTerms(1.0, 0.01, link_efficiency=0.5)})
    assert half.predict_ms(gemm, "all_reduce", *short_k, "bfloat16", link) == pytest.approx(
        2 * (8192 // 2) * 4096 * 2 / (0.5 * link) + 0.01)


@pytest.mark.parametrize("collective,world,m,ok", [
    ("reduce_scatter", 2, 4096, True), ("reduce_scatter", 4, 4096, False), ("reduce_scatter", 2, 4095, False),
    ("all_reduce", 2, 4096, False), ("all_to_all", 2, 4096, False)])
def test_covers_only_what_the_route_runs(collective, world, m, ok):
    assert PeerModel(2, {"reduce_scatter": PeerTerms(1.0, 0.0)}).covers(collective, world, m) is ok


def test_fit_recovers_the_terms_and_ignores_one_disturbed_row():
    gemm, truth = _gemm(), PeerTerms(1.07, 0.04)
    rng = random.Random(7)
    rows = [(m, n, k, (truth.gemm_factor * gemms_ms(gemm, "reduce_scatter", m, n, k, "bfloat16") + truth.fixed_ms)
             * (1 + rng.uniform(-0.005, 0.005))) for m, n, k in GRID]
    rows[3] = (*rows[3][:3], rows[3][3] * 1.6)  # one row slowed by the host (as in a noisy run)
    got = fit_terms(gemm, "reduce_scatter", rows)
    assert got.gemm_factor == pytest.approx(1.07, abs=0.01) and got.fixed_ms == pytest.approx(0.04, abs=0.01)
    errs = relative_errors(gemm, "reduce_scatter", got, rows)
    assert sorted(errs)[len(errs) // 2] < 0.01 and max(errs) > 0.3  # the disturbed row stays an outlier
    with pytest.raises(ValueError):
        fit_terms(gemm, "reduce_scatter", rows[:1])


def _doc_with(peer_section):
    doc = json.loads((registry.data_dir() / "gemm_h200.json").read_text())
    doc["peer"] = peer_section
    return doc


@pytest.mark.parametrize("mutate", [
    lambda p: p.update(world_size=1),
    lambda p: p["collectives"]["all_reduce"].update(gemm_factor=0),
    lambda p: p["collectives"]["all_reduce"].update(fixed_ms=-0.01),
    lambda p: p["collectives"].update(all_gather={"gemm_factor": 1.0, "fixed_ms": 0.0}),
    lambda p: p["collectives"]["reduce_scatter"].pop("fixed_ms"),
    lambda p: p.update(collectives=[]),
    lambda p: p["collectives"]["all_reduce"].update(host_floor_ms=-0.1),
    lambda p: p["collectives"]["all_reduce"].update(link_efficiency=1.5),
    lambda p: p["collectives"]["all_reduce"].update(link_efficiency=0),
])
def test_schema_rejects_a_malformed_peer_section(mutate):
    section = copy.deepcopy(json.loads((registry.data_dir() / "gemm_h200.json").read_text())["peer"])
    validate_gemm(_doc_with(section), "ok.json")
    mutate(section)
    with pytest.raises(ConfigError, match="peer"):
        validate_gemm(_doc_with(section), "bad.json")


def test_decide_predicts_the_peer_route_when_told():
    model = model_for("NVIDIA H200")[0]
    m, n, k = 8192, 8192, 8192
    nccl = decide("reduce_scatter", m, n, k, "bfloat16", 2)
    peer = decide("reduce_scatter", m, n, k, "bfloat16", 2, peer=True)
    assert nccl.route == "nccl" and peer.route == "peer" and "peer route" in peer.reason
    assert peer.predicted_fused_ms == pytest.approx(model.peer_ms("reduce_scatter", m, n, k, "bfloat16", 2))
    assert peer.predicted_seq_ms == nccl.predicted_seq_ms and peer.plan == nccl.plan  # the fallback's plan
    assert peer.fuse == (peer.predicted_fused_ms <= (1 - config.current().min_gain_fraction) * peer.predicted_seq_ms)
    # calls the peer model does not cover are predicted on the NCCL route
    for args in (("all_to_all", m, n, k, "bfloat16", 2), ("all_reduce", m, n, k, "bfloat16", 4),
                 ("all_reduce", m + 1, n, k, "bfloat16", 2)):
        assert decide(*args, peer=True).route == "nccl"
    small = decide("all_reduce", 128, n, k, "bfloat16", 2, peer=True)
    assert not small.fuse and "min_rows" in small.reason and small.route == "peer"


def test_decide_drops_the_host_floor_for_cuda_graphs():
    """A shape the host floor decides: declined for eager calls, fused where CUDA graphs replay it."""
    model = model_for("NVIDIA H200")[0]
    m, n, k = 2048, 4096, 1024
    floor = model.gemm.peer.terms["all_reduce"].host_floor_ms
    eager = decide("all_reduce", m, n, k, "bfloat16", 2, peer=True)
    graphs = decide("all_reduce", m, n, k, "bfloat16", 2, peer=True, cuda_graphs=True)
    assert eager.predicted_fused_ms == pytest.approx(floor) and not eager.fuse
    assert graphs.predicted_fused_ms == pytest.approx(model.peer_ms("all_reduce", m, n, k, "bfloat16", 2, False))
    assert graphs.predicted_fused_ms < floor and graphs.route == "peer"
    gain = config.current().min_gain_fraction
    assert graphs.fuse == (graphs.predicted_fused_ms <= (1 - gain) * graphs.predicted_seq_ms)
    # calls the peer model does not cover are predicted on the NCCL route, which has no host floor: the flag
    # changes nothing there
    for args in (("all_reduce", m, n, k, "bfloat16", 4), ("all_to_all", m, n, k, "bfloat16", 2)):
        assert decide(*args, peer=True, cuda_graphs=True) == decide(*args, peer=True)


def test_decide_without_a_peer_model_says_so(monkeypatch):
    model = model_for("NVIDIA H200")[0]
    bare = dataclasses.replace(model, gemm=dataclasses.replace(model.gemm, peer=None))
    monkeypatch.setattr(registry, "model_for", lambda name, directory=None: (bare, "exact"))
    d = decide("reduce_scatter", 8192, 8192, 8192, "bfloat16", 2, peer=True)
    assert d.route == "nccl" and "no peer-route model" in d.reason


def test_bench_error_column_only_for_the_route_predicted():
    from examples.bench_report import derive

    base = {"seq_ms": 2.0, "fused_ms": 1.6, "ideal_ms": 1.5, "chunked_ms": math.nan, "asynctp_ms": math.nan,
            "auto_ms": 1.6, "pred_fused_ms": 1.7, "pred_seq_ms": 2.1, "fused_path": True}
    peer_row = derive({**base, "launch": "reduce_scatter ...: peer route, GEMM 2 x", "pred_route": "peer"})
    assert peer_row["err_fused"] == pytest.approx(0.1 / 1.6)
    assert math.isnan(derive({**base, "launch": "x: peer route", "pred_route": "nccl"})["err_fused"])
    assert math.isnan(derive({**base, "launch": "persistent grid", "pred_route": "peer"})["err_fused"])
    assert derive({**base, "launch": "persistent grid"})["err_fused"] == pytest.approx(0.1 / 1.6)


def _peer_bench(terms: dict[str, PeerTerms]) -> dict:
    model, rows = model_for("NVIDIA H200")[0], []
    for op, t in terms.items():
        for m, n, k in GRID + [(8192, 4096, 512), (8192, 8192, 1024)]:  # the last two bound by the link
            ms = PeerModel(2, {op: t}).predict_ms(model.gemm, op, m, n, k, "bfloat16", model.link_bytes_per_ms(2))
            rows.append({"op": op, "m": m, "n": n, "k": k, "world": 2, "plan": "", "fused_path": True,
                         "fused_ms": ms, "launch": f"{op} rows={m}: peer route, GEMM 2 cfg, push", "variants": {}})
    # a row on the NCCL route: never part of the peer fit (and the peer rows never part of the NCCL fit)
    rows.append({"op": "reduce_scatter", "m": 8192, "n": 8192, "k": 8192, "world": 2, "plan": "",
                 "fused_path": True, "fused_ms": 9.9, "launch": "persistent grid", "variants": {}})
    return {"meta": {"gpu": "NVIDIA H200"}, "rows": rows}


def test_tune_fit_peer_writes_the_section(tmp_path, monkeypatch):
    data = tmp_path / "configs"
    data.mkdir()
    for p in registry.data_dir().glob("*.json"):
        (data / p.name).write_text(p.read_text())
    truth = {"all_reduce": PeerTerms(1.05, 0.09, link_efficiency=0.8), "reduce_scatter": PeerTerms(1.08, 0.03)}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_peer_bench(truth)))
    assert len(tune_fit.load_rows([str(bench)], None, peer=True)[0]) == 2 * (len(GRID) + 2)
    assert len(tune_fit.load_rows([str(bench)], None)[0]) == 1
    monkeypatch.setitem(config._overrides, "config_dir", str(data))  # as config.patch
    registry.clear_caches()
    assert tune.main(["fit", "--peer", "--bench", str(bench), "--host-floor", "reduce_scatter=0.123", "--write"]) == 0
    registry.clear_caches()
    peer = model_for("NVIDIA H200")[0].gemm.peer
    for op, t in truth.items():
        assert peer.terms[op].gemm_factor == pytest.approx(t.gemm_factor, abs=2e-3)
        assert peer.terms[op].fixed_ms == pytest.approx(t.fixed_ms, abs=2e-3)
        assert peer.terms[op].link_efficiency == t.link_efficiency
    assert peer.fit["all_reduce"]["rows"] == len(GRID) + 2
    assert peer.terms["reduce_scatter"].host_floor_ms == 0.123
    # a refit without --host-floor keeps the floors in the file
    assert tune.main(["fit", "--peer", "--bench", str(bench), "--write"]) == 0
    registry.clear_caches()
    assert model_for("NVIDIA H200")[0].gemm.peer.terms["reduce_scatter"].host_floor_ms == 0.123
    assert tune.main(["fit", "--peer", "--bench", str(bench), "--host-floor", "all_reduce"]) == 2
    assert tune.main(["fit", "--peer", "--bench", str(bench), "--host-floor", "all_gather=0.1"]) == 2
    # rows of one collective: the other keeps its terms
    only_rs = tmp_path / "rs.json"
    doc = _peer_bench({"reduce_scatter": PeerTerms(1.2, 0.05)})
    only_rs.write_text(json.dumps(doc))
    assert tune.main(["fit", "--peer", "--bench", str(only_rs), "--write"]) == 0
    registry.clear_caches()
    peer = model_for("NVIDIA H200")[0].gemm.peer
    assert peer.terms["reduce_scatter"].gemm_factor == pytest.approx(1.2, abs=2e-3)
    assert peer.terms["all_reduce"].gemm_factor == pytest.approx(1.05, abs=2e-3)
    assert set(peer.fit) == {"all_reduce", "reduce_scatter"}
