"""Benchmark the sm90 signal-GEMM against cuBLAS (torch.mm) on one GPU; writes JSON and prints a table.

    python examples/bench_gemm.py --swizzles 1,2,4,8 --json sweep.json          # sweep every compiled config
    python examples/bench_gemm.py --select selection.json --reps 12 --extras --json eval.json   # evaluate

Per shape (M x N x K, bf16, A [M,K], B a Linear weight [N,K]) it times cuBLAS in three forms (the best is the
baseline) and our configurations with signals off, on (deferred) and on (immediate), plus signals on with
8/16/24 SMs left free. Timing: ``--reps`` interleaved repetitions in a fresh random order, each the mean of
``--iters`` (more for small shapes) back-to-back launches between CUDA events, all enqueued before one
synchronization (no idle gaps: the H200 is power-capped, and idle gaps favour whatever runs next); medians.
A sweep tries every configuration x ``--swizzles``; ``--select`` evaluates the per-shape choices of an earlier run
(no winner's curse) with the on/off/immediate variants of the chosen configuration adjacent, for paired ratios.
Signals go to ``--groups`` wave groups of whole tile-rows (``plan.uniform_plan``), with no waiter.
``--extras`` adds: a cool-GPU burst measurement (0.2 s idle, 3 warm-ups, 10 timed), the wait kernel vs
``cuStreamWaitValue32`` (release latency, cost), and the A-row gather that reduce_scatter layouts need.
``--host-cost`` only times the host side of one GEMM call (the library's launch cache hit vs miss) and exits.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashoverlap_inductor import build  # noqa: E402
from flashoverlap_inductor.native import kernels  # noqa: E402
from flashoverlap_inductor.schedule import plan  # noqa: E402
from flashoverlap_inductor.tools import kernel_calls  # noqa: E402

GRID_MS = (2048, 4096, 8192, 16384)
GRID_NK = ((8192, 8192), (8192, 7168), (8192, 14336), (4096, 4096))


def _time_variants(variants: dict, reps: int, iters: int, seed: int = 0,
                   block: list[str] | None = None) -> dict[str, list[float]]:
    """Interleaved timing: every repetition runs each variant ``iters`` times between two events, in a fresh
    random order (so no variant sits at a favoured position of the power/clock cycle), with no idle gap: all
    repetitions are enqueued before one synchronization, the host far ahead of the GPU. The variants in
    ``block`` stay adjacent (in random order) so that their per-repetition ratios are paired comparisons."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up (module load, TMA descriptors, clocks)
        fn()
        fn()
    torch.cuda.synchronize()
    block = [b for b in block or [] if b in variants]
    units = [[name] for name in variants if name not in block] + ([block] if block else [])
    rng, events = random.Random(seed), []
    torch.cuda._sleep(2_000_000)  # let the host get ahead before the first event
    for _ in range(reps):
        rng.shuffle(units)
        for unit in units:
            rng.shuffle(unit)
        for name in (x for unit in units for x in unit):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                variants[name]()
            end.record()
            events.append((name, start, end))
    torch.cuda.synchronize()
    for name, start, end in events:
        times[name].append(start.elapsed_time(end) / iters)
    return times


def _variant_key(cfg: str, mode: str, free: int, swizzle: int) -> str:
    return f"{cfg}|{mode}|free{free}|swz{swizzle}"


