"""Split a traced step at its grad marker and run compute-grad once per micro-batch.

Alpa dissertation 3.5: a training step is compute-grad (forward and backward of one micro-batch),
gradient accumulation, and apply-grad (the optimizer update). The ``"grad"`` marker that
:func:`alpa_like.grad` puts on its results is the boundary. :func:`split_at_grad_marker` classifies the
equations of the flat step jaxpr:

* ``hoisted``: before the marker and independent of the batch (run once per step);
* ``per_micro_batch``: the batch-dependent ancestors of the marker's inputs (run once per micro-batch),
  and what they read that the step computes from its random keys (a dropout mask, a key split off the
  step's key): each micro-batch computes those again from the key roots with its index folded in
  (:mod:`~alpa_like.compiler.micro_batch_keys`), so micro-batches draw their own masks;
* ``apply``: everything else (run once, after the marker; must not read the batch).

The jaxpr is traced for one micro-batch (``trace_step(..., num_micro_batches=m)``), so the per-micro-batch
equations have the right shapes; the values of the grad marker do not depend on the batch size.

:func:`make_step_fn` evaluates the pieces; the micro-batch results are summed by a `lax.scan` and divided
by the number of micro-batches, so for a loss that is a mean over the batch the step computes the same
values as without accumulation (only the summation order differs); a loss that sums over the batch comes
out 1/m of the full-batch sum (:mod:`~alpa_like.compiler.loss_reduction` finds it; docs/micro-batches.md).
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
from alpa_like.compiler.micro_batch_keys import (DERIVED, KeyDraws, draws_random_numbers,
                                                 fold_micro_batch_index, fold_points, key_data, key_origins,
                                                 key_roots, unfoldable_draws)

ValuesFn = Callable[[list[Any]], list[Any]]


@dataclasses.dataclass(frozen=True)
class GradSplit:
    """The equations of a step jaxpr, in jaxpr order, grouped by when they run."""

    hoisted: tuple[JaxprEqn, ...]
    per_micro_batch: tuple[JaxprEqn, ...]
    marker: JaxprEqn
    apply: tuple[JaxprEqn, ...]
    folded_keys: KeyDraws = ()
    """The per-micro-batch equations that read key roots, with those operands: each micro-batch folds its
    index into them (:func:`~alpa_like.compiler.micro_batch_keys.fold_micro_batch_index`)."""


def grad_markers(closed: ClosedJaxpr) -> list[JaxprEqn]:
    return [e for e in closed.jaxpr.eqns if is_marker(e, "grad")]


def result_name(marker: JaxprEqn, position: int) -> str:
    """The user's name of the grad marker's value at ``position`` (``aux['logits']``, ``grads['w']``), as
    :func:`alpa_like.grad` names it; ``a value`` where the marker has no names."""
    names = marker.params.get("names", ())
    return names[position] if len(names) == len(marker.invars) else "a value"


def grad_call(marker: JaxprEqn) -> str:
    """``al.value_and_grad`` or ``al.grad``: the call that put the grad marker in the step."""
    names = marker.params.get("names", ())
    if not names:
        return "al.grad / al.value_and_grad"
    return "al.value_and_grad" if names[0] == "value" else "al.grad"


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
    for position, var in enumerate(marker.invars):
        if not jnp.issubdtype(var.aval.dtype, jnp.inexact):
            raise ValueError(
                f"{grad_call(marker)} returns {result_name(marker, position)} of dtype {var.aval.dtype}; with "
                "num_micro_batches > 1 what it returns is averaged over micro-batches, so it must be floating "
                "point (return integer metrics from outside the grad call)")
    batch_vars = {v for v, b in zip(closed.jaxpr.invars, batch_mask, strict=True) if b}
    # dead code (e.g. jax.grad's unused loss) is dropped; effects (jax.debug.print) and what they read are not
    effectful = {i for i, e in enumerate(eqns) if e.effects}
    effect_inputs = [v for i in sorted(effectful) for v in jax_compat.eqn_inputs(eqns[i])]
    live = jax_compat.ancestors(eqns, list(closed.jaxpr.outvars) + effect_inputs) | effectful
    dependent = batch_dependent(eqns[:k], batch_vars)
    _check_no_per_example_results(eqns, marker, dependent, {v.aval.shape[0] for v in batch_vars if v.aval.shape})
    hoisted, per_micro, apply = _phases(eqns, k, live, effectful, dependent)
    dependent = batch_dependent([eqns[i] for i in apply], dependent)
    for i in apply:
        if any(v in dependent for v in jax_compat.eqn_inputs(eqns[i])):
            raise ValueError(
                f"with num_micro_batches > 1, `{eqns[i].primitive.name}` outside al.grad uses the batch or a "
                "value computed from it; compute it inside the loss and return it as aux "
                "(al.value_and_grad(..., has_aux=True)) so that it is averaged over micro-batches")
    outvars = [v for v in closed.jaxpr.outvars if isinstance(v, Var)]
    if any(v in dependent for v in outvars):
        raise ValueError("with num_micro_batches > 1 the step returns a value computed per micro-batch; "
                         "return it from the loss as aux (al.value_and_grad(..., has_aux=True))")
    # each micro-batch computes what the step computes from its keys again, from the keys with its index folded in
    data = key_data(closed.jaxpr)
    origins = key_origins(eqns[:k], {**key_roots(closed.jaxpr.constvars + closed.jaxpr.invars, data),
                                     **{v: DERIVED for v in batch_vars}}, data)
    read_after = [v for i in apply for v in jax_compat.eqn_inputs(eqns[i])] + outvars
    rerun, kept = _rerun_in_loop(eqns, hoisted, per_micro, marker.invars, set(read_after), origins)
    loop = sorted(set(per_micro) | set(rerun))
    unfoldable = unfoldable_draws([eqns[i] for i in loop], origins, data)
    if unfoldable:  # nothing folded: every micro-batch computes what the step computes, consistently
        loop, kept = per_micro, []
    hoisted = _needed_before_loop(eqns, hoisted, loop, read_after + jax_compat.eqn_inputs(marker))
    loop_eqns = [eqns[i] for i in loop]
    _warn_shared_random_draws(eqns, kept, loop, unfoldable)
    folded = () if unfoldable else fold_points(loop_eqns, origins, data)
    return GradSplit(hoisted=tuple(eqns[i] for i in hoisted), per_micro_batch=tuple(loop_eqns), marker=marker,
                     apply=tuple(eqns[i] for i in apply), folded_keys=folded)


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
    for position, var in enumerate(marker.invars):
        shape = tuple(var.aval.shape)
        if var in dependent and shape and shape[0] in rows and shape not in param_shapes:
            raise ValueError(
                f"{grad_call(marker)} returns {result_name(marker, position)} of shape {shape} whose dim 0 is a "
                f"micro-batch's {shape[0]} rows (a per-example aux, e.g. logits): with num_micro_batches > 1 "
                "what it returns is averaged over micro-batches, so these rows would not be the batch's; return "
                "a reduction over the examples (e.g. their mean) as aux, or use num_micro_batches=1 "
                "(docs/micro-batches.md)")


def _rerun_in_loop(eqns: Sequence[JaxprEqn], hoisted: Sequence[int], per_micro: Sequence[int],
                   marker_inputs: Sequence[Any], read_later: set[Var],
                   origins: dict[Var, str]) -> tuple[list[int], list[int]]:
    """The hoisted equations computed from keys that the micro-batch computation reads, or al.grad returns
    (a dropout mask from the step's key, a key split off it, an aux of the mask): they run again in the
    micro-batch loop, from the folded key roots (:mod:`~alpa_like.compiler.micro_batch_keys`). Second, the
    hoisted draws whose numbers are read after al.grad or returned: they stay once per step (their numbers
    must be one value) and the loop reads them as they are."""
    hoisted_eqns = [eqns[i] for i in hoisted]
    kept = [i for i in hoisted if draws_random_numbers(eqns[i])
            and batch_dependent(hoisted_eqns, set(eqns[i].outvars)) & read_later]
    derived = [i for i in hoisted if i not in kept and any(origins.get(v) == DERIVED for v in eqns[i].outvars)]
    read = [v for i in per_micro for v in jax_compat.eqn_inputs(eqns[i])] + list(marker_inputs)
    return [derived[j] for j in sorted(jax_compat.ancestors([eqns[i] for i in derived], read))], kept


def _needed_before_loop(eqns: Sequence[JaxprEqn], hoisted: Sequence[int], loop: Sequence[int],
                        read_after: Sequence[Any]) -> list[int]:
    """The hoisted equations still needed once ``loop`` runs its own copies: those the loop's other inputs,
    ``read_after`` (the marker's inputs, what runs after it) and the effects depend on."""
    made_in_loop = {v for i in loop for v in eqns[i].outvars}
    effects = [j for j, i in enumerate(hoisted) if eqns[i].effects]
    wanted = [v for i in loop for v in jax_compat.eqn_inputs(eqns[i]) if v not in made_in_loop]
    wanted += list(read_after) + [v for j in effects for v in jax_compat.eqn_inputs(eqns[hoisted[j]])]
    kept = jax_compat.ancestors([eqns[i] for i in hoisted], wanted) | set(effects)
    return [hoisted[j] for j in sorted(kept)]


def _warn_shared_random_draws(eqns: Sequence[JaxprEqn], kept: Sequence[int], loop: Sequence[int],
                              unknown: Sequence[JaxprEqn]) -> None:
    """Random numbers every micro-batch reads the same of: drawn once per step (``kept``: also read after
    al.grad) and read in the ``loop``; or all of them, when some are drawn from keys the micro-batch's index
    cannot be folded into (``unknown``: a key made from a seed inside a call body)."""
    read = {v for i in loop for v in jax_compat.eqn_inputs(eqns[i])}
    shared = [eqns[i] for i in kept if set(eqns[i].outvars) & read]
    if shared:
        shapes = ", ".join(sorted({str(tuple(v.aval.shape)) for e in shared for v in e.outvars}))
        warnings.warn(f"with num_micro_batches > 1, the random numbers drawn in the step (shapes {shapes}) are "
                      "drawn once per step and every micro-batch reads the same ones (they are also used after "
                      "al.grad, or returned): a dropout mask repeats in each micro-batch. Draw them inside the loss",
                      stacklevel=3)
    if unknown:
        names = ", ".join(sorted({e.primitive.name for e in unknown}))
        warnings.warn(f"with num_micro_batches > 1, `{names}` draws random numbers from a key that is neither an "
                      "argument of the step nor made from one outside a jax.checkpoint, scan or cond body (a "
                      "seed inside the body, or key data of an unknown layout): the micro-batch's index cannot "
                      "be folded into it, so every micro-batch draws the same random numbers, all of them. "
                      "Make the key outside the body and pass it in", stacklevel=3)


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
        is given also folds the micro-batch's index into the step's key roots (:func:`fold_micro_batch_index`).
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
