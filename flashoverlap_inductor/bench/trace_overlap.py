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

Per kernel (``by_kernel``; one item per full kernel name, shown by ``short_name``, with ``#2``, ``#3``... where
several full names shorten alike, e.g. the CUTLASS GEMMs of different tile shapes, all ``device_kernel``): each
communication kernel's exposed time (the part of its interval with no compute beside it; two communication kernels
exposed at once both count, so the items may sum to more than ``comm_exposed_ms``), and each compute kernel's summed
time, the largest first: what a fused step's exposed communication and its extra GEMM time are made of, row against
row (the same kernel may carry another ``#`` number in another trace: match on the time, or on ``full`` in the JSON).
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict
from typing import Any

GEMM_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas")
FO_KERNELS = ("wait_counter_kernel", "gather_step_kernel", "gather_finish_kernel", "notify_list_kernel",
              "stamp_kernel", "fault_clear_kernel", "fault_exchange_kernel", "fault_finish_kernel",
              "fault_local_kernel", "fault_mark_kernel", "inject_spin_kernel", "moe_poison")
COMM_CLASSES = ("nccl", "copy", "sync")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace categories of GPU events
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


def short_name(name: str, width: int = 48) -> str:
    """A kernel's name without ``void``, template and call arguments, namespaces, at most ``width`` characters
    (``void ns::(anonymous namespace)::gather_step_kernel(Args)`` -> ``gather_step_kernel``)."""
    head = re.sub(r"^void ", "", name.strip()).replace("(anonymous namespace)::", "")
    while True:  # template arguments, innermost first
        bare = re.sub(r"<[^<>]*>", "", head)
        if bare == head:
            break
        head = bare
    head = head.split("(", 1)[0].strip() or head
    return head.rsplit("::", 1)[-1][:width]


def covered(start: float, end: float, disjoint: list[tuple[float, float]], starts: list[float]) -> float:
    """How much of ``[start, end)`` the sorted, disjoint intervals cover (``starts``: their starts)."""
    i, total = max(bisect.bisect_right(starts, start) - 1, 0), 0.0
    while i < len(disjoint) and disjoint[i][0] < end:
        lo, hi = max(start, disjoint[i][0]), min(end, disjoint[i][1])
        total += max(hi - lo, 0.0)
        i += 1
    return total


def overlap(gpu_events: list[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """``{"compute_ms", "comm_ms", "both_ms", "comm_exposed_ms", "classes": {class: [count, summed ms]},
    "by_kernel": {"exposed": [[name, class, count, exposed ms, full]], "compute": [[name, class, count, ms, full]]}}``
    (``name``: the shown name, ``full``: the kernel's, cut at 300 characters) of a
    trace's GPU events (dicts with ``name``, ``cat``, ``ts`` and ``dur`` in us); ``by_kernel`` keeps the ``top``
    largest of each."""
    sides: dict[str, list] = {"compute": [], "comm": []}
    classes: dict[str, list] = defaultdict(lambda: [0, 0.0])
    tagged = []
    for e in gpu_events:
        c = classify(e.get("name", ""), e.get("cat", ""))
        classes[c][0] += 1
        classes[c][1] += e["dur"] / 1e3
        sides["comm" if c in COMM_CLASSES else "compute"].append((e["ts"], e["ts"] + e["dur"]))
        tagged.append((e, c))
    compute, comm = union(sides["compute"]), union(sides["comm"])
    both = intersect(compute, comm)
    starts = [s for s, _ in compute]
    exposed: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    work: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for e, c in tagged:
        key = (e.get("name", ""), c)
        if c in COMM_CLASSES:
            end = e["ts"] + e["dur"]
            exposed[key][0] += 1
            exposed[key][1] += (e["dur"] - covered(e["ts"], end, compute, starts)) / 1e3
        else:
            work[key][0] += 1
            work[key][1] += e["dur"] / 1e3

    shown: dict[str, str] = {}  # full name -> its short name, numbered where several full names share one
    seen: Counter = Counter()
    for full in sorted({name for name, _ in (*exposed, *work)}):
        short = short_name(full)
        seen[short] += 1
        shown[full] = short if seen[short] == 1 else f"{short}#{seen[short]}"

    def ranked(items: dict) -> list[list]:
        rows = sorted(items.items(), key=lambda kv: -kv[1][1])[:top]
        return [[shown[name], c, n, round(ms, 4), name[:300]] for (name, c), (n, ms) in rows]

    return {"compute_ms": round(length(compute) / 1e3, 4), "comm_ms": round(length(comm) / 1e3, 4),
            "both_ms": round(both / 1e3, 4), "comm_exposed_ms": round((length(comm) - both) / 1e3, 4),
            "classes": {c: [classes[c][0], round(classes[c][1], 4)] for c in CLASSES if c in classes},
            "by_kernel": {"exposed": ranked(exposed), "compute": ranked(work)}}


def describe(o: dict[str, Any]) -> str:
    """``overlap``'s result: one line, then (when ``by_kernel`` is there) one line each for the communication
    kernels' exposed time and the compute kernels' time."""
    per = ", ".join(f"{c} {ms:.3f} ms/{n}" for c, (n, ms) in o["classes"].items())
    text = (f"compute {o['compute_ms']:.3f} ms, communication {o['comm_ms']:.3f} ms of which beside compute "
            f"{o['both_ms']:.3f}, exposed {o['comm_exposed_ms']:.3f}; kernel time by class: {per}")
    by = o.get("by_kernel") or {}
    if by.get("exposed"):
        text += "\n    exposed by kernel: " + ", ".join(f"{it[0]} {it[3]:.3f} ms/{it[2]}" for it in by["exposed"])
    if by.get("compute"):
        text += "\n    compute by kernel: " + ", ".join(f"{it[0]} {it[3]:.3f} ms/{it[2]}" for it in by["compute"])
    return text
