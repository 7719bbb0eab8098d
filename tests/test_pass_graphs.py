"""Graph-rewrite tests of FlashOverlapPass: the post-pass graph of every collective and source form, printed and
compared with expecttest, plus a simulated-collective check that each rewrite computes what the original graph
computes (``pass_harness.check_equivalent``).

Fuse mode "always" throughout, so the graphs do not depend on cost-model numbers (plan strings are printed as
``plan(m=..,n=..)``). Graphs are printed with canonical value names (``pass_harness.canonical_names``): torch
versions differ in how many inputs DTensor lifts and in the numeric suffixes of generated names, not in the
statements, which are compared exactly. Refresh expectations with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_pass_graphs.py``.
"""

# ruff: noqa: E501  (expected graphs are printed one statement per line)
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from pass_harness import FakePGTestCase, fused_lines, graph_str
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing import FileCheck
from torch.testing._internal.common_utils import run_tests

from flashoverlap_inductor.passes import counters


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 64, bias: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Attention(nn.Module):
    """Llama-style attention whose projections are tensor-parallel (heads split over ranks)."""

    def __init__(self, dim: int = 32, head_dim: int = 8) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def _mlp_plan(sequence_parallel: bool = False) -> dict:
    if sequence_parallel:
        return {"up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


class TestFunctionalCollectives(FakePGTestCase):
    def test_all_reduce_2d(self):
        g = self.group
        fn = lambda x, w: funcol.all_reduce(x @ w, "sum", g)
        (gm,), _ = self.capture(fn, torch.randn(8, 16), torch.randn(16, 32))
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1):
    gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(in0, in1, None, 'sum', '0', 'plan(m=8,n=32)')
    return (gemm_all_reduce_default,)""")
        self.assertEqual(dict(counters), {"fused:all_reduce": 1})
        self.assert_rewrites_equivalent()

    def test_all_reduce_3d_linear_bias(self):
        g = self.group
        fn = lambda x, w, b: funcol.all_reduce(F.linear(x, w, b), "sum", g)
        args = torch.randn(2, 4, 16), torch.randn(32, 16), torch.randn(32)
        (gm,), _ = self.capture(fn, *args)
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1, in2):
    view = aten.reshape.default(in0, [8, 16])
    permute = aten.permute.default(in1, [1, 0])
    gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(view, permute, in2, 'sum', '0', 'plan(m=8,n=32)')
    reshape_default = aten.reshape.default(gemm_all_reduce_default, [2, 4, 32])
    return (reshape_default,)""")
        self.assert_rewrites_equivalent()

    def test_reduce_scatter_dim0(self):
        g = self.group
        fn = lambda x, w: funcol.reduce_scatter_tensor(F.linear(x, w), "sum", 0, g)
        args = torch.randn(4, 3, 16), torch.randn(32, 16)
        (gm,), out = self.capture(fn, *args)
        self.assertEqual(out.shape, (2, 3, 32))
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1):
    view = aten.reshape.default(in0, [12, 16])
    permute = aten.permute.default(in1, [1, 0])
    gemm_reduce_scatter_default = flashoverlap.gemm_reduce_scatter.default(view, permute, None, 'sum', 2, '0', 'plan(m=12,n=32)')
    reshape_default = aten.reshape.default(gemm_reduce_scatter_default, [2, 3, 32])
    return (reshape_default,)""")
        self.assertEqual(dict(counters), {"fused:reduce_scatter": 1})
        self.assert_rewrites_equivalent()

    def test_reduce_scatter_dim1_split_cat(self):
        """funcol's split/getitem/cat form: the rewrite reorders a's rows so the op scatters dim 0."""
        g = self.group
        fn = lambda x, w: funcol.reduce_scatter_tensor(F.linear(x, w), "sum", 1, g)
        args = torch.randn(2, 8, 16), torch.randn(32, 16)
        (gm,), out = self.capture(fn, *args)
        self.assertEqual(out.shape, (2, 4, 32))
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1):
    view = aten.reshape.default(in0, [16, 16])
    permute = aten.permute.default(in1, [1, 0])
    reshape_default = aten.reshape.default(view, [2, 2, 4, -1])
    permute_default = aten.permute.default(reshape_default, [1, 0, 2, 3])
    reshape_default_1 = aten.reshape.default(permute_default, [-1, 16])
    gemm_reduce_scatter_default = flashoverlap.gemm_reduce_scatter.default(reshape_default_1, permute, None, 'sum', 2, '0', 'plan(m=16,n=32)')
    reshape_default_2 = aten.reshape.default(gemm_reduce_scatter_default, [2, 4, 32])
    return (reshape_default_2,)""")
        self.assert_rewrites_equivalent()

    def test_reduce_scatter_4d_dim2(self):
        g = self.group
        fn = lambda x, w: funcol.reduce_scatter_tensor(F.linear(x, w), "sum", 2, g)
        args = torch.randn(2, 3, 4, 16), torch.randn(8, 16)
        (gm,), out = self.capture(fn, *args)
        self.assertEqual(out.shape, (2, 3, 2, 8))
        self.assertEqual(dict(counters), {"fused:reduce_scatter": 1})
        self.assert_rewrites_equivalent()

    def test_all_to_all_even(self):
        g = self.group
        fn = lambda x, w: funcol.all_to_all_single(F.linear(x, w), None, None, g)
        args = torch.randn(4, 3, 16), torch.randn(32, 16)
        (gm,), _ = self.capture(fn, *args)
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1):
    view = aten.reshape.default(in0, [12, 16])
    permute = aten.permute.default(in1, [1, 0])
    gemm_all_to_all_default = flashoverlap.gemm_all_to_all.default(view, permute, None, [6, 6], [6, 6], '0', 'plan(m=12,n=32)')
    reshape_default = aten.reshape.default(gemm_all_to_all_default, [4, 3, 32])
    return (reshape_default,)""")
        self.assertEqual(dict(counters), {"fused:all_to_all": 1})
        self.assert_rewrites_equivalent()

    def test_all_to_all_uneven(self):
        g = self.group
        fn = lambda x, w: funcol.all_to_all_single(x @ w, [5, 5], [3, 5], g)
        args = torch.randn(8, 16), torch.randn(16, 32)
        (gm,), out = self.capture(fn, *args)
        self.assertEqual(out.shape, (10, 32))
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1):
    gemm_all_to_all_default = flashoverlap.gemm_all_to_all.default(in0, in1, None, [5, 5], [3, 5], '0', 'plan(m=8,n=32)')
    return (gemm_all_to_all_default,)""")
        self.assert_rewrites_equivalent()

    def test_bmm_all_reduce(self):
        g = self.group
        fn = lambda x, w: funcol.all_reduce(torch.bmm(x, w), "sum", g)
        args = torch.randn(2, 4, 16), torch.randn(2, 16, 8)
        (gm,), _ = self.capture(fn, *args)
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1):
    gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(in0, in1, None, 'sum', '0', 'plan(m=8,n=8)')
    return (gemm_all_reduce_default,)""")
        self.assert_rewrites_equivalent()

    def test_bmm_reduce_scatter_whole_batches(self):
        """bmm [2, 4, 8] viewed as [8, 8]: the 4-row shards are whole batch elements, so the op can scatter."""
        g = self.group
        fn = lambda x, w: funcol.reduce_scatter_tensor(torch.bmm(x, w).view(8, 8), "sum", 0, g)
        (gm,), out = self.capture(fn, torch.randn(2, 4, 16), torch.randn(2, 16, 8))
        self.assertEqual(out.shape, (4, 8))
        self.assertEqual(dict(counters), {"fused:reduce_scatter": 1})
        self.assertExpectedInline(fused_lines(gm, canonical=True), """gemm_reduce_scatter_default = flashoverlap.gemm_reduce_scatter.default(in0, in1, None, 'sum', 2, '0', 'plan(m=8,n=8)')""")
        self.assert_rewrites_equivalent()

    def test_two_layers_chained(self):
        """The output of one fused op feeds the next GEMM: both rewrites must compose."""
        g = self.group
        fn = lambda x, w1, w2: funcol.all_reduce(funcol.all_reduce(x @ w1, "sum", g) @ w2, "sum", g)
        args = torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 8)
        (gm,), _ = self.capture(fn, *args)
        self.assertEqual(dict(counters), {"fused:all_reduce": 2})
        self.assertExpectedInline(fused_lines(gm, canonical=True), """\
gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(in0, in1, None, 'sum', '0', 'plan(m=8,n=16)')
gemm_all_reduce_default_1 = flashoverlap.gemm_all_reduce.default(gemm_all_reduce_default, in2, None, 'sum', '0', 'plan(m=8,n=8)')""")
        self.assert_rewrites_equivalent()


class TestInPlaceDistributed(FakePGTestCase):
    """``torch.distributed`` in-place calls in the compiled region (Dynamo rewrites them to funcol)."""

    def test_inplace_all_reduce(self):
        def fn(x, w):
            y = x @ w
            dist.all_reduce(y)
            return y

        args = torch.randn(8, 16), torch.randn(16, 32)
        (gm,), _ = self.capture(fn, *args)
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1):
    gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(in0, in1, None, 'sum', '0', 'plan(m=8,n=32)')
    return (gemm_all_reduce_default,)""")
        self.assert_rewrites_equivalent()

    def test_inplace_reduce_scatter_and_all_to_all(self):
        def fn(x, w):
            y = x @ w
            rs = torch.empty(4, 32)
            dist.reduce_scatter_tensor(rs, y)
            a2a = torch.empty_like(y)
            dist.all_to_all_single(a2a, x @ w)
            return rs, a2a

        args = torch.randn(8, 16), torch.randn(16, 32)
        (gm,), _ = self.capture(fn, *args)
        self.assertEqual(dict(counters), {"fused:reduce_scatter": 1, "fused:all_to_all": 1})
        self.assertExpectedInline(fused_lines(gm, canonical=True), """\
gemm_reduce_scatter_default = flashoverlap.gemm_reduce_scatter.default(in0, in1, None, 'sum', 2, '0', 'plan(m=8,n=32)')
gemm_all_to_all_default = flashoverlap.gemm_all_to_all.default(in0, in1, None, [4, 4], [4, 4], '0', 'plan(m=8,n=32)')""")
        self.assert_rewrites_equivalent()


