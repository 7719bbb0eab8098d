"""The end-to-end benchmark (``python -m flashoverlap_inductor.bench e2e``) on the tiny presets, 2 gloo ranks.

* the plans are exact: tp / sp / ep training in eager equals the unsharded model's (losses of three AdamW steps),
  which checks the gradient sums of replicated weights (Qwen3's q/k norms, the MoE router) and the EP dispatch;
* tp and sp training through ``run()`` inside the rank pool: eager, Inductor and flashoverlap (``fuse="always"``)
  match Inductor, and the pass fused the row-parallel all_reduces (tp) and reduce_scatters (sp);
* the ep plan of the tiny MoE runs (prefill), fused combine included, and reports its coverage;
* the CLI itself under ``torch.distributed.run`` (prefill): exit status 0, the JSON, and the PNG when matplotlib
  is installed;
* argument validation (one-line errors, status 2) and the table's mismatch marking, without ranks.

Compiles share one Inductor cache per run (``--cache shared``) and use one decoder layer to stay quick.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dist_utils import adamw_losses, get_pool  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--device", "cpu", "--layers", "1", "--seq", "16", "--steps", "2", "--warmup", "0", "--fuse", "always",
         "--cache", "keep", "--quiet"]


# ------------------------------------------------------------------------------------------ rank workers


def bench_worker(argv: list[str], json_path: str) -> dict:
    """``run(argv + --json)`` on this rank; its status, stdout and (rank 0) the JSON."""
    import torch.distributed as dist

    from flashoverlap_inductor.bench.e2e import run

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run([*argv, "--json", json_path])
    data = json.loads(Path(json_path).read_text()) if dist.get_rank() == 0 else None
    return {"rc": rc, "stdout": out.getvalue(), "json": data}


def plans_exact_worker() -> dict:
    """Losses of 3 eager AdamW steps, per (preset, plan) and for the unsharded model on this rank."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from flashoverlap_inductor.bench import models, plans

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for name, plan in (("tiny-qwen3", "tp"), ("tiny-qwen3", "sp"), ("tiny-gemma3", "tp"), ("tiny-gemma3", "sp"),
                       ("tiny-moe", "ep")):
        spec = models.PRESETS[name].with_overrides(layers=1)
        for label in ("whole", plan):
            model = models.build(spec, torch.device("cpu"), torch.float32, 0, 64)
            if label != "whole":
                model = plans.apply(model, spec, plan, mesh)
            losses = adamw_losses(model, spec.vocab, torch.Generator().manual_seed(1), batch=2)
            out[f"{name}/{label if label == 'whole' else plan}"] = losses
    return out


# ------------------------------------------------------------------------------------------ tests (2 ranks)


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


def _rows(data: dict, **match) -> list[dict]:
    return [r for r in data["rows"] if all(r[k] == v for k, v in match.items())]


def test_plans_match_the_unsharded_model(pool):
    import torch

    for res in pool.run(plans_exact_worker):
        for name, plan in (("tiny-qwen3", "tp"), ("tiny-qwen3", "sp"), ("tiny-gemma3", "tp"), ("tiny-gemma3", "sp"),
                           ("tiny-moe", "ep")):
            torch.testing.assert_close(res[f"{name}/{plan}"], res[f"{name}/whole"], rtol=1e-5, atol=1e-6,
                                       msg=lambda s, n=name, p=plan: f"{n} {p}: {s}")


