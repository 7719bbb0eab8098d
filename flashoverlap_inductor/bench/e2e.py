"""``python -m flashoverlap_inductor.bench e2e``: end-to-end speed of a tensor-/sequence-/expert-parallel HF model
under eager, Inductor, Inductor + async-TP, and the flashoverlap backend, side by side in one run.

    torchrun --nproc_per_node=N -m flashoverlap_inductor.bench e2e --preset llama3-8b --layers 8 --plan tp,sp \
        --workload train,prefill --json e2e.json --png e2e.png

Per model preset and plan, every rank builds the model from one seed and parallelizes it (``plans.py``); per
workload and sequence length, every selected backend runs on a deep copy of that model with the same inputs
(``runner.py``). Rows report the median step time (ms, max over ranks), tokens/s, the speedup over the reference
(Inductor when selected, else the first backend), peak CUDA memory (bytes), compile time (s, first call, in a
fresh Inductor cache per backend unless ``--cache shared``) and, for the fusing backends, what the pass fused and
skipped (``flashoverlap_inductor.fusion_report()``). Losses (train, every measured step) and last-position logits
(prefill) are compared with the reference's: beyond the dtype's tolerance (``TOLERANCE``) the row says MISMATCH and
the exit status is 1 (also after any backend error). Launch: torchrun (NCCL with one GPU per rank, or gloo on
CPU), or plainly for world size 1; or call ``run(argv)`` inside an existing process group (the tests do).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from . import bound, cli, coverage, output
from .budget import FINISH_SHARE
from .runner import BOUNDS, FUSING, GRAPHED, Case, Env, rel_error, release, run_backend, unavailable, variant

TOLERANCE = {"bf16": 2e-2, "fp32": 1e-4}
# eager rounds every intermediate to bf16 where Inductor keeps a fused kernel's intermediates in fp32: on random-init
# models their last-position logits differed by 1.4e-2 (norm-wise) in one llama3-8b layer on an H100
EAGER_BF16_TOLERANCE = 5e-2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _device_type(choice: str) -> str:
    """``--device``; ``auto``: the existing process group's kind (NCCL: cuda, gloo: cpu), else cuda if available."""
    if choice != "auto":
        return choice
    if dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def launched() -> bool:
    """Started by torchrun (or another launcher that sets ``LOCAL_RANK`` and the ``env://`` variables)."""
    return dist.is_torchelastic_launched() or dist.get_node_local_rank(fallback_rank=-1) >= 0


def init_distributed(device_type: str, timeout_s: int, share_gpu: bool = False) -> tuple[bool, str | None]:
    """Join the launcher's process group (``env://``), or make a group of one; (whether we created it, an error
    line or None). With CUDA, each rank takes the GPU of its local rank, and a rank without one stops here;
    ``share_gpu``: the GPU of its local rank modulo the GPUs, in a gloo group (ranks sharing a GPU: correctness
    only)."""
    if dist.is_initialized():
        return False, None
    timeout = datetime.timedelta(seconds=timeout_s)
    alone = {} if launched() else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return False, "--device cuda: CUDA is not available"
        local, gpus = dist.get_node_local_rank(fallback_rank=0), torch.cuda.device_count()
        if share_gpu:
            torch.cuda.set_device(local % gpus)
            dist.init_process_group("gloo", timeout=timeout, **alone)
            return True, None
        if local >= gpus:
            return False, (f"local rank {local} has no GPU of its own ({gpus} on this host): NCCL needs one GPU per "
                           f"rank (ranks cannot share a GPU); use --nproc_per_node <= {gpus}, --share-gpu (gloo: a "
                           "correctness run) or --device cpu")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local), **alone)
    else:
        dist.init_process_group("gloo", timeout=timeout, **alone)
    return True, None


def make_env(args: argparse.Namespace, device_type: str) -> Env:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,))
    return Env(rank, world, device, DTYPES[args.dtype], mesh, mesh.get_group().group_name, quiet=args.quiet)


