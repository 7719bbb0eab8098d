"""``FlashOverlapPass``: fuse a GEMM and the collective that consumes its output into one FlashOverlap op.

Flow per candidate (one ``wait_tensor`` of an all_reduce / reduce_scatter / all_to_all fed by mm/addmm/bmm):

    match   (``matching.find_matches``)   gemm -> views -> [split/cat] -> collective -> wait
            (before them: the MoE combine, experts' GEMM -> index_put -> all_to_all: ``combine.py``; and the
            MoE dispatch, all_to_all -> index -> experts' GEMMs: ``dispatch.py``)
    check   (``FlashOverlapPass.check``)  users, reduce op, dtype, row geometry, divisibility, group
    decide  (``FlashOverlapPass.choose_plan``)  fuse mode + cost model -> plan string (or skip)
    replace (``rewrite.replace``)         flashoverlap::gemm_<collective>(a, b, bias, ..., plan) + reshape

Every skip is logged with its reason and counted (``report.SKIP_REASONS``). Invariants of a rewrite: the wait's
users see a tensor of exactly the wait's shape and value; the collective still acts on dim 0 of the GEMM's
flattened output rows; no raw SymInt enters a node argument (shapes reuse existing argument nodes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
from torch.fx import Node

import flashoverlap_inductor.ops  # noqa: F401  (registers torch.ops.flashoverlap.*; a cached graph calls them)
from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import config

from . import all_gather, cache_key, combine, dispatch, manifest, rewrite, sum_of_gemms, tp_sequence
from .fx_forms import gpu_name, known_eq, known_true, node_arg, val
from .matching import Fusion, GemmCollectiveMatch, find_matches, find_sum, match_at_wait
from .report import log, record_deferred, record_fused, record_skip

aten = torch.ops.aten
TRAINING_KINDS = ("forward", "backward")  # the graphs of a training step (an inference graph: "inference")


def graph_settings(settings: config.Settings, kind: str | None, cudagraphs: bool = False) -> config.Settings:
    """The settings a graph of ``kind`` is rewritten under: ``host_floors="auto"`` becomes "off" in the graphs of a
    training step and "on" elsewhere (``config.Settings.host_floors``); in a graph Inductor replays as a CUDA graph
    (``cudagraphs``: its ``triton.cudagraphs``, e.g. ``mode="reduce-overhead"``) every floor is left out ("off"),
    so the fused ops' own choices (the reduce_scatter route) weigh GPU time alone, as the pass's verdicts there do
    (``FlashOverlapPass.without_host``); other settings are returned as they are."""
    if cudagraphs and settings.host_floors != "off":
        return settings.replace(host_floors="off")
    if settings.host_floors != "auto":
        return settings
    return settings.replace(host_floors="off" if kind in TRAINING_KINDS else "on")


class FlashOverlapPass(compat.CustomGraphPass):
    """Inductor ``post_grad_custom_pre_pass`` (runs on forward and backward graphs).

    ``settings`` is the ``config.Settings`` captured when the backend is called (a dict: changes to
    ``config.current()``); the pass uses only these, also for the backward graph that is compiled later, hands
    them to every fused op it emits (``Settings.key()``) and hashes them whole into ``uuid()``, so the FX graph
    cache never serves a graph compiled under other settings. ``graph_kind`` ("forward", "backward", "inference" or
    None: unknown) is the kind of the graph being compiled, set by the backend around each graph's compilation; a
    graph is rewritten under ``graph_settings(settings, graph_kind, ...)`` (``host_floors`` resolved), which its
    fused ops carry. Inductor's FX graph cache keys the graph's kind (``is_backward``, ``is_inference``) besides
    ``uuid()``.
    """

    def __init__(self, settings: config.Settings | dict[str, Any] | None = None) -> None:
        if not isinstance(settings, config.Settings):
            settings = config.current().replace(**(settings or {}))
        self.settings: config.Settings = settings
        self.graph_kind: str | None = None

    # ------------------------------------------------------------------------------------------------ driver

    def __call__(self, graph: torch.fx.Graph) -> None:
        settings = graph_settings(self.settings, self.graph_kind, compat.cudagraphs_enabled())
        local = self if settings is self.settings else FlashOverlapPass(settings)
        with config.using(settings):  # the cost model reads the settings captured at compile time
            if settings.fuse != "never":  # first: its reduce_scatters and all_gathers are the main pass's to fuse
                tp_sequence.shard_all_reduces(graph, settings, self.graph_kind)
            local.run(graph)
        manifest.record(manifest.graph_manifest(graph))  # what the ranks agree on before its first run

    def run(self, graph: torch.fx.Graph) -> int:
        """Rewrite ``graph`` in place; returns the number of fused matches."""
        if self.settings.fuse == "never":
            record_skip("fuse_never", "fuse mode is 'never'; graph left unchanged")
            return 0
        fused = combine.fuse_combines(graph, self.settings)  # first: its all_to_alls are no GEMM -> collective match
        fused += dispatch.fuse_dispatches(graph, self.settings)  # the MoE dispatch, the combine's mirror
        for match in find_matches(graph):
            log.debug("flashoverlap: match %s", match.describe())
            try:  # checks only read the graph: a bug here must cost a fusion, never the compilation
                fusion = self.check(match)
                if fusion is not None:
                    fusion.plan = self.choose_plan(fusion)
            except Exception as exc:
                record_skip("internal_error", "%s: %r", match.describe(), exc, level=logging.WARNING, exc_info=True)
                continue
            if fusion is None or fusion.plan is None:
                continue
            fusion.settings = self.settings.key()
            if rewrite.replace(graph, fusion):
                fused += 1
                record = record_deferred if fusion.plan == "auto" else record_fused
                record(match.collective, "%s (rows=%s n=%s k=%s %s, group %r x%d, plan %s)", match.describe(),
                       fusion.rows, fusion.n, fusion.k, fusion.dtype, fusion.group_name, fusion.group_size,
                       fusion.plan)
        fused += self._fuse_sums(graph)
        fused += all_gather.fuse_gathers(graph, self.settings)
        if fused:
            graph.lint()
        return fused

    def _fuse_sums(self, graph: torch.fx.Graph) -> int:
        """Sums of GEMMs feeding a collective (``sum_of_gemms``): each staged as one GEMM over the concatenated K,
        then matched, checked and decided like any other; unstaged again where it is not fused."""
        fused = 0
        for wait in list(graph.find_nodes(op="call_function", target=compat.c10d.wait_tensor.default)):
            form = find_sum(wait)
            if form is None:
                continue
            self._stage_sum(form, wait, graph)
            match = match_at_wait(wait)
            fusion = None
            if match is not None:
                match.label = form.describe()
                try:
                    fusion = self.check(match)
                    if fusion is not None:
                        fusion.sum_form = form
                        fusion.plan = self.choose_plan(fusion)
                except Exception as exc:
                    record_skip("internal_error", "%s: %r", match.describe(), exc, level=logging.WARNING,
                                exc_info=True)
                    fusion = None
            if fusion is None or fusion.plan is None:
                sum_of_gemms.unstage(form, graph)
                continue
            fusion.settings = self.settings.key()
            if not rewrite.replace(graph, fusion):
                sum_of_gemms.unstage(form, graph)
                continue
            sum_of_gemms.erase_terms(form, graph)
            fused += 1
            record = record_deferred if fusion.plan == "auto" else record_fused
            record(match.collective, "%s (rows=%s n=%s k=%s %s, group %r x%d, plan %s)", match.describe(),
                   fusion.rows, fusion.n, fusion.k, fusion.dtype, fusion.group_name, fusion.group_size, fusion.plan)
        return fused

    def _stage_sum(self, form: Any, wait: Node, graph: torch.fx.Graph) -> None:
        """Stage ``form`` for the pull route where it applies and its cost model says it pays (or fuse mode
        "always"), else as one GEMM over the concatenated K (``sum_of_gemms``)."""
        shape = sum_of_gemms.pull_applies(form, wait, self.settings)
        if shape is not None:
            from flashoverlap_inductor import cost_model
            from flashoverlap_inductor.cost_model import pull

            m, n, ks, dtype = shape
            try:
                form.pull_verdict = pull.sum_verdict(m, n, ks, dtype, gpu_name(val(form.terms[0])),
                                                     self.settings.min_gain_fraction, self.without_host(),
                                                     cost_model.registry.data_dir(self.settings))
            except Exception as exc:  # a bug costs the pull staging, never the compilation: the cats' form
                log.warning("flashoverlap: %s: the pull route's cost model failed (%r); staged as one GEMM",
                            form.describe(), exc)
                form.pull_verdict = None
            if form.pull_verdict is not None and (form.pull_verdict[0] or self.settings.fuse == "always"):
                sum_of_gemms.stage_pull(form, graph)
                return
        sum_of_gemms.stage(form, graph)

    def uuid(self) -> str:
        return cache_key.uuid_for(self.settings)

    def without_host(self) -> bool:
        """Whether this graph's verdicts leave the fused calls' host floors out: its calls are replayed from a CUDA
        graph, or its settings say so (``host_floors``)."""
        return compat.cudagraphs_enabled() or not self.settings.counts_host()

    # ------------------------------------------------------------------------------------------------ check

    def check(self, m: GemmCollectiveMatch) -> Fusion | None:
        """All static conditions of a fusion; returns None after recording the first failing one."""
        desc = m.describe()
        if m.collective not in self.settings.collectives:
            return _skip("collective_disabled", "%s: %s not in config.collectives %s", desc, m.collective,
                         self.settings.collectives)
        extra = _unexpected_user(m)
        if extra is not None:
            return _skip("multiple_users", "%s: %s has %d users %s", desc, extra.name, len(extra.users),
                         [u.name for u in extra.users])
        if not m.wait.users:
            return _skip("unused_result", "%s: the collective's result is unused", desc)
        reduce_op = m.args.get("reduce_op", "sum")
        if m.collective != "all_to_all" and str(reduce_op).lower() != "sum":
            return _skip("reduce_op", "%s: reduce op %r is not 'sum'", desc, reduce_op)
        nodes = [m.gemm, m.rows_node, m.wait, *m.gemm.all_input_nodes]
        if any(not isinstance(val(x), (torch.Tensor, torch.SymInt, int)) for x in nodes):
            return _skip("no_meta", "%s: missing meta['val']", desc)
        y = val(m.gemm)
        dtype = str(y.dtype).removeprefix("torch.")
        if dtype not in self.settings.dtypes:
            return _skip("dtype", "%s: dtype %s not in config.dtypes %s", desc, dtype, self.settings.dtypes)
        mixed = [x.name for x in [*m.gemm.all_input_nodes, m.wait] if val(x).dtype != y.dtype]
        if mixed:
            return _skip("dtype_mismatch", "%s: %s differ in dtype from the GEMM's %s output (%s)", desc, mixed,
                         dtype, [str(val(x).dtype).removeprefix("torch.") for x in m.gemm.all_input_nodes])
        if m.gemm.target is aten.addmm.default:
            beta, alpha = node_arg(m.gemm, 3, "beta", 1), node_arg(m.gemm, 4, "alpha", 1)
            if beta != 1 or alpha != 1:
                return _skip("addmm_scale", "%s: addmm beta=%s alpha=%s", desc, beta, alpha)
            bias, a, b = m.gemm.args[:3]
        else:
            (a, b), bias = m.gemm.args[:2], None
        group_name = _group_name(m.args.get("group_name"))
        size = {"all_reduce": lambda: compat.group_size(group_name) if group_name else None,
                "reduce_scatter": lambda: m.args["group_size"],
                "all_to_all": lambda: len(m.args["input_split_sizes"])}[m.collective]()
        if group_name is None or not isinstance(size, int) or size < 1:
            return _skip("unknown_group", "%s: group %r (size %s) cannot be resolved", desc,
                         m.args.get("group_name"), size)
        fusion = Fusion(m, a, b, bias, math.prod(y.shape[:-1]), y.shape[-1], val(a).shape[-1], dtype, group_name,
                        size)
        return fusion if self._check_geometry(fusion) else None

    def _check_geometry(self, f: Fusion) -> bool:
        """Row geometry: the views only regroup rows, the collective's dim 0 covers whole op dim-0 elements,
        the reduce_scatter form is expressible, sizes divide. Fills ``out_shape``/``row_perm``/``split_scale``."""
        m, desc = f.match, f.match.describe()
        y, t = val(m.gemm).shape, val(m.rows_node).shape
        if m.views and not (known_eq(t[-1], y[-1]) and known_eq(math.prod(t[:-1]), math.prod(y[:-1]))):
            return _fail("view_shape", "%s: reshape %s -> %s is not a pure row flatten/unflatten", desc,
                         list(y), list(t))
        unit_op, unit_c = math.prod(y[1:-1]), math.prod(t[1:-1])  # flattened rows per dim-0 element
        sc = m.scatter
        if sc is not None and not self._check_scatter(f, t):
            return False
        whole = known_true(unit_c % unit_op == 0)  # a collective dim-0 element holds whole op dim-0 elements
        if m.collective == "reduce_scatter":
            if sc is None and compat.is_static_int(t[0]) and int(t[0]) % f.group_size:
                return _fail("indivisible", "%s: dim 0 (%s) does not divide by the group size %d", desc,
                             t[0], f.group_size)
            # the op shards dim 0 of the GEMM output (whole bmm batches); the same rows iff that dim divides
            if not (whole or known_true(y[0] % f.group_size == 0)):
                return _fail("indivisible", "%s: the GEMM output's dim 0 (%s) does not divide by the group size %d",
                             desc, y[0], f.group_size)
        if m.collective == "all_to_all":
            ins = [val(x) for x in m.args["input_split_sizes"]]
            if all(compat.is_static_int(x) for x in ins) and compat.is_static_int(t[0]) and sum(ins) != t[0]:
                return _fail("indivisible", "%s: input_split_sizes %s do not sum to dim 0 = %s", desc, ins, t[0])
            if not whole:
                return _fail("view_shape", "%s: a split unit of the collective (%s rows) is not a whole dim-0 "
                             "element of the GEMM output (%s rows)", desc, unit_c, unit_op)
            scale = unit_c // unit_op if compat.is_static_int(unit_c) and compat.is_static_int(unit_op) else None
            if scale is None and not known_eq(unit_c, unit_op):
                return _fail("view_shape", "%s: symbolic rows per split unit (%s)", desc, unit_c)
            f.split_scale, f.rows_per_split_unit = int(scale or 1), unit_c
        return self._set_out_shape(f, t)

    def _check_scatter(self, f: Fusion, t: Any) -> bool:
        """The funcol split/cat form of reduce_scatter over ``dim``: equal consecutive pieces, one per rank,
        along a row dim. For dim > 0 the rewrite reorders ``a``'s rows so that the op's dim-0 shard is the cat's."""
        sc, desc, ws = f.match.scatter, f.match.describe(), f.group_size
        assert sc is not None
        chunk = val(sc.chunk)
        if sc.dim >= len(t) - 1:
            return _fail("scatter_dim", "%s: scatter dim %d is the GEMM's column dim", desc, sc.dim)
        if sc.dim > 0 and f.match.gemm.target is aten.bmm.default:
            return _fail("scatter_dim", "%s: scatter dim %d > 0 after bmm", desc, sc.dim)
        even = len(sc.pieces) == ws and known_eq(t[sc.dim], ws * chunk)
        even = even and all(known_eq(val(p).shape[sc.dim], chunk) for p in sc.pieces)
        if sc.split is None:  # slice form: piece i starts at i * chunk
            even = even and all(known_eq(val(node_arg(p, 2, "start", 0)), i * chunk) for i, p in enumerate(sc.pieces))
        if not even:
            return _fail("scatter_dim", "%s: %d pieces of %s along dim %d are not %d equal consecutive chunks",
                         desc, len(sc.pieces), list(t), sc.dim, ws)
        if sc.dim == 0:
            return True
        bias = None if f.bias is None else val(f.bias)
        pull_bias = (bias is not None and bias.dim() == 2 and known_eq(bias.shape[0], f.rows)
                     and known_eq(bias.shape[1], f.n) and ws == 2 and self.settings.transport == "peer"
                     and "scatter_pull" in self.settings.experiments)
        if bias is not None and bias.dim() >= 2 and not known_eq(bias.shape[0], 1) and not pull_bias:
            # only the pull route takes a bias of the output's rows (a staged sum's partial, reordered as a's rows)
            return _fail("bias_shape", "%s: bias %s varies along the rows that the rewrite reorders", desc,
                         list(bias.shape))
        args = _shape_args(f.match.rows_node)
        if args is None:
            return _fail("view_shape", "%s: the view's shape cannot be reused", desc)
        d = sc.dim
        f.row_perm = ([*args[:d], ws, sc.chunk, *args[d + 1:-1], -1], [d, *range(d), *range(d + 1, len(t) + 1)])
        return True

    def _set_out_shape(self, f: Fusion, t: Any) -> bool:
        m = f.match
        wait_shape = val(m.wait).shape
        if all(compat.is_static_int(x) for x in wait_shape):
            f.out_shape = [int(x) for x in wait_shape]
            return True
        if not m.views:
            return True  # the op returns the collective's shape already
        args = _shape_args(m.rows_node)
        if args is None:
            return _fail("view_shape", "%s: the view's shape %s cannot be reused", m.describe(), m.rows_node.args)
        if m.scatter is not None:
            d = m.scatter.dim
            f.out_shape = [*args[:d], m.scatter.chunk, *args[d + 1:]]
        elif m.collective == "all_reduce":
            f.out_shape = list(args)
        else:
            f.out_shape = [-1, *args[1:]]
        return True

    # ------------------------------------------------------------------------------------------------ decide

    def choose_plan(self, f: Fusion) -> str | None:
        """The op's plan string: the cost model's plan for static sizes, "auto" for symbolic ones; None after
        recording a skip (fuse mode "auto" only)."""
        mode, desc = self.settings.fuse, f.match.describe()
        if f.match.collective == "all_to_all" and mode == "auto":
            # Every rank must take the same decision or their collectives mismatch (a hang). all_to_all ranks may
            # hold different rows, and a cost verdict from this rank's rows could differ between ranks; it also
            # measured slower than unfused on 2 and 4 H200s (docs/results.md). The op's all_to_all schedule
            # uses rank-independent fractions, so "always" is safe.
            return _skip("all_to_all_auto", "%s: all_to_all is fused only under fuse='always'", desc)
        splits = None
        if f.match.collective == "all_to_all":
            splits = [val(x) * f.rows_per_split_unit for x in f.match.args["input_split_sizes"]]
        sizes = [f.rows, f.n, f.k, *(splits or [])]
        if not all(compat.is_static_int(x) for x in sizes):
            log.info("flashoverlap: %s: symbolic sizes (rows=%s): plan 'auto' (decided per call)", desc, f.rows)
            return "auto"
        rows = int(f.rows)
        if mode == "auto" and rows < self.settings.min_rows:
            return _skip("too_small", "%s: %d rows < config.min_rows=%d", desc, rows, self.settings.min_rows)
        try:
            from flashoverlap_inductor import cost_model  # looked up per call: tests may patch cost_model.decide

            y = val(f.match.gemm)
            decision = cost_model.decide(f.match.collective, rows, int(f.n), int(f.k), f.dtype, f.group_size,
                                         device_name=gpu_name(y),
                                         input_split_sizes=[int(x) for x in splits] if splits else None,
                                         **_route_of(f.match.collective, rows, int(f.n), int(f.k), f.dtype,
                                                     f.group_size, y, self.settings),
                                         cuda_graphs=self.without_host(), settings=self.settings)
        except Exception as exc:
            if mode == "auto":
                return _skip("cost_model_error", "%s: cost model failed: %r", desc, exc, level=logging.WARNING)
            log.warning("flashoverlap: %s: cost model failed (%r); plan 'auto'", desc, exc)
            return "auto"
        if f.sum_form is not None and f.sum_form.pull:  # staged for the pull route: its own verdict
            verdict, fused, seq, summary = f.sum_form.pull_verdict
            decision = dataclasses.replace(decision, fuse=verdict, reason=f"{f.sum_form.describe()}: {summary}",
                                           predicted_fused_ms=fused, predicted_seq_ms=seq)
        elif f.sum_form is not None:  # the cats' copies and the adds it saves: on top of the one-GEMM prediction
            verdict, reason = sum_of_gemms.adjust(decision, f.sum_form, f.dtype, gpu_name(y),
                                                  self.settings.min_gain_fraction)
            decision = dataclasses.replace(decision, fuse=verdict, reason=reason)
        if mode == "auto" and not decision.fuse:
            return _skip("cost_model", "%s: %s", desc, decision.reason)
        log.info("flashoverlap: %s: %s %s", desc, "fusing:" if decision.fuse else "fusing anyway (always):",
                 decision.reason)
        return decision.plan.to_str()


