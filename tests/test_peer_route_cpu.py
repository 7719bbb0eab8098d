"""The peer route's host side without a GPU: the argument struct ``execute`` hands to ``fo_peer_call`` (which buffer
GEMM 1 writes and GEMM 2 reads, per ``PARTIAL``), the settings check, ``takes`` and the pass's ``_route_of``.
The kernels themselves are covered by tests/test_gpu_peer.py on two GPUs."""

from __future__ import annotations

import ctypes
import types

import pytest
import torch

from flashoverlap_inductor import kernels, peer_route, streams

# the regions of this call's set as ``Workspace.regions`` returns them: (partial, own, peer's partial, peer's own)
PARTIAL, OWN, PEER_PARTIAL, PEER_OWN = 0x10000, 0x20000, 0x30000, 0x40000


class _FakeWorkspace:
    def __init__(self) -> None:
        self.flags = types.SimpleNamespace(buf=torch.zeros(8, dtype=torch.uint8), peer_base=0x50000,
                                           expected=torch.zeros(4, dtype=torch.int32),
                                           pull=types.SimpleNamespace(cuda_stream=7))

    def regions(self):
        return PARTIAL, OWN, PEER_PARTIAL, PEER_OWN


def _run_execute(monkeypatch, collective: str, partial: str, push: bool) -> peer_route.PeerArgs:
    seen = {}

    class Lib:
        def fo_peer_call(self, ref):
            seen["p"] = peer_route.PeerArgs.from_buffer_copy(ref._obj)
            return 0

    fake = types.SimpleNamespace(lib=Lib(), check=lambda rc, what: None)
    monkeypatch.setattr(streams, "kernel_lib", lambda: fake)
    rows, n, k = 64, 32, 16
    launch = peer_route.PeerLaunch(collective, 0, 1, rows // 2, 0, rows // 2, 0, None, None, None, 132, 0, "test",
                                   push, partial, peer_route.PeerArgs())
    res = types.SimpleNamespace(counters=[torch.zeros(4, dtype=torch.int32)], record=torch.zeros(4),
                                side=types.SimpleNamespace(cuda_stream=5))
    a, b = torch.randn(rows, k), torch.randn(k, n)
    out = torch.empty(rows if collective == "all_reduce" else rows // 2, n)
    ws = _FakeWorkspace()
    peer_route.execute(launch, ws, a, b, n, None, out, res, 0, types.SimpleNamespace(cuda_stream=3), 0, 0, 1, 1000)
    assert (seen["p"].flags, seen["p"].peer_flags) == (ws.flags.buf.data_ptr(), 0x50000)
    return seen["p"]


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_partial_push_sends_gemm1_to_the_peer_and_reads_c_locally(monkeypatch, collective):
    push = collective == "all_reduce"
    p = _run_execute(monkeypatch, collective, "push", push)
    assert (p.partial, p.peer_partial) == (PEER_PARTIAL, PARTIAL)  # GEMM 1 -> the peer's memory; C from ours
    q = _run_execute(monkeypatch, collective, "pull", push)
    assert (q.partial, q.peer_partial) == (PARTIAL, PEER_PARTIAL)  # GEMM 1 -> ours; C read from the peer
    if push:  # all_reduce: GEMM 2 lands in the peer's own buffer, this rank copies its landing buffer
        assert (p.peer_own, p.own_dst) == (PEER_OWN, OWN)
    assert p.cur_stream == 3 and p.side_stream == 5 and p.pull_stream == 7


@pytest.mark.parametrize("name,value", [("PARTIAL", "pushh"), ("GATE", "kernal"), ("TRANSPORT", "p2p"),
                                        ("FINAL_COPY", "dma")])
def test_settings_outside_their_choices_raise(monkeypatch, name, value):
    peer_route.check_settings()
    monkeypatch.setattr(peer_route, name, value)
    with pytest.raises(ValueError, match=name):
        peer_route.check_settings()


def _addc(*variants):
    return [types.SimpleNamespace(name="x_addc", variants=tuple(variants))]


def test_takes_only_what_the_route_runs(monkeypatch):
    monkeypatch.setattr(peer_route, "TRANSPORT", "peer")
    monkeypatch.setattr(kernels, "configs", lambda add_c=0: _addc(("bfloat16", "nk")))
    bf16 = torch.bfloat16
    assert peer_route.takes("all_reduce", 4096, 1024, 512, bf16, 2)
    assert peer_route.takes("reduce_scatter", 4096, 1024, 512, bf16, 2)
    for args in (("all_to_all", 4096, 1024, 512, bf16, 2), ("all_reduce", 4096, 1024, 512, bf16, 4),
                 ("all_reduce", 4095, 1024, 512, bf16, 2), ("all_reduce", 4096, 1024, 512, torch.float16, 2)):
        assert not peer_route.takes(*args), args
    monkeypatch.setattr(peer_route, "TRANSPORT", "nccl")
    assert not peer_route.takes("all_reduce", 4096, 1024, 512, bf16, 2)
    monkeypatch.setattr(peer_route, "TRANSPORT", "peer")

    def no_library(add_c=0):
        raise kernels.KernelLibraryError("no library")
    monkeypatch.setattr(kernels, "configs", no_library)
    assert not peer_route.takes("all_reduce", 4096, 1024, 512, bf16, 2)


def test_the_pass_predicts_the_route_for_cuda_with_and_without_cuda_graphs(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashoverlap_inductor import _inductor_compat as compat
    from flashoverlap_inductor import ring_route
    from passes import gemm_collective

    calls = []
    monkeypatch.setattr(peer_route, "takes", lambda *args: calls.append(args) or True)
    monkeypatch.setattr(ring_route, "takes", lambda *args: 0)
    with FakeTensorMode():
        y_cuda = torch.empty(4, 4, device="cuda")
    y_cpu = torch.empty(4, 4)
    args = ("all_reduce", 4096, 1024, 512, "bfloat16", 2)
    assert gemm_collective._route_of(*args, y_cuda) == {"peer": True, "ring_rounds": 0}
    assert calls == [("all_reduce", 4096, 1024, 512, torch.bfloat16, 2)]
    assert gemm_collective._route_of(*args, y_cpu) == {"peer": False, "ring_rounds": 0}
    monkeypatch.setattr(compat, "cudagraphs_enabled", lambda: True)  # captures take the route too
    assert gemm_collective._route_of(*args, y_cuda)["peer"]
    assert len(calls) == 2
    monkeypatch.setattr(peer_route, "takes", lambda *args: False)
    monkeypatch.setattr(ring_route, "takes", lambda *args: 2)
    assert gemm_collective._route_of("all_reduce", 4096, 1024, 512, "bfloat16", 4, y_cuda) == \
        {"peer": False, "ring_rounds": 2}


def test_cudagraphs_enabled_reads_inductors_setting(monkeypatch):
    from flashoverlap_inductor import _inductor_compat as compat

    cfg = compat.inductor_config()
    monkeypatch.setattr(cfg.triton, "cudagraphs", True)
    assert compat.cudagraphs_enabled()
    monkeypatch.setattr(cfg.triton, "cudagraphs", False)
    assert not compat.cudagraphs_enabled()


def test_peer_args_struct_matches_the_c_header():
    """Every field of ``fo_peer_args`` (csrc/flashoverlap_sm90.h) in order, so the ctypes mirror cannot drift."""
    import re
    from pathlib import Path

    header = (Path(peer_route.__file__).resolve().parent.parent / "csrc" / "flashoverlap_sm90.h").read_text()
    body = header[header.index("typedef struct {", header.index("FO_PEER_MAX_GROUPS")):]
    body = body[:body.index("} fo_peer_args;")]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = [n for decl in body.split(";") for n in re.findall(r"(\w+)\s*(?:,|$)", decl.strip()) if decl.strip()]
    assert names == [f for f, _ in peer_route.PeerArgs._fields_]
    assert ctypes.sizeof(peer_route.PeerArgs) % 8 == 0


def test_workspaces_serve_every_call_of_a_shape_grow_outside_captures_and_are_kept(monkeypatch):
    """``workspace``: the same regions for every call of a shape (no host parity for a CUDA graph to freeze), no
    collective allocation inside a capture (None: the NCCL route), the smallest workspace with room (a shape keeps
    its workspace after a larger one is made, so replays and eager calls agree), one flag page for all."""
    made = []

    def persistent(index, make):
        return make()

    def symm_empty(nbytes, dtype, device):
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=dtype)

    fake_symm = types.SimpleNamespace(
        empty=symm_empty,
        rendezvous=lambda buf, name: types.SimpleNamespace(get_buffer=lambda rank, shape, dtype: buf.clone()))
    monkeypatch.setitem(__import__("sys").modules, "torch.distributed._symmetric_memory", fake_symm)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", fake_symm, raising=False)
    monkeypatch.setattr(streams, "persistent", persistent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: types.SimpleNamespace(cuda_stream=9))
    peer_route.reset()
    group, dev = types.SimpleNamespace(group_name="g", rank=lambda: 0), torch.device("cpu")
    mib = 1 << 20
    ws1 = peer_route.workspace(group, dev, 1000)
    assert made == [peer_route.FLAG_BYTES, 2 * mib] and ws1.capacity == mib
    assert ws1.flags.buf.count_nonzero() == 0  # the flag page starts zeroed
    assert peer_route.workspace(group, dev, mib) is ws1 and ws1.regions() == ws1.regions()
    partial, own, peer_partial, peer_own = ws1.regions()
    assert own - partial == mib and peer_own - peer_partial == mib
    assert peer_route.workspace(group, dev, 3 * mib, capturing=True) is None and len(made) == 2
    ws2 = peer_route.workspace(group, dev, 3 * mib)
    assert ws2.capacity == 4 * mib and made[-1] == 8 * mib and ws2.flags is ws1.flags
    assert peer_route.workspace(group, dev, 1000) is ws1  # a small shape keeps its workspace
    assert peer_route.workspace(group, dev, 2 * mib, capturing=True) is ws2
    ws3 = peer_route.workspace(group, dev, 5 * mib)
    assert ws3.capacity == 8 * mib and peer_route._workspaces[(None, "g")] == [ws1, ws2, ws3]
    assert len(made) == 4  # one flag page
    peer_route.reset()
    assert not peer_route._workspaces and not peer_route._flags
