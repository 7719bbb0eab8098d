"""``routes/moe_plan_lib.py`` (the MoE plan and the deferred poison as library calls, ``csrc/moe_plan.cu``): the
ctypes mirrors against the C header field by field (a C compiler prints every ``offsetof``), the settle layout the
kernels assume, and which implementation the dispatchers take. The kernels' results are checked on a GPU by
``tests/test_moe_plan_kernel.py`` (its cases run through both the library and the Triton kernels).

    python3 -m pytest -q tests/test_moe_plan_lib.py
"""

from __future__ import annotations

import pytest
import torch
from c_layout import HEADER, assert_mirrors_header, needs_cc

from flashoverlap_inductor import config
from flashoverlap_inductor.routes import moe_deferred, moe_plan_kernel, moe_plan_lib


@needs_cc
@pytest.mark.parametrize("struct,c_name", [(moe_plan_lib.PlanArgs, "fo_moe_plan_args"),
                                           (moe_plan_lib.PoisonArgs, "fo_moe_poison_args"),
                                           (moe_plan_lib.MoveArgs, "fo_moe_move_args")])
def test_the_ctypes_mirrors_match_the_c_layout(tmp_path, struct, c_name):
    assert_mirrors_header(struct, c_name, "moe_plan.cu", tmp_path)


def test_the_header_limits_are_the_modules():
    text = HEADER.read_text()
    assert f"#define FO_MOE_MAX_BLOCKS {moe_plan_lib.MAX_BLOCKS}\n" in text
    assert f"#define FO_MOE_MAX_PIECES {moe_plan_lib.MAX_PIECES}\n" in text
    assert f"#define FO_MOE_POISON_SLOTS {moe_plan_lib.POISON_SLOTS}\n" in text
    assert f"#define FO_MOE_MOVE_SLOTS {moe_plan_lib.MOVE_SLOTS}\n" in text
    assert f"#define FO_MOE_MAX_EXPERTS {moe_plan_kernel.MAX_EXPERTS}\n" in text
    assert moe_plan_lib.MAX_BLOCKS == moe_plan_kernel.MAX_BLOCKS


def test_on_by_default_off_under_the_opt_out_and_never_on_the_cpu(monkeypatch):
    index, offs = torch.arange(8), torch.tensor([4, 8], dtype=torch.int32)
    out = [torch.zeros(4)]
    moves = [(torch.zeros(8, 4), torch.zeros(8, 4))]
    monkeypatch.setattr(moe_plan_lib, "_failed", [])
    with config.patch(experiments=set()):
        assert moe_plan_lib.on()  # the default
        # CPU tensors: never the library
        assert not moe_plan_lib.should_plan(index, offs) and not moe_plan_lib.should_poison(out, 2)
        assert not moe_plan_lib.should_move(index, moves) and not moe_plan_lib.usable(index)
    with config.patch(experiments={"moe_plan_triton"}):
        assert not moe_plan_lib.on()


def test_the_widest_word_divides_every_size():
    assert moe_plan_lib._word(4096, 8192, 4096, 0x7F0000, 0x7F1000) == 16
    assert moe_plan_lib._word(1536 * 2, 1536 * 2, 3072, 0x7F0008, 0x7F1000) == 8
    assert moe_plan_lib._word(6, 6, 12, 0x10, 0x20) == 2


def test_the_dispatchers_take_the_library_where_it_should_be_used(monkeypatch):
    """``moe_plan_kernel.build`` and ``moe_deferred.poison_if_bad`` call the library where its predicate holds
    (stand-ins here: no GPU), and nothing else."""
    calls = []
    monkeypatch.setattr(moe_plan_lib, "should_plan", lambda *a: True)
    monkeypatch.setattr(moe_plan_lib, "plan", lambda index, offs, bounds, cuts=None: calls.append(("plan", bounds))
                        or "built")
    monkeypatch.setattr(moe_plan_lib, "should_poison", lambda outs, world: True)
    monkeypatch.setattr(moe_plan_lib, "poison", lambda outs, vectors, world, mirror=None:
                        calls.append(("poison", len(outs))) or [])
    index, offs = torch.arange(8), torch.tensor([4, 8], dtype=torch.int32)
    assert moe_plan_kernel.should_use(index, offs, 2)
    assert moe_plan_kernel.build(index, offs, [0, 3, 8]) == "built"
    moe_deferred.poison_if_bad([torch.zeros(3), torch.zeros(0), torch.zeros(2)], torch.zeros(16), 2)
    assert calls == [("plan", [0, 3, 8]), ("poison", 2)]  # the empty output left out


