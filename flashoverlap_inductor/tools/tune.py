"""Tuner CLI: measure the NCCL bandwidth curves, the signal-GEMM configurations, and the best wave groups of one
shape, and write them as the cost model's data files (see ``tune.schemas`` for the files and formats).

    torchrun --nproc_per_node=W -m flashoverlap_inductor.tune bandwidth [--out FILE] [--quick]
    python -m flashoverlap_inductor.tune gemm [--out FILE] [--shapes 8192x8192x8192,...] [--free 0,8,16,24,32]
    torchrun --nproc_per_node=W -m flashoverlap_inductor.tune search --collective all_reduce --shape 8192x8192x8192
        [--mode both|exhaustive|predictive] [--max-units 8] [--out-dir DIR] [--record FILE] [--time-budget-s S]
    python -m flashoverlap_inductor.tune fit --bench bench_w4.json [bench_w2.json] [--records FILE ...] [--write]

``bandwidth``: every collective (all_reduce in place, reduce_scatter, all_to_all_single, all_gather; bf16) from
64 KiB to 1 GiB at 4 points per octave, world size = the torchrun world; merged into the GPU's bandwidth file (other
world sizes kept). ``gemm``: one GPU; cuBLAS and every compiled configuration (bf16, B as a Linear weight, 8 wave groups
signalled) on each shape and with SMs left free; refits ``fused.kernel_efficiency`` and writes ``tuned_kernels``.
``search``: exhaustive (every composition of at most ``--max-units`` units) and/or predictive (the cost model's
argmin) candidates, all measured as the fused op on the torchrun world, the fastest refined and written as a
tuned plan with its measured fused and sequential times (cuBLAS then NCCL, timed inside every batch beside the
plans: a baseline timed apart ran at other clocks and skewed the verdict by up to 13%); ``--record`` keeps every
candidate's times. ``fit`` (CPU): the fused-path parameters of the GEMM model fitted to ``examples/bench_ops.py``
results and to search records (``tune.fit``). Defaults write into the data directory the cost model
reads (``config.config_dir`` or the package's ``configs/``); ``--out``/``--out-dir`` write elsewhere (a
bandwidth file that does not exist yet starts from the data directory's one). Times are CUDA-event medians,
max over ranks (``tune.measure``).

Before it touches a GPU, each command checks what it needs (a CUDA sm90 GPU, the built library, a torchrun world
of >= 2 ranks) and the data files it will merge into, and stops with one line saying what is missing and how to
get it (exit status 2; ``cli_util``). Long loops print ``k/N`` progress lines with an ETA.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.cost_model.pipeline import CostModel
from flashoverlap_inductor.cost_model.schema import ConfigError
from flashoverlap_inductor.routes import unfused
from flashoverlap_inductor.schedule.plan import chunks_for
from flashoverlap_inductor.tools import cli_util as cli
from flashoverlap_inductor.tune import fit as tune_fit
from flashoverlap_inductor.tune import measure as tm
from flashoverlap_inductor.tune import schemas as docs

GRID = [(m, n, k) for m in (2048, 4096, 8192, 16384) for n, k in ((8192, 8192), (8192, 7168), (8192, 14336),
                                                                   (4096, 4096))]
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
SEQ = "<seq>"  # the sequential baseline's name among a search batch's variants (no plan string looks like it)
DEVICE = "cuda"  # "cpu" only for the CPU dry runs of tests/test_tune_cpu.py (gloo, simulated kernels)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"8192x8192x8192,4096x4096x4096"`` -> [(m, n, k), ...]; ``"grid"`` -> the benchmark grid."""
    if text == "grid":
        return list(GRID)
    out = []
    for part in text.split(","):
        m, n, k = (int(x) for x in part.lower().split("x"))
        out.append((m, n, k))
    return out


_created_group: list[bool] = []


