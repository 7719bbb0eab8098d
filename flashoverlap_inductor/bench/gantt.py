"""Timelines of fused calls: the breakdown of a call's time and its Gantt chart (text and PNG), pure Python.

A timeline is ``{rank: {lane: [(label, start_ms, end_ms), ...]}}`` (lanes such as "compute", "copy", "pull"; times in
ms from the call's start on that rank). ``png`` writes an RGB PNG with no dependency (zlib only): one row of bars
per (rank, lane), a colour per label kind (the text before ``:``), a tick every ``tick_ms``; ``text`` draws the same
in characters. Both take every rank's timeline on one time axis.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence

Bar = tuple[str, float, float]  # label, start ms, end ms
Timeline = Mapping[int, Mapping[str, Sequence[Bar]]]

COLOURS = {"handshake": (150, 150, 150), "gemm": (52, 101, 164), "pull": (237, 125, 49), "wait": (220, 220, 220),
           "tail": (200, 60, 60), "comm": (237, 125, 49), "host": (120, 180, 90), "exchange": (140, 90, 170),
           "copy": (230, 190, 40), "add": (90, 170, 170)}
CHARS = {"handshake": "h", "gemm": "G", "pull": "p", "wait": ".", "tail": "t", "comm": "c", "host": "H",
         "exchange": "x", "copy": "y", "add": "+"}


def kind(label: str) -> str:
    return label.split(":", 1)[0]


def span_ms(timeline: Timeline) -> float:
    return max((end for lanes in timeline.values() for bars in lanes.values() for _, _, end in bars), default=0.0)


def text(timeline: Timeline, width: int = 96) -> str:
    """One line per (rank, lane): each bar's kind letter (``CHARS``) over its share of ``width`` columns."""
    total = span_ms(timeline) or 1.0
    lines = [f"0 ms {'-' * (width - 12)} {total:.3f} ms"]
    for rank in sorted(timeline):
        for lane, bars in timeline[rank].items():
            row = [" "] * width
            for label, start, end in bars:
                a, b = int(start / total * width), max(int(start / total * width) + 1, int(end / total * width))
                for i in range(a, min(b, width)):
                    row[i] = CHARS.get(kind(label), "?")
            lines.append(f"rank {rank} {lane:<8}|{''.join(row)}|")
    lines.append("legend: " + ", ".join(f"{c} {k}" for k, c in CHARS.items()))
    return "\n".join(lines)


