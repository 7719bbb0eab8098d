"""What a user of the command lines sees (CPU only, fast): ``tune`` and ``build`` check for CUDA, the built library
and a process group before they touch them, and bad input files end in one line naming the file; each expected
failure exits with status 2 and no traceback. Every option has help text; the build and the tuner's long loops
print ``k/N`` progress lines with an ETA.

Each test names the old behaviour it guards against (a traceback, a silent build)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flashoverlap_inductor import build
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.tools import cli_util, tune
from flashoverlap_inductor.tune import measure as tune_measure
from flashoverlap_inductor.tune import rows as tune_rows
from flashoverlap_inductor.tune import schemas as tune_docs

ROOT = Path(__file__).resolve().parent.parent
NEED_GPU = "needs a CUDA GPU (sm90: H100/H200); none is visible here"
TORCHRUN = "run under torchrun --nproc_per_node=N (N >= 2)"


SUBPROCESS_CASES = {  # name -> (argv, extra environment): started together, once (each imports torch)
    "gemm": (["gemm", "--quick"], {}),
    "rank0": (["bandwidth", "--quick"], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}),
    "rank1": (["bandwidth", "--quick"], {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    """``python -m flashoverlap_inductor.tune ARGV`` of every ``SUBPROCESS_CASES`` entry with no GPU visible (as on
    a CPU machine), run in parallel."""
    procs = {}
    for name, (argv, extra) in SUBPROCESS_CASES.items():
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        env.update(CUDA_VISIBLE_DEVICES="", **extra)
        procs[name] = subprocess.Popen([sys.executable, "-m", "flashoverlap_inductor.tune", *argv], cwd=ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def _main(capsys, argv: list[str]) -> tuple[int, str]:
    """``tune.main(argv)``: its status and its stderr (asserted to be at most one line, no traceback)."""
    rc = tune.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
    return rc, err.strip()


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_gpu(monkeypatch, no_torchrun):
    """No GPU visible, whatever the machine has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kernels, "available", lambda: False)


@pytest.fixture
def gpu_ok(monkeypatch, no_torchrun):
    """As on a machine with an sm90 GPU and NCCL (nothing here touches it)."""
    monkeypatch.setattr(cli_util, "cuda_problem", lambda env: None)
    monkeypatch.setattr(cli_util, "nccl_problem", lambda: None)


# --------------------------------------------------------------------------------------------- what a run needs


def test_gemm_without_cuda_says_what_it_needs_in_a_subprocess(runs):
    """Was: ``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'`` (a traceback, status 1)."""
    r = runs["gemm"]
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr and "_cuda_setDevice" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tune gemm: {NEED_GPU}"), r.stderr


def test_bandwidth_under_torchrun_without_cuda_in_a_subprocess(runs):
    """Under torchrun (WORLD_SIZE=2) without CUDA, was the same ``_cuda_setDevice`` traceback on every rank: now
    rank 0 says what is missing and every rank exits 2 (rank 1 silently, no duplicate line)."""
    r0 = runs["rank0"]
    assert r0.returncode == 2 and "Traceback" not in r0.stderr, r0
    assert r0.stderr.strip().splitlines() == [r0.stderr.strip()] and r0.stderr.startswith(f"tune bandwidth: {NEED_GPU}")
    assert TORCHRUN not in r0.stderr  # the world is there: only the GPU is missing
    r1 = runs["rank1"]
    assert r1.returncode == 2 and r1.stderr == "", r1


@pytest.mark.parametrize("argv", [["bandwidth", "--quick"],
                                  ["search", "--collective", "all_reduce", "--shape", "8192x8192x8192"]])
def test_multi_rank_commands_without_cuda_or_torchrun(capsys, no_gpu, argv):
    """Was: "tune bandwidth: run under torchrun with >= 2 ranks" (nothing about the GPU it also lacks) and
    "tune search: needs torchrun with >= 2 ranks, sm90 GPUs and the built library" (not which one is missing)."""
    rc, err = _main(capsys, argv)
    assert rc == 2 and err.startswith(f"tune {argv[0]}: {NEED_GPU}") and err.endswith(f"needs >= 2 ranks: {TORCHRUN}")


@pytest.mark.parametrize("argv", [["bandwidth"], ["search", "--collective", "all_to_all", "--shape", "grid"]])
def test_multi_rank_commands_in_one_process_with_a_gpu(capsys, monkeypatch, gpu_ok, argv):
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert _main(capsys, argv) == (2, f"tune {argv[0]}: needs >= 2 ranks: {TORCHRUN}")
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc_per_node=1
    assert _main(capsys, argv) == (2, f"tune {argv[0]}: needs >= 2 ranks, this run has 1: {TORCHRUN}")