def test_tp_and_sp_training_match_inductor_and_fuse(pool, tmp_path):
    argv = ["--preset", "tiny-llama", "--plan", "tp,sp", "--workload", "train", "--backends",
            "inductor,flashoverlap,bound", *QUICK]
    results = pool.run(bench_worker, argv, str(tmp_path / "tp_sp.json"), timeout_s=600)
    assert [r["rc"] for r in results] == [0, 0], results[0]["stdout"]
    data = results[0]["json"]
    assert data["failed"] == 0
    for plan, collective in (("tp", "all_reduce"), ("sp", "reduce_scatter")):
        rows = _rows(data, plan=plan, workload="train")
        assert [r["backend"] for r in rows] == ["inductor", "flashoverlap", "bound"]
        assert all(len(r["step_ms_max"]) == len(r["step_ms"]) > 0 for r in rows), rows  # per step, max over ranks
        bound = rows.pop()  # the step with every collective replaced by a local op: no collective in its graphs
        assert bound["status"] == "ok" and "results meaningless" in bound["note"] and "rel_err" not in bound, bound
        assert bound["graphs"] and all(g["collectives"] == {} and g["fused"] == {} for g in bound["graphs"]), bound
        for r in rows:
            assert r["status"] == "ok" and r["reference"] == "inductor", r
            assert r["rel_err"] <= r["tolerance"] == 1e-4, r
            assert r["ms"] > 0 and r["tokens_per_s"] > 0 and len(r["step_ms"]) == 2 and r["compile_s"] > 0, r
        fo = rows[1]
        assert fo["fusion"].get(f"fused:{collective}", 0) > 0, fo["fusion"]
        assert fo["runtime"].get("route:cpu", 0) > 0, fo["runtime"]
    tp_cov = next(e for e in data["coverage"] if e["plan"] == "tp")
    assert tp_cov["graphs"]["forward"]["fused"].get("flashoverlap:gemm_all_reduce", 0) == 2  # o and down, 1 layer
    assert tp_cov["graphs"]["backward"]["fused"].get("flashoverlap:gemm_all_reduce", 0) == 5  # q, k, v, gate, up
    sp_cov = next(e for e in data["coverage"] if e["plan"] == "sp")
    assert sp_cov["graphs"]["forward"]["fused"].get("flashoverlap:gemm_reduce_scatter", 0) == 2
    # backward: the q/k/v (gate/up) input gradients are summed before their reduce_scatter: fused as one GEMM over
    # the concatenated K (passes/sum_of_gemms.py); nothing is left behind an add
    assert sp_cov["graphs"]["backward"]["fused"].get("flashoverlap:gemm_reduce_scatter", 0) == 2, sp_cov
    assert sp_cov["graphs"]["backward"]["collectives"].get("reduce_scatter <- via add", 0) == 0, sp_cov
    # every all_gather feeding a GEMM: the attention's and the MLP's inputs and lm_head's input (forward, 3); the
    # o and down projections' output gradients (backward, 2). Left: the embedding's gradient (no GEMM reads it)
    assert sp_cov["graphs"]["forward"]["fused"].get("flashoverlap:all_gather_gemm", 0) == 3, sp_cov
    assert "all_gather <- other" not in sp_cov["graphs"]["forward"]["collectives"], sp_cov
    assert sp_cov["graphs"]["backward"]["fused"].get("flashoverlap:all_gather_gemm", 0) == 2, sp_cov
    assert sp_cov["graphs"]["backward"]["collectives"].get("all_gather <- other", 0) == 1, sp_cov
    out = results[0]["stdout"]
    assert "tiny-llama / sp / train" in out and "every compared row matches" in out
    assert results[1]["stdout"] == ""  # only rank 0 prints


def test_moe_expert_parallel_runs_and_reports_coverage(pool, tmp_path):
    argv = ["--preset", "tiny-moe", "--plan", "ep", "--workload", "prefill", "--backends",
            "eager,flashoverlap,flashoverlap@shadow_check", "--value-calls", "2", *QUICK]
    results = pool.run(bench_worker, argv, str(tmp_path / "ep.json"), timeout_s=600)
    assert [r["rc"] for r in results] == [0, 0], results[0]["stdout"]
    data = results[0]["json"]
    eager, fo, shadowed = _rows(data, plan="ep")
    assert eager["status"] == fo["status"] == shadowed["status"] == "ok" and fo["rel_err"] <= 1e-4, fo
    assert len(fo["later_rel_errs"]) == 1 and fo["later_rel_errs"][0] <= 1e-4, fo  # --value-calls 2
    # under shadow_check both MoE ops of every call were compared with their reference (CPU route), none bad
    ran = shadowed["runtime"]
    assert ran.get("shadow:combine", 0) >= 1 and ran.get("shadow:dispatch", 0) >= 1, ran
    assert not any(k.endswith(":bad") for k in ran) and "shadow_bad" not in shadowed, shadowed
    assert fo["fusion"].get("fused:reduce_scatter", 0) == 1, fo["fusion"]  # the attention's o projection
    cov = data["coverage"][0]
    fwd = cov["graphs"]["inference"]["collectives"]
    # 2 local experts per rank: the experts' GEMMs, the un-permutation (index_copy -> index_put) and the combine
    # all_to_all are one fused op, and so are the dispatch all_to_all, the permutation and the gate_up GEMMs; the
    # count exchange is left (no GEMM in reach)
    assert cov["graphs"]["inference"]["fused"].get("flashoverlap:gemm_unpermute_all_to_all") == 1, cov
    assert cov["graphs"]["inference"]["fused"].get("flashoverlap:all_to_all_permute_gemm") == 1, cov
    assert {k: n for k, n in fwd.items() if k.startswith("all_to_all")} == {"all_to_all <- other": 1}, cov
    assert any("MoE combine: the experts' GEMM with the un-permutation" in n for n in cov["notes"]), cov["notes"]
    assert fo["fusion"].get("fused:all_to_all_combine") == 1 and "near_miss:index_put" not in fo["fusion"], fo
    assert "MoE combine" in results[0]["stdout"]


