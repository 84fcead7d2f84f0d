"""Parallel algorithms ("strategies") of heavy operators on a 1-D or 2-D logical mesh (dissertation §3.4.1).

A :class:`Strategy` is one row of a table like Table 3.3: the sharding spec of every output, the spec every
operand must have, and the collectives the algorithm itself performs (its communication cost ``c_v`` in
Eq. 3.1). Operands that arrive in another layout are resharded at the cost of Table 3.2; that cost belongs
to the graph's edges, not to the strategy.

This module holds the *root* rules: operators that get their own enumerated list of strategies and their
own decision variable in the ILP (``dot_general``, convolution, gather, scatter). The cheap operators that
follow an operand's spec live in :mod:`alpa_like.compiler.propagation`.

Enumeration: a strategy assigns each mesh axis of size > 1 to at most one *loop* of the operator (for a
batched matmul ``C[b,i,j] = sum_k A[b,i,k] B[b,k,j]`` the loops are ``b``, ``i``, ``j``, ``k``). Both axes on
one loop shard it ``S^{01}``. A loop shards every tensor dim it indexes; a reduced loop (``k``) leaves a
partial sum that is all-reduced over its axes (Table 3.3 #2, #3, #5, #7). Heavy operators only use
strategies that split the work over every device ("we do not allow replicated computation" for matmuls,
§3.4.2), so their compute cost ``d_v`` is the same for all of them and is set to 0; only when no such
strategy divides the shapes are partially replicated strategies offered, charged with the redundant compute
time ``flops / rate * (1 / shards - 1 / devices)``, at the operator's rate
(:meth:`~alpa_like.compiler.flops.ComputeRates.flop_rate`).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence

from jax.extend.core import JaxprEqn, Literal

from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import ComputeRates, conv_flops, dot_general_flops
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.sharding_spec import DimAxes, ShardingSpec

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective an algorithm performs: ``kind`` of a ``num_bytes`` tensor over mesh ``axes``.

    ``num_bytes`` follows :class:`LogicalMesh`'s convention: the full buffer within one group of devices
    along ``axes`` (for an all-reduce, the per-device partial result).
    """

    kind: str
    """One of :data:`COLLECTIVE_KINDS`."""
    axes: tuple[int, ...]
    """Mesh axes of the group, e.g. ``(1,)`` or ``(0, 1)`` (one ring over both)."""
    num_bytes: float

    def seconds(self, mesh: LogicalMesh) -> float:
        """Alpha-beta time of the collective on ``mesh``."""
        axis = self.axes[0] if len(self.axes) == 1 else self.axes
        price = {"all-reduce": mesh.all_reduce_cost, "all-gather": mesh.all_gather_cost,
                 "reduce-scatter": mesh.reduce_scatter_cost, "all-to-all": mesh.all_to_all_cost}[self.kind]
        return float(price(self.num_bytes, axis))

    def __str__(self) -> str:
        axes = "{" + ",".join(map(str, self.axes)) + "}" if len(self.axes) > 1 else str(self.axes[0])
        return f"{self.kind}({self.num_bytes:g} B, {axes})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """One parallel algorithm of one operator: a row of Table 3.3."""

    name: str
    """The loop-to-axis mapping, e.g. ``"i->0, k->1"``, or how the spec was propagated."""
    out_specs: tuple[ShardingSpec, ...]
    """Spec of each output."""
    in_specs: tuple[ShardingSpec | None, ...]
    """Spec each operand must have (``None`` for literals)."""
    collectives: tuple[Collective, ...] = ()
    """Communication the algorithm performs itself (its ``c_v``)."""
    comm_seconds: float = 0.0
    """Total time of ``collectives`` on the mesh the strategy was made for."""
    compute_seconds: float = 0.0
    """Compute beyond the perfectly parallel time (``d_v``): 0 unless work is replicated."""

    @property
    def cost(self) -> float:
        """``c_v + d_v`` of Eq. 3.1 for this choice."""
        return self.comm_seconds + self.compute_seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyContext:
    """What a rule needs besides the equation: the mesh and the device speed."""

    mesh: LogicalMesh
    rates: ComputeRates = ComputeRates(1e12)
    """How fast one device computes, to price replicated work of heavy operators."""


def make_spec(axes: Sequence[DimAxes]) -> ShardingSpec:
    """A cached :class:`ShardingSpec` (construction validates, so reuse instances)."""
    return _make_spec(tuple(tuple(a) for a in axes))


@functools.lru_cache(maxsize=1 << 16)
def _make_spec(axes: tuple[DimAxes, ...]) -> ShardingSpec:
    return ShardingSpec(axes=axes)


def replicated(ndim: int) -> ShardingSpec:
    return _make_spec(((),) * ndim)


def itemsize(aval) -> int:
    return int(jax_compat.numpy_dtype(aval.dtype).itemsize)


def nbytes(aval) -> float:
    return float(math.prod(aval.shape)) * itemsize(aval)


def shards(spec: ShardingSpec, mesh_shape: tuple[int, ...]) -> int:
    """Number of distinct tiles of ``spec`` on ``mesh_shape``."""
    return math.prod(mesh_shape[a] for dim_axes in spec.axes for a in dim_axes)


def divides(shape: Sequence[int], spec: ShardingSpec, mesh_shape: tuple[int, ...]) -> bool:
    """Whether every sharded dim of ``shape`` splits evenly under ``spec``."""
    return all(size % math.prod(mesh_shape[a] for a in axes) == 0 for size, axes in zip(shape, spec.axes))


def make_strategy(name: str, out_specs, in_specs, collectives: Sequence[Collective], ctx: StrategyContext,
                  compute_seconds: float = 0.0) -> Strategy:
    """A :class:`Strategy` with ``comm_seconds`` priced on ``ctx.mesh``; empty collectives are dropped."""
    kept = tuple(c for c in collectives if ctx.mesh.axis_size(c.axes) > 1 and c.num_bytes > 0)
    return Strategy(name=name, out_specs=tuple(out_specs), in_specs=tuple(in_specs), collectives=kept,
                    comm_seconds=sum(c.seconds(ctx.mesh) for c in kept), compute_seconds=compute_seconds)


def replicated_strategy(eqn: JaxprEqn, name: str = "replicated") -> Strategy:
    """Every operand and output replicated, no communication."""
    return Strategy(name=name, out_specs=tuple(replicated(len(v.aval.shape)) for v in eqn.outvars),
                    in_specs=tuple(None if isinstance(v, Literal) else replicated(len(v.aval.shape))
                                   for v in eqn.invars))


# ------------------------------------------------------------------------------------------- loop enumeration

@dataclasses.dataclass(frozen=True)
class Loop:
    """A parallelisable loop of an operator: the tensor dims it indexes, and whether it is reduced."""

    label: str
    in_dims: tuple[int | None, ...]
    """Per operand, the dim this loop indexes (None if the operand does not have it)."""
    out_dim: int | None
    """The output dim, or None for a reduced loop (its split leaves partial sums)."""


def enumerate_loop_mappings(loops: Sequence[Loop], mesh_shape: tuple[int, ...]):
    """Yields ``{loop index: axes}`` for every assignment of each mesh axis of size > 1 to one loop or none.

    Both axes on one loop give ``(0, 1)``. The first mapping is the empty one (everything replicated).
    """
    useful = [a for a, n in enumerate(mesh_shape) if n > 1]
    for choice in itertools.product([None, *range(len(loops))], repeat=len(useful)):
        mapping: dict[int, tuple[int, ...]] = {}
        for axis, loop in zip(useful, choice):
            if loop is not None:
                mapping[loop] = mapping.get(loop, ()) + (axis,)
        yield mapping


def loop_strategies(eqn: JaxprEqn, loops: Sequence[Loop], ctx: StrategyContext, *, flops: float,
                    partial_kind: str = "all-reduce", heavy: bool = True) -> list[Strategy]:
    """Strategies of an operator described by its loops (Table 3.3 generalised to any dims).

    Each mapping yields output and operand specs (the loop's axes on every dim it indexes) and, for reduced
    loops, a ``partial_kind`` collective of the per-device output over their axes. Mappings that do not
    divide a sharded dim are skipped. With ``heavy``, only mappings using every mesh axis of size > 1 are
    kept when any exists (see the module docstring); others are charged their redundant compute.
    """
    mesh = ctx.mesh.shape
    out_aval = eqn.outvars[0].aval
    in_avals = [v.aval for v in eqn.invars]
    useful = [a for a, n in enumerate(mesh) if n > 1]
    full, partial = [], []
    for mapping in enumerate_loop_mappings(loops, mesh):
        out_axes = [()] * len(out_aval.shape)
        in_axes = [[()] * len(a.shape) for a in in_avals]
        reduce_axes: tuple[int, ...] = ()
        for li, axes in mapping.items():
            loop = loops[li]
            for op, dim in enumerate(loop.in_dims):
                if dim is not None:
                    in_axes[op][dim] = axes
            if loop.out_dim is None:
                reduce_axes += axes
            else:
                out_axes[loop.out_dim] = axes
        out_spec = make_spec(out_axes)
        in_specs = [None if isinstance(v, Literal) else make_spec(ax) for v, ax in zip(eqn.invars, in_axes)]
        if not divides(out_aval.shape, out_spec, mesh) or not all(
                s is None or divides(a.shape, s, mesh) for s, a in zip(in_specs, in_avals)):
            continue
        collectives = []
        if reduce_axes:
            local = nbytes(out_aval) / shards(out_spec, mesh)
            collectives.append(Collective(kind=partial_kind, axes=tuple(sorted(reduce_axes)), num_bytes=local))
        name = ", ".join(f"{loops[li].label}->{''.join(map(str, axes))}" for li, axes in sorted(mapping.items()))
        used = {a for axes in mapping.values() for a in axes}
        work_shards = math.prod(mesh[a] for a in used)
        strategy = dict(name=name or "replicated", out_specs=(out_spec,), in_specs=in_specs,
                        collectives=collectives)
        if used >= set(useful):
            full.append(make_strategy(**strategy, ctx=ctx))
        else:
            redundant = 1.0 / work_shards - 1.0 / ctx.mesh.num_devices
            extra = flops / ctx.rates.flop_rate(eqn) * redundant if heavy else 0.0
            partial.append(make_strategy(**strategy, ctx=ctx, compute_seconds=extra))
    if heavy and full:
        return full
    return full + partial


# ------------------------------------------------------------------------------------------------ root rules

def dot_general_loops(eqn: JaxprEqn) -> list[Loop]:
    """Loops ``b`` (batch pairs), ``i`` (lhs free), ``j`` (rhs free), ``k`` (contracting pairs)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs_nd, rhs_nd = (len(v.aval.shape) for v in eqn.invars)
    lf = [d for d in range(lhs_nd) if d not in lc and d not in lb]
    rf = [d for d in range(rhs_nd) if d not in rc and d not in rb]

    def label(kind, n, t):
        return kind if n == 1 else f"{kind}{t}"

    loops = [Loop(label("b", len(lb), t), (l, r), t) for t, (l, r) in enumerate(zip(lb, rb))]
    loops += [Loop(label("i", len(lf), t), (d, None), len(lb) + t) for t, d in enumerate(lf)]
    loops += [Loop(label("j", len(rf), t), (None, d), len(lb) + len(lf) + t) for t, d in enumerate(rf)]
    loops += [Loop(label("k", len(lc), t), (l, r), None) for t, (l, r) in enumerate(zip(lc, rc))]
    return loops


def dot_general_rule(eqn: JaxprEqn, ctx: StrategyContext) -> list[Strategy]:
    """Every Table 3.3 mapping of ``dot_general``, batch dims included, for any number of each kind of dim."""
    return loop_strategies(eqn, dot_general_loops(eqn), ctx, flops=dot_general_flops(eqn))


def conv_loops(eqn: JaxprEqn) -> list[Loop]:
    """Convolution loops: ``b`` (batch), ``o`` (output channels), ``c`` (input channels, reduced).

    Spatial dims are never split (that needs halo exchange). Grouped convolutions only offer the batch loop
    (``feature_group_count > 1``) or nothing (``batch_group_count > 1``, a grouped weight gradient).
    """
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    if eqn.params.get("batch_group_count", 1) > 1:
        return []
    loops = [Loop("b", (lhs_spec[0], None), out_spec[0])]
    if eqn.params.get("feature_group_count", 1) == 1:
        loops += [Loop("o", (None, rhs_spec[0]), out_spec[1]), Loop("c", (lhs_spec[1], rhs_spec[1]), None)]
    return loops


def conv_rule(eqn: JaxprEqn, ctx: StrategyContext) -> list[Strategy]:
    """Batch, output-channel and input-channel splits of ``conv_general_dilated``."""
    return loop_strategies(eqn, conv_loops(eqn), ctx, flops=conv_flops(eqn)) or [replicated_strategy(eqn)]


def gather_loops(eqn: JaxprEqn) -> list[Loop]:
    """Loops of ``gather(operand, indices)`` (index vector dim last, as jax emits it).

    * each indices batch dim (and its paired operand batching dim) -> an output batch dim;
    * each operand dim sliced in full (not collapsed, not batching) -> its output offset dim;
    * each indexed (collapsed, slice size 1) operand dim -> reduced: every device looks up the rows it holds,
      the others read as 0, and the partial results are all-reduced (Megatron's vocabulary-parallel
      embedding).
    """
    dn = eqn.params["dimension_numbers"]
    sizes = eqn.params["slice_sizes"]
    operand, indices = (v.aval.shape for v in eqn.invars)
    out_nd = len(eqn.outvars[0].aval.shape)
    batch_out = [d for d in range(out_nd) if d not in dn.offset_dims]
    index_dims = list(range(len(indices) - 1))
    pair = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims))
    loops = []
    for t, (d, o) in enumerate(zip(index_dims, batch_out)):
        loops.append(Loop(f"n{t}", (pair.get(d), d), o))
    offset_operand = [p for p in range(len(operand)) if p not in dn.collapsed_slice_dims
                      and p not in dn.operand_batching_dims]
    for p, o in zip(offset_operand, dn.offset_dims):
        if sizes[p] == operand[p]:
            loops.append(Loop(f"d{p}", (p, None), o))
    for p in dn.collapsed_slice_dims:
        if p in dn.start_index_map and sizes[p] == 1:
            loops.append(Loop(f"v{p}", (p, None), None))
    return loops


