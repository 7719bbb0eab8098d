"""Sequence parallelism made from a tensor-parallel graph's all_reduces (the setting ``tp_sequence``).

In a tensor-parallel decoder the row-parallel GEMMs (o_proj, down_proj) end in an all_reduce whose result only
row-wise ops read before the next GEMMs: the residual add, the RMSNorm (a mean over the last dim, casts, products
with a weight of one row). Here each such all_reduce becomes a reduce_scatter over the rows (the product of every
dim but the last), the row-wise ops run on this rank's rows, and one all_gather per sharded value brings the rows
back wherever anything else reads them (the next GEMMs, a slice, the graph's output) -- the rewrite of vLLM's
sequence-parallelism pass, so that the main pass then fuses GEMM -> reduce_scatter and all_gather -> GEMMs. An
all_reduce is a reduce_scatter plus an all_gather, so the bytes moved stay the same; the row-wise ops do 1/world of
their work; a full-row tensor that a sharded op also reads (the residual stream entering the first sharded add) is
sliced to this rank's rows.

Only in inference graphs (``FlashOverlapPass.graph_kind == "inference"``): a training forward's saved activations
keep their full shapes for the backward compiled apart from it. Only sum all_reduces of a GEMM's output (through
views) with a static row count that the group size divides. Rank ``r`` holds rows ``[r * M / world, (r + 1) * M /
world)``, the layout of ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` on dim 0, so the graph embeds its
rank (read at compile time from the group), as a graph of DTensor's local shards does; the pass's cache key then
names the rank (``cache_key.rank_part``: the ranks of a host share the FX graph cache). Invariants: every node
outside the sharded region reads a tensor of the shape and value it read before; the new collectives are issued in
graph order, the same on every rank. Tests: ``tests/test_tp_sequence.py`` (CPU, gloo); on 2 H200s (39th session)
Llama-3-8B tp prefill ran it correct and faster (1.074x over Inductor against 1.034x: docs/results.md).
"""

from __future__ import annotations

import collections
import math

import torch
from torch.fx import Node

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import config

from .fx_forms import val
from .matching import GEMM_OPS, VIEW_OPS, behind_views
from .report import log, record_rewrite
from .rewrite import _Builder

aten = torch.ops.aten
ROW_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default)
ROWS_TAG = "flashoverlap_tp_rows"  # node.meta key of the slices of this rank's rows the rewrite made
EVENT = "tp_sequence"  # the report's ``rewrite:tp_sequence``: one per all_reduce rewritten
PICKS = (aten.slice.Tensor, aten.select.int, aten.squeeze.dim, aten.unsqueeze.default)  # some of the rows, reshaped


def shard_all_reduces(graph: torch.fx.Graph, settings: config.Settings, kind: str | None) -> int:
    """Rewrite every qualifying all_reduce of ``graph`` (module docstring) under ``settings`` (the graph's); the
    number rewritten. Under ``tp_sequence="auto"`` and ``fuse="auto"`` an all_reduce of fewer than ``min_rows`` rows
    (a decode step's) or off the GPU stays: the pass would fuse neither half, and two collectives would take the
    place of one."""
    if not rewrites(settings) or kind != "inference":
        return 0
    guarded = settings.fuse == "auto" and settings.tp_sequence == "auto"
    min_rows = settings.min_rows if guarded else 0
    done, taken = 0, set()
    for wait in list(graph.find_nodes(op="call_function", target=compat.c10d.wait_tensor.default)):
        if wait in taken or not _is_all_reduce(wait):
            continue
        why = _unsupported(wait.args[0], wait, min_rows, gpu_only=guarded)
        if why:
            log.info("flashoverlap: tp_sequence: all_reduce %s left as it is: %s", wait.args[0].name, why)
            continue
        region = _Region(graph, wait)
        region.rewrite()
        taken |= region.seeds
        done += len(region.seeds)
    if done:
        graph.lint()
    return done


def rewrites(settings: config.Settings) -> bool:
    """Whether graphs compiled under ``settings`` may be rewritten here (then they depend on the rank): not under
    ``tp_sequence="off"`` or ``fuse="never"``, nor where ``collectives`` leaves out either half."""
    halves = {"reduce_scatter", "all_gather"} <= set(settings.collectives)
    return settings.tp_sequence != "off" and settings.fuse != "never" and halves


def _is_all_reduce(wait: Node) -> bool:
    coll = wait.args[0] if wait.args else None
    return isinstance(coll, Node) and coll.target is compat.c10d.all_reduce.default and coll.args[1] == "sum"


def _unsupported(coll: Node, wait: Node, min_rows: int = 0, gpu_only: bool = False) -> str | None:
    x, _ = behind_views(coll.args[0])
    if not isinstance(x, Node) or x.target not in GEMM_OPS:
        return "no GEMM behind it"
    full = val(wait)
    world = compat.group_size(coll.args[2])
    if full is None or full.dim() < 2 or not all(compat.is_static_int(s) for s in full.shape):
        return "not a static tensor of rows"
    rows = math.prod(full.shape[:-1])
    if world is None or world < 2 or rows % world:
        return f"{rows} rows do not split over {world} ranks"
    if rows < min_rows:
        return f"{rows} rows < config.min_rows={min_rows}"
    if gpu_only and full.device.type != "cuda":
        return f"on {full.device.type}, where fuse='auto' fuses neither half"
    if not _gemm_after_row_wise_ops(wait):
        return "no GEMM after row-wise ops reads it (a reduce_scatter and an all_gather would only take its place)"
    return None


