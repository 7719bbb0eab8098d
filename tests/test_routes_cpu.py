"""The route registry and the routes' host side without a GPU: which route takes which call (``unsupported``,
``select``, the pass's prediction), the dispatcher's rules (memo, capture rule, fallback, a toy route added with one
registry line), the argument structs against the C header, what ``execute`` hands to the library, and the
workspaces. The kernels are covered by tests/test_gpu_peer.py and tests/test_gpu_ring.py on GPUs."""

from __future__ import annotations

import ctypes
import re
import types
from pathlib import Path

import pytest
import torch

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.routes import peer, ring
from flashoverlap_inductor.runtime import streams

BF16 = torch.bfloat16
HEADER = Path(peer.__file__).resolve().parents[2] / "csrc" / "flashoverlap_sm90.h"


def _info(name, tile_m, tile_n, cluster_m, variants=(("bfloat16", "nk"),)):
    return kernels.KernelInfo(name, tile_m, tile_n, 64, cluster_m, 1, "cooperative", 0, 0, 0, tuple(variants))


@pytest.fixture
def library(monkeypatch):
    """A kernel library with one plain, one _addc and one _addc_aux configuration for bf16 with B as [N, K]."""
    plain = _info("coop_128x256x64_c2x1_e128x64", 128, 256, 2)
    add = _info("coop_128x256x64_c2x1_e128x64_addc", 128, 256, 2)
    aux = _info("coop_128x256x64_c2x1_e128x32_addc_aux", 128, 256, 2)
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(kernels, "configs", lambda add_c=0: {0: [plain], 1: [add], 2: [aux]}.get(int(add_c), []))
    return plain, add, aux


def _call(collective="all_reduce", rows=4096, world=2, dtype=BF16, layout="nk", **kw):
    return routes.Call(collective, rows, 1024, 512, dtype, world, 0, "cuda", layout, **kw)


def test_select_takes_the_first_route_that_takes_the_call(library):
    s = config.Settings()
    assert routes.select(_call(), s).name == "peer"
    big = routes.Call("reduce_scatter", 16384, 8192, 7168, BF16, 2, 0, "cuda", "nk")
    assert routes.select(big, s).name == "scatter_pull"  # auto: its GPU + host cost within the tolerance
    mid = routes.Call("reduce_scatter", 4096, 4096, 7168, BF16, 2, 0, "cuda", "nk")
    assert routes.select(mid, s).name == "peer"  # its GPU edge smaller than the host time it adds
    assert routes.select(mid, s.replace(host_floors="off")).name == "scatter_pull"  # GPU times alone
    assert routes.select(_call("reduce_scatter"), s).name == "peer"  # auto: the pull route's host floor is longer
    assert routes.select(_call("reduce_scatter"), s.replace(scatter_route="peer")).name == "peer"
    assert routes.select(_call("reduce_scatter", world=4), s).name == "nccl"  # the pull route is for 2 ranks
    assert routes.select(_call("all_to_all"), s).name == "nccl"
    assert routes.select(_call(world=4), s).name == "nccl"  # the ring is opt-in
    assert routes.select(_call(world=4), s.replace(ring="wide")).name == "ring"
    assert routes.select(_call(world=2), s.replace(ring="wide")).name == "peer"
    assert routes.select(_call(world=2), s.replace(ring="all")).name == "ring"
    assert routes.select(_call(rows=4095), s).name == "nccl"  # odd rows: no halves
    assert routes.select(_call(dtype=torch.float16), s).name == "nccl"  # no fp16 _addc configuration
    assert routes.select(_call(layout=None), s).name == "nccl"  # B's strides: no layout the _addc kernels read
    assert routes.select(_call(), s.replace(transport="nccl")).name == "nccl"
    assert routes.select(_call(operand_issue=("dtype", "fp32")), s).name == "unfused"
    assert routes.select(_call(dtype=torch.float32), s).name == "unfused"
    cpu = routes.Call("all_reduce", 4096, 1024, 512, BF16, 2, device="cpu")
    assert routes.select(cpu, s).name == "cpu"


