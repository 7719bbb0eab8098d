"""Op-level benchmark of the MoE expert-parallel ops on 2 GPUs of one host (one rank per GPU, NCCL, bf16): the combine
(``flashoverlap::gemm_unpermute_all_to_all``: the experts' down GEMM, the un-permutation, the all_to_all back) and the
dispatch (``flashoverlap::all_to_all_permute_gemm``: the all_to_all of the routed rows, the permutation by expert,
the experts' gate/up GEMM), both in the grouped form (``torch._grouped_mm``), on the P2P route (``routes/moe_p2p.py``).

Shapes (``--shapes preset:tokens,...``; tokens per rank): ``qwen3`` (Qwen3-MoE-like: hidden 2048, expert inter 768,
64 experts per rank, top-8) and ``mixtral`` (Mixtral-like: hidden 4096, inter 14336, 4 experts per rank, top-2), at
4096, 8192 and 16384 tokens per rank by default. Routing: every rank's tokens pick their top-k experts of a uniform
random score (one shared seed, so every rank knows every split size), rows sent expert-sorted as the MoE layer sends
them. Per shape and op, all variants timed interleaved (``tune.measure.Timer``: CUDA events, warm-up, medians of
rounds, max over ranks):

* ``seq``: the unfused graph (combine: ``_grouped_mm``, ``index_put``, ``all_to_all_single``; dispatch:
  ``all_to_all_single``, the index, ``_grouped_mm``); ``gemm``: its compute alone; ``comm``: its ``all_to_all_single``
  alone; ``ideal``: max(gemm, comm);
* ``fused[<plan>]``: the op under each ``--plans`` entry (default ``blocks``: the whole-block path,
  ``routes/moe_fast.py``; ``blocks:c=2``: the general path; ``experts``: the dispatch cut by expert,
  ``routes/moe_expert_cut.py``); the route and path it took (``moe_p2p/whole-block``, ``moe_p2p/expert-cut``,
  ``moe_p2p/general``, ``moe_p2p/redo``) and its relative error against ``seq`` (worst rank) are reported.

The cost model's verdict for the shape (``cost_model.moe.decide_moe``: ``auto`` fuse or not, ``pred x`` its
predicted speedup; the pass does not act on it yet, the rows being per rank) sits beside the measured one, and a last
line checks that no shape it would fuse runs more than 2% slower than ``seq`` under the first plan (a row whose first
plan failed counts as a failure there).

Each fused call reads the device once (the settle; the general path also copies its routing cut to the host before
its first GEMM): the host syncs are in the timings.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 examples/bench_moe.py [--shapes qwen3:4096,mixtral:8192] \\
        [--plans blocks,blocks:c=2,blocks:c=4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.cost_model import moe
from flashoverlap_inductor.schedule.combine import NO_ROWS
from flashoverlap_inductor.tune import measure as tm

PRESETS = {"qwen3": {"hidden": 2048, "inter": 768, "experts": 64, "top_k": 8},
           "mixtral": {"hidden": 4096, "inter": 14336, "experts": 4, "top_k": 2}}
TOKENS = (4096, 8192, 16384)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="", help="preset:tokens,... (presets: " + ", ".join(PRESETS) + ")")
    p.add_argument("--plans", default="blocks,blocks+deferred,experts+deferred,blocks+peer,blocks+deferred+peer",
                   help="the fused op's plans, one column each; '<plan>+<experiment>[+...]': that plan with those "
                        "experiments on (config.EXPERIMENTS; short forms: 'deferred' moe_settle_deferred, "
                        "'plan_triton' moe_plan_triton, 'two_behind' moe_judge_two_behind, 'peer' moe_peer: "
                        "copy-engine pushes and direct writes, one host; 'no_rows': the dispatch returns no permuted "
                        "rows, as in an inference graph), e.g. "
                        "blocks+deferred,blocks+deferred+plan_triton,blocks+deferred+peer,blocks+deferred+no_rows")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=20.0)
    p.add_argument("--json", default=None)
    p.add_argument("--one-gpu", action="store_true",
                   help="allow one rank on one GPU (torchrun --nproc_per_node=1): every row local, no transfer; the "
                        "ops' own GPU and host work and their results on the hardware, not an overlap figure")
    return p.parse_args(argv)


def shapes_of(text: str) -> list[tuple[str, int]]:
    if not text:
        return [(preset, t) for preset in PRESETS for t in TOKENS]
    out = []
    for item in text.split(","):
        preset, tokens = item.split(":")
        if preset not in PRESETS:
            raise SystemExit(f"bench_moe: unknown preset {preset!r} (expected one of {list(PRESETS)})")
        out.append((preset, int(tokens)))
    return out


def routing(experts: int, top_k: int, tokens: int, world: int, rank: int, dev: torch.device) -> dict:
    """Split sizes and the permutation of the dispatch's received rows (source-major, then local expert) into expert
    order. ``counts[i, j * E + e]``: rows rank i sends to local expert e of rank j (the same on every rank)."""
    gen = torch.Generator(device=dev).manual_seed(tokens)
    counts = torch.stack([torch.rand(tokens, world * experts, generator=gen, device=dev).topk(top_k, dim=1)
                          .indices.flatten().bincount(minlength=world * experts) for _ in range(world)]).cpu()
    per_block = counts.view(world, world, experts)  # [source, destination, local expert]
    ins = per_block[rank].sum(1).tolist()  # rows this rank sends each rank (dispatch)
    outs = per_block[:, rank].sum(1).tolist()  # rows it receives from each rank
    mine = per_block[:, rank]  # [source, local expert]
    expert_of_row = torch.arange(experts).repeat(world).repeat_interleave(mine.flatten())
    perm = expert_of_row.argsort(stable=True).to(dev)
    offs = mine.sum(0).cumsum(0).to(torch.int32).to(dev)
    return {"ins": ins, "outs": outs, "perm": perm, "offs": offs, "rows": sum(outs)}


def _relerr(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


SUFFIXES = {"deferred": "moe_settle_deferred", "plan_triton": "moe_plan_triton", "two_behind": "moe_judge_two_behind",
            "peer": "moe_peer"}


def _settings(plan: str) -> tuple[str, str]:
    """The op's plan and settings key of a column ``<plan>[+<experiment>...]``: each ``+`` name (or its short form in
    ``SUFFIXES``) is added to the current settings' experiments, passed as the op's settings argument (no context
    manager in the timed call). A plan without ``+`` runs under the current settings (key ""). ``+no_rows`` is the
    op's plan suffix instead (the dispatch returns no ``p``, as in an inference graph; ignored by the combine)."""
    plan, *extra = plan.split("+")
    if "no_rows" in extra:
        extra.remove("no_rows")
        plan += NO_ROWS
    if not extra:
        return plan, ""
    now = config.current()
    names = {SUFFIXES.get(name, name) for name in extra}
    unknown = names - set(config.EXPERIMENTS)
    if unknown:
        raise SystemExit(f"bench_moe: unknown experiments {sorted(unknown)} in a plan (known: "
                         f"{', '.join(sorted(config.EXPERIMENTS))}; short forms: {', '.join(SUFFIXES)})")
    return plan, now.replace(experiments=now.experiments | names).key()


