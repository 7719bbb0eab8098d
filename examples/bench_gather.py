"""Op-level benchmark of all_gather -> GEMM (``flashoverlap::all_gather_gemm``) against every baseline, on W GPUs of
one host (one rank per GPU, NCCL). Per shape (M_total gathered rows, N, K; each rank holds M_total / W rows), all
variants timed interleaved in one run (``tune_measure.Timer``: CUDA events, warm-up, medians, max over ranks):

* ``gemm``: cuBLAS ``torch.mm`` of the gathered [M_total, K] @ [K, N]; ``comm``: ``all_gather_into_tensor`` alone;
  ``ideal``: max(gemm, comm);
* ``seq``: all_gather then ``torch.mm`` (the unfused graph);
* ``peer``: the op on the copy-engine route (``transport="peer"``, the default on one host) with its GEMMs after
  the handshake (``gather_start="handshake"``); ``peer_eager``: the same with ``gather_start="eager"`` (the GEMMs
  at once, the protocol's step kernels waiting for a free SM); ``peer_push``: ``gather_start="push"`` (the GEMMs at
  once, every shard pushed by copy engine into the peers' receive buffers: the default on 2 ranks);
  ``peer_push_copy`` (3+ ranks): the same under the experiment ``gather_copy_notify`` (each peer told by copy engine
  right after its push); ``peer_torchmm``:
  ``peer`` with its GEMMs as one ``torch.mm`` per shard and weight from Python (the experiment
  ``gather_torch_gemms``; ``peer`` issues them in one library call, ``routes/gather_gemms.py``); ``nccl``: the op
  on the NCCL ring route (``transport="nccl"``);
* ``asynctp``: PyTorch's ``torch.ops.symm_mem.fused_all_gather_matmul`` (symmetric memory enabled for the group).

Correctness first: every fused variant's output against ``seq`` on fresh data (relative Frobenius error, worst
rank), and the route each one took (``route:<name>`` counted). Then the host time of one call of every fused variant
(``host_ms_<v>``, max over ranks; ``tune.measure.host_us``, the GPU kept busy): where it reaches 90% of the
variant's median the row is host-bound for it (``host_bound``: the GPU waits for the slowest rank's host, not for
the route; seen on some hosts at the small shapes). Prints a table (rank 0) and writes ``--json``.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc_per_node=W examples/bench_gather.py \\
        [--shapes 4096x4096x4096,8192x14336x4096,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.tune import measure as tm

# Llama-3-8B-like column-parallel GEMMs after a sequence-parallel gather: q/k/v fused width 6144 and gate/up 28672,
# split over W ranks by the bench itself (N / W per rank), at 4k-16k tokens.
SHAPES = [(m, n, 4096) for m in (4096, 8192, 16384) for n in (6144, 28672)]
FUSED = {"peer": {"transport": "peer", "gather_start": "handshake"},
         "peer_eager": {"transport": "peer", "gather_start": "eager"},
         # the push schedule (the default on 2 ranks): a short wait bound, so a fault costs seconds, not the group's
         "peer_push": {"transport": "peer", "gather_start": "push", "wait_timeout_ms": 5000.0},
         # push under the experiment gather_copy_notify (3+ ranks only: on 2 it is peer_push)
         "peer_push_copy": {"transport": "peer", "gather_start": "push", "wait_timeout_ms": 5000.0,
                            "experiments": config.current().experiments | {"gather_copy_notify"}},
         "peer_torchmm": {"transport": "peer", "gather_start": "handshake",
                          "experiments": config.current().experiments | {"gather_torch_gemms"}},
         "nccl": {"transport": "nccl"}}
MIN_WORLD = {"peer_push_copy": 3}  # fused variants that differ from another only from this many ranks on
COLUMNS = (*FUSED, "asynctp")
HOST_BOUND = 0.9  # a variant whose host time per call reaches this share of its median is host-bound there


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_gather", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="", help="MxNxK,... (M = gathered rows, N before the split over ranks)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=20.0)
    p.add_argument("--warmup-shapes", type=int, default=2,
                   help="the leading shapes run once, untimed, before the timed sweep (every variant's first calls, "
                        "buffers and peer mappings; on a fresh 4-H200 host the first shape ran slow for every fused "
                        "variant and the second for all but the peer route)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def shapes_of(text: str) -> list[tuple[int, int, int]]:
    if not text:
        return SHAPES
    out = []
    for item in text.split(","):
        m, n, k = (int(x) for x in item.lower().split("x"))
        out.append((m, n, k))
    return out


def asynctp(a: torch.Tensor, b: torch.Tensor, name: str):
    """async-TP's fused all_gather + matmul, or (None, why not)."""
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable_symm_mem_for_group(name)
        fn = torch.ops.symm_mem.fused_all_gather_matmul
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        return None, repr(exc)[:200]
    return (lambda: fn(a, [b], 0, name)[1][0]), ""


