"""``gather_start="push"`` of ``routes/gather_peer.py`` on the CPU: ``execute`` for every rank of a simulated group
with the library faked. The fake ``fo_gather_call`` checks what the route hands the library (the push option, a
receive buffer of ``SLOT_SETS`` sets of ``world`` slots from the push workspace list, the set alternating per call
alike on every rank, staging only when the gathered rows are returned) and plays the peers' pushes: it writes each
peer's shard into slot ``j`` of the call's set of this rank's buffer and this rank's shard into slot ``rank`` of the
same set of every peer's buffer (where ``csrc/gather_call.cu`` copies it), then copies the slots out as the library
does under ``copy_own``. Each rank's GEMM outputs (the Python loop: fp32 takes no library GEMMs) must be its GEMMs
over the gathered rows of that call, and the gathered rows the all_gather's. Also: ``fo_gather_args`` and its
constants as the C header declares them."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.routes import gather_peer, gather_protocol, gather_start

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "flashoverlap_sm90.h"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("returned", [False, True])
def test_push_execute_reads_every_shard_from_its_slot(monkeypatch, world, returned):
    gen = torch.Generator().manual_seed(11)
    rows, k, ns = 6, 16, (24, 8)  # shard rows per rank, K, the N of two GEMMs sharing the gather
    weights = [torch.randn(k, n, generator=gen) for n in ns]
    shard_bytes = rows * k * 4
    sets = gather_start.SLOT_SETS
    set_bytes = world * shard_bytes + 64  # room to spare: the sets lie set_bytes apart, not world shards apart
    buffers = [torch.zeros(sets * set_bytes, dtype=torch.uint8) for _ in range(world)]  # "symmetric" memory
    settings = config.current().replace(gather_start="push")
    asked = []

    def workspace(group, device, need, capturing=False, push=False):
        asked.append((need, push))
        return ws

    flags = SimpleNamespace(views=[torch.zeros(4) for _ in range(world)],
                            events=[SimpleNamespace(cuda_event=None) for _ in range(world)],
                            epoch=torch.zeros(1), fault=SimpleNamespace(block_ptr=None, mirror_ptr=None),
                            copy=SimpleNamespace(cuda_stream=None))
    ws = SimpleNamespace(flags=flags, views=buffers, serial=-1, capacity=sets * set_bytes)
    monkeypatch.setattr(gather_peer, "group_issue", lambda g: None)
    monkeypatch.setattr(gather_peer, "workspace", workspace)
    monkeypatch.setattr(gather_peer, "_push_calls", {})
    monkeypatch.setattr(gather_peer.compat, "group_timeout_ms", lambda g: 1000.0)
    monkeypatch.setattr(gather_peer.compat, "current_raw_stream", lambda i: 0)
    monkeypatch.setattr(gather_peer.symmetric, "order_after_last", lambda g, d, s: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_event=lambda e: None))
    launches = {}
    for number in range(2 * sets):  # every set twice; a rank's calls alternate the sets, as its peers' do
        shards = [torch.randn(rows, k, generator=gen) for _ in range(world)]
        gathered = torch.cat(shards)
        for rank in range(world):
            def gather_call(pp, rank=rank, shards=shards, number=number):
                p = pp._obj
                assert p.options == gather_start.PUSH and p.rank == rank and p.world == world
                assert p.shard_bytes == shard_bytes and p.copy_own == int(returned)
                assert p.slot_set == number % sets
                assert (p.staging is not None) == returned  # no staging unless the gathered rows are returned
                assert [p.buffers[j] for j in range(world)] == [b.data_ptr() for b in buffers]
                assert p.set_bytes == set_bytes
                base = p.slot_set * p.set_bytes
                for j in range(world):  # the peers' pushes into this rank's slots, this rank's into theirs
                    if j != rank:
                        ctypes.memmove(p.buffers[rank] + base + j * shard_bytes, shards[j].data_ptr(), shard_bytes)
                        ctypes.memmove(p.buffers[j] + base + rank * shard_bytes, p.a, shard_bytes)
                if p.copy_own:  # the slots and a into staging, as push_call's last step copies them
                    for j in range(world):
                        src = p.a if j == rank else p.buffers[rank] + base + j * shard_bytes
                        ctypes.memmove(p.staging + j * shard_bytes, src, shard_bytes)
                return 0

            lib = SimpleNamespace(fo_gather_call=gather_call, fo_gather_finish=lambda pp: 0)
            monkeypatch.setattr(gather_peer.kernels, "library", lambda lib=lib: lib)
            call = routes.Call("all_gather", world * rows, sum(ns), k, torch.float32, world, rank, "cuda", None,
                               "auto", group_name="g")
            ctx = SimpleNamespace(a=shards[rank], b=weights, bias=[None] * len(ns),
                                  group=SimpleNamespace(group_name=f"rank{rank}"),  # each rank's own count
                                  y_shape=[world * rows, k], gather_dim=0, return_gathered=returned,
                                  capturing=False, probe=None, settings=settings)
            if rank not in launches:
                launches[rank] = gather_peer.make_launch(call, settings, ctx)
                launches[rank].args.clear()
            launch = launches[rank]
            assert launch.options == gather_start.PUSH and launch.gemms is None  # fp32: the Python loop
            outs = gather_peer.ROUTE.execute(launch, ctx)
            assert asked[-1] == (sets * world * shard_bytes, True)  # every set's world slots, from the push list
            assert len(outs) == len(ns) + returned
            for w, y in zip(weights, outs, strict=False):
                torch.testing.assert_close(y, gathered @ w)
            if returned:
                assert torch.equal(outs[-1], gathered)


def test_push_sets_never_overlap_across_call_sizes():
    """Calls of any shard size on one push workspace: every byte a set-``b`` call's slots take (the library's
    ``buffers + b * set_bytes + [0, world * shard_bytes)``, and the views the GEMMs and adds read) lies in set ``b``'s
    fixed range, so the waits of one set guard everything its calls write (a set-1 push of a small call once
    overwrote the rows of a queued larger set-0 call: offsets then scaled with the shard size)."""
    from flashoverlap_inductor.routes import scatter_pull

    capacity, world = 1 << 20, 2
    buf = torch.zeros(capacity, dtype=torch.uint8)
    ws = SimpleNamespace(capacity=capacity, views=[buf, buf], serial=-1,
                         flags=SimpleNamespace(views=[buf, buf], events=[SimpleNamespace(cuda_event=None)] * 2,
                                               epoch=torch.zeros(1), copy=SimpleNamespace(cuda_stream=None),
                                               fault=SimpleNamespace(block_ptr=None, mirror_ptr=None)))
    base, step = buf.data_ptr(), capacity // gather_start.SLOT_SETS
    for rows in (128, 48, 320, 8):  # shard rows of K 384 in bf16: 96, 36, 240 (a full set) and 6 KiB shards
        shard_bytes = rows * 384 * 2
        geo = SimpleNamespace(world=world, shard_rows=rows, k=384)
        launch = gather_peer.GatherLaunch(geo, 0, torch.bfloat16, shard_bytes, 1, "", gather_start.PUSH,
                                          gather_start.SLOT_SETS * world * shard_bytes)
        scatter = scatter_pull.ScatterLaunch(0, rows, 384, 64, torch.bfloat16, None, shard_bytes, 1, "",
                                             options=gather_start.PUSH, buffer_bytes=launch.buffer_bytes)
        p = gather_peer.args_for(launch, ws)
        views = [gather_peer.receive_slots(launch, ws, torch.bfloat16),
                 scatter_pull.receive_buffer(scatter, ws)]
        assert scatter_pull.args_for(scatter, ws).set_bytes == p.set_bytes == step
        for b in range(gather_start.SLOT_SETS):
            lo, hi = p.buffers[0] + b * p.set_bytes, p.buffers[0] + b * p.set_bytes + world * shard_bytes
            assert base + b * step <= lo and hi <= base + (b + 1) * step, (rows, b)
            for v in views:
                t = v[b]
                assert (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) == (lo, hi), (rows, b)


def test_push_set_count_restarts_with_the_flags(monkeypatch):
    """``zero_state`` (resync: the device counters of the sets are zero again) and ``reset`` restart the host's
    count, so every rank's next push call takes set 0."""
    monkeypatch.setattr(gather_peer, "_push_calls", {})
    group, device = SimpleNamespace(group_name="g"), torch.device("cuda", 0)
    assert [gather_peer.next_slot_set(group, device) for _ in range(3)] == [0, 1, 0]
    monkeypatch.setattr(gather_peer.GatherPeerRoute.__mro__[1], "zero_state", lambda self, key: None)
    gather_peer.ROUTE.zero_state((0, "g"))
    assert gather_peer.next_slot_set(group, device) == 0
    assert gather_peer.next_slot_set(SimpleNamespace(group_name="h"), device) == 0  # per group


