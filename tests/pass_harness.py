"""Shared harness of the pass tests (tests/test_pass_*.py): fake process group, graph capture, and a
single-process *semantic* check of a rewrite.

* ``FakePGTestCase``: world of 2 on the ``fake`` process group (collectives move no data), a fresh Inductor
  cache per test (the pass must really run; never an on-disk cache hit), counters reset. Built on
  ``common_utils.TestCase`` so ``assertExpectedInline`` can rewrite expectations (``EXPECTTEST_ACCEPT=1``).
* ``capture(fn, *args, options=...)``: compiles ``fn`` with the real ``flashoverlap`` backend and records the
  post-grad graph after our pass (via Inductor's ``post_grad_custom_post_pass``). By default it stops Inductor
  right there (no C++ codegen: ~0.3 s instead of ~5 s per graph) and runs the Dynamo graph eagerly;
  ``full=True`` compiles and runs everything (needed for backward graphs and for the fused op's codegen).
* ``assert_rewrites_equivalent()`` / ``check_equivalent(before, after)``: runs each graph as it entered the
  pass and as it left Inductor's post-grad passes on the same fresh random inputs, with every collective (and
  every fused op) simulated as rank ``RANK`` of a world where all ranks hold the same data; the outputs must
  match. This catches wrong row orders, wrong split scaling and wrong views in a rewrite.
"""

from __future__ import annotations

import re
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._inductor.utils import fresh_cache
from torch.testing._internal.common_utils import TestCase

from flashoverlap_inductor import passes
from flashoverlap_inductor.backend import flashoverlap_backend
from flashoverlap_inductor.passes import FlashOverlapPass

WORLD = 2
RANK = 1  # simulate a rank whose shard is not the first one
c10d = torch.ops._c10d_functional
fo = torch.ops.flashoverlap


class _Captured(Exception):
    """Raised by the capture hook to stop Inductor after the post-grad passes."""


_SHORT = (("torch.ops.aten.", "aten."), ("torch.ops._c10d_functional.", "c10d."),
          ("torch.ops.flashoverlap.", "flashoverlap."))


def graph_str(gm: torch.fx.GraphModule, canonical: bool = False) -> str:
    """Stable, compact text of a graph: python code without file comments and without the ``x = None``
    buffer-freeing statements, op namespaces shortened, plan strings shortened to their sizes, the settings argument
    (``Settings.key()``) left out.
    ``canonical``: also rename values as ``canonical_names`` does (version-robust expectations)."""
    code = gm.graph.python_code("self").src.strip()
    code = re.sub(r";  [\w, =]+ = None$", "", code, flags=re.M)
    for long, short in _SHORT:
        code = code.replace(long, short)
    code = re.sub(r"'v1;m=(\w+);n=(\w+);[^']*'", r"'plan(m=\1,n=\2)'", code)
    code = re.sub(r", \"\(\('fuse'[^\"]*\"", "", code)  # the ops' settings argument (test_pass_auto checks it)
    return canonical_names(code) if canonical else code


def fused_lines(gm: torch.fx.GraphModule, canonical: bool = False) -> str:
    """Only the lines of ``graph_str`` that mention our ops (compact expectations for big graphs); ``canonical``
    names are those of the whole graph."""
    return "\n".join(line.strip() for line in graph_str(gm, canonical).splitlines() if "flashoverlap" in line)


_HEADER = re.compile(r"^def forward\(self(?:, )?([^)]*)\):$")
_ASSIGNED = re.compile(r"^\s+(\w+) = ")
_NAME = re.compile(r"(?<![\w.'])[A-Za-z_]\w*(?![\w'])")


