"""Build ``build/libflashoverlap_sm90.so``: the sm90 signal-GEMM configurations, the wait kernel and the C ABI.

Usage::

    python -m flashoverlap_inductor.build [--require] [-j N] [--configs GLOB ...] [--variants all|bf16_nk]
                                          [--smoke] [--keep-going] [--copy-cutlass DIR] [--list]

It finds nvcc (``$NVCC``, ``PATH``, ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``, the pip ``nvidia/cu13/bin``) and
the CUTLASS headers (``$CUTLASS_DIR``, ``build/cutlass`` -- a copy made by ``--copy-cutlass`` that travels to a
GPU machine --, then the ``nvidia-cutlass`` wheel's ``cutlass_library/source``). Without nvcc it prints a message
and exits 0 (1 with ``--require``). Every (configuration, dtype, B layout) is one translation unit of
``csrc/gemm_sm90.cu``, and each of ``HOST_UNITS`` one more; units compile in parallel and are rebuilt only when
their command, their source or a ``csrc`` header they include changed. The library links cudart statically and
exports only the ``fo_*`` C functions, so it loads under any Python (ctypes) next to any torch. Each finished
unit prints one line, ``[k/N] built <unit> (elapsed, ETA)`` (ETA: mean compile time x units left / jobs).

Next to it, always, ``libflashoverlap_sm90_test.so`` from ``TEST_UNITS`` (``csrc/test_api.cu``: the helper kernels
the GPU tests and benchmarks use, ``fo_test_*``; no GEMM, no CUTLASS), so the shipped library exports no test
function.

``CONFIGS`` below is the one list of kernel configurations; the library reports them at run time
(``flashoverlap_inductor.native.kernels.configs()``).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

try:
    from flashoverlap_inductor.tools import cli_util as cli
except ImportError:  # loaded by its file path (setup.py, package not importable): load its sibling the same way
    _spec = importlib.util.spec_from_file_location("_flashoverlap_cli_util",
                                                   Path(__file__).parent / "tools" / "cli_util.py")
    cli = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(cli)

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
BUILD = ROOT / "build"
LIB_NAME = "libflashoverlap_sm90.so"
TEST_LIB_NAME = "libflashoverlap_sm90_test.so"
# The host-side translation units (csrc/<name>.cu), each compiled once; the GEMM units come from CONFIGS.
HOST_UNITS = ("api", "fused_call", "peer_call", "ring_call", "gather_call", "gather_gemms", "scatter_run", "moe_plan",
              "grouped_gemm", "moe_dispatch_cut", "moe_combine_blocks")
# The units of the test library (TEST_LIB_NAME), linked on their own.
TEST_UNITS = ("test_api",)


@dataclass(frozen=True)
class KernelConfig:
    """One CUTLASS sm90 configuration. ``schedule``: "coop" (two consumer warpgroups share a tile) or "pp"
    (ping-pong: each consumer warpgroup owns a tile). ``stages`` 0 = as many as fit; ``epi`` (0, 0) = CUTLASS's
    epilogue subtile. ``variants``: "all" = bf16/fp16 x B [N,K]/[K,N]; "bf16" = bf16 x both B layouts; "bf16_nk" =
    tuning candidate only.
    ``add_c``: the epilogue adds a C operand (the peer route's second GEMM; name suffix ``_addc``), 2 / 3: and
    stores its result again to an aux tensor (``_addc_aux`` by TMA, ``_addc_auxr`` from registers)."""

    schedule: str
    tile: tuple[int, int, int]
    cluster: tuple[int, int]
    stages: int = 0
    epi: tuple[int, int] = (0, 0)
    variants: str = "all"
    add_c: int = 0  # 1: adds C; 2 / 3: and stores D again to an aux tensor (2: by TMA, 3: from registers)

    @property
    def name(self) -> str:
        s = f"{self.schedule}_{self.tile[0]}x{self.tile[1]}x{self.tile[2]}_c{self.cluster[0]}x{self.cluster[1]}"
        if self.stages:
            s += f"_s{self.stages}"
        if self.epi != (0, 0):
            s += f"_e{self.epi[0]}x{self.epi[1]}"
        if self.add_c:
            s += ("", "_addc", "_addc_aux", "_addc_auxr")[self.add_c]
        return s


CONFIGS: tuple[KernelConfig, ...] = (
    # Shipped (every dtype x B layout). Chosen on the H200 bench grid (docs/results.md): the first is the default.
    KernelConfig("coop", (128, 256, 64), (2, 1), epi=(128, 64)),
    KernelConfig("coop", (256, 128, 64), (1, 1)),
    KernelConfig("coop", (128, 128, 64), (2, 1)),
    KernelConfig("pp", (128, 128, 64), (1, 1)),
    # Tuning candidates that won a shape or came close (bf16, B [N,K] only).
    KernelConfig("coop", (128, 256, 64), (1, 2), epi=(128, 64), variants="bf16_nk"),
    KernelConfig("coop", (256, 128, 64), (2, 1), epi=(128, 64), variants="bf16_nk"),
    KernelConfig("pp", (64, 256, 64), (1, 1), variants="bf16_nk"),
    # The peer route's second GEMM (adds the peer's partial as C). A 128x32 epilogue subtile keeps the C + D
    # epilogue buffers at the plain configuration's 32 KB of shared memory (four mainloop stages); 128x64 needs
    # 64 KB (three stages).
    KernelConfig("coop", (128, 256, 64), (2, 1), epi=(128, 32), variants="bf16_nk", add_c=1),
    KernelConfig("coop", (128, 256, 64), (2, 1), epi=(128, 64), variants="bf16", add_c=1),
    # The ring route's steps where 128x256 tiles fill less than one wave (cost_model.ring.step_tile): at 256 rows by
    # 8192 columns they leave half the SMs idle; 128x128 fill them.
    KernelConfig("coop", (128, 128, 64), (2, 1), variants="bf16", add_c=1),
    # all_reduce by push: D stored twice (out, and the peer's landing buffer). By TMA the aux tile needs 16 KB more
    # shared memory at 128x32 (three mainloop stages); from registers none.
    KernelConfig("coop", (128, 256, 64), (2, 1), epi=(128, 32), variants="bf16", add_c=2),
    KernelConfig("coop", (128, 256, 64), (2, 1), epi=(128, 64), variants="bf16_nk", add_c=3),
)
# Measured and dropped (docs/results.md): coop 128x128 c1x1, 128x256 c1x1/c1x2/c2x1 (default epilogue tile),
# 256x128 c1x2/c2x1, pp 128x128 c1x2/c2x1, pp 64x256 c1x2/c2x1.

DTYPES = {"bf16": 0, "fp16": 1}
B_LAYOUTS = {"nk": 0, "kn": 1}
SCHEDULES = {"coop": 0, "pp": 1}


@dataclass(frozen=True)
class Unit:
    """One translation unit: a configuration in one dtype and B layout."""

    config: KernelConfig
    dtype: str
    b_layout: str

    @property
    def stem(self) -> str:
        return f"gemm_{self.config.name}_{self.dtype}_{self.b_layout}"

    def defines(self) -> list[str]:
        c = self.config
        d = {
            "FO_NAME": f'"{c.name}"',
            "FO_SCHED": SCHEDULES[c.schedule],
            "FO_TM": c.tile[0],
            "FO_TN": c.tile[1],
            "FO_TK": c.tile[2],
            "FO_CM": c.cluster[0],
            "FO_CN": c.cluster[1],
            "FO_STAGES": c.stages,
            "FO_EPI_M": c.epi[0],
            "FO_EPI_N": c.epi[1],
            "FO_DTYPE": DTYPES[self.dtype],
            "FO_BLAYOUT": B_LAYOUTS[self.b_layout],
            "FO_ADD_C": int(c.add_c),
        }
        return [f"-D{k}={v}" for k, v in d.items()]


def smoke_units() -> list[Unit]:
    """Two units that cover both schedules, both dtypes and both B layouts: a quick compile check (CI)."""
    coop = next(c for c in CONFIGS if c.schedule == "coop" and c.variants == "all")
    pp = next(c for c in CONFIGS if c.schedule == "pp" and c.variants == "all")
    return [Unit(coop, "bf16", "nk"), Unit(pp, "fp16", "kn")]


def units(patterns: list[str] | None = None, variants: str = "all") -> list[Unit]:
    """Translation units for configurations matching ``patterns`` (fnmatch globs on the name; None = all).
    ``variants="bf16_nk"`` builds only bf16 with B [N,K] (the tuning grid)."""
    out = []
    for c in CONFIGS:
        if patterns and not any(fnmatch.fnmatch(c.name, p) for p in patterns):
            continue
        full = c.variants == "all" and variants == "all"
        layouts = B_LAYOUTS if full or (c.variants == "bf16" and variants == "all") else ("nk",)
        for dt in DTYPES if full else ("bf16",):
            for bl in layouts:
                out.append(Unit(c, dt, bl))
    return out


def find_nvcc() -> str | None:
    cands = [os.environ.get("NVCC"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands.append(os.path.join(home, "bin", "nvcc"))
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cands.append(os.path.join(loc, "cu13", "bin", "nvcc"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


CUTLASS_WHEEL = "nvidia-cutlass==4.2.0.0"
FETCHED_CUTLASS = BUILD / "_deps" / "cutlass"


def fetch_cutlass(dst: Path = FETCHED_CUTLASS) -> Path:
    """Download the ``nvidia-cutlass`` wheel (no dependencies), unpack its C++ headers into ``dst``; returns it."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        CUTLASS_WHEEL, "-d", tmp], check=True)
        return unpack_cutlass_headers(next(Path(tmp).glob("nvidia_cutlass-*.whl")), dst)


class UnsafeArchiveError(RuntimeError):
    """An archive member that could be written outside the destination folder (nothing was unpacked)."""


def unpack_cutlass_headers(wheel: Path, dst: Path) -> Path:
    """Unpack ``cutlass_library/source/{include,tools/util/include}/`` of an ``nvidia-cutlass`` wheel into ``dst``.
    Every member is checked before anything is written: an absolute name, a ``..`` part, a symbolic link, or a
    target outside ``dst`` once resolved (e.g. through a link already in ``dst``) raises ``UnsafeArchiveError``."""
    prefix, root = "cutlass_library/source/", dst.resolve()
    todo = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name) or ".." in re.split(r"[/\\]", name):
                raise UnsafeArchiveError(f"{wheel.name}: member {name!r} has an absolute path or a '..' part")
            if stat.S_ISLNK(info.external_attr >> 16):
                raise UnsafeArchiveError(f"{wheel.name}: member {name!r} is a symbolic link")
            rel = name[len(prefix):] if name.startswith(prefix) else ""
            if rel.startswith(("include/", "tools/util/include/")) and not info.is_dir():
                target = dst / rel
                if not target.resolve().is_relative_to(root):
                    raise UnsafeArchiveError(f"{wheel.name}: member {name!r} would be written outside {dst}")
                todo.append((info, target))
        for info, target in todo:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(info))
    return dst


