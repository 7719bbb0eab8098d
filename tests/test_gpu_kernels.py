"""Tests of the sm90 signal-GEMM library: the build script and loader on any machine, kernels on a Hopper GPU.

GPU tests skip without CUDA, without an sm90 device, or without the built library
(``python -m flashoverlap_inductor.build``); those that use the test helper kernels (``fo_test_*``) also without
the test library the build writes next to it (``libflashoverlap_sm90_test.so`` from ``csrc/test_api.cu``, or
``$FLASHOVERLAP_TEST_LIB``). They check results against torch on fresh random data with poisoned outputs, that
counters end exactly at the plan's group sizes, that every group's rows are complete when its wait releases, and
that a wait that can never succeed raises ``FlashOverlapTimeout``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import pytest
import torch

from flashoverlap_inductor import build, config
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.schedule import plan
from flashoverlap_inductor.tools import kernel_calls

GPU = pytest.mark.skipif(not kernels.available(), reason="needs an sm90 GPU and the built CUDA library")


# --------------------------------------------------------------------------------------------- CPU-only parts
def test_build_skips_cleanly_without_nvcc(monkeypatch, capsys):
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    assert build.build(verbose=False) is None
    assert "nvcc not found" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="nvcc not found"):
        build.build(require=True)
    assert build.main([]) == 0
    assert build.main(["--require"]) == 1


def test_build_units_are_unique_and_cover_every_variant():
    stems = [u.stem for u in build.units()]
    assert len(stems) == len(set(stems))
    names = [c.name for c in build.CONFIGS]
    assert len(names) == len(set(names))
    full = [c for c in build.CONFIGS if c.variants == "all"]
    assert {(c.schedule, c.tile[:2]) for c in full} >= {("coop", (128, 128)), ("coop", (128, 256)),
                                                         ("coop", (256, 128)), ("pp", (128, 128))}
    for c in full:
        got = {(u.dtype, u.b_layout) for u in build.units([c.name]) if u.config == c}
        assert got == {(d, b) for d in build.DTYPES for b in build.B_LAYOUTS}
    assert kernels.DEFAULT_CONFIG in names
    assert all(u.dtype == "bf16" and u.b_layout == "nk" for u in build.units(variants="bf16_nk"))
    smoke = build.smoke_units()
    assert {u.config.schedule for u in smoke} == {"coop", "pp"}
    assert {u.dtype for u in smoke} == set(build.DTYPES) and {u.b_layout for u in smoke} == set(build.B_LAYOUTS)


def test_loader_reports_missing_library(tmp_path):
    with config.patch(library=str(tmp_path / "nope.so")):  # Settings.library ($FLASHOVERLAP_LIB, read once)
        with pytest.raises(kernels.KernelLibraryError, match="flashoverlap_inductor.build"):
            kernels.library()
        assert not kernels.available()


def test_shipped_abi_has_no_test_functions():
    """The test helpers (``fo_test_*``) live in their own library: the shipped header and sources have none (the
    built library is checked by ``test_library_exports_no_test_functions``)."""
    csrc = build.CSRC
    for name in ["flashoverlap_sm90.h"] + [f"{u}.cu" for u in build.HOST_UNITS]:
        assert "fo_test_" not in (csrc / name).read_text(), name
    assert "fo_test_stamp" in (csrc / "test_api.cu").read_text()
    assert set(build.TEST_UNITS).isdisjoint(build.HOST_UNITS)


def test_wrap32_is_cyclic():
    assert kernel_calls._wrap32(5) == 5
    assert kernel_calls._wrap32(2**31) == -(2**31)
    assert kernel_calls._wrap32(2**32 + 7) == 7


# --------------------------------------------------------------------------------------------------- GPU parts
def _reference(a, b, bias):
    ref = a.double() @ b.double()
    if bias is not None:
        ref += bias.double()
    return ref


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _operands(m, n, k, dtype, b_layout, with_bias, gen):
    a = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    if b_layout == "nk":
        b = torch.randn(n, k, generator=gen, device="cuda").to(dtype).t()  # a Linear weight's view
    else:
        b = torch.randn(k, n, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype) if with_bias else None
    return a, b, bias


SHAPES = [(512, 1024, 256), (1000, 776, 328), (129, 264, 64), (2048, 2056, 1024), (64, 4096, 8)]


@GPU
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_config_matches_torch(shape):
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    m, n, k = shape
    for info in kernels.configs():
        for dtype_name, b_layout in info.variants:
            dtype = getattr(torch, dtype_name)
            for with_bias in (False, True):
                a, b, bias = _operands(m, n, k, dtype, b_layout, with_bias, gen)
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                kernel_calls.signal_gemm(a, b, bias, out, config=info.name)
                ref = _reference(a, b, bias)
                assert not out.isnan().any(), f"{info.name} {dtype_name} {b_layout}: unwritten output"
                err = _rel_err(out, ref)
                assert err < 1e-2, f"{info.name} {dtype_name} {b_layout} bias={with_bias}: rel err {err}"
                torch_err = _rel_err(torch.addmm(bias, a, b) if with_bias else a @ b, ref)
                assert err < 2 * torch_err + 1e-3, f"{info.name}: {err} vs torch {torch_err}"


@GPU
def test_every_addc_config_matches_the_reference():
    """The ``_addc`` GEMMs alone (the peer route's GEMM 2, the ring's steps), in every compiled dtype and B layout:
    ``round(a @ b + bias) + c``, rounded once, on ragged shapes and ring pieces of 256 and 512 x 8192 at the swizzle
    the ring picks for them (``kernels.unpadded_swizzle``) and at 4; without C they refuse."""
    infos = kernels.configs(add_c=1)
    assert infos, "the library has no _addc configuration"
    for info in infos:
        for dtype_name, b_layout in info.variants:
            dtype = getattr(torch, dtype_name)
            for (m, n, k), swizzle in (((1000, 776, 328), 4), ((256, 4096, 1024), 2), ((40, 264, 64), 1),
                                       ((256, 8192, 512), None), ((512, 8192, 256), None), ((512, 8192, 256), 4)):
                if swizzle is None:
                    swizzle = kernels.unpadded_swizzle(m, n, info.tile_m, info.tile_n, info.cluster_m,
                                                       info.cluster_n, kernels.DEFAULT_SWIZZLE)
                gen = torch.Generator(device="cuda").manual_seed(m + n + k + swizzle)
                a, b, bias = _operands(m, n, k, dtype, b_layout, True, gen)
                # C as large as a @ b (entries ~ sqrt(k)): a lost or misplaced addend shows in the error
                c = (torch.randn(m, n, generator=gen, device="cuda") * k ** 0.5).to(dtype)
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                kernel_calls.signal_gemm(a, b, bias, out, config=info.name, addend=c, swizzle=swizzle)
                ref = _reference(a, b, bias).to(dtype).double() + c.double()
                err = _rel_err(out, ref)
                what = f"{info.name} {dtype_name} {b_layout} {m}x{n}x{k} swizzle {swizzle}"
                assert torch.isfinite(out).all() and err < 5e-3, f"{what}: rel err {err:.3g}"
                with pytest.raises(kernels.KernelLibraryError):  # an _addc configuration needs its C operand
                    kernel_calls.signal_gemm(a, b, bias, out, config=info.name)


@GPU
def test_strided_a_and_out_views():
    gen = torch.Generator(device="cuda").manual_seed(7)
    big = torch.randn(700, 1040, generator=gen, device="cuda").bfloat16()
    a = big[:, 8:520]  # row stride 1040, 16-byte aligned offset
    w = torch.randn(384, 512, generator=gen, device="cuda").bfloat16()
    out_big = torch.full((700, 400), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = out_big[:, :384]
    kernel_calls.signal_gemm(a, w.t(), None, out)
    assert _rel_err(out, _reference(a, w.t(), None)) < 1e-2
    assert out_big[:, 384:].isnan().all()
    at = torch.randn(512, 700, generator=gen, device="cuda").bfloat16().t()  # column-major A: copied
    assert _rel_err(kernel_calls.signal_gemm(at, w.t()), _reference(at, w.t(), None)) < 1e-2


@GPU
@pytest.mark.parametrize("mode", ["deferred", "immediate"])
def test_counters_end_at_group_sizes(mode):
    gen = torch.Generator(device="cuda").manual_seed(11)
    for info in kernels.configs():
        for m, n, k, groups, sms, swz in ((1000, 1032, 256, 3, 0, 1), (4096, 2048, 512, 5, 116, 4),
                                          (300, 264, 64, 1, 124, 2)):
            p = plan.uniform_plan(m, n, info.tile_m, info.tile_n, groups)
            gmap = plan.group_of_tile_row(p.row_bounds, info.tile_m)
            expect = plan.tiles_per_group(p.row_bounds, info.tile_m, info.tile_n, n)
            a, b, _ = _operands(m, n, k, torch.bfloat16, "nk", False, gen)
            counters = torch.zeros(len(expect), dtype=torch.int32, device="cuda")
            for rep in range(1, 3):
                out = kernel_calls.signal_gemm(a, b, config=info.name, counters=counters, group_of_tile_row=gmap,
                                          sm_count=sms, swizzle=swz, signal_mode=mode)
                torch.cuda.synchronize()
                assert counters.tolist() == [rep * e for e in expect], f"{info.name} {m}x{n}x{k} rep {rep}"
            assert _rel_err(out, _reference(a, b, None)) < 1e-2
            # identity map: one counter per tile-row
            per_row = torch.zeros(math.ceil(m / info.tile_m), dtype=torch.int32, device="cuda")
            kernel_calls.signal_gemm(a, b, config=info.name, counters=per_row, signal_mode=mode, raster="along_m")
            torch.cuda.synchronize()
            assert per_row.tolist() == [math.ceil(n / info.tile_n)] * per_row.numel()


TEST_LIB_ENV = "FLASHOVERLAP_TEST_LIB"


@functools.cache
def _test_lib_at(path: str, device: int) -> ctypes.CDLL:
    c_int, c_i64, c_p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib = ctypes.CDLL(path)
    for name, res, args in (("fo_test_abi_version", c_int, []), ("fo_test_last_error", ctypes.c_char_p, []),
                            ("fo_test_preload", c_int, []),
                            ("fo_test_delayed_add", c_int, [c_p, c_int, c_i64, c_p, c_p]),
                            ("fo_test_stamp", c_int, [c_p, c_p])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    assert lib.fo_test_abi_version() == 1, f"{path}: unexpected test ABI {lib.fo_test_abi_version()}"
    with torch.cuda.device(device):
        _test_check(lib, lib.fo_test_preload(), "fo_test_preload")
    return lib


def _test_lib() -> ctypes.CDLL:
    """The test helper library (``fo_test_*``) with its kernels loaded on the current device; skips the test when
    it is not built. Call it before queueing any wait: loading a kernel lazily behind a spinning wait deadlocks."""
    path = os.environ.get(TEST_LIB_ENV) or str(kernels.library_path().with_name(build.TEST_LIB_NAME))
    if not os.path.isfile(path):
        pytest.skip(f"needs the test helper library {path} (python -m flashoverlap_inductor.build builds it)")
    return _test_lib_at(path, torch.cuda.current_device())


def _test_check(lib, rc, what):
    if rc != 0:
        raise kernels.KernelLibraryError(f"{what} failed (code {rc}): {lib.fo_test_last_error().decode()}")


def _stamp(lib, buf, i, stream):
    _test_check(lib, lib.fo_test_stamp(buf.data_ptr() + 8 * i, stream.cuda_stream), "fo_test_stamp")


def _cache_stats() -> tuple[int, int]:
    return kernels.gemm_cache_stats()


@GPU
def test_library_exports_no_test_functions():
    """The library under test is current: no ``fo_test_*`` (those are in the test library), the launch cache's
    counters."""
    lib = ctypes.CDLL(str(kernels.library_path()))
    assert not hasattr(lib, "fo_test_stamp") and not hasattr(lib, "fo_test_delayed_add")
    assert hasattr(lib, "fo_gemm_cache_stats")


@GPU
@pytest.mark.parametrize("cached", [True, False])
def test_launch_cache_hits_and_never_serves_stale_parameters(cached):
    """A repeated launch takes its kernel parameters from the library's launch cache and computes with the tensors'
    current values; launches that differ in a pointer or a setting get their own parameters, also after more
    distinct launches of one configuration than the cache keeps (256), on another stream, and in reverse order."""
    was = kernels.gemm_cache_enable(cached)
    try:
        _launch_cache_case(cached)
    finally:
        kernels.gemm_cache_enable(was)


def _launch_cache_case(cached: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(13)
    m, n, k, pieces = 256, 512, 128, 300
    a, b, bias = _operands(m, n, k, torch.bfloat16, "nk", True, gen)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    kernel_calls.signal_gemm(a, b, bias, out)
    h0, m0 = _cache_stats()
    for _ in range(3):  # same pointers, new values
        a.copy_(torch.randn(m, k, generator=gen, device="cuda").bfloat16())
        out.fill_(float("nan"))
        kernel_calls.signal_gemm(a, b, bias, out)
        assert _rel_err(out, _reference(a, b, bias)) < 1e-2
    h1, m1 = _cache_stats()
    assert (h1 - h0, m1 - m0) == ((3, 0) if cached else (0, 3))
    kernel_calls.signal_gemm(a, b, bias, out)
    first = out.clone()
    # every piece its own D pointer and a swizzle / raster / SM count of its own (the values never depend on those)
    settings = [(swz, raster, sms) for sms in (0, 100, 132) for raster in ("along_n", "along_m")
                for swz in (1, 2, 4, 8)]
    side = torch.cuda.Stream()
    for order in (range(pieces), reversed(range(pieces))):
        big = torch.full((pieces * m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        for i in order:
            swz, raster, sms = settings[i % len(settings)]
            with torch.cuda.stream(side if i % 3 == 0 else torch.cuda.current_stream()):
                kernel_calls.signal_gemm(a, b, bias if i % 2 else None, big[i * m:(i + 1) * m], swizzle=swz,
                                         raster=raster, sm_count=sms)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        no_bias = kernel_calls.signal_gemm(a, b)
        for i in range(pieces):
            piece = big[i * m:(i + 1) * m]
            assert torch.equal(piece, first if i % 2 else no_bias), f"piece {i}: stale or missing launch"
    h2, m2 = _cache_stats()
    assert h2 + m2 - h1 - m1 == 2 * pieces + 3


@GPU
@pytest.mark.parametrize("mode", ["deferred", "immediate"])
def test_groups_release_in_order_with_complete_rows(mode):
    """A side stream waits for each group, then snapshots its rows: every snapshot must equal the final output
    (the rows were in memory when the counter said so), and the releases come in group order, before the end."""
    tl = _test_lib()
    m, n, k, groups = 8192, 4096, 2048, 8
    info = kernels.config_info(kernels.DEFAULT_CONFIG)
    p = plan.uniform_plan(m, n, info.tile_m, info.tile_n, groups)
    gmap = plan.group_of_tile_row(p.row_bounds, info.tile_m)
    tiles = plan.tiles_per_group(p.row_bounds, info.tile_m, info.tile_n, n)
    gen = torch.Generator(device="cuda").manual_seed(3)
    a, b, _ = _operands(m, n, k, torch.bfloat16, "nk", False, gen)
    counters = torch.zeros(groups, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    for epoch in range(1, 3):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        snap = torch.empty_like(out)
        stamps = torch.zeros(groups + 1, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        main = torch.cuda.current_stream()
        with torch.cuda.stream(side):
            for g in range(groups):
                kernel_calls.wait_group(counters, g, epoch * tiles[g], stream=side, timeout_ms=5000)
                lo, hi = p.row_bounds[g], p.row_bounds[g + 1]
                snap[lo:hi].copy_(out[lo:hi])
                _stamp(tl, stamps, g, side)
        kernel_calls.signal_gemm(a, b, out=out, counters=counters, group_of_tile_row=gmap, sm_count=120,
                            signal_mode=mode)
        _stamp(tl, stamps, groups, main)
        torch.cuda.synchronize()
        kernel_calls.raise_if_timed_out()
        assert torch.equal(snap, out), f"epoch {epoch}: a group was released before its rows were written"
        t = stamps.tolist()
        assert t[:groups] == sorted(t[:groups])
        assert t[0] < t[groups], "group 0 was released only after the GEMM ended"


@GPU
@pytest.mark.parametrize("grid", ["persistent", "tiles"])
def test_tile_row_order_scatters_groups_and_releases_them_complete(grid):
    """reduce_scatter's "schedule" route: 4 chunks, each group a piece of every chunk (not contiguous). With the
    scheduler's tile-row order every group is released before the GEMM ends, in order, with all its rows written;
    every configuration gives the same values as torch, and the counters end at the map's tile counts."""
    tl = _test_lib()
    world, m, n, k, groups = 4, 8192, 4096, 2048, 4
    gen = torch.Generator(device="cuda").manual_seed(5)
    a, b, _ = _operands(m, n, k, torch.bfloat16, "nk", False, gen)
    ref = _reference(a, b, None)
    for info in kernels.configs():
        p = plan.uniform_plan(m, n, info.tile_m, info.tile_n, groups, align=world)
        layout = plan.buffer_layout(p, plan.chunks_for("reduce_scatter", m, world))
        gmap = plan.natural_group_of_tile_row(layout, info.tile_m)
        order = plan.scheduled_tile_rows(gmap)
        assert order != sorted(order)  # the groups really are scattered
        tiles = plan.tiles_of_groups(gmap, groups, info.tile_n, n)
        rows = [[(nat, cnt) for _, nat, cnt in layout.natural_pieces(g)] for g in range(groups)]
        counters = torch.zeros(groups, dtype=torch.int32, device="cuda")
        sms = -(-m // info.tile_m) * -(-n // info.tile_n) if grid == "tiles" else 116
        side = torch.cuda.Stream()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        snap = torch.empty_like(out)
        stamps = torch.zeros(groups + 1, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for g in range(groups):
                kernel_calls.wait_group(counters, g, tiles[g], stream=side, timeout_ms=5000)
                _stamp(tl, stamps, g, side)  # the release time
                for nat, cnt in rows[g]:
                    snap[nat:nat + cnt].copy_(out[nat:nat + cnt])
        kernel_calls.signal_gemm(a, b, out=out, config=info.name, counters=counters, group_of_tile_row=gmap,
                            sm_count=sms, tile_row_order=order)
        _stamp(tl, stamps, groups, torch.cuda.current_stream())
        torch.cuda.synchronize()
        kernel_calls.raise_if_timed_out()
        assert counters.tolist() == tiles, info.name
        assert torch.equal(snap, out), f"{info.name}: a group was released before its rows were written"
        assert _rel_err(out, ref) < 1e-2, info.name
        t = stamps.tolist()
        assert t[:groups] == sorted(t[:groups]), f"{info.name}: releases {t}"
        if info.name == kernels.DEFAULT_CONFIG:  # timing: checked for the default configuration only
            assert t[0] < t[groups], f"{info.name}: group 0 released only after the GEMM ended: {t}"


@GPU
def test_wait_timeout_raises():
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")
    kernel_calls.raise_if_timed_out()
    kernel_calls.wait_group(counters, 1, 5, timeout_ms=20)
    torch.cuda.synchronize()
    with pytest.raises(kernels.FlashOverlapTimeout, match="group 1 timed out: counter at 0, target 5"):
        kernel_calls.raise_if_timed_out()
    kernel_calls.raise_if_timed_out()  # cleared
    expected = torch.zeros(2, dtype=torch.int32, device="cuda")
    kernel_calls.wait_group_epoch(counters, expected, 0, 3, timeout_ms=20)
    torch.cuda.synchronize()
    with pytest.raises(kernels.FlashOverlapTimeout):
        kernel_calls.raise_if_timed_out()
    assert expected.tolist() == [3, 0]  # the epoch advanced anyway


@GPU
def test_epoch_waits_survive_graph_replay():
    m, n, k = 1024, 1024, 256
    info = kernels.config_info(kernels.DEFAULT_CONFIG)
    p = plan.uniform_plan(m, n, info.tile_m, info.tile_n, 4)
    gmap = plan.group_of_tile_row(p.row_bounds, info.tile_m)
    tiles = plan.tiles_per_group(p.row_bounds, info.tile_m, info.tile_n, n)
    gen = torch.Generator(device="cuda").manual_seed(5)
    a, b, _ = _operands(m, n, k, torch.bfloat16, "nk", False, gen)
    counters = torch.zeros(len(tiles), dtype=torch.int32, device="cuda")
    expected = torch.zeros_like(counters)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    kernel_calls.signal_gemm(a, b, out=out, counters=counters, group_of_tile_row=gmap)  # warm-up (loads, attributes)
    for g, t in enumerate(tiles):
        kernel_calls.wait_group_epoch(counters, expected, g, t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        kernel_calls.signal_gemm(a, b, out=out, counters=counters, group_of_tile_row=gmap, sm_count=124)
        with torch.cuda.stream(side):
            for g, t in enumerate(tiles):
                kernel_calls.wait_group_epoch(counters, expected, g, t, stream=side, timeout_ms=5000)
        main.wait_stream(side)
    for _ in range(3):
        a.copy_(torch.randn(m, k, generator=gen, device="cuda").bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        kernel_calls.raise_if_timed_out()
        assert _rel_err(out, _reference(a, b, None)) < 1e-2
    assert counters.tolist() == [4 * t for t in tiles]  # 1 eager + 3 replays (capture does not run)
    assert expected.tolist() == counters.tolist()


@GPU
def test_stream_wait_value_releases_after_the_add():
    tl = _test_lib()  # loaded before the unbounded wait is queued
    counters = torch.zeros(1, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(2, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    kernel_calls.stream_wait_value(counters, 0, 3, stream=side)
    _stamp(tl, stamps, 1, side)
    _test_check(tl, tl.fo_test_delayed_add(counters.data_ptr(), 3, 200_000, stamps.data_ptr(), main.cuda_stream),
                "fo_test_delayed_add")
    torch.cuda.synchronize()
    set_at, released_at = stamps.tolist()
    assert released_at >= set_at
