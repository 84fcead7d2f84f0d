"""SPMD methods: how every input and output leaf of a step is laid out on one device mesh.

Each method (:mod:`alpa_like.compiler.options`) is laid out by :func:`spmd_layout`, which returns an
:class:`SpmdLayout` (plain data: a mesh shape and one :class:`ShardingSpec` per leaf);
:mod:`alpa_like.runtime.spmd` compiles the layout with `jax.jit` and GSPMD inserts the collectives.

* ``DataParallel``: batch split along dim 0 over all devices, everything else replicated; gradients are
  all-reduced.
* ``Zero2Parallel``: as DataParallel, but optimizer state and gradients are sharded (reduce-scatter of
  gradients, sharded update, all-gather of the new parameters).
* ``Zero3Parallel``: parameters sharded too (all-gathered where used).
* ``ManualShardParallel``: a mesh and PartitionSpecs (or logical-axis rules) written by the user.
* ``ShardParallel``: the intra-op ILP (:mod:`alpa_like.shard_parallel`).

Every method takes ``num_micro_batches`` for gradient accumulation inside one step.
"""
from __future__ import annotations

import math
import warnings as python_warnings
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.input_roles import input_roles, match_outputs_to_inputs
from alpa_like.compiler.options import DataParallel, ManualShardParallel, ShardParallel, Zero2Parallel, Zero3Parallel
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.spmd_layout import SpmdLayout, largest_dim_spec
from alpa_like.compiler.trace import LeafInfo, TracedStep
from alpa_like.shard_parallel import auto_sharding_layout

DATA_AXIS = "data"

_DATA_PARALLEL = {
    DataParallel: dict(shard_state=(), shard_grads=False),
    Zero2Parallel: dict(shard_state=("optimizer_state",), shard_grads=True),
    Zero3Parallel: dict(shard_state=("optimizer_state", "param", "state"), shard_grads=True,
                        gathered_roles=("param", "state")),
}
"""What each data-parallel method shards over the devices: the roles of the sharded inputs, whether the
gradients are, and the roles gathered where they are used."""


def spmd_layout(method: Any, traced: TracedStep, cluster: ClusterSpec, *,
                devices: Sequence[Any] | None = None) -> SpmdLayout:
    """The layout ``method`` (one of :data:`~alpa_like.compiler.options.SPMD_METHODS`) gives ``traced`` on
    one mesh of ``cluster``'s devices.

    ``devices``: the devices of ``cluster`` (in its order), on which ``ShardParallel`` with
    ``plan_selection="measured"`` times its candidates; None (``al.plan``) selects by the objective.
    """
    if isinstance(method, ShardParallel):
        return auto_sharding_layout(method, traced, cluster, devices=devices)
    if isinstance(method, ManualShardParallel):
        return manual_layout(method, traced, cluster)
    if type(method) in _DATA_PARALLEL:
        return _data_parallel_layout(traced, cluster.num_devices, method.num_micro_batches,
                                     **_DATA_PARALLEL[type(method)])
    raise TypeError(f"method must be an SPMD method (DataParallel, Zero2Parallel, Zero3Parallel, "
                    f"ManualShardParallel or ShardParallel), got {type(method).__name__}")


def batch_spec(leaf: LeafInfo, num_shards: int, num_micro_batches: int) -> ShardingSpec:
    """dim 0 on mesh axis 0; a clear error when the rows do not split into micro-batches and devices."""
    if not leaf.shape:
        raise ValueError(f"batch leaf {leaf.path} is a scalar; batch_argnums leaves need a batch dim 0 "
                         "(move scalars to another argument)")
    rows = leaf.shape[0]
    if rows % (num_shards * num_micro_batches):
        raise ValueError(
            f"batch leaf {leaf.path} has {rows} rows in dim 0, which is not divisible by {num_shards} devices x "
            f"{num_micro_batches} micro-batches; use a batch size that is a multiple of "
            f"{num_shards * num_micro_batches}, or pass a leaf that is not per-example (a random key, a setting) "
            "in an argument outside batch_argnums")
    return ShardingSpec(axes=((0,),) + ((),) * (len(leaf.shape) - 1))


def _outputs_like_inputs(traced: TracedStep, in_specs: Sequence[ShardingSpec],
                         default: ShardingSpec | None) -> tuple[ShardingSpec | None, ...]:
    match = match_outputs_to_inputs(traced)
    out = []
    for leaf, i in zip(traced.out_leaves, match, strict=True):
        if i is not None:
            out.append(in_specs[i])
        elif default is None:
            out.append(None)
        else:
            out.append(ShardingSpec.replicated(len(leaf.shape)))
    return tuple(out)


