"""What each input leaf of a traced step is to the step: the roles every method lays out by.

:func:`input_roles` gives every input leaf one of :data:`~alpa_like.compiler.plan.ROLES` (parameters from
``al.grad``, optimizer state, PRNG keys, batch); :func:`match_outputs_to_inputs` pairs each output leaf with
the input it updates (the new train state), so that it can keep that input's layout.
"""
from __future__ import annotations

import re
import warnings as python_warnings

from alpa_like.compiler.loss_reduction import batch_sum_warnings
from alpa_like.compiler.trace import LeafInfo, TracedStep, arguments_in_outputs

_KEY_NAME = re.compile(r"rng|key|seed", re.IGNORECASE)


def is_prng_key(leaf: LeafInfo) -> bool:
    """Whether ``leaf`` holds PRNG keys: typed keys (dtype ``key<fry>``, ``jax.random.key``), or raw ``uint32``
    key data (``jax.random.PRNGKey``: a last dim of 2, or 4 for ``rbg``) under a path component named like a
    key (``dropout_rng``, ``rng_key``, ``rngs.dropout``, ``seed``)."""
    if leaf.dtype.startswith("key<"):
        return True
    return (leaf.dtype == "uint32" and leaf.shape[-1:] in ((2,), (4,))
            and any(_KEY_NAME.search(part) for part in leaf.path.split(".")[1:]))


def input_roles(traced: TracedStep) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Role of every input leaf (one of :data:`alpa_like.compiler.plan.ROLES`), and warnings. Parameters come from
    al.grad markers, else from the flax convention of a ``params`` path component. When parameters are
    known, the other state leaves are ``optimizer_state`` (what ZeRO shards), except PRNG keys
    (:func:`is_prng_key`), which are ``state``."""
    params = list(traced.param_mask)
    warnings = []
    if not any(params):
        params = [not leaf.is_batch and "params" in leaf.path.split(".") for leaf in traced.in_leaves]
        if any(params):
            warnings.append("parameters found by the 'params' path convention (no al.grad in the step)")
    roles = []
    for leaf, is_param in zip(traced.in_leaves, params, strict=True):
        if leaf.is_batch:
            roles.append("batch")
        elif is_param:
            roles.append("param")
        else:
            roles.append("optimizer_state" if any(params) and not is_prng_key(leaf) else "state")
    for message in batch_sum_warnings(traced):  # every method reads the roles once per compile
        python_warnings.warn(message, stacklevel=3)
        warnings.append(message)
    return tuple(roles), tuple(warnings)


def match_outputs_to_inputs(traced: TracedStep) -> list[int | None]:
    """For each output leaf, the input leaf it updates, when a subtree of the output has the pytree structure
    (paths below the root, shapes and dtypes) of a whole input argument (``return new_state, metrics``,
    ``return {"state": new_state, "loss": loss}``): :func:`~alpa_like.compiler.trace.arguments_in_outputs`."""
    return arguments_in_outputs(traced.in_leaves, traced.out_leaves)
