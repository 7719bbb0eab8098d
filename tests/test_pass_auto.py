"""Fuse mode "auto" and the cost-model contract of FlashOverlapPass.

The decision logic is tested in isolation with ``cost_model.decide`` replaced by a recording fake (so the tests do
not depend on bandwidth numbers); two tests use the real cost model end to end (its plan reaches the op
unchanged; a large bf16 GEMM is fused under "auto").
"""

# ruff: noqa: E501  (expected graphs are printed one statement per line)
from __future__ import annotations

import logging
from unittest import mock

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from pass_harness import FakePGTestCase, fused_lines, graph_str
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import run_tests

from flashoverlap_inductor import config, cost_model
from flashoverlap_inductor.passes import FlashOverlapPass, counters
from flashoverlap_inductor.schedule.plan import uniform_plan

c10d = torch.ops._c10d_functional


class FakeDecide:
    """Stands in for ``cost_model.decide``: records every call, answers ``fuse`` with a fixed uniform plan."""

    def __init__(self, fuse: bool = True, error: Exception | None = None) -> None:
        self.fuse, self.error, self.calls = fuse, error, []

    def __call__(self, collective, m, n, k, dtype, world_size, *, device_name=None, input_split_sizes=None,
                 peer=False, ring_rounds=0, pull=False, cuda_graphs=False, settings=None):
        self.calls.append(dict(collective=collective, m=m, n=n, k=k, dtype=dtype, world_size=world_size,
                               device_name=device_name, input_split_sizes=input_split_sizes, peer=peer,
                               ring_rounds=ring_rounds, cuda_graphs=cuda_graphs, pull=pull))
        if self.error is not None:
            raise self.error
        self.plan = uniform_plan(m, n, 64, 32, 2)
        verdict = "fast" if self.fuse else "slow"
        return cost_model.Decision(self.fuse, self.plan, 1.0, 2.0 if self.fuse else 0.5, f"fake verdict: {verdict}")


