"""``routes.gather_gemms``: which calls the gather route's library GEMMs take (``static_args``: the call shape;
``usable``: torch's settings now), the ``fo_gather_gemm_args`` it prepares, and the cuBLAS it binds. CPU only: the
library call itself runs in ``tests/test_gpu_gather.py`` (equal to ``torch.mm`` bit for bit)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from flashoverlap_inductor.routes import gather_gemms
from flashoverlap_inductor.schedule import gather as schedule


def _ctx(shape=(256, 512), ns=(384, 128), dtype=torch.bfloat16, bias=False, layout="t", rank=1):
    k = shape[-1]
    a = torch.zeros(shape, dtype=dtype)
    if layout == "t":
        ws = [torch.zeros(n, k, dtype=dtype).t() for n in ns]
    else:
        ws = [torch.zeros(k, n, dtype=dtype) for n in ns]
    cs = [torch.zeros(n, dtype=dtype) if bias else None for n in ns]
    return SimpleNamespace(a=a, b=ws, bias=cs, group=SimpleNamespace(rank=lambda: rank))


def _geo(shape=(256, 512), gather_dim=0, world=2):
    return schedule.geometry(list(shape), gather_dim, world)


def test_static_args_of_a_plain_call():
    p = gather_gemms.static_args(_ctx(), _geo(), rank=1)
    assert isinstance(p, gather_gemms.GatherGemmArgs)
    assert (p.world, p.rank, p.rows, p.k, p.num_weights) == (2, 1, 256, 512, 2)
    assert (p.elem_type, p.math_mode) == (14, 0)
    assert list(p.weight_transposed)[:2] == [1, 1] and list(p.n)[:2] == [384, 128]


@pytest.mark.parametrize("why, ctx, geo", [
    ("bias", _ctx(bias=True), _geo()),
    ("fp16: never run on a GPU", _ctx(dtype=torch.float16), _geo()),
    ("fp32", _ctx(dtype=torch.float32), _geo()),
    ("row-major [K, N] weights: never run on a GPU", _ctx(layout="kn"), _geo()),
    ("strided shards (lead 2)", _ctx(shape=(2, 96, 512)), _geo((2, 96, 512), 1)),
    ("one row", _ctx(shape=(1, 512)), _geo((1, 512))),
    ("N of 1", _ctx(ns=(1,)), _geo()),
    ("9 weights", _ctx(ns=(8,) * 9), _geo()),
    ("world 9", _ctx(), _geo(world=9)),
])
def test_static_args_declines(why, ctx, geo):
    assert gather_gemms.static_args(ctx, geo, rank=0) is None, why


def test_contiguous_3d_shard_is_taken():
    """A shard gathered along dim 1 with a leading size of 1 is contiguous again (``lead == 1``)."""
    assert gather_gemms.static_args(_ctx(shape=(1, 200, 384)), _geo((1, 200, 384), 1), rank=0) is not None


def test_usable_follows_torch_settings(monkeypatch):
    monkeypatch.setattr(gather_gemms, "bind", lambda: True)
    monkeypatch.setattr(gather_gemms.compat, "cublas_preferred", lambda: True)
    monkeypatch.setattr(gather_gemms, "_tunable_on", lambda: False)
    bf16, none = torch.bfloat16, frozenset()
    assert gather_gemms.usable(bf16, none, None)
    assert not gather_gemms.usable(bf16, frozenset({gather_gemms.EXPERIMENT}), None)
    assert not gather_gemms.usable(bf16, none, object())  # the timeline's probe: the torch.mm loop
    monkeypatch.setattr(gather_gemms, "_tunable_on", lambda: True)
    assert not gather_gemms.usable(bf16, none, None)
    monkeypatch.setattr(gather_gemms, "_tunable_on", lambda: False)
    matmul = torch.backends.cuda.matmul  # torch's own setter, set back by hand (monkeypatch's undo may delattr it)
    before = matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_bf16_reduced_precision_reduction = False
        assert not gather_gemms.usable(bf16, none, None)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
    assert gather_gemms.usable(bf16, none, None)
    monkeypatch.setattr(gather_gemms.compat, "cublas_preferred", lambda: False)
    assert not gather_gemms.usable(bf16, none, None)


def test_mapped_libraries_reads_proc_maps_lines():
    lines = [
        "7f00-7f10 r-xp 00000000 08:01 123 /venv/nvidia/cublas/lib/libcublas.so.13\n",
        "7f10-7f20 r--p 00010000 08:01 123 /venv/nvidia/cublas/lib/libcublas.so.13\n",
        "7f20-7f30 r-xp 00000000 08:01 124 /venv/nvidia/cublas/lib/libcublasLt.so.13\n",
        "7f30-7f40 rw-p 00000000 00:00 0 \n",
        "7f40-7f50 r-xp 00000000 08:01 125 /tmp/old/libcublas.so.12 (deleted)\n",
    ]
    assert gather_gemms.mapped_libraries(lines, "libcublas.so") == ["/tmp/old/libcublas.so.12",
                                                                    "/venv/nvidia/cublas/lib/libcublas.so.13"]
    assert gather_gemms.mapped_libraries(lines[:4], "libcublas.so") == ["/venv/nvidia/cublas/lib/libcublas.so.13"]
    assert gather_gemms.mapped_libraries(lines, "libcublasLt.so") == ["/venv/nvidia/cublas/lib/libcublasLt.so.13"]


def test_struct_matches_the_c_header_sizes():
    """Field order and widths as ``fo_gather_gemm_args`` (csrc/flashoverlap_sm90.h): world/rank, then int64 sizes,
    pointers, the event array of FO_GATHER_MAX_WORLD, then the per-weight arrays of FO_GATHER_MAX_OUTPUTS."""
    S = gather_gemms.GatherGemmArgs
    assert S.rows.offset == 8 and S.k.offset == 16 and S.a.offset == 24
    assert S.shard_events.size == 8 * gather_gemms.MAX_WORLD
    assert S.workspace.offset == S.outputs.offset + S.outputs.size  # then the workspace pointer and its int64 size
    assert S.workspace_bytes.offset == S.workspace.offset + 8
    assert S.workspace_bytes.offset + 8 == ctypes.sizeof(S)
