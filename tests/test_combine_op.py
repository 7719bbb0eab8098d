"""The fused MoE combine op (``flashoverlap::gemm_unpermute_all_to_all``) on 2 and 3 gloo ranks: the P2P route's
ring schedule (one unit per destination and ring step, or several with ``"blocks:c=N"``) against the unfused
reference (``routes.combine.reference``, one GEMM, one ``index_put``, one ``all_to_all_single``) on random uneven
splits, for the per-expert loop, ``torch._grouped_mm`` (one term, and the two-term sum of torchtitan's backward), a
permutation as the MoE forms make it, a random permutation and duplicate indices with ``accumulate``, split sizes
with empty blocks (one direction of a pair empty, a pair of ranks exchanging nothing); the failure contract;
validation; the geometry of ``schedule.combine``; the fake implementation and ``opcheck``.

Every 2-process case runs under ``torch.use_deterministic_algorithms(True)``, which fills ``torch.empty`` with NaN:
a row the schedule forgets to write or receive poisons the comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import get_pool

from flashoverlap_inductor.routes import combine as combine_route
from flashoverlap_inductor.schedule import combine as geo

K, N, E = 16, 24, 3
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 5e-2}}


# ------------------------------------------------------------------------------------------ helpers (all ranks)


def make_case(form: str, index_kind: str, dtype: torch.dtype, seed: int, world: int, rank: int,
              empty: bool = False) -> dict:
    """One call's arguments on ``rank``: uneven split sizes shared by construction (``counts[i][j]`` rows go from rank
    i to rank j, some 0; ``empty``: chosen pairs empty, every other one not: ``split_counts``),
    this rank's expert GEMM operands and the un-permutation's index."""
    counts = split_counts(seed, world, empty)
    ins, outs = counts[rank].tolist(), counts[:, rank].tolist()
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    send_rows = sum(ins)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    if index_kind == "moe":  # rank-major rows (destination j, then expert e) sorted by expert, as bench.moe makes it
        per = torch.tensor([_split(n, E, gen) for n in ins])  # [world, E]: rows for rank j of expert e
        expert_of_row = torch.arange(E).repeat(world).repeat_interleave(per.flatten())
        index = expert_of_row.argsort(stable=True)
        rows, sizes = send_rows, per.sum(0).tolist()
    elif index_kind == "perm":
        index, rows = torch.randperm(send_rows, generator=gen), send_rows
        sizes = _split(rows, E, gen)
    else:  # "dup": more GEMM rows than send rows, repeated indices (accumulate sums them)
        rows = send_rows + 5
        index = torch.randint(0, max(send_rows, 1), (rows,), generator=gen) if send_rows else torch.zeros(0, dtype=int)
        rows = index.shape[0]
        sizes = _split(rows, E, gen)
        index = index - send_rows * (torch.rand(rows, generator=gen) < 0.3)  # some negative: counted from the end
    if form == "loop":
        a, b, offs = [rnd(m, K) for m in sizes], [rnd(K, N) for _ in sizes], None
    else:
        terms = 2 if form == "grouped2" else 1
        a = [rnd(rows, K) for _ in range(terms)]
        b = [rnd(E, N, K).transpose(-2, -1) for _ in range(terms)]  # the transposed weights of the MoE graphs
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return {"a": a, "b": b, "offs": offs, "index": index, "accumulate": index_kind == "dup", "outs": outs, "ins": ins}


def split_counts(seed: int, world: int, empty: bool) -> torch.Tensor:
    """``counts[i][j]``: rows rank i sends rank j (module docstring of ``make_case``); the same on every rank."""
    counts = torch.randint(0, 7, (world, world), generator=torch.Generator().manual_seed(seed))
    counts[0, 0] = 0  # a rank that keeps none of its rows
    if empty:  # one direction empty (0 -> 1 while 1 -> 0 carries rows); on 3 ranks a pair exchanging nothing
        counts = counts.clamp(min=1)
        counts[0, 1] = 0
        if world > 2:
            counts[1, 2] = counts[2, 1] = counts[2, 0] = 0
    return counts


def _split(rows: int, groups: int, gen: torch.Generator) -> list[int]:
    cuts = sorted(torch.randint(0, rows + 1, (groups - 1,), generator=gen).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]


def run_cases(op: str, make, check, forms: list[str], index_kinds: list[str], dtype_name: str, seeds: list[int],
              plan: str, empty: bool) -> int:
    """Every (form, index kind, seed): ``check(make(form, kind, dtype, seed, world, rank, empty), dtype, where)``
    on this rank, with deterministic algorithms; asserts the P2P route of MoE ``op`` ran every call (not the
    reference); returns the count. Also the dispatch tests'."""
    from flashoverlap_inductor.routes import stats

    dtype = getattr(torch, dtype_name)
    g = dist.group.WORLD
    before = stats[f"{op}:p2p"]
    torch.use_deterministic_algorithms(True)
    done = 0
    try:
        for form in forms:
            for kind in index_kinds:
                for seed in seeds:
                    case = make(form, kind, dtype, seed, g.size(), g.rank(), empty)
                    check(case, dtype, f"{form} {kind} {seed} {plan}")
                    done += 1
    finally:
        torch.use_deterministic_algorithms(False)
    assert stats[f"{op}:p2p"] - before == done  # the P2P route ran, not the reference
    return done


