"""The route registry: which implementation runs a fused call, decided in one place.

A *route* is one module implementing the ``Route`` protocol: ``name``, ``devices``, ``unsupported(call, settings)``
(pure: why the route cannot take a call shape, identical on every rank), ``make_launch(call, settings, ctx)``
(everything that depends only on the call shape, memoized here per call shape), ``execute(launch, ctx)`` and
``reset()``. ``REGISTRY`` lists them in order of preference; ``select(call, settings)`` is the first that takes a
call. The pass asks ``select`` which route the cost model should predict; the runtime (``dispatch``) asks it which
route to run, so the two never disagree. Adding a route = one module + one line in ``REGISTRY`` (``docs/routes.md``).

The dispatcher owns the rules every route shares:

- **Memo**: per call key (shapes, strides, dtype, B alignment, device, group, plan, settings) the candidate routes
  and their launches, made on first use; the per-call path is a dict lookup, then the route's ``execute``.
- **CUDA-graph capture**: nothing is made inside a capture (no launches, workspaces or collective allocations); a
  launch first needed inside one is skipped for the next route, down to ``unfused``, which always runs.
- **Resynchronization**: a call on a (device, group) that a raised fault of a symmetric-memory route marked first
  runs ``symmetric.resync`` (collective: every rank raised that fault, so every rank's next call on the group does
  it; inside a capture it raises instead), before anything else of the call; ``stats["resync"]`` counts them.
- **Fallback**: a route whose ``make_launch`` or ``execute`` returns a reason (a ``str``) passes the call to the next
  candidate; logged once per reason, counted in ``stats["skip:<route>:<reason>"]``. Every reason depends only on
  what all ranks share (shapes, dtypes, strides, settings, call history), so all ranks run the same collectives.

Statistics (what ran, per call; ``flashoverlap_inductor.fusion_report()`` shows them): ``stats["fused:<collective>"]``
and ``stats["route:<name>"]`` per call that ran fused on a GPU route, ``stats["route:cpu"]`` per call the CPU route
ran (the op's schedule with gloo collectives), ``stats["fallback:<reason>"]`` per call that ran unfused on CUDA,
``stats["captured"]`` per call captured into a graph.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flashoverlap_inductor import config
from flashoverlap_inductor.runtime import faults, kernel_select, streams

from .. import _inductor_compat as compat
from ..schedule import steps as schedule
from . import (
    agree,
    cpu,
    gather_nccl,
    gather_peer,
    moe_deferred,
    nccl,
    peer,
    reduce_pull,
    ring,
    scatter_pull,
    shadow,
    symmetric,
    unfused,
)
from .base import Call, Context, Route, forget_notes, note, stats

__all__ = ["NO_ROUTE_ARGS", "REGISTRY", "Call", "Context", "Route", "candidates", "check", "cost_args", "dispatch",
           "make_call", "note", "reset", "resync_marked", "select", "stats"]

log = logging.getLogger("flashoverlap")


# In order of preference: the first route whose ``unsupported`` is None takes a call.
REGISTRY: list[Route] = [scatter_pull.ROUTE, reduce_pull.ROUTE, ring.ROUTE, peer.ROUTE, nccl.ROUTE, gather_peer.ROUTE,
                         gather_nccl.ROUTE, unfused.ROUTE, cpu.ROUTE]
last_launch: Any = None
MAX_ENTRIES = 512
_memo: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()  # LRU order
_captured: set[tuple] = set()  # keys whose launches a captured graph holds (never evicted)
_lock = threading.RLock()  # guards the memo and the call locks (never held across a collective)
_call_locks: dict[tuple, threading.RLock] = {}  # per CUDA device or process group: see ``_call_lock``


@dataclass
class _Entry:
    """A call key's ``Call``, output shape, candidate routes and the launches made so far."""

    call: Call
    out_shape: list[int]
    routes: list[Route]
    declined: str = ""  # why the first kernel route of the registry declined the call ("" = none did)
    agreed: bool = False  # the group's ranks compared this call's decision items (``agree.check``)
    launches: dict[str, Any] = field(default_factory=dict)
    lock: Any = None  # the lock its calls run under (``_call_lock``), found once with the entry