def gather_rule(eqn: JaxprEqn, ctx: StrategyContext) -> list[Strategy]:
    """Batch-, feature- and index-parallel gathers (embedding lookups); replicated compute is allowed."""
    return loop_strategies(eqn, gather_loops(eqn), ctx, flops=0.0, heavy=False)


def scatter_loops(eqn: JaxprEqn) -> list[Loop]:
    """Loops of ``scatter*(operand, indices, updates)``: mirror images of :func:`gather_loops`.

    A split of the scatter dims of ``updates`` (not paired with an operand batching dim) leaves each device a
    partial result of the whole operand: reduced (all-reduce), valid for ``scatter-add`` only. A split of an
    indexed operand dim needs no communication: each device applies the updates that land in its rows.
    """
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = (v.aval.shape for v in eqn.invars[:3])
    additive = eqn.primitive.name == "scatter-add"
    scatter_dims = [u for u in range(len(updates)) if u not in dn.update_window_dims]
    pair = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims))
    loops = []
    for t, (d, u) in enumerate(zip(range(len(indices) - 1), scatter_dims)):
        p = pair.get(d)
        if p is not None:
            loops.append(Loop(f"n{t}", (p, d, u), p))
        elif additive:
            loops.append(Loop(f"n{t}", (None, d, u), None))
    window_operand = [p for p in range(len(operand)) if p not in dn.inserted_window_dims
                      and p not in dn.operand_batching_dims]
    for p, u in zip(window_operand, dn.update_window_dims):
        if updates[u] == operand[p]:
            loops.append(Loop(f"d{p}", (p, None, u), p))
    for p in dn.inserted_window_dims:
        if p in dn.scatter_dims_to_operand_dims:
            loops.append(Loop(f"v{p}", (p, None, None), p))
    return loops


def scatter_rule(eqn: JaxprEqn, ctx: StrategyContext) -> list[Strategy]:
    """Strategies of scatter / scatter-add (e.g. the gradient of an embedding lookup)."""
    return loop_strategies(eqn, scatter_loops(eqn), ctx, flops=0.0, heavy=False)


RootRule = Callable[[JaxprEqn, StrategyContext], list[Strategy]]

ROOT_LOOPS: dict[str, Callable[[JaxprEqn], list[Loop]]] = {
    "dot_general": dot_general_loops,
    "conv_general_dilated": conv_loops,
    "gather": gather_loops,
    "scatter-add": scatter_loops,
    "scatter": scatter_loops,
}
"""Primitive name -> its loops (the root rules' strategies are mappings of these)."""

ROOT_RULES: dict[str, RootRule] = {
    "dot_general": dot_general_rule,
    "conv_general_dilated": conv_rule,
    "gather": gather_rule,
    "scatter-add": scatter_rule,
    "scatter": scatter_rule,
}
"""Primitive name -> rule enumerating its strategies (operators with their own ILP decision variable)."""

HEAVY_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
"""Operators whose work must be split over all devices (d_v = 0, §3.4.2)."""