def test_without_the_library_every_cuda_call_runs_unfused(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert [r.name for r in routes.candidates(_call(), config.Settings())] == ["unfused"]
    assert routes.select(_call(compile_time=True), config.Settings()).name == "unfused"


def test_the_pass_predicts_the_route_the_registry_selects(library):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashoverlap_inductor.passes import gemm_collective

    with FakeTensorMode():
        y_cuda = torch.empty(4, 4, device="cuda")
    s = config.Settings()
    args = ("all_reduce", 4096, 1024, 512, "bfloat16")
    none = {"peer": False, "ring_rounds": 0, "pull": False}
    assert gemm_collective._route_of(*args, 2, y_cuda, s) == {**none, "peer": True}
    assert gemm_collective._route_of(*args, 2, torch.empty(4, 4), s) == none
    assert gemm_collective._route_of(*args, 4, y_cuda, s) == none
    assert gemm_collective._route_of(*args, 4, y_cuda, s.replace(ring="wide")) == {**none, "ring_rounds": 2}
    rs = ("reduce_scatter", 16384, 8192, 7168, "bfloat16", 2, y_cuda)
    assert gemm_collective._route_of(*rs, s) == {**none, "pull": True}  # auto: the pull route's model within reach
    mid = ("reduce_scatter", 4096, 4096, 7168, "bfloat16", 2, y_cuda)
    assert gemm_collective._route_of(*mid, s) == {**none, "peer": True}  # auto: the host time it adds
    assert gemm_collective._route_of(*rs, s.replace(scatter_route="peer")) == {**none, "peer": True}
    small = ("reduce_scatter", *args[1:], 2, y_cuda)
    assert gemm_collective._route_of(*small, s) == {**none, "peer": True}  # auto: the pull route's host floor
    assert gemm_collective._route_of(*args, 4, y_cuda, s.replace(ring="wide", ring_rounds=1))["ring_rounds"] == 1


def test_ring_rounds_cut_equal_pieces_of_at_least_one_tile_row():
    assert ring.rounds_for("all_reduce", 8192, 4, 2) == 2  # 1024-row pieces
    assert ring.rounds_for("reduce_scatter", 8192, 4, 2) == 1  # no gather to overlap
    assert ring.rounds_for("all_reduce", 1000, 2, 2) == 2  # 250-row pieces (not tile multiples)
    assert ring.rounds_for("all_reduce", 768, 4, 2) == 1  # 96-row pieces in 2 rounds: too small
    assert ring.rounds_for("all_reduce", 1026, 4, 2) is None  # not divisible by 4
    assert ring.rounds_for("reduce_scatter", 256, 4, 2) is None  # 64 rows per rank


class _ToyRoute:
    """A route that declines odd rows and fails its first execute (a workspace that cannot grow, say)."""

    name = "toy"
    devices = ("cpu",)
    collectives = ("all_reduce",)
    last_resort = False

    def __init__(self):
        self.made, self.ran, self.fail_next = 0, 0, True

    def unsupported(self, call, settings):
        return "odd rows" if call.rows % 2 else None

    def make_launch(self, call, settings, ctx):
        self.made += 1
        return {"collective": call.collective}

    def execute(self, launch, ctx):
        if self.fail_next:
            self.fail_next = False
            return "busy: try the next route"
        self.ran += 1
        return torch.full(ctx.out_shape, 7.0)

    def reset(self):
        self.made = self.ran = 0


def test_a_toy_route_is_one_registry_line_and_the_dispatcher_owns_memo_fallback_and_capture(monkeypatch):
    toy = _ToyRoute()
    monkeypatch.setattr(routes, "REGISTRY", [toy, *routes.REGISTRY])  # the one line that adds a route
    routes.reset()
    group = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0, group_name="toy")
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None, async_op=False: types.SimpleNamespace(
        wait=lambda: None))
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    out = routes.dispatch("all_reduce", a, b, None, group, "auto", "", [8, 6])  # toy declines once: the CPU route
    torch.testing.assert_close(out, a @ b)
    assert routes.stats["skip:toy:busy"] == 1 and toy.made == 1
    out = routes.dispatch("all_reduce", a, b, None, group, "auto", "", [8, 6])
    assert toy.ran == 1 and toy.made == 1 and bool((out == 7).all())  # memoized launch
    assert routes.stats["route:toy"] == 1 and routes.stats["fused:all_reduce"] == 1
    odd = torch.randn(7, 4)
    torch.testing.assert_close(routes.dispatch("all_reduce", odd, b, None, group, "auto", "", [7, 6]), odd @ b)
    assert toy.made == 1  # unsupported: never asked for a launch
    monkeypatch.setattr(routes, "_capturing", lambda a: True)  # inside a CUDA-graph capture:
    torch.testing.assert_close(routes.dispatch("all_reduce", a, b, None, group, "auto", "", [8, 6]), b.new_full(
        (8, 6), 7.0))  # a launch made before the capture runs
    new = torch.randn(10, 4)  # a new call shape: no launch is made in a capture; the last resort runs it
    torch.testing.assert_close(routes.dispatch("all_reduce", new, b, None, group, "auto", "", [10, 6]), new @ b)
    assert toy.made == 1 and routes.stats["skip:toy:capture-new"] == 1 and routes.stats["captured:toy"] == 1
    monkeypatch.setattr(routes, "_capturing", lambda a: False)
    with config.patch(swizzle=8):  # an eager call (settings "") under other settings: a launch of its own
        routes.dispatch("all_reduce", a, b, None, group, "auto", "", [8, 6])
    assert toy.made == 2
    routes.reset()
    assert toy.made == 0 and not routes.stats


