"""Split a traced step at its grad marker and run compute-grad once per micro-batch.

Alpa dissertation 3.5: a training step is compute-grad (forward and backward of one micro-batch),
gradient accumulation, and apply-grad (the optimizer update). The ``"grad"`` marker that
:func:`alpa_like.grad` puts on its results is the boundary. :func:`split_at_grad_marker` classifies the
equations of the flat step jaxpr:

* ``hoisted``: before the marker and independent of the batch (run once per step);
* ``per_micro_batch``: the batch-dependent ancestors of the marker's inputs (run once per micro-batch),
  and the draws of random numbers that only they read (a dropout mask): each micro-batch draws its own,
  from the draw's key with the micro-batch's index folded in (:func:`fold_micro_batch_index`);
* ``apply``: everything else (run once, after the marker; must not read the batch).

The jaxpr is traced for one micro-batch (``trace_step(..., num_micro_batches=m)``), so the per-micro-batch
equations have the right shapes; the values of the grad marker do not depend on the batch size.

:func:`make_step_fn` evaluates the pieces; the micro-batch results are summed by a `lax.scan` and divided
by the number of micro-batches, so for a loss that is a mean over the batch the step computes the same
values as without accumulation (only the summation order differs).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import eqn_flops
from alpa_like.compiler.markers import is_marker

ValuesFn = Callable[[list[Any]], list[Any]]
KeyDraws = tuple[tuple[JaxprEqn, tuple[int, ...]], ...]
"""Equations that draw random numbers, each with the positions of its per-step key operands."""


@dataclasses.dataclass(frozen=True)
class GradSplit:
    """The equations of a step jaxpr, in jaxpr order, grouped by when they run."""

    hoisted: tuple[JaxprEqn, ...]
    per_micro_batch: tuple[JaxprEqn, ...]
    marker: JaxprEqn
    apply: tuple[JaxprEqn, ...]
    folded_keys: KeyDraws = ()
    """Per-micro-batch equations that draw random numbers from a per-step PRNG key, with the positions of
    those key operands: each micro-batch folds its index into them (:func:`fold_micro_batch_index`)."""


def grad_markers(closed: ClosedJaxpr) -> list[JaxprEqn]:
    return [e for e in closed.jaxpr.eqns if is_marker(e, "grad")]


def batch_dependent(eqns: Sequence[JaxprEqn], batch_vars: set[Var]) -> set[Var]:
    """``batch_vars`` and every value ``eqns`` compute from them (in order)."""
    dependent = set(batch_vars)
    for eqn in eqns:
        if any(v in dependent for v in jax_compat.eqn_inputs(eqn)):
            dependent.update(eqn.outvars)
    return dependent


def split_at_grad_marker(closed: ClosedJaxpr, batch_mask: Sequence[bool]) -> GradSplit:
    """Groups the equations of ``closed`` around its single grad marker (see the module docstring).

    Args:
      closed: a flat step jaxpr (nested calls inlined), invars in the order of ``batch_mask``.
      batch_mask: per invar, True when it is a batch leaf (split into micro-batches).

    Raises:
      ValueError: no grad marker or several; a per-micro-batch value is used after the marker or returned
        without going through it; a marked value is not floating point (it cannot be averaged).
    """
    markers = grad_markers(closed)
    if len(markers) != 1:
        raise ValueError(
            f"num_micro_batches > 1 needs exactly one al.grad / al.value_and_grad call in the step, found "
            f"{len(markers)}; plain jax.grad cannot be split into micro-batches: use al.grad")
    marker = markers[0]
    eqns = closed.jaxpr.eqns
    k = eqns.index(marker)
    for var in marker.invars:
        if not jnp.issubdtype(var.aval.dtype, jnp.inexact):
            raise ValueError(
                f"a value returned by al.grad/al.value_and_grad has dtype {var.aval.dtype}; with "
                "num_micro_batches > 1 these values are averaged over micro-batches, so they must be floating "
                "point (return integer metrics from outside the grad call)")
    batch_vars = {v for v, b in zip(closed.jaxpr.invars, batch_mask, strict=True) if b}
    # dead code (e.g. jax.grad's unused loss) is dropped; effects (jax.debug.print) and what they read are not
    effectful = {i for i, e in enumerate(eqns) if e.effects}
    effect_inputs = [v for i in sorted(effectful) for v in jax_compat.eqn_inputs(eqns[i])]
    live = jax_compat.ancestors(eqns, list(closed.jaxpr.outvars) + effect_inputs) | effectful
    dependent = batch_dependent(eqns[:k], batch_vars)
    _check_no_per_example_results(eqns, marker, dependent, {v.aval.shape[0] for v in batch_vars if v.aval.shape})
    hoisted, per_micro, apply = _phases(eqns, k, live, effectful, dependent)
    # draws moved into the loop: each micro-batch draws its own, from the key with its index folded in
    drawing_calls = sorted({eqns[i].primitive.name for i in per_micro if draws_inside_a_call(eqns[i])})
    per_micro_values = batch_vars
    if not drawing_calls:
        per_micro_values = batch_vars | {v for i in _per_step_draws(eqns, hoisted, per_micro, apply,
                                                                    closed.jaxpr.outvars) for v in eqns[i].outvars}
    if per_micro_values != batch_vars:
        hoisted, per_micro, apply = _phases(eqns, k, live, effectful, batch_dependent(eqns[:k], per_micro_values))
    _warn_shared_random_draws([eqns[i] for i in hoisted], [eqns[i] for i in per_micro], drawing_calls)
    dependent = batch_dependent([eqns[i] for i in apply], dependent)
    for i in apply:
        if any(v in dependent for v in jax_compat.eqn_inputs(eqns[i])):
            raise ValueError(
                f"with num_micro_batches > 1, `{eqns[i].primitive.name}` outside al.grad uses the batch or a "
                "value computed from it; compute it inside the loss and return it as aux "
                "(al.value_and_grad(..., has_aux=True)) so that it is averaged over micro-batches")
    if any(v in dependent for v in closed.jaxpr.outvars if isinstance(v, Var)):
        raise ValueError("with num_micro_batches > 1 the step returns a value computed per micro-batch; "
                         "return it from the loss as aux (al.value_and_grad(..., has_aux=True))")
    folded = () if drawing_calls else per_step_key_draws([eqns[i] for i in per_micro], per_micro_values)
    return GradSplit(hoisted=tuple(eqns[i] for i in hoisted), per_micro_batch=tuple(eqns[i] for i in per_micro),
                     marker=marker, apply=tuple(eqns[i] for i in apply), folded_keys=folded)


def _phases(eqns: Sequence[JaxprEqn], k: int, live: set[int], effectful: set[int],
            dependent: set[Var]) -> tuple[list[int], list[int], list[int]]:
    """Positions of the hoisted, per-micro-batch and apply equations (module docstring); ``k`` is the grad
    marker's position, ``dependent`` the values that differ from micro-batch to micro-batch."""
    effectful_before = {i for i in effectful if i < k}
    feeds_marker = jax_compat.ancestors(eqns[:k], list(eqns[k].invars) + [
        v for i in sorted(effectful_before) for v in jax_compat.eqn_inputs(eqns[i])]) | effectful_before
    per_micro = [i for i in sorted(feeds_marker)  # an effect on a micro-batch's values runs once per micro-batch
                 if set(eqns[i].outvars) & dependent or any(v in dependent for v in jax_compat.eqn_inputs(eqns[i]))]
    hoisted = [i for i in range(k) if i in live and i not in per_micro and not set(eqns[i].outvars) & dependent]
    apply = [i for i in range(len(eqns)) if i in live and i != k and i not in per_micro and i not in hoisted]
    return hoisted, per_micro, apply