def test_cli_under_torchrun_writes_json_and_png(tmp_path):
    out_json, out_png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "flashoverlap_inductor.bench", "e2e", "--preset", "tiny-llama", "--plan", "tp",
           "--workload", "prefill", "--backends", "eager,flashoverlap", *QUICK,
           "--json", str(out_json), "--png", str(out_png), "--trace", str(tmp_path / "traces")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out_json.read_text())
    assert data["meta"]["world"] == 2 and data["meta"]["device"] == "cpu" and data["failed"] == 0
    fo = _rows(data, backend="flashoverlap")[0]
    # tp prefill, 1 layer, under tp_sequence (the default): o's and down's all_reduces fused reduce_scatters, the
    # MLP's gate/up fed by a fused all_gather (lm_head's, read through the last position's slice, left)
    assert fo["status"] == "ok" and "fused:all_reduce" not in fo["fusion"], fo
    assert fo["fusion"].get("fused:reduce_scatter", 0) == 2 and fo["fusion"].get("fused:all_gather", 0) == 1, fo
    assert fo["reference"] == "eager" and fo["rel_err"] <= 1e-4
    for backend in ("inductor+async-tp", "flashoverlap-ro"):
        assert backend not in proc.stdout  # not selected
    assert "model" in proc.stdout and "ms/step" in proc.stdout
    traces = sorted(p.name for p in (tmp_path / "traces").glob("*.json"))  # --trace: a Chrome trace per rank
    assert traces == [f"tiny-llama_tp_prefill_s16_{b}_rank{r}.json" for b in ("eager", "flashoverlap")
                      for r in (0, 1)], traces
    summary = fo["trace"]  # rank 0's trace summarized: its fused reduce_scatters' host time, 2 steps x 2 calls
    assert summary["span_ms"] > 0 and summary["gpu_busy_ms"] == 0 and summary["fused"]["gemm_reduce_scatter"][0] == 4
    assert "tiny-llama tp prefill 16 flashoverlap: span" in proc.stdout and "gemm_reduce_scatter 4 x" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert out_png.stat().st_size > 1000
    else:
        assert not out_png.exists() and "no PNG" in proc.stdout


