"""``routes/moe_plan_kernel.py`` (the whole-block path's routing plan in two Triton kernels, or one library call:
the ``impl`` fixture runs each case through both) against its reference,
``moe_fast.plan_with_torch``, on random routing data: the MoE form (the premise holds), random permutations, repeated
and unnamed rows, negative and out-of-range entries, offsets decreasing, short of or past the rows, 1-8 blocks with
empty ones, experts not a multiple of 4 and up to 1024, several programs per kernel, int32 and int64 operands.
``idx``, ``inv`` (the last expert row naming a row, where several do, in both) and ``facts`` bit for bit; ``table``
bit for bit where the data are good and the premise holds, else within its bounds (each block's offsets
non-decreasing, at most its rows: all the GEMMs need before the settle redoes or refuses the call). On CUDA where a
GPU is present, else on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh process); skips
without Triton.

    python3 -m pytest -q tests/test_moe_plan_kernel.py
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
# On the CPU the kernels run under Triton's interpreter, which must be on before Triton is first imported (its
# library functions, tl.sum and the like, are decorated then): in a fresh process (test_under_the_interpreter)
HERE = DEV.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
here = pytest.mark.skipif(not HERE, reason="on the CPU: run by test_under_the_interpreter in a fresh process")


@pytest.mark.skipif(HERE, reason="the kernels run in this process")
def test_under_the_interpreter():
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.fixture(params=["triton", "library"])
def impl(request):
    """Which kernels build the plan and poison: Triton's (the experiment ``moe_plan_triton``; also wherever the
    library does not load) or the library's (``routes/moe_plan_lib.py``: the default on an sm90 GPU with the library
    built)."""
    from flashoverlap_inductor import config
    from flashoverlap_inductor.native import kernels

    if request.param == "triton":
        with config.patch(experiments={"moe_plan_triton"}):
            yield "triton"
        return
    if DEV.type != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the library's kernels need an sm90 GPU")
    if not kernels.available():  # on an sm90 GPU the library must be built: these cases must not vanish
        pytest.fail("the library does not load on this sm90 GPU: build it (python -m flashoverlap_inductor.build)")
    with config.patch(experiments=set()):  # the default, whatever the environment sets
        yield "library"


def _case(seed: int, kind: str, blocks: int, experts: int, rows_per_block: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, rows_per_block + 1, (blocks,), generator=gen).tolist()
    if kind != "empty-blocks":
        sizes = [max(s, 1) for s in sizes]
    rows = sum(sizes) or 1
    sizes[-1] += rows - sum(sizes)
    per = torch.zeros(blocks, experts, dtype=torch.int64)
    for j, n in enumerate(sizes):
        if n:
            per[j] = torch.multinomial(torch.ones(experts), n, replacement=True, generator=gen).bincount(
                minlength=experts)
    expert_of_row = torch.arange(experts).repeat(blocks).repeat_interleave(per.flatten())
    index = expert_of_row.argsort(stable=True)  # the MoE form: block-major rows, expert-major after the index
    offs = per.sum(0).cumsum(0)
    if kind == "random-perm":
        index = torch.randperm(rows, generator=gen)
    elif kind == "repeats":
        index[torch.randint(0, rows, (max(1, rows // 5),), generator=gen)] = int(index[0])
    elif kind == "negative":
        index = index - rows * torch.randint(0, 2, (rows,), generator=gen)
    elif kind == "out-of-range":
        index[int(torch.randint(0, rows, (1,), generator=gen))] = rows + 3
    elif kind == "offs-decreasing" and experts > 1:
        offs[0], offs[1] = offs[1] + 1, offs[0]
    elif kind == "offs-short":
        offs = (offs - 1).clamp(min=0)
    elif kind == "offs-past":
        offs[-1] = rows + 5
    elif kind == "unsorted-block":
        index = index.flip(0)
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    return index, offs, bounds


KINDS = ["moe", "empty-blocks", "random-perm", "repeats", "negative", "out-of-range", "offs-decreasing", "offs-short",
         "offs-past", "unsorted-block"]


@here
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocks,experts,per_block", [(1, 4, 40), (2, 64, 40), (3, 5, 40), (8, 13, 40), (2, 130, 40),
                                                      (3, 16, 700), (2, 1024, 60)])
def test_the_kernels_build_the_reference_plan(kind, blocks, experts, per_block, impl):
    """(3, 16, 700): several programs per kernel (512 lanes each), neighbours compared across their edges; (2, 1024,
    60): the most experts, 16 lanes per program."""
    from flashoverlap_inductor.routes import moe_fast, moe_p2p, moe_plan_kernel

    for seed in range(3 if per_block <= 60 else 1):
        index, offs, bounds = _case(seed * 31 + blocks * 7 + experts, kind, blocks, experts, per_block)
        for itype, otype in ((torch.int64, torch.int32), (torch.int32, torch.int64)):
            i, o = index.to(DEV, itype), offs.to(DEV, otype)
            want = moe_fast.plan_with_torch(i, o, bounds)
            assert impl != "library" or moe_plan_kernel.moe_plan_lib.should_plan(i, o)
            from flashoverlap_inductor.routes import base

            built = base.stats["moe:plan_lib"]
            got = moe_plan_kernel.build(i, o, bounds)
            assert base.stats["moe:plan_lib"] == built + (impl == "library"), "the library refused the plan"
            name = f"{kind} seed {seed} {itype} {otype}"
            assert torch.equal(got[0], want[0]), f"idx: {name}"
            assert got[3].tolist() == want[3].tolist(), f"facts: {name}"
            if not any(moe_p2p.verdicts(want[3].tolist())):  # good data, the premise holds: the same offsets
                assert torch.equal(got[2], want[2]), f"table: {name}\n{got[2]}\n{want[2]}"
            assert torch.equal(got[1], want[1]), f"inv: {name}"  # the last naming row where several do: determined
            assert (got[2] >= 0).all() and (got[2][:, :experts].diff(dim=1) >= 0).all(), name
            sizes = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], device=DEV)
            assert (got[2] <= sizes[:, None]).all(), f"table past a block: {name}"


@here
def test_the_premise_verdicts_are_the_references(impl):
    """The settle's verdicts (``moe_p2p.verdicts``) on the kernels' facts name the same failures."""
    from flashoverlap_inductor.routes import base, moe_fast, moe_p2p, moe_plan_kernel

    seen, before = set(), base.stats["moe:plan_lib"]
    for kind in KINDS:
        index, offs, bounds = _case(5, kind, 2, 8, 50)
        i, o = index.to(DEV), offs.to(DEV, torch.int32)
        got = moe_p2p.verdicts(moe_plan_kernel.build(i, o, bounds)[3].tolist())
        assert got == moe_p2p.verdicts(moe_fast.plan_with_torch(i, o, bounds)[3].tolist()), kind
        seen.add((kind, got))
    assert ("moe", (False, False, False)) in seen and ("out-of-range", (True, False, True)) in seen
    assert ("repeats", (False, False, True)) in seen and ("offs-past", (False, True, True)) in seen
    assert base.stats["moe:plan_lib"] == before + (len(KINDS) if impl == "library" else 0)


@pytest.mark.skipif(DEV.type != "cuda", reason="direct launches need a GPU (the interpreter always runs)")
def test_later_launches_go_straight_to_the_compiled_kernels():
    """After a key's first launch the plan's kernels launch through their compiled form (``runtime.triton_launch``)
    and still build the reference plan, on fresh data of the same form and on other block sizes."""
    from flashoverlap_inductor import config
    from flashoverlap_inductor.routes import moe_fast, moe_plan_kernel
    from flashoverlap_inductor.runtime import triton_launch

    for seed in range(4):
        index, offs, bounds = _case(seed, "moe", 2, 64, 300 + seed)
        i, o = index.to(DEV), offs.to(DEV, torch.int32)
        before = triton_launch.counts["direct"]
        with config.patch(experiments={"moe_plan_triton"}):  # the Triton kernels, not the library's
            got = moe_plan_kernel.build(i, o, bounds)
        want = moe_fast.plan_with_torch(i, o, bounds)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), seed
        if seed:
            assert triton_launch.counts["direct"] == before + 2, "the plan's kernels went through triton.jit's run"


def test_the_predicate():
    from flashoverlap_inductor.routes import moe_plan_kernel

    i, o = torch.arange(8), torch.tensor([4, 8], dtype=torch.int32)
    assert moe_plan_kernel.fits(i, o, 2) and not moe_plan_kernel.should_use(i, o, 2)  # CPU tensors: the torch ops
    for args in ((i, o, 9), (i, o, 0), (i[:0], o, 2), (i.view(2, 4), o, 2), (i[::2], o, 2), (i.float(), o, 2),
                 (i, o.float(), 2), (i, torch.arange(1025), 2), (i, o[:0], 2)):
        assert not moe_plan_kernel.fits(*args), args
    if torch.cuda.is_available():
        assert moe_plan_kernel.should_use(i.cuda(), o.cuda(), 2)
        assert not moe_plan_kernel.should_use(i.cuda(), o.cuda(), 9)
        assert not moe_plan_kernel.should_use(i.cuda()[:0], o.cuda(), 2)


@here
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_poison_kernel_judges_as_the_torch_verdict(dtype, impl):
    """``moe_plan_triton.poison_if_bad`` (the deferred settle's poison, ``routes/moe_deferred.py``) against
    ``moe_deferred.bad``: every field's bad value on one rank of 1-8, and good vectors (from real plans and the
    general path's zeros); NaN over the whole output where bad, the output untouched where good."""
    from flashoverlap_inductor.routes import moe_deferred, moe_fast, moe_p2p, moe_plan_kernel

    kernel = moe_plan_kernel._kernels()[2]  # as the deferred settle launches it: through its compiled form
    good = [moe_fast.plan_with_torch(*_case(s, "moe", 2, 8, 30)[:2], _case(s, "moe", 2, 8, 30)[2])[3].tolist()
            for s in range(3)] + [[0] * moe_p2p.SETTLE_LEN]
    changes = [(moe_p2p.FAIL, 2), (moe_p2p.IDX_MAX, 10 ** 6), (moe_p2p.IDX_MIN, -10 ** 6), (moe_p2p.OFFS_STEP, -1),
               (moe_p2p.UNNAMED, 1), (moe_p2p.OFFS_LAST, 10 ** 6), (moe_p2p.KEY_STEP, -3), (None, None)]
    for world in (1, 2, 3, 8):
        for field, value in changes:
            rows = [list(good[r % len(good)]) for r in range(world)]
            if field is not None:  # on a whole-block rank's vector (the general path's zeros have no rows to judge)
                rows[world // 2 if world in (3, 8) else 0][field] = value
            vectors = torch.tensor(rows, dtype=torch.int64, device=DEV).flatten()
            # 1-4 outputs of other sizes (not multiples of the block) and dtypes, in one launch
            outs = [torch.randn(3, 4099, device=DEV).to(dtype), torch.randn(1500, device=DEV),
                    torch.randn(2, 7, device=DEV).to(dtype), torch.randn(5000, device=DEV).to(dtype)][:1 + world % 4]
            wants = [out.clone().masked_fill_(moe_deferred.bad(vectors, world), float("nan")) for out in outs]
            if impl == "library":
                from flashoverlap_inductor.routes import moe_plan_lib

                assert moe_plan_lib.should_poison(outs, world)
                moe_plan_lib.poison(outs, vectors, world)
            else:
                moe_deferred.poison_with_kernel(kernel, outs, vectors, world, block=1024)
            for out, want in zip(outs, wants, strict=True):
                assert torch.equal(out.isnan(), want.isnan()) and \
                    torch.equal(out.nan_to_num(0), want.nan_to_num(0)), (world, field, len(outs))
            assert all(bool(w.isnan().all()) == (field is not None) for w in wants), (world, field)


@pytest.mark.skipif(DEV.type != "cuda", reason="the kernel poisons CUDA outputs (CPU ones take the masked fill)")
def test_more_outputs_than_slots_take_several_launches(impl):
    """``moe_deferred.poison_if_bad`` with 6 outputs (``POISON_SLOTS`` = 4 per launch): all NaN where bad, all
    untouched where good."""
    from flashoverlap_inductor.routes import base, moe_deferred, moe_p2p

    before = base.stats["moe:poison_lib"]
    for value in (2, 0):
        vectors = torch.zeros(2 * moe_p2p.SETTLE_LEN, dtype=torch.int64, device=DEV)
        vectors[moe_p2p.FAIL] = value
        outs = [torch.randn(100 + 37 * i, device=DEV).to(torch.bfloat16) for i in range(6)]
        keep = [o.clone() for o in outs]
        moe_deferred.poison_if_bad(outs, vectors, 2)
        for out, old in zip(outs, keep, strict=True):
            assert bool(out.isnan().all()) if value else torch.equal(out, old), value
    assert base.stats["moe:poison_lib"] == before + (4 if impl == "library" else 0)  # 2 calls of 6 outputs: 4 + 2
