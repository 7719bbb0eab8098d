"""The failure contract of the NCCL routes on 2 GPUs: 2 processes, one GPU each (``cuda:<rank>``), faults injected
into one rank (``flashoverlap_inductor/runtime/fault_inject.py`` for the GEMM -> collective NCCL route; a GEMM that
raises for the NCCL gather route). Run through ``fault_probe.py --nccl-world 2`` (or this file directly).

Groups: a gloo WORLD (coordination: barriers, which an NCCL abort cannot break) and an NCCL subgroup of both ranks
(``transport="nccl"``, ``fuse="always"``, an explicit 4-group plan, bf16) that every fused call uses. Cases, in
this order (each prints one JSON line per rank; ``clear`` is the case's verdict):

- ``inprogress/<op>`` (all_reduce, reduce_scatter): rank 0's 2nd NCCL call of a fused call returns
  ``ncclInProgress`` then ``POLLS`` in-progress polls. Clear: the call is correct on every rank, no error, the
  injection fired and was polled.
- ``stall/<op>``: rank 1's GEMM starts ``--stall-ms`` late (past ``--timeout-ms``, the same bound on both ranks).
  Clear: the call's output is NaN or correct on every rank, ``routes.check()`` raises ``FlashOverlapTimeout`` on
  every rank, the next call is correct.
- ``gather/gemm_raises``: rank 1's first shard GEMM raises in an ``all_gather_gemm`` on the NCCL gather route. Clear:
  rank 1 raises its error and rank 0 ``PeerFailure`` in that call or the next, no wrong output, a later call exact.
- ``refused/all_reduce`` (last: it aborts a group): rank 0's first NCCL call is refused with ``ncclInternalError``.
  Rank 0 must raise (the route aborts its group); rank 1 must raise or its output of the call must be NaN, within
  ``--case-s``; never a finite wrong result. Then both ranks make a new NCCL group and a call on it must be correct
  (an aborted group is not reused). A rank still waiting on the device after ``--case-s`` counts as a hang
  (``hang``: the probe then aborts that rank's group itself, to go on).

Timeouts: the NCCL group's 60 s, each case's ``--case-s`` bounded polls of a CUDA event (no unbounded sync on a
case's outputs), and the parent's per-process deadline ``--limit-s`` (fault_probe.py). Env per rank, unless set:
``NCCL_NVLS_ENABLE=0``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (a watchdog error aborts, never kills the rank).

    python examples/device/fault_probe.py --nccl-world 2
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import traceback
from unittest import mock

import fault_probe
import torch

WORLD = 2
ROWS, N, K = 2048, 1024, 1024  # rows: whole 128-row tile-rows for both ranks' reduce_scatter chunks
POLLS = 200


def _plan(op: str) -> str:
    from flashoverlap_inductor.schedule import plan as planlib

    return planlib.uniform_plan(ROWS, N, 128, 256, 4, align=1 if op == "all_reduce" else WORLD).to_str()


def _inputs(seed: int, rank: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    a = torch.randn(ROWS, K, generator=gen).bfloat16().to(device)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).bfloat16().to(device)
    return a, w.t()


def _reference(seed: int, rank: int, op: str, device: torch.device) -> torch.Tensor:
    total = sum(a.double() @ b.double() for a, b in (_inputs(seed, r, device) for r in range(WORLD)))
    return total if op == "all_reduce" else total.chunk(WORLD)[rank]


def _op(op: str, seed: int, rank: int, device: torch.device, name: str) -> torch.Tensor:
    import flashoverlap_inductor.ops  # noqa: F401

    a, b = _inputs(seed, rank, device)
    if op == "all_reduce":
        return torch.ops.flashoverlap.gemm_all_reduce(a, b, None, "sum", name, _plan(op))
    return torch.ops.flashoverlap.gemm_reduce_scatter(a, b, None, "sum", WORLD, name, _plan(op))


def _settle(seconds: float) -> bool:
    """Whether the current device finished its queued work within ``seconds`` (event polls: never an unbounded
    sync)."""
    ev = torch.cuda.Event()
    ev.record()
    end = time.monotonic() + seconds
    while not ev.query():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _errors(fn) -> str:
    """"none", or "raised <Type>: <message>" for what ``fn()`` raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported
        return f"raised {type(exc).__name__}: {str(exc)[:200]}"
    return "none"


def _new_nccl_group(device: torch.device):
    import torch.distributed as dist

    kw = {"backend": "nccl", "timeout": datetime.timedelta(seconds=60)}
    try:
        return dist.new_group(list(range(WORLD)), device_id=device, **kw)
    except TypeError:  # a torch without new_group(device_id=)
        return dist.new_group(list(range(WORLD)), **kw)