def _check_no_per_example_results(eqns: Sequence[JaxprEqn], marker: JaxprEqn, dependent: set[Var],
                                  rows: set[int]) -> None:
    """al.grad's results are averaged over micro-batches: a per-example one (an aux with the micro-batch's
    rows in dim 0, e.g. logits) would come back with one micro-batch's rows, averaged. Gradients have their
    parameters' shapes, so a result shaped like a parameter is taken for a gradient."""
    param_shapes = {tuple(v.aval.shape) for e in eqns if is_marker(e, "param") for v in e.outvars}
    for var in marker.invars:
        shape = tuple(var.aval.shape)
        if var in dependent and shape and shape[0] in rows and shape not in param_shapes:
            raise ValueError(
                f"al.grad / al.value_and_grad returns a value of shape {shape} whose dim 0 is a micro-batch's "
                f"{shape[0]} rows (a per-example aux, e.g. logits): with num_micro_batches > 1 what it returns "
                "is averaged over micro-batches, so these rows would not be the batch's; return a reduction "
                "over the examples (e.g. their mean) as aux, or use num_micro_batches=1")


_RANDOM_PRIMITIVES = frozenset({"random_bits", "threefry2x32"})


def draws_random_numbers(eqn: JaxprEqn) -> bool:
    """True when ``eqn`` draws random numbers: a random primitive, or a call (``checkpoint``, ``cond``, ...)
    whose body draws."""
    return eqn.primitive.name in _RANDOM_PRIMITIVES or any(
        draws_random_numbers(inner) for body in jax_compat.nested_jaxprs(eqn) for inner in body.eqns)