def check_memory(spec, plan: str, workload: str, env: Env, live: int = 1) -> str | None:
    """A rough static estimate (parameters, template copy, gradients, AdamW state; no activations; ``live`` models
    at once: ``--interleave`` keeps every compiled backend's) against the GPU's memory: a one-line error with the
    number of layers that would fit, or None."""
    if not env.cuda:
        return None
    size = torch.finfo(env.dtype).bits // 8
    per_layer = (spec.params() - 2 * spec.vocab * spec.hidden) / max(spec.layers, 1)
    fixed = 2 * spec.vocab * spec.hidden

    def need(layers: int) -> float:
        sharded = per_layer * layers / env.world + fixed
        copies = 1 + live * (4 if workload == "train" else 1)  # template + live models (+ grads + 2 AdamW states)
        return max((per_layer * layers + fixed) * size, sharded * copies * size)

    total = torch.cuda.get_device_properties(env.device).total_memory * 0.9
    if need(spec.layers) <= total:
        return None
    fits = max((n for n in range(spec.layers + 1) if need(n) <= total), default=0)
    return (f"{spec.name} with {spec.layers} layers needs about {need(spec.layers) / 2**30:.0f} GiB per rank for "
            f"{workload} before activations (GPU: {total / 0.9 / 2**30:.0f} GiB): use --layers {max(fits - 1, 1)} or "
            "fewer")


def build_template(spec, plan: str, env: Env, args: argparse.Namespace, max_seq: int):
    from . import models, plans

    model = models.build(spec, env.device, env.dtype, args.seed, max_seq)
    return plans.apply(model, spec, plan, env.mesh, args.expert_gemm)


def run_case(case: Case, template, env: Env, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every selected backend on ``case``; then speedups and the correctness check against the reference."""
    from .runner import make_data

    data = make_data(case, 1 + args.warmup + args.steps, args.seed, env.device)
    base = {"model": case.spec.name, "plan": case.plan, "workload": case.workload, "seq": case.seq,
            "batch": case.batch, "tokens": case.tokens, "world": env.world, "dtype": args.dtype}
    why = {backend: unavailable(variant(backend)[0], case, env) for backend in args.backends}
    rows = []
    if args.interleave:
        from .interleave import run_interleaved

        ran = run_interleaved([b for b in args.backends if not why[b]], case, template, data, env, args)
        release(env)
    for backend in args.backends:
        if why[backend]:
            rows.append({**base, "backend": backend, "status": "n/a", "note": why[backend]})
        elif args.interleave:
            rows.append({**base, **ran.pop(0)})
        elif not args.budget.allows(env, "backend", FINISH_SHARE):
            rows.append({**base, "backend": backend, "status": "n/a", "note": args.budget.skipped("this backend")})
        else:
            started = args.budget.now()
            try:
                rows.append({**base, **run_backend(backend, case, template, data, env, args)})
            except Exception as exc:  # noqa: BLE001 - reported in the row; the exit status becomes 1
                if env.rank == 0:
                    traceback.print_exc()
                rows.append({**base, "backend": backend, "status": "error",
                             "note": f"{type(exc).__name__}: {exc}"[:300]})
            release(env)
            args.budget.timed("backend", args.budget.now() - started)
    for r in rows:
        if r["backend"] in BOUNDS and r["status"] == "ok":
            r["note"] = "; ".join(x for x in (bound.NOTE, r["note"]) if x)
            r["values"] = r.pop("_values").flatten()[:8].tolist()
    ran = [r for r in rows if r["status"] == "ok" and r["backend"] not in BOUNDS]
    ref = next((r for r in ran if r["backend"] == "inductor"), ran[0] if ran else None)
    errors = env.reduce_max([rel_error(r["_values"], ref["_values"], case.workload) for r in ran]) if ref else []
    closest = closest_calls(ran, ref, env, case.workload)
    for r, err, best in zip(ran, errors, closest):
        compiled = ref["backend"] != "eager" and r["backend"] != "eager"
        tol = TOLERANCE[args.dtype] if compiled or args.dtype != "bf16" else EAGER_BF16_TOLERANCE
        r["reference"], r["rel_err"], r["tolerance"] = ref["backend"], err, tol
        r["speedup"] = ref["ms"] / r["ms"] if r["ms"] > 0 else None
        if best > tol:
            r["status"] = "MISMATCH"
            said = (f"{case.workload} {'losses' if case.workload == 'train' else 'logits'} differ from "
                    f"{ref['backend']} by {err:.2e} (tolerance {tol:.0e})") if err > tol \
                else "a later value call is not finite"  # (best <= err unless a call is not finite)
            r["note"] = "; ".join(x for x in (said, r["note"]) if x)
        elif err > tol:
            r["closest_rel_err"] = best
            r["note"] = "; ".join(x for x in (f"first value call off by {err:.1e}, another within {best:.1e} of "
                                               "one of the reference's", r["note"]) if x)
    later_calls(ran, ref, env, case.workload)
    cross_check([r for r in ran if r is not ref], env, case.workload)
    for r in rows:
        r.pop("_more_values", None)
    for r in ran:
        r["values"] = r.pop("_values").flatten()[:8].tolist()  # a sample for the JSON
    add_hidden(rows)
    return rows


def closest_calls(ran: list[dict[str, Any]], ref: dict[str, Any] | None, env: Env, workload: str) -> list[float]:
    """Per row, the smallest error between any of its value calls and any of the reference's (``--value-calls N``;
    max over ranks, one all_reduce): the row's verdict. A model whose result varies from call to call (2 H200s,
    qwen3-moe ``ep`` on torch 2.11: one call in three to six off by 1.4e-1 under Inductor and eager alike) has more
    than one answer; a row none of whose calls is near any of the reference's is wrong. With one value call this is
    the first calls' error; a row with a non-finite value in any call is wrong (inf)."""
    if ref is None:
        return []
    calls = lambda r: [r["_values"], *r.get("_more_values", [])]  # noqa: E731
    pairs = [(i, v, w) for i, r in enumerate(ran) for v in calls(r) for w in calls(ref)]
    errors = env.reduce_max([rel_error(v, w, workload) for _, v, w in pairs])
    best = [float("inf")] * len(ran)
    for (i, _, _), err in zip(pairs, errors, strict=True):
        best[i] = min(best[i], err)
    finite = env.reduce_max([float(not all(bool(torch.isfinite(v).all()) for v in calls(r))) for r in ran])
    return [float("inf") if bad else b for b, bad in zip(best, finite, strict=True)]