def worker(rank: int, port: int, out_dir: str, timeout_ms: float, stall_ms: float, case_s: float) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    import torch.distributed as dist

    from flashoverlap_inductor import config, errors, routes
    from flashoverlap_inductor.runtime import fault_inject
    from flashoverlap_inductor.schedule import gather as gather_schedule

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    pg = _new_nccl_group(device)
    lines: list[dict] = []
    path = os.path.join(out_dir, f"fault_probe_ncclw{WORLD}_rank{rank}.json")

    def record(case: str, **kw) -> None:
        line = {"case": case, "rank": rank, **kw}
        lines.append(line)
        print(json.dumps(line), flush=True)
        with open(path, "w") as f:  # after every case: a rank killed later keeps its earlier lines
            json.dump(lines, f)

    def settings(**kw):
        return config.patch(transport="nccl", fuse="always", **kw)

    def verdict(out: torch.Tensor, seed: int, op: str) -> str:
        return fault_probe._verdict(out, _reference(seed, rank, op, device))

    def on_route(before: int) -> bool:
        return routes.stats.get("route:nccl", 0) > before

    def run(case: str, body) -> None:
        try:
            record(case, **body())
        except Exception:  # noqa: BLE001 - reported as not clear
            record(case, clear=False, error="EXCEPTION " + traceback.format_exc()[-800:])
        with contextlib.suppress(Exception):
            dist.barrier()  # gloo: survives an aborted NCCL group

    def inprogress(op: str) -> dict:
        with settings(wait_timeout_ms=timeout_ms):
            name = pg.group_name
            warm = verdict(_op(op, 1, rank, device, name), 1, op)  # the launch and the ranks' agreement
            dist.barrier()
            before = routes.stats.get("route:nccl", 0)
            inj = fault_inject.NcclInjection(nth=2, code=fault_inject.NCCL_IN_PROGRESS, polls=POLLS)
            with fault_inject.nccl(inj) if rank == 0 else contextlib.nullcontext() as stats:
                out = _op(op, 2, rank, device, name)
            done = _settle(case_s)
            got = verdict(out, 2, op) if done else "HANG"
            err = _errors(routes.check) if done else "not settled"
            st = stats.read() if stats is not None else {}
        fired = rank != 0 or (st.get("fired") == 1 and st.get("polled") == POLLS)
        return {"injected": inj.describe() if rank == 0 else "-", "warm": warm, "call": got, "error": err,
                "stats": st, "route_nccl": on_route(before), "hang": not done,
                "clear": got == "correct" and err == "none" and fired and on_route(before)}

    def stall(op: str) -> dict:
        with settings(wait_timeout_ms=timeout_ms):
            name = pg.group_name
            warm = verdict(_op(op, 3, rank, device, name), 3, op)
            dist.barrier()
            before = routes.stats.get("route:nccl", 0)
            inj = fault_inject.NcclInjection(stall_ms=stall_ms)
            with fault_inject.nccl(inj) if rank == 1 else contextlib.nullcontext() as stats:
                out = _op(op, 4, rank, device, name)
            done = _settle(case_s)
            got = verdict(out, 4, op) if done else "HANG"
            err = "not settled"
            if done:
                try:
                    routes.check()
                    err = "NO ERROR"
                except errors.FlashOverlapTimeout as exc:
                    err = f"raised FlashOverlapTimeout: {str(exc)[:200]}"
            dist.barrier()
            nxt = verdict(_op(op, 5, rank, device, name), 5, op) if done else "skipped"
            nxt_err = _errors(routes.check) if done and _settle(case_s) else "not settled"
            st = stats.read() if stats is not None else {}
        return {"injected": inj.describe() if rank == 1 else "-", "warm": warm, "stalled_call": got, "error": err,
                "next_call": nxt, "next_error": nxt_err, "stats": st, "route_nccl": on_route(before),
                "hang": not done, "clear": got in ("poisoned", "correct") and err.startswith("raised")
                and nxt == "correct" and nxt_err == "none" and (rank != 1 or st.get("stalled") == 1)}

    def gather() -> dict:
        a = torch.randn(1024, 512, generator=torch.Generator().manual_seed(100 + rank)).bfloat16().to(device)
        b = [(torch.randn(512, 384, generator=torch.Generator().manual_seed(7)) / 512 ** 0.5).bfloat16().to(device)]
        want = torch.cat([torch.randn(1024, 512, generator=torch.Generator().manual_seed(100 + r)).bfloat16()
                          for r in range(WORLD)]).double() @ b[0].double().cpu()
        real, calls = gather_schedule.shard_gemm, [0]

        def failing_gemm(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("injected GEMM failure")
            return real(*args, **kwargs)

        seen, before = [], routes.stats.get("route:gather_nccl", 0)
        for i in range(3):
            patch = mock.patch.object(gather_schedule, "shard_gemm", failing_gemm) if i == 0 and rank == 1 \
                else contextlib.nullcontext()
            try:
                with patch, settings(wait_timeout_ms=timeout_ms):
                    got = torch.ops.flashoverlap.all_gather_gemm(a, b, [None], 0, WORLD, pg.group_name, "ring", False)
                seen.append("HANG" if not _settle(case_s) else fault_probe._verdict(got[0], want.to(device)))
            except errors.PeerFailure as exc:
                seen.append("peer" if "rank 1" in str(exc) else f"peer? {str(exc)[:120]}")
            except RuntimeError as exc:
                seen.append("own" if "injected" in str(exc) else f"other: {str(exc)[:160]}")
        routed = routes.stats.get("route:gather_nccl", 0) > before
        err = _errors(routes.check) if _settle(case_s) else "not settled"
        want_seen = [["own", "correct", "correct"]] if rank == 1 else [["peer", "correct", "correct"],
                                                                      ["correct", "peer", "correct"]]
        return {"injected": "shard GEMM 1 raises" if rank == 1 else "-", "calls": seen, "check": err,
                "route_gather_nccl": routed, "hang": "HANG" in seen, "wrong": "WRONG" in seen,
                "clear": seen in want_seen and err == "none" and routed}

    def refused() -> dict:
        nonlocal pg
        op, hang = "all_reduce", False
        with settings(wait_timeout_ms=timeout_ms):
            old = pg
            warm = verdict(_op(op, 6, rank, device, old.group_name), 6, op)
            dist.barrier()
            inj = fault_inject.NcclInjection(nth=1, code=3)  # ncclInternalError
            err, got = "none", "no output"
            try:
                with fault_inject.nccl(inj) if rank == 0 else contextlib.nullcontext():
                    out = _op(op, 7, rank, device, old.group_name)
                if _settle(case_s):
                    got = verdict(out, 7, op)
                    err = _errors(routes.check)
                else:
                    got, hang = "HANG", True
            except Exception as exc:  # noqa: BLE001 - the expected outcome on rank 0
                err = f"raised {type(exc).__name__}: {str(exc)[:240]}"
            aborted = "aborted" in err and "NOT aborted" not in err
            if hang or not aborted:  # the probe ends this rank's part of the old group itself, to go on
                from flashoverlap_inductor import _inductor_compat as compat

                compat.abort_group(old)
                _settle(case_s)
            dist.barrier()
            pg = _new_nccl_group(device)
            nxt = verdict(_op(op, 8, rank, device, pg.group_name), 8, op)
            nxt_err = _errors(routes.check) if _settle(case_s) else "not settled"
        ok = err.startswith("raised") or got == "poisoned"
        return {"injected": inj.describe() if rank == 0 else "-", "warm": warm, "call": got, "error": err,
                "group_aborted_by_route": aborted, "next_call_on_new_group": nxt, "next_error": nxt_err,
                "hang": hang, "wrong": got == "WRONG",
                "clear": ok and not hang and got != "WRONG" and nxt == "correct" and nxt_err == "none"}

    for op in ("all_reduce", "reduce_scatter"):
        run(f"inprogress/{op}", lambda op=op: inprogress(op))
    for op in ("all_reduce", "reduce_scatter"):
        run(f"stall/{op}", lambda op=op: stall(op))
    run("gather/gemm_raises", gather)
    run("refused/all_reduce", refused)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def main(out_dir: str, timeout_ms: float, stall_ms: float, case_s: float, limit_s: float) -> int:
    """Spawn the 2 ranks, wait at most ``limit_s`` (a rank past it is killed and counts as a hang), summarize.
    Fewer than 2 GPUs: a message and 0 (skipped)."""
    import socket

    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < WORLD:
        print(f"fault probe: skipped: --nccl-world {WORLD} needs {WORLD} GPUs, {gpus} visible")
        return 0
    from flashoverlap_inductor.native import kernels
    from flashoverlap_inductor.runtime import fault_inject

    if not kernels.available() or not fault_inject.available():
        print("fault probe: FAILED to start: the kernel library (with fo_nccl_inject) or an sm90 GPU is missing; "
              "build it: python -m flashoverlap_inductor.build")
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.spawn(worker, args=(port, out_dir, timeout_ms, stall_ms, case_s), nprocs=WORLD, join=False)
    end, hangs = time.monotonic() + limit_s, 0
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > end:
                hangs = 1
                print(f"fault probe: a rank was still running after {limit_s:g} s: killed (a hang)", flush=True)
                for proc in ctx.processes:
                    proc.kill()
                break
    except Exception:  # noqa: BLE001 - a rank died: its later cases are missing from the files
        traceback.print_exc()
    return fault_probe.summarize(out_dir, hangs)


if __name__ == "__main__":
    import sys

    sys.argv[1:1] = ["--nccl-world", str(WORLD)]
    fault_probe.main()