def candidates(call: Call, settings: config.Settings, declined: list[str] | None = None) -> list[Route]:
    """The routes that take ``call``, in ``REGISTRY`` order (each logged once per reason it declines; the reasons
    appended to ``declined``)."""
    out = []
    for route in REGISTRY:
        if call.device not in route.devices or call.collective not in route.collectives:
            continue
        why = route.unsupported(call, settings)
        if why is None:
            out.append(route)
            continue
        if declined is not None and route.name != "unfused":
            declined.append(why)
        if not call.compile_time:
            note(f"unsupported:{route.name}:{why}", logging.DEBUG, "flashoverlap: %s does not take the %s route: %s",
                 call.collective, route.name, why)
    return out


def select(call: Call, settings: config.Settings) -> Route:
    """The route that runs ``call`` (the first candidate); the pass asks it which route the cost model predicts."""
    found = candidates(call, settings)
    if not found:
        raise RuntimeError(f"flashoverlap: no route takes {call}")
    return found[0]


NO_ROUTE_ARGS = {"peer": False, "ring_rounds": 0, "pull": False}  # ``cost_args`` of a call on no route of its own


def cost_args(call: Call, settings: config.Settings) -> dict[str, Any]:
    """``cost_model.decide``'s route arguments for the route ``select`` gives ``call``: the peer route, the ring in
    how many rounds, or the reduce_scatter pull route (else the NCCL route: ``NO_ROUTE_ARGS``), so a prediction is of
    the route that runs. Raises as ``select`` where no route takes the call."""
    name = select(call, settings).name
    return {"peer": name == "peer", "ring_rounds": ring.rounds(call, settings) if name == "ring" else 0,
            "pull": name in ("scatter_pull", "reduce_pull")}


