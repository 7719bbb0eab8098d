"""One GPU: does cuBLAS run slower when its A operand lies in a symmetric-memory buffer than in the caching
allocator's memory? Under ``gather_start="push"`` the gather route's GEMMs read each peer's shard straight from the
receive buffer (symmetric memory); under ``"handshake"`` from ``staging`` (a fresh tensor). On 2 H200s (31st session,
docs/results.md) the push start ran 2-5% behind the handshake start back to back at N 28672 although its lone calls
were the faster ones; this probe times that one candidate apart.

Per shape ``MxNxK`` (M = gathered rows, N before the split over ``--world`` ranks, as ``examples/bench_gather.py``):
the shard GEMM ``[M / world, K] @ [K, N / world]`` (a Linear's ``W.t()``), A in (1) a regular tensor, (2) a slot of a
symmetric buffer laid out as the push schedule's (two sets of ``world`` slots; the slot of set 1, rank 1), timed
interleaved (``tune.measure.Timer``: CUDA events, warm-up, medians). Both results must be equal bit for bit.

    torchrun --nproc_per_node=1 examples/device/symm_operand_probe.py [--shapes 16384x28672x4096,...] [--world 2]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from flashoverlap_inductor.tune import measure as tm

SHAPES = "4096x6144x4096,8192x28672x4096,16384x6144x4096,16384x28672x4096"


def time_shape(spec: str, world: int, timer: tm.Timer, group_name: str) -> str:
    """One table row: the shard GEMM of ``spec`` with A regular and in a symmetric slot."""
    import torch.distributed._symmetric_memory as symm_mem

    m, n, k = (int(x) for x in spec.split("x"))
    rows, n_shard = m // world, n // world
    a = torch.randn(rows, k, device="cuda").bfloat16()
    w = (torch.randn(n_shard, k, device="cuda") / k ** 0.5).bfloat16().t()
    shard_bytes = a.numel() * a.element_size()
    buf = symm_mem.empty(2 * world * shard_bytes, dtype=torch.uint8, device="cuda")
    symm_mem.rendezvous(buf, group_name)
    slot = (world + 1) * shard_bytes  # set 1, slot 1
    a_symm = buf[slot:slot + shard_bytes].view(torch.bfloat16).view(rows, k)
    a_symm.copy_(a)
    out_r, out_s = (torch.empty(rows, n_shard, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = timer.measure({"regular": lambda: torch.mm(a, w, out=out_r),
                           "symmetric": lambda: torch.mm(a_symm, w, out=out_s)})
    torch.cuda.synchronize()
    r, s = times["regular"].ms, times["symmetric"].ms
    return f"{spec} | {rows}x{n_shard} | {r:.3f} | {s:.3f} | {s / r:.3f} | {torch.equal(out_r, out_s)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--world", type=int, default=2, help="ranks the bench's shapes are split over")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.cuda.set_device(0)
    timer = tm.Timer(rounds=7, target_ms=20.0, distributed=False)
    print(f"shard GEMM, A regular vs in symmetric memory ({torch.cuda.get_device_name()}); ms, medians")
    print("M x N x K | rows x N_shard | regular | symmetric | symmetric / regular | equal")
    for spec in args.shapes.split(","):
        print(time_shape(spec, args.world, timer, dist.group.WORLD.group_name), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