def later_calls(ran: list[dict[str, Any]], ref: dict[str, Any] | None, env: Env, workload: str) -> None:
    """``--value-calls N``: each row's later value calls (``_more_values``; a prefill takes one input at every
    call) compared with the reference's first, errors max over ranks (one all_reduce; the same rows on every rank),
    under ``later_rel_errs`` and in the note where one is off by more than the row's tolerance while the first is
    not, or the other way round (a result that varies from call to call); where the reference's own later calls
    differ from its first, every mismatched row's note says the reference is unstable."""
    pairs = [(r, v) for r in ran for v in r.get("_more_values", [])]
    if ref is None or not pairs:
        return
    errors = env.reduce_max([rel_error(v, ref["_values"], workload) for _, v in pairs])
    for r in ran:
        r["later_rel_errs"] = [e for (x, _), e in zip(pairs, errors, strict=True) if x is r]
        tol = r.get("tolerance", 0.0)
        if r["later_rel_errs"] and any((e > tol) != (r["rel_err"] > tol) for e in r["later_rel_errs"]):
            said = f"later value calls off by {', '.join(f'{e:.1e}' for e in r['later_rel_errs'])}"
            r["note"] = "; ".join(x for x in (r["note"], said) if x)
    drift = max(ref.get("later_rel_errs") or [0.0])
    if drift > ref.get("tolerance", 0.0):  # the reference's own calls disagree: its first may be the odd one
        for r in ran:
            if r["status"] == "MISMATCH":
                said = f"the reference's own value calls differ by up to {drift:.1e} (unstable reference)"
                r["note"] = "; ".join(x for x in (r["note"], said) if x)


def cross_check(rows: list[dict[str, Any]], env: Env, workload: str) -> None:
    """Where a row mismatches its reference, name the other compared rows whose values it agrees with (within its
    tolerance; errors max over ranks, one all_reduce, the same rows on every rank): mismatched rows that agree with
    each other point at the reference as the odd one (rerun with ``eager`` among the backends to tell), a lone one at
    the row itself.
    Writes ``agrees_with`` on each mismatched row and a clause in its note; takes ``_values`` (before they are cut)."""
    bad = [r for r in rows if r["status"] == "MISMATCH"]
    pairs = [(a, b) for a in bad for b in rows if b is not a]
    if not pairs:
        return
    errors = env.reduce_max([rel_error(a["_values"], b["_values"], workload) for a, b in pairs])
    for a in bad:
        near = [b for (x, b), err in zip(pairs, errors) if x is a and err <= a["tolerance"]]
        a["agrees_with"] = [b["backend"] for b in near]
        if near:
            odd = " (the reference may be the odd one)" if all(b["status"] == "MISMATCH" for b in near) else ""
            a["note"] += f"; agrees with {', '.join(a['agrees_with'])}{odd}"


