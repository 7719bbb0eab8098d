"""The ``flashoverlap`` torch.compile backend: Inductor plus the FlashOverlap FX pass.

``torch.compile(model, backend="flashoverlap")`` finds ``flashoverlap_backend`` through the
``torch_dynamo_backends`` entry point in setup.py; this module must never also call ``register_backend`` with
that name (Dynamo would raise "duplicate name" when it loads the entry point).

Options: ``torch.compile(m, backend="flashoverlap", options={"flashoverlap.fuse": "always", ...})``. Keys with
the ``flashoverlap.`` prefix are our settings (``config.py``); they, ``config.patch`` and the environment are
resolved ONCE here into one ``config.Settings`` held by the pass object, which also serves the backward graph that
AOTAutograd compiles later (after this call returned). Every other key is an Inductor config patch, exactly as
with ``backend="inductor"``; ``mode=`` works as there too. The compiled callable checks for recorded faults after
every run (``checked``). Each graph's compilation, or its load from Inductor's caches, is watched
(``passes.report.GraphWatch``): one report and one INFO line per graph, the same on a cache hit.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from . import _inductor_compat as compat
from . import config, errors


def make_pass(settings: config.Settings | dict[str, Any] | None = None) -> Any:
    """The pass object for ``settings`` (a dict: changes to ``config.current()``)."""
    from .passes import FlashOverlapPass  # imports .ops, which registers torch.ops.flashoverlap.*

    return FlashOverlapPass(settings)


def inductor_patches(mode: str | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
    """Split ``torch.compile``'s ``mode``/``options`` into (our settings, Inductor config patches)."""
    if mode is not None and options:
        raise RuntimeError("flashoverlap: either mode or options can be given, not both (as with torch.compile)")
    ours, rest = config.split_options(options)
    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(compat.list_mode_options(mode))
    patches.update(rest)
    return ours, patches


def flashoverlap_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None,
                         options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """Compile ``gm`` with Inductor, with ``FlashOverlapPass`` as ``post_grad_custom_pre_pass``.

    Our settings are applied for this compilation only (module config and env var are left as they were); a
    ``post_grad_custom_pre_pass`` the user configured (option or global config) runs after ours.
    """
    if kwargs:
        raise TypeError(f"flashoverlap_backend: unexpected arguments {sorted(kwargs)}")
    ours, patches = inductor_patches(mode, options)
    fo_pass = make_pass(config.current().replace(**ours))  # validated here: a bad option fails the compile
    existing = patches.get(compat.PRE_PASS_KEY, getattr(compat.inductor_config(), compat.PRE_PASS_KEY, None))
    patches[compat.PRE_PASS_KEY] = compat.chain_passes(fo_pass, existing)
    from .passes.report import GraphWatch

    with GraphWatch("cached", inner=False):  # reports graphs the AOTAutograd cache serves whole
        compiled = compat.compile_fx(gm, example_inputs, config_patches=patches,
                                     around_graph=lambda kind: _Watched(kind, fo_pass), after_graph=_agree_first)
    return checked(compiled)


class _Watched:
    """Around one graph's ``compile_fx_inner``: its report (``GraphWatch``), the manifest it recorded, and the
    graph's kind on the pass (``FlashOverlapPass.graph_kind``, restored after: AOTAutograd compiles the backward
    later, possibly inside another compilation). Compiled autograd hands its backward to the backend as an inference
    graph: there ``host_floors="auto"`` counts the floors and ``tp_sequence`` may rewrite it (gradients sum over the
    same rows)."""

    def __init__(self, kind: str, fo_pass: Any) -> None:
        from .passes import manifest, moe_verdict
        from .passes.report import GraphWatch

        self.watch, self.before = GraphWatch(kind, inner=True), manifest.snapshot()
        self.verdicts_before = moe_verdict.snapshot()
        self.kind, self.fo_pass, self.outer = kind, fo_pass, None

    def __enter__(self) -> _Watched:
        self.watch.__enter__()
        self.outer, self.fo_pass.graph_kind = self.fo_pass.graph_kind, self.kind  # after: nothing left to raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fo_pass.graph_kind = self.outer
        self.watch.__exit__(*exc)


