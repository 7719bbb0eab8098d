"""The MoE ops' whole-block path (``routes/moe_fast.py``) on 2 and 3 gloo ranks: taken where each rank's routing data
have the MoE layers' form (bf16, grouped, plan ``"blocks"``), equal to the unfused reference; every rank redoes the
call unfused where any rank's premise fails (a rank whose index is not expert-sorted per block, or not a
permutation); a rank on the general path (an index longer than the buffer) interoperates with one on this path;
an index entry out of bounds or decreasing offsets raise on their rank and ``PeerFailure`` on the others; a fault in
the middle of a call raises on every rank and the next call is exact.

Every case runs under ``torch.use_deterministic_algorithms(True)`` (``torch.empty`` filled with NaN): a row the path
forgets to compute or gather poisons the comparison.
"""

from __future__ import annotations

from unittest import mock

import pytest
import test_combine_op as tc
import test_dispatch_op as td
import torch
import torch.distributed as dist
from dist_utils import get_pool

from flashoverlap_inductor import errors, routes
from flashoverlap_inductor.routes import combine as combine_route
from flashoverlap_inductor.routes import moe_fast

BF16 = torch.bfloat16


def _case(op: str, form: str, kind: str, seed: int) -> dict:
    """``make_case`` of the op's test module; kind "moe_empty": the MoE form with some blocks empty."""
    g = dist.group.WORLD
    empty = kind == "moe_empty"
    return (tc if op == "combine" else td).make_case(form, "moe" if empty else kind, BF16, seed, g.size(), g.rank(),
                                                     empty)


def _call(op: str, c: dict, plan: str = "blocks") -> list[torch.Tensor]:
    g = dist.group.WORLD
    if op == "dispatch":
        return td._call(c, g, plan)
    return [torch.ops.flashoverlap.gemm_unpermute_all_to_all(c["a"], c["b"], c["offs"], c["index"], c["accumulate"],
                                                             c["outs"], c["ins"], g.group_name, plan)]


def _reference(op: str, c: dict) -> list[torch.Tensor]:
    g = dist.group.WORLD
    if op == "dispatch":
        return td._reference(c, g)
    return [combine_route.reference(c["a"], c["b"], c["offs"], c["index"], c["accumulate"], c["outs"], c["ins"], g)]


def _same(got: list[torch.Tensor], want: list[torch.Tensor], where: str) -> None:
    assert len(got) == len(want), where
    for x, y in zip(got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, where
        torch.testing.assert_close(x, y, rtol=1.6e-2, atol=5e-2, msg=lambda m: f"{where}: {m}")


def _mutate(c: dict, how: str | None) -> dict:
    """This rank's case changed so that its whole-block premise fails while the op stays well defined: "twice" (one
    entry named twice, one row unnamed: same length), "no_group" (the last expert row in no group)."""
    if how is None:
        return c
    c = dict(c)
    if how == "twice" and c["index"].shape[0] >= 2:
        c["index"] = c["index"].clone()
        c["index"][1] = c["index"][0]
    elif how == "no_group" and int(c["offs"][-1]) > 0:  # the trailing equal offsets one less: still non-decreasing
        c["offs"] = torch.where(c["offs"] == c["offs"][-1], c["offs"] - 1, c["offs"])
    return c


def path_worker(op: str, kinds_by_rank: list[str], forms: list[str], seeds: list[int],
                mutate_by_rank: list[str | None] | None = None, exact: bool = False, n: int | None = None
                ) -> dict[str, int]:
    """Each (form, seed) with this rank's index kind ``kinds_by_rank[rank]`` (and ``_mutate``'s change
    ``mutate_by_rank[rank]``; ``n``: the GEMMs' N): the op equals the reference (``exact``: bit for bit); returns the
    path counters of this rank (``<op>:fast``, ``<op>:redo``, ``<op>:p2p``)."""
    torch.use_deterministic_algorithms(True)
    before = {k: routes.stats[f"{op}:{k}"] for k in ("fast", "redo", "p2p")}
    rank = dist.get_rank()
    kind, how = kinds_by_rank[rank], (mutate_by_rank or [None] * dist.get_world_size())[rank]
    mod = tc if op == "combine" else td
    saved = mod.N
    mod.N = n or saved
    try:
        for form in forms:
            for seed in seeds:
                c = _mutate(_case(op, form, kind, seed), how)
                if op == "combine" and "dup" in kinds_by_rank:
                    c["accumulate"] = True  # as "dup" needs (repeated rows summed): the same on every rank
                got, want = _call(op, c), _reference(op, c)
                where = f"{op} {form} {kind} {how} seed {seed}"
                if exact:
                    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), where
                _same(got, want, where)
    finally:
        mod.N = saved
    return {k: routes.stats[f"{op}:{k}"] - v for k, v in before.items()}