def _data_parallel_layout(traced: TracedStep, num_devices: int, num_micro_batches: int,
                          shard_state: Sequence[str], shard_grads: bool,
                          gathered_roles: tuple[str, ...] = ()) -> SpmdLayout:
    roles, warnings = input_roles(traced)
    if shard_state and "optimizer_state" in shard_state and all(r in ("batch", "state") for r in roles):
        warnings += ("could not tell parameters from optimizer state (call al.grad / al.value_and_grad in the "
                     "step): optimizer state is kept replicated",)
    specs = []
    for leaf, role in zip(traced.in_leaves, roles, strict=True):
        if role == "batch":
            specs.append(batch_spec(leaf, num_devices, num_micro_batches))
        elif role in shard_state:
            specs.append(largest_dim_spec(leaf.shape, num_devices))
        else:
            specs.append(ShardingSpec.replicated(len(leaf.shape)))
    if not any(roles_is_batch for roles_is_batch in (r == "batch" for r in roles)):
        warnings += ("no batch leaves (batch_argnums): every device computes the same thing",)
    return SpmdLayout(mesh_shape=(num_devices,), axis_names=(DATA_AXIS,), roles=roles, in_specs=tuple(specs),
                      out_specs=_outputs_like_inputs(traced, specs, default=ShardingSpec.replicated(0)),
                      shard_grads=shard_grads, gathered_roles=gathered_roles, warnings=warnings)


def _has_grouped_convolution(traced: TracedStep) -> bool:
    return any(e.primitive.name == "conv_general_dilated"
               and (e.params["feature_group_count"] > 1 or e.params["batch_group_count"] > 1)
               for e in traced.closed_jaxpr.jaxpr.eqns)


def _mesh_spec(method: ManualShardParallel, spec: PartitionSpec | None, path: str) -> PartitionSpec:
    """``spec`` with its logical names mapped to mesh axes by ``method.logical_axis_rules`` (when given)."""
    if spec is None:
        return PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"spec for {path} must be a PartitionSpec or None, got {type(spec).__name__}")
    if method.logical_axis_rules is None:
        return spec
    rules = dict(method.logical_axis_rules)
    mapped = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        axes = []
        for name in names:
            if name is None:
                continue
            if name not in rules:
                raise ValueError(f"logical axis {name!r} of {path} has no rule in logical_axis_rules "
                                 f"(known: {sorted(rules)})")
            target = rules[name]
            axes.extend(() if target is None else (target,) if isinstance(target, str) else target)
        mapped.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*mapped)


def _leaf_spec(method: ManualShardParallel, pspec: PartitionSpec | None, leaf: LeafInfo) -> ShardingSpec:
    """``leaf``'s ShardingSpec from its PartitionSpec, checked against ``method``'s mesh and the leaf's shape."""
    pspec = _mesh_spec(method, pspec, leaf.path)
    if len(pspec) > len(leaf.shape):
        raise ValueError(f"spec {pspec} for {leaf.path} has {len(pspec)} entries but the leaf has shape "
                         f"{leaf.shape}")
    named = []
    for entry in pspec:
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None and name not in method.mesh_axis_names:
                raise ValueError(f"spec {pspec} for {leaf.path} names mesh axis {name!r}; the mesh axes "
                                 f"are {method.mesh_axis_names}")
            if name is not None and name in named:
                raise ValueError(f"spec {pspec} for {leaf.path} uses mesh axis {name!r} twice; a mesh axis "
                                 "splits at most one dim")
            named.append(name)
    spec = ShardingSpec.from_partition_spec(pspec, method.mesh_axis_names, len(leaf.shape))
    for d, axes in enumerate(spec.axes):
        shards = math.prod(method.mesh_shape[a] for a in axes)
        if leaf.shape[d] % shards:
            raise ValueError(f"spec {pspec} splits dim {d} of {leaf.path} (size {leaf.shape[d]}) into "
                             f"{shards} shards, which does not divide it")
    return spec


