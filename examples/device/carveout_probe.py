"""One GPU: does an SM carveout let a small kernel, or a copy-engine copy, on a high-priority stream run beside a
cuBLAS GEMM? (The probe behind the gather peer route's start, docs/results.md, twenty-seventh session.)

Per mode (no carveout; torch's ``_set_sm_carveout_experimental`` only; cuBLAS's handle target only; both; both with
cuBLASLt preferred), the GEMM's kernel name and grid (profiler trace) and, over 20 trials after a 1 ms spin, when a
one-element kernel on a high-priority stream (released by an event right after the GEMM's launch) ends, against the
GEMM's end (ms from the GEMM's start; medians). Run: ``python examples/device/carveout_probe.py [MxNxK ...]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import statistics
import sys
import tempfile

import torch


def cublas() -> ctypes.CDLL:
    """The cuBLAS library torch loaded (from ``/proc/self/maps``)."""
    torch.cuda.current_blas_handle()
    with open("/proc/self/maps") as maps:
        path = sorted({line.split()[-1] for line in maps if "/libcublas.so" in line})[0]
    lib = ctypes.CDLL(path)
    lib.cublasSetSmCountTarget.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


@contextlib.contextmanager
def torch_knob(sms: int):
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


@contextlib.contextmanager
def handle_target(sms: int):
    lib, handle = cublas(), torch.cuda.current_blas_handle()
    lib.cublasSetSmCountTarget(handle, torch.cuda.get_device_properties(0).multi_processor_count - sms)
    try:
        yield
    finally:
        lib.cublasSetSmCountTarget(handle, 0)


@contextlib.contextmanager
def both(sms: int):
    with torch_knob(sms), handle_target(sms):
        yield


def beside_gemm(a, b, hi, mode, side) -> list[float]:
    """After a 1 ms spin, the GEMM under ``mode`` on the current stream and ``side(start)`` on the high-priority
    stream ``hi`` (it enqueues its work after ``start`` and returns its timing events); ms from the GEMM's start to
    each of those events, then to the GEMM's end."""
    cur = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000)
    start, done_gemm = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record(cur)
    with mode():
        torch.mm(a, b)
    with torch.cuda.stream(hi):
        hi.wait_event(start)
        marks = side()
    done_gemm.record(cur)
    torch.cuda.synchronize()
    return [start.elapsed_time(e) for e in (*marks, done_gemm)]


def _recorded(stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def trial(a, b, small, hi, mode) -> list[float]:
    """When a one-element kernel on ``hi`` ends beside the GEMM, and when the GEMM ends."""
    def side():
        torch.cuda._sleep(1000)  # give the GEMM time to launch first
        small.add_(1)
        return [_recorded(hi)]
    return beside_gemm(a, b, hi, mode, side)


def copy_trial(a, b, src, dst, hi, mode) -> list[float]:
    """When a D2D copy of ``src`` (then a small kernel) on the high-priority stream ends beside the GEMM."""
    def side():
        dst.copy_(src)
        copied = _recorded(hi)
        dst[:1].add_(1)
        return [copied, _recorded(hi)]
    return beside_gemm(a, b, hi, mode, side)


def kernels_of(fn) -> list[tuple[str, list]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return [(e["name"][:90], e.get("args", {}).get("grid")) for e in trace["traceEvents"]
            if e.get("cat") == "kernel"]


def main(argv: list[str]) -> None:
    dev = torch.device("cuda", 0)
    shapes = [tuple(int(x) for x in s.split("x")) for s in (argv or ["8192x3072x4096", "8192x14336x4096"])]
    hi = torch.cuda.Stream(priority=-100)
    small = torch.zeros(1, device=dev)

    @contextlib.contextmanager
    def lt_both():
        prev = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            with both(2):
                yield
        finally:
            torch.backends.cuda.preferred_blas_library(prev)

    modes = {"none": contextlib.nullcontext, "torch": lambda: torch_knob(2), "cublas": lambda: handle_target(2),
             "both": lambda: both(2), "lt_both": lt_both}
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} "
          f"SMs {torch.cuda.get_device_properties(0).multi_processor_count} "
          f"blas {torch.backends.cuda.preferred_blas_library()}")
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16).t()
        for name, mode in modes.items():
            for _ in range(3):
                trial(a, b, small, hi, mode)
            rows = [trial(a, b, small, hi, mode) for _ in range(20)]
            def gemm(mode=mode, a=a, b=b):
                with mode():
                    torch.mm(a, b)

            ks = kernels_of(gemm)
            s, g = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
            print(f"{m}x{n}x{k} {name:8s} small ends {s:.3f} ms, gemm ends {g:.3f} ms; kernels {ks}")
            src = torch.randn(m // 2 * k // 2, device=dev)  # a bf16 shard of m/2 rows, as float32 words
            dst = torch.empty_like(src)
            rows = [copy_trial(a, b, src, dst, hi, mode) for _ in range(10)]
            c, s2, g = (statistics.median(r[i] for r in rows) for i in range(3))
            print(f"{m}x{n}x{k} {name:8s} copy of {src.numel() * 4 >> 20} MiB ends {c:.3f} ms, small after it "
                  f"{s2:.3f} ms, gemm ends {g:.3f} ms")
    src = torch.randn(1 << 24, device=dev)
    dst = torch.empty_like(src)
    print("a 64 MiB D2D copy_ as the profiler sees it:", kernels_of(lambda: dst.copy_(src)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dst.copy_(src)
        torch.cuda.synchronize()
    print(prof.key_averages().table(row_limit=5))


if __name__ == "__main__":
    main(sys.argv[1:])
