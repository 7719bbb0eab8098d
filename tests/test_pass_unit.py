"""FlashOverlapPass on hand-traced graphs (make_fx, no Inductor): forms Dynamo rarely emits, the internal
shape safety net, and the counters/skip-reason bookkeeping."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from unittest import mock

import torch
from pass_harness import FakePGTestCase, check_equivalent, graph_str
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import run_tests

import flashoverlap_inductor.passes as passes
from flashoverlap_inductor.passes import FlashOverlapPass, counters, gemm_collective, report

c10d = torch.ops._c10d_functional


def _trace(fn, *args) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """(original, rewritten) graphs of ``fn`` under fuse mode "always"."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    before = copy.deepcopy(gm)
    FlashOverlapPass({"fuse": "always"})(gm.graph)
    gm.recompile()
    return before, gm


class TestHandTracedForms(FakePGTestCase):
    def test_narrow_cat_reduce_scatter(self):
        """funcol's unbacked-size form of reduce_scatter over dim 1: slice/cat instead of split/getitem/cat."""

        def fn(x, w):
            y = (x.view(16, 16) @ w).view(2, 8, 32)
            z = torch.cat([y.narrow(1, 0, 4), y.narrow(1, 4, 4)])
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", 2, "0"))

        before, after = _trace(fn, torch.randn(2, 8, 16), torch.randn(16, 32))
        self.assertEqual(dict(counters), {"fused:reduce_scatter": 1})
        self.assertExpectedInline(graph_str(after), """\
def forward(self, x_1, w_1):
    view = aten.view.default(x_1, [16, 16])
    reshape_default = aten.reshape.default(view, [2, 2, 4, -1])
    permute_default = aten.permute.default(reshape_default, [1, 0, 2, 3])
    reshape_default_1 = aten.reshape.default(permute_default, [-1, 16])
    gemm_reduce_scatter_default = flashoverlap.gemm_reduce_scatter.default(reshape_default_1, w_1, None, 'sum', 2, '0', 'plan(m=16,n=32)')
    reshape_default_2 = aten.reshape.default(gemm_reduce_scatter_default, [2, 4, 32])
    return reshape_default_2""")  # noqa: E501
        check_equivalent(self, before, after)

    def test_pieces_not_one_per_rank_are_refused(self):
        """4 pieces for 2 ranks is not funcol's form: refused (skip:scatter_dim), graph untouched."""

        def fn(x, w):
            y = (x @ w).view(2, 8, 32)
            z = torch.cat([y.narrow(1, 2 * i, 2) for i in range(4)])
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", 2, "0"))

        with self.assertLogs("flashoverlap", level="INFO"):
            before, after = _trace(fn, torch.randn(16, 16), torch.randn(16, 32))
        self.assertEqual(dict(counters), {"skip:scatter_dim": 1})
        self.assertEqual(graph_str(after), graph_str(before))

    def test_chain_of_views(self):
        """Several views in a row ([16,32] -> [4,4,32] -> [2,2,4,32]) and a view-typed (not reshape) chain."""

        def fn(x, w):
            y = (x @ w).view(4, 4, 32).view(2, 2, 4, 32)
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 2, "0"))

        before, after = _trace(fn, torch.randn(16, 16), torch.randn(16, 32))
        self.assertEqual(dict(counters), {"fused:reduce_scatter": 1})
        self.assertIn("aten.reshape.default(gemm_reduce_scatter_default, [1, 2, 4, 32])", graph_str(after))
        check_equivalent(self, before, after)

    def test_shape_safety_net_rolls_back(self):
        """If the checks let through a rewrite whose result shape differs from the collective's, the new nodes
        are removed again and the match is skipped with a WARNING (never a wrong graph)."""

        def wrong_out_shape(self_, f, t):
            f.out_shape = [4, -1]
            return True

        fn = lambda x, w: c10d.wait_tensor(c10d.all_reduce((x @ w).view(2, 4, 32), "sum", "0"))
        with mock.patch.object(FlashOverlapPass, "_set_out_shape", wrong_out_shape), \
                self.assertLogs("flashoverlap", level="WARNING") as logs:
            before, after = _trace(fn, torch.randn(8, 16), torch.randn(16, 32))
        self.assertEqual(dict(counters), {"skip:shape_mismatch": 1})
        self.assertEqual(graph_str(after), graph_str(before))
        self.assertIn("result shape [4, 64] != collective's [2, 4, 32]", "\n".join(logs.output))


    def test_a_bug_in_the_checks_costs_the_fusion_not_the_compilation(self):
        def broken(self_, f):
            raise RuntimeError("boom")

        fn = lambda x, w: c10d.wait_tensor(c10d.all_reduce(x @ w, "sum", "0"))
        with mock.patch.object(FlashOverlapPass, "_check_geometry", broken), \
                self.assertLogs("flashoverlap", level="WARNING") as logs:
            before, after = _trace(fn, torch.randn(8, 16), torch.randn(16, 32))
        self.assertEqual(dict(counters), {"skip:internal_error": 1})
        self.assertEqual(graph_str(after), graph_str(before))
        self.assertIn("RuntimeError('boom')", "\n".join(logs.output))


class TestBookkeeping(FakePGTestCase):
    def test_counters_are_one_live_object(self):
        self.assertIs(passes.counters, report.counters)
        passes.counters["x"] += 1
        held = passes.counters
        passes.reset_counters()
        self.assertIs(passes.counters, held)
        self.assertEqual(dict(held), {})

    def test_every_skip_slug_is_documented(self):
        source = "".join(p.read_text() for p in Path(gemm_collective.__file__).parent.glob("*.py"))
        used = set(re.findall(r'(?:_skip|_fail|record_skip)\("(\w+)"', source))
        self.assertTrue(used, "no skip slugs found")
        self.assertLessEqual(used, set(report.SKIP_REASONS))
        with self.assertRaises(KeyError):
            report.record_skip("not_a_reason", "x")


if __name__ == "__main__":
    run_tests()
