"""The peer and ring routes' argument structs compute the collective: every rank's real ``fo_peer_args`` /
``fo_ring_args`` (``make_launch``, ``args_for`` and ``execute``'s pointer filling, with fakes for the GPU parts) is
run through a CPU simulation of what ``fo_peer_call`` / ``fo_ring_call`` do with it, as ``csrc/flashoverlap_sm90.h``
states it (the reference here, not the routes' Python), and every rank's output must be the reduce_scatter's chunk
or the all_reduce's sum of ``A_r @ B_r`` over the ranks.

Each simulated rank has an address space of its own: its symmetric buffers at their addresses, every peer's buffer
mapped at another address (a fake ``torch.distributed._symmetric_memory``), its A, B and output. A pointer resolves
only in the space of the rank whose struct holds it, to the owner's memory and offset, so a struct that names the
wrong rank's buffer, offset or rows computes the wrong sum or reaches no memory at all. Small integer operands keep
every bf16 sum exact, so outputs are compared exactly. The kernels are covered on GPUs by tests/test_gpu_peer.py and
tests/test_gpu_ring.py."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest
import torch

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.routes import nccl, peer, ring
from flashoverlap_inductor.runtime import streams

BF16 = torch.bfloat16
N, K = 32, 16
CONFIGS = [  # (name, add_c level); the fake library's index of a configuration is its position here
    ("coop_128x256x64_c2x1_e128x64", 0),
    ("coop_128x256x64_c2x1_e128x64_addc", 1),
    ("coop_128x256x64_c2x1_e128x32_addc_aux", 2),
]
PULL = CONFIGS[1][0]  # all_reduce by pull: peer_kernel naming a plain _addc configuration


class Space:
    """One rank's address space: (base, bytes, the memory behind it (uint8), its owner rank)."""

    def __init__(self, rank: int):
        self.rank, self.regions = rank, []

    def add(self, base: int, backing: torch.Tensor, owner: int) -> None:
        self.regions.append((base, backing.numel(), backing, owner))

    def find(self, addr: int, nbytes: int) -> tuple[torch.Tensor, int]:
        for base, size, backing, owner in self.regions:
            if base <= addr and addr + nbytes <= base + size:
                return backing[addr - base:addr - base + nbytes], owner
        raise AssertionError(f"rank {self.rank}: {addr:#x} (+{nbytes} bytes) is no memory this rank can reach")

    def owner(self, addr: int) -> int:
        return self.find(addr, 1)[1]

    def mat(self, addr: int, rows: int, cols: int, ld: int) -> torch.Tensor:
        """The bf16 [rows, cols] matrix at ``addr`` with row stride ``ld`` (elements): a view of the memory."""
        assert ld >= cols
        flat = self.find(addr, ((rows - 1) * ld + cols) * 2)[0].view(BF16)
        return flat.as_strided((rows, cols), (ld, 1))


class FakeWorld:
    """Symmetric memory of ``world`` ranks run one after another in this process: the i-th symmetric allocation of
    every rank is one collective allocation; ``get_buffer(p)`` maps rank p's buffer into the running rank's space
    (at an address of its own; its own buffer at the buffer's address)."""

    def __init__(self, world: int):
        self.world, self.rank = world, 0
        self.spaces = [Space(r) for r in range(world)]
        self.owned: dict[tuple[int, int], torch.Tensor] = {}  # (allocation, owner) -> memory
        self.made = [0] * world
        self.index: dict[int, int] = {}  # a buffer's address -> its allocation
        self.keep: list[torch.Tensor] = []

    def memory(self, i: int, owner: int, nbytes: int) -> torch.Tensor:
        buf = self.owned.setdefault((i, owner), torch.zeros(nbytes, dtype=torch.uint8))
        assert buf.numel() == nbytes, "a symmetric allocation of different sizes on two ranks"
        return buf

    def empty(self, nbytes, dtype, device):
        assert dtype == torch.uint8
        i, r = self.made[self.rank], self.rank
        self.made[r] += 1
        buf = self.memory(i, r, nbytes)
        self.index[buf.data_ptr()] = i
        self.spaces[r].add(buf.data_ptr(), buf, r)
        return buf

    def rendezvous(self, buf, name):
        i = self.index[buf.data_ptr()]

        def get_buffer(p, shape, dtype):
            assert dtype == torch.uint8 and tuple(shape) == (buf.numel(),)
            if p == self.rank:
                return buf
            mapping = torch.empty(buf.numel(), dtype=torch.uint8)  # only its address is used
            self.keep.append(mapping)
            self.spaces[self.rank].add(mapping.data_ptr(), self.memory(i, p, buf.numel()), p)
            return mapping

        return types.SimpleNamespace(get_buffer=get_buffer)