def test_b_layout_reads_strides_never_the_pointer():
    """A misaligned B (a view at an odd element offset) has the layout its strides say on every rank; the route
    copies it per call instead (``routes.nccl.kernel_b``)."""
    from flashoverlap_inductor.runtime import kernel_select

    w = torch.randn(64 * 32 + 1)[1:].view(64, 32)  # 4 bytes past an aligned address
    assert w.data_ptr() % 16
    assert kernel_select.b_layout(w.t()) == "nk" and kernel_select.b_layout(w) == "kn"
    assert kernel_select.b_layout(torch.randn(64, 64)[:, ::2]) is None


def test_settings_reach_the_route_from_the_op_argument(library):
    key = config.Settings().replace(ring="wide", ring_rounds=1).key()
    s = config.from_key(key)
    assert s.ring == "wide" and s.tuning.ring_rounds == 1 and config.from_key(key) is s  # memoized
    assert config.from_key("") == config.current()


def test_peer_args_struct_matches_the_c_header():
    """Every field of ``fo_peer_args`` (csrc/flashoverlap_sm90.h) in order, so the ctypes mirror cannot drift."""
    header = HEADER.read_text()
    body = header[header.index("typedef struct {", header.index("FO_PEER_MAX_GROUPS")):]
    body = re.sub(r"/\*.*?\*/", "", body[:body.index("} fo_peer_args;")], flags=re.S)
    names = [n for decl in body.split(";") for n in re.findall(r"(\w+(?:\[\w+\])?)\s*(?:,|$)", decl.strip())
             if decl.strip()]
    ours = [f if not hasattr(t, "_length_") else f"{f}[FO_PEER_PROBE_EVENTS]" for f, t in peer.PeerArgs._fields_]
    assert names == ours
    assert ctypes.sizeof(peer.PeerArgs) % 8 == 0


