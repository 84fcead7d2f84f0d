"""Reduce gradients over a stage's mesh once per step instead of once per micro-batch.

Alpa (dissertation 3.5, gradient accumulation) and Megatron-LM all-reduce the data-parallel gradients once
per iteration, after the last micro-batch; a GSPMD backward piece jitted on its own instead all-reduces its
weight gradients every time it runs, because its outputs must be whole arrays. This module finds, in a
stage's backward piece, the gradients whose all-reduce can wait: a gradient computed by contractions over a
sharded dim (a weight gradient ``x^T dy`` whose batch dim is split over the data axes, a bias gradient
``sum(dy)`` over it), followed only by linear operations (casts, transposes, reshapes, sums of such terms,
products with values that do not depend on them). Each such contraction is rewritten to keep one partial
sum per shard of that dim: the split dim ``n`` becomes ``(d, n / d)``, the ``d`` part a batch dim of the
contraction (its leading output dim), laid out over the mesh axes that split it, so no device exchanges
anything; the linear operations after it run per partial sum (``vmap`` over the leading dim). The piece then
outputs a stack ``(d, *shape)`` of partial sums; the accumulator adds stacks micro-batch after micro-batch,
and the step's mean sums the stack once (one all-reduce or reduce-scatter per gradient per step).

The rewrite is exact algebra (only the order of floating-point additions changes), so it needs no
assumption about the model: batch-coupling layers such as BatchNorm are untouched, since only the final
contractions into gradients are split. A gradient whose computation is anything else keeps its
per-micro-batch all-reduce.

:func:`deferrable_gradients` is the analysis (pure, on jaxpr equations and the ILP's layouts); the runtime
evaluates the rewritten piece (:func:`alpa_like.runtime.pipeshard_runtime` via :func:`split_operand` and
:func:`stacked_params`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jax.extend.core import JaxprEqn, Var

from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.sharding_spec import ShardingSpec

UNARY_LINEAR = frozenset({"convert_element_type", "transpose", "reshape", "neg", "copy", "copy_p", "squeeze",
                          "expand_dims", "reduce_sum", "broadcast_in_dim", "reduce_precision"})
"""Linear in their one operand: applied to each partial sum, they sum to the result on the whole."""
ADDITIVE = frozenset({"add", "add_any", "sub"})
"""Linear when every operand is a stack of partial sums."""
SCALING = frozenset({"mul", "div"})
"""Linear in one operand (``div``: the numerator) when the other does not depend on the partial sums."""


@dataclasses.dataclass(frozen=True)
class Split:
    """How a source contraction keeps its partial sums: operand ``operand``'s dim ``dim`` is split into
    ``(stack, dim_size / stack)`` (for ``dot_general``, one entry per operand)."""

    dims: tuple[tuple[int, int], ...]
    """(operand index, dim) pairs split (both contracting dims of a ``dot_general``; one for ``reduce_sum``)."""
    specs: tuple[ShardingSpec, ...]
    """The layout of each split operand as the contraction reads it."""
    stack: int
    axes: tuple[int, ...]
    """The mesh axes that split those dims: the stack is laid out over them."""


@dataclasses.dataclass(frozen=True)
class DeferredGradients:
    """The rewrite of one backward piece (see the module docstring)."""

    outputs: Mapping[Var, tuple[int, ...]]
    """Gradient values computed as stacks of partial sums -> the mesh axes the stack lies over."""
    sources: Mapping[int, Split]
    """``id(eqn)`` of each contraction kept as partial sums -> its split."""
    lifted: Mapping[int, tuple[int, ...]]
    """``id(eqn)`` of each linear equation run per partial sum -> the mesh axes of its stack."""
    stacked: Mapping[Var, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Every value computed as a stack (sources' and lifted equations' outputs, markers' passed-through
    values) -> the mesh axes of its stack."""

    def __bool__(self) -> bool:
        return bool(self.outputs)


NONE = DeferredGradients(outputs={}, sources={}, lifted={}, stacked={})


