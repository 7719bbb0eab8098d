"""The timeline tool's pure parts (``bench.gantt``, ``bench.timeline_peer``): the breakdown of a gather or peer-route
call's gap to the ideal adds up, its bars follow the marks, the report's text and the PNG and text charts are well
formed. The probed GPU run itself: ``python -m flashoverlap_inductor.bench timeline [--op reduce_scatter]`` on 2
GPUs (examples/device/two_gpu_suite.sh)."""

from __future__ import annotations

import random
import struct
import zlib

import pytest

from flashoverlap_inductor.bench import gantt


def _marks(rng: random.Random, world: int, rank: int) -> tuple[dict[str, float], list[int]]:
    order = [(rank - s) % world for s in range(world)]
    t = {"start": 0.0, "gemm_start": rng.uniform(0.0, 0.05)}
    now, pulled = t["gemm_start"], t["gemm_start"]
    for j in order:
        if j != rank:
            pulled += rng.uniform(0.01, 0.3)
            t[f"pull:{j}"] = pulled
            now = max(now, pulled)
        now += rng.uniform(0.02, 0.4)
        t[f"gemm_done:{j}"] = now
    t["end"] = now + rng.uniform(0.0, 0.02)
    return t, order


@pytest.mark.parametrize("seed", range(20))
def test_gather_breakdown_adds_up(seed):
    rng = random.Random(seed)
    world = rng.randint(2, 8)
    rank = rng.randrange(world)
    t, order = _marks(rng, world, rank)
    gemm_ms = rng.uniform(0.05, 1.0)
    comm_ms = gemm_ms * rng.uniform(0.1, 0.9)  # the GEMM is the longer side: the identity holds exactly
    out, lanes = gantt.gather_breakdown(t, rank, order, gemm_ms, comm_ms)
    assert out["total"] == pytest.approx(t["end"])
    assert out["gap"] == pytest.approx(out["handshake"] + out["gemm_extra"] + out["waits"] + out["tail"])
    assert out["waits"] >= 0 and out["tail"] >= 0
    compute = lanes["compute"]
    assert compute[0] == ("handshake", 0.0, t["gemm_start"]) and compute[-1][0] == "tail"
    for (_, _, end), (_, start, _) in zip(compute, compute[1:]):  # contiguous, in time order
        assert start == pytest.approx(end)
    assert [label for label, _, _ in lanes["copy"]] == [f"pull:{j}" for j in order if j != rank]
    busy = sum(e - s for label, s, e in compute if label.startswith("gemm"))
    assert busy == pytest.approx(gemm_ms + out["gemm_extra"])


def test_png_and_text(tmp_path):
    timeline = {0: {"compute": [("handshake", 0.0, 0.02), ("gemm:0", 0.02, 0.1), ("wait:1", 0.1, 0.12),
                                ("gemm:1", 0.12, 0.2), ("tail", 0.2, 0.21)],
                    "copy": [("pull:1", 0.02, 0.12)]},
                1: {"compute": [("handshake", 0.0, 0.03), ("gemm:1", 0.03, 0.2)], "copy": [("pull:0", 0.03, 0.1)]}}
    path = tmp_path / "t.png"
    gantt.png(timeline, str(path), width=300, lane_px=10)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width == 300 and height == 4 * 14 + 12 * 2 + 8
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    raw = zlib.decompress(idat)
    assert len(raw) == height * (1 + 3 * width)
    assert bytes(gantt.COLOURS["gemm"]) in raw and bytes(gantt.COLOURS["pull"]) in raw
    text = gantt.text(timeline, width=40)
    lines = text.splitlines()
    assert len(lines) == 1 + 4 + 1 and "G" in lines[1] and "p" in lines[2] and "h" in lines[1]


def _peer_marks(rng: random.Random, how: str, groups: int = 0) -> dict[str, float]:
    """Synthetic marks of one peer-route call (ms since start), in the order the route records them."""
    t = {"start": 0.0}
    now = t["gemm1"] = rng.uniform(0.1, 1.0)
    now = t["notify"] = now + rng.uniform(0.0, 0.2)
    now = t["gemm2"] = now + rng.uniform(0.1, 1.2)
    for g in range(groups):  # the copy streams' marks: any time after the notify
        t[f"pull:{g}"] = t["notify"] + rng.uniform(0.05, 1.3) + 0.1 * g
        t[f"side:{g}"] = t["notify"] + rng.uniform(0.05, 1.3) + 0.1 * g
    if how == "pull":
        now = t["join"] = max([now] + [v for name, v in t.items() if ":" in name]) + rng.uniform(0.0, 0.01)
    else:
        now = t["exchange"] = now + rng.uniform(0.0, 0.1)
    if how == "push":
        now = t["copy"] = now + rng.uniform(0.01, 0.1)
    t["end"] = now + rng.uniform(0.0, 0.02)
    return t