# ------------------------------------------------------------------------------------------ no ranks


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny-llama", "--heads", "3", "--head-dim", "16"], "attention heads (3)"),
    (["--preset", "tiny-llama", "--plan", "ep"], "plan ep needs a MoE model"),
    (["--preset", "tiny-moe", "--plan", "tp"], "is a MoE model"),
    (["--preset", "tiny-llama", "--plan", "sp", "--seq", "15"], "do not divide by the world size"),
    (["--preset", "tiny-moe", "--experts", "3"], "3 experts do not divide"),
    (["--preset", "tiny-llama", "--experts", "4"], "apply to MoE presets"),
])
def test_invalid_arguments_are_one_line_errors(argv, message, capsys):
    from flashoverlap_inductor.bench import cli

    args = cli.build_parser().parse_args(argv)
    with pytest.raises(cli.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cli.resolve(args, "cpu", 2)


def test_share_gpu_refuses_the_sequence_parallel_plans():
    from flashoverlap_inductor.bench import cli

    for plan in ("sp", "ep"):
        preset = "tiny-moe" if plan == "ep" else "tiny-llama"
        args = cli.build_parser().parse_args(["--share-gpu", "--preset", preset, "--plan", plan, "--seq", "64"])
        with pytest.raises(cli.UsageError, match="--share-gpu runs the tp plan only"):
            cli.resolve(args, "cuda", 2)
    args = cli.build_parser().parse_args(["--share-gpu", "--preset", "tiny-llama", "--plan", "tp", "--seq", "64"])
    assert cli.resolve(args, "cuda", 2).cases  # tp is fine


def test_usage_error_exit_status(capsys):
    import torch.distributed as dist

    from flashoverlap_inductor.bench.__main__ import main

    before = dist.is_initialized()
    assert main(["e2e", "--device", "cpu", "--preset", "tiny-llama", "--plan", "ep"]) == 2  # in a world of one
    assert dist.is_initialized() == before  # the group it made is gone
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["e2e: error: plan ep needs a MoE model; tiny-llama is dense (use tp or sp)"]


def test_hidden_share_from_the_bound_row():
    from flashoverlap_inductor.bench import output
    from flashoverlap_inductor.bench.e2e import add_hidden

    base = {"model": "m", "plan": "sp", "workload": "train", "seq": 8, "status": "ok"}
    rows = [{**base, "backend": "inductor", "ms": 10.0, "speedup": 1.0}, {**base, "backend": "flashoverlap", "ms": 9.0},
            {**base, "backend": "inductor+async-tp", "ms": 10.5}, {**base, "backend": "bound", "ms": 8.0, "note": ""}]
    add_hidden(rows)
    assert rows[1]["hidden"] == pytest.approx(0.5) and rows[2]["hidden"] == pytest.approx(-0.25)
    assert "hidden" not in rows[0] and "hidden" not in rows[3] and rows[3]["speedup"] == pytest.approx(1.25)
    assert " 50%" in output.table(rows) and "-25%" in output.table(rows)
    slow = [{k: v for k, v in r.items() if k != "hidden"} for r in rows]
    slow[3]["ms"] = 11.0
    add_hidden(slow)  # a bound no faster than Inductor: no share
    assert all("hidden" not in r for r in slow) and "not faster than inductor" in slow[3]["note"]


def test_mismatched_rows_are_cross_checked_against_each_other():
    import torch

    from flashoverlap_inductor.bench.e2e import cross_check

    class OneRank:
        def reduce_max(self, values):
            return values

    def row(backend, status, values):
        return {"backend": backend, "status": status, "tolerance": 2e-2, "note": "differ",
                "_values": torch.tensor(values, dtype=torch.float64)}

    # two fused rows off the reference alike: they agree with each other, so the reference may be the odd one
    a, b = row("fo@x", "MISMATCH", [1.0, 2.0]), row("fo@y", "MISMATCH", [1.0, 2.001])
    c = row("fo@z", "ok", [1.3, 2.6])
    cross_check([a, b, c], OneRank(), "prefill")
    assert a["agrees_with"] == ["fo@y"] and b["agrees_with"] == ["fo@x"] and "agrees_with" not in c
    assert "the reference may be the odd one" in a["note"]
    # a lone mismatch agrees with nobody; one that agrees with an ok row is borderline, not a bad reference
    lone, other = row("fo@x", "MISMATCH", [5.0, 2.0]), row("fo@y", "ok", [1.0, 2.0])
    cross_check([lone, other], OneRank(), "prefill")
    assert lone["agrees_with"] == [] and lone["note"] == "differ"
    near, fine = row("fo@x", "MISMATCH", [1.0, 2.0]), row("fo@y", "ok", [1.0, 2.01])
    cross_check([near, fine], OneRank(), "prefill")
    assert near["agrees_with"] == ["fo@y"] and "odd one" not in near["note"]


def test_later_value_calls_show_a_stale_first_call_and_an_unstable_reference():
    """``--value-calls``: a row whose first call is off and its later ones right (or the other way round) says so
    (its result varies from call to call);
    where the reference's own later calls differ from its first, every mismatched row says the reference is
    unstable; rows without later calls are left alone."""
    import torch

    from flashoverlap_inductor.bench.e2e import later_calls

    class OneRank:
        def reduce_max(self, values):
            return values

    def row(backend, status, first, *later):
        t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        return {"backend": backend, "status": status, "tolerance": 2e-2, "note": "", "rel_err": 0.0,
                "_values": t(first), "_more_values": [t(v) for v in later]}

    ref = row("inductor", "ok", [1.0, 2.0], [1.0, 2.0], [1.0, 2.0])
    stale = row("fo@x", "MISMATCH", [1.5, 2.0], [1.0, 2.0], [1.0, 2.0])
    stale["rel_err"] = 0.22
    steady = row("fo@y", "ok", [1.0, 2.0], [1.0, 2.0])
    later_calls([ref, stale, steady], ref, OneRank(), "prefill")
    assert stale["later_rel_errs"] == [0.0, 0.0] and "later value calls off by 0.0e+00, 0.0e+00" in stale["note"]
    assert steady["note"] == "" and "unstable" not in stale["note"]
    shaky = row("inductor", "ok", [1.0, 2.0], [1.5, 2.0])
    off = row("fo@x", "MISMATCH", [1.5, 2.0], [1.5, 2.0])
    off["rel_err"] = 0.22
    later_calls([shaky, off], shaky, OneRank(), "prefill")
    assert "(unstable reference)" in off["note"] and "unstable" not in shaky["note"]
    alone = row("inductor", "ok", [1.0, 2.0])
    later_calls([alone], alone, OneRank(), "prefill")
    assert "later_rel_errs" not in alone


def test_the_verdict_takes_the_closest_pair_of_value_calls_and_never_a_non_finite_one():
    """Under ``--value-calls`` a row is judged by its closest call to any of the reference's: a reference whose one
    call is off still judges the rows right, a row none of whose calls is near is wrong, a NaN in any call is
    wrong; with one call the first calls' error is the verdict."""
    import torch

    from flashoverlap_inductor.bench.e2e import closest_calls

    class OneRank:
        def reduce_max(self, values):
            return values

    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731

    def row(first, *later):
        return {"_values": t(first), "_more_values": [t(v) for v in later]}

    ref = row([1.5, 2.0], [1.0, 2.0], [1.0, 2.0])  # the reference's first call is the odd one
    right, wrong = row([1.0, 2.0], [1.0, 2.0]), row([3.0, 2.0], [3.0, 2.0])
    nan = row([1.0, 2.0], [float("nan"), 2.0])
    best = closest_calls([ref, right, wrong, nan], ref, OneRank(), "prefill")
    assert best[0] == 0.0 and best[1] == 0.0 and best[2] > 0.5 and best[3] == float("inf")
    one = closest_calls([row([1.0, 2.0]), row([1.1, 2.0])], row([1.0, 2.0]), OneRank(), "prefill")
    assert one[0] == 0.0 and one[1] == pytest.approx(0.1 / 5 ** 0.5)


def test_hidden_share_of_graphed_rows_like_for_like():
    """A ``-ro`` row's share is measured against ``inductor-ro`` and ``bound-ro`` where both ran (the graphs' own
    host-time saving is not hidden communication), an eager row's against ``inductor`` and ``bound``; without the
    graphed pair a ``-ro`` row falls back to the eager pair (``inductor-ro`` then gets a share too)."""
    from flashoverlap_inductor.bench import output
    from flashoverlap_inductor.bench.e2e import add_hidden

    base = {"model": "m", "plan": "sp", "workload": "prefill", "seq": 8, "status": "ok", "note": ""}
    rows = [{**base, "backend": "inductor", "ms": 22.0}, {**base, "backend": "flashoverlap", "ms": 21.0},
            {**base, "backend": "bound", "ms": 18.0}, {**base, "backend": "inductor-ro", "ms": 21.0},
            {**base, "backend": "flashoverlap-ro@scatter_route=pull", "ms": 19.0},
            {**base, "backend": "bound-ro", "ms": 17.0}]
    add_hidden(rows)
    by = {r["backend"]: r for r in rows}
    assert by["flashoverlap"]["hidden"] == pytest.approx(0.25) and by["flashoverlap"]["hidden_vs"] == "inductor"
    assert by["flashoverlap-ro@scatter_route=pull"]["hidden"] == pytest.approx(0.5)  # (21 - 19) / (21 - 17)
    assert by["flashoverlap-ro@scatter_route=pull"]["hidden_vs"] == "inductor-ro"
    assert all("hidden" not in by[b] for b in ("inductor", "bound", "inductor-ro", "bound-ro"))
    assert by["bound-ro"]["speedup"] == pytest.approx(22 / 17) and " 50%" in output.table(rows)  # over inductor
    eager_pair = [{k: v for k, v in r.items() if not k.startswith("hidden") and k != "speedup"}
                  for r in rows if r["backend"] != "bound-ro"]
    add_hidden(eager_pair)
    by = {r["backend"]: r for r in eager_pair}
    assert by["flashoverlap-ro@scatter_route=pull"]["hidden"] == pytest.approx(0.75)  # (22 - 19) / (22 - 18)
    assert by["inductor-ro"]["hidden"] == pytest.approx(0.25)


def test_hidden_share_spread_step_by_step():
    """Each step's gain over Inductor's same step (max over ranks) as a share of the medians' exposed time: a bound
    step barely faster than Inductor's cannot blow it up; non-finite steps are left out, and a spread needs 2
    steps; the table prints the lowest and highest step beside the medians' share."""
    from flashoverlap_inductor.bench import output
    from flashoverlap_inductor.bench.e2e import add_hidden

    base = {"model": "m", "plan": "sp", "workload": "prefill", "seq": 8, "status": "ok", "note": ""}
    rows = [{**base, "backend": "inductor", "ms": 10.0, "step_ms_max": [10.0, 10.4, 9.8, 10.0]},
            {**base, "backend": "flashoverlap", "ms": 9.0, "step_ms_max": [9.0, 9.6, 9.7, float("inf")]},
            {**base, "backend": "bound", "ms": 8.0, "step_ms_max": [8.0, 8.4, 9.79, 8.0]}]
    add_hidden(rows)
    assert rows[1]["hidden"] == pytest.approx(0.5)
    # (10 - 9) / 2, (10.4 - 9.6) / 2, (9.8 - 9.7) / 2 (the bound's 9.79 plays no part); the inf step left out
    assert rows[1]["hidden_steps"] == pytest.approx([0.5, 0.4, 0.05])
    assert "50% (5..50)" in output.table(rows)
    fresh = [{k: v for k, v in r.items() if not k.startswith("hidden")} for r in rows]
    short = [{**r, "step_ms_max": r["step_ms_max"][:3]} if r["backend"] == "flashoverlap" else dict(r) for r in fresh]
    add_hidden(short)  # step lists of different lengths: no spread
    assert "hidden_steps" not in short[1] and "50%  " in output.table(short)
    one = [{**r, "step_ms_max": r["step_ms_max"][2:]} for r in fresh]
    add_hidden(one)  # one finite step: no spread
    assert "hidden_steps" not in one[1]


def test_host_time_per_step_names_host_paced_rows():
    """``output.host_lines``: per case, each row's host ms beside its step ms; a row whose host needs >= 90% of its
    step is named host-paced; rows without host times (CPU, errors) are left out."""
    from flashoverlap_inductor.bench import output

    base = {"model": "m", "plan": "tp", "workload": "prefill", "seq": 8, "status": "ok"}
    rows = [{**base, "backend": "inductor", "ms": 10.0, "host_ms": 6.0},
            {**base, "backend": "flashoverlap", "ms": 9.5, "host_ms": 9.2},
            {**base, "backend": "bound", "ms": 8.0},
            {**base, "workload": "train", "backend": "inductor", "ms": 50.0, "host_ms": 20.0}]
    lines = output.host_lines(rows)
    assert len(lines) == 2 and lines[0].startswith("m tp prefill 8: ") and lines[1].startswith("m tp train 8: ")
    assert "inductor 6.000 / 10.000;" in lines[0] and lines[0].endswith("flashoverlap 9.200 / 9.500 host-paced")
    assert "bound" not in lines[0] and "host-paced" not in lines[1]
    assert output.host_lines([{**base, "backend": "x", "ms": 1.0}]) == []
    train = {**base, "workload": "train"}
    waits = output.host_lines([{**train, "backend": "inductor", "ms": 100.0, "host_ms": 101.0},
                               {**train, "backend": "bound", "ms": 95.0, "host_ms": 95.1}])
    assert waits[0].endswith("host time does not tell the rows' pacing apart)")
    assert "bound 95.100 / 95.000 host-paced" in waits[0]
    assert "does not tell" not in lines[0]


def test_timed_takes_one_host_time_per_call_and_finish_its_median(monkeypatch):
    """``runner.timed`` on a (stubbed) CUDA env: the host time of step ``host_at`` only (the one issued behind the
    lead steps), each step's CUDA-event time; ``finish``: ``host_ms`` the median of those, the step times intact."""
    import types

    import torch

    from flashoverlap_inductor.bench import runner

    clock = iter(range(0, 10_000, 5))  # perf_counter: +5 s per read

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = len(recorded)
            recorded.append(self)

        def elapsed_time(self, end):
            return float(end.t - self.t) * 10

    recorded: list = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(runner.dist, "barrier", lambda *a: None)
    monkeypatch.setattr(runner.time, "perf_counter", lambda: next(clock))
    env = runner.Env(rank=0, world=1, device=torch.device("cuda", 0), dtype=torch.bfloat16, mesh=None,
                     group_name="0")
    bar = types.SimpleNamespace(update=lambda *a: None)
    host: list[float] = []
    times, outs = runner.timed(lambda i: i * 2, [3, 4, 5], env, bar, host, host_at=1)
    assert outs == [6, 8, 10] and times == [10.0, 10.0, 10.0]
    assert host == [5000.0]  # one read pair, of the second step: 5 s
    case = types.SimpleNamespace(tokens=100)
    capture = types.SimpleNamespace(graphs=[])
    row = runner.finish("inductor", case, env, [2.0, 3.0, 4.0], 1.0, None, capture, None, None, None, None,
                        [7.0, 5.0, 6.0])
    assert row["host_ms"] == 6.0 and row["step_ms_max"] == [2.0, 3.0, 4.0] and row["ms"] == 3.0
    assert "host_ms" not in runner.finish("inductor", case, env, [2.0], 1.0, None, capture, None, None, None, None)


def test_bound_pass_removes_every_collective():
    """``bound.replace_collectives`` on a graph with each collective: none left, shapes kept."""
    import torch
    import torch.distributed._functional_collectives as funcol  # noqa: F401  (registers _c10d_functional)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashoverlap_inductor.bench.bound import replace_collectives

    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    with FakeTensorMode() as mode:
        xv = mode.from_tensor(torch.randn(8, 4))
    x = g.placeholder("x")
    x.meta["val"] = xv
    outs = []
    for target, args, shape in ((c10d.all_reduce.default, (x, "sum", "0"), (8, 4)),
                                (c10d.reduce_scatter_tensor.default, (x, "sum", 2, "0"), (4, 4)),
                                (c10d.all_gather_into_tensor.default, (x, 2, "0"), (16, 4)),
                                (c10d.all_to_all_single.default, (x, [3, 5], [3, 5], "0"), (8, 4)),
                                (c10d.all_to_all_single.default, (x, [2, 4], [3, 5], "0"), (6, 4))):
        coll = g.call_function(target, args)
        wait = g.call_function(c10d.wait_tensor.default, (coll,))
        wait.meta["val"] = torch.empty(shape, device="meta")
        outs.append(wait)
    g.output(tuple(outs))
    assert replace_collectives(g) == 5
    assert not [n for n in g.nodes if getattr(n.target, "namespace", "") == "_c10d_functional"]
    # the gathered rows depend on x (a constant would let Inductor fold away everything downstream)
    gathered = g.output_node().args[0][2]
    assert gathered.target is torch.ops.aten.repeat.default and gathered.args[0] is x
    assert gathered.meta["val"].shape == (16, 4)


def test_table_marks_mismatch_and_na():
    import torch

    from flashoverlap_inductor.bench import output
    from flashoverlap_inductor.bench.runner import rel_error

    assert rel_error(torch.tensor([2.0, 4.0]), torch.tensor([2.0, 4.0004]), "train") == pytest.approx(1e-4, rel=1e-3)
    assert rel_error(torch.tensor([float("nan")]), torch.tensor([1.0]), "train") == float("inf")
    base = {"model": "m", "plan": "tp", "workload": "train", "seq": 8}
    rows = [{**base, "backend": "inductor", "status": "ok", "ms": 2.0, "speedup": 1.0, "rel_err": 0.0},
            {**base, "backend": "flashoverlap", "status": "MISMATCH", "ms": 1.0, "speedup": 2.0, "rel_err": 0.5,
             "note": "differs", "fusion": {"fused:all_reduce": 3, "skip:cost_model": 1}},
            {**base, "backend": "inductor+async-tp", "status": "n/a", "note": "n/a (needs CUDA symmetric memory)"}]
    text = output.table(rows)
    assert "MISMATCH" in text and "fused AR 3; skip cost_model 1" in text and "needs CUDA symmetric memory" in text


def test_backend_with_experiments_parses_and_splits():
    """``--backends flashoverlap@a+b``: a fusing backend's row with more experiments (an A/B in one run); a name on a
    non-fusing backend or an unknown experiment is a one-line parse error."""
    from flashoverlap_inductor.bench import cli, runner

    args = cli.build_parser().parse_args(
        ["--backends", "inductor,flashoverlap,flashoverlap@moe_plan_triton+moe_settle_deferred"])
    assert args.backends == ["inductor", "flashoverlap", "flashoverlap@moe_plan_triton+moe_settle_deferred"]
    assert runner.variant(args.backends[2]) == ("flashoverlap", ("moe_plan_triton", "moe_settle_deferred"))
    assert runner.variant("inductor") == ("inductor", ())
    same = cli.build_parser().parse_args(
        ["--backends", "flashoverlap@moe_settle_deferred+moe_plan_triton,"
         "flashoverlap@moe_plan_triton+moe_settle_deferred+moe_plan_triton"])
    assert same.backends == ["flashoverlap@moe_plan_triton+moe_settle_deferred"]  # one spelling, one row
    for bad in ("inductor@moe_plan_triton", "flashoverlap@no_such", "flashoverlap@", "flashoverlap@a++b",
                "flashoverlap@moe_plan_triton+", "nothing", "flashoverlap@gather_start=nope", "flashoverlap@no_such=1",
                "inductor@gather_start=push", "flashoverlap@gather_start=push+gather_start=eager",
                "flashoverlap@scatter_pull+experiments=moe_plan_triton", "flashoverlap@fuse=always"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["--backends", bad])


def test_backend_with_a_setting_compiles_with_its_option(monkeypatch):
    """``flashoverlap@scatter_pull+gather_start=push``: the experiment joins ``flashoverlap.experiments`` and the
    setting becomes the option ``flashoverlap.gather_start`` of that row's compile."""
    import torch

    from flashoverlap_inductor.bench import cli, runner

    args = cli.build_parser().parse_args(["--backends", "flashoverlap@scatter_pull+gather_start=push,"
                                          "flashoverlap@wait_timeout_ms=5e3,flashoverlap@wait_timeout_ms=5000"])
    assert args.backends[1:] == ["flashoverlap@wait_timeout_ms=5000.0"]  # one spelling per setting, one row
    kind, extra = runner.variant(args.backends[0])
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda module, backend, options, dynamic: seen.update(options))
    runner.compile_for(kind, torch.nn.Linear(2, 2), None, "auto", None, extra)
    assert seen["flashoverlap.experiments"] == frozenset({"scatter_pull"}), seen
    assert seen["flashoverlap.gather_start"] == "push" and seen["flashoverlap.fuse"] == "auto", seen