def stacked_spec(spec: ShardingSpec, axes: tuple[int, ...]) -> ShardingSpec:
    """The layout of a stack of partial sums of a value laid out as ``spec``: the stack dim over ``axes``,
    the value's dims as in ``spec`` without those axes."""
    return ShardingSpec(axes=(tuple(axes),) + tuple(tuple(a for a in dim if a not in axes) for dim in spec.axes))


def _source_split(eqn: JaxprEqn, spec_of, mesh_shape: tuple[int, ...], is_zero=lambda v: False) -> Split | None:
    """The split of a contraction over a sharded dim, or None when ``eqn`` is not one. ``is_zero(v)``: whether
    ``v`` is known to be all zeros (the table an embedding gradient's ``scatter-add`` starts from)."""
    name = eqn.primitive.name
    if name == "scatter-add":
        dims, specs, axes = _scatter_split(eqn, spec_of, is_zero)
        if dims is None:
            return None
    elif name == "dot_general":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        lhs, rhs = spec_of(eqn, 0), spec_of(eqn, 1)
        if lhs is None or rhs is None:
            return None
        pairs = [(a, b) for a, b in zip(lc, rc) if lhs.axes[a]]
        if len(pairs) != 1:
            return None
        a, b = pairs[0]
        axes = lhs.axes[a]
        if rhs.axes[b] != axes or any(lhs.axes[x] for x in lc if x != a) or any(rhs.axes[x] for x in rc if x != b):
            return None
        dims, specs = ((0, a), (1, b)), (lhs, rhs)
    elif name == "conv_general_dilated":
        dims, specs, axes = _conv_split(eqn, spec_of)
        if dims is None:
            return None
    elif name == "reduce_sum":
        spec = spec_of(eqn, 0)
        if spec is None:
            return None
        sharded = [d for d in eqn.params["axes"] if spec.axes[d]]
        if len(sharded) != 1:
            return None
        axes = spec.axes[sharded[0]]
        dims, specs = ((0, sharded[0]),), (spec,)
    else:
        return None
    stack = math.prod(mesh_shape[x] for x in axes)
    if stack == 1:
        return None
    for k, dim in dims:
        if eqn.invars[k].aval.shape[dim] % stack:
            return None
    return Split(dims=dims, specs=specs, stack=stack, axes=tuple(axes))


def _conv_split(eqn: JaxprEqn, spec_of):
    """A convolution contracting a feature dim split over mesh axes, with nothing else split (a weight
    gradient: JAX puts the batch in the feature dims of ``x`` and ``dy``): the (lhs, rhs) feature dims, their
    specs and the axes; ``(None, None, None)`` otherwise."""
    if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
        return None, None, None
    lhs, rhs = spec_of(eqn, 0), spec_of(eqn, 1)
    if lhs is None or rhs is None:
        return None, None, None
    dn = eqn.params["dimension_numbers"]
    a, b = dn.lhs_spec[1], dn.rhs_spec[1]
    axes = lhs.axes[a]
    others = [x for d, x in enumerate(lhs.axes) if d != a] + [x for d, x in enumerate(rhs.axes) if d != b]
    if not axes or rhs.axes[b] != axes or any(others):
        return None, None, None
    return ((0, a), (1, b)), (lhs, rhs), axes


def _scatter_split(eqn: JaxprEqn, spec_of, is_zero):
    """A ``scatter-add`` of updates split over mesh axes along one scatter dim into a table of zeros: the
    (indices dim, updates dim) pair, their specs and the axes; ``(None, None, None)`` otherwise. Indices of
    no known layout (replicated, e.g. positions from an ``iota``) are sliced like the updates, for free."""
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = eqn.invars
    idx, upd = spec_of(eqn, 1), spec_of(eqn, 2)
    if upd is None or not is_zero(operand) or dn.operand_batching_dims:
        return None, None, None
    scatter_dims = [u for u in range(len(updates.aval.shape)) if u not in dn.update_window_dims]
    pairs = [(t, u) for t, u in zip(range(len(indices.aval.shape) - 1), scatter_dims) if upd.axes[u]]
    if len(pairs) != 1:
        return None, None, None
    t, u = pairs[0]
    axes = upd.axes[u]
    if idx is None:
        idx = ShardingSpec(axes=tuple(axes if d == t else () for d in range(len(indices.aval.shape))))
    if idx.axes[t] != axes or any(upd.axes[w] for w in dn.update_window_dims):
        return None, None, None
    return ((1, t), (2, u)), (idx, upd), axes