def library_moves_worker() -> tuple[dict[str, int], list[int]]:
    """The dispatch with its per-block moves handed to ``moe_plan_lib.move_rows`` (a stand-in doing what the library
    call does, ``dst[inv[r]] = src[r]`` per pair, with torch ops: no GPU here): the pairs and indices it is given make
    the reference's outputs bit for bit. Returns the path counters and the moves of each call it got."""
    from flashoverlap_inductor.routes import moe_plan_lib

    calls = []

    def move_rows(inv, moves):
        calls.append(len(moves))
        for dst, src in moves:
            dst.index_copy_(0, inv, src)
        return True

    saved = moe_plan_lib.usable, moe_plan_lib.should_move, moe_plan_lib.move_rows
    moe_plan_lib.usable, moe_plan_lib.should_move, moe_plan_lib.move_rows = (lambda like: True), \
        (lambda inv, moves: True), move_rows
    try:
        counts = path_worker("dispatch", ["moe", "moe"], ["grouped", "grouped2"], [1, 2], None, True)
    finally:
        moe_plan_lib.usable, moe_plan_lib.should_move, moe_plan_lib.move_rows = saved
    return counts, calls


def bad_data_worker(op: str, bad_rank: int, what: str) -> tuple[str, str]:
    """``bad_rank``'s index gets an entry past its buffer (``what`` "index") or its offsets a decrease ("offs"):
    this call's outcome per rank, then whether the next (good) call is exact."""
    torch.use_deterministic_algorithms(True)
    rank = dist.get_rank()
    c = _case(op, "grouped", "moe", 7)
    bad = dict(c)
    if rank == bad_rank and what == "index":
        bad["index"] = c["index"].clone()
        bad["index"][0] = c["index"].shape[0] + 3
    elif rank == bad_rank and what == "offs":
        bad["offs"] = c["offs"].clone()
        bad["offs"][0] = c["offs"][-1] + 1  # the first expert's end past the next ones'
    elif rank == bad_rank:
        bad["offs"] = c["offs"].clone()
        bad["offs"][-1] = c["index"].shape[0] + 2  # past the rows: the unfused _grouped_mm would fault on CUDA
    try:
        _call(op, bad)
        first = "no error"
    except errors.PeerFailure as exc:
        first = f"PeerFailure: {exc}"
    except (IndexError, ValueError) as exc:
        first = f"{type(exc).__name__}: {exc}"
    _same(_call(op, c), _reference(op, c), "next call")
    return first, "next call exact"


def fault_worker(op: str, bad_rank: int) -> tuple[str, str]:
    """A grouped GEMM that raises on ``bad_rank`` in the middle of a whole-block call: every rank raises; the next
    call is exact."""
    torch.use_deterministic_algorithms(True)
    c = _case(op, "grouped2", "moe", 9)  # two terms: two grouped GEMMs per block
    real, seen = torch._grouped_mm, []

    def flaky(*args, **kwargs):
        seen.append(1)
        if dist.get_rank() == bad_rank and len(seen) == 2:
            raise RuntimeError("injected GEMM fault")
        return real(*args, **kwargs)

    with mock.patch.object(moe_fast.torch, "_grouped_mm", flaky):
        try:
            _call(op, c)
            first = "no error"
        except errors.PeerFailure as exc:
            first = f"PeerFailure: {exc}"
        except RuntimeError as exc:
            first = f"RuntimeError: {exc}"
    _same(_call(op, c), _reference(op, c), "next call")
    return first, "next call exact"