def _variants(op: str, shape: dict, r: dict, plans: list[str], dev: torch.device) -> tuple[dict, object]:
    """The timed functions of one op (module docstring) and the reference result's function."""
    g, name = dist.group.WORLD, dist.group.WORLD.group_name
    rank, h, inter, e = dist.get_rank(), shape["hidden"], shape["inter"], shape["experts"]
    torch.manual_seed(1000 + rank)
    if op == "dispatch":
        x = torch.randn(sum(r["ins"]), h, device=dev).bfloat16()
        torch.manual_seed(7)
        w = (torch.randn(e, 2 * inter, h, device=dev) / math.sqrt(h)).bfloat16().transpose(-2, -1)
        recv = torch.empty(r["rows"], h, device=dev, dtype=torch.bfloat16)

        def comm():
            dist.all_to_all_single(recv, x, r["outs"], r["ins"], group=g)
            return recv

        def gemm():
            return torch._grouped_mm(recv[r["perm"]], w, offs=r["offs"])

        def seq():
            comm()
            return gemm()

        def fused(plan):
            plan, key = _settings(plan)
            return lambda: torch.ops.flashoverlap.all_to_all_permute_gemm(
                x, r["perm"], [w], None, r["offs"], r["outs"], r["ins"], name, plan, key)[1]
    else:
        a = torch.randn(r["rows"], inter, device=dev).bfloat16()
        torch.manual_seed(8)
        w = (torch.randn(e, h, inter, device=dev) / math.sqrt(inter)).bfloat16().transpose(-2, -1)
        send = torch.empty(r["rows"], h, device=dev, dtype=torch.bfloat16)
        out = torch.empty(sum(r["ins"]), h, device=dev, dtype=torch.bfloat16)

        def gemm():
            return send.index_put_((r["perm"],), torch._grouped_mm(a, w, offs=r["offs"]))

        def comm():
            dist.all_to_all_single(out, send, r["ins"], r["outs"], group=g)
            return out

        def seq():
            gemm()
            return comm()

        def fused(plan):
            plan, key = _settings(plan)
            plan = plan.removesuffix(NO_ROWS)  # the combine returns no permuted rows
            return lambda: torch.ops.flashoverlap.gemm_unpermute_all_to_all(
                [a], [w], r["offs"], r["perm"], False, r["ins"], r["outs"], name, plan, key)

    variants = {"seq": seq, "gemm": gemm, "comm": comm, **{f"fused[{p}]": fused(p) for p in plans}}
    return variants, seq


