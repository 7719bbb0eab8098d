"""Arguments of ``python -m flashoverlap_inductor.bench e2e``: parsing, device-dependent defaults and validation.

Validation errors are one line each (``UsageError``); ``e2e.main`` prints them on rank 0 and exits with status 2.
"""

from __future__ import annotations

import argparse

from flashoverlap_inductor import config

from . import models, plans
from .budget import Budget
from .runner import FUSING

BACKENDS = ("eager", "inductor", "inductor+async-tp", "flashoverlap", "flashoverlap-ro", "inductor-ro", "bound",
            "bound-ro")
DEFAULT_BACKENDS = ("eager", "inductor", "inductor+async-tp", "flashoverlap", "flashoverlap-ro", "bound")
WORKLOADS = ("train", "prefill")
# per device: (train seqs, prefill seqs, batch, steps, warmup)
DEFAULTS = {"cuda": ([4096], [2048, 4096, 8192, 16384], 1, 10, 3), "cpu": ([64], [64, 128], 2, 3, 1)}


class UsageError(ValueError):
    """A bad argument combination (one line)."""


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _names(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(out))
    return parse


RESERVED_SETTINGS = ("experiments", "fuse")  # set by --experiments / '@experiment' and --fuse, not as name=value


def _setting(item: str) -> str | None:
    """``name=value`` with the value as ``config`` checks it (one spelling per setting), or None where ``name`` is
    no setting, a reserved one, or ``value`` is not accepted (``config.split_options``)."""
    name, _, value = item.partition("=")
    if name in RESERVED_SETTINGS:
        return None
    try:
        checked = config.split_options({config.OPTION_PREFIX + name: value})[0]
    except ValueError:
        return None
    return f"{name}={checked[name]}"


