"""The ring route's host side without a GPU: the argument struct against the C header, the settings, which calls
take the ring (``enabled``, ``rounds_for``, ``unsupported``), the flag area's bound, what ``execute`` hands to
``fo_ring_call`` and the workspaces. The kernels are covered by tests/test_gpu_ring.py on two GPUs."""

from __future__ import annotations

import ctypes
import re
import types
from pathlib import Path

import pytest
import torch

from flashoverlap_inductor import kernels, peer_route, ring_route, streams

BF16 = torch.bfloat16


def _addc(*variants):
    return [kernels.KernelInfo("coop_128x256x64_c2x1_e128x64_addc", 128, 256, 64, 2, 1, "cooperative", 0, 128, 64,
                               tuple(variants))]


def test_ring_args_struct_matches_the_c_header():
    """Every field of ``fo_ring_args`` (csrc/flashoverlap_sm90.h) in order, arrays with their length."""
    header = (Path(ring_route.__file__).resolve().parent.parent / "csrc" / "flashoverlap_sm90.h").read_text()
    assert f"#define FO_RING_MAX_WORLD {ring_route.MAX_WORLD}\n" in header
    assert f"#define FO_RING_FLAGS {ring_route.FLAG_INTS}\n" in header
    body = header[header.index("typedef struct {", header.index("#define FO_RING_FLAGS")):]
    body = re.sub(r"/\*.*?\*/", "", body[:body.index("} fo_ring_args;")], flags=re.S)
    names = [m for decl in body.split(";") if decl.strip()
             for m in re.findall(r"(\w+(?:\[\w+\])?)\s*(?:,|$)", decl.strip())]
    ours = [f if not hasattr(t, "_length_") else f"{f}[FO_RING_MAX_WORLD]" for f, t in ring_route.RingArgs._fields_]
    assert names == ours
    assert ctypes.sizeof(ring_route.RingArgs) % 8 == 0


@pytest.mark.parametrize("name,value", [("RING", "on"), ("ROUNDS", 0), ("ROUNDS", 17)])
def test_settings_outside_their_choices_raise(monkeypatch, name, value):
    ring_route.check_settings()
    monkeypatch.setattr(ring_route, name, value)
    with pytest.raises(ValueError, match=name):
        ring_route.check_settings()


def test_enabled_follows_the_setting(monkeypatch):
    for setting, worlds in (("off", []), ("wide", [3, 4, 8]), ("all", [2, 3, 4, 8])):
        monkeypatch.setattr(ring_route, "RING", setting)
        assert [w for w in (1, 2, 3, 4, 8) if ring_route.enabled(w)] == worlds, setting


def test_rounds_cut_equal_pieces_of_at_least_one_tile_row(monkeypatch):
    monkeypatch.setattr(ring_route, "ROUNDS", 2)
    assert ring_route.rounds_for("all_reduce", 8192, 4) == 2  # 1024-row pieces
    assert ring_route.rounds_for("reduce_scatter", 8192, 4) == 1  # no gather to overlap
    assert ring_route.rounds_for("all_reduce", 1000, 2) == 2  # 250-row pieces (not tile multiples)
    assert ring_route.rounds_for("all_reduce", 768, 4) == 1  # 96-row pieces in 2 rounds: too small
    assert ring_route.rounds_for("all_reduce", 1026, 4) is None  # not divisible by 4
    assert ring_route.rounds_for("reduce_scatter", 256, 4) is None  # 64 rows per rank
    monkeypatch.setattr(ring_route, "ROUNDS", 4)
    assert ring_route.rounds_for("all_reduce", 8192, 4) == 4
    assert ring_route.rounds_for("all_reduce", 1536, 4) == 3  # 128-row pieces; 4 rounds would cut 96


def test_the_flag_area_holds_every_call_shape():
    for world in range(2, ring_route.MAX_WORLD + 1):
        assert ring_route.flag_count(world, ring_route.MAX_ROUNDS) <= ring_route.FLAG_INTS, world