def bench(op: str, preset: str, tokens: int, plans: list[str], timer: tm.Timer, dev: torch.device) -> dict:
    shape = PRESETS[preset]
    world, rank = dist.get_world_size(), dist.get_rank()
    r = routing(shape["experts"], shape["top_k"], tokens, world, rank, dev)
    variants, seq = _variants(op, shape, r, plans, dev)
    row = {"op": op, "preset": preset, "tokens": tokens, **shape, "world": world,
           "rows_received": tm.reduce_max([float(r["rows"])])[0], "errors": {}}
    want = seq().clone()
    for p in plans:
        v = f"fused[{p}]"
        before = routes.stats["route:moe_p2p"]
        paths = {k: routes.stats[f"{op}:{k}"] for k in ("fast", "redo", "experts")}
        try:
            got = variants[v]()
            torch.cuda.synchronize()
            row[f"relerr_{v}"] = tm.reduce_max([_relerr(got, want)])[0]
        except Exception as exc:  # noqa: BLE001 - the variant is dropped from the timing and reported
            row["errors"][v] = repr(exc)[:200]
            del variants[v]
            continue
        path = "whole-block" if routes.stats[f"{op}:fast"] > paths["fast"] else \
            "expert-cut" if routes.stats[f"{op}:experts"] > paths["experts"] else \
            "redo" if routes.stats[f"{op}:redo"] > paths["redo"] else "general"
        row[f"route_{v}"] = f"moe_p2p/{path}" if routes.stats["route:moe_p2p"] > before else "unfused"
    for v, t in timer.measure(variants).items():
        row[f"{v}_ms"] = t.ms
    row["ideal_ms"] = max(row["gemm_ms"], row["comm_ms"])
    for v in [*(f"fused[{p}]" for p in plans), "ideal"]:
        if f"{v}_ms" in row:
            row[f"speedup_{v}"] = row["seq_ms"] / row[f"{v}_ms"]
    d = moe.decide_moe(op, tokens * shape["top_k"], _gemms(op, shape), "bfloat16", world,
                       device_name=torch.cuda.get_device_name(dev))
    row.update(auto=d.fuse, pred_speedup=d.predicted_seq_ms / d.predicted_fused_ms, pred_seq_ms=d.predicted_seq_ms,
               pred_fused_ms=d.predicted_fused_ms)
    return row