def canonical_names(code: str) -> str:
    """``code`` (a ``graph_str``) with the names that torch versions choose differently made canonical.

    Only names change, never the statements: the inputs the graph reads become ``in0, in1, ...`` in placeholder
    order and inputs it never reads are dropped from the signature (DTensor lifts a version-dependent number of
    them); every assigned value ``base`` / ``base_<k>`` becomes ``base``, ``base_1``, ``base_2``... in order of
    definition (the suffixes count nodes the tracer created and discarded, which differs between versions, e.g.
    ``mul_23`` on 2.13 vs ``mul_21`` on 2.11).
    """
    lines = code.splitlines()
    header = _HEADER.match(lines[0])
    assert header is not None, lines[0]
    params = [p.strip() for p in header.group(1).split(",") if p.strip()]
    body = "\n".join(lines[1:])
    used = set(_NAME.findall(body))
    rename = {p: f"in{i}" for i, p in enumerate(p for p in params if p in used)}
    seen: dict[str, int] = {}
    for line in lines[1:]:
        m = _ASSIGNED.match(line)
        if m is None or m.group(1) in rename:
            continue
        base = re.sub(r"_\d+$", "", m.group(1))
        k = seen[base] = seen.get(base, -1) + 1
        rename[m.group(1)] = base if k == 0 else f"{base}_{k}"
    assert len(set(rename.values())) == len(rename), f"canonical names collide: {rename}"
    body = _NAME.sub(lambda t: rename.get(t.group(0), t.group(0)), body)
    signature = "".join(f", {rename[p]}" for p in params if p in rename)
    return f"def forward(self{signature}):\n{body}"


def _copy(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    new = torch.fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), new)


def _is_captured(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, _Captured):
            return True
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return False


class FakePGTestCase(TestCase):
    """Single process, ``fake`` process group of world size 2 (group name '0')."""

    _owns_pg = False

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        if not dist.is_initialized():
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
            cls._owns_pg = True

    @classmethod
    def tearDownClass(cls) -> None:
        if cls._owns_pg:
            dist.destroy_process_group()
            cls._owns_pg = False
        super().tearDownClass()

    def setUp(self) -> None:
        super().setUp()
        torch._dynamo.reset()
        passes.reset_counters()
        self._cache = fresh_cache()
        self._cache.__enter__()
        self.before, self.after = [], []
        self._record_before()

    def tearDown(self) -> None:
        self._cache.__exit__(None, None, None)
        torch._dynamo.reset()
        super().tearDown()

    @property
    def group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def capture(self, fn: Any, *args: Any, options: dict | None = None, fuse: str | None = "always",
                full: bool = False, dynamic: bool | None = None) -> tuple[list[torch.fx.GraphModule], Any]:
        """Compile ``fn`` with the flashoverlap backend (fullgraph) and run it on ``args``; returns the post-pass
        graphs (one per compiled graph; with ``full``, a backward graph is appended when it is compiled) and the
        output. ``self.before`` collects the same graphs as the pass received them. ``fuse`` is passed as the
        ``flashoverlap.fuse`` option (None: not passed, so config/env decide)."""
        self.before: list[torch.fx.GraphModule] = []
        self.after: list[torch.fx.GraphModule] = []

        def hook(graph: torch.fx.Graph) -> None:
            self.after.append(_copy(graph))
            if not full:
                raise _Captured

        opts = {**({"flashoverlap.fuse": fuse} if fuse else {}), **(options or {}), "post_grad_custom_post_pass": hook}

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            try:
                return flashoverlap_backend(gm, example_inputs, options=opts)
            except Exception as exc:
                if _is_captured(exc):
                    return gm.forward
                raise

        torch._dynamo.reset()
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
        return self.after, out

    def assert_rewrites_equivalent(self) -> None:
        """Each graph captured by the last ``capture`` computes after the pass what it computed before."""
        self.assertEqual(len(self.before), len(self.after))
        self.assertGreater(len(self.after), 0)
        for before, after in zip(self.before, self.after, strict=True):
            self.assertNotIn("flashoverlap", graph_str(before))
            check_equivalent(self, before, after)

    def _record_before(self) -> None:
        """Snapshot every graph as it enters the pass (also the lazily compiled backward graph)."""
        original = FlashOverlapPass.run

        def run(pass_self: FlashOverlapPass, graph: torch.fx.Graph) -> int:
            self.before.append(_copy(graph))
            return original(pass_self, graph)

        patcher = mock.patch.object(FlashOverlapPass, "run", run)
        patcher.start()
        self.addCleanup(patcher.stop)


# ------------------------------------------------------------------------------------------- simulation