def manual_layout(method: ManualShardParallel, traced: TracedStep, cluster: ClusterSpec) -> SpmdLayout:
    """The layout of :class:`~alpa_like.compiler.options.ManualShardParallel`: its mesh and specs, checked."""
    if math.prod(method.mesh_shape) != cluster.num_devices:
        raise ValueError(f"mesh_shape {method.mesh_shape} has {math.prod(method.mesh_shape)} devices, but "
                         f"{cluster.num_devices} are available")
    num_args = max(traced.dynamic_argnums, default=-1) + 1
    if len(method.in_specs) < num_args:
        raise ValueError(f"in_specs has {len(method.in_specs)} entries; the step has {num_args} positional "
                         "arguments (give one entry per argument)")
    roles, warnings = input_roles(traced)
    per_leaf = _broadcast_prefix(method.in_specs, traced, "in_specs")
    in_specs = tuple(_leaf_spec(method, p, leaf) for p, leaf in zip(per_leaf, traced.in_leaves, strict=True))
    for leaf, spec in zip(traced.in_leaves, in_specs, strict=True):
        if leaf.is_batch and method.num_micro_batches > 1:
            shards = math.prod(method.mesh_shape[a] for a in spec.axes[0]) if spec.axes else 1
            if leaf.shape[0] % (shards * method.num_micro_batches):
                raise ValueError(f"batch leaf {leaf.path} has {leaf.shape[0]} rows, not divisible by "
                                 f"{shards} shards x {method.num_micro_batches} micro-batches")
    if method.out_specs is None:
        out_specs = _outputs_like_inputs(traced, in_specs, default=None)
    else:
        out_leaf_specs = _broadcast_output_prefix(method.out_specs, traced)
        out_specs = tuple(_leaf_spec(method, p, leaf)
                          for p, leaf in zip(out_leaf_specs, traced.out_leaves, strict=True))
    if sum(n > 1 for n in method.mesh_shape) > 1 and _has_grouped_convolution(traced):
        message = ("the step has a grouped (or depthwise) convolution on a 2-D mesh: XLA's CPU partitioner "
                   "was seen computing its weight gradient 4x too large on a (2, 4) mesh with the batch on "
                   "one axis and the kernel replicated (plain jax.jit too); check the step against jax.jit "
                   "on one device, or use a 1-D mesh")
        # a wrong answer: a Python warning, not only a line in the plan
        python_warnings.warn(f"ManualShardParallel: {message}", stacklevel=2)
        warnings += (message,)
    return SpmdLayout(mesh_shape=tuple(method.mesh_shape), axis_names=tuple(method.mesh_axis_names), roles=roles,
                      in_specs=in_specs, out_specs=out_specs, shard_grads=False, warnings=warnings)


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _broadcast_prefix(prefixes: Sequence[Any], traced: TracedStep, name: str) -> list[Any]:
    """One spec per input leaf from a per-argument pytree prefix of specs."""
    args = jax.tree_util.tree_unflatten(traced.in_tree, range(len(traced.in_leaves)))
    per_leaf: list[Any] = [None] * len(traced.in_leaves)
    for arg_pos, arg_index in enumerate(traced.dynamic_argnums):
        _fill(prefixes[arg_index], args[arg_pos], per_leaf, f"{name}[{arg_index}]")
    return per_leaf


def _broadcast_output_prefix(prefix: Any, traced: TracedStep) -> list[Any]:
    outs = jax.tree_util.tree_unflatten(traced.out_tree, range(len(traced.out_leaves)))
    per_leaf: list[Any] = [None] * len(traced.out_leaves)
    _fill(prefix, outs, per_leaf, "out_specs")
    return per_leaf


def _fill(prefix: Any, indices_tree: Any, per_leaf: list[Any], name: str) -> None:
    spec_leaves, spec_def = jax.tree_util.tree_flatten(prefix, is_leaf=_is_spec_leaf)
    try:
        subtrees = spec_def.flatten_up_to(indices_tree)
    except (ValueError, TypeError) as e:
        cause = str(e).split("; value:")[0]  # the rest prints the whole argument
        cause = cause if len(cause) <= 300 else cause[:300] + " ..."
        raise ValueError(f"{name} is not a pytree prefix of the argument it describes ({cause}); build the specs "
                         "from the argument itself, e.g. jax.tree.map(lambda x: PartitionSpec(), state): a "
                         "flax TrainState's specs need the same apply_fn and tx") from None
    for spec, sub in zip(spec_leaves, subtrees, strict=True):
        for index in jax.tree_util.tree_leaves(sub):
            per_leaf[index] = spec