def test_library_missing_names_the_build_command(capsys, monkeypatch, gpu_ok, tmp_path):
    """Was: "tune gemm: needs an sm90 GPU and the built library" (which of the two, and how to get it?)."""
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "libflashoverlap_sm90.so")
    rc, err = _main(capsys, ["gemm"])
    assert rc == 2 and err == (f"tune gemm: needs the built library ({tmp_path / 'libflashoverlap_sm90.so'} is "
                               f"missing): python -m flashoverlap_inductor.build")


def test_gemm_on_other_ranks_idles(capsys, no_gpu, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert _main(capsys, ["gemm"]) == (0, "")


def test_bad_numbers_are_argument_errors(capsys):
    """Was: ``ValueError: not enough values to unpack`` from ``parse_shapes`` once the GPU was set up."""
    for argv, what in ((["gemm", "--shapes", "8192x8192"], "argument --shapes: '8192x8192' is not MxNxK"),
                       (["gemm", "--free", "0,a"], "argument --free: '0,a': give non-negative integers"),
                       (["search", "--collective", "all_reduce", "--shape", "1x2xz"], "argument --shape: '1x2xz'")):
        with pytest.raises(SystemExit) as exc:
            tune.main(argv)
        assert exc.value.code == 2 and what in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- input files

BENCH_HINT = "torchrun --nproc_per_node=N examples/bench_ops.py --json FILE"


def _files(tmp_path: Path) -> dict[str, Path]:
    out = {"missing": tmp_path / "missing.json", "folder": tmp_path}
    for name, text in {"empty": "", "notjson": "not json{", "emptyobj": "{}", "list": "[1, 2]",
                       "norows": json.dumps({"meta": {"gpu": "NVIDIA H200"}}),
                       "badrow": json.dumps({"meta": {"gpu": "NVIDIA H200"}, "rows": [{"op": "all_reduce"}]})
                       }.items():
        out[name] = tmp_path / f"{name}.json"
        out[name].write_text(text)
    return out


BENCH_CASES = {  # was (last line of the traceback, status 1) -> now
    "missing": ("FileNotFoundError: [Errno 2] No such file or directory", "no such file; a benchmark file comes from"),
    "empty": ("json.decoder.JSONDecodeError: Expecting value", "the file is empty; a benchmark file comes from"),
    "notjson": ("json.decoder.JSONDecodeError: Expecting value", "not JSON (Expecting value at line 1, column 1)"),
    "emptyobj": ("KeyError: 'meta'", "not a benchmark file (no 'meta' object); one comes from"),
    "list": ("TypeError: list indices must be integers", "not a benchmark file (a JSON list, not an object)"),
    "norows": ("KeyError: 'rows'", "not a benchmark file (no 'rows' list)"),
    "badrow": ("KeyError: 'variants' (with --variant)", "not a benchmark file (row 0 lacks 'm', 'n', 'k', 'world')"),
    "folder": ("IsADirectoryError: [Errno 21] Is a directory", "is a folder, not a file"),
}


@pytest.mark.parametrize("section", ["", "--peer", "--ring", "--sequential", "--gemm"])
@pytest.mark.parametrize("case", sorted(BENCH_CASES))
def test_fit_bench_file_problems_are_one_line(capsys, tmp_path, section, case):
    path = _files(tmp_path)[case]
    rc, err = _main(capsys, ["fit", *([section] if section else []), "--bench", str(path), "--variant", "x"])
    assert rc == 2 and err.startswith(f"tune fit: --bench {path}: {BENCH_CASES[case][1]}"), err
    assert err.endswith(BENCH_HINT) and "Error" not in err


@pytest.mark.parametrize("case, now", [("missing", "no such file; a tune search record file comes from"),
                                       ("notjson", "not JSON (Expecting value at line 1, column 1)"),
                                       ("emptyobj", "not a tune search record file (no 'schema'")])
def test_fit_records_file_problems_are_one_line(capsys, tmp_path, case, now):
    """Was: FileNotFoundError / JSONDecodeError / ValueError tracebacks."""
    path = _files(tmp_path)[case]
    rc, err = _main(capsys, ["fit", "--records", str(path)])
    assert rc == 2 and err.startswith(f"tune fit: --records {path}: {now}") and "tune search ... --record FILE" in err


def test_fit_record_without_its_shape(capsys, tmp_path):
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"schema": tune_docs.RECORDS_SCHEMA, "records": [{"collective": "all_reduce",
                                                                                  "candidates": []}]}))
    rc, err = _main(capsys, ["fit", "--records", str(path)])
    assert rc == 2 and "not a tune search record file (record 0 lacks 'm', 'n', 'k', 'world_size')" in err