def test_gather_args_match_the_c_header():
    header = HEADER.read_text()
    for name, value in (("MAX_WORLD", gather_protocol.MAX_WORLD), ("MAX_OUTPUTS", gather_protocol.MAX_OUTPUTS),
                        ("SLOT_SETS", gather_start.SLOT_SETS), ("PUSH", gather_start.PUSH),
                        ("GEMM_AFTER_HANDSHAKE", gather_start.GEMM_AFTER_HANDSHAKE),
                        ("COPY_NOTIFY", gather_start.COPY_NOTIFY)):
        assert f"#define FO_GATHER_{name} {value}\n" in header
    per_rank = gather_protocol.FLAG_INTS // gather_protocol.MAX_WORLD
    assert f"#define FO_GATHER_FLAG_INTS ({per_rank} * FO_GATHER_MAX_WORLD)" in header
    # the page: ready, done, then done and ready per set, then the sets' own counters (pushes, reads) and epoch
    # snapshots (3+ ranks), all before the fault block; the C side asserts its layout and fo_gather_args's size and
    # slot_set's offset
    sets, most = gather_start.SLOT_SETS, gather_protocol.MAX_WORLD
    assert (3 + 2 * sets) * most + 3 * sets + 2 + gather_protocol.MAX_PIECES <= gather_protocol.FLAG_INTS
    assert f"#define FO_SCATTER_MAX_PIECES {gather_protocol.MAX_PIECES}\n" in header
    source = (HEADER.parent / "gather_protocol.hpp").read_text()
    chain = ["kSetDone = 2 * kMaxWorld;", "kSetReady = kSetDone + kSlotSets * kMaxWorld;",
             "kSetUses = kSetReady + kSlotSets * kMaxWorld;", "kSetReads = kSetUses + kSlotSets;",
             "kSetEpoch = kSetReads + kSlotSets;", "kPieceReady = kSetEpoch + kSlotSets;",
             "kPieceSent = kPieceReady + kMaxWorld;", "kPieceRecv = kPieceSent + 1;", "kPieceSrc = kPieceRecv + 1;",
             "static_assert(kPieceSrc + kMaxPieces <= FO_GATHER_FLAG_INTS"]
    assert all(f in source for f in chain), [f for f in chain if f not in source]
    size = re.search(r"sizeof\(fo_gather_args\) == (\d+) && offsetof\(fo_gather_args, slot_set\) == (\d+)", source)
    assert size and (ctypes.sizeof(gather_protocol.GatherArgs), gather_protocol.GatherArgs.slot_set.offset) == (
        int(size.group(1)), int(size.group(2)))
    start = header.index("typedef struct {", header.index("#define FO_GATHER_PUSH"))
    body = re.sub(r"/\*.*?\*/", "", header[start:header.index("} fo_gather_args;")], flags=re.S)
    names = [m for decl in body[len("typedef struct {"):].split(";") if decl.strip()
             for m in re.findall(r"\**(\w+)(?:\[\w+\])?\s*(?:,|$)", decl.strip())]
    assert names == [f for f, _ in gather_protocol.GatherArgs._fields_]


