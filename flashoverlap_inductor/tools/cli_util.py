"""What the command lines (``tune``, ``build``) share: one-line errors for what a run needs (a CUDA GPU, the built
library, a process group) and for bad input files, and plain progress lines with an ETA.

An expected failure raises ``CliError``; the command's ``main`` prints ``"<prog>: <message>"`` on stderr (once per
torchrun job: rank 0 only, unless the problem is this rank's own) and exits with status 2, without a traceback.

Progress lines are plain text, one per step, flushed (they read the same in a terminal and in a CI log):
``[k/N] <what> (elapsed 1m05s, ETA 3m20s)``, ETA = mean time of one unit x units left / parallel jobs.

Importing this module imports neither torch nor the package (``build.py`` loads it by its file path when
``setup.py`` runs the build without the package installed). It reads no environment variable itself (only
``config`` and the command-line modules do): the callers pass theirs (``env``: torchrun's ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, and ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
BUILD_CMD = "python -m flashoverlap_inductor.build"
TORCHRUN = "run under torchrun --nproc_per_node=N (N >= 2)"
BENCH_FILE = ("a benchmark file", "torchrun --nproc_per_node=N examples/bench_ops.py --json FILE")
RECORDS_FILE = ("a tune search record file", "torchrun --nproc_per_node=N -m flashoverlap_inductor.tune search ... "
                                         "--record FILE")
BANDWIDTH_FILE = ("a bandwidth file (flashoverlap.bandwidth/1)",
                  "torchrun --nproc_per_node=N -m flashoverlap_inductor.tune bandwidth")
GEMM_FILE = ("a GEMM model file (flashoverlap.gemm/1)",
             "python -m flashoverlap_inductor.tune.import_anchor, updated by tune gemm")
PLANS_FILE = ("a plans file (flashoverlap.plans/1)", "torchrun --nproc_per_node=N -m flashoverlap_inductor.tune search")


class CliError(ValueError):
    """An expected failure of a command line: one line for the user, exit status 2, no traceback.
    ``every_rank``: the problem is this rank's own (say it on every rank, not only on rank 0). A ``ValueError``, as
    the errors of the loaders that raise it were (``json.JSONDecodeError`` is one)."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


def report(prog: str, exc: CliError, env: Mapping[str, str]) -> int:
    """Print ``"<prog>: <message>"`` on stderr (rank 0 of a torchrun job, or every rank for a rank's own problem);
    returns the exit status, 2."""
    if exc.every_rank or env_int(env, "RANK", 0) == 0:
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
    return EXIT_USAGE


# --------------------------------------------------------------------------------------------- what a run needs


def cuda_problem(env: Mapping[str, str]) -> str | None:
    """Why this process cannot use its CUDA GPU (``LOCAL_RANK``'s, an sm90 one), or None."""
    import torch

    need = "needs a CUDA GPU (sm90: H100/H200)"
    if torch.version.cuda is None:
        return f"{need}; none is visible here (torch {torch.__version__} is built without CUDA)"
    if not torch.cuda.is_available():
        hidden = " (CUDA_VISIBLE_DEVICES is empty)" if env.get("CUDA_VISIBLE_DEVICES") == "" else ""
        return f"{need}; none is visible here{hidden}"
    local, count = env_int(env, "LOCAL_RANK", 0), torch.cuda.device_count()
    if local >= count:
        return f"{need} per rank; local rank {local} has none ({count} visible): use --nproc_per_node <= {count}"
    major, minor = torch.cuda.get_device_capability(local)
    if (major, minor) != (9, 0):
        return f"{need}; GPU {local} is {torch.cuda.get_device_name(local)} (sm{major}{minor})"
    return None


def library_problem(cuda_ok: bool) -> str | None:
    """Why the built library cannot be used, or None (None too when only a GPU could tell: ``cuda_ok`` False and
    the file exists)."""
    from flashoverlap_inductor.native import kernels

    if kernels.available():
        return None
    path = kernels.library_path()
    if not path.is_file():
        return f"needs the built library ({path} is missing): {BUILD_CMD}"
    if not cuda_ok:
        return None
    try:
        kernels.library()
    except kernels.KernelLibraryError as exc:
        return f"needs a working built library ({exc}): rebuild with {BUILD_CMD}"
    return None