def op_worker(forms: list[str], index_kinds: list[str], dtype_name: str, seeds: list[int], plan: str = "blocks",
              empty: bool = False) -> int:
    """Every (form, index kind, seed): the fused op under ``plan`` equals the unfused reference on this rank; returns
    the count."""
    g = dist.group.WORLD

    def check(c: dict, dtype: torch.dtype, where: str) -> None:
        got = torch.ops.flashoverlap.gemm_unpermute_all_to_all(
            c["a"], c["b"], c["offs"], c["index"], c["accumulate"], c["outs"], c["ins"], g.group_name, plan)
        want = combine_route.reference(c["a"], c["b"], c["offs"], c["index"], c["accumulate"], c["outs"], c["ins"], g)
        assert got.shape == (sum(c["outs"]), N) and got.dtype == dtype, (where, got.shape)
        torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, w=where: f"{w}: {m}")

    return run_cases("combine", make_case, check, forms, index_kinds, dtype_name, seeds, plan, empty)

def failure_worker(bad_rank: int) -> tuple[str, str]:
    """A GEMM that raises on ``bad_rank`` in the middle of a call: every rank raises; the next call is exact."""
    from unittest import mock

    from flashoverlap_inductor import errors

    g = dist.group.WORLD
    c = make_case("loop", "moe", torch.float32, 5, g.size(), g.rank())
    call = lambda: torch.ops.flashoverlap.gemm_unpermute_all_to_all(  # noqa: E731
        c["a"], c["b"], None, c["index"], False, c["outs"], c["ins"], g.group_name, "blocks")
    real = combine_route.CombineUnits.fill
    seen = []

    def flaky(self, u, send):
        seen.append(u)
        if g.rank() == bad_rank and len(seen) == 2:
            raise RuntimeError("injected GEMM fault")
        return real(self, u, send)

    with mock.patch.object(combine_route.CombineUnits, "fill", flaky):
        try:
            call()
            first = "no error"
        except errors.PeerFailure as exc:
            first = f"PeerFailure: {exc}"
        except RuntimeError as exc:
            first = f"RuntimeError: {exc}"
    want = combine_route.reference(c["a"], c["b"], None, c["index"], False, c["outs"], c["ins"], g)
    torch.testing.assert_close(call(), want)
    return first, "next call exact"