@pytest.mark.parametrize("start, world, on, expect", [
    ("push", 3, True, True), ("push", 4, True, True), ("push", 2, True, False), ("push", 4, False, False),
    ("auto", 4, True, False), ("handshake", 4, True, False)])
def test_copy_notify_is_an_opt_in_of_push_on_three_or_more_ranks(monkeypatch, start, world, on, expect):
    """``FO_GATHER_COPY_NOTIFY`` (correct on 4 H200s, no faster: 33rd session) is set only for a push call of 3+
    ranks under the experiment ``gather_copy_notify``; "auto" on 3+ ranks takes the handshake start, so never it."""
    monkeypatch.setattr(gather_peer, "group_issue", lambda g: None)
    monkeypatch.setattr(gather_peer.compat, "group_timeout_ms", lambda g: 1000.0)
    settings = config.current().replace(gather_start=start)
    if on:
        settings = settings.replace(experiments=frozenset({gather_start.COPY_NOTIFY_EXPERIMENT}))
    rows, k = 64, 256
    call = routes.Call("all_gather", world * rows, 128, k, torch.float32, world, 0, "cuda", None, "auto",
                       group_name="g")
    ctx = SimpleNamespace(a=torch.zeros(rows, k), b=[torch.zeros(k, 128)], bias=[None], group=None,
                          gather_dim=0, return_gathered=False)
    launch = gather_peer.make_launch(call, settings, ctx)
    assert bool(launch.options & gather_start.COPY_NOTIFY) == expect
    assert ("told by copy engine" in launch.description) == expect


