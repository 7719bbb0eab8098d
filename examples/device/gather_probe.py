"""The all_gather -> GEMMs peer route (``routes.gather_peer``) on one GPU: correctness with ranks sharing it, then the
per-shard GEMM times of what the route issues.

Stage 1 (``--world`` processes, default 4; rank r on GPU r % count, one GPU serves): a gloo group and torch's
symmetric memory (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), as ``ring_probe4.py``. Each case runs
``torch.ops.flashoverlap.all_gather_gemm`` on fresh random bf16 data and compares with eager PyTorch on the same rank
(gloo ``all_gather`` of the shards, then ``torch.mm`` / ``addmm``): the relative difference to eager over every
element, both errors against an fp32 reference on every 8th row, the gathered tensor bit for bit, and that the call
counted ``route:gather_peer``. Ranks time-slice the GPU: stage 1 checks, it does not time.

Stage 2 (this process alone, after the ranks exited; ``--no-timing`` skips it): per-shard kernel times of a
Llama-3-8B-like layer (M_total 4096 / 8192 tokens, K 4096, N 4096 and 14336, bf16, B = W.t() of a Linear weight)
for world 2 / 4 / 8 shards: ``schedule.gather.shard_gemm`` of ``[M_total / world, K]`` into a shard view of the
``[M_total, N]`` result -- contiguous (gather_dim 0: ``torch.mm(out=...)``) and strided (gather_dim 1 with 2
leading rows: ``torch.bmm(out=...)`` into ``[2, unit, N]``) -- against ``torch.mm`` of the same rows into a fresh
tensor and against 1 / world of the unsplit ``[M_total, K] @ [K, N]``. CUDA events around batches of calls after
a warm-up; medians.

    python examples/device/gather_probe.py [--world 4] [--out DIR] [--no-timing] [--timing-only]

Writes ``gather_probe_world<W>.json`` and ``gather_probe_timing.{json,md}`` to ``--out`` (default ``$OUT`` or .);
prints one line per case and rank, then the timing table. Exits 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import traceback

import torch
import torch.multiprocessing as mp

K = 4096
# (shard shape, gather_dim, N of each GEMM, bias, return_gathered)
CASES = [((1024, K), 0, [4096], False, False), ((1024, K), 0, [14336], True, True),
         ((4096, K), 0, [4096], False, True), ((4096, K), 0, [14336], False, False),
         ((8192, K), 0, [4096], True, False), ((8192, K), 0, [14336], False, False),
         ((2048, K), 0, [4096, 1024, 1024], True, True),  # q / k / v sharing one gather
         ((2, 1024, K), 1, [4096], False, True)]  # sequence-sharded [batch, seq, K]: strided shard rows


def _rel(x: torch.Tensor, ref: torch.Tensor, chunk: int = 4096) -> float:
    """||x - ref|| / ||ref|| in fp32, over row chunks (the full fp32 copies of a large result would not fit 8 ranks)."""
    diff = norm = 0.0
    for i in range(0, x.shape[0], chunk):
        xs, rs = x[i:i + chunk].float(), ref[i:i + chunk].float()
        diff += float((xs - rs).square().sum())
        norm += float(rs.square().sum())
    return (diff / max(norm, 1e-30)) ** 0.5


def _case(i: int, case: tuple, rank: int, world: int, device: torch.device) -> dict:
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    shape, gdim, ns, bias, ret = case
    gen = torch.Generator(device=device).manual_seed(1000 * i + rank)
    a = torch.randn(shape, generator=gen, device=device).bfloat16()
    ws = [(torch.randn(n, K, generator=gen, device=device) / K ** 0.5).bfloat16().t() for n in ns]
    cs = [torch.randn(n, generator=gen, device=device).bfloat16() if bias else None for n in ns]
    before = routes.stats["route:gather_peer"]
    group = dist.group.WORLD
    outs = torch.ops.flashoverlap.all_gather_gemm(a, ws, cs, gdim, world, group.group_name, "auto", ret)
    torch.cuda.synchronize()
    routes.check()
    routed = routes.stats["route:gather_peer"] - before
    parts = [torch.empty(a.shape, dtype=torch.float32) for _ in range(world)]
    dist.all_gather(parts, a.cpu().float().contiguous())  # bf16 -> fp32 is exact; gloo has no 16-bit ints
    g = torch.cat([p.bfloat16().to(device) for p in parts], gdim)
    flat = g.reshape(-1, K)
    sample = flat[::8].float()
    line = {"case": i, "rank": rank, "shard": list(shape), "gather_dim": gdim, "n": ns, "bias": bias,
            "gathered": ret, "routed": routed, "vs_eager": [], "err": [], "eager_err": []}
    good = routed == 1 and len(outs) == len(ns) + ret
    for y, w, c in zip(outs, ws, cs, strict=False):
        eager = torch.mm(flat, w) if c is None else torch.addmm(c, flat, w)
        ref = sample @ w.float() + (0 if c is None else c.float())
        line["vs_eager"].append(_rel(y, eager))
        line["err"].append(_rel(y[::8], ref))
        line["eager_err"].append(_rel(eager[::8], ref))
        good &= bool(torch.isfinite(y).all()) and line["vs_eager"][-1] < 1e-2 and \
            line["err"][-1] <= 1.5 * line["eager_err"][-1] + 1e-3
        del eager
    if ret:
        line["gathered_exact"] = bool(outs[-1].shape == g.shape and torch.equal(outs[-1], g))
        good &= line["gathered_exact"]
    line["ok"] = bool(good)
    return line


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    import torch.distributed as dist

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import flashoverlap_inductor.ops  # noqa: F401  (registers torch.ops.flashoverlap.*)
    from flashoverlap_inductor import config, routes

    results, ok = [], True
    for i, case in enumerate(CASES):
        try:
            with config.patch(transport="peer", wait_timeout_ms=120000.0):  # time-sliced ranks: a long bound
                line = _case(i, case, rank, world, device)
        except Exception:  # noqa: BLE001 - reported per case
            line = {"case": i, "rank": rank, "ok": False, "error": traceback.format_exc()[-1500:]}
            routes.reset()
        ok &= line["ok"]
        results.append(line)
        print(json.dumps(line), flush=True)
        torch.cuda.empty_cache()
        dist.barrier()
    with open(os.path.join(out_dir, f"gather_probe_world{world}_rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "results": results}, f, indent=1)
    dist.barrier()
    routes.reset()
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def _time_us(fn, inner: int = 10, reps: int = 15, warmup: int = 10) -> float:
    """Median over ``reps`` batches of ``inner`` calls of the time per call (us), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


