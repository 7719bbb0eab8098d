"""The MoE combine fused end to end on 2 gloo ranks: ``torch.compile(..., backend="flashoverlap")`` of real
expert-parallel models against eager, forward and gradients, on fresh random data, with the pass's counters checked
inside each rank.

* the e2e harness's ``ep`` plan of tiny-moe (Qwen3-MoE) and tiny-mixtral, per-expert ``mm`` loop, fp32, batch 1 and
  2: the forward's combine (the down GEMMs -> index_put(empty) -> all_to_all) and the backward's (the gate_up input
  gradients -> index_put(zeros, accumulate) -> all_to_all) are fused, nothing is a near miss any more;
* the harness's MoE block with ``torch._grouped_mm`` in bf16;
* torchtitan's expert-parallel data path (``AllToAllTokenDispatcher`` + ``GroupedExperts`` of torchtitan 0.3.0, its
  op sequence re-typed below: arithmetic permuted indices, ``new_empty`` + ``x[perm] = y``, grouped GEMMs with int32
  offsets, ``type_as``), whose backward sums two grouped GEMMs (w1's and w3's input gradients) before the
  un-permutation;
* ``fuse="auto"``: every rank declines every combine alike (data-dependent rows: ``skip:combine_auto``).

Every compile follows ``torch._dynamo.reset()`` on ranks whose Inductor FX-graph cache is off, so the pass really
runs.
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

FP32 = {"rtol": 1e-4, "atol": 1e-5}
BF16 = {"rtol": 3e-2, "atol": 3e-2}


# ------------------------------------------------------------------------------------------ helpers (ranks)


class _Run:
    """A compile context: dynamo reset, counters and route statistics cleared, scalar outputs captured (the MoE's
    split sizes). The pool's ranks run with Inductor's FX-graph and AOTAutograd caches off (``dist_utils``), so the
    pass runs on every graph; compiled C++ kernels are reused from the on-disk cache (CPU compile time)."""

    def __enter__(self):
        from flashoverlap_inductor import routes
        from flashoverlap_inductor.passes import reset_counters

        torch._dynamo.reset()
        reset_counters()
        routes.stats.clear()
        self._scalars = torch._dynamo.config.patch(capture_scalar_outputs=True)
        self._scalars.__enter__()
        return self

    def __exit__(self, *exc):
        self._scalars.__exit__(*exc)
        torch._dynamo.reset()

    def report(self) -> dict:
        from flashoverlap_inductor import routes
        from flashoverlap_inductor.passes import counters

        return {"pass": {k: v for k, v in counters.items() if "combine" in k or k.startswith("near_miss")},
                "calls": routes.stats["combine:p2p"]}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _compare(ref: nn.Module, got: nn.Module, out_ref, out_got, tol: dict) -> None:
    torch.testing.assert_close(out_got.float(), out_ref.float(), **tol)
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(_local(q.grad).float(), _local(p.grad).float(), **tol,
                                   msg=lambda s, n=name: f"grad {n}: {s}")


def ep_model_worker(preset: str, batches: list[int], fuse: str = "always", dynamic: bool | None = False,
                    run_cls: type = _Run, seed: int = 7, options: dict | None = None) -> dict:
    """The harness's ep plan of ``preset`` (one layer, seq 16, fp32): compiled vs eager loss and every gradient at
    each batch size, on fresh random token ids (``seed``). ``dynamic=None``: the second batch size recompiles with a
    symbolic batch (torch.compile's automatic dynamic shapes). ``options``: more backend options. Returns
    ``run_cls``'s report."""
    from torch.distributed.device_mesh import init_device_mesh

    from flashoverlap_inductor.bench import models, plans
    from flashoverlap_inductor.bench.runner import TrainLoss

    spec = models.PRESETS[preset].with_overrides(layers=1)
    model = plans.apply(models.build(spec, torch.device("cpu"), torch.float32, 0, 16), spec, "ep",
                        init_device_mesh("cpu", (dist.get_world_size(),)), "loop")
    ref, got = TrainLoss(model), TrainLoss(copy.deepcopy(model))
    with run_cls() as run:
        compiled = torch.compile(got, backend="flashoverlap", options={"flashoverlap.fuse": fuse, **(options or {})},
                                 dynamic=dynamic)
        for batch in batches:
            gen = torch.Generator().manual_seed(100 * batch + seed)  # the same tokens on every rank, fresh per batch
            ids = torch.randint(0, spec.vocab, (batch, 16), generator=gen)
            targets = torch.randint(0, spec.vocab, (batch, 16), generator=gen)
            for m in (ref, got):
                m.zero_grad(set_to_none=True)
            loss_ref, loss_got = ref(ids, targets), compiled(ids, targets)
            loss_ref.backward()
            loss_got.backward()
            _compare(ref, got, loss_ref.detach(), loss_got.detach(), FP32)
        return run.report()


def grouped_block_worker() -> dict:
    """The harness's MoE block (tiny-moe's experts, 2 per rank) with ``torch._grouped_mm``, bf16."""
    from flashoverlap_inductor.bench import models, moe

    spec = models.PRESETS["tiny-moe"].with_overrides(layers=1)
    block = models.build(spec, torch.device("cpu"), torch.float32, 0, 16).model.layers[0].mlp
    ref = moe.ExpertParallelMoE(block, dist.group.WORLD, "grouped").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(11 + dist.get_rank())  # each rank its own tokens
    x, dy = (torch.randn(2, 8, spec.hidden, generator=gen).to(torch.bfloat16) for _ in range(2))
    return _block_vs_eager(ref, x, dy)


def _block_vs_eager(ref: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Compiled (fuse "always") vs eager output, input and parameter gradients (bf16); the fused ops' lines of the
    post-grad graphs, forward then backward."""
    got, lines = copy.deepcopy(ref), []
    options = {"flashoverlap.fuse": "always", "post_grad_custom_post_pass": lambda g: lines.extend(
        line.strip() for line in g.python_code("self").src.splitlines() if "flashoverlap.gemm_unpermute" in line)}
    with _Run() as run:
        compiled = torch.compile(got, backend="flashoverlap", options=options)
        x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out_got = ref(x_ref), compiled(x_got)
        out_ref.backward(dy)
        out_got.backward(dy)
        _compare(ref, got, out_ref.detach(), out_got.detach(), BF16)
        torch.testing.assert_close(x_got.grad.float(), x_ref.grad.float(), **BF16)
        return {**run.report(), "ops": lines}


class TitanStyleMoE(nn.Module):
    """torchtitan 0.3.0's expert-parallel MoE data path on ``group`` (``models/common/token_dispatcher.py``
    ``AllToAllTokenDispatcher`` and ``models/common/moe.py`` ``GroupedExperts``), re-typed with the same ops: tokens
    sorted by expert, the count exchange, the token all_to_all, ``_permute`` (arithmetic permuted indices from the
    per-(rank, expert) counts), three grouped GEMMs with int32 cumulative offsets, ``_unpermute`` (``new_empty`` then
    ``x[perm, :] = y``), the combine all_to_all, then the scores and a scatter_add. Input ``[T, D]``."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.world, self.group, self.top_k, self.experts = group.size(), group.group_name, top_k, experts
        local = experts // self.world
        gen = torch.Generator().manual_seed(5)  # one model on every rank; each rank keeps its experts' weights
        self.router = nn.Parameter(torch.randn(experts, dim, generator=gen) * 0.2)
        full = {n: torch.randn(experts, *s, generator=gen) * 0.1 for n, s in
                (("w1", (hidden, dim)), ("w2", (dim, hidden)), ("w3", (hidden, dim)))}
        lo = group.rank() * local
        self.w1, self.w2, self.w3 = (nn.Parameter(full[n][lo:lo + local].clone()) for n in ("w1", "w2", "w3"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, ids = F.linear(x, self.router.to(x.dtype)).float().softmax(-1).topk(self.top_k, dim=-1)
        counts = torch.zeros(self.experts, dtype=torch.int64).scatter_add(0, ids.flatten(), torch.ones_like(
            ids.flatten()))
        order = torch.argsort(ids.view(-1), stable=True)
        scores_sorted, token = scores.view(-1)[order], order // self.top_k
        routed = x[token]
        recv = funcol.all_to_all_single(counts.view(self.world, -1), None, None, self.group)
        recv = torch.ops._c10d_functional.wait_tensor(recv).reshape(-1)
        ins = counts.view(self.world, -1).sum(1).tolist()
        outs = recv.view(self.world, -1).sum(1).tolist()
        routed = funcol.all_to_all_single_autograd(routed, outs, ins, self.group)
        perm, per_expert = self._permute_indices(recv, routed.shape[0])
        shape, routed = routed.shape, routed[perm, :]
        offs = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(routed.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(routed.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
        out = torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(routed)
        unpermuted = out.new_empty(shape)
        unpermuted[perm, :] = out
        back = funcol.all_to_all_single_autograd(unpermuted, ins, outs, self.group)
        back = (back.float() * scores_sorted.reshape(-1, 1)).to(back.dtype)
        return torch.zeros_like(x).scatter_add(0, token.reshape(-1, 1).expand(-1, x.shape[-1]), back)

    def _permute_indices(self, counts: torch.Tensor, total) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank-major (rank, expert) segments -> expert-major, without a host sync (torchtitan's ``_permute``)."""
        local = counts.shape[0] // self.world
        t_mat = counts.view(self.world, local)
        starts = (counts.cumsum(0) - counts).view(self.world, local).t().reshape(-1)
        lens = t_mat.t().reshape(-1)
        seg = torch.arange(lens.shape[0]).repeat_interleave(lens, output_size=total)
        out_starts = lens.cumsum(0) - lens
        perm = starts[seg] + torch.arange(seg.shape[0]) - out_starts[seg]
        return perm, t_mat.sum(0)


def titan_worker() -> dict:
    ref = TitanStyleMoE(64, 32, 4, 2, dist.group.WORLD).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(21 + dist.get_rank())
    x, dy = (torch.randn(16, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    return _block_vs_eager(ref, x, dy)


class Declined(nn.Module):
    """Two combines the pass must decline, each with its reason: the experts' GEMMs carry a bias (addmm pieces), and
    the un-permutation writes into a buffer of ones."""

    def __init__(self, k: int = 16, n: int = 24) -> None:
        super().__init__()
        self.e0, self.e1 = nn.Linear(k, n), nn.Linear(k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, perm = dist.group.WORLD.group_name, torch.arange(x.shape[0] - 1, -1, -1)
        half = x.shape[0] // 2
        biased = torch.cat([self.e0(x[:half]), self.e1(x[half:])])
        plain = torch.cat([x[:half] @ self.e0.weight.t(), x[half:] @ self.e1.weight.t()])
        out = []
        for y, buf in ((biased, torch.empty_like(biased)), (plain, torch.ones_like(plain))):
            send = buf.index_put((perm,), y)
            out.append(funcol.all_to_all_single(send, [half, half], [half, half], group))
        return out[0] + out[1]


def declined_worker() -> dict:
    with _Run() as run, torch.no_grad():
        torch.compile(Declined(), backend="flashoverlap", options={"flashoverlap.fuse": "always"})(torch.randn(8, 16))
        return run.report()


# ------------------------------------------------------------------------------------------ 2-process tests


def _op_args(line: str) -> dict:
    """The fused op's GEMM terms, offsets and accumulate flag from its line of graph code."""
    m = re.search(r"gemm_unpermute_all_to_all\.default\(\[([^\]]*)\], \[[^\]]*\], (\w+), \w+, (\w+),", line)
    assert m is not None, line
    return {"terms": len(m.group(1).split(",")), "offs": m.group(2), "accumulate": m.group(3)}


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


@pytest.mark.parametrize("preset, dynamic", [("tiny-moe", False), ("tiny-mixtral", None)])
def test_ep_training_fuses_the_combine_forward_and_backward_and_matches_eager(pool, preset, dynamic):
    for got in pool.run(ep_model_worker, preset, [1, 2], "always", dynamic, timeout_s=600):
        # a forward and a backward graph per compilation (one per batch size), one combine each
        assert got["pass"] == {"fused:all_to_all_combine": 4}, got  # and no near miss
        assert got["calls"] == 4, got  # forward and backward at both batch sizes ran the CPU route


def test_grouped_mm_block_in_bf16(pool):
    for got in pool.run(grouped_block_worker, timeout_s=400):
        assert got["pass"] == {"fused:all_to_all_combine": 2} and got["calls"] == 2, got
        forward, backward = (_op_args(line) for line in got["ops"])
        assert forward["terms"] == backward["terms"] == 1 and forward["offs"] != "None", got["ops"]
        assert (forward["accumulate"], backward["accumulate"]) == ("False", "True"), got["ops"]  # empty; zeros


def test_torchtitan_style_expert_parallel_block(pool):
    for got in pool.run(titan_worker, timeout_s=400):
        assert got["pass"] == {"fused:all_to_all_combine": 2} and got["calls"] == 2, got
        forward, backward = (_op_args(line) for line in got["ops"])
        # forward: w2's grouped GEMM; backward: the sum of w1's and w3's input gradients, one op of two terms
        assert (forward["terms"], backward["terms"]) == (1, 2), got["ops"]
        assert (forward["accumulate"], backward["accumulate"]) == ("False", "True"), got["ops"]


def test_unsupported_combines_are_declined_with_their_reason(pool):
    for got in pool.run(declined_worker, timeout_s=300):
        assert got["pass"] == {"skip:combine_gemm": 1, "skip:combine_base": 1} and got["calls"] == 0, got


def test_auto_declines_every_combine_on_every_rank(pool):
    got = pool.run(ep_model_worker, "tiny-moe", [2], "auto", timeout_s=600)
    assert got[0] == got[1], got
    assert got[0]["pass"] == {"skip:combine_auto": 2} and got[0]["calls"] == 0, got
