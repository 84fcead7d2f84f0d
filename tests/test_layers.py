"""The floors of the house (docs/README.md): ``compiler/`` imports neither the runtimes nor the API,
``runtime/`` imports the compiler only, the API sits on top. Checked by import-linter's layers contract in
``.importlinter``.

The installed package maps ``alpa_like.compiler`` and ``alpa_like.runtime`` to the top-level ``compiler/``
and ``runtime/`` folders, where import-linter (which walks the package's folder) does not look; the test lays
the three folders out as one package in a temporary directory and lints that copy.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _package_copy(tmp_path: Path) -> Path:
    package = tmp_path / "alpa_like"
    shutil.copytree(ROOT / "alpa_like", package, ignore=shutil.ignore_patterns("__pycache__"))
    for floor in ("compiler", "runtime"):
        shutil.copytree(ROOT / floor, package / floor, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def _lint(tmp_path: Path) -> subprocess.CompletedProcess:
    importlinter = pytest.importorskip("importlinter")
    config = tmp_path / ".importlinter"
    shutil.copy(ROOT / ".importlinter", config)
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": os.pathsep.join((str(tmp_path), _site_of(importlinter))),
                               "PATH": "/usr/bin:/bin"}, timeout=300)


def _site_of(module) -> str:
    """The folder ``module``'s package was imported from (the child finds import-linter and its needs there
    wherever they are installed, e.g. a folder on PYTHONPATH)."""
    return str(Path(module.__file__).resolve().parents[1])


def test_no_floor_imports_a_floor_above_it(tmp_path):
    _package_copy(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_a_back_edge_breaks_the_contract(tmp_path):
    package = _package_copy(tmp_path)
    trace = package / "compiler" / "trace.py"
    trace.write_text(trace.read_text() + "\nfrom alpa_like import api  # a back-edge\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "alpa_like.compiler.trace -> alpa_like.api" in result.stdout