def test_a_refused_call_hands_over_to_the_triton_kernels_and_a_device_error_raises(monkeypatch):
    """A library refusal (rc < 100: its arguments) is recorded and logged, and the predicates say no from then on;
    a CUDA error (rc >= 100) raises."""
    fake = type("Lib", (), {"fo_last_error": staticmethod(lambda: b"bad ends")})()
    monkeypatch.setattr(moe_plan_lib.kernels, "library", lambda: fake)
    monkeypatch.setattr(moe_plan_lib, "_failed", [])
    assert moe_plan_lib._called(0, "fo_moe_plan")
    with pytest.raises(moe_plan_lib.kernels.KernelLibraryError, match="fo_moe_poison failed"):
        moe_plan_lib._called(105, "fo_moe_poison")
    assert not moe_plan_lib._failed
    with config.patch(experiments=set()):  # the default: the library
        assert moe_plan_lib.on()
        assert not moe_plan_lib._called(2, "fo_moe_plan")
        assert moe_plan_lib._failed == ["fo_moe_plan: bad ends"] and not moe_plan_lib.on()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the library's kernels need an sm90 GPU")
@pytest.mark.parametrize("dtype,cols,pad,moves,word", [
    (torch.bfloat16, 2048, 0, 4, 16),
    (torch.bfloat16, 772, 0, 1, 8),    # 1544-byte rows
    (torch.bfloat16, 770, 6, 2, 4),    # 1540-byte rows, padded strides
    (torch.bfloat16, 769, 1, 3, 2),    # 1538-byte rows
    (torch.float32, 96, 8, 4, 16),     # fp32, padded
    (torch.float16, 3, 0, 1, 2),       # 6-byte rows
])
def test_move_rows_is_index_copy_bit_for_bit(dtype, cols, pad, moves, word):
    """``fo_moe_move_rows`` against ``index_copy_`` on fresh random rows: every word width (16/8/4/2 bytes), padded
    row strides (a column slice of a wider tensor, both sides), 1-4 moves in one call, a permutation with rows
    left untouched in ``dst`` (their poison must survive), bit for bit; the column padding is never written."""
    from flashoverlap_inductor.native import kernels

    if not kernels.available():  # on an sm90 GPU the library must be built: these cases must not vanish
        pytest.fail("the library does not load on this sm90 GPU: build it (python -m flashoverlap_inductor.build)")
    g = torch.Generator(device="cuda").manual_seed(cols * 7 + moves)
    rows, dst_rows = 1000, 1300
    inv = torch.randperm(dst_rows, device="cuda", generator=g)[:rows].contiguous()
    pairs, wants = [], []
    for _ in range(moves):
        src = torch.randn(rows, cols + pad, device="cuda", generator=g).to(dtype)[:, :cols]
        dst = torch.full((dst_rows, cols + pad), float("nan"), device="cuda", dtype=dtype)[:, :cols]
        want = dst.clone().index_copy_(0, inv, src)
        pairs.append((dst, src))
        wants.append(want)
        size = dst.element_size()  # the word the library is given for this pair
        assert moe_plan_lib._word(cols * size, src.stride(0) * size, dst.stride(0) * size, src.data_ptr(),
                                  dst.data_ptr()) == word
    with config.patch(experiments=set()):  # the default: the library
        assert moe_plan_lib.usable(inv) and moe_plan_lib.should_move(inv, pairs)
        before = moe_plan_lib.stats["moe:move_lib"]
        assert moe_plan_lib.move_rows(inv, pairs)
        assert moe_plan_lib.stats["moe:move_lib"] == before + 1
    torch.cuda.synchronize()
    for (dst, _), want in zip(pairs, wants):
        assert torch.equal(dst.view(torch.int16 if dst.element_size() == 2 else torch.int32),
                           want.view(torch.int16 if want.element_size() == 2 else torch.int32))
        if pad:  # the padding columns kept their NaN
            assert torch.isnan(dst._base[:, cols:].float()).all()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the library's kernels need an sm90 GPU")