@pytest.mark.parametrize("setting, world, cap_mb, start", [
    ("auto", 2, None, "push"), ("auto", 2, 1, "handshake"), ("auto", 2, 0, "handshake"),
    ("auto", 3, None, "handshake"), ("auto", 4, None, "handshake"), ("push", 4, None, "push"),
    ("push", 4, 2, "handshake"), ("handshake", 2, None, "handshake"), ("eager", 4, None, "eager")])
def test_the_start_each_call_takes(monkeypatch, setting, world, cap_mb, start):
    """``gather_start`` defaults to "auto": "push" on 2 ranks, "handshake" on more (``PUSH_AUTO_MAX_WORLD``); a push
    call whose receive buffer (``SLOT_SETS`` x world x shard bytes) would pass ``gather_push_max_mb`` starts with
    the handshake instead; a start set by name is kept otherwise. The launch says why where it changed."""
    monkeypatch.setattr(gather_peer, "group_issue", lambda g: None)
    monkeypatch.setattr(gather_peer.compat, "group_timeout_ms", lambda g: 1000.0)
    assert config.Settings().tuning.gather_start == "auto" and gather_start.PUSH_AUTO_MAX_WORLD == 2
    settings = config.current().replace(gather_start=setting)
    if cap_mb is not None:
        settings = settings.replace(gather_push_max_mb=cap_mb)
    rows, k = 128, 1024  # 512 KiB fp32 shards: 2 x world x 512 KiB of receive buffer (2 MiB on 2 ranks, 4 on 4)
    call = routes.Call("all_gather", world * rows, 512, k, torch.float32, world, 0, "cuda", None, "auto",
                       group_name="g")
    ctx = SimpleNamespace(a=torch.zeros(rows, k), b=[torch.zeros(k, 512)], bias=[None], group=None,
                          gather_dim=0, return_gathered=False)
    launch = gather_peer.make_launch(call, settings, ctx)
    assert launch.options == gather_start.OPTIONS[start]
    shard = rows * k * 4
    assert launch.buffer_bytes == (gather_start.SLOT_SETS * world * shard if start == "push" else shard)
    changed = start != setting and not (setting == "auto" and start == "push")
    assert ("handshake start" in launch.description) == changed