def bench_shape(m: int, n: int, k: int, world: int, timer: tm.Timer) -> dict:
    rank, name = dist.get_rank(), dist.group.WORLD.group_name
    n_rank = n // world
    torch.manual_seed(1000 + rank)
    a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(7)
    b = (torch.randn(n_rank, k, device="cuda") / math.sqrt(k)).bfloat16().t()  # a Linear weight, as TP has it
    gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.flashoverlap.all_gather_gemm

    def seq():
        dist.all_gather_into_tensor(gathered, a)
        return gathered @ b

    def fused(**changes):
        key = config.current().replace(**changes).key()
        return lambda: op(a, [b], [None], 0, world, name, "ring", False, key)[0]

    variants = {"gemm": lambda: gathered @ b, "comm": lambda: dist.all_gather_into_tensor(gathered, a),
                "seq": seq, **{v: fused(**changes) for v, changes in FUSED.items() if world >= MIN_WORLD.get(v, 2)}}
    tp_fn, tp_why = asynctp(a, b, name)
    if tp_fn is not None:
        variants["asynctp"] = tp_fn
    row = {"m": m, "n": n, "n_per_rank": n_rank, "k": k, "world": world, "errors": {}}
    if tp_why:
        row["errors"]["asynctp"] = tp_why
    want = seq().float()
    for v in COLUMNS:
        if v not in variants:
            continue
        before = dict(routes.stats)
        try:
            got = variants[v]().float()
            torch.cuda.synchronize()
            err = ((got - want).norm() / want.norm()).item()
        except Exception as exc:  # noqa: BLE001 - the variant is dropped from the timing and reported
            row["errors"][v] = repr(exc)[:200]
            del variants[v]
            continue
        row[f"relerr_{v}"] = tm.reduce_max([err])[0]
        ran = [key for key, c in routes.stats.items() if key.startswith("route:") and c > before.get(key, 0)]
        row[f"route_{v}"] = ",".join(sorted(ran)) or ("-" if v == "asynctp" else "unfused")
    times = timer.measure(variants)
    for v, t in times.items():
        row[f"{v}_ms"] = t.ms
    fused_names = [v for v in COLUMNS if v in variants]
    hosts = tm.reduce_max([tm.host_us(variants[v], 20, batch=10, sync=dist.barrier) / 1e3 for v in fused_names])
    row.update({f"host_ms_{v}": h for v, h in zip(fused_names, hosts, strict=True)})
    row["host_bound"] = [v for v, h in zip(fused_names, hosts, strict=True) if h >= HOST_BOUND * row[f"{v}_ms"]]
    row["ideal_ms"] = max(row["gemm_ms"], row["comm_ms"])
    for v in COLUMNS:
        if f"{v}_ms" in row:
            row[f"speedup_{v}"] = row["seq_ms"] / row[f"{v}_ms"]
    row["speedup_ideal"] = row["seq_ms"] / row["ideal_ms"]
    return row


def host_bound(row: dict) -> str:
    """The row's host-bound variants with their host ms per call, for the table."""
    return ", ".join(f"{v} (host {row['host_ms_' + v]:.3f} ms)" for v in row["host_bound"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.cuda.set_device(dist.get_node_local_rank(fallback_rank=0))  # before the NCCL communicator exists
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        print("bench_gather: run under torchrun with >= 2 ranks", file=sys.stderr)
        return 2
    timer = tm.Timer(rounds=args.rounds, target_ms=args.target_ms, min_iters=2, max_iters=40, spin_ms=0.3)
    shapes = shapes_of(args.shapes)
    for m, n, k in shapes[:max(args.warmup_shapes, 0)]:  # discarded: one short timing of every variant
        bench_shape(m, n, k, world, tm.Timer(rounds=1, target_ms=5.0, min_iters=2, max_iters=10, spin_ms=0.3))
    rows = [bench_shape(m, n, k, world, timer) for m, n, k in shapes]
    if rank == 0:
        cols = ("seq", *COLUMNS, "ideal")
        print(f"all_gather -> GEMM, {world} x {torch.cuda.get_device_name()}, bf16; ms (median, max over ranks); "
              "speedup = seq / variant")
        print("M_total x N x K | gemm | comm | " + " | ".join(cols) + " | " + " | ".join(f"x {c}" for c in cols[1:])
              + " | err peer | err push | err push_copy | err nccl")
        for r in rows:
            ms = " | ".join(f"{r.get(f'{c}_ms', math.nan):.3f}" for c in cols)
            sp = " | ".join(f"{r.get(f'speedup_{c}', math.nan):.3f}" for c in cols[1:])
            print(f"{r['m']}x{r['n']}x{r['k']} | {r['gemm_ms']:.3f} | {r['comm_ms']:.3f} | {ms} | {sp} | "
                  f"{r.get('relerr_peer', math.nan):.1e} | {r.get('relerr_peer_push', math.nan):.1e} | "
                  f"{r.get('relerr_peer_push_copy', math.nan):.1e} | {r.get('relerr_nccl', math.nan):.1e}"
                  + (f"  errors: {r['errors']}" if r["errors"] else "")
                  + (f"  host-bound: {host_bound(r)}" if r["host_bound"] else ""))
        geo = {c: math.exp(sum(math.log(r[f"speedup_{c}"]) for r in rows) / len(rows))
               for c in cols[1:] if all(f"speedup_{c}" in r for r in rows)}
        print("geomean speedup over seq: " + ", ".join(f"{c} {v:.3f}" for c, v in geo.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": rows, "geomean": geo}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
