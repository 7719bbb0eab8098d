"""The settings of flashoverlap-inductor: one frozen, typed ``Settings`` object, and the only module that reads the
environment.

Sources, strongest first:

1. ``torch.compile(m, backend="flashoverlap", options={"flashoverlap.<name>": value})``;
2. ``with flashoverlap_inductor.config.patch(<name>=value): ...``;
3. the documented environment variables (``ENV``), read once per process;
4. the defaults below.

Names are flat: a ``Tuning`` field (``swizzle``, ``ring_rounds``, ...) is set by its own name too. ``current()``
resolves all sources into one ``Settings``; the backend captures it once per compilation, the pass hashes it whole
into its ``uuid()`` (``Settings.key()``) and hands it to every fused op it emits as a string argument, so a compiled
graph runs with the settings it was compiled under, and a new setting can never serve a stale cached graph.

Every value is checked where it is set -- an option when ``torch.compile`` calls the backend, ``patch`` on entry, an
environment variable when the environment is first read -- by the setting's rule
(``RULES``, ``config_check``): a value not accepted raises one ``ValueError`` naming the setting as the user wrote it,
the value and what is accepted, never a failure later inside the pass. An unknown name is an error too, naming the
closest known one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import config_check as check

log = logging.getLogger("flashoverlap")

MAX_WAIT_TIMEOUT_MS = 7 * 24 * 3600 * 1000.0  # 7 days
DEFAULT_WAIT_TIMEOUT_MS = 600_000.0  # when a group's timeout cannot be read: torch's NCCL default (10 min)
FUSE_MODES = ("auto", "always", "never")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all", "all_gather")
TRANSPORTS = ("peer", "nccl")
RING_MODES = ("off", "wide", "all")
GEMM_GRIDS = ("tiles", "persistent")
ROW_ORDERS = ("schedule", "gather")
GATHER_STARTS = ("auto", "handshake", "eager", "push")
SCATTER_ROUTES = ("auto", "pull", "peer")
SCATTER_STARTS = ("push", "handshake")
HOST_FLOORS = ("auto", "on", "off")
TP_SEQUENCES = ("auto", "on", "off")
DTYPES = ("bfloat16", "float16", "float32")  # the GEMM output dtypes the fused routes and the cost model know
OPTION_PREFIX = "flashoverlap."
# Experimental variants still under study: each name turns one on (``Settings.experiments``).
EXPERIMENTS = {
    "single_group": "run a one-group plan fused (it overlaps nothing; for tests of the fused path on tiny shapes)",
    "shadow_check": "compare every fused call with its unfused reference run right after it, on the device "
                    "(routes/shadow.py; bench e2e: shadow:<op>:bad under 'ran'); its timings mean nothing",
    "moe_p2p_cuda": "run the fused MoE combine and dispatch on CUDA with their point-to-point route over NCCL "
                    "(correct on 2 GPUs; with moe_settle_deferred combine 0.95-1.62x and dispatch 0.46-0.91x of "
                    "sequential on 2 H100s, slower end to end: host-bound); without it CUDA runs their unfused "
                    "reference",
    "moe_settle_deferred": "end the fused MoE calls' status exchange without a host read once a group's calls held "
                           "the whole-block premise (routes/moe_deferred.py): a failure poisons the outputs with NaN "
                           "and raises errors.PoisonedResult at a later call; a failed premise is then not redone",
    "moe_plan_triton": "run the fused MoE calls' routing plan, the deferred settle's poison and the dispatch's moves "
                       "into expert order as Triton launches and torch ops, as where the library is not built, "
                       "instead of the library's CUDA kernels (csrc/moe_plan.cu: one ctypes call each; 2 H200s: "
                       "dispatch 1.10-1.20x and combine 1.08-1.22x faster at qwen3 shapes than with this "
                       "experiment)",
    "moe_dispatch_by_expert": "give the fused MoE dispatches the plan \"experts\" (routes/moe_expert_cut.py): the "
                              "experts cut into 2 pieces, each one grouped GEMM of the library's over every source's "
                              "rows (one H200, 44th session: 2 pieces 0.91-1.12x of torch's uncut grouped GEMM where "
                              "cutting by source block costs 1.15-1.76x) instead of one per source block; not yet "
                              "run on 2 GPUs",
    "moe_peer": "move the fused MoE calls' all_to_all blocks by copy-engine pushes into the peers' symmetric memory "
                "(one host, 2-8 ranks; routes/moe_peer.py) instead of NCCL's send/recv: no SM moves a byte; correct "
                "with 2-3 ranks sharing one H200, never run on 2 GPUs",
    "moe_peer_push": "with moe_peer, push the MoE combine's blocks by copy engine from a local send buffer after "
                     "its GEMMs instead of letting its one library call write each block straight into its "
                     "destination's receive slot over NVLink (routes/moe_peer.py; neither measured on 2 GPUs)",
    "moe_judge_two_behind": "with moe_settle_deferred, judge a deferred MoE call's status at the end of the call "
                            "after next instead of the next one (the host may run two MoE calls ahead of the GPU; "
                            "a failure raises one call later)",
    "gather_copy_notify": "on 3 or more ranks, let the all_gather push start (gather_start=\"push\") tell each peer "
                          "right after its push by two 4-byte copy-engine writes of the values its ready flags would "
                          "reach, instead of one notification kernel after the last push (FO_GATHER_COPY_NOTIFY; 4 "
                          "H200s, 33rd session: correct, and no faster, 1.085x over sequential against push's 1.100x: "
                          "the waits for the peers' shards queue behind the pushes on the one copy stream)",
    "gather_torch_gemms": "run the all_gather peer route's GEMMs as one torch.mm per shard and weight from Python "
                          "(the route before 2026-11-27) instead of one library call into torch's cuBLAS "
                          "(routes/gather_gemms.py)",
    "gather_gemm_ex": "issue the all_gather peer route's library GEMMs through cublasGemmEx, as before "
                      "2026-11-28, instead of cublasLtMatmul with descriptors and an algorithm kept per shape "
                      "(routes/gather_gemms.py; cublasGemmEx runs cuBLAS's heuristic on every call)",
    "scatter_pull": "stage a sum of GEMMs feeding a reduce_scatter over 2 ranks of one NVLink host for the pull "
                    "route where its cost model (cost_model/pull.py) says it pays: the first terms unfused, the last "
                    "fused with their sum as its bias, which the pull route runs (routes/scatter_pull.py: cuBLAS "
                    "halves, the peer's half pulled by copy engine, one add; 2 H200s: 1.11-1.14x over sequential "
                    "where the concatenated form ran 0.71-0.87x; end to end no faster: 29th session)",
    "moe_judge_per_graph": "with moe_settle_deferred, inside a compiled graph with fused MoE ops (forward, backward or "
                           "inference) judge a group's deferred MoE calls at the end of its next graph run instead of "
                           "at each call (the host may run a whole graph ahead; a failure raises at the end of the "
                           "next run; 2 H200s, qwen3-moe EP2: no faster than one call behind)",
    "reduce_even_pieces": "cut the all_reduce pull route's rows into pieces of equal rows (its first schedule) "
                          "instead of pieces shrinking so the last push is short (routes/reduce_pull.py)",
}


def _dtype_name(value: Any) -> Any:
    """``torch.bfloat16`` and ``"torch.bfloat16"`` -> ``"bfloat16"`` (the pass compares names); else unchanged."""
    if isinstance(value, str) or (type(value).__name__ == "dtype" and type(value).__module__ == "torch"):
        return str(value).removeprefix("torch.")
    return value


# What each setting (a field of ``Settings`` or ``Tuning``, every one) accepts, and the one type it is stored in.
RULES: dict[str, check.Rule] = {
    "fuse": check.Choice(FUSE_MODES),
    "collectives": check.Names(COLLECTIVES),
    # < 1: at 1 the fused time would have to be <= 0 (fuse="never" says that)
    "min_gain_fraction": check.Float(0.0, 1.0, high_open=True),
    "min_rows": check.Int(0),
    "dtypes": check.Names(DTYPES, item=_dtype_name),
    "all_to_all_default_groups": check.Int(1),
    "wait_timeout_ms": check.OrNone(check.Float(0.0, MAX_WAIT_TIMEOUT_MS, low_open=True, unit=" ms (7 days)"),
                                    "the process group's own timeout", words=("none", "group", "")),
    "config_dir": check.OrNone(check.Path("when a data file is read"), "the package's configs/", words=()),
    "transport": check.Choice(TRANSPORTS),
    "host_floors": check.Choice(HOST_FLOORS),
    "tp_sequence": check.Choice(TP_SEQUENCES),
    "ring": check.Choice(RING_MODES),
    "library": check.OrNone(check.Path("when the library is loaded"), "build/libflashoverlap_sm90.so", words=()),
    "experiments": check.Names(tuple(EXPERIMENTS), kind=frozenset),
    "gemm_grid": check.OrNone(check.Choice(GEMM_GRIDS), "the GPU's data file decides"),
    "sm_reserve": check.OrNone(check.Int(0), "the GPU's data file, or NCCL_MAX_CTAS + 2"),
    "swizzle": check.Int(1),
    "row_order": check.OrNone(check.Choice(ROW_ORDERS), "the measured default"),
    "ring_rounds": check.Int(1, 16),
    "peer_kernel": check.OrNone(check.Text("a GEMM configuration name"), "the preferred one", words=()),
    "gather_start": check.Choice(GATHER_STARTS),
    "gather_push_max_mb": check.Int(0),
    "scatter_route": check.Choice(SCATTER_ROUTES),
    "scatter_start": check.Choice(SCATTER_STARTS),
    "scatter_pieces": check.Int(0, 8),
    "all_reduce_route": check.Choice(SCATTER_ROUTES),
    "all_reduce_pieces": check.Int(1, 8),
}


def _check_fields(obj: Any, skip: tuple[str, ...] = ()) -> None:
    """Set each field of the frozen dataclass ``obj`` (but ``skip``) to its rule's canonical value: a field without
    a rule fails here (KeyError), the first time one is built."""
    for f in dataclasses.fields(obj):
        if f.name not in skip:
            object.__setattr__(obj, f.name, RULES[f.name].check(f.name, f.name, getattr(obj, f.name)))


@dataclass(frozen=True)
class Tuning:
    """Knobs of the GPU routes that the GPU's data files or measurements decide; ``None`` = that default."""

    gemm_grid: str | None = None  # "tiles" (one CTA per tile) | "persistent" (one per SM); None: data file
    sm_reserve: int | None = None  # persistent grid: SMs left to NCCL; None: data file / NCCL_MAX_CTAS + 2
    swizzle: int = 4  # tile-rows per band of the GEMM's tile scheduler
    row_order: str | None = None  # "schedule" | "gather"; None: measured default (``schedule.row_order.route``)
    ring_rounds: int = 2  # ring all_reduce: at most this many rounds (1 .. 16)
    peer_kernel: str | None = None  # peer/ring routes: the _addc GEMM configuration; None: preferred
    # gather_peer route: when the caller's GEMMs start. "push": at once, each rank pushing its shard by copy engine
    # into the peers' receive buffers (two sets of world slots); "handshake": after every rank's shard is in its
    # buffer (one handshake, ~10-80 us), so the pulls need no SM while the GEMMs run (a receive buffer of one shard);
    # "eager": at once, the protocol's per-peer step kernels then wait for an SM the GEMM frees (the route before
    # 2026-11-26); "auto": "push" on 2 ranks, "handshake" on more (4 H200s: push 1.03x over sequential against the
    # handshake's 1.41x, its peers told only after all its pushes; 32nd session). 2 H200s, Llama-3-8B sp, steady-state
    # steps (37th session, each turn's first step left out): push ahead in prefill (1.066x / 1.096x over Inductor
    # against 1.039x / 1.036x) and level or ahead in training (1.041x / 1.031x against 1.027x / 1.030x); the op
    # bench (bench_gather, queued calls) favours the handshake (1.203x against 1.107x, 36th). The choice depends on
    # the world size, shapes and settings only: the same on every rank.
    gather_start: str = "auto"
    # "push" (chosen or by "auto") takes a call only where its receive buffer (2 x world x shard bytes per rank) is at
    # most this many MiB; larger calls start with the handshake (a buffer of one shard).
    gather_push_max_mb: int = 1024
    # GEMM -> reduce_scatter over 2 ranks of one NVLink host: "pull" the pull route (routes/scatter_pull.py: cuBLAS
    # GEMMs of the two halves, the peer's half pulled by copy engine and added), "peer" the peer route (CUTLASS GEMMs,
    # the reduction in GEMM 2's epilogue); "auto": for bf16, the pull route unless its model predicts it more than
    # ``cost_model.pull.TOLERANCE`` slower than the peer route's, host floors included (unless ``host_floors`` leaves
    # them out) (2 H200s, 27 Nov: the pull
    # route 0.93-1.03x of the peer route's GPU time on 23 shapes; Llama-3-8B sp train 0.7-1.5 ms per step faster; its
    # ~0.32 ms of host time per eager call keeps small outputs on the peer route). A function of the shapes, settings
    # and cost data only: the same on every rank.
    scatter_route: str = "auto"
    # The pull route's schedule (routes/scatter_pull.py), when the own half's GEMM starts. "push" (where its receive
    # buffer, 2 x 2 halves per rank, fits gather_push_max_mb; else the handshake): at once, the peer's half pushed by
    # copy engine into the peer's receive slot; "handshake": after the peer's half is copied into this rank's buffer
    # and both ranks shook hands (a buffer of one half). 2 H200s: push ahead on the 16-shape op grid (36th session:
    # 1.158x over sequential against 1.126x), its own bench (37th: 1.226x against 1.182x) and the steady-state
    # Llama-3-8B sp steps (38th, prefill 1.115x over Inductor and 67% hidden against 1.058x and 36%; 37th, train 0.3%
    # ahead); the 36th session's eager medians that put it behind counted each interleaved turn's slow first step
    # (docs/e2e.md, --turn-lead). The same on every rank.
    scatter_start: str = "push"
    # The pull route's push schedule as one library call (``fo_scatter_run``, bf16 calls without bias). 1: the
    # Python path's schedule (two cuBLAS halves, one add) in that call; 2-8: the peer's half in this many row pieces,
    # each pushed while the next computes, the own half's pieces adding the received rows in their GEMMs (cuBLASLt,
    # C = the receive slot) instead of the add (2 H200s, 42nd session: level with the add on the GPU at 2 pieces, the
    # GEMMs' extra tails eating the add's time; slower at 3-4); 0: the route's Python path, also its reference
    # semantics. The same on every rank.
    scatter_pieces: int = 1
    # GEMM -> all_reduce over 2 ranks of one NVLink host (bf16, no bias): "peer" (the default) the peer route (CUTLASS
    # GEMMs, the sum in GEMM 2's epilogue); "pull" the pull route (routes/reduce_pull.py: cuBLAS GEMMs in
    # all_reduce_pieces row pieces, each rank's partial pushed by copy engine into the peer's receive slot piece by
    # piece, one add per piece); "auto": the pull route where its model predicts it within cost_model.pull.TOLERANCE
    # of the peer route's, host floors included where they count, as scatter_route. 2 H200s, 43rd session: at 4
    # pieces 1.163x over sequential against the peer route's 1.136x in scatter_pull_bench (8 shapes, one run), but
    # level on bench_ops' grid (1.153x against 1.152x), behind under CUDA graphs (1.146x against 1.159x) and in
    # Llama-3-8B TP training (eager 1.005x against 1.013x over Inductor, host-paced: ~0.36 ms of host per call against
    # ~0.16; graphed 0.999x against 1.009x), hence not the default. The same on every rank.
    all_reduce_route: str = "peer"
    # The all_reduce pull route's pieces (1-8), shrinking towards the last (cost_model.pull.piece_cuts): 2 H200s, 43rd
    # session, geomeans over 8 shapes: 3 pieces 1.157x, 4 1.163x, 6 1.090x; even pieces at 4: 1.125x.
    all_reduce_pieces: int = 4

    def __post_init__(self) -> None:
        _check_fields(self)  # every field in its rule's type (``RULES``)