def _agree_first(kind: str, compiled: Any, watched: _Watched) -> None:
    """Before the first run of ``compiled``, its ranks agree on the collectives it issues (``agree.check_graph``);
    a graph with no collective needs nothing. The MoE verdicts it was built with under ``fuse="auto"`` are offered to
    their groups' stores again first (``moe_verdict.conflicts``: a graph from the cache may hold another job's; such
    a graph raises at each run instead). A
    graph with fused MoE ops runs each time inside
    ``moe_deferred.graph_run`` (its deferred calls judged per run under ``moe_judge_per_graph``): forward, inference
    and the backward that autograd calls alike."""
    import logging

    from .passes import manifest, moe_verdict
    from .routes import agree, moe_deferred

    conflict = moe_verdict.conflicts(moe_verdict.take(watched.verdicts_before))
    if conflict:  # at every run, before anything of the graph runs (module docstring of moe_verdict)
        def refuse(inputs: Any) -> None:
            raise errors.RankMismatch(conflict)

        if not compat.run_first(compiled, refuse):
            raise errors.RankMismatch(conflict)
        return
    found = manifest.take(watched.before)
    if not found:
        return
    if any(op in entry for _, entry in found for op in moe_deferred.MOE_OPS) and \
            not compat.wrap_runs(compiled, moe_deferred.graph_run):  # before run_first, which keeps what it finds
        logging.getLogger("flashoverlap").warning("flashoverlap: cannot judge a compiled %s graph's MoE calls per run "
                                                  "(%s): unknown Inductor output", kind, type(compiled).__name__)
    if manifest.per_rank(found):  # rank-dependent shapes may recompile on one rank alone: nothing to pair with
        logging.getLogger("flashoverlap").debug("flashoverlap: a compiled %s graph with per-rank sizes (all_to_all "
                                                "split sizes): no first-run agreement", kind)
        return

    def first(inputs: Any) -> None:
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor) and x.is_cuda), None)
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():  # the graph's GPU
            ms = agree.check_graph(found, kind)
        logging.getLogger("flashoverlap").info("flashoverlap: the ranks agreed on the %d collective(s) of a compiled "
                                               "%s graph in %.2f ms (first run only)", len(found), kind, ms)

    if not compat.run_first(compiled, first):
        logging.getLogger("flashoverlap").warning("flashoverlap: cannot check that the ranks agree on a compiled %s "
                                                  "graph (%s): unknown Inductor output", kind, type(compiled).__name__)


def checked(compiled: Any) -> Any:
    """``compiled`` followed, at every run, by the host-side fault check (``faults.raise_pending``: a pinned-memory
    read per fault domain, no device sync), so a wait that gave up inside a fused op -- CUDA-graph replays included
    -- raises at the next run the host sees it, on every rank, like an eager call would (``docs/design.md``); and
    preceded by the resynchronization of the groups such a fault marked (``routes.resync_marked``; a set test when
    none is), which replays would otherwise never reach."""
    from flashoverlap_inductor.runtime import faults

    @functools.wraps(compiled)  # keeps Inductor's attributes (``_boxed_call``, ...) and its calling convention
    def run(*args: Any, **kwargs: Any) -> Any:
        if faults.marked():
            from flashoverlap_inductor import routes

            routes.resync_marked()
        out = compiled(*args, **kwargs)
        faults.raise_pending()
        return out

    return run


def _reset() -> None:
    compat.reset_cudagraph_trees()


# ``torch._dynamo.reset()`` calls ``reset`` of a backend that has one (as it does for backend="inductor").
flashoverlap_backend.reset = _reset  # type: ignore[attr-defined]
