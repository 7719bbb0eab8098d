"""What the MoE sub-passes share (``combine.py``: experts' GEMM -> un-permutation -> all_to_all; ``dispatch.py``:
all_to_all -> permutation -> experts' GEMMs): the find / check / decide / fuse loop, the rank-identical decision,
the group check and the grouped-GEMM form check.

Rank agreement, for both: every check reads only the graph's structure, dtypes, the weights' sizes and the settings
(never the per-rank rows or split sizes). The fuse mode then decides: ``always`` fuses every match; ``auto`` asks
the cost model (``cost_model.moe.decide_moe``) at the rows this rank compiled (its token rows: the dispatch's input,
the combine's output; none where they are symbolic, which declines) and takes the group's verdict for the op, agreed
through the group's store with no collective (``moe_verdict``: the first verdict offered for the op's identity,
which leaves the rows out, holds for every rank and every later compilation). A verdict from each rank's own rows
could differ between ranks and pair a fused op with another rank's all_to_all. Deciding per call instead (the op
running its unfused reference where the model declines) was built and measured at 0.869x of Inductor on the
qwen3-moe EP2 prefill (2 H100s), and withdrawn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import config, errors

from . import moe_verdict
from .combine_match import GROUPED_OP
from .fx_forms import gpu_name, node_arg, val
from .report import record_skip

PLAN = "blocks"  # per peer rank: its block of every expert's rows (``schedule.combine``)
EXPERT_PLAN = "experts"  # the dispatch's experts in 2 pieces (experiment moe_dispatch_by_expert; moe_expert_cut)


def skip(slug: str, msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Record a skip under ``slug`` (``report.SKIP_REASONS``); returns None, for ``return skip(...)``."""
    record_skip(slug, msg, *args, level=level)
    return None


@dataclass(frozen=True)
class MoeProblem:
    """What ``auto`` decides a MoE op from (module docstring): ``rows`` per rank (None: symbolic), the GEMM terms'
    ``(k, n)`` (as text where symbolic), ``experts`` per rank (the loop form: its GEMM pieces), the dtype name, the
    group's size, the GPU's name (None: the cost model's default)."""

    rows: int | None
    gemms: tuple[tuple[Any, Any], ...]
    experts: Any
    dtype: str
    world: int
    device: str | None

    def identity(self, op: str, settings: config.Settings) -> str:
        """The op's name in the group's store (``moe_verdict``): all of the problem but the rows, the settings the
        ranks share and the cost-model data's digest; the same on every rank that runs the same program."""
        from flashoverlap_inductor.routes import agree

        return "|".join((op, self.dtype, f"world {self.world}", f"experts {self.experts}", repr(self.gemms),
                         agree.shared_settings_key(settings), agree.data_digest(settings.config_dir)))

    def verdict(self, op: str, settings: config.Settings) -> tuple[bool, str]:
        """This rank's own verdict and the cost model's reason (no verdict, so declined, where anything is
        symbolic)."""
        if self.rows is None:
            return False, "declined: its rows are symbolic (data-dependent split sizes or dynamic shapes)"
        if not all(isinstance(d, int) for g in self.gemms for d in g):
            return False, "declined: its weights' sizes are symbolic"
        from flashoverlap_inductor.cost_model import moe

        found = moe.decide_moe(op, self.rows, self.gemms, self.dtype, self.world, device_name=self.device,
                               settings=settings)
        return found.fuse, found.reason


def problem_of(rows_from: Node, weights: list[Node], loop: bool, dtype: torch.dtype, world: int) -> MoeProblem:
    """The ``MoeProblem`` of a match: ``rows_from``'s row count (dim 0: this rank's token rows; a symbolic count
    where the graph asserts it equal to an int, as Dynamo does where the split parts meet a static shape; else
    None), the (k, n) of each weight's last two dims (one term for the per-expert loop form, whose pieces make
    one GEMM) and the experts per rank (the loop's pieces, or a grouped weight's dim 0)."""
    like = val(rows_from)
    rows = compat.asserted_int(like.shape[0])
    terms = [val(w).shape for w in (weights[:1] if loop else weights)]

    def plain(d: Any) -> Any:  # a symbol's name depends on the order a rank allocated it: never part of the identity
        return d if isinstance(d, int) else "symbolic"

    experts = len(weights) if loop else plain(terms[0][0])
    return MoeProblem(rows, tuple((plain(s[-2]), plain(s[-1])) for s in terms),
                      experts, str(dtype).removeprefix("torch."), world, gpu_name(like))


