"""Every repository path that README.md and docs/*.md mention exists, so no reference dangles.

A *mentioned path* is a word inside inline code (`...`) or a fenced code block that starts with one of the
repository's top-level folders (``flashoverlap_inductor/``, ``csrc/``, ``examples/``, ``experiments/``,
``docs/``, ``tests/``, ``.ci/``) or is one of its top-level files (``README.md``, ``setup.py``, ...). Words that
only resemble paths are left alone: dotted names (``flashoverlap_inductor.config``), git-ignored outputs
(``build/...``), placeholders (``...``, ``<name>``) and globs other than ``*``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
TOP_FOLDERS = ("flashoverlap_inductor/", "csrc/", "examples/", "experiments/", "docs/", "tests/", ".ci/")
TOP_FILES = ("README.md", "setup.py", "pyproject.toml", "ruff.toml")

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
# Separators inside code: whitespace, quotes, brackets, commas, '=' (FOO=path), ':' is kept out of paths too.
_SPLIT = re.compile(r"[\s\"'(),=\[\]{};:|]+")


def mentioned_paths(text: str) -> set[str]:
    """The repository paths mentioned in the code spans and code blocks of one Markdown text."""
    spans = [m.group(0) for m in _FENCE.finditer(text)]
    spans += _INLINE.findall(_FENCE.sub("", text))
    out = set()
    for span in spans:
        for word in _SPLIT.split(span):
            word = word.removeprefix("$REPO/").removeprefix("./")
            if "..." in word or "<" in word or ">" in word or "?" in word or "$" in word:
                continue
            word = word.rstrip(".,")
            if word.startswith(TOP_FOLDERS) or word in TOP_FILES:
                out.add(word)
    return out


def missing(paths: set[str]) -> list[str]:
    """The paths of ``paths`` that name nothing in the checkout (a ``*`` must match at least one file)."""
    gone = []
    for p in sorted(paths):
        if "*" in p:
            if not list(ROOT.glob(p.rstrip("/"))):
                gone.append(p)
        elif not (ROOT / p).exists():
            gone.append(p)
    return gone


def test_mentioned_paths_recognises_repo_paths_only():
    text = (
        "See `examples/bench_ops.py`, `flashoverlap_inductor.config`, `build/libflashoverlap_sm90.so`,\n"
        "`torch.compile(m, backend=\"flashoverlap\")`, `docs/design.md`, `tests/...`, `csrc/<file>` and\n"
        "`FLASHOVERLAP_LIB=csrc/x.so`.\n"
        "```bash\n"
        "torchrun --nproc_per_node=4 $REPO/examples/bench_ops.py --json out.json && bash .ci/run\n"
        "python3 -m pip install -e \".[test]\"  # README.md\n"
        "```\n"
    )
    assert mentioned_paths(text) == {
        "examples/bench_ops.py", "docs/design.md", "csrc/x.so", ".ci/run", "README.md",
    }
    assert missing({"README.md", "docs/", "examples/*.py", "docs/no_such_file.md", "examples/*.nothing"}) == [
        "docs/no_such_file.md", "examples/*.nothing",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_mentioned_path_exists(doc: Path):
    paths = mentioned_paths(doc.read_text(encoding="utf-8"))
    gone = missing(paths)
    assert not gone, f"{doc.relative_to(ROOT)} mentions paths that do not exist: {gone}"


def test_docs_exist():
    names = {p.name for p in DOCS}
    assert {"README.md", "design.md", "results.md", "devices.md", "routes.md"} <= names
