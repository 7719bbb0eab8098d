"""The MoE dispatch fused end to end on 2 gloo ranks: ``torch.compile(..., backend="flashoverlap")`` of real
expert-parallel models against eager, forward and gradients, with the pass's counters checked inside each rank.

* the e2e harness's ``ep`` plan of tiny-moe (Qwen3-MoE) and tiny-mixtral, per-expert ``mm`` loop, fp32, batch 1 and
  2: the forward's dispatch (all_to_all -> index -> split_with_sizes -> gate_up ``mm`` per expert) and the
  backward's (the combine's gradient: all_to_all -> index -> expand -> slices -> the down GEMMs' input gradients)
  are fused beside the combine; only the count exchange is left;
* the harness's MoE block with ``torch._grouped_mm`` in bf16;
* torchtitan's expert-parallel data path (``TitanStyleMoE`` of ``test_combine_pass``, its op sequence re-typed),
  whose forward feeds the permuted rows to two grouped GEMMs (w1 and w3);
* ``fuse="auto"`` with the package's data: every rank declines every dispatch alike (``skip:dispatch_auto``; where
  the model's terms make it pay: ``test_moe_auto.py``);
* declined forms, each with its slug.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from dist_utils import get_pool
from torch import nn

pytest.importorskip("transformers")

from test_combine_pass import FP32, TitanStyleMoE, _compare, _Run  # noqa: E402  (after the importorskip)
from test_combine_pass import ep_model_worker as combine_ep_model_worker  # noqa: E402

OP = "all_to_all_permute_gemm"


class _DispatchRun(_Run):
    def report(self) -> dict:
        from flashoverlap_inductor import routes
        from flashoverlap_inductor.passes import counters

        keep = ("dispatch", "combine", "near_miss")
        return {"pass": {k: v for k, v in counters.items() if any(w in k for w in keep)},
                "calls": routes.stats["dispatch:p2p"], "combine_calls": routes.stats["combine:p2p"]}


def ep_model_worker(preset: str, batches: list[int], fuse: str = "always", dynamic: bool | None = False,
                    options: dict | None = None) -> dict:
    """``test_combine_pass.ep_model_worker`` (the harness's ep plan vs eager), reporting the dispatch's counters."""
    return combine_ep_model_worker(preset, batches, fuse, dynamic, run_cls=_DispatchRun, seed=3, options=options)


def _paying_data(tmp_path) -> str:
    """The package's data files with MoE terms under which every MoE op pays (no host floor, a fast fused path)."""
    import json
    import shutil

    from flashoverlap_inductor import configs

    out = tmp_path / "data"
    shutil.copytree(configs.__path__[0], out, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    path = out / "gemm_h200.json"
    doc = json.loads(path.read_text())
    for op in ("dispatch", "combine"):
        doc["moe"][op].update(factor=0.01, host_floor_ms=0.0, model_error=0.0)
    path.write_text(json.dumps(doc))
    return str(out)

def _block_vs_eager(ref: nn.Module, x: torch.Tensor, dy: torch.Tensor, experiments: frozenset = frozenset(),
                    options: dict | None = None) -> dict:
    """Compiled (fuse "always", or as ``options`` say) vs eager output, input and parameter gradients (bf16); the
    dispatch ops' lines of the post-grad graphs, forward then backward; ``experts``: calls the expert cut took."""
    from test_combine_pass import BF16

    from flashoverlap_inductor import routes

    got, lines = copy.deepcopy(ref), []
    options = {"flashoverlap.fuse": "always", "post_grad_custom_post_pass": lambda g: lines.extend(
        line.strip() for line in g.python_code("self").src.splitlines() if f"flashoverlap.{OP}" in line),
        **(options or {})}
    if experiments:
        options["flashoverlap.experiments"] = experiments
    before = routes.stats["dispatch:experts"]
    with _DispatchRun() as run:
        compiled = torch.compile(got, backend="flashoverlap", options=options)
        x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out_got = ref(x_ref), compiled(x_got)
        out_ref.backward(dy)
        out_got.backward(dy)
        _compare(ref, got, out_ref.detach(), out_got.detach(), BF16)
        torch.testing.assert_close(x_got.grad.float(), x_ref.grad.float(), **BF16)
        return {**run.report(), "ops": lines, "experts": routes.stats["dispatch:experts"] - before}


def grouped_block_worker(experiments: frozenset = frozenset()) -> dict:
    from flashoverlap_inductor.bench import models, moe

    spec = models.PRESETS["tiny-moe"].with_overrides(layers=1)
    block = models.build(spec, torch.device("cpu"), torch.float32, 0, 16).model.layers[0].mlp
    ref = moe.ExpertParallelMoE(block, dist.group.WORLD, "grouped").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(13 + dist.get_rank())
    x, dy = (torch.randn(2, 8, spec.hidden, generator=gen).to(torch.bfloat16) for _ in range(2))
    return _block_vs_eager(ref, x, dy, experiments)


def inference_block_worker(form: str) -> dict:
    """The harness's MoE block (``form``: "grouped" in bf16, "loop" in fp32) compiled under ``no_grad``: nothing but
    the GEMMs reads the permuted rows, so the op is told not to return them (the plan suffix ``+no_rows``); the
    output must equal eager's. Returns the counters and the op's graph lines."""
    from test_combine_pass import BF16

    from flashoverlap_inductor.bench import models, moe

    dtype = torch.bfloat16 if form == "grouped" else torch.float32
    spec = models.PRESETS["tiny-moe"].with_overrides(layers=1)
    block = models.build(spec, torch.device("cpu"), torch.float32, 0, 16).model.layers[0].mlp
    ref = moe.ExpertParallelMoE(block, dist.group.WORLD, form).to(dtype)
    x = torch.randn(2, 8, spec.hidden, generator=torch.Generator().manual_seed(31 + dist.get_rank())).to(dtype)
    lines = []
    options = {"flashoverlap.fuse": "always", "post_grad_custom_post_pass": lambda g: lines.extend(
        line.strip() for line in g.python_code("self").src.splitlines() if f"flashoverlap.{OP}" in line)}
    with _DispatchRun() as run, torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(copy.deepcopy(ref), backend="flashoverlap", options=options)(x)
        torch.testing.assert_close(got.float(), ref(x).float(), **(BF16 if form == "grouped" else FP32))
        return {**run.report(), "ops": lines}


def titan_worker() -> dict:
    ref = TitanStyleMoE(64, 32, 4, 2, dist.group.WORLD).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(23 + dist.get_rank())
    x, dy = (torch.randn(16, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    return _block_vs_eager(ref, x, dy)


class Declined(nn.Module):
    """Three dispatches the pass must decline, each with its reason: the experts' GEMMs carry a bias (addmm pieces),
    the pieces overlap, and the permutation indexes two dims."""

    def __init__(self, k: int = 16, n: int = 24) -> None:
        super().__init__()
        self.e0, self.e1 = nn.Linear(k, n), nn.Linear(k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, half = dist.group.WORLD.group_name, x.shape[0] // 2
        perm, w0, w1 = torch.arange(x.shape[0] - 1, -1, -1), self.e0.weight.t(), self.e1.weight.t()
        out = []
        for kind in ("bias", "overlap", "index"):
            recv = funcol.all_to_all_single(x * (len(out) + 1), [half, half], [half, half], group)
            if kind == "bias":
                p = recv[perm]
                out.append(torch.cat([self.e0(p[:half]), self.e1(p[half:])]))
            elif kind == "overlap":
                p = recv[perm]
                out.append(torch.cat([p[:half + 1] @ w0, p[half - 1:] @ w1])[:x.shape[0]])
            else:
                p = recv[perm.unsqueeze(1), torch.arange(x.shape[1])]
                out.append(torch.cat([p[:half] @ w0, p[half:] @ w1]))
        return F.relu(sum(out))


def declined_worker() -> dict:
    with _DispatchRun() as run, torch.no_grad():
        torch.compile(Declined(), backend="flashoverlap", options={"flashoverlap.fuse": "always"})(torch.randn(8, 16))
        return run.report()


class OpenEndedPieces(nn.Module):
    """A dispatch whose rows are data-dependent and whose last piece is ``p[h:]`` (a slice ending at INT64_MAX): the
    op's piece sizes must come out as ``rows - h``, not ``INT64_MAX - h``."""

    def __init__(self, k: int = 16, n: int = 24) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w0 = nn.Parameter(torch.randn(k, n, generator=gen) / 4)
        self.w1 = nn.Parameter(torch.randn(k, n, generator=gen) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD.group_name
        dest = (x[:, 0] > 0).long()
        send = torch.bincount(dest, minlength=2)
        ins, outs = send.tolist(), funcol.all_to_all_single(send, [1, 1], [1, 1], group).tolist()
        for v in ins + outs:
            torch._check(v >= 0)
        recv = funcol.all_to_all_single(x[dest.argsort(stable=True)], outs, ins, group)
        p = recv[torch.arange(recv.shape[0] - 1, -1, -1)]
        torch._check(outs[0] <= p.shape[0])
        return torch.cat([p[:outs[0]] @ self.w0, p[outs[0]:] @ self.w1])


def open_ended_worker() -> dict:
    model = OpenEndedPieces()
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    with _DispatchRun() as run, torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(model, backend="flashoverlap", options={"flashoverlap.fuse": "always"})(x)
        torch.testing.assert_close(got, model(x), **FP32)
        return run.report()


# ------------------------------------------------------------------------------------------ 2-process tests


def _terms(line: str) -> dict:
    """The fused op's GEMM count and offsets from its line of graph code."""
    m = re.search(rf"{OP}\.default\(\w+, \w+, \[([^\]]*)\], (\[[^\]]*\]|None), (\w+),", line)
    assert m is not None, line
    return {"terms": len(m.group(1).split(",")), "offs": m.group(3)}


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("preset, dynamic", [("tiny-moe", False), ("tiny-mixtral", None)])
def test_ep_training_fuses_the_dispatch_forward_and_backward_and_matches_eager(pool, preset, dynamic):
    for got in pool.run(ep_model_worker, preset, [1, 2], "always", dynamic, timeout_s=600):
        # a forward and a backward graph per compilation (one per batch size): one dispatch and one combine each
        assert got["pass"] == {"fused:all_to_all_dispatch": 4, "fused:all_to_all_combine": 4}, got
        assert got["calls"] == 4 and got["combine_calls"] == 4, got


def test_grouped_mm_block_in_bf16(pool):
    for got in pool.run(grouped_block_worker, timeout_s=400):
        assert got["pass"].get("fused:all_to_all_dispatch") == 2 and got["calls"] == 2, got
        forward, backward = (_terms(line) for line in got["ops"])
        assert forward["terms"] == backward["terms"] == 1 and forward["offs"] != "None", got["ops"]
        # training: the forward's rows are saved for the weight gradient, the backward's feed it: both returned
        assert not any("+no_rows" in line for line in got["ops"]), got["ops"]


@pytest.mark.parametrize("form", ["grouped", "loop"])
def test_an_inference_dispatch_does_not_return_the_rows_nothing_reads(pool, form):
    for got in pool.run(inference_block_worker, form, timeout_s=400):
        assert got["pass"].get("fused:all_to_all_dispatch") == 1 and got["calls"] == 1, got
        assert len(got["ops"]) == 1 and "+no_rows'" in got["ops"][0], got["ops"]


def test_the_expert_cut_experiment_gives_the_dispatches_its_plan(pool):
    """Under ``moe_dispatch_by_expert`` the pass gives every dispatch the plan "experts"; the forward's (gate/up
    Linear weights) and the backward's (the down projection as stored: the library's other B layout) take the cut on
    both ranks; everything matches eager."""
    for got in pool.run(grouped_block_worker, frozenset({"moe_dispatch_by_expert"}), timeout_s=400):
        assert got["pass"].get("fused:all_to_all_dispatch") == 2 and got["calls"] == 2, got
        assert all("'experts'" in line for line in got["ops"]) and got["experts"] == 2, got


def test_torchtitan_style_expert_parallel_block(pool):
    for got in pool.run(titan_worker, timeout_s=400):
        assert got["pass"].get("fused:all_to_all_dispatch") == 2 and got["calls"] == 2, got
        forward, backward = (_terms(line) for line in got["ops"])
        # forward: w1's and w3's grouped GEMMs share the permuted rows; backward: w2's input gradient
        assert (forward["terms"], backward["terms"]) == (2, 1), got["ops"]


def test_unsupported_dispatches_are_declined_with_their_reason(pool):
    for got in pool.run(declined_worker, timeout_s=300):
        assert {k: v for k, v in got["pass"].items() if "dispatch" in k} == {
            "skip:dispatch_gemm": 1, "skip:dispatch_pieces": 1, "skip:dispatch_index": 1}, got
        assert got["calls"] == 0, got


def test_auto_declines_every_dispatch_on_every_rank(pool):
    got = pool.run(ep_model_worker, "tiny-moe", [2], "auto", timeout_s=600)
    assert got[0] == got[1], got
    assert got[0]["pass"] == {"skip:dispatch_auto": 2, "skip:combine_auto": 2}, got
    assert got[0]["calls"] == got[0]["combine_calls"] == 0, got


def test_an_open_ended_last_piece_with_data_dependent_rows_fuses(pool):
    for got in pool.run(open_ended_worker, timeout_s=300):
        assert got["pass"] == {"fused:all_to_all_dispatch": 1} and got["calls"] == 1, got
