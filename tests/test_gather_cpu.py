"""``flashoverlap::all_gather_gemm`` on real gloo ranks (2 and 3): results against eager ``all_gather`` + ``mm``, on
fresh random data, for every gather dim, bias form, dtype and number of weights; bad inputs; the failure contract
(one rank's GEMM fails: it raises, every other rank raises ``PeerFailure``, the next call works); opcheck."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import get_pool

import flashoverlap_inductor.ops  # noqa: F401  (registers torch.ops.flashoverlap.*)
from flashoverlap_inductor import errors

K = 24
SHAPES = {0: (6, K), 1: (2, 3, K), 2: (2, 2, 3, K)}  # gather_dim -> a local shard of that rank
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}


def _eager(a: torch.Tensor, b: list, bias: list, gather_dim: int) -> tuple[list, torch.Tensor]:
    parts = [torch.empty_like(a) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, a.contiguous())
    g = torch.cat(parts, gather_dim)
    flat = g.reshape(-1, a.shape[-1])
    return [torch.mm(flat, w) if c is None else torch.addmm(c, flat, w) for w, c in zip(b, bias, strict=True)], g


def check_worker(dtype_name: str, seed: int) -> int:
    """Every gather dim x bias form x 1-3 weights x return_gathered; returns the number of cases checked."""
    dtype, rank = getattr(torch, dtype_name), dist.get_rank()
    gname = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed * 100 + rank)  # each rank its own shard
    wgen = torch.Generator().manual_seed(seed)  # weights shared by every rank, as in tensor parallelism
    cases = 0
    for gather_dim, shape in SHAPES.items():
        for nw in (1, 3):
            for bias_kind in (None, "1d", "row"):
                a = torch.randn(shape, generator=gen).to(dtype)
                b = [torch.randn(K, 8 + 4 * i, generator=wgen).to(dtype) for i in range(nw)]
                if nw == 3:
                    b[1] = torch.randn(8, K, generator=wgen).to(dtype).t()  # a transposed (nn.Linear) weight
                bias = [None if bias_kind is None else torch.randn(w.shape[1], generator=wgen).to(dtype) for w in b]
                if bias_kind == "row":
                    bias = [c.unsqueeze(0) for c in bias]
                want, g = _eager(a, b, bias, gather_dim)
                for ret in (False, True):
                    got = torch.ops.flashoverlap.all_gather_gemm(a, b, bias, gather_dim, dist.get_world_size(),
                                                                 gname, "auto", ret)
                    assert len(got) == nw + ret, (len(got), nw, ret)
                    for y, ref in zip(got, want, strict=False):
                        torch.testing.assert_close(y, ref, **TOL[dtype_name])
                    if ret:
                        assert torch.equal(got[-1], g), "gathered tensor differs from all_gather + cat"
                    cases += 1
    return cases


def failure_worker() -> list[str]:
    """Rank 1's GEMM raises in one call: every rank raises (rank 1 its own error, the others ``PeerFailure`` naming
    rank 1); then a clean call matches eager on every rank."""
    from unittest import mock

    from flashoverlap_inductor.schedule import gather as schedule

    gname, rank, world = dist.group.WORLD.group_name, dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(4, K), [torch.randn(K, 8)]
    seen = []

    def broken(*args, **kwargs):
        raise RuntimeError("injected GEMM failure")

    with mock.patch.object(schedule, "shard_gemm", broken) if rank == 1 else mock.patch.object(schedule, "K_", 0,
                                                                                                create=True):
        try:
            torch.ops.flashoverlap.all_gather_gemm(a, b, [None], 0, world, gname, "auto", False)
            seen.append("returned")
        except errors.PeerFailure as exc:
            seen.append(f"PeerFailure: {'rank 1' in str(exc)}")
        except RuntimeError as exc:
            seen.append(f"own: {exc}")
    got = torch.ops.flashoverlap.all_gather_gemm(a, b, [None], 0, world, gname, "auto", False)
    want, _ = _eager(a, b, [None], 0)
    torch.testing.assert_close(got[0], want[0])
    seen.append("next call ok")
    return seen


def bad_inputs_worker() -> list[str]:
    gname, op = dist.group.WORLD.group_name, torch.ops.flashoverlap.all_gather_gemm
    a, b = torch.randn(4, K), torch.randn(K, 8)
    cases = {
        "gather_dim is K": lambda: op(a, [b], [None], 1, 2, gname, "auto", False),
        "no weights": lambda: op(a, [], [], 0, 2, gname, "auto", False),
        "3D weight": lambda: op(a, [b.unsqueeze(0)], [None], 0, 2, gname, "auto", False),
        "row-varying bias": lambda: op(a, [b], [torch.randn(8, 8)], 0, 2, gname, "auto", False),
        "wrong group size": lambda: op(a, [b], [None], 0, dist.get_world_size() + 1, gname, "auto", False),
        "unknown plan": lambda: op(a, [b], [None], 0, 2, gname, "v1;m=8", False),
        "inner sizes": lambda: op(a, [torch.randn(K + 1, 8)], [None], 0, 2, gname, "auto", False),
    }
    out = []
    for name, fn in cases.items():
        try:
            fn()
        except (ValueError, RuntimeError) as exc:
            out.append(f"{name}: {'flashoverlap' in str(exc)}")
        else:
            out.append(f"{name}: NO ERROR")
    dist.barrier()
    return out


def opcheck_worker() -> list:
    gname = dist.group.WORLD.group_name
    torch.manual_seed(dist.get_rank())
    a, b = torch.randn(2, 3, K), [torch.randn(K, 8), torch.randn(16, K).t()]
    op = torch.ops.flashoverlap.all_gather_gemm.default
    return [torch.library.opcheck(op, (a, b, [None, torch.randn(16)], 1, dist.get_world_size(), gname, "auto", True)),
            torch.library.opcheck(op, (a[0], b[:1], [None], 0, dist.get_world_size(), gname, "ring", False))]


def compiled_sp_block_worker(batch: int = 2) -> dict:
    """A sequence-parallel MLP (gather along the sequence dim, two GEMMs, reduce_scatter back) compiled with the
    backend, forward and backward, against eager on the same data: the output, the input's and both weights'
    gradients; and what the pass fused. The gather in funcol's form for ``batch``: split/cat along the sequence dim,
    or at batch 1 a reshape (``_maybe_view_chunk_cat``: the chunks of a batch-1 tensor are consecutive)."""
    import torch.distributed._functional_collectives as funcol

    from flashoverlap_inductor import passes
    from flashoverlap_inductor.backend import flashoverlap_backend

    torch._dynamo.reset()  # another batch's graph of ``block`` would make this compile dynamic (per-call plans)
    g, world = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(0)
    w1, w2 = torch.randn(K, 40) / K ** 0.5, torch.randn(40, K) / 40 ** 0.5
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(batch, 4, K)

    # torch 2.13 renamed them (*_single_autograd; the old names warn); 2.11 has only the old ones
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd

    def block(x, w1, w2):
        full = gather(x, 0, g)
        if batch == 1:
            full = full.reshape(1, 4 * world, K).reshape(-1, K)
        else:
            full = torch.cat(full.chunk(world, 0), dim=1).reshape(-1, K)
        y = (torch.relu(full @ w1) @ w2).view(batch, 4 * world, K)
        return scatter(y, "sum", 1, g)

    def run(fn):
        xs, a, b = (t.clone().requires_grad_() for t in (x, w1, w2))
        out = fn(xs, a, b)
        out.pow(2).sum().backward()
        return [out.detach(), xs.grad, a.grad, b.grad]

    want = run(block)
    passes.reset_counters()
    got = run(torch.compile(block, backend=flashoverlap_backend, options={"flashoverlap.fuse": "always"}))
    for name, p, q in zip(("out", "x.grad", "w1.grad", "w2.grad"), got, want, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return {k: v for k, v in passes.counters.items() if not k.startswith("skip:fuse_never")}


@pytest.fixture(scope="module", params=[2, 3])
def pool(request):
    return get_pool(request.param)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_all_gather_gemm_matches_eager(pool, dtype_name):
    counts = pool.run(check_worker, dtype_name, 1)
    assert counts == [len(SHAPES) * 2 * 3 * 2] * pool.world_size


def test_bad_inputs_raise_clear_errors(pool):
    for per_rank in pool.run(bad_inputs_worker):
        assert all(line.endswith("True") for line in per_rank), per_rank


def test_one_rank_failing_reaches_every_rank(pool):
    results = pool.run(failure_worker)
    assert results[1] == ["own: injected GEMM failure", "next call ok"], results
    for r, seen in enumerate(results):
        if r != 1:
            assert seen == ["PeerFailure: True", "next call ok"], (r, results)


def test_opcheck(pool):
    for per_rank in pool.run(opcheck_worker):
        for report in per_rank:
            assert all(v == "SUCCESS" for v in report.values()), report


@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_sequence_parallel_block_forward_and_backward(pool, batch):
    """Forward: the gather into the first GEMM and the reduce_scatter after the second; backward: the output
    gradient's gather into the input gradient's GEMM and the reduce_scatter of the input gradient. All fused, the
    results and gradients as eager's, at batch 1 (the gather's reshape form) and 2 (its split/cat form)."""
    if batch == 1 and pool.world_size != 2:
        pytest.skip("batch 1 once, on 2 ranks (kept short)")
    for fused in pool.run(compiled_sp_block_worker, batch, timeout_s=400):
        assert fused == {"fused:all_gather": 2, "fused:reduce_scatter": 2}, fused


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(2, 5, K), [torch.empty(K, 8), torch.empty(K, 4)]
        from flashoverlap_inductor.ops import check_gather

        shapes = check_gather(a, b, [None, None], 1, 4)
    assert shapes == [[40, 8], [40, 4], [2, 20, K]]


def test_a_call_shape_is_validated_once():
    """``ops.checked_gather`` (the run-time op's front): ``check_gather``'s shapes, memoized by the operands' shapes,
    dtypes and devices; a call that fails validation raises every time (never memoized), and one that differs only
    in b's dtype is validated again (and refused)."""
    from unittest import mock

    from flashoverlap_inductor import ops

    a, b = torch.randn(2, 5, K), [torch.randn(K, 8), torch.randn(K, 4)]
    ops._checked_gathers.clear()
    with mock.patch.object(ops, "check_gather", wraps=ops.check_gather) as checks:
        first = ops.checked_gather(a, b, [None, None], 1, 4)
        first[0][0] = -1  # the caller's own copy
        again = ops.checked_gather(a, b, [None, None], 1, 4)
        assert again == [[40, 8], [40, 4], [2, 20, K]] and checks.call_count == 1
        for _ in range(2):
            with pytest.raises(ValueError, match="share a dtype"):
                ops.checked_gather(a, [b[0].double(), b[1]], [None, None], 1, 4)
        with pytest.raises(ValueError, match="must be a row dim"):
            ops.checked_gather(a, b, [None, None], 2, 4)
        assert checks.call_count == 4
