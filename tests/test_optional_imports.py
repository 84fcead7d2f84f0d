"""alpa_like and its SPMD methods run with only jax, flax, optax, numpy and scipy installed; a feature whose
package is missing says which package it needs."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import alpa_like as al
from alpa_like.compiler import ilp
from tests.helpers import mlp_state

OPTIONAL = ("ray", "pulp", "orbax", "tensorstore", "tqdm", "matplotlib", "hypothesis")
"""Packages alpa_like's core must not need (PuLP: the "cbc" solver; orbax: checkpoints; ...)."""

REPO = Path(__file__).resolve().parent.parent


def block(monkeypatch, package: str) -> None:
    """Makes ``package`` and its loaded submodules unimportable for the rest of the test."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


def test_spmd_methods_run_without_the_optional_packages():
    code = textwrap.dedent(f"""
        import sys
        for name in {OPTIONAL!r}:
            sys.modules[name] = None
        sys.path.insert(0, {str(REPO)!r})
        import numpy as np, optax
        import alpa_like as al
        from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state
        step = make_train_step(mlp_loss)
        for method in (al.DataParallel(), al.ShardParallel()):
            state, metrics = al.parallelize(step, method=method)(mlp_state(tx=optax.sgd(0.1)),
                                                                 mlp_batch(np.random.default_rng(0)))
            print(type(method).__name__, float(metrics["loss"]))
        print(sorted(n for n in {OPTIONAL!r} if sys.modules.get(n) is not None))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["DataParallel", "ShardParallel"]
    assert lines[2] == "[]"


def test_the_cbc_solver_without_pulp_names_the_package(monkeypatch):
    block(monkeypatch, "pulp")
    with pytest.raises(ImportError, match=r"solver='cbc' needs the 'pulp' package.*pip install pulp"):
        ilp.cbc_path()


def test_a_checkpoint_without_orbax_names_the_package(monkeypatch, tmp_path):
    block(monkeypatch, "orbax")
    state = mlp_state()
    with pytest.raises(ImportError, match=r"al.save_checkpoint.*needs the 'orbax-checkpoint' package"):
        al.save_checkpoint(tmp_path / "ckpt", state, 0)


def test_the_ray_backend_without_ray_names_the_package(monkeypatch):
    block(monkeypatch, "ray")
    try:
        with pytest.raises(ImportError, match=r"al.init\(cluster='ray'\) needs the 'ray' package"):
            al.init("ray")
    finally:
        al.shutdown()