class TestDTensor(FakePGTestCase):
    """DTensor tensor-parallel plans (inference graphs; parameters are plain post-grad inputs)."""

    def setUp(self):
        super().setUp()
        self.mesh = init_device_mesh("cpu", (2,))

    def _run(self, module: nn.Module, plan: dict, x: torch.Tensor) -> torch.fx.GraphModule:
        torch.manual_seed(0)
        model = parallelize_module(module, self.mesh, plan)
        with torch.no_grad():
            (gm,), _ = self.capture(model, x)
            self.assert_rewrites_equivalent()
        return gm

    def test_mlp_no_bias(self):
        gm = self._run(MLP(bias=False), _mlp_plan(), torch.randn(2, 8, 16))
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1, in2):
    view = aten.reshape.default(in0, [16, 16])
    permute = aten.permute.default(in1, [1, 0])
    mm = aten.mm.default(view, permute)
    view_1 = aten.reshape.default(mm, [2, 8, 32])
    relu = aten.relu.default(view_1)
    view_2 = aten.reshape.default(relu, [16, 32])
    permute_1 = aten.permute.default(in2, [1, 0])
    gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(view_2, permute_1, None, 'sum', '0', 'plan(m=16,n=16)')
    reshape_default = aten.reshape.default(gemm_all_reduce_default, [2, 8, 16])
    return (reshape_default,)""")

    def test_mlp_bias(self):
        """DTensor divides the Replicate bias by the world size and uses addmm: the op adds it before the sum."""
        gm = self._run(MLP(bias=True), _mlp_plan(), torch.randn(2, 8, 16))
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1, in2, in3, in4):
    div = aten.div.Tensor(in4, 2)
    view = aten.reshape.default(in0, [16, 16])
    permute = aten.permute.default(in1, [1, 0])
    addmm = aten.addmm.default(in2, view, permute)
    view_1 = aten.reshape.default(addmm, [2, 8, 32])
    relu = aten.relu.default(view_1)
    view_2 = aten.reshape.default(relu, [16, 32])
    permute_1 = aten.permute.default(in3, [1, 0])
    gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(view_2, permute_1, div, 'sum', '0', 'plan(m=16,n=16)')
    reshape_default = aten.reshape.default(gemm_all_reduce_default, [2, 8, 16])
    return (reshape_default,)""")

    def test_attention(self):
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
        gm = self._run(Attention(), plan, torch.randn(2, 6, 32))
        self.assertEqual(dict(counters), {"fused:all_reduce": 1})
        self.assertExpectedInline(fused_lines(gm, canonical=True), """gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(view_10, permute_7, None, 'sum', '0', 'plan(m=12,n=32)')""")

    def test_sequence_parallel_mlp(self):
        """Sequence parallel: the input gathered along the sequence dim (split/cat form) into the colwise GEMM, and
        rowwise with Shard(1) output: reduce_scatter over the sequence dim (split/cat form). Both fused."""
        gm = self._run(MLP(), _mlp_plan(sequence_parallel=True), torch.randn(2, 4, 16))
        self.assertEqual(dict(counters), {"fused:all_gather": 1, "fused:reduce_scatter": 1})
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1, in2):
    permute = aten.permute.default(in1, [1, 0])
    all_gather_gemm_default = flashoverlap.all_gather_gemm.default(in0, [permute], [None], 1, 2, '0', 'ring', False)
    getitem = all_gather_gemm_default[0]
    view = aten.reshape.default(getitem, [2, 8, 32])
    relu = aten.relu.default(view)
    view_1 = aten.reshape.default(relu, [16, 32])
    permute_1 = aten.permute.default(in2, [1, 0])
    reshape_default = aten.reshape.default(view_1, [2, 2, 4, -1])
    permute_default = aten.permute.default(reshape_default, [1, 0, 2, 3])
    reshape_default_1 = aten.reshape.default(permute_default, [-1, 32])
    gemm_reduce_scatter_default = flashoverlap.gemm_reduce_scatter.default(reshape_default_1, permute_1, None, 'sum', 2, '0', 'plan(m=16,n=16)')
    reshape_default_2 = aten.reshape.default(gemm_reduce_scatter_default, [2, 4, 16])
    return (reshape_default_2,)""")


class TestSymbolicM(FakePGTestCase):
    """Dynamic batch: the op gets plan 'auto' and the reshapes reuse the graph's SymInt nodes."""

    def test_all_reduce_dynamic_batch(self):
        g = self.group
        fn = lambda x, w: funcol.all_reduce(F.linear(x, w), "sum", g)
        x = torch.randn(3, 4, 16)
        torch._dynamo.mark_dynamic(x, 0)
        (gm,), _ = self.capture(fn, x, torch.randn(32, 16))
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1, in2):
    mul = in0 * 4
    view = aten.reshape.default(in1, [mul, 16])
    permute = aten.permute.default(in2, [1, 0])
    gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(view, permute, None, 'sum', '0', 'auto')
    reshape_default = aten.reshape.default(gemm_all_reduce_default, [in0, 4, 32])
    return (reshape_default,)""")
        self.assert_rewrites_equivalent()

    def test_all_to_all_dynamic_batch(self):
        """Even splits of a symbolic dim 0 of a 3D view: the op's row splits become ``split * 4`` nodes."""
        g = self.group
        fn = lambda x, w: funcol.all_to_all_single(F.linear(x, w), None, None, g)
        x = torch.randn(6, 4, 16)
        torch._dynamo.mark_dynamic(x, 0)
        (gm,), _ = self.capture(fn, x, torch.randn(32, 16))
        self.assertEqual(dict(counters), {"per_call:all_to_all": 1})
        self.assertExpectedInline(graph_str(gm, canonical=True), """\
def forward(self, in0, in1, in2):
    mul = in0 * 4
    view = aten.reshape.default(in1, [mul, 16])
    permute = aten.permute.default(in2, [1, 0])
    floordiv = in0 // 2
    mul_1 = floordiv * 4
    gemm_all_to_all_default = flashoverlap.gemm_all_to_all.default(view, permute, None, [mul_1, mul_1], [mul_1, mul_1], '0', 'auto')
    reshape_default = aten.reshape.default(gemm_all_to_all_default, [-1, 4, 32])
    return (reshape_default,)""")
        self.assert_rewrites_equivalent()

    def test_sequence_parallel_dynamic_batch(self):
        mesh = init_device_mesh("cpu", (2,))
        model = parallelize_module(MLP(), mesh, _mlp_plan(sequence_parallel=True))
        x = torch.randn(3, 4, 16)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            (gm,), _ = self.capture(model, x)
            self.assert_rewrites_equivalent()
        self.assertExpectedInline(fused_lines(gm, canonical=True), """\
all_gather_gemm_default = flashoverlap.all_gather_gemm.default(in1, [permute], [None], 1, 2, '0', 'auto', False)
gemm_reduce_scatter_default = flashoverlap.gemm_reduce_scatter.default(reshape_default_1, permute_1, None, 'sum', 2, '0', 'auto')""")


