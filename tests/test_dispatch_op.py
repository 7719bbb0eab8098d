"""The fused MoE dispatch op (``flashoverlap::all_to_all_permute_gemm``) on 2 and 3 gloo ranks: the P2P route's
ring schedule (one unit per source and ring step, or several with ``"blocks:c=N"``) against the unfused reference
(``routes.moe_dispatch.reference``: one ``all_to_all_single``, one ``index``, the GEMMs) on random uneven splits, for
the per-expert loop and ``torch._grouped_mm`` (one term, and torchtitan's two terms sharing the rows), a permutation
as the MoE forms make it, a random permutation and duplicate / negative indices, split sizes with empty blocks
(``test_combine_op.split_counts``); the failure contract; validation; the fake implementation and ``opcheck``.

Every 2-process case runs under ``torch.use_deterministic_algorithms(True)``, which fills ``torch.empty`` with NaN:
a row the schedule forgets to receive, gather or compute poisons the comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import get_pool
from test_combine_op import _split, run_cases, split_counts

from flashoverlap_inductor.routes import moe_dispatch as dispatch_route

K, N, E = 16, 24, 3
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 5e-2}}


# ------------------------------------------------------------------------------------------ helpers (all ranks)


def make_case(form: str, index_kind: str, dtype: torch.dtype, seed: int, world: int, rank: int,
              empty: bool = False) -> dict:
    """One call's arguments on ``rank``: uneven split sizes shared by construction (``counts[i][j]`` rows go from rank
    i to rank j, some 0; ``empty``: chosen pairs empty: ``split_counts``), this rank's rows, the permutation by expert
    and the experts' weights."""
    counts = split_counts(seed, world, empty)
    ins, outs = counts[rank].tolist(), counts[:, rank].tolist()
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    recv_rows = sum(outs)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    if index_kind == "moe":  # received rows are source-major (source i, then expert e); sorted by expert, stably
        per = torch.tensor([_split(n, E, gen) for n in outs])  # [world, E]
        expert_of_row = torch.arange(E).repeat(world).repeat_interleave(per.flatten())
        index, sizes = expert_of_row.argsort(stable=True), per.sum(0).tolist()
    elif index_kind == "perm":
        index = torch.randperm(recv_rows, generator=gen)
        sizes = _split(recv_rows, E, gen)
    else:  # "dup": more rows than received, repeated and negative indices; the loop's pieces leave 2 rows out
        rows = recv_rows + 5
        index = torch.randint(0, max(recv_rows, 1), (rows,), generator=gen) if recv_rows else \
            torch.zeros(0, dtype=torch.int64)
        index = index - recv_rows * (torch.rand(index.shape[0], generator=gen) < 0.3)
        sizes = _split(max(index.shape[0] - 2, 0), E, gen)
    x = rnd(sum(ins), K)
    if form == "loop":
        b, offs = [rnd(N, K).t() for _ in sizes], None  # the transposed weights of the MoE graphs
    else:
        terms = 2 if form == "grouped2" else 1
        b = [rnd(E, N, K).transpose(-2, -1) for _ in range(terms)]
        offs, sizes = torch.tensor(sizes).cumsum(0).to(torch.int32), None
    return {"x": x, "index": index, "b": b, "sizes": sizes, "offs": offs, "outs": outs, "ins": ins}


def _call(c: dict, g, plan: str = "blocks") -> list[torch.Tensor]:
    return torch.ops.flashoverlap.all_to_all_permute_gemm(c["x"], c["index"], c["b"], c["sizes"], c["offs"],
                                                          c["outs"], c["ins"], g.group_name, plan)


def _reference(c: dict, g) -> list[torch.Tensor]:
    return dispatch_route.reference(c["x"], c["index"], c["b"], c["sizes"], c["offs"], c["outs"], c["ins"], g)


def op_worker(forms: list[str], index_kinds: list[str], dtype_name: str, seeds: list[int], plan: str = "blocks",
              empty: bool = False) -> int:
    """Every (form, index kind, seed): the fused op under ``plan`` equals the unfused reference on this rank; returns
    the count."""
    g = dist.group.WORLD

    keep = not plan.endswith("+no_rows")

    def check(c: dict, dtype: torch.dtype, where: str) -> None:
        got, want = _call(c, g, plan), _reference(c, g)
        assert len(got) == len(want) == 1 + len(c["b"]), where
        assert got[0].shape == ((c["index"].shape[0] if keep else 0), K), (where, got[0].shape)
        if not keep:  # p not returned: the GEMMs' results only
            got, want = got[1:], want[1:]
        for x, y in zip(got, want, strict=True):
            assert x.dtype == dtype and x.shape == y.shape, where
            torch.testing.assert_close(x, y, **TOL[dtype], msg=lambda m, w=where: f"{w}: {m}")

    return run_cases("dispatch", make_case, check, forms, index_kinds, dtype_name, seeds, plan, empty)