def decide(op: str, desc: str, group: str, settings: config.Settings,
           problem: Callable[[], MoeProblem]) -> str | None:
    """The plan of a checked MoE ``op`` ("combine" / "dispatch") over ``group``, or None after recording
    ``<op>_auto``: ``always`` fuses every match; ``auto`` takes the group's verdict for ``problem()`` (asked only
    here), agreed through the group's store (module docstring)."""
    plan = EXPERT_PLAN if op == "dispatch" and "moe_dispatch_by_expert" in settings.experiments else PLAN
    if settings.fuse != "auto":  # the same settings on every rank: the same plan
        return plan
    try:
        found = problem()
        identity = found.identity(op, settings)
    except Exception as exc:  # the op cannot be named: no rank may decide it alone (fails the compilation)
        raise errors.FlashOverlapError(f"flashoverlap: {desc}: cannot name the MoE op for the group's verdict under "
                                       f"fuse='auto' ({exc!r}); use fuse='always' or 'never'") from exc
    try:
        mine, reason = found.verdict(op, settings)
    except Exception as exc:  # noqa: BLE001 - this rank offers a decline; the group's verdict still holds
        mine, reason = False, f"declined: no prediction ({exc!r})"
    held = moe_verdict.agreed(group, identity, mine, found.rows)  # raises where the store fails: see fuse_each
    if held.fuse:
        logging.getLogger("flashoverlap").info("flashoverlap: %s: fused under fuse='auto' (%s); the cost model "
                                               "here: %s", desc, held.describe(), reason)
        return plan
    return skip(f"{op}_auto", "%s: declined under fuse='auto' (%s); the cost model here: %s", desc,
                held.describe(), reason)


def group_of(args: dict[str, Any], desc: str) -> str | None:
    """The all_to_all's group name when it resolves and its split sizes are two lists of the group's size, else
    None after recording ``unknown_group``. ``args``: the all_to_all's ``output_split_sizes``,
    ``input_split_sizes`` and ``group_name``."""
    group = args.get("group_name")
    group = group if isinstance(group, str) else getattr(group, "group_name", None)
    splits = (args.get("output_split_sizes"), args.get("input_split_sizes"))
    if group is None or not all(isinstance(s, (list, tuple)) for s in splits) or \
            len(splits[0]) != len(splits[1]) or len(splits[1]) != compat.group_size(group):
        return skip("unknown_group", "%s: group %r with split sizes %s cannot be resolved", desc,
                    args.get("group_name"), splits)
    return group


def grouped_gemm_problem(gemms: list[Node]) -> str:
    """Why ``torch._grouped_mm`` terms are not ones the MoE ops run ("" when they are): no bias or other output
    dtype, one shared 1-D int32 offsets tensor, ``[rows, K] @ [experts, K, N]``."""
    offs = [node_arg(g, 2, "offs") for g in gemms]
    extras = [g.name for g in gemms if node_arg(g, 3, "bias") is not None or
              node_arg(g, 4, "out_dtype") not in (None, val(g).dtype)]
    if extras:
        return f"{extras} have a bias or another output dtype"
    if not isinstance(offs[0], Node) or any(o is not offs[0] for o in offs):
        return "the grouped GEMMs do not share one offsets tensor"
    if any(g.target is not GROUPED_OP or val(g.args[0]).dim() != 2 or val(g.args[1]).dim() != 3 for g in gemms):
        return "a grouped GEMM is not [rows, K] @ [experts, K, N]"
    if val(offs[0]).dtype != torch.int32 or val(offs[0]).dim() != 1:
        return "the offsets are not a 1-D int32 tensor"
    return ""


def fuse_each(graph: torch.fx.Graph, settings: config.Settings, match: Callable[[Node], Any],
              check: Callable[[Any, config.Settings], str | None], op: str,
              fuse: Callable[[Any, str, str, str], bool], problem: Callable[[Any], MoeProblem]) -> int:
    """For every ``wait_tensor`` of ``graph``: ``match(wait)`` (a match object or None), ``check(m, settings)``
    (the group name, or None after a skip), ``decide`` (with ``problem(m)``), then ``fuse(m, group, plan,
    settings_key)`` (True when it rewrote, recording the fusion); returns how many were fused. A check that raises
    costs the fusion, never the compilation (``internal_error``); a decision that raises (under ``auto``: the
    op's identity or the group's store failed) fails the compilation, since this rank declining alone could pair a
    plain all_to_all with its peers' fused op."""
    fused = 0
    for wait in list(graph.find_nodes(op="call_function", target=compat.c10d.wait_tensor.default)):
        m = match(wait)
        if m is None:
            continue
        try:
            group = check(m, settings)
        except Exception as exc:  # noqa: BLE001
            record_skip("internal_error", "%s: %r", m.describe(), exc, level=logging.WARNING, exc_info=True)
            continue
        if group is None:
            continue
        # not caught: under auto a rank that could not take the group's verdict must not decline alone (its peers
        # may fuse), so the compilation fails on it, before any of its collectives run
        plan = decide(op, m.describe(), group, settings, lambda m=m: problem(m))
        if plan is not None and fuse(m, group, plan, settings.key()):
            fused += 1
    return fused
