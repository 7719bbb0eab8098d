"""The ring route's time model (``cost_model/ring.py``): rounds, formula, fit, data file section,
``decide(ring_rounds=...)`` and ``tune fit --ring`` (CPU only, fast)."""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import pytest

from flashoverlap_inductor import config
from flashoverlap_inductor.cost_model import clear_caches, decide, model_for, registry
from flashoverlap_inductor.cost_model.peer import PeerTerms
from flashoverlap_inductor.cost_model.ring import (
    STEP_TILES,
    RingModel,
    fit_terms,
    relative_errors,
    rounds_for,
    step_tile,
    steps_ms,
)
from flashoverlap_inductor.cost_model.schema import ConfigError, validate_gemm
from flashoverlap_inductor.tools import tune
from flashoverlap_inductor.tune import fit_ring as tune_fit_ring
from flashoverlap_inductor.tune import rows as tune_rows

GRID = [(m, n, k) for m in (2048, 4096, 8192, 16384) for n, k in ((8192, 8192), (8192, 7168), (4096, 4096),
                                                                  (8192, 14336))]
BF = "bfloat16"


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_caches()
    yield
    clear_caches()


def _model():
    return model_for("NVIDIA H200")[0]


def test_rounds_cut_equal_pieces_of_at_least_128_rows():
    assert rounds_for("all_reduce", 8192, 4, 4) == 4 and rounds_for("all_reduce", 2048, 4, 4) == 4
    assert rounds_for("all_reduce", 1024, 4, 4) == 2 and rounds_for("all_reduce", 512, 4, 4) == 1
    assert rounds_for("all_reduce", 256, 4, 4) is None and rounds_for("all_reduce", 8194, 4, 4) is None
    assert rounds_for("all_reduce", 3072, 3, 4) == 4 and rounds_for("all_reduce", 3 * 2 * 200, 3, 4) == 2
    assert rounds_for("reduce_scatter", 8192, 4, 4) == 1  # reduce_scatter runs one round


def test_step_tile_fills_the_sms_and_prefers_the_first_tile_on_ties():
    assert step_tile(256, 8192, 132) == (128, 128)  # 64 tiles of 128x256 would leave half the SMs idle
    assert step_tile(512, 8192, 132) == (128, 256)  # 1 wave of 128 tiles against 2 waves of half the area: a tie
    assert step_tile(1024, 8192, 132) == (128, 256)
    assert step_tile(256, 1024, 132) == (128, 128)  # one wave either way: the smaller tile's wave is shorter
    assert step_tile(384, 8192, 132) == (128, 256)  # 96 tiles in 1 wave against 192 in 2
    for rows in (640, 768, 1152, 1280):  # a full wave of 128x256 or more: the preferred tile, though 128x128 would
        assert step_tile(rows, 8192, 132) == (128, 256)  # quantize better (not timed there)
    assert step_tile(256, 8192, 132, [(128, 256)]) == (128, 256)
    assert step_tile(256, 8192, 132, [(128, 128), (128, 256)]) == (128, 128)


def test_step_tiles_are_the_compiled_step_configurations():
    from flashoverlap_inductor import build

    tiles = [c.tile[:2] for c in build.CONFIGS if c.add_c == 1]
    assert list(dict.fromkeys(tiles)) == list(STEP_TILES)  # the same tiles, the preferred one first