def init_distributed() -> tuple[int, int]:
    """NCCL process group from torchrun's environment (one GPU per local rank), unless one exists; (rank, world)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        _created_group.append(True)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                                timeout=datetime.timedelta(seconds=int(os.environ.get("FO_PG_TIMEOUT_S", "300"))))
        dist.all_reduce(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
    return tm.world()


def data_dir() -> Path:
    from flashoverlap_inductor.cost_model import registry

    return registry.data_dir()


def _say(rank: int, *args: object) -> None:
    if rank == 0:
        print(*args, flush=True)


# --------------------------------------------------------------------------------------------- bandwidth


def cmd_bandwidth(args: argparse.Namespace) -> int:
    cli.require(os.environ, cuda=DEVICE == "cuda", ranks=2)
    if args.out:  # a malformed --out fails now, not after the measurement
        cli.read_data_file(args.out, "--out", cli.BANDWIDTH_FILE)
    rank, world = init_distributed()
    gpu, sms = torch.cuda.get_device_name(), torch.cuda.get_device_properties(None).multi_processor_count
    base = tm.on_rank0(rank, lambda: docs.bandwidth_base(data_dir(), args.out, gpu, sms, world))
    sizes = docs.bandwidth_sizes(args.min_bytes, args.max_bytes, args.points_per_octave, world)
    _say(rank, f"tune bandwidth: {gpu} x{world}, {len(sizes)} sizes {sizes[0]}..{sizes[-1]} bytes, {args.collectives}")
    elems = sizes[-1] // 2
    x = torch.randn(elems, device=DEVICE, dtype=torch.bfloat16)
    y = torch.empty(elems // world, device=DEVICE, dtype=torch.bfloat16)
    z = torch.empty_like(x)
    timer = tm.Timer(rounds=args.rounds, target_ms=args.target_ms, min_iters=2, max_iters=40, spin_ms=0.05)
    fns = {
        "all_reduce": lambda n: dist.all_reduce(x[:n]),
        "reduce_scatter": lambda n: unfused.reduce_scatter_into(y[:n // world], x[:n]),
        "all_to_all": lambda n: dist.all_to_all_single(z[:n], x[:n]),
        "all_gather": lambda n: dist.all_gather_into_tensor(z[:n], x[:n // world]),
    }
    curves: dict[str, list[list[float]]] = {c: [] for c in args.collectives}
    bar = tm.Progress(len(sizes), f"bandwidth w{world}", enabled=rank == 0)
    for nbytes in sizes:
        n = nbytes // 2
        got = timer.measure({c: (lambda c=c, n=n: fns[c](n)) for c in args.collectives})
        for c in args.collectives:
            curves[c].append([nbytes, got[c].ms])
        bar.update(note=" ".join(f"{c[:2]}={got[c].ms:.3f}" for c in args.collectives))
    bar.close()
    if rank == 0:
        out = Path(args.out) if args.out else docs.bandwidth_path(data_dir(), gpu)
        note = (f"flashoverlap_inductor.tune bandwidth (torch {torch.__version__}, NCCL "
                f"{'.'.join(map(str, torch.cuda.nccl.version()))}; CUDA-event medians, max over ranks)")
        doc = docs.merge_bandwidth(base, gpu, sms, world, curves, note)
        print(f"wrote {docs.write_json(out, doc)}")
        print("bytes        " + " ".join(f"{c:>14}" for c in args.collectives))
        for i, nbytes in enumerate(sizes):
            print(f"{nbytes:>12} " + " ".join(f"{curves[c][i][1]:14.4f}" for c in args.collectives))
    return 0


# --------------------------------------------------------------------------------------------- gemm


def cmd_gemm(args: argparse.Namespace) -> int:
    from flashoverlap_inductor.native import kernels

    if int(os.environ.get("RANK", "0")) != 0:  # one GPU is enough (no process group): other ranks idle
        return 0
    cli.require(os.environ, cuda=DEVICE == "cuda", library=True)
    if args.out:  # a malformed --out fails now, not after the measurement
        cli.read_data_file(args.out, "--out", cli.GEMM_FILE)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kernels.ready(torch.cuda.current_device())
    gpu, sms = torch.cuda.get_device_name(), torch.cuda.get_device_properties(None).multi_processor_count
    out_path, base = docs.gemm_base(data_dir(), args.out, gpu)
    infos = [i for i in kernels.configs() if ("bfloat16", "nk") in i.variants
             and any(fnmatch.fnmatch(i.name, p) for p in args.configs)]
    if not infos:
        raise cli.CliError(f"no bf16 configuration of the library matches --configs {' '.join(args.configs)} "
                           f"(it has: {' '.join(i.name for i in kernels.configs())})")
    shapes = parse_shapes(args.shapes)
    frees = sorted({int(x) for x in args.free.split(",")})
    timer = tm.Timer(rounds=args.rounds, target_ms=args.target_ms, spin_ms=0.3, distributed=False)
    samples: list[docs.GemmSample] = []
    cublas: list[tuple[int, int, int, float]] = []
    print(f"tune gemm: {gpu}, {len(infos)} configurations x {len(frees)} SM settings x {len(shapes)} shapes",
          flush=True)
    bar = tm.Progress(len(shapes), "gemm", every_s=0.0)
    for m, n, k in shapes:
        got = tm.time_gemm_shape(m, n, k, infos, [sms - f for f in frees], timer, DEVICE)
        cublas.append((m, n, k, got.pop("cublas")))
        for info in infos:
            for free in frees:
                samples.append(docs.GemmSample(info.name, info.tile_m, info.tile_n, m, n, k, sms - free,
                                               got[f"{info.name}@{sms - free}"]))
        best = min(got, key=got.__getitem__)
        bar.update(note=f"{m}x{n}x{k}: cublas {cublas[-1][3]:.3f} best {best} {got[best]:.3f}")
    bar.close()
    from flashoverlap_inductor.cost_model.search import DEFAULT_TILE

    doc = docs.update_gemm_doc(base, samples, sms, DEFAULT_TILE, f"flashoverlap_inductor.tune gemm on {gpu}",
                               cublas)
    print(f"wrote {docs.write_json(out_path, doc)}")
    tk = doc["tuned_kernels"]
    print(f"kernel_efficiency {doc['fused']['kernel_efficiency']}; best by tile {tk['best_by_tile']}; "
          f"SM scaling {tk['sm_scaling']}")
    return 0


# --------------------------------------------------------------------------------------------- search


def cmd_search(args: argparse.Namespace) -> int:
    """Every shape of ``--shape`` in turn (no new shape once ``--time-budget-s`` has passed); one plans file, and
    with ``--record`` one records file (``flashoverlap.search_records/1``) holding every searched shape."""
    import time

    from flashoverlap_inductor.cost_model import model_for

    cli.require(os.environ, cuda=DEVICE == "cuda", library=True, ranks=2)
    rank, world = init_distributed()
    gpu, sms = torch.cuda.get_device_name(), torch.cuda.get_device_properties(None).multi_processor_count
    path = docs.plans_path(Path(args.out_dir) if args.out_dir else data_dir(), gpu, world)
    note = f"flashoverlap_inductor.tune search on {gpu}"
    tm.on_rank0(rank, lambda: docs.plans_base(path, gpu, sms))
    model = model_for(gpu)[0]
    start, records, shapes = time.monotonic(), [], parse_shapes(args.shape)
    for i, shape in enumerate(shapes):
        if not tm.agree([time.monotonic() - start <= args.time_budget_s])[0]:  # all ranks stop at one shape
            _say(rank, f"tune search: time budget spent; {len(shapes) - i} shapes not searched")
            break
        _say(rank, f"tune search: shape {i + 1}/{len(shapes)} (elapsed {cli.duration(time.monotonic() - start)})")
        rc, entry, record = search_shape(args, shape, rank, world, gpu, sms, model)
        if rc:
            return rc
        if rank == 0:
            doc = docs.merge_plans(cli.read_data_file(path, "", cli.PLANS_FILE), gpu, sms, [entry], note)
            print(f"wrote {docs.write_json(path, doc)}")
            if args.record:  # every candidate's times, for ranking-aware calibration of the cost model
                records.append(record)
                print(f"wrote {docs.write_json(Path(args.record), docs.records_doc(records))}")
    return 0


def search_shape(args: argparse.Namespace, shape: tuple[int, int, int], rank: int, world: int, gpu: str, sms: int,
                 model: CostModel) -> tuple[int, dict, dict]:
    """One shape's search: ``(rc, plans entry, record)``; rank 0 prints the summary line."""
    from flashoverlap_inductor.cost_model.search import DEFAULT_TILE, predictive_search

    (m, n, k), coll, dtype_name = shape, args.collective, args.dtype
    dtype = getattr(torch, dtype_name)
    chunks = chunks_for(coll, m, world)
    predictive = predictive_search(model, coll, m, n, k, dtype_name, world, chunks, tile_m=DEFAULT_TILE[0],
                                   tile_n=DEFAULT_TILE[1], max_units=args.max_units).plan
    candidates = docs.candidate_plans(coll, m, n, world, DEFAULT_TILE, args.max_units) \
        if args.mode in ("both", "exhaustive") else []
    _say(rank, f"tune search: {coll} {m}x{n}x{k} {dtype_name} x{world} on {gpu}: {len(candidates)} exhaustive "
               f"candidates + predictive {predictive.row_bounds}")
    gen = torch.Generator(device=DEVICE).manual_seed(1234 + rank)
    a = torch.randn(m, k, device=DEVICE, dtype=dtype, generator=gen)
    w = (torch.randn(n, k, device=DEVICE, dtype=dtype, generator=gen) / math.sqrt(k)).to(dtype)
    b, group = w.t(), dist.group.WORLD
    # wave-group plans are the NCCL route's (the peer route ignores them): every candidate is timed on that route
    key = config.current().replace(transport="nccl").key()

    def fused(plan: str):
        return lambda: routes.dispatch(coll, a, b, None, group, plan, key, [m, n])

    def seq_fn():  # the unfused graph: cuBLAS then one collective
        return unfused.run(coll, a, b, None, group)
    ref, got = seq_fn(), fused(predictive.to_str())()
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    ok = tm.agree([err < 2e-2])[0]
    if not ok:
        print(f"tune search: the fused op disagrees with cuBLAS+NCCL (rel err {err:.3g} on rank {rank}); abort",
              file=sys.stderr)
        return 1, {}, {}
    fused_before = routes.stats["route:nccl"]
    # progress in plan-rounds (a refined plan costs its rounds); an upper bound: the confirmation may not run
    first = len(set(candidates) | {predictive})
    total = first + (min(first, args.refine + 1) * args.rounds if args.rounds > 0 else 0) + 2 * args.confirm_rounds
    bar = tm.Progress(total, f"search {m}x{n}x{k}", enabled=rank == 0)
    seq_runs: list[list[float]] = []  # per measure call: the sequential baseline timed inside each batch

    def measure(plans: list, rounds: int) -> list[float]:
        timer = tm.Timer(rounds=rounds, target_ms=args.target_ms, spin_ms=0.3)
        out: list[float] = []
        seq_runs.append([])
        for i in range(0, len(plans), 16):  # batches keep each interleaved set small
            part = plans[i:i + 16]
            got = timer.measure({**{p.to_str(): fused(p.to_str()) for p in part}, SEQ: seq_fn})
            out += [got[p.to_str()].ms for p in part]
            seq_runs[-1].append(got[SEQ].ms)
            bar.update(len(part) * rounds)
        return out

    def predict(p) -> float:
        return model.fused(p, coll, chunks, k, dtype_name, world).total_ms

    report = docs.search(candidates, measure, predict=predict, predictive=predictive, refine_top=args.refine,
                         refine_rounds=args.rounds, confirm_rounds=args.confirm_rounds)
    # timed beside the finalists, as their times were (same clocks and heat): the refinement batch (the second
    # measure call; the first when there is no refinement)
    seq_ms = tm.median(seq_runs[1 if args.rounds > 0 else 0])
    bar.close()
    if routes.stats["route:nccl"] == fused_before:
        print(f"tune search: the fused path never ran ({dict(routes.stats)}); abort", file=sys.stderr)
        return 1, {}, {}
    entry = {"world_size": world, "collective": coll, "dtype": dtype_name, "m": m, "n": n, "k": k,
             "plan": report.best.to_str(), "measured_fused_ms": round(report.best_ms, 5),
             "measured_seq_ms": round(seq_ms, 5), "predicted_fused_ms": round(predict(report.best), 5),
             "mode": args.mode, "evaluated": len(report.measured)}
    record = report.record(gpu=gpu, sm_count=sms, world_size=world, collective=coll, dtype=dtype_name, m=m, n=n,
                           k=k, max_units=args.max_units, measured_seq_ms=seq_ms)
    if rank == 0:
        errs = report.model_errors
        print(f"best {report.best.row_bounds}: {report.best_ms:.4f} ms fused vs {seq_ms:.4f} ms sequential "
              f"({seq_ms / report.best_ms:.3f}x); predictive {report.predictive_ms:.4f} ms (relative performance "
              f"{report.relative_performance:.3f}, refinement batch {report.refined_relative_performance:.3f}); "
              f"cost model median |pred-meas|/meas "
              f"{tm.median(errs) if errs else math.nan:.3f} over {len(errs)} plans", flush=True)
    return 0, entry, record


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashoverlap_inductor.tune", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bw = sub.add_parser("bandwidth", help="NCCL time per collective and size at the torchrun world size (>= 2 GPUs)")
    bw.add_argument("--out", metavar="FILE", help="bandwidth file to merge into and write (default: the data "
                    "directory's bandwidth_<gpu>.json)")
    bw.add_argument("--collectives", nargs="+", default=[*COLLECTIVES, "all_gather"],
                    choices=[*COLLECTIVES, "all_gather"],
                    help="collectives to measure (default: all four; all_gather's bytes are the gathered buffer's)")
    bw.add_argument("--min-bytes", type=int, metavar="BYTES", default=64 * docs.KIB,
                    help="smallest message, bytes (default: %(default)s = 64 KiB)")
    bw.add_argument("--max-bytes", type=int, metavar="BYTES", default=docs.GIB,
                    help="largest message, bytes (default: %(default)s = 1 GiB)")
    bw.add_argument("--points-per-octave", type=int, metavar="N", default=4,
                    help="sizes per doubling (default: %(default)s)")
    bw.add_argument("--rounds", type=int, metavar="N", default=3,
                    help="interleaved timing rounds per size (default: %(default)s)")
    bw.add_argument("--target-ms", type=float, metavar="MS", default=15.0,
                    help="timed ms per size, collective and round (default: %(default)s)")
    bw.add_argument("--quick", action="store_true", help="2 rounds of ~4 ms (same sizes)")
    gm = sub.add_parser("gemm", help="per-configuration GEMM times and their scaling with SMs left free (one GPU)")
    gm.add_argument("--out", metavar="FILE", help="GEMM model file to update (default: the data directory's "
                    "gemm_<gpu>.json)")
    gm.add_argument("--shapes", default="grid", type=cli.parse_shape_list, metavar="MxNxK[,...]|grid",
                    help=f"GEMM shapes to time; grid = the {len(GRID)}-shape benchmark grid (default: %(default)s)")
    gm.add_argument("--free", default="0,8,16,24,32", type=cli.parse_int_list, metavar="N[,N...]",
                    help="SMs left free, comma separated (default: %(default)s)")
    gm.add_argument("--configs", nargs="+", default=["*"], metavar="GLOB",
                    help="fnmatch globs of configuration names (default: every bf16 configuration)")
    gm.add_argument("--rounds", type=int, metavar="N", default=3,
                    help="interleaved timing rounds per shape (default: %(default)s)")
    gm.add_argument("--target-ms", type=float, metavar="MS", default=6.0,
                    help="timed ms per variant and round (default: %(default)s)")
    gm.add_argument("--quick", action="store_true", help="4 shapes, 0 and 16 SMs free, 2 rounds")
    se = sub.add_parser("search", help="measure the wave groups of one shape and write the best plan (>= 2 GPUs)")
    se.add_argument("--collective", required=True, choices=COLLECTIVES, help="the collective after the GEMM")
    se.add_argument("--shape", required=True, type=cli.parse_shape_list, metavar="MxNxK[,...]|grid",
                    help="MxNxK[,MxNxK...] or grid: searched one after the other")
    se.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="operand dtype (default: %(default)s)")
    se.add_argument("--mode", default="both", choices=("both", "exhaustive", "predictive"),
                    help="candidates: every composition of the units, the cost model's argmin, or both (default: "
                    "%(default)s)")
    se.add_argument("--max-units", type=int, metavar="N", default=8,
                    help="row units of the exhaustive search: 2^(units-1) candidates (default: %(default)s)")
    se.add_argument("--refine", type=int, metavar="N", default=5,
                    help="fastest candidates re-measured (default: %(default)s)")
    se.add_argument("--rounds", type=int, metavar="N", default=5,
                    help="rounds of the refinement batch; 0: no refinement (default: %(default)s)")
    se.add_argument("--confirm-rounds", type=int, metavar="N", default=5,
                    help="rounds of the batch that re-measures the best and the predictive plan; 0: none (default: "
                    "%(default)s)")
    se.add_argument("--target-ms", type=float, metavar="MS", default=8.0,
                    help="timed ms per plan and round (default: %(default)s)")
    se.add_argument("--out-dir", metavar="DIR", help="data directory to write plans/<gpu>_w<world>.json into "
                    "(default: the data directory)")
    se.add_argument("--record", metavar="FILE",
                    help="also write every candidate's measured, refined and predicted ms (JSON; for tune fit "
                    "--records)")
    se.add_argument("--time-budget-s", type=float, metavar="S", default=math.inf,
                    help="seconds after which no new shape starts (default: no limit)")
    tune_fit.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "quick", False):
        if args.command == "bandwidth":
            args.rounds, args.target_ms = 2, 4.0
        elif args.command == "gemm":
            args.rounds, args.free = 2, "0,16"
            args.shapes = args.shapes if args.shapes != "grid" else "4096x8192x8192,8192x8192x8192,16384x8192x7168," \
                                                                    "2048x4096x4096"
    try:
        return {"bandwidth": cmd_bandwidth, "gemm": cmd_gemm, "search": cmd_search,
                "fit": tune_fit.cmd_fit}[args.command](args)
    except cli.CliError as exc:  # an expected problem (what the run needs, a bad input file): one line, status 2
        return cli.report(f"tune {args.command}", exc, os.environ)
    except ConfigError as exc:  # a malformed file of the cost model's data directory (the message names it)
        return cli.report(f"tune {args.command}", cli.CliError(f"the cost model's data: {exc}"), os.environ)
    finally:
        if _created_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            _created_group.clear()


if __name__ == "__main__":
    sys.exit(main())
