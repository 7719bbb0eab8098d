"""Ranks whose compiled graphs disagree fail clearly on every rank (2 gloo ranks, CPU).

Before the first run of every graph the backend compiled, its ranks exchange the collectives it will issue
(``passes.manifest``, ``routes.agree.check_graph``). Cases, each a tensor-parallel GEMM -> all_reduce compiled on
both ranks:

* fuse: rank 0 compiles with ``fuse="always"`` (a fused ``gemm_all_reduce``), rank 1 with ``fuse="never"`` (mm, then
  a plain all_reduce). Before, both hung until gloo's timeout;
* plan: both fuse, but rank 1's cost model fails (as with a broken data folder), so its op carries plan "auto"
  where rank 0's carries the cost model's plan;
* agree: both ranks alike: no error, the result as eager's.

Every rank must raise ``RankMismatch`` within seconds, naming the first differing collective and what each rank has;
the next, correctly configured compile and run on the same ranks must work.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import DistPool, get_pool


def _gpus() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - any failure to probe means: skip
        return 0


def mismatch_worker(case: str, cuda: bool = False) -> dict:
    import torch.distributed._functional_collectives as funcol

    from flashoverlap_inductor import cost_model
    from flashoverlap_inductor.backend import flashoverlap_backend
    from flashoverlap_inductor.errors import RankMismatch

    rank, g = dist.get_rank(), dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 48, generator=gen)
    x = torch.randn(64, 32, generator=gen) + rank
    if cuda:  # NCCL: the exchange runs on the GPU
        dev = torch.device("cuda", torch.cuda.current_device())
        w, x = w.to(dev, torch.bfloat16), x.to(dev, torch.bfloat16)

    def layer(x, w):
        return funcol.all_reduce(x @ w, "sum", g).relu()

    want = layer(x, w)
    options = {"flashoverlap.fuse": "always"}
    if case == "fuse" and rank == 1:
        options = {"flashoverlap.fuse": "never"}
    if case == "paths" and rank == 1:  # a node-local library path differs: not a disagreement on what runs
        options = {"flashoverlap.fuse": "always", "flashoverlap.library": "/elsewhere/libflashoverlap_sm90.so"}
    decide = cost_model.decide
    if case == "plan" and rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("no data file")
        cost_model.decide = broken
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        got = torch.compile(layer, backend=flashoverlap_backend, options=options)(x, w)
        first = "ran, " + ("correct" if torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2) else "WRONG")
    except RankMismatch as exc:
        first = f"RankMismatch: {exc}"
    finally:
        cost_model.decide = decide
    seconds = time.perf_counter() - start
    torch._dynamo.reset()  # the next run, configured alike on every rank
    got = torch.compile(layer, backend=flashoverlap_backend, options={"flashoverlap.fuse": "always"})(x, w)
    return {"first": first, "seconds": seconds,
            "next": bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))}


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("case", ["fuse", "plan"])
def test_ranks_that_compile_differently_raise_rank_mismatch_on_every_rank(pool, case):
    results = pool.run(mismatch_worker, case, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["first"].startswith("RankMismatch"), (rank, r)
        assert "collective #1" in r["first"] and "rank 0" in r["first"] and "rank 1" in r["first"], r["first"]
        assert r["seconds"] < 60, r  # compile included; a hang would last until the group's timeout (120 s)
        assert r["next"], r
    text = results[0]["first"]
    if case == "fuse":
        assert "flashoverlap.gemm_all_reduce" in text and "_c10d_functional.all_reduce" in text, text
    else:
        assert "with plan=" in text and "plan=\"auto\"" in text, text


@pytest.mark.parametrize("case", ["agree", "paths"])
def test_ranks_that_agree_run(pool, case):
    """Alike ranks run; so do ranks whose settings differ only in a path (then the next run, under the same settings
    on every rank, reuses what was agreed on rank 0 and agrees anew on rank 1: it hung before)."""
    for r in pool.run(mismatch_worker, case, timeout_s=120):
        assert r["first"] == "ran, correct" and r["next"], r


def test_a_call_with_no_rows_keeps_plan_auto():
    """Plan "auto" of a call with no rows stays "auto" (nothing to cut; the op returns its empty result)."""
    from flashoverlap_inductor import config, routes

    a = torch.empty(0, 8)
    assert routes.resolve_plan("all_reduce", "auto", a, [0, 4], dist.group.WORLD if dist.is_initialized() else
                               _FakeGroup(), config.current(), False) == "auto"


class _FakeGroup:
    def size(self) -> int:
        return 2


@pytest.mark.skipif(_gpus() < 2, reason="needs >= 2 CUDA GPUs")
def test_on_two_gpus_over_nccl():
    """The same cases over NCCL, one GPU per rank (bf16; without the kernel library the fused op runs unfused, which
    changes nothing here: the graphs and their agreement are the same)."""
    pool = DistPool(2, backend="nccl")
    try:
        for case in ("fuse", "plan", "agree"):
            for rank, r in enumerate(pool.run(mismatch_worker, case, True, timeout_s=300)):
                want = "ran, correct" if case == "agree" else "RankMismatch"
                assert r["first"].startswith(want) and r["next"] and r["seconds"] < 60, (case, rank, r)
    finally:
        pool.close()
