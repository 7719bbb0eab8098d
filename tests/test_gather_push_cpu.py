"""``gather_start="push"`` of ``routes/gather_peer.py`` on the CPU: ``execute`` for every rank of a simulated group
with the library faked. The fake ``fo_gather_call`` checks what the route hands the library (the push option, a
receive buffer of ``world`` slots from the push workspace list, staging only when the gathered rows are returned)
and plays the peers' pushes: it writes each peer's shard into slot ``j`` of this rank's buffer and this rank's shard
into slot ``rank`` of every peer's buffer (where ``csrc/gather_call.cu`` copies it), then copies the slots out as the
library does under ``copy_own``. Each rank's GEMM outputs (the Python loop: fp32 takes no
library GEMMs) must be its GEMMs over the gathered rows, and the gathered rows the all_gather's."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.routes import gather_peer


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("returned", [False, True])
def test_push_execute_reads_every_shard_from_its_slot(monkeypatch, world, returned):
    gen = torch.Generator().manual_seed(11)
    rows, k, ns = 6, 16, (24, 8)  # shard rows per rank, K, the N of two GEMMs sharing the gather
    shards = [torch.randn(rows, k, generator=gen) for _ in range(world)]
    weights = [torch.randn(k, n, generator=gen) for n in ns]
    gathered = torch.cat(shards)
    shard_bytes = rows * k * 4
    buffers = [torch.zeros(world * shard_bytes, dtype=torch.uint8) for _ in range(world)]  # "symmetric" memory
    settings = config.current().replace(gather_start="push")
    asked = []

    def workspace(group, device, need, capturing=False, push=False):
        asked.append((need, push))
        return ws

    flags = SimpleNamespace(views=[torch.zeros(4) for _ in range(world)],
                            events=[SimpleNamespace(cuda_event=None) for _ in range(world)],
                            epoch=torch.zeros(1), fault=SimpleNamespace(block_ptr=None, mirror_ptr=None),
                            copy=SimpleNamespace(cuda_stream=None))
    ws = SimpleNamespace(flags=flags, views=buffers, serial=-1)
    monkeypatch.setattr(gather_peer, "group_issue", lambda g: None)
    monkeypatch.setattr(gather_peer, "workspace", workspace)
    monkeypatch.setattr(gather_peer.compat, "group_timeout_ms", lambda g: 1000.0)
    monkeypatch.setattr(gather_peer.compat, "current_raw_stream", lambda i: 0)
    monkeypatch.setattr(gather_peer.symmetric, "order_after_last", lambda g, d, s: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_event=lambda e: None))
    for rank in range(world):
        def gather_call(pp, rank=rank):
            p = pp._obj
            assert p.options == gather_peer.PUSH and p.rank == rank and p.world == world
            assert p.shard_bytes == shard_bytes and p.copy_own == int(returned)
            assert (p.staging is not None) == returned  # no staging unless the gathered rows are returned
            assert [p.buffers[j] for j in range(world)] == [b.data_ptr() for b in buffers]
            for j in range(world):  # the peers' pushes into this rank's slots, this rank's into theirs
                if j != rank:
                    ctypes.memmove(p.buffers[rank] + j * shard_bytes, shards[j].data_ptr(), shard_bytes)
                    ctypes.memmove(p.buffers[j] + rank * shard_bytes, p.a, shard_bytes)
            if p.copy_own:  # the slots and a into staging, as push_call's last step copies them
                for j in range(world):
                    src = p.a if j == rank else p.buffers[rank] + j * shard_bytes
                    ctypes.memmove(p.staging + j * shard_bytes, src, shard_bytes)
            return 0

        lib = SimpleNamespace(fo_gather_call=gather_call, fo_gather_finish=lambda pp: 0)
        monkeypatch.setattr(gather_peer.kernels, "library", lambda lib=lib: lib)
        call = routes.Call("all_gather", world * rows, sum(ns), k, torch.float32, world, rank, "cuda", None, "auto",
                           group_name="g")
        ctx = SimpleNamespace(a=shards[rank], b=weights, bias=[None] * len(ns), group=None,
                              y_shape=[world * rows, k], gather_dim=0, return_gathered=returned, capturing=False,
                              probe=None, settings=settings)
        launch = gather_peer.make_launch(call, settings, ctx)
        assert launch.options == gather_peer.PUSH and launch.gemms is None  # fp32: the Python loop
        launch.args.clear()
        outs = gather_peer.ROUTE.execute(launch, ctx)
        assert asked[-1] == (world * shard_bytes, True)  # world slots, from the push list
        assert len(outs) == len(ns) + returned
        for w, y in zip(weights, outs, strict=False):
            torch.testing.assert_close(y, gathered @ w)
        if returned:
            assert torch.equal(outs[-1], gathered)
    for j in range(world):  # every rank's shard sits in slot j of every peer's buffer
        for r in range(world):
            if r != j:
                got = buffers[r][j * shard_bytes:(j + 1) * shard_bytes].view(torch.float32).view(rows, k)
                assert torch.equal(got, shards[j])
