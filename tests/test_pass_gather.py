"""all_gather -> GEMMs in the pass (``passes/all_gather.py``): the dim-0 and the sequence-dim (funcol split/cat)
forms, several GEMMs sharing one gather, bias, the gathered tensor kept for other users, weights computed late, and
what is left alone (no GEMM, a GEMM behind another op, "auto" on small sizes). Each rewrite is checked for
equivalence by simulating the collectives (``pass_harness``)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from pass_harness import FakePGTestCase, graph_str
from torch.testing._internal.common_utils import run_tests

from flashoverlap_inductor import cost_model
from flashoverlap_inductor.passes import counters, report

H, N1, N2 = 32, 48, 16


class TestAllGatherGemm(FakePGTestCase):
    def test_dim0_gather_feeding_two_gemms_fuses_once(self):
        g = self.group

        def fn(x, w1, w2):
            full = funcol.all_gather_tensor(x, 0, g)
            return full @ w1, torch.relu(full @ w2)

        (gm,), _ = self.capture(fn, torch.randn(8, H), torch.randn(H, N1), torch.randn(H, N2))
        code = graph_str(gm)
        self.assertEqual(code.count("flashoverlap.all_gather_gemm"), 1)
        self.assertNotIn("all_gather_into_tensor", code)
        self.assertNotIn("aten.mm", code)
        self.assertIn(", 0, 2, '0', 'ring', False", code)  # gather_dim 0, 2 ranks, plan, no gathered result
        self.assertEqual(dict(counters), {"fused:all_gather": 1})
        self.assert_rewrites_equivalent()

    def test_sequence_dim_gather_with_bias_and_a_kept_gathered_tensor(self):
        """DTensor's sequence parallelism: [batch, seq/w, hidden] shards gathered along dim 1 (funcol's split/cat),
        flattened to rows, three Linears (one with bias); the gathered tensor is also used elsewhere."""
        g = self.group

        def fn(x, wq, wk, wv, bv):  # the gather along dim 1 as DTensor and funcol emit it (torch 2.11's dynamo does
            # not trace funcol.all_gather_tensor(x, 1, g) itself)
            full = torch.cat(funcol.all_gather_tensor(x, 0, g).chunk(2, 0), dim=1)
            rows = full.view(-1, H)
            return rows @ wq, rows @ wk, F.linear(rows, wv, bv), full.sum()

        (gm,), _ = self.capture(fn, torch.randn(2, 4, H), torch.randn(H, N1), torch.randn(H, N2),
                                torch.randn(N2, H), torch.randn(N2))
        code = graph_str(gm)
        self.assertEqual(code.count("flashoverlap.all_gather_gemm"), 1)
        self.assertNotIn("aten.cat", code)
        self.assertNotIn("aten.addmm", code)
        self.assertIn(", 1, 2, '0', 'ring', True", code)  # gather_dim 1, the gathered tensor returned
        self.assertEqual(dict(counters), {"fused:all_gather": 1})
        self.assert_rewrites_equivalent()

    def test_backward_weight_gradient_reads_the_gathered_tensor(self):
        """Sequence-parallel row-parallel backward: the gathered output gradient feeds dx = dy @ W (fused) and
        dW = x^T @ dy (the gathered tensor as B: not a consumer; it reads the op's gathered result)."""
        g = self.group

        def fn(dy, x, w):
            full = funcol.all_gather_tensor(dy, 0, g)
            return full @ w, x.t() @ full

        (gm,), _ = self.capture(fn, torch.randn(8, N1), torch.randn(16, H), torch.randn(N1, H))
        code = graph_str(gm)
        self.assertEqual(code.count("flashoverlap.all_gather_gemm"), 1)
        self.assertEqual(code.count("aten.mm"), 1)  # the weight gradient
        self.assertIn("'ring', True", code)
        self.assert_rewrites_equivalent()

    def test_no_gemm_or_a_gemm_behind_another_op_is_left_alone(self):
        g = self.group

        def fn(x, w):
            a = funcol.all_gather_tensor(x, 0, g)
            b = funcol.all_gather_tensor(x * 2, 0, g)
            return a.sum(), torch.relu(b) @ w

        (gm,), _ = self.capture(fn, torch.randn(8, H), torch.randn(H, N1))
        code = graph_str(gm)
        self.assertNotIn("flashoverlap", code)
        self.assertEqual(code.count("= c10d.all_gather_into_tensor.default("), 2)
        self.assertEqual(dict(counters), {"skip:no_gemm_consumer": 1, "near_miss:relu": 1})

    def test_auto_declines_small_sizes_and_leaves_the_graph(self):
        g = self.group

        def fn(x, w):
            return funcol.all_gather_tensor(x, 0, g) @ w

        (gm,), _ = self.capture(fn, torch.randn(8, H), torch.randn(H, N1), fuse="auto")
        self.assertNotIn("flashoverlap", graph_str(gm))
        self.assertEqual(dict(counters), {"skip:too_small": 1})

    def test_collectives_setting_turns_it_off(self):
        g = self.group

        def fn(x, w):
            return funcol.all_gather_tensor(x, 0, g) @ w

        (gm,), _ = self.capture(fn, torch.randn(8, H), torch.randn(H, N1),
                                options={"flashoverlap.collectives": "all_reduce,reduce_scatter"})
        self.assertNotIn("flashoverlap", graph_str(gm))
        self.assertEqual(dict(counters), {"skip:collective_disabled": 1})

    def test_one_gemm_between_a_gather_and_a_reduce_scatter_fuses_one_side(self):
        g = self.group

        def fn(x, w):
            return funcol.reduce_scatter_tensor(funcol.all_gather_tensor(x, 0, g) @ w, "sum", 0, g)

        (gm,), _ = self.capture(fn, torch.randn(8, H), torch.randn(H, N1))
        code = graph_str(gm)
        self.assertEqual(code.count("flashoverlap.gemm_reduce_scatter"), 1)
        self.assertEqual(dict(counters), {"fused:reduce_scatter": 1, "skip:gemm_taken": 1})
        self.assert_rewrites_equivalent()

    def test_chained_and_nested_gathers_each_fuse(self):
        """A rewrite erases nodes that a later gather's match read (its shard is the first op's output, or the
        first gather's result): each gather is matched just before it is decided."""
        g = self.group

        def chain(x, w1, w2):
            y = funcol.all_gather_tensor(x, 0, g) @ w1
            return funcol.all_gather_tensor(y, 0, g) @ w2

        (gm,), _ = self.capture(chain, torch.randn(8, H), torch.randn(H, H), torch.randn(H, N2))
        self.assertEqual(graph_str(gm).count("flashoverlap.all_gather_gemm"), 2)
        self.assertEqual(dict(counters), {"fused:all_gather": 2})
        self.assert_rewrites_equivalent()

        def nested(x, w1, w2):
            a = funcol.all_gather_tensor(x, 0, g)
            return a @ w1, funcol.all_gather_tensor(a, 0, g) @ w2

        counters.clear()
        (gm,), _ = self.capture(nested, torch.randn(8, H), torch.randn(H, H), torch.randn(H, N2))
        self.assertEqual(graph_str(gm).count("flashoverlap.all_gather_gemm"), 2)
        self.assert_rewrites_equivalent()

    def test_a_weight_computed_from_the_gathered_rows_is_left_alone(self):
        g = self.group

        def gram(x):
            full = funcol.all_gather_tensor(x, 0, g)
            return full @ full.t(), full @ full

        (gm,), _ = self.capture(gram, torch.randn(H // 2, H))
        self.assertNotIn("flashoverlap", graph_str(gm))
        self.assertEqual(dict(counters), {"skip:weight_reads_gathered": 1})
        self.assert_rewrites_equivalent()

    def test_skip_reasons_are_known(self):
        for slug in ("no_gemm_consumer", "inputs_after_use", "gemm_taken", "weight_reads_gathered"):
            self.assertIn(slug, report.SKIP_REASONS)


class TestGatherCostModel(torch.testing._internal.common_utils.TestCase):
    def test_large_gathers_pay_small_ones_do_not(self):
        big = cost_model.decide_gather(16384, [14336 // 2], 4096, "bfloat16", 2)
        small = cost_model.decide_gather(256, [512], 4096, "bfloat16", 2)
        self.assertTrue(big.fuse, big.reason)
        self.assertLess(big.predicted_fused_ms, big.predicted_seq_ms)
        self.assertFalse(small.fuse, small.reason)
        self.assertEqual(big.plan, "ring")

    def test_world_one_and_bad_rows_decline(self):
        self.assertIn("world size 1", cost_model.decide_gather(4096, [4096], 4096, "bfloat16", 1).reason)
        self.assertIn("do not divide", cost_model.decide_gather(4097, [4096], 4096, "bfloat16", 2).reason)

    def test_copy_engine_route_is_never_slower_than_nccl(self):
        for rows in (2048, 8192, 32768):
            nccl = cost_model.decide_gather(rows, [4096], 4096, "bfloat16", 4, route="nccl")
            peer = cost_model.decide_gather(rows, [4096], 4096, "bfloat16", 4, route="peer")
            self.assertLessEqual(peer.predicted_fused_ms, nccl.predicted_fused_ms)


if __name__ == "__main__":
    run_tests()
