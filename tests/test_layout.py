"""The package's shape: one package folder, no import cycles, the environment read only in ``config.py``, no
experiment loaded by importing the package, and one typed settings object."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flashoverlap_inductor
from flashoverlap_inductor import config

PKG = Path(flashoverlap_inductor.__file__).resolve().parent
ROOT = PKG.parent
# CLIs that read torchrun's / the toolchain's own variables (WORLD_SIZE, NVCC, ...); never a FLASHOVERLAP_ setting
CLI_MODULES = {"build.py", "tune.py", "demo.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that ``name`` imports (at any depth of its code, ``TYPE_CHECKING`` blocks too),
    parents excluded: importing a submodule always loads its package first, which is no cycle of ours."""
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # typing-only imports count too: a cycle is a cycle
        if isinstance(node, ast.ImportFrom):
            anchor = base
            for _ in range(node.level - 1):
                anchor = anchor.rpartition(".")[0]
            target = (f"{anchor}.{node.module}" if node.module else anchor) if node.level else node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


PRIVATE_TORCH = re.compile(r"torch\._C\b|_comm_ptr|_resolve_process_group|\._get_backend\(|distributed_c10d\._|"
                           r"current_callable|_functorch\.config")


def test_the_runtime_does_not_import_the_cost_model():
    """``runtime/`` decides from its arguments; what the cost model's data says comes from the routes
    (``cost_model/launch.py``), so the runtime never loads the cost model (any import, function-level too)."""
    modules = _modules()
    found = {name: sorted(m for m in _imports(name, path, modules) if m.startswith("flashoverlap_inductor.cost_model"))
             for name, path in modules.items() if name.startswith("flashoverlap_inductor.runtime")}
    assert found and not any(found.values()), found


def test_private_torch_only_in_the_compat_module():
    """Version-fragile private torch names live in ``_inductor_compat.py`` alone (a torch upgrade is a one-file
    review)."""
    found = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in PKG.rglob("*.py")
             if path.name != "_inductor_compat.py" for m in PRIVATE_TORCH.finditer(path.read_text())]
    assert found == [], found


def test_the_environment_is_read_only_in_config():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "config.py":
            continue
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            env = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os"
            if env and path.name not in CLI_MODULES:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        if path.name in CLI_MODULES and "environ.get(\"FLASHOVERLAP_" in text:
            offenders.append(f"{path.relative_to(ROOT)}: reads a FLASHOVERLAP_ variable")
    assert not offenders, offenders


def test_importing_the_package_loads_no_experiment_and_no_old_module():
    code = ("import sys, flashoverlap_inductor.backend, flashoverlap_inductor.ops, flashoverlap_inductor.passes; "
            "print(sorted(m for m in sys.modules if m.startswith(('experiments', 'examples', 'passes', "
            "'cost_model'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "[]"
    for gone in ("runtime_peer", "runtime_cpu", "runtime_cuda", "ring_route", "fused_launch", "group_comm", "plan",
                 "row_order"):
        assert not (PKG / f"{gone}.py").exists(), gone


def test_importing_the_package_registers_every_op():
    """``import flashoverlap_inductor`` alone registers ``torch.ops.flashoverlap.*`` (benchmarks, eager callers and
    cached graphs use them without importing the backend); the opposite broke the 2-GPU gather tests once."""
    from flashoverlap_inductor import ops

    code = ("import torch, flashoverlap_inductor; "
            f"print(sorted(n for n in {sorted(ops._SCHEMAS)!r} if hasattr(torch.ops.flashoverlap, n)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == str(sorted(ops._SCHEMAS))


def test_the_old_alias_modules_are_gone():
    for name in ("runtime_gpu", "peer_route"):
        assert not (PKG / f"{name}.py").exists(), name  # their names live on in routes (stats, check, reset)


def test_modules_stay_small():
    big = [f"{p.relative_to(ROOT)}: {n}" for p in PKG.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 470]
    assert not big, big


def test_settings_are_one_frozen_validated_object():
    s = config.Settings()
    with pytest.raises(AttributeError):
        s.fuse = "never"  # type: ignore[misc]
    assert config.from_key(s.key()) == s
    assert s.replace(collectives="all_reduce").collectives == ("all_reduce",)  # a name, not its characters
    for bad in ({"fuse": "sometimes"}, {"collectives": "broadcast"}, {"min_rows": "abc"}, {"ring": "on"},
                {"ring_rounds": 0}, {"swizzle": 0}, {"row_order": "stage"}, {"experiments": {"nope"}},
                {"wait_timeout_ms": -1}, {"wait_timeout_ms": float("inf")}, {"wait_timeout_ms": 0},
                {"wait_timeout_ms": 1e13}, {"min_gain_fraction": float("nan")},
                {"swizzle": True}, {"library": 3}, {"no_such_setting": 1}):
        with pytest.raises(ValueError):
            s.replace(**bad)
    assert config.Settings(wait_timeout_ms=30000).key() == s.replace(wait_timeout_ms=30000.0).key()  # one type
    assert s.wait_timeout_ms is None and s.replace(wait_timeout_ms="none").wait_timeout_ms is None
    assert s.timeout_ns(group_timeout_ms=1800_000.0) == 1800 * 10**9  # None: the group's own timeout
    assert s.replace(wait_timeout_ms=5).timeout_ns(1800_000.0) == 5 * 10**6
    t = s.replace(collectives="all_reduce,reduce_scatter", swizzle="8", experiments=["single_group"])
    assert t.collectives == ("all_reduce", "reduce_scatter") and t.tuning.swizzle == 8
    assert t.experiments == frozenset({"single_group"}) and t.key() != s.key()


def test_patch_changes_current_and_restores():
    before = config.current()
    with config.patch(fuse="always", ring="wide", swizzle=8) as s:
        assert config.current() is s and s.fuse == "always" and s.tuning.swizzle == 8
    assert config.current() == before
    with pytest.raises(ValueError):
        with config.patch(fuse="sometimes"):
            pass
    assert config.current() == before
    assert not hasattr(config, "fuse")  # no module attributes for settings: they are explicit (``current()``)


def test_environment_settings(monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_FUSE", "Never")
    monkeypatch.setenv("FLASHOVERLAP_RING_ROUNDS", "3")
    monkeypatch.setenv("FLASHOVERLAP_SWIZZLE", "2")  # renamed two releases ago: no longer read
    monkeypatch.setenv("FLASHOVERLAP_HOST_LOOP", "python")  # a removed variant: not read
    config.reload_environment()
    try:
        s = config.current()
        assert (s.fuse, s.tuning.ring_rounds, s.tuning.swizzle, s.tuning.row_order) == ("never", 3, 4, None)
    finally:
        monkeypatch.undo()
        config.reload_environment()
    assert config.current().fuse == "auto"