def host_reads_worker(op: str) -> dict[str, int]:
    """The tensor-to-host reads of one whole-block call (``tolist``, ``item``, ``cpu``, ``bool``/``int``/``float``
    of a tensor), counted by wrapping them: on CUDA each is a host sync. The settle's one read is the only one."""
    c = _case(op, "grouped2", "moe", 4)
    _call(op, c)  # warm: the first call of a kind exchanges the ranks' agreement digests
    counts: dict[str, int] = {}
    names = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__")
    patches = []
    for name in names:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(self, *args, **kwargs)

        patches.append(mock.patch.object(torch.Tensor, name, counted))
    fast = routes.stats[f"{op}:fast"]
    for patch in patches:
        patch.start()
    try:
        _call(op, c)
    finally:
        for patch in patches:
            patch.stop()
    assert routes.stats[f"{op}:fast"] == fast + 1
    return counts


# ------------------------------------------------------------------------------------------ 2-process tests


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_moe_form_takes_the_whole_block_path_and_matches_the_reference(pool, op):
    """Bit for bit: each block's grouped GEMM and the gathers round as the unfused graph does."""
    forms = ["grouped", "grouped2"]
    for counts in pool.run(path_worker, op, ["moe", "moe"], forms, [1, 2, 3], None, True):
        assert counts == {"fast": 6, "redo": 0, "p2p": 6}, counts


def test_the_dispatch_hands_each_blocks_moves_to_the_library_in_one_call(pool):
    """With the library (the default; not under ``moe_plan_triton``) a block's row move and its GEMM results' moves
    are one ``fo_moe_move_rows`` call."""
    for counts, calls in pool.run(library_moves_worker):
        assert counts == {"fast": 4, "redo": 0, "p2p": 4}, counts
        assert set(calls) == {2, 3}, calls  # per non-empty block: its rows and 1 (grouped) or 2 (grouped2) results


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_gemm_width_off_16_bytes_is_sent_whole(pool, op):
    """N = 12 in bf16: ``_grouped_mm`` pads its output rows to 16 bytes (a strided result); the combine sends the
    rows contiguous."""
    for counts in pool.run(path_worker, op, ["moe", "moe"], ["grouped"], [1, 2], None, False, 12):
        assert counts == {"fast": 2, "redo": 0, "p2p": 2}, counts


@pytest.mark.parametrize("op", ["combine", "dispatch"])
@pytest.mark.parametrize("how", ["twice", "no_group"])
def test_each_clause_of_the_premise_makes_every_rank_redo(pool, op, how):
    """Rank 1 names a row twice (and so leaves one unnamed) or leaves its last expert row out of every group: its
    premise fails, both ranks redo the call unfused, and both match the reference."""
    for counts in pool.run(path_worker, op, ["moe", "moe"], ["grouped"], [1, 2], [None, how]):
        assert counts == {"fast": 0, "redo": 2, "p2p": 2}, counts


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_general_path_rank_redoes_when_a_whole_block_rank_refuses(pool, op):
    """Rank 0 takes the whole-block path and fails its premise (a row named twice); rank 1 takes the general path
    (an index longer than its buffer): both redo the call unfused."""
    got = pool.run(path_worker, op, ["moe", "dup"], ["grouped"], [1, 2], ["twice", None])
    assert got == [{"fast": 0, "redo": 2, "p2p": 2}] * 2, got


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_one_rank_outside_the_premise_makes_every_rank_redo_the_call(pool, op):
    """Rank 1's index is a random permutation (not expert-sorted per block): its premise fails; rank 0's holds, yet
    both redo the call unfused (the same answer from the settle), and both match the reference. (A random
    permutation of a few rows can be expert-sorted per block by chance: then both take the whole-block path.)"""
    got = pool.run(path_worker, op, ["moe", "perm"], ["grouped"], [1, 2, 3])
    assert got[0] == got[1] and got[0]["redo"] >= 2 and got[0]["fast"] + got[0]["redo"] == 3, got


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_a_rank_on_the_general_path_interoperates_with_one_on_the_whole_block_path(pool, op):
    """Rank 1's index is longer than its buffer (repeats): it takes the general path, rank 0 the whole-block one;
    their transfers and settle pair up."""
    got = pool.run(path_worker, op, ["moe", "dup"], ["grouped"], [1, 2])
    assert got[0] == {"fast": 2, "redo": 0, "p2p": 2}, got
    assert got[1] == {"fast": 0, "redo": 0, "p2p": 2}, got


