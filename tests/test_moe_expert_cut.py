"""The MoE dispatch cut by expert (``routes/moe_expert_cut.py``, plan ``"experts"`` / ``"experts:c=N"``) on 2 and 3
gloo ranks: taken where the whole-block path would be, equal to the unfused reference bit for bit (each expert's
rows round as the graph's one ``torch._grouped_mm`` rounds them; every output pre-filled with NaN by
``torch.use_deterministic_algorithms``, so a row a piece forgets poisons the comparison); empty blocks and 3 ranks; a
rank on the general path (same transfers: plan ``"blocks:c=N"``'s) interoperates; a rank whose premise fails makes
every rank redo the call; a GEMM fault in a piece raises on every rank and the next call is exact; the pieces'
expert bounds from the routing (``moe_fast.pieces_with_torch``, ``BlockPlan``'s ``pieces``); the combine under an
expert plan sends whole blocks (its whole-block path).

    python3 -m pytest -q tests/test_moe_expert_cut.py
"""

from __future__ import annotations

import pytest
import test_dispatch_op as td
import test_moe_fast as tm
import torch
import torch.distributed as dist
from dist_utils import get_pool

from flashoverlap_inductor import routes
from flashoverlap_inductor.routes import moe_fast
from flashoverlap_inductor.schedule.combine import cuts_by_expert, parse_plan

COUNTERS = ("experts", "fast", "redo")


def cut_worker(kinds_by_rank: list[str], forms: list[str], seeds: list[int], plan: str,
               mutate_by_rank: list[str | None] | None = None) -> dict[str, int]:
    """Each (form, seed) under ``plan`` with this rank's index kind (and ``test_moe_fast._mutate``'s change): the
    dispatch equals the reference bit for bit; returns this rank's path counters."""
    torch.use_deterministic_algorithms(True)
    g, rank = dist.group.WORLD, dist.get_rank()
    before = {k: routes.stats[f"dispatch:{k}"] for k in COUNTERS}
    kind, how = kinds_by_rank[rank], (mutate_by_rank or [None] * dist.get_world_size())[rank]
    for form in forms:
        for seed in seeds:
            c = tm._mutate(tm._case("dispatch", form, kind, seed), how)
            got, want = td._call(c, g, plan), td._reference(c, g)
            where = f"{plan} {form} {kind} {how} seed {seed}"
            assert len(got) == len(want), where
            for x, y in zip(got, want, strict=True):
                assert x.shape == y.shape and torch.equal(x, y), where
    return {k: routes.stats[f"dispatch:{k}"] - v for k, v in before.items()}


def combine_worker(plan: str) -> int:
    """The combine under an expert plan: whole blocks (no expert cut there), the reference's result bit for bit;
    returns how many calls took the whole-block path."""
    torch.use_deterministic_algorithms(True)
    before = routes.stats["combine:fast"]
    for seed in (1, 2):
        c = tm._case("combine", "grouped", "moe", seed)
        got, want = tm._call("combine", c, plan), tm._reference("combine", c)
        assert torch.equal(got[0], want[0]), seed
    return routes.stats["combine:fast"] - before


def layout_worker(layout: str) -> dict[str, int]:
    """Weights as ``[E, K, N]`` contiguous (``"kn"``: the backward's form, the library's ``b_layout`` 1) or with
    padded rows (``"padded"``: no layout of the library's, so every rank runs the plan as "blocks", the whole-block
    path), bit for bit as the reference either way."""
    torch.use_deterministic_algorithms(True)
    g = dist.group.WORLD
    before = {k: routes.stats[f"dispatch:{k}"] for k in COUNTERS}
    for seed in (1, 2):
        c = tm._case("dispatch", "grouped", "moe", seed)
        if layout == "kn":
            c["b"] = [w.contiguous() for w in c["b"]]
        else:
            c["b"] = [torch.cat([w, w[..., :8]], -1)[..., :w.shape[-1]] for w in c["b"]]
        got, want = td._call(c, g, "experts"), td._reference(c, g)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), seed
    return {k: routes.stats[f"dispatch:{k}"] - v for k, v in before.items()}


def fault_worker(bad_rank: int) -> tuple[str, str]:
    """A piece's grouped GEMM raises on ``bad_rank`` in the middle of a cut call (its second GEMM of four): every rank
    raises (its own error, ``PeerFailure`` on the others), no rank returns a tensor; the next call is exact."""
    from unittest import mock

    from flashoverlap_inductor import errors
    from flashoverlap_inductor.native import grouped

    torch.use_deterministic_algorithms(True)
    g = dist.group.WORLD
    c = tm._case("dispatch", "grouped2", "moe", 9)
    real, seen = grouped.grouped_mm, []

    def flaky(*args, **kwargs):
        seen.append(1)
        if dist.get_rank() == bad_rank and len(seen) == 2:
            raise RuntimeError("injected GEMM fault")
        return real(*args, **kwargs)

    with mock.patch.object(grouped, "grouped_mm", flaky):
        try:
            td._call(c, g, "experts")
            first = "no error"
        except errors.PeerFailure as exc:
            first = f"PeerFailure: {exc}"
        except RuntimeError as exc:
            first = f"RuntimeError: {exc}"
    got, want = td._call(c, g, "experts"), td._reference(c, g)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    return first, "next call exact"


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("plan,pieces", [("experts", 2), ("experts:c=3", 3), ("experts:c=1", 1)])
def test_the_plans(plan, pieces):
    assert parse_plan(plan, "dispatch") == pieces and cuts_by_expert(plan)
    assert not cuts_by_expert("blocks:c=2") and parse_plan("blocks:c=2", "dispatch") == 2
    with pytest.raises(ValueError, match="unknown dispatch plan"):
        parse_plan("experts:c=0", "dispatch")


