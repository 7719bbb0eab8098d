"""``fo_moe_combine_blocks`` (``routes/moe_combine_lib.py``): the MoE combine's whole-block compute in one library call.

On one sm90 GPU, with the library, on fresh random bf16 routing in the whole-block form (each block's send rows
sorted by expert, some (block, expert) pairs and whole blocks empty): 2-4 blocks, the own block at each position,
one to three terms, both weight layouts. The call is enqueued behind a ~20 ms sleep on its stream; a side stream
copies each peer block once its ready event fires, so an event recorded before its block's GEMM (or never) would copy
the NaN the send buffer was filled with. Every block (sent and own) must equal the library's uncut grouped GEMM of
each term, the terms summed in bf16, un-permuted by the index, bit for bit; the sum an fp64 oracle within a bf16
tolerance and ``torch._grouped_mm`` (the Python loop's GEMM) within one bf16 rounding per term; the settle vector the
plan's own. A refused call enqueues nothing, is counted once and leaves the later calls to the Python loop.

    python3 -m pytest -q tests/test_moe_combine_lib.py
"""

from __future__ import annotations

import pytest
import torch
from c_layout import assert_mirrors_header, needs_cc

from flashoverlap_inductor.native import grouped, kernels
from flashoverlap_inductor.routes import moe_combine_lib, moe_plan_lib
from flashoverlap_inductor.schedule.combine import offsets

sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                          or not kernels.available(), reason="needs an sm90 GPU and the built library")
TOL = 4 * torch.finfo(torch.bfloat16).eps  # normwise relative error of a bf16 GEMM output against fp64


@needs_cc
def test_the_ctypes_mirror_matches_the_c_layout(tmp_path):
    assert_mirrors_header(moe_combine_lib.CombineArgs, "fo_moe_combine_args", "moe_combine_blocks.cu", tmp_path)


def _case(seed: int, world: int, rank: int, experts: int, ks: list[int], n: int, layout: int, empty_block: bool):
    """One rank's combine: the expert rows ``a`` (one per term), the weights ``b`` ([E, K, N], as the op takes them),
    the offsets, the index (expert row -> send row) and the blocks' rows ``ins``."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 24, (world, experts), generator=g)  # block j's rows of expert e
    counts[torch.rand(world, experts, generator=g) < 0.2] = 0
    counts[rank, 0] += 1
    if empty_block:
        counts[(rank + 1) % world] = 0  # a peer this rank sends nothing
    ins = counts.sum(1).tolist()
    start = offsets(ins)
    index = []
    for e in range(experts):  # expert order: experts, then blocks, then the block's rows of the expert
        for j in range(world):
            first = start[j] + int(counts[j, :e].sum())
            index += range(first, first + int(counts[j, e]))
    dev = torch.device("cuda")
    rows = sum(ins)
    a = [torch.randn(rows, k, generator=g).to(torch.bfloat16).to(dev) for k in ks]
    b = []
    for k in ks:
        w = torch.randn(experts, k, n, generator=g).to(torch.bfloat16).to(dev) / k ** 0.5
        b.append(w if layout == 1 else w.transpose(-2, -1).contiguous().transpose(-2, -1))  # N contiguous, or K
    offs = torch.tensor(counts.sum(0).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    return a, b, offs, torch.tensor(index, dtype=torch.int64, device=dev), ins


def _expected(a, b, offs, index, rows):
    """The send layout: the library's uncut grouped GEMM per term, bf16 terms summed as torch sums them, scattered by
    the index; and the fp64 oracle and ``torch._grouped_mm``'s sum, likewise."""
    lib = fp64 = torch_sum = None
    for x, w in zip(a, b, strict=True):
        t = grouped.grouped_mm(x, w.transpose(-2, -1), offs)
        lib = t if lib is None else lib + t
        exact = torch.cat([x[s:e].double() @ w[i].double() for i, (s, e) in
                           enumerate(grouped.rows_of(offs.tolist(), rows))])
        fp64 = exact if fp64 is None else fp64 + exact
        tt = torch._grouped_mm(x, w, offs=offs)
        torch_sum = tt if torch_sum is None else torch_sum + tt

    def unpermute(y):
        out = torch.empty_like(y)
        out[index] = y
        return out
    return unpermute(lib), unpermute(fp64), unpermute(torch_sum)