def test_unsupported_names_the_reason(monkeypatch):
    monkeypatch.setattr(ring_route, "RING", "wide")
    add = _addc(("bfloat16", "nk"))
    assert ring_route.unsupported("all_reduce", 8192, 4, BF16, "nk", add) is None
    assert ring_route.unsupported("reduce_scatter", 8192, 8, BF16, "nk", add) is None
    assert "no ring route" in ring_route.unsupported("all_to_all", 8192, 4, BF16, "nk", add)
    assert "off for 2 ranks" in ring_route.unsupported("all_reduce", 8192, 2, BF16, "nk", add)
    assert "world size 16" in ring_route.unsupported("all_reduce", 8192, 16, BF16, "nk", add)
    assert "equal pieces" in ring_route.unsupported("all_reduce", 1026, 4, BF16, "nk", add)
    assert "_addc" in ring_route.unsupported("all_reduce", 8192, 4, torch.float16, "nk", add)
    assert "_addc" in ring_route.unsupported("all_reduce", 8192, 4, BF16, "kn", add)


def test_ring_calls_are_predicted_on_the_ring_not_the_peer_route(monkeypatch):
    monkeypatch.setattr(peer_route, "TRANSPORT", "peer")
    monkeypatch.setattr(kernels, "configs", lambda add_c=0: _addc(("bfloat16", "nk")))
    monkeypatch.setattr(ring_route, "RING", "off")
    monkeypatch.setattr(ring_route, "ROUNDS", 2)
    assert peer_route.takes("all_reduce", 4096, 1024, 512, BF16, 2)
    assert ring_route.takes("all_reduce", 4096, 1024, 512, BF16, 2) == 0
    monkeypatch.setattr(ring_route, "RING", "all")  # 2 ranks on the ring: not what the peer model describes
    assert not peer_route.takes("all_reduce", 4096, 1024, 512, BF16, 2)
    assert ring_route.takes("all_reduce", 4096, 1024, 512, BF16, 2) == 2
    monkeypatch.setattr(ring_route, "RING", "wide")
    assert ring_route.takes("all_reduce", 4096, 1024, 512, BF16, 4) == 2  # 512-row pieces
    assert ring_route.takes("all_reduce", 1024, 1024, 512, BF16, 4) == 2  # 128-row pieces
    assert ring_route.takes("all_reduce", 512, 1024, 512, BF16, 4) == 1
    assert ring_route.takes("reduce_scatter", 4096, 1024, 512, BF16, 4) == 1
    for args in (("all_to_all", 4096, 1024, 512, BF16, 4), ("all_reduce", 4096, 1024, 512, BF16, 2),
                 ("all_reduce", 4002, 1024, 512, BF16, 4), ("all_reduce", 4096, 1024, 512, torch.float16, 4)):
        assert ring_route.takes(*args) == 0, args
    monkeypatch.setattr(peer_route, "TRANSPORT", "nccl")
    assert ring_route.takes("all_reduce", 4096, 1024, 512, BF16, 4) == 0
    monkeypatch.setattr(peer_route, "TRANSPORT", "peer")

    def no_library(add_c=0):
        raise kernels.KernelLibraryError("no library")
    monkeypatch.setattr(kernels, "configs", no_library)
    assert ring_route.takes("all_reduce", 4096, 1024, 512, BF16, 4) == 0


def _info(name, tile_m, tile_n, cluster_m, variants=(("bfloat16", "nk"),)):
    return kernels.KernelInfo(name, tile_m, tile_n, 64, cluster_m, 1, "cooperative", 0, 0, 0, tuple(variants))


def test_step_configs_fill_the_sms_with_matching_plain_configurations(monkeypatch):
    big_add = _info("coop_128x256x64_c2x1_e128x64_addc", 128, 256, 2)
    small_add = _info("coop_128x128x64_c2x1_addc", 128, 128, 2)
    big = _info("coop_128x256x64_c2x1_e128x64", 128, 256, 2)
    small_c1, small_c2 = _info("pp_128x128x64_c1x1", 128, 128, 1), _info("coop_128x128x64_c2x1", 128, 128, 2)
    wide = _info("coop_256x128x64_c1x1", 256, 128, 1)
    monkeypatch.setattr(kernels, "configs", lambda add_c=0: [small_add, big_add] if add_c == 1 else
                        [small_c1, small_c2, big, wide])
    monkeypatch.setattr(peer_route, "ADD_KERNEL", None)
    assert ring_route.step_configs(big, "bfloat16", "nk", 1024, 8192, 132) == (big, big_add)
    assert ring_route.step_configs(big, "bfloat16", "nk", 256, 8192, 132) == (small_c2, small_add)  # same cluster
    assert ring_route.step_configs(wide, "bfloat16", "nk", 1024, 8192, 132) == (big, big_add)
    with pytest.raises(ValueError, match="no _addc configuration"):  # (``unsupported`` turns these calls away)
        ring_route.step_configs(big, "bfloat16", "kn", 256, 8192, 132)
    monkeypatch.setattr(peer_route, "ADD_KERNEL", "coop_128x256x64_c2x1_e128x64_addc")
    assert ring_route.step_configs(big, "bfloat16", "nk", 256, 8192, 132) == (big, big_add)  # named: kept


