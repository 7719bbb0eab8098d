"""Negative cases of FlashOverlapPass: the graph is left exactly as it was, and the skip is counted and logged
with its reason. Fuse mode "always" (so only the check under test can refuse), except where a test says so."""

from __future__ import annotations

import os
from unittest import mock

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from pass_harness import FakePGTestCase, graph_str
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import run_tests

from flashoverlap_inductor import config
from flashoverlap_inductor.passes import FlashOverlapPass, counters

c10d = torch.ops._c10d_functional


class SkipTestCase(FakePGTestCase):
    def assert_skipped(self, slug: str, fn, *args, options: dict | None = None, fuse: str | None = "always",
                       count: int = 1) -> str:
        """Compile ``fn``; the post-pass graph has no fused op, the counters hold only ``skip:<slug>``, and the
        log names the reason. Returns the log text."""
        with self.assertLogs("flashoverlap", level="INFO") as logs:
            (gm,), _ = self.capture(fn, *args, options=options, fuse=fuse)
        code = graph_str(gm)
        self.assertNotIn("flashoverlap", code)
        self.assertIn("c10d.wait_tensor", code)
        self.assertEqual(dict(counters), {f"skip:{slug}": count})
        text = "\n".join(logs.output)
        self.assertIn(f"skip:{slug}", text)
        return text

    def run_pass_on(self, fn, *args, settings: dict | None = None) -> torch.fx.GraphModule:
        """make_fx-trace ``fn`` (fake tensors) and run the pass on it directly; checks the graph is unchanged."""
        gm = make_fx(fn, tracing_mode="fake")(*args)
        before = graph_str(gm)
        FlashOverlapPass({"fuse": "always", **(settings or {})})(gm.graph)
        gm.recompile()
        self.assertEqual(graph_str(gm), before)
        return gm