def add_hidden(rows: list[dict[str, Any]]) -> None:
    """``hidden`` (a fraction) on every timed row but the baselines' and the bounds', when its baseline and its
    bound ran and the bound is faster: ``(T_base - T_row) / (T_base - T_bound)`` of the medians, the share of the
    baseline's exposed communication time the row hid (1.0: as fast as a step with no communication; < 0: slower
    than the baseline). A row under CUDA graphs (``-ro``) is measured against ``inductor-ro`` and ``bound-ro`` where
    both ran (like for like: the graphs' own saving of host time is not counted as hidden communication; none if
    that bound is no faster), else, as every other row, against ``inductor`` and ``bound``; ``hidden_vs`` names the
    pair. A bound's ``speedup`` is over ``inductor`` (the table's reference) where it ran.

    Its spread within the run, ``hidden_steps``: step ``i``'s gain over the baseline's step ``i`` (the same inputs;
    ms per step, max over ranks: ``step_ms_max``) as a share of the same median exposed time, one per step where
    both are finite, when at least 2 are; the table prints their range beside the share. The denominator stays the
    medians' (a step's own bound time would make a ratio of two noises that blows up where the bound is barely
    faster). Between runs the baseline's and the bound's medians move too, by as much as the gain at times, which
    no single run shows: compare runs for that."""
    by = {r["backend"]: r for r in rows if r["status"] in ("ok", "MISMATCH") and r.get("ms")}
    ran = {}  # (baseline, bound) -> the baseline's exposed ms (<= 0: the bound no faster) for each pair that ran
    for base, bnd_name in (("inductor", "bound"), ("inductor-ro", "bound-ro")):
        ind, bnd = by.get(base), by.get(bnd_name)
        if ind is None or bnd is None:
            continue
        ran[(base, bnd_name)] = exposed = ind["ms"] - bnd["ms"]
        bnd["speedup"] = by.get("inductor", ind)["ms"] / bnd["ms"]  # over the table's reference, as every row's
        if exposed <= 0:
            bnd["note"] += f"; not faster than {base} (by {-exposed:.3f} ms): no hidden share"
    for name, r in by.items():
        graphed = variant(name)[0] in GRAPHED and ("inductor-ro", "bound-ro") in ran
        pair = ("inductor-ro", "bound-ro") if graphed else ("inductor", "bound")
        if name in (*pair, "eager") or name in BOUNDS or not ran.get(pair, 0) > 0:
            continue
        ind, exposed = by[pair[0]], ran[pair]
        r["hidden"], r["hidden_vs"] = (ind["ms"] - r["ms"]) / exposed, pair[0]
        steps = step_shares(ind.get("step_ms_max"), r.get("step_ms_max"), exposed)
        if steps is not None:
            r["hidden_steps"] = steps


def step_shares(ind: list[float] | None, row: list[float] | None, exposed_ms: float) -> list[float] | None:
    """Per step ``i``: ``(ind[i] - row[i]) / exposed_ms`` (rounded to 4 places), skipping steps with a non-finite
    time; None without equally long step lists, without a positive ``exposed_ms`` or with fewer than 2 steps."""
    if not ind or not row or len(ind) != len(row) or not exposed_ms > 0:
        return None
    shares = [round((i - r) / exposed_ms, 4) for i, r in zip(ind, row, strict=True)
              if math.isfinite(i) and math.isfinite(r)]
    return shares if len(shares) >= 2 else None


