"""Is the loss that ``al.grad`` differentiates a sum over the batch dim?

With ``num_micro_batches = m > 1`` the step averages what :func:`alpa_like.grad` returns over the
micro-batches. For a loss that is a mean over the examples that is the full-batch value; for a loss that
adds the examples up (``jnp.sum(per_example)``) the average is ``1/m`` of the full-batch sum, and so are the
gradients. :func:`batch_sums` finds the second kind in a traced step, conservatively: it reports a loss
only when it can see the sum.

The loss itself is often gone from the step jaxpr (``al.grad`` drops it), but its backward pass is there,
and it starts with the derivative of the loss's last reductions. Reverse mode seeds the loss's cotangent
with the constant ``1.0``; transposing the loss's tail turns each ``reduce_sum`` into a ``broadcast_in_dim``
of that constant and each division by a constant into a division of it. So the cotangent stays a known
constant array until it meets the first value that the loss computed from its inputs, where the backward
pass *exits* the constant part:

* ``jnp.sum(l)``: ``broadcast_in_dim 1.0`` -> exit into ``l``'s backward with cotangent 1 per example;
* ``jnp.mean(l)``, ``jnp.sum(l) / l.shape[0]``: ``div 1.0 B`` -> broadcast -> exit with cotangent ``1/B``.

An exit is a sum over the batch when the value it meets still carries the batch split of the batch inputs
(:func:`~alpa_like.compiler.propagation.follow_layouts` from the batch leaves split on dim 0), i.e. is
per-example, and the constant was not divided by a multiple of the micro-batch's rows (nor multiplied by
the inverse of one) before the broadcast that gave it the batch dim: a mean over the examples divides
before it, ``jnp.mean(token_losses, -1)`` summed over the examples divides after it. Divisions by
anything computed (``jnp.sum(mask)``), reductions other than sums (``max``) and exits into a call or a
loop (``scan``, ``checkpoint``: their bodies may divide) end the search without a finding, and so do
divisors that merely happen to be multiples of the rows where the dims cannot be followed (a reshape).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.propagation import follow_layouts
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.trace import TracedStep

_LINEAR = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose", "convert_element_type",
                     "reduce_precision", "copy", "copy_p", "neg", "reduce_sum", "mul", "div", "add", "add_any",
                     "sub"})
"""Primitives through which a constant cotangent stays a known constant (the transposes of a loss's tail)."""


@dataclasses.dataclass(frozen=True)
class BatchSum:
    """One place where the loss adds up per-example values: the backward pass gives them cotangent
    ``scale`` each, a constant independent of the number of rows."""

    shape: tuple[int, ...]
    """Shape of the per-example values (one micro-batch's rows in the batch dim)."""
    scale: float
    """d loss / d value, per element."""
    where: str
    """The equation that reads the cotangent: ``name_stack/primitive``."""


@dataclasses.dataclass(frozen=True)
class _Cotangent:
    """A cotangent of the loss that is a known constant array.

    ``dims[i]`` tells whether a division by a multiple of the number of rows came before dim ``i`` appeared
    (a broadcast: the transpose of a reduction over that dim), i.e. whether the loss may average over it;
    ``dims`` is None where the dims could not be followed (a reshape). ``normalized``: whether such a
    division came anywhere on the way."""

    value: float
    normalized: bool
    dims: tuple[bool, ...] | None


_SEED = _Cotangent(value=1.0, normalized=False, dims=())


def batch_sums(closed: ClosedJaxpr, batch_mask: Sequence[bool]) -> tuple[BatchSum, ...]:
    """The per-example values that the loss of the step's single ``al.grad`` call provably sums over the
    batch dim (module docstring); empty when it cannot tell, or when the step has no single grad marker.

    Args:
      closed: a flat step jaxpr (nested calls inlined), traced for one micro-batch.
      batch_mask: per invar, True for a batch leaf (dim 0 is the batch).
    """
    markers = [i for i, e in enumerate(closed.jaxpr.eqns) if is_marker(e, "grad")]
    batch_vars = [v for v, b in zip(closed.jaxpr.invars, batch_mask, strict=True) if b and v.aval.shape]
    rows = {v.aval.shape[0] for v in batch_vars}
    if len(markers) != 1 or len(rows) != 1 or min(rows) < 2:  # one row: a sum is a mean
        return ()
    eqns, consts = closed.jaxpr.eqns[:markers[0]], _scalar_consts(closed)
    exits = [(eqn, operand, ct) for eqn, operand, ct in _constant_cotangent_exits(eqns, consts, min(rows))
             if not ct.normalized or ct.dims is not None and not all(ct.dims)]  # else averaged over every dim
    if not exits:
        return ()
    split = {v: ShardingSpec(axes=((0,),) + ((),) * (len(v.aval.shape) - 1)) for v in batch_vars}
    layouts = follow_layouts(eqns, split, (min(rows),))
    found: dict[tuple, BatchSum] = {}
    for eqn, operand, cotangent in exits:
        if _sums_the_batch(eqn, operand, cotangent, layouts):
            shape = tuple(operand.aval.shape)
            where = f"{jax_compat.name_stack(eqn)}/{eqn.primitive.name}".lstrip("/")
            found.setdefault((shape, where), BatchSum(shape=shape, scale=cotangent.value, where=where))
    return tuple(found.values())


def _sums_the_batch(eqn: JaxprEqn, operand, cotangent: _Cotangent, layouts: dict[Var, ShardingSpec]) -> bool:
    """Whether the constant ``cotangent`` that ``eqn`` reads as ``operand`` meets a per-example value (one
    that keeps the batch split) and no division by a multiple of the rows came before the batch dim
    appeared; where ``eqn`` does not line the batch dim up with ``operand``'s (a contraction, or dims not
    followed), before none anywhere on the way."""
    shape = tuple(operand.aval.shape)
    per_example = [v for v in jax_compat.eqn_inputs(eqn) if v is not operand and v in layouts and any(layouts[v].axes)]
    if not per_example:
        return False
    aligned = [v for v in per_example if tuple(v.aval.shape) == shape]
    if cotangent.dims is None or not aligned:
        return not cotangent.normalized
    batch_dims = {d for v in aligned for d, axes in enumerate(layouts[v].axes) if axes}
    return any(not cotangent.dims[d] for d in batch_dims)


def _in_outer_backward(eqn: JaxprEqn) -> bool:
    """True for an equation of the outermost ``jax.grad``'s backward pass: its name stack, after the user's
    scopes, is ``transpose(jvp(...))`` with no other transform inside (a nested grad's backward has more)."""
    transforms = [(type(entry).__name__ == "Transform", getattr(entry, "name", None))
                  for entry in eqn.source_info.name_stack.stack]
    first = next((i for i, (is_transform, _) in enumerate(transforms) if is_transform), None)
    if first is None or transforms[first:first + 2] != [(True, "transpose"), (True, "jvp")]:
        return False
    return not any(is_transform for is_transform, _ in transforms[first + 2:])


def _scalar_consts(closed: ClosedJaxpr) -> dict[Var, float]:
    """The closed-over real scalar constants of ``closed`` and their values."""
    values = {v: _real_scalar(c) for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)}
    return {v: x for v, x in values.items() if x is not None}


