"""Spec propagation through computationally trivial operators (dissertation §3.4.2, "merge").

"We merge computationally-trivial operators, such as element-wise operators, transpose, and reduction, into
one of their operands and propagate the sharding spec from the operand." A *follow rule* does the
propagation: given the spec of the operand the operator is merged into, it returns the one
:class:`Strategy` the operator then uses: its output specs, the specs it needs from every operand, and the
collectives it performs (an all-reduce when a reduction runs over a sharded dim).

Where a spec cannot pass through (a reshape that would need a strided layout, a slice of a sharded dim, a
sort along a sharded dim) the rule asks for the operand with those mesh axes removed; the graph pass then
charges the all-gather of Table 3.2 for that resharding, so the cost stays exact.

Each rule is two small pure functions in a :class:`FollowRule`: ``candidates(eqn)`` lists the operand
positions the operator may be merged into, ``derive(eqn, pos, spec, ctx)`` builds the strategy.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from jax.extend.core import JaxprEqn, Literal, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.strategies import (
    ROOT_LOOPS,
    Collective,
    Strategy,
    StrategyContext,
    loop_strategies,
    make_spec,
    make_strategy,
    nbytes,
    replicated,
    shards,
)

ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "clz", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq",
    "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma", "igammac", "imag",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne",
    "neg", "nextafter", "not", "or", "polygamma", "population_count", "pow", "real", "reduce_precision", "rem",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin",
    "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "optimization_barrier",
    "bitcast_convert_type", "sharding_constraint", "reshard",
})
"""Operators applied element by element to operands of one shape (scalars broadcast); a
``bitcast_convert_type`` between types of different widths changes the shape and is not merged (replicated).
A user's ``with_sharding_constraint`` (and the ``reshard`` of its backward) is an identity here: the ILP
chooses its layout like any other value's."""

SUM_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                            "reduce_xor"})
"""Reductions whose partial results over a sharded dim combine with one all-reduce."""

