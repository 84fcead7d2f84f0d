"""SPMD parallel methods: how every input and output leaf of a step is laid out on one device mesh.

Each method is a small frozen dataclass. Its ``layout(traced, cluster)`` returns an :class:`SpmdLayout`
(plain data: a mesh shape and one :class:`ShardingSpec` per leaf); :mod:`alpa_like.runtime.spmd` compiles
the layout with `jax.jit` and GSPMD inserts the collectives.

* :class:`DataParallel`: batch split along dim 0 over all devices, everything else replicated; gradients
  are all-reduced.
* :class:`Zero2Parallel`: as DataParallel, but optimizer state and gradients are sharded (reduce-scatter
  of gradients, sharded update, all-gather of the new parameters).
* :class:`Zero3Parallel`: parameters sharded too (all-gathered where used).
* :class:`ManualShardParallel`: a mesh and PartitionSpecs (or logical-axis rules) written by the user.

Every method takes ``num_micro_batches`` for gradient accumulation inside one step.
"""
from __future__ import annotations

import dataclasses
import math
import re
import warnings as python_warnings
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.loss_reduction import batch_sum_warnings
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.trace import LeafInfo, TracedStep
from alpa_like.compiler.spmd_layout import SpmdLayout, largest_dim_spec

DATA_AXIS = "data"


def _check_micro_batches(num_micro_batches: Any) -> None:
    if not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be a positive int, got {num_micro_batches!r}")


_KEY_NAME = re.compile(r"rng|key|seed", re.IGNORECASE)


def is_prng_key(leaf: LeafInfo) -> bool:
    """Whether ``leaf`` holds PRNG keys: typed keys (dtype ``key<fry>``, ``jax.random.key``), or raw ``uint32``
    key data (``jax.random.PRNGKey``: a last dim of 2, or 4 for ``rbg``) under a path component named like a
    key (``dropout_rng``, ``rng_key``, ``rngs.dropout``, ``seed``)."""
    if leaf.dtype.startswith("key<"):
        return True
    return (leaf.dtype == "uint32" and leaf.shape[-1:] in ((2,), (4,))
            and any(_KEY_NAME.search(part) for part in leaf.path.split(".")[1:]))


