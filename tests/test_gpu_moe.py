"""The MoE ops' P2P route on NCCL (``routes/combine.py``, ``routes/moe_dispatch.py``), 2 GPUs, one rank per GPU:
the combine (``flashoverlap::gemm_unpermute_all_to_all``) and the dispatch (``flashoverlap::all_to_all_permute_gemm``)
in bf16 on random uneven splits (some pairs empty), loop and grouped forms (one and two ``torch._grouped_mm`` terms),
the MoE permutation and a random one, plans ``blocks``, ``blocks:c=2``, ``experts`` and ``experts:c=3`` (the dispatch
cut by expert, ``routes/moe_expert_cut.py``): against an fp64 oracle (the same
semantics in float64, its all_to_all on NCCL too) with a bf16-fit tolerance, and against the unfused bf16 reference
(the grouped forms in fp16 and fp32 too, which run one mm per expert run and term instead of ``torch._grouped_mm``);
``p`` bit-exact (it is moved, not computed). Outputs pre-poisoned (the caching allocator hands out blocks of a freed
NaN tensor); the route counted (``combine:p2p``, ``route:moe_p2p``), so the test cannot pass on the reference. Also:
an fp64 call falls back to the reference (``fallback:dtype``); a GEMM raising on rank 1 in the middle of a call
reaches both ranks as an exception (its own on rank 1, ``PeerFailure`` on rank 0) and the next call is exact.

    NCCL_NVLS_ENABLE=0 python3 -m pytest -q tests/test_gpu_moe.py
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import DistPool, cuda_gpus

TIMEOUT_S = 150.0
K, N, E = 256, 384, 4  # bf16 rows of 512 / 768 bytes: _grouped_mm's 16-byte stride rule holds
SCALE = 37  # rows per unit of test_combine_op.split_counts (0 .. 222 rows per pair of ranks)
TOL = 4 * torch.finfo(torch.bfloat16).eps  # normwise relative error of a bf16 GEMM output against fp64
TOLS = {torch.bfloat16: TOL, torch.float16: 4 * torch.finfo(torch.float16).eps, torch.float32: 1e-5}


two_gpus = pytest.mark.skipif(cuda_gpus() < 2, reason="needs >= 2 CUDA GPUs")


@pytest.fixture(scope="module")
def _pools():
    held: list[DistPool] = []
    yield held
    for p in held:
        p.close()


@pytest.fixture
def pool(_pools):
    """The module's NCCL ranks, started again after a test whose worker raised or timed out (``DistPool`` closes
    itself then), so that one failure does not fail every test after it."""
    if not _pools or not _pools[-1].alive:
        _pools.append(DistPool(2, backend="nccl", timeout_s=TIMEOUT_S, env={"NCCL_NVLS_ENABLE": "0"}))
    return _pools[-1]


# ------------------------------------------------------------------------------------------ helpers (all ranks)


def routing(kind: str, seed: int, world: int, rank: int, blocked: str) -> dict:
    """Split sizes (``ins``, ``outs``; some pairs empty, shared by construction), the expert rows' sizes and the
    permutation between the expert rows and the ``blocked`` side (``"send"``: the combine's send buffer, ``"recv"``:
    the dispatch's receive buffer), on the host."""
    from test_combine_op import split_counts

    counts = split_counts(seed, world, True) * SCALE
    ins, outs = counts[rank].tolist(), counts[:, rank].tolist()
    sizes_by_block = ins if blocked == "send" else outs
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    rows = sum(sizes_by_block)
    if kind == "moe":  # block-major rows (block, then expert); expert-major after the permutation
        per = torch.stack([torch.multinomial(torch.ones(E), n, replacement=True, generator=gen).bincount(minlength=E)
                           if n else torch.zeros(E, dtype=torch.int64) for n in sizes_by_block])
        expert_of_row = torch.arange(E).repeat(world).repeat_interleave(per.flatten())
        index, sizes = expert_of_row.argsort(stable=True), per.sum(0).tolist()
    else:
        index = torch.randperm(rows, generator=gen)
        cuts = sorted(torch.randint(0, rows + 1, (E - 1,), generator=gen).tolist())
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
    return {"ins": ins, "outs": outs, "index": index, "sizes": sizes, "rows": rows}


def weights(form: str, dev: torch.device, seed: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """The experts' weights as the MoE graphs hold them (transposed Linear weights), in ``dtype``, the same on every
    rank."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    if form == "loop":
        return [(torch.randn(N, K, generator=gen, device=dev) / K ** 0.5).to(dtype).t() for _ in range(E)]
    terms = 2 if form == "grouped2" else 1
    return [(torch.randn(E, N, K, generator=gen, device=dev) / K ** 0.5).to(dtype).transpose(-2, -1)
            for _ in range(terms)]


def _poison_allocator(dev: torch.device) -> None:
    # freed: the next outputs' blocks hold NaN. Both pools of the caching allocator: blocks of at most 1 MiB (every
    # output of these cases) come from the small pool's 2 MiB segments, which the large tensor never touches.
    poison = [torch.full((64 << 20,), float("nan"), device=dev),
              *(torch.full((1 << 18,), float("nan"), device=dev) for _ in range(64))]
    del poison


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if bool(got.isnan().any()):
        return float("nan")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def combine_case(form: str, kind: str, seed: int, dev: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    import torch.distributed as dist

    r = routing(kind, seed, dist.get_world_size(), dist.get_rank(), "send")
    gen = torch.Generator(device=dev).manual_seed(seed * 10 + dist.get_rank())
    b = weights(form, dev, seed, dtype)
    if form == "loop":
        a, offs = [torch.randn(m, K, generator=gen, device=dev).to(dtype) for m in r["sizes"]], None
    else:
        a = [torch.randn(r["rows"], K, generator=gen, device=dev).to(dtype) for _ in b]
        offs = torch.tensor(r["sizes"], device=dev).cumsum(0).to(torch.int32)
    return dict(r, a=a, b=b, offs=offs, index=r["index"].to(dev))


def combine_fp64(c: dict, group) -> torch.Tensor:
    """The combine's semantics in float64 (its all_to_all on the group too)."""
    import torch.distributed as dist

    starts = [0, *torch.tensor(c["sizes"]).cumsum(0).tolist()]
    y = torch.zeros(c["rows"], N, dtype=torch.float64, device=c["index"].device)
    for e in range(E):
        lo, hi = starts[e], starts[e + 1]
        if c["offs"] is None:
            y[lo:hi] = c["a"][e].double() @ c["b"][e].double()
        else:
            for x, w in zip(c["a"], c["b"], strict=True):
                y[lo:hi] += x[lo:hi].double() @ w[e].double()
    send = torch.zeros(sum(c["ins"]), N, dtype=torch.float64, device=y.device).index_put_((c["index"],), y)
    out = torch.empty(sum(c["outs"]), N, dtype=torch.float64, device=y.device)
    dist.all_to_all_single(out, send, c["outs"], c["ins"], group=group)
    return out


def dispatch_case(form: str, kind: str, seed: int, dev: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    import torch.distributed as dist

    r = routing(kind, seed, dist.get_world_size(), dist.get_rank(), "recv")
    gen = torch.Generator(device=dev).manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(sum(r["ins"]), K, generator=gen, device=dev).to(dtype)
    b = weights(form, dev, seed, dtype)
    offs = None if form == "loop" else torch.tensor(r["sizes"], device=dev).cumsum(0).to(torch.int32)
    return dict(r, x=x, b=b, offs=offs, index=r["index"].to(dev), loop_sizes=r["sizes"] if form == "loop" else None)


def dispatch_fp64(c: dict, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    recv = torch.empty(sum(c["outs"]), K, dtype=torch.float64, device=c["x"].device)
    dist.all_to_all_single(recv, c["x"].double(), c["outs"], c["ins"], group=group)
    p = recv[c["index"]]
    starts = [0, *torch.tensor(c["sizes"]).cumsum(0).tolist()]
    if c["offs"] is None:
        return [p, *[p[starts[e]:starts[e + 1]] @ c["b"][e].double() for e in range(E)]]
    ys = []
    for w in c["b"]:
        y = torch.zeros(p.shape[0], w.shape[-1], dtype=torch.float64, device=p.device)
        for e in range(E):
            y[starts[e]:starts[e + 1]] = p[starts[e]:starts[e + 1]] @ w[e].double()
        ys.append(y)
    return [p, *ys]


EXPERIMENTS = {"moe_p2p_cuda"}  # tests/test_gpu_moe_peer.py's ranks add "moe_peer"


def _p2p():
    """The settings under which CUDA calls take the P2P route (an experiment until it is measured on GPUs)."""
    from flashoverlap_inductor import config

    return config.patch(experiments=EXPERIMENTS)


def _combine(c: dict, g, plan: str) -> torch.Tensor:
    with _p2p():
        return torch.ops.flashoverlap.gemm_unpermute_all_to_all(c["a"], c["b"], c["offs"], c["index"], False,
                                                                c["outs"], c["ins"], g.group_name, plan)


def _dispatch(c: dict, g, plan: str) -> list[torch.Tensor]:
    with _p2p():
        return torch.ops.flashoverlap.all_to_all_permute_gemm(c["x"], c["index"], c["b"], c["loop_sizes"], c["offs"],
                                                              c["outs"], c["ins"], g.group_name, plan)


# ------------------------------------------------------------------------------------------ workers


def _check_combine(form: str, kind: str, plan: str, seed: int, dtype: torch.dtype, dev: torch.device,
                   where: str) -> list[str]:
    import torch.distributed as dist

    from flashoverlap_inductor import routes
    from flashoverlap_inductor.routes import combine as combine_route

    g, tol, bad = dist.group.WORLD, TOLS[dtype], []
    c = combine_case(form, kind, seed, dev, dtype)
    want, ref = combine_fp64(c, g), combine_route.reference(
        c["a"], c["b"], c["offs"], c["index"], False, c["outs"], c["ins"], g)
    before = (routes.stats["combine:p2p"], routes.stats["route:moe_p2p"])
    _poison_allocator(dev)
    got = _combine(c, g, plan)
    torch.cuda.synchronize()
    if (routes.stats["combine:p2p"], routes.stats["route:moe_p2p"]) != (before[0] + 1, before[1] + 1):
        bad.append(f"combine {where}: not the P2P route: {dict(routes.stats)}")
    for name, err in (("fp64", _err(got, want)), ("reference", _err(got, ref))):
        if not err <= tol:
            bad.append(f"combine {where}: rel err vs {name} {err:.3g}")
    return bad


def _check_dispatch(form: str, kind: str, plan: str, seed: int, dtype: torch.dtype, dev: torch.device,
                    where: str) -> list[str]:
    import torch.distributed as dist

    from flashoverlap_inductor import routes
    from flashoverlap_inductor.routes import moe_dispatch as dispatch_route

    g, tol, bad = dist.group.WORLD, TOLS[dtype], []
    d = dispatch_case(form, kind, seed, dev, dtype)
    want, ref = dispatch_fp64(d, g), dispatch_route.reference(
        d["x"], d["index"], d["b"], d["loop_sizes"], d["offs"], d["outs"], d["ins"], g)
    before, cut = routes.stats["dispatch:p2p"], routes.stats["dispatch:experts"]
    _poison_allocator(dev)
    got = _dispatch(d, g, plan)
    torch.cuda.synchronize()
    if routes.stats["dispatch:p2p"] != before + 1:
        bad.append(f"dispatch {where}: not the P2P route: {dict(routes.stats)}")
    # the expert plans' grouped bf16 calls in the MoE form are cut by expert (its premise holds on every rank)
    if plan.startswith("experts") and form != "loop" and kind == "moe" and dtype == torch.bfloat16 and \
            routes.stats["dispatch:experts"] != cut + 1:
        bad.append(f"dispatch {where}: the expert cut not taken: {dict(routes.stats)}")
    if not torch.equal(got[0], ref[0]):
        bad.append(f"dispatch {where}: p differs from the reference's")
    for i, (y, w, r) in enumerate(zip(got[1:], want[1:], ref[1:], strict=True)):
        for name, err in (("fp64", _err(y, w)), ("reference", _err(y, r))):
            if not err <= tol:
                bad.append(f"dispatch {where}: y{i} rel err vs {name} {err:.3g}")
    return bad


def ops_worker(forms: list[str], kinds: list[str], plans: list[str], seeds: list[int],
               dtype_name: str = "bfloat16") -> list[str]:
    """Every case of both ops in ``dtype_name``: what went wrong (nothing: []). An exception ends the worker (a rank
    that went on could wait in NCCL for a peer that raised alone, until the group's timeout)."""
    dev, dtype = torch.device("cuda", torch.cuda.current_device()), getattr(torch, dtype_name)
    bad = []
    for form in forms:
        for kind in kinds:
            for plan in plans:
                for seed in seeds:
                    where = f"{dtype_name} {form} {kind} {plan} {seed}"
                    bad += _check_combine(form, kind, plan, seed, dtype, dev, where)
                    bad += _check_dispatch(form, kind, plan, seed, dtype, dev, where)
    return bad


def fallback_worker() -> list[str]:
    """An fp64 call (a dtype the route does not take) runs the reference, counted ``fallback:dtype``."""
    import torch.distributed as dist

    from flashoverlap_inductor import routes

    g, dev = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device())
    c = combine_case("loop", "moe", 9, dev)
    c = dict(c, a=[x.double() for x in c["a"]], b=[w.double() for w in c["b"]])
    before = routes.stats["fallback:dtype"]
    got = _combine(c, g, "blocks")
    bad = [] if routes.stats["fallback:dtype"] == before + 1 else [f"not counted: {dict(routes.stats)}"]
    err = _err(got, combine_fp64(c, g))
    return bad + ([] if err < 1e-12 else [f"fp64 fallback rel err {err:.3g}"])


def fault_worker(op: str, path: str) -> list[str]:
    """Rank 1's GEMMs raise in its first call, whichever runs them (``path`` "general": plan ``"blocks:c=2"``, the
    units of ``CombineUnits`` / ``DispatchUnits``; "whole-block": plan ``"blocks"``, ``routes/moe_fast.py``: the
    combine's one library call, ``moe_combine_lib.run``, or its Python loop's ``torch._grouped_mm``, and the
    dispatch's grouped GEMMs); the second call runs normally. Per call and rank: "own" (rank 1), "peer" (the
    others, naming rank 1) or "exact". Under ``EXPERIMENTS`` (``tests/test_gpu_moe_peer.py`` adds ``moe_peer``)."""
    from unittest import mock

    import torch.distributed as dist

    from flashoverlap_inductor import errors
    from flashoverlap_inductor.routes import combine as combine_route
    from flashoverlap_inductor.routes import moe_combine_lib, moe_fast
    from flashoverlap_inductor.routes import moe_dispatch as dispatch_route

    g, dev, rank = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()), dist.get_rank()
    if path == "general":
        targets = [(combine_route.CombineUnits, "fill") if op == "combine" else (dispatch_route.DispatchUnits,
                                                                                  "compute")]
        plan = "blocks:c=2"
    else:
        targets, plan = [(moe_fast.torch, "_grouped_mm"), (moe_combine_lib, "run")], "blocks"

    def flaky(*args, **kwargs):
        raise RuntimeError("injected GEMM fault")

    c = combine_case("grouped", "moe", 5, dev) if op == "combine" else dispatch_case("grouped", "moe", 5, dev)
    want = combine_fp64(c, g) if op == "combine" else dispatch_fp64(c, g)[1]
    out = []
    for i in range(2):
        patches = [mock.patch.object(owner, name, flaky) for owner, name in targets] if i == 0 and rank == 1 else []
        _poison_allocator(dev)
        try:
            for patch in patches:
                patch.start()
            try:
                got = _combine(c, g, plan) if op == "combine" else _dispatch(c, g, plan)[1]
            finally:
                for patch in patches:
                    patch.stop()
            torch.cuda.synchronize()
        except errors.PeerFailure as exc:
            out.append("peer" if "rank 1 (" in str(exc) else f"peer, not naming rank 1: {exc}")
            continue
        except RuntimeError as exc:
            out.append("own" if "injected" in str(exc) else f"other: {exc}")
            continue
        err = _err(got, want)
        out.append("exact" if err <= TOL else f"WRONG: rel err {err:.3g}")
    return out


def _deferred_calls(op: str, experiments: tuple[str, ...], dev: torch.device, g) -> tuple:
    """(the fp64 reference, ``run``): one bf16 ``blocks`` call of ``op`` on the MoE form's case, under
    ``EXPERIMENTS`` and ``experiments`` (passed as the op's settings: no nesting); the dispatch's p and y side by
    side, both checked, both poisoned."""
    from flashoverlap_inductor import config

    c = combine_case("grouped", "moe", 2, dev) if op == "combine" else dispatch_case("grouped", "moe", 2, dev)
    want = combine_fp64(c, g) if op == "combine" else torch.cat(dispatch_fp64(c, g), dim=1)
    key = config.current().replace(experiments={*EXPERIMENTS, *experiments}).key()
    return want, lambda: call_op(op, c, g, key)


def call_op(op: str, c: dict, g, key: str) -> torch.Tensor:
    """One ``blocks`` call of ``op`` on case ``c`` under the settings of ``key`` (passed as the op's settings: no
    nesting); the dispatch's p and y side by side."""
    if op == "combine":
        return torch.ops.flashoverlap.gemm_unpermute_all_to_all(c["a"], c["b"], c["offs"], c["index"], False,
                                                                c["outs"], c["ins"], g.group_name, "blocks", key)
    return torch.cat(torch.ops.flashoverlap.all_to_all_permute_gemm(
        c["x"], c["index"], c["b"], c["loop_sizes"], c["offs"], c["outs"], c["ins"], g.group_name, "blocks", key),
        dim=1)


def _gemm_fault(rank: int):
    """A context in which the first GEMM call of this process raises "injected GEMM fault" where ``rank`` is 1:
    whichever runs the whole-block path's GEMMs (the combine's one library call, ``moe_combine_lib.run``, or
    ``torch._grouped_mm``)."""
    import contextlib
    from unittest import mock

    from flashoverlap_inductor.routes import moe_combine_lib, moe_fast

    seen = []

    def flaky(real):
        def gemms(*args, **kwargs):
            seen.append(1)
            if rank == 1 and len(seen) == 1:
                raise RuntimeError("injected GEMM fault")
            return real(*args, **kwargs)
        return gemms

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(moe_fast.torch, "_grouped_mm", flaky(torch._grouped_mm)))
    stack.enter_context(mock.patch.object(moe_combine_lib, "run", flaky(moe_combine_lib.run)))
    return stack


def deferred_worker(op: str, extra: tuple[str, ...] = (), sync_free: bool = True) -> list[str]:
    """The settle without a host read (``routes/moe_deferred.py``) on the whole-block path: warm calls, then deferred
    calls against fp64 (no host sync inside them: ``set_sync_debug_mode("error")``, unless not ``sync_free``: a gloo
    group's exchange goes through the host), then rank 1's GEMMs (the combine's library call or the grouped GEMMs)
    raising in a deferred call: rank 1 raises it, the others' outputs are NaN, and they raise ``PoisonedResult`` at
    the end of a later call (after a device sync, its event is done); then exact again. Per step: an outcome word.
    ``extra``: more experiments (``moe_plan_triton``: the plan, the poison and the moves by Triton kernels and torch
    ops instead of the library's kernels)."""
    import torch.distributed as dist

    from flashoverlap_inductor import errors, routes
    from flashoverlap_inductor.routes import moe_deferred

    g, dev, rank = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()), dist.get_rank()
    moe_deferred.forget()
    want, run = _deferred_calls(op, (moe_deferred.EXPERIMENT, *extra), dev, g)

    out = []
    for _ in range(moe_deferred.HELD_BEFORE_DEFERRING):
        run()
    before = routes.stats["moe:deferred"]
    keys = ("moe:plan_lib", "moe:poison_lib", "moe:move_lib")
    lib = [routes.stats[k] for k in keys]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error" if sync_free else 0)
    try:
        got = run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    err = _err(got, want)
    grew = [routes.stats[k] - v for k, v in zip(keys, lib, strict=True)]
    from flashoverlap_inductor.native import kernels

    # the library's plan, poison and (dispatch) moves unless opted out, where it loads (on sm90 it must:
    # tests/test_moe_plan_kernel.py fails without it)
    on = "moe_plan_triton" not in extra and kernels.available()
    if grew[:2] != ([1, 1] if on else [0, 0]) or (grew[2] > 0) != (on and op == "dispatch"):
        out.append(f"library calls {dict(zip(keys, grew, strict=True))}")
    else:
        out.append("exact" if err <= TOL and routes.stats["moe:deferred"] == before + 1 else f"WRONG {err:.3g}")
    try:
        with _gemm_fault(rank):
            got = run()
        torch.cuda.synchronize()
        out.append("NaN" if bool(got.isnan().all()) else "NOT POISONED")
    except RuntimeError as exc:
        out.append("own" if "injected" in str(exc) else f"other: {exc}")
    torch.cuda.synchronize()
    for _ in range(2):
        try:
            got = run()
            torch.cuda.synchronize()
            out.append("exact" if _err(got, want) <= TOL else "WRONG")
        except errors.PoisonedResult as exc:
            out.append(f"poisoned ({type(exc.__cause__).__name__})")
    return out