def test_peer_args_layout_matches_the_static_asserts_and_probe_indices():
    """The offsets and size that csrc/peer_call.cu asserts at compile time (nvcc checks the C side) are the ctypes
    mirror's, and the probe indices are the header's ``FO_PEER_PROBE_*``."""
    source = (HEADER.parent / "peer_call.cu").read_text()
    offsets = dict(re.findall(r"static_assert\(offsetof\(fo_peer_args, (\w+)\) == (\d+)", source))
    assert set(offsets) == {"launch_id", "probe_events"}
    for name, offset in offsets.items():
        assert getattr(peer.PeerArgs, name).offset == int(offset)
    size = re.search(r"static_assert\(sizeof\(fo_peer_args\) == (\d+)", source)
    assert size and ctypes.sizeof(peer.PeerArgs) == int(size.group(1))
    defines = dict(re.findall(r"#define FO_PEER_PROBE_(\w+) (\d+)\n", HEADER.read_text()))
    assert {k.lower(): int(v) for k, v in defines.items() if k not in ("PULL", "GROUPS")} == peer.PROBE_CUR
    assert (int(defines["PULL"]), int(defines["GROUPS"])) == (peer.PROBE_PULL, peer.PROBE_GROUPS)
    assert peer.PROBE_EVENTS == len(peer.PeerArgs().probe_events) == peer.PROBE_PULL + 2 * peer.PROBE_GROUPS
    assert "#define FO_PEER_PROBE_SIDE (FO_PEER_PROBE_PULL + FO_PEER_PROBE_GROUPS)" in HEADER.read_text()


def test_ring_args_struct_matches_the_c_header():
    header = HEADER.read_text()
    assert f"#define FO_RING_MAX_WORLD {ring.MAX_WORLD}\n" in header
    assert f"#define FO_RING_FLAGS {ring.FLAG_INTS}\n" in header
    body = header[header.index("typedef struct {", header.index("#define FO_RING_FLAGS")):]
    body = re.sub(r"/\*.*?\*/", "", body[:body.index("} fo_ring_args;")], flags=re.S)
    names = [m for decl in body.split(";") if decl.strip()
             for m in re.findall(r"(\w+(?:\[\w+\])?)\s*(?:,|$)", decl.strip())]
    ours = [f if not hasattr(t, "_length_") else f"{f}[FO_RING_MAX_WORLD]" for f, t in ring.RingArgs._fields_]
    assert names == ours
    assert ctypes.sizeof(ring.RingArgs) % 8 == 0


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
    made_streams = iter(range(100, 200))
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: types.SimpleNamespace(cuda_stream=next(made_streams)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=3))


def _record_peer_calls(monkeypatch) -> list:
    """A fake kernel library whose ``fo_peer_call`` appends a copy of its ``PeerArgs`` to the returned list (and
    succeeds); the peer route's memo reset."""
    seen: list = []

    class Lib:
        def fo_peer_call(self, ref):
            seen.append(peer.PeerArgs.from_buffer_copy(ref._obj))
            return 0

    monkeypatch.setattr(kernels, "library", lambda: Lib())
    monkeypatch.setattr(kernels, "check", lambda rc, what: None)
    peer.ROUTE.reset()
    return seen


def _ctx(group, rows, n, k, out_rows):
    a, b = torch.randn(rows, k), torch.randn(n, k).t()
    res = types.SimpleNamespace(counters=[torch.zeros(4, dtype=torch.int32)], record=torch.zeros(4),
                                side=types.SimpleNamespace(cuda_stream=5), slot=lambda stream, dedicated=False: 0)
    opnd = types.SimpleNamespace(a=a, b=b, bias=None)
    return routes.Context(a, b, None, group, [rows, n], [out_rows, n], "auto", config.Settings(), opnd, res)


