"""Each micro-batch draws its own random numbers: its index is folded into the step's keys where they enter.

A step that draws a dropout mask from a key it is given draws it once. Split into micro-batches (gradient
accumulation, Alpa dissertation 3.5; a pipeline's micro-batches) the draw runs once per micro-batch, and
with the same key every micro-batch would draw the same mask. The rule, the same for the SPMD methods and
the pipeline: micro-batch ``j > 0`` computes as if every *key root* of the step were ``fold_in(root, j)``;
micro-batch 0 computes with the roots themselves, so its values are the step's own (the value a pipeline
returns when the step returns a key it splits off before al.grad).

A key root is a key value the step does not compute from another key: a typed key argument
(``jax.random.key``), uint32 key data that reaches a ``random_wrap`` without being made from a key (a raw
``jax.random.PRNGKey`` argument), a key made from a seed. Everything the step computes from a root is
computed in the micro-batch loop from the folded root (:func:`fold_points` folds each root where an
equation of the loop reads it), so the forward's draws and their recomputation in a ``jax.checkpoint`` /
``nn.remat`` body for the backward start from the same folded key, and so do the draws in ``scan`` /
``cond`` bodies.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.markers import is_marker

ROOT, DERIVED = "root", "derived"
"""Key origins (:func:`key_origins`): a key root, or a value computed from a root (or from the batch)."""

KeyFolds = tuple[tuple[int, Any], ...]
"""Operand positions of an equation that read a key root, each with the PRNG impl of its key data (None for
a typed key)."""
KeyDraws = tuple[tuple[JaxprEqn, KeyFolds], ...]
"""The equations of a micro-batch's computation that read key roots, with those operands."""

_RANDOM_PRIMITIVES = frozenset({"random_bits", "threefry2x32"})
# Equations whose uint32 result rearranges their uint32 operands: key data stays key data through them.
_DATA_MOVEMENT = frozenset({"slice", "squeeze", "reshape", "expand_dims", "broadcast_in_dim", "concatenate",
                            "gather", "dynamic_slice", "dynamic_update_slice", "transpose", "copy", "copy_p",
                            "select_n", "rev", "pad", "convert_element_type"})


def draws_random_numbers(eqn: JaxprEqn) -> bool:
    """True when ``eqn`` draws random numbers: a random primitive, or a call (``checkpoint``, ``cond``, ...)
    whose body draws."""
    return eqn.primitive.name in _RANDOM_PRIMITIVES or any(
        draws_random_numbers(inner) for body in jax_compat.nested_jaxprs(eqn) for inner in body.eqns)


def key_data(jaxpr: Jaxpr, outputs: Sequence[Any] = ()) -> dict[Var, Any]:
    """The uint32 values of ``jaxpr`` that are PRNG key data, each with its PRNG impl: they reach a
    ``random_wrap`` (directly, through slices, reshapes and the like, or through the body of a call, loop or
    cond).

    Args:
      jaxpr: the program.
      outputs: per outvar of ``jaxpr``, the impl when what it becomes outside is key data, else None.
    """
    found: dict[Var, Any] = {}
    for var, impl in zip(jaxpr.outvars, outputs):
        if impl is not None:
            _mark_key_data(found, var, impl)
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name == "random_wrap":
            _mark_key_data(found, eqn.invars[0], eqn.params["impl"])
        elif _passes_through(eqn):
            for var, out in zip(eqn.invars, eqn.outvars, strict=True):
                if out in found:
                    _mark_key_data(found, var, found[out])
        elif eqn.primitive.name in _DATA_MOVEMENT:
            impl = next((found[v] for v in eqn.outvars if v in found), None)
            if impl is not None:
                for var in eqn.invars:
                    _mark_key_data(found, var, impl)
        else:
            for body, reads, becomes in jax_compat.body_operands(eqn):
                inner = key_data(body, [found.get(v) if isinstance(v, Var) else None for v in becomes])
                for var, operand in zip(body.invars, reads, strict=True):
                    if var in inner:
                        _mark_key_data(found, operand, inner[var])
    return found


def _passes_through(eqn: JaxprEqn) -> bool:
    """True for an equation whose outputs are its operands, position by position (an optimization barrier,
    a marker)."""
    return eqn.primitive.name == "optimization_barrier" or is_marker(eqn)


def seeds_keys(eqn: JaxprEqn) -> bool:
    """True when ``eqn`` runs, in a body, a ``random_seed``: a key made inside it from a seed."""
    return any(inner.primitive.name == "random_seed" or seeds_keys(inner)
               for body in jax_compat.nested_jaxprs(eqn) for inner in body.eqns)


def _mark_key_data(found: dict[Var, Any], var, impl) -> None:
    if isinstance(var, Var) and var.aval.dtype == np.uint32:
        found.setdefault(var, impl)


