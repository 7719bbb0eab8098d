"""CPU checks of the copy route's piece map (``copy_route.pieces`` / ``fits``): on the "schedule" and the "gather"
routes every rank's pieces, over all groups, fill each destination block's rows exactly once, and each group's
pieces cover its GEMM output rows exactly once."""

from __future__ import annotations

import pytest

from flashoverlap_inductor import copy_route, ops, row_order, runtime_cpu
from flashoverlap_inductor import plan as planlib


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("route", ["gather", "schedule"])
@pytest.mark.parametrize("bounds_frac", [(0, 3, 8), (0, 1, 2, 5, 8)])
def test_pieces_tile_every_block_once(world, route, bounds_frac):
    rows, n, k = 4096, 1024, 512
    bounds = tuple(rows * f // 8 for f in bounds_frac)
    plan = planlib.GroupPlan(rows, n, 128, 256, bounds).to_str()
    block = rows // world
    sched = ops.resolve_schedule("reduce_scatter", plan, rows, n, k, "bfloat16", world)
    for rank in range(world):
        steps = runtime_cpu.schedule_steps("reduce_scatter", plan, rows, n, k, "bfloat16", world, rank)
        if route == "schedule":
            nat = row_order.natural_order("reduce_scatter", sched.layout, steps, 128, 256, n, 2)
            assert not isinstance(nat, str), nat
            steps = nat.steps
        assert copy_route.fits(steps, world, block)
        filled = {j: [0] * block for j in range(world)}
        for step in steps:
            got = copy_route.pieces(step, world, block)
            covered = sorted((lo, hi) for _, lo, hi, _ in got)
            if route == "gather":  # the group's buffer rows, in order
                assert covered[0][0] == step.lo and covered[-1][1] == step.hi
            assert sum(hi - lo for lo, hi in covered) == (step.hi - step.lo)
            for j, lo, hi, row in got:
                for r in range(row, row + hi - lo):
                    filled[j][r] += 1
        assert all(v == 1 for j in filled for v in filled[j]), (rank, route)


def test_fits_rejects_unequal_gather_pieces():
    step = runtime_cpu.GroupStep((), 0, 100, out=(0, 30))
    assert not copy_route.fits([step], 4, 1000)