def png(timeline: Timeline, path: str, width: int = 1200, lane_px: int = 28, tick_ms: float = 0.05) -> None:
    """Write the chart to ``path`` (RGB PNG): rows of bars per (rank, lane), 4 px between lanes and 12 between ranks,
    thin grey ticks every ``tick_ms``."""
    rows = [(rank, lane) for rank in sorted(timeline) for lane in timeline[rank]]
    total = span_ms(timeline) or 1.0
    height = len(rows) * (lane_px + 4) + 12 * len(timeline) + 8
    img = [[(255, 255, 255)] * width for _ in range(height)]
    t = 0.0
    while t <= total and tick_ms > 0:
        x = min(width - 1, int(t / total * (width - 1)))
        for y in range(height):
            img[y][x] = (235, 235, 235)
        t += tick_ms
    y0, last_rank = 4, None
    for rank, lane in rows:
        if last_rank is not None and rank != last_rank:
            y0 += 12
        last_rank = rank
        for label, start, end in timeline[rank][lane]:
            colour = COLOURS.get(kind(label), (0, 0, 0))
            a = int(start / total * (width - 1))
            b = max(a + 1, int(end / total * (width - 1)))
            for y in range(y0 + 2, y0 + lane_px - 2):
                row = img[y]
                for x in range(a, min(b, width)):
                    row[x] = colour
                if b - a > 2:  # a dark edge between adjacent bars of one kind
                    row[a] = tuple(c // 2 for c in colour)
        y0 += lane_px + 4
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def gather_breakdown(t: Mapping[str, float], rank: int, order: Sequence[int], gemm_ms: float, comm_ms: float
                     ) -> tuple[dict[str, float], dict[str, list[Bar]]]:
    """The gap of one gather_peer call to the ideal ``max(gemm_ms, comm_ms)`` and its bars, from the probe's marks
    ``t`` (ms since ``start``: ``gemm_start``, ``gemm_done:<j>``, ``pull:<j>`` for every peer, ``end``) on ``rank``;
    ``order``: the shards in the order the GEMMs take them (``schedule.gather.arrival_order``, the local one first).

    Returns (breakdown, lanes). Breakdown (ms): ``total``; ``ideal``; ``handshake`` (start to the first GEMM);
    ``gemm_extra`` (the shard GEMMs' busy time beyond ``gemm_ms``: split and shared HBM); ``waits`` (GEMMs idle for a
    pull); ``tail`` (the last GEMM's end to the call's end); ``gap`` = total - ideal; when the GEMM is the longer
    side, ``gap`` = handshake + gemm_extra + waits + tail exactly."""
    lanes: dict[str, list[Bar]] = {"compute": [], "copy": []}
    start = t["gemm_start"]
    lanes["compute"].append(("handshake", 0.0, start))
    prev, busy, waits = start, 0.0, 0.0
    pulled = start
    for j in order:
        if j != rank:
            land = t[f"pull:{j}"]
            lanes["copy"].append((f"pull:{j}", min(pulled, land), land))
            pulled = land
            if land > prev:
                lanes["compute"].append((f"wait:{j}", prev, land))
                waits += land - prev
                prev = land
        done = t[f"gemm_done:{j}"]
        lanes["compute"].append((f"gemm:{j}", prev, done))
        busy += done - prev
        prev = done
    end = t["end"]
    lanes["compute"].append(("tail", prev, end))
    ideal = max(gemm_ms, comm_ms)
    out = {"total": end, "ideal": ideal, "handshake": start, "gemm_extra": busy - gemm_ms, "waits": waits,
           "tail": end - prev, "gap": end - ideal}
    return out, lanes


def peer_breakdown(t: Mapping[str, float], gemm_ms: float, half_ms: float, comm_ms: float
                   ) -> tuple[dict[str, float], dict[str, list[Bar]]]:
    """The gap of one peer-route call (GEMM -> all_reduce / reduce_scatter on two ranks) to the ideal
    ``max(gemm_ms, comm_ms)`` and its bars, from the probe's marks ``t`` (ms since ``start``, on one rank; names of
    ``routes.peer.probe_points``): ``gemm1``, ``notify``, ``gemm2``, ``exchange`` (reduce_scatter, push) or ``join``
    (pull), ``copy`` (push), ``end``; by pull ``pull:<g>`` and ``side:<g>`` per copy group. ``gemm_ms``: cuBLAS on
    the full rows alone; ``half_ms``: on half of them (one rank's GEMM 1 or GEMM 2 alone); ``comm_ms``: NCCL alone.

    Returns (breakdown, lanes). Breakdown (ms): ``total``; ``ideal``; ``gemm1`` (start to GEMM 1's end: the launch's
    first kernels included); ``wait`` (the notify, or notify + wait kernel: the peer's GEMM 1); ``gemm2`` (GEMM 2,
    its gate's waits included when the gate is in its epilogue); ``gemm1_extra`` / ``gemm2_extra``: each beyond
    ``half_ms`` (GEMM 2's: remote C loads, pushes to the peer, the gate); ``split`` = 2 ``half_ms`` - ``gemm_ms``
    (two half GEMMs against one); ``exchange`` (GEMM 2's end to the flag exchange's, or by pull to the join of the
    copy streams); ``copy`` (push: the final copy); ``tail`` (the last mark on cur to the call's end: the fault
    finish kernel); ``gap`` = total - ideal; when the GEMM is the longer side, ``gap`` = split + gemm1_extra + wait +
    gemm2_extra + exchange + copy + tail exactly. Lanes: ``compute`` (cur, contiguous) and, by pull, ``pull`` and
    ``side``, whose bars span from the lane's previous mark (the first: ``notify``) to their own: wait and copy."""
    lanes: dict[str, list[Bar]] = {"compute": []}
    g1, notify, g2 = t["gemm1"], t["notify"], t["gemm2"]
    exch_name = "join" if "join" in t else "exchange"
    exch = t[exch_name]
    copy = t.get("copy", exch)
    end = t["end"]
    lanes["compute"] += [("gemm:1", 0.0, g1), ("wait:peer", g1, notify), ("gemm:2", notify, g2),
                         (f"exchange:{exch_name}", g2, exch)]
    if "copy" in t:
        lanes["compute"].append(("copy", exch, copy))
    lanes["compute"].append(("tail", copy, end))
    for lane, kind_ in (("pull", "pull"), ("side", "copy")):
        groups = sorted(int(name.split(":", 1)[1]) for name in t if name.startswith(f"{lane}:"))
        if groups:
            prev, bars = notify, []
            for g in groups:
                land = t[f"{lane}:{g}"]
                bars.append((f"{kind_}:{g}", min(prev, land), land))
                prev = land
            lanes[lane] = bars
    ideal = max(gemm_ms, comm_ms)
    out = {"total": end, "ideal": ideal, "gap": end - ideal, "gemm1": g1, "wait": notify - g1, "gemm2": g2 - notify,
           "gemm1_extra": g1 - half_ms, "gemm2_extra": g2 - notify - half_ms, "split": 2 * half_ms - gemm_ms,
           "exchange": exch - g2, "copy": copy - exch, "tail": end - copy}
    return out, lanes


def pull_breakdown(t: Mapping[str, float], peer: int, gemm_ms: float, half_ms: float, comm_ms: float
                   ) -> tuple[dict[str, float], dict[str, list[Bar]]]:
    """The gap of one reduce_scatter pull-route call (``routes.scatter_pull``, two ranks) to the ideal ``max(gemm_ms,
    comm_ms)`` and its bars, from the probe's marks ``t`` (ms since ``start``, on one rank): ``part`` (the peer's half
    GEMM done), ``own_start`` (after the protocol's kernels on the caller's stream: the handshake's, or push's begin),
    ``own`` (the own half's GEMM done), ``arrived`` (the caller's stream past its wait for the peer's part),
    ``add``, ``end``; ``pull:<peer>``: the peer's part landed here (the library's event on the copy stream).
    ``half_ms``: cuBLAS on half the rows alone; ``gemm_ms`` on all of them; ``comm_ms``: NCCL alone.

    Returns (breakdown, lanes). Breakdown (ms): ``total``; ``ideal``; ``gemm_peer`` / ``gemm_own`` (each half's GEMM)
    and ``peer_extra`` / ``own_extra`` (each beyond ``half_ms``: the copy engine's HBM traffic beside it); ``split`` = 2
    ``half_ms`` - ``gemm_ms``; ``handshake`` (the protocol's kernels before the own GEMM); ``wait`` (the own GEMM's end
    to the part's arrival); ``add``; ``tail`` (the join, the done notification, the fault check); ``landed`` (the
    part's arrival after the start); ``gap`` = total - ideal; when the GEMM is the longer side, ``gap`` = split +
    peer_extra + handshake + own_extra + wait + add + tail exactly. Lanes: ``compute`` (cur, contiguous) and ``copy``
    (the part's transfer, from the handshake's end, or its landing if earlier). Push schedule: the library records
    the landing after its wait kernel on the copy stream, which needs a free SM (the own GEMM's end at the earliest),
    so ``landed`` may show the arrival late and part of ``wait`` be that kernel's scheduling, not the transfer."""
    part, own_start, own, arrived, add, end = (t[name] for name in ("part", "own_start", "own", "arrived", "add",
                                                                     "end"))
    land = t[f"pull:{peer}"]
    lanes: dict[str, list[Bar]] = {
        "compute": [("gemm:peer", 0.0, part), ("handshake", part, own_start), ("gemm:own", own_start, own),
                    ("wait:part", own, arrived), ("add", arrived, add), ("tail", add, end)],
        "copy": [(f"pull:{peer}", min(own_start, land), land)]}
    ideal = max(gemm_ms, comm_ms)
    out = {"total": end, "ideal": ideal, "gap": end - ideal, "gemm_peer": part, "gemm_own": own - own_start,
           "peer_extra": part - half_ms, "own_extra": own - own_start - half_ms, "split": 2 * half_ms - gemm_ms,
           "handshake": own_start - part, "wait": arrived - own, "add": add - arrived, "tail": end - add,
           "landed": land}
    return out, lanes
