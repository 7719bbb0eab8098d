"""Small faults, each pinned by a test: CUTLASS header unpacking that could write outside its folder, fused calls
whose GEMM output is empty, and sizes beyond the C library's 32-bit ints taking a kernel route."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
import types
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashoverlap_inductor import build, config, ops, routes  # noqa: F401 (ops: registers)
from flashoverlap_inductor.native import kernels  # noqa: F401 (ops: registers)
from flashoverlap_inductor.runtime import kernel_select  # noqa: F401 (ops: registers)

BF16 = torch.bfloat16
BIG = 2**31  # one past the C library's int range
SRC = "cutlass_library/source/"

# ------------------------------------------------------------------------------------ unpacking CUTLASS headers


def _wheel(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    """A zip archive with ``members`` (name -> content) and symbolic-link ``links`` (name -> link target)."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return path


def _fetch(monkeypatch, tmp_path: Path, members: dict[str, bytes], links=None) -> Path:
    """``fetch_cutlass`` into ``tmp_path/dst`` with pip replaced by a copy of the crafted wheel (no network)."""
    def fake_pip(cmd, check):
        _wheel(Path(cmd[cmd.index("-d") + 1]) / "nvidia_cutlass-4.2.0.0-py3-none-any.whl", members, links)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(build.subprocess, "run", fake_pip)
    return build.fetch_cutlass(tmp_path / "x" / "y" / "dst")  # deep: a '..' escape stays in tmp_path


def test_fetch_cutlass_unpacks_only_the_headers(monkeypatch, tmp_path):
    dst = _fetch(monkeypatch, tmp_path, {SRC + "include/cutlass/cutlass.h": b"// h", SRC + "tools/util/include/u.h":
                                         b"// u", SRC + "python/x.py": b"", "cutlass_library/__init__.py": b""})
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()) == [
        "include/cutlass/cutlass.h", "tools/util/include/u.h"]
    assert (dst / "include/cutlass/cutlass.h").read_bytes() == b"// h"


@pytest.mark.parametrize("name", [SRC + "include/../../../escaped.h", SRC + "include/cutlass/../../../../escaped.h",
                                  "/tmp/escaped.h", "../escaped.h", "C:/escaped.h"])
def test_fetch_cutlass_refuses_members_outside_the_folder(monkeypatch, tmp_path, name):
    good = {SRC + "include/cutlass/cutlass.h": b"// h"}
    with pytest.raises(build.UnsafeArchiveError, match="absolute path or a '..' part"):
        _fetch(monkeypatch, tmp_path, {**good, name: b"evil"})
    assert not list(tmp_path.rglob("*.h"))  # refused before anything was written


def test_fetch_cutlass_refuses_links(monkeypatch, tmp_path):
    with pytest.raises(build.UnsafeArchiveError, match="symbolic link"):
        _fetch(monkeypatch, tmp_path, {SRC + "include/cutlass/cutlass.h": b"// h"},
               links={SRC + "include/cutlass/up": "../../../.."})
    assert not list(tmp_path.rglob("*.h"))


def test_unpacking_refuses_to_write_through_a_link_out_of_the_folder(tmp_path):
    outside, dst = tmp_path / "outside", tmp_path / "dst"
    outside.mkdir()
    dst.mkdir()
    os.symlink(outside, dst / "include")  # a link already in the folder, pointing out of it
    wheel = _wheel(tmp_path / "w.whl", {SRC + "include/cutlass/cutlass.h": b"// h"})
    with pytest.raises(build.UnsafeArchiveError, match="outside"):
        build.unpack_cutlass_headers(wheel, dst)
    assert not list(outside.rglob("*"))


# ------------------------------------------------------------------------------------ empty GEMM outputs