@pytest.fixture
def fakes(monkeypatch):
    """The kernel library of ``CONFIGS`` (bf16, B as [N, K]), symmetric memory, streams; returns (structs passed to
    the library, a function that makes the FakeWorld of a group)."""
    infos = {lvl: [kernels.KernelInfo(name, 128, 256, 64, 2, 1, "cooperative", 0, 0, 0, (("bfloat16", "nk"),))]
             for name, lvl in CONFIGS}
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(kernels, "configs", lambda add_c=0: list(infos.get(int(add_c), [])))
    monkeypatch.setattr(kernels, "config_index", lambda name, dtype, layout: [c for c, _ in CONFIGS].index(name))
    monkeypatch.setattr(kernels, "workspace_bytes", lambda *args: 0)
    monkeypatch.setattr(kernels, "check", lambda rc, what: None)
    monkeypatch.setattr(nccl, "kernel_infos", lambda: tuple(kernels.configs()))
    monkeypatch.setattr(nccl, "grid_for", lambda res, tuning, group, tiles: 132)
    monkeypatch.setattr(streams, "persistent", lambda index, make: make())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    made_streams = iter(range(100, 10_000))
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: types.SimpleNamespace(cuda_stream=next(made_streams)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=3))
    seen: list = []

    class Lib:
        def fo_peer_call(self, ref):
            seen.append(peer.PeerArgs.from_buffer_copy(ref._obj))
            return 0

        def fo_ring_call(self, ref):
            seen.append(ring.RingArgs.from_buffer_copy(ref._obj))
            return 0

    monkeypatch.setattr(kernels, "library", lambda: Lib())

    def world(size: int) -> FakeWorld:
        w = FakeWorld(size)
        fake = types.SimpleNamespace(empty=w.empty, rendezvous=w.rendezvous)
        monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", fake)
        monkeypatch.setattr(torch.distributed, "_symmetric_memory", fake, raising=False)
        return w

    peer.ROUTE.reset()
    ring.ROUTE.reset()
    yield seen, world
    peer.ROUTE.reset()
    ring.ROUTE.reset()


def run_ranks(module, collective: str, rows: int, settings: config.Settings, seen: list, w: FakeWorld):
    """Every rank's launch, argument struct and output through the route's own code (``make_launch``, then
    ``execute``: ``args_for`` and ``finish``), its operands registered in its space; the route's state dropped
    between ranks (each rank is a process of its own)."""
    ranks = []
    gen = torch.Generator().manual_seed(1234 + w.world)
    for r in range(w.world):
        w.rank = r
        a = torch.randint(-2, 3, (rows, K), generator=gen).to(BF16)
        b_nk = torch.randint(-2, 3, (N, K), generator=gen).to(BF16)  # B = b_nk.t(), stored as [N, K]
        group = types.SimpleNamespace(group_name="g", rank=lambda r=r: r, size=lambda: w.world)
        res = types.SimpleNamespace(index=None, name="fake", sm_count=132, record=torch.zeros(4, dtype=torch.int32),
                                    side=types.SimpleNamespace(cuda_stream=5), slot=lambda stream, dedicated=False: 0,
                                    counters=[torch.zeros(peer.MAX_GROUPS, dtype=torch.int32)])
        out_rows = rows if collective == "all_reduce" else rows // w.world
        ctx = routes.Context(a, b_nk.t(), None, group, [rows, N], [out_rows, N], "auto", settings,
                             types.SimpleNamespace(a=a, b=b_nk.t(), bias=None), res)
        call = routes.Call(collective, rows, N, K, BF16, w.world, r, "cuda", "nk")
        launch = module.make_launch(call, settings, ctx)
        assert not isinstance(launch, str), launch
        before = len(seen)
        out = module.ROUTE.execute(launch, ctx)
        assert not isinstance(out, str), out
        assert len(seen) == before + 1, "one library call per fused op"
        space = w.spaces[r]
        for t in (a, b_nk, out):
            space.add(t.data_ptr(), t.reshape(-1).view(torch.uint8), r)
        ranks.append(types.SimpleNamespace(p=seen[-1], out=out, a=a, b=b_nk.t(), launch=launch, space=space))
        module.ROUTE.reset()
    return ranks


