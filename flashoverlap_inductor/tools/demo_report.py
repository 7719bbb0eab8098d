"""What the demo (``python -m flashoverlap_inductor.demo``, runner in ``demo.py``) tells its user: the checks of its
arguments (argparse types and one-line usage errors), the note of a CPU run, the report built from each backend's
results (one dict per backend, from rank 0 of that backend's processes) and the final ``PASS: ...`` / ``FAIL: ...``
line."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from flashoverlap_inductor.schedule.plan import GroupPlan

BACKENDS = ("inductor", "flashoverlap")  # what the demo compiles, each in its own fresh processes
BURST = 5  # forward calls per timed sample on GPU
# Largest max |compiled - eager| / max |eager| of the logits that passes, per dtype: about 6 bf16 steps at the
# largest logit (reductions reordered over 2+ layers; the demo's tolerance before), far above fp32's noise (~1e-6).
TOLERANCE = {"torch.bfloat16": 5e-2, "torch.float16": 5e-2, "torch.float32": 1e-3}
COMPILE_NOTE = ("compile: seconds from torch.compile to the first output (rank 0); each backend compiled in a fresh "
                "process with an empty Inductor cache")


# ------------------------------------------------------------------------------------------------ arguments


def whole(lo: int, why: str = ""):
    """An argparse ``type``: a whole number >= ``lo``; the error names the value and what is accepted."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"got {text}; accepted: a whole number >= {lo}{why}")
        return value

    parse.__name__ = f"whole number >= {lo}"
    return parse


def backends(text: str) -> tuple[str, ...]:
    """An argparse ``type``: a comma-separated subset of ``BACKENDS``, in the order given."""
    names = tuple(x.strip() for x in text.split(","))
    if not names or any(n not in BACKENDS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"got {text}; accepted: {', '.join(BACKENDS)}, or both comma-separated")
    return names


