"""Demo: a small Llama-style decoder, tensor-parallel over 2 ranks, compiled with ``backend="flashoverlap"``.

    python -m flashoverlap_inductor.demo [--world-size 2] [--fuse auto|always|never] [--steps 10] [--warmup 3]
                                         [--backends inductor,flashoverlap] [--device auto|cuda|cpu]
                                         [--layers 2] [--dim D] [--seq S] [--batch 4] [--mode default|reduce-overhead]

Parallelizes the model with DTensor ``parallelize_module`` (column-parallel q/k/v/gate/up, row-parallel o/down: every
row-parallel GEMM ends in an all_reduce) on ``--world-size`` ranks (NCCL on GPUs when there are enough, else gloo on
CPU) and compiles it with plain Inductor and with the flashoverlap backend, each backend in its own fresh rank
processes with an empty Inductor cache (so neither reuses the other's kernels and the compile times compare). Prints
what the pass fused or skipped (with reasons and the chosen wave-group plans), each backend's largest deviation from
eager, forward timings (medians over ``--steps`` samples after ``--warmup`` calls; on GPU, CUDA events around 5
calls back to back) and compile times, then one ``PASS: ...`` / ``FAIL: ...`` line (exit status 1 on FAIL).
Inference only (``torch.no_grad``). ``--mode reduce-overhead`` (GPU) compiles both for CUDA graphs, as
``torch.compile(mode="reduce-overhead")`` does; the logits compared are then those of a replay. On CPU the timings
mean nothing and ``--fuse`` defaults to ``always`` (the cost model behind ``auto`` describes H200 GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor.tools import demo_report
from flashoverlap_inductor.tools.demo_report import BACKENDS, BURST, model_sizes, shape_error, whole


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


def _timeit(fn, inputs, steps: int, warmup: int, device: torch.device) -> float:
    """Median forward time in ms after ``warmup`` calls. GPU: each of ``steps`` samples times ``BURST`` calls back
    to back between CUDA events (after a barrier), as an inference loop runs them: each call's host work before its
    first kernel overlaps the previous call's kernels instead of showing as idle GPU time. CPU: one call per sample,
    barrier-aligned."""
    for _ in range(warmup):
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


def _worker(rank: int, args: argparse.Namespace, port: int, backend: str, time_eager: bool, out: str) -> None:
    """One rank of one backend's processes; rank 0 writes the results (``demo_report``) as JSON to ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torch._inductor import config as inductor_config

    inductor_config.fx_graph_cache = False  # the pass really runs and reports (the variable is read at import)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world_size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=args.world_size)
    try:
        result = _run(rank, args, device, backend, time_eager)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        if device.type == "cuda":  # free the CUDA graphs first: NCCL waits for graphs holding its kernels
            torch.cuda.synchronize()
            torch._dynamo.reset()
            gc.collect()
        dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace, device: torch.device, backend: str, time_eager: bool) -> dict:
    """Eager reference, ``backend``'s compilation (timed) and deviation (max over the ranks), then forward times
    (``time_eager``: eager's first) and, with ``--profile`` on GPU, rank 0's kernel table."""
    from torch._inductor.utils import fresh_cache
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from flashoverlap_inductor import routes
    from flashoverlap_inductor.passes import counters, reset_counters

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.hidden).to(device, dtype)
    model = parallelize_module(model, init_device_mesh(device.type, (args.world_size,)), tp_plan(model)).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    collect = _Collect()
    logging.getLogger("flashoverlap").addHandler(collect)
    logging.getLogger("flashoverlap").setLevel(logging.INFO)
    # A fresh process and an empty Inductor (and Triton) cache: this backend compiles every kernel itself.
    with torch.no_grad(), fresh_cache():
        ref = model(ids)
        graphs = args.mode == "reduce-overhead"
        options = compat.list_mode_options(args.mode) if graphs else {}
        if backend == "flashoverlap":
            options["flashoverlap.fuse"] = args.fuse
        torch._dynamo.reset()
        reset_counters()
        t0 = time.perf_counter()
        fn = torch.compile(model, backend=backend, options=options or None)
        for _ in range(3 if graphs else 1):  # CUDA graphs: warm-up, capture, then a replay
            out = fn(ids)
        compile_s = time.perf_counter() - t0
        out, fused_counters = out.clone(), dict(counters)
        err = (out.float() - ref.float()).abs().max().item()
        dev = torch.tensor([err if math.isfinite(err) else math.inf, ref.float().abs().max().item()],
                           dtype=torch.float64, device=device)
        dist.all_reduce(dev, op=dist.ReduceOp.MAX)
        err, scale = dev.tolist()
        times = {"eager": _timeit(model, ids, args.steps, args.warmup, device)} if time_eager else {}
        times[backend] = _timeit(fn, ids, args.steps, args.warmup, device)
        profile = None
        if args.profile and device.type == "cuda":
            trace = args.trace and os.path.join(args.trace, f"{backend}_rank{rank}.json")
            profile = _profile(fn, ids, trace)
    logging.getLogger("flashoverlap").removeHandler(collect)
    return {"backend": backend, "dtype": str(dtype), "compile_s": compile_s, "err": err, "scale": scale,
            "rel_err": err / scale if scale > 0 else err, "times": times, "counters": fused_counters,
            "lines": collect.lines, "stats": dict(routes.stats), "profile": profile}


