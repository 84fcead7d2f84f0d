"""Run a backward piece with some gradients kept as stacks of per-shard partial sums, and reduce the stacks.

The analysis and its contract are :mod:`alpa_like.compiler.gradient_sync`. Here: :func:`eval_piece`
evaluates a piece's equations with the contractions it names split (their stack of partial sums laid out
over the mesh axes that split the contracted dim) and the linear equations after them run per partial sum
(``jax.vmap`` over the stack); :func:`step_means` turns the accumulated stacks into the gradients once per
step (one executable per mesh; :func:`reduce_stack` for one stack).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var
from jax.sharding import PartitionSpec

from alpa_like.compiler import jax_compat
from alpa_like.compiler.gradient_sync import (
    DeferredGradients,
    Split,
    split_shape,
    split_spec,
    stack_position,
    stacked_params,
    stacked_spec,
)
from alpa_like.runtime.mesh import named_sharding


def eval_piece(closed: ClosedJaxpr, args: Sequence[Any], deferred: DeferredGradients, mesh, *,
               hook=None, operand_hook=None) -> list[Any]:
    """``closed`` on ``args`` like :func:`~alpa_like.compiler.jax_compat.eval_closed_jaxpr`, except that the
    gradients ``deferred`` names come out as stacks ``(d, *shape)`` of partial sums (see the module
    docstring). ``hook`` / ``operand_hook`` pin layouts (:func:`~alpa_like.runtime.spmd.pin_hook`); the
    hook must give stacked values stacked layouts."""
    jaxpr = closed.jaxpr
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    eval_eqns(jaxpr.eqns, env, deferred, mesh, hook=hook, operand_hook=operand_hook)
    return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]


def eval_eqns(eqns: Sequence[JaxprEqn], env: dict, deferred: DeferredGradients, mesh, *, hook=None,
              operand_hook=None) -> None:
    """:func:`eval_piece` on equations, reading and writing ``env`` (like
    :func:`~alpa_like.compiler.jax_compat.eval_eqns`)."""
    stacked: set[Var] = set()

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in eqns:
        invals = [read(v) for v in eqn.invars]
        if operand_hook is not None:
            invals = operand_hook(eqn, invals)
        split = deferred.sources.get(id(eqn))
        if split is not None:
            outvals = [_partial_sums(eqn, invals, split, mesh)]
        elif id(eqn) in deferred.lifted:
            in_axes = tuple(0 if isinstance(v, Var) and v in stacked else None for v in eqn.invars)
            outvals = jax.vmap(lambda *xs, eqn=eqn: jax_compat.bind_eqn(eqn, xs), in_axes=in_axes)(*invals)
        else:
            outvals = jax_compat.bind_eqn(eqn, invals)
        if split is not None or id(eqn) in deferred.lifted:
            stacked.update(eqn.outvars)
        if hook is not None:
            outvals = hook(eqn, outvals)
        env.update(zip(eqn.outvars, outvals, strict=True))


def _partial_sums(eqn: JaxprEqn, invals: Sequence[Any], split: Split, mesh) -> Any:
    """The contraction ``eqn`` with its split dims cut into ``(stack, rest)``: one partial sum per shard,
    stacked on a leading dim laid out over the shards' mesh axes (no communication)."""
    if eqn.primitive.name == "conv_general_dilated":
        return _conv_partial_sums(eqn, invals, split, mesh)
    ops = list(invals)
    for (k, dim), spec in zip(split.dims, split.specs, strict=True):
        x = jnp.reshape(ops[k], split_shape(ops[k].shape, dim, split.stack))
        ops[k] = jax.lax.with_sharding_constraint(x, named_sharding(mesh, split_spec(spec, dim)))
    if eqn.primitive.name == "scatter-add":  # one scatter per shard of the updates into its own zero table
        in_axes = (None,) + tuple(dim for _, dim in split.dims)
        return jax.vmap(lambda *xs: jax_compat.bind_eqn(eqn, xs)[0], in_axes=in_axes)(*ops)
    params = eqn.primitive.get_bind_params(stacked_params(eqn, split))
    return jnp.moveaxis(eqn.primitive.bind(*ops, **params), stack_position(eqn, split), 0)


def _conv_partial_sums(eqn: JaxprEqn, invals: Sequence[Any], split: Split, mesh) -> Any:
    """A convolution's partial sums, one per shard, each device convolving its own shard (``shard_map``).
    ``jax.vmap`` over the split dims would batch it as a grouped convolution, and XLA's CPU partitioner was
    seen to compute a sharded one wrongly when each group has one feature (one row per device)."""
    names = tuple(mesh.axis_names[a] for a in split.axes)
    in_specs = tuple(spec.to_partition_spec(mesh.axis_names) for spec in split.specs)
    out_spec = PartitionSpec(names, *([None] * len(eqn.outvars[0].aval.shape)))

    def local(lhs, rhs):
        return jax_compat.bind_eqn(eqn, (lhs, rhs))[0][None]
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(*invals)


def reduce_stack(stack: Any, count: int, sharding=None) -> Any:
    """The mean over ``count`` micro-batches of an accumulated stack of partial sums: its sum over the
    leading dim (one all-reduce, or a reduce-scatter when ``sharding`` splits the result over the stack's
    axes) divided by ``count``."""
    (mean,), _ = step_means([stack], (sharding,), [], count)
    return mean


def step_means(stacks: Sequence[Any], shardings: tuple, totals: Sequence[Any], count: int):
    """The means over ``count`` micro-batches of one mesh's accumulated values, in one executable: each of
    ``stacks`` summed over its leading dim (laid out as its entry of ``shardings``, or as XLA chooses for
    None) and divided by ``count``, and each of ``totals`` divided by ``count``. Returns the two lists.

    One executable per mesh and step, not one per gradient: on XLA's CPU devices every executable with a
    collective occupies a host thread per device while it waits for the others, and dozens of small ones
    in flight at once were seen to exhaust the threads and deadlock (a 1-stage, 8-device pipeline)."""
    return _means(tuple(stacks), tuple(totals), count, tuple(shardings))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _means(stacks, totals, count: int, shardings: tuple):
    def mean(x):  # the mean of one micro-batch is its value, of any dtype (an integer count, a key)
        return x if count == 1 else x / jnp.asarray(count, x.dtype)
    reduced = []
    for stack, sharding in zip(stacks, shardings, strict=True):
        total = jnp.sum(stack, axis=0)
        if sharding is not None:
            total = jax.lax.with_sharding_constraint(total, sharding)
        reduced.append(mean(total))
    return reduced, [mean(t) for t in totals]


def stacked_pins(value_pins, deferred: DeferredGradients):
    """``value_pins`` with the values ``deferred`` computes as stacks pinned to their stacked layouts."""
    out = []
    for eqn, k, spec in value_pins:
        axes = deferred.stacked.get(eqn.outvars[k])
        out.append((eqn, k, spec if axes is None else stacked_spec(spec, axes)))
    return out

