"""The demo's command line (``python -m flashoverlap_inductor.demo``), CPU only: every bad argument is one usage
error (exit status 2) naming the argument, the value and what is accepted, before any rank starts; the note of a
CPU run; the report's final PASS / FAIL line and exit status (from canned rank results); and one real tiny run on 2
gloo ranks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessRaisedException

from flashoverlap_inductor.tools import demo

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "argument --world-size: got 0; accepted: a whole number >= 1"),
    (["--world-size", "two"], "argument --world-size: got two; accepted: a whole number >= 1"),
    (["--steps", "0"], "argument --steps: got 0; accepted: a whole number >= 1"),
    (["--warmup", "-1"], "argument --warmup: got -1; accepted: a whole number >= 0"),
    (["--layers", "0"], "argument --layers: got 0; accepted: a whole number >= 1"),
    (["--seq", "0"], "argument --seq: got 0; accepted: a whole number >= 1"),
    (["--batch", "-2"], "argument --batch: got -2; accepted: a whole number >= 1"),
    (["--dim", "0"], "argument --dim: got 0; accepted: a whole number >= 24"),  # once taken as "the default"
    (["--world-size", "3"], "argument --world-size: got 3, but at --dim 256 its 4 attention heads (dim // 64) do not "
                            "split over 3 ranks; accepted at --dim 256: 1, 2, 4, 8,"),
    (["--dim", "90"], "argument --dim: got 90, but its head size 90 // 2 heads = 45 is odd (rotary embedding halves "
                      "it); accepted with --world-size 2: e.g. 89 or 92"),
    (["--dim", "192", "--world-size", "3"], "argument --dim: got 192, but its FFN width 512 does not split over 3 "
                                            "ranks; accepted with --world-size 3: e.g."),
    (["--backends", "eager"], "argument --backends: got eager; accepted: inductor, flashoverlap, or both"),
    (["--mode", "reduce-overhead"], "argument --mode: got reduce-overhead, which captures CUDA graphs; accepted on "
                                    "CPU: default"),
    (["--trace", "t"], "argument --trace: got t; accepted only with --profile on GPU"),
    (["--fuse", "sometimes"], "argument --fuse: invalid choice: 'sometimes'"),
])
def test_bad_arguments_are_one_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.parse_args([*argv, "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m flashoverlap_inductor.demo: error: ") and message in err[-1], err[-1]


def test_bad_arguments_fail_before_any_rank_starts(monkeypatch, capsys):
    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("spawned ranks"))
    for argv in (["--world-size", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exc:
            demo.main(argv)
        assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the message of a machine without GPUs")
def test_cuda_without_gpus(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--device", "cuda"])
    assert "argument --device: got cuda, but found 0 CUDA GPUs for --world-size 2; accepted: auto or cpu" in \
        capsys.readouterr().err


def test_cpu_defaults():
    args = demo.parse_args(["--device", "cpu"])
    assert (args.fuse, args.fuse_given, args.dim, args.seq) == ("always", False, 256, 64)
    assert (args.steps, args.warmup, args.world_size, args.device) == (10, 3, 2, "cpu")
    assert (args.heads, args.kv_heads, args.hidden, args.backends) == (4, 2, 640, ("inductor", "flashoverlap"))
    assert demo.parse_args(["--device", "cpu", "--backends", "flashoverlap"]).backends == ("flashoverlap",)


# ------------------------------------------------------------------------- main, on canned rank results


def _canned(monkeypatch, err: float = 3e-7, counters: dict | None = None, fail: str | None = None) -> list:
    """``mp.spawn`` replaced: "rank 0" of each backend writes a result (or the spawn raises ``fail``)."""
    calls = []
    counters = {"fused:all_reduce": 2} if counters is None else counters

    def spawn(fn, args, nprocs, join):
        cli, _port, backend, time_eager, out = args
        calls.append((backend, time_eager, nprocs))
        if fail:
            raise ProcessRaisedException(f"\n\n-- Process 1 terminated with the following error:\n{fail}\n", 1, 1)
        fused = backend == "flashoverlap"
        with open(out, "w") as f:
            json.dump({"backend": backend, "dtype": "torch.float32", "compile_s": 12.0, "err": err * 3.0,
                       "scale": 3.0, "rel_err": err if fused else 3e-7,
                       "times": {**({"eager": 5.0} if time_eager else {}), backend: 4.0},
                       "counters": counters if fused else {}, "lines": [], "stats": {"route:cpu": 4} if fused else {},
                       "profile": None}, f)

    monkeypatch.setattr(mp, "spawn", spawn)
    return calls


def test_cpu_run_prints_the_note_and_passes(monkeypatch, capsys):
    calls = _canned(monkeypatch)
    assert demo.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "note: CPU run (--device cpu; gloo ranks): correctness only; the timings mean nothing here."
    assert "cost model fitted on H200 GPUs" in out[1] and "uses fuse='always' unless --fuse is given" in out[2]
    assert "fuse mode 'always'" in out[3]
    assert calls == [("inductor", True, 2), ("flashoverlap", False, 2)]  # each backend its own fresh ranks
    assert any("each backend compiled in a fresh process with an empty Inductor cache" in line for line in out)
    assert out[-1] == ("PASS: inductor and flashoverlap match eager (max rel err: inductor 3.0e-07, flashoverlap "
                       "3.0e-07 <= 1e-03 for float32); fused 2 (all_reduce 2)")


def test_explicit_auto_on_cpu_says_it_fuses_nothing(monkeypatch, capsys):
    _canned(monkeypatch, counters={"skip:too_small": 2})
    assert demo.main(["--device", "cpu", "--fuse", "auto"]) == 0  # auto may decline: no failure
    out = capsys.readouterr().out.splitlines()
    assert "--fuse auto was given, so expect nothing fused." in out[2]
    assert out[-1].startswith("PASS: ") and out[-1].endswith("; fused nothing; skipped 2 (too_small 2)")


@pytest.mark.parametrize("err, counters, fail", [
    (0.1, None, "FAIL: flashoverlap deviates from eager (max rel err 1.0e-01 > 1e-03)"),
    (float("nan"), None, "FAIL: flashoverlap deviates from eager (max rel err nan > 1e-03)"),
    (3e-7, {"skip:multiple_users": 2}, "FAIL: fuse='always' fused no GEMM -> collective site"),
])
def test_fail_line_and_exit_status(monkeypatch, capsys, err, counters, fail):
    _canned(monkeypatch, err=err, counters=counters)
    assert demo.main(["--device", "cpu"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith(fail)


def test_a_rank_that_raises_is_a_fail(monkeypatch, capsys):
    _canned(monkeypatch, fail="RuntimeError: boom")
    assert demo.main(["--device", "cpu"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "FAIL: the inductor run failed: RuntimeError: boom"


# ----------------------------------------------------------------------------------------- one real run


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")
def test_tiny_cpu_run_passes_and_fuses():
    argv = ["--device", "cpu", "--world-size", "2", "--layers", "1", "--dim", "24", "--seq", "8", "--batch", "1",
            "--steps", "1", "--warmup", "0", "--backends", "flashoverlap"]
    proc = subprocess.run([sys.executable, "-m", "flashoverlap_inductor.demo", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert out[0].startswith("note: CPU run")
    m = re.fullmatch(r"PASS: flashoverlap matches eager \(max rel err: flashoverlap \S+ <= 1e-03 for float32\); "
                     r"fused (\d+) \(all_gather (\d+), reduce_scatter (\d+)\)", out[-1])
    # the demo's tensor-parallel forward (inference) under tp_sequence, the default: each all_reduce a fused
    # reduce_scatter, the next layer's input a fused all_gather
    assert m and int(m.group(1)) == int(m.group(2)) + int(m.group(3)) and int(m.group(3)) > 0, out[-1]
