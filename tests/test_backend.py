"""The ``flashoverlap`` backend: entry-point discovery, options, fuse-mode sources, settings capture, uuid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from unittest import mock

import torch
from pass_harness import FakePGTestCase
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import TestCase, run_tests

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import backend, config
from flashoverlap_inductor.passes import FlashOverlapPass, counters

c10d = torch.ops._c10d_functional

_FRESH_INTERPRETER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not any(m.startswith("flashoverlap_inductor") for m in sys.modules), "imported too early"
    assert "flashoverlap" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    g = dist.group.WORLD
    fn = torch.compile(lambda x, w: funcol.all_reduce(x @ w, "sum", g), backend="flashoverlap", fullgraph=True)
    out = fn(torch.randn(8, 16), torch.randn(16, 32))
    from flashoverlap_inductor.passes import counters
    print(json.dumps({"shape": list(out.shape), "counters": dict(counters)}))
""")


class TestEntryPoint(TestCase):
    def test_fresh_interpreter_finds_and_runs_the_backend(self):
        """``backend="flashoverlap"`` works in an interpreter that never imported the package (entry point), the
        graph is compiled end to end (no FX cache) and the fused op runs."""
        env = {**os.environ, "FLASHOVERLAP_FUSE": "always", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
               "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
        proc = subprocess.run([sys.executable, "-c", _FRESH_INTERPRETER], env=env, capture_output=True, text=True,
                              timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        self.assertEqual(result, {"shape": [8, 32], "counters": {"fused:all_reduce": 1}})


def _graph():
    """A post-grad-like graph with one fusable all_reduce (fake tensors)."""
    fn = lambda x, w: c10d.wait_tensor(c10d.all_reduce(x @ w, "sum", "0"))
    return make_fx(fn, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32))


class TestBackendOptions(FakePGTestCase):
    def _patches(self, **kwargs) -> dict:
        """Run the backend with compile_fx replaced by a recorder; returns the config patches it got."""
        seen = {}

        def fake_compile_fx(gm, example_inputs, config_patches, around_graph=None, after_graph=None):
            seen.update(config_patches)
            return gm.forward

        gm = torch.fx.symbolic_trace(lambda x: x + 1)
        with mock.patch.object(compat, "compile_fx", fake_compile_fx):
            backend.flashoverlap_backend(gm, [torch.randn(2)], **kwargs)
        return seen

    def test_our_options_are_stripped_and_captured(self):
        patches = self._patches(options={"flashoverlap.fuse": "never", "flashoverlap.min_rows": 4,
                                         "flashoverlap.collectives": ["all_reduce"], "max_autotune": False})
        fo_pass = patches.pop(compat.PRE_PASS_KEY)
        self.assertEqual(patches, {"max_autotune": False})  # only Inductor's keys are left
        self.assertIsInstance(fo_pass, FlashOverlapPass)
        self.assertEqual((fo_pass.settings.fuse, fo_pass.settings.min_rows, fo_pass.settings.collectives),
                         ("never", 4, ("all_reduce",)))
        self.assertEqual(config.current().fuse, "auto")  # the module config is untouched
        self.assertEqual(config.current().min_rows, 256)

    def test_unknown_option_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "unknown option 'flashoverlap.nope'"):
            self._patches(options={"flashoverlap.nope": 1})
        with self.assertRaisesRegex(ValueError, "fuse must be one of"):
            self._patches(options={"flashoverlap.fuse": "sometimes"})
        with self.assertRaisesRegex(ValueError, "collectives must be"):
            self._patches(options={"flashoverlap.collectives": ["broadcast"]})

    def test_unknown_inductor_option_reaches_inductor(self):
        gm = torch.fx.symbolic_trace(lambda x: x + 1)
        with self.assertRaises(AttributeError):
            backend.flashoverlap_backend(gm, [torch.randn(2)], options={"no_such_inductor_option": 1})

    def test_mode(self):
        patches = self._patches(mode="max-autotune-no-cudagraphs")
        self.assertTrue(patches["max_autotune"])
        with self.assertRaisesRegex(RuntimeError, "either mode or options"):
            self._patches(mode="max-autotune", options={"flashoverlap.fuse": "never"})

    def test_env_var_and_precedence(self):
        with mock.patch.dict(os.environ, {"FLASHOVERLAP_FUSE": "never"}):
            config.reload_environment()
            self.assertEqual(self._patches()[compat.PRE_PASS_KEY].settings.fuse, "never")
            with config.patch(fuse="auto"):  # the module attribute beats the env var
                self.assertEqual(self._patches()[compat.PRE_PASS_KEY].settings.fuse, "auto")
            options = {"flashoverlap.fuse": "always"}  # an option beats both
            self.assertEqual(self._patches(options=options)[compat.PRE_PASS_KEY].settings.fuse, "always")
        with mock.patch.dict(os.environ, {"FLASHOVERLAP_FUSE": "always"}):
            config.reload_environment()
            self.assertEqual(self._patches()[compat.PRE_PASS_KEY].settings.fuse, "always")
        config.reload_environment()

    def test_settings_survive_for_the_lazily_compiled_backward(self):
        """The pass keeps the settings it was built with, whatever the config says when it finally runs."""
        fo_pass = self._patches(options={"flashoverlap.fuse": "always"})[compat.PRE_PASS_KEY]
        gm = _graph()
        with config.patch(fuse="never"), mock.patch.dict(os.environ, {"FLASHOVERLAP_FUSE": "never"}):
            fo_pass(gm.graph)
        self.assertEqual(dict(counters), {"fused:all_reduce": 1})

    def test_user_pre_pass_runs_after_ours(self):
        order = []

        def user_pass(graph):
            order.append(sum(1 for n in graph.nodes if "flashoverlap" in str(n.target)))

        chained = self._patches(options={"flashoverlap.fuse": "always",
                                         "post_grad_custom_pre_pass": user_pass})[compat.PRE_PASS_KEY]
        chained(_graph().graph)
        self.assertEqual(order, [1])  # the user's pass saw the fused graph
        self.assertIsNone(chained.uuid())  # a plain function: Inductor must bypass the FX graph cache


