"""Packages only some features need, imported when a feature is used.

``import alpa_like`` and every SPMD method need only jax, flax, optax, numpy and scipy. Ray (the ``"ray"``
backend), PuLP (the ``"cbc"`` ILP solver), orbax-checkpoint (checkpoints), matplotlib (plots) and tqdm (the
benchmark CLI's progress bars) are imported by the feature that uses them, through :func:`require`.
"""
from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, feature: str, *, package: str | None = None) -> ModuleType:
    """Imports and returns ``module``, which ``feature`` needs.

    Args:
      module: the dotted module name, e.g. ``"orbax.checkpoint"``.
      feature: what needs it, as the user names it, e.g. ``"al.save_checkpoint"``.
      package: the pip distribution that provides it (default: the module's top-level name).

    Raises:
      ImportError: the module cannot be imported; the message names the feature and the package to install.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = package or module.split(".")[0]
        raise ImportError(f"{feature} needs the {package!r} package, which is not installed "
                          f"(pip install {package}); the rest of alpa_like works without it") from e