def ranks_problem(min_ranks: int, env: Mapping[str, str]) -> str | None:
    """Why this run has no process group of at least ``min_ranks`` ranks coming (torchrun's ``WORLD_SIZE``, or a
    group already initialized), or None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = env_int(env, "WORLD_SIZE", 1)
    if world >= min_ranks:
        return None
    got = f", this run has {world}" if "WORLD_SIZE" in env or world > 1 else ""
    return f"needs >= {min_ranks} ranks{got}: {TORCHRUN}"


def nccl_problem() -> str | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return None
    if not dist.is_available() or not dist.is_nccl_available():
        return "needs torch.distributed with NCCL, which this torch build lacks: install a CUDA build of torch"
    return None


def require(env: Mapping[str, str], cuda: bool = False, library: bool = False, ranks: int = 0) -> None:
    """Raise ``CliError`` naming everything that is missing of: a CUDA sm90 GPU for this rank, the built library
    and a process group of ``ranks`` ranks (0: none needed); each with how to get it. ``env``: the process's
    environment (torchrun's variables)."""
    problems = []
    cuda_bad = cuda_problem(env) if cuda else None
    problems.append(cuda_bad)
    if library:
        problems.append(library_problem(cuda_ok=cuda and cuda_bad is None))
    if ranks:
        problems.append(ranks_problem(ranks, env))
        if cuda and cuda_bad is None:
            problems.append(nccl_problem())
    problems = [p for p in problems if p]
    if problems:
        own = cuda_bad is not None and "local rank" in cuda_bad
        raise CliError(". Also ".join(problems), every_rank=own)


# --------------------------------------------------------------------------------------------- input files


def read_json(path: str | Path, option: str, kind: tuple[str, str]) -> Any:
    """The parsed JSON of the file ``path`` given as ``option``; ``CliError`` naming the file, what is wrong with it
    and what writes a valid one (``kind`` = (what it should be, the command that writes one)) otherwise."""
    what, producer = kind
    hint = f"{what} comes from: {producer}"
    p = Path(path)
    where = f"{option} {path}" if option else str(path)
    if not p.exists():
        raise CliError(f"{where}: no such file; {hint}")
    if p.is_dir():
        raise CliError(f"{where}: is a folder, not a file; {hint}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{where}: cannot read it ({getattr(exc, 'strerror', None) or exc}); {hint}") from None
    if not text.strip():
        raise CliError(f"{where}: the file is empty; {hint}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{where}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); {hint}") from None


def read_data_file(path: str | Path, option: str, kind: tuple[str, str]) -> dict[str, Any] | None:
    """The JSON object of a data file that may not exist yet (None then); ``CliError`` when it exists but is not a
    readable JSON object."""
    if not Path(path).exists():
        return None
    doc = read_json(path, option, kind)
    if not isinstance(doc, dict):
        raise malformed(path, option, kind, f"a JSON {type(doc).__name__}, not an object")
    return doc


def malformed(path: str | Path, option: str, kind: tuple[str, str], problem: str) -> CliError:
    """``CliError`` for a file that parsed but is not ``kind``: ``problem`` says what is missing or wrong."""
    what, producer = kind
    where = f"{option} {path}" if option else str(path)
    return CliError(f"{where}: not {what} ({problem}); one comes from: {producer}")


def read_bench(path: str | Path, option: str = "--bench") -> dict[str, Any]:
    """A benchmark JSON (``examples/bench_ops.py --json``): an object with ``meta.gpu`` and ``rows``, each row an
    object with ``op``, ``m``, ``n``, ``k`` and ``world``; ``CliError`` otherwise."""
    doc = read_json(path, option, BENCH_FILE)
    if not isinstance(doc, dict):
        raise malformed(path, option, BENCH_FILE, f"a JSON {type(doc).__name__}, not an object")
    for key, typ, name in (("meta", dict, "object"), ("rows", list, "list")):
        if not isinstance(doc.get(key), typ):
            raise malformed(path, option, BENCH_FILE, f"no {key!r} {name}")
    if not isinstance(doc["meta"].get("gpu"), str):
        raise malformed(path, option, BENCH_FILE, "'meta' has no 'gpu' name")
    for i, row in enumerate(doc["rows"]):
        lacks = [k for k in ("op", "m", "n", "k", "world") if not isinstance(row, dict) or k not in row]
        if lacks:
            raise malformed(path, option, BENCH_FILE, f"row {i} lacks {', '.join(map(repr, lacks))}")
    return doc


def check_records(path: str | Path, records: Sequence[Any], option: str = "--records") -> None:
    """``CliError`` unless every record of a ``--record`` file has its shape and a list of candidates."""
    for i, rec in enumerate(records):
        lacks = [k for k in ("collective", "m", "n", "k", "world_size", "candidates")
                 if not isinstance(rec, dict) or k not in rec]
        if lacks:
            raise malformed(path, option, RECORDS_FILE, f"record {i} lacks {', '.join(map(repr, lacks))}")
        if not isinstance(rec["candidates"], list) or not all(isinstance(c, dict) and "plan" in c
                                                              for c in rec["candidates"]):
            raise malformed(path, option, RECORDS_FILE, f"record {i} has candidates without a 'plan'")


# --------------------------------------------------------------------------------------------- progress


def duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"``, ``"1h02m"``; ``"?"`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_s(done: int, total: int, unit_s: float | None, jobs: int = 1) -> float:
    """Seconds left: ``unit_s`` (mean seconds of one unit) x units left / ``jobs``; nan when ``unit_s`` is unknown."""
    if unit_s is None or not math.isfinite(unit_s):
        return math.nan
    return unit_s * max(0, total - done) / max(1, jobs)


def progress_line(done: int, total: int, what: str, elapsed_s: float, unit_s: float | None = None,
                  jobs: int = 1) -> str:
    """``"[k/N] <what> (elapsed 1m05s, ETA 3m20s)"`` (see ``eta_s``; ``ETA ?`` while no unit time is known)."""
    width = len(str(total))
    return (f"[{done:>{width}}/{total}] {what} (elapsed {duration(elapsed_s)}, "
            f"ETA {duration(eta_s(done, total, unit_s, jobs))})")


def parse_shape_list(text: str) -> str:
    """An argparse ``type`` for ``MxNxK[,MxNxK...]`` or ``grid``: the text itself when it parses."""
    import argparse

    if text != "grid":
        for part in text.split(","):
            dims = part.lower().split("x")
            if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
                raise argparse.ArgumentTypeError(f"{part!r} is not MxNxK (three positive integers, e.g. "
                                                 f"8192x8192x8192); give MxNxK[,MxNxK...] or grid")
    return text


def parse_int_list(text: str) -> str:
    """An argparse ``type`` for comma-separated non-negative integers: the text itself when it parses."""
    import argparse

    if not all(x.strip().isdigit() for x in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: give non-negative integers separated by commas, e.g. 0,16")
    return text
