"""The experiment ``shadow_check`` (``routes/shadow.py``): the comparison itself on made-up results (errors, rows off
per block, a non-finite result, a shape that differs, an output the fused op does not return), and on 2 gloo ranks
the MoE ops' P2P route compared with its reference at each call: exact calls counted and never flagged, a block
corrupted on its way (the combine's send rows from rank 1) flagged on the receiving rank, with the block named."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from dist_utils import get_pool
from test_combine_op import make_case
from test_dispatch_op import make_case as make_dispatch_case

from flashoverlap_inductor import config
from flashoverlap_inductor.routes import combine as combine_route
from flashoverlap_inductor.routes import shadow, stats


@pytest.fixture(autouse=True)
def _fresh():
    shadow.collect()
    yield
    shadow.collect()


def test_an_exact_result_is_counted_and_not_flagged():
    ref = torch.randn(6, 8, dtype=torch.bfloat16)
    before = stats["shadow:op"], stats["shadow:op:bad"]
    shadow.compare("op", ref.clone(), lambda: ref, shadow.Spec(lambda: "exact", [2, 4]))
    shadow.compare("op", [ref[:0].clone(), ref.clone()], lambda: [ref[:0], ref], shadow.Spec())  # 0 rows
    shadow.compare("op", torch.empty(0, 8), lambda: torch.empty(0, 8), shadow.Spec())
    assert shadow.collect() == []
    assert (stats["shadow:op"], stats["shadow:op:bad"]) == (before[0] + 3, before[1])


def test_rows_off_are_counted_per_block_and_the_call_named(caplog):
    ref = torch.randn(6, 8)
    got = ref.clone()
    got[4] += 10  # a row of the second block
    with caplog.at_level(logging.WARNING, logger="flashoverlap"):
        shadow.compare("op", got, lambda: ref, shadow.Spec(lambda: "splits [2, 4]", [2, 4]))
        shadow.compare("op", ref.clone(), lambda: ref, shadow.Spec(lambda: "the next"))
        bad = shadow.collect()
    assert len(bad) == 1 and bad[0].startswith("op call ") and "(splits [2, 4])" in bad[0], bad
    assert "1 rows off (by block [0, 1])" in bad[0], bad
    assert "shadow check: op call" in caplog.text


def test_one_wrong_row_in_many_is_bad_though_the_norm_is_within_tolerance():
    ref = torch.randn(4096, 64, dtype=torch.bfloat16)
    got = ref.clone()
    got[123] *= 0.5  # a whole token row wrong: norm-wise 0.5 / sqrt(4096) = 0.008, within bf16's 0.031
    shadow.compare("op", got, lambda: ref, shadow.Spec(lambda: "one row"))
    bad = shadow.collect()
    assert len(bad) == 1 and "1 rows off" in bad[0], bad


def test_non_finite_misshapen_missing_or_extra_outputs_are_bad_and_skipped_ones_are_not():
    ref = [torch.randn(4, 8), torch.randn(4, 3)]
    nan = ref[1].clone()
    nan[0, 0] = float("nan")
    nan_ref = [ref[0], nan]
    shadow.compare("op", [torch.empty(0, 8), nan], lambda: ref, shadow.Spec(lambda: "nan", skip=(0,)))
    shadow.compare("op", [ref[0].clone(), torch.randn(3, 3)], lambda: ref, shadow.Spec(lambda: "shape"))
    shadow.compare("op", [torch.empty(0, 8), ref[1].clone()], lambda: ref, shadow.Spec(lambda: "no rows", skip=(0,)))
    shadow.compare("op", [torch.empty(0, 8), ref[1].clone()], lambda: ref, shadow.Spec(lambda: "not skipped"))
    shadow.compare("op", [ref[0].clone(), nan.clone()], lambda: nan_ref, shadow.Spec(lambda: "nan reference"))
    shadow.compare("op", [ref[0].clone()], lambda: ref, shadow.Spec(lambda: "one output"))
    bad = shadow.collect()
    assert len(bad) == 5, bad
    assert "(nan): output 1: rel err inf, 1 rows off" in bad[0] and "output 0" not in bad[0], bad
    assert "(shape): output 1: rel err inf" in bad[1] and "output 0" not in bad[1], bad
    assert "(not skipped): output 0: rel err inf, 4 rows off" in bad[2], bad
    assert "(nan reference): output 1: rel err inf" in bad[3], bad
    assert "(one output): 1 outputs, the reference 2" in bad[4], bad


def test_the_tolerance_is_each_outputs_dtypes():
    ref = torch.randn(64, 64)
    noisy = ref * (1 + 1e-3 * torch.randn_like(ref))  # off by 1e-3: a bf16 rounding, far past fp32's
    shadow.compare("op", noisy.bfloat16(), lambda: ref.bfloat16(), shadow.Spec(lambda: "bf16"))
    shadow.compare("op", [noisy.bfloat16(), noisy], lambda: [ref.bfloat16(), ref], shadow.Spec(lambda: "both"))
    bad = shadow.collect()
    assert len(bad) == 1 and "(both): output 1:" in bad[0] and "output 0" not in bad[0], bad


def test_a_comparison_that_raises_is_recorded_not_raised():
    class Odd:  # not a tensor: the comparison raises, the call goes on
        pass

    shadow.compare("op", [Odd()], lambda: [torch.ones(2, 2)], shadow.Spec(lambda: "odd"))
    bad = shadow.collect()
    assert len(bad) == 1 and "(odd): the comparison raised" in bad[0], bad


# ------------------------------------------------------------------------------------------ 2 gloo ranks


def moe_worker() -> tuple[int, int, list[str], list[str]]:
    """Two exact calls of each op, then a combine whose rows for rank 0 are corrupted on rank 1 (after its GEMM);
    returns the calls compared, those flagged before the corruption, and the lines of the exact and the bad part."""
    from unittest import mock

    g, rank = dist.group.WORLD, dist.get_rank()
    c = make_case("loop", "moe", torch.float32, 3, g.size(), rank)
    d = make_dispatch_case("grouped", "moe", torch.float32, 3, g.size(), rank)
    fo = torch.ops.flashoverlap
    before = stats["shadow:combine"] + stats["shadow:dispatch"]

    def combine():
        return fo.gemm_unpermute_all_to_all(c["a"], c["b"], c["offs"], c["index"], c["accumulate"], c["outs"],
                                            c["ins"], g.group_name, "blocks")

    with config.patch(experiments={shadow.EXPERIMENT}):
        for _ in range(2):
            combine()
            fo.all_to_all_permute_gemm(d["x"], d["index"], d["b"], d["sizes"], d["offs"], d["outs"], d["ins"],
                                       g.group_name, "blocks")
        exact = shadow.collect()
        compared = stats["shadow:combine"] + stats["shadow:dispatch"] - before
        real = combine_route.CombineUnits.fill

        def corrupt(self, u, send):
            real(self, u, send)
            if rank == 1 and u == 0:  # plan "blocks" on 2 ranks: unit 0 is the block for rank 0
                send.add_(100.0)

        with mock.patch.object(combine_route.CombineUnits, "fill", corrupt):
            combine()
        bad = shadow.collect()
    return compared, len(exact), exact, bad


def test_the_moe_ops_are_compared_at_each_call_and_a_corrupted_block_is_named():
    r0, r1 = get_pool(2).run(moe_worker)
    assert r0[:2] == (4, 0) and r1[:2] == (4, 0), (r0, r1)
    # (calls are numbered per process: the shared pool's processes ran other tests' calls before)
    assert len(r0[3]) == 1 and r0[3][0].startswith("combine call ") and "by block [0, " in r0[3][0], r0[3]
    assert "by block [0, 0]" not in r0[3][0], r0[3]
    assert r1[3] == [], r1[3]
