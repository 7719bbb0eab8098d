"""Settings are explicit per call and thread-safe: two threads making fused calls at the same time under different
settings each see only their own (``config.using`` is a ``ContextVar``, not a process-global stack). 2 gloo ranks;
each thread uses its own process group (collectives of one group must not interleave between threads), and the
ranks start their threads in opposite orders: a process-wide lock held across a collective deadlocks then."""

from __future__ import annotations

import pytest
from dist_utils import get_pool


def two_threads_worker(calls: int) -> list[str]:
    import threading
    import time

    import torch
    import torch.distributed as dist

    from flashoverlap_inductor import config
    from flashoverlap_inductor.routes import cpu

    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    keys = [config.current().replace(fuse="always", min_rows=100 + i).key() for i in range(2)]
    index = threading.local()
    bad: list[str] = []
    execute = cpu.CpuRoute.execute

    def spy(self, launch, ctx):
        before = config.current().key()
        time.sleep(0.002)  # let the other thread run inside its own call meanwhile
        out = execute(self, launch, ctx)
        for seen in (before, config.current().key()):
            if seen != keys[index.i]:
                bad.append(f"thread {index.i} saw the settings of another call")
        return out

    def work(i: int) -> None:
        index.i = i
        if i != dist.get_rank():  # rank r's thread r goes first: a process-wide lock held inside a collective of one
            time.sleep(0.3)       # group would then block the other group's thread, whose peers wait: a deadlock
        gen = torch.Generator().manual_seed(i)
        for _ in range(calls):
            a, b = torch.randn(64, 16, generator=gen), torch.randn(16, 8, generator=gen)
            y = torch.ops.flashoverlap.gemm_all_reduce(a, b, None, "sum", groups[i].group_name, "auto", keys[i])
            want = a @ b
            dist.all_reduce(want, group=groups[i])
            if not torch.allclose(y, want, rtol=1e-4, atol=1e-4):
                bad.append(f"thread {i}: wrong result")
        if config.current().key() == keys[i]:
            bad.append(f"thread {i}: the settings outlived the call")

    cpu.CpuRoute.execute = spy
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        cpu.CpuRoute.execute = execute
    return bad


@pytest.fixture(scope="module")
def pool():
    return get_pool(2)


def test_two_threads_fused_calls_under_different_settings(pool):
    assert pool.run(two_threads_worker, 20, timeout_s=120) == [[], []]