def _real_scalar(value) -> float | None:
    """``value`` as a float when it is a real (integer or floating) scalar; None otherwise."""
    dtype = getattr(value, "dtype", None)
    try:
        real = np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)
    except TypeError:  # an extended dtype (a PRNG key)
        return None
    return float(np.asarray(value)) if real and np.shape(value) == () else None


def _constant_cotangent_exits(eqns: Sequence[JaxprEqn], consts: dict[Var, float],
                              rows: int) -> list[tuple[JaxprEqn, Any, _Cotangent]]:
    """(equation, operand, cotangent) where a constant cotangent of the outermost grad's loss meets a value
    the loss computed, in equation order.

    A transpose is linear in its cotangent: the values it meets are the forward pass's, never other
    cotangents (except where the backward pass adds cotangents up, ``add_any``). So a constant that meets a
    cotangent is no seed (``jnp.ones_like(g)`` in a ``custom_vjp`` rule)."""
    known: dict[Var, _Cotangent] = {}
    from_seed: set[Var] = set()
    exits = []
    for eqn in eqns:
        carried = _cotangent_operands(eqn, known, consts)
        if is_marker(eqn):  # the identity: each operand passes through to its result
            known.update({eqn.outvars[k]: c for k, c in carried.items()})
            from_seed.update(out for k, (v, out) in enumerate(zip(eqn.invars, eqn.outvars, strict=True))
                             if k in carried or isinstance(v, Var) and v in from_seed)
            continue
        if carried or any(v in from_seed for v in jax_compat.eqn_inputs(eqn)):
            from_seed.update(eqn.outvars)
        if not carried:
            continue
        others = [_scalar(v, consts) for k, v in enumerate(eqn.invars) if k not in carried]
        if eqn.primitive.name in _LINEAR and all(c is not None for c in others):
            result = _transfer(eqn, carried, others, rows)
            if result is not None:
                known[eqn.outvars[0]] = result
            continue
        if jax_compat.nested_jaxprs(eqn):  # a call or a loop: its body may still divide
            continue
        met = [v for k, v in enumerate(eqn.invars) if k not in carried and isinstance(v, Var)]
        if eqn.primitive.name != "add_any" and any(v in from_seed for v in met):
            continue
        exits += [(eqn, eqn.invars[k], c) for k, c in carried.items()]
    return exits