ARG_REDUCTIONS = frozenset({"argmax", "argmin"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
WINDOWED = frozenset({"reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window"})


def unshard(spec: ShardingSpec, dims: Sequence[int]) -> ShardingSpec:
    """``spec`` with the given dims replicated."""
    drop = set(dims)
    return make_spec([() if d in drop else a for d, a in enumerate(spec.axes)])


def fit(spec: ShardingSpec, shape: Sequence[int], mesh_shape: tuple[int, ...]) -> ShardingSpec:
    """``spec`` with the axes of every dim that they would not divide evenly removed."""
    return make_spec([a if size % math.prod(mesh_shape[x] for x in a) == 0 else ()
                      for size, a in zip(shape, spec.axes)])


def _specs_for(eqn: JaxprEqn, spec_of_shape: Callable[[tuple[int, ...]], ShardingSpec | None]):
    """Operand specs: None for literals, ``spec_of_shape(shape)`` for the rest."""
    return tuple(None if isinstance(v, Literal) else spec_of_shape(tuple(v.aval.shape)) for v in eqn.invars)


def _same_shape_as_output(eqn: JaxprEqn) -> tuple[int, ...]:
    """Operands of the output's shape; when there is none (``(b, s, 1) * (1, 1, h)``, as in LayerNorm's
    ``rsqrt(var) * scale``), the operands of the output's rank that broadcast to it."""
    shape = tuple(eqn.outvars[0].aval.shape)
    same = tuple(p for p, v in enumerate(eqn.invars) if not isinstance(v, Literal) and tuple(v.aval.shape) == shape)
    if same:
        return same
    return tuple(p for p, v in enumerate(eqn.invars) if not isinstance(v, Literal) and len(v.aval.shape) == len(shape)
                 and all(n in (1, m) for n, m in zip(v.aval.shape, shape)))


def _all_vars(eqn: JaxprEqn) -> tuple[int, ...]:
    return tuple(p for p, v in enumerate(eqn.invars) if not isinstance(v, Literal))


def _first_var(eqn: JaxprEqn) -> tuple[int, ...]:
    return tuple(p for p, v in enumerate(eqn.invars[:1]) if not isinstance(v, Literal))


def _uniform(eqn: JaxprEqn, name: str, out_spec: ShardingSpec, in_spec: ShardingSpec, ctx: StrategyContext,
             collectives=()) -> Strategy:
    """Operands of the main operand's rank get ``in_spec``, lower-rank ones R; outputs of the output rank
    get ``out_spec``."""
    rank = len(in_spec.axes)

    def operand_spec(shape):
        return in_spec if len(shape) == rank else replicated(len(shape))
    outs = tuple(out_spec if len(v.aval.shape) == len(out_spec.axes) else replicated(len(v.aval.shape))
                 for v in eqn.outvars)
    return make_strategy(name, outs, _specs_for(eqn, operand_spec), collectives, ctx)


# -------------------------------------------------------------------------------------------- derive rules

def derive_elementwise(eqn, pos, spec, ctx):
    """Output and every same-shape operand take the followed operand's spec; size-1 dims of an operand
    that broadcasts against the others, and scalars, are R."""
    shape = tuple(eqn.outvars[0].aval.shape)
    followed = tuple(eqn.invars[pos].aval.shape)
    if followed != shape:  # a broadcasting operand: its size-1 dims carry no axes into the output
        spec = make_spec([a if n == m else () for a, n, m in zip(spec.axes, followed, shape)])
    spec = fit(spec, shape, ctx.mesh.shape)

    def operand_spec(s):
        if s == shape:
            return spec
        if len(s) == len(shape):
            return make_spec([a if n == m else () for a, n, m in zip(spec.axes, s, shape)])
        return replicated(len(s))
    ins = _specs_for(eqn, operand_spec)
    outs = tuple(spec if tuple(v.aval.shape) == shape else replicated(len(v.aval.shape)) for v in eqn.outvars)
    return make_strategy(f"follow {spec}", outs, ins, (), ctx)


def derive_reduction(eqn, pos, spec, ctx):
    """Reduced dims drop out of the spec; a sharded reduced dim leaves partial results: all-reduce them."""
    axes = tuple(eqn.params["axes"])
    out_aval = eqn.outvars[0].aval
    out_spec = make_spec([a for d, a in enumerate(spec.axes) if d not in axes])
    reduce_axes = tuple(sorted(x for d in axes for x in spec.axes[d]))
    collectives = []
    if reduce_axes:
        local = nbytes(out_aval) / shards(out_spec, ctx.mesh.shape)
        collectives.append(Collective(kind="all-reduce", axes=reduce_axes, num_bytes=local))
    return _uniform(eqn, f"follow {spec}", out_spec, spec, ctx, collectives)


def derive_arg_reduction(eqn, pos, spec, ctx):
    """argmax/argmin need the reduced dims whole."""
    axes = tuple(eqn.params["axes"])
    spec = unshard(spec, axes)
    out_spec = make_spec([a for d, a in enumerate(spec.axes) if d not in axes])
    return _uniform(eqn, f"follow {spec}", out_spec, spec, ctx)


def derive_broadcast(eqn, pos, spec, ctx):
    """Operand dim ``i`` keeps its axes at output dim ``broadcast_dimensions[i]``; new dims are R."""
    out_shape = eqn.params["shape"]
    dims = eqn.params["broadcast_dimensions"]
    in_shape = eqn.invars[0].aval.shape
    out_axes = [()] * len(out_shape)
    in_axes = list(spec.axes)
    for i, d in enumerate(dims):
        if in_shape[i] == out_shape[d]:
            out_axes[d] = spec.axes[i]
        else:
            in_axes[i] = ()
    in_spec = make_spec(in_axes)
    return make_strategy(f"follow {in_spec}", (make_spec(out_axes),),
                         (in_spec,) + _specs_for(eqn, lambda s: replicated(len(s)))[1:], (), ctx)


def reshape_axes(in_shape: Sequence[int], out_shape: Sequence[int], spec: ShardingSpec,
                 mesh_shape: tuple[int, ...]) -> tuple[list, list]:
    """(operand axes kept, output axes) of a reshape.

    A sharded operand dim ``d`` moves to output dim ``e`` when both start at the same offset of the
    row-major flattening (``prod(in_shape[:d]) == prod(out_shape[:e])``) and its shards divide
    ``out_shape[e]``: the contiguous chunks are then the same elements. Otherwise the longest major prefix
    of its axes that does is kept and the rest is gathered.
    """
    in_axes = [()] * len(in_shape)
    out_axes = [()] * len(out_shape)
    out_prefix = {}
    running = 1
    for e, size in enumerate(out_shape):
        if size > 1:
            out_prefix.setdefault(running, e)
        running *= size
    running = 1
    for d, size in enumerate(in_shape):
        axes = spec.axes[d]
        e = out_prefix.get(running)
        running *= size
        if not axes or e is None:
            continue
        for keep in range(len(axes), 0, -1):
            n = math.prod(mesh_shape[a] for a in axes[:keep])
            if out_shape[e] % n == 0:
                in_axes[d] = out_axes[e] = axes[:keep]
                break
    return in_axes, out_axes


def derive_reshape(eqn, pos, spec, ctx):
    in_shape = eqn.invars[0].aval.shape
    out_shape = eqn.outvars[0].aval.shape
    in_axes, out_axes = reshape_axes(in_shape, out_shape, spec, ctx.mesh.shape)
    in_spec = make_spec(in_axes)
    return make_strategy(f"follow {in_spec}", (make_spec(out_axes),),
                         (in_spec,) + _specs_for(eqn, lambda s: replicated(len(s)))[1:], (), ctx)


def derive_squeeze(eqn, pos, spec, ctx):
    dims = {d % len(spec.axes) for d in eqn.params["dimensions"]}
    spec = unshard(spec, dims)
    return make_strategy(f"follow {spec}", (make_spec([a for d, a in enumerate(spec.axes) if d not in dims]),),
                         (spec,), (), ctx)


def derive_transpose(eqn, pos, spec, ctx):
    perm = eqn.params["permutation"]
    return make_strategy(f"follow {spec}", (make_spec([spec.axes[p] for p in perm]),), (spec,), (), ctx)


def _unsharded_dims_rule(dims_of: Callable[[JaxprEqn], Sequence[int]]):
    """A rule that keeps the followed spec except on ``dims_of(eqn)``, which must be whole."""
    def derive(eqn, pos, spec, ctx):
        # Dims outside dims_of(eqn) have the same size in every operand and output of these operators.
        spec = fit(unshard(spec, dims_of(eqn)), eqn.outvars[0].aval.shape, ctx.mesh.shape)
        return _uniform(eqn, f"follow {spec}", spec, spec, ctx)
    return derive


def _sliced_dims(eqn):
    shape = eqn.invars[0].aval.shape
    starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params.get("strides") or (1,) * len(shape)
    return [d for d in range(len(shape)) if (starts[d], limits[d], strides[d]) != (0, shape[d], 1)]


def _padded_dims(eqn):
    return [d for d, cfg in enumerate(eqn.params["padding_config"]) if any(int(c) != 0 for c in cfg)]


def _partial_dims(eqn):
    shape = eqn.invars[0].aval.shape
    return [d for d, n in enumerate(eqn.params["slice_sizes"]) if n != shape[d]]


def _update_dims(eqn):
    operand, update = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    return [d for d in range(len(operand)) if operand[d] != update[d]]


def _window_dims(eqn):
    p = eqn.params
    n = len(p["window_dimensions"])
    pads = p.get("padding") or ((0, 0),) * n
    base = p.get("base_dilation") or (1,) * n
    win = p.get("window_dilation") or (1,) * n
    return [d for d in range(n) if p["window_dimensions"][d] > 1 or p["window_strides"][d] > 1
            or tuple(pads[d]) != (0, 0) or base[d] > 1 or win[d] > 1]


def _axis_param(name):
    def dims(eqn):
        rank = len(eqn.invars[0].aval.shape)
        return [eqn.params[name] % rank] if rank else []
    return dims


def _top_k_dims(eqn):
    rank = len(eqn.invars[0].aval.shape)
    return [eqn.params.get("axis", rank - 1) % rank]


class FollowRule(NamedTuple):
    """How a trivial operator is merged into an operand (see the module docstring)."""

    candidates: Callable[[JaxprEqn], tuple[int, ...]]
    """Operand positions the operator may follow."""
    derive: Callable[[JaxprEqn, int, ShardingSpec, StrategyContext], Strategy]
    """The strategy when operand ``pos`` has ``spec``."""


_ELEMENTWISE_RULE = FollowRule(_same_shape_as_output, derive_elementwise)

FOLLOW_RULES: dict[str, FollowRule] = {
    **{name: _ELEMENTWISE_RULE for name in ELEMENTWISE},
    **{name: FollowRule(_first_var, derive_reduction) for name in SUM_REDUCTIONS},
    **{name: FollowRule(_first_var, derive_arg_reduction) for name in ARG_REDUCTIONS},
    **{name: FollowRule(_first_var, _unsharded_dims_rule(_axis_param("axis"))) for name in CUMULATIVE},
    **{name: FollowRule(_first_var, _unsharded_dims_rule(_window_dims)) for name in WINDOWED},
    "broadcast_in_dim": FollowRule(_first_var, derive_broadcast),
    "reshape": FollowRule(_first_var, derive_reshape),
    "squeeze": FollowRule(_first_var, derive_squeeze),
    "transpose": FollowRule(_first_var, derive_transpose),
    "rev": FollowRule(_first_var, _unsharded_dims_rule(lambda e: e.params["dimensions"])),
    "pad": FollowRule(_first_var, _unsharded_dims_rule(_padded_dims)),
    "slice": FollowRule(_first_var, _unsharded_dims_rule(_sliced_dims)),
    "dynamic_slice": FollowRule(_first_var, _unsharded_dims_rule(_partial_dims)),
    "dynamic_update_slice": FollowRule(lambda e: tuple(p for p in (0, 1) if not isinstance(e.invars[p], Literal)),
                                       _unsharded_dims_rule(_update_dims)),
    "concatenate": FollowRule(_all_vars, _unsharded_dims_rule(lambda e: [e.params["dimension"]])),
    "sort": FollowRule(_first_var, _unsharded_dims_rule(_axis_param("dimension"))),
    "top_k": FollowRule(_first_var, _unsharded_dims_rule(_top_k_dims)),
    "split": FollowRule(_first_var, _unsharded_dims_rule(_axis_param("axis"))),
    "select_and_scatter_add": FollowRule(lambda e: (1,), _unsharded_dims_rule(_window_dims)),
}
"""Primitive name -> follow rule (the operators merged into an operand)."""

RNG_PRIMITIVES = frozenset({"random_bits", "random_seed", "random_wrap", "random_unwrap", "random_split",
                            "random_fold_in", "random_clone", "threefry2x32", "rng_bit_generator", "rng_uniform"})
"""Random-number operators: computed replicated, so every device draws the same numbers (no warning)."""

SOURCE_PRIMITIVES = frozenset({"iota", "full", "empty"}) | RNG_PRIMITIVES
"""Operators that only create values: replicated (slicing a replicated value is free, Table 3.2 #1)."""


def follow_forward(eqns: Sequence[JaxprEqn], known: Mapping[Var, ShardingSpec],
                   ctx: StrategyContext) -> dict[Var, ShardingSpec]:
    """The layouts that follow from ``known`` ones when nothing else is pinned: ``known`` plus, equation by
    equation, the outputs of each equation that reads a sharded value and has a strategy reading every
    sharded operand as it is laid out, with no collective of its own (a trivial operator by its follow rule,
    a root operator by one of its Table 3.3 strategies). Operands of no entry are replicated, which any
    strategy can slice for free (Table 3.2 #1).

    A call-like equation (``custom_jvp``, ``checkpoint``) gives its outputs the layouts its body gives them.

    Data parallelism is the use: from the batch leaves split on dim 0, the activations and their gradients
    keep the split, and a contraction over it (a weight gradient ``x^T dy``, the loss's sum) gets no entry,
    since its result is all-reduced. Equations with sharded operands that no strategy reads as they are
    laid out (operands that disagree, an operator without a rule) get no entry either: their outputs are
    taken as replicated.
    """
    specs = dict(known)
    for eqn in eqns:
        sharded = {k: specs[v] for k, v in enumerate(eqn.invars)
                   if isinstance(v, Var) and v in specs and any(specs[v].axes)}
        if not sharded:
            continue
        if eqn.primitive.name == "optimization_barrier" or is_marker(eqn):  # each value passes through as it is
            specs.update((out, sharded[k]) for k, out in enumerate(eqn.outvars) if k in sharded)
            continue
        body = jax_compat.inlinable_body(eqn)
        if body is not None:  # a call (custom_jvp's relu, a checkpointed block): the layouts its body gives
            inner = body.jaxpr
            inside = follow_forward(inner.eqns, {inner.invars[k]: spec for k, spec in sharded.items()}, ctx)
            specs.update({v: inside[w] for v, w in zip(eqn.outvars, inner.outvars, strict=True)
                          if isinstance(w, Var) and w in inside})
            continue
        strategy = _strategy_reading(eqn, sharded, ctx)
        if strategy is not None:
            specs.update(zip(eqn.outvars, strategy.out_specs, strict=True))
    return specs


def follow_layouts(eqns: Sequence[JaxprEqn], known: Mapping[Var, ShardingSpec],
                   mesh_shape: Sequence[int]) -> dict[Var, ShardingSpec]:
    """:func:`follow_forward` on a logical mesh of ``mesh_shape``, for the layouts alone (no link costs)."""
    n = len(mesh_shape)
    mesh = LogicalMesh(shape=tuple(mesh_shape), alpha=(0.0,) * n, beta=(1.0,) * n)
    return follow_forward(eqns, known, StrategyContext(mesh=mesh))


def _strategy_reading(eqn: JaxprEqn, sharded: Mapping[int, ShardingSpec], ctx: StrategyContext) -> Strategy | None:
    """A strategy of ``eqn`` without collectives that reads operand ``k`` as ``sharded[k]`` for each ``k``: a
    follow rule's (which slices the other operands alike), or a root rule's reading the others whole."""
    name = eqn.primitive.name
    if name in FOLLOW_RULES:
        rule = FOLLOW_RULES[name]
        candidates = [rule.derive(eqn, pos, sharded[pos], ctx) for pos in rule.candidates(eqn) if pos in sharded]
    elif name in ROOT_LOOPS:  # every mapping, those leaving a mesh axis idle too (a batch split on one axis)
        candidates = [s for s in loop_strategies(eqn, ROOT_LOOPS[name](eqn), ctx, flops=0.0, heavy=False)
                      if all(spec is None or k in sharded or not any(spec.axes) for k, spec in enumerate(s.in_specs))]
    else:
        return None
    return next((s for s in candidates
                 if not s.collectives and all(s.in_specs[k] == spec for k, spec in sharded.items())), None)