@pytest.mark.parametrize("world", [2, 3])
def test_empty_blocks_and_three_ranks(world):
    """Some blocks empty (a rank sending a peer nothing, on 3 ranks a pair exchanging nothing): their GEMMs and
    transfers are left out on both sides alike; and the plain MoE form on 3 ranks (ring order)."""
    for op in ("combine", "dispatch"):
        for counts in get_pool(world).run(path_worker, op, ["moe_empty"] * world, ["grouped", "grouped2"], [3]):
            assert counts == {"fast": 2, "redo": 0, "p2p": 2}, counts
    if world == 3:
        for op in ("combine", "dispatch"):
            for counts in get_pool(3).run(path_worker, op, ["moe"] * 3, ["grouped", "grouped2"], [1, 2]):
                assert counts == {"fast": 4, "redo": 0, "p2p": 4}, counts


@pytest.mark.parametrize("op", ["combine", "dispatch"])
@pytest.mark.parametrize("what,error", [("index", "IndexError: flashoverlap"), ("offs", "ValueError: flashoverlap"),
                                        ("offs_past", "ValueError: flashoverlap")])
def test_bad_routing_data_raise_on_their_rank_and_peer_failure_on_the_other(pool, op, what, error):
    for rank, (first, after) in enumerate(pool.run(bad_data_worker, op, 1, what)):
        assert first.startswith(error if rank == 1 else "PeerFailure"), (rank, first)
        assert after == "next call exact"


@pytest.mark.parametrize("op", ["combine", "dispatch"])
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_fault_in_the_middle_raises_on_every_rank_and_the_next_call_is_exact(pool, op, bad_rank):
    for rank, (first, after) in enumerate(pool.run(fault_worker, op, bad_rank)):
        assert first.startswith("RuntimeError: injected" if rank == bad_rank else "PeerFailure"), (rank, first)
        assert after == "next call exact"


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_the_whole_block_path_reads_the_device_once_per_call(pool, op):
    for counts in pool.run(host_reads_worker, op):
        assert counts == {"tolist": 1}, counts


def test_the_model_error_allowance():
    """all_to_all on the NCCL route needs its model's error (predictions) or its spread (tuned plans' measured times),
    doubled on another GPU's data; other collectives and routes need none; a verdict adds it to min_gain."""
    from flashoverlap_inductor.cost_model import gain

    assert gain.model_error("all_to_all", None, True) == pytest.approx(0.067)
    assert gain.model_error("all_to_all", "nccl", False) == pytest.approx(2 * 0.067)
    assert gain.model_error("all_to_all", None, True, measured=True) == pytest.approx(0.03)
    assert gain.model_error("all_to_all", "peer", True) == 0.0
    assert gain.model_error("all_reduce", None, False) == 0.0
    assert gain.verdict(0.95, 1.0, 8192, 0.03, 1024, "s")[0]  # 5% gain >= 3%
    fuse, why = gain.verdict(0.95, 1.0, 8192, 0.03, 1024, "s", 0.067)
    assert not fuse and "error allowance 0.067" in why


def test_eligibility():
    assert moe_fast.eligible(True, BF16, 1, 10, 10)
    assert not moe_fast.eligible(True, torch.float32, 1, 10, 10)  # no grouped kernel: one mm per expert run
    assert not moe_fast.eligible(True, BF16, 2, 10, 10)  # "blocks:c=2": chunks are the general path's
    assert not moe_fast.eligible(True, BF16, 1, 12, 10)  # an index longer than the buffer
    assert not moe_fast.eligible(False, BF16, 1, 10, 10)  # the loop form
