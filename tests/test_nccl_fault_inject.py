"""CPU tests of the NCCL fault-injection plumbing (``runtime/fault_inject.py``), the NCCL route's handling of a
refused call (``routes/nccl.py``: codes 300-399 abort the group), ``nccl_direct.NcclLibrary.check``'s
``ncclInProgress`` wait-out with a fake library, the probe's summary, and the 2-GPU probe's skip without GPUs. The
injection itself (``fo_nccl_inject`` in ``csrc/fused_call.cu``) runs only on GPUs: ``examples/device/
fault_probe.py --nccl-world 2``."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from flashoverlap_inductor import config
from flashoverlap_inductor.native import kernels, nccl_direct
from flashoverlap_inductor.routes import nccl
from flashoverlap_inductor.runtime import fault_inject

ROOT = Path(__file__).resolve().parents[1]


class FakeInjectLib:
    """Stands in for the kernel library's hook: records each arming, counts like the C side."""

    def __init__(self) -> None:
        self.armed: list[tuple[int, int, int, int]] = []
        self.counts = (0, 0, 0)
        self.fo_nccl_inject = self._inject
        self.fo_nccl_inject_stats = self._stats

    def _inject(self, nth, code, polls, stall_ns):
        self.armed.append((nth, code, polls, stall_ns))
        self.counts = (0, 0, 0)
        return 0

    def _stats(self, fired, polled, stalled):
        for ref, v in zip((fired, polled, stalled), self.counts, strict=True):
            ref._obj.value = v
        return 0


def test_injection_arms_and_disarms():
    lib = FakeInjectLib()
    inj = fault_inject.NcclInjection(nth=2, code=fault_inject.NCCL_IN_PROGRESS, polls=50, stall_ms=1.5)
    with fault_inject.nccl(inj, lib) as stats:
        assert lib.armed == [(2, 7, 50, 1_500_000)]
        lib.counts = (1, 50, 1)
        assert stats.read() == {"fired": 1, "polled": 50, "stalled": 1}
    assert lib.armed[-1] == (0, 0, 0, 0)  # disarmed
    assert stats.read() == {"fired": 1, "polled": 50, "stalled": 1}  # the block's counts, kept
    with pytest.raises(RuntimeError, match="boom"), fault_inject.nccl(fault_inject.NcclInjection(1, 3), lib):
        raise RuntimeError("boom")
    assert lib.armed[-1] == (0, 0, 0, 0)  # disarmed whatever raised
    assert "refused with ncclInternalError (3)" in fault_inject.NcclInjection(1, 3).describe()
    assert "200 in-progress polls" in fault_inject.NcclInjection(2, 7, 200).describe()


@pytest.mark.parametrize("bad", [dict(nth=1), dict(code=3), dict(nth=1, code=99), dict(nth=1, code=3, polls=5),
                                 dict(nth=-1), dict(stall_ms=-1.0)])
def test_injection_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        fault_inject.NcclInjection(**bad)


def test_library_without_hook_says_rebuild():
    old = types.SimpleNamespace()
    assert not fault_inject.available(old)
    with pytest.raises(kernels.KernelLibraryError, match="rebuild"), \
            fault_inject.nccl(fault_inject.NcclInjection(stall_ms=1.0), old):
        pass
    assert fault_inject.available(FakeInjectLib())


class FakeNccl:
    """``ncclCommGetAsyncError`` reporting in progress ``busy`` times, then ``final``; ``ncclGetErrorString``."""

    def __init__(self, busy: int, final: int = 0) -> None:
        self.busy, self.final, self.polls = busy, final, 0

    def ncclCommGetAsyncError(self, comm, state_ref):
        self.polls += 1
        state_ref._obj.value = nccl_direct.NCCL_IN_PROGRESS if self.polls <= self.busy else self.final
        return 0

    def ncclGetErrorString(self, rc):
        return {3: b"internal error", 5: b"invalid usage"}.get(rc, b"?")


def _library(fake) -> nccl_direct.NcclLibrary:
    lib = object.__new__(nccl_direct.NcclLibrary)
    lib.lib, lib.path, lib.version = fake, "fake", 0
    return lib


def test_in_progress_is_waited_out():
    fake = FakeNccl(busy=25)
    _library(fake).check(nccl_direct.NCCL_IN_PROGRESS, "ncclAllReduce", comm=1234)
    assert fake.polls == 26


def test_in_progress_ending_in_an_error_raises_it():
    with pytest.raises(nccl_direct.NcclError, match=r"NCCL error 5 \(invalid usage\)"):
        _library(FakeNccl(busy=3, final=5)).check(nccl_direct.NCCL_IN_PROGRESS, "ncclSend", comm=1)


def test_in_progress_past_the_bound_raises():
    with config.patch(wait_timeout_ms=30.0), \
            pytest.raises(nccl_direct.NcclError, match="stayed in progress past the timeout"):
        _library(FakeNccl(busy=10 ** 12)).check(nccl_direct.NCCL_IN_PROGRESS, "ncclAllReduce", comm=1)