def _gemms(op: str, shape: dict) -> list[tuple[int, int]]:
    """The timed op's GEMM terms as the cost model takes them, (k, n) each: the dispatch's one gate-up weight
    ``[experts, hidden, 2 * inter]``, the combine's down weight."""
    h, i = shape["hidden"], shape["inter"]
    return [(h, 2 * i)] if op == "dispatch" else [(i, h)]


def _print(rows: list[dict], plans: list[str], world: int) -> None:
    fused = [f"fused[{p}]" for p in plans]
    print(f"MoE ops, {world} x {torch.cuda.get_device_name()}, bf16, grouped experts; ms (median, max over ranks); "
          "speedup = seq / variant")
    print("op | preset | tokens/rank | seq | " + " | ".join(fused) + " | gemm | comm | ideal | "
          + " | ".join(f"x {v}" for v in [*fused, "ideal"]) + " | pred x | auto | route | max err")
    for r in rows:
        ms = " | ".join(f"{r.get(f'{v}_ms', math.nan):.3f}" for v in ["seq", *fused, "gemm", "comm", "ideal"])
        sp = " | ".join(f"{r.get(f'speedup_{v}', math.nan):.3f}" for v in [*fused, "ideal"])
        route = ",".join(sorted({r.get(f"route_{v}", "-") for v in fused}))
        err = max((r.get(f"relerr_{v}", math.nan) for v in fused), default=math.nan)
        print(f"{r['op']} | {r['preset']} | {r['tokens']} | {ms} | {sp} | {r['pred_speedup']:.3f} | "
              f"{'fuse' if r['auto'] else 'no'} | {route} | {err:.1e}"
              + (f"  errors: {r['errors']}" if r["errors"] else ""))
    first = fused[0] if fused else None
    chosen = [r for r in rows if r["auto"] and first]
    worst = min((r.get(f"speedup_{first}", 0.0) for r in chosen), default=math.nan)
    print(f"auto fuses {len(chosen)} of {len(rows)} rows; the slowest of them runs {worst:.3f}x of seq under {first} "
          f"[{'PASS' if not chosen or worst >= 1 / 1.02 else 'FAIL'}: none more than 2% slower]")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = 1 if args.one_gpu else 2
    if gpus < need or not dist.is_torchelastic_launched():
        print(f"bench_moe: needs {need} CUDA GPU(s) of one host and torchrun (found {gpus} GPU(s), "
              f"{'under' if dist.is_torchelastic_launched() else 'not under'} torchrun); run:\n"
              "  NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 examples/bench_moe.py", file=sys.stderr)
        return 2
    torch.cuda.set_device(dist.get_node_local_rank(fallback_rank=0))  # before the NCCL communicator exists
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < need:
        print("bench_moe: run with --nproc_per_node=2 (one rank per GPU), or 1 with --one-gpu", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    plans = [p for p in args.plans.split(",") if p]
    timer = tm.Timer(rounds=args.rounds, target_ms=args.target_ms, min_iters=2, max_iters=40, spin_ms=0.3)
    # the route on CUDA is an experiment until measured; "always": the fused columns time the fused op whatever the
    # default fuse mode says (the cost model's verdict is a column of its own)
    with config.patch(experiments={"moe_p2p_cuda"}, fuse="always"):
        rows = [bench(op, preset, tokens, plans, timer, dev) for preset, tokens in shapes_of(args.shapes)
                for op in ("dispatch", "combine")]
    if rank == 0:
        _print(rows, plans, world)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