class TestAutoDecision(FakePGTestCase):
    def setUp(self):
        super().setUp()
        self.decide = FakeDecide()
        patcher = mock.patch.object(cost_model, "decide", self.decide)
        patcher.start()
        self.addCleanup(patcher.stop)

    def _all_reduce(self, rows: int):
        g = self.group
        return (lambda x, w: funcol.all_reduce(x @ w, "sum", g)), torch.randn(rows, 16), torch.randn(16, 32)

    def test_too_small(self):
        """Under auto, fewer rows than config.min_rows are skipped before the cost model is asked."""
        with self.assertLogs("flashoverlap", level="INFO") as logs:
            (gm,), _ = self.capture(*self._all_reduce(16), fuse="auto")
        self.assertNotIn("flashoverlap", graph_str(gm))
        self.assertEqual(dict(counters), {"skip:too_small": 1})
        self.assertIn("16 rows < config.min_rows=256", "\n".join(logs.output))
        self.assertEqual(self.decide.calls, [])

    def test_min_rows_option(self):
        (gm,), _ = self.capture(*self._all_reduce(16), fuse="auto", options={"flashoverlap.min_rows": 8})
        self.assertEqual(dict(counters), {"fused:all_reduce": 1})
        self.assertEqual(len(self.decide.calls), 1)

    def test_cost_model_declines(self):
        self.decide.fuse = False
        with self.assertLogs("flashoverlap", level="INFO") as logs:
            (gm,), _ = self.capture(*self._all_reduce(512), fuse="auto")
        self.assertNotIn("flashoverlap", graph_str(gm))
        self.assertEqual(dict(counters), {"skip:cost_model": 1})
        self.assertIn("skip:cost_model: mm -> all_reduce -> wait_tensor at mm: fake verdict: slow",
                      "\n".join(logs.output))

    def test_cost_model_accepts_and_its_plan_reaches_the_op(self):
        (gm,), _ = self.capture(*self._all_reduce(512), fuse="auto")
        self.assertEqual(dict(counters), {"fused:all_reduce": 1})
        self.assertEqual(self.decide.calls, [dict(collective="all_reduce", m=512, n=32, k=16, dtype="float32",
                                                  world_size=2, device_name=None, input_split_sizes=None,
                                                  peer=False, ring_rounds=0, cuda_graphs=False,
                                                  pull=False)])  # CPU: never the peer or pull route
        (op,) = gm.graph.find_nodes(op="call_function", target=torch.ops.flashoverlap.gemm_all_reduce.default)
        self.assertEqual(op.args[-2], self.decide.plan.to_str())
        self.assertEqual(op.args[-1], config.current().replace(fuse="auto").key())  # the settings it runs under

    def test_cuda_graph_compiles_tell_the_cost_model(self):
        """Compiled for CUDA graphs (Inductor's triton.cudagraphs), the pass asks for replayed calls."""
        from flashoverlap_inductor import _inductor_compat as compat

        with mock.patch.object(compat.inductor_config().triton, "cudagraphs", True):
            self.capture(*self._all_reduce(512), fuse="auto")
        self.assertEqual([c["cuda_graphs"] for c in self.decide.calls], [True])

    def test_always_fuses_what_auto_declines(self):
        self.decide.fuse = False
        self.capture(*self._all_reduce(512), fuse="always")
        self.assertEqual(dict(counters), {"fused:all_reduce": 1})
        (op,) = self.after[0].graph.find_nodes(op="call_function",
                                               target=torch.ops.flashoverlap.gemm_all_reduce.default)
        self.assertEqual(op.args[-2], self.decide.plan.to_str())

    def test_auto_never_fuses_all_to_all(self):
        """A per-rank verdict could differ between ranks holding different rows: all_to_all needs "always"."""
        self.decide.error = AssertionError("decide must not be called for all_to_all under auto")
        g = self.group
        fn = lambda x, w: funcol.all_to_all_single(F.linear(x, w), [3, 3], [1, 3], g)
        (gm,), _ = self.capture(fn, torch.randn(4, 128, 16), torch.randn(32, 16), fuse="auto")
        self.assertEqual(dict(counters), {"skip:all_to_all_auto": 1})
        self.assertFalse(gm.graph.find_nodes(op="call_function", target=torch.ops.flashoverlap.gemm_all_to_all.default))

    def test_decide_gets_rows_and_row_splits_of_3d_all_to_all(self):
        """Split sizes count dim-0 elements of the collective input ([4, 128, N] -> 128 rows each)."""
        g = self.group
        fn = lambda x, w: funcol.all_to_all_single(F.linear(x, w), [3, 3], [1, 3], g)
        self.capture(fn, torch.randn(4, 128, 16), torch.randn(32, 16), fuse="always")
        self.assertEqual(dict(counters), {"fused:all_to_all": 1})
        call = self.decide.calls[0]
        self.assertEqual((call["collective"], call["m"], call["input_split_sizes"]), ("all_to_all", 512, [128, 384]))
        self.assertExpectedInline(fused_lines(self.after[0]), """gemm_all_to_all_default = flashoverlap.gemm_all_to_all.default(view, permute, None, [384, 384], [128, 384], '0', 'plan(m=512,n=32)')""")
        self.assert_rewrites_equivalent()

    def test_decide_gets_flattened_rows_of_bmm(self):
        g = self.group
        fn = lambda x, w: funcol.reduce_scatter_tensor(torch.bmm(x, w), "sum", 0, g)
        self.capture(fn, torch.randn(4, 128, 16), torch.randn(4, 16, 8), fuse="auto")
        self.assertEqual(dict(counters), {"fused:reduce_scatter": 1})
        call = self.decide.calls[0]
        self.assertEqual((call["collective"], call["m"], call["n"], call["k"]), ("reduce_scatter", 512, 8, 16))

    def test_symbolic_m_gets_plan_auto_without_asking(self):
        self.decide.error = AssertionError("decide must not be called for symbolic M")
        g = self.group
        x = torch.randn(600, 16)
        torch._dynamo.mark_dynamic(x, 0)
        (gm,), _ = self.capture(lambda x, w: funcol.all_reduce(x @ w, "sum", g), x, torch.randn(16, 32), fuse="auto")
        self.assertEqual(dict(counters), {"per_call:all_reduce": 1})  # plan "auto": decided at each call
        self.assertIn("'sum', '0', 'auto')", graph_str(gm))

    def test_cost_model_error_under_auto_skips(self):
        self.decide.error = RuntimeError("no curve")
        with self.assertLogs("flashoverlap", level="WARNING") as logs:
            (gm,), _ = self.capture(*self._all_reduce(512), fuse="auto")
        self.assertNotIn("flashoverlap", graph_str(gm))
        self.assertEqual(dict(counters), {"skip:cost_model_error": 1})
        self.assertIn("no curve", "\n".join(logs.output))

    def test_cost_model_error_under_always_uses_plan_auto(self):
        self.decide.error = RuntimeError("no curve")
        with self.assertLogs("flashoverlap", level="WARNING"):
            (gm,), _ = self.capture(*self._all_reduce(512), fuse="always")
        self.assertEqual(dict(counters), {"per_call:all_reduce": 1})  # plan "auto": decided at each call
        self.assertIn("'sum', '0', 'auto')", graph_str(gm))


class TestRealCostModel(FakePGTestCase):
    def test_always_uses_the_cost_model_plan(self):
        g = self.group
        (gm,), _ = self.capture(lambda x, w: funcol.all_reduce(x @ w, "sum", g), torch.randn(8, 16),
                                torch.randn(16, 32), fuse="always")
        (op,) = gm.graph.find_nodes(op="call_function", target=torch.ops.flashoverlap.gemm_all_reduce.default)
        self.assertEqual(op.args[-2], cost_model.decide("all_reduce", 8, 32, 16, "float32", 2).plan.to_str())

    def test_auto_fuses_a_large_bf16_gemm(self):
        """An 8192^3 bf16 GEMM + all_reduce (fake tensors, no memory): the real cost model predicts a gain."""
        fn = lambda x, w: c10d.wait_tensor(c10d.all_reduce(x @ w, "sum", "0"))
        with FakeTensorMode():
            x = torch.empty(8192, 8192, dtype=torch.bfloat16)
            w = torch.empty(8192, 8192, dtype=torch.bfloat16)
        gm = make_fx(fn, tracing_mode="fake")(x, w)
        decision = cost_model.decide("all_reduce", 8192, 8192, 8192, "bfloat16", 2)
        with self.assertLogs("flashoverlap", level=logging.INFO) as logs:
            FlashOverlapPass({"fuse": "auto"})(gm.graph)
        if not decision.fuse:
            self.skipTest(f"the shipped cost model declines this GEMM ({decision.reason})")
        self.assertEqual(dict(counters), {"fused:all_reduce": 1})
        (op,) = gm.graph.find_nodes(op="call_function", target=torch.ops.flashoverlap.gemm_all_reduce.default)
        self.assertEqual(op.args[-2], decision.plan.to_str())
        self.assertIn(decision.reason, "\n".join(logs.output))


if __name__ == "__main__":
    run_tests()
