"""The one place that touches Inductor, Dynamo and other torch internals (torch 2.11 and 2.13).

Everything version-dependent lives here, so a torch upgrade is a one-file review:

* ``compile_fx`` and the ``post_grad_custom_pre_pass`` hook: 2.11 accepts ONE callable only, 2.13 also a
  list/tuple. We always install one ``CustomGraphPass`` object (see ``chain_passes`` for user passes).
* ``CustomGraphPass`` (its ``uuid()`` keys the FX graph cache): same API in both.
* ``_resolve_process_group`` (group name -> ProcessGroup), ``_get_process_group_store``, fake-mode detection,
  symbolic-shape queries.
* The ``_c10d_functional`` op overloads the pass matches (same names and schemas in both).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = [
    "CustomGraphPass",
    "compile_fx",
    "run_first",
    "inductor_config",
    "cudagraphs_enabled",
    "hash_files",
    "process_group_ranks",
    "list_mode_options",
    "reset_cudagraph_trees",
    "detect_fake_mode",
    "fake_mode_for",
    "group_size",
    "resolve_group",
    "group_backend",
    "group_store",
    "nccl_communicator",
    "AFTER_AUTOGRAD_KEYSET",
    "CUDA_DISPATCH_KEY",
    "statically_known_true",
    "is_static_int",
    "chain_passes",
    "cublas_preferred",
    "PRE_PASS_KEY",
    "POST_PASS_KEY",
    "c10d",
]

# Name of the Inductor config entry our pass is installed in (runs on forward AND backward post-grad graphs).
PRE_PASS_KEY = "post_grad_custom_pre_pass"
# The entry after Inductor's own post-grad passes (``bench.model_coverage`` records the graphs there).
POST_PASS_KEY = "post_grad_custom_post_pass"

c10d = torch.ops._c10d_functional


def compile_fx(gm: torch.fx.GraphModule, example_inputs: list[Any], config_patches: dict[str, Any],
               around_graph: Callable[[str], Any] | None = None,
               after_graph: Callable[[str, Any, Any], None] | None = None) -> Any:
    """Inductor's ``compile_fx``. ``config_patches`` (not ``with config.patch()``) also covers the backward
    graph, which AOTAutograd compiles lazily after this call has returned. ``around_graph(kind)``: a context
    manager entered around each graph's ``compile_fx_inner`` (kind "forward", "backward" or "inference"), whether
    the graph is compiled or loaded from the FX graph cache. ``after_graph(kind, compiled, entered)``: called inside
    it with each compiled graph and what ``around_graph``'s ``__enter__`` returned. With ``after_graph`` the
    AOTAutograd cache is off for this compilation (it would serve the graphs without ``compile_fx_inner``); the FX
    graph cache still serves each graph."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    from torch._inductor.compile_fx import compile_fx_inner

    if around_graph is None and after_graph is None:
        return _compile_fx(gm, example_inputs, config_patches=config_patches)

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        with around_graph(kind) if around_graph is not None else contextlib.nullcontext() as entered:
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
            if after_graph is not None:
                after_graph(kind, compiled, entered)
            return compiled

    with torch._functorch.config.patch(enable_autograd_cache=False) if after_graph is not None else \
            contextlib.nullcontext():
        return _compile_fx(gm, example_inputs, inner_compile=inner, config_patches=config_patches)


def recompile_limit(at_least: int) -> Any:
    """A context manager raising Dynamo's recompile limit (per code object: a module compiled for several backends
    at once holds one cache entry per backend) to ``at_least`` where it is lower."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    return dynamo_config.patch(**{name: max(at_least, getattr(dynamo_config, name))})


def wrap_runs(compiled: Any, around: Callable[[], Any]) -> bool:
    """Make every run of ``compiled`` (what ``compile_fx_inner`` returned) happen inside the context manager
    ``around()``; False when ``compiled`` is not the Inductor output this knows (``CompiledFxGraph`` with its
    ``current_callable``). Call it before ``run_first``, which restores what it found after the first run."""
    inner = getattr(compiled, "current_callable", None)
    if inner is None:
        return False

    def run(inputs: Any) -> Any:
        with around():
            return inner(inputs)

    compiled.current_callable = run
    return True


def run_first(compiled: Any, first: Callable[[Any], None]) -> bool:
    """Make ``first(inputs)`` run before the first run of ``compiled`` (what ``compile_fx_inner`` returned; ``inputs``:
    that run's inputs) and never again once it returned (after it raised, it runs again at the next run); False when
    ``compiled`` is not the Inductor output this knows (``CompiledFxGraph`` with its ``current_callable``)."""
    inner = getattr(compiled, "current_callable", None)
    if inner is None:
        return False

    def once(inputs: Any) -> Any:
        first(inputs)
        compiled.current_callable = inner  # from now on the graph runs exactly as Inductor compiled it
        return inner(inputs)

    compiled.current_callable = once
    return True


def inductor_counters() -> Any:
    """Inductor's counters (``torch._dynamo.utils.counters["inductor"]``): what a compilation adds there is
    stored with the compiled graph and added again on every FX-graph and AOTAutograd cache hit."""
    from torch._dynamo.utils import counters

    return counters["inductor"]


def register_log_name(name: str) -> None:
    """Let ``torch._logging.set_logs`` and ``TORCH_LOGS`` name the logger ``name`` (``TORCH_LOGS`` also finds it
    before this runs, through the top-level module of that name)."""
    from torch._logging._internal import log_registry, register_log

    if not log_registry.is_log(name):
        register_log(name, name)


def _named_groups() -> list[tuple[str, Any]] | None:
    """(name, group) of each of this process's process groups ([] without distributed; None where torch's private
    registry cannot be read)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        from torch.distributed import distributed_c10d as c10d

        return sorted(((name, pg) for pg, name in getattr(c10d._world, "pg_names", {}).items()), key=lambda x: x[0])
    except Exception:  # noqa: BLE001 - private API
        return None


