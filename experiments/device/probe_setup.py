"""Shared start and end of the communication probes of experiments/device (``window_probe.py``, ``ring_probe.py``,
``zero_cta_probe.py``), run with torchrun, one process per GPU."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from flashoverlap_inductor.native import nccl_direct


def start() -> tuple[int, torch.device, nccl_direct.Communicator]:
    """Refuse to run with NVLink multicast possible (NCCL_NVLS_ENABLE must be 0), set this rank's GPU, start the
    NCCL group and make its communicator (one all_reduce); return (rank, device, the group's communicator)."""
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        raise SystemExit("NCCL_NVLS_ENABLE must be 0 (no NVLink multicast)")
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    dist.all_reduce(torch.ones(1, device=device))
    comm = nccl_direct.communicator(dist.group.WORLD, device)
    if comm is None:
        raise SystemExit("no direct NCCL communicator for the group")
    return rank, device, comm


def emit(rank: int, rows: list[dict], row: dict) -> None:
    """Add one shape's ``row`` to ``rows``; rank 0 prints it as a JSON line."""
    rows.append(row)
    if rank == 0:
        print(json.dumps(row), flush=True)


def finish(rank: int, path: str, doc: dict) -> None:
    """Rank 0 writes ``doc`` as JSON to ``path``; every rank leaves the group."""
    if rank == 0:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    dist.destroy_process_group()