def bench_shape(m: int, n: int, k: int, cfgs: list[kernels.KernelInfo], args) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = torch.randn(n, k, generator=gen, device="cuda").bfloat16()
    b = w.t()
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b_kn = b.contiguous()  # the same B stored [K,N]: cuBLAS's other layout, to take its best form
    variants = {"cublas": lambda: torch.mm(a, b, out=out), "cublas_alloc": lambda: torch.mm(a, b),
                "cublas_kn": lambda: torch.mm(a, b_kn, out=out)}
    sel = args.selection.get(f"{m}x{n}x{k}") if args.selection else None
    for info in cfgs:
        if sel is not None and info.name not in sel["per_config"]:
            continue
        p = plan.uniform_plan(m, n, info.tile_m, info.tile_n, args.groups)
        gmap = plan.group_of_tile_row(p.row_bounds, info.tile_m)
        counters = torch.zeros(p.num_groups, dtype=torch.int32, device="cuda")

        def run(cfg=info.name, mode="off", free=0, swz=1, gmap=gmap, counters=counters):
            kernel_calls.signal_gemm(a, b, out=out, config=cfg, counters=None if mode == "off" else counters,
                                group_of_tile_row=None if mode == "off" else gmap,
                                sm_count=sms - free if free else 0, swizzle=swz,
                                signal_mode="deferred" if mode == "off" else mode)

        if sel is None:  # tuning sweep: every swizzle and signal mode; free SMs at the first swizzle
            swizzles, modes, free_swz = args.swizzles, args.modes, args.swizzles[0]
        else:  # evaluation of a selection made by an earlier run (no winner's curse): its swizzle only, and
            # the signal-mode comparison for the shape's selected configuration only
            free_swz = sel["per_config"][info.name]
            swizzles = [free_swz]
            modes = args.modes if info.name == sel["best"][0] else ["deferred"]
        for swz in swizzles:
            for mode in modes:
                variants[_variant_key(info.name, mode, 0, swz)] = (
                    lambda cfg=info.name, mode=mode, swz=swz, run=run: run(cfg, mode, 0, swz))
        if sel is None or info.name == sel["best"][0]:
            # control: the signals-off variant twice, to read the noise floor between identical kernels
            variants[_variant_key(info.name, "off2", 0, free_swz)] = (
                lambda cfg=info.name, run=run, swz=free_swz: run(cfg, "off", 0, swz))
        for free in args.free:
            if free:
                variants[_variant_key(info.name, "deferred", free, free_swz)] = (
                    lambda cfg=info.name, free=free, run=run, swz=free_swz: run(cfg, "deferred", free, swz))
    # correctness of every variant's output once (fresh data, poisoned output) before timing
    ref = torch.mm(a, b)
    for name, fn in variants.items():
        out.fill_(float("nan"))
        res = fn()
        got = res if name == "cublas_alloc" else out
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        if not err < 1e-2:
            raise RuntimeError(f"{m}x{n}x{k} {name}: relative error {err}")
    flop = 2.0 * m * n * k
    block = None
    if sel is not None:
        cfg, swz = sel["best"]
        block = [_variant_key(cfg, mode, 0, swz) for mode in (*args.modes, "off2")]
    times = _time_variants(variants, args.reps, max(args.iters, math.ceil(1e12 / flop)), seed=m + n + k,
                           block=block)
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        row = {"m": m, "n": n, "k": k, "variant": name, "ms": med, "tflops": flop / med / 1e9,
               "ms_min": min(t), "ms_max": max(t), "ms_all": t}
        if not name.startswith("cublas"):
            cfg, mode, free, swz = name.split("|")
            row.update(config=cfg, mode=mode, free_sms=int(free[4:]), swizzle=int(swz[3:]))
        rows.append(row)
    return rows


def bench_burst(summary: list[dict], shapes: list[tuple[int, int, int]], groups: int, reps: int = 3) -> list[dict]:
    """A second harness, like a quick standalone check: after 0.2 s idle, 3 warm-ups and 10 back-to-back launches
    timed as one block (mean); cuBLAS forms and our best configuration (signals on) alternate; medians of
    ``reps``. Unlike the sustained round-robin run, the GPU starts cool here."""
    out_rows = []
    for m, n, k in shapes:
        best = next((s for s in summary if (s["m"], s["n"], s["k"]) == (m, n, k)), None)
        if best is not None:
            out_rows.append(_burst_one(m, n, k, best, groups, reps))
    return out_rows


