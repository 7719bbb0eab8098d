"""Demo: a small Llama-style decoder, tensor-parallel over 2 ranks, compiled with ``backend="flashoverlap"``.

    python -m flashoverlap_inductor.demo [--world-size 2] [--fuse auto|always|never] [--steps 20] [--device cpu]
                                         [--mode default|reduce-overhead]

Spawns ``--world-size`` ranks (NCCL on GPUs when there are enough, else gloo on CPU), parallelizes the model with
DTensor ``parallelize_module`` (column-parallel q/k/v/gate/up, row-parallel o/down: every row-parallel GEMM ends
in an all_reduce), compiles it with plain Inductor and with the flashoverlap backend, and prints what the pass
fused or skipped (with reasons and the chosen wave-group plans), the largest deviation from eager, and forward
timings (medians over ``--steps`` samples; on GPU, CUDA events around 5 calls back to back). Inference only
(``torch.no_grad``). ``--mode reduce-overhead`` (GPU) compiles both for CUDA graphs, as
``torch.compile(mode="reduce-overhead")`` does; the logits compared are then those of a replay.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import re
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import _inductor_compat as compat
from .schedule.plan import GroupPlan


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x`` [batch, heads, seq, head_dim] (rotate-half form)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    ang = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention; the head count per rank follows from the (sharded) projections."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotary(q), rotary(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.input_norm, self.post_norm = RMSNorm(dim), RMSNorm(dim)
        self.self_attn, self.mlp = Attention(dim, heads, kv_heads), MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x))
        return x + self.mlp(self.post_norm(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.lm_head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def tp_plan(model: Decoder) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


# ---------------------------------------------------------------------------------------------------- runner


class _Collect(logging.Handler):
    """Keeps the pass's "fused" / "skip:" / plan-decision lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(("flashoverlap: fused", "flashoverlap: skip:")) or " fusing" in msg:
            self.lines.append(msg)


def _short_plans(text: str) -> str:
    def repl(m: re.Match) -> str:
        try:
            p = GroupPlan.from_str(m.group(0))
        except (KeyError, ValueError):
            return m.group(0)
        return f"[{p.num_groups} groups, rows {list(p.row_bounds)}, tile {p.tile_m}x{p.tile_n}]"

    return re.sub(r"v1;m=\d+;n=\d+;tile=\d+x\d+;bounds=[\d,]+;kernel=[\w.-]*", repl, text)


BURST = 5  # forward calls per timed sample on GPU