@dataclass(frozen=True)
class Settings:
    """Every setting of the backend. Frozen and hashable; every field holds its rule's canonical value
    (``RULES``), so equal settings give equal ``key()`` strings."""

    fuse: str = "auto"  # "auto" (cost model decides) | "always" | "never"
    collectives: tuple[str, ...] = COLLECTIVES  # collectives the pass may fuse
    # Under "auto", fuse only when predicted fused time <= (1 - margin) * predicted sequential time. 0.03 is the
    # smallest margin at which no shape the cost model fused ran more than 2% slower than sequential in the
    # calibration benchmark (2026-11-22, 2 and 4 H200s; docs/results.md).
    min_gain_fraction: float = 0.03
    min_rows: int = 256  # under "auto": never fuse GEMMs with fewer output rows (latency-bound)
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")  # dtypes the pass may fuse
    all_to_all_default_groups: int = 4  # all_to_all with explicit split sizes: uniform fractions 1/groups
    # Bound of a fused call's GPU waits (ms; the call's waits share one deadline); None: the process group's own
    # timeout (torch's default: 10 min for NCCL), so a straggler that torch tolerates never trips it.
    wait_timeout_ms: float | None = None
    config_dir: str | None = None  # data folder (curves, plans); None: the package's configs/
    transport: str = "peer"  # "peer": peer / ring routes where they apply; "nccl": always the NCCL route
    ring: str = "off"  # "off" | "wide" (groups of 3-8 ranks) | "all" (2-rank groups too, instead of the peer route)
    library: str | None = None  # the CUDA kernel library; None: build/libflashoverlap_sm90.so
    # Whether the cost model counts a fused call's host time (``host_floor_ms`` of the peer, ring and pull routes: back
    # to back, an eager call takes at least that long) in its fuse verdicts and the reduce_scatter route choice. "on":
    # always; "off": never (the GPU's time alone, as for calls replayed from a CUDA graph); "auto": off in the graphs
    # of a training step (a forward with a backward, and the backward), on in inference graphs and eager calls,
    # resolved per graph from its kind alone (the same on every rank). 2 H200s, Llama-3-8B sp (38th session): "off"
    # put every reduce_scatter on the pull route and lost prefill (0.968x of Inductor against 1.055x: host-bound);
    # in training "auto" ran level with "on" (99.64 against 99.74 ms per step, within the spread), so "on" stays.
    # A graph that Inductor replays as a CUDA graph (mode="reduce-overhead") leaves the floors out whatever this says
    # (passes/gemm_collective.graph_settings): no call of it is issued from the host one by one.
    host_floors: str = "on"
    # Sequence parallelism made from a tensor-parallel inference graph's all_reduces (passes/tp_sequence.py): each
    # sum all_reduce of a GEMM's output that row-wise ops (residual add, RMSNorm) read becomes a reduce_scatter,
    # those ops run on this rank's rows and an all_gather feeds the next GEMMs, which the pass then fuses. "auto":
    # in inference graphs, but under fuse="auto" not an all_reduce of fewer than ``min_rows`` rows (a decode step's)
    # nor one off the GPU (the pass would fuse neither half);
    # "on": every such all_reduce of an inference graph; "off": never. Training graphs are never rewritten. 2 H200s,
    # Llama-3-8B tp prefill, 8 layers, seq 4096 (39th session): 1.060-1.074x over Inductor, 57-62% of the
    # communication hidden, against 1.025-1.034x and 22-27% with the all_reduces fused as they are, on three hosts;
    # under CUDA graphs 1.110x over graphed Inductor (82%) against 1.058x (45%); 0.991x against 1.026x on a
    # host-paced machine (15 more fused calls' host time per step). Depends on the graph alone: the same on every
    # rank.
    tp_sequence: str = "auto"
    tuning: Tuning = field(default_factory=Tuning)
    experiments: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _check_fields(self, skip=("tuning",))
        if not isinstance(self.tuning, Tuning):
            raise ValueError(check.rejection("tuning", self.tuning, "tuning must be a config.Tuning (set its fields "
                                             "by name: swizzle=8, ...)"))
        object.__setattr__(self, "_key", repr(_canonical(self)))  # computed once: the per-call path reads it

    def key(self) -> str:
        """A canonical string of every field: the pass's cache key and the fused ops' ``settings`` argument."""
        return self._key  # type: ignore[attr-defined]

    def counts_host(self) -> bool:
        """Whether verdicts under these settings count a fused call's host floor (``host_floors`` not "off"; a call
        outside a compiled graph, "auto", does)."""
        return self.host_floors != "off"

    def timeout_ns(self, group_timeout_ms: float | None = None) -> int:
        """The bound of a call's waits in ns: ``wait_timeout_ms``, else the group's timeout (``group_timeout_ms``),
        else ``DEFAULT_WAIT_TIMEOUT_MS``; at most ``MAX_WAIT_TIMEOUT_MS`` (the device's int64 clock never wraps)."""
        ms = self.wait_timeout_ms if self.wait_timeout_ms is not None else (group_timeout_ms or DEFAULT_WAIT_TIMEOUT_MS)
        return max(1, int(min(ms, MAX_WAIT_TIMEOUT_MS) * 1e6))

    def replace(self, **changes: Any) -> Settings:
        """A copy with flat ``changes`` (``Settings`` or ``Tuning`` field names), validated."""
        return _apply(self, changes)