def failure_worker(bad_rank: int) -> tuple[str, str]:
    """A GEMM that raises on ``bad_rank`` in the middle of a call: every rank raises; the next call is exact."""
    from unittest import mock


    g = dist.group.WORLD
    c = make_case("loop", "moe", torch.float32, 5, g.size(), g.rank())
    real = dispatch_route.DispatchUnits.compute
    seen = []

    def flaky(self, v, recv):
        seen.append(v)
        if g.rank() == bad_rank and len(seen) == 2:
            raise RuntimeError("injected GEMM fault")
        return real(self, v, recv)

    with mock.patch.object(dispatch_route.DispatchUnits, "compute", flaky):
        first = _outcome(lambda: _call(c, g), RuntimeError)
    return first, _next_call_exact(c, g)


def _outcome(call, expected: type[Exception]) -> str:
    """What ``call()`` did on this rank: "no error", "PeerFailure: ..." or "<expected's name>: ..."."""
    from flashoverlap_inductor import errors

    try:
        call()
        return "no error"
    except errors.PeerFailure as exc:
        return f"PeerFailure: {exc}"
    except expected as exc:
        return f"{expected.__name__}: {exc}"


def _next_call_exact(c: dict, g) -> str:
    for x, y in zip(_call(c, g), _reference(c, g), strict=True):
        torch.testing.assert_close(x, y)
    return "next call exact"


def bad_index_worker() -> tuple[str, str]:
    """An index out of range on rank 1 only (per-rank data): raised there after every transfer, PeerFailure on rank
    0; the next call is exact."""

    g = dist.group.WORLD
    c = make_case("grouped", "moe", torch.bfloat16, 2, g.size(), g.rank())
    bad = dict(c, index=c["index"] + (10_000 if g.rank() == 1 else 0))
    return _outcome(lambda: _call(bad, g), IndexError), _next_call_exact(c, g)


def bad_inputs_worker() -> dict[str, str]:
    g = dist.group.WORLD
    fo = torch.ops.flashoverlap
    x, idx, b = torch.randn(4, K), torch.arange(4), [torch.randn(K, N)]
    name = g.group_name
    cases = {
        "sizes": lambda: fo.all_to_all_permute_gemm(x, idx, b + b, [4], None, [2, 2], [2, 2], name, "blocks"),
        "dtype": lambda: fo.all_to_all_permute_gemm(x, idx, [b[0].double()], [4], None, [2, 2], [2, 2], name,
                                                    "blocks"),
        "index": lambda: fo.all_to_all_permute_gemm(x, idx.float(), b, [4], None, [2, 2], [2, 2], name, "blocks"),
        "splits": lambda: fo.all_to_all_permute_gemm(x, idx, b, [4], None, [4], [4], name, "blocks"),
        "self": lambda: fo.all_to_all_permute_gemm(x, idx, b, [4], None, [1, 3], [3, 1], name, "blocks"),
        "plan": lambda: fo.all_to_all_permute_gemm(x, idx, b, [4], None, [2, 2], [2, 2], name, "v1;x"),
        "chunks": lambda: fo.all_to_all_permute_gemm(x, idx, b, [4], None, [2, 2], [2, 2], name, "blocks:c=99"),
        "offs": lambda: fo.all_to_all_permute_gemm(x, idx, [torch.randn(2, K, N)], None, torch.tensor([1, 4]),
                                                   [2, 2], [2, 2], name, "blocks"),
    }
    out = {}
    for key, fn in cases.items():
        try:
            fn()
            out[key] = "NO ERROR"
        except (ValueError, RuntimeError) as exc:
            out[key] = str(exc)
    dist.barrier()  # still in step: nothing was half-sent
    return out


def opcheck_worker() -> list[dict]:
    g = dist.group.WORLD
    results = []
    for form in ("loop", "grouped2"):
        c = make_case(form, "moe", torch.bfloat16 if form != "loop" else torch.float32, 3, g.size(), g.rank())
        args = (c["x"], c["index"], c["b"], c["sizes"], c["offs"], c["outs"], c["ins"], g.group_name, "blocks")
        results.append(torch.library.opcheck(torch.ops.flashoverlap.all_to_all_permute_gemm.default, args))
    return results