def _profile(fn, inputs, trace: str | None = None) -> str:
    """The kernels of three calls of ``fn`` by GPU time (torch.profiler; every rank runs, rank 0's table is
    printed); ``trace``: also write the Chrome trace there (kernel start and end times: the GPU's idle gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn(inputs)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn(inputs)
        torch.cuda.synchronize()
    if trace:
        os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
        prof.export_chrome_trace(trace)
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60)


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's arguments, each checked here: a bad one exits with status 2 and a one-line usage error."""
    p = argparse.ArgumentParser(prog="python -m flashoverlap_inductor.demo", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=whole(1), default=2, help="ranks (tensor-parallel degree)")
    p.add_argument("--fuse", choices=("auto", "always", "never"), default=None,
                   help="default: 'auto' on GPU, 'always' on CPU (the cost model describes GPUs)")
    p.add_argument("--steps", type=whole(1), default=10, help="timed samples per variant (the median is shown)")
    p.add_argument("--warmup", type=whole(0), default=3, help="untimed forward calls before the timed ones")
    p.add_argument("--backends", type=demo_report.backends, default=BACKENDS,
                   help="what to compile, each in its own fresh processes (default: inductor,flashoverlap)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: NCCL on GPUs if there are --world-size of them, else gloo on CPU")
    p.add_argument("--layers", type=whole(1), default=2)
    p.add_argument("--dim", type=whole(24, " (the FFN width, 8 * dim / 3 rounded down to a multiple of 64, must "
                                            "be positive)"), default=None,
                   help="model width (default 256 on CPU, 4096 on GPU)")
    p.add_argument("--seq", type=whole(1), default=None, help="sequence length (default 64 on CPU, 2048 on GPU)")
    p.add_argument("--batch", type=whole(1), default=4)
    p.add_argument("--profile", action="store_true", help="GPU: also print each compiled variant's kernels by time")
    p.add_argument("--trace", default=None, help="with --profile: write each variant's Chrome trace into this folder")
    p.add_argument("--mode", choices=("default", "reduce-overhead"), default="default",
                   help="torch.compile mode of both compiled variants (reduce-overhead: CUDA graphs, GPU only)")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto":
        args.device = "cuda" if gpus >= args.world_size else "cpu"
        args.cpu_reason = "no CUDA GPU" if gpus == 0 else f"{gpus} GPU(s) for --world-size {args.world_size}"
    else:
        args.cpu_reason = "--device cpu"
    if args.device == "cuda" and gpus < args.world_size:
        p.error(f"argument --device: got cuda, but found {gpus} CUDA GPUs for --world-size {args.world_size}; "
                "accepted: auto or cpu" + (f", or --world-size {gpus} or less" if gpus else ""))
    gpu = args.device == "cuda"
    if args.mode == "reduce-overhead" and not gpu:
        p.error("argument --mode: got reduce-overhead, which captures CUDA graphs; accepted on CPU: default")
    if args.trace and not (args.profile and gpu):
        p.error(f"argument --trace: got {args.trace}; accepted only with --profile on GPU (it writes its traces)")
    args.fuse_given, args.fuse = args.fuse is not None, args.fuse or ("auto" if gpu else "always")
    dim_given = args.dim is not None
    args.dim = args.dim or (4096 if gpu else 256)
    args.seq = args.seq or (2048 if gpu else 64)
    if (why := shape_error(args.dim, args.world_size, dim_given)) is not None:
        p.error(why)
    args.heads, args.kv_heads, args.hidden = model_sizes(args.dim, args.world_size)
    args.vocab = 512 if not gpu else 32000
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status (0: PASS, 1: FAIL)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    args = parse_args(argv)
    say = lambda *a: print(*a, flush=True)
    gpu = args.device == "cuda"
    if not gpu:
        say(demo_report.cpu_note(args))
    say(f"== {args.layers}-layer Llama-style decoder, dim {args.dim}, ffn {args.hidden}, heads {args.heads}/"
        f"{args.kv_heads} kv, TP={args.world_size} on {args.device} ({torch.bfloat16 if gpu else torch.float32}), "
        f"batch {args.batch} x seq {args.seq} -> {args.batch * args.seq} GEMM rows; fuse mode {args.fuse!r}, "
        f"compile mode {args.mode!r}")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="flashoverlap-demo-") as tmp:
        for i, backend in enumerate(args.backends):
            what = "it and eager" if i == 0 else "it"
            procs = f"{args.world_size} fresh process{'es' if args.world_size > 1 else ''}"
            say(f"[{i + 1}/{len(args.backends)}] {backend}: compiling on {procs} (empty Inductor cache), then timing "
                f"{what}")
            out = os.path.join(tmp, f"{backend}.json")
            try:
                mp.spawn(_worker, args=(args, _free_port(), backend, i == 0, out), nprocs=args.world_size, join=True)
            except ProcessException as exc:
                print(exc, file=sys.stderr, flush=True)
                last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                say(f"FAIL: the {backend} run failed: {last}")
                return 1
            with open(out) as f:
                results.append(json.load(f))
    return 0 if demo_report.report(args, results, say) else 1


if __name__ == "__main__":
    sys.exit(main())
