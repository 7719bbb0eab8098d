"""The fused ops on CPU: 2-process gloo numerics against eager, the schedule/layout in one process (simulated
worlds), validation errors, plan resolution, fake implementations and ``opcheck``.

Every 2-process case runs with ``torch.use_deterministic_algorithms(True)``, which fills ``torch.empty`` with NaN:
a row the schedule forgets to write (or to receive) poisons the comparison.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from dist_utils import get_pool

from flashoverlap_inductor import ops
from flashoverlap_inductor.routes import cpu as cpu_route
from flashoverlap_inductor.schedule import plan as planlib
from flashoverlap_inductor.schedule import steps as sched

K, N = 20, 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 5e-2}}
FORMS = ("2d", "2d_bt", "3d_2d", "bmm", "bmm_expand")
PLAN_KINDS = ("multi", "tiles", "single", "stale", "auto")
BIAS_KINDS = (None, "1d", "full")


# ------------------------------------------------------------------------------------------ helpers (all ranks)


def make_plan(kind: str, rows: int, n: int = N) -> str:
    """Plans with several groups, including groups smaller than a tile (tile_m = 8), a stale one and "auto"."""
    if kind == "auto":
        return "auto"
    if kind == "stale":
        return planlib.uniform_plan(rows + 64, n, 8, 8, 3).to_str()
    if kind == "single":
        return planlib.GroupPlan(rows, n, 8, 8, (0, rows)).to_str()
    if kind == "tiles":
        return planlib.plan_from_tile_row_counts(rows, n, 4, 8, [1, 2, 1, 3]).to_str()
    bounds = sorted({0, rows} | {b for b in (3, 5, rows // 2, rows - 2) if 0 < b < rows})
    return planlib.GroupPlan(rows, n, 8, 8, tuple(bounds)).to_str()


def make_operands(form: str, dim0: int, m: int, dtype: torch.dtype, bias_kind: str | None, gen: torch.Generator):
    """(a, b, bias, reference y) for ``form``; ``dim0`` is y's dim 0 (rows for 2D, batch for 3D)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    if form in ("2d", "2d_bt"):
        a = rnd(dim0, K)
        b = rnd(N, K).t() if form == "2d_bt" else rnd(K, N)
        y_shape = (dim0, N)
    elif form == "3d_2d":
        a, b, y_shape = rnd(dim0, m, K), rnd(N, K).t(), (dim0, m, N)
    elif form == "bmm":
        a, b, y_shape = rnd(dim0, m, K), rnd(dim0, K, N), (dim0, m, N)
    else:  # the graph of x.transpose(0, 1) @ w: permuted a, stride-0 expanded b
        a, b, y_shape = rnd(m, dim0, K).permute(1, 0, 2), rnd(K, N).expand(dim0, K, N), (dim0, m, N)
    bias = None
    if bias_kind == "1d":
        bias = rnd(N)
    elif bias_kind == "full":
        bias = rnd(*y_shape[-2:])
    if a.dim() == 2:
        y = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    else:
        b3 = b if b.dim() == 3 else b.expand(dim0, K, N)
        y = torch.bmm(a, b3) if bias is None else torch.baddbmm(bias.expand(y_shape), a, b3)
    return a, b, bias, y


