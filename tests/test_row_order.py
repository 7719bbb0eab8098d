"""The "schedule" route (tile-row order in the GEMM's scheduler, natural rows): on random plans and layouts, what
the collectives read equals what the gather route's buffer holds, and no group is released before its rows are
written. Pure torch on CPU; the GPU tests run the same route on the device."""

from __future__ import annotations

import random

import pytest
import torch

from flashoverlap_inductor.runtime.kernel_select import gather_rows
from flashoverlap_inductor.schedule import plan as P
from flashoverlap_inductor.schedule import row_order
from flashoverlap_inductor.schedule import steps as sched


def _random_bounds(rng: random.Random, m: int, max_groups: int, align: int = 1) -> tuple[int, ...]:
    cands = list(range(align, m, align))
    inner = sorted(rng.sample(cands, min(len(cands), rng.randint(1, max_groups - 1))))
    return (0, *inner, m)


def _check_release_order(layout: P.BufferLayout, gmap: list[int], order: list[int], tile_m: int) -> None:
    """Every row of group g lies in a tile-row counted by a group <= g (released no later), and the order is a
    permutation that runs the groups one after another."""
    assert sorted(order) == list(range(len(gmap)))
    assert [gmap[t] for t in order] == sorted(gmap)
    for g in range(len(layout.pieces)):
        for _, natural, rows in layout.natural_pieces(g):
            for r in range(natural, natural + rows):
                assert gmap[r // tile_m] <= g


@pytest.mark.parametrize("seed", range(25))
def test_reduce_scatter_pieces_deliver_each_rank_its_shard(seed: int) -> None:
    """The "schedule" route: per group, one reduce per chunk piece (root = the chunk's rank) from natural rows."""
    rng = random.Random(seed)
    world = rng.choice([2, 4, 8])
    tile_m = rng.choice([64, 128])
    m, n = world * rng.randint(1, 100) * rng.choice([1, 8]), 8
    p = P.GroupPlan(m, n, tile_m, 128, _random_bounds(rng, m, 6, align=world))
    layout = P.buffer_layout(p, P.chunks_for("reduce_scatter", m, world))
    ds = [torch.randn(m, n, dtype=torch.float64) for _ in range(world)]  # every rank's GEMM output, natural rows
    expected = sum(ds).chunk(world)
    for rank in range(world):
        steps = sched.schedule_steps("reduce_scatter", p.to_str(), m, n, 32, "bfloat16", world, rank)
        nat = row_order.natural_order("reduce_scatter", layout, steps, tile_m, 128, n)
        _check_release_order(layout, nat.group_of_row, nat.order, tile_m)
        out = torch.full((m // world, n), float("nan"), dtype=torch.float64)
        for step in nat.steps:
            for root, lo, hi in step.sends:
                if root == rank:  # what ncclReduce delivers to this root: the sum of the piece over the ranks
                    assert hi - lo == step.out[1] - step.out[0]
                    out[step.out[0]:step.out[1]] = sum(d[lo:hi] for d in ds)
        torch.testing.assert_close(out, expected[rank])


@pytest.mark.parametrize("seed", range(25))
def test_all_to_all_sends_natural_rows_of_the_same_data(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    rank = rng.randrange(world)
    tile_m = rng.choice([64, 128])
    send = tuple(rng.randint(0, 300) for _ in range(world))
    recv = tuple(send[j] if j == rank else rng.randint(0, 300) for j in range(world))  # ours to ourselves agree
    m, n = sum(send), 8
    if m == 0:
        return
    bounds = _random_bounds(rng, m, 5) if m > 1 else (0, m)
    p = P.GroupPlan(m, n, tile_m, 128, bounds)
    layout = sched.resolve_schedule("all_to_all", p.to_str(), m, n, 32, "bfloat16", world, send, recv).layout
    steps = sched.schedule_steps("all_to_all", p.to_str(), m, n, 32, "bfloat16", world, rank, send, recv)
    nat = row_order.natural_order("all_to_all", layout, steps, tile_m, 128, n)
    assert not isinstance(nat, str)
    _check_release_order(layout, nat.group_of_row, nat.order, tile_m)
    d = torch.randn(m, n, dtype=torch.float64)
    buffer = d.index_select(0, torch.tensor(gather_rows(layout) or list(range(m)), dtype=torch.long))
    for old, new in zip(steps, nat.steps):
        assert (old.lo, old.hi, old.recvs) == (new.lo, new.hi, new.recvs)
        for (j, lo, hi), (j2, nlo, nhi) in zip(old.sends, new.sends):
            assert j == j2 and hi - lo == nhi - nlo
            torch.testing.assert_close(d[nlo:nhi], buffer[lo:hi])
        if old.local is not None:
            (b, o, c), (nb, no, nc) = old.local, new.local
            assert (o, c) == (no, nc)
            torch.testing.assert_close(d[nb:nb + nc], buffer[b:b + c])


def test_straddling_tile_rows_go_to_the_earliest_group() -> None:
    # two chunks of 100 rows, tile_m 64: tile-row 1 (rows 64..127) holds chunk 0's rows 64..99 and chunk 1's 0..27
    p = P.GroupPlan(200, 8, 64, 8, (0, 100, 200))
    layout = P.buffer_layout(p, [100, 100])  # group 0: rows 0..49 and 100..149; group 1: 50..99 and 150..199
    gmap = P.natural_group_of_tile_row(layout, 64)
    assert gmap == [0, 0, 0, 1]  # tile-row 1 holds rows 64..127: chunk 0's group 1 and chunk 1's group 0
    assert P.scheduled_tile_rows(gmap) == [0, 1, 2, 3]
    assert P.tiles_of_groups(gmap, 2, 8, 8) == [3, 1]


def test_route_setting() -> None:
    """The measured default per collective and world size; the tuning setting overrides it."""
    assert row_order.route() == "schedule"
    assert row_order.route(None, "reduce_scatter", 2) == "schedule"
    assert row_order.route(None, "all_to_all", 4) == "schedule"
    assert row_order.route(None, "reduce_scatter", 4) == "gather"  # measured on 2 GPUs only
    assert row_order.route("schedule", "reduce_scatter", 4) == "schedule"
    assert row_order.route("gather", "all_to_all", 2) == "gather"
    with pytest.raises(ValueError):
        row_order.route("stage")
