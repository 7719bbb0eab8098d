"""A small pool of spawned ranks with one process group (gloo on CPU, or NCCL with one GPU per rank), reused by
many tests.

Spawning a process and importing torch costs seconds; a pool per test module pays that once. ``pool.run(fn,
*args)`` runs ``fn(*args)`` on every rank (``fn`` must be a module-level function, pickled by reference) and
returns the per-rank results; a worker exception is re-raised in the test with the rank's traceback. Nothing can
hang: every wait is bounded, and a failed or timed-out pool is torn down (the next ``get_pool`` call starts a
fresh one).
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240.0


def _worker(rank: int, world_size: int, init_file: str, tasks, results, env: dict[str, str], backend: str,
            setup: Callable[[], None] | None) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":  # one GPU per rank, communicator created eagerly
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120), **kwargs)
    if backend == "nccl":
        dist.all_reduce(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
    if setup is not None:
        setup()
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args = task
            try:
                results.put((rank, True, fn(*args)))
            except BaseException:  # noqa: BLE001 - reported to the test process
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class WorkerError(AssertionError):
    """A rank raised; the message holds its traceback."""


class DistPool:
    """``world_size`` spawned ranks in one gloo (or NCCL) world (see the module docstring). ``setup``: a
    module-level function every rank runs once after joining the group."""

    def __init__(self, world_size: int = 2, env: dict[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 backend: str = "gloo", setup: Callable[[], None] | None = None):
        self.world_size, self.timeout_s = world_size, timeout_s
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="fo_gloo_")
        os.close(fd)
        os.unlink(self._init_file)  # the FileStore creates it
        env = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
               "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", **(env or {})}
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, self._init_file, self._tasks[r],
                                                         self._results, env, backend, setup), daemon=True)
                       for r in range(world_size)]
        # Spawned ranks import modules (the pickled ``setup`` and tasks) before ``_worker`` runs, and those imports may
        # read the environment (torch's and our settings are read once per process): start them inside ``env``.
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for p in self._procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; returns the results indexed by rank."""
        if not self.alive:
            raise RuntimeError("DistPool is closed")
        for q in self._tasks:
            q.put((fn, args))
        out: list[Any] = [None] * self.world_size
        errors: list[str] = []
        timeout = timeout_s or self.timeout_s
        for _ in range(self.world_size):
            try:
                # once one rank failed, the others may block in a collective: give them only a short grace
                rank, ok, value = self._results.get(timeout=10.0 if errors else timeout)
            except queue.Empty:
                self.close(force=True)
                raise WorkerError("\n".join(errors) or f"{fn.__name__}: timed out after {timeout} s") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            self.close(force=True)
            raise WorkerError("\n".join(errors))
        return out

    def close(self, force: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


_pools: dict[tuple[int, tuple[tuple[str, str], ...]], DistPool] = {}


def get_pool(world_size: int = 2, env: dict[str, str] | None = None) -> DistPool:
    """A live pool for (world_size, env), started on first use and restarted after a failure."""
    key = (world_size, tuple(sorted((env or {}).items())))
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        pool = _pools[key] = DistPool(world_size, env)
    return pool


def close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


atexit.register(close_pools)


def adamw_losses(model, vocab: int, gen, batch: int, steps: int = 3, lr: float = 1e-2) -> list[float]:
    """The losses of ``steps`` AdamW steps of a causal LM on random token ids and targets ``[batch, 16]`` drawn from
    ``gen``: the training run the multi-rank tests compare between plans and backends."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        ids, tgt = (torch.randint(0, vocab, (batch, 16), generator=gen) for _ in range(2))
        loss = F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def cuda_gpus() -> int:
    """CUDA GPUs visible to this process (0 when CUDA is missing or its probe fails): for the 2-GPU tests' skips."""
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - any failure to probe means: skip
        return 0


def gather_library_ready() -> bool:
    """CUDA, an sm90 GPU and a built library with the gather protocol (``fo_gather_call``): what the symmetric-memory
    pull routes' GPU tests need (any failure to probe counts as not ready)."""
    try:
        import torch

        from flashoverlap_inductor.native import kernels

        return torch.cuda.is_available() and kernels.available() and hasattr(kernels.library(), "fo_gather_call")
    except Exception:  # noqa: BLE001 - any failure to probe means: skip
        return False


def gpu0_setup() -> None:
    """A pool's per-rank setup for ranks sharing one GPU: GPU 0 current and ``torch.ops.flashoverlap.*``
    registered."""
    import torch

    torch.cuda.set_device(0)
    from flashoverlap_inductor import ops  # noqa: F401