@sm90
@pytest.mark.parametrize("world,rank,ks,layout,empty", [(2, 0, [768], 1, False), (2, 1, [512, 512], 0, False),
                                                        (3, 1, [256], 1, True), (4, 3, [384, 256], 1, False),
                                                        (4, 0, [256, 256, 128], 0, True)])
def test_one_call_equals_the_uncut_gemm_and_fp64_and_events_follow_their_blocks(world, rank, ks, layout, empty):
    experts, n = 16, 512
    for seed in range(3):
        a, b, offs, index, ins = _case(seed * 11 + world, world, rank, experts, ks, n, layout, empty)
        rows, start = sum(ins), offsets(ins)
        send = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        own = torch.full((ins[rank], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        ready = [None if j == rank or not ins[j] else torch.cuda.Event() for j in range(world)]
        order = [(rank + s) % world for s in range(1, world)] + [rank]
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)  # the call's kernels run late
        before = moe_combine_lib.stats["moe:combine_lib"]
        facts = moe_combine_lib.run(a, b, offs, index, ins, order, send, own, rank, ready)
        assert facts is not None and moe_combine_lib.stats["moe:combine_lib"] == before + 1
        side, seen = torch.cuda.Stream(), {}
        for j, event in enumerate(ready):  # each block copied as soon as its event fires
            if event is not None:
                side.wait_event(event)
                with torch.cuda.stream(side):
                    seen[j] = send[start[j]:start[j + 1]].clone()
        torch.cuda.synchronize()
        want, exact, via_torch = _expected(a, b, offs, index, rows)
        for j in range(world):
            got = own if j == rank else send[start[j]:start[j + 1]]
            assert torch.equal(got, want[start[j]:start[j + 1]]), (seed, j)
            if j in seen:
                assert torch.equal(seen[j], got), (seed, j)  # the event followed the block's GEMMs
        whole = send.clone()
        whole[start[rank]:start[rank + 1]] = own
        assert ((whole.double() - exact).norm() / exact.norm()).item() < TOL * len(ks)
        assert ((whole.double() - via_torch.double()).norm() / exact.norm()).item() < TOL * len(ks)
        ref = moe_plan_lib.plan(index, offs, start)  # the plan on its own
        assert torch.equal(facts, ref[3]) and facts[0].item() == 0 and facts[5].item() == 0


@sm90
def test_a_refused_call_enqueues_nothing_and_later_calls_take_the_python_loop(monkeypatch):
    monkeypatch.setattr(moe_combine_lib, "_refused", [])
    a, b, offs, index, ins = _case(5, 3, 0, 16, [256], 512, 1, False)
    send = torch.full((sum(ins), 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    own = torch.full((ins[0], 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = moe_combine_lib.run(a, b, offs, index, ins, [1, 1, 0], send, own, 0, [None] * 3)  # block 1 twice
    torch.cuda.synchronize()
    assert got is None and moe_combine_lib._refused and b"order" in kernels.library().fo_last_error()
    assert send.isnan().all() and own.isnan().all()
    assert not moe_combine_lib.should_run(a, b, offs, index, 3)


def test_the_one_call_is_asked_only_within_its_limits(monkeypatch):
    """``should_run``: bf16 terms (1 to 4) whose weights the library reads, N and K multiples of 8, one int32
    offsets tensor, the kernels' limits, and no refusal in this process."""
    monkeypatch.setattr(moe_combine_lib, "_refused", [])
    x, w = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 8, dtype=torch.bfloat16)
    index, offs = torch.arange(4), torch.tensor([2, 4], dtype=torch.int32)

    def asks(a=(x,), b=(w,), offs=offs, world=2):
        return moe_combine_lib.should_run(list(a), list(b), offs, index, world)

    assert asks() and asks(a=(x,) * 4, b=(w,) * 4) and asks(world=8)
    assert not asks(a=(x,) * 5, b=(w,) * 5) and not asks(world=9)
    assert not asks(a=(x.float(),), b=(w.float(),))  # fp32: the Python loop
    assert not asks(b=(torch.zeros(2, 16, 12, dtype=torch.bfloat16),))  # N 12
    assert not asks(offs=offs.long())
    assert not asks(a=(x[:3],)) and not asks(b=(torch.zeros(2, 24, 8, dtype=torch.bfloat16),))  # rows, K differ
    assert not asks(b=(torch.zeros(2, 8, 32, dtype=torch.bfloat16)[:, :, ::2],))  # neither K nor N contiguous
    monkeypatch.setattr(moe_combine_lib, "_refused", ["an earlier refusal"])
    assert not asks()
