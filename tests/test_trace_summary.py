"""``bench/trace_summary.py``: the GPU's busy time as the union of its intervals over streams (overlaps counted once,
gaps not at all), the host time per fused op, the one-line description; on a hand-made Chrome trace whose answer is
known."""

from __future__ import annotations

import json

import pytest

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


def _rank_trace(tmp_path, rank: int, base_ns: int, events: list[tuple[str, str, float, float]]) -> str:
    """A trace of rank ``rank``: ``(name, cat, ts_us, dur_us)`` events, ``ts`` relative to ``base_ns``."""
    path = tmp_path / f"case_train_rank{rank}.json"
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": [
        {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur} for name, cat, ts, dur in events]}))
    return str(path)


def test_skew_charges_a_collective_s_wait_to_the_rank_that_came_last(tmp_path):
    """On one clock (each trace's base + ts), the i-th kernel of a name is one step on every rank: rank 0's
    all_reduce started 100 us before rank 1's and waited for it; the gather step waited the other way (30 us);
    a peer copy is never waiting; a name whose counts differ between ranks is left out and named."""
    from flashoverlap_inductor.bench import trace_skew

    ar, step = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "gather_step_kernel"
    r0 = _rank_trace(tmp_path, 0, 1_000_000_000, [
        (ar, "kernel", 0.0, 150.0), (step, "kernel", 500.0, 20.0), ("Memcpy PtoP (Device -> Device)", "gpu_memcpy",
        600.0, 50.0), ("ncclDevKernel_AllGather_RING_LL", "kernel", 700.0, 10.0), ("sm90_gemm", "kernel", 0.0, 900.0)])
    r1 = _rank_trace(tmp_path, 1, 1_000_002_000, [  # its base 2 us later: its ts are 2 us smaller for one instant
        (ar, "kernel", 98.0, 50.0), (step, "kernel", 468.0, 60.0), ("Memcpy PtoP (Device -> Device)", "gpu_memcpy",
        580.0, 80.0)])
    assert trace_skew.rank_groups([r1, r0, str(tmp_path / "other_rank0.json")]) == {str(tmp_path / "case_train"):
                                                                                     [r0, r1]}
    s = trace_skew.skew([r0, r1])
    assert s["matched"] == 2 and s["unmatched"] == ["ncclDevKernel_AllGather_RING_LL"]  # the copy: no step
    assert s["waited_ms"] == [0.1, 0.03] and s["late_ms"] == [0.03, 0.1]
    assert s["by_kernel"][0] == ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", [0.1, 0.0])
    text = trace_skew.describe(s)
    assert "rank 0 waited 0.100 ms" in text and "others waited 0.100 ms for it" in text, text
    bare = tmp_path / "bare_rank0.json"
    bare.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="baseTimeNanoseconds"):  # no clock to set it beside another rank's
        trace_skew.skew([str(bare), r1])
