"""``fo_moe_dispatch_cut`` (``routes/moe_cut_lib.py``): the MoE dispatch cut by expert's compute in one library call.

On one sm90 GPU, with the library, on fresh random bf16 routing in the whole-block form (each block's rows sorted by
expert, some experts and chunks empty): 2-4 blocks, the own block at each position, 1-3 pieces, one or two terms,
both weight layouts. The peers' chunks land in the receive buffer late, from a side stream that sleeps first and
records each unit's landing event, so a call that did not wait for them would move the receive buffer's NaN poison
into ``p``. ``p`` must equal ``buffer[index]`` bit for bit, each ``y`` the library's one uncut grouped GEMM bit for
bit and an fp64 oracle within a bf16 tolerance; the settle vector and the pieces' bounds equal the plan's own. A
refused call (its arguments) enqueues nothing, is counted once and leaves the later calls to the Python steps.

    python3 -m pytest -q tests/test_moe_cut_lib.py
"""

from __future__ import annotations

import pytest
import torch
from c_layout import assert_mirrors_header, needs_cc

from flashoverlap_inductor.native import grouped, kernels
from flashoverlap_inductor.routes import moe_cut_lib, moe_nccl, moe_plan_lib
from flashoverlap_inductor.schedule.combine import chunk_sizes, offsets

sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                          or not kernels.available(), reason="needs an sm90 GPU and the built library")
TOL = 4 * torch.finfo(torch.bfloat16).eps  # normwise relative error of a bf16 GEMM output against fp64


@needs_cc
def test_the_ctypes_mirror_matches_the_c_layout(tmp_path):
    assert_mirrors_header(moe_cut_lib.DispatchArgs, "fo_moe_dispatch_args", "moe_dispatch_cut.cu", tmp_path)


