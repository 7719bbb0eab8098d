"""A stack of the e2e harness's expert-parallel MoE blocks (``bench/moe.py``, HF weights of a preset), compiled by
the flashoverlap backend under ``fuse="always"`` and each given experiments set, against the same stack run
eagerly (without CUDA: fp32 on CPU over gloo): a correctness probe for what the e2e rows compare only at the
logits (a diagnostic, not a benchmark).

Each layer is ``x = x + moe(rms_norm(x))``, so a later layer's dispatch reads an earlier layer's combine. Per variant
and step (fresh random tokens per rank), prints the norm-wise relative error of the output against eager, its
largest per-token relative error, how many tokens are off by more than ``--row-tol``, and the counters of the fused
calls (fused, deferred, peer, unfused). ``--train``: also the input's gradient (a backward through the fused ops).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 examples/device/moe_stack_check.py --preset qwen3-moe \
        --layers 2 --tokens 4096 --variants moe_p2p_cuda,moe_p2p_cuda+moe_settle_deferred

``--share-gpu``: every rank on GPU 0 over gloo (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``); only the peer
transfers' variants (``+moe_peer``) carry CUDA rows there. Exit status 1 when any compared value is off by more
than ``--tol``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

GROUPS: dict[str, dist.ProcessGroup] = {}  # by name: a module holds the name (it must deep-copy)
COUNTERS = ("dispatch:p2p", "combine:p2p", "moe:deferred", "moe:moe_peer", "fused:all_gather", "fused:reduce_scatter",
            "unfused")


class SequenceParallelMLP(nn.Module):
    """The sequence-parallel pattern of the e2e ``ep`` plan's attention, without attention: this rank's tokens
    all-gathered (funcol inside a graph, c10d eagerly: dim 0 of the token rows), a GEMM by this rank's column
    shard, SiLU, a GEMM by its row shard, the sum reduce-scattered back to this rank's tokens (the pass fuses
    all_gather -> GEMM and GEMM -> reduce_scatter)."""

    def __init__(self, hidden: int, inner: int, group_name: str, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.up = nn.Parameter(torch.randn(inner, hidden, generator=gen) * hidden ** -0.5)
        self.down = nn.Parameter(torch.randn(hidden, inner, generator=gen) * inner ** -0.5)
        self.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():  # the graph's functional collectives (what the pass fuses)
            full = funcol.all_gather_tensor(rows, 0, self.group_name)
            part = F.linear(F.silu(F.linear(full, self.up)), self.down)
            return funcol.reduce_scatter_tensor(part, "sum", 0, self.group_name).view(x.shape)
        group = GROUPS[self.group_name]  # eagerly c10d's collectives (funcol on gloo's CUDA rows crashes)
        full = rows.new_empty((rows.shape[0] * group.size(), rows.shape[1]))
        dist.all_gather_into_tensor(full, rows.contiguous(), group=group)
        part = F.linear(F.silu(F.linear(full, self.up)), self.down)
        out = rows.new_empty(rows.shape)
        dist.reduce_scatter_tensor(out, part.contiguous(), group=group)
        return out.view(x.shape)


class Stack(nn.Module):
    """Pre-norm residual layers: an optional sequence-parallel part, then a MoE block (the MoE ops are what is
    checked; the sequence-parallel part puts the fused all_gather and reduce_scatter between them, as in e2e)."""

    def __init__(self, blocks: list[nn.Module], sp: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.sp = nn.ModuleList(sp or [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.sp:
                x = x + self.sp[i](F.rms_norm(x, (x.shape[-1],)))
            x = x + block(F.rms_norm(x, (x.shape[-1],)))
        return x


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-moe")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank and step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--variants", default="moe_p2p_cuda,moe_p2p_cuda+moe_settle_deferred",
                   help="comma-separated experiments sets, each joined by '+' ('none': no experiment)")
    p.add_argument("--gemm", default="auto", choices=("auto", "grouped", "loop"), help="auto: grouped in bf16 on CUDA")
    p.add_argument("--train", action="store_true", help="also compare the input gradient")
    p.add_argument("--sp", type=int, default=0, metavar="INNER",
                   help="a sequence-parallel MLP of INNER columns (split over the ranks) before each MoE block")
    p.add_argument("--share-gpu", action="store_true", help="every rank on GPU 0 over gloo")
    p.add_argument("--lag-ms", type=float, default=0.0,
                   help="CUDA: hold the GPU this long (a sleep kernel on the caller's stream) at each deferred settle "
                        "and each NCCL transfer's issue, so the host runs ahead of the GPU (gloo's settle syncs)")
    p.add_argument("--tol", type=float, default=2e-2, help="norm-wise relative error allowed (bf16)")
    p.add_argument("--row-tol", type=float, default=0.1, help="a token's relative error counted as off")
    return p.parse_args(argv)


def compare(got: torch.Tensor, ref: torch.Tensor, row_tol: float) -> tuple[float, float, int]:
    """(norm-wise relative error, largest per-token relative error, tokens off by more than ``row_tol``)."""
    g, r = got.double().reshape(-1, got.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    if not bool(torch.isfinite(g).all()):
        return float("inf"), float("inf"), int((~torch.isfinite(g).all(-1)).sum())
    rows = (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)
    return float((g - r).norm() / r.norm().clamp_min(1e-12)), float(rows.max()), int((rows > row_tol).sum())


def lag_gpu(ms: float) -> None:
    """Make the GPU lag the host by ``ms`` at every deferred settle (before its poison) and every NCCL transfer's
    issue: a sleep kernel enqueued on the caller's stream there (``torch.cuda._sleep``, ~1.9e6 cycles per ms)."""
    from flashoverlap_inductor.routes import moe_deferred, moe_nccl

    cycles = int(ms * 1.9e6)
    for module, name in ((moe_deferred, "poison_if_bad"), (moe_nccl, "transfer_blocks")):
        inner = getattr(module, name)

        def lagged(*a, _inner=inner, **k):
            torch.cuda._sleep(cycles)
            return _inner(*a, **k)

        setattr(module, name, lagged)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from flashoverlap_inductor import routes
    from flashoverlap_inductor.bench import models, moe
    from flashoverlap_inductor.routes import moe_deferred

    cuda = torch.cuda.is_available()
    nccl = cuda and not args.share_gpu
    dist.init_process_group("nccl" if nccl else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(0 if args.share_gpu else int(os.environ.get("LOCAL_RANK", rank)))
    if args.lag_ms and cuda:
        lag_gpu(args.lag_ms)
    GROUPS[dist.group.WORLD.group_name] = dist.group.WORLD
    dev, g = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"), dist.group.WORLD
    dtype = torch.bfloat16 if cuda else torch.float32
    spec = models.PRESETS[args.preset].with_overrides(layers=args.layers, vocab=256)
    hf = models.build(spec, dev, dtype, 0, 128)
    sp = [SequenceParallelMLP(spec.hidden, args.sp // world, g.group_name, 7 * i + rank)
          for i in range(args.layers)] if args.sp else None
    ref = Stack([moe.ExpertParallelMoE(layer.mlp, g, args.gemm) for layer in hf.model.layers], sp).to(dev, dtype)
    del hf
    bad = 0
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"moe_stack_check: {args.preset} x {args.layers} layers, {args.tokens} tokens/rank, world {world} "
        f"({'nccl' if nccl else 'gloo'}), {args.gemm}, torch {torch.__version__}"
        f"{', train' if args.train else ', no_grad'}{f', sp {args.sp}' if args.sp else ''}"
        f"{f', GPU lag {args.lag_ms} ms' if args.lag_ms else ''}")
    for name in args.variants.split(","):
        experiments = frozenset() if name == "none" else frozenset(name.split("+"))
        moe_deferred.forget()
        torch._dynamo.reset()
        got = copy.deepcopy(ref)
        start = dict(routes.stats)
        options = {"flashoverlap.fuse": "always", "flashoverlap.experiments": experiments}
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            compiled = torch.compile(got, backend="flashoverlap", options=options)
            for step in range(args.steps):
                gen = torch.Generator().manual_seed(1000 * step + rank)
                x = torch.randn(1, args.tokens, spec.hidden, generator=gen).to(dev, dtype)
                before = {k: routes.stats[k] for k in COUNTERS}
                rows = []
                if args.train:
                    xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
                    out_ref, out_got = ref(xr), compiled(xg)
                    dy = torch.randn(out_ref.shape, generator=gen).to(dev, dtype)
                    out_ref.backward(dy)
                    out_got.backward(dy)
                    rows = [("out", out_got.detach(), out_ref.detach()), ("dx", xg.grad, xr.grad)]
                else:
                    with torch.no_grad():
                        out_ref, out_got = ref(x), compiled(x)
                    rows = [("out", out_got, out_ref)]
                if cuda:
                    torch.cuda.synchronize()
                counts = " ".join(f"{k}={routes.stats[k] - before[k]}" for k in COUNTERS)
                for what, a, b in rows:
                    err, worst, off = compare(a, b, args.row_tol)
                    flags = torch.tensor([err], dtype=torch.float64, device=dev if nccl else "cpu")
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                    bad += int(not float(flags[0]) <= args.tol)
                    print(f"  [{name}] rank {rank} step {step} {what}: rel.err {err:.2e} worst token {worst:.2e} "
                          f"off {off}/{a.numel() // a.shape[-1]}; {counts}", flush=True)
        grew = {k: v - start.get(k, 0) for k, v in routes.stats.items()
                if k.startswith(("route:", "fallback:")) and v > start.get(k, 0)}
        say(f"  [{name}] calls by route and by fallback reason (rank {rank}): {grew}")
        try:
            routes.check()
        except Exception as exc:  # noqa: BLE001 - reported, counted
            bad += 1
            print(f"  [{name}] rank {rank}: routes.check() raised {type(exc).__name__}: {exc}", flush=True)
        del compiled, got
        torch._dynamo.reset()
    say(f"moe_stack_check: {'every value matched' if not bad else f'{bad} value(s) off'}")
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
