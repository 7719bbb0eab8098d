"""Packaging for flashoverlap-inductor.

Layout (DEVELOPERS.md): the importable package ``flashoverlap_inductor/`` plus two top-level source folders,
``passes/`` and ``cost_model/``, installed as ``flashoverlap_inductor.passes`` and
``flashoverlap_inductor.cost_model``. ``configs/`` ships as package data.

The CUDA library (``build/libflashoverlap_sm90.so``) is built by ``python -m flashoverlap_inductor.build``. Setup
runs that build too when ``FLASHOVERLAP_BUILD_CUDA=1`` (it then needs nvcc; without nvcc the build says so and
skips). It is opt-in because a full build of every kernel configuration takes 20-30 minutes on 2 cores, which
a plain ``pip install -e .`` for the CPU demo or tests should not pay.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithCuda(build_py):
    """``build_py`` that also builds the CUDA library when ``FLASHOVERLAP_BUILD_CUDA=1``."""

    def run(self) -> None:
        if os.environ.get("FLASHOVERLAP_BUILD_CUDA", "0") == "1":
            path = Path(__file__).resolve().parent / "flashoverlap_inductor" / "build.py"
            spec = importlib.util.spec_from_file_location("_flashoverlap_build", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            if module.main([]) != 0:
                raise SystemExit("flashoverlap: CUDA library build failed")
        super().run()


setup(
    name="flashoverlap-inductor",
    version="0.1.0",
    description="torch.compile backend that overlaps tensor-parallel GEMMs with their NCCL collectives",
    python_requires=">=3.10",
    packages=[
        "flashoverlap_inductor",
        "flashoverlap_inductor.passes",
        "flashoverlap_inductor.cost_model",
        "flashoverlap_inductor.configs",
    ],
    package_dir={
        "flashoverlap_inductor": "flashoverlap_inductor",
        "flashoverlap_inductor.passes": "passes",
        "flashoverlap_inductor.cost_model": "cost_model",
        "flashoverlap_inductor.configs": "configs",
    },
    package_data={"flashoverlap_inductor.configs": ["*.json", "plans/*.json"]},
    install_requires=["torch>=2.11"],
    extras_require={"test": ["pytest", "expecttest", "ruff"], "demo": ["transformers"]},
    cmdclass={"build_py": BuildPyWithCuda},
    entry_points={"torch_dynamo_backends": ["flashoverlap = flashoverlap_inductor.backend:flashoverlap_backend"]},
)
