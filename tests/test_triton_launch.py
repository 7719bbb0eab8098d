"""``runtime/triton_launch.py``: a Triton kernel launched through its compiled form after the first launch of each
key, with every parameter in the kernel's order; ``run`` wherever the key or the direct launch cannot be trusted.
On stand-ins for ``triton.jit`` and ``CompiledKernel`` (no GPU here); the real launches are checked bit for bit by
``tests/test_moe_plan_kernel.py`` on CUDA and under Triton's interpreter.

    python3 -m pytest -q tests/test_triton_launch.py
"""

from __future__ import annotations

import types

import pytest
import torch

from flashoverlap_inductor.runtime import triton_launch


class Compiled:
    """A stand-in ``CompiledKernel``: records each direct launch (grid, values, stream)."""

    metadata = None

    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def __getitem__(self, grid):
        def runner(*values, stream=None):
            if self.fail:
                raise TypeError("launcher: wrong number of arguments")
            self.log.append(("direct", grid, values, stream))
        return runner


class Jit:
    """A stand-in ``triton.jit`` function of parameters ``a, n, B, C``: ``run`` records and returns a compiled kernel
    (None: the interpreter)."""

    arg_names = ["a", "n", "B", "C"]
    constexprs = [2, 3]  # B and C, as triton.jit's ``constexprs`` (positions)

    def __init__(self, interpreted: bool = False, fail: bool = False) -> None:
        self.log: list = []
        self.interpreted, self.fail = interpreted, fail

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("run", grid, args, kw))
            return None if self.interpreted else Compiled(self.log, self.fail)
        return run


@pytest.fixture(autouse=True)
def _stream(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=77))
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)


def kinds(fn: Jit) -> list[str]:
    return [e[0] for e in fn.log]


def test_the_second_launch_of_a_key_is_direct_with_every_parameter_in_order():
    fn = Jit()
    launch = triton_launch.Launcher(fn)
    x = torch.zeros(8, dtype=torch.int64)
    launch[(3,)](x, 5, C=2, B=1)
    launch[(4,)](x, 7, B=1, C=2)  # another value of a keyed-alike int: the same kernel
    assert kinds(fn) == ["run", "direct"]
    _, grid, values, stream = fn.log[1]
    assert grid == (4, 1, 1) and stream == 77
    assert values[0] is x and values[1:] == (7, 1, 2)  # a, n, then B and C in the kernel's order


@pytest.mark.parametrize("change", ["dtype", "constexpr", "int-one", "int-wide", "int-16", "alignment"])
def test_what_triton_specializes_on_compiles_again(change):
    fn = Jit()
    launch = triton_launch.Launcher(fn)
    x = torch.zeros(16, dtype=torch.int64)
    launch[(1,)](x, 5, B=1, C=2)
    other = {"dtype": (x.to(torch.int32), 5, 1), "constexpr": (x, 5, 3), "int-one": (x, 1, 1),
             "int-wide": (x, 2 ** 40, 1), "int-16": (x, 32, 1), "alignment": (x[1:], 5, 1)}[change]
    launch[(1,)](other[0], other[1], B=other[2], C=2)
    launch[(1,)](other[0], other[1], B=other[2], C=2)
    assert kinds(fn) == ["run", "run", "direct"]


def test_a_default_left_out_or_an_unkeyed_argument_always_runs():
    fn = Jit()
    launch = triton_launch.Launcher(fn)
    x = torch.zeros(8)
    for _ in range(2):
        launch[(1,)](x, 5, B=1)  # C left to its default
        launch[(1,)](x, "text", B=1, C=2)  # a type the key does not cover
    assert kinds(fn) == ["run"] * 4


def test_the_interpreter_and_launch_hooks_go_through_run(monkeypatch):
    fn = Jit(interpreted=True)
    launch = triton_launch.Launcher(fn)
    x = torch.zeros(8)
    launch[(1,)](x, 5, B=1, C=2)
    launch[(1,)](x, 5, B=1, C=2)
    assert kinds(fn) == ["run", "run"]
    fn = Jit()
    launch = triton_launch.Launcher(fn)
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: True)
    launch[(1,)](x, 5, B=1, C=2)
    launch[(1,)](x, 5, B=1, C=2)
    assert kinds(fn) == ["run", "run"]


def test_a_launcher_of_another_convention_falls_back_to_run_for_good():
    fn = Jit(fail=True)
    launch = triton_launch.Launcher(fn)
    x = torch.zeros(8)
    for _ in range(3):
        launch[(2,)](x, 5, B=1, C=2)
    assert kinds(fn) == ["run", "run", "run"]  # the failed direct launch ran the kernel through run instead
    assert not launch.direct


def test_an_empty_hook_chain_is_no_hook():
    """Triton 3.5+ keeps the launch hooks in ``HookChain`` objects that are never None (measured on the device:
    every launch went through ``run`` while this module took the empty chain for a hook)."""
    chain = types.SimpleNamespace(calls=[])
    assert not triton_launch.hook_set(None) and not triton_launch.hook_set(chain)
    chain.calls.append(print)
    assert triton_launch.hook_set(chain) and triton_launch.hook_set(print)
    knobs = pytest.importorskip("triton").knobs
    hook = knobs.runtime.launch_enter_hook
    if getattr(hook, "calls", None) == []:  # this Triton's own empty chain: no hook
        assert not triton_launch.hook_set(hook)


def test_a_constexpr_is_keyed_by_its_value_and_type_by_name_or_position():
    """Found by review: a constexpr passed positionally was keyed like a runtime int (2 and 3 alike), and ``True``,
    ``1`` and ``1.0`` compare equal by name; Triton compiles each apart."""
    fn = Jit()
    launch = triton_launch.Launcher(fn)
    x = torch.zeros(8)
    launch[(1,)](x, 5, 2, C=2)
    launch[(1,)](x, 5, 3, C=2)  # B positional, another value
    launch[(1,)](x, 5, 3, C=True)
    launch[(1,)](x, 5, 3, C=1)
    launch[(1,)](x, 5, 3, C=1.0)
    launch[(1,)](x, 5, 3, C=1.0)
    assert kinds(fn) == ["run"] * 5 + ["direct"]
