"""``native/grouped.py`` (``fo_grouped_gemm``, ``csrc/grouped_gemm.cu``: the experts' grouped GEMM with device
offsets): the ctypes mirror against the C header field by field, the clear errors for what the kernel cannot take
(CPU); on an sm90 GPU with the library, fresh random bf16 data against an fp64 oracle (a bf16-fit normwise
tolerance) and against ``torch._grouped_mm``: empty experts, rows not a multiple of the tile, padded row strides,
int32 and int64 offsets, the experts cut into pieces that write one pre-poisoned (NaN) output (rows of no expert in
range keep the poison: the kernel writes exactly its rows), offsets out of order or past the rows (clamped, never out
of bounds), and a call after a refused one.

    python3 -m pytest -q tests/test_grouped_gemm.py
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from c_layout import assert_mirrors_header, needs_cc

from flashoverlap_inductor.native import grouped, kernels

TOL = 4 * torch.finfo(torch.bfloat16).eps  # normwise relative error of a bf16 GEMM output against fp64
sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="the library's kernels need an sm90 GPU")


@needs_cc
def test_the_ctypes_mirror_matches_the_c_layout(tmp_path):
    assert_mirrors_header(grouped.GroupedGemmArgs, "fo_grouped_gemm_args", "grouped_gemm.cu", tmp_path)


@pytest.mark.parametrize("a,w,offs,match", [
    ((8, 16), (2, 8, 24), torch.tensor([4, 8]), "k=16"),
    ((8, 16), (3, 8, 16), torch.tensor([4, 8]), "one entry per expert"),
    ((8, 12), (2, 8, 12), torch.tensor([4, 8]), "multiples of 8"),
])
def test_bad_input_gets_a_clear_error_before_any_device_work(a, w, offs, match):
    x, wt = torch.zeros(*a, dtype=torch.bfloat16), torch.zeros(*w, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        grouped.grouped_mm(x, wt, offs)
    with pytest.raises(ValueError, match="bfloat16 only"):
        grouped.grouped_mm(x.float(), wt.float(), offs)


def test_the_weight_layouts():
    w = torch.zeros(4, 24, 16)
    assert grouped.b_layout_of(w) == 0  # Linear weights [n, k]
    assert grouped.b_layout_of(torch.zeros(4, 16, 24).transpose(-2, -1)) == 1  # [k, n] stored, n contiguous
    assert grouped.b_layout_of(torch.zeros(4, 24, 24)[..., :16]) is None  # padded rows
    assert grouped.b_layout_of(w[0]) is None


def test_the_cpu_runs_the_reference_semantics():
    """On the CPU ``grouped_mm`` is ``reference``: torch's grouped GEMM's rows of the experts in range (host bounds
    and device-style ``within`` alike), other rows of ``out`` untouched; each expert's rows bit for bit as torch's."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(40, 16, generator=g).bfloat16()
    w = torch.randn(4, 8, 16, generator=g).bfloat16()
    offs = torch.tensor([10, 10, 25, 40], dtype=torch.int32)
    full = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    out = torch.full((40, 8), float("nan")).bfloat16()
    grouped.grouped_mm(a, w, offs, out=out, within=torch.tensor([1, 3], dtype=torch.int32))
    assert torch.equal(out[10:25], full[10:25]) and bool(out[:10].isnan().all()) and bool(out[25:].isnan().all())
    grouped.grouped_mm(a, w, offs, out=out, experts=(3, 4))
    grouped.grouped_mm(a, w, offs, out=out, experts=(0, 1))
    assert torch.equal(out, full)


# ----------------------------------------------------------------------------------------------- on an sm90 GPU


def _library():
    if not kernels.available():  # on an sm90 GPU the library must be built: these cases must not vanish
        pytest.fail("the library does not load on this sm90 GPU: build it (python -m flashoverlap_inductor.build)")


