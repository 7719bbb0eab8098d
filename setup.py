"""Packaging for flashoverlap-inductor.

Layout: one importable package, ``flashoverlap_inductor/``, with its subpackages (``passes``, ``cost_model``,
``routes``, ``schedule``, ``native``, ``runtime``, ``tune``, ``tools``, ``bench``, ``demo``) and its data
(``configs/``) inside it, so an import resolves the same in an editable and a regular install.

The CUDA library (``build/libflashoverlap_sm90.so``) is built by ``python -m flashoverlap_inductor.build``. Setup
runs that build too when ``FLASHOVERLAP_BUILD_CUDA=1`` (it then needs nvcc; without nvcc the build says so and
skips). It is opt-in because a full build of every kernel configuration takes 20-30 minutes on 2 cores, which
a plain ``pip install -e .`` for the CPU demo or tests should not pay.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithCuda(build_py):
    """``build_py`` that also builds the CUDA library when ``FLASHOVERLAP_BUILD_CUDA=1``."""

    def run(self) -> None:
        if os.environ.get("FLASHOVERLAP_BUILD_CUDA", "0") == "1":
            path = Path(__file__).resolve().parent / "flashoverlap_inductor" / "build.py"
            spec = importlib.util.spec_from_file_location("_flashoverlap_build", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up there
            spec.loader.exec_module(module)
            if module.main([]) != 0:
                raise SystemExit("flashoverlap: CUDA library build failed")
        super().run()


setup(
    name="flashoverlap-inductor",
    version="0.1.0",
    description="torch.compile backend that overlaps tensor-parallel GEMMs with their NCCL collectives",
    python_requires=">=3.10",
    packages=find_packages(include=["flashoverlap_inductor", "flashoverlap_inductor.*"]),
    py_modules=["flashoverlap"],  # the logging name (TORCH_LOGS="flashoverlap"): flashoverlap.py
    package_data={"flashoverlap_inductor.configs": ["*.json", "plans/*.json"]},
    install_requires=["torch>=2.11"],
    extras_require={"test": ["pytest", "expecttest", "numpy", "ruff", "transformers"], "demo": ["transformers"]},
    cmdclass={"build_py": BuildPyWithCuda},
    entry_points={"torch_dynamo_backends": ["flashoverlap = flashoverlap_inductor.backend:flashoverlap_backend"]},
)