def product(space: Space, p, row: int, rows: int) -> torch.Tensor:
    """round(A[row:row + rows] @ B) as the struct's configuration reads A and B (fp32 accumulation); no bias."""
    assert not p.bias and p.elem_bytes == 2
    a = space.mat(p.a + row * p.lda * p.elem_bytes, rows, p.k, p.lda)
    b = space.mat(p.b, p.n, p.k, p.ldb).t()  # B as [N, K] with row stride ldb (the configurations' "nk")
    return (a.float() @ b.float()).to(BF16)


def add_c(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The _addc epilogue: the rounded product plus C, summed in fp32, rounded once."""
    return (d.float() + c.float()).to(BF16)


def simulate_peer(ranks) -> None:
    """``fo_peer_call`` of both ranks, phase by phase (every flag wait of the header is a barrier between phases)."""
    # Where the pointers lead. The header lets the caller choose who crosses NVLink (GEMM 1 storing into the peer,
    # or GEMM 2 loading C from it: both sum the same), so which one the route chose (routes/peer.py: GEMM 1 pushes)
    # is checked here, by owner, not by the sums.
    for r, x in enumerate(ranks):
        p, s = x.p, x.space
        add = CONFIGS[p.config_add][1]  # _addc; with an aux store exactly when push is set
        assert CONFIGS[p.config_partial][1] == 0 and (add >= 2 if p.push else add == 1)
        assert (s.owner(p.partial), s.owner(p.peer_partial)) == (1 - r, r), "GEMM 1 -> the peer's memory, C local"
        if p.push or p.num_groups:
            assert (s.owner(p.peer_own), s.owner(p.own_dst)) == (1 - r, r)
    # GEMM 1: A's peer rows -> partial; then notify the peer / wait for its GEMM 1
    stores = [(x.space, x.p.partial, x.p.n, product(x.space, x.p, x.p.peer_row, x.p.rows)) for x in ranks]
    for space, addr, ld, value in stores:
        space.mat(addr, value.shape[0], value.shape[1], ld).copy_(value)
    # GEMM 2: A's own rows + C = peer_partial -> own_dst (push: -> out's own rows and the peer's landing buffer)
    stores = []
    for x in ranks:
        p, s = x.p, x.space
        d = add_c(product(s, p, p.own_row, p.rows), s.mat(p.peer_partial, p.rows, p.n, p.n))
        if p.push:
            assert p.num_groups == 0
            stores += [(s, p.out + p.own_row * p.ld_out * p.elem_bytes, p.ld_out, d), (s, p.peer_own, p.n, d)]
        else:
            stores.append((s, p.own_dst, p.ld_own, d))
    for space, addr, ld, value in stores:
        space.mat(addr, value.shape[0], value.shape[1], ld).copy_(value)
    # all_reduce: push: own_dst (the landing buffer) -> out's peer rows; pull: per group own_dst -> out's own rows,
    # peer_own -> out's peer rows. reduce_scatter: done.
    for x in ranks:
        p, s, eb = x.p, x.space, x.p.elem_bytes
        own_out, peer_out = p.out + p.own_row * p.ld_out * eb, p.out + p.peer_row * p.ld_out * eb
        if p.push:
            s.mat(peer_out, p.rows, p.n, p.ld_out).copy_(s.mat(p.own_dst, p.rows, p.n, p.n))
            continue
        bounds = list((ctypes.c_int32 * (p.num_groups + 1)).from_address(p.group_rows)) if p.num_groups else []
        assert not bounds or (bounds[0], bounds[-1]) == (0, p.rows)
        for r0, r1 in zip(bounds, bounds[1:]):
            if r1 > r0:
                s.mat(own_out + r0 * p.ld_out * eb, r1 - r0, p.n, p.ld_out).copy_(
                    s.mat(p.own_dst + r0 * p.ld_own * eb, r1 - r0, p.n, p.ld_own))
                s.mat(peer_out + r0 * p.ld_out * eb, r1 - r0, p.n, p.ld_out).copy_(
                    s.mat(p.peer_own + r0 * p.n * eb, r1 - r0, p.n, p.n))


def simulate_ring(ranks) -> None:
    """``fo_ring_call`` of every rank: per round t, step s in lock step (step s + 1 waits for the arrival flag of
    step s), then (all_reduce) the round's gather (after every rank's ready flag of round t)."""
    p0 = ranks[0].p
    world, rounds, rows, n, eb = p0.world, p0.rounds, p0.rows, p0.n, p0.elem_bytes
    piece = rows * n * eb

    def slot(p, owner, t, s):  # buffers[owner]: rounds * (world - 1) slots, then rounds own pieces
        return p.buffers[owner] + (t * (world - 1) + s) * piece

    def own_piece(p, owner, t):
        return p.buffers[owner] + (rounds * (world - 1) + t) * piece

    def first_row(c, t):
        return c * rows * rounds + t * rows

    for x in ranks:
        assert (x.p.world, x.p.rounds, x.p.rows, x.p.n) == (world, rounds, rows, n)
        assert (CONFIGS[x.p.config_first][1], CONFIGS[x.p.config_add][1]) == (0, 1)
        assert [x.space.owner(x.p.buffers[q]) for q in range(world)] == list(range(world))
    for t in range(rounds):
        for s in range(world):
            stores = []
            for r, x in enumerate(ranks):
                p, sp = x.p, x.space
                assert p.rank == r
                d = product(sp, p, first_row((r + s + 1) % world, t), rows)
                if s > 0:
                    d = add_c(d, sp.mat(slot(p, r, t, s - 1), rows, n, n))
                if s < world - 1:
                    stores.append((sp, slot(p, (r - 1) % world, t, s), n, d))
                elif p.all_reduce:
                    stores.append((sp, own_piece(p, r, t), n, d))
                else:
                    stores.append((sp, p.out + t * rows * p.ld_out * eb, p.ld_out, d))
            for sp, addr, ld, value in stores:
                sp.mat(addr, rows, n, ld).copy_(value)
        if p0.all_reduce:
            for r, x in enumerate(ranks):
                p, sp = x.p, x.space
                for d in range(world):  # d = 0: the side stream's own piece; else pull stream d - 1 from rank q
                    q = (r + d) % world
                    sp.mat(p.out + first_row(q, t) * p.ld_out * eb, rows, n, p.ld_out).copy_(
                        sp.mat(own_piece(p, q, t), rows, n, n))


def check_outputs(ranks, collective: str) -> None:
    total = sum(x.a.double() @ x.b.double() for x in ranks)
    world = len(ranks)
    chunk = total.shape[0] // world
    for r, x in enumerate(ranks):
        want = total if collective == "all_reduce" else total[r * chunk:(r + 1) * chunk]
        got = x.out.double()
        assert got.shape == want.shape
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"rank {r}: {len(bad)} wrong output rows, the first {bad[:8]}"


@pytest.mark.parametrize("collective, settings", [
    ("reduce_scatter", {}),
    ("all_reduce", {}),  # by push (an _addc_aux configuration is compiled)
    ("all_reduce", {"peer_kernel": PULL, "swizzle": 1}),  # by pull, in several copy groups
], ids=["reduce_scatter", "all_reduce-push", "all_reduce-pull"])
def test_peer_structs_compute_the_collective(fakes, collective, settings):
    seen, make_world = fakes
    rows = 1280
    ranks = run_ranks(peer, collective, rows, config.Settings().replace(**settings), seen, make_world(2))
    push = collective == "all_reduce" and "peer_kernel" not in settings
    for x in ranks:
        assert bool(x.p.push) == push and (x.p.num_groups > 1) == (collective == "all_reduce" and not push)
        assert x.p.rows == rows // 2
    simulate_peer(ranks)
    check_outputs(ranks, collective)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("collective, max_rounds", [("reduce_scatter", 1), ("all_reduce", 1), ("all_reduce", 2)])
def test_ring_structs_compute_the_collective(fakes, world, collective, max_rounds):
    seen, make_world = fakes
    rows = world * 2 * ring.MIN_PIECE_ROWS
    settings = config.Settings().replace(ring="all", ring_rounds=max_rounds)
    ranks = run_ranks(ring, collective, rows, settings, seen, make_world(world))
    assert ranks[0].p.rounds == max_rounds and ranks[0].p.all_reduce == (collective == "all_reduce")
    simulate_ring(ranks)
    check_outputs(ranks, collective)