@pytest.mark.parametrize("seed", range(24))
def test_peer_breakdown_adds_up(seed):
    rng = random.Random(seed)
    how = ("reduce_scatter", "push", "pull")[seed % 3]
    groups = rng.randint(1, 8) if how == "pull" else 0
    t = _peer_marks(rng, how, groups)
    half_ms = rng.uniform(0.1, 1.0)
    gemm_ms = 2 * half_ms * rng.uniform(0.9, 1.0)
    comm_ms = gemm_ms * rng.uniform(0.1, 0.9)  # the GEMM is the longer side: the identity holds exactly
    out, lanes = gantt.peer_breakdown(t, gemm_ms, half_ms, comm_ms)
    assert out["total"] == pytest.approx(t["end"]) and out["ideal"] == pytest.approx(gemm_ms)
    parts = ("split", "gemm1_extra", "wait", "gemm2_extra", "exchange", "copy", "tail")
    assert out["gap"] == pytest.approx(sum(out[p] for p in parts))
    assert out["gemm1"] == pytest.approx(half_ms + out["gemm1_extra"])
    assert out["gemm2"] == pytest.approx(half_ms + out["gemm2_extra"])
    assert out["gemm1"] + out["wait"] + out["gemm2"] + out["exchange"] + out["copy"] + out["tail"] == \
        pytest.approx(t["end"])
    assert (out["copy"] > 0) == (how == "push") and out["copy"] >= 0
    compute = lanes["compute"]
    assert compute[0] == ("gemm:1", 0.0, t["gemm1"]) and compute[-1] == ("tail", compute[-2][2], t["end"])
    for (_, _, end), (_, start, _) in zip(compute, compute[1:]):  # contiguous, in time order
        assert start == pytest.approx(end)
    kinds = [gantt.kind(label) for label, _, _ in compute]
    assert kinds == ["gemm", "wait", "gemm", "exchange", *(["copy"] if how == "push" else []), "tail"]
    if how == "pull":
        assert [label for label, _, _ in lanes["pull"]] == [f"pull:{g}" for g in range(groups)]
        assert [label for label, _, _ in lanes["side"]] == [f"copy:{g}" for g in range(groups)]
        assert all(s <= e for lane in ("pull", "side") for _, s, e in lanes[lane])
    else:
        assert set(lanes) == {"compute"}


def _peer_row(rank: int, how: str, seed: int) -> dict:
    t = _peer_marks(random.Random(seed), how, 2 if how == "pull" else 0)
    out, lanes = gantt.peer_breakdown(t, 1.0, 0.5, 0.6)
    out.update(gemm=1.0, half=0.5, comm=0.6, seq=1.6, hidden=(1.6 - out["total"]) / 0.6, host_ms=0.05)
    return {"op": "all_reduce", "m": 4096, "n": 8192, "k": 8192, "gate": "epilogue", "rank": rank,
            "how": f"all_reduce {how}", "breakdown": out, "lanes": lanes}


def test_peer_report_text_and_png(tmp_path):
    from flashoverlap_inductor.bench import timeline_peer

    rows = [[_peer_row(0, "pull", 1), _peer_row(1, "pull", 2)],
            [{"op": "reduce_scatter", "m": 6, "n": 8, "k": 8, "gate": "kernel", "rank": r,
              "declined": "6 rows do not split"} for r in range(2)]]
    text = timeline_peer.format_report(rows)
    lines = text.splitlines()
    assert lines[0] == timeline_peer.HEADER
    assert lines[1] == "== all_reduce 4096x8192x8192 gate=epilogue: all_reduce pull"
    assert lines[2].split(" | ")[1:] == list(timeline_peer.COLS)
    for r, line in enumerate(lines[3:5]):
        cells = [c.strip() for c in line.split("|")]
        assert cells[0] == str(r) and len(cells) == 1 + len(timeline_peer.COLS)
        assert float(cells[1 + timeline_peer.COLS.index("hidden")]) == \
            pytest.approx(rows[0][r]["breakdown"]["hidden"], abs=1e-3)
    gantt_lines = [ln for ln in lines if ln.startswith("rank ")]
    assert [ln.split("|")[0].split()[:3] for ln in gantt_lines] == \
        [["rank", str(r), lane] for r in range(2) for lane in ("compute", "pull", "side")]
    assert "x" in gantt_lines[0] and "G" in gantt_lines[0] and "y" in gantt_lines[2]
    assert lines[-1] == "== reduce_scatter 6x8x8 gate=kernel: declined: 6 rows do not split"
    timeline_peer.report(rows, str(tmp_path))
    path = timeline_peer.png_path(str(tmp_path), rows[0][0])
    assert path.endswith("timeline_all_reduce_4096x8192x8192_epilogue.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline_all_reduce_4096x8192x8192_epilogue.png"]


