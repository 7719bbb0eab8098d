"""Two GPUs, one process: would an all_gather -> GEMM schedule of copy-engine pushes and stream memory operations
(no SM spent on the protocol) let each GEMM start at once and still hide the transfer? The probe behind the next
gather protocol (docs/design.md, "Ops and routes", the gather peer route; issue 31 item 2: 1.30x over sequential).

Today's gather peer route starts its GEMMs after a handshake: the own shard's device-to-device copy into symmetric
memory and one-thread step kernels (which a persistent cuBLAS GEMM would starve of SMs) must finish first, 0.02-0.10
ms a call. The schedule probed here has neither. Per iteration ``it`` on each GPU ``d`` (peer ``p``), shard ``x_d``
``[m, K]``, weight ``w_d`` ``[K, N]``, output ``y_d`` ``[2m, N]``, receive buffer ``r_d`` ``[m, K]`` (written by ``p``):

    cur_d:  GEMM x_d @ w_d -> y_d[own rows]; wait(ready_d >= it); GEMM r_d @ w_d -> y_d[peer rows];
            write(done_p := it)                                    (``p`` may overwrite r_d again)
    copy_d: wait(done_d >= it - 1); copy x_d -> r_p (peer-to-peer, copy engine); write(ready_p := it)

where ``wait`` / ``write`` are ``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` (flags in device memory, the
peer's through peer access). Where the driver refuses a memory operation on the peer's flag, the signal is a 4-byte
peer-to-peer copy instead (printed). Measured per shape (CUDA events per device, medians over ``--iters``, max over
the 2 GPUs; ms):

* ``ideal``: one GEMM over the gathered ``[2m, K]``; ``own``: the own shard's GEMM alone; ``copy``: the push alone;
* ``seq``: the peer's shard pulled into a gathered buffer (copy engine), then one GEMM (an all_gather then the GEMM);
* ``push``: the schedule above; ``push_done``: when its copy ended, from the iteration's start (against ``own``: the
  copy ran beside the GEMM when it is smaller); results checked against the gathered GEMM (relative error).

Every stream waits at a start gate that opens once all iterations are queued (the host's queueing is not timed).
A wait that does not release within ``--deadline-s`` is released from the host (every flag set past every target),
reported as a hang, and the probe exits at once with status 1.
``python examples/device/push_probe.py [--shapes 4096x6144x4096,...]`` (M = gathered rows, both GPUs' shards; N; K).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

from flashoverlap_inductor.bench.timeline_peer import median_ms

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
SHAPES = "4096x6144x4096,8192x6144x4096,16384x6144x4096,4096x28672x4096,8192x28672x4096,16384x28672x4096"


class Driver:
    """The driver API entry points the probe uses (libcuda, through ctypes); each returns a CUresult (0: success)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        self.wait = self._fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32",
                             [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint])
        self.write = self._fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32",
                              [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint])
        self.memcpy = self._fn("cuMemcpyAsync", None,
                               [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p])
        self.memset = self._fn("cuMemsetD32Async", None,
                               [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p])

    def _fn(self, name: str, fallback: str | None, argtypes: list):
        fn = getattr(self.lib, name, None) or (getattr(self.lib, fallback) if fallback else None)
        if fn is None:
            raise RuntimeError(f"libcuda has no {name}")
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn


