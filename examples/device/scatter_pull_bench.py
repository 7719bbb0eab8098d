"""GEMM -> reduce_scatter on 2 GPUs: the pull route (``scatter_route="pull"``) on its two schedules (``pull``:
``scatter_start="handshake"``; ``push<P>``: ``scatter_start="push"``, the default, with ``scatter_pieces=P``: 0 the
Python path, else one ``fo_scatter_run`` of P pieces; ``--pieces``) against the peer route, cuBLAS then
NCCL, and the ideal ``max(T_gemm, T_comm)``, interleaved in one run (``tune.measure.Timer``: CUDA events, warm-up,
medians, max over ranks); and the sum of two GEMMs (a backward's summed input gradients: ``x1 @ w1 + x2 @ w2``
then reduce_scatter) as Inductor runs it (``mm``, ``mm``, ``add``, NCCL), as the pass fuses it today (one GEMM over
the concatenated K, the cats included) and on the pull route (``t = x1 @ w1``, then the fused op with ``t`` as its
bias). Every variant's result is checked against the sequential one (relative error); its route and, for the fused
ones, the host ms per call are printed (HOST-BOUND where that reaches 90% of its median).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 examples/device/scatter_pull_bench.py \\
        [--shapes 4096x4096x4096,4096x4096x14336] [--sum-shapes 4096x4096x14336] [--pieces 0,2,4]

``--op all_reduce``: GEMM -> all_reduce instead, the peer route against the all_reduce pull route
(``routes/reduce_pull.py``, ``all_reduce_route="pull"``) at each ``--pieces`` value P > 0 (``all_reduce_pieces=P``:
variant ``pull<P>``; ``eP``:
variant ``even<P>``, the experiment ``reduce_even_pieces``), cuBLAS then NCCL and the ideal; no sum shapes.

Shapes are M x N x K with K the whole reduction (each rank holds K/2; a sum shape's two terms K/4 each per rank).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.tune import measure as tm
from flashoverlap_inductor.tune.rows import route_of_launch


def shapes_of(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


FUSED = ["peer", "pull", "push0", "push2"]  # set by --pieces
HOST_BOUND = 0.9  # a fused variant whose host time per call reaches this share of its median is host-bound there


def run_row(variants: dict, ref_name: str, timer: tm.Timer) -> dict:
    """Each variant's route, error against ``ref_name``'s result and median ms (interleaved); each fused variant's
    host ms per call (``tm.host_us``, the GPU kept busy; max over ranks), and ``host_bound`` where it reaches
    ``HOST_BOUND`` of the median (the GPU then waits for the host: push's slow small rows, 36th session)."""
    want = variants[ref_name]().float()
    row = {}
    for v, fn in variants.items():
        before = dict(routes.stats)
        got = fn()
        torch.cuda.synchronize()
        ran = [k for k, c in routes.stats.items() if k.startswith("route:") and c > before.get(k, 0)]
        if route_of_launch(getattr(routes.last_launch, "description", "")) == "push":
            ran.append("push schedule")  # the push column must say so: else it fell back to the handshake
        err = ((got.float() - want).norm() / want.norm()).item() if got is not None and got.shape == want.shape else 0.0
        row[v] = {"route": ",".join(ran) or "-", "err": tm.reduce_max([err])[0]}
    for v, t in timer.measure(variants).items():
        row[v]["ms"] = t.ms
    hosts = tm.reduce_max([tm.host_us(variants[v], 20, batch=10, sync=dist.barrier) / 1e3 for v in FUSED])
    for v, h in zip(FUSED, hosts, strict=True):
        row[v]["host"] = h
        row[v]["host_bound"] = h >= HOST_BOUND * row[v]["ms"]
    return row


def print_table(lines: list, note: str) -> None:
    """Rank 0: one row per shape (``lines``: label, row, ideal), each fused variant's ms and x over sequential, the
    routes and errors, and the geomeans."""
    if dist.get_rank() != 0:
        return
    print(f"{torch.cuda.get_device_name()} x {dist.get_world_size()}; ms (median, max over ranks); x = seq / "
          f"variant; {note}")
    print(f"{'shape':24} {'gemm':>7} {'comm':>7} {'seq':>7} " + " ".join(f"{v:>7}" for v in FUSED)
          + f" {'ideal':>7} " + " ".join(f"{'x ' + v:>7}" for v in FUSED) + f" {'x ideal':>7}  routes / errors")
    ratios = {v: [] for v in FUSED}
    for label, row, ideal in lines:
        s = row["seq"]["ms"]
        for v in FUSED:
            ratios[v].append(s / row[v]["ms"])
        print(f"{label:24} {row['gemm']['ms']:7.3f} {row['comm']['ms']:7.3f} {s:7.3f} "
              + " ".join(f"{row[v]['ms']:7.3f}" for v in FUSED) + f" {ideal:7.3f} "
              + " ".join(f"{s / row[v]['ms']:7.3f}" for v in FUSED) + f" {s / ideal:7.3f}  "
              + "; ".join(f"{v} {row[v]['route']} err {row[v]['err']:.1e} host {row[v]['host']:.3f} ms"
                          + (" HOST-BOUND" if row[v]["host_bound"] else "") for v in FUSED))
    print("geomean " + ", ".join(f"x {v} {tm.geomean(ratios[v]):.3f}" for v in FUSED))


def all_reduce_rows(shapes: list[tuple[int, int, int]], pieces: list[str]) -> None:
    """``--op all_reduce``: per shape, sequential (cuBLAS then NCCL), the GEMM and the all_reduce alone, the peer route
    and the pull route at each piece count (``P``: variant ``pull<P>``, its pieces shrinking towards the last; ``eP``:
    ``even<P>``, the experiment ``reduce_even_pieces``), interleaved; then the table."""
    FUSED[:] = ["peer"] + [f"even{v[1:]}" if v.startswith("e") else f"pull{v}" for v in pieces]
    rank, world, name = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
    op = torch.ops.flashoverlap.gemm_all_reduce
    base = config.current().replace(transport="peer")
    keys = {"peer": base.replace(all_reduce_route="peer").key()}
    for v, label in zip(pieces, FUSED[1:], strict=True):
        even = frozenset({"reduce_even_pieces"} if v.startswith("e") else ())
        keys[label] = base.replace(all_reduce_route="pull", all_reduce_pieces=int(v.removeprefix("e")),
                                   experiments=even).key()
    timer = tm.Timer(rounds=5, target_ms=10.0, min_iters=2, max_iters=40, spin_ms=0.3)
    lines = []
    for m, n, k in shapes:
        torch.manual_seed(100 + rank)
        x = torch.randn(m, k // world, device="cuda").bfloat16()
        w = (torch.randn(n, k // world, device="cuda") / math.sqrt(k)).bfloat16().t()
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        def seq(x=x, w=w):
            out = x @ w
            dist.all_reduce(out)
            return out

        variants = {"seq": seq, "gemm": lambda x=x, w=w: x @ w, "comm": lambda y=y: dist.all_reduce(y)}
        for v, key in keys.items():
            variants[v] = lambda x=x, w=w, key=key: op(x, w, None, "sum", name, "auto", key)
        row = run_row(variants, "seq", timer)
        lines.append((f"{m}x{n}x{k}", row, max(row["gemm"]["ms"], row["comm"]["ms"])))
    print_table(lines, "GEMM -> all_reduce: peer = the peer route, pull<P> = the pull route in P pieces shrinking "
                "towards the last, even<P> = in P even pieces")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4096x4096x4096,4096x4096x14336,8192x4096x14336,16384x4096x4096")
    p.add_argument("--sum-shapes", default="4096x4096x14336,8192x4096x14336")
    p.add_argument("--pieces", default="0,2,4", help="scatter_pieces values, one push variant each (all_reduce: "
                   "all_reduce_pieces values, one pull variant each; eP: P even pieces)")
    p.add_argument("--op", default="reduce_scatter", choices=("reduce_scatter", "all_reduce"))
    args = p.parse_args()
    torch.cuda.set_device(dist.get_node_local_rank(fallback_rank=0))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    if args.op == "all_reduce":
        all_reduce_rows(shapes_of(args.shapes), [v for v in args.pieces.split(",") if v and v != "0"])
        dist.destroy_process_group()
        return
    pieces = [int(v) for v in args.pieces.split(",") if v]
    FUSED[:] = ["peer", "pull"] + [f"push{v}" for v in pieces]
    rank, world, name = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
    op = torch.ops.flashoverlap.gemm_reduce_scatter
    peer_key = config.current().replace(transport="peer", scatter_route="peer").key()
    pull_key = config.current().replace(transport="peer", scatter_route="pull", scatter_start="handshake").key()
    push_keys = {f"push{v}": config.current().replace(transport="peer", scatter_route="pull", scatter_start="push",
                                                      scatter_pieces=v).key() for v in pieces}
    timer = tm.Timer(rounds=5, target_ms=10.0, min_iters=2, max_iters=40, spin_ms=0.3)
    lines = []
    for m, n, k in shapes_of(args.shapes):
        torch.manual_seed(100 + rank)
        x = torch.randn(m, k // world, device="cuda").bfloat16()
        w = (torch.randn(n, k // world, device="cuda") / math.sqrt(k)).bfloat16().t()
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)

        def seq(x=x, w=w, out=out):
            dist.reduce_scatter_tensor(out, x @ w)
            return out

        variants = {"seq": seq, "gemm": lambda x=x, w=w: x @ w,
                    "comm": lambda y=y, out=out: dist.reduce_scatter_tensor(out, y),
                    "peer": lambda x=x, w=w: op(x, w, None, "sum", world, name, "auto", peer_key),
                    "pull": lambda x=x, w=w: op(x, w, None, "sum", world, name, "auto", pull_key)}
        for v, key in push_keys.items():
            variants[v] = lambda x=x, w=w, key=key: op(x, w, None, "sum", world, name, "auto", key)
        row = run_row(variants, "seq", timer)
        ideal = max(row["gemm"]["ms"], row["comm"]["ms"])
        lines.append((f"{m}x{n}x{k}", row, ideal))
    for m, n, k in shapes_of(args.sum_shapes):
        torch.manual_seed(200 + rank)
        x1, x2 = (torch.randn(m, k // world // 2, device="cuda").bfloat16() for _ in range(2))
        w1, w2 = ((torch.randn(n, k // world // 2, device="cuda") / math.sqrt(k)).bfloat16().t() for _ in range(2))
        out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        def seq_sum(x1=x1, x2=x2, w1=w1, w2=w2, out=out):
            dist.reduce_scatter_tensor(out, torch.mm(x1, w1) + torch.mm(x2, w2))
            return out

        def peer_cat(x1=x1, x2=x2, w1=w1, w2=w2):
            return op(torch.cat([x1, x2], 1), torch.cat([w1, w2], 0), None, "sum", world, name, "auto", peer_key)

        def pull_sum(x1=x1, x2=x2, w1=w1, w2=w2, key=pull_key):
            return op(x2, w2, torch.mm(x1, w1), "sum", world, name, "auto", key)

        variants = {"seq": seq_sum, "gemm": lambda x1=x1, x2=x2, w1=w1, w2=w2: torch.mm(x1, w1) + torch.mm(x2, w2),
                    "comm": lambda y=y, out=out: dist.reduce_scatter_tensor(out, y),
                    "peer": peer_cat, "pull": pull_sum}
        for v, key in push_keys.items():  # a bias: the Python path whatever the pieces
            variants[v] = lambda key=key: pull_sum(key=key)
        row = run_row(variants, "seq", timer)
        ideal = max(row["gemm"]["ms"], row["comm"]["ms"])
        lines.append((f"sum {m}x{n}x{k}", row, ideal))
    print_table(lines, "sum rows: peer = one GEMM over the concatenated K (cats included), pull = mm then the op "
                "with it as bias")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