class TestHostFloors(FakePGTestCase):
    """``host_floors="auto"`` resolved per graph from its kind (``graph_settings``): off in a training step's
    forward and backward, on in inference graphs; the fused ops of a graph carry the resolved setting."""

    def test_graph_settings(self):
        from flashoverlap_inductor.passes.gemm_collective import graph_settings

        self.assertEqual(config.current().host_floors, "on")  # the default
        auto = config.current().replace(host_floors="auto")
        self.assertTrue(auto.counts_host())  # an eager call outside any graph counts its host time
        got = {kind: graph_settings(auto, kind).host_floors for kind in ("forward", "backward", "inference", None)}
        self.assertEqual(got, {"forward": "off", "backward": "off", "inference": "on", None: "on"})
        for fixed in ("on", "off"):
            settings = auto.replace(host_floors=fixed)
            self.assertIs(graph_settings(settings, "backward"), settings)
            self.assertIs(graph_settings(settings, "inference"), settings)
        self.assertFalse(auto.replace(host_floors="off").counts_host())
        for fixed in ("auto", "on"):  # a graph replayed from a CUDA graph: the floors out, whatever the setting
            for kind in ("forward", "backward", "inference", None):
                self.assertEqual(graph_settings(auto.replace(host_floors=fixed), kind, True).host_floors, "off")
        off = auto.replace(host_floors="off")
        self.assertIs(graph_settings(off, "inference", True), off)

    def _kinds_seen(self, requires_grad: bool, options: dict | None = None) -> list[str]:
        """Compile and run ``x @ w`` (then backward where ``w`` requires grad) with the real backend; the
        ``host_floors`` each graph was rewritten under, in compilation order."""
        seen = []
        original = FlashOverlapPass.run

        def run(self_, graph):
            seen.append(self_.settings.host_floors)
            return original(self_, graph)

        w = torch.randn(16, 32, requires_grad=requires_grad)
        fn = torch.compile(lambda x, w: (x @ w).relu(), backend="flashoverlap", options=options)
        with mock.patch.object(FlashOverlapPass, "run", run):
            out = fn(torch.randn(8, 16), w)
            if requires_grad:
                out.sum().backward()
        return seen

    def test_training_graphs_leave_host_floors_out(self):
        auto = {"flashoverlap.host_floors": "auto"}
        self.assertEqual(self._kinds_seen(True, auto), ["off", "off"])  # forward, then the backward

    def test_inference_graphs_count_them(self):
        self.assertEqual(self._kinds_seen(False, {"flashoverlap.host_floors": "auto"}), ["on"])

    def test_an_explicit_setting_holds_in_every_graph(self):
        self.assertEqual(self._kinds_seen(True), ["on", "on"])  # the default
        self.assertEqual(self._kinds_seen(True, {"flashoverlap.host_floors": "off"}), ["off", "off"])

    def test_graphs_replayed_by_cuda_graphs_leave_them_out(self):
        """Under Inductor's CUDA graphs (``mode="reduce-overhead"``'s ``triton.cudagraphs``) every graph is rewritten
        with the floors out, an explicit "on" (the default) too: its ops' route choice weighs GPU time alone."""
        self.assertEqual(self._kinds_seen(False, {"triton.cudagraphs": True}), ["off"])
        self.assertEqual(self._kinds_seen(True, {"triton.cudagraphs": True}), ["off", "off"])

    def test_the_route_choice_follows_it(self):
        """Llama-3-8B sp's o_proj reduce_scatter (4096 x 4096, K 2048 per rank; 2 H200s' data): the peer route
        where the pull route's host floor counts, the pull route (cuBLAS GEMMs) where it does not."""
        from flashoverlap_inductor.cost_model import pull

        self.assertFalse(pull.prefers_pull(4096, 4096, 2048, "bfloat16", "NVIDIA H200"))
        self.assertTrue(pull.prefers_pull(4096, 4096, 2048, "bfloat16", "NVIDIA H200", host_floors=False))


