"""Tensor (and sequence) parallelism beside FSDP2 on a 2-D mesh, as torchtitan composes them: 4 gloo ranks, mesh
``(dp 2, tp 2)``, the benchmark's ``tp`` / ``sp`` plan on the ``tp`` sub-mesh, each decoder layer compiled on its own
(``dynamic=False``) and then ``fully_shard`` over ``dp`` (the whole model too), every ``dp`` rank its own batch.
Three AdamW steps of a Llama model under ``backend="flashoverlap"`` (``fuse="always"``) must give Inductor's losses,
with every collective of the ``tp`` group beside a GEMM fused (the fused ops run on the 2-rank ``tp`` sub-group, not
the world; FSDP's own collectives run outside the compiled graphs and are left alone).

One ``torch.compile`` of the whole FSDP-wrapped sequence-parallel model fails in torch 2.13's Dynamo before any
backend runs (a DTensor on the ``tp`` sub-mesh under dynamic shapes: "unhashable type: non-nested SymInt"), which is
why the per-layer form (``dynamic=False``) is the one checked."""

from __future__ import annotations

import pytest
from dist_utils import adamw_losses, get_pool

# ------------------------------------------------------------------------------------------ helpers (ranks)


def _build(plan: str, backend: str, mesh):
    import torch
    from torch.distributed.fsdp import fully_shard

    from flashoverlap_inductor.bench import models, plans

    spec = models.PRESETS["tiny-llama"]
    model = plans.apply(models.build(spec, torch.device("cpu"), torch.float32, 0, 64), spec, plan, mesh["tp"])
    options = {"flashoverlap.fuse": "always"} if backend == "flashoverlap" else {}
    for i, layer in enumerate(model.model.layers):  # torchtitan's order: parallelize, compile per block, shard
        layer = torch.compile(layer, backend=backend, options=options, dynamic=False)
        model.model.layers[i] = layer
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return spec, model


def train_worker(plan: str) -> dict:
    """Per backend: the losses of 3 AdamW steps and (flashoverlap) the pass's and the dispatcher's counts."""
    import torch
    from torch._inductor.utils import fresh_cache
    from torch.distributed.device_mesh import init_device_mesh

    from flashoverlap_inductor import reporting as fo

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {"tp_group": mesh["tp"].get_group().group_name}
    for backend in ("inductor", "flashoverlap"):
        torch._dynamo.reset()
        fo.reset_fusion_report()
        with fresh_cache():
            spec, model = _build(plan, backend, mesh)
            gen = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())  # each dp rank its own batch
            losses = adamw_losses(model, spec.vocab, gen, batch=1)
        report = fo.fusion_report()
        out[backend] = {"losses": losses, "compile": dict(report.compile), "runtime": dict(report.runtime)}
    torch._dynamo.reset()
    return out


# ------------------------------------------------------------------------------------------ tests (4 ranks)


@pytest.fixture(scope="module")
def pool():
    return get_pool(4)


@pytest.mark.parametrize(("plan", "fused"), [
    # tp: the two layers share one compiled graph pair (2 all_reduces forward: o, down; 5 backward: the input
    # gradients of q, k, v, gate, up); sp: two graph pairs (layer 0's input hook, likely), 2 x (2 + 2) each
    ("tp", {"fused:all_reduce": 7}),
    ("sp", {"fused:all_gather": 8, "fused:reduce_scatter": 8}),
])
def test_tp_beside_fsdp2_matches_inductor_and_fuses_on_the_tp_group(pool, plan, fused):
    import torch

    results = pool.run(train_worker, plan, timeout_s=600)
    assert len({r["tp_group"] for r in results}) == 2  # two tp sub-groups, neither the world
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["flashoverlap"]["losses"], r["inductor"]["losses"], rtol=1e-5, atol=1e-6,
                                   msg=lambda s, rank=rank: f"rank {rank}: {s}")
        compiled = {k: v for k, v in r["flashoverlap"]["compile"].items() if k.startswith("fused:")}
        assert compiled == fused, r["flashoverlap"]
        assert r["flashoverlap"]["runtime"].get("route:cpu", 0) > 0, r["flashoverlap"]
    # rank = 2 dp + tp: the two tp ranks of a dp rank share its batch and loss; the dp ranks' batches differ
    torch.testing.assert_close(results[0]["inductor"]["losses"], results[1]["inductor"]["losses"], rtol=1e-6, atol=0)
    assert results[0]["inductor"]["losses"] != results[2]["inductor"]["losses"]