def test_peer_execute_pushes_gemm1_to_the_peer_and_fills_only_the_calls_pointers(monkeypatch):
    made: list[int] = []
    _fake_symmetric(monkeypatch, made)
    seen = _record_peer_calls(monkeypatch)
    group = types.SimpleNamespace(group_name="g", rank=lambda: 0, size=lambda: 2)
    rows, n, k = 64, 32, 16
    t = peer.PeerArgs()
    t.n, t.side_stream = n, 5
    choice = types.SimpleNamespace(b_layout="nk", convert_b=False)
    for collective, out_rows in (("all_reduce", rows), ("reduce_scatter", rows // 2)):
        launch = peer.PeerLaunch(collective, choice, rows // 2, 0, None, None, None, None, rows // 2 * n * 4, "t",
                                 collective == "all_reduce", peer.PeerArgs.from_buffer_copy(t))
        ctx = _ctx(group, rows, n, k, out_rows)
        out = peer.ROUTE.execute(launch, ctx)
        p = seen[-1]
        ws = peer._workspaces[(None, "g")][0]
        partial, own, peer_partial, peer_own = ws.regions()
        assert (p.partial, p.peer_partial) == (peer_partial, partial)  # GEMM 1 -> the peer's memory; C from ours
        assert (p.a, p.b, p.out, p.cur_stream, p.side_stream) == (ctx.a.data_ptr(), ctx.b.data_ptr(),
                                                                  out.data_ptr(), 3, 5)
        assert (p.flags, p.peer_flags) == (ws.flags.buf.data_ptr(), ws.flags.peer_base)
        assert p.fault == ws.flags.buf.data_ptr() + peer.FAULT_OFFSET and p.mirror == ws.flags.fault.mirror_ptr
        assert ws.flags.fault.peers == [ws.flags.peer_base + peer.FAULT_OFFSET]  # a timeout also writes the peer's
        if collective == "all_reduce":  # GEMM 2 lands in the peer's own buffer; this rank copies its landing buffer
            assert (p.peer_own, p.own_dst) == (peer_own, own)
        else:
            assert p.own_dst == out.data_ptr()
        assert len(launch.args) == 1  # the workspace's args are made once per launch
    peer.ROUTE.reset()


class _Probe:
    """A ``runtime.probe.CallProbe`` stand-in: events as handles 1000, 1001, ... and the marks' names."""

    def __init__(self):
        self.handles = iter(range(1000, 2000))
        self.events: dict[str, tuple[int, str]] = {}
        self.marks: list[str] = []

    def events_for(self, names, lane):
        out = [types.SimpleNamespace(cuda_event=next(self.handles)) for _ in names]
        self.events.update({n: (e.cuda_event, lane) for n, e in zip(names, out, strict=True)})
        return out

    def mark(self, name, stream, lane="compute"):
        self.marks.append(name)


@pytest.mark.parametrize("how", ["reduce_scatter", "push", "pull"])
def test_peer_probe_events_reach_the_struct_for_the_probed_call_only(monkeypatch, how):
    """A probed call gets the probe's events at its points' indices (``probe_points``) and the start / end marks;
    the memoized struct holds none before or after it."""
    _fake_symmetric(monkeypatch, [])
    seen = _record_peer_calls(monkeypatch)
    group = types.SimpleNamespace(group_name="g", rank=lambda: 0, size=lambda: 2)
    rows, n, k = 64, 32, 16
    collective = "reduce_scatter" if how == "reduce_scatter" else "all_reduce"
    groups = 10 if how == "pull" else 0  # more than PROBE_GROUPS: the later ones record none
    t = peer.PeerArgs()
    t.n = n
    choice = types.SimpleNamespace(b_layout="nk", convert_b=False)
    launch = peer.PeerLaunch(collective, choice, rows // 2, groups, None, None, None, None, rows // 2 * n * 4, "t",
                             how == "push", peer.PeerArgs.from_buffer_copy(t))
    ctx = _ctx(group, rows, n, k, rows if collective == "all_reduce" else rows // 2)
    peer.ROUTE.execute(launch, ctx)
    ctx.probe = probe = _Probe()
    peer.ROUTE.execute(launch, ctx)
    ctx.probe = None
    peer.ROUTE.execute(launch, ctx)
    assert all(not any(p.probe_events) for p in (seen[0], seen[2]))
    assert probe.marks == ["start", "end"]
    points = peer.probe_points(launch)
    got = {i: h for i, h in enumerate(seen[1].probe_events) if h}
    assert got == {i: probe.events[name][0] for i, name, _ in points}
    names = [name for _, name, _ in points]
    assert names[:3] == ["gemm1", "notify", "gemm2"]
    assert names[3] == ("join" if how == "pull" else "exchange")
    assert ("copy" in names) == (how == "push")
    pulls = [i for i, name, lane in points if lane == "pull"]
    assert pulls == ([peer.PROBE_PULL + g for g in range(peer.PROBE_GROUPS)] if how == "pull" else [])
    assert all(probe.events[name][1] == lane for _, name, lane in points)
    peer.ROUTE.reset()


def test_peer_probe_events_are_cleared_when_the_probed_call_raises(monkeypatch):
    """A probe whose end mark raises must not leave its (soon freed) events in the memoized struct: the next plain
    call records none."""
    _fake_symmetric(monkeypatch, [])
    seen = _record_peer_calls(monkeypatch)
    class Failing(_Probe):
        def mark(self, name, stream, lane="compute"):
            if name == "end":
                raise RuntimeError("mark failed")
            super().mark(name, stream, lane)

    group = types.SimpleNamespace(group_name="g", rank=lambda: 0, size=lambda: 2)
    rows, n, k = 64, 32, 16
    t = peer.PeerArgs()
    t.n = n
    choice = types.SimpleNamespace(b_layout="nk", convert_b=False)
    launch = peer.PeerLaunch("reduce_scatter", choice, rows // 2, 0, None, None, None, None, rows // 2 * n * 4, "t",
                             False, peer.PeerArgs.from_buffer_copy(t))
    ctx = _ctx(group, rows, n, k, rows // 2)
    ctx.probe = Failing()
    with pytest.raises(RuntimeError, match="mark failed"):
        peer.ROUTE.execute(launch, ctx)
    ctx.probe = None
    peer.ROUTE.execute(launch, ctx)
    assert any(seen[0].probe_events) and not any(seen[1].probe_events)
    peer.ROUTE.reset()


def test_workspaces_grow_outside_captures_only_and_are_kept():
    made = []

    def make(capacity):
        made.append(capacity)
        return types.SimpleNamespace(capacity=capacity)

    from flashoverlap_inductor.routes import symmetric

    kept: list = []
    mib = 1 << 20
    ws1 = symmetric.smallest_with_room(kept, 1000, False, make)
    assert ws1.capacity == mib and symmetric.smallest_with_room(kept, mib, False, make) is ws1
    assert symmetric.smallest_with_room(kept, 3 * mib, True, make) is None and made == [mib]
    ws2 = symmetric.smallest_with_room(kept, 3 * mib, False, make)
    assert ws2.capacity == 4 * mib and symmetric.smallest_with_room(kept, 1000, False, make) is ws1


def test_ring_step_configs_fill_the_sms_with_matching_plain_configurations(monkeypatch):
    big_add = _info("coop_128x256x64_c2x1_e128x64_addc", 128, 256, 2)
    small_add = _info("coop_128x128x64_c2x1_addc", 128, 128, 2)
    big = _info("coop_128x256x64_c2x1_e128x64", 128, 256, 2)
    small_c1, small_c2 = _info("pp_128x128x64_c1x1", 128, 128, 1), _info("coop_128x128x64_c2x1", 128, 128, 2)
    wide = _info("coop_256x128x64_c1x1", 256, 128, 1)
    monkeypatch.setattr(kernels, "configs", lambda add_c=0: [small_add, big_add] if add_c == 1 else
                        [small_c1, small_c2, big, wide])
    assert ring.step_configs(big, "bfloat16", "nk", 1024, 8192, 132) == (big, big_add)
    assert ring.step_configs(big, "bfloat16", "nk", 256, 8192, 132) == (small_c2, small_add)  # same cluster
    assert ring.step_configs(wide, "bfloat16", "nk", 1024, 8192, 132) == (big, big_add)
    with pytest.raises(ValueError, match="no _addc configuration"):
        ring.step_configs(big, "bfloat16", "kn", 256, 8192, 132)
    named = "coop_128x256x64_c2x1_e128x64_addc"
    assert ring.step_configs(big, "bfloat16", "nk", 256, 8192, 132, named) == (big, big_add)  # named: kept


def test_ring_execute_passes_every_ranks_buffers(monkeypatch):
    made: list[int] = []
    _fake_symmetric(monkeypatch, made)
    ring.ROUTE.reset()
    world, mib = 4, 1 << 20
    group = types.SimpleNamespace(group_name="g", rank=lambda: 1, size=lambda: world)
    seen = {}

    class Lib:
        def fo_ring_call(self, ref):
            seen["p"] = ring.RingArgs.from_buffer_copy(ref._obj)
            return 0

    monkeypatch.setattr(kernels, "library", lambda: Lib())
    monkeypatch.setattr(kernels, "check", lambda rc, what: None)
    rows, n, k = 512, 64, 32
    t = ring.RingArgs()
    t.n, t.swizzle, t.side_stream = n, 2, 5
    choice = types.SimpleNamespace(b_layout="nk", convert_b=False)
    launch = ring.RingLaunch("all_reduce", choice, rows // (world * 2), 2, world, 3 * mib, None, "t", t)
    out = ring.ROUTE.execute(launch, _ctx(group, rows, n, k, rows))
    ws = ring._workspaces[(None, "g")][0]
    assert made == [ring.FLAG_BYTES, 4 * mib] and len(ws.views) == world and len(ws.flags.pulls) == world - 1
    p = seen["p"]
    assert list(p.buffers)[:world] == [v.data_ptr() for v in ws.views]
    assert list(p.flags)[:world] == [v.data_ptr() for v in ws.flags.views]
    assert list(p.pull_streams)[:world - 1] == [s.cuda_stream for s in ws.flags.pulls]
    assert (p.cur_stream, p.side_stream, p.out, p.expected) == (3, 5, out.data_ptr(), ws.flags.expected.data_ptr())
    assert p.swizzle == 2  # the launch's (unpadded) swizzle
    ring.ROUTE.reset()
    assert not ring._workspaces and not ring._flags


def test_unpadded_swizzle_keeps_cutlass_from_padding_the_tile_grid():
    u = kernels.unpadded_swizzle
    assert [u(m, 8192, 128, 256, 2, 1, 4) for m in (128, 256, 512, 1000, 1024, 2048)] == [1, 1, 2, 4, 4, 4]
    assert u(512, 8192, 128, 256, 1, 1, 4) == 4
    assert u(8192, 768, 128, 256, 1, 2, 4) == 2
    assert u(5120, 8192, 128, 256, 1, 1, 8) == 8 and u(4992, 8192, 128, 256, 1, 1, 8) == 1


def test_abi_version_matches_the_library_source():
    """``native.kernels.ABI_VERSION`` is the number ``fo_abi_version`` returns (``csrc/api.cu``): a library built
    from other sources is refused at load, never called with structs of another layout."""
    from flashoverlap_inductor.native import kernels

    source = (HEADER.parent / "api.cu").read_text()
    found = re.search(r"int fo_abi_version\(void\) \{ return (\d+); \}", source)
    assert found and int(found.group(1)) == kernels.ABI_VERSION
