"""Triton kernels launched through their compiled form, not through ``JITFunction.run`` on every call.

``kernel[grid](*args, **constexprs)`` binds the arguments, builds the specialization key and looks the compiled
kernel up on every launch: Python work that held a fused MoE call's host for tens of microseconds per kernel on the
2-H100 hosts (the MoE calls launch 3-5 per call; docs/results.md). ``Launcher`` keeps each compiled kernel under a
key of its own and launches it with ``CompiledKernel[grid](*values, stream=...)`` (Triton's public launch of a
compiled kernel, since 2.x): ``values`` is every parameter in the kernel's order, the constexprs included, as
``JITFunction.run`` passes them to the launcher in Triton 3.x.

**The key** is a superset of what Triton specializes on, so a cached kernel is always the one ``run`` would pick:
the current device, each constexpr's value and type (by name or by position: ``fn.constexprs``), and per other
positional argument: a tensor's dtype and whether its address
is a multiple of 16; an int's width class (int32, int64, uint64) and whether it is 1 and a multiple of 16; a bool's
or None's value; a float's type. Anything else (a default left out, an argument of another type) goes through
``run`` every time.

``run`` is also taken where the direct launch cannot be trusted: the first launch of each key (it compiles; its
``CompiledKernel`` is kept), Triton's interpreter (``run`` returns no compiled kernel there), launch hooks set (a
profiler's: ``run`` calls them; an empty ``HookChain`` is none), and for good after a direct launch raised (a
launcher of another calling convention: ``TypeError``; logged once). The launch's results are the same either way;
``tests/test_triton_launch.py`` checks the caching and order on stand-ins, ``tests/test_moe_plan_kernel.py`` the
real launches bit for bit on CUDA.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

log = logging.getLogger("flashoverlap")

counts: Counter[str] = Counter()  # "direct" and "run" launches, for the tests and the profile tool
_INT32 = (-(2 ** 31), 2 ** 31 - 1)
_INT64_MAX = 2 ** 63 - 1


def _arg_key(v: object) -> object:
    """The part of the key of one positional argument (module docstring), or ``NotImplemented`` when the argument's
    type is not one this module keys on."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        width = "i32" if _INT32[0] <= v <= _INT32[1] else ("i64" if v <= _INT64_MAX else "u64")
        return (width, v == 1, v % 16 == 0)
    if isinstance(v, float):
        return float
    return NotImplemented


def _value_key(v: object) -> tuple:
    """A constexpr's part of the key: its value with its type (Triton compiles ``True``, ``1`` and ``1.0`` apart)."""
    return (type(v), v)


def _hooks_set() -> bool:
    """Whether Triton's launch hooks are set (then every launch goes through ``run``, which calls them)."""
    try:
        from triton import knobs
    except ImportError:  # an older Triton: no knobs, no hooks of this kind
        return False
    return hook_set(knobs.runtime.launch_enter_hook) or hook_set(knobs.runtime.launch_exit_hook)


def hook_set(hook: object) -> bool:
    """Whether a launch hook is set: a callable, or a Triton 3.5+ ``HookChain`` (never None) with hooks in it."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


class Launcher:
    """``fn`` (a ``triton.jit`` function) launched as ``launcher[grid](*args, **constexprs)`` (or
    ``launcher(grid, *args, **constexprs)``) with the effect of ``fn[grid](*args, **constexprs)`` on the current
    device and stream (module docstring); ``grid``: 1 to 3 program counts."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.names = list(getattr(fn, "arg_names", ()))
        self.constexpr_at = frozenset(getattr(fn, "constexprs", ()))  # the constexpr parameters' positions
        self.compiled: dict[tuple, object] = {}
        self.direct = bool(self.names)  # False for good after a direct launch raised

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **constexprs: self(grid, *args, **constexprs)

    def __call__(self, grid: tuple[int, ...], *args, **constexprs) -> None:
        key = self._key(args, constexprs) if self.direct else None
        kernel = None if key is None else self.compiled.get(key)
        if kernel is not None and not _hooks_set():
            values = [*args, *(constexprs[n] for n in self.names[len(args):])]
            stream = torch.cuda.current_stream().cuda_stream
            try:
                kernel[(*grid, 1, 1)[:3]](*values, stream=stream)
            except TypeError as exc:  # the launcher takes another argument list: Triton's own path from now on
                self.direct = False
                log.warning("flashoverlap: the direct launch of Triton kernel %s failed (%r); launching it through "
                            "triton.jit's run from now on", getattr(self.fn, "__name__", self.fn), exc)
            else:
                counts["direct"] += 1
                return
        compiled = self.fn[grid](*args, **constexprs)
        counts["run"] += 1
        if key is not None and hasattr(compiled, "__getitem__") and hasattr(compiled, "metadata"):
            self.compiled[key] = compiled

    def _key(self, args: tuple, constexprs: dict) -> tuple | None:
        """The launch's key, or None where it goes through ``run`` (an argument of an unkeyed type, or a parameter
        given neither positionally nor by name: a default)."""
        if len(args) + len(constexprs) != len(self.names) or any(n not in constexprs for n in self.names[len(args):]):
            return None
        parts = tuple(_value_key(v) if i in self.constexpr_at else _arg_key(v) for i, v in enumerate(args))
        if any(p is NotImplemented for p in parts):
            return None
        try:
            fixed = tuple((k, *_value_key(v)) for k, v in sorted(constexprs.items()))
            hash((parts, fixed))
        except TypeError:  # an unhashable constexpr
            return None
        return (torch.cuda.current_device() if torch.cuda.is_available() else -1, parts, fixed)