def per_graph_worker(op: str, sync_free: bool = True) -> list[str]:
    """The settle without a host read judged per graph run (the experiment ``moe_judge_per_graph``): three graph runs
    as the backend wraps a compiled graph's runs (``moe_deferred.graph_run``) of two deferred calls each, none judged
    inside its run (the calls pending at its end count them; ``set_sync_debug_mode("error")`` catches other host
    syncs, unless not ``sync_free``: a gloo group's exchange goes through the host); rank 1's GEMMs raise in run 2's
    first call. Per step an outcome word: rank 1 raises its own fault there; the others' call is NaN, their run's
    second call exact, and they raise ``PoisonedResult`` at the end of run 3."""
    import contextlib

    import torch.distributed as dist

    from flashoverlap_inductor import errors
    from flashoverlap_inductor.routes import moe_deferred

    g, dev, rank = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()), dist.get_rank()
    moe_deferred.forget()
    want, run = _deferred_calls(op, (moe_deferred.EXPERIMENT, moe_deferred.PER_GRAPH), dev, g)

    for _ in range(moe_deferred.HELD_BEFORE_DEFERRING):
        run()
    torch.cuda.synchronize()
    out = []
    for number in (1, 2, 3):
        got = []
        try:
            with moe_deferred.graph_run():
                for call in range(2):
                    torch.cuda.set_sync_debug_mode("error" if sync_free else 0)
                    try:
                        with _gemm_fault(rank) if number == 2 and call == 0 else contextlib.nullcontext():
                            got.append(run())
                    except RuntimeError as exc:
                        out.append("own" if "injected" in str(exc) else f"other: {exc}")
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                out.append(f"pending {moe_deferred.pending(g)}")
            torch.cuda.synchronize()
            out += ["NaN" if bool(t.isnan().all()) else "exact" if _err(t, want) <= TOL else "WRONG" for t in got]
            out.append(f"run {number}: ok")
        except errors.PoisonedResult as exc:
            out.append(f"run {number}: poisoned ({type(exc.__cause__).__name__})")
    return out


