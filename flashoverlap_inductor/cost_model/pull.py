"""Time model of the reduce_scatter pull route (``routes/scatter_pull.py``, 2 ranks) and the verdict for a sum of GEMMs
staged for it (``passes/sum_of_gemms.stage_pull``); ms throughout.

The route runs the protocol of the all_gather peer route, so it takes that route's fitted terms (the GEMM data's
``gather_peer`` section: ``fixed_ms`` the handshake, ``gemm_factor`` the split GEMMs and the pulls' share of HBM,
``link_efficiency`` the copy engine's share of the NVLink rate)::

    T_pull = max(host_floor, fixed_ms + gemm_factor * (T_half + max(T_half, B / (link_efficiency * link)))
                             + copy(2 B) + copy(3 B))
    T_half = T_ref(rows, n, k) / 2        B = rows / 2 * n * itemsize

``copy(2 B)``: the peer's half into the symmetric buffer, read and written (``cost_model.copy_ms`` counts traffic);
``copy(3 B)``: the add of the pulled half (two reads, one write). Not counted: the reorder of a scatter over dim > 0
with more than one leading row (copies of ``a`` and the partial sum), and the decision's error allowance (the
concatenated form's verdict adds it). ``host_floor`` (``HOST_FLOOR_MS``; none when the call is replayed from a CUDA
graph): measured on 2 H200s (twenty-eighth session): back to back at 4096x4096x4096 (each rank K 2048) the route ran
0.41-0.44 ms per call, host-bound, where its GPU work is ~0.15 ms. Fitted to nothing else yet: the route's own rows of
that run (down_proj 4096x4096x14336: 0.371 ms; the summed gradients 4096x4096x2x7168: 0.397 ms with the first GEMM) are
what it should be checked against.

A staged sum ``x_1 @ w_1 + ... + x_t @ w_t`` runs its first ``t - 1`` GEMMs unfused (``mm``, then ``addmm`` onto the
partial sum) and the last as the fused op with the partial sum as its bias; sequentially the ``t`` GEMMs, the ``t - 1``
adds (3 ``M x N`` each, read + write) and the reduce_scatter on the bandwidth curve. The host floor bounds the fused
side as a whole (the unfused GEMMs' launches are cheap beside the fused call's).
"""

from __future__ import annotations

from collections.abc import Sequence

from . import gain, registry
from .decide import copy_ms
from .pipeline import DTYPE_BYTES

HOST_FLOOR_MS = 0.4


def pull_gpu_ms(model, rows: int, n: int, k: int, dtype: str, device_name: str | None) -> float | None:
    """``T_pull`` (module docstring) without the host floor, the GPU's time alone, of a GEMM ``[rows, k] @ [k, n]`` then
    reduce_scatter on 2 ranks; None when the data has no ``gather_peer`` terms."""
    terms = model.gemm.gather_peer
    if terms is None:
        return None
    half = model.gemm.reference_ms(rows, n, k, dtype) / 2
    shard = rows // 2 * n * DTYPE_BYTES[dtype]
    pull = shard / (terms.link_efficiency * model.link_bytes_per_ms(2))
    return terms.fixed_ms + terms.gemm_factor * (half + max(half, pull)) + copy_ms(5 * shard, device_name)


def sum_verdict(m: int, n: int, ks: Sequence[int], dtype: str, device_name: str | None, min_gain: float,
                cuda_graphs: bool = False, directory=None) -> tuple[bool, float, float, str]:
    """``(fuse, fused_ms, seq_ms, summary)`` for the sum of ``len(ks)`` GEMMs ``[m, k_i] @ [k_i, n]`` feeding a
    reduce_scatter over 2 ranks, staged for the pull route (module docstring). ``directory``: the data folder (None:
    the current settings')."""
    model, how = registry.model_for(device_name, directory)
    note = "" if how == "exact" else f" [{how} match: using data of {model.gemm.gpu}]"
    nan = float("nan")
    if dtype not in DTYPE_BYTES or not model.gemm.supports(dtype):
        return False, nan, nan, f"declined: no cost data for dtype {dtype!r}{note}"
    item = DTYPE_BYTES[dtype]
    gemms = [model.gemm.reference_ms(m, n, k, dtype) for k in ks]
    first = sum(gemms[:-1]) + copy_ms((len(ks) - 2) * m * n * item, device_name)  # each addmm also reads C
    fused_last = pull_gpu_ms(model, m, n, ks[-1], dtype, device_name)
    if fused_last is None:
        return False, nan, nan, f"declined: the data has no gather_peer terms for the pull route{note}"
    comm = model.curve.comm_ms("reduce_scatter", 2, m * n * item)
    seq = sum(gemms) + copy_ms(3 * (len(ks) - 1) * m * n * item, device_name) + comm
    fused = first + fused_last  # the unfused GEMMs' host time is small: the fused call's floor bounds the whole
    fused = fused if cuda_graphs else max(fused, HOST_FLOOR_MS)
    fuse = gain.pays(fused, seq, min_gain)
    return fuse, fused, seq, (f"pull route: predicted {fused:.3f} ms fused ({len(ks) - 1} GEMM(s) unfused, the last "
                              f"fused with their sum as its bias) vs {seq:.3f} ms sequential ({seq / fused:.3f}x; "
                              f"reduce_scatter {comm:.3f} ms){note}")
