"""The setting ``tp_sequence`` (``passes/tp_sequence.py``, on by default): a tensor-parallel inference graph's
all_reduces become reduce_scatters, the residual adds and RMSNorms run on this rank's rows, all_gathers feed the next
GEMMs, and the main pass fuses both; on a real 2-rank gloo world against eager (fresh random data, fp32), and the cases
it leaves alone (training graphs, rows the group does not divide, the setting off) on the fake process group."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from dist_utils import get_pool
from pass_harness import FakePGTestCase
from torch import nn

from flashoverlap_inductor import config

FP32 = {"rtol": 1e-4, "atol": 1e-5}
ON = {"flashoverlap.tp_sequence": "auto"}  # the default, named
OFF = {"flashoverlap.tp_sequence": "off"}


class Block(nn.Module):
    """Pre-norm decoder-like layer, tensor-parallel by hand: this rank's column shard of ``up``, row shard of
    ``down`` (whose partial sums the all_reduce adds), the residual stream replicated."""

    def __init__(self, dim: int = 32, local_hidden: int = 24) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.up = nn.Linear(dim, local_hidden, bias=False)
        self.down = nn.Linear(local_hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + funcol.all_reduce(self.down(torch.nn.functional.silu(self.up(self.norm(x)))), "sum",
                                     dist.group.WORLD)


class Stack(nn.Module):
    def __init__(self, layers: int = 3, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.final = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final(x)[:, -1])  # the last position only, as a prefill's logits


def _worker(batch: int, seq: int) -> tuple[dict, dict]:
    from torch._inductor.utils import fresh_cache

    from flashoverlap_inductor.passes import counters, reset_counters

    torch.manual_seed(7 + dist.get_rank())  # each rank its own shards of the weights
    model = Stack()
    torch.manual_seed(11)  # the input replicated
    x = torch.randn(batch, seq, 32)
    with torch.no_grad():
        ref = model(x) + 0
        got = {}
        for name, options in (("plain", OFF), ("tp_sequence", ON)):
            torch._dynamo.reset()
            reset_counters()
            with fresh_cache():
                out = torch.compile(model, backend="flashoverlap", options={"flashoverlap.fuse": "always",
                                                                             **options})(x)
            torch.testing.assert_close(out, ref, **FP32)
            got[name] = dict(counters)
    return got["plain"], got["tp_sequence"]


def test_inference_all_reduces_become_fused_reduce_scatters_and_gathers():
    """3 layers, batch 2, seq 8 (16 rows over 2 ranks): every all_reduce a reduce_scatter fused with its GEMM; the
    all_gathers before layers 2 and 3 fused with their ``up`` GEMMs; the final norm's gather (a slice reads it) left
    unfused; outputs equal to eager on both ranks."""
    for plain, seq in get_pool(2).run(_worker, 2, 8):
        assert plain.get("fused:all_reduce") == 3 and "fused:reduce_scatter" not in plain, plain
        assert seq.get("fused:reduce_scatter") == 3 and "fused:all_reduce" not in seq, seq
        assert seq.get("fused:all_gather") == 2, seq
        assert seq.get("rewrite:tp_sequence") == 3 and "rewrite:tp_sequence" not in plain, seq


class TestLeftAlone(FakePGTestCase):
    """On the fake process group (2 ranks): where the rewrite does not apply, the all_reduce stays."""

    def _graph_ops(self, fn, *args, options=ON) -> set[str]:
        graphs, _ = self.capture(fn, *args, options=options)
        return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}

    def _fn(self):
        g = dist.group.WORLD
        w1, w2, res = torch.randn(32, 16), torch.randn(16, 32), torch.randn(16, 32)

        def fn(x):
            h = res + funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g)
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w1

        return fn

    def test_rewritten_where_it_applies(self):
        with torch.no_grad():
            ops = self._graph_ops(self._fn(), torch.randn(16, 32))
        self.assertIn("flashoverlap.gemm_reduce_scatter.default", ops)
        self.assertIn("flashoverlap.all_gather_gemm.default", ops)
        self.assertNotIn("flashoverlap.gemm_all_reduce.default", ops)

    def test_rows_the_group_does_not_divide(self):
        g = dist.group.WORLD
        w1, w2, res = torch.randn(32, 16), torch.randn(16, 32), torch.randn(15, 32)
        fn = lambda x: (res + funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g)).pow(2) @ w1  # noqa: E731
        with torch.no_grad():
            ops = self._graph_ops(fn, torch.randn(15, 32))
        self.assertIn("flashoverlap.gemm_all_reduce.default", ops)

    def test_few_rows_under_auto(self):
        """16 rows < min_rows (256) under ``fuse="auto"``: neither half would be fused, so the all_reduce stays (the
        rows decide before the device does)."""
        with self.assertLogs("flashoverlap", "INFO") as logs:
            self._left_under_auto(torch.randn(16, 32))
        reason = "left as it is: 16 rows < config.min_rows=256"
        self.assertTrue(any(reason in line for line in logs.output), logs.output)

    def test_cpu_rows_under_auto(self):
        """512 rows on CPU under ``fuse="auto"``: the cost model fuses nothing there, so the all_reduce stays."""
        g = dist.group.WORLD
        w1, w2, res = torch.randn(32, 16), torch.randn(16, 32), torch.randn(512, 32)
        fn = lambda x: (res + funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g)).pow(2) @ w2.t()  # noqa: E731
        self._left_under_auto(torch.randn(512, 32), fn)

    def _left_under_auto(self, x, fn=None):
        with torch.no_grad():
            graphs, _ = self.capture(fn or self._fn(), x, options=ON, fuse="auto")
        ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
        self.assertIn("_c10d_functional.all_reduce.default", ops)
        self.assertNotIn("_c10d_functional.reduce_scatter_tensor.default", ops)

    def test_no_gemm_after_row_wise_ops(self):
        """An all_reduce that goes out of the graph, through row-wise ops or not, or straight into a GEMM stays:
        no all_gather -> GEMMs would come of it."""
        g = dist.group.WORLD
        w1, w2 = torch.randn(32, 16), torch.randn(16, 32)
        cases = {"out": lambda x: funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g),
                 "row-wise, out": lambda x: torch.relu(funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g)) + 1.0,
                 "GEMM": lambda x: funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g) @ w1}
        for name, fn in cases.items():
            with self.subTest(name), torch.no_grad():
                ops = self._graph_ops(fn, torch.randn(16, 32))
                self.assertIn("flashoverlap.gemm_all_reduce.default", ops)
                self.assertNotIn("flashoverlap.gemm_reduce_scatter.default", ops)

    def test_few_rows_under_on(self):
        """``tp_sequence="on"``: no ``min_rows`` guard; the reduce_scatter and all_gather then stay unfused on CPU."""
        with torch.no_grad():
            graphs, _ = self.capture(self._fn(), torch.randn(16, 32), options={"flashoverlap.tp_sequence": "on"},
                                     fuse="auto")
        ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
        self.assertNotIn("_c10d_functional.all_reduce.default", ops)
        self.assertIn("_c10d_functional.reduce_scatter_tensor.default", ops)
        self.assertIn("_c10d_functional.all_gather_into_tensor.default", ops)

    def test_a_users_slice_of_this_ranks_rows_is_no_shard(self):
        """``h[0:8]`` of 16 rows is rank 0's rows by its numbers only: both ranks gather it alike (the same
        collectives on every rank), and only the pass's own slices count as a shard."""
        g = dist.group.WORLD
        w1, w2, res = torch.randn(32, 16), torch.randn(16, 32), torch.randn(16, 32)

        def fn(x):
            h = res + funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g)
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w1, h[0:8] * 2

        from flashoverlap_inductor.passes import tp_sequence

        init, per_rank = tp_sequence._Region.__init__, []
        for rank in (0, 1):  # the fake group is rank 0's: the region takes the rank it is given
            def as_rank(region, graph, wait, rank=rank):
                init(region, graph, wait)
                region.rank = rank

            with mock.patch.object(tp_sequence._Region, "__init__", as_rank), torch.no_grad():
                graphs, _ = self.capture(fn, torch.randn(16, 32), options=ON)
            per_rank.append([str(n.target) for gm in graphs for n in gm.graph.nodes
                             if "all_gather" in str(n.target) or "reduce_scatter" in str(n.target)])
        self.assertEqual(per_rank[0], per_rank[1])
        self.assertIn("_c10d_functional.all_gather_into_tensor.default", per_rank[0])

    def test_a_pointwise_op_read_in_full_seeds_nothing(self):
        """``addcmul(h, b, z)`` with ``z`` of fewer rows: the op stays (read in full), and the all_reduce ``b`` it
        would have joined is neither left half-made nor used before it is defined (the graph lints)."""
        g = dist.group.WORLD
        w1, w2, res, z = torch.randn(32, 16), torch.randn(16, 32), torch.randn(2, 8, 32), torch.randn(8, 32)

        def fn(x):
            h = res + funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g)
            b = funcol.all_reduce(torch.relu(x @ w1) @ w2, "sum", g)
            return (torch.addcmul(h, b, z) * 2) @ w1

        with torch.no_grad():
            graphs, _ = self.capture(fn, torch.randn(2, 8, 32), options=ON)
        for gm in graphs:
            gm.graph.lint()
        ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        self.assertIn("aten.addcmul.default", ops)  # read in full, its sharded inputs gathered
        self.assertNotIn("flashoverlap.gemm_all_reduce.default", ops)  # b's all_reduce a region of its own
        self.assertEqual(ops.count("flashoverlap.gemm_reduce_scatter.default"),
                         ops.count("_c10d_functional.all_gather_into_tensor.default"))

    def test_setting_off(self):
        with torch.no_grad():
            ops = self._graph_ops(self._fn(), torch.randn(16, 32), options=OFF)
        self.assertIn("flashoverlap.gemm_all_reduce.default", ops)
        self.assertNotIn("flashoverlap.gemm_reduce_scatter.default", ops)

    def test_a_training_forward_keeps_its_all_reduce(self):
        x = torch.randn(16, 32, requires_grad=True)
        ops = self._graph_ops(self._fn(), x)  # grad enabled, an input that requires it: a training forward
        self.assertIn("flashoverlap.gemm_all_reduce.default", ops)
        self.assertNotIn("flashoverlap.gemm_reduce_scatter.default", ops)