def _burst_one(m: int, n: int, k: int, best: dict, groups: int, reps: int) -> dict:
    a = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    b, b_kn = w.t(), w.t().contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    info = kernels.config_info(best["best_config"])
    p = plan.uniform_plan(m, n, info.tile_m, info.tile_n, groups)
    gmap = plan.group_of_tile_row(p.row_bounds, info.tile_m)
    counters = torch.zeros(p.num_groups, dtype=torch.int32, device="cuda")
    fns = {"cublas": lambda: torch.mm(a, b, out=out), "cublas_kn": lambda: torch.mm(a, b_kn, out=out),
           "ours": lambda: kernel_calls.signal_gemm(a, b, out=out, config=info.name, counters=counters,
                                               group_of_tile_row=gmap, swizzle=best["best_swizzle"])}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            time.sleep(0.2)
            for _ in range(3):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / 10)
    flop = 2.0 * m * n * k
    row = {"m": m, "n": n, "k": k, "config": info.name, "swizzle": best["best_swizzle"]}
    row.update({f"{name}_tflops": flop / statistics.median(t) / 1e9 for name, t in times.items()})
    row["ratio"] = row["ours_tflops"] / max(row["cublas_tflops"], row["cublas_kn_tflops"])
    return row


def bench_host_cost(calls: int = 200, reps: int = 7) -> dict:
    """Host time of one ``fo_gemm`` call through ctypes (bf16, B [N,K], 256x1024x512, signals on): "hit" repeats one
    call of the default configuration (its kernel parameters come from the library's launch cache), "miss" gives
    every call another ``workspace_bytes`` (part of the cache key, unused by these kernels: a miss every time, the
    parameters built as before the cache), "hit_1x1" repeats one call of a configuration without clusters (a plain
    launch instead of cudaLaunchKernelEx), "reject" is a call the library refuses at once (no such configuration:
    the ctypes cost of 23 arguments), "notify" one ``fo_notify`` (a one-thread kernel: the cost of a bare launch
    plus 2 ctypes arguments). Medians over ``reps`` batches of ``calls``, in microseconds per call; the GPU sleeps
    meanwhile, so no launch waits for queue space."""
    lib = kernels.ready()
    stats_fn = lib.fo_gemm_cache_stats
    stats_fn.restype, stats_fn.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int64)] * 2

    def stats() -> tuple[int, int]:
        h, m = ctypes.c_int64(0), ctypes.c_int64(0)
        stats_fn(ctypes.byref(h), ctypes.byref(m))
        return h.value, m.value

    index: dict[str, int] = {}
    for i in range(lib.fo_num_configs()):
        name, ints = ctypes.create_string_buffer(128), (ctypes.c_int * 12)()
        kernels.check(lib.fo_config_info(i, name, 128, ints), "fo_config_info")
        if ints[9] == 0 and ints[10] == 0 and ints[11] == 0:  # bf16, B [N,K], no C
            index.setdefault(name.value.decode() if ints[3] * ints[4] > 1 else "1x1", i)
    if kernels.DEFAULT_CONFIG not in index:
        raise kernels.KernelLibraryError(f"{kernels.DEFAULT_CONFIG} is not compiled for bf16 with B as [N,K]")
    m, n, k = 256, 1024, 512
    a = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    serial = [0]

    def call(config: int, ws_bytes: int) -> int:
        return lib.fo_gemm(config, a.data_ptr(), k, w.data_ptr(), k, None, None, 0, d.data_ptr(), n, m, n, k,
                           counters.data_ptr(), None, None, 0, 0, 2, 4, None, ws_bytes, stream)

    def next_bytes() -> int:
        serial[0] += 1
        return serial[0]

    default = index[kernels.DEFAULT_CONFIG]
    variants = {"hit": lambda: call(default, 0), "miss": lambda: call(default, next_bytes())}
    if "1x1" in index:
        variants["hit_1x1"] = lambda: call(index["1x1"], 0)
    variants["reject"] = lambda: call(-1, 0)
    variants["notify"] = lambda: lib.fo_notify(counters.data_ptr() + 4 * 63, stream)
    for fn in variants.values():  # warm-up: loads, the hits' entries
        fn()
    torch.cuda.synchronize()
    out: dict = {"calls": calls}
    for name, fn in variants.items():
        per_call, before = [], stats()
        for _ in range(reps):
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time: the launches only queue
            t0 = time.perf_counter()
            for _ in range(calls):
                rc = fn()
            per_call.append((time.perf_counter() - t0) * 1e6 / calls)
            if name != "reject":
                kernels.check(rc, name)
            torch.cuda.synchronize()
        after = stats()
        out[name] = {"us_median": round(statistics.median(per_call), 2), "us_min": round(min(per_call), 2),
                     "cache_hits": after[0] - before[0], "cache_misses": after[1] - before[1]}
    return out