def model_sizes(dim: int, world_size: int) -> tuple[int, int, int]:
    """Attention heads, kv heads and FFN width of the demo's model at width ``dim`` on ``world_size`` ranks."""
    return max(world_size, dim // 64), max(world_size, dim // 256), (8 * dim) // 3 // 64 * 64


def shape_problem(dim: int, ws: int) -> str | None:
    """Why the model of width ``dim`` cannot be split over ``ws`` ranks (None: it can)."""
    heads, kv, hidden = model_sizes(dim, ws)
    parts = ((f"its {heads} attention heads (dim // 64) do", heads), (f"its {kv} kv heads (dim // 256) do", kv),
             (f"its FFN width {hidden} does", hidden))
    for what, size in parts:
        if size % ws:
            return f"{what} not split over {ws} ranks"
    if (dim // heads) % 2:
        return f"its head size {dim} // {heads} heads = {dim // heads} is odd (rotary embedding halves it)"
    if heads % kv:
        return f"its {heads} attention heads do not group over {kv} kv heads"
    return None


def shape_error(dim: int, ws: int, dim_given: bool) -> str | None:
    """The usage error (None: none) of a model of width ``dim`` on ``ws`` ranks, naming the argument to change:
    ``--dim`` if it was given, else ``--world-size``."""
    why = shape_problem(dim, ws)
    if why is None:
        return None
    sizes = [w for w in range(1, dim + 1) if shape_problem(dim, w) is None]
    sizes_text = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
    if not dim_given:
        return (f"argument --world-size: got {ws}, but at --dim {dim} {why}; accepted at --dim {dim}: {sizes_text} "
                "(or change --dim)")
    below = next((d for d in range(dim - 1, 23, -1) if shape_problem(d, ws) is None), None)
    above = next((d for d in range(dim + 1, 4 * dim + 4096) if shape_problem(d, ws) is None), None)
    near = " or ".join(str(d) for d in (below, above) if d is not None)
    return (f"argument --dim: got {dim}, but {why}; accepted with --world-size {ws}: e.g. {near} (or, at --dim {dim}, "
            f"--world-size {sizes_text})")


# --------------------------------------------------------------------------------------------------- report


def cpu_note(args: argparse.Namespace) -> str:
    """Three lines for a run on CPU ranks: what it shows, and which fuse mode it uses and why."""
    fuse = {"auto": "--fuse auto was given, so expect nothing fused.",
            "never": "--fuse never was given: nothing is fused.",
            "always": "--fuse always was given."}[args.fuse] if args.fuse_given else \
        "so on CPU this demo uses fuse='always' unless --fuse is given."
    return (f"note: CPU run ({args.cpu_reason}; gloo ranks): correctness only; the timings mean nothing here.\n"
            "      fuse='auto' asks a cost model fitted on H200 GPUs, which says nothing about a CPU (at the demo's "
            f"sizes it declines every site),\n      {fuse}")


def short_plans(text: str) -> str:
    """``v1;m=...;bounds=...`` plan strings in ``text`` as ``[2 groups, rows [...], tile MxN]``."""
    def repl(m: re.Match) -> str:
        try:
            p = GroupPlan.from_str(m.group(0))
        except (KeyError, ValueError):
            return m.group(0)
        return f"[{p.num_groups} groups, rows {list(p.row_bounds)}, tile {p.tile_m}x{p.tile_n}]"

    return re.sub(r"v1;m=\d+;n=\d+;tile=\d+x\d+;bounds=[\d,]+;kernel=[\w.-]*", repl, text)


def _by_prefix(counters: dict[str, int], *prefixes: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, n in counters.items():
        for prefix in prefixes:
            if key.startswith(prefix):
                name = key[len(prefix):]
                out[name] = out.get(name, 0) + n
    return dict(sorted(out.items()))


def _counts(c: dict[str, int]) -> str:
    return f"{sum(c.values())} ({', '.join(f'{k} {n}' for k, n in c.items())})"


def verdict(args: argparse.Namespace, results: list[dict]) -> tuple[bool, str]:
    """``(passed, line)``. FAIL when a backend's logits deviate from eager's beyond ``TOLERANCE`` (or are not
    finite), or when ``fuse='always'`` on 2+ ranks fused nothing (the pass missed the demo's GEMM -> all_reduce
    sites). What was fused: the flashoverlap backend's compile-time counters (``passes.counters``)."""
    dtype = results[0]["dtype"]
    tol = TOLERANCE.get(dtype, 5e-2)
    rel = {r["backend"]: r["rel_err"] for r in results}
    fo = next((r for r in results if r["backend"] == "flashoverlap"), None)
    fused = _by_prefix(fo["counters"], "fused:", "per_call:") if fo else {}
    per_call = sum(_by_prefix(fo["counters"], "per_call:").values()) if fo else 0
    if fused:
        what = f"fused {_counts(fused)}" + (f", {per_call} of them decided per call" if per_call else "")
    elif fo is None:
        what = "flashoverlap not run"
    else:
        skipped = _by_prefix(fo["counters"], "skip:")
        what = "fused nothing" + (f"; skipped {_counts(skipped)}" if skipped else "; nothing matched")
    problems = [f"{name} deviates from eager (max rel err {e:.1e} > {tol:.0e})"
                for name, e in rel.items() if not (math.isfinite(e) and e <= tol)]
    if fo is not None and not fused and args.fuse == "always" and args.world_size > 1:
        problems.append("fuse='always' fused no GEMM -> collective site")
    errs = ", ".join(f"{name} {e:.1e}" for name, e in rel.items())
    dt = dtype.removeprefix("torch.")
    if problems:
        return False, f"FAIL: {'; '.join(problems)} (max rel err: {errs}; tolerance {tol:.0e} for {dt}); {what}"
    names = " and ".join(rel)
    verb = "match" if len(rel) > 1 else "matches"
    return True, f"PASS: {names} {verb} eager (max rel err: {errs} <= {tol:.0e} for {dt}); {what}"


def report(args: argparse.Namespace, results: list[dict], say: Callable[[str], None] = print) -> bool:
    """Print what the pass did, the deviations from eager, the timings and the verdict; returns whether it
    passed."""
    fo = next((r for r in results if r["backend"] == "flashoverlap"), None)
    if fo is not None:
        say("\n-- what the pass did (rank 0) --")
        for key in sorted(fo["counters"]):
            say(f"  {key:28s} {fo['counters'][key]}")
        if not fo["counters"]:
            say("  (nothing matched)")
        say("\n-- matches, decisions and plans --")
        for line in dict.fromkeys(fo["lines"]):
            say("  " + short_plans(line.removeprefix("flashoverlap: ")))

    say(f"\n-- max |compiled - eager| (logits, max |eager| = {results[0]['scale']:.3g}, all ranks) --")
    for r in results:
        say(f"  {r['backend']:14s} {r['err']:.3e}   (relative {r['rel_err']:.1e})")

    burst = f" samples of {BURST} calls back to back" if args.device == "cuda" else ""
    say(f"\n-- forward time, median of {args.steps}{burst} (ms per call) --")
    for r in results:
        for name, ms in r["times"].items():
            extra = f"   (compile {r['compile_s']:.1f} s)" if name == r["backend"] else ""
            say(f"  {name:14s} {ms:9.3f}{extra}")
    say(f"  {COMPILE_NOTE}")
    if fo is not None:
        say(f"  fused-op runtime counters (rank 0): {dict(sorted(fo['stats'].items()))}")
    for r in results:
        if r.get("profile"):
            say(f"\n-- GPU time by kernel, 3 forward calls, {r['backend']} (rank 0) --")
            say(r["profile"])
    ok, line = verdict(args, results)
    say("\n" + line)
    return ok
