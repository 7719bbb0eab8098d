"""Time model of the reduce_scatter pull route (``routes/scatter_pull.py``, 2 ranks), the route choice between it and
the peer route (``prefers_pull``), and the verdict for a sum of GEMMs staged for it
(``passes/sum_of_gemms.stage_pull``); ms throughout. The all_reduce pull route (``routes/reduce_pull.py``) has the
same form of terms (the data file's ``all_reduce_pull`` section: its GEMMs in pieces, each partial pushed, one add
per piece) and the same choice (``all_reduce_route="auto"``), and its pieces' rows come from ``piece_cuts``.

The route runs both halves' GEMMs by cuBLAS at full rate, the peer's half first, pulls the peer's partial of its own
rows by copy engine while its own half runs, then adds it. Its terms come from the GPU data file's ``scatter_pull``
section (``peer.PullTerms``)::

    T_pull = max(host_floor_ms, fixed_ms + gemm_factor * T_ref(rows, n, k) + add_factor * copy(rows * n * itemsize))

``T_ref`` is the whole GEMM's reference time (``GemmModel.reference_ms``), ``copy`` the time to move that many bytes
through device memory (``cost_model.copy_ms``): the add of the pulled half reads two halves and writes one (1.5x the
output's bytes), and the pull's own HBM traffic slows the GEMM beside it; ``add_factor`` holds both. On 2 H200s (the
fit's note) the terms predict 23 measured rows within 1.5% on average (7% at worst, 16384x8192x14336). Those rows
ran the handshake schedule; the same terms price the push schedule, the default since the 38th session (its grid
rows: median error 3.6%, 9.1% at worst, mostly predicting it slower than it ran: the choice errs towards the peer
route). ``host_floor`` does not apply when the call is replayed from a CUDA graph, nor where the settings leave it
out (``host_floors``).

``prefers_pull``: the route choice of ``scatter_route="auto"`` (``config.Tuning``). The pull route takes a call unless
its cost is predicted more than ``TOLERANCE`` above the peer route's. Where the host floors count (``host_floors``:
"on", or "auto" outside a training step's graphs, whose fused ops carry that setting) a route's cost is its GPU time
**plus** its host floor: in a step the host paces, each call's host time adds to the step; where the GPU paces it,
its GPU time does; the sum ranks the routes without knowing which, so the pull route must save more GPU time than the
host time it adds. It runs the gather route's protocol and three launches from Python: eagerly, back to back, it
measured 0.32 ms where the GPU needed 0.24 (4096 x 4096, K 4096 per rank, against the peer route's floor of 0.15 ms),
and its host time per call, 0.33 ms against the peer route's 0.11 (the stage timer of
``examples/device/gather_host_profile.py``, 4096 x 4096 at K 7168 per rank, 2 H200s, 40th session), made Llama-3-8B
TP prefill host-paced: 19.565 ms per step with the 8 down_proj reduce_scatters on it, 17.109 on the peer route, on
one host. Under the sum the pull route keeps the largest outputs (GPU times of ~2.8 ms and more at 16384 x 8192, where
its 2.5-5% GPU edge exceeds the floors' difference). The rule was ``max(GPU, floor)`` per route until then, which
counts a call's host time only where that call alone is host-bound and so put every down_proj on the pull route.
Without the floors (a CUDA graph's replay has none, but neither the run time nor every compile knows whether one
replays the call: the choice is the same eager and under CUDA graphs, at compile time and at run time) the GPU times
alone decide. The peer model errs by up to -10% at small K (4096 rows, K 2048 per rank: predicted 0.141 ms, measured
0.157), so a margin of that order keeps the choice from following its error; where the pull route measured slower
(16384 x 8192 rows at K 8192-14336 per rank: 1.8-2.5%, both models erring towards the pull route there by 3-7%) it
is within the margin, a known cost of the rule. Only H200 data has the terms; other GPUs take them through the
registry's family or default match (unmeasured there: on an H100's copy rate some small-K shapes go to the peer
route).
"""

from __future__ import annotations

from collections.abc import Sequence

from . import gain, registry
from .decide import copy_ms
from .pipeline import DTYPE_BYTES

TOLERANCE = 0.05  # the pull route's predicted cost may exceed the peer route's by this fraction (prefers_pull)
# bytes per ms one copy engine pushes to the peer over NVLink beside a GEMM (2 H200s, 43rd session: the all_reduce
# pull route in one piece at 16384 x 8192, K 14336 per rank, took 0.93 ms past its GEMM for 256 MiB pushed and an
# add of ~0.22 ms: ~0.36 GB per ms)
PUSH_BYTES_PER_MS = 3.6e8
CUT_ALIGN = 64  # rows: piece cuts on multiples of this (an even N keeps every piece's rows on 256 bytes)
CUT_MARGIN = 1.25  # a piece's push must end within this fraction of the next piece's GEMM