@pytest.mark.parametrize("blocks,experts,pieces", [(2, 64, 2), (3, 5, 4), (2, 3, 1), (2, 40, 8), (2, 40, 10)])
def test_the_plans_piece_bounds_are_torchs(blocks, experts, pieces):
    """``fo_moe_plan`` with cuts writes the expert pieces' bounds as ``moe_fast.pieces_with_torch`` computes them from
    the same table: random routings in the MoE form (every block expert-sorted), chunks of random sizes; past
    ``MAX_PIECES`` pieces the library writes none (``BlockPlan`` then takes torch's) and is not refused."""
    from flashoverlap_inductor.native import kernels
    from flashoverlap_inductor.routes import moe_fast

    if not kernels.available():
        pytest.fail("the library does not load on this sm90 GPU: build it (python -m flashoverlap_inductor.build)")
    g = torch.Generator().manual_seed(blocks * 100 + experts + pieces)
    per = torch.randint(0, 40, (blocks, experts), generator=g)  # rows of (block, expert)
    sizes = per.sum(1).tolist()
    expert_of_row = torch.arange(experts).repeat(blocks).repeat_interleave(per.flatten())
    index = expert_of_row.argsort(stable=True).cuda()
    offs = per.sum(0).cumsum(0).to(torch.int32).cuda()
    cuts = [sorted(torch.randint(0, n + 1, (pieces,), generator=g).tolist()[:-1]) + [n] for n in sizes]
    with config.patch(experiments=set()):
        built = moe_plan_lib.plan(index, offs, [0, *torch.tensor(sizes).cumsum(0).tolist()], cuts)
    assert built is not None and not moe_plan_lib._failed
    want = moe_fast.pieces_with_torch(built[2], cuts, experts, index.device)
    if pieces > moe_plan_lib.MAX_PIECES:
        assert len(built) == 4
        with config.patch(experiments=set()):
            plan = moe_fast.BlockPlan(index, offs, sizes, cuts)
        assert plan.pieces.tolist() == want.tolist()
        return
    assert len(built) == 5 and built[4].tolist() == want.tolist(), (built[4].tolist(), want.tolist(), cuts)


def test_a_refused_status_mirror_is_dropped_alone(monkeypatch):
    """``fo_moe_poison`` refusing the status mirror (not memory the device addresses): the poison runs again without
    it and counts, the library's other steps stay on, and later calls do not offer a mirror (``mirrors`` False)."""
    seen = []

    class Lib:
        @staticmethod
        def fo_moe_poison(ref):
            seen.append(ref._obj.mirror)
            return 2 if ref._obj.mirror else 0

        @staticmethod
        def fo_last_error():
            return b"fo_moe_poison: mirror must be page-locked host memory the device can address"

    monkeypatch.setattr(moe_plan_lib.kernels, "ready", lambda dev: Lib)
    monkeypatch.setattr(moe_plan_lib.kernels, "library", lambda: Lib)
    monkeypatch.setattr(moe_plan_lib.compat, "current_raw_stream", lambda index: 0)
    monkeypatch.setattr(moe_plan_lib, "_failed", [])
    monkeypatch.setattr(moe_plan_lib, "_no_mirror", [])
    outs, vectors, mirror = [torch.zeros(3), torch.zeros(2)], torch.zeros(16, dtype=torch.int64), torch.zeros(16)
    before = moe_plan_lib.stats["moe:poison_lib"]
    assert moe_plan_lib.mirrors()
    assert moe_plan_lib.poison(outs, vectors, 2, mirror) == []
    assert seen == [mirror.data_ptr(), None] and not moe_plan_lib.mirrors() and not moe_plan_lib._failed
    assert moe_plan_lib.stats["moe:poison_lib"] == before + 1
    assert moe_plan_lib.poison(outs, vectors, 2, mirror) == [] and seen[2:] == [None]  # no mirror offered again