def coverage_entry(spec, plan: str, workload: str, rows: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """The graphs of the fusing backend (else of the first compiled one) for one (model, plan, workload)."""
    mine = [r for r in rows if r["model"] == spec.name and r["plan"] == plan and r["workload"] == workload
            and r.get("graphs")]
    src = next((r for r in mine if r["backend"] == "flashoverlap"), None) or \
        next((r for r in mine if variant(r["backend"])[0] in FUSING), None) or (mine[0] if mine else None)
    entry: dict[str, Any] = {"model": spec.name, "plan": plan, "workload": workload, "notes": [],
                             "source": f"{src['backend']} at seq {src['seq']}" if src else "none",
                             "graphs": coverage.merge(src["graphs"]) if src else {},
                             "events": src.get("events", {}) if src else {}}
    if world == 1:
        entry["notes"].append("world size 1: the plans need no collectives, so there is nothing to fuse")
    if src and variant(src["backend"])[0] not in FUSING:
        entry["notes"].append("no flashoverlap backend ran: the pairs are listed unfused")
    if plan == "ep" and src:
        entry["notes"].append(output.moe_combine_note(entry))
    return entry


def run(argv: list[str] | None = None) -> int:
    """Parse, run every case, print and write the results; the exit status (0 ok, 1 mismatch or error, 2 usage).
    Errors before the process group exists are printed by each host's local rank 0, later ones by rank 0."""
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    device_type = _device_type(args.device)
    first_on_host = dist.get_node_local_rank(fallback_rank=0) == 0 if not dist.is_initialized() else \
        dist.get_rank() == 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        if first_on_host:
            print("e2e: error: the e2e benchmark builds HuggingFace models: pip install transformers", file=sys.stderr)
        return 2
    owns, why = init_distributed(device_type, args.timeout_s, args.share_gpu and device_type == "cuda")
    if why:
        print(f"e2e: error: {why}", file=sys.stderr)  # only the ranks it concerns get here
        return 2
    try:
        try:
            cli.resolve(args, device_type, dist.get_world_size())
        except cli.UsageError as exc:
            if dist.get_rank() == 0:
                print(f"e2e: error: {exc}", file=sys.stderr)
            return 2
        return _run(args, make_env(args, device_type))
    finally:
        if owns:
            dist.destroy_process_group()


def _run(args: argparse.Namespace, env: Env) -> int:
    from torch._inductor.utils import fresh_cache

    say = print if env.rank == 0 else (lambda *a, **k: None)
    for spec, plan in args.cases:
        for workload in args.workload:
            live = sum(b != "eager" for b in args.backends) if args.interleave else 1
            why = check_memory(spec, plan, workload, env, max(live, 1))
            if why:
                say(f"e2e: error: {why}", file=sys.stderr)
                return 2
    meta = output.meta(args, env)
    say(output.header(meta, args))
    with fresh_cache() if args.cache == "shared" else contextlib.nullcontext():
        rows, entries = _cases(args, env)
    say(output.table(rows))
    for line in output.host_lines(rows):
        say(line)
    if args.trace:
        say(output.trace_lines(rows))
    if args.coverage == "on":
        say("\n".join(line for e in entries for line in coverage.coverage_lines(e)))
    if env.rank == 0:
        if args.json:
            output.write_json(args.json, meta, rows, entries)
            say(f"wrote {args.json}")
        if args.png:
            say(output.plot(rows, args.png, meta["gpu"] or "CPU (gloo): timings not meaningful"))
    bad = [r for r in rows if r["status"] in ("MISMATCH", "error")]
    say(f"e2e: {len(bad)} row(s) with a mismatch or error" if bad else "e2e: every compared row matches its reference")
    late = [r for r in rows if r["status"] == "n/a" and "time budget" in str(r.get("note", ""))]
    if late:
        say(f"e2e: {len(late)} row(s) not run: the time budget of {args.time_budget_s:g} s ran out")
    if late and not any(r["status"] in ("ok", "MISMATCH") for r in rows):
        return 1  # nothing measured: not a pass
    return 1 if bad else 0


def _cases(args: argparse.Namespace, env: Env) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (model, plan) x workload x sequence length: the rows and the coverage entries."""
    rows: list[dict[str, Any]] = []
    entries = []
    for spec, plan in args.cases:
        max_seq = max(s for w in args.workload for s in args.seqs[w])
        if env.rank == 0 and not args.quiet:
            print(f"{spec.name}/{plan}: building the model ({spec.params() / 1e9:.3f} B parameters, whole on every "
                  "rank) and parallelizing it", flush=True)
        template = build_template(spec, plan, env, args, max_seq)
        # dropless MoE dispatch reads its split sizes on the host: unbacked SymInts under torch.compile (restored after)
        scalars = spec.moe or torch._dynamo.config.capture_scalar_outputs
        with torch._dynamo.config.patch(capture_scalar_outputs=scalars):
            for workload in args.workload:
                for seq in args.seqs[workload]:
                    rows += run_case(Case(spec, plan, workload, seq, args.batch), template, env, args)
                entries.append(coverage_entry(spec, plan, workload, rows, env.world))
        del template
    return rows, entries


def main(argv: list[str] | None = None) -> int:
    return run(argv)