def input_roles(traced: TracedStep) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Role of every input leaf (one of :data:`alpa_like.compiler.plan.ROLES`), and warnings. Parameters come from
    al.grad markers, else from the flax convention of a ``params`` path component. When parameters are
    known, the other state leaves are ``optimizer_state`` (what ZeRO shards), except PRNG keys
    (:func:`is_prng_key`), which are ``state``."""
    params = list(traced.param_mask)
    warnings = []
    if not any(params):
        params = [not leaf.is_batch and "params" in leaf.path.split(".") for leaf in traced.in_leaves]
        if any(params):
            warnings.append("parameters found by the 'params' path convention (no al.grad in the step)")
    roles = []
    for leaf, is_param in zip(traced.in_leaves, params, strict=True):
        if leaf.is_batch:
            roles.append("batch")
        elif is_param:
            roles.append("param")
        else:
            roles.append("optimizer_state" if any(params) and not is_prng_key(leaf) else "state")
    for message in batch_sum_warnings(traced):  # every method reads the roles once per compile
        python_warnings.warn(message, stacklevel=3)
        warnings.append(message)
    return tuple(roles), tuple(warnings)


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
            f"{num_shards * num_micro_batches}")
    return ShardingSpec(axes=((0,),) + ((),) * (len(leaf.shape) - 1))


def match_outputs_to_inputs(traced: TracedStep) -> list[int | None]:
    """For each output leaf, the input leaf it updates, when an output element has the pytree structure
    (paths below the root, shapes and dtypes) of a whole input argument (``return new_state, metrics``)."""
    def strip_root(path: str, depth: int) -> str:
        return ".".join(path.split(".")[depth:])

    by_arg: dict[int, dict[tuple, int]] = {}
    for i, leaf in enumerate(traced.in_leaves):
        by_arg.setdefault(leaf.arg_index, {})[(strip_root(leaf.path, 1), leaf.shape, leaf.dtype)] = i
    by_out: dict[int, list[tuple[int, tuple]]] = {}
    for j, leaf in enumerate(traced.out_leaves):
        depth = 1 if leaf.arg_index == -1 else 2
        by_out.setdefault(leaf.arg_index, []).append((j, (strip_root(leaf.path, depth), leaf.shape, leaf.dtype)))
    match: list[int | None] = [None] * len(traced.out_leaves)
    for members in by_out.values():
        keys = {k for _, k in members}
        for table in by_arg.values():
            if keys == set(table) and len(keys) == len(members):
                for j, key in members:
                    match[j] = table[key]
                break
    return match


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataParallel:
    """Batch sharded over all devices along dim 0; parameters and state replicated."""

    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)

    def layout(self, traced: TracedStep, cluster: ClusterSpec) -> SpmdLayout:
        return _data_parallel_layout(traced, cluster.num_devices, self.num_micro_batches, shard_state=(),
                                     shard_grads=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Zero2Parallel:
    """DataParallel with optimizer state and gradients sharded (ZeRO stage 2, Alpa's weight-update sharding)."""

    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)

    def layout(self, traced: TracedStep, cluster: ClusterSpec) -> SpmdLayout:
        return _data_parallel_layout(traced, cluster.num_devices, self.num_micro_batches,
                                     shard_state=("optimizer_state",), shard_grads=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Zero3Parallel:
    """Zero2Parallel with the parameters sharded too (ZeRO stage 3 / fully sharded data parallel)."""

    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)

    def layout(self, traced: TracedStep, cluster: ClusterSpec) -> SpmdLayout:
        return _data_parallel_layout(traced, cluster.num_devices, self.num_micro_batches,
                                     shard_state=("optimizer_state", "param", "state"), shard_grads=True,
                                     gathered_roles=("param", "state"))


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManualShardParallel:
    """A device mesh and partition specs written by hand, the way pjit / MaxText users write them.

    Example::

        method = al.ManualShardParallel(
            mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
            in_specs=(state_specs, PartitionSpec("data")),      # one pytree prefix per positional argument
        )
        # or with logical names, mapped by rules (unmatched names are an error):
        method = al.ManualShardParallel(
            mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
            in_specs=(state_logical_specs, PartitionSpec("batch")),
            logical_axis_rules=(("batch", "data"), ("mlp", "model"), ("embed", None)),
        )
    """

    mesh_shape: tuple[int, ...]
    """Devices per mesh axis; the product must equal the number of devices."""
    mesh_axis_names: tuple[str, ...]
    """One name per mesh axis."""
    in_specs: tuple[Any, ...]
    """One entry per positional argument of the step: a pytree prefix of it whose leaves are
    PartitionSpec (or None for replicated). Entries for static arguments are ignored."""
    out_specs: Any = None
    """A pytree prefix of the output with PartitionSpec leaves; None keeps the input's spec for outputs that
    mirror an input argument (e.g. the new train state) and lets XLA choose the rest."""
    logical_axis_rules: tuple[tuple[str, Any], ...] | None = None
    """(logical name, mesh axis name | tuple of names | None) pairs: PartitionSpec entries of in_specs and
    out_specs are then logical names. Duplicate names are an error."""
    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)
        if not self.mesh_shape or any(not isinstance(n, int) or n < 1 for n in self.mesh_shape):
            raise ValueError(f"mesh_shape must be a tuple of positive ints, got {self.mesh_shape!r}")
        if len(self.mesh_axis_names) != len(self.mesh_shape):
            raise ValueError(f"mesh_axis_names {self.mesh_axis_names!r} must name each of the "
                             f"{len(self.mesh_shape)} axes of mesh_shape {self.mesh_shape!r}")
        if len(self.mesh_shape) > 2:
            raise ValueError(f"mesh_shape {self.mesh_shape!r} has {len(self.mesh_shape)} axes; logical meshes are "
                             "1-D or 2-D (Alpa's S0/S1 notation)")
        if len(set(self.mesh_axis_names)) != len(self.mesh_axis_names):
            raise ValueError(f"mesh_axis_names has duplicates: {self.mesh_axis_names!r}")
        if self.logical_axis_rules is not None:
            names = [name for name, _ in self.logical_axis_rules]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"logical_axis_rules has duplicate logical names {dup}")

    def _to_mesh_spec(self, spec: PartitionSpec | None, path: str) -> PartitionSpec:
        if spec is None:
            return PartitionSpec()
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"spec for {path} must be a PartitionSpec or None, got {type(spec).__name__}")
        if self.logical_axis_rules is None:
            return spec
        rules = dict(self.logical_axis_rules)
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

    def _spec(self, pspec: PartitionSpec | None, leaf: LeafInfo) -> ShardingSpec:
        pspec = self._to_mesh_spec(pspec, leaf.path)
        if len(pspec) > len(leaf.shape):
            raise ValueError(f"spec {pspec} for {leaf.path} has {len(pspec)} entries but the leaf has shape "
                             f"{leaf.shape}")
        named = []
        for entry in pspec:
            for name in entry if isinstance(entry, tuple) else (entry,):
                if name is not None and name not in self.mesh_axis_names:
                    raise ValueError(f"spec {pspec} for {leaf.path} names mesh axis {name!r}; the mesh axes "
                                     f"are {self.mesh_axis_names}")
                if name is not None and name in named:
                    raise ValueError(f"spec {pspec} for {leaf.path} uses mesh axis {name!r} twice; a mesh axis "
                                     "splits at most one dim")
                named.append(name)
        spec = ShardingSpec.from_partition_spec(pspec, self.mesh_axis_names, len(leaf.shape))
        for d, axes in enumerate(spec.axes):
            shards = math.prod(self.mesh_shape[a] for a in axes)
            if leaf.shape[d] % shards:
                raise ValueError(f"spec {pspec} splits dim {d} of {leaf.path} (size {leaf.shape[d]}) into "
                                 f"{shards} shards, which does not divide it")
        return spec

    def layout(self, traced: TracedStep, cluster: ClusterSpec) -> SpmdLayout:
        if math.prod(self.mesh_shape) != cluster.num_devices:
            raise ValueError(f"mesh_shape {self.mesh_shape} has {math.prod(self.mesh_shape)} devices, but "
                             f"{cluster.num_devices} are available")
        num_args = max(traced.dynamic_argnums, default=-1) + 1
        if len(self.in_specs) < num_args:
            raise ValueError(f"in_specs has {len(self.in_specs)} entries; the step has {num_args} positional "
                             "arguments (give one entry per argument)")
        roles, warnings = input_roles(traced)
        per_leaf = _broadcast_prefix(self.in_specs, traced, "in_specs")
        in_specs = tuple(self._spec(p, leaf) for p, leaf in zip(per_leaf, traced.in_leaves, strict=True))
        for leaf, spec in zip(traced.in_leaves, in_specs, strict=True):
            if leaf.is_batch and self.num_micro_batches > 1:
                shards = math.prod(self.mesh_shape[a] for a in spec.axes[0]) if spec.axes else 1
                if leaf.shape[0] % (shards * self.num_micro_batches):
                    raise ValueError(f"batch leaf {leaf.path} has {leaf.shape[0]} rows, not divisible by "
                                     f"{shards} shards x {self.num_micro_batches} micro-batches")
        if self.out_specs is None:
            out_specs = _outputs_like_inputs(traced, in_specs, default=None)
        else:
            out_leaf_specs = _broadcast_output_prefix(self.out_specs, traced)
            out_specs = tuple(self._spec(p, leaf) for p, leaf in zip(out_leaf_specs, traced.out_leaves,
                                                                    strict=True))
        if sum(n > 1 for n in self.mesh_shape) > 1 and _has_grouped_convolution(traced):
            message = ("the step has a grouped (or depthwise) convolution on a 2-D mesh: XLA's CPU partitioner "
                       "was seen computing its weight gradient 4x too large on a (2, 4) mesh with the batch on "
                       "one axis and the kernel replicated (plain jax.jit too); check the step against jax.jit "
                       "on one device, or use a 1-D mesh")
            # a wrong answer: a Python warning, not only a line in the plan
            python_warnings.warn(f"ManualShardParallel: {message}", stacklevel=2)
            warnings += (message,)
        return SpmdLayout(mesh_shape=tuple(self.mesh_shape), axis_names=tuple(self.mesh_axis_names), roles=roles,
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
        raise ValueError(f"{name} is not a pytree prefix of the argument it describes: {e}") from None
    for spec, sub in zip(spec_leaves, subtrees, strict=True):
        for index in jax.tree_util.tree_leaves(sub):
            per_leaf[index] = spec
