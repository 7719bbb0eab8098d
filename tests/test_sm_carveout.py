"""``runtime.sm_carveout.gemm_carveout``: both knobs set inside the block and restored after it (also when the block
raises); a no-op on CPU and for 0 SMs. On a GPU (skipped without CUDA): the real cuBLAS handle's SM target and
torch's carveout as the block leaves them, and a GEMM inside the block equal to one outside."""

from __future__ import annotations

import ctypes

import pytest
import torch

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor.runtime import sm_carveout


class FakeCublas:
    """cuBLAS's two SM-target calls on a dict of handles."""

    def __init__(self) -> None:
        self.targets: dict[int, int] = {}

    def cublasGetSmCountTarget(self, handle, out) -> int:  # noqa: N802 - cuBLAS's name
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int)).contents.value = self.targets.get(handle, 0)
        return 0

    def cublasSetSmCountTarget(self, handle, count) -> int:  # noqa: N802 - cuBLAS's name
        self.targets[handle] = count
        return 0


def test_cpu_and_zero_are_no_ops(monkeypatch):
    calls = []
    monkeypatch.setattr(compat, "swap_matmul_sm_carveout", lambda sms: calls.append(sms) or (True, None))
    with sm_carveout.gemm_carveout(2, torch.device("cpu")):
        pass
    with sm_carveout.gemm_carveout(0, torch.device("cuda", 0)):
        pass
    assert calls == []
    assert not sm_carveout.available(torch.device("cpu"))


@pytest.mark.parametrize("raises", [False, True])
def test_set_inside_and_restored(monkeypatch, raises):
    fake, torch_knob = FakeCublas(), {"value": 5}
    fake.targets[77] = 100  # a target someone set before

    def swap(sms):
        previous, torch_knob["value"] = torch_knob["value"], sms
        return True, previous

    monkeypatch.setattr(compat, "swap_matmul_sm_carveout", swap)
    monkeypatch.setattr(sm_carveout, "_cublas", lambda: fake)
    monkeypatch.setattr(sm_carveout, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: 77)
    seen = {}
    with pytest.raises(RuntimeError) if raises else _nothing():
        with sm_carveout.gemm_carveout(2, torch.device("cuda", 0)):
            seen = {"torch": torch_knob["value"], "cublas": fake.targets[77]}
            if raises:
                raise RuntimeError("inside")
    assert seen == {"torch": 2, "cublas": 130}
    assert torch_knob["value"] == 5 and fake.targets[77] == 100


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_compat_swap_round_trips():
    ok, before = compat.swap_matmul_sm_carveout(3)
    try:
        if ok:
            assert torch._C._get_sm_carveout_experimental() == 3
    finally:
        compat.swap_matmul_sm_carveout(before)
    if ok:
        assert torch._C._get_sm_carveout_experimental() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_targets_and_values():
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    b = torch.randn(512, 768, device=dev, dtype=torch.bfloat16)
    want = a @ b
    assert sm_carveout.available(dev)
    lib, handle, sms = sm_carveout._cublas(), torch.cuda.current_blas_handle(), sm_carveout._sm_count(dev.index)
    target = ctypes.c_int(-1)
    with sm_carveout.gemm_carveout(2, dev):
        got = a @ b
        assert lib.cublasGetSmCountTarget(handle, ctypes.byref(target)) == 0 and target.value == sms - 2
        assert torch._C._get_sm_carveout_experimental() == 2
    assert lib.cublasGetSmCountTarget(handle, ctypes.byref(target)) == 0 and target.value == 0
    assert torch._C._get_sm_carveout_experimental() is None
    torch.testing.assert_close(got, want)  # another kernel may round otherwise (split-K)