def draws_inside_a_call(eqn: JaxprEqn) -> bool:
    """True when ``eqn`` is a call (``checkpoint``, ``scan``, ``cond``, ...) whose body draws random numbers."""
    return eqn.primitive.name not in _RANDOM_PRIMITIVES and draws_random_numbers(eqn)


def _is_key(var) -> bool:
    return isinstance(var, Var) and jax_compat.is_prng_key(var.aval.dtype)


def per_step_key_draws(eqns: Sequence[JaxprEqn], per_micro_batch: set[Var]) -> KeyDraws:
    """The equations of a micro-batch's computation that draw random numbers from a typed PRNG key computed
    once per step, with the positions of those key operands (what :func:`fold_micro_batch_index` folds).

    Args:
      eqns: equations run once per micro-batch, in order.
      per_micro_batch: the values that differ from micro-batch to micro-batch when ``eqns`` start (the batch;
        numbers already drawn per micro-batch); what ``eqns`` compute from them differs too.
    """
    differs = batch_dependent(eqns, set(per_micro_batch))
    drawn = []
    for eqn in eqns:
        keys = tuple(k for k, v in enumerate(eqn.invars) if _is_key(v) and v not in differs)
        if keys and draws_random_numbers(eqn):
            drawn.append((eqn, keys))
    return tuple(drawn)


def _per_step_draws(eqns: Sequence[JaxprEqn], hoisted: Sequence[int], per_micro: Sequence[int],
                    apply: Sequence[int], outvars: Sequence[Any]) -> list[int]:
    """The hoisted draws from a typed key whose numbers only the per-micro-batch equations read (through
    hoisted equations or directly), e.g. a dropout mask: they move into the micro-batch loop, which draws
    them from the key with the micro-batch's index folded in. A draw that is also read after al.grad, or
    returned, stays once per step (its numbers must be one value)."""
    read = {v for i in per_micro for v in jax_compat.eqn_inputs(eqns[i])}
    read_later = ({v for i in apply for v in jax_compat.eqn_inputs(eqns[i])}
                  | {v for v in outvars if isinstance(v, Var)})
    hoisted_eqns = [eqns[i] for i in hoisted]
    moved = []
    for i in hoisted:
        if not (draws_random_numbers(eqns[i]) and any(_is_key(v) for v in eqns[i].invars)):
            continue
        reach = batch_dependent(hoisted_eqns, set(eqns[i].outvars))
        if reach & read and not reach & read_later:
            moved.append(i)
    return moved