class TestUuid(TestCase):
    def test_uuid_tracks_settings(self):
        always = FlashOverlapPass({"fuse": "always"})
        self.assertIsInstance(always.uuid(), str)
        self.assertEqual(always.uuid(), FlashOverlapPass({"fuse": "always"}).uuid())
        self.assertNotEqual(always.uuid(), FlashOverlapPass({"fuse": "never"}).uuid())
        self.assertNotEqual(always.uuid(), FlashOverlapPass({"fuse": "always", "min_rows": 1}).uuid())
        self.assertNotEqual(always.uuid(), FlashOverlapPass({"fuse": "always", "collectives": ("all_reduce",)}).uuid())
        with mock.patch.dict(os.environ, {"FLASHOVERLAP_FUSE": "never"}):
            config.reload_environment()
            self.assertEqual(FlashOverlapPass().uuid(), FlashOverlapPass({"fuse": "never"}).uuid())
        config.reload_environment()
        before = always.uuid()  # every setting is in the key: the ring's change the route the cost model predicts
        for name, value in (("ring", "wide"), ("ring_rounds", 3), ("swizzle", 8), ("experiments", {"single_group"}),
                            ("wait_timeout_ms", 1000.0), ("transport", "nccl")):
            self.assertNotEqual(before, FlashOverlapPass({"fuse": "always", name: value}).uuid(), name)

    def test_uuid_covers_sources_and_data(self):
        from flashoverlap_inductor.passes import cache_key

        files = {os.path.basename(p) for p in cache_key.source_files(FlashOverlapPass().settings)}
        self.assertTrue({"gemm_collective.py", "matching.py", "rewrite.py", "sum_of_gemms.py", "cache_key.py",
                         "ops.py", "plan.py", "steps.py",
                         "peer.py", "ring.py", "nccl.py", "__init__.py", "config.py"} <= files, files)
        self.assertTrue(any(f.endswith(".json") for f in files), files)  # shipped cost-model data

    def test_uuid_changes_when_a_source_changes(self):
        from flashoverlap_inductor.passes import cache_key

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "source.py")
            with mock.patch.object(cache_key, "source_files", lambda settings: [path]):
                with open(path, "w") as f:
                    f.write("x = 1\n")
                first = FlashOverlapPass().uuid()
                self.assertEqual(first, FlashOverlapPass().uuid())
                with open(path, "w") as f:
                    f.write("x = 2\n")
                self.assertNotEqual(first, FlashOverlapPass().uuid())


if __name__ == "__main__":
    run_tests()
