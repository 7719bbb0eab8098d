"""MoE ops under ``fuse="auto"``: one verdict per op for the whole group, agreed through the group's store
(``passes/moe_verdict.py``), so a rank never fuses where another does not.

* the store's first-writer-wins agreement, what it records with the graph and its re-check of a graph loaded from
  Inductor's cache, through the backend's per-graph hook (one process, a ``HashStore``);
* the e2e harness's ``ep`` plan of tiny-moe on 2 gloo ranks, compiled vs eager (loss and every gradient): under data
  whose terms make every MoE op pay, all four ops (forward dispatch and combine, and their backward forms) fuse on
  every rank, their symbolic rows resolved through the graph's runtime assertions; with ranks of different token
  counts whose own verdicts differ (one under ``min_rows``, one over; torchtitan's block, whose ranks may route
  different token counts), both take the group's one verdict and match eager.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from dist_utils import get_pool

from flashoverlap_inductor import errors
from flashoverlap_inductor.passes import moe_verdict

pytest.importorskip("transformers")

from test_combine_pass import ep_model_worker as combine_ep_model_worker  # noqa: E402  (after the importorskip)
from test_dispatch_pass import _DispatchRun, _paying_data  # noqa: E402

FUSED_ALL = {"fused:all_to_all_dispatch": 2, "fused:all_to_all_combine": 2}


@pytest.fixture
def store(monkeypatch):
    """Every group's store is one ``HashStore`` (the group's own prefix left out)."""
    from flashoverlap_inductor import _inductor_compat as compat

    shared = dist.HashStore()
    monkeypatch.setattr(compat, "resolve_group", lambda name: name)
    monkeypatch.setattr(compat, "group_store", lambda group: shared)
    monkeypatch.setattr(moe_verdict, "_held", {})  # this process's memo of the group's verdicts, fresh too
    return shared


def test_the_first_verdict_offered_holds_for_every_later_offer(store, monkeypatch):
    before = moe_verdict.snapshot()
    monkeypatch.setattr(moe_verdict, "_held", {})
    first = moe_verdict.agreed("g", "dispatch|x", True, 4096)
    later = moe_verdict.agreed("g", "dispatch|x", False, 8)  # another rank (or recompilation) with fewer rows
    other = moe_verdict.agreed("g", "combine|x", False, None)  # another op: a verdict of its own
    assert (first.fuse, first.rows, first.own) == (True, 4096, True)
    assert (later.fuse, later.rows, later.own) == (True, 4096, False)
    assert "adopted" in later.describe() and "4096 rows per rank" in later.describe()
    assert (other.fuse, other.rows, other.own) == (False, None, True)
    assert json.loads(store.get(moe_verdict.STORE_PREFIX + "dispatch|x")) == [True, 4096]
    # what the graph was built with is recorded for cache loads: the held verdicts, not the offers
    assert sorted(moe_verdict.take(before)) == [("g", "combine|x", False, None), ("g", "dispatch|x", True, 4096)]


def test_a_graph_loaded_with_a_verdict_the_group_does_not_hold_raises_at_each_run(store):
    """What an FX-graph cache hit does: the pass does not run, Inductor replays the compilation's counters (the
    verdict it was built with), and the backend's per-graph hook offers it to the store again; the graph then raises
    at each run, before anything of it runs (a raise at compile time could fall back to eager under Dynamo's
    ``suppress_errors``, beside fused peers)."""
    from types import SimpleNamespace

    from flashoverlap_inductor import _inductor_compat as compat
    from flashoverlap_inductor import backend
    from flashoverlap_inductor.passes import manifest

    moe_verdict.agreed("g", "combine|z", False, 64)  # the group's verdict, from a rank that compiled
    ran = []
    graph = SimpleNamespace(current_callable=lambda inputs: ran.append(inputs))
    for compiled in (graph, object()):  # an Inductor output it knows, and one it does not (raised at once)
        watched = SimpleNamespace(before=manifest.snapshot(), verdicts_before=moe_verdict.snapshot())
        compat.inductor_counters()[moe_verdict.VERDICT_PREFIX + json.dumps(["g", "combine|z", True, 64])] += 1
        if compiled is graph:
            backend._agree_first("forward", compiled, watched)
            for _ in range(2):
                with pytest.raises(errors.RankMismatch, match="combine.*was fused under fuse='auto'.*has run"):
                    compiled.current_callable([1])
            assert ran == []
        else:
            with pytest.raises(errors.RankMismatch, match="agreed to decline"):
                backend._agree_first("forward", compiled, watched)


def test_conflicts_takes_an_unknown_verdict_and_names_another(store):
    assert moe_verdict.conflicts([("g", "dispatch|y", False, 64)]) == ""  # first in its job: its verdict holds
    assert json.loads(store.get(moe_verdict.STORE_PREFIX + "dispatch|y")) == [False, 64]
    assert moe_verdict.conflicts([("g", "dispatch|y", False, 9)]) == ""  # the same verdict at other rows
    assert "was fused under fuse='auto', but group g agreed to decline" in \
        moe_verdict.conflicts([("g", "dispatch|y", True, 64)])


def test_the_store_is_asked_once_per_op_and_a_failing_store_fails_the_compilation(store, monkeypatch):
    from flashoverlap_inductor import _inductor_compat as compat
    from flashoverlap_inductor import config
    from flashoverlap_inductor.passes import moe_pass

    asked = []
    real = moe_verdict._offer
    monkeypatch.setattr(moe_verdict, "_offer", lambda *a: asked.append(a) or real(*a))
    for _ in range(3):
        assert moe_verdict.agreed("g", "dispatch|once", True, 8).fuse
    assert len(asked) == 1  # the group's verdict never changes: one round trip per op and group

    def broken(group):
        raise RuntimeError("store timed out")

    monkeypatch.setattr(compat, "group_store", broken)
    problem = moe_pass.MoeProblem(4096, ((2048, 768),), 64, "bfloat16", 2, None)
    with pytest.raises(RuntimeError, match="store timed out"):  # never a silent decline on this rank alone
        moe_pass.decide("combine", "a combine", "g2", config.Settings(fuse="auto"), lambda: problem)
    with pytest.raises(errors.FlashOverlapError, match="cannot name the MoE op"):
        moe_pass.decide("combine", "a combine", "g2", config.Settings(fuse="auto"), lambda: 1 / 0)


@pytest.fixture(scope="module")
def pool():
    return get_pool()


def _auto_worker(batches_by_rank: list[int], options: dict) -> dict:
    """The harness's ep plan under ``auto`` at this rank's batch size, vs eager, with the verdict lines logged."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("flashoverlap")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        got = combine_ep_model_worker("tiny-moe", [batches_by_rank[dist.get_rank()]], "auto", False,
                                      run_cls=_DispatchRun, seed=3, options=options)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return {**got, "verdicts": [line.split("(the group's verdict, ")[1].split(")")[0] for line in lines
                                if "the group's verdict" in line]}