class TestSkips(SkipTestCase):
    def test_gemm_result_used_twice(self):
        g = self.group

        def fn(x, w):
            y = x @ w
            return funcol.all_reduce(y, "sum", g), y.sum()

        text = self.assert_skipped("multiple_users", fn, torch.randn(8, 16), torch.randn(16, 32))
        self.assertIn("mm has 2 users", text)

    def test_view_used_twice(self):
        g = self.group

        def fn(x, w):
            y = F.linear(x, w).view(2, 4, 32)
            return funcol.all_reduce(y, "sum", g), y.relu()

        self.assert_skipped("multiple_users", fn, torch.randn(8, 16), torch.randn(32, 16))

    def test_reduce_op_max(self):
        g = self.group
        text = self.assert_skipped("reduce_op", lambda x, w: funcol.all_reduce(x @ w, "max", g),
                                   torch.randn(8, 16), torch.randn(16, 32))
        self.assertIn("'max'", text)

    def test_dtype_float64(self):
        g = self.group
        text = self.assert_skipped("dtype", lambda x, w: funcol.all_reduce(x @ w, "sum", g),
                                   torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64))
        self.assertIn("float64", text)

    def test_dtype_not_in_configured_dtypes(self):
        g = self.group
        self.assert_skipped("dtype", lambda x, w: funcol.all_reduce(x @ w, "sum", g), torch.randn(8, 16),
                            torch.randn(16, 32), options={"flashoverlap.dtypes": ["bfloat16"]})

    def test_indivisible_rows(self):
        """7 rows cannot be reduce-scattered over 2 ranks (funcol refuses to trace it; the raw op does not)."""

        def fn(x, w):
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(x @ w, "sum", 2, "0"))

        with self.assertLogs("flashoverlap", level="INFO") as logs:
            self.run_pass_on(fn, torch.randn(7, 16), torch.randn(16, 32))
        self.assertEqual(dict(counters), {"skip:indivisible": 1})
        self.assertIn("dim 0 (7) does not divide by the group size 2", "\n".join(logs.output))

    def test_reshape_splits_columns(self):
        """[8, 32] -> [8, 4, 8] is not a row flatten/unflatten: the collective's dim 0 is not the GEMM's rows."""
        g = self.group
        text = self.assert_skipped("view_shape", lambda x, w: funcol.all_reduce((x @ w).view(8, 4, 8), "sum", g),
                                   torch.randn(8, 16), torch.randn(16, 32))
        self.assertIn("is not a pure row flatten/unflatten", text)

    def test_bmm_rows_regrouped_across_batches(self):
        """bmm [3, 4, 8] viewed as [12, 8]: 12 rows divide by 2 ranks, but the op scatters whole batch elements
        (dim 0 = 3), so it cannot express this shard."""
        g = self.group
        fn = lambda x, w: funcol.reduce_scatter_tensor(torch.bmm(x, w).view(12, 8), "sum", 0, g)
        text = self.assert_skipped("indivisible", fn, torch.randn(3, 4, 16), torch.randn(3, 16, 8))
        self.assertIn("the GEMM output's dim 0 (3)", text)

    def test_scatter_over_columns(self):
        g = self.group
        text = self.assert_skipped("scatter_dim", lambda x, w: funcol.reduce_scatter_tensor(x @ w, "sum", 1, g),
                                   torch.randn(8, 16), torch.randn(16, 32))
        self.assertIn("column dim", text)

    def test_bias_varies_along_reordered_rows(self):
        """reduce_scatter over dim 1 reorders a's rows; a full [M, N] bias would have to follow: refused."""
        g = self.group
        fn = lambda b, x, w: funcol.reduce_scatter_tensor(torch.addmm(b, x, w).view(2, 8, 32), "sum", 1, g)
        self.assert_skipped("bias_shape", fn, torch.randn(16, 32), torch.randn(16, 16), torch.randn(16, 32))

    def test_addmm_with_beta(self):
        self.run_pass_on(lambda b, x, w: c10d.wait_tensor(c10d.all_reduce(torch.addmm(b, x, w, beta=0.5), "sum", "0")),
                         torch.randn(32), torch.randn(8, 16), torch.randn(16, 32))
        self.assertEqual(dict(counters), {"skip:addmm_scale": 1})

    def test_collective_disabled(self):
        g = self.group
        self.assert_skipped("collective_disabled", lambda x, w: funcol.reduce_scatter_tensor(x @ w, "sum", 0, g),
                            torch.randn(8, 16), torch.randn(16, 32),
                            options={"flashoverlap.collectives": ["all_reduce"]})

    def test_not_a_gemm_producer(self):
        """all_reduce(relu(mm)) is no match at all: nothing counted, no INFO log."""
        g = self.group
        (gm,), _ = self.capture(lambda x, w: funcol.all_reduce(torch.relu(x @ w), "sum", g), torch.randn(8, 16),
                                torch.randn(16, 32))
        self.assertNotIn("flashoverlap", graph_str(gm))
        self.assertEqual(dict(counters), {"near_miss:relu": 1})  # a GEMM reaches it through relu


class TestFuseModes(SkipTestCase):
    def _two_collectives(self):
        g = self.group
        fn = lambda x, w: (funcol.all_reduce(x @ w, "sum", g), funcol.reduce_scatter_tensor(x @ w, "sum", 0, g))
        return fn, torch.randn(8, 16), torch.randn(16, 32)

    def test_fuse_never_option(self):
        """Under "never" the graph is untouched and skip:fuse_never is counted once per graph."""
        self.assert_skipped("fuse_never", *self._two_collectives(), fuse="never")

    def test_fuse_never_env_var(self):
        with mock.patch.dict(os.environ, {"FLASHOVERLAP_FUSE": "never"}):
            config.reload_environment()  # the environment is read once per process
            try:
                self.assert_skipped("fuse_never", *self._two_collectives(), fuse=None)
            finally:
                config.reload_environment()

    def test_fuse_never_config(self):
        with config.patch(fuse="never"):
            self.assert_skipped("fuse_never", *self._two_collectives(), fuse=None)


if __name__ == "__main__":
    run_tests()