def _case(seed: int, rows_per: list[int], n: int, k: int, pad: int = 0, offs_dtype=torch.int32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(rows_per)
    a = torch.randn(rows, k + pad, device="cuda", generator=g).bfloat16()[:, :k]
    w = (torch.randn(len(rows_per), n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    offs = torch.tensor(rows_per, device="cuda").cumsum(0).to(offs_dtype)
    return a, w, offs


def _oracle(a, w, offs, experts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 results and a mask of the rows the experts in range own."""
    ends = [0]
    for v in offs.tolist():  # running maxima, at most the rows (the kernel's clamp)
        ends.append(max(ends[-1], int(v)))
    ends = [min(e, a.shape[0]) for e in ends]
    first, last = experts or (0, w.shape[0])
    want = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    mask = torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    for e in range(first, last):
        lo, hi = ends[e], ends[e + 1]
        want[lo:hi] = a[lo:hi].double() @ w[e].double().t()
        mask[lo:hi] = True
    return want, mask


def _relerr(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


@sm90
@pytest.mark.parametrize("rows_per,n,k,pad,offs_dtype", [
    ([256, 0, 131, 77, 1, 300, 0, 512], 1536, 2048, 0, torch.int32),   # Qwen3-MoE's gate/up, empty experts
    ([97, 200, 3, 128], 2048, 768, 8, torch.int64),                    # its down, padded rows, int64 offsets
    ([1000, 24], 4096, 1024, 0, torch.int32),                          # few experts, many rows
])
def test_against_fp64_and_torch_grouped_mm(rows_per, n, k, pad, offs_dtype):
    _library()
    a, w, offs = _case(len(rows_per) * 31 + n, rows_per, n, k, pad, offs_dtype)
    out = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = grouped.grouped_mm(a, w, offs, out=out)
    torch.cuda.synchronize()
    want, mask = _oracle(a, w, offs)
    assert got.data_ptr() == out.data_ptr() and bool(mask.all())
    assert _relerr(got, want) < TOL
    ref = torch._grouped_mm(a.contiguous(), w.transpose(-2, -1), offs=offs.to(torch.int32))
    assert _relerr(got, ref.double()) < TOL  # both bf16 outputs of fp32 sums


@sm90
@pytest.mark.parametrize("rows_per,n,k", [([97, 200, 3, 128], 768, 2048),
                                          ([0, 300, 64, 1, 256, 0, 77, 512], 2048, 768)])
def test_weights_stored_transposed(rows_per, n, k):
    """``b_layout`` 1 (each expert's weight stored ``[k, n]``, n contiguous: the backward dispatch's down projection)
    against fp64 and ``torch._grouped_mm`` on the same operand, into a NaN-filled output."""
    _library()
    a, _, offs = _case(n + k, rows_per, n, k)
    g = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(len(rows_per), k, n, device="cuda", generator=g) / k ** 0.5).bfloat16().transpose(-2, -1)
    assert grouped.b_layout_of(w) == 1
    out = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, w, offs, out=out)
    torch.cuda.synchronize()
    want, mask = _oracle(a, w, offs)
    assert _relerr(out[mask], want[mask]) < TOL and bool(out[~mask].isnan().all())
    ref = torch._grouped_mm(a.contiguous(), w.transpose(-2, -1), offs=offs)
    assert _relerr(out[mask], ref[mask].double()) < TOL


@sm90
@pytest.mark.parametrize("pieces", [2, 3, 8])
def test_expert_pieces_fill_one_output_and_touch_nothing_else(pieces):
    """Experts cut into pieces, each a call into one NaN-filled output: after all pieces every row equals the
    oracle; after the first piece only its rows are written (the rest still NaN)."""
    _library()
    rows_per = [64, 0, 200, 17, 130, 5, 0, 256]
    a, w, offs = _case(pieces, rows_per, 768, 512)
    out = torch.full((a.shape[0], 768), float("nan"), device="cuda", dtype=torch.bfloat16)
    cuts = [len(rows_per) * i // pieces for i in range(pieces + 1)]
    for j, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        grouped.grouped_mm(a, w, offs, out=out, experts=(lo, hi))
        if j == 0:
            torch.cuda.synchronize()
            want, mask = _oracle(a, w, offs, (lo, hi))
            assert bool(out[~mask].isnan().all()) and not bool(out[mask].isnan().any())
            assert _relerr(out[mask], want[mask]) < TOL
    want, _ = _oracle(a, w, offs)
    assert _relerr(out, want) < TOL


@sm90
def test_device_side_piece_bounds_fill_one_output():
    """``within`` (the bounds the MoE dispatch's cut computes on the device): each piece over every expert, only the
    ones within its bounds written (an empty piece included), together every row."""
    _library()
    rows_per = [64, 0, 200, 17, 130, 5, 0, 256]
    a, w, offs = _case(11, rows_per, 768, 512, 0, torch.int64)
    out = torch.full((a.shape[0], 768), float("nan"), device="cuda", dtype=torch.bfloat16)
    bounds = torch.tensor([0, 3, 3, 5, 8], device="cuda", dtype=torch.int32)
    for q in range(4):
        grouped.grouped_mm(a, w, offs, out=out, within=bounds[q:q + 2])
        if q == 0:
            torch.cuda.synchronize()
            want, mask = _oracle(a, w, offs, (0, 3))
            assert bool(out[~mask].isnan().all()) and _relerr(out[mask], want[mask]) < TOL
    want, _ = _oracle(a, w, offs)
    assert _relerr(out, want) < TOL


@sm90
@pytest.mark.parametrize("bad", [[150, 120, 380, 360], [150, 120, 600, 380]])
def test_offsets_out_of_order_or_past_the_rows_are_clamped(bad):
    """Bad offsets give fewer rows, never another expert's or rows outside a or out: a step back (expert 1 empty,
    expert 2 from row 150), the last rows in no expert, or an end past the rows; ``out`` lies inside a NaN buffer
    whose rows around it must stay NaN, and its rows of no expert too; the rest is the clamped oracle's."""
    _library()
    a, w, _ = _case(7, [100, 100, 100, 100], 1024, 256)
    offs = torch.tensor(bad, device="cuda", dtype=torch.int32)
    big = torch.full((a.shape[0] + 64, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = big[32:32 + a.shape[0]]
    grouped.grouped_mm(a, w, offs, out=out)
    torch.cuda.synchronize()
    want, mask = _oracle(a, w, offs)
    assert bool(big[:32].isnan().all()) and bool(big[-32:].isnan().all())
    assert bool(out[~mask].isnan().all()) and _relerr(out[mask], want[mask]) < TOL
    assert int(mask.sum()) == min(max(bad), a.shape[0])


@sm90
def test_a_refused_call_raises_clearly_and_the_next_call_works():
    """Python's refusals (before any library call) and the library's own (a b_layout it does not know: code 2 and
    its message), then a good call is exact."""
    _library()
    a, w, offs = _case(3, [64, 64], 512, 256)
    out, ws = torch.empty(128, 512, device="cuda", dtype=torch.bfloat16), torch.empty(1 << 20, device="cuda")
    args = grouped.GroupedGemmArgs(a.data_ptr(), w.data_ptr(), out.data_ptr(), offs.data_ptr(), None, 128, 512, 256,
                                   256, 512, 512 * 256, 2, 0, 2, 4, ws.data_ptr(), ws.numel() * 4, 0, 7, 0)
    lib = kernels.ready(0)
    assert lib.fo_grouped_gemm(ctypes.byref(args)) == 2
    assert b"b_layout" in lib.fo_last_error()
    with pytest.raises(ValueError, match="experts must be"):
        grouped.grouped_mm(a, w, offs, experts=(1, 1))
    with pytest.raises(ValueError, match="16 bytes"):
        grouped.grouped_mm(a.view(-1)[1:1 + a.numel() - 256].view(-1, 256)[:127], w,
                           torch.tensor([64, 127], device="cuda", dtype=torch.int32))
    got = grouped.grouped_mm(a, w, offs)
    want, _ = _oracle(a, w, offs)
    assert _relerr(got, want) < TOL