class Side:
    """One GPU's tensors, streams, flags (int32: ``ready`` at 0, ``done`` at 1, the start gate at 2) and signal
    sources."""

    def __init__(self, d: int, m: int, n: int, k: int, iters: int, gen: torch.Generator) -> None:
        self.d = d
        dev = torch.device("cuda", d)
        with torch.cuda.device(dev):
            self.x = torch.randn(m, k, generator=gen).bfloat16().to(dev)
            self.w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().to(dev).t()  # a Linear's W.t()
            self.y = torch.empty(2 * m, n, dtype=torch.bfloat16, device=dev)
            self.r = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
            self.g = torch.empty(2 * m, k, dtype=torch.bfloat16, device=dev)  # seq: the gathered rows
            self.flags = torch.zeros(64, dtype=torch.int32, device=dev)
            self.values = torch.arange(iters + 2, dtype=torch.int32, device=dev)  # the copy-signal's sources
            self.cur = torch.cuda.Stream(dev)
            self.copy = torch.cuda.Stream(dev)
            self.gate = torch.cuda.Stream(dev)  # opens the start gate once every iteration is queued

    def flag(self, i: int) -> int:
        return self.flags.data_ptr() + 4 * i


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def signal(drv: Driver, src: Side, stream: torch.cuda.Stream, addr: int, value: int, by_copy: bool) -> None:
    """``*addr = value`` in ``stream``'s order: a memory operation, or a 4-byte copy from ``src``'s value table."""
    if by_copy:
        check(drv.memcpy(addr, src.values.data_ptr() + 4 * value, 4, stream.cuda_stream), "signal copy")
    else:
        check(drv.write(stream.cuda_stream, addr, value, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")


def push_iteration(drv: Driver, sides: list[Side], it: int, m: int, by_copy: bool, marks: dict) -> None:
    """Enqueue iteration ``it`` of the push schedule on both GPUs (module docstring)."""
    for d, s in enumerate(sides):
        p = sides[1 - d]
        with torch.cuda.device(s.d):
            start, pushed, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record(s.cur)
            s.copy.wait_event(start)
            check(drv.wait(s.copy.cuda_stream, s.flag(1), it - 1, CU_STREAM_WAIT_VALUE_GEQ), "wait done")
            check(drv.memcpy(p.r.data_ptr(), s.x.data_ptr(), s.x.numel() * 2, s.copy.cuda_stream), "push")
            signal(drv, s, s.copy, p.flag(0), it, by_copy)
            pushed.record(s.copy)
            with torch.cuda.stream(s.cur):
                own = slice(d * m, (d + 1) * m)
                torch.mm(s.x, s.w, out=s.y[own])
                check(drv.wait(s.cur.cuda_stream, s.flag(0), it, CU_STREAM_WAIT_VALUE_GEQ), "wait ready")
                torch.mm(s.r, s.w, out=s.y[(1 - d) * m:(2 - d) * m])
            signal(drv, s, s.cur, p.flag(1), it, by_copy)
            s.cur.wait_stream(s.copy)  # the iteration ends with its push
            end.record(s.cur)
            marks.setdefault(d, []).append((start, pushed, end))


def settle(drv: Driver, sides: list[Side], deadline_s: float) -> bool:
    """Wait for every stream; past ``deadline_s`` set every flag past every target from fresh streams (the waits
    queued so far release) and return False: the caller then exits at once (later signals may lower a flag again, so
    nothing more is waited for)."""
    end = time.monotonic() + deadline_s
    events = []
    for s in sides:
        with torch.cuda.device(s.d):
            for st in (s.cur, s.copy):
                events.append(st.record_event())
    while not all(e.query() for e in events):
        if time.monotonic() > end:
            for s in sides:  # a fresh stream is not blocked behind the waits
                with torch.cuda.device(s.d):
                    rescue = torch.cuda.Stream(s.d)
                    check(drv.memset(s.flags.data_ptr(), 1 << 30, 3, rescue.cuda_stream), "rescue memset")
            return False
        time.sleep(0.001)
    return True


def timed(fn, device: int, iters: int) -> float:
    """Median ms of ``fn()`` on ``device``'s current stream (``timeline_peer.median_ms``: CUDA events), after 3
    warm-up calls."""
    with torch.cuda.device(device):
        for _ in range(3):
            fn()
        return median_ms(fn, iters)


def probe_shape(drv: Driver, mt: int, n: int, k: int, iters: int, deadline_s: float, by_copy: bool) -> dict:
    m = mt // 2
    gen = torch.Generator().manual_seed(mt + n + k)
    sides = [Side(d, m, n, k, 2 * iters + 8, gen) for d in (0, 1)]
    row: dict = {"shape": f"{mt}x{n}x{k}"}
    for key in ("ideal", "own", "copy", "seq"):
        row[key] = 0.0
    for d, s in enumerate(sides):
        p = sides[1 - d]
        full = torch.cat([s.x, s.x])  # the gathered rows' shape (the values do not matter for the time)
        row["ideal"] = max(row["ideal"], timed(lambda s=s, full=full: torch.mm(full, s.w), s.d, iters))
        row["own"] = max(row["own"], timed(lambda s=s: torch.mm(s.x, s.w), s.d, iters))

        def push(s=s, p=p) -> None:  # this GPU's shard into the peer's buffer, on this GPU's current stream
            check(drv.memcpy(p.r.data_ptr(), s.x.data_ptr(), s.x.numel() * 2,
                             torch.cuda.current_stream(s.d).cuda_stream), "push")
        row["copy"] = max(row["copy"], timed(push, s.d, iters))

        def seq(s=s, p=p, d=d) -> None:
            stream = torch.cuda.current_stream(s.d).cuda_stream
            s.g[d * m:(d + 1) * m].copy_(s.x)
            check(drv.memcpy(s.g[(1 - d) * m:].data_ptr(), p.x.data_ptr(), p.x.numel() * 2, stream), "seq pull")
            torch.mm(s.g, s.w)
        row["seq"] = max(row["seq"], timed(seq, s.d, iters))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for d, s in enumerate(sides):  # cuBLAS's workspace of each caller stream exists before the gate closes (no
        with torch.cuda.device(s.d), torch.cuda.stream(s.cur):  # allocation while the streams wait)
            torch.mm(s.x, s.w, out=s.y[d * m:(d + 1) * m])
        torch.cuda.synchronize(s.d)
    marks: dict = {}
    for s in sides:  # every stream waits at the gate, so the host's queueing is out of the timed iterations
        with torch.cuda.device(s.d):
            for st in (s.cur, s.copy):
                check(drv.wait(st.cuda_stream, s.flag(2), 1, CU_STREAM_WAIT_VALUE_GEQ), "gate wait")
    for it in range(1, 1 + iters + 3):  # 3 warm-up iterations, then the timed ones
        push_iteration(drv, sides, it, m, by_copy, marks)
    for s in sides:
        with torch.cuda.device(s.d):
            check(drv.memset(s.flag(2), 1, 1, s.gate.cuda_stream), "gate open")
    ok = settle(drv, sides, deadline_s)
    row["hang"] = not ok
    if ok:
        per = {d: [(a.elapsed_time(e), a.elapsed_time(pu)) for a, pu, e in ms[3:]] for d, ms in marks.items()}
        row["push"] = max(statistics.median(t for t, _ in v) for v in per.values())
        row["push_done"] = max(statistics.median(t for _, t in v) for v in per.values())
        err = 0.0
        for d, s in enumerate(sides):
            p = sides[1 - d]
            gathered = torch.cat([s.x, p.x.to(s.x.device)] if d == 0 else [p.x.to(s.x.device), s.x])
            ref = (gathered.float() @ s.w.float())
            err = max(err, float((s.y.float() - ref).norm() / ref.norm()))
        row["err"] = err
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--deadline-s", type=float, default=10.0)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("push_probe: needs 2 CUDA GPUs; skipped")
        return 0
    for a, b in ((0, 1), (1, 0)):  # torch enables peer access on its first copy between the two
        if not torch.cuda.can_device_access_peer(a, b):
            print(f"push_probe: GPU {a} cannot access GPU {b}; skipped")
            return 0
        torch.empty(1, device=f"cuda:{b}").copy_(torch.empty(1, device=f"cuda:{a}"))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    drv = Driver()
    # does the driver take a memory operation on the peer's memory? (an enqueue error here: signal by copy)
    probe_flags = torch.zeros(1, dtype=torch.int32, device="cuda:1")
    with torch.cuda.device(0):
        rc = drv.write(torch.cuda.current_stream(0).cuda_stream, probe_flags.data_ptr(), 7, 0)
        torch.cuda.synchronize(0)
    by_copy = rc != 0 or int(probe_flags.item()) != 7
    how = f"4-byte copy (cuStreamWriteValue32 on peer memory: CUresult {rc})" if by_copy else "cuStreamWriteValue32"
    print(f"push_probe: {torch.cuda.get_device_name(0)} x 2, torch {torch.__version__}; peer flag write by {how}")
    cols = ("ideal", "own", "copy", "seq", "push", "push_done")
    print("shape", *cols, "x push", "x ideal", "err", sep=" | ")
    for text in args.shapes.split(","):
        mt, n, k = (int(v) for v in text.lower().split("x"))
        row = probe_shape(drv, mt, n, k, args.iters, args.deadline_s, by_copy)
        if row["hang"]:  # the flags were set from the host; queued work may still be in flight: stop here
            print(row["shape"], *(f"{row[c]:.3f}" for c in cols[:4]), "HANG (released from the host; stopping)",
                  sep=" | ", flush=True)
            os._exit(1)
        print(row["shape"], *(f"{row[c]:.3f}" for c in cols), f"{row['seq'] / row['push']:.3f}",
              f"{row['seq'] / row['ideal']:.3f}", f"{row['err']:.1e}", sep=" | ", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
