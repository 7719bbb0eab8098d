"""What the MoE P2P route's host sync costs (a diagnostic, not a mode): runs ``python -m flashoverlap_inductor.bench
e2e ...`` or ``examples/bench_moe.py ...`` with ``moe_p2p.settle`` replaced by a version that issues the same
all_gather of the routing facts but never reads it on the host (no sync; a failure or a premise violation would go
unnoticed, so the figures bound what a sync-free settle could give, nothing more; the e2e harness still compares
every row with its reference).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 examples/device/moe_settle_cost.py e2e --preset qwen3-moe ...
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 examples/device/moe_settle_cost.py bench_moe [--shapes ...]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flashoverlap_inductor.routes import moe_p2p  # noqa: E402


def settle_without_read(failure, facts, what, device, group):
    """``moe_p2p.settle``'s collective without its host read: raises this rank's own failure, returns False."""
    local = torch.zeros(moe_p2p.SETTLE_LEN, dtype=torch.int64, device=device) if facts is None else facts
    if group.size() > 1:
        dist.all_gather_into_tensor(local.new_empty(group.size() * moe_p2p.SETTLE_LEN), local, group=group)
    if failure is not None:
        raise failure
    return False


def main() -> int:
    moe_p2p.settle = settle_without_read
    if sys.argv[1] == "e2e":
        from flashoverlap_inductor.bench.e2e import run

        return run(sys.argv[2:])
    import bench_moe

    return bench_moe.main(sys.argv[2:]) or 0


if __name__ == "__main__":
    sys.exit(main())