def sync_free_worker(op: str) -> list[str]:
    """The whole-block path (``routes/moe_fast.py``) takes the MoE form's call with no host sync before its settle:
    under ``torch.cuda.set_sync_debug_mode("error")`` (off inside ``moe_p2p.settle`` alone, whose one read is the
    call's sync); its result against fp64 and the path's counter."""
    from unittest import mock

    import torch.distributed as dist

    from flashoverlap_inductor import routes
    from flashoverlap_inductor.routes import moe_p2p

    g, dev = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device())
    c = (combine_case if op == "combine" else dispatch_case)("grouped2", "moe", 6, dev)
    want = combine_fp64(c, g) if op == "combine" else dispatch_fp64(c, g)[1]
    call = (lambda: _combine(c, g, "blocks")) if op == "combine" else (lambda: _dispatch(c, g, "blocks")[1])
    call()  # warm: the first call of a kind exchanges the ranks' agreement digests
    torch.cuda.synchronize()
    real = moe_p2p.settle

    def unguarded(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    fast = routes.stats[f"{op}:fast"]
    try:
        with mock.patch.object(moe_p2p, "settle", unguarded):
            torch.cuda.set_sync_debug_mode("error")
            got = call()
    except RuntimeError as exc:
        return [f"synced: {exc}"[:300]]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    out = [] if routes.stats[f"{op}:fast"] == fast + 1 else [f"not the whole-block path: {dict(routes.stats)}"]
    err = _err(got, want)
    return out + ([] if err <= TOL else [f"WRONG: rel err {err:.3g}"])


def direct_worker() -> list[str]:
    """Both ops on both paths with their transfers straight into NCCL (``routes/moe_nccl.py``, counted
    ``moe:nccl_direct``): against fp64 and the reference, as ``ops_worker``."""
    from flashoverlap_inductor import routes

    dev = torch.device("cuda", torch.cuda.current_device())
    keys = ("moe:nccl_direct", "moe:nccl_direct_status", "combine:fast", "dispatch:fast", "combine:redo",
            "dispatch:redo")
    before = {k: routes.stats[k] for k in keys}
    bad = []
    for plan in ("blocks", "blocks:c=2"):
        where = f"direct {plan}"
        bad += _check_combine("grouped", "moe", plan, 3, torch.bfloat16, dev, where)
        bad += _check_dispatch("grouped2", "moe", plan, 3, torch.bfloat16, dev, where)
    grew = {k: routes.stats[k] - before[k] for k in keys}
    # 4 calls on 2 ranks: one status exchange each; one transfer per ring step and chunk unless both its sides are
    # empty (plan "blocks": 1 chunk, "blocks:c=2": 2); plan "blocks" on the whole-block path, never redone
    want = {"moe:nccl_direct_status": 4, "combine:fast": 1, "dispatch:fast": 1, "combine:redo": 0, "dispatch:redo": 0}
    got = {k: v for k, v in grew.items() if k in want}
    if got != want or not 1 <= grew["moe:nccl_direct"] <= 6:
        bad.append(f"counters grew by {grew}; want {want} and 1-6 direct transfers")
    return bad


def skipped_call_worker(timeout_ms: int) -> str:
    """Rank 1 skips a combine that rank 0 makes (after two calls on both): rank 0's transfer has no peer, the NCCL
    watchdog (``runtime/nccl_watch.py``) aborts the group past its bound and rank 0 raises ``FlashOverlapTimeout``
    (``moe_nccl.check_not_given_up``: what the aborted exchange left is not trusted); returns what each rank saw
    and, on rank 0, within how many seconds (the group is unusable afterwards: the test restarts the ranks)."""
    import time

    import torch.distributed as dist

    from flashoverlap_inductor import config

    g, dev, rank = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()), dist.get_rank()
    c = combine_case("grouped", "moe", 4, dev)
    for _ in range(2):  # warm, under the default bound (a first call's compile skew must not abort the group)
        _combine(c, g, "blocks")
    with config.patch(wait_timeout_ms=timeout_ms):
        _combine(c, g, "blocks")  # both ranks agree on the new settings here (the agreement is torch's collective)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            return "skipped"
        t0 = time.monotonic()
        try:
            got = _combine(c, g, "blocks")
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - the outcome is the test's
            return f"raised {type(exc).__name__} in {time.monotonic() - t0:.0f} s"
        return f"returned (finite: {bool(torch.isfinite(got).all())}) in {time.monotonic() - t0:.0f} s"


