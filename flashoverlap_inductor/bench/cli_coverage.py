"""``python -m flashoverlap_inductor.bench coverage``: which collectives of a model the pass fuses, nothing timed.

    # your own model: pkg/module.py defines make(mesh) -> (module, args) or (module, args, kwargs)
    torchrun --nproc_per_node=2 -m flashoverlap_inductor.bench coverage --model pkg.module:make
    # a preset of the e2e harness under a plan, at several batch sizes
    torchrun --nproc_per_node=2 -m flashoverlap_inductor.bench coverage --preset tiny-llama --plan sp --batch 1,2

On CPU (gloo, ``--device cpu``) the pass runs with ``fuse="always"`` (what it can fuse); on GPUs with the settings'
own mode (``auto``: what it will fuse), unless ``--fuse`` says otherwise. Per case it prints the coverage table
(``model_coverage.Coverage``), then one summary line; ``--strict`` exits 1 when any collective is a near miss.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from . import models, plans
from .model_coverage import Coverage, model_coverage


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashoverlap_inductor.bench coverage",
                                description="What the flashoverlap pass fuses in a model's graphs (nothing timed). "
                                            "Launch with torchrun, one rank per GPU (or gloo ranks with --device cpu).")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", metavar="MODULE:FUNCTION",
                      help="FUNCTION(mesh) returns (module, args) or (module, args, kwargs), already parallelized "
                           "over the 1-D device mesh of the whole world")
    what.add_argument("--preset", choices=sorted(models.PRESETS), help="a model of the e2e harness")
    p.add_argument("--plan", choices=plans.PLANS, help="--preset: the parallel plan (default: sp, ep for MoE)")
    p.add_argument("--batch", type=_ints, default=[1, 2], help="--preset: batch sizes (default 1,2)")
    p.add_argument("--seq", type=int, default=64, help="--preset: sequence length (default 64)")
    p.add_argument("--layers", type=int, default=1, help="--preset: decoder layers (default 1)")
    p.add_argument("--workload", default="train,prefill", help="--preset: train and/or prefill")
    p.add_argument("--backward", choices=("auto", "on", "off"), default="auto",
                   help="--model: run the backward of the summed outputs (auto: when an output requires grad)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--fuse", choices=("auto", "always"), default=None,
                   help="the pass's mode (default: always on CPU, the settings' own on GPUs)")
    p.add_argument("--experiments", default="", help="comma-separated names of config.EXPERIMENTS the pass runs "
                   "under, or settings name=value (e.g. tp_sequence=off)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any collective is a near miss")
    p.add_argument("--json", help="write every case's coverage here (rank 0)")
    return p


def preset_cases(args: argparse.Namespace, mesh: Any, device: torch.device) -> list[Coverage]:
    """Every (batch, workload) of ``--preset`` under ``--plan``: one ``Coverage`` each."""
    from .runner import Prefill, TrainLoss

    spec = models.PRESETS[args.preset].with_overrides(layers=args.layers)
    plan = args.plan or ("ep" if spec.moe else "sp")
    why = plans.check(spec, plan, mesh.size(), [args.seq])
    if why:
        raise SystemExit(f"coverage: error: {why}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    for workload in args.workload.split(","):
        model = plans.apply(models.build(spec, device, dtype, 0, args.seq), spec, plan, mesh)
        module = TrainLoss(model) if workload == "train" else Prefill(model)
        for batch in args.batch:
            gen = torch.Generator().manual_seed(batch)
            ids, tgt = (torch.randint(0, spec.vocab, (batch, args.seq), generator=gen).to(device) for _ in range(2))
            title = f"{spec.name} / {plan} / {workload} at batch {batch}, seq {args.seq}"
            call = (ids, tgt) if workload == "train" else (ids,)
            with torch._dynamo.config.patch(capture_scalar_outputs=spec.moe or
                                            torch._dynamo.config.capture_scalar_outputs), \
                    torch.set_grad_enabled(workload == "train"):
                out.append(model_coverage(module, *call, options=_options(args), title=title))
    return out


def model_case(args: argparse.Namespace, mesh: Any) -> list[Coverage]:
    mod_name, _, fn_name = args.model.partition(":")
    if not fn_name:
        raise SystemExit("coverage: error: --model takes MODULE:FUNCTION")
    made = getattr(importlib.import_module(mod_name), fn_name)(mesh)
    module, call_args, call_kwargs = (*made, {})[:3] if len(made) == 2 else made
    backward = {"auto": None, "on": True, "off": False}[args.backward]
    return [model_coverage(module, *call_args, backward=backward, options=_options(args),
                           title=f"{args.model} / - / {'forward' if backward is False else 'as run'}",
                           **call_kwargs)]


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from .runner import split_experiments

    options: dict[str, Any] = {"flashoverlap.fuse": args.fuse} if args.fuse else {}
    names, settings = split_experiments(x for x in args.experiments.split(",") if x)
    if names:
        options["flashoverlap.experiments"] = names
    return {**options, **settings}


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh

    from .e2e import _device_type, init_distributed

    device_type = _device_type(args.device)
    owns, why = init_distributed(device_type, 300)
    if why:
        print(f"coverage: error: {why}", file=sys.stderr)
        return 2
    try:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        cases = preset_cases(args, mesh, device) if args.preset else model_case(args, mesh)
        if dist.get_rank() == 0:
            for cov in cases:
                print(cov)
            near, left = sum(c.near_misses for c in cases), sum(c.left_beside_gemm for c in cases)
            fused = sum(sum(c.fused().values()) for c in cases)
            print(f"coverage: {len(cases)} case(s), {dist.get_world_size()} rank(s), torch {torch.__version__}: "
                  f"{fused} fused op(s), {near} near miss(es), {left} collective(s) left beside a GEMM "
                  "(each with its skip reason above)")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump([{"title": c.title, "graphs": c.graphs, "events": c.events, "notes": c.notes,
                                "near_misses": c.near_misses, "left_beside_gemm": c.left_beside_gemm}
                               for c in cases], f, indent=1)
        return 1 if args.strict and any(c.near_misses for c in cases) else 0
    finally:
        if owns:
            dist.destroy_process_group()