def _eager_collective(collective: str, y: torch.Tensor, outs=None, ins=None) -> torch.Tensor:
    y = y.contiguous()
    if collective == "all_reduce":
        dist.all_reduce(y)
        return y
    if collective == "reduce_scatter":
        out = y.new_empty(y.shape[0] // dist.get_world_size(), *y.shape[1:])
        ops.reduce_scatter_into(out, y)
        return out
    out = y.new_empty(sum(outs) if outs is not None else y.shape[0], *y.shape[1:])
    dist.all_to_all_single(out, y, outs, ins)
    return out


def _call(collective, a, b, bias, group_name, plan, outs=None, ins=None):
    if collective == "all_reduce":
        return torch.ops.flashoverlap.gemm_all_reduce(a, b, bias, "sum", group_name, plan)
    if collective == "reduce_scatter":
        return torch.ops.flashoverlap.gemm_reduce_scatter(a, b, bias, "sum", dist.get_world_size(), group_name, plan)
    return torch.ops.flashoverlap.gemm_all_to_all(a, b, bias, outs, ins, group_name, plan)


def _splits(split_kind: str, rank: int, dim0: int):
    """(dim0, output_split_sizes, input_split_sizes) for a 2-rank all_to_all; "uneven" gives ranks different
    dim-0 sizes (rank 0 sends [3, 6] and receives [3, 5]; rank 1 sends [5, 2] and receives [6, 2])."""
    if split_kind == "even":
        return dim0, None, None
    if split_kind == "explicit_even":
        return dim0, [dim0 // 2] * 2, [dim0 // 2] * 2
    ins = ([3, 6], [5, 2])[rank]
    outs = ([3, 5], [6, 2])[rank]
    return sum(ins), outs, ins


def check_op_worker(collective: str, dtype_name: str, form: str, split_kind: str, seed: int) -> int:
    """Every bias kind x plan kind of one (collective, dtype, form) against eager; returns the cases run."""
    rank, dtype = dist.get_rank(), DTYPES[dtype_name]
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    three_d = form not in ("2d", "2d_bt")
    m = 5
    cases = 0
    torch.use_deterministic_algorithms(True)  # torch.empty -> NaN: unwritten rows fail the comparison
    try:
        for bias_kind in BIAS_KINDS:
            for plan_kind in PLAN_KINDS:
                dim0 = 4 if three_d else {"all_reduce": 37}.get(collective, 38)
                outs = ins = None
                if collective == "all_to_all":
                    dim0, outs, ins = _splits(split_kind, rank, dim0)
                a, b, bias, y = make_operands(form, dim0, m, dtype, bias_kind, gen)
                rows = y.numel() // N
                plan = make_plan(plan_kind, rows)
                ref = _eager_collective(collective, y, outs, ins)
                out = _call(collective, a, b, bias, group_name, plan, outs, ins)
                where = f"{collective} {dtype_name} {form} bias={bias_kind} plan={plan_kind} splits={split_kind}"
                assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous(), where
                torch.testing.assert_close(out, ref, **TOL[dtype], msg=lambda s, w=where: f"{w}: {s}")
                cases += 1
    finally:
        torch.use_deterministic_algorithms(False)
    return cases


def bad_inputs_worker() -> list[tuple[str, str]]:
    """Each bad call must raise ValueError/RuntimeError on both ranks before any communication."""
    g = dist.group.WORLD.group_name
    a, w = torch.randn(38, K), torch.randn(K, N)
    fo = torch.ops.flashoverlap
    calls = {
        "reduce_op": lambda: fo.gemm_all_reduce(a, w, None, "max", g, "auto"),
        "indivisible": lambda: fo.gemm_reduce_scatter(a[:37], w, None, "sum", 2, g, "auto"),
        "group_size": lambda: fo.gemm_reduce_scatter(a, w, None, "sum", 3, g, "auto"),
        "split_sum": lambda: fo.gemm_all_to_all(a, w, None, [19, 19], [20, 19], g, "auto"),
        "split_len": lambda: fo.gemm_all_to_all(a, w, None, [38], [38], g, "auto"),
        "self_split": lambda: fo.gemm_all_to_all(a, w, None, [18, 20], [20, 18], g, "auto"),
        "bias_shape": lambda: fo.gemm_all_reduce(a, w, torch.randn(N + 1), "sum", g, "auto"),
        "inner_dim": lambda: fo.gemm_all_reduce(a, torch.randn(K + 1, N), None, "sum", g, "auto"),
        "dtype": lambda: fo.gemm_all_reduce(a, w.double(), None, "sum", g, "auto"),
        "bad_plan": lambda: fo.gemm_all_reduce(a, w, None, "sum", g, "v9;m=1"),
    }
    out = []
    for name, call in calls.items():
        try:
            call()
        except (ValueError, RuntimeError) as exc:
            out.append((name, str(exc)))
        else:
            out.append((name, "NO ERROR"))
    dist.barrier()  # both ranks are still in step: nothing was half-sent
    return out


def opcheck_worker() -> list[dict]:
    """Full opcheck on a real gloo world: the fake PG moves no P2P data (all_to_all), and on some torch versions
    (2.11) its reduce_scatter leaves the output unwritten, so those ops' numerics need real collectives."""
    g = dist.group.WORLD.group_name
    torch.manual_seed(dist.get_rank())
    a, w, bias = torch.randn(12, K), torch.randn(N, K), torch.randn(N)
    a3, b3 = torch.randn(4, 3, K), torch.randn(K, N).expand(4, K, N)
    ins, outs = ([5, 7], [6, 6])[dist.get_rank()], ([5, 6], [7, 6])[dist.get_rank()]
    a2a_in = torch.randn(sum(ins), K)
    fo = torch.ops.flashoverlap
    return [torch.library.opcheck(fo.gemm_all_to_all.default, (a2a_in, w.t(), bias, outs, ins, g, "auto")),
            torch.library.opcheck(fo.gemm_all_to_all.default,
                                  (a2a_in[:12], w.t(), None, None, None, g, make_plan("multi", 12))),
            torch.library.opcheck(fo.gemm_reduce_scatter.default, (a, w.t(), bias, "sum", 2, g, "auto")),
            torch.library.opcheck(fo.gemm_reduce_scatter.default,
                                  (a3, b3, None, "sum", 2, g, make_plan("tiles", 12)))]


# ------------------------------------------------------------------------------------------ 2-process tests


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_op_matches_eager(pool, collective, form, dtype_name):
    cases = pool.run(check_op_worker, collective, dtype_name, form, "", 1)
    assert cases == [len(BIAS_KINDS) * len(PLAN_KINDS)] * 2


@pytest.mark.parametrize("split_kind", ["even", "explicit_even", "uneven"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("form", FORMS)
def test_all_to_all_matches_eager(pool, form, dtype_name, split_kind):
    cases = pool.run(check_op_worker, "all_to_all", dtype_name, form, split_kind, 2)
    assert cases == [len(BIAS_KINDS) * len(PLAN_KINDS)] * 2


def test_bad_inputs_raise_clear_errors(pool):
    expect = {"reduce_op": "reduce_op must be 'sum'", "indivisible": "does not divide", "group_size": "group_size 3",
              "split_sum": "sum to dim 0", "split_len": "needs 2 split sizes", "self_split": "sends itself",
              "bias_shape": "does not broadcast", "inner_dim": "inner sizes", "dtype": "share a dtype",
              "bad_plan": "bad plan string"}
    for per_rank in pool.run(bad_inputs_worker):
        got = dict(per_rank)
        for name, fragment in expect.items():
            assert fragment in got[name], (name, got[name])


def test_opcheck_all_to_all_gloo(pool):
    """All of opcheck's utilities (incl. ``test_aot_dispatch_dynamic``) for all_to_all and reduce_scatter."""
    for per_rank in pool.run(opcheck_worker):
        assert len(per_rank) == 4
        for result in per_rank:
            assert set(result.values()) == {"SUCCESS"}, result


# ------------------------------------------------------------------------------------------ one process


def _expected_buffer(y: torch.Tensor, chunks: list[int], bounds) -> torch.Tensor:
    """Independent statement of the layout: group g holds, chunk by chunk, the next piece of every chunk."""
    pieces = planlib.chunk_pieces(chunks, bounds)
    starts = [sum(chunks[:k]) for k in range(len(chunks))]
    done = [0] * len(chunks)
    parts = []
    for per_chunk in pieces:
        for k, rows in enumerate(per_chunk):
            parts.append(y[starts[k] + done[k]:starts[k] + done[k] + rows])
            done[k] += rows
    return torch.cat(parts)


def _buffer_of(steps, a, b, bias, rows) -> torch.Tensor:
    buf = torch.full((rows, N), float("nan"))
    gemm = cpu_route._RowGemm(a, b, bias, ops.gemm_output_shape(a, b, bias))
    for step in steps:
        for buf_row, src, count in step.segments:
            assert step.lo <= buf_row and buf_row + count <= step.hi
            gemm(src, count, buf[buf_row:buf_row + count])
    return buf


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("form", ["2d_bt", "bmm_expand"])
@pytest.mark.parametrize("plan_kind", ["multi", "tiles", "single"])
def test_buffer_rows_come_from_the_right_input_rows(world, form, plan_kind):
    gen = torch.Generator().manual_seed(world)
    a, b, bias, y = make_operands(form, 12 * world, 3, torch.float32, "full", gen)
    rows = y.numel() // N
    plan = make_plan(plan_kind, rows)
    steps = sched.schedule_steps("reduce_scatter", plan, rows, N, K, "float32", world, 0)
    buf = _buffer_of(steps, a, b, bias, rows)
    expect = _expected_buffer(y.reshape(rows, N), [rows // world] * world, planlib.GroupPlan.from_str(plan).row_bounds)
    torch.testing.assert_close(buf, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_to_all"])
def test_each_group_computes_exactly_its_rows(collective):
    """Every group's GEMM work is its own buffer rows, in order: the collective of group g never waits for the
    GEMM of later groups (also when ``buffer_layout`` merged segments across groups, e.g. the identity layout)."""
    rows = 48
    steps = sched.schedule_steps(collective, make_plan("multi", rows), rows, N, K, "float32", 2, 1)
    assert len(steps) == 5
    for step in steps:
        covered = [r for buf_row, _, count in step.segments for r in range(buf_row, buf_row + count)]
        assert covered == list(range(step.lo, step.hi)), step


@pytest.mark.parametrize("world", [2, 3, 4])
def test_simulated_reduce_scatter_world(world):
    """All ranks' schedules in one process, the collective done by hand per group: equals eager reduce_scatter."""
    gen = torch.Generator().manual_seed(7)
    rows = 10 * world + 2 * world
    plan = make_plan("multi", rows)
    ys, bufs, outs = [], [], []
    for r in range(world):
        a, b, bias, y = make_operands("2d_bt", rows, 0, torch.float32, "1d", gen)
        steps = sched.schedule_steps("reduce_scatter", plan, rows, N, K, "float32", world, r)
        ys.append(y)
        bufs.append((steps, _buffer_of(steps, a, b, bias, rows)))
        outs.append(torch.full((rows // world, N), float("nan")))
    for g in range(len(bufs[0][0])):
        total = sum(buf[steps[g].lo:steps[g].hi] for steps, buf in bufs)
        parts = total.chunk(world)
        for r, (steps, _) in enumerate(bufs):
            lo, hi = steps[g].out
            outs[r][lo:hi] = parts[r]
    expect = sum(ys).chunk(world)
    for r in range(world):
        torch.testing.assert_close(outs[r], expect[r], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_simulated_uneven_all_to_all(world):
    """Ranks with different row counts: every send matches the peer's receive, and the data lands in natural order."""
    gen = torch.Generator().manual_seed(11)
    send = [[(3 * r + 2 * j + 1) % 7 for j in range(world)] for r in range(world)]  # send[r][j]: rows r -> j
    ys, steps_of, bufs = [], [], []
    for r in range(world):
        rows = sum(send[r])
        a, b, bias, y = make_operands("2d", rows, 0, torch.float32, None, gen)
        recv = tuple(send[j][r] for j in range(world))
        steps = sched.schedule_steps("all_to_all", "auto", rows, N, K, "float32", world, r,
                                           tuple(send[r]), recv)
        ys.append(y)
        steps_of.append(steps)
        bufs.append(_buffer_of(steps, a, b, bias, rows))
    outs = [torch.full((sum(send[j][r] for j in range(world)), N), float("nan")) for r in range(world)]
    for g in range(len(steps_of[0])):
        for r in range(world):
            step = steps_of[r][g]
            if step.local:
                b_lo, o_lo, count = step.local
                outs[r][o_lo:o_lo + count] = bufs[r][b_lo:b_lo + count]
            for j, lo, hi in step.sends:
                match = [(olo, ohi) for src, olo, ohi in steps_of[j][g].recvs if src == r]
                assert len(match) == 1 and match[0][1] - match[0][0] == hi - lo, (g, r, j)
                outs[j][match[0][0]:match[0][1]] = bufs[r][lo:hi]
    for r in range(world):
        expect = torch.cat([ys[j][sum(send[j][:r]):sum(send[j][:r + 1])] for j in range(world)])
        torch.testing.assert_close(outs[r], expect, rtol=1e-5, atol=1e-5)


def test_stale_plan_falls_back_with_one_warning(caplog):
    stale = planlib.uniform_plan(100, N, 8, 8, 3).to_str()
    with caplog.at_level(logging.WARNING, logger="flashoverlap"):
        s1 = sched.resolve_schedule("all_reduce", stale, 41, N, K, "float32", 2)
        s2 = sched.resolve_schedule("reduce_scatter", stale, 41 * 2, N, K, "float32", 2)
        sched.resolve_schedule("all_reduce", stale, 41, N, K, "float32", 2)
    assert s1.plan.m == 41 and s1.plan.num_groups > 1 and s1.layout.group_bounds[-1] == 41
    assert s2.plan.m == 82
    assert sum("does not fit" in r.getMessage() for r in caplog.records) == 2


def test_auto_plan_is_resolved_by_the_cost_model_once_per_shape():
    """Plan "auto" (symbolic sizes at compile time) is the cost model's plan for the call shape
    (``cost_model.call_plan``, memoized), resolved by the dispatcher; the schedule never asks the cost model
    itself (an unresolved "auto" reaching it gets the uniform fallback plan)."""
    from flashoverlap_inductor import config, cost_model

    settings = config.current()
    cost_model.clear_caches()
    p2 = cost_model.call_plan("all_reduce", 512, N, K, "bfloat16", 2, None, settings)
    cost_model.call_plan("all_reduce", 512, N, K, "bfloat16", 4, None, settings)
    assert cost_model.call_plan("all_reduce", 512, N, K, "bfloat16", 2, None, settings) == p2
    info = cost_model.decide_cache_info()
    assert info.misses == 2  # the third call never reached decide: call_plan's own memo answered
    s = sched.resolve_schedule("all_reduce", p2, 512, N, K, "bfloat16", 2)
    assert s.plan is not None and s.plan.m == 512 and s.layout.group_bounds[-1] == 512
    fallback = sched.resolve_schedule("all_reduce", "auto", 512, N, K, "bfloat16", 2)
    assert fallback.plan == sched.fallback_plan(512, N)
    import ast

    imported = [n.module or "" for n in ast.walk(ast.parse(open(sched.__file__).read()))
                if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if "cost_model" in m], imported  # the schedule stays pure


def test_fused_ops_are_side_effectful():
    for op in ops.FUSED_OPS:
        assert op in torch.fx.node._side_effectful_functions


@pytest.mark.parametrize("form", FORMS)
def test_fake_shapes(form):
    from torch._subclasses.fake_tensor import FakeTensorMode
    gen = torch.Generator().manual_seed(3)
    a, b, bias, y = make_operands(form, 4, 5, torch.bfloat16, "1d", gen)
    fo = torch.ops.flashoverlap
    with FakeTensorMode() as mode:
        fa, fb, fbias = mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(bias)
        ar = fo.gemm_all_reduce(fa, fb, fbias, "sum", "0", "auto")
        rs = fo.gemm_reduce_scatter(fa, fb, fbias, "sum", 2, "0", "auto")
        a2a = fo.gemm_all_to_all(fa, fb, None, [3, 4], [1, 3], "0", "auto")
        a2a_even = fo.gemm_all_to_all(fa, fb, None, None, None, "0", "auto")
    assert ar.shape == y.shape and ar.stride() == y.contiguous().stride() and ar.dtype == torch.bfloat16
    assert rs.shape == (2, *y.shape[1:]) and rs.is_contiguous()
    assert a2a.shape == (7, *y.shape[1:]) and a2a_even.shape == y.shape


@pytest.fixture
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


NO_NUMERICS = ("test_schema", "test_autograd_registration", "test_faketensor")  # opcheck minus the eager-vs-AOT run


def _fake_reduce_scatter_writes_output() -> bool:
    """Whether this torch's fake PG writes reduce_scatter's output (2.13: the rank's input shard) or leaves it as it
    was (2.11): then the op's output is uninitialized memory and two runs of it cannot be compared."""
    y = torch.arange(8.0).reshape(4, 2)
    outs = [torch.full((2, 2), fill) for fill in (-1.0, -2.0)]
    for out in outs:
        ops.reduce_scatter_into(out, y)
    return torch.equal(outs[0], outs[1])


def test_opcheck_fake_pg(fake_pg):
    torch.manual_seed(0)
    a, w, bias = torch.randn(12, K), torch.randn(N, K), torch.randn(N)
    a3, b3 = torch.randn(4, 3, K), torch.randn(K, N).expand(4, K, N)
    fo = torch.ops.flashoverlap
    # Where the fake PG leaves reduce_scatter's output unwritten, eager and AOT results are two reads of garbage:
    # skip only that comparison here; test_opcheck_all_to_all_gloo runs the full opcheck on real collectives.
    rs_utils = None if _fake_reduce_scatter_writes_output() else NO_NUMERICS
    checks = [
        (fo.gemm_all_reduce.default, (a, w.t(), bias, "sum", fake_pg, make_plan("multi", 12)), None),
        (fo.gemm_all_reduce.default, (a3, b3, None, "sum", fake_pg, "auto"), None),
        (fo.gemm_reduce_scatter.default, (a, w.t(), bias, "sum", 2, fake_pg, "auto"), rs_utils),
        (fo.gemm_reduce_scatter.default, (a3, b3, None, "sum", 2, fake_pg, make_plan("tiles", 12)), rs_utils),
        # the fake PG moves no P2P data, so the received rows are garbage: numerics run in test_opcheck_all_to_all_gloo
        (fo.gemm_all_to_all.default, (a, w.t(), bias, [5, 6], [5, 7], fake_pg, "auto"), NO_NUMERICS),
    ]
    for op, args, utils in checks:
        kwargs = {"test_utils": utils} if utils else {}
        result = torch.library.opcheck(op, args, **kwargs)
        assert set(result.values()) == {"SUCCESS"}, (op, result)