def deferrable_gradients(eqns: Sequence[JaxprEqn], gradients: Sequence[Var], outputs: Sequence[Var],
                         var_specs: Mapping[Var, ShardingSpec], operand_specs: Mapping[tuple[int, int], ShardingSpec],
                         mesh_shape: tuple[int, ...], before: Sequence[JaxprEqn] = ()) -> DeferredGradients:
    """Which of ``gradients`` (outputs of the piece ``eqns``) can be computed as stacks of partial sums.

    Args:
      eqns: the piece's equations, in order.
      gradients: its outputs that are accumulated over micro-batches and only read after the step's mean.
      outputs: all its outputs (a value on the way to a gradient that is also an output, or is read by an
        equation outside the way, keeps the gradient whole).
      var_specs: the ILP's layout of values (where produced or received).
      operand_specs: ``(id(eqn), operand) -> spec`` as heavy operators read them (the operand pins).
      mesh_shape: the stage's logical mesh.
      before: equations computed before the piece whose outputs it reads (hoisted out of the micro-batch
        loop); only tables of zeros are looked up there.
    """
    producer = {v: e for e in eqns for v in e.outvars}
    made_before = {v: e for e in before for v in e.outvars}
    readers: dict[Var, list[JaxprEqn]] = {}
    for e in eqns:
        for v in e.invars:
            if isinstance(v, Var):
                readers.setdefault(v, []).append(e)
    output_set = set(outputs)

    def spec_of(eqn, k):
        return operand_specs.get((id(eqn), k)) or var_specs.get(eqn.invars[k])

    def is_zero(v) -> bool:
        """A broadcast of the literal 0 (how the transpose of a gather starts its table)."""
        e = (producer.get(v) or made_before.get(v)) if isinstance(v, Var) else None
        return (e is not None and e.primitive.name == "broadcast_in_dim" and not isinstance(e.invars[0], Var)
                and np.all(np.asarray(e.invars[0].val) == 0))

    found_outputs, found_sources, found_lifted, found_values, claimed = {}, {}, {}, {}, set()
    for g in gradients:
        sources: dict[int, Split] = {}
        lifted: set[int] = set()
        passed: set[int] = set()  # markers the stack passes through
        members: set[Var] = set()  # values computed as stacks

        def visit(v) -> bool:
            """Whether ``v`` can be computed as a stack (recording how)."""
            if not isinstance(v, Var) or v not in producer:
                return False
            if v in members:
                return True
            eqn = producer[v]
            split = _source_split(eqn, spec_of, mesh_shape, is_zero)
            if split is not None:
                sources[id(eqn)] = split
                members.update(eqn.outvars)
                return True
            name = eqn.primitive.name
            if is_marker(eqn):  # identity, position by position: the stack passes through
                ok = visit(eqn.invars[eqn.outvars.index(v)])
                if ok:
                    members.add(v)
                    passed.add(id(eqn))
                return ok
            if len(eqn.outvars) != 1:
                return False
            if name in UNARY_LINEAR:
                ok = visit(eqn.invars[0])
            elif name in ADDITIVE:
                ok = all(visit(x) for x in eqn.invars)
            elif name in SCALING:
                k = 0 if name == "div" else next((i for i, x in enumerate(eqn.invars)
                                                  if isinstance(x, Var) and x in producer
                                                  and _reaches_source(x, producer, spec_of, mesh_shape, is_zero)),
                          None)
                ok = k is not None and visit(eqn.invars[k]) and not _depends(eqn.invars[1 - k], members, producer)
            elif name == "scatter-add" and is_zero(eqn.invars[0]):  # into zeros, it is linear in the updates
                ok = visit(eqn.invars[2]) and not _depends(eqn.invars[1], members, producer)
            else:
                ok = False
            if ok:
                lifted.add(id(eqn))
                members.add(v)
            return ok

        if not visit(g):
            continue
        chain = {id(producer[v]) for v in members} | passed
        # Every value on the way is read only on the way; the gradient only by the piece's outputs.
        inside = not readers.get(g) and all(
            v is g or (v not in output_set and all(id(r) in chain for r in readers.get(v, ()))) for v in members)
        axes = {s.axes for s in sources.values()}
        if not inside or len(axes) != 1 or (chain - passed) & claimed:
            continue
        claimed |= chain - passed  # a marker passes each position on its own
        found_outputs[g] = axes = axes.pop()
        found_sources.update(sources)
        found_lifted.update(dict.fromkeys(lifted, axes))
        found_values.update(dict.fromkeys(members, axes))
    return DeferredGradients(outputs=found_outputs, sources=found_sources, lifted=found_lifted,
                             stacked=found_values)