def test_error_code_is_named():
    with pytest.raises(nccl_direct.NcclError, match=r"ncclAllReduce failed: NCCL error 3 \(internal error\)"):
        _library(FakeNccl(busy=0)).check(3, "ncclAllReduce", comm=1)
    _library(FakeNccl(busy=0)).check(0, "ncclAllReduce", comm=1)  # success: nothing


def _execute_with(monkeypatch, code: int):
    """``NcclRoute.execute`` on CPU tensors, its library call raising ``KernelLibraryError`` with ``code`` (what
    ``kernels.check`` raises for ``fo_fused_call``'s return code); returns (exception, aborted groups)."""
    aborted = []
    group = types.SimpleNamespace(group_name="g7", rank=lambda: 1)

    def fused_call(*args, **kwargs):
        exc = kernels.KernelLibraryError(f"fo_fused_call failed (code {code}): ncclAllReduce failed")
        exc.code = code
        raise exc

    monkeypatch.setattr(nccl.nccl_direct, "communicator", lambda g, d: types.SimpleNamespace(comm=1))
    monkeypatch.setattr(nccl.compat, "current_raw_stream", lambda index: 0)
    monkeypatch.setattr(nccl.compat, "abort_group", lambda g: aborted.append(g) or True)
    monkeypatch.setattr(nccl, "slot_domain", lambda res, slot: None)
    monkeypatch.setattr(nccl, "kernel_b", lambda b, choice: (b, b.stride(0)))
    monkeypatch.setattr(nccl, "fused_call", fused_call)
    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: types.SimpleNamespace(record=lambda s=None: None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: None)  # the watchdog's start event
    a, b = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    res = types.SimpleNamespace(slot=lambda cur, dedicated: 0, counters=[torch.zeros(4, dtype=torch.int32)],
                                expected=[torch.zeros(4, dtype=torch.int32)], side=types.SimpleNamespace(cuda_stream=0))
    ctx = types.SimpleNamespace(opnd=types.SimpleNamespace(a=a, b=b, bias=None), res=res, group=group,
                                capturing=False, out_shape=(256, 128))
    launch = types.SimpleNamespace(collective="all_reduce", gather=None, kernel=None, workspace_bytes=0, index=0,
                                   gmap=None, order=None, sm_count=1, swizzle=1, csteps=None, timeout_ns=1,
                                   launch_id=1, description="all_reduce rows=256 n=128 k=64 bf16")
    with pytest.raises(kernels.KernelLibraryError) as info:
        nccl.ROUTE.execute(launch, ctx)
    return info.value, aborted


@pytest.mark.parametrize("nccl_result", [1, 3, 5, 6, 7])
def test_refused_nccl_call_aborts_the_group(monkeypatch, nccl_result):
    """What an injected code becomes: the library returns 300 + ncclResult_t (7: still in progress after the
    bound); the route aborts the group and says so."""
    exc, aborted = _execute_with(monkeypatch, 300 + nccl_result)
    assert [g.group_name for g in aborted] == ["g7"]
    assert "process group g7 was aborted" in str(exc) and "NCCL failed inside a fused all_reduce" in str(exc)
    assert isinstance(exc.__cause__, kernels.KernelLibraryError)


@pytest.mark.parametrize("code", [2, 104, 8])
def test_other_library_errors_do_not_abort(monkeypatch, code):
    exc, aborted = _execute_with(monkeypatch, code)
    assert aborted == [] and f"code {code}" in str(exc)


def test_summary_counts_clear_hangs_and_wrong(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "device"))
    import fault_probe

    lines = [{"case": "a", "rank": 0, "clear": True}, {"case": "b", "rank": 0, "clear": False, "hang": True},
             {"case": "c", "rank": 0, "clear": False, "wrong": True},
             {"case": "d", "rank": 0, "error": "raised x", "next_call": "correct"}]
    (tmp_path / "fault_probe_ncclw2_rank0.json").write_text(json.dumps(lines))
    assert fault_probe.summarize(str(tmp_path), 0) == 1
    assert "faults injected 4, wrong results 1, hangs 1, clear errors 2" in capsys.readouterr().out
    (tmp_path / "fault_probe_ncclw2_rank0.json").write_text(json.dumps([lines[0], lines[3]]))
    assert fault_probe.summarize(str(tmp_path), 0) == 0


def test_two_gpu_probe_skips_without_gpus(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "device" / "fault_probe.py"), "--nccl-world",
                           "2", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fault probe: skipped: --nccl-world 2 needs 2 GPUs, 0 visible" in proc.stdout


def test_ctypes_refs_used_by_the_fakes():  # the fakes read byref()'s target as the C side would write it
    v = ctypes.c_int64(0)
    ref = ctypes.byref(v)
    ref._obj.value = 5
    assert v.value == 5