def make_call(collective: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup,
              plan: str, output_split_sizes: Sequence[int] | None, input_split_sizes: Sequence[int] | None,
              y_shape: list[int], cuda: bool) -> tuple[Call, kernel_select.Operands | None, list[int]]:
    """The ``Call`` of a runtime call, the kernels' operands (``cuda``) and the op's output shape."""
    world, rank = group.size(), group.rank()
    rows, n, k = math.prod(y_shape[:-1]), y_shape[-1], a.shape[-1]
    send_rows = recv_rows = None
    if collective == "all_gather":  # rows: the gathered rows; n: all GEMMs' columns; the GEMMs are cuBLAS's
        n = sum(w.shape[-1] for w in b)
        call = Call(collective, rows, n, k, a.dtype, world, rank, "cuda" if cuda else "cpu", None, plan,
                    group_name=getattr(group, "group_name", str(id(group))))
        return call, None, list(y_shape)
    if collective == "all_reduce":
        out_shape = list(y_shape)
    elif collective == "reduce_scatter":
        out_shape = [y_shape[0] // world, *y_shape[1:]]
    else:
        outs, ins = schedule.all_to_all_splits(y_shape[0], world, output_split_sizes, input_split_sizes)
        unit = math.prod(y_shape[1:-1])  # flattened rows per dim-0 element
        if output_split_sizes is not None or input_split_sizes is not None:
            send_rows, recv_rows = tuple(s * unit for s in ins), tuple(s * unit for s in outs)
        out_shape = [sum(outs), *y_shape[1:]]
    opnd, issue, layout = None, None, None
    if cuda:
        got = kernel_select.normalize_operands(a, b, bias, collective)
        if isinstance(got, tuple):
            issue = got
        else:
            opnd, layout = got, kernel_select.b_layout(got.b)
            if rows == 0 and send_rows is None:  # every rank has the same rows here
                issue = ("degenerate", "no rows")
    call = Call(collective, rows, n, k, a.dtype, world, rank, "cuda" if cuda else "cpu", layout, plan,
                send_rows, recv_rows,
                getattr(group, "group_name", str(id(group))), issue, device_index=a.device.index if cuda else None)
    return call, opnd, out_shape


def dispatch(collective: str, a: torch.Tensor, b: Any, bias: Any, group: dist.ProcessGroup, plan: str,
             settings_key: str, y_shape: list[int], output_split_sizes: Sequence[int] | None = None,
             input_split_sizes: Sequence[int] | None = None, gather_dim: int = 0,
             return_gathered: bool = False) -> Any:
    """Run one fused call on the first route that takes it (see the module docstring). ``b`` / ``bias``: a tensor
    (None), or for all_gather a list of them; ``y_shape``: the GEMM output's shape, for all_gather the gathered
    tensor's."""
    settings = config.from_key(settings_key)  # "" (an eager call): the current settings, under their own key
    with config.using(settings):  # everything below (library, data files, cost model) reads these settings
        return _dispatch(collective, a, b, bias, group, plan, settings, y_shape, output_split_sizes,
                         input_split_sizes, gather_dim, return_gathered)


def _layout_key(x: Any) -> Any:
    """Shapes and strides of a tensor, of None, or of a list of them (never a pointer)."""
    if isinstance(x, (list, tuple)):  # a list of tensors (or None) without a call per element: host time per call
        return tuple([(t.shape, t.stride()) if isinstance(t, torch.Tensor) else _layout_key(t) for t in x])
    return None if x is None else (x.shape, x.stride())


def resolve_plan(collective: str, plan: str, a: torch.Tensor, y_shape: list[int], group: dist.ProcessGroup,
                 settings: config.Settings, uneven: bool) -> str:
    """The concrete plan a call runs: ``plan`` itself, or for "auto" (sizes symbolic at compile time) the cost
    model's plan for this call shape under ``settings`` (``cost_model.call_plan``; once per call shape, in the memo
    entry). all_gather's "auto" is a verdict the gather routes take themselves, and an all_to_all with explicit split
    sizes runs uniform fractions whatever its plan (``schedule.steps.resolve_schedule``): both stay "auto"."""
    if plan != "auto" or collective == "all_gather" or (collective == "all_to_all" and uneven):
        return plan
    if math.prod(y_shape[:-1]) == 0 or y_shape[-1] == 0 or a.shape[-1] == 0:  # nothing to plan: no rows to cut
        return plan
    from flashoverlap_inductor import cost_model

    return cost_model.call_plan(collective, math.prod(y_shape[:-1]), y_shape[-1], a.shape[-1],
                                str(a.dtype).removeprefix("torch."), group.size(), None, settings)


def _call_lock(cuda: bool, a: torch.Tensor, group: dist.ProcessGroup) -> threading.RLock:
    """The lock a call runs under once its memo entry is found: per CUDA device (the device's counter slots and
    streams are shared by its calls), else per process group. Never one lock for the process: a thread holding it
    inside a collective of one group would block a thread of another group, whose peer ranks then wait forever in
    theirs (two threads of one process with fused calls on two groups deadlocked so on gloo)."""
    return _named_lock(("cuda", a.device.index) if cuda else ("group", id(group)))


def _named_lock(name: tuple) -> threading.RLock:
    with _lock:
        lock = _call_locks.get(name)
        if lock is None:
            lock = _call_locks[name] = threading.RLock()
    return lock


def _resync(group: dist.ProcessGroup, index: int, settings: config.Settings, capturing: bool, call_id: str) -> None:
    """``symmetric.resync`` of (device ``index``, ``group``) over every symmetric-memory route, bounded by the
    group's wait bound under ``settings``; under the device's call lock."""
    timeout_s = settings.timeout_ns(compat.group_timeout_ms(group)) / 1e9
    symmetric.resync(group, index, [r for r in REGISTRY if isinstance(r, symmetric.SymmetricRoute)], timeout_s,
                     capturing, call_id)
    stats["resync"] += 1


def device_lock(index: int) -> threading.RLock:
    """The call lock of CUDA device ``index``: the dispatcher's calls on it, and ``moe_peer``'s from begin to
    finish, run one at a time (they share the symmetric routes' flag pages, copy streams and argument structs)."""
    return _named_lock(("cuda", index))


def resync_group(group: dist.ProcessGroup, index: int, settings: config.Settings, call_id: str) -> None:
    """``_resync`` of (device ``index``, ``group``) for a call outside the dispatcher (``moe_peer``), under the
    device's call lock; never inside a capture (such calls decline there)."""
    with _named_lock(("cuda", index)):
        if faults.resync_due(index, group.group_name):
            _resync(group, index, settings, False, call_id)


def resync_marked() -> None:
    """Resynchronize every (device, group) a raised fault marked: the compiled wrapper's step before each run
    (``backend.checked``), since CUDA-graph replays reach no dispatcher. Every rank runs the same graphs in the same
    order, so every rank does it at the same run."""
    capturing = torch.cuda.is_available() and compat.is_capturing()
    for index, name in faults.marked():
        with _named_lock(("cuda", index)):
            if faults.resync_due(index, name):
                _resync(compat.resolve_group(name), index, config.current(), capturing, "the run of a compiled graph")


def _dispatch(collective: str, a: torch.Tensor, b: Any, bias: Any, group: dist.ProcessGroup,
              plan: str, settings: config.Settings, y_shape: list[int], output_split_sizes: Sequence[int] | None,
              input_split_sizes: Sequence[int] | None, gather_dim: int = 0, return_gathered: bool = False) -> Any:
    global last_launch
    cuda = _on_cuda(a)
    if cuda and a.device.type == "cuda" and a.device.index != compat.current_device():  # launches need it current
        with torch.cuda.device(a.device):
            return _dispatch(collective, a, b, bias, group, plan, settings, y_shape, output_split_sizes,
                             input_split_sizes, gather_dim, return_gathered)
    capturing = _capturing(a)
    # shapes and strides only (never a pointer): every rank builds the same key for the same call
    key = (collective, plan, settings.key(), a.shape, a.stride(), _layout_key(b), _layout_key(bias), a.dtype,
           a.device, id(group), output_split_sizes and tuple(output_split_sizes),
           input_split_sizes and tuple(input_split_sizes), gather_dim, return_gathered)
    with _lock:
        entry = _memo.get(key)
        if entry is None:
            concrete = resolve_plan(collective, plan, a, y_shape, group, settings,
                                    output_split_sizes is not None or input_split_sizes is not None)
            call, opnd, out_shape = make_call(collective, a, b, bias, group, concrete, output_split_sizes,
                                              input_split_sizes, y_shape, cuda)
            if len(_memo) >= MAX_ENTRIES:
                _evict(a)
            declined: list[str] = []
            found = candidates(call, settings, declined)
            entry = _memo[key] = _Entry(call, out_shape, found, _slug(declined[-1]) if declined else "",
                                        lock=_call_lock(cuda, a, group))
        else:
            call, out_shape, opnd = entry.call, entry.out_shape, None
            if cuda and call.operand_issue is None and collective != "all_gather":
                opnd = kernel_select.normalize_operands(a, b, bias, collective)
        _memo.move_to_end(key)
    with entry.lock:  # the rest: this device's (CUDA) or this group's (CPU) calls, one at a time
        ctx = Context(a, b, bias, group, y_shape, out_shape, plan, settings, opnd, None, capturing,
                      output_split_sizes, input_split_sizes, gather_dim, return_gathered)
        if cuda:
            ctx.res = streams.resources(a.device.index or 0)
            if not capturing:  # a fault an earlier call (or graph replay) recorded: raise it, before this call
                faults.raise_pending(a.device.index or 0)
            if faults.resync_due(a.device.index or 0, call.group_name):  # every rank raised the group's fault
                _resync(group, a.device.index or 0, settings, capturing,
                        f"{collective} N={call.n} K={call.k} {call.dtype_name}")
        if not entry.agreed and not capturing:  # before any route acts: ranks that disagree fail here, together
            gpu = ctx.res.name if ctx.res is not None else a.device.type
            found = agree.items(call, settings, entry.routes, gpu)
            agree.check_once(found, group, _what(collective, a, b, call))  # per group and items, not per entry
            entry.agreed = True
        reason = entry.declined
        for route in entry.routes:
            if cuda and ctx.res is None and not route.last_resort:  # a capture before the device's first call
                _skip(route, collective, "capturing", "the first call on this device is inside a CUDA-graph capture")
                continue
            launch = entry.launches.get(route.name)
            if launch is None:
                if capturing and not route.last_resort:
                    _skip(route, collective, "capture-new", "a call shape first seen inside a CUDA-graph capture")
                    continue
                launch = entry.launches[route.name] = route.make_launch(call, settings, ctx)
            if isinstance(launch, str):
                reason = _slug(launch)
                _skip(route, collective, reason, launch)
                continue
            out = route.execute(launch, ctx)
            if isinstance(out, str):
                reason = _slug(out)
                _skip(route, collective, reason, out)
                continue
            if route.name == "unfused":
                stats[f"fallback:{reason or 'none'}"] += 1
            elif route.last_resort:  # the CPU route: the op's group schedule, with gloo collectives
                stats[f"route:{route.name}"] += 1
            if route.last_resort:
                return out
            last_launch = launch
            stats[f"fused:{collective}"] += 1
            stats[f"route:{route.name}"] += 1
            if shadow.on(settings):
                _shadow(collective, out, ctx, call, route.name)
            if capturing:
                stats["captured"] += 1
                stats[f"captured:{route.name}"] += 1
                _captured.add(key)
            return out
    raise RuntimeError(f"flashoverlap: no route ran {call}")  # unreachable: unfused and cpu always run


def _shadow(collective: str, out: Any, ctx: Context, call: Call, route: str) -> None:
    """The experiment ``shadow_check``: the fused call compared with its unfused reference (not while capturing)."""
    if ctx.capturing:
        shadow.skip_capture()
        return
    shadow.compare(collective, out, lambda: unfused.reference(collective, ctx), shadow.Spec(
        lambda: f"{_what(collective, ctx.a, ctx.b, call)} on route {route}, plan {ctx.plan}"))


def _what(collective: str, a: torch.Tensor, b: Any, call: Call) -> str:
    """The call in words, for errors."""
    if isinstance(b, (list, tuple)):
        return f"{collective} of a {list(a.shape)} shard, then {len(b)} GEMM(s) with N={[w.shape[-1] for w in b]} " \
               f"({call.dtype_name})"
    return f"{collective} of a {list(a.shape)} @ {list(b.shape)} {call.dtype_name} GEMM"


def _slug(why: str) -> str:
    """The counter name of a reason: its first word before ':' (``"alignment: N=..."`` -> ``alignment``)."""
    head = why.split(":", 1)[0].strip()
    return head if head and " " not in head else "unsupported"


def _on_cuda(a: torch.Tensor) -> bool:
    """Whether a call runs on the CUDA routes (a seam for the CPU simulation of the GPU path in the tests)."""
    return a.is_cuda


def _capturing(a: torch.Tensor) -> bool:
    """Whether the caller's stream is capturing a CUDA graph (CUDA tensors only)."""
    return a.is_cuda and compat.is_capturing()


def _skip(route: Route, collective: str, reason: str, detail: str) -> None:
    stats[f"skip:{route.name}:{reason}"] += 1
    nxt = "the next route"
    note(f"skip:{route.name}:{detail}", logging.INFO, "flashoverlap: %s leaves the %s route for %s: %s", collective,
         route.name, nxt, detail)


def _evict(a: torch.Tensor) -> None:
    """Drop the least recently used entry that no captured graph holds (after a device sync: calls in flight
    may still read its launch's index tensors)."""
    victim = next((k for k in _memo if k not in _captured), None)
    if victim is None:
        return
    note("evict", logging.INFO, "flashoverlap: more than %d call shapes; evicting the least recently used (with a "
         "device sync each time)", MAX_ENTRIES)
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    del _memo[victim]


def check(sync: bool = True) -> None:
    """Raise the fault any fused call recorded (``faults``: ``errors.FlashOverlapTimeout`` or ``PeerFailure``),
    after synchronizing the devices when ``sync`` (without it, what the host can see so far: the compiled wrapper
    runs that after each call). Every rank of the faulted group raises it; with ``sync`` that includes a rank that
    ran nothing since a peer recorded the fault in its block (it skipped the faulted call: the blocks themselves
    are read, ``faults.raise_pending(deep=True)``), so that every rank's next call on the group resynchronizes it.
    Then the failures of peers that the NCCL all_gather route's exchange brought and no call reported yet
    (``gather_nccl.raise_pending``: ``errors.PeerFailure``), and the MoE calls settled without a host read that
    failed (``moe_deferred.raise_pending``: ``errors.PoisonedResult``)."""
    for res in streams.existing():
        if sync:
            torch.cuda.synchronize(res.index)
        if res.timed_out():
            res.raise_if_timed_out()
    faults.raise_pending(deep=sync)
    gather_nccl.raise_pending(sync)
    moe_deferred.raise_pending(sync=sync)


def reset() -> None:
    """Forget memoized launches, statistics and logged notes, and every route's state (workspaces, flags) and
    resynchronization marks: tests (after a fault, the group's next call resynchronizes it; no reset needed).
    Synchronizes the devices first. CUDA graphs captured before must not be replayed after it."""
    global last_launch
    for res in streams.existing():
        torch.cuda.synchronize(res.index)
    with _lock:
        _memo.clear()
        _captured.clear()
        agree.forget()
        for route in REGISTRY:
            route.reset()
        faults.forget()
        moe_deferred.forget()
        stats.clear()
        forget_notes()
        last_launch = None