def test_fit_without_inputs_or_usable_rows(capsys, tmp_path):
    """Was: "tune fit: no usable rows" on stdout, for no input at all too."""
    rc, err = _main(capsys, ["fit"])
    assert rc == 2 and err.startswith("tune fit: nothing to fit: give --bench FILE...") and "--records FILE" in err
    rc, err = _main(capsys, ["fit", "--ring"])
    assert rc == 2 and "--records" not in err
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200"}, "rows": []}))
    rc, err = _main(capsys, ["fit", "--bench", str(path)])
    assert rc == 2 and err.startswith(f"tune fit: no usable rows: no row of {path} has a positive time")
    assert _main(capsys, ["fit", "--peer", "--ring", "--bench", str(path)]) == \
        (2, "tune fit: --peer, --ring and --sequential fit different sections; give one")


def test_data_files_are_checked_before_measuring(capsys, tmp_path, monkeypatch, no_torchrun):
    """Was: a malformed ``--out`` file crashed (JSONDecodeError) after the whole measurement."""
    monkeypatch.setattr(cli_util, "require", lambda env, **kw: None)
    files = _files(tmp_path)
    for cmd in ("bandwidth", "gemm"):
        rc, err = _main(capsys, [cmd, "--out", str(files["notjson"])])
        assert rc == 2 and err.startswith(f"tune {cmd}: --out {files['notjson']}: not JSON"), err
        rc, err = _main(capsys, [cmd, "--out", str(files["list"])])
        assert rc == 2 and "(a JSON list, not an object)" in err, err


def test_data_file_checks(tmp_path):
    gpu = "NVIDIA H200"
    with pytest.raises(cli_util.CliError, match=r"no GEMM model for NVIDIA H100 to update: .* does not exist; "
                                                 r"write one with python -m flashoverlap_inductor.tune.import_anchor"):
        tune_docs.gemm_base(tmp_path, None, "NVIDIA H100")
    bad = tmp_path / "gemm.json"
    bad.write_text(json.dumps({"schema": "flashoverlap.gemm/1", "gpu": gpu}))
    with pytest.raises(cli_util.CliError, match=r"--out .*gemm.json: not a GEMM model file .*\(schema check: "):
        tune_docs.gemm_base(tmp_path, str(bad), gpu)
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps({"schema": "flashoverlap.plans/1", "gpu": gpu, "sm_count": 132, "date": "x",
                                 "source": "", "entries": []}))
    assert tune_docs.plans_base(plans, gpu, 132) is not None
    with pytest.raises(cli_util.CliError, match="schema check: plans file is for 132 SMs, tuned on 114"):
        tune_docs.plans_base(plans, gpu, 114)
    assert tune_docs.plans_base(tmp_path / "none.json", gpu, 132) is None
    assert tune_docs.bandwidth_base(tmp_path, None, gpu, 132, 2) is None  # none yet: a new document


def test_malformed_data_directory_file(tmp_path, monkeypatch):
    from flashoverlap_inductor.cost_model import registry

    (tmp_path / "gemm_x.json").write_text("{oops")
    monkeypatch.setattr(registry, "data_dir", lambda settings=None: tmp_path)
    with pytest.raises(cli_util.CliError, match=r"gemm_x.json: not JSON \(Expecting property name"):
        tune_rows.write_section("NVIDIA H200", lambda doc: None, "peer section")


# --------------------------------------------------------------------------------------------- help text


