"""Which collectives a gloo group runs on CUDA tensors, with 2 ranks sharing one GPU (each op in its own pair of
processes: an unsupported one may crash the process). Prints one line per op: ok / wrong / error / crash."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "send_recv", "all_to_all_single",
       "broadcast", "all_gather"]


def _worker(rank: int, world: int, port: int, op: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.full((8,), float(rank + 1), device="cuda")
    if op == "all_reduce":
        dist.all_reduce(x)
        ok = bool((x == 3).all())
    elif op == "all_gather_into_tensor":
        out = torch.empty(16, device="cuda")
        dist.all_gather_into_tensor(out, x)
        ok = bool((out[:8] == 1).all() and (out[8:] == 2).all())
    elif op == "reduce_scatter_tensor":
        out = torch.empty(4, device="cuda")
        dist.reduce_scatter_tensor(out, x)
        ok = bool((out == 3).all())
    elif op == "send_recv":
        y = torch.empty(8, device="cuda")
        ops = [dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, y, 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        ok = bool((y == 2 - rank).all())
    elif op == "all_to_all_single":
        out = torch.empty(8, device="cuda")
        dist.all_to_all_single(out, x)
        ok = bool((out[:4] == 1).all() and (out[4:] == 2).all())
    elif op == "broadcast":
        dist.broadcast(x, 0)
        ok = bool((x == 1).all())
    else:
        parts = [torch.empty(8, device="cuda") for _ in range(world)]
        dist.all_gather(parts, x)
        ok = bool((parts[0] == 1).all() and (parts[1] == 2).all())
    torch.cuda.synchronize()
    if rank == 0:
        print(f"{op}: {'ok' if ok else 'wrong'}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    for op in OPS:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        try:
            mp.start_processes(_worker, args=(2, port, op), nprocs=2, start_method="spawn")
        except Exception as exc:  # noqa: BLE001 - reported
            print(f"{op}: error/crash: {str(exc).splitlines()[-1][:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
