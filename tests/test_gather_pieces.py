"""The peer route's pieces of a pulled shard (``schedule.gather.pieces`` / ``piece_bounds`` / ``piece_view``) and
the cost model's pipeline over them (``cost_model.gather.peer_pipeline_ms``), on CPU: the pieces cover each shard
once, on tile or leading-element boundaries; the GEMMs of the pieces written through ``piece_view`` equal the
gathered GEMM; the modelled time never grows with pieces and shrinks where a pull is longer than the local
shard's GEMMs. The route itself: ``tests/test_gpu_gather.py`` (GPU)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from flashoverlap_inductor import config
from flashoverlap_inductor.cost_model import gather as cost
from flashoverlap_inductor.cost_model import registry
from flashoverlap_inductor.schedule import gather as schedule


@pytest.mark.parametrize("seed", range(30))
def test_pieces_cover_each_shard_once_on_boundaries(seed):
    rng = random.Random(seed)
    lead = rng.choice([1, 1, 2, 3, 5])
    unit = rng.randint(1, 3000)
    geo = schedule.GatherGeometry(rng.randint(2, 8), lead, unit, 64)
    for requested in (None, 1, 2, 3, 4):
        count = schedule.pieces(geo, requested)
        bounds = schedule.piece_bounds(geo, count)
        assert len(bounds) == count >= 1
        assert bounds[0][0] == 0 and bounds[-1][1] == geo.shard_rows
        assert all(lo < hi for lo, hi in bounds) and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        step = geo.unit if lead > 1 else schedule.PIECE_ALIGN
        assert all(lo % step == 0 for lo, _ in bounds)
        if requested is not None:
            assert count <= requested
    with pytest.raises(ValueError):
        schedule.pieces(geo, schedule.MAX_PIECES + 1)


def test_one_piece_unless_asked():
    assert schedule.pieces(schedule.GatherGeometry(2, 1, 16384, 4096), None) == 1
    assert schedule.pieces(schedule.GatherGeometry(2, 1, 16384, 4096), 4) == 4


@pytest.mark.parametrize("shape,gather_dim", [((256, 16), 0), ((3, 40, 16), 1), ((1, 300, 16), 1), ((2, 2, 7, 16), 2)])
@pytest.mark.parametrize("requested", [1, 2, 3, 4])
def test_piece_gemms_assemble_the_gathered_gemm(shape, gather_dim, requested):
    world = 3
    torch.manual_seed(requested)
    shards = [torch.randn(shape, dtype=torch.float64) for _ in range(world)]
    b = torch.randn(shape[-1], 5, dtype=torch.float64)
    bias = torch.randn(5, dtype=torch.float64)
    gathered = torch.cat(shards, gather_dim).reshape(-1, shape[-1])
    geo = schedule.geometry(list(shape), gather_dim, world)
    out = torch.full((geo.rows, 5), float("nan"), dtype=torch.float64)
    bounds = schedule.piece_bounds(geo, schedule.pieces(geo, requested))
    for j in range(world):
        x = shards[j].reshape(geo.shard_rows, shape[-1])
        for lo, hi in bounds:
            schedule.shard_gemm(x[lo:hi], b, bias, schedule.piece_view(out, geo, j, lo, hi))
    torch.testing.assert_close(out, torch.addmm(bias, gathered, b))


def test_pieces_shorten_the_model_only_where_pulls_wait():
    model, _ = registry.model_for("NVIDIA H200", registry.data_dir(config.current()))
    for rows, n, world in [(4096, 3072, 2), (16384, 3072, 2), (16384, 14336, 2), (8192, 1536, 4)]:
        args = (model, rows // world, [n], 4096, "bfloat16", world)
        times = [cost.peer_pipeline_ms(*args, eff, p) for eff in (0.05, 1.0) for p in (1, 2, 4)]
        slow, fast = times[:3], times[3:]
        assert slow[0] > slow[1] > slow[2]  # a slow link: the GEMMs wait for each pull, pieces start them earlier
        assert fast[2] <= fast[1] <= fast[0]