@pytest.fixture(scope="module")
def group_name():
    """A one-rank gloo group in this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    fd, path = tempfile.mkstemp(prefix="fo_gloo_small_")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _run(collective: str, a, b, bias, g):
    fo = torch.ops.flashoverlap
    if collective == "all_reduce":
        return fo.gemm_all_reduce(a, b, bias, "sum", g, "auto")
    if collective == "reduce_scatter":
        return fo.gemm_reduce_scatter(a, b, bias, "sum", 1, g, "auto")
    return fo.gemm_all_to_all(a, b, bias, None, None, g, "auto")


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
EMPTY = {  # (a shape, b shape, bias shape); every one an empty y on every rank
    "n0": ((4, 8), (8, 0), None),
    "n0_bias": ((4, 8), (8, 0), (0,)),
    "n0_3d_2d": ((2, 4, 8), (8, 0), None),
    "n0_bmm": ((2, 4, 8), (2, 8, 0), None),
    "rows0": ((0, 8), (8, 5), (5,)),
    "rows0_3d": ((2, 0, 8), (8, 5), None),
    "batch0": ((0, 4, 8), (8, 5), None),
}


def _empty_case(case: str):
    a_shape, b_shape, bias_shape = EMPTY[case]
    a, b = torch.randn(a_shape).to(BF16), torch.randn(b_shape).to(BF16)
    bias = torch.randn(bias_shape).to(BF16) if bias_shape else None
    return a, b, bias, torch.matmul(a, b) if bias is None else torch.matmul(a, b) + bias


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("case", sorted(EMPTY))
def test_empty_output_is_the_eager_empty_tensor(group_name, collective, case):
    a, b, bias, want = _empty_case(case)  # one rank: every collective returns y
    out = _run(collective, a, b, bias, group_name)
    assert out.shape == want.shape and out.dtype == want.dtype and out.is_contiguous()


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("case", sorted(EMPTY))
def test_empty_output_reaches_no_route(group_name, monkeypatch, collective, case):
    """Empty on every rank: no GEMM and no collective anywhere (so no rank waits for one)."""
    a, b, bias, want = _empty_case(case)
    monkeypatch.setattr(routes, "dispatch", lambda *args: pytest.fail("an empty call reached a route"))
    assert _run(collective, a, b, bias, group_name).shape == want.shape


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_zero_k_runs_and_gives_zeros(group_name, collective):
    a, b = torch.randn(2, 4, 0), torch.randn(0, 6)
    out = _run(collective, a, b, None, group_name)
    assert torch.equal(out, torch.zeros(2, 4, 6))


def test_kernel_operands_of_a_3d_a_with_no_k_are_degenerate():
    a, b = torch.empty(2, 4, 0, dtype=BF16), torch.empty(0, 8, dtype=BF16)
    assert kernel_select.normalize_operands(a, b, None)[0] == "degenerate"


# ------------------------------------------------------------------------------------ the C library's int range


def _meta(shape, stride=None):
    if stride is None:
        return torch.empty(shape, dtype=BF16, device="meta")
    return torch.empty_strided(shape, stride, dtype=BF16, device="meta")


INT_RANGE = {  # name -> (a, b): one size or leading dimension just past 2**31 - 1, nothing allocated
    "rows": lambda: (_meta((BIG, 64)), _meta((64, 64))),
    "rows_3d_expanded": lambda: (torch.zeros(1, 1, 64, dtype=BF16).expand(2**16, 2**15, 64),
                                 torch.zeros(64, 64, dtype=BF16)),
    "n": lambda: (_meta((16, 64)), _meta((64, BIG))),
    "k": lambda: (_meta((16, BIG)), _meta((BIG, 64))),
    "lda": lambda: (_meta((16, 64), (BIG, 1)), _meta((64, 64))),
    "ldb_nk": lambda: (_meta((16, 64)), _meta((64, 64), (1, BIG))),
    "ldb_kn": lambda: (_meta((16, 64)), _meta((64, 64), (BIG, 1))),
}


@pytest.mark.parametrize("case", sorted(INT_RANGE))
def test_sizes_past_the_c_int_range_are_declined(case):
    a, b = INT_RANGE[case]()
    got = kernel_select.normalize_operands(a, b, None)
    assert isinstance(got, tuple) and got[0] == "int_range", got
    assert str(BIG) in got[1]


def test_sizes_at_the_c_int_limit_are_taken():
    a, b = _meta((BIG - 1, 64)), _meta((64, 64), (1, BIG - 8))
    assert isinstance(kernel_select.normalize_operands(a, b, None), kernel_select.Operands)


def test_a_call_past_the_c_int_range_runs_unfused(monkeypatch):
    infos = [kernels.KernelInfo("coop_128x256x64_c2x1_e128x64" + suffix, 128, 256, 64, 2, 1, "cooperative", 0, 0, 0,
                                (("bfloat16", "nk"),)) for suffix in ("", "_addc", "_addc_aux")]
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(kernels, "configs", lambda add_c=0: infos[int(add_c):int(add_c) + 1])
    group = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0, group_name="g")
    s = config.Settings()
    for rows in (BIG - 2, BIG):  # a kernel route takes the first, the second would wrap
        a, b = _meta((rows, 64)), _meta((64, 64), (1, 64))
        call, _, _ = routes.make_call("all_reduce", a, b, None, group, "auto", None, None, [rows, 64], cuda=True)
        assert (routes.select(call, s).name == "unfused") == (rows >= BIG)
    assert call.operand_issue[0] == "int_range"
