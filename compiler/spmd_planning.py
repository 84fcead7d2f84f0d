"""Turn an SPMD method's layout into a :class:`ParallelPlan` with modelled costs (the last pass of
:func:`~alpa_like.compiler.pipeline.plan_spmd`).

The cost model (no overlap of compute and communication):

.. math::

    t_\\text{step} = \\frac{\\text{FLOPs}}{N \\cdot \\text{peak}} + \\sum_c t_c

FLOPs come from the traced jaxpr (:mod:`alpa_like.compiler.flops`); each collective ``c`` is priced with
the alpha-beta model of :class:`LogicalMesh` on the cluster. Modelled collectives are the gradient
synchronisation of data parallelism and ZeRO (all-reduce, or reduce-scatter plus all-gather of the
updated parameters) and ZeRO-3's parameter all-gathers (before forward and backward, per micro-batch).
Activation collectives of hand-written tensor parallelism are not modelled here (the intra-op pass models
them); the compiled executable reports the collectives XLA actually inserted.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.flops import equation_seconds, jaxpr_flops, jaxpr_seconds
from alpa_like.compiler.grad_accumulation import batch_dependent, split_at_grad_marker, split_total
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.memory_estimate import peak_live_bytes
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.trace import LeafInfo, TracedStep
from alpa_like.compiler.spmd_layout import SpmdLayout, batch_axes, largest_dim_spec
from alpa_like.compiler.plan import CommEstimate, ParallelPlan, StagePlan, TensorPlan


def cluster_submesh(cluster: ClusterSpec) -> tuple[int, int]:
    return (cluster.num_nodes, cluster.num_devices_per_node)


def logical_mesh(cluster: ClusterSpec, mesh_shape: Sequence[int]) -> tuple[LogicalMesh, tuple[tuple[int, ...], ...]]:
    """The LogicalMesh of a 1-D or 2-D mesh over the whole cluster, and per mesh axis the LogicalMesh axes
    that price its collectives. A 1-D mesh is priced as the view ``(num_nodes, devices per node)`` with its
    axis as both axes, so an all-reduce over it may take the two-level form across nodes
    (:meth:`LogicalMesh.all_reduce_cost`)."""
    shape = tuple(mesh_shape)
    if len(shape) == 1:
        return LogicalMesh.from_cluster(cluster, cluster_submesh(cluster), cluster_submesh(cluster)), ((0, 1),)
    return LogicalMesh.from_cluster(cluster, cluster_submesh(cluster), shape), ((0,), (1,))


def tensor_plan(leaf: LeafInfo, role: str, spec: ShardingSpec | None, mesh_shape: Sequence[int]) -> TensorPlan:
    shards = 1 if spec is None else spec.num_shards(tuple(mesh_shape))
    return TensorPlan(path=leaf.path, shape=leaf.shape, dtype=leaf.dtype, role=role, spec=spec,
                      bytes_per_device=leaf.nbytes // shards)


def gradient_communication(layout: SpmdLayout, in_leaves: Sequence[LeafInfo], mesh: LogicalMesh,
                           axis_map: Sequence[tuple[int, ...]], num_micro_batches: int) -> list[CommEstimate]:
    """Modelled per-step collectives for the parameters (see the module docstring); ``axis_map`` as
    :func:`logical_mesh` returns it."""
    sync_axes = batch_axes(layout)
    totals: dict[tuple[str, tuple[int, ...], str], int] = {}

    def add(kind, axes, nbytes, what):
        key = (kind, axes, what)
        totals[key] = totals.get(key, 0) + nbytes

    mesh_shape = layout.mesh_shape
    for leaf, role, spec in zip(in_leaves, layout.roles, layout.in_specs, strict=True):
        if role != "param":
            continue
        own = {a for dim in spec.axes for a in dim}
        axes = tuple(a for a in sync_axes if a not in own and mesh_shape[a] > 1)
        local_bytes = leaf.nbytes // spec.num_shards(mesh_shape)
        if any(a in own for a in sync_axes):  # ZeRO-3: sharded over the batch axes
            gather_axes = tuple(a for a in sync_axes if a in own and mesh_shape[a] > 1)
            add("all-gather", gather_axes, 2 * num_micro_batches * leaf.nbytes,
                "parameters gathered for forward and backward")
            add("reduce-scatter", gather_axes, leaf.nbytes, "gradient synchronisation")
        if not axes:
            continue
        grad_sharded = layout.shard_grads and largest_dim_spec(leaf.shape, math.prod(
            mesh_shape[a] for a in axes)).axes != ((),) * len(leaf.shape)
        if grad_sharded:
            add("reduce-scatter", axes, local_bytes, "gradient synchronisation")
            add("all-gather", axes, local_bytes, "updated parameters gathered")
        else:
            add("all-reduce", axes, local_bytes, "gradient synchronisation")
    estimates = []
    for (kind, axes, what), nbytes in totals.items():
        cost_axis = tuple(sorted(m for a in axes for m in axis_map[a]))
        axis = cost_axis[0] if len(cost_axis) == 1 else cost_axis
        price = {"all-reduce": mesh.all_reduce_cost, "all-gather": mesh.all_gather_cost,
                 "reduce-scatter": mesh.reduce_scatter_cost}[kind]
        estimates.append(CommEstimate(kind=kind, mesh_axes=axes, num_bytes=int(nbytes),
                                      seconds=float(price(nbytes, axis)), what=what))
    return estimates


def spmd_peak_memory(traced: TracedStep, inputs: Sequence[TensorPlan], num_devices: int) -> int:
    """Bytes per device the step needs (:mod:`~alpa_like.compiler.memory_estimate`): its inputs as laid out,
    a gradient per parameter laid out like it, and the peak of its live activations (values computed from
    the batch with the (micro-)batch's rows in dim 0, traced per micro-batch) spread over the devices."""
    jaxpr = traced.closed_jaxpr.jaxpr
    batch_vars = {v for v, leaf in zip(jaxpr.invars, traced.in_leaves, strict=True) if leaf.is_batch}
    rows = {v.aval.shape[0] for v in batch_vars if v.aval.shape}
    param_shapes = {leaf.shape for leaf, is_param in zip(traced.in_leaves, traced.param_mask, strict=True)
                    if is_param}
    activations = peak_live_bytes(jaxpr, {v for v in batch_dependent(jaxpr.eqns, batch_vars) - batch_vars
                                          if v.aval.shape[:1] and v.aval.shape[0] in rows
                                          and v.aval.shape not in param_shapes})
    held = sum(t.bytes_per_device * (2 if t.role == "param" else 1) for t in inputs)
    return int(held + math.ceil(activations / num_devices))


def spmd_plan(method, traced: TracedStep, layout: SpmdLayout, cluster: ClusterSpec,
              device_ids: Sequence[int] = (), out_specs: Sequence[ShardingSpec | None] | None = None) -> ParallelPlan:
    """The one-stage plan of an SPMD method on ``cluster``. Its compute time is the traced step's roofline
    spread over the cluster's devices (:func:`~alpa_like.compiler.flops.jaxpr_seconds`: FLOPs at peak, or
    bytes at ``cluster.memory_bandwidth`` when larger and known), as the stage profiler and the simulator
    price a stage; the predicted collectives add to it.

    Args:
      out_specs: the output specs actually compiled (XLA's choice filled in); defaults to the layout's.
    """
    out_specs = layout.out_specs if out_specs is None else tuple(out_specs)
    mesh_shape = layout.mesh_shape
    inputs = tuple(tensor_plan(leaf, role, spec, mesh_shape)
                   for leaf, role, spec in zip(traced.in_leaves, layout.roles, layout.in_specs, strict=True))
    outputs = tuple(tensor_plan(leaf, "output", spec, mesh_shape)
                    for leaf, spec in zip(traced.out_leaves, out_specs, strict=True))
    mesh, axis_map = logical_mesh(cluster, mesh_shape)
    if layout.communication is not None:  # the intra-op pass predicted every collective itself
        comm = tuple(layout.communication)
    else:
        comm = tuple(gradient_communication(layout, traced.in_leaves, mesh, axis_map, method.num_micro_batches))
    rates, n = cluster.compute_rates, cluster.num_devices
    if method.num_micro_batches > 1:
        split = split_at_grad_marker(traced.closed_jaxpr, [leaf.is_batch for leaf in traced.in_leaves])
        flops = float(split_total(split, method.num_micro_batches))
        compute = split_total(split, method.num_micro_batches, lambda e: equation_seconds(e, rates, n))
    else:
        flops = float(jaxpr_flops(traced.closed_jaxpr))
        compute = jaxpr_seconds(traced.closed_jaxpr, rates, n)
    stage = StagePlan(stage_id=0, layer_ids=(), submesh_shape=cluster_submesh(cluster),
                      logical_mesh_shape=tuple(mesh_shape), mesh_axis_names=layout.axis_names,
                      device_ids=tuple(int(d) for d in device_ids), inputs=inputs, outputs=outputs,
                      communication=comm, flops=flops, compute_seconds=compute,
                      memory_per_device=int(np.sum([t.bytes_per_device for t in inputs], dtype=np.int64)),
                      peak_memory_per_device=spmd_peak_memory(traced, inputs, math.prod(mesh_shape)),
                      ops=tuple(layout.op_plans), solver=layout.solver)
    return ParallelPlan(method=repr(method), num_micro_batches=method.num_micro_batches, cluster=cluster,
                        stages=(stage,), pipeline_schedule=None,
                        estimated_iteration_time=compute + stage.communication_seconds,
                        warnings=tuple(layout.warnings))