def _actions(parser: argparse.ArgumentParser, name: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for pseudo in action._choices_actions:
                yield f"{name} {pseudo.dest}", pseudo
            for sub_name, sub in action.choices.items():
                yield from _actions(sub, f"{name} {sub_name}")
        elif not isinstance(action, argparse._HelpAction):
            yield name, action


@pytest.mark.parametrize("make", [tune.build_parser, build.build_parser], ids=["tune", "build"])
def test_every_option_has_help(make):
    """Was: 13 options of ``tune`` without any help (bandwidth --collectives --min-bytes --max-bytes
    --points-per-octave --rounds; gemm --shapes --rounds --target-ms; search --collective --dtype --mode --rounds
    --target-ms)."""
    parser = make()
    found = list(_actions(parser, parser.prog))
    missing = [f"{where}: {'/'.join(a.option_strings) or a.dest}" for where, a in found if not (a.help or "").strip()]
    assert not missing, missing
    assert len(found) >= 9
    parser.format_help()  # every %(default)s expands
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                assert "(default: " in sub.format_help()


# --------------------------------------------------------------------------------------------- progress


def test_progress_line_formatter():
    """The build's line: ``[k/N] built <unit> (elapsed, ETA)``, ETA = mean unit time x units left / jobs."""
    assert cli_util.progress_line(3, 52, "built gemm_x.o", 65.0, unit_s=20.0, jobs=2) == \
        "[ 3/52] built gemm_x.o (elapsed 1m05s, ETA 8m10s)"
    assert cli_util.progress_line(1, 7, "cached api.o", 0.2) == "[1/7] cached api.o (elapsed 0s, ETA ?)"
    assert cli_util.progress_line(7, 7, "built b.o", 4000, unit_s=3.0) == "[7/7] built b.o (elapsed 1h06m, ETA 0s)"
    assert [cli_util.duration(x) for x in (0.4, 59.6, 61, 3600 * 2 + 61, float("nan"))] == \
        ["0s", "1m00s", "1m01s", "2h01m", "?"]


FAKE_NVCC = """#!/bin/sh
echo "$*" >> "$FAKE_NVCC_LOG"
prev=""
for a in "$@"; do if [ "$prev" = "-o" ]; then echo x > "$a"; fi; prev="$a"; done
"""


def test_build_prints_one_progress_line_per_unit(tmp_path, monkeypatch, capsys):
    """Was: ``built   <unit>`` per unit, no count, no ETA. The link order (the command order) is unchanged."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    cutlass = tmp_path / "cutlass"
    (cutlass / "include" / "cutlass").mkdir(parents=True)
    (cutlass / "include" / "cutlass" / "cutlass.h").write_text("")
    log = tmp_path / "nvcc.log"
    monkeypatch.setenv("NVCC", str(nvcc))
    monkeypatch.setenv("CUTLASS_DIR", str(cutlass))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    assert build.main(["--smoke", "--out-dir", str(tmp_path / "out"), "-j", "3"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[")]
    n = len(build.HOST_UNITS) + len(build.TEST_UNITS) + 2
    assert [x.split("]")[0] for x in lines] == [f"[{k:>{len(str(n))}}/{n}" for k in range(1, n + 1)], lines
    assert all(" built " in x and "(elapsed " in x and ", ETA " in x for x in lines), lines
    links = [x for x in log.read_text().splitlines() if x.startswith("-shared")]
    objs = [Path(a).stem for a in links[0].split() if a.endswith(".o")]
    assert objs == list(build.HOST_UNITS) + [u.stem for u in build.smoke_units()]
    assert build.main(["--smoke", "--out-dir", str(tmp_path / "out")]) == 0  # rebuilt only when changed
    assert all(" cached " in x for x in capsys.readouterr().out.splitlines() if x.startswith("["))


def test_tuner_progress_lines_have_count_and_eta(monkeypatch, capsys):
    clock = iter([100.0, 110.0, 120.0, 130.0, 140.0, 150.0])
    monkeypatch.setattr(tune_measure, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    bar = tune_measure.Progress(4, "gemm", every_s=0.0)  # t0 = 100
    bar.update(note="8192x8192x8192")  # t = 110 (check) and 120 (line)
    bar.update()  # t = 130, 140
    assert capsys.readouterr().out.splitlines() == [
        "gemm: 1/4 (25%) [elapsed 20s, ETA 1m00s] 8192x8192x8192", "gemm: 2/4 (50%) [elapsed 40s, ETA 40s]"]


def test_quick_loops_stay_silent(capsys):
    bar = tune_measure.Progress(3, "quick", every_s=60.0)
    for _ in range(3):
        bar.update()
    bar.close()
    assert capsys.readouterr().out == ""


def test_bench_moe_plan_columns_add_experiments():
    """``examples/bench_moe.py --plans``: ``<plan>+<experiment>...`` adds each experiment (short forms too) to the
    column's settings key; an unknown name exits naming it (it once took only ``+deferred``)."""
    import importlib.util

    from flashoverlap_inductor import config

    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "examples" / "bench_moe.py")
    bench_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_moe)
    assert bench_moe._settings("blocks") == ("blocks", "")
    plan, key = bench_moe._settings("blocks:c=2+deferred+plan_triton")
    assert plan == "blocks:c=2"
    assert config.from_key(key).experiments >= {"moe_settle_deferred", "moe_plan_triton"}
    with pytest.raises(SystemExit, match="no_such"):
        bench_moe._settings("blocks+no_such")
    plan, key = bench_moe._settings("blocks+deferred+no_rows")  # the op's plan suffix, not an experiment
    assert plan == "blocks+no_rows" and config.from_key(key).experiments >= {"moe_settle_deferred"}
    assert bench_moe._settings("blocks+no_rows") == ("blocks+no_rows", "")