def process_group_layout() -> str:
    """The sizes of this process's process groups by name ("" without distributed): group names repeat between
    runs of different world sizes ("0" is the default group), so a compiled graph's cache key needs the sizes."""
    import torch.distributed as dist

    groups = _named_groups()
    if groups is None:  # the world size alone then
        return f"world:{dist.get_world_size()}"
    return ",".join(f"{name}:{pg.size()}" for name, pg in groups)


def process_group_ranks() -> str:
    """This process's rank in each of its process groups by name ("" without distributed): what a graph that embeds
    its rank within a group depends on (the global rank alone does not say it where groups' members differ)."""
    return ",".join(f"{name}:{pg.rank()}" for name, pg in _named_groups() or [])


def inductor_config() -> Any:
    """The ``torch._inductor.config`` module."""
    from torch._inductor import config

    return config


def cudagraphs_enabled() -> bool:
    """Whether Inductor compiles the current graph for CUDA graphs (``mode="reduce-overhead"``)."""
    return bool(getattr(inductor_config().triton, "cudagraphs", False))


def list_mode_options(mode: str, dynamic: bool | None = None) -> dict[str, Any]:
    """Inductor config patches of a ``torch.compile(mode=...)`` (the same ones ``backend="inductor"`` uses)."""
    from torch._inductor import list_mode_options as _list_mode_options

    return dict(_list_mode_options(mode, dynamic))


def reset_cudagraph_trees() -> None:
    """What ``torch._dynamo.reset()`` does for ``backend="inductor"`` (mode "reduce-overhead"): drop the
    CUDA-graph trees of compiled graphs. A no-op without CUDA."""
    if torch.cuda.is_available():
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees as _reset

        _reset()