def find_cutlass() -> Path | None:
    """A folder holding ``include/cutlass`` and ``tools/util/include``."""
    cands = [os.environ.get("CUTLASS_DIR"), str(BUILD / "cutlass"), str(FETCHED_CUTLASS)]
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.origin:
        cands.append(os.path.join(os.path.dirname(spec.origin), "source"))
    for c in cands:
        if c and (Path(c) / "include" / "cutlass" / "cutlass.h").is_file():
            return Path(c)
    return None


def copy_cutlass(src: Path, dst: Path) -> None:
    """Copy only the headers the build needs (about 28 MB), e.g. to carry them to a GPU machine."""
    for sub in ("include", "tools/util/include"):
        shutil.copytree(src / sub, dst / sub, dirs_exist_ok=True)


def _cuda_lib_dirs(nvcc: str) -> list[str]:
    home = Path(nvcc).resolve().parent.parent
    return [str(p) for p in (home / "lib64", home / "lib") if p.is_dir()]


def _local_includes(name: str) -> list[str]:
    """``name`` and every ``csrc`` file it includes with ``#include "..."``, transitively, sorted."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        cur = todo.pop()
        if cur in seen or not (CSRC / cur).is_file():
            continue
        seen.add(cur)
        todo += re.findall(r'^\s*#\s*include\s+"([^"]+)"', (CSRC / cur).read_text(), flags=re.M)
    return sorted(seen)


def _sources_digest(unit: str) -> str:
    """Digest of the sources translation unit ``unit`` (a ``csrc`` file name) is built from: itself and the
    ``csrc`` headers it includes, transitively (so changing the C ABI header does not rebuild the GEMM units)."""
    h = hashlib.sha256()
    for name in _local_includes(unit):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:16]


def _compile(cmd: list[str], obj: Path, digest: str) -> tuple[Path, bool, str, float]:
    """Compile unless ``obj`` was built by the same command from the same sources: (obj, compiled, error, seconds)."""
    stamp, start = obj.with_suffix(".cmd"), time.monotonic()
    key = " ".join(cmd) + "\n" + digest
    if obj.is_file() and stamp.is_file() and stamp.read_text() == key:
        return obj, False, "", 0.0
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return obj, True, f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}", time.monotonic() - start
    stamp.write_text(key)
    return obj, True, "", time.monotonic() - start


def build(patterns: list[str] | None = None, variants: str = "all", jobs: int | None = None,
          require: bool = False, out_dir: Path = BUILD, verbose: bool = True, keep_going: bool = False,
          smoke: bool = False) -> Path | None:
    """Build the library; returns its path, or None when nvcc is missing (raises with ``require``).
    ``keep_going``: link the units that compiled and report the others (for tuning sweeps)."""
    nvcc = find_nvcc()
    if nvcc is None:
        msg = "nvcc not found: skipping the CUDA library build (set NVCC or CUDA_HOME to enable it)"
        if require:
            raise RuntimeError(msg)
        print(msg)
        return None
    cutlass = find_cutlass()
    if cutlass is None:
        print(f"CUTLASS headers not found: fetching {CUTLASS_WHEEL} (headers only) into {FETCHED_CUTLASS}", flush=True)
        try:
            cutlass = fetch_cutlass()
        except (subprocess.CalledProcessError, StopIteration, OSError) as exc:
            print(f"fetching CUTLASS failed: {exc!r}", flush=True)
            cutlass = find_cutlass()
    if cutlass is None:
        raise RuntimeError("CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 (no deps needed), "
                           "or set CUTLASS_DIR to a folder with include/cutlass and tools/util/include")
    todo = smoke_units() if smoke else units(patterns, variants)
    if not todo:
        raise RuntimeError(f"no configuration matches {patterns}")
    obj_dir = out_dir / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    common = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
              "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC,-fvisibility=hidden",
              f"-I{CSRC}", f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}"]
    cmds = [(common + ["-c", str(CSRC / f"{src}.cu"), "-o", str(obj_dir / f"{src}.o")], obj_dir / f"{src}.o")
            for src in HOST_UNITS + TEST_UNITS]
    for u in todo:
        obj = obj_dir / f"{u.stem}.o"
        cmds.append((common + u.defines() + ["-c", str(CSRC / "gemm_sm90.cu"), "-o", str(obj)], obj))
    digests = {name: _sources_digest(name)
               for name in [f"{u}.cu" for u in HOST_UNITS + TEST_UNITS] + ["gemm_sm90.cu"]}
    jobs = jobs or max(1, min(len(cmds), os.cpu_count() or 1))
    if verbose:
        print(f"nvcc: {nvcc}\nCUTLASS: {cutlass}\ncompiling {len(cmds)} translation units with {jobs} jobs")
    results, unit_s, t0 = [], [], time.monotonic()
    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(_compile, c, o, digests[Path(c[c.index("-c") + 1]).name]) for c, o in cmds]
        for k, fut in enumerate(as_completed(futures), 1):  # one line per finished unit, with the ETA
            obj, rebuilt, err, secs = fut.result()
            results.append((obj, err))
            unit_s += [secs] if rebuilt else []  # a cached unit says nothing about the compile time
            if verbose:
                print(cli.progress_line(k, len(cmds), f"{'FAILED' if err else 'built' if rebuilt else 'cached'} "
                      f"{obj.name}", time.monotonic() - t0, sum(unit_s) / len(unit_s) if unit_s else None, jobs),
                      flush=True)
    results.sort(key=lambda r: [o for _, o in cmds].index(r[0]))  # the command order, as before (link order)
    test_obj_paths = {obj_dir / f"{src}.o" for src in TEST_UNITS}
    errors = [err for _, err in results if err]
    objs = [obj for obj, err in results if not err and obj not in test_obj_paths]
    test_objs = [obj for obj, err in results if not err and obj in test_obj_paths]
    if errors and (not keep_going or any(obj_dir / f"{src}.o" not in objs for src in HOST_UNITS)
                   or len(test_objs) < len(TEST_UNITS) or len(objs) <= len(HOST_UNITS)):
        raise RuntimeError("CUDA compilation failed:\n" + "\n".join(errors))
    if errors:
        print("CUDA compilation failed for some units (linking the rest):\n" + "\n".join(errors), file=sys.stderr)
    lib = out_dir / LIB_NAME
    _link(nvcc, lib, objs)
    if verbose:
        print(f"wrote {lib} ({lib.stat().st_size / 1e6:.1f} MB, {len(objs) - len(HOST_UNITS)} GEMM units)")
    test_lib = out_dir / TEST_LIB_NAME
    _link(nvcc, test_lib, test_objs)
    if verbose:
        print(f"wrote {test_lib} ({test_lib.stat().st_size / 1e6:.1f} MB, test helpers)")
    return lib


def _link(nvcc: str, lib: Path, objs: list[Path]) -> None:
    """One shared library from ``objs``: cudart static, only the default-visibility C functions exported."""
    link = [nvcc, "-shared", "-cudart", "static", "-gencode=arch=compute_90a,code=sm_90a",
            "-Xlinker", "--exclude-libs,ALL", "-o", str(lib), "-ldl"]
    link += [f"-L{d}" for d in _cuda_lib_dirs(nvcc)] + [str(o) for o in objs]
    r = subprocess.run(link, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"link failed:\n$ {' '.join(link)}\n{r.stdout}{r.stderr}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashoverlap_inductor.build", description=__doc__.split("\n")[0])
    p.add_argument("--require", action="store_true", help="fail (exit 1) when nvcc is missing (default: skip, exit 0)")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel nvcc processes (default: CPU count)")
    p.add_argument("--configs", nargs="*", default=None, metavar="GLOB", help="configuration name globs (default: all)")
    p.add_argument("--variants", choices=("all", "bf16_nk"), default="all",
                   help="bf16_nk: only bf16 with B as [N,K] for every configuration (tuning) (default: all)")
    p.add_argument("--out-dir", default=str(BUILD), metavar="DIR", help="output folder (default: build/)")
    p.add_argument("--copy-cutlass", metavar="DIR", help="copy the CUTLASS headers to DIR and exit")
    p.add_argument("--list", action="store_true", help="list the translation units and exit")
    p.add_argument("--keep-going", action="store_true", help="link the units that compiled, report the others")
    p.add_argument("--smoke", action="store_true", help="only two units covering both schedules, dtypes and "
                   "B layouts (a compile check, e.g. for CI)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.list:
        for u in smoke_units() if a.smoke else units(a.configs, a.variants):
            print(u.stem)
        return 0
    if a.copy_cutlass:
        src = find_cutlass()
        if src is None:
            print("CUTLASS headers not found", file=sys.stderr)
            return 1
        copy_cutlass(src, Path(a.copy_cutlass))
        print(f"copied CUTLASS headers from {src} to {a.copy_cutlass}")
        return 0
    try:
        lib = build(a.configs, a.variants, a.jobs, a.require, Path(a.out_dir), keep_going=a.keep_going,
                    smoke=a.smoke)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0 if lib is not None or not a.require else 1


if __name__ == "__main__":
    sys.exit(main())
