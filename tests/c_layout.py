"""A ctypes mirror of a C ABI struct checked against ``csrc/flashoverlap_sm90.h`` field by field: a C compiler prints
every ``offsetof`` and the ``sizeof``, and the unit that nvcc compiles must assert that size (so the three agree)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "flashoverlap_sm90.h"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def assert_mirrors_header(struct: type[ctypes.Structure], c_name: str, unit: str, tmp_path: Path) -> None:
    """``struct``'s fields sit where the header's ``c_name`` has them, its size is the header's, and ``csrc/<unit>``
    asserts that size."""
    fields = [f for f, _ in struct._fields_]
    prints = "".join(f'printf("{f} %zu\\n", offsetof({c_name}, {f}));' for f in fields)
    src = tmp_path / "layout.c"
    src.write_text(f'#include <stddef.h>\n#include <stdio.h>\n#include "{HEADER}"\n'
                   f'int main(void) {{ {prints} printf("sizeof %zu\\n", sizeof({c_name})); return 0; }}\n')
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=c11", str(src), "-o", str(exe)], check=True, capture_output=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                       text=True).stdout.splitlines())
    assert {f: int(got[f]) for f in fields} == {f: getattr(struct, f).offset for f in fields}
    assert int(got["sizeof"]) == ctypes.sizeof(struct)
    assert f"sizeof({c_name}) == {ctypes.sizeof(struct)}" in (HEADER.parent / unit).read_text()