# ------------------------------------------------------------------------------------------ tests


@two_gpus
def test_both_ops_match_fp64_and_the_reference_on_uneven_splits(pool):
    got = pool.run(ops_worker, ["loop", "grouped", "grouped2"], ["moe", "perm"],
                   ["blocks", "blocks:c=2", "experts", "experts:c=3"], [1, 2])
    assert got == [[], []]


def peer_ops_worker() -> list[str]:
    """``ops_worker``'s cases with the blocks moved by copy-engine pushes between the GPUs (experiment ``moe_peer``,
    an NCCL group: the settle on NCCL), every call counted ``moe:moe_peer``."""
    from flashoverlap_inductor import routes

    global EXPERIMENTS
    kept, EXPERIMENTS = EXPERIMENTS, {"moe_p2p_cuda", "moe_peer"}
    before = routes.stats["moe:moe_peer"]
    try:  # the pool's process runs the module's later tests too: they must not take the peer transfers
        bad = ops_worker(["grouped", "grouped2", "loop"], ["moe", "perm"], ["blocks", "blocks:c=2", "experts"],
                         [1, 2])
    finally:
        EXPERIMENTS = kept
    if routes.stats["moe:moe_peer"] - before != 2 * 3 * 2 * 3 * 2:
        bad.append(f"{routes.stats['moe:moe_peer'] - before} calls took the peer transfers, not 72")
    return bad