def hash_files(paths: Iterable[str], extra: str = "") -> str:
    """Hex digest of the names and contents of ``paths`` (sorted, de-duplicated) plus ``extra``.

    Read on every call (a few small files per compilation): unlike Inductor's ``get_hash_for_files``, which
    memoizes by path list, an edited file changes the digest within the same process too."""
    digest = hashlib.sha256()
    for path in sorted(set(paths)):
        digest.update(path.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    digest.update(extra.encode())
    return digest.hexdigest()


def detect_fake_mode(values: Any) -> Any:
    """The FakeTensorMode of the FakeTensors in ``values`` (``meta["val"]`` of post-grad nodes), or None."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


def fake_mode_for(values: Any) -> Any:
    """The fake mode of ``values``, or a fresh one that accepts real tensors (graphs traced with real values)."""
    mode = detect_fake_mode(values)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def group_size(group_name: str) -> int | None:
    """Size of the process group registered under ``group_name`` (as in ``_c10d_functional`` args), or None."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(group_name).size())
    except Exception:  # unknown name, no default group, distributed not built
        return None


def statically_known_true(expr: Any) -> bool:
    """True iff ``expr`` (bool or SymBool) is provably true without adding a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as _skt

    return bool(_skt(expr))


def asserted_int(size: Any) -> int | None:
    """The int that ``size`` (an int or SymInt) equals: itself, its constant, or the integer a deferred runtime
    assertion of its shape environment equates it with (``Eq(u0 + u1, 32)``: a split's parts summing to a static
    row count, which Dynamo asserts where the rows meet a static shape); None where none is known. Adds no guard."""
    node = getattr(size, "node", None)
    known = size if isinstance(size, int) else node.maybe_as_int() if node is not None else None
    if known is not None:
        return int(known)
    asserts = getattr(getattr(node, "shape_env", None), "deferred_runtime_asserts", None) or {}
    sides = (side for ras in asserts.values() for ra in ras if type(getattr(ra, "expr", None)).__name__ == "Equality"
             for side in ra.expr.args if getattr(side, "is_Integer", False))  # sympy's Eq(expr, integer)
    return next((int(side) for side in sides if statically_known_true(size == int(side))), None)


def is_static_int(x: Any) -> bool:
    """True for Python ints and SymInts whose value is a constant (no free symbols)."""
    if isinstance(x, int):
        return True
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return isinstance(x, torch.SymInt) and is_concrete_int(x)


class _ChainedPass(CustomGraphPass):
    """Runs several post-grad passes in order inside the one hook slot that torch 2.11 offers."""

    def __init__(self, passes: list[Callable[[torch.fx.Graph], None]]) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        ids = []
        for p in self.passes:
            if not isinstance(p, CustomGraphPass) or not p.uuid():
                return None  # a plain callable: Inductor cannot key the cache on it -> bypass the FX cache
            ids.append(str(p.uuid()))
        return hashlib.sha256("|".join(ids).encode()).hexdigest()


def chain_passes(ours: CustomGraphPass, existing: Any) -> CustomGraphPass:
    """``ours`` first, then any pass the user already configured (a callable, or on 2.13 a list/tuple)."""
    if not existing:
        return ours
    extra = list(existing) if isinstance(existing, (list, tuple)) else [existing]
    return _ChainedPass([ours, *extra])


# The per-call path's CUDA queries, without the Python wrappers' checks (the tensors are on an initialized device).
# torch builds without CUDA lack these bindings; the public functions serve there (and in the CPU tests' fakes).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def cublas_preferred() -> bool:
    """Whether torch's GEMMs go to cuBLAS (``preferred_blas_library()`` is ``_BlasBackend.Cublas``), not cuBLASLt."""
    backend = getattr(torch._C, "_BlasBackend", None)
    if backend is None:
        return False
    if _get_blas_backend is not None:  # the setting's own getter: a few us less per fused call than the wrapper's
        return _get_blas_backend() == backend.Cublas
    return torch.backends.cuda.preferred_blas_library() == backend.Cublas


_get_blas_backend = getattr(torch._C, "_get_blas_preferred_backend", None)


def current_raw_stream(index: int) -> int:
    """The ``cudaStream_t`` (as an int) of device ``index``'s current stream."""
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


def is_capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph."""
    return _is_capturing() if _is_capturing is not None else torch.cuda.is_current_stream_capturing()


def current_device() -> int:
    """The current CUDA device's index."""
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def group_timeout_ms(group: Any, device_type: str = "cuda") -> float | None:
    """The process group's own collective timeout in ms (its backend's options), else torch's default for its
    backend; None when neither can be read."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for dev in (device_type, "cpu"):
        try:
            backend = group._get_backend(torch.device(dev))
            return backend.options._timeout.total_seconds() * 1e3
        except Exception:  # noqa: BLE001 - private API: fall through to the default
            continue
    try:
        return c10d._get_default_timeout(dist.get_backend(group)).total_seconds() * 1e3
    except Exception:  # noqa: BLE001
        return None


def abort_group(group: Any) -> bool:
    """Abort ``group``'s communicators through torch's own path (after NCCL refused a call mid-operation, so that
    no collective of this rank waits forever); True when an abort ran."""
    from torch.distributed import distributed_c10d as c10d

    fn = getattr(c10d, "_abort_process_group", None)
    try:
        if fn is not None:
            fn(group)
            return True
        group.abort()
        return True
    except Exception:  # noqa: BLE001 - an abort is best effort; the caller raises anyway
        return False


# ------------------------------------------------------------------------------------------ process groups, dispatch


def resolve_group(group_name: str) -> Any:
    """The ``ProcessGroup`` named ``group_name`` (``distributed_c10d._resolve_process_group``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_store(group: Any) -> Any:
    """The c10d store of ``group`` (its ``PrefixStore``: keys are the group's own; ``_get_process_group_store``)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_process_group_store(group)


def group_backend(group: Any, device: torch.device) -> Any:
    """The backend object of ``group`` on ``device`` (``ProcessGroup._get_backend``; e.g. ``ProcessGroupNCCL``)."""
    return group._get_backend(device)


def nccl_communicator(group: Any, device: torch.device) -> int:
    """The ``ncclComm_t`` of ``group`` on ``device`` as an int (``ProcessGroupNCCL._comm_ptr()``); raises when the
    group is not NCCL, has no communicator yet, or torch lacks the binding."""
    return int(group_backend(group, device)._comm_ptr())


# The dispatch keys of the ops' CUDA fast path (``ops.py``): the keyset below autograd, and the CUDA key.
AFTER_AUTOGRAD_KEYSET = torch._C._after_autograd_keyset
CUDA_DISPATCH_KEY = torch._C.DispatchKey.CUDA
