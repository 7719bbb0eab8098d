"""What the flashoverlap pass makes of a user's own model, without timing anything.

``flashoverlap_inductor.model_coverage(module, *args, **kwargs)`` (every rank of the process group calls it, as it
would call the model) compiles ``module`` with ``backend="flashoverlap"``, runs it once on the given inputs (and,
when an output requires grad, the backward of the sum of its floating outputs), and returns a ``Coverage``: per
compiled graph kind (forward, backward, inference) the fused ops, the collectives left and what feeds each (a GEMM
the pass declined, a GEMM behind an op it does not see through, or no GEMM in reach), and the pass's skip reasons
and near misses. ``print(cov)`` prints the table the e2e harness prints; ``cov.near_misses`` and
``cov.left_beside_gemm`` count what a user would want fused and is not.

On CPU (gloo) the cost model declines every fusion, so the default there is ``fuse="always"``: what the pass *can*
fuse. On Hopper GPUs the default is the settings' own (``auto``): what it *will* fuse. The command line,
``torchrun --nproc_per_node=N -m flashoverlap_inductor.bench coverage --model pkg.module:factory`` (or ``--preset``
with ``--plan``), is ``cli_coverage.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flashoverlap_inductor import _inductor_compat as compat

from . import coverage


@dataclass
class Coverage:
    """``graphs``: per kind, ``{"fused": {op: n}, "collectives": {"<collective> <- <feed>": n}}`` (``coverage.merge``);
    ``events``: per kind, the pass's ``{counter: [detail, ...]}`` (``skip:<slug>``, ``near_miss:<op>``, ``fused:``);
    ``title``: the first line of the printed table."""

    title: str
    graphs: dict[str, dict[str, dict[str, int]]]
    events: dict[str, dict[str, list[str]]]
    notes: list[str] = field(default_factory=list)

    @property
    def near_misses(self) -> int:
        """Collectives fed by (or feeding) a GEMM through an op the pass does not see through."""
        return sum(len(d) for ev in self.events.values() for c, d in ev.items() if c.startswith("near_miss:"))

    @property
    def left_beside_gemm(self) -> int:
        """Collectives left unfused with a GEMM directly before them (each has a ``skip:`` reason in ``events``)."""
        return sum(n for g in self.graphs.values() for k, n in g["collectives"].items() if k.endswith("<- gemm"))

    def fused(self) -> dict[str, int]:
        """Fused ops over every graph, ``{op: n}``."""
        out: dict[str, int] = {}
        for g in self.graphs.values():
            for op, n in g["fused"].items():
                out[op] = out.get(op, 0) + n
        return out

    def lines(self) -> list[str]:
        model, _, rest = self.title.partition(" / ")
        plan, _, workload = rest.partition(" / ")
        entry = {"model": model, "plan": plan, "workload": workload, "source": "flashoverlap",
                 "graphs": self.graphs, "events": self.events, "notes": self.notes}
        return coverage.coverage_lines(entry)

    def __str__(self) -> str:
        return "\n".join(self.lines())


def default_fuse(example: Any) -> str | None:
    """``"always"`` when the inputs live on the CPU (the cost model declines everything there), else None (the
    settings' own mode)."""
    tensors = [x for x in torch.utils._pytree.tree_leaves(example) if isinstance(x, torch.Tensor)]
    return "always" if tensors and all(t.device.type == "cpu" for t in tensors) else None


def model_coverage(module: torch.nn.Module, *args: Any, backward: bool | None = None,
                   options: dict[str, Any] | None = None, title: str | None = None, **kwargs: Any) -> Coverage:
    """Compile ``module`` with the flashoverlap backend, run it once on ``args``/``kwargs`` and report what the pass
    fused, declined (with its reason) and missed; see the module docstring.

    ``backward``: also run the backward of the sum of the floating outputs (None: when an output requires grad).
    ``options``: as ``torch.compile``'s (``{"flashoverlap.fuse": "always"}``; our keys and Inductor's). The graphs are
    recorded in Inductor's ``post_grad_custom_post_pass``; a pass the user set there (in ``options``, else in
    Inductor's config) still runs, right after the recording, on every graph (``compat.chain_passes``). The module's
    parameters are not changed (no optimizer step); their ``.grad`` is, when the backward runs. Collective: every
    rank of the groups the model uses must call it with inputs of the same shapes."""
    from flashoverlap_inductor.reporting import fusion_report, reset_fusion_report

    from .runner import flashoverlap_backend

    opts = dict(options or {})
    fuse = default_fuse((args, kwargs)) if "flashoverlap.fuse" not in opts else None  # the caller's mode stands
    if fuse is not None:
        opts["flashoverlap.fuse"] = fuse
    capture = coverage.GraphCapture()
    existing = opts.get(compat.POST_PASS_KEY, getattr(compat.inductor_config(), compat.POST_PASS_KEY, None))
    opts[compat.POST_PASS_KEY] = compat.chain_passes(capture, existing)  # the capture, then the user's own
    reset_fusion_report()
    compiled = torch.compile(module, backend=flashoverlap_backend(), options=opts, dynamic=False)
    out = compiled(*args, **kwargs)
    floats = [_local(x) for x in torch.utils._pytree.tree_leaves(out)
              if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if backward is None:
        backward = any(x.requires_grad for x in floats)
    if backward:
        grads = [x for x in floats if x.requires_grad]
        if not grads:
            raise ValueError("flashoverlap: model_coverage(backward=True): no output requires grad")
        torch.stack([x.float().sum() for x in grads]).sum().backward()
    notes = [f"fuse={opts.get('flashoverlap.fuse', 'the settings default')}"]
    if fuse == "always":
        notes.append("CPU inputs: fuse='always' (on CPU the cost model declines every fusion); this shows what the "
                     "pass can fuse, not what it would choose on GPUs")
    return Coverage(title or f"{type(module).__name__} / - / {'train' if backward else 'forward'}",
                    coverage.merge(capture.graphs), coverage.report_events(fusion_report()), notes)


def _local(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its backward flows into the DTensor), else ``x``."""
    to_local = getattr(x, "to_local", None)
    return to_local() if callable(to_local) else x
