"""Packaging for flashoverlap-inductor.

Layout (DEVELOPERS.md): the importable package ``flashoverlap_inductor/`` plus two top-level source folders,
``passes/`` and ``cost_model/``, installed as ``flashoverlap_inductor.passes`` and
``flashoverlap_inductor.cost_model``. ``configs/`` ships as package data. The CUDA library is not built here:
``python -m flashoverlap_inductor.build`` builds it (it skips cleanly without nvcc).
"""

from setuptools import setup

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
    entry_points={"torch_dynamo_backends": ["flashoverlap = flashoverlap_inductor.backend:flashoverlap_backend"]},
)