def fold_micro_batch_index(folded_keys: KeyDraws, index,
                           operand_hook: jax_compat.EqnHook | None = None) -> jax_compat.EqnHook | None:
    """An operand hook that gives each equation of ``folded_keys`` its per-step keys with the micro-batch
    ``index`` folded in (`jax.random.fold_in`), after ``operand_hook``: every micro-batch draws its own
    numbers (its own dropout mask), as consecutive steps of a loop over micro-batches would."""
    positions = {id(eqn): keys for eqn, keys in folded_keys}
    if not positions:
        return operand_hook

    def hook(eqn, invals):
        if operand_hook is not None:
            invals = operand_hook(eqn, invals)
        keys = positions.get(id(eqn))
        if keys:
            invals = list(invals)
            for k in keys:
                invals[k] = _fold_in(invals[k], index)
        return invals
    return hook


def _fold_in(keys, index):
    """`jax.random.fold_in` on every key of a key array of any shape."""
    flat = jnp.reshape(keys, (-1,))
    return jnp.reshape(jax.vmap(jax.random.fold_in, in_axes=(0, None))(flat, index), keys.shape)


def _warn_shared_random_draws(hoisted: Sequence[JaxprEqn], per_micro_batch: Sequence[JaxprEqn],
                              drawing_calls: Sequence[str] = ()) -> None:
    """Random numbers every micro-batch reads the same of: drawn once per step because :func:`_per_step_draws`
    could not move them into the micro-batch loop (also read after al.grad), or because the micro-batch
    computation also draws inside a call body (``drawing_calls``: ``jax.checkpoint``/``nn.remat``, ``scan``,
    ``cond``). There, JAX draws the forward's numbers outside the body and recomputes them inside it for the
    backward; folding the micro-batch's index into the draws' keys would give the two different masks, so
    nothing is folded and a dropout mask repeats in every micro-batch: a warning says so."""
    read = {v for e in per_micro_batch for v in jax_compat.eqn_inputs(e)}
    draws = [e for e in hoisted if draws_random_numbers(e) and batch_dependent(hoisted, set(e.outvars)) & read]
    if drawing_calls:
        warnings.warn(f"with num_micro_batches > 1, the step draws random numbers inside {', '.join(drawing_calls)} "
                      "(jax.checkpoint / nn.remat, scan or cond) bodies: every micro-batch draws the same ones "
                      "(a dropout mask repeats in each micro-batch), because giving each micro-batch its own "
                      "would not yet keep the forward's and the recomputed backward's draws equal",
                      stacklevel=3)
    elif draws:
        shapes = ", ".join(sorted({str(tuple(v.aval.shape)) for e in draws for v in e.outvars}))
        warnings.warn(f"with num_micro_batches > 1, the random numbers drawn in the step (shapes {shapes}) are "
                      "drawn once per step and every micro-batch reads the same ones (they are also used after "
                      "al.grad): a dropout mask repeats in each micro-batch. Draw them inside the loss",
                      stacklevel=3)


def split_total(split: GradSplit, num_micro_batches: int, cost: Callable[[JaxprEqn], float] = eqn_flops) -> float:
    """A per-equation ``cost`` (FLOPs by default) summed over one step: the per-micro-batch equations count
    once per micro-batch."""
    def total(eqns):
        return sum(cost(e) for e in eqns)
    return total(split.hoisted) + num_micro_batches * total(split.per_micro_batch) + total(split.apply)


def to_micro_batches(x, num_micro_batches: int):
    """[B, ...] -> [m, B/m, ...] where micro-batch j holds rows j, j+m, j+2m, ...

    Strided rather than contiguous so that a batch sharded along dim 0 stays local to each device.
    """
    rows = x.shape[0] // num_micro_batches
    return jnp.swapaxes(x.reshape(rows, num_micro_batches, *x.shape[1:]), 0, 1)