def _sim_collective(x: torch.Tensor, collective: str, out_splits: Any = None, in_splits: Any = None) -> torch.Tensor:
    """Rank RANK's result when every rank contributes ``x`` (sum over WORLD identical tensors)."""
    if collective == "all_reduce":
        return x * WORLD
    if collective == "reduce_scatter":
        return (x * WORLD).chunk(WORLD, dim=0)[RANK].contiguous()
    if collective == "all_to_all":
        ins = [int(s) for s in in_splits] if in_splits is not None else [x.shape[0] // WORLD] * WORLD
        outs = [int(s) for s in out_splits] if out_splits is not None else ins
        piece = x.split(ins, dim=0)[RANK]  # what every rank sends to RANK
        assert all(o == piece.shape[0] for o in outs), f"inconsistent splits for identical ranks: {ins} {outs}"
        return torch.cat([piece] * WORLD, dim=0)
    if collective == "all_gather":
        return torch.cat([x] * WORLD, dim=0)
    raise AssertionError(collective)


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.matmul(a, b)
    return y if bias is None else y + bias


class _Simulator(torch.fx.Interpreter):
    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is c10d.wait_tensor.default:
            return args[0]
        if target is c10d.all_reduce.default:
            return _sim_collective(args[0], "all_reduce")
        if target is c10d.reduce_scatter_tensor.default:
            return _sim_collective(args[0], "reduce_scatter")
        if target is c10d.all_to_all_single.default:
            return _sim_collective(args[0], "all_to_all", args[1], args[2])
        if target is c10d.all_gather_into_tensor.default:
            return _sim_collective(args[0], "all_gather")
        if target is fo.gemm_all_reduce.default:
            return _sim_collective(_gemm(*args[:3]), "all_reduce")
        if target is fo.gemm_reduce_scatter.default:
            return _sim_collective(_gemm(*args[:3]), "reduce_scatter")
        if target is fo.gemm_all_to_all.default:
            y = _gemm(*args[:3])
            return _sim_collective(y, "all_to_all", args[3], args[4])
        if target is fo.all_gather_gemm.default:  # (a, b list, bias list, gather_dim, ..., return_gathered, ...)
            a, bs, biases, dim, ret = args[0], args[1], args[2], args[3], args[7]
            g = torch.cat([a] * WORLD, dim=dim)
            ys = [_gemm(g.reshape(-1, a.shape[-1]), w, c) for w, c in zip(bs, biases, strict=True)]
            return [*ys, g] if ret else ys
        return super().call_function(target, args, kwargs)


def _concrete(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return int(hint if hint is not None else x.node.shape_env.size_hint(x.node.expr))
    return int(x)


def random_inputs(gm: torch.fx.GraphModule, seed: int = 0) -> list[Any]:
    """Fresh random values for the placeholders of ``gm`` (SymInts: their hints; opaque objects: None)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            shape = [_concrete(s) for s in v.shape]
            if v.dtype.is_floating_point:
                out.append(torch.randn(shape, generator=gen, dtype=v.dtype))
            else:
                out.append(torch.randint(0, 2, shape, generator=gen).to(v.dtype))
        elif isinstance(v, (int, torch.SymInt)):
            out.append(_concrete(v))
        else:  # e.g. an opaque ProcessGroup/DeviceMesh object that DTensor lifts as an (unused) input
            out.append(None)
    return out


def check_equivalent(tc: TestCase, before: torch.fx.GraphModule, after: torch.fx.GraphModule) -> None:
    """``before`` and ``after`` give the same outputs on fresh random inputs (collectives simulated)."""
    inputs = random_inputs(before)
    ref = _Simulator(before).run(*inputs)
    got = _Simulator(after).run(*inputs)
    ref, got = torch.utils._pytree.tree_leaves(ref), torch.utils._pytree.tree_leaves(got)
    tc.assertEqual(len(ref), len(got))
    for r, g in zip(ref, got, strict=True):
        if isinstance(r, torch.Tensor):
            tc.assertEqual(g.shape, r.shape)
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        else:
            tc.assertEqual(g, r)


__all__ = ["FakePGTestCase", "graph_str", "fused_lines", "check_equivalent", "random_inputs", "WORLD", "RANK"]
