"""alpa-like: a JAX auto-parallelizing compiler (Alpa's passes, TeraPipe slicing, Megatron schedules)."""
from setuptools import setup

setup(
    name="alpa-like",
    version="0.1.0",
    description="Auto-parallelize JAX training steps: pipeline stages, ILP shardings, MPMD runtime.",
    python_requires=">=3.11,<3.13",
    packages=[
        "alpa_like",
        "alpa_like.bench",
        "alpa_like.models",
        "alpa_like.compiler",
        "alpa_like.runtime",
    ],
    package_dir={
        "alpa_like": "alpa_like",
        "alpa_like.compiler": "compiler",
        "alpa_like.runtime": "runtime",
    },
    install_requires=[
        "jax[cpu]>=0.10.2,<0.11",
        "jaxlib>=0.10.2,<0.11",
        "flax>=0.12,<0.13",
        "optax>=0.2.4,<0.3",
        "pulp>=3.0,<4",
        "numpy>=1.26,<3",
        "scipy>=1.11,<2",  # the intra-op ILP's default solver (HiGHS) and the GPU cost model's fit
        "ray>=2.59,<3",  # token authentication on for a new local cluster (docs/ray.md)
        "flatbuffers>=24",  # jax.export serialisation (the Ray backend ships stage programs with it)
        "rich>=13,<16",
        "tqdm>=4.66,<5",
        "matplotlib>=3.8,<4",
        "orbax-checkpoint>=0.11,<0.13",
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-timeout>=2.3,<3",
            "pytest-xdist>=3.5,<4",
            "hypothesis>=6.100,<7",
            "import-linter>=2.1,<3",  # the layers contract in .importlinter (tests/test_layers.py)
            "filelock>=3",  # JAX's compilation cache shared by the test workers locks its files with it
            "psutil>=5",  # the Ray loopback test lists the listening sockets of Ray's processes
            "transformers>=4.50,<5",  # Hugging Face Flax models in tests (its version 5 has no Flax models)
        ],
    },
)