def test_interleaved_backends_match_the_sequential_run(pool, tmp_path):
    """``--interleave 1``: every backend built and warmed, then the measured steps in turns; each row's losses are
    the ones the backends give one after another (the same inputs in the same order), the fusing row keeps its
    own compile report and runtime counts, and an unavailable backend stays n/a."""
    argv = ["--preset", "tiny-llama", "--plan", "sp", "--workload", "train", "--backends",
            "inductor,flashoverlap,inductor+async-tp", *QUICK, "--steps", "3"]
    one, two = (pool.run(bench_worker, argv + extra, str(tmp_path / f"{name}.json"), timeout_s=600)
                for name, extra in (("seq", []), ("inter", ["--interleave", "1", "--turn-lead", "0"])))
    assert [r["rc"] for r in one + two] == [0, 0, 0, 0], two[0]["stdout"]
    seq, inter = (_rows(res[0]["json"], plan="sp", workload="train") for res in (one, two))
    assert [r["backend"] for r in inter] == ["inductor", "flashoverlap", "inductor+async-tp"]
    assert inter[2]["status"] == "n/a", inter[2]
    for a, b in zip(seq[:2], inter[:2], strict=True):
        assert b["status"] == "ok" and len(b["step_ms"]) == 3 and "interleaved" in b["note"], b
        assert b["values"] == a["values"], (a["values"], b["values"])  # the same losses, step for step
        assert b["peak_bytes"] is None
    assert inter[1]["fusion"] == seq[1]["fusion"] and inter[1]["fusion"].get("fused:reduce_scatter", 0) > 0
    assert inter[1]["runtime"].get("route:cpu", 0) == seq[1]["runtime"].get("route:cpu", 0) > 0, \
        (inter[1]["runtime"], seq[1]["runtime"])


def test_time_budget_spent_reports_every_backend_not_started(pool, tmp_path):
    """``--time-budget-s`` already spent when the backends come: no backend starts, on either rank (the ranks decide
    together), every row says why, and the run ends cleanly with status 1 (nothing was measured)."""
    argv = ["--preset", "tiny-llama", "--plan", "sp", "--workload", "train", "--backends", "inductor,flashoverlap",
            *QUICK, "--time-budget-s", "0.001"]
    res = pool.run(bench_worker, argv, str(tmp_path / "budget.json"), timeout_s=300)
    assert [r["rc"] for r in res] == [1, 1], res[0]["stdout"]  # nothing measured: not a pass
    assert "2 row(s) not run: the time budget of 0.001 s ran out" in res[0]["stdout"]
    rows = _rows(res[0]["json"], plan="sp", workload="train")
    assert [(r["backend"], r["status"]) for r in rows] == [("inductor", "n/a"), ("flashoverlap", "n/a")], rows
    assert all("time budget" in r["note"] for r in rows), rows
