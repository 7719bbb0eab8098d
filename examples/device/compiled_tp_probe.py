"""A tensor-parallel MLP compiled with ``backend="flashoverlap"`` on 2 ranks that share one GPU (gloo group, torch's
symmetric memory across processes with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``): the pass must fuse the
row-parallel GEMM with its all_reduce (and, sequence-parallel, with its reduce_scatter), the fused ops must run on
the peer route, and the outputs must match the fp64 reference on fresh random inputs, call after call. Correctness
only: ranks sharing a GPU time-slice it.

    python examples/device/compiled_tp_probe.py [--rows 2048] [--hidden 1024] [--ffn 4096] [--calls 3]

Prints one line per rank; exits 1 on a mismatch, a missing fusion or an error.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

WORLD = 2


def _mlp(x, w1, w2, collective: str, world: int, group_name: str):
    import torch.distributed._functional_collectives as funcol

    h = torch.relu(x @ w1)
    y = h @ w2
    if collective == "all_reduce":
        return funcol.wait_tensor(funcol.all_reduce(y, "sum", group_name))
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(y, "sum", 0, group_name))


def _worker(rank: int, args: argparse.Namespace, port: int, errors) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1",
                          TORCHINDUCTOR_FX_GRAPH_CACHE="0", FLASHOVERLAP_SCATTER_ROUTE="peer")  # the peer route
        import torch.distributed as dist

        from flashoverlap_inductor import passes, routes

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        name = dist.group.WORLD.group_name
        gen = torch.Generator().manual_seed(7)  # the same full weights on every rank
        w1_full = (torch.randn(args.hidden, args.ffn, generator=gen) / args.hidden ** 0.5).bfloat16()
        w2_full = (torch.randn(args.ffn, args.hidden, generator=gen) / args.ffn ** 0.5).bfloat16()
        cols = slice(rank * args.ffn // WORLD, (rank + 1) * args.ffn // WORLD)
        w1, w2 = w1_full[:, cols].to(device), w2_full[cols, :].to(device)
        worst = 0.0
        for collective in ("all_reduce", "reduce_scatter"):
            torch._dynamo.reset()
            passes.reset_counters()
            routes.reset()
            fn = torch.compile(lambda x, c=collective: _mlp(x, w1, w2, c, WORLD, name), backend="flashoverlap",
                               options={"flashoverlap.fuse": "always"})
            for call in range(args.calls):
                x = torch.randn(args.rows, args.hidden, generator=torch.Generator().manual_seed(100 + call)).bfloat16()
                out = fn(x.to(device))
                torch.cuda.synchronize()
                ref = torch.relu(x.double() @ w1_full.double()).bfloat16().double() @ w2_full.double()
                if collective == "reduce_scatter":
                    ref = ref.chunk(WORLD)[rank]
                err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
                worst = max(worst, err)
                if not err < 2e-2:
                    raise AssertionError(f"{collective} call {call}: relative error {err:.3g}")
            fused = passes.counters[f"fused:{collective}"]
            on_peer = routes.stats["route:peer"]
            if fused < 1 or on_peer < args.calls:
                raise AssertionError(f"{collective}: fused {fused} in the graph, {on_peer} calls on the peer route "
                                     f"(counters {dict(passes.counters)}, runtime {dict(routes.stats)})")
            print(f"rank {rank} {collective}: fused {fused}, {on_peer} peer calls, worst rel err {worst:.2e}",
                  flush=True)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048, help="tokens (GEMM rows) per call")
    p.add_argument("--hidden", type=int, default=1024, help="model width")
    p.add_argument("--ffn", type=int, default=4096, help="MLP width (split over the ranks)")
    p.add_argument("--calls", type=int, default=3, help="calls per collective, each on fresh inputs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("compiled_tp_probe: needs a CUDA GPU")
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, errors)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
    failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
    while not errors.empty():
        print(errors.get(), file=sys.stderr)
    print("compiled_tp_probe: " + ("FAIL" if failed else "PASS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