@two_gpus
def test_both_ops_over_peer_transfers_between_two_gpus(pool):
    assert pool.run(peer_ops_worker) == [[], []]


@two_gpus
@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_grouped_forms_in_fp16_and_fp32_take_the_route_without_grouped_mm(pool, dtype_name):
    """fp16 / fp32: the grouped form runs one mm per expert run and term (``moe_p2p.grouped_kernel``: torch's CUDA
    _grouped_mm has no fp16 / fp32 kernel and its fallback syncs the host per call)."""
    got = pool.run(ops_worker, ["grouped", "grouped2"], ["moe", "perm"], ["blocks:c=2"], [1], dtype_name)
    assert got == [[], []]


@two_gpus
def test_an_unsupported_dtype_falls_back_to_the_reference(pool):
    assert pool.run(fallback_worker) == [[], []]


@two_gpus
@pytest.mark.parametrize("op", ["combine", "dispatch"])
@pytest.mark.parametrize("path", ["general", "whole-block"])
def test_a_gemm_fault_on_one_rank_raises_on_every_rank_and_the_next_call_is_exact(pool, op, path):
    assert pool.run(fault_worker, op, path) == [["peer", "exact"], ["own", "exact"]]


@two_gpus
@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_the_whole_block_path_syncs_the_host_only_in_its_settle(pool, op):
    assert pool.run(sync_free_worker, op) == [[], []]