def _reaches_source(v: Var, producer, spec_of, mesh_shape, is_zero) -> bool:
    """Whether some contraction over a sharded dim is an ancestor of ``v`` through linear equations."""
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if not isinstance(x, Var) or x in seen or x not in producer:
            continue
        seen.add(x)
        eqn = producer[x]
        if _source_split(eqn, spec_of, mesh_shape, is_zero) is not None:
            return True
        if eqn.primitive.name in UNARY_LINEAR | ADDITIVE | SCALING:
            stack.extend(eqn.invars)
        elif is_marker(eqn):
            stack.append(eqn.invars[eqn.outvars.index(x)])
    return False


def _depends(v, members: set[Var], producer) -> bool:
    """Whether ``v`` is (computed from) one of ``members``."""
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if not isinstance(x, Var) or x in seen:
            continue
        if x in members:
            return True
        seen.add(x)
        if x in producer:
            stack.extend(producer[x].invars)
    return False


def split_shape(shape: Sequence[int], dim: int, stack: int) -> tuple[int, ...]:
    """``shape`` with ``dim`` split into ``(stack, shape[dim] // stack)``."""
    return tuple(shape[:dim]) + (stack, shape[dim] // stack) + tuple(shape[dim + 1:])


def split_spec(spec: ShardingSpec, dim: int) -> ShardingSpec:
    """The layout of an operand after :func:`split_shape`: the stack part keeps the dim's axes."""
    return ShardingSpec(axes=spec.axes[:dim] + (spec.axes[dim], ()) + spec.axes[dim + 1:])


def stacked_params(eqn: JaxprEqn, split: Split) -> dict:
    """The parameters of the source ``eqn`` applied to its split operands, producing the stack of partial
    sums as the leading output dim."""
    params = dict(eqn.params)
    if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        (_, a), (_, b) = split.dims

        def shift(dims, at):
            return tuple(x + 1 if x > at else x for x in dims)
        lc2 = tuple(x + 1 if x == a else x for x in shift(lc, a))
        rc2 = tuple(x + 1 if x == b else x for x in shift(rc, b))
        params["dimension_numbers"] = ((lc2, rc2), ((a,) + shift(lb, a), (b,) + shift(rb, b)))
        return params
    (_, r), = split.dims
    axes = tuple(x + 1 if x >= r else x for x in params["axes"])  # the stack part (dim r) is kept
    params["axes"] = axes
    return params


def stack_position(eqn: JaxprEqn, split: Split) -> int:
    """Where the stack dim lands in the output of :func:`stacked_params`'s contraction (moved to 0 after)."""
    if eqn.primitive.name in ("dot_general", "scatter-add"):
        return 0
    (_, r), = split.dims
    return r - sum(1 for x in eqn.params["axes"] if x < r)
