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
* ``apply``: everything else (run once, after the marker), except what reads the full batch (below).

The jaxpr is traced for one micro-batch (``trace_step(..., num_micro_batches=m)``), so the per-micro-batch
equations have the right shapes; the values of the grad marker do not depend on the batch size, except a
*per-example* result (an aux with the micro-batch's rows in dim 0, e.g. logits: :func:`per_example_results`).

:func:`make_step_fn` evaluates the pieces; the micro-batch results are summed by a `lax.scan` and divided
by the number of micro-batches, so for a loss that is a mean over the batch the step computes the same
values as without accumulation (only the summation order differs); a loss that sums over the batch comes
out 1/m of the full-batch sum (:mod:`~alpa_like.compiler.loss_reduction` finds it; docs/micro-batches.md).
A per-example result is not averaged: the micro-batches' rows are put back in the full batch's order.

Code after the marker may read the full batch: the batch leaves, the per-example results, and what the step
computes from the batch without feeding al.grad or from the batch alone (a padding mask made from the
labels: :func:`batch_only_values`). Such *full-batch* step outputs (Flax's metrics from the logits and the
labels) are computed by :class:`AfterGrad`, the step after its al.grad call traced again for the full batch.
A value computed per micro-batch for al.grad from the batch and other inputs (an activation outside the
loss: :func:`computed_per_micro_batch`) has no full-batch value, and reading it after al.grad is an error.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

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
    per_example: tuple[int, ...] = ()
    """Positions of the marker's per-example values (:func:`per_example_results`): put back together in the
    full batch's row order (:func:`from_micro_batches`), not averaged."""
    full_outputs: tuple[int, ...] = ()
    """The step outputs that read the full batch: :class:`AfterGrad` computes them, ``apply`` leaves them out."""


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
      ValueError: no grad marker or several; a value computed per micro-batch from the batch and other inputs
        (not al.grad's result, not the batch alone) is used after the marker or returned; a marked value that
        is averaged is not floating point.
    """
    markers = grad_markers(closed)
    if len(markers) != 1:
        raise ValueError(
            f"num_micro_batches > 1 needs exactly one al.grad / al.value_and_grad call in the step, found "
            f"{len(markers)}; " + ("plain jax.grad cannot be split into micro-batches: use al.grad" if not markers else
                                   "a step with several gradient calls (a GAN's two losses) runs with "
                                   "num_micro_batches=1"))
    marker = markers[0]
    eqns = closed.jaxpr.eqns
    k = eqns.index(marker)
    batch_vars = {v for v, b in zip(closed.jaxpr.invars, batch_mask, strict=True) if b}
    dependent = batch_dependent(eqns[:k], batch_vars)
    per_example, per_micro_batch_values, full = _full_batch(closed, marker, batch_vars, dependent)
    for position, var in enumerate(marker.invars):
        if position not in per_example and not jnp.issubdtype(var.aval.dtype, jnp.inexact):
            raise ValueError(
                f"{grad_call(marker)} returns {result_name(marker, position)} of dtype {var.aval.dtype}; with "
                "num_micro_batches > 1 what it returns is averaged over micro-batches, so it must be floating "
                "point (return integer metrics from outside the grad call)")
    # dead code (e.g. jax.grad's unused loss) is dropped; effects (jax.debug.print) and what they read are not
    effectful = {i for i, e in enumerate(eqns) if e.effects}
    effect_inputs = [v for i in sorted(effectful) for v in jax_compat.eqn_inputs(eqns[i])]
    live = jax_compat.ancestors(eqns, list(closed.jaxpr.outvars) + effect_inputs) | effectful
    _, _, apply = _phases(eqns, k, live, effectful, dependent)
    _check_full_batch_reads(eqns, apply, closed.jaxpr.outvars, per_micro_batch_values)
    # the full-batch outputs, and the effects reading them, are AfterGrad's: the rest runs as split here
    full_outputs = tuple(i for i, v in enumerate(closed.jaxpr.outvars) if isinstance(v, Var) and v in full)
    effectful = {i for i in effectful if i < k or not any(v in full for v in jax_compat.eqn_inputs(eqns[i]))}
    outvars = [v for v in closed.jaxpr.outvars if isinstance(v, Var) and v not in full]
    effect_inputs = [v for i in sorted(effectful) for v in jax_compat.eqn_inputs(eqns[i])]
    live = jax_compat.ancestors(eqns, outvars + effect_inputs) | effectful
    hoisted, per_micro, apply = _phases(eqns, k, live, effectful, dependent)
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
                     apply=tuple(eqns[i] for i in apply), folded_keys=folded, per_example=per_example,
                     full_outputs=full_outputs)


def _full_batch(closed: ClosedJaxpr, marker: JaxprEqn, batch_vars: set[Var],
                dependent: set[Var]) -> tuple[tuple[int, ...], set[Var], set[Var]]:
    """The marker's per-example positions, the values computed per micro-batch that have no full-batch value
    (:func:`computed_per_micro_batch`), and the values that read the full batch (:func:`full_batch_values`)."""
    eqns, constvars = closed.jaxpr.eqns, closed.jaxpr.constvars
    rows = {v.aval.shape[0] for v in batch_vars if v.aval.shape}
    per_example = per_example_results(eqns, marker, dependent, rows)
    full = full_batch_values(eqns, marker, batch_vars, constvars, [marker.outvars[p] for p in per_example])
    return per_example, computed_per_micro_batch(eqns, marker, batch_vars, constvars), full


def computed_per_micro_batch(eqns: Sequence[JaxprEqn], marker: JaxprEqn, batch_vars: set[Var],
                             constvars: Sequence[Var]) -> set[Var]:
    """The values computed once per micro-batch, for the grad ``marker``'s inputs, from the batch and other
    inputs of the step (the parameters): a micro-batch's activations. Those computed from the batch alone
    (:func:`batch_only_values`) are left out: they have a full-batch value, the others none."""
    before = eqns[:list(eqns).index(marker)]
    dependent = batch_dependent(before, batch_vars)
    made = {v for i in jax_compat.ancestors(before, marker.invars) for v in before[i].outvars if v in dependent}
    return made - batch_only_values(before, batch_vars, constvars)


def full_batch_values(eqns: Sequence[JaxprEqn], marker: JaxprEqn, batch_vars: set[Var], constvars: Sequence[Var],
                      per_example: Sequence[Var]) -> set[Var]:
    """The values that read the full batch: those that depend on ``batch_vars`` before the grad ``marker``
    except the ones :func:`computed_per_micro_batch` (the batch, values computed from it alone, values the
    step computes from it and the parameters without feeding al.grad), the marker's ``per_example`` values,
    and what the equations after the marker compute from them."""
    k = list(eqns).index(marker)
    seeds = batch_dependent(eqns[:k], batch_vars) - computed_per_micro_batch(eqns, marker, batch_vars, constvars)
    return batch_dependent(eqns[k + 1:], seeds | set(per_example))


def full_batch_outputs(closed: ClosedJaxpr, batch_mask: Sequence[bool]) -> tuple[int, ...]:
    """The step outputs that read the full batch after al.grad (the module docstring), as
    :func:`split_at_grad_marker` finds them; empty (never an error) where the step has no single grad marker."""
    markers = grad_markers(closed)
    if len(markers) != 1:
        return ()
    eqns = closed.jaxpr.eqns
    batch_vars = {v for v, b in zip(closed.jaxpr.invars, batch_mask, strict=True) if b}
    _, _, full = _full_batch(closed, markers[0], batch_vars,
                             batch_dependent(eqns[:eqns.index(markers[0])], batch_vars))
    return tuple(i for i, v in enumerate(closed.jaxpr.outvars) if isinstance(v, Var) and v in full)


def batch_only_values(eqns: Sequence[JaxprEqn], batch_vars: set[Var], constvars: Sequence[Var] = ()) -> set[Var]:
    """``batch_vars`` and the values ``eqns`` compute from them and from constants alone (no other input of
    the step, no marker, no effect): a padding mask ``jnp.where(batch['y'] > 0, 1.0, 0.0)``, a one-hot
    of the labels. They have a full-batch value, computed again from the full batch after al.grad."""
    pure = set(batch_vars) | set(constvars)
    for eqn in eqns:
        if not is_marker(eqn) and not eqn.effects and all(v in pure for v in jax_compat.eqn_inputs(eqn)):
            pure.update(eqn.outvars)
    return pure


def _check_full_batch_reads(eqns: Sequence[JaxprEqn], apply: Sequence[int], outvars: Sequence[Any],
                            per_micro_batch: set[Var]) -> None:
    """Raises where the equations at ``apply`` (after al.grad) or the step's ``outvars`` read a value
    computed per micro-batch that has no full-batch value (``per_micro_batch``: computed from the batch and
    other inputs, e.g. the parameters)."""
    for i in apply:
        if any(v in per_micro_batch for v in jax_compat.eqn_inputs(eqns[i])):
            raise ValueError(
                f"with num_micro_batches > 1, `{eqns[i].primitive.name}` outside al.grad uses the batch through a "
                "value computed per micro-batch from the batch and other inputs (e.g. the parameters), which has "
                "no full-batch value after al.grad; compute it inside the loss and return it as aux "
                "(al.value_and_grad(..., has_aux=True)): a per-example aux comes back with the full batch's "
                "rows, other values averaged over micro-batches. After al.grad the step may read the batch, "
                "values computed from it alone, and what al.grad returns (docs/micro-batches.md)")
    if any(isinstance(v, Var) and v in per_micro_batch for v in outvars):
        raise ValueError("with num_micro_batches > 1 the step returns a value computed per micro-batch from the "
                         "batch and other inputs (e.g. the parameters); return it from the loss as aux "
                         "(al.value_and_grad(..., has_aux=True)) (docs/micro-batches.md)")


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


def per_example_results(eqns: Sequence[JaxprEqn], marker: JaxprEqn, dependent: set[Var],
                        rows: set[int]) -> tuple[int, ...]:
    """Positions of the grad marker's per-example values: computed from the batch, with a micro-batch's
    ``rows`` in dim 0, and not a gradient (an aux such as logits or predictions). The marker's names tell
    the gradients (``grads...``); without names a value shaped like a parameter is taken for one."""
    names = marker.params.get("names", ())
    named = len(names) == len(marker.invars)
    param_shapes = {tuple(v.aval.shape) for e in eqns if is_marker(e, "param") for v in e.outvars}
    found = []
    for position, var in enumerate(marker.invars):
        shape = tuple(var.aval.shape)
        gradient = names[position].startswith("grads") if named else shape in param_shapes
        if var in dependent and shape and shape[0] in rows and not gradient:
            found.append(position)
    return tuple(found)


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


def from_micro_batches(stack):
    """The inverse of :func:`to_micro_batches`: [m, B/m, ...] -> [B, ...], row ``r * m + j`` from micro-batch
    ``j``'s row ``r``.

    >>> from_micro_batches(to_micro_batches(jnp.arange(6), 3)).tolist()
    [0, 1, 2, 3, 4, 5]
    """
    return jnp.swapaxes(stack, 0, 1).reshape(stack.shape[0] * stack.shape[1], *stack.shape[2:])


@dataclasses.dataclass(frozen=True)
class AfterGrad:
    """The step's full-batch outputs (the module docstring) as a function of its inputs and al.grad's results.

    ``jaxpr`` is the step after its al.grad call, traced for the full batch: its invars are the step's flat
    inputs followed by the grad marker's values (full batch: the averages, and the per-example results with
    every row), its outvars the step outputs at ``outputs``. It computes again what they read before the
    call that al.grad's results do not give (a padding mask made from the batch).
    """

    jaxpr: ClosedJaxpr
    outputs: tuple[int, ...]
    results: tuple[Var, ...] = ()
    """The grad marker's values in the step jaxpr traced for one micro-batch, in order: what ``jaxpr``'s
    last invars are the full-batch values of."""
    per_example: tuple[int, ...] = ()
    """Positions in ``results`` of the per-example values (:func:`per_example_results`)."""

    def __call__(self, inputs: Sequence[Any], results: Sequence[Any]) -> list[Any]:
        """The outputs at ``outputs``, given the step's flat ``inputs`` and al.grad's full-batch ``results``."""
        return jax_compat.eval_closed_jaxpr(self.jaxpr, *inputs, *results)


def after_grad(closed: ClosedJaxpr, batch_mask: Sequence[bool],
               trace_full_batch: Callable[[], ClosedJaxpr]) -> AfterGrad | None:
    """The :class:`AfterGrad` of a step whose flat jaxpr for one micro-batch is ``closed``, or None when no
    output reads the full batch (:func:`full_batch_outputs`). ``trace_full_batch()`` traces the same step for
    the full batch (only called when needed), flat and without dead code, as ``closed``.

    Raises:
      ValueError: al.grad's results traced for the full batch are not those for one micro-batch, with
        the per-example ones' rows times the number of micro-batches (the step's code depends on the
        batch size).
    """
    outputs = full_batch_outputs(closed, batch_mask)
    if not outputs:
        return None
    full = trace_full_batch()
    marker = grad_markers(closed)[0]
    full_markers = grad_markers(full)
    micro_shapes = [tuple(v.aval.shape) for v in marker.invars]
    full_shapes = [tuple(v.aval.shape) for v in full_markers[0].invars] if len(full_markers) == 1 else None
    if full_shapes is None or len(full_shapes) != len(micro_shapes) or any(
            f[1:] != m[1:] or (f[:1] != m[:1] and f[0] % m[0])
            for f, m in zip(full_shapes, micro_shapes, strict=False)):
        raise ValueError(f"{grad_call(marker)} returns values of shapes {micro_shapes} for one micro-batch, but "
                         f"{full_shapes} for the full batch: with num_micro_batches > 1 the step after al.grad "
                         "runs on the full batch, so the step must trace the same way for both batch sizes")
    batch_vars = {v for v, b in zip(closed.jaxpr.invars, batch_mask, strict=True) if b}
    eqns = closed.jaxpr.eqns
    per_example = per_example_results(eqns, marker, batch_dependent(eqns[:eqns.index(marker)], batch_vars),
                                      {v.aval.shape[0] for v in batch_vars if v.aval.shape})
    return AfterGrad(jaxpr=after_grad_jaxpr(full, batch_mask, outputs), outputs=outputs,
                     results=tuple(marker.outvars), per_example=per_example)


def after_grad_jaxpr(full: ClosedJaxpr, batch_mask: Sequence[bool], outputs: Sequence[int]) -> ClosedJaxpr:
    """``full`` (a step jaxpr with one grad marker) as a function of its inputs and the marker's values that
    returns its outputs at ``outputs``: the marker's values become invars, and only the equations those
    outputs, and the effects after the marker reading the full batch, need stay (the loss's forward and
    backward go)."""
    jaxpr = full.jaxpr
    marker = grad_markers(full)[0]
    k = jaxpr.eqns.index(marker)
    batch_vars = {v for v, b in zip(jaxpr.invars, batch_mask, strict=True) if b}
    _, _, reads_batch = _full_batch(full, marker, batch_vars, batch_dependent(jaxpr.eqns[:k], batch_vars))
    effects = {id(e) for e in jaxpr.eqns[k + 1:]
               if e.effects and any(v in reads_batch for v in jax_compat.eqn_inputs(e))}
    results = [v if isinstance(v, Var) and not jax_compat._is_dropped(v) else Var(v.aval) for v in marker.outvars]
    eqns = [e for e in jaxpr.eqns if e is not marker]
    targets = [jaxpr.outvars[i] for i in outputs]
    live = jax_compat.ancestors(eqns, targets + [v for e in eqns if id(e) in effects
                                                 for v in jax_compat.eqn_inputs(e)])
    kept = [e for i, e in enumerate(eqns) if i in live or id(e) in effects]
    invars = [*jaxpr.invars, *results]
    cut = Jaxpr(constvars=jaxpr.constvars, invars=invars, outvars=targets, eqns=kept,
                effects=frozenset().union(*(e.effects for e in kept)),
                debug_info=jax_compat.debug_info("after_grad", len(invars), len(targets)))
    return full.replace(jaxpr=cut)


def make_step_fn(closed: ClosedJaxpr, batch_mask: Sequence[bool], *, num_micro_batches: int = 1,
                 eqn_hook: jax_compat.EqnHook | None = None, on_micro_batch: ValuesFn | None = None,
                 operand_hook: jax_compat.EqnHook | None = None,
                 micro_batch_eval: Callable[[Sequence[JaxprEqn], dict, jax_compat.EqnHook | None], None]
                 | None = None,
                 stack_sizes: dict[Var, int] | None = None, after_grad: AfterGrad | None = None) -> Callable:
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
      after_grad: computes the outputs that read the full batch (:class:`AfterGrad`); needed when the step
        has any (:func:`full_batch_outputs`).

    Raises:
      ValueError: as :func:`split_at_grad_marker`; ``after_grad`` is missing, or computes other outputs than
        the step reads the full batch in.
    """
    if num_micro_batches == 1:
        def step(*flat):
            return jax_compat.eval_closed_jaxpr(closed, *flat, hook=eqn_hook, operand_hook=operand_hook)
        return step

    split = split_at_grad_marker(closed, batch_mask)
    if split.full_outputs != (after_grad.outputs if after_grad else ()):
        raise ValueError(f"the step's outputs {list(split.full_outputs)} read the full batch after al.grad, but "
                         f"after_grad computes {list(after_grad.outputs) if after_grad else []}: trace the step "
                         "with trace_step(..., num_micro_batches=m), whose after_grad they are")
    jaxpr = closed.jaxpr
    batch_vars = [v for v, b in zip(jaxpr.invars, batch_mask, strict=True) if b]
    m = num_micro_batches
    stack_sizes = stack_sizes or {}
    marker_values = list(split.marker.invars)
    per_example = set(split.per_example)
    if micro_batch_eval is None:
        def micro_batch_eval(eqns, env, micro_operand_hook):
            jax_compat.eval_eqns(eqns, env, hook=eqn_hook, operand_hook=micro_operand_hook)

    def value_of(env, position):
        var = marker_values[position]
        if not isinstance(var, Var):
            return var.val
        if position in per_example and var in stack_sizes:  # a stack of partial sums: its rows are one value
            return jnp.sum(env[var], axis=0)
        return env[var]

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
            summed = [a + value_of(local, p) for a, p in zip(acc, averaged, strict=True)]
            return summed, [value_of(local, p) for p in split.per_example]

        averaged = [p for p in range(len(marker_values)) if p not in per_example]
        stacks = [stack_sizes.get(marker_values[p]) if isinstance(marker_values[p], Var) else None
                  for p in averaged]
        zeros = [jnp.zeros(((d,) if d else ()) + marker_values[p].aval.shape, marker_values[p].aval.dtype)
                 for p, d in zip(averaged, stacks, strict=True)]
        total, rows = jax.lax.scan(body, zeros, (micro_batches, jnp.arange(m, dtype=jnp.uint32)))
        total = [jnp.sum(t, axis=0) if d else t for t, d in zip(total, stacks, strict=True)]
        results = dict(zip(averaged, [t / np.asarray(m, dtype=t.dtype) for t in total], strict=True))
        results.update(zip(split.per_example, [from_micro_batches(r) for r in rows], strict=True))
        marker_env = {v: results[p] for p, v in enumerate(marker_values)}
        jax_compat.eval_eqns([split.marker], marker_env, hook=eqn_hook, operand_hook=operand_hook)
        env.update({v: marker_env[v] for v in split.marker.outvars})
        jax_compat.eval_eqns(split.apply, env, hook=eqn_hook, operand_hook=operand_hook)
        out = [v.val if not isinstance(v, Var) else env.get(v) for v in jaxpr.outvars]
        if after_grad is not None:
            computed = after_grad(flat, [marker_env[v] for v in split.marker.outvars])
            for k, x in zip(after_grad.outputs, computed, strict=True):
                out[k] = x
        return out

    return step