def bad_inputs_worker() -> dict[str, str]:
    g = dist.group.WORLD
    fo = torch.ops.flashoverlap
    a, b, idx = [torch.randn(4, K)], [torch.randn(K, N)], torch.arange(4)
    cases = {
        "counts": lambda: fo.gemm_unpermute_all_to_all(a, b + b, None, idx, False, [2, 2], [2, 2], g.group_name,
                                                       "blocks"),
        "dtype": lambda: fo.gemm_unpermute_all_to_all(a, [b[0].double()], None, idx, False, [2, 2], [2, 2],
                                                      g.group_name, "blocks"),
        "index": lambda: fo.gemm_unpermute_all_to_all(a, b, None, idx.float(), False, [2, 2], [2, 2], g.group_name,
                                                      "blocks"),
        "splits": lambda: fo.gemm_unpermute_all_to_all(a, b, None, idx, False, [4], [4], g.group_name, "blocks"),
        "self": lambda: fo.gemm_unpermute_all_to_all(a, b, None, idx, False, [1, 3], [3, 1], g.group_name, "blocks"),
        "plan": lambda: fo.gemm_unpermute_all_to_all(a, b, None, idx, False, [2, 2], [2, 2], g.group_name, "v1;x"),
        "chunks": lambda: fo.gemm_unpermute_all_to_all(a, b, None, idx, False, [2, 2], [2, 2], g.group_name,
                                                       "blocks:c=0"),
        "offs": lambda: fo.gemm_unpermute_all_to_all(a, [torch.randn(2, K, N)], torch.tensor([1, 4]), idx, False,
                                                     [2, 2], [2, 2], g.group_name, "blocks"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "NO ERROR"
        except (ValueError, RuntimeError) as exc:
            out[name] = str(exc)
    dist.barrier()  # still in step: nothing was half-sent
    return out


def opcheck_worker() -> list[dict]:
    g = dist.group.WORLD
    results = []
    for form in ("loop", "grouped"):
        c = make_case(form, "moe", torch.bfloat16 if form == "grouped" else torch.float32, 3, g.size(), g.rank())
        args = (c["a"], c["b"], c["offs"], c["index"], False, c["outs"], c["ins"], g.group_name, "blocks")
        results.append(torch.library.opcheck(torch.ops.flashoverlap.gemm_unpermute_all_to_all.default, args))
    return results


# ------------------------------------------------------------------------------------------ 2-process tests


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_loop_form_matches_the_reference_on_uneven_splits(pool, dtype_name):
    kinds = ["moe", "perm", "dup"]
    assert pool.run(op_worker, ["loop"], kinds, dtype_name, [1, 2, 3, 4]) == [12, 12]


def test_three_ranks():
    """Three ranks: each block order starts at a different peer (ring order), splits uneven, one rank keeping none."""
    got = get_pool(3).run(op_worker, ["loop", "grouped"], ["moe", "dup"], "bfloat16", [1, 2])
    assert got == [8, 8, 8]


def test_grouped_forms_match_the_reference_in_bf16(pool):
    kinds = ["moe", "perm", "dup"]
    assert pool.run(op_worker, ["grouped", "grouped2"], kinds, "bfloat16", [1, 2, 3]) == [18, 18]


def test_grouped_forms_without_a_grouped_mm_kernel_match_the_reference(pool):
    """fp32 (and fp16): one mm per (expert run, term) from the host counts, not _grouped_mm, whose CUDA fallback for
    these dtypes copies offs to the host on every call (``moe_p2p.grouped_kernel``)."""
    from flashoverlap_inductor.routes import moe_p2p

    assert moe_p2p.grouped_kernel(torch.bfloat16) and not moe_p2p.grouped_kernel(torch.float32)
    assert pool.run(op_worker, ["grouped", "grouped2"], ["moe", "perm", "dup"], "float32", [1, 2]) == [12, 12]


@pytest.mark.parametrize("plan", ["blocks:c=2", "blocks:c=3"])
def test_chunked_plans_match_the_reference(pool, plan):
    """Each block in 2 or 3 chunks (some empty: blocks of fewer rows than chunks), one transfer per chunk."""
    assert pool.run(op_worker, ["loop", "grouped2"], ["moe", "dup"], "bfloat16", [1, 2], plan) == [8, 8]


@pytest.mark.parametrize("world,plan", [(2, "blocks"), (2, "blocks:c=2"), (3, "blocks"), (3, "blocks:c=2")])
def test_empty_blocks_are_skipped_alike_on_both_sides(world, plan):
    """Rank 0 sends rank 1 nothing while rank 1 sends it rows; on 3 ranks ranks 1 and 2 exchange nothing and rank 2
    sends rank 0 nothing: the empty transfers are left out on both sides, the others still pair up."""
    got = get_pool(world).run(op_worker, ["loop", "grouped"], ["moe", "perm"], "float32", [3], plan, True)
    assert got == [4] * world


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_fault_on_one_rank_raises_on_every_rank_and_the_next_call_works(pool, bad_rank):
    got = pool.run(failure_worker, bad_rank)
    for rank, (first, after) in enumerate(got):
        want = "RuntimeError: injected GEMM fault" if rank == bad_rank else "PeerFailure"
        assert first.startswith(want), (rank, first)
        assert after == "next call exact"


def test_bad_inputs_raise_on_every_rank_before_any_transfer(pool):
    expect = {"counts": "one b per a", "dtype": "share one dtype", "index": "1-D int64", "splits": "2 split sizes",
              "self": "sends itself", "plan": "unknown combine plan", "offs": "1-D int32",
              "chunks": "unknown combine plan"}
    for per_rank in pool.run(bad_inputs_worker):
        for name, fragment in expect.items():
            assert fragment in per_rank[name], (name, per_rank[name])


def test_opcheck_on_gloo(pool):
    for per_rank in pool.run(opcheck_worker):
        for result in per_rank:
            assert set(result.values()) == {"SUCCESS"}, result


# ------------------------------------------------------------------------------------------ one process


def test_unit_geometry_cuts_every_row_once():
    index = torch.tensor([3, 0, 4, 1, 5, 2, -1])  # 7 rows of y into 7 send rows (-1: row 6); blocks of 2, 3, 2 rows
    sizes = geo.chunk_sizes([2, 3, 2], 2)
    assert sizes == [1, 1, 1, 2, 1, 1]
    bounds = geo.offsets(sizes)
    ends = [2, 5, 6, 7]  # experts: rows [0,2) [2,5) [5,6); row 6 in no expert (the last group)
    plan, extra = geo.plan_units(index, torch.tensor(ends[:3]), torch.tensor(bounds), 7, torch.tensor([9]))
    assert extra.tolist() == [9] and plan.counts.sum().item() == 7
    assert plan.target.tolist() == [int(index[r]) % 7 for r in plan.order.tolist()]
    seen = []
    for u in range(len(sizes)):
        rows = plan.order[plan.starts[u]:plan.starts[u + 1]].tolist()
        assert rows == sorted(rows) and all(bounds[u] <= int(index[r]) % 7 < bounds[u + 1] for r in rows)
        assert rows[:plan.grouped_rows(u)] == [r for r in rows if r < 6]  # rows in an expert first
        for g, pos, count, row0 in plan.segments(u):
            run = plan.order[pos:pos + count].tolist()
            assert all((ends[g - 1] if g else 0) <= r < ends[g] for r in run)
            assert row0 is None or run == list(range(row0, row0 + count))
        seen += rows
    assert sorted(seen) == list(range(7))
    assert plan.expert_offsets().shape == (6, 4) and plan.expert_offsets().dtype == torch.int32
    with pytest.raises(IndexError, match="index 7 is out of bounds"):
        geo.plan_units(torch.tensor([0, 7]), torch.tensor([2]), torch.tensor([0, 7]), 7)
    assert geo.ring_steps(4, 1) == [(2, 0), (3, 3), (0, 2)] and geo.ring_steps(1, 0) == []
    for world in (2, 3, 5):  # at step s, r's destination has r as its source
        for s in range(world - 1):
            assert all(geo.ring_steps(world, geo.ring_steps(world, r)[s][0])[s][1] == r for r in range(world))
    assert [geo.parse_plan(p, "x") for p in ("blocks", "auto", "blocks:c=3")] == [1, 1, 3]
    for bad in ("blocks:c=0", "blocks:c=17", "ring"):
        with pytest.raises(ValueError, match="unknown x plan"):
            geo.parse_plan(bad, "x")
    with pytest.raises(ValueError):
        geo.group_ends(torch.tensor([3, 2]), 5, cumulative=True)


def test_fake_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        a = [mode.from_tensor(torch.randn(5, K))]
        b = [mode.from_tensor(torch.randn(E, K, N, dtype=torch.float32))]
        offs = mode.from_tensor(torch.tensor([1, 3, 5], dtype=torch.int32))
        out = torch.ops.flashoverlap.gemm_unpermute_all_to_all(a, b, offs, mode.from_tensor(torch.arange(5)), False,
                                                               [4, 2], [3, 2], "0", "blocks")
    assert out.shape == (6, N) and out.is_contiguous()


def test_cuda_calls_take_the_p2p_route_only_under_its_experiment():
    """The MoE ops' P2P route on CUDA is slower than the unfused ops (2 H100s): it is the experiment
    ``moe_p2p_cuda`` (else the unfused reference runs, ``fallback:experiment``); CPU calls (gloo) take it always."""
    import types

    from flashoverlap_inductor import config
    from flashoverlap_inductor.routes import moe_p2p

    assert "moe_p2p_cuda" in config.EXPERIMENTS
    cuda_like = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda", index=0), dtype=torch.bfloat16)
    assert moe_p2p.unsupported(cuda_like, None, 2, frozenset()).startswith("experiment:")
    assert moe_p2p.unsupported(torch.zeros(2, 2), None, 2, frozenset()) is None


@pytest.mark.parametrize("dtype,cols", [(torch.bfloat16, 24), (torch.bfloat16, 12), (torch.float16, 6),
                                        (torch.float32, 3), (torch.float32, 8), (torch.uint8, 5)])
def test_copy_rows_matches_index_copy_bit_for_bit(dtype, cols):
    """``moe_p2p.copy_rows`` moves rows as wide words where they divide a row: the same bits as ``index_copy_``,
    on whole tensors and on row slices (a slice's offset, a whole number of rows, stays word-aligned)."""
    from flashoverlap_inductor.routes import moe_p2p

    gen = torch.Generator().manual_seed(cols)
    full = torch.randint(0, 255, (40, cols * torch.empty((), dtype=dtype).element_size()), generator=gen,
                         dtype=torch.uint8).view(dtype)
    src = torch.randint(0, 255, (9, full.shape[1] * full.element_size()), generator=gen,
                        dtype=torch.uint8).view(dtype)
    index = torch.randperm(20, generator=gen)[:9]
    for dst_of in (lambda t: t, lambda t: t[3:23]):
        got, want = full.clone(), full.clone()
        moe_p2p.copy_rows(dst_of(got), index, src)
        dst_of(want).index_copy_(0, index, src)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
