"""Device meshes for plans: a jax Mesh over a given list of devices, with Auto axis types so that GSPMD
propagates shardings between the ones a plan pins."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from alpa_like.compiler.sharding_spec import ShardingSpec


def make_mesh(devices: Sequence[Any], shape: Sequence[int], axis_names: Sequence[str]) -> Mesh:
    """A Mesh of ``devices`` (row-major) reshaped to ``shape``."""
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, got {len(devices)}")
    grid = np.asarray(devices, dtype=object).reshape(tuple(shape))
    return Mesh(grid, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))


def named_sharding(mesh: Mesh, spec: ShardingSpec) -> NamedSharding:
    return NamedSharding(mesh, spec.to_partition_spec(tuple(mesh.axis_names)))


def has_layout(x: Any, sharding: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` laid out as ``sharding`` (equal, or the same layout spelled another
    way: XLA returns ``P(None,)`` for a replicated ``P()``, ``P('y',)`` for ``P('y', None)``)."""
    import jax

    if not isinstance(x, jax.Array):
        return False
    have = x.sharding
    return have == sharding or have.is_equivalent_to(sharding, x.ndim)