def make_step_fn(closed: ClosedJaxpr, batch_mask: Sequence[bool], *, num_micro_batches: int = 1,
                 eqn_hook: jax_compat.EqnHook | None = None, on_micro_batch: ValuesFn | None = None,
                 operand_hook: jax_compat.EqnHook | None = None,
                 micro_batch_eval: Callable[[Sequence[JaxprEqn], dict, jax_compat.EqnHook | None], None]
                 | None = None,
                 stack_sizes: dict[Var, int] | None = None) -> Callable:
    """A function of the flat inputs that computes the flat outputs of ``closed``.

    Args:
      closed: the flat step jaxpr.
      batch_mask: per invar, whether it is a batch leaf.
      num_micro_batches: 1 evaluates the jaxpr as it is; m > 1 runs compute-grad on m micro-batches.
      eqn_hook: ``hook(eqn, outvals) -> outvals`` applied to every equation (the grad marker after
        accumulation), e.g. to pin shardings with `with_sharding_constraint`.
      on_micro_batch: applied to the batch leaves of one micro-batch, e.g. to pin their sharding.
      operand_hook: ``hook(eqn, invals) -> invals`` applied to every equation's operands as that equation
        reads them (e.g. to pin the layout one reader needs).
      micro_batch_eval: ``eval(eqns, env, operand_hook)`` evaluates the per-micro-batch equations into ``env``
        instead of :func:`~alpa_like.compiler.jax_compat.eval_eqns` with the hooks (e.g. keeping gradients as
        stacks of per-shard partial sums, :mod:`~alpa_like.compiler.gradient_sync`); the ``operand_hook`` it
        is given also folds the micro-batch's index into per-step random keys (:func:`fold_micro_batch_index`).
      stack_sizes: the grad marker's inputs that ``micro_batch_eval`` computes as stacks ``(d, *shape)`` ->
        ``d``; they are accumulated as stacks and summed over the stack once, after the last micro-batch.
    """
    if num_micro_batches == 1:
        def step(*flat):
            return jax_compat.eval_closed_jaxpr(closed, *flat, hook=eqn_hook, operand_hook=operand_hook)
        return step

    split = split_at_grad_marker(closed, batch_mask)
    jaxpr = closed.jaxpr
    batch_vars = [v for v, b in zip(jaxpr.invars, batch_mask, strict=True) if b]
    m = num_micro_batches
    stack_sizes = stack_sizes or {}
    if micro_batch_eval is None:
        def micro_batch_eval(eqns, env, micro_operand_hook):
            jax_compat.eval_eqns(eqns, env, hook=eqn_hook, operand_hook=micro_operand_hook)

    def step(*flat):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, flat, strict=True))
        jax_compat.eval_eqns(split.hoisted, env, hook=eqn_hook, operand_hook=operand_hook)
        micro_batches = [to_micro_batches(env[v], m) for v in batch_vars]

        def body(acc, xs):
            batch_values, index = xs
            if on_micro_batch is not None:
                batch_values = on_micro_batch(list(batch_values))
            local = dict(env)
            local.update(zip(batch_vars, batch_values, strict=True))
            micro_batch_eval(split.per_micro_batch, local,
                             fold_micro_batch_index(split.folded_keys, index, operand_hook))
            values = [v.val if not isinstance(v, Var) else local[v] for v in split.marker.invars]
            return [a + v for a, v in zip(acc, values, strict=True)], None

        stacks = [stack_sizes.get(v) if isinstance(v, Var) else None for v in split.marker.invars]
        zeros = [jnp.zeros(((d,) if d else ()) + v.aval.shape, v.aval.dtype)
                 for v, d in zip(split.marker.invars, stacks, strict=True)]
        total, _ = jax.lax.scan(body, zeros, (micro_batches, jnp.arange(m, dtype=jnp.uint32)))
        total = [jnp.sum(t, axis=0) if d else t for t, d in zip(total, stacks, strict=True)]
        mean = [t / np.asarray(m, dtype=t.dtype) for t in total]
        marker_env = dict(zip(split.marker.invars, mean, strict=True))
        jax_compat.eval_eqns([split.marker], marker_env, hook=eqn_hook, operand_hook=operand_hook)
        env.update({v: marker_env[v] for v in split.marker.outvars})
        jax_compat.eval_eqns(split.apply, env, hook=eqn_hook, operand_hook=operand_hook)
        return [v.val if not isinstance(v, Var) else env[v] for v in jaxpr.outvars]

    return step