def test_the_cache_key_names_the_rank_under_the_setting(monkeypatch):
    """The ranks of one host share the FX graph cache and their input graphs are alike: under the setting the
    pass's uuid carries the rank (its graphs slice the rank's rows), with it off or nothing fused not."""
    from flashoverlap_inductor.passes import cache_key

    on = config.current().replace(tp_sequence="on")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for rank in (0, 3):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        assert cache_key.rank_part(on).startswith(f"|rank:{rank}|group_ranks:")
        assert cache_key.rank_part(config.current()) == cache_key.rank_part(on)  # "auto", the default
        assert cache_key.rank_part(on.replace(tp_sequence="off")) == ""
        assert cache_key.rank_part(on.replace(fuse="never")) == ""


class TestGroupRanks(FakePGTestCase):
    def test_the_cache_key_names_this_rank_in_each_group(self):
        """``compat.process_group_ranks``: this process's rank in each group by name, in the key beside the global
        rank (a graph embeds its rank within the group)."""
        from flashoverlap_inductor import _inductor_compat as compat
        from flashoverlap_inductor.passes import cache_key

        sub = dist.new_group([0, 1])
        ranks = dict(item.split(":") for item in compat.process_group_ranks().split(","))
        self.assertEqual(ranks[dist.group.WORLD.group_name], "0")
        self.assertEqual(ranks[sub.group_name], "0")
        key = cache_key.rank_part(config.current())
        self.assertEqual(key, f"|rank:0|group_ranks:{compat.process_group_ranks()}")
        dist.destroy_process_group(sub)


def test_the_setting_is_checked():
    assert config.current().tp_sequence == "auto"
    with pytest.raises(ValueError, match="tp_sequence"):
        config.current().replace(tp_sequence="yes")


def test_which_settings_rewrite():
    """``rewrites``: "auto" and "on" do, "off", ``fuse="never"`` and ``collectives`` without either half do not (the
    ``min_rows`` guard of "auto" alone: ``TestLeftAlone.test_few_rows_under_on``)."""
    from flashoverlap_inductor.passes import tp_sequence

    base = config.current().replace(fuse="auto")
    assert tp_sequence.rewrites(base) and tp_sequence.rewrites(base.replace(tp_sequence="on"))
    assert not tp_sequence.rewrites(base.replace(tp_sequence="off"))
    assert not tp_sequence.rewrites(base.replace(fuse="never"))
    assert not tp_sequence.rewrites(base.replace(collectives=("all_reduce", "reduce_scatter")))