def foldable(var, data: Mapping[Var, Any]) -> bool:
    """True when ``var`` is a key :func:`fold_key` can fold: a typed key array, or key data (``data``, from
    :func:`key_data`) whose trailing dimensions hold one key of its impl."""
    if not isinstance(var, Var):
        return False
    if jax_compat.is_prng_key(var.aval.dtype):
        return True
    impl = data.get(var)
    key_shape = tuple(getattr(impl, "key_shape", ()))
    shape = tuple(var.aval.shape)
    return bool(key_shape) and shape[len(shape) - len(key_shape):] == key_shape


def key_roots(variables: Sequence[Any], data: Mapping[Var, Any]) -> dict[Var, str]:
    """The key roots among a program's inputs: ``{var: ROOT}`` for each foldable one."""
    return {v: ROOT for v in variables if foldable(v, data)}


def key_origins(eqns: Sequence[JaxprEqn], origins: Mapping[Var, str], data: Mapping[Var, Any]) -> dict[Var, str]:
    """``origins`` (of the values ``eqns`` read: :func:`key_roots`, and DERIVED for the batch) extended over
    ``eqns``, in order: an equation that reads a root or a derived value makes derived values; one that reads
    neither makes a root of each foldable key it returns (a key from a seed)."""
    origins = dict(origins)
    for eqn in eqns:
        if _passes_through(eqn):  # value by value: a seed through an optimization barrier is still a seed
            origins.update((out, DERIVED) for v, out in zip(eqn.invars, eqn.outvars, strict=True)
                           if isinstance(v, Var) and v in origins)  # a root is folded where it is read: here
        elif any(v in origins for v in jax_compat.eqn_inputs(eqn)):
            origins.update((v, DERIVED) for v in eqn.outvars)
        else:
            origins.update((v, ROOT) for v in eqn.outvars if foldable(v, data))
    return origins


def fold_points(eqns: Sequence[JaxprEqn], origins: Mapping[Var, str], data: Mapping[Var, Any]) -> KeyDraws:
    """The equations of ``eqns`` (one micro-batch's computation) that read key roots, with those operands:
    where :func:`fold_micro_batch_index` folds the micro-batch's index in."""
    points = []
    for eqn in eqns:
        folds = tuple((k, data.get(v)) for k, v in enumerate(eqn.invars)
                      if isinstance(v, Var) and origins.get(v) == ROOT)
        if folds:
            points.append((eqn, folds))
    return tuple(points)


def unfoldable_draws(eqns: Sequence[JaxprEqn], origins: Mapping[Var, str],
                     data: Mapping[Var, Any]) -> list[JaxprEqn]:
    """The equations of ``eqns`` that draw random numbers from keys the fold cannot reach: a draw that reads
    no key with an origin, or a call whose body makes a key from a seed (the forward's copy of that key,
    made outside the body, is a root and would be folded, the backward's recomputation inside would not).
    When there are any, nothing may be folded: the micro-batches then share their random numbers."""
    def keyish(v):
        return jax_compat.is_prng_key(v.aval.dtype) or v in data
    return [e for e in eqns if draws_random_numbers(e) and (
        not any(keyish(v) and v in origins for v in jax_compat.eqn_inputs(e)) or _makes_keys_inside(e, origins))]


def _makes_keys_inside(eqn: JaxprEqn, origins: Mapping[Var, str]) -> bool:
    """True when a body of ``eqn`` (or of a call in it) makes a key from no key it is given."""
    for body, reads, _ in jax_compat.body_operands(eqn):
        data = key_data(body)
        inner = key_origins(body.eqns, {v: DERIVED for v, r in zip(body.invars, reads, strict=True)
                                        if isinstance(r, Var) and r in origins}, data)
        if ROOT in inner.values() or any(_makes_keys_inside(e, inner) for e in body.eqns):
            return True
    return False


def fold_micro_batch_index(draws: KeyDraws, index,
                           operand_hook: jax_compat.EqnHook | None = None) -> jax_compat.EqnHook | None:
    """An operand hook that gives each equation of ``draws`` its key roots as micro-batch ``index`` sees them
    (:func:`fold_key`), after ``operand_hook``."""
    positions = {id(eqn): folds for eqn, folds in draws}
    if not positions:
        return operand_hook

    def hook(eqn, invals):
        if operand_hook is not None:
            invals = operand_hook(eqn, invals)
        folds = positions.get(id(eqn))
        if folds:
            invals = list(invals)
            for k, impl in folds:
                invals[k] = fold_key(invals[k], index, impl)
        return invals
    return hook


def fold_key(key, index, impl=None):
    """``key`` as micro-batch ``index`` sees it: itself for micro-batch 0, ``jax.random.fold_in(key, index)``
    (on every key of the array) for the others. ``key`` is a typed key array, or with ``impl`` uint32 key
    data of that impl (folded as the typed keys it wraps)."""
    keys = key if impl is None else jax.random.wrap_key_data(key, impl=impl)
    flat = jnp.reshape(keys, (-1,))
    folded = jnp.reshape(jax.vmap(jax.random.fold_in, in_axes=(0, None))(flat, index), keys.shape)
    if impl is not None:
        folded = jax.random.key_data(folded)
    return jax.lax.select(index == 0, key, folded)