def _cotangent_operands(eqn: JaxprEqn, known: dict[Var, _Cotangent],
                        consts: dict[Var, float]) -> dict[int, _Cotangent]:
    """Operand position -> constant cotangent that ``eqn`` reads: the known ones, or the seed ``1.0`` where
    ``eqn`` starts the outermost grad's backward pass (it reads that literal and nothing computed)."""
    carried = {k: known[v] for k, v in enumerate(eqn.invars) if isinstance(v, Var) and v in known}
    if carried or not _in_outer_backward(eqn):
        return carried
    if not all(isinstance(v, Literal) or v in consts for v in eqn.invars):
        return {}
    seed = next((k for k, v in enumerate(eqn.invars) if isinstance(v, Literal) and _real_scalar(v.val) == 1.0
                 and np.issubdtype(np.asarray(v.val).dtype, np.floating)), None)
    return {} if seed is None else {seed: _SEED}


def _scalar(v, consts: dict[Var, float]) -> float | None:
    """The value of a real scalar constant operand (a literal or a closed-over constant); None otherwise."""
    if isinstance(v, Literal):
        return _real_scalar(np.asarray(v.val))
    return consts.get(v)


def _counts_rows(factor: float, rows: int) -> bool:
    """True when dividing by ``factor`` may normalize by the number of examples: ``|factor|`` is a whole
    multiple of ``rows`` (a mean over the batch, or over the batch and other dims)."""
    n = abs(factor)
    return n >= rows and math.isclose(n, round(n), rel_tol=1e-6) and round(n) % rows == 0


def _transfer(eqn: JaxprEqn, carried: dict[int, _Cotangent], others: Sequence[float],
              rows: int) -> _Cotangent | None:
    """The constant cotangent ``eqn`` (a ``_LINEAR`` primitive) computes from ``carried`` ones and scalar
    constants ``others``; None where it is no transpose of a loss's tail (e.g. a product of two cotangents)."""
    name = eqn.primitive.name
    if name in ("add", "add_any", "sub"):
        return None if others else _added(carried, negate_second=name == "sub")
    if len(carried) != 1:
        return None
    (position, ct), = carried.items()
    if name in ("mul", "div"):
        factor = others[0] if name == "div" else 1.0 / others[0] if others[0] else 0.0
        if position != 0 and name == "div":
            return None
        return dataclasses.replace(ct, value=ct.value / factor if factor else 0.0,
                                   normalized=ct.normalized or _counts_rows(factor, rows))
    if others:
        return None
    if name == "neg":
        return dataclasses.replace(ct, value=-ct.value)
    if name == "reduce_sum":
        axes = eqn.params["axes"]
        count = math.prod(eqn.invars[0].aval.shape[a] for a in axes)
        dims = None if ct.dims is None else tuple(f for d, f in enumerate(ct.dims) if d not in axes)
        return dataclasses.replace(ct, value=ct.value * count, dims=dims)
    return dataclasses.replace(ct, dims=_moved_dims(eqn, ct))