def bench_gather(m: int, k: int, world: int, groups: int) -> dict:
    """The reduce_scatter A-row gather (rows in buffer order, plan.BufferLayout.segments), two ways."""
    a = torch.randn(m, k, device="cuda").bfloat16()
    dst = torch.empty_like(a)
    p = plan.uniform_plan(m, 1, 128, 128, groups, align=8)
    lay = plan.buffer_layout(p, plan.chunks_for("reduce_scatter", m, world))
    idx = torch.cat([torch.arange(src, src + rows) for _, src, rows in lay.segments]).cuda()

    def by_index():
        torch.index_select(a, 0, idx, out=dst)

    def by_segments():
        for buf, src, rows in lay.segments:
            dst[buf:buf + rows].copy_(a[src:src + rows])

    t = _time_variants({"index_select": by_index, "segments": by_segments}, 10, 5)
    return {"m": m, "k": k, "world": world, "groups": groups, "segments": len(lay.segments),
            "index_select_ms": statistics.median(t["index_select"]), "segments_ms": statistics.median(t["segments"]),
            "bytes": 2 * a.numel() * a.element_size()}


def _test_lib() -> ctypes.CDLL | None:
    """The test helper library (``fo_test_*``, ``csrc/test_api.cu``; ``$FLASHOVERLAP_TEST_LIB``, else next to the
    kernel library) with its kernels loaded on the current device, or None when it is not built."""
    path = os.environ.get("FLASHOVERLAP_TEST_LIB") or str(kernels.library_path().with_name(build.TEST_LIB_NAME))
    if not os.path.isfile(path):
        return None
    lib = ctypes.CDLL(path)
    lib.fo_test_last_error.restype = ctypes.c_char_p
    lib.fo_test_stamp.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.fo_test_delayed_add.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_void_p]
    _test_check(lib, lib.fo_test_preload(), "fo_test_preload")  # before any wait can spin (lazy loading)
    return lib


def _test_check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise kernels.KernelLibraryError(f"{what} failed (code {rc}): {lib.fo_test_last_error().decode()}")