def _backends(text: str) -> list[str]:
    """``--backends``: names from ``BACKENDS``; a fusing one may carry ``@item[+item...]``, each an experiment or a
    setting ``name=value`` (runner.variant; a value holds neither ``,`` nor ``+``; each setting at most once)."""
    out = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        kind, at, extra = name.partition("@")
        names = extra.split("+") if at else []
        items = [x if x in config.EXPERIMENTS else _setting(x) if "=" in x else None for x in names]
        settings = [x.partition("=")[0] for x in items if x and "=" in x]
        if kind not in BACKENDS or (at and (kind not in FUSING or None in items
                                            or len(settings) != len(set(settings)))):
            raise argparse.ArgumentTypeError(
                f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}; {' or '.join(FUSING)} may add "
                f"'@item[+item...]', each an experiment ({', '.join(config.EXPERIMENTS)}) or a setting name=value "
                f"once (e.g. gather_start=handshake; not {' or '.join(RESERVED_SETTINGS)})")
        names = items
        out.append(kind + ("@" + "+".join(sorted(set(names))) if names else ""))  # one spelling per row
    if not out:
        raise argparse.ArgumentTypeError(f"no backend in {text!r}")
    return list(dict.fromkeys(out))


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", type=_names(tuple(models.PRESETS)), default=None,
                   help="comma-separated presets: " + ", ".join(models.PRESETS)
                   + " (default: tiny-llama on CPU, llama3-8b on GPU)")
    for name, what in (("hidden", "hidden size"), ("intermediate", "MLP width (MoE: each expert's width)"),
                       ("layers", "decoder layers (cuts depth so the model fits)"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads"), ("head-dim", "head size (default hidden / heads)"),
                       ("vocab", "vocabulary size"), ("experts", "MoE: number of experts"),
                       ("top-k", "MoE: experts per token")):
        g.add_argument(f"--{name}", type=_positive, default=None, help=f"override the preset's {what}")
    g = p.add_argument_group("parallelism and workload")
    g.add_argument("--plan", type=_names(plans.PLANS), default=None,
                   help="comma-separated: tp (all_reduce), sp (all_gather + reduce_scatter), ep (MoE: all_to_all); "
                        "default: tp,sp for dense presets, ep for MoE presets")
    g.add_argument("--workload", type=_names(WORKLOADS), default=list(WORKLOADS),
                   help="comma-separated: train (forward + backward + AdamW step), prefill (no-grad forward)")
    g.add_argument("--seq", type=_ints, default=None,
                   help="comma-separated sequence lengths (tokens); default: train 4096, prefill 2048,4096,8192,16384 "
                        "on GPU; train 64, prefill 64,128 on CPU")
    g.add_argument("--batch", type=_positive, default=None, help="sequences per step (default 1 on GPU, 2 on CPU)")
    g.add_argument("--steps", type=_positive, default=None, help="measured steps per backend (default 10 GPU, 3 CPU)")
    g.add_argument("--warmup", type=int, default=None,
                   help="unmeasured steps after the first (compiling) call (default 3 GPU, 1 CPU)")
    g.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="build and warm every backend first, then take the measured steps in turns of N steps per "
                        "backend, the order rotating (bench/interleave.py: a drift during the run touches every "
                        "backend alike; every backend's model in memory at once); 0: one backend after another")
    g.add_argument("--turn-lead", type=int, default=None, metavar="L",
                   help="--interleave: unmeasured steps at the start of each turn (the turn's first inputs again), "
                        "so the rows time the steady state, not the step after a switch of model (default 1 under "
                        "--interleave; 0 keeps the values of a run without --interleave)")
    g.add_argument("--value-calls", type=_positive, default=1, metavar="N",
                   help="prefill: N value calls after the measured steps; a row is judged by the closest pair of "
                        "its calls and the reference's (a non-finite call is a mismatch), and its later calls are "
                        "compared with the reference's first (every prefill call takes the same input: calls that "
                        "disagree show a result that varies from call to call)")
    g.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (train)")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the token ids")
    g.add_argument("--expert-gemm", choices=("auto", "loop", "grouped"), default="auto",
                   help="ep: local experts as a loop of mm, or torch._grouped_mm (bf16 only); auto: grouped on CUDA "
                        "bf16 with several experts per rank")
    g = p.add_argument_group("backends")
    g.add_argument("--backends", type=_backends, default=list(DEFAULT_BACKENDS),
                   help="comma-separated, run side by side on the same inputs and initial weights: "
                        + ", ".join(BACKENDS) + "; a fusing one with '@exp+exp' runs with those experiments on too "
                        "(e.g. flashoverlap,flashoverlap@moe_plan_triton: an A/B in one run), and with "
                        "'@name=value' with that setting (e.g. flashoverlap@gather_start=handshake)")
    g.add_argument("--fuse", choices=("auto", "always", "never"), default="auto",
                   help="flashoverlap's fuse setting (auto: the cost model, fitted on H200s, decides; it fuses "
                        "nothing on CPU; always: for CPU correctness runs)")
    g.add_argument("--experiments", type=_names(tuple(config.EXPERIMENTS)), default=[],
                   help="flashoverlap's experiments setting, comma-separated (e.g. moe_p2p_cuda: the MoE ops' P2P "
                        "route on CUDA): " + ", ".join(config.EXPERIMENTS))
    g.add_argument("--cache", choices=("fresh", "shared", "keep"), default="fresh",
                   help="fresh: an empty Inductor cache per backend and case (fair compile times); shared: one "
                        "empty cache for the whole run (later backends reuse compiled kernels: faster, compile times "
                        "not comparable); keep: Inductor's own cache directory as it is (quickest on reruns)")
    g.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda when available")
    g.add_argument("--share-gpu", action="store_true",
                   help="cuda: every rank on the same GPU(s) (local rank modulo the GPUs), over gloo: a correctness "
                        "run on one GPU; its timings mean nothing (ranks share the GPU; gloo stages collectives)")
    g.add_argument("--timeout-s", type=_positive, default=900, help="process-group timeout (s)")
    g.add_argument("--time-budget-s", type=float, default=None, metavar="S",
                   help="end within S seconds of the start, with the rows measured by then: backends not built in "
                        "time show n/a, interleaved rows may hold fewer steps (whole rounds; bench/budget.py)")
    g.add_argument("--budget-start-unix", type=float, default=None, metavar="T",
                   help="--time-budget-s counts from this wall-clock time (s since the epoch; e.g. $(date +%%s) when "
                        "the run was launched) instead of from the argument check")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write every row, the coverage and the settings here (rank 0)")
    g.add_argument("--png", default=None, help="speedup chart per model x plan x workload x backend (matplotlib)")
    g.add_argument("--coverage", choices=("on", "off"), default="on",
                   help="print which GEMM -> collective pairs the graphs hold and which were fused (always in JSON)")
    g.add_argument("--trace", default=None, metavar="DIR",
                   help="after the timed steps, 2 more steps of every backend under torch.profiler: one Chrome "
                        "trace per case, backend and rank in DIR (open in Perfetto / chrome://tracing)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def resolve(args: argparse.Namespace, device: str, world: int) -> argparse.Namespace:
    """Fill the device-dependent defaults and validate against ``world``; raises ``UsageError``."""
    train_seqs, prefill_seqs, batch, steps, warmup = DEFAULTS[device]
    args.preset = args.preset or (["llama3-8b"] if device == "cuda" else ["tiny-llama"])
    args.batch = args.batch or batch
    args.steps = args.steps or steps
    args.warmup = warmup if args.warmup is None else args.warmup
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.interleave < 0:
        raise UsageError(f"--interleave must be >= 0, got {args.interleave}")
    args.turn_lead = (1 if args.interleave else 0) if args.turn_lead is None else args.turn_lead
    if args.turn_lead < 0:
        raise UsageError(f"--turn-lead must be >= 0, got {args.turn_lead}")
    if args.turn_lead and not args.interleave:
        raise UsageError(f"--turn-lead {args.turn_lead} needs --interleave (it leads each turn)")
    if not args.lr > 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")
    if args.time_budget_s is not None and not args.time_budget_s > 0:
        raise UsageError(f"--time-budget-s must be > 0, got {args.time_budget_s}")
    args.budget = Budget(args.time_budget_s) if args.budget_start_unix is None else \
        Budget(args.time_budget_s, args.budget_start_unix)  # the run's deadline
    args.seqs = {"train": args.seq or train_seqs, "prefill": args.seq or prefill_seqs}
    args.dtype = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    overrides = {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                 "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "vocab": args.vocab,
                 "experts": args.experts, "top_k": args.top_k}
    args.specs = []
    for name in args.preset:
        spec = models.PRESETS[name].with_overrides(**overrides)
        if (args.experts or args.top_k) and not spec.moe:
            raise UsageError(f"--experts/--top-k apply to MoE presets; {name} is dense")
        if spec.head_dim is None and spec.hidden % spec.heads:
            raise UsageError(f"{name}: hidden {spec.hidden} does not divide by {spec.heads} heads (give --head-dim)")
        if spec.head_size % 2:
            raise UsageError(f"{name}: head size {spec.head_size} must be even (rotary embedding)")
        args.specs.append(spec)
    args.cases = []  # (spec, plan)
    for spec in args.specs:
        for plan in args.plan or (["ep"] if spec.moe else ["tp", "sp"]):
            seqs = sorted({s for w in args.workload for s in args.seqs[w]})
            why = plans.check(spec, plan, world, seqs)
            if why:
                raise UsageError(why)
            if getattr(args, "share_gpu", False) and device == "cuda" and plan != "tp" and world > 1:
                raise UsageError(f"--share-gpu runs the tp plan only: with --plan {plan}, DTensor all-gathers CUDA "
                                 "tensors along the sequence dim through funcol, which crashes gloo (a segfault, "
                                 "torch 2.11); use --plan tp, or --device cpu")
            args.cases.append((spec, plan))
    return args


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python -m flashoverlap_inductor.bench e2e")
    add_arguments(p)
    return p
