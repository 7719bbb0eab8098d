"""The route protocol and what the registry and the routes share: ``Call``, ``Context``, statistics, log-once.

Kept apart from the registry (``routes/__init__.py``) so that route modules import it, never their package.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flashoverlap_inductor import config
from flashoverlap_inductor.runtime import kernel_select, streams

log = logging.getLogger("flashoverlap")

@dataclass(frozen=True)
class Call:
    """What every rank knows of one fused call: sizes in flattened rows (``rows`` x ``k`` @ ``k`` x ``n``), the
    dtype, the group (``world``, ``rank``), the device type, B's layout (``"nk"``/``"kn"``; None: strides the
    kernels cannot read, or at compile time: not known yet), the plan string and all_to_all's split sizes in
    flattened rows (None: even). ``operand_issue``: why the GPU kernels cannot take these operands (None: they
    can)."""

    collective: str
    rows: int
    n: int
    k: int
    dtype: torch.dtype
    world: int
    rank: int = 0
    device: str = "cuda"
    b_layout: str | None = None
    plan: str = "auto"
    send_rows: tuple[int, ...] | None = None
    recv_rows: tuple[int, ...] | None = None
    group_name: str = ""
    operand_issue: tuple[str, str] | None = None
    compile_time: bool = False  # asked by the pass: the library's state, not the operands, decides
    device_index: int | None = None  # the CUDA device's index (None: the current one), for its GPU model's cost data

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass
class Context:
    """One call's tensors and device state, handed to ``make_launch`` and ``execute``. For all_gather, ``b`` and
    ``bias`` are lists (one per GEMM), ``y_shape`` is the gathered tensor's shape and ``out_shape`` too."""

    a: torch.Tensor
    b: Any
    bias: Any
    group: dist.ProcessGroup
    y_shape: list[int]  # the shape of a @ b
    out_shape: list[int]  # the op's output shape
    plan: str
    settings: config.Settings
    opnd: kernel_select.Operands | None = None  # the kernels' operands (CUDA routes)
    res: streams.DeviceResources | None = None
    capturing: bool = False
    output_split_sizes: Sequence[int] | None = None
    input_split_sizes: Sequence[int] | None = None
    gather_dim: int = 0  # all_gather: the dim of ``a`` the shards are concatenated along (``schedule.gather``)
    return_gathered: bool = False  # all_gather: also return the gathered tensor
    probe: Any = None  # a ``runtime.probe.CallProbe`` (the timeline tool's; None for every dispatched call)


class Route(Protocol):
    """See ``docs/routes.md``. ``last_resort``: the route takes every call of its devices and makes nothing that a
    CUDA-graph capture forbids (``unfused``, ``cpu``); the dispatcher never skips it and counts no fusion for it."""

    name: str
    devices: tuple[str, ...]
    collectives: tuple[str, ...]  # the collectives it runs: the registry asks no other route about a call
    last_resort: bool

    def unsupported(self, call: Call, settings: config.Settings) -> str | None: ...

    def make_launch(self, call: Call, settings: config.Settings, ctx: Context) -> Any: ...

    def execute(self, launch: Any, ctx: Context) -> torch.Tensor | str: ...

    def reset(self) -> None: ...


class LastResortRoute:
    """A route that takes every call of its devices and makes nothing per call shape (``unfused``, ``cpu``): a
    subclass names itself and its devices and implements ``execute(launch, ctx)``; its launch is the collective."""

    name = ""
    devices: tuple[str, ...] = ()
    collectives: tuple[str, ...] = config.COLLECTIVES
    last_resort = True

    def unsupported(self, call: Call, settings: config.Settings) -> str | None:
        return None

    def make_launch(self, call: Call, settings: config.Settings, ctx: Context) -> tuple[str]:
        return (call.collective,)  # a tuple: a ``str`` would be a reason to decline

    def reset(self) -> None:
        pass


stats: collections.Counter = collections.Counter()
_noted: set[str] = set()


def note(key: str, level: int, msg: str, *args: object) -> None:
    """Log ``msg`` once per ``key``."""
    if key not in _noted:
        _noted.add(key)
        log.log(level, msg, *args)


def forget_notes() -> None:
    _noted.clear()