@two_gpus
@pytest.mark.parametrize("op", ["combine", "dispatch"])
@pytest.mark.parametrize("extra", [(), ("moe_plan_triton",)])
def test_the_settle_without_a_host_read_poisons_and_raises_a_call_later(pool, op, extra):
    r0, r1 = pool.run(deferred_worker, op, extra)
    assert r0 == ["exact", "NaN", "poisoned (PeerFailure)", "exact"], r0
    assert r1 == ["exact", "own", "exact", "exact"], r1


@two_gpus
@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_per_graph_judging_waits_for_nothing_inside_a_run_and_raises_a_run_later(pool, op):
    r0, r1 = pool.run(per_graph_worker, op)
    assert r0 == ["pending 2", "exact", "exact", "run 1: ok", "pending 4", "NaN", "exact", "run 2: ok", "pending 4",
                  "run 3: poisoned (PeerFailure)"], r0
    assert r1 == ["pending 2", "exact", "exact", "run 1: ok", "own", "pending 4", "exact", "run 2: ok", "pending 4",
                  "exact", "exact", "run 3: ok"], r1


@two_gpus
def test_transfers_go_straight_into_nccl_and_stay_exact(pool):
    assert pool.run(direct_worker) == [[], []]


@two_gpus
def test_a_rank_that_skips_a_call_makes_its_peer_raise_within_the_bound(pool):
    """No hang: the skipped rank's peer raises within ~2 x the wait bound + 1 s (the watchdog's deadline)."""
    try:
        r0, r1 = pool.run(skipped_call_worker, 300, timeout_s=60)
    finally:
        pool.close(force=True)  # the group was aborted on rank 0
    assert r1 == "skipped"
    assert r0.startswith("raised FlashOverlapTimeout") and int(r0.split(" in ")[1].split()[0]) <= 10, r0