def test_timeline_op_option():
    from flashoverlap_inductor.bench import timeline

    args = timeline.parse_args(["--op", "all_gather,reduce_scatter", "--gate", "epilogue,kernel"])
    assert args.op == "all_gather,reduce_scatter" and args.shapes is None and args.spin_ms == 1.0
    assert timeline.parse_args([]).op == "all_gather"
    with pytest.raises(SystemExit):
        timeline.parse_args(["--op", "all_to_all"])


def test_lead_calls_run_unprobed_right_before_each_probed_call(monkeypatch):
    """``--lead N``: per probed call, N plain calls after the spin and before it (no sync between), none of them
    probed; the warm-up first; the marks' medians come from the probed calls alone."""
    from types import SimpleNamespace

    from flashoverlap_inductor.bench import timeline, timeline_peer

    log = []
    monkeypatch.setattr(timeline_peer.dist, "barrier", lambda: log.append("barrier"))
    monkeypatch.setattr(timeline_peer.torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(timeline_peer.measure, "spin", lambda ms: log.append("spin"))

    class Probe:
        def times(self):
            return {"start": 0.0, "end": 2.0 + len(log) % 2}

    monkeypatch.setattr(timeline_peer, "CallProbe", Probe)
    ctx = SimpleNamespace(probe=None)

    def execute():
        log.append("probed" if ctx.probe is not None else "plain")
        return []

    args = timeline.parse_args(["--lead", "2", "--iters", "3", "--warmup", "1"])
    marks, _ = timeline_peer.probed_calls(execute, ctx, args)
    one = ["barrier", "sync", "spin", "plain", "plain", "probed", "sync"]
    assert log == ["plain", *one * 3] and ctx.probe is None
    assert marks["start"] == 0.0 and marks["end"] in (2.0, 3.0)
    assert timeline.parse_args([]).lead == 0


def test_host_gap_before_each_lead_and_probed_call(monkeypatch):
    """``--host-gap-us G --skew-us S``: G us of host wait before each lead and probed call, G + S on rank 1 only (none
    before the warm-up); negative values are refused; ``host_gap`` itself waits at least that long."""
    import time
    from types import SimpleNamespace

    from flashoverlap_inductor.bench import timeline, timeline_peer

    for rank, want in ((0, 150.0), (1, 270.0)):
        log = []
        monkeypatch.setattr(timeline_peer.dist, "barrier", lambda: None)
        monkeypatch.setattr(timeline_peer.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(timeline_peer.dist, "get_rank", lambda rank=rank: rank)
        monkeypatch.setattr(timeline_peer.torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(timeline_peer.measure, "spin", lambda ms: None)
        monkeypatch.setattr(timeline_peer, "host_gap", lambda us, log=log: log.append(us))
        monkeypatch.setattr(timeline_peer, "CallProbe", lambda: SimpleNamespace(times=lambda: {"start": 0.0}))
        ctx = SimpleNamespace(probe=None)
        args = timeline.parse_args(["--lead", "2", "--iters", "2", "--warmup", "1", "--host-gap-us", "150",
                                    "--skew-us", "120"])
        timeline_peer.probed_calls(lambda: [], ctx, args)
        assert log == [want] * 6, (rank, log)
    for bad in (["--host-gap-us", "-1"], ["--skew-us", "-5"]):
        with pytest.raises(SystemExit):
            timeline.parse_args(bad)
    monkeypatch.undo()
    t0 = time.perf_counter()
    timeline_peer.host_gap(2000.0)
    assert time.perf_counter() - t0 >= 2e-3


def _pull_marks(rng: random.Random, peer: int) -> dict[str, float]:
    """Synthetic marks of one pull-route call (ms since start), in the order the route records them."""
    t = {"start": 0.0}
    now = t["part"] = rng.uniform(0.05, 1.0)
    now = t["own_start"] = now + rng.uniform(0.0, 0.05)
    t[f"pull:{peer}"] = now + rng.uniform(0.01, 1.5)  # the copy stream: any time after the protocol began
    now = t["own"] = now + rng.uniform(0.05, 1.0)
    now = t["arrived"] = max(now, t[f"pull:{peer}"]) + rng.uniform(0.0, 0.005)
    now = t["add"] = now + rng.uniform(0.005, 0.05)
    t["end"] = now + rng.uniform(0.0, 0.02)
    return t


@pytest.mark.parametrize("seed", range(16))
def test_pull_breakdown_adds_up(seed):
    rng = random.Random(seed)
    peer = seed % 2
    t = _pull_marks(rng, peer)
    half_ms = rng.uniform(0.05, 1.0)
    gemm_ms = 2 * half_ms * rng.uniform(0.9, 1.0)
    comm_ms = gemm_ms * rng.uniform(0.1, 0.9)  # the GEMM is the longer side: the identity holds exactly
    out, lanes = gantt.pull_breakdown(t, peer, gemm_ms, half_ms, comm_ms)
    assert out["total"] == pytest.approx(t["end"]) and out["ideal"] == pytest.approx(gemm_ms)
    parts = ("split", "peer_extra", "handshake", "own_extra", "wait", "add", "tail")
    assert out["gap"] == pytest.approx(sum(out[p] for p in parts))
    assert out["gemm_peer"] == pytest.approx(half_ms + out["peer_extra"])
    assert out["gemm_own"] == pytest.approx(half_ms + out["own_extra"])
    assert out["wait"] >= 0 and out["landed"] == t[f"pull:{peer}"]
    compute = lanes["compute"]
    assert [gantt.kind(label) for label, _, _ in compute] == ["gemm", "handshake", "gemm", "wait", "add", "tail"]
    assert compute[0][1] == 0.0 and compute[-1][2] == pytest.approx(t["end"])
    for (_, _, end), (_, start, _) in zip(compute, compute[1:]):  # contiguous, in time order
        assert start == pytest.approx(end)
    (label, start, end), = lanes["copy"]
    assert label == f"pull:{peer}" and start <= end == t[f"pull:{peer}"]


def test_pull_report_text_and_png(tmp_path):
    from flashoverlap_inductor.bench import timeline, timeline_pull

    rows = []
    for schedule in ("handshake", "push"):
        per_rank = []
        for rank in range(2):
            t = _pull_marks(random.Random(rank), 1 - rank)
            out, lanes = gantt.pull_breakdown(t, 1 - rank, 1.0, 0.5, 0.4)
            out.update(gemm=1.0, half=0.5, comm=0.4, seq=1.4, hidden=(1.4 - out["total"]) / 0.4, host_ms=0.2)
            per_rank.append({"op": "reduce_scatter_pull", "m": 4096, "n": 4096, "k": 8192, "schedule": schedule,
                             "rank": rank, "how": f"pull {schedule}", "breakdown": out, "lanes": lanes})
        rows.append(per_rank)
    rows.append([{"op": "reduce_scatter_pull", "m": 6, "n": 8, "k": 8, "schedule": "push", "rank": r,
                  "declined": "the pull route runs on 2 ranks"} for r in range(2)])
    lines = timeline_pull.format_report(rows).splitlines()
    assert lines[0] == timeline_pull.HEADER
    assert lines[1] == "== reduce_scatter_pull 4096x4096x8192 schedule=handshake: pull handshake"
    assert lines[2].split(" | ")[1:] == list(timeline_pull.COLS)
    assert lines[-1] == "== reduce_scatter_pull 6x8x8 schedule=push: declined: the pull route runs on 2 ranks"
    gantt_lines = [ln for ln in lines if ln.startswith("rank ")]
    assert "+" in gantt_lines[0] and "G" in gantt_lines[0] and "p" in gantt_lines[1]
    timeline_pull.report(rows, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "timeline_pull_4096x4096x8192_handshake.png", "timeline_pull_4096x4096x8192_push.png"]
    args = timeline.parse_args(["--op", "reduce_scatter_pull"])
    assert args.scatter_schedule == "push,handshake" and set(args.scatter_schedule.split(",")) == set(
        timeline_pull.SCHEDULES)