def _timeit(fn, inputs, steps: int, device: torch.device) -> float:
    """Median forward time in ms after 3 warm-up calls. GPU: each of ``steps`` samples times ``BURST`` calls back to
    back between CUDA events (after a barrier), as an inference loop runs them: each call's host work before its
    first kernel overlaps the previous call's kernels instead of showing as idle GPU time. CPU: one call per sample,
    barrier-aligned."""
    for _ in range(3):
        fn(inputs)
    times = []
    for _ in range(steps):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(BURST):
                fn(inputs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / BURST)
        else:
            t0 = time.perf_counter()
            fn(inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHINDUCTOR_FX_GRAPH_CACHE="0")
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world_size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=args.world_size)
    try:
        _run(rank, args, device)
    finally:
        if device.type == "cuda":  # free the CUDA graphs first: NCCL waits for graphs holding its kernels
            torch.cuda.synchronize()
            torch._dynamo.reset()
            gc.collect()
        dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace, device: torch.device) -> None:
    from torch._inductor.utils import fresh_cache
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from flashoverlap_inductor.passes import counters, reset_counters

    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.hidden).to(device, dtype)
    model = parallelize_module(model, init_device_mesh(device.type, (args.world_size,)), tp_plan(model)).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    say(f"== {args.layers}-layer Llama-style decoder, dim {args.dim}, ffn {args.hidden}, heads {args.heads}/"
        f"{args.kv_heads} kv, TP={args.world_size} on {device.type} ({dtype}), batch {args.batch} x seq {args.seq}"
        f" -> {args.batch * args.seq} GEMM rows; fuse mode {args.fuse!r}, compile mode {args.mode!r}")

    collect = _Collect()
    logging.getLogger("flashoverlap").addHandler(collect)
    logging.getLogger("flashoverlap").setLevel(logging.INFO)
    # One fresh Inductor cache for both compiles: the second reuses the C++ kernels of the first, while the
    # FX graph cache stays off (TORCHINDUCTOR_FX_GRAPH_CACHE=0) so the pass really runs and reports.
    with torch.no_grad(), fresh_cache():
        ref = model(ids)
        compiled = {}
        graphs = args.mode == "reduce-overhead"
        mode_options = compat.list_mode_options(args.mode) if graphs else {}
        for name, backend, options in (("inductor", "inductor", dict(mode_options)),
                                       ("flashoverlap", "flashoverlap",
                                        {"flashoverlap.fuse": args.fuse, **mode_options})):
            torch._dynamo.reset()
            reset_counters()
            t0 = time.perf_counter()
            fn = torch.compile(model, backend=backend, options=options or None)
            for _ in range(3 if graphs else 1):  # CUDA graphs: warm-up, capture, then a replay
                out = fn(ids)
            compiled[name] = (fn, out.clone(), dict(counters), time.perf_counter() - t0)
        _, out, fused_counters, _ = compiled["flashoverlap"]

        say("\n-- what the pass did (rank 0) --")
        for key in sorted(fused_counters):
            say(f"  {key:28s} {fused_counters[key]}")
        if not fused_counters:
            say("  (nothing matched)")
        say("\n-- matches, decisions and plans --")
        for line in dict.fromkeys(collect.lines):
            say("  " + _short_plans(line.removeprefix("flashoverlap: ")))

        errors = {name: (c[1].float() - ref.float()).abs().max().item() for name, c in compiled.items()}
        scale = ref.float().abs().max().item()
        say(f"\n-- max |compiled - eager| (logits, max |eager| = {scale:.3g}) --")
        for name, err in errors.items():
            say(f"  {name:14s} {err:.3e}")

        burst = f" samples of {BURST} calls back to back" if device.type == "cuda" else ""
        say(f"\n-- forward time, median of {args.steps}{burst} (ms per call) --")
        rows = [("eager", model)] + [(name, c[0]) for name, c in compiled.items()]
        for name, fn in rows:
            ms = _timeit(fn, ids, args.steps, device)
            extra = f"   (compile {compiled[name][3]:.1f} s)" if name in compiled else ""
            say(f"  {name:14s} {ms:9.3f}{extra}")
        if device.type == "cuda":
            from . import routes

            say(f"  fused-op runtime counters (rank 0): {dict(sorted(routes.stats.items()))}")
        if args.profile and device.type == "cuda":
            for name in compiled:
                say(f"\n-- GPU time by kernel, 3 forward calls, {name} (rank 0) --")
                trace = args.trace and os.path.join(args.trace, f"{name}_rank{rank}.json")
                _profile(compiled[name][0], ids, say, trace)
    logging.getLogger("flashoverlap").removeHandler(collect)
    tol = 5e-2 * max(scale, 1.0) if dtype == torch.bfloat16 else 1e-3 * max(scale, 1.0)
    if errors["flashoverlap"] > tol:
        raise SystemExit(f"rank {rank}: flashoverlap output deviates from eager by {errors['flashoverlap']:.3e}")


def _profile(fn, inputs, say, trace: str | None = None) -> None:
    """Print the kernels of three calls of ``fn`` by GPU time (torch.profiler; every rank runs, rank 0 prints);
    ``trace``: also write the Chrome trace there (kernel start and end times: the GPU's idle gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn(inputs)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn(inputs)
        torch.cuda.synchronize()
    say(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    if trace:
        os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
        prof.export_chrome_trace(trace)


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flashoverlap_inductor.demo", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--fuse", choices=("auto", "always", "never"), default=None,
                   help="default: 'auto' on GPU, 'always' on CPU (the cost model describes GPUs)")
    p.add_argument("--steps", type=int, default=10, help="timed forward calls per variant")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: NCCL on GPUs if there are --world-size of them, else gloo on CPU")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=None, help="model width (default 256 on CPU, 4096 on GPU)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 64 on CPU, 2048 on GPU)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--profile", action="store_true", help="GPU: also print each compiled variant's kernels by time")
    p.add_argument("--trace", default=None, help="with --profile: write each variant's Chrome trace into this folder")
    p.add_argument("--mode", choices=("default", "reduce-overhead"), default="default",
                   help="torch.compile mode of both compiled variants (reduce-overhead: CUDA graphs, GPU only)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size else "cpu"
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        p.error(f"--device cuda needs {args.world_size} GPUs, found {torch.cuda.device_count()}")
    gpu = args.device == "cuda"
    if args.mode == "reduce-overhead" and not gpu:
        p.error("--mode reduce-overhead needs the GPUs (CUDA graphs)")
    if args.trace and not (args.profile and gpu):
        p.error("--trace writes the traces of --profile (GPU)")
    args.fuse = args.fuse or ("auto" if gpu else "always")
    args.dim = args.dim or (4096 if gpu else 256)
    args.seq = args.seq or (2048 if gpu else 64)
    args.heads, args.kv_heads = max(args.world_size, args.dim // 64), max(args.world_size, args.dim // 256)
    args.hidden, args.vocab = (8 * args.dim) // 3 // 64 * 64, 512 if not gpu else 32000
    for what, size in (("heads", args.heads), ("kv heads", args.kv_heads), ("ffn", args.hidden)):
        if size % args.world_size:
            p.error(f"{what} ({size}) must divide by --world-size {args.world_size}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(args, _free_port()), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
