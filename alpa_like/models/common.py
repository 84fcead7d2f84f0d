"""Helpers shared by the bundled models: parameter counting, argument checks, the loss, config lookup."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "check_positive_int",
    "check_float_dtype",
    "lookup_config",
    "num_params",
    "mean_cross_entropy",
    "variable_shapes",
]


def num_params(param_tree: Any) -> int:
    """Total number of scalars in a pytree of arrays or ``jax.ShapeDtypeStruct`` (nothing is read).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> num_params({"w": jax.ShapeDtypeStruct((3, 4), jnp.float32), "b": jnp.zeros(4)})
      16
    """
    return int(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(param_tree)))


def check_positive_int(owner: str, **values: Any) -> None:
    """Raise ValueError naming ``owner.field`` unless every value is an ``int`` >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def check_float_dtype(owner: str, dtype: Any) -> None:
    """Raise ValueError unless ``dtype`` is a floating-point dtype (float32, bfloat16, float16...)."""
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{owner}.dtype must be a floating dtype such as jnp.float32 or jnp.bfloat16, got {dtype!r}"
        )


def lookup_config(name: str, tables: Mapping[str, Mapping[str, Any]]) -> Any:
    """Return the entry ``name`` of the first table holding it; the error lists every valid name.

    Args:
      name: a config name such as ``"gpt-1.3b"``.
      tables: table title -> {name: config}; titles only appear in the error message.
    """
    for table in tables.values():
        if name in table:
            return table[name]
    valid = ", ".join(f"{title}: {sorted(table)}" for title, table in tables.items())
    raise ValueError(f"unknown config name {name!r}; valid names are {valid}")


def mean_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross entropy over every label position, computed in float32.

    The mean is over all ``batch * seq`` positions, so the mean of the losses of equal-sized
    micro-batches equals the loss of the full batch.

    Args:
      logits: ``[..., vocab]`` (any float dtype).
      labels: int ``[...]`` matching the leading dims of ``logits``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape must equal logits shape without the last dim, {logits.shape[:-1]}, "
            f"got {labels.shape}"
        )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.mean(losses)


def variable_shapes(model: Any, *example_args: Any, **static_kwargs: Any) -> Any:
    """Every variable collection of ``model.init(key, *example_args, **static_kwargs)`` as
    ``ShapeDtypeStruct``s, via ``jax.eval_shape``: nothing is allocated, so it works for 175B models.

    ``example_args`` may be arrays or ``ShapeDtypeStruct``s; ``static_kwargs`` (e.g. ``train=False``) are
    passed through unchanged.
    """

    def init(*args: Any) -> Any:
        return model.init(jax.random.key(0), *args, **static_kwargs)

    return jax.eval_shape(init, *example_args)