class TestCodegen(FakePGTestCase):
    def test_output_code_calls_the_fused_op(self):
        """Fully compiled by name: Inductor emits the fused op as a fallback kernel and no collective remains."""
        g = self.group
        fn = torch.compile(lambda x, w: funcol.all_reduce(F.linear(x, w), "sum", g), backend="flashoverlap",
                           fullgraph=True, options={"flashoverlap.fuse": "always"})
        out, (code,) = run_and_get_code(fn, torch.randn(2, 4, 16), torch.randn(32, 16))
        self.assertEqual(out.shape, (2, 4, 32))
        self.assertEqual(dict(counters), {"fused:all_reduce": 1})
        FileCheck().check("torch.ops.flashoverlap.gemm_all_reduce.default(").check_not("_c10d_functional").run(code)


class TestTraining(FakePGTestCase):
    def test_training_step_forward_and_backward(self):
        """Colwise -> Rowwise MLP training step, fully compiled: the forward's Rowwise all_reduce and the
        backward's Colwise input-gradient all_reduce are both fused; both graphs match the unfused ones."""
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = parallelize_module(MLP(bias=True), mesh, _mlp_plan())
        x = torch.randn(2, 8, 16, requires_grad=True)

        def step(x):
            return model(x).sum()

        graphs, loss = self.capture(step, x, full=True)
        self.assertEqual(len(graphs), 1)  # the backward graph is compiled at the first backward()
        loss.backward()
        self.assertEqual(len(graphs), 2)
        self.assertEqual(x.grad.shape, x.shape)
        self.assertEqual(dict(counters), {"fused:all_reduce": 2})
        self.assert_rewrites_equivalent()
        fwd, bwd = graphs
        # Version-independent facts: one fused op per graph, no all_reduce left, operands of the right shapes
        # (fwd: relu output [16, 32] x down.weight^T [32, 16], the bias/2 added before the sum; bwd: grad of up's
        # output [16, 32] x up.weight [32, 16]), the fixed arguments.
        for gm, bias in ((fwd, "div"), (bwd, "None")):
            text = graph_str(gm, canonical=True)
            FileCheck().check_count("flashoverlap.gemm_all_reduce.default(", 1, exactly=True).check_not(
                "c10d.all_reduce").run(text)
            FileCheck().check_regex(rf"gemm_all_reduce\.default\(\w+, \w+, {bias}, 'sum', '0', 'plan\(m=16,n=16\)'\)").run(text)
            (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.flashoverlap.gemm_all_reduce.default]
            self.assertEqual([tuple(arg.meta["val"].shape) for arg in node.args[:2]], [(16, 32), (32, 16)])
        self.assertExpectedInline(fused_lines(fwd, canonical=True), """gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(view_2, permute_1, div, 'sum', '0', 'plan(m=16,n=16)')""")
        if torch.__version__ >= "2.13":  # the backward's recomputed views and their order are the partitioner's choice
            self.assertExpectedInline(fused_lines(bwd, canonical=True), """gemm_all_reduce_default = flashoverlap.gemm_all_reduce.default(view_3, permute_2, None, 'sum', '0', 'plan(m=16,n=16)')""")


if __name__ == "__main__":
    run_tests()