def _added(carried: dict[int, _Cotangent], negate_second: bool) -> _Cotangent:
    """The sum (or difference) of constant cotangents: normalized only where all of them are."""
    cts = list(carried.values())
    signs = [-1.0 if negate_second and k == 1 else 1.0 for k in carried]
    same_rank = len({None if c.dims is None else len(c.dims) for c in cts}) == 1 and cts[0].dims is not None
    dims = tuple(all(flags) for flags in zip(*(c.dims for c in cts))) if same_rank else None
    return _Cotangent(value=sum(s * c.value for s, c in zip(signs, cts)),
                      normalized=all(c.normalized for c in cts), dims=dims)


def _moved_dims(eqn: JaxprEqn, ct: _Cotangent) -> tuple[bool, ...] | None:
    """``ct.dims`` as the shape-changing ``eqn`` rearranges them; a dim a broadcast adds (or widens from 1)
    appears now, after whatever divisions ``ct`` went through."""
    name, rank = eqn.primitive.name, len(eqn.outvars[0].aval.shape)
    if ct.dims is None:
        return None
    if name == "broadcast_in_dim":
        source = {out: d for d, out in enumerate(eqn.params["broadcast_dimensions"])}
        in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        return tuple(ct.dims[source[i]] if i in source and in_shape[source[i]] == out_shape[i] else ct.normalized
                     for i in range(rank))
    if name == "transpose":
        return tuple(ct.dims[d] for d in eqn.params["permutation"])
    if name == "squeeze":
        dropped = {d % len(ct.dims) for d in eqn.params["dimensions"]}
        return tuple(f for d, f in enumerate(ct.dims) if d not in dropped)
    if name in ("convert_element_type", "reduce_precision", "copy", "copy_p"):
        return ct.dims
    return None  # a reshape: which dim went where is not followed


def micro_batches_traced(traced: TracedStep) -> int:
    """The number of micro-batches ``traced`` was traced for: its batch leaves' rows over the jaxpr's
    (:func:`~alpa_like.compiler.trace.trace_step` traces one micro-batch); 1 without batch leaves."""
    for leaf, var in zip(traced.in_leaves, traced.closed_jaxpr.jaxpr.invars, strict=True):
        if leaf.is_batch and leaf.shape and var.aval.shape[0]:
            return leaf.shape[0] // var.aval.shape[0]
    return 1


def batch_sum_warnings(traced: TracedStep) -> tuple[str, ...]:
    """A warning when ``traced`` runs in micro-batches and the loss of its ``al.grad`` call is a sum over
    the batch dim (:func:`batch_sums`): what the step computes then, and what to do."""
    m = micro_batches_traced(traced)
    if m == 1:
        return ()
    sums = batch_sums(traced.closed_jaxpr, [leaf.is_batch for leaf in traced.in_leaves])
    if not sums:
        return ()
    shapes = ", ".join(sorted({str(s.shape) for s in sums}))
    return (f"with num_micro_batches={m}, the loss that al.grad / al.value_and_grad differentiates adds up "
            f"per-example values over the batch dim (shapes {shapes} per micro-batch) instead of averaging them: "
            f"the step averages al.grad's loss, aux and gradients over the {m} micro-batches, so it computes "
            f"1/{m} of the full-batch sum and of its gradients. Divide the loss by the batch size (a mean over "
            f"the examples), or scale the learning rate by {m}, or use num_micro_batches=1 "
            "(docs/micro-batches.md)",)