def _fake_symmetric(monkeypatch, made: list):
    def symm_empty(nbytes, dtype, device):
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=dtype)

    fake = types.SimpleNamespace(
        empty=symm_empty,
        rendezvous=lambda buf, name: types.SimpleNamespace(
            get_buffer=lambda rank, shape, dtype: torch.zeros(shape, dtype=dtype) + rank))
    monkeypatch.setitem(__import__("sys").modules, "torch.distributed._symmetric_memory", fake)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", fake, raising=False)
    monkeypatch.setattr(streams, "persistent", lambda index, make: make())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    streams_made = iter(range(100, 200))
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: types.SimpleNamespace(cuda_stream=next(streams_made)))


def test_workspaces_map_every_rank_and_execute_passes_them(monkeypatch):
    made: list[int] = []
    _fake_symmetric(monkeypatch, made)
    peer_route.reset()
    world, mib = 4, 1 << 20
    group, dev = types.SimpleNamespace(group_name="g", rank=lambda: 1, size=lambda: world), torch.device("cpu")
    ws = ring_route.workspace(group, dev, 3 * mib)
    assert made == [ring_route.FLAG_BYTES, 4 * mib] and len(ws.views) == world and len(ws.flags.pulls) == world - 1
    assert ring_route.workspace(group, dev, mib) is ws
    assert ring_route.workspace(group, dev, 5 * mib, capturing=True) is None  # no collective allocation there
    seen = {}

    class Lib:
        def fo_ring_call(self, ref):
            seen["p"] = ring_route.RingArgs.from_buffer_copy(ref._obj)
            return 0

    monkeypatch.setattr(streams, "kernel_lib", lambda: types.SimpleNamespace(lib=Lib(), check=lambda rc, what: None))
    rows, n, k = 512, 64, 32
    launch = ring_route.RingLaunch("all_reduce", rows // (world * 2), 2, world, 2, 1, 0, 132, 0, "test",
                                   ring_route.RingArgs())
    res = types.SimpleNamespace(record=torch.zeros(4), side=types.SimpleNamespace(cuda_stream=5))
    a, b = torch.randn(rows, k), torch.randn(k, n)
    out = torch.empty(rows, n)
    ring_route.execute(launch, ws, a, b, n, None, out, res, types.SimpleNamespace(cuda_stream=3), 0, 0, 1, 1000)
    p = seen["p"]
    assert list(p.buffers)[:world] == [v.data_ptr() for v in ws.views]
    assert list(p.flags)[:world] == [v.data_ptr() for v in ws.flags.views]
    assert list(p.pull_streams)[:world - 1] == [s.cuda_stream for s in ws.flags.pulls]
    assert (p.cur_stream, p.side_stream, p.out, p.expected) == (3, 5, out.data_ptr(), ws.flags.expected.data_ptr())
    assert p.swizzle == 2  # the launch's (unpadded) swizzle, not the runtime's 1 passed above
    peer_route.reset()  # drops the ring's workspaces too
    assert not ring_route._workspaces and not ring_route._flags


def test_unpadded_swizzle_keeps_cutlass_from_padding_the_tile_grid():
    """128x256 tiles in 2x1 clusters at swizzle 4: CUTLASS rounds the tile-rows up to swizzle x cluster_m, so 512
    rows (4 tile-rows) would run 8, 256 rows (2) 4 and 128 rows (1, 2 with the cluster) 4 too; 1024 rows and more
    keep swizzle 4."""
    u = kernels.unpadded_swizzle
    assert [u(m, 8192, 128, 256, 2, 1, 4) for m in (128, 256, 512, 1000, 1024, 2048)] == [1, 1, 2, 4, 4, 4]
    assert u(512, 8192, 128, 256, 1, 1, 4) == 4  # 4 tile-rows are a multiple of 4 x 1
    assert u(8192, 768, 128, 256, 1, 2, 4) == 2  # 3 tile-columns: the 1x2 cluster pads to 4 anyway, 4 x 2 to 8
    assert u(5120, 8192, 128, 256, 1, 1, 8) == 8 and u(4992, 8192, 128, 256, 1, 1, 8) == 1  # 40 and 39 tile-rows