def _gemm_after_row_wise_ops(wait: Node, limit: int = 256) -> bool:
    """Whether a GEMM reads what row-wise ops made of ``wait`` (a pointwise op or a row reduction on the way, views
    and slices besides): the next layer's q/k/v or gate/up after the residual add and the norm, whose all_gather
    the pass then fuses. Walks at most ``limit`` nodes."""
    seen: set[Node] = set()
    todo = collections.deque((u, False) for u in wait.users)  # breadth first: the nearby norm -> GEMM before the
    while todo and len(seen) < limit:  # residual stream's later layers
        node, row_wise = todo.popleft()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target in GEMM_OPS:
            if row_wise:
                return True
            continue
        if node.target in VIEW_OPS or node.target in PICKS:
            todo.extend((u, row_wise) for u in node.users)
        elif node.target in ROW_REDUCTIONS or _pointwise(node.target):
            todo.extend((u, True) for u in node.users)
    return False


def _pointwise(target: object) -> bool:
    """An ATen / prims op tagged pointwise."""
    return torch.Tag.pointwise in getattr(target, "tags", ())


class _Region:
    """The values made sharded from one all_reduce: ``shard[full node] = node of this rank's rows`` (2-D,
    ``[M / world, C]``), and the all_gathers that give them back in full (one per shard node)."""

    def __init__(self, graph: torch.fx.Graph, wait: Node) -> None:
        coll = wait.args[0]
        self.graph, self.wait = graph, wait
        self.group = coll.args[2]
        self.world = compat.group_size(self.group)
        self.rank = compat.resolve_group(self.group).rank()
        full = val(wait)
        self.lead = tuple(int(s) for s in full.shape[:-1])
        self.rows = math.prod(self.lead)
        self.share = self.rows // self.world
        self.build = _Builder(graph, coll)
        self.shard: dict[Node, Node] = {}
        self.gathered: dict[Node, Node] = {}
        self.seeds: set[Node] = set()  # the all_reduces' waits made reduce_scatters (this one, and those a sharded
        # op reads beside a shard: the next layer's, whose sum then joins the same sharded residual stream)
        self.pending: list[Node] = []

    def _seed(self, wait: Node) -> None:
        """``wait``'s all_reduce as a reduce_scatter of the rows (made before the all_reduce); its readers queued."""
        coll, c10d = wait.args[0], compat.c10d
        with self.graph.inserting_before(coll):
            x = self.build.call(aten.reshape.default, (coll.args[0], [self.rows, val(wait).shape[-1]]))
            rs = self.build.call(c10d.reduce_scatter_tensor.default, (x, "sum", self.world, self.group))
            self.shard[wait] = self.build.call(c10d.wait_tensor.default, (rs,))
        self.seeds.add(wait)
        record_rewrite(EVENT, "%s, a sum all_reduce of %d rows over %d ranks -> reduce_scatter, the row-wise ops on "
                       "this rank's rows, all_gather before the next GEMMs", coll.name, self.rows, self.world)
        self.pending.extend(u for u in wait.users if u in self.order)

    def rewrite(self) -> None:
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}  # the originals (each node made here reads a shard)
        self._seed(self.wait)
        seen: set[Node] = set()
        while self.pending:
            self.pending = sorted(set(self.pending), key=self.order.__getitem__)
            node = self.pending.pop(0)
            if node in seen or node in self.shard:
                continue
            seen.add(node)
            if self._propagate(node):
                self.pending.extend(u for u in node.users if u in self.order)
            else:
                self._read_full(node)
        colls = [wait.args[0] for wait in self.seeds]
        for node in sorted(self.shard, key=self.order.__getitem__, reverse=True):  # the full originals no one reads
            if not node.users:
                self.graph.erase_node(node)
        for coll in colls:
            if not coll.users:
                self.graph.erase_node(coll)

    # ---------------------------------------------------------------------------------------------- propagate

    def _joins(self, a: Node) -> bool:
        """Whether ``a`` is another all_reduce's wait that this region can take as a reduce_scatter: a sum over the
        same group of a GEMM's rows of the same leading shape."""
        return a.op == "call_function" and a.target is compat.c10d.wait_tensor.default and _is_all_reduce(a) and \
            a.args[0].args[2] == self.group and _unsupported(a.args[0], a) is None and self._row_shape(val(a))

    def _own_rows(self, node: Node) -> bool:
        """``node`` is ``slice(x, 0, rank * share, (rank + 1) * share)`` of a flattened ``x`` sharded here, made by
        this pass: the tag (``ROWS_TAG``) names the group, rank, share and rows its bounds came from (a slice of the
        user's whose bounds happen to be this rank's rows is no shard, or one rank would take it for its shard and
        another gather it)."""
        return node.meta.get(ROWS_TAG) == self._rows_tag() and node.args[0] in self.shard

    def _row_shape(self, t: torch.Tensor) -> bool:
        return t.dim() >= 1 and tuple(int(s) for s in t.shape[:-1]) == self.lead

    def _propagate(self, node: Node) -> bool:
        """Make ``node``'s sharded twin where it is row-wise in its sharded inputs (True), else False."""
        if node.op != "call_function" or len(node.kwargs) > 0 and node.target not in ROW_REDUCTIONS:
            return False
        out = val(node)
        if node.target is aten.slice.Tensor and self._own_rows(node):  # an earlier region's slice of this rank's
            self.shard[node] = self.shard[node.args[0]]  # rows of a value sharded here: the shard itself
            node.replace_all_uses_with(self.shard[node])
            return True
        if not isinstance(out, torch.Tensor):
            return False
        if node.target in VIEW_OPS:  # the same rows, flattened ([rows, C], as the 2-D shard) or regrouped: the shard
            src = node.args[0]
            rows_kept = self._row_shape(out) or tuple(out.shape[:-1]) == (self.rows,)
            if rows_kept and src in self.shard and int(out.shape[-1]) == int(val(src).shape[-1]):
                self.shard[node] = self.shard[src]
                return True
            return False
        if not self._row_shape(out):
            return False
        if node.target in ROW_REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            last = val(node.args[0]).dim() - 1
            if not keep or list(dims) not in ([-1], [last]) or node.args[0] not in self.shard or \
                    node.kwargs.get("dtype") is not None:
                return False
            with self.graph.inserting_before(node):
                self.shard[node] = self.build.call(node.target, (self.shard[node.args[0]], [-1], True))
            return True
        if not _pointwise(node.target):
            return False
        kinds = [self._arg_kind(a) for a in node.args]
        if "full" in kinds:  # read in full: the node stays (its sharded inputs gathered), nothing made or seeded
            return False
        args = []
        with self.graph.inserting_before(node):
            for a, kind in zip(node.args, kinds):
                if kind == "join" and a not in self.shard:  # (an argument twice: seeded once)
                    self._seed(a)
                if kind in ("shard", "join"):
                    args.append(self.shard[a])
                elif kind == "broadcast" and val(a).dim() > 1:  # a weight of one row: as a 1-D row
                    args.append(self.build.call(aten.reshape.default, (a, [int(val(a).shape[-1])])))
                elif kind == "rows":  # a full-row tensor: this rank's rows of it
                    flat = self.build.call(aten.reshape.default, (a, [self.rows, int(val(a).shape[-1])]))
                    start = self.rank * self.share
                    args.append(self.build.call(aten.slice.Tensor, (flat, 0, start, start + self.share)))
                    args[-1].meta[ROWS_TAG] = self._rows_tag()
                else:  # not a node, a scalar or a 1-D row
                    args.append(a)
            self.shard[node] = self.build.call(node.target, tuple(args))
        return True

    def _arg_kind(self, a: object) -> str:
        """How a pointwise op's argument ``a`` reads: "shard" (sharded here), "join" (another all_reduce this region
        takes: seeded once the op is known to propagate), "broadcast" (a scalar or one row), "rows" (a full-row
        tensor: sliced), "full" (read in full: the op cannot run on the shard), or "const" (not a node)."""
        if not isinstance(a, Node):
            return "const"
        if a in self.shard:
            return "shard"
        if self._joins(a):
            return "join"
        t = val(a)
        if isinstance(t, torch.Tensor) and (t.numel() == 1 or all(int(s) == 1 for s in t.shape[:-1])):
            return "broadcast"
        if isinstance(t, torch.Tensor) and self._row_shape(t):
            return "rows"
        return "full"

    def _rows_tag(self) -> tuple:
        """What a slice of this rank's rows made here carries (``ROWS_TAG``): only such a slice is ``_own_rows``."""
        return (str(self.group), self.rank, self.share, self.rows)

    # ---------------------------------------------------------------------------------------------- gather

    def _read_full(self, node: Node) -> None:
        """``node`` reads sharded values in full: each through the all_gather of its shard (one per shard node,
        made before its first reader), viewed back to the value's own shape."""
        for a in list(node.all_input_nodes):
            if a not in self.shard:
                continue
            s = self.shard[a]
            if s not in self.gathered:
                with self.graph.inserting_after(s):
                    ag = self.build.call(compat.c10d.all_gather_into_tensor.default, (s, self.world, self.group))
                with self.graph.inserting_after(ag):
                    self.gathered[s] = self.build.call(compat.c10d.wait_tensor.default, (ag,))
            full, shape = self.gathered[s], list(val(a).shape)
            if list(val(full).shape) != shape:
                with self.graph.inserting_before(node):
                    full = self.build.call(aten.reshape.default, (full, shape))
            node.replace_input_with(a, full)
