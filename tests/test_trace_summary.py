"""``bench/trace_summary.py``: the GPU's busy time as the union of its intervals over streams (overlaps counted once,
gaps not at all), the host time per fused op, the one-line description; on a hand-made Chrome trace whose answer is
known."""

from __future__ import annotations

import json

from flashoverlap_inductor.bench import trace_summary


def _trace(tmp_path, events):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_busy_time_is_the_union_of_the_gpu_intervals(tmp_path):
    x = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        x("cpu_op", "flashoverlap::gemm_reduce_scatter", 0, 400),   # host: 0.4 ms
        x("cpu_op", "flashoverlap::gemm_reduce_scatter", 5000, 600),  # host: 0.6 ms
        x("cpu_op", "flashoverlap::all_gather_gemm", 2000, 1000),
        x("cpu_op", "aten::mm", 2100, 50),
        x("kernel", "gemm", 100, 1000),       # 0.1 - 1.1 ms
        x("kernel", "nccl", 600, 1000),       # 0.6 - 1.6 ms: overlaps the GEMM (union 0.1 - 1.6)
        x("gpu_memcpy", "copy", 1600, 400),   # 1.6 - 2.0 ms: touches it
        x("kernel", "tail", 9000, 1000),      # 9 - 10 ms; the span ends here
        {"ph": "i", "name": "marker", "ts": 20000},  # not a complete event: ignored
        x("Trace", "PyTorch Profiler (0)", -5000, 30000),  # the profiler's window: not part of the span
    ]
    s = trace_summary.summarize(_trace(tmp_path, events))
    assert s["span_ms"] == 10.0 and s["gpu_busy_ms"] == 2.9
    assert s["fused"] == {"gemm_reduce_scatter": [2, 1.0], "all_gather_gemm": [1, 1.0]}
    line = trace_summary.describe(s)
    assert line.startswith("span 10.000 ms, GPU busy 2.900 ms (29%), idle 7.100 ms; host thread in fused ops "
                           "(waits included): ")
    assert "gemm_reduce_scatter 2 x 0.500 ms" in line and "all_gather_gemm 1 x 1.000 ms" in line


def test_an_empty_trace(tmp_path):
    s = trace_summary.summarize(_trace(tmp_path, []))
    assert s == {"span_ms": 0.0, "gpu_busy_ms": 0.0, "fused": {}} and trace_summary.describe(s) == "no events"


def test_idle_gaps_are_charged_to_what_the_host_ran(tmp_path):
    x = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        x("kernel", "a", 0, 100),             # busy 0 - 100
        x("kernel", "b", 150, 50),            # gap 100 - 150 (50 us)
        x("kernel", "c", 210, 40),            # gap 200 - 210 (10 us: under the threshold)
        x("gpu_memcpy", "d", 1250, 50),       # gap 250 - 1250 (1000 us)
        x("kernel", "e", 1400, 10),           # gap 1300 - 1400 (100 us)
        x("cpu_op", "flashoverlap::all_to_all_permute_gemm", 80, 1500),
        x("cpu_op", "aten::index_select", 90, 30),  # innermost at t = 100
        x("cpu_op", "aten::mm", 1290, 200),         # innermost at t = 1300
        x("cuda_runtime", "cudaStreamSynchronize", 240, 1000),  # at t = 250
    ]
    gaps = trace_summary.idle_gaps(_trace(tmp_path, events))
    assert gaps == [("flashoverlap::all_to_all_permute_gemm | cudaStreamSynchronize", 1, 1.0),
                    ("aten::mm | -", 1, 0.1), ("aten::index_select | -", 1, 0.05)]


def test_overlap_splits_communication_beside_compute_from_exposed(tmp_path):
    x = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        x("kernel", "sm90_xmma_gemm_bf16bf16", 100, 1000),            # compute 0.1 - 1.1 ms
        x("kernel", "ncclDevKernel_ReduceScatter_Sum_bf16", 600, 1000),  # comm 0.6 - 1.6: 0.5 beside the GEMM
        x("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 1600, 400),   # comm 1.6 - 2.0, exposed
        x("kernel", "wait_counter_kernel", 1900, 300),                  # comm 1.9 - 2.2 (sync), exposed
        x("kernel", "triton_poi_fused_mul_0", 2100, 100),               # compute 2.1 - 2.2: beside the wait
        x("kernel", "void at::native::elementwise_kernel", 9000, 1000),  # compute ("other")
    ]
    o = trace_summary.summarize(_trace(tmp_path, events))["overlap"]
    assert o["compute_ms"] == 2.1 and o["comm_ms"] == 1.6
    assert o["both_ms"] == 0.6 and o["comm_exposed_ms"] == 1.0
    assert o["classes"] == {"gemm": [1, 1.0], "triton": [1, 0.1], "other": [1, 1.0], "nccl": [1, 1.0],
                            "copy": [1, 0.4], "sync": [1, 0.3]}
    assert "exposed 1.000" in trace_summary.describe(trace_summary.summarize(_trace(tmp_path, events)))


def test_exposed_communication_charged_to_its_kernels(tmp_path):
    """Each communication kernel's exposed time is its interval less the compute beside it (two such kernels at once
    both count); compute kernels are summed per full name, shown without templates, arguments and namespaces and
    numbered where two full names shorten alike."""
    from flashoverlap_inductor.bench import trace_overlap

    x = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    gemm_a, gemm_b = "void cutlass::device_kernel<Gemm<128>>(Params)", "void cutlass::device_kernel<Gemm<256>>(P)"
    events = [
        x("kernel", gemm_a, 0, 1000),                                                # compute 0 - 1.0 ms
        x("kernel", gemm_a, 3000, 500),                                              # compute 3.0 - 3.5
        x("kernel", gemm_b, 1200, 300),                                              # compute 1.2 - 1.5
        x("kernel", "void fo::(anonymous namespace)::gather_step_kernel(Step)", 800, 600),  # 0.8 - 1.4: 0.2 exposed
        x("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 1400, 800),                # 1.4 - 2.2: 0.1 under gemm_b
        x("kernel", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(Args)", 2000, 1200),  # 2.0 - 3.2: 1.0 exposed
    ]
    o = trace_overlap.overlap(events, top=2)
    exposed = {name: (c, n, ms) for name, c, n, ms, _ in o["by_kernel"]["exposed"]}
    assert list(exposed) == ["ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "Memcpy PtoP"]  # the top 2
    assert exposed["ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"] == ("nccl", 1, 1.0)
    assert exposed["Memcpy PtoP"] == ("copy", 1, 0.7)
    full = trace_overlap.overlap(events)
    assert ["gather_step_kernel", "sync", 1, 0.2] in [it[:4] for it in full["by_kernel"]["exposed"]]
    assert full["by_kernel"]["compute"] == [["device_kernel", "gemm", 2, 1.5, gemm_a],
                                            ["device_kernel#2", "gemm", 1, 0.3, gemm_b]]
    assert full["comm_exposed_ms"] == 1.7  # the union: 1.0-1.2, 1.5-3.0 (the charged items sum to 1.9)
    text = trace_overlap.describe(full)
    assert "exposed by kernel: ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL 1.000 ms/1" in text
    assert "compute by kernel: device_kernel 1.500 ms/2, device_kernel#2 0.300 ms/1" in text
    assert trace_overlap.short_name("void a::b<c::d<e>>::f(g)") == "f" and trace_overlap.short_name("k") == "k"
