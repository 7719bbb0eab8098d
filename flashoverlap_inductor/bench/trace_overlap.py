"""How much of a traced step's communication ran beside compute, from a Chrome trace's GPU events (``bench e2e
--trace DIR``; ``trace_summary`` prints this under its line per trace).

Each GPU event (kernel, copy, memset) falls in one class by its name (``classify``):

- ``gemm``: cuBLAS / cuBLASLt / CUTLASS kernels (``gemm``, ``nvjet``, ``xmma``, ``cutlass``, ``sm90_``), our fused
  GEMMs included (their epilogues also push data to peers: they count as compute);
- ``triton``: Inductor's generated kernels (``triton_``);
- ``nccl``: NCCL kernels (``nccl``);
- ``copy``: copy-engine transfers between device memories (``Memcpy PtoP`` / ``DtoD``: the gather route's pulls and
  shard copies, peer copies);
- ``sync``: our protocol kernels (signal waits, flags, the watchdog's marks, ``FO_KERNELS``): they spin while they
  wait for a peer, so their time is waiting, not work;
- ``other``: everything else (Inductor's extern kernels, ``Memset``, host copies ``HtoD`` / ``DtoH``, elementwise
  ATen kernels).

Communication is ``nccl`` + ``copy`` + ``sync``; compute is the rest. ``overlap`` gives, in ms over the whole trace
(all its steps), the union of each side's intervals over every stream, their intersection, and the communication
that ran with no compute beside it (``comm_exposed_ms``): the time a step pays for its communication, as far as
the GPU shows it (a spin-waiting ``sync`` kernel beside idle SMs counts as exposed; a GEMM slowed by a transfer
beside it shows only as a longer ``gemm`` total, which ``classes`` gives per class as summed kernel time and
count: compare it between backends of one case).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

GEMM_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas")
FO_KERNELS = ("wait_counter_kernel", "gather_step_kernel", "gather_finish_kernel", "notify_list_kernel",
              "stamp_kernel", "fault_clear_kernel", "fault_exchange_kernel", "fault_finish_kernel",
              "fault_local_kernel", "fault_mark_kernel", "inject_spin_kernel", "moe_poison")
COMM_CLASSES = ("nccl", "copy", "sync")
CLASSES = ("gemm", "triton", "other", "nccl", "copy", "sync")


def classify(name: str, cat: str) -> str:
    """The class (one of ``CLASSES``) of a GPU event named ``name`` in trace category ``cat``."""
    low = name.lower()
    if cat == "gpu_memcpy" or low.startswith("memcpy"):
        return "other" if "htod" in low or "dtoh" in low else "copy"  # host transfers are not communication
    if "nccl" in low:
        return "nccl"
    if any(k in name for k in FO_KERNELS):
        return "sync"
    if low.startswith("triton_") or low.startswith("triton"):
        return "triton"
    if any(m in low for m in GEMM_MARKS):
        return "gemm"
    return "other"


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The sorted, disjoint union of ``(start, end)`` intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    """The total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(gpu_events: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"compute_ms", "comm_ms", "both_ms", "comm_exposed_ms", "classes": {class: [count, summed ms]}}`` of a
    trace's GPU events (dicts with ``name``, ``cat``, ``ts`` and ``dur`` in us)."""
    sides: dict[str, list] = {"compute": [], "comm": []}
    classes: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in gpu_events:
        c = classify(e.get("name", ""), e.get("cat", ""))
        classes[c][0] += 1
        classes[c][1] += e["dur"] / 1e3
        sides["comm" if c in COMM_CLASSES else "compute"].append((e["ts"], e["ts"] + e["dur"]))
    compute, comm = union(sides["compute"]), union(sides["comm"])
    both = intersect(compute, comm)
    return {"compute_ms": round(length(compute) / 1e3, 4), "comm_ms": round(length(comm) / 1e3, 4),
            "both_ms": round(both / 1e3, 4), "comm_exposed_ms": round((length(comm) - both) / 1e3, 4),
            "classes": {c: [classes[c][0], round(classes[c][1], 4)] for c in CLASSES if c in classes}}


def describe(o: dict[str, Any]) -> str:
    """One line of ``overlap``'s result."""
    per = ", ".join(f"{c} {ms:.3f} ms/{n}" for c, (n, ms) in o["classes"].items())
    return (f"compute {o['compute_ms']:.3f} ms, communication {o['comm_ms']:.3f} ms of which beside compute "
            f"{o['both_ms']:.3f}, exposed {o['comm_exposed_ms']:.3f}; kernel time by class: {per}")
