"""What an SPMD method decides: one mesh and a layout per leaf (:class:`SpmdLayout`), plain data between the
methods that choose it (``alpa_like.methods``, the intra-op pass) and the runtime that compiles it
(:mod:`alpa_like.runtime.spmd`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from alpa_like.compiler.plan import CommEstimate, OpPlan, SolverReport
from alpa_like.compiler.sharding_spec import ShardingSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpmdLayout:
    """A mesh and one sharding per leaf: what an SPMD method decided."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    roles: tuple[str, ...]
    """Per input leaf, one of plan.ROLES."""
    in_specs: tuple[ShardingSpec, ...]
    out_specs: tuple[ShardingSpec | None, ...]
    """None leaves the output's sharding to XLA."""
    shard_grads: bool = False
    """Pin the gradients (the values of the grad marker) to :func:`largest_dim_spec`."""
    gathered_roles: tuple[str, ...] = ()
    """Roles whose leaves are stored sharded but gathered whole where the step reads them (ZeRO-3's
    parameters): their ``in_specs`` say nothing about the layouts of the values computed from them."""
    eqn_constraints: tuple[tuple[int, int, ShardingSpec], ...] = ()
    """(equation index in the traced jaxpr, output index, spec): intermediate values pinned with
    `with_sharding_constraint` (how the intra-op pass makes XLA follow its choice)."""
    operand_constraints: tuple[tuple[int, int, ShardingSpec], ...] = ()
    """(equation index, operand position, spec): an operand pinned as that one equation reads it (the layout
    its chosen algorithm needs), leaving the value itself, and its other readers, alone."""
    warnings: tuple[str, ...] = ()
    communication: tuple[CommEstimate, ...] | None = None
    """Modelled collectives per step when the method predicts them itself (the intra-op pass); None lets
    :func:`alpa_like.compiler.spmd_planning.spmd_plan` model data-parallel gradient synchronisation."""
    op_plans: tuple[OpPlan, ...] = ()
    """The intra-op pass's chosen spec and cost per parameter and heavy operator (shown by the plan)."""
    solver: SolverReport | None = None
    """How the intra-op ILP was solved (shown by the plan)."""


def largest_dim_spec(shape: Sequence[int], num_shards: int, axis: int = 0) -> ShardingSpec:
    """Shards the largest dim divisible by ``num_shards`` on mesh ``axis``; replicated if none divides."""
    candidates = [d for d, n in enumerate(shape) if n % num_shards == 0 and n >= num_shards]
    dims = [()] * len(shape)
    if candidates and num_shards > 1:
        best = max(candidates, key=lambda d: (shape[d], -d))
        dims[best] = (axis,)
    return ShardingSpec(axes=tuple(dims))


def batch_axes(layout: SpmdLayout) -> tuple[int, ...]:
    """Mesh axes that split the batch (dim 0 of the batch leaves)."""
    axes = set()
    for role, spec in zip(layout.roles, layout.in_specs, strict=True):
        if role == "batch" and spec.axes:
            axes.update(spec.axes[0])
    return tuple(sorted(axes))