_TOP = {f.name for f in dataclasses.fields(Settings)} - {"tuning"}
_TUNING = {f.name for f in dataclasses.fields(Tuning)}
NAMES = tuple(sorted(_TOP | _TUNING))

# The environment variables read (here only), name -> setting.
ENV = {
    "FLASHOVERLAP_FUSE": "fuse",
    "FLASHOVERLAP_TRANSPORT": "transport",
    "FLASHOVERLAP_RING": "ring",
    "FLASHOVERLAP_RING_ROUNDS": "ring_rounds",
    "FLASHOVERLAP_SCATTER_ROUTE": "scatter_route",
    "FLASHOVERLAP_ALL_REDUCE_ROUTE": "all_reduce_route",
    "FLASHOVERLAP_LIB": "library",
}
def _canonical(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return tuple((f.name, _canonical(getattr(obj, f.name))) for f in dataclasses.fields(obj))
    if isinstance(obj, (frozenset, set)):
        return tuple(sorted(obj))
    return obj


def _checked(changes: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``changes`` (flat setting names) with every value in its field's type. A name not known or a value not
    accepted raises the ValueError naming the setting as the user wrote it (``prefix`` + name: ``flashoverlap.``
    for options, ``config.`` for the attribute, nothing for ``patch``)."""
    out = {}
    for name, value in changes.items():
        if name == "tuning":  # a field, set through its own fields' names
            raise ValueError(check.rejection(prefix + name, value, f"tuning is set by its fields' names: "
                                             f"{', '.join(prefix + k for k in sorted(_TUNING))}"))
        if name not in RULES:
            kind = "option" if prefix == OPTION_PREFIX else "setting"
            raise check.unknown_name(prefix + name, value, name, NAMES, prefix=prefix, kind=kind)
        out[name] = RULES[name].check(prefix + name, name, value)
    return out


def _apply(base: Settings, changes: dict[str, Any]) -> Settings:
    """``base`` with flat ``changes`` (``Settings`` or ``Tuning`` field names), checked (``_checked``)."""
    changes = _checked(changes)
    top = {k: v for k, v in changes.items() if k in _TOP}
    tune = {k: v for k, v in changes.items() if k in _TUNING}
    if tune:
        top["tuning"] = dataclasses.replace(base.tuning, **tune)
    return dataclasses.replace(base, **top)


@functools.lru_cache(maxsize=1)
def _from_env() -> dict[str, Any]:
    """The environment's settings, read once per process (a failed read is not kept: it fails again at the next
    ``current()``), each value checked as read: values not accepted raise one ValueError, a line per variable,
    naming the variable, its value and what its setting accepts. An empty variable counts as unset."""
    out: dict[str, Any] = {}
    errors: list[str] = []

    def read(var: str, name: str) -> None:
        try:
            out[name] = RULES[name].check(var, name, os.environ[var])
        except ValueError as exc:
            errors.append(str(exc))

    for var, name in ENV.items():
        if os.environ.get(var):
            read(var, name)
    if errors:
        raise ValueError("\n".join(errors))
    return out


def nccl_max_ctas_env() -> int | None:
    """``$NCCL_MAX_CTAS`` (NCCL's own variable: it caps the CTAs of NCCL's kernels), or None."""
    env = os.environ.get("NCCL_MAX_CTAS")
    return int(env) if env and env.isdigit() and int(env) > 0 else None


def reload_environment() -> None:
    """Read the environment again at the next ``current()`` (it is read once per process otherwise)."""
    _from_env.cache_clear()
    _resolved.clear()


_overrides: dict[str, Any] = {}  # set by patch() / config.<name> = value
_resolved: dict[str, Settings] = {}  # repr of the overrides (types included: 1, 1.0 and True differ) -> Settings


# using(): the settings a compilation captured (while its pass runs) or a fused op carries (while it runs), per
# thread and per asyncio task: two threads making fused calls under different settings never see each other's.
_pinned: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("flashoverlap_settings", default=None)


def current() -> Settings:
    """The effective settings now: defaults < environment < ``patch`` overrides; inside ``using(s)``
    (in this thread or task), exactly ``s``."""
    pinned = _pinned.get()
    if pinned is not None:
        return pinned
    key = repr(sorted(_overrides.items()))
    settings = _resolved.get(key)
    if settings is None:
        settings = _resolved[key] = _resolve(dict(_overrides))
    return settings


class using:  # noqa: N801  (used like a function: ``with config.using(s):``)
    """``with config.using(settings):`` makes ``current()`` return ``settings`` (the pass under the settings its
    compilation captured, the dispatcher under a fused op's: the library, data files and cost model read them through
    ``current()``). A plain class, not a generator: the dispatcher enters one on every fused call."""

    __slots__ = ("settings", "token")

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def __enter__(self) -> Settings:
        self.token = _pinned.set(self.settings)
        return self.settings

    def __exit__(self, *exc: object) -> None:
        _pinned.reset(self.token)


def _resolve(overrides: dict[str, Any]) -> Settings:
    return _apply(_apply(Settings(), _from_env()), overrides)


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[Settings]:
    """Temporarily override settings: ``with config.patch(fuse="always", swizzle=8) as s: ...`` (checked on
    entry, before anything changes; yields the effective ``Settings``)."""
    checked = _checked(changes)
    old = dict(_overrides)
    _overrides.update(checked)
    try:
        yield current()
    finally:
        _overrides.clear()
        _overrides.update(old)


def from_key(key: str) -> Settings:
    """The ``Settings`` whose ``key()`` is ``key`` ("" = ``current()``); memoized, so a fused op pays one dict
    lookup per call."""
    return current() if not key else _from_key(key)


@functools.lru_cache(maxsize=256)
def _from_key(key: str) -> Settings:
    import ast

    fields = dict(ast.literal_eval(key))
    tuning = Tuning(**dict(fields.pop("tuning")))
    fields["experiments"] = frozenset(fields["experiments"])
    settings = Settings(**fields, tuning=tuning)
    if settings.key() != key:
        raise ValueError(f"flashoverlap: settings string {key!r} does not round-trip (made by another version?)")
    return settings


def split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``torch.compile`` options into (ours: the prefix stripped, every value checked and in its field's type)
    and (the rest, for Inductor). An unknown ``flashoverlap.`` name or a value not accepted raises the ValueError
    naming the option (``flashoverlap.<name>``)."""
    ours, rest = {}, {}
    for key, value in (options or {}).items():
        if isinstance(key, str) and key.startswith(OPTION_PREFIX):
            ours[key[len(OPTION_PREFIX):]] = value
        else:
            rest[key] = value
    return _checked(ours, OPTION_PREFIX), rest

