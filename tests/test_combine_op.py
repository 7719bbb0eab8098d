"""The fused MoE combine op (``flashoverlap::gemm_unpermute_all_to_all``) on 2 gloo ranks: the CPU route's pipelined
per-destination schedule against the unfused reference (``routes.combine.reference``, one GEMM, one ``index_put``,
one ``all_to_all_single``) on random uneven splits, for the per-expert loop, ``torch._grouped_mm`` (one term, and
the two-term sum of torchtitan's backward), a permutation as the MoE forms make it, a random permutation and
duplicate indices with ``accumulate``; the failure contract; validation; the geometry of ``schedule.combine``; the
fake implementation and ``opcheck``.

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


def make_case(form: str, index_kind: str, dtype: torch.dtype, seed: int, world: int, rank: int) -> dict:
    """One call's arguments on ``rank``: uneven split sizes shared by construction (``counts[i][j]`` rows go from rank
    i to rank j, some 0), this rank's expert GEMM operands and the un-permutation's index."""
    shared = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 7, (world, world), generator=shared)
    counts[0, 0] = 0  # a rank that keeps none of its rows
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


def _split(rows: int, groups: int, gen: torch.Generator) -> list[int]:
    cuts = sorted(torch.randint(0, rows + 1, (groups - 1,), generator=gen).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]


def op_worker(forms: list[str], index_kinds: list[str], dtype_name: str, seeds: list[int]) -> int:
    """Every (form, index kind, seed): the fused op equals the unfused reference on this rank; returns the count."""
    from flashoverlap_inductor.routes import stats

    dtype = getattr(torch, dtype_name)
    g = dist.group.WORLD
    before = stats["combine:cpu"]
    torch.use_deterministic_algorithms(True)
    done = 0
    try:
        for form in forms:
            for kind in index_kinds:
                for seed in seeds:
                    c = make_case(form, kind, dtype, seed, g.size(), g.rank())
                    got = torch.ops.flashoverlap.gemm_unpermute_all_to_all(
                        c["a"], c["b"], c["offs"], c["index"], c["accumulate"], c["outs"], c["ins"], g.group_name,
                        "blocks")
                    want = combine_route.reference(c["a"], c["b"], c["offs"], c["index"], c["accumulate"], c["outs"],
                                                   c["ins"], g)
                    assert got.shape == (sum(c["outs"]), N) and got.dtype == dtype, (form, kind, seed, got.shape)
                    where = f"{form} {kind} {seed}"
                    torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, w=where: f"{w}: {m}")
                    done += 1
    finally:
        torch.use_deterministic_algorithms(False)
    assert stats["combine:cpu"] - before == done  # the pipelined CPU route ran, not the reference
    return done


def failure_worker(bad_rank: int) -> tuple[str, str]:
    """A GEMM that raises on ``bad_rank`` in the middle of a call: every rank raises; the next call is exact."""
    from unittest import mock

    from flashoverlap_inductor import errors

    g = dist.group.WORLD
    c = make_case("loop", "moe", torch.float32, 5, g.size(), g.rank())
    call = lambda: torch.ops.flashoverlap.gemm_unpermute_all_to_all(  # noqa: E731
        c["a"], c["b"], None, c["index"], False, c["outs"], c["ins"], g.group_name, "blocks")
    real = combine_route.ExpertGemm.segment
    seen = []

    def flaky(self, seg):
        seen.append(seg)
        if g.rank() == bad_rank and len(seen) == 2:
            raise RuntimeError("injected GEMM fault")
        return real(self, seg)

    with mock.patch.object(combine_route.ExpertGemm, "segment", flaky):
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


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_fault_on_one_rank_raises_on_every_rank_and_the_next_call_works(pool, bad_rank):
    got = pool.run(failure_worker, bad_rank)
    for rank, (first, after) in enumerate(got):
        want = "RuntimeError: injected GEMM fault" if rank == bad_rank else "PeerFailure"
        assert first.startswith(want), (rank, first)
        assert after == "next call exact"


def test_bad_inputs_raise_on_every_rank_before_any_transfer(pool):
    expect = {"counts": "one b per a", "dtype": "share one dtype", "index": "1-D int64", "splits": "2 split sizes",
              "self": "sends itself", "plan": "unknown combine plan", "offs": "1-D int32"}
    for per_rank in pool.run(bad_inputs_worker):
        for name, fragment in expect.items():
            assert fragment in per_rank[name], (name, per_rank[name])


def test_opcheck_on_gloo(pool):
    for per_rank in pool.run(opcheck_worker):
        for result in per_rank:
            assert set(result.values()) == {"SUCCESS"}, result


# ------------------------------------------------------------------------------------------ one process


def test_block_geometry_cuts_every_grouped_row_once_in_block_order():
    index = torch.tensor([3, 0, 4, 1, 5, 2, 6])  # 7 rows of y into 7 send rows; blocks of 2, 3, 2 rows
    blocks = geo.plan_blocks(index, [2, 5, 6], [2, 3, 2])  # experts: rows [0,2) [2,5) [5,6); row 6 in no expert
    assert [(b.lo, b.hi) for b in blocks] == [(0, 2), (2, 5), (5, 7)]
    seen = []
    for b in blocks:
        for s in b.segments:
            rows = s.row_ids().tolist()
            seen += rows
            assert all(b.lo <= int(index[r]) < b.hi for r in rows)
            assert (s.dest + b.lo).tolist() == index[s.row_ids()].tolist()
    assert sorted(seen) == list(range(6))  # row 6 is past the last offset: written nowhere
    assert geo.block_order(4, 1) == [2, 3, 0, 1] and geo.block_order(1, 0) == [0]
    assert geo.normalize_index(torch.tensor([-1, 0]), 3).tolist() == [2, 0]
    with pytest.raises(IndexError):
        geo.normalize_index(torch.tensor([3]), 3)
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
