"""The timeline tool's pure parts (``bench.gantt``): the breakdown of a gather call's gap to the ideal adds up, its
bars follow the marks, and the PNG and text charts are well formed. The probed GPU run itself:
``python -m flashoverlap_inductor.bench timeline`` on 2 GPUs (examples/device/two_gpu_suite.sh)."""

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