def test_the_regressor_is_the_formula():
    gemm, link = _model().gemm, 3.0e8  # bytes per ms
    m, n, k = 8192, 8192, 4096
    p = m // 8  # 4 ranks, 2 rounds: 1024-row pieces in 128x256 tiles (the reference tile)
    t, b = gemm.reference_ms(p, n, k, BF), p * n * 2 / link
    assert t == gemm.gemm_ms(p, n, k, BF, 128, 256, gemm.sm_count)
    assert t > b  # compute-bound steps: every round is world steps, all_reduce adds the last gather
    assert steps_ms(gemm, "reduce_scatter", m, n, k, BF, 4, 2, link) == pytest.approx(2 * 4 * t)
    assert steps_ms(gemm, "all_reduce", m, n, k, BF, 4, 2, link) == pytest.approx(2 * 4 * t + 3 * b)
    # a short K: the link bounds the steps and, for all_reduce, the rounds that also carry the pulls
    k = 256
    t = gemm.reference_ms(m // 4, n, k, BF)
    b = (m // 4) * n * 2 / link
    assert b > t
    assert steps_ms(gemm, "reduce_scatter", m, n, k, BF, 4, 1, link) == pytest.approx(3 * b + t)  # the last
    # step pushes nothing
    p = m // 8
    b = p * n * 2 / link
    t = gemm.reference_ms(p, n, k, BF)
    assert step_tile(p, n, gemm.sm_count) == (128, 256)
    # round 0: 3 pushing steps (each max(t, b)) and the last; round 1: also the 3 pulls of round 0 -> 6 pieces on the
    # link; then the last round's 3 pulls
    want = max(3 * max(t, b) + t, 3 * b) + max(3 * max(t, b) + t, 6 * b) + 3 * b
    assert steps_ms(gemm, "all_reduce", m, n, k, BF, 4, 2, link) == pytest.approx(want)
    with pytest.raises(ValueError):
        steps_ms(gemm, "all_reduce", m, n, k, BF, 1, 1, link)
    with pytest.raises(ValueError):
        steps_ms(gemm, "all_reduce", 4, n, k, BF, 4, 2, link)  # no rows per piece
    # 256-row pieces: steps in 128x128 tiles, half the 128x256 wave
    small = gemm.gemm_ms(256, 8192, 8192, BF, 128, 128, gemm.sm_count)
    assert small < gemm.reference_ms(256, 8192, 8192, BF)
    assert steps_ms(gemm, "reduce_scatter", 1024, 8192, 8192, BF, 4, 1) == pytest.approx(4 * small)


def test_prediction_host_floor_and_coverage():
    gemm = _model().gemm
    model = RingModel({4: {"all_reduce": PeerTerms(1.1, 0.05, host_floor_ms=0.4, link_efficiency=0.8)}})
    m, n, k, link = 4096, 8192, 8192, 3.0e8
    x = steps_ms(gemm, "all_reduce", m, n, k, BF, 4, 2, link * 0.8)
    assert model.predict_ms(gemm, "all_reduce", m, n, k, BF, 4, 2, link) == pytest.approx(max(0.4, 1.1 * x + 0.05))
    small = model.predict_ms(gemm, "all_reduce", 512, 1024, 1024, BF, 4, 1, link)
    assert small == 0.4 and model.predict_ms(gemm, "all_reduce", 512, 1024, 1024, BF, 4, 1, link, False) < 0.4
    assert model.covers("all_reduce", 4) and not model.covers("reduce_scatter", 4)
    assert not model.covers("all_reduce", 8)
    with pytest.raises(ValueError):
        model.predict_ms(gemm, "reduce_scatter", m, n, k, BF, 4, 1, link)


def _truth_rows(model, terms: dict[str, PeerTerms], world: int) -> list[tuple]:
    link = model.link_bytes_per_ms(world)
    ring = RingModel({world: terms})
    rows = []
    for op in terms:
        for m, n, k in GRID + [(8192, 8192, 512)]:
            for most in ((1, 2, 4) if op == "all_reduce" else (1,)):
                q = rounds_for(op, m, world, most)
                rows.append((op, m, n, k, q, most, ring.predict_ms(model.gemm, op, m, n, k, BF, world, q, link)))
    return rows


def test_fit_recovers_the_terms_and_ignores_one_disturbed_row():
    model = _model()
    truth = PeerTerms(1.12, 0.06, link_efficiency=0.85)
    rng = random.Random(3)
    rows = [(m, n, k, q, ms * (1 + rng.uniform(-0.004, 0.004)))
            for _, m, n, k, q, _, ms in _truth_rows(model, {"all_reduce": truth}, 4)]
    rows[5] = (*rows[5][:4], rows[5][4] * 1.7)
    link = model.link_bytes_per_ms(4)
    got = fit_terms(model.gemm, "all_reduce", 4, rows, link_bytes_per_ms=link)
    assert got.gemm_factor == pytest.approx(1.12, abs=0.01) and got.fixed_ms == pytest.approx(0.06, abs=0.01)
    errs = relative_errors(model.gemm, "all_reduce", 4, got, rows, link_bytes_per_ms=link)
    assert sorted(errs)[len(errs) // 2] < 0.01 and max(errs) > 0.3
    with pytest.raises(ValueError):
        fit_terms(model.gemm, "all_reduce", 4, rows[:1])


def _doc_with(ring_section):
    doc = json.loads((registry.data_dir() / "gemm_h200.json").read_text())
    doc["ring"] = ring_section
    return doc


GOOD = {"worlds": {"4": {"all_reduce": {"gemm_factor": 1.1, "fixed_ms": 0.05, "link_efficiency": 0.9},
                         "reduce_scatter": {"gemm_factor": 1.05, "fixed_ms": 0.02}}}, "fit": {}, "note": "x"}


@pytest.mark.parametrize("mutate", [
    lambda r: r["worlds"].update({"1": {"all_reduce": {"gemm_factor": 1.0, "fixed_ms": 0.0}}}),
    lambda r: r["worlds"].update({"four": {}}),
    lambda r: r["worlds"]["4"]["all_reduce"].update(gemm_factor=0),
    lambda r: r["worlds"]["4"]["all_reduce"].update(link_efficiency=1.2),
    lambda r: r["worlds"]["4"].update(all_to_all={"gemm_factor": 1.0, "fixed_ms": 0.0}),
    lambda r: r["worlds"]["4"]["reduce_scatter"].pop("fixed_ms"),
    lambda r: r.update(worlds=[]),
    lambda r: r.update(fit=[]),
])
def test_schema_rejects_a_malformed_ring_section(mutate):
    section = copy.deepcopy(GOOD)
    validate_gemm(_doc_with(section), "ok.json")
    mutate(section)
    with pytest.raises(ConfigError, match="ring"):
        validate_gemm(_doc_with(section), "bad.json")


def _with_ring(monkeypatch, section=GOOD):
    model = _model()
    gemm = dataclasses.replace(model.gemm, ring=RingModel.from_json(section))
    ringed = dataclasses.replace(model, gemm=gemm)
    monkeypatch.setattr(registry, "model_for", lambda name, directory=None: (ringed, "exact"))
    return ringed


def test_decide_predicts_the_ring_when_told(monkeypatch):
    m, n, k = 8192, 8192, 8192
    model = _model()
    monkeypatch.setattr(registry, "model_for", lambda name, directory=None: (dataclasses.replace(
        model, gemm=dataclasses.replace(model.gemm, ring=None)), "exact"))
    bare = decide("all_reduce", m, n, k, BF, 4, ring_rounds=2)  # data without ring terms
    assert bare.route == "nccl" and "no ring-route model" in bare.reason
    clear_caches()
    model = _with_ring(monkeypatch)
    nccl = decide("all_reduce", m, n, k, BF, 4)
    ring = decide("all_reduce", m, n, k, BF, 4, ring_rounds=2)
    assert ring.route == "ring" and "ring route" in ring.reason
    assert ring.predicted_fused_ms == pytest.approx(model.ring_ms("all_reduce", m, n, k, BF, 4, 2))
    assert ring.predicted_seq_ms == nccl.predicted_seq_ms and ring.plan == nccl.plan
    assert ring.fuse == (ring.predicted_fused_ms <= (1 - config.current().min_gain_fraction) * ring.predicted_seq_ms)
    assert decide("all_reduce", m, n, k, BF, 8, ring_rounds=2).route == "nccl"  # no terms for 8 ranks
    odd = decide("all_reduce", 1024, n, k, BF, 4, ring_rounds=4)  # 64-row pieces: not a call the ring takes
    assert odd.route == "nccl" and "ring_rounds=4" in odd.reason
    assert decide("all_reduce", m, n, k, BF, 4, ring_rounds=4).predicted_fused_ms != ring.predicted_fused_ms


def _ring_bench(model, terms, world: int) -> dict:
    rows = {}
    for op, m, n, k, _, most, ms in _truth_rows(model, terms, world):
        row = rows.setdefault((op, m, n, k), {"op": op, "m": m, "n": n, "k": k, "world": world, "plan": "",
                                             "fused_path": True, "fused_ms": 9.9, "launch": "persistent grid",
                                             "variants": {}})
        row["variants"][f"tiles/peer////ring{most}"] = {"ms": ms}
    odd = {"op": "all_reduce", "m": 8193, "n": 4096, "k": 4096, "world": world, "plan": "", "fused_path": True,
           "fused_ms": 1.0, "launch": "persistent grid",  # no equal pieces: the variant ran the NCCL route
           "variants": {"tiles/peer////ring2": {"ms": 5.0}, "tiles/peer////wait": {"ms": 5.0}}}
    a2a = {**odd, "op": "all_to_all", "m": 8192}
    return {"meta": {"gpu": "NVIDIA H200"}, "rows": [*rows.values(), odd, a2a]}


def test_rows_are_told_apart_by_route():
    row = {"op": "all_reduce", "m": 8192, "n": 8192, "k": 8192, "world": 4}
    assert tune_rows.route_of_row({**row, "launch": "all_reduce rows=8192 ...: ring route, 4 ranks x 2"}) == "ring"
    assert tune_rows.route_of_row({**row, "launch": "reduce_scatter ...: peer route, GEMM 2 x"}) == "peer"
    assert tune_rows.route_of_row({**row, "launch": "persistent grid"}) == "nccl"
    assert tune_rows.route_of_row(row, "tiles/peer////ring2") == "ring"
    assert tune_rows.route_of_row(row, "tiles/peer////wait+ring4") == "ring"
    assert tune_rows.route_of_row(row, "tiles/peer////ring3") == "nccl"  # not a flag bench_ops knows: no ring
    assert tune_rows.route_of_row(row, "tiles/peer") == "nccl"  # the peer route is for 2 ranks
    assert tune_rows.route_of_row(row, "tiles/direct") == "nccl"
    two = {**row, "world": 2}
    assert tune_rows.route_of_row(two, "tiles/peer") == "peer"
    assert tune_rows.route_of_row(two, "tiles/peer////ring2") == "ring"  # 2 ranks on the ring: not the peer model
    assert tune_rows.route_of_row({**row, "m": 8193}, "tiles/peer////ring2") == "nccl"
    assert tune_rows.route_of_row({**row, "op": "all_to_all"}, "tiles/peer////ring2") == "nccl"
    assert tune_rows.modelled_ring_variant("tiles/peer////ring4") == 4
    for spec in ("tiles/peer////wait+ring2", "tiles/peer//coop_128x128x64_c2x1_addc//ring2", "tiles/peer////wait",
                 "tiles/direct", "tiles/peer////ring3"):
        assert tune_rows.modelled_ring_variant(spec) == 0, spec
    assert tune_rows.parse_host_floor("all_reduce=0.2,reduce_scatter=0.1") == {"all_reduce": 0.2,
                                                                              "reduce_scatter": 0.1}
    for bad in ("all_reduce", "all_reduce=x", "all_reduce=0", "all_gather=0.1"):
        with pytest.raises(ValueError, match="host-floor"):
            tune_rows.parse_host_floor(bad)


def test_tune_fit_ring_writes_the_section(tmp_path, monkeypatch):
    data = tmp_path / "configs"
    data.mkdir()
    for p in registry.data_dir().glob("*.json"):
        (data / p.name).write_text(p.read_text())
    model = _model()
    truth = {"all_reduce": PeerTerms(1.1, 0.07, link_efficiency=0.9), "reduce_scatter": PeerTerms(1.04, 0.03)}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_ring_bench(model, truth, 4)))
    rows, gpu = tune_fit_ring.load_ring_rows([str(bench)])
    assert gpu == "NVIDIA H200" and len(rows) == len(_truth_rows(model, truth, 4))
    assert len(tune_fit_ring.load_ring_rows([str(bench)], "tiles/peer////ring2")[0]) == len(GRID) + 1
    monkeypatch.setitem(config._overrides, "config_dir", str(data))  # as config.patch
    registry.clear_caches()
    assert tune.main(["fit", "--ring", "--bench", str(bench), "--host-floor", "all_reduce=0.3", "--write"]) == 0
    registry.clear_caches()
    ring = model_for("NVIDIA H200")[0].gemm.ring
    for op, t in truth.items():
        got = ring.terms[4][op]
        assert got.gemm_factor == pytest.approx(t.gemm_factor, abs=2e-3)
        assert got.fixed_ms == pytest.approx(t.fixed_ms, abs=2e-3) and got.link_efficiency == t.link_efficiency
    assert ring.terms[4]["all_reduce"].host_floor_ms == 0.3 and ring.terms[4]["reduce_scatter"].host_floor_ms == 0
    assert ring.fit["4"]["all_reduce"]["rows"] == 3 * (len(GRID) + 1)
    # a refit from rows of another world size keeps world 4 (and its host floor)
    other = tmp_path / "w2.json"
    other.write_text(json.dumps(_ring_bench(model, {"reduce_scatter": PeerTerms(1.2, 0.01)}, 2)))
    assert tune.main(["fit", "--ring", "--bench", str(other), "--write"]) == 0
    registry.clear_caches()
    ring = model_for("NVIDIA H200")[0].gemm.ring
    assert ring.terms[2]["reduce_scatter"].gemm_factor == pytest.approx(1.2, abs=2e-3)
    assert ring.terms[4]["all_reduce"].host_floor_ms == 0.3 and set(ring.fit) == {"2", "4"}
    assert tune.main(["fit", "--ring", "--bench", str(bench), "--host-floor", "all_gather=0.1"]) == 2
    assert tune.main(["fit", "--ring", "--peer", "--bench", str(bench)]) == 2
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200"}, "rows": []}))
    assert tune.main(["fit", "--ring", "--bench", str(empty)]) == 2