def test_auto_fuses_every_moe_op_on_every_rank_where_the_model_predicts_a_gain(pool, tmp_path):
    """Terms under which every MoE op pays: the forward dispatch (static rows) and the combine and both backward
    forms (rows symbolic, ``u0 + u1``, which the graph asserts equal to the 32 token rows) fuse alike."""
    options = {"flashoverlap.config_dir": _paying_data(tmp_path), "flashoverlap.min_rows": 0}
    got = pool.run(_auto_worker, [2, 2], options, timeout_s=600)
    for rank in got:
        assert rank["pass"] == FUSED_ALL, got
        assert rank["calls"] == rank["combine_calls"] == 2, got
        assert rank["verdicts"] == ["fuse, first given at 32 rows per rank; this rank's own is the same"] * 4, got


def _titan_auto_worker(tokens_by_rank: list[int], options: dict) -> dict:
    """torchtitan's expert-parallel block (``TitanStyleMoE``: 4 experts, top-2, bf16) under ``auto`` with this
    rank's token count: compiled vs eager output and gradients (``_block_vs_eager``), the pass's counters and the
    verdict lines."""
    import logging

    from test_combine_pass import TitanStyleMoE
    from test_dispatch_pass import _block_vs_eager

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("flashoverlap")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    ref = TitanStyleMoE(64, 32, 4, 2, dist.group.WORLD).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(29 + dist.get_rank())
    x, dy = (torch.randn(tokens_by_rank[dist.get_rank()], 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    try:
        report = _block_vs_eager(ref, x, dy, options={"flashoverlap.fuse": "auto", **options})
    finally:
        log.removeHandler(handler)
    return {**report, "verdicts": [line.split("(the group's verdict, ")[1].split(")")[0] for line in lines
                                   if "the group's verdict" in line]}


def test_ranks_with_different_token_counts_take_the_groups_one_verdict(pool, tmp_path):
    """Rank 0 routes 16 tokens x top-2 = 32 rows, rank 1 16; ``min_rows=24``: rank 0's own verdict fuses, rank 1's
    declines. A verdict from each rank's own rows would pair a fused op with a plain all_to_all (a hang, or gloo's
    size mismatch); the group's one verdict (whichever rank offered first) holds on both, and both match eager."""
    options = {"flashoverlap.config_dir": _paying_data(tmp_path), "flashoverlap.min_rows": 24}
    got = pool.run(_titan_auto_worker, [16, 8], options, timeout_s=600)
    assert got[0]["pass"] == got[1]["pass"] and got[0]["calls"] == got[1]["calls"], got
    held = [[v.split(";")[0] for v in r["verdicts"]] for r in got]  # "fuse, first given at 32 rows per rank"
    assert held[0] == held[1] and len(held[0]) == 4, got  # the forward's two ops and the backward's two
    for verdict, mine, theirs in zip(held[0], got[0]["verdicts"], got[1]["verdicts"], strict=True):
        decider = 0 if "32 rows" in verdict else 1
        assert verdict.startswith("fuse" if decider == 0 else "decline"), got  # the deciding rank's own verdict
        assert ("adopted" in (theirs if decider == 0 else mine)) and "adopted" not in (mine, theirs)[decider], got
