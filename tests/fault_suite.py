"""Fault injection for the fused ops' failure contract on CPU (gloo, 2- and 3-rank worlds).

The contract (``docs/design.md``, ``flashoverlap_inductor.errors``): a fault on one rank reaches every rank as a
clear exception, no rank returns a wrong tensor, and the next call works with no manual reset. Each case injects
one fault into direct ``torch.ops.flashoverlap.*`` calls and then makes the next matching call on every rank:

* ``raise``: a rank's row GEMM (``routes.cpu._RowGemm``) raises at a chosen group of a multi-group plan, after the
  earlier groups' collectives were started; the failing rank must re-raise it, the others ``PeerFailure`` naming it,
  and the same call retried on every rank must be correct.
* ``mismatch``: one rank calls with a different plan string, settings, rows or data folder; every rank must raise
  ``RankMismatch`` naming the differing item (the dispatcher's digest exchange, ``routes.agree``), and a matching
  call afterwards must be correct.

Counts (per case, each at most once): *wrong result*: some rank returned a tensor that differs from eager (computed
locally on every rank from every rank's seeded inputs, no collective) beyond tolerance, in the faulted call or the
follow-up; *hang*: a call did not finish within ``CASE_TIMEOUT_S`` (the ranks are killed, a fresh pool is started);
*clear error*: every rank raised the expected exception with a message naming the problem and the follow-up was
correct. ``python3 -m tests.fault_suite [-v] [--extra]`` prints the figure line (``-v``: a line per case;
``--extra``: the known gaps too); ``tests/test_faults_cpu.py`` asserts on it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

try:
    from .dist_utils import DistPool, WorkerError
except ImportError:  # collected by pytest as a top-level module (tests/ on sys.path)
    from dist_utils import DistPool, WorkerError

K = 16
CASE_TIMEOUT_S = 20.0  # per call of a case on every rank (the calls themselves take milliseconds)
START_TIMEOUT_S = 120.0  # spawning a pool: importing torch on every rank
TOL = {"rtol": 1e-4, "atol": 1e-4}  # float32; the group's reduction order differs from the local sum
PEER_FAILURE, RANK_MISMATCH = "flashoverlap_inductor.errors.PeerFailure", "flashoverlap_inductor.errors.RankMismatch"


class InjectedFault(RuntimeError):
    """The exception the faulty row GEMM raises."""


# ------------------------------------------------------------------------------------------ ranks


def _settings(spec: dict, rank: int) -> dict:
    """``spec["common"]`` with ``spec["per_rank"][rank]`` on top: this rank's call."""
    return {**spec["common"], **spec.get("per_rank", {}).get(rank, {})}