def _case(seed: int, world: int, rank: int, pieces: int, experts: int, k: int, ns: list[int], layout: int):
    """One rank's call: the routing, its tensors (on the GPU) and the arguments of ``moe_cut_lib.run``."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 24, (world, experts), generator=g)  # block j's rows of expert e
    counts[torch.rand(world, experts, generator=g) < 0.2] = 0  # empty (block, expert) pairs
    counts[rank, 0] += 1  # at least one row
    outs = counts.sum(1).tolist()
    rows = sum(outs)
    block_start = offsets(outs)
    index = []
    for e in range(experts):  # expert order: experts, then blocks, then the block's rows of the expert
        for j in range(world):
            first = block_start[j] + int(counts[j, :e].sum())
            index += range(first, first + int(counts[j, e]))
    dev = torch.device("cuda")
    offs = torch.tensor(counts.sum(0).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    buffer = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(dev)
    ins = [outs[rank] if j == rank else int(v) for j, v in enumerate(torch.randint(0, 30, (world,), generator=g))]
    send_off, recv_off = offsets(chunk_sizes(ins, pieces)), offsets(chunk_sizes(outs, pieces))
    x = torch.randn(send_off[-1], k, generator=g).to(torch.bfloat16).to(dev)
    x[send_off[rank * pieces]:send_off[(rank + 1) * pieces]] = buffer[block_start[rank]:block_start[rank + 1]]
    recv = torch.full((rows, k), float("nan"), dtype=torch.bfloat16, device=dev)  # the peers' blocks land late
    ws = []
    for n in ns:
        w = torch.randn(experts, n, k, generator=g).to(torch.bfloat16).to(dev) / k ** 0.5
        ws.append(w if layout == 0 else w.transpose(-2, -1).contiguous().transpose(-2, -1))  # [k, n] stored
    cuts = [[outs[j] if j == rank else recv_off[j * pieces + q + 1] - recv_off[j * pieces] for q in range(pieces)]
            for j in range(world)]
    order = [(rank - s) % world for s in range(1, world)]
    index = torch.tensor(index, dtype=torch.int64, device=dev)
    return dict(x=x, recv=recv, index=index, offs=offs, outs=outs, cuts=cuts, ws=ws, buffer=buffer,
                send_off=send_off, recv_off=recv_off, order=order, rows=rows)


def _land_late(c: dict, rank: int, pieces: int) -> list[tuple[int, list]]:
    """The peers' chunks copied into the receive buffer from a side stream after a sleep (~20 ms), one landing event
    per unit, as ``moe_nccl.transfer`` leaves them."""
    side = torch.cuda.Stream()
    landing = []
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(40_000_000)
        for j in c["order"]:
            for q in range(pieces):
                u = j * pieces + q
                lo, hi = c["recv_off"][u], c["recv_off"][u + 1]
                c["recv"][lo:hi].copy_(c["buffer"][lo:hi])
                done = torch.cuda.Event()
                done.record(side)
                landing.append((u, [moe_nccl.Transfer(done, c["x"].device, ())]))
    return landing


@sm90
@pytest.mark.parametrize("world,rank,pieces,ns,layout", [(2, 0, 2, [768, 768], 0), (2, 1, 2, [512], 1),
                                                         (3, 1, 3, [256], 0), (4, 3, 2, [384, 256], 0),
                                                         (2, 0, 1, [256], 1)])
def test_one_call_equals_the_steps_and_fp64(world, rank, pieces, ns, layout):
    experts, k = 16, 512
    for seed in range(3):
        c = _case(seed * 7 + world, world, rank, pieces, experts, k, ns, layout)
        landing = _land_late(c, rank, pieces)
        p = torch.full((c["rows"], k), float("nan"), dtype=torch.bfloat16, device="cuda")
        ys = [torch.full((c["rows"], w.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda") for w in c["ws"]]
        before = moe_cut_lib.stats["moe:cut_lib"]
        facts = moe_cut_lib.run(c["x"], c["recv"], c["index"], c["offs"], c["outs"], c["cuts"],
                                list(zip(c["ws"], ys, strict=True)), p, c["send_off"], c["recv_off"], landing,
                                c["order"], rank, pieces)
        assert facts is not None and moe_cut_lib.stats["moe:cut_lib"] == before + 1
        want_p = c["buffer"][c["index"]]
        assert torch.equal(p, want_p)  # moved, never computed: bit for bit, the late chunks included
        for w, y in zip(c["ws"], ys, strict=True):
            one = grouped.grouped_mm(want_p, w, c["offs"])  # the library's uncut call
            assert torch.equal(y, one)
            exact = torch.cat([want_p[s:e].double() @ w[i].double().T for i, (s, e) in
                               enumerate(grouped.rows_of(c["offs"].tolist(), c["rows"]))])
            assert ((y.double() - exact).norm() / exact.norm()).item() < TOL
        ref = moe_plan_lib.plan(c["index"], c["offs"], offsets(c["outs"]), c["cuts"])  # the plan on its own
        assert torch.equal(facts, ref[3])
        assert facts[0].item() == 0 and facts[5].item() == 0  # no failure, every buffer row named


@sm90
def test_a_refused_call_enqueues_nothing_and_later_calls_take_the_python_steps(monkeypatch):
    monkeypatch.setattr(moe_cut_lib, "_refused", [])
    c = _case(5, 3, 0, 2, 16, 512, [256], 0)
    p = torch.full((c["rows"], 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = torch.full((c["rows"], 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    bad_order = [c["order"][0]] * 2  # a peer listed twice: refused before any launch
    got = moe_cut_lib.run(c["x"], c["recv"], c["index"], c["offs"], c["outs"], c["cuts"], [(c["ws"][0], y)], p,
                          c["send_off"], c["recv_off"], [], bad_order, 0, 2)
    torch.cuda.synchronize()
    assert got is None and moe_cut_lib._refused and b"order" in kernels.library().fo_last_error()
    assert p.isnan().all() and y.isnan().all()
    assert not moe_cut_lib.should_run(c["x"], c["index"], c["offs"], 3, 2, 1, [])


def test_the_one_call_is_asked_only_within_its_limits(monkeypatch):
    """``should_run``: within the kernels' limits (blocks, pieces, terms), every transfer an event the library's
    stream can wait for (a ``torch.distributed`` work is not), and no refusal in this process."""
    monkeypatch.setattr(moe_cut_lib.moe_plan_lib, "usable", lambda x: True)
    monkeypatch.setattr(moe_cut_lib, "_refused", [])
    x, index, offs = torch.zeros(4, 8, dtype=torch.bfloat16), torch.arange(4), torch.tensor([4], dtype=torch.int32)
    step = moe_nccl.Transfer(None, x.device, ())

    def asks(world=2, pieces=2, terms=1, landing=((1, [step]),)):
        return moe_cut_lib.should_run(x, index, offs, world, pieces, terms, list(landing))

    assert asks() and asks(world=8, pieces=8, terms=4) and asks(landing=())
    assert not asks(world=9) and not asks(pieces=9) and not asks(pieces=0) and not asks(terms=5)
    assert not asks(landing=((1, [object()]),))  # a torch.distributed work: the Python steps
    monkeypatch.setattr(moe_cut_lib, "_refused", ["an earlier refusal"])
    assert not asks()