def piece_cuts(rows: int, n: int, gemm_ms: float, pieces: int, min_rows: int = 0, itemsize: int = 2) -> list[int]:
    """The all_reduce pull route's piece boundaries (``routes/reduce_pull.py``): ``pieces + 1`` rows from 0 to
    ``rows``, the pieces shrinking by a ratio ``q`` so the last push (the call's tail after its last GEMM) is short,
    while each piece's push still ends within the next piece's GEMM: ``q = push / GEMM`` time per row times
    ``CUT_MARGIN``, kept in [0.5, 1], and raised (by 0.05) until every piece has ``min_rows`` (a GEMM of fewer rows
    leaves SMs idle: one wave of tiles, ``GemmModel.wave_rows``). ``gemm_ms``: the whole GEMM's. Cuts on
    ``CUT_ALIGN`` rows; even pieces where that cannot hold. Pure: the same on every rank."""
    push_ms = rows * n * itemsize / PUSH_BYTES_PER_MS
    q = min(1.0, max(0.5, CUT_MARGIN * push_ms / gemm_ms)) if gemm_ms > 0 else 1.0
    while q < 1.0:
        weights = [q ** i for i in range(pieces)]
        total, acc, cuts = sum(weights), 0.0, [0]
        for w in weights[:-1]:
            acc += w
            cuts.append(round(rows * acc / total / CUT_ALIGN) * CUT_ALIGN)
        cuts.append(rows)
        if all(b - a >= max(min_rows, 1) for a, b in zip(cuts, cuts[1:], strict=False)):
            return cuts
        q = min(1.0, q + 0.05)
    return even_cuts(rows, pieces)


def even_cuts(rows: int, pieces: int) -> list[int]:
    """``pieces + 1`` rows from 0 to ``rows`` cutting them into pieces of equal rows (within one)."""
    return [rows * i // pieces for i in range(pieces + 1)]


def pull_ms(model, rows: int, n: int, k: int, dtype: str, device_name: str | None,
            host_bound: bool = True, collective: str = "reduce_scatter") -> float | None:
    """``T_pull`` (module docstring) of a GEMM ``[rows, k] @ [k, n]`` then ``collective`` on 2 ranks, with its host
    floor (``host_bound=False``: replayed from a CUDA graph, none); None when the data has no terms for it."""
    terms = model.gemm.pull_terms(collective)
    if terms is None:
        return None
    return terms.predict_ms(model.gemm, rows, n, k, dtype, copy_ms(rows * n * DTYPE_BYTES[dtype], device_name),
                            host_bound)


def pull_gpu_ms(model, rows: int, n: int, k: int, dtype: str, device_name: str | None,
                collective: str = "reduce_scatter") -> float | None:
    """``pull_ms`` without the host floor: the GPU's time alone."""
    return pull_ms(model, rows, n, k, dtype, device_name, host_bound=False, collective=collective)


def prefers_pull(rows: int, n: int, k: int, dtype: str, device_name: str | None, directory=None,
                 host_floors: bool = True, collective: str = "reduce_scatter") -> bool:
    """Whether ``scatter_route="auto"`` (``all_reduce_route="auto"`` for all_reduce) puts a GEMM ``[rows, k] @ [k,
    n]`` -> ``collective`` over 2 ranks on its pull route (module docstring): its GPU time, plus its host floor where
    the floors count (``host_floors``: the settings' ``counts_host()``), within ``TOLERANCE`` of the peer route's.
    False where the data lacks either model or the dtype. Pure: a function of its arguments and the data folder's
    files."""
    model, _ = registry.model_for(device_name, directory)
    if dtype not in DTYPE_BYTES or not model.gemm.supports(dtype):
        return False
    pull = pull_gpu_ms(model, rows, n, k, dtype, device_name, collective)
    peer = model.peer_ms(collective, rows, n, k, dtype, 2, host_bound=False)
    if pull is None or peer is None:
        return False
    if host_floors:  # ms of host per eager call, added: the module docstring
        pull += model.gemm.pull_terms(collective).host_floor_ms
        peer += model.gemm.peer.terms[collective].host_floor_ms
    return pull <= (1 + TOLERANCE) * peer


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
        return False, nan, nan, f"declined: the data has no scatter_pull terms for the pull route{note}"
    comm = model.curve.comm_ms("reduce_scatter", 2, m * n * item)
    seq = sum(gemms) + copy_ms(3 * (len(ks) - 1) * m * n * item, device_name) + comm
    fused = first + fused_last  # the unfused GEMMs' host time is small: the fused call's floor bounds the whole
    fused = fused if cuda_graphs else max(fused, model.gemm.scatter_pull.host_floor_ms)
    fuse = gain.pays(fused, seq, min_gain)
    return fuse, fused, seq, (f"pull route: predicted {fused:.3f} ms fused ({len(ks) - 1} GEMM(s) unfused, the last "
                              f"fused with their sum as its bias) vs {seq:.3f} ms sequential ({seq / fused:.3f}x; "
                              f"reduce_scatter {comm:.3f} ms){note}")