def _operands(seed: int, rank: int, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(rows, K, generator=gen), torch.randn(K, n, generator=gen), torch.randn(n, generator=gen)


def _splits(mine: dict, rank: int, world: int) -> tuple[list[int] | None, list[int] | None]:
    """(output_split_sizes, input_split_sizes) of an all_to_all: ``send[r][j]`` rows go from rank r to rank j;
    ``None`` without a ``send`` matrix (even splits)."""
    send = mine.get("send")
    if send is None:
        return None, None
    return [send[j][rank] for j in range(world)], list(send[rank])


def _reference(spec: dict, rank: int, world: int) -> torch.Tensor | None:
    """Eager ``collective(a @ b + bias)`` for this rank from every rank's inputs; None where the ranks' calls do not
    define one (all_reduce / reduce_scatter with different rows)."""
    calls = [_settings(spec, j) for j in range(world)]
    coll, n = calls[rank]["collective"], calls[rank]["n"]
    if any(c["n"] != n for c in calls):
        return None
    ys = []
    for j, c in enumerate(calls):
        a, b, bias = _operands(spec["seed"], j, _rows(c, j), n)
        ys.append(torch.addmm(bias, a, b))
    if coll == "all_to_all":
        if calls[rank].get("send") is None:
            return torch.cat([y.chunk(world)[rank] for y in ys])
        send = calls[rank]["send"]
        return torch.cat([ys[j][sum(send[j][:rank]):sum(send[j][:rank + 1])] for j in range(world)])
    if len({y.shape[0] for y in ys}) != 1:
        return None
    total = sum(ys)
    return total if coll == "all_reduce" else total.chunk(world)[rank]


def _rows(call: dict, rank: int) -> int:
    return sum(call["send"][rank]) if call.get("send") is not None else call["rows"]


def _faulty_gemm(original: type, trigger: tuple[int, int], kind: str, message: str, fired: list) -> type:
    """A ``_RowGemm`` whose call for the segment ``trigger`` = (source row, rows) raises (once)."""

    class FaultyRowGemm(original):
        def __call__(self, src: int, rows: int, out: torch.Tensor) -> None:
            if (src, rows) == trigger and not fired:
                fired.append(True)
                raise (KeyboardInterrupt if kind == "interrupt" else InjectedFault)(message)
            super().__call__(src, rows, out)

    return FaultyRowGemm


def case_worker(spec: dict) -> dict:
    """One call of ``spec`` on this rank (every rank runs it): what it returned or raised."""
    from flashoverlap_inductor import config, ops  # noqa: F401  (ops registers torch.ops.flashoverlap)
    from flashoverlap_inductor.routes import cpu as cpu_route
    from flashoverlap_inductor.schedule import steps as sched

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _settings(spec, rank)
    coll, n, rows = mine["collective"], mine["n"], _rows(mine, rank)
    a, b, bias = _operands(spec["seed"], rank, rows, n)
    outs, ins = _splits(mine, rank, world)
    group_name = dist.group.WORLD.group_name
    fired: list = []
    original = cpu_route._RowGemm
    report: dict = {"rank": rank, "returned": False, "close": None, "type": "", "injected": False, "msg": "",
                    "fired": None}
    torch.use_deterministic_algorithms(True)  # torch.empty -> NaN: rows nobody wrote fail the comparison
    try:
        with config.patch(**mine.get("patch", {})) as settings:
            inject = mine.get("inject")
            if inject is not None:
                steps = sched.schedule_steps(coll, mine["plan"], rows, n, K, "float32", world, rank,
                                             ins and tuple(ins), outs and tuple(outs),
                                             settings.all_to_all_default_groups)
                _, src, count = steps[inject["group"]].segments[0]
                message = f"injected fault: row GEMM of group {inject['group']} on rank {rank}"
                cpu_route._RowGemm = _faulty_gemm(original, (src, count), inject["kind"], message, fired)
            fo = torch.ops.flashoverlap
            if coll == "all_reduce":
                out = fo.gemm_all_reduce(a, b, bias, "sum", group_name, mine["plan"])
            elif coll == "reduce_scatter":
                out = fo.gemm_reduce_scatter(a, b, bias, "sum", world, group_name, mine["plan"])
            else:
                out = fo.gemm_all_to_all(a, b, bias, outs, ins, group_name, mine["plan"])
        ref = _reference(spec, rank, world)
        report["returned"] = True
        report["close"] = ref is not None and out.shape == ref.shape and bool(torch.allclose(out, ref, **TOL))
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: it is one of the injected faults
        report.update(type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                      injected=isinstance(exc, (InjectedFault, KeyboardInterrupt)) and "injected fault" in str(exc),
                      msg=str(exc)[:4000])
    finally:
        cpu_route._RowGemm = original
        torch.use_deterministic_algorithms(False)
        if mine.get("inject") is not None:
            report["fired"] = bool(fired)
    return report


def start_rank() -> int:
    """Once per rank: the cost model's warnings (no curve for world size 3) stay out of the suite's output."""
    logging.getLogger("flashoverlap").setLevel(logging.ERROR)
    return dist.get_rank()


# ------------------------------------------------------------------------------------------ cases


@dataclass
class Case:
    """One injected fault: ``spec`` (the faulted call) and ``follow`` (the matching call made next), both passed to
    ``case_worker``; ``expect(rank, report)`` says whether a rank's exception is the clear error expected."""

    name: str
    world: int
    kind: str  # "raise" | "mismatch"
    spec: dict
    follow: dict
    fault_ranks: tuple[int, ...] = ()
    names: dict = field(default_factory=dict)  # mismatch: rank -> words its message must contain
    before: dict | None = None  # a matching call made first (its call shapes are then known to the dispatcher)

    def expect(self, rank: int, r: dict) -> bool:
        if self.kind == "raise":
            if rank in self.fault_ranks:
                return r["injected"] and r["fired"] is True
            first = re.search(r"\brank (\d+)\b", r["msg"])
            shape = str([_rows(self.spec["common"], rank), self.spec["common"]["n"]])
            return (r["type"] == PEER_FAILURE and first is not None and int(first.group(1)) == max(self.fault_ranks)
                    and self.spec["common"]["collective"] in r["msg"] and shape in r["msg"])
        head = r["msg"].split("Every rank must")[0]  # not the generic advice, which mentions settings and data
        return r["type"] == RANK_MISMATCH and all(re.search(rf"(?<![\w.]){re.escape(s)}(?![\w.])", head)
                                                   for s in self.names.get(rank, ()))


def _plan(rows: int, n: int, groups: int) -> str:
    from flashoverlap_inductor.schedule import plan as planlib

    return planlib.uniform_plan(rows, n, 8, 8, groups).to_str()


def _raising(name: str, world: int, faults: dict[int, tuple[int, str]], seed: int, common: dict) -> Case:
    """``faults``: rank -> (group, "error" | "interrupt") whose row GEMM raises; the retry is the same call."""
    per_rank = {r: {"inject": {"group": g, "kind": kind}} for r, (g, kind) in faults.items()}
    return Case(name, world, "raise", {"seed": seed, "common": common, "per_rank": per_rank},
                {"seed": seed, "common": common}, tuple(faults))


def _mismatch(name: str, world: int, common: dict, differ: dict, names: list[str], seed: int) -> Case:
    """The last rank calls with ``differ`` on top of ``common``; every rank must name ``names``."""
    spec = {"seed": seed, "common": common, "per_rank": {world - 1: differ}}
    per_rank = {r: list(names) + ([_settings(spec, r)["plan"]] if "plan" in differ else []) for r in range(world)}
    return Case(name, world, "mismatch", spec, {"seed": seed, "common": common}, names=per_rank)


def make_cases(alt_config_dir: str, extra: bool = False) -> list[Case]:
    """The suite: every case has its own N, so each rank's dispatcher sees each call shape first in its case.
    ``extra``: also the known gap (``--extra``): a rows mismatch after a matching call of one rank's shape."""
    cases: list[Case] = []
    n = 16

    def next_n() -> int:
        nonlocal n
        n += 8
        return n

    fault_rank = {(2, "all_reduce"): 1, (2, "reduce_scatter"): 0, (2, "all_to_all"): 1,
                  (3, "all_reduce"): 1, (3, "reduce_scatter"): 2, (3, "all_to_all"): 0}
    for world in (2, 3):
        rows = 16 * world
        for coll in ("all_reduce", "reduce_scatter", "all_to_all"):
            nn, f = next_n(), fault_rank[(world, coll)]
            cases.append(_raising(f"raise {coll} w{world} rank {f} group 1", world, {f: (1, "error")}, len(cases),
                                  {"collective": coll, "rows": rows, "n": nn, "plan": _plan(rows, nn, 4)}))
    # two ranks fail (the others name the highest); a KeyboardInterrupt; an uneven all_to_all failing at its last group
    nn = next_n()
    cases.append(_raising("raise all_reduce w3 ranks 0+2 groups 2/1", 3, {0: (2, "error"), 2: (1, "error")},
                          len(cases), {"collective": "all_reduce", "rows": 48, "n": nn, "plan": _plan(48, nn, 4)}))
    nn = next_n()
    cases.append(_raising("interrupt reduce_scatter w2 rank 0 group 1", 2, {0: (1, "interrupt")}, len(cases),
                          {"collective": "reduce_scatter", "rows": 32, "n": nn, "plan": _plan(32, nn, 4)}))
    nn = next_n()
    cases.append(_raising("raise all_to_all uneven w3 rank 1 group 3", 3, {1: (3, "error")}, len(cases),
                          {"collective": "all_to_all", "rows": 0, "n": nn, "plan": "auto",
                           "send": [[5, 9, 6], [8, 4, 7], [6, 10, 5]]}))
    for world in (2, 3):
        rows = 16 * world
        nn = next_n()
        cases.append(_mismatch(f"mismatch plan w{world}", world, {"collective": "all_reduce", "rows": rows, "n": nn,
                                                                  "plan": _plan(rows, nn, 4)},
                               {"plan": _plan(rows, nn, 2)}, ["call"], len(cases)))
        nn = next_n()
        cases.append(_mismatch(f"mismatch settings w{world}", world,
                               {"collective": "all_to_all", "rows": rows, "n": nn, "plan": "auto",
                                "send": [[rows // world] * world] * world},
                               {"patch": {"all_to_all_default_groups": 2}},
                               ["settings", "all_to_all_default_groups"], len(cases)))
        nn = next_n()
        cases.append(_mismatch(f"mismatch rows w{world}", world, {"collective": "all_reduce", "rows": rows, "n": nn,
                                                                  "plan": "auto"},
                               {"rows": rows + 8}, ["rows"], len(cases)))
        nn = next_n()
        cases.append(_mismatch(f"mismatch data w{world}", world, {"collective": "reduce_scatter", "rows": rows,
                                                                  "n": nn, "plan": "auto"},
                               {"patch": {"config_dir": alt_config_dir}}, ["data"], len(cases)))
    if extra:  # the digest runs on a call shape's first use: here rank 0's shape was agreed before, rank 1's is new
        nn = next_n()
        case = _mismatch("mismatch rows after a matching call w2", 2, {"collective": "all_reduce", "rows": 32,
                                                                       "n": nn, "plan": "auto"},
                         {"rows": 40}, ["rows"], len(cases))
        case.before = case.follow
        cases.append(case)
    return cases


def stale_config_dir(root: str) -> str:
    """A copy of the package's data folder with one file changed (a stale copy on one node)."""
    from flashoverlap_inductor import configs

    dst = Path(root) / "configs_stale"
    shutil.copytree(Path(configs.__file__).parent, dst)
    path = dst / "bandwidth_h200.json"
    doc = json.loads(path.read_text())
    doc["date"] = "2020-01-01"
    path.write_text(json.dumps(doc, indent=1))
    return str(dst)


# ------------------------------------------------------------------------------------------ driver


@dataclass
class Summary:
    faults: int = 0
    wrong: int = 0
    hangs: int = 0
    clear: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # one line per case that was not a clear error

    def figure(self) -> str:
        return (f"fault suite: faults injected {self.faults}, wrong results {self.wrong}, hangs {self.hangs}, "
                f"clear errors {self.clear}")


class _Pools:
    """One live ``DistPool`` per world size, restarted after a hang (``DistPool.run`` kills a pool that timed out)."""

    def __init__(self, worlds: tuple[int, ...]):
        self.pools = {w: DistPool(w) for w in worlds}  # spawned together: the imports overlap
        self.started: set[int] = set()
        for w in worlds:
            self.get(w)

    def get(self, world: int) -> DistPool:
        if not self.pools[world].alive:
            self.pools[world] = DistPool(world)
            self.started.discard(world)
        if world not in self.started:
            self.pools[world].run(start_rank, timeout_s=START_TIMEOUT_S)
            self.started.add(world)
        return self.pools[world]

    def run(self, world: int, spec: dict) -> list[dict] | None:
        """``case_worker(spec)`` on every rank; None if it did not finish in time (a hang)."""
        try:
            return self.get(world).run(case_worker, spec, timeout_s=CASE_TIMEOUT_S)
        except WorkerError:
            return None

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def run_case(pools: _Pools, case: Case, summary: Summary, verbose: bool = False) -> None:
    summary.faults += 1
    wrong = hang = False
    got = pools.run(case.world, case.before) if case.before is not None else []
    if got is not None:
        got = pools.run(case.world, case.spec)
    followed = None
    if got is None:
        hang = True
    else:
        wrong = any(r["returned"] and not r["close"] for r in got)
        followed = pools.run(case.world, case.follow)
        hang = followed is None
        wrong = wrong or (followed is not None and any(r["returned"] and not r["close"] for r in followed))
    follow_ok = followed is not None and all(r["returned"] and r["close"] for r in followed)
    clear = got is not None and all(not r["returned"] and case.expect(i, r) for i, r in enumerate(got)) and follow_ok
    summary.wrong += wrong
    summary.hangs += hang
    summary.clear += clear
    if not clear or verbose:
        what = "hang" if got is None else "; ".join(
            f"rank {r['rank']}: " + ("returned " + ("correct" if r["close"] else "WRONG") if r["returned"] else
                                     f"{r['type']}: {r['msg'][:160]}") for r in got)
        after = "follow-up hang" if got is not None and followed is None else \
            "follow-up " + ("ok" if follow_ok else "FAILED " + repr(followed)[:300])
        summary.notes.append(f"{'ok  ' if clear else 'FAIL'} {case.name}: {what} | {after}")
        if verbose:
            print(summary.notes[-1], flush=True)


def run_suite(verbose: bool = False, extra: bool = False) -> Summary:
    start = time.monotonic()
    summary = Summary()
    root = tempfile.mkdtemp(prefix="fo_faults_")
    pools = _Pools((2, 3))
    try:
        for case in make_cases(stale_config_dir(root), extra):
            run_case(pools, case, summary, verbose)
    finally:
        pools.close()
        shutil.rmtree(root, ignore_errors=True)
    summary.seconds = time.monotonic() - start
    return summary


def main(argv: list[str]) -> int:
    summary = run_suite(verbose="-v" in argv, extra="--extra" in argv)
    for line in summary.notes:
        if line.startswith("FAIL") and "-v" not in argv:
            print(line)
    print(f"({summary.seconds:.1f} s, 2- and 3-rank gloo worlds)")
    print(summary.figure(), flush=True)
    ok = summary.wrong == 0 and summary.hangs == 0 and summary.clear == summary.faults
    return 0 if ok else 1


if __name__ == "__main__":
    # run through the importable module, so that the ranks unpickle ``case_worker`` as tests.fault_suite's
    sys.path.insert(0, os.getcwd())
    from tests import fault_suite

    sys.exit(fault_suite.main(sys.argv[1:]))
