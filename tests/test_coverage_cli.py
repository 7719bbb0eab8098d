"""Coverage of the graphs real models produce, at batch 1 (the usual long-sequence shape), on 2 gloo ranks:
``flashoverlap_inductor.model_coverage`` and ``python -m flashoverlap_inductor.bench coverage`` (nothing timed).

* ``sp`` (HF Llama, one layer, training): every all_gather a GEMM reads and every reduce_scatter a GEMM feeds is
  fused, forward and backward, with no near miss: at batch 1 funcol gathers the sequence dim as a ``reshape`` (the
  chunks of a batch-1 tensor are consecutive), at batch 2 as split/cat;
* ``tp`` (HF Qwen3, prefill): both row-parallel all_reduces fused;
* ``ep`` (the tiny MoE, prefill): the attention's gather and reduce_scatter fused, and the MoE combine (the experts'
  GEMMs, the un-permutation and the all_to_all: one op) and the MoE dispatch (the all_to_all, the permutation and
  the experts' gate_up GEMMs: one op); the count exchange is left;
* ``--model MODULE:FUNCTION`` on a user's own DTensor-parallel MLP, through the CLI's ``run``.
"""

from __future__ import annotations

import contextlib
import io

import pytest

pytest.importorskip("transformers")

from dist_utils import get_pool  # noqa: E402


def preset_worker(preset: str, plan: str, workload: str, batch: int, settings: dict | None = None) -> dict:
    """``model_coverage`` of a one-layer preset under ``plan`` at ``batch`` (seq 16) on this rank, under
    ``settings`` (``config.patch`` names)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from flashoverlap_inductor import config, model_coverage
    from flashoverlap_inductor.bench import models, plans
    from flashoverlap_inductor.bench.runner import Prefill, TrainLoss

    torch._dynamo.reset()
    spec = models.PRESETS[preset].with_overrides(layers=1)
    model = plans.apply(models.build(spec, torch.device("cpu"), torch.float32, 0, 16), spec, plan,
                        init_device_mesh("cpu", (2,)))
    ids = torch.randint(0, spec.vocab, (batch, 16), generator=torch.Generator().manual_seed(batch))
    with torch._dynamo.config.patch(capture_scalar_outputs=spec.moe), torch.set_grad_enabled(workload == "train"), \
            config.patch(**(settings or {})):
        cov = model_coverage(TrainLoss(model), ids, ids) if workload == "train" else model_coverage(Prefill(model), ids)
    events = {kind: sorted(c for c in ev if c.startswith(("skip:", "near_miss:"))) for kind, ev in cov.events.items()}
    return {"fused": {k: g["fused"] for k, g in cov.graphs.items()}, "events": events,
            "near": cov.near_misses, "left_gemm": cov.left_beside_gemm, "text": str(cov)}


def make_user_mlp(mesh):
    """A user's model for ``--model``: a tensor-parallel MLP (DTensor colwise -> rowwise) and a batch-1 input."""
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return mlp, (torch.randn(1, 24, 32),)


def cli_worker() -> tuple[int, str]:
    import torch

    from flashoverlap_inductor.bench.cli_coverage import run

    torch._dynamo.reset()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run(["--device", "cpu", "--model", f"{__name__}:make_user_mlp", "--backward", "off", "--strict"])
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_sp_training_at_batch_1_fuses_every_gather_and_reduce_scatter(pool, preset):
    """Gemma 3's norms around each sublayer (the plan's SequenceParallel on all four) leave Llama's patterns."""
    got = pool.run(preset_worker, preset, "sp", "train", 1, timeout_s=400)[0]
    assert got["fused"]["forward"] == {"flashoverlap:all_gather_gemm": 3, "flashoverlap:gemm_reduce_scatter": 2}, got
    assert got["fused"]["backward"] == {"flashoverlap:all_gather_gemm": 2, "flashoverlap:gemm_reduce_scatter": 2}, got
    # the one gather left: the embedding's gradient, which no GEMM reads
    assert got["events"] == {"forward": [], "backward": ["skip:no_gemm_consumer"]}, got
    assert got["near"] == 0 and got["left_gemm"] == 0, got["text"]


def test_tp_prefill_at_batch_1_without_tp_sequence(pool):
    got = pool.run(preset_worker, "tiny-qwen3", "tp", "prefill", 1, {"tp_sequence": "off"}, timeout_s=400)[0]
    assert got["fused"]["inference"] == {"flashoverlap:gemm_all_reduce": 2}, got
    assert got["near"] == 0 and got["left_gemm"] == 0, got["text"]


def test_tp_prefill_under_tp_sequence(pool):
    """The setting ``tp_sequence`` (on by default) makes the SP plan's fusions out of the TP plan's graph: both
    all_reduces reduce_scatters, the MLP's gate/up fed by a fused all_gather (the attention's q/k/v read the embedding's
    norm, never sharded; the final norm's gather is read through the last position's slice)."""
    got = pool.run(preset_worker, "tiny-qwen3", "tp", "prefill", 1, timeout_s=400)[0]
    assert got["fused"]["inference"] == {"flashoverlap:all_gather_gemm": 1, "flashoverlap:gemm_reduce_scatter": 2}, got
    assert got["events"] == {"inference": ["skip:row_subset"]}, got
    assert got["near"] == 0 and got["left_gemm"] == 0, got["text"]


def test_ep_prefill_at_batch_1_fuses_the_attention_and_the_moe_combine_and_dispatch(pool):
    got = pool.run(preset_worker, "tiny-moe", "ep", "prefill", 1, timeout_s=400)[0]
    assert got["fused"]["inference"] == {"flashoverlap:all_gather_gemm": 1, "flashoverlap:gemm_reduce_scatter": 1,
                                         "flashoverlap:gemm_unpermute_all_to_all": 1,
                                         "flashoverlap:all_to_all_permute_gemm": 1}, got
    # lm_head's last position (a slice of the gathered rows)
    assert got["events"]["inference"] == ["skip:row_subset"], got
    assert got["near"] == 0 and got["left_gemm"] == 0, got["text"]


def test_cli_on_a_users_own_model(pool):
    rc, text = pool.run(cli_worker, timeout_s=300)[0]
    assert rc == 0, text
    assert "fused ops flashoverlap:gemm_all_reduce 1" in text, text
    assert "0 near miss(es), 0 collective(s) left beside a GEMM" in text, text


def test_cli_experiments_reach_the_options():
    from flashoverlap_inductor.bench import cli_coverage

    args = cli_coverage.build_parser().parse_args(["--preset", "tiny-llama", "--experiments",
                                                   "scatter_pull,tp_sequence=off"])
    assert cli_coverage._options(args) == {"flashoverlap.experiments": ["scatter_pull"],
                                           "flashoverlap.tp_sequence": "off"}
    assert cli_coverage._options(cli_coverage.build_parser().parse_args(["--preset", "tiny-llama"])) == {}