def bench_wait(reps: int = 20) -> dict:
    """Release latency: a kernel spins 100 us then release-adds; a side stream waits (wait kernel or
    cuStreamWaitValue32) and then stamps %globaltimer. Also the cost of 8 already-satisfied waits."""
    kernels.ready()
    lib = _test_lib()
    if lib is None:
        return {"skipped": f"no {build.TEST_LIB_NAME} next to the kernel library (python -m "
                           "flashoverlap_inductor.build builds both)"}
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    out = {}
    for how in ("kernel", "wait_value"):
        lat = []
        for _ in range(reps):
            counters = torch.zeros(1, dtype=torch.int32, device="cuda")
            stamps = torch.zeros(2, dtype=torch.int64, device="cuda")
            torch.cuda.synchronize()
            if how == "kernel":
                kernel_calls.wait_group(counters, 0, 1, stream=side, timeout_ms=1000)
            else:
                kernel_calls.stream_wait_value(counters, 0, 1, stream=side)
            _test_check(lib, lib.fo_test_stamp(stamps.data_ptr() + 8, side.cuda_stream), "stamp")
            _test_check(lib, lib.fo_test_delayed_add(counters.data_ptr(), 1, 100_000, stamps.data_ptr(),
                                                     main.cuda_stream), "delayed_add")
            torch.cuda.synchronize()
            s, r = stamps.tolist()
            lat.append((r - s) / 1e3)
        kernel_calls.raise_if_timed_out()
        counters = torch.ones(8, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            torch.cuda._sleep(4_000_000)  # keep the GPU busy while the host enqueues: time GPU cost, not Python
        start.record(side)
        for _ in range(10):
            for g in range(8):
                if how == "kernel":
                    kernel_calls.wait_group(counters, g, 1, stream=side)
                else:
                    kernel_calls.stream_wait_value(counters, g, 1, stream=side)
        end.record(side)
        torch.cuda.synchronize()
        out[how] = {"release_latency_us_median": statistics.median(lat), "release_latency_us_max": max(lat),
                    "satisfied_wait_us": start.elapsed_time(end) * 1e3 / 80}
    return out


def summarize(rows: list[dict], free: list[int], selection: dict | None = None) -> list[dict]:
    """Per shape: cuBLAS (the best of its forms), the best signals-on configuration on all SMs -- the one an
    earlier run selected when ``selection`` is given, else the fastest here --, its on/off ratio, free-SM
    scaling, and every configuration's ratio."""
    shapes = sorted({(r["m"], r["n"], r["k"]) for r in rows})
    out = []
    for m, n, k in shapes:
        rs = [r for r in rows if (r["m"], r["n"], r["k"]) == (m, n, k)]
        cub = max((r for r in rs if r["variant"].startswith("cublas")), key=lambda r: r["tflops"])
        cub_forms = {r["variant"]: r["tflops"] for r in rs if r["variant"].startswith("cublas")}
        on = [r for r in rs if r.get("mode") == "deferred" and r["free_sms"] == 0]
        best = max(on, key=lambda r: r["tflops"])
        chosen = (selection or {}).get(f"{m}x{n}x{k}")
        if chosen is not None:
            best = next(r for r in on if [r["config"], r["swizzle"]] == chosen["best"])

        def find(mode, fr=0, swz=best["swizzle"], cfg=best["config"], rs=rs):
            return next((r for r in rs if r.get("config") == cfg and r.get("mode") == mode
                         and r["free_sms"] == fr and r["swizzle"] == swz), None)

        off, imm, off2 = find("off"), find("immediate"), find("off2")

        def paired(x, y):  # median over repetitions of y's time / x's time (x's throughput relative to y)
            if x is None or y is None or len(x["ms_all"]) != len(y["ms_all"]):
                return None
            return statistics.median([b / a for a, b in zip(x["ms_all"], y["ms_all"], strict=True)])
        ctl = [(find("off", swz=r["swizzle"], cfg=r["config"]), r) for r in rs if r.get("mode") == "off2"]
        noise = [abs(x["tflops"] / y["tflops"] - 1) for x, y in ctl if x]
        best_off = max((r for r in rs if r.get("mode") == "off"), key=lambda r: r["tflops"], default=None)
        per_config = {}
        for r in on:
            per_config[r["config"]] = max(per_config.get(r["config"], 0.0), r["tflops"] / cub["tflops"])
        s = {"m": m, "n": n, "k": k, "cublas_tflops": cub["tflops"], "cublas_form": cub["variant"],
             "per_config_ratio": per_config,
             "cublas_forms": cub_forms, "noise_off_vs_off_max": max(noise, default=None),
             "best_config": best["config"],
             "best_swizzle": best["swizzle"], "on_tflops": best["tflops"], "ratio_vs_cublas": best["tflops"] /
             cub["tflops"], "off_tflops": off["tflops"] if off else None,
             "on_off_ratio": best["tflops"] / off["tflops"] if off else None,
             "immediate_off_ratio": imm["tflops"] / off["tflops"] if imm and off else None,
             "best_off_config": best_off["variant"] if best_off else None,
             "best_off_ratio_vs_cublas": best_off["tflops"] / cub["tflops"] if best_off else None,
             "on_off_paired": paired(best, off), "immediate_off_paired": paired(imm, off),
             "off2_off_paired": paired(off2, off)}
        s["free_sms_tflops"] = {r["config"]: {str(x["free_sms"]): x["tflops"] for x in rs if x.get("config") ==
                                              r["config"] and x.get("mode") == "deferred"} for r in on}
        for fr in free:
            if fr:
                # free-SM runs use the first --swizzles value; prefer the best config's own
                r = find("deferred", fr) or next((x for x in rs if x.get("config") == best["config"]
                                                  and x["free_sms"] == fr), None)
                s[f"free{fr}_tflops"] = r["tflops"] if r else None
        out.append(s)
    return out


def print_table(summary: list[dict], free: list[int]) -> None:
    hdr = (f"{'M':>6} {'N':>5} {'K':>6} | {'cuBLAS':>6} | {'best config (signals on)':<30} {'on':>6} {'x cuB':>6} |"
           f" {'off':>6} {'on/off':>6} {'imm/off':>7} | " + " ".join(f"free{f:<2}" for f in free if f))
    print(hdr)
    print("-" * len(hdr))
    for s in summary:
        frees = " ".join(f"{s.get(f'free{f}_tflops') or float('nan'):6.0f}" for f in free if f)
        cfg = f"{s['best_config']} s{s['best_swizzle']}"
        print(f"{s['m']:>6} {s['n']:>5} {s['k']:>6} | {s['cublas_tflops']:6.0f} | {cfg:<30} {s['on_tflops']:6.0f} "
              f"{s['ratio_vs_cublas']:6.3f} | {s['off_tflops'] or 0:6.0f} {s['on_off_ratio'] or 0:6.3f} "
              f"{s['immediate_off_ratio'] or 0:7.3f} | {frees}")
    ratios = [s["ratio_vs_cublas"] for s in summary]
    per_cfg: dict[str, list[float]] = {}
    for s in summary:
        for cfg, r in s["per_config_ratio"].items():
            per_cfg.setdefault(cfg, []).append(r)
    print("per configuration (signals on, best swizzle per shape) vs cuBLAS: geomean / min")
    for cfg, rs in sorted(per_cfg.items(), key=lambda x: -sum(map(math.log, x[1]))):
        print(f"  {cfg:<32} {math.exp(sum(map(math.log, rs)) / len(rs)):.3f} / {min(rs):.3f}")
    onoff = [s["on_off_ratio"] for s in summary if s["on_off_ratio"]]
    paired = [(s["on_off_paired"], s["immediate_off_paired"], s["off2_off_paired"]) for s in summary
              if s.get("on_off_paired")]
    if paired:
        print("signals on/off, paired per repetition (median): deferred " + " ".join(f"{x[0]:.3f}" for x in paired))
        print("                                               immediate " + " ".join(f"{x[1]:.3f}" for x in paired
                                                                                      if x[1]))
        print("                                   off vs off (noise floor) " + " ".join(f"{x[2]:.3f}" for x in paired
                                                                                       if x[2]))
        print(f"paired deferred/off min {min(x[0] for x in paired):.3f} max {max(x[0] for x in paired):.3f}")
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    noise = [s["noise_off_vs_off_max"] for s in summary if s["noise_off_vs_off_max"] is not None]
    print(f"geomean best-on/cuBLAS {geo:.3f} (target >= 0.93), min {min(ratios):.3f} (target >= 0.88); "
          f"on/off min {min(onoff):.3f} max {max(onoff):.3f} (target within 2%); cuBLAS = best of its forms; "
          f"identical-kernel noise up to {max(noise, default=float('nan')):.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default=",".join(map(str, GRID_MS)))
    p.add_argument("--nk", default=",".join(f"{n}x{k}" for n, k in GRID_NK))
    p.add_argument("--configs", nargs="*", default=None, help="configuration names (default: all compiled)")
    p.add_argument("--modes", default="off,deferred,immediate")
    p.add_argument("--swizzles", default="1")
    p.add_argument("--free", default="0,8,16,24", help="SMs left free (signals on, deferred)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--extras", action="store_true", help="also time the A-row gather and the wait mechanisms")
    p.add_argument("--host-cost", action="store_true", help="only time the host side of one GEMM call, launch "
                   "cache hit vs miss (bench_host_cost), then exit")
    p.add_argument("--json", default=None)
    p.add_argument("--select", default=None, metavar="JSON",
                   help="evaluate the per-shape choices of an earlier run ({'shapes': {'MxNxK': {'best': [config, "
                        "swizzle], 'per_config': {config: swizzle}}}}) instead of sweeping")
    args = p.parse_args(argv)
    args.selection = json.loads(Path(args.select).read_text())["shapes"] if args.select else None
    args.modes = args.modes.split(",")
    args.swizzles = [int(x) for x in args.swizzles.split(",")]
    args.free = [int(x) for x in args.free.split(",")]
    if not kernels.available():
        print("needs an sm90 GPU and the built library (python -m flashoverlap_inductor.build)")
        return 1
    if args.host_cost:
        cost = bench_host_cost()
        print("host cost per fo_gemm call (us):", json.dumps(cost))
        if args.json:
            Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "host_cost": cost},
                                                  indent=1))
        return 0
    cfgs = [c for c in kernels.configs() if args.configs is None or c.name in args.configs]
    shapes = [(m, *map(int, nk.split("x"))) for m in map(int, args.ms.split(",")) for nk in args.nk.split(",")]
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "configs": [c.name for c in cfgs],
              "reps": args.reps, "iters": args.iters, "groups": args.groups, "selection": args.selection,
              "rows": []}

    def save() -> None:  # after every step: a later failure or timeout keeps what was measured
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    for m, n, k in shapes:
        result["rows"] += bench_shape(m, n, k, cfgs, args)
        save()
        print(f"# {m}x{n}x{k} done ({time.time() - t0:.0f} s)", flush=True)
    result["summary"] = summarize(result["rows"], args.free, args.selection)
    save()
    print_table(result["summary"], args.free)
    if args.extras:
        try:
            burst_shapes = shapes if args.selection else [
                x for x in ((8192, 8192, 8192), (4096, 8192, 8192), (2048, 4096, 4096), (16384, 8192, 14336))
                if x in shapes]
            result["burst"] = bench_burst(result["summary"], burst_shapes, args.groups)
            save()
            for r in result["burst"]:
                print(f"burst {r['m']}x{r['n']}x{r['k']}: cuBLAS {r['cublas_tflops']:.0f} / [K,N] "
                      f"{r['cublas_kn_tflops']:.0f}, ours {r['ours_tflops']:.0f} ({r['config']} s{r['swizzle']}) "
                      f"ratio {r['ratio']:.3f}")
            br = [r["ratio"] for r in result["burst"]]
            print(f"burst geomean {math.exp(sum(map(math.log, br)) / len(br)):.3f} min {min(br):.3f}")
            if (8192, 8192, 8192) in shapes:  # every configuration in the cool regime, on one shape
                one = next(x for x in result["summary"] if (x["m"], x["n"], x["k"]) == (8192, 8192, 8192))
                result["burst_configs"] = [
                    _burst_one(8192, 8192, 8192, dict(one, best_config=c.name, best_swizzle=swz), args.groups, 3)
                    for c in cfgs for swz in ((4, 8) if args.selection else (1,))]
                save()
                for r in result["burst_configs"]:
                    print(f"burst 8192^3 {r['config']:<30} s{r['swizzle']}: {r['ours_tflops']:.0f} vs cuBLAS "
                          f"{max(r['cublas_tflops'], r['cublas_kn_tflops']):.0f} ({r['ratio']:.3f})")
            result["wait"] = bench_wait()
            save()
            print("wait:", json.dumps(result["wait"]))
            result["gather"] = [bench_gather(m, k, 8, args.groups) for m in sorted({s[0] for s in shapes})
                                for k in sorted({s[2] for s in shapes})]
            save()
        except Exception as e:  # report, keep the GEMM numbers
            result["extras_error"] = repr(e)
            save()
            print("extras failed:", repr(e))
        gemm_ms = {(s["m"], s["k"]): 2e-9 * s["m"] * s["n"] * s["k"] / s["on_tflops"]
                   for s in result["summary"]}
        for g in result.get("gather", []):
            ref = max((v for (m, k), v in gemm_ms.items() if m == g["m"] and k == g["k"]), default=None)
            print(f"gather M={g['m']} K={g['k']}: index_select {g['index_select_ms']:.3f} ms, {g['segments']} "
                  f"segment copies {g['segments_ms']:.3f} ms" + (f" ({g['index_select_ms'] / ref:.1%} of the GEMM)"
                                                                 if ref else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