# ------------------------------------------------------------------------------------------ 2-process tests


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_loop_form_matches_the_reference_on_uneven_splits(pool, dtype_name):
    assert pool.run(op_worker, ["loop"], ["moe", "perm", "dup"], dtype_name, [1, 2, 3, 4]) == [12, 12]


def test_grouped_forms_match_the_reference_in_bf16(pool):
    assert pool.run(op_worker, ["grouped", "grouped2"], ["moe", "perm", "dup"], "bfloat16", [1, 2, 3]) == [18, 18]


def test_grouped_forms_without_a_grouped_mm_kernel_match_the_reference(pool):
    """fp32 (and fp16): one mm per (expert run, term) from the host counts, not _grouped_mm (``moe_p2p``)."""
    assert pool.run(op_worker, ["grouped", "grouped2"], ["moe", "perm", "dup"], "float32", [1, 2]) == [12, 12]


def test_three_ranks():
    """Three ranks: each arrival order starts at a different peer, splits uneven, one rank keeping none."""
    assert get_pool(3).run(op_worker, ["loop", "grouped"], ["moe", "dup"], "bfloat16", [1, 2]) == [8, 8, 8]


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
    for rank, (first, after) in enumerate(pool.run(failure_worker, bad_rank)):
        want = "RuntimeError: injected GEMM fault" if rank == bad_rank else "PeerFailure"
        assert first.startswith(want), (rank, first)
        assert after == "next call exact"


def test_a_bad_index_on_one_rank_raises_on_every_rank(pool):
    got = pool.run(bad_index_worker)
    assert got[0][0].startswith("PeerFailure") and got[1][0].startswith("IndexError"), got
    assert got[0][1] == got[1][1] == "next call exact"


def test_bad_inputs_raise_on_every_rank_before_any_transfer(pool):
    expect = {"sizes": "one expert size per b", "dtype": "share one dtype", "index": "1-D int64",
              "splits": "2 split sizes", "self": "sends itself", "plan": "unknown dispatch plan", "offs": "1-D int32",
              "chunks": "unknown dispatch plan"}
    for per_rank in pool.run(bad_inputs_worker):
        for name, fragment in expect.items():
            assert fragment in per_rank[name], (name, per_rank[name])


def test_opcheck_on_gloo(pool):
    for per_rank in pool.run(opcheck_worker):
        for result in per_rank:
            assert set(result.values()) == {"SUCCESS"}, result


# ------------------------------------------------------------------------------------------ one process


@pytest.mark.parametrize("plan", ["blocks+no_rows", "blocks:c=2+no_rows", "experts+no_rows"])
def test_a_plan_without_the_rows_returns_the_gemms_alone(pool, plan):
    """The suffix the pass adds where nothing but the GEMMs reads ``p``: ``p`` comes back as [0, K], every GEMM's
    result equal to the reference's, on every path (whole-block, chunked, the expert cut where it runs)."""
    assert pool.run(op_worker, ["loop", "grouped", "grouped2"], ["moe", "dup"], "bfloat16", [1, 2], plan) == [12, 12]


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, K))
        idx = mode.from_tensor(torch.arange(6))
        loop = torch.ops.flashoverlap.all_to_all_permute_gemm(
            x, idx, [mode.from_tensor(torch.randn(K, N)), mode.from_tensor(torch.randn(K, 8))], [2, 4], None,
            [3, 3], [3, 2], "0", "blocks")
        grouped = torch.ops.flashoverlap.all_to_all_permute_gemm(
            x, idx, [mode.from_tensor(torch.randn(E, K, N))], None, mode.from_tensor(torch.tensor([1, 3, 6],
                                                                                            dtype=torch.int32)),
            [3, 3], [3, 2], "0", "blocks")
    assert [tuple(t.shape) for t in loop] == [(6, K), (2, N), (4, 8)]
    assert [tuple(t.shape) for t in grouped] == [(6, K), (6, N)]
    with FakeTensorMode() as mode:
        dropped = torch.ops.flashoverlap.all_to_all_permute_gemm(
            mode.from_tensor(torch.randn(5, K)), mode.from_tensor(torch.arange(6)),
            [mode.from_tensor(torch.randn(E, K, N))], None,
            mode.from_tensor(torch.tensor([1, 3, 6], dtype=torch.int32)), [3, 3], [3, 2], "0", "blocks+no_rows")
    assert [tuple(t.shape) for t in dropped] == [(0, K), (6, N)]