@pytest.mark.parametrize("plan", ["experts", "experts:c=3"])
def test_the_moe_form_is_cut_by_expert_and_matches_the_reference_bit_for_bit(pool, plan):
    for counts in pool.run(cut_worker, ["moe", "moe"], ["grouped", "grouped2"], [1, 2, 3], plan):
        assert counts == {"experts": 6, "fast": 0, "redo": 0}, counts


@pytest.mark.parametrize("world", [2, 3])
def test_empty_blocks_and_three_ranks(world):
    for counts in get_pool(world).run(cut_worker, ["moe_empty"] * world, ["grouped", "grouped2"], [3], "experts"):
        assert counts == {"experts": 2, "fast": 0, "redo": 0}, counts
    if world == 3:
        for counts in get_pool(3).run(cut_worker, ["moe"] * 3, ["grouped"], [1, 2], "experts:c=4"):
            assert counts == {"experts": 2, "fast": 0, "redo": 0}, counts


def test_a_rank_on_the_general_path_interoperates(pool):
    """Rank 1's index is longer than its buffer (repeats): it takes the general path with the same chunked
    transfers; rank 0 cuts by expert; both match the reference."""
    got = pool.run(cut_worker, ["moe", "dup"], ["grouped"], [1, 2], "experts")
    assert got[0] == {"experts": 2, "fast": 0, "redo": 0}, got
    assert got[1] == {"experts": 0, "fast": 0, "redo": 0}, got


@pytest.mark.parametrize("how", ["twice", "no_group"])
def test_a_rank_outside_the_premise_makes_every_rank_redo(pool, how):
    for counts in pool.run(cut_worker, ["moe", "moe"], ["grouped"], [1, 2], "experts", [None, how]):
        assert counts == {"experts": 0, "fast": 0, "redo": 2}, counts


def test_piece_bounds_take_the_experts_complete_in_every_block():
    """3 experts, 2 blocks (block 0 the own one, block 1 cut into 2 chunks of 5 and 4 rows): block 1's expert ends
    are 3, 3, 9, so after its first chunk experts 0 and 1 are complete there; block 0 is local (all complete)."""
    table = torch.tensor([[2, 2, 7, 0], [3, 3, 9, 0]], dtype=torch.int32)  # the routing this test states
    bounds = moe_fast.pieces_with_torch(table, [[7, 7], [5, 9]], 3, torch.device("cpu"))
    assert bounds.tolist() == [0, 2, 3] and bounds.dtype == torch.int32
    bounds = moe_fast.pieces_with_torch(table, [[7, 7, 7], [2, 5, 9]], 3, torch.device("cpu"))
    assert bounds.tolist() == [0, 0, 2, 3]  # the first chunk holds no whole expert: an empty first piece
    # a plan built with cuts carries them: a real routing (expert rows 0-4 expert 0, 5-15 expert 2; blocks of 7 and 9
    # rows: tables [5, 5, 7] and [0, 0, 9]), block 1 cut after 5 rows: experts 0 and 1 complete everywhere
    index, offs = torch.arange(16), torch.tensor([5, 5, 16], dtype=torch.int32)
    plan = moe_fast.BlockPlan(index, offs, [7, 9], [[7, 7], [5, 9]])
    assert plan.table[:, :3].tolist() == [[5, 5, 7], [0, 0, 9]] and plan.pieces.tolist() == [0, 2, 3]
    assert moe_fast.BlockPlan(index, offs, [7, 9]).pieces is None


def test_the_combine_sends_whole_blocks_under_an_expert_plan(pool):
    assert pool.run(combine_worker, "experts:c=3") == [2, 2]


def test_the_backwards_weight_layout_is_cut_and_others_run_the_plan_as_blocks_on_every_rank(pool):
    assert pool.run(layout_worker, "kn") == [{"experts": 2, "fast": 0, "redo": 0}] * 2
    assert pool.run(layout_worker, "padded") == [{"experts": 0, "fast": 2, "redo": 0}] * 2


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_fault_in_a_piece_raises_on_every_rank_and_the_next_call_is_exact(pool, bad_rank):
    for rank, (first, after) in enumerate(pool.run(fault_worker, bad_rank)):
        assert first.startswith("RuntimeError: injected" if rank == bad_rank else "PeerFailure"), (rank, first)
        assert after == "next call exact"
