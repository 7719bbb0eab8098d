"""The NCCL route of all_gather -> GEMMs: the ring of ``gather_ring`` on CUDA streams, through the process group's
own point-to-point ops (so its watchdog bounds every transfer, as for any NCCL collective). Any world size >= 2.

Per call: a side stream issues every ring step at once; the caller's stream computes the local shard's GEMMs, then
each arrived shard's after an event of its step; cuBLAS does the GEMMs (one per shard and weight, into the shard's
rows of each result). Declines (the same on every rank): another collective, one rank (nothing to overlap), a group
whose backend is not NCCL, a plan it does not know.

Failure: the transfers are NCCL's (a timeout is the process group's, raised on every rank by its watchdog); a GEMM
that raises on one rank raises there only, after that rank issued all its ring steps: the peers' results are exact,
since they depend only on the shards.
"""

from __future__ import annotations

import torch

from .. import config
from .gather_ring import GatherCall, run_streams
from .nccl import is_nccl_group

PLANS = ("auto", "ring")


def unsupported_plan(plan: str) -> str | None:
    if plan not in PLANS:
        return f"plan: {plan!r} is not an all_gather plan ({', '.join(PLANS)})"
    return None


class GatherNcclRoute:
    name = "gather_nccl"
    devices = ("cuda",)
    collectives = ("all_gather",)
    last_resort = False

    def unsupported(self, call, settings: config.Settings) -> str | None:
        if call.collective != "all_gather":
            return f"{call.collective} is not an all_gather"
        if call.world < 2:
            return "one rank: nothing to gather"
        return unsupported_plan(call.plan)

    def make_launch(self, call, settings: config.Settings, ctx) -> tuple | str:
        if not is_nccl_group(ctx.group):
            return "backend: the group's backend is not NCCL"
        return (call,)

    def execute(self, launch: tuple, ctx) -> list[torch.Tensor]:
        call = GatherCall(ctx)
        run_streams(call)
        return call.result()

    def reset(self) -> None:
        pass


ROUTE = GatherNcclRoute()