# ---------------------------------------------------------------------------------------------------- helpers


def _skip(slug: str, msg: str, *args: Any, level: int = logging.INFO) -> None:
    record_skip(slug, msg, *args, level=level)
    return None


def _fail(slug: str, msg: str, *args: Any) -> bool:
    record_skip(slug, msg, *args)
    return False


def _unexpected_user(m: GemmCollectiveMatch) -> Node | None:
    """The first node on the chain whose users are not exactly the next step of the chain."""
    steps: list[tuple[Node, set[Node]]] = []
    seq = [m.gemm, *m.views]
    for node, nxt in zip(seq, seq[1:], strict=False):
        steps.append((node, {nxt}))
    sc = m.scatter
    if sc is None:
        steps.append((seq[-1], {m.coll}))
    else:
        steps.append((seq[-1], {sc.split} if sc.split is not None else set(sc.pieces)))
        if sc.split is not None:
            steps.append((sc.split, set(sc.pieces)))
        steps += [(p, {sc.cat}) for p in sc.pieces]
        steps.append((sc.cat, {m.coll}))
    steps.append((m.coll, {m.wait}))
    for node, expected in steps:
        if set(node.users) != expected:
            return node
    return None


def _group_name(arg: Any) -> str | None:
    if isinstance(arg, str):
        return arg
    name = getattr(arg, "group_name", None)  # a ProcessGroup passed as an opaque object
    return name if isinstance(name, str) else None


def _shape_args(view: Node) -> list | None:
    """The shape argument of a view node, with any -1 replaced by its static size (None if symbolic)."""
    if len(view.args) < 2 or not isinstance(view.args[1], (list, tuple)):
        return None
    out = []
    for i, x in enumerate(view.args[1]):
        if isinstance(x, int) and x == -1:
            size = val(view).shape[i]
            if not compat.is_static_int(size):
                return None
            x = int(size)
        out.append(x)
    return out


def _route_of(collective: str, rows: int, n: int, k: int, dtype: str, world: int, y: torch.Tensor,
              settings: config.Settings) -> dict[str, Any]:
    """``decide``'s route arguments from the route registry (``routes.select``, the same choice the runtime makes):
    the peer route, the ring in how many rounds, or the reduce_scatter pull route, so the cost model predicts the
    route that runs. A capture takes
    the route where the call shape ran before the capture, as torch.compile's warm-up runs it."""
    from flashoverlap_inductor import routes

    if y.device.type != "cuda":
        return dict(routes.NO_ROUTE_ARGS)
    call = routes.Call(collective, rows, n, k, getattr(torch, dtype), world, device=y.device.type,
                       compile_time=True, device_index=y.device.index)
    return routes.cost_args(call, settings)