def timing(out_dir: str) -> list[dict]:
    """Stage 2 (module docstring): one row per (M_total, world, N, layout)."""
    from flashoverlap_inductor.schedule import gather as schedule

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rows = []
    for m_total in (4096, 8192):
        for n in (4096, 14336):
            w = torch.randn(n, K, device=device).bfloat16().t()  # [K, N], K contiguous: a Linear weight's W.t()
            full_a = torch.randn(m_total, K, device=device).bfloat16()
            full_us = _time_us(lambda a=full_a, w=w: torch.mm(a, w))
            for world in (2, 4, 8):
                shard = m_total // world
                x = full_a[:shard].contiguous()
                out = torch.empty(m_total, n, device=device, dtype=torch.bfloat16)
                mm_us = _time_us(lambda x=x, w=w: torch.mm(x, w))
                for layout, shape, gdim in (("contiguous", [shard, K], 0), ("strided", [2, shard // 2, K], 1)):
                    geo = schedule.geometry(shape, gdim, world)
                    view = schedule.shard_view(out, geo, world - 1)
                    us = _time_us(lambda x=x, w=w, view=view: schedule.shard_gemm(x, w, None, view))
                    flops = 2 * shard * n * K
                    rows.append({"m_total": m_total, "world": world, "shard_rows": shard, "k": K, "n": n,
                                 "layout": layout, "shard_gemm_us": round(us, 1), "mm_same_rows_us": round(mm_us, 1),
                                 "full_mm_per_world_us": round(full_us / world, 1),
                                 "shard_gemm_tflops": round(flops / us / 1e6, 1),
                                 "vs_mm": round(us / mm_us, 3), "vs_full_share": round(us * world / full_us, 3)})
                    print(json.dumps(rows[-1]), flush=True)
    md = ["| M_total | world | shard rows | N | shard view | shard_gemm us | torch.mm same rows us | "
          "unsplit mm / world us | shard_gemm TFLOP/s | shard_gemm / mm | world x shard_gemm / unsplit |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['m_total']} | {r['world']} | {r['shard_rows']} | {r['n']} | {r['layout']} | "
                  f"{r['shard_gemm_us']} | {r['mm_same_rows_us']} | {r['full_mm_per_world_us']} | "
                  f"{r['shard_gemm_tflops']} | {r['vs_mm']} | {r['vs_full_share']} |")
    table = "\n".join(md)
    print(f"\nper-shard GEMM kernel time on {torch.cuda.get_device_name(device)} (K={K}, bf16, medians)\n{table}",
          flush=True)
    with open(os.path.join(out_dir, "gather_probe_timing.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows}, f,
                  indent=1)
    with open(os.path.join(out_dir, "gather_probe_timing.md"), "w") as f:
        f.write(f"Per-shard GEMM kernel time, {torch.cuda.get_device_name(device)}, K={K}, bf16\n\n{table}\n")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-timing", action="store_true", help="skip stage 2")
    ap.add_argument("--timing-only", action="store_true", help="only stage 2")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    failed = False
    if not args.timing_only:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.spawn(worker, args=(args.world, port, args.out), nprocs=args.world, join=False)
        try:
            while not ctx.join():
                pass
            print(f"gather_probe: every case matched on {args.world} ranks", flush=True)
        except Exception as exc:  # noqa: BLE001 - a failed rank
            print(f"gather_probe: {exc}", flush=True)
            failed = True
    if not args.no_timing:
        timing(args.out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
