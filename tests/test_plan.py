"""The shared layout module: plans, buffer layouts and the tile -> group mapping.

The layout tests simulate the per-group collectives in pure torch on W virtual ranks and check that what each
rank ends with equals what the unfused collective returns, on random data and random plans.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashoverlap_inductor.schedule import plan as P


def _random_bounds(rng: random.Random, m: int, max_groups: int, align: int = 1) -> tuple[int, ...]:
    cands = list(range(align, m, align))
    inner = sorted(rng.sample(cands, min(len(cands), rng.randint(0, max_groups - 1))))
    return (0, *inner, m)


def test_plan_invariants_and_round_trip() -> None:
    p = P.GroupPlan(1000, 512, 128, 256, (0, 256, 640, 1000), "coop_128x256")
    assert P.GroupPlan.from_str(p.to_str()) == p
    assert p.num_groups == 3 and p.tile_rows == 8 and p.tile_cols == 2
    assert p.group_rows() == [256, 384, 360]
    for bad in [(0, 1000, 1000), (1, 1000), (0, 500), (0,)]:
        with pytest.raises(ValueError):
            P.GroupPlan(1000, 512, 128, 256, bad)
    with pytest.raises(ValueError):
        P.GroupPlan.from_str("v0;m=1")


def test_uniform_plan_alignment() -> None:
    p = P.uniform_plan(8192, 8192, 128, 256, 4, align=4)
    assert p.row_bounds == (0, 2048, 4096, 6144, 8192)
    q = P.uniform_plan(100, 64, 128, 64, 4)  # fewer rows than one tile: one group
    assert q.row_bounds == (0, 100)
    r = P.uniform_plan(1000, 64, 128, 64, 3, align=3)
    assert all(b % 384 == 0 for b in r.row_bounds[1:-1])


def test_plan_from_tile_row_counts_clips() -> None:
    p = P.plan_from_tile_row_counts(1000, 64, 128, 64, [2, 3, 5])
    assert p.row_bounds == (0, 256, 640, 1000)


def test_group_of_tile_row_straddling_tiles_go_to_the_earlier_group() -> None:
    bounds = (0, 100, 130, 300, 520)
    # tile-rows of 128: [0,128) starts in g0; [128,256) starts in g1 (128 in [100,130)); [256,384) in g2;
    # [384,512) in g3; [512,520) in g3.
    assert P.group_of_tile_row(bounds, 128) == [0, 1, 2, 3, 3]
    assert P.tiles_per_group(bounds, 128, 64, 200) == [4, 4, 4, 8]


def test_tiles_per_group_matches_the_mapping_on_random_plans() -> None:
    rng = random.Random(0)
    for _ in range(500):
        m, tm, tn, n = rng.randint(1, 5000), rng.choice([64, 128, 256]), rng.choice([128, 256]), rng.randint(1, 900)
        bounds = _random_bounds(rng, m, 8)
        counts = [0] * (len(bounds) - 1)
        for g in P.group_of_tile_row(bounds, tm):
            counts[g] += -(-n // tn)
        assert counts == P.tiles_per_group(bounds, tm, tn, n)
        assert sum(counts) == -(-m // tm) * -(-n // tn)


def test_chunks_for() -> None:
    assert P.chunks_for("all_reduce", 12, 4) == [12]
    assert P.chunks_for("reduce_scatter", 12, 4) == [3, 3, 3, 3]
    assert P.chunks_for("all_to_all", 12, 4) == [3, 3, 3, 3]
    assert P.chunks_for("all_to_all", 12, 3, [5, 0, 7]) == [5, 0, 7]
    with pytest.raises(ValueError):
        P.chunks_for("reduce_scatter", 10, 4)
    with pytest.raises(ValueError):
        P.chunks_for("broadcast", 10, 2)


def _buffer_from_segments(x: torch.Tensor, layout: P.BufferLayout) -> torch.Tensor:
    buf = torch.full_like(x, float("nan"))  # poisoned: every row must be written
    for dst, src, rows in layout.segments:
        buf[dst:dst + rows] = x[src:src + rows]
    assert not torch.isnan(buf).any()
    return buf


def test_all_reduce_layout_is_the_identity() -> None:
    p = P.uniform_plan(777, 16, 128, 16, 3)
    layout = P.buffer_layout(p, P.chunks_for("all_reduce", 777, 2))
    assert layout.is_identity and layout.group_bounds == p.row_bounds


@pytest.mark.parametrize("seed", range(20))
def test_reduce_scatter_groups_deliver_each_rank_its_natural_shard(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([2, 4, 8])
    m = world * rng.randint(1, 200)
    p = P.GroupPlan(m, 8, 128, 8, _random_bounds(rng, m, 6, align=world))
    layout = P.buffer_layout(p, P.chunks_for("reduce_scatter", m, world))
    ys = [torch.randn(m, 8, dtype=torch.float64) for _ in range(world)]  # each rank's GEMM output
    bufs = [_buffer_from_segments(y, layout) for y in ys]
    expected = sum(ys).chunk(world)  # reduce_scatter_tensor of the natural outputs
    for r in range(world):
        out = torch.full((m // world, 8), float("nan"), dtype=torch.float64)
        for g in range(p.num_groups):
            lo, hi = layout.group_bounds[g], layout.group_bounds[g + 1]
            part = sum(b[lo:hi] for b in bufs).chunk(world)[r]  # reduce_scatter of the group's contiguous slice
            off = layout.output_offsets(g)[r]
            assert part.shape[0] == layout.pieces[g][r]
            out[off:off + part.shape[0]] = part
        torch.testing.assert_close(out, expected[r])


@pytest.mark.parametrize("seed", range(20))
def test_all_to_all_groups_deliver_the_natural_all_to_all_output(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    splits = [[rng.randint(0, 40) for _ in range(world)] for _ in range(world)]  # splits[src][dst]
    fractions = _random_bounds(rng, 1000, 5)
    ys, layouts = [], []
    for src in range(world):
        m = sum(splits[src])
        ys.append(torch.randn(m, 4, dtype=torch.float64))
        if m == 0:
            layouts.append(None)
            continue
        # every rank uses the same fractions, scaled to its own rows
        bounds = sorted({(b * m) // 1000 for b in fractions} | {0, m})
        p = P.GroupPlan(m, 4, 64, 4, tuple(bounds))
        layouts.append((p, P.buffer_layout(p, splits[src])))
    for dst in range(world):
        expected = torch.cat([ys[src][sum(splits[src][:dst]):sum(splits[src][:dst + 1])] for src in range(world)])
        got = torch.full_like(expected, float("nan"))
        recv_off = [sum(splits[s][dst] for s in range(src)) for src in range(world)]
        for src in range(world):
            if layouts[src] is None:
                continue
            p, layout = layouts[src]
            buf = _buffer_from_segments(ys[src], layout)
            # the receiver's view of the same cut: chunk_pieces over its output split from this source
            mine = P.chunk_pieces([splits[src][dst]], p.row_bounds)
            for g in range(p.num_groups):
                lo = layout.group_bounds[g] + sum(layout.pieces[g][:dst])
                rows = layout.pieces[g][dst]
                assert rows == mine[g][0]
                off = recv_off[src] + layout.output_offsets(g)[dst]
                got[off:off + rows] = buf[lo:lo + rows]
        torch.testing.assert_close(got, expected)


def test_group_segments_are_clipped_to_their_group() -> None:
    p = P.uniform_plan(1024, 8, 128, 8, 4)
    layout = P.buffer_layout(p, [1024])
    assert layout.segments == ((0, 0, 1024),)
    assert [layout.group_segments(g) for g in range(4)] == [[(0, 0, 256)], [(256, 256, 256)], [(512, 512, 256)],
                                                            [(768, 768, 256)]]
    rs = P.buffer_layout(p, [512, 512])
    for g in range(4):
        rows = sum(s[2] for s in rs.group_segments(g))
        assert rows == rs.group_bounds[g + 1] - rs.group_bounds[g]
