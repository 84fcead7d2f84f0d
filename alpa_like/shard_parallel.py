"""``ShardParallel``: Alpa's intra-operator auto-sharding of a whole training step on one device mesh.

The pipeline (dissertation §3.4, each step in :mod:`alpa_like.compiler`)::

    traced step -> build_op_graph            (merge trivial operators, inline custom_jvp/vjp/checkpoint)
                -> for each logical view of the mesh (8 devices: 1x8, 2x4, 4x2, 8x1):
                       auto_shard            (strategies, Table 3.2 resharding costs, Eq. 3.1)
                -> the cheapest view         (plan_selection="objective", the default)
                -> plan_weight_update_sharding   (post-ILP all-reduce -> reduce-scatter + all-gather)
                -> SpmdLayout                (in/out specs, with_sharding_constraint on heavy operators)

With ``plan_selection="measured"`` the plan is chosen by timing instead, as Alpa's profiler does for its
candidates: each view's plan under each of :data:`COST_MODELS` (the cluster's alpha-beta costs; latency 0;
no all-to-all), each with and without the post-ILP weight-update sharding (which Eq. 3.1 does not price),
is realised, compiled, and run on the devices (:func:`measure_layouts`); the fastest median wins. Plans that lay every pinned value out on
the same devices (e.g. data parallelism on the 1x8 and the 2x4 view, or a plan the rewrite leaves alone) are
one program, compiled and timed once.

Example::

    method = al.ShardParallel(auto_sharding_option=al.AutoShardingOption(logical_mesh_shape=(2, 4)))
    train_step = al.parallelize(train_step, method=method)
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.auto_sharding import (
    PINNED_PRIMITIVES,
    PassOptions,
    ShardingSolution,
    alias_pairs,
    auto_shard,
    operand_pins,
    pins,
    prepare,
    price_on,
    solve_prepared,
    without_latency,
)
from alpa_like.compiler.grad_accumulation import split_at_grad_marker
from alpa_like.compiler.logical_mesh import LogicalMesh, logical_shapes
from alpa_like.compiler.op_graph import CONTROL_FLOW, OpGraph, build_op_graph
from alpa_like.compiler.sharding_spec import ShardingSpec, enumerate_specs
from alpa_like.compiler.trace import TracedStep
from alpa_like.compiler.weight_update_sharding import WeightUpdateSharding, plan_weight_update_sharding
from alpa_like.compiler.input_roles import input_roles, match_outputs_to_inputs
from alpa_like.compiler.options import AutoShardingOption, ShardParallel
from alpa_like.compiler.spmd_layout import SpmdLayout
from alpa_like.compiler.plan import OpPlan, PlanCandidate, SolverReport
from alpa_like.compiler.communication import communication
from alpa_like.runtime.spmd import compile_spmd
from alpa_like.timing import time_interleaved

MESH_AXIS_NAMES = ("x", "y")
"""Names of the two logical mesh axes in the compiled program (mesh axis 0 is ``x``)."""

REPORTED_PRIMITIVES = PINNED_PRIMITIVES | CONTROL_FLOW
"""Operators listed one by one in the plan."""


def auto_sharding_layout(method: ShardParallel, traced: TracedStep, cluster: ClusterSpec, *,
                         devices: Sequence[Any] | None = None) -> SpmdLayout:
    """Runs the intra-op pass of ``method`` (see the module docstring) and returns the layout to compile.

    ``devices``: the devices of ``cluster`` (in its order), on which ``plan_selection="measured"``
    times its candidates; None (``al.plan``) selects by the objective.
    """
    option = method.auto_sharding_option
    views = _views(option.logical_mesh_shape, cluster)
    if devices is not None and len(devices) != cluster.num_devices:
        raise ValueError(f"devices: {len(devices)} given for a cluster of {cluster.num_devices} devices")
    roles, warns = input_roles(traced)
    graph = build_op_graph(traced.closed_jaxpr, [leaf.path for leaf in traced.in_leaves])
    if graph.unsupported:
        message = (f"ShardParallel: no sharding rule for primitive(s) {', '.join(graph.unsupported)}; they are "
                   "computed replicated")
        warnings.warn(message, stacklevel=2)
        warns += (message,)
    measure = option.plan_selection == "measured"
    if measure and devices is None:
        message = ("ShardParallel: plan_selection='measured' needs the devices to time plans on, and al.plan "
                   "runs nothing: the view with the lowest objective is used")
        warnings.warn(message, stacklevel=2)
        warns += (message,)
        measure = False
    start = time.perf_counter()
    output_to_input = match_outputs_to_inputs(traced)
    weights = _node_weights(traced, graph, method.num_micro_batches)
    # With micro-batches the gradients are accumulated as per-shard partial sums and reduced once per step
    # (runtime/spmd.deferred_gradients): their all-reduces run 1 / m as often as their operators.
    sync_weight = 1.0 / method.num_micro_batches
    candidates = solve_views(traced, graph, roles, cluster, views, option, weights,
                             alias_pairs(graph, output_to_input),
                             cost_models=tuple(COST_MODELS) if measure else ("alpha-beta",),
                             gradient_sync_weight=sync_weight)
    views_report = tuple((c.solution.mesh.shape, c.solution.objective) for c in candidates
                         if c.cost_model == "alpha-beta")
    if measure and option.prefer_reduce_scatter:  # the post-ILP rewrite is a candidate too (Eq. 3.1 omits it)
        candidates = [dataclasses.replace(c, rewrite=r) for c in candidates for r in (True, False)]
    params = [i for i, r in enumerate(roles) if r == "param"]

    def build(c: Candidate) -> SpmdLayout:
        rewrites = plan_weight_update_sharding(graph, c.solution, params, output_to_input) if c.rewrite else ()
        status = c.solution.ilp.status
        notes = warns if status == "optimal" else warns + (
            f"intra-op ILP on mesh {c.solution.mesh.shape}: {status}",)
        return realize(traced, graph, c.solution, rewrites, roles, output_to_input, weights, views=views_report,
                       seconds=c.seconds, warnings=notes, gradient_sync_weight=sync_weight)

    if not measure:
        return build(min(candidates, key=lambda c: c.solution.objective))
    layouts = [build(c) for c in candidates]
    report = select_measured(traced, candidates, layouts, devices, num_micro_batches=method.num_micro_batches,
                             rounds=option.measure_rounds)
    chosen = layouts[next(i for i, c in enumerate(report) if c.chosen)]
    solver = dataclasses.replace(chosen.solver, selection="measured", candidates=report,
                                 selection_seconds=time.perf_counter() - start)
    return dataclasses.replace(chosen, solver=solver)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan of the intra-op pass."""

    solution: ShardingSolution
    """The ILP's answer, priced on the cluster's alpha-beta costs."""
    cost_model: str
    """What it was solved under, a name of :data:`COST_MODELS`."""
    seconds: float
    """Seconds of its pass (strategies, costs and solve)."""
    rewrite: bool
    """Apply the post-ILP weight-update sharding (:func:`plan_weight_update_sharding`)."""


COST_MODELS: dict[str, Callable[[LogicalMesh, PassOptions], tuple[LogicalMesh, PassOptions]]] = {
    "alpha-beta": lambda mesh, options: (mesh, options),
    "bandwidth only": lambda mesh, options: (without_latency(mesh), options),
    "no all-to-all": lambda mesh, options: (mesh, dataclasses.replace(options, allow_all_to_all=False)),
}
"""The cost models ``plan_selection="measured"`` solves every view under: Eq. 3.1 on the cluster's
alpha-beta costs; with every latency 0 (the latency ClusterSpec.local() measures between programs is the least
certain parameter on one host); and with every resharding priced as all-gathers then a slice (the
all-to-alls of Table 3.2 cost far more than modelled on CPU devices). Each plan is then priced on the first."""


def solve_views(traced: TracedStep, graph: OpGraph, roles: Sequence[str], cluster: ClusterSpec,
                views: Sequence[tuple[int, int]], option: AutoShardingOption, weights: Sequence[float] | None,
                aliases: Sequence[tuple[int, int]], cost_models: Sequence[str] = ("alpha-beta",),
                gradient_sync_weight: float = 1.0) -> list[Candidate]:
    """The ILP's plan on every logical view under each of ``cost_models`` (names of :data:`COST_MODELS`),
    each priced on the option's own Eq. 3.1 (:func:`price_on`); view by view, in the order given."""
    candidates = []
    for shape in views:
        mesh = LogicalMesh.from_cluster(cluster, (cluster.num_nodes, cluster.num_devices_per_node), shape)
        options = PassOptions(memory_budget=option.memory_budget_per_device,
                              allow_all_to_all=option.allow_all_to_all,
                              input_candidates=_batch_candidates(traced, graph, roles, mesh, option),
                              solver_time_limit=float(option.solver_time_limit), solver=option.solver,
                              rates=cluster.compute_rates, node_weights=weights,
                              gradient_sync_weight=gradient_sync_weight)
        start = time.perf_counter()
        prepared = prepare(graph, mesh, options, aliases=aliases)
        solution = solve_prepared(prepared)
        seconds = time.perf_counter() - start
        for name in cost_models:
            if name != "alpha-beta":
                start = time.perf_counter()
                solution = price_on(prepared, auto_shard(graph, *COST_MODELS[name](mesh, options), aliases=aliases))
                seconds = time.perf_counter() - start
            candidates.append(Candidate(solution=solution, cost_model=name, seconds=seconds,
                                        rewrite=option.prefer_reduce_scatter))
    return candidates


def select_measured(traced: TracedStep, candidates: Sequence[Candidate], layouts: Sequence[SpmdLayout],
                    devices: Sequence[Any], *, num_micro_batches: int, rounds: int) -> tuple[PlanCandidate, ...]:
    """Times the distinct ``layouts`` (:func:`duplicates`, :func:`measure_layouts`) and reports every
    candidate, the fastest median marked ``chosen`` (the first of equal medians)."""
    same_as = duplicates(layouts)
    distinct = [i for i, j in enumerate(same_as) if j is None]
    medians = measure_layouts(traced, [layouts[i] for i in distinct], devices, num_micro_batches=num_micro_batches,
                              rounds=rounds)
    measured = dict(zip(distinct, medians, strict=True))
    best = min(distinct, key=lambda i: measured[i])
    return tuple(PlanCandidate(logical_mesh_shape=c.solution.mesh.shape, cost_model=c.cost_model,
                               weight_update_sharding=c.rewrite, objective=c.solution.objective,
                               measured_seconds=measured.get(i), same_as=same_as[i], chosen=i == best)
                 for i, c in enumerate(candidates))


# -------------------------------------------------------------------------------- measured selection

def device_layout(spec: ShardingSpec, mesh_shape: Sequence[int]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per tensor dim, the ``(blocks, device stride)`` factors that split it, major first, for devices
    numbered row-major on ``mesh_shape`` (axis 0 has stride ``n1``, axis 1 stride 1); axes of one device
    are left out and a factor whose stride is the next factor's ``blocks x stride`` is merged with it.

    Two specs on views of the same devices with equal device layouts put the same block of the tensor on
    every device: ``S01`` on a 2x4 view and ``S1`` on a 1x8 view are both ``((8, 1),)`` on their dim.

    >>> device_layout(ShardingSpec.from_str("S01R"), (2, 4)), device_layout(ShardingSpec.from_str("RS1"), (1, 8))
    ((((8, 1),), ()), ((), ((8, 1),)))
    >>> device_layout(ShardingSpec.from_str("S0R"), (2, 4)), device_layout(ShardingSpec.from_str("S10"), (2, 4))
    ((((2, 4),), ()), (((4, 1), (2, 4)),))
    """
    strides = (mesh_shape[1], 1)
    out = []
    for axes in spec.axes:
        factors: list[tuple[int, int]] = []
        for a in axes:
            n, stride = mesh_shape[a], strides[a]
            if n == 1:
                continue
            if factors and factors[-1][1] == n * stride:
                factors[-1] = (factors[-1][0] * n, stride)
            else:
                factors.append((n, stride))
        out.append(tuple(factors))
    return tuple(out)


def layout_key(layout: SpmdLayout) -> tuple:
    """What makes two layouts of one step the same program: the device layout (:func:`device_layout`) of
    every input, output and pinned value, whatever logical view names it."""
    def key(spec):
        return None if spec is None else device_layout(spec, layout.mesh_shape)
    return (tuple(map(key, layout.in_specs)), tuple(map(key, layout.out_specs)), layout.shard_grads,
            frozenset((e, k, key(s)) for e, k, s in layout.eqn_constraints),
            frozenset((e, k, key(s)) for e, k, s in layout.operand_constraints))


def duplicates(layouts: Sequence[SpmdLayout]) -> list[int | None]:
    """Per layout, the index of the first earlier layout with the same :func:`layout_key`, or None."""
    first: dict[tuple, int] = {}
    out: list[int | None] = []
    for i, key in enumerate(map(layout_key, layouts)):
        out.append(first.get(key))
        first.setdefault(key, i)
    return out


def zero_inputs(traced: TracedStep, shardings: Sequence[Any]) -> list[jax.Array]:
    """Zeros of the step's input shapes and dtypes (typed PRNG keys included), created on the devices in
    ``shardings`` (nothing is built on the host or on one device first)."""
    avals = [(leaf.shape, v.aval.dtype) for leaf, v in zip(traced.in_leaves, traced.closed_jaxpr.jaxpr.invars,
                                                          strict=True)]
    return jax.jit(lambda: [jnp.zeros(shape, dtype) for shape, dtype in avals], out_shardings=list(shardings))()


def _run_blocking(compiled, inputs) -> None:
    jax.block_until_ready(compiled(*inputs))


def measure_layouts(traced: TracedStep, layouts: Sequence[SpmdLayout], devices: Sequence[Any], *,
                    num_micro_batches: int, rounds: int) -> tuple[float, ...]:
    """Median seconds of one step of each layout on ``devices``.

    Each layout is compiled without donation and run on :func:`zero_inputs` in its own input shardings,
    the same inputs every run: the user's arrays are neither read nor donated, and nothing the step
    returns is kept, so the step the user runs afterwards is unaffected. The runs follow
    :func:`alpa_like.timing.time_interleaved` (one warm-up run each, then ``rounds`` shuffled rounds). Every
    compiled candidate and its inputs stay in device memory until the timing ends.
    """
    runs = {}
    for i, layout in enumerate(layouts):
        compiled = compile_spmd(traced, layout, devices, num_micro_batches=num_micro_batches)
        inputs = jax.tree.unflatten(traced.in_tree, zero_inputs(traced, compiled.in_shardings))
        runs[i] = functools.partial(_run_blocking, compiled.compiled, inputs)
    medians = time_interleaved(runs, rounds=rounds).medians()
    return tuple(medians[i] for i in range(len(layouts)))


def _views(shape: tuple[int, int] | None, cluster: ClusterSpec) -> tuple[tuple[int, int], ...]:
    if shape is None:
        return logical_shapes(cluster.num_devices)
    if math.prod(shape) != cluster.num_devices:
        raise ValueError(f"logical_mesh_shape {shape} has {math.prod(shape)} devices, but the cluster has "
                         f"{cluster.num_devices}; valid shapes: {logical_shapes(cluster.num_devices)}")
    return (tuple(shape),)


def _batch_candidates(traced: TracedStep, graph: OpGraph, roles, mesh: LogicalMesh, option: AutoShardingOption):
    """Allowed specs of the batch inputs under ``force_batch_dim_to_mesh_axis``."""
    axis = option.force_batch_dim_to_mesh_axis
    if axis is None or mesh.shape[axis] == 1:
        return {}
    out = {}
    for i, role in enumerate(roles):
        shape = graph.tensors[graph.input_tensors[i]].shape
        if role != "batch" or not shape:
            continue
        specs = tuple(s for s in enumerate_specs(shape, mesh) if s.axes[0] == (axis,))
        if not specs:
            raise ValueError(f"force_batch_dim_to_mesh_axis={axis}: batch leaf {traced.in_leaves[i].path} has "
                             f"{shape[0]} rows per micro-batch, not divisible by the {mesh.shape[axis]} devices "
                             f"of mesh axis {axis} (logical mesh {mesh.shape})")
        out[i] = specs
    return out


def _node_weights(traced: TracedStep, graph: OpGraph, num_micro_batches: int) -> tuple[float, ...] | None:
    """Per graph node: ``num_micro_batches`` for compute-grad equations, 1 for the rest."""
    if num_micro_batches == 1:
        return None
    split = split_at_grad_marker(traced.closed_jaxpr, [leaf.is_batch for leaf in traced.in_leaves])
    per_micro = {id(e) for e in split.per_micro_batch}
    eqns = traced.closed_jaxpr.jaxpr.eqns
    return tuple(float(num_micro_batches) if n.eqn_index is not None and id(eqns[n.eqn_index]) in per_micro
                 else 1.0 for n in graph.nodes)


# ---------------------------------------------------------------------------------------------- realize

def realize(traced: TracedStep, graph: OpGraph, solution: ShardingSolution,
            rewrites: Sequence[WeightUpdateSharding], roles: Sequence[str], output_to_input: Sequence[int | None],
            weights: Sequence[float] | None, *, views, seconds: float, warnings: Sequence[str],
            gradient_sync_weight: float = 1.0) -> SpmdLayout:
    """The :class:`SpmdLayout` that makes XLA follow ``solution`` (and the weight-update sharding);
    ``gradient_sync_weight``: times per run of their operators that gradients are synchronised."""
    def weight(n: int) -> float:  # times node n runs per step (scan bodies, micro-batches)
        return graph.nodes[n].repeat * (1.0 if weights is None else weights[n])
    in_specs = list(solution.input_specs())
    rewritten_nodes = set()
    grad_pins = []
    for r in rewrites:
        for i in r.state_inputs:
            in_specs[i] = r.spec
        grad_pins += [(eqn, pos, r.spec) for eqn, pos in r.grad_pins]
        rewritten_nodes.update(r.grad_nodes)
        for t in r.update_tensors:  # the update runs on shards: pin its values (new moments, new parameter)
            rewritten_nodes.add(graph.tensors[t].producer)
            if t in graph.pins:
                grad_pins.append((*graph.pins[t], r.spec))
    out_specs = []
    for j, t in enumerate(graph.output_tensors):
        i = output_to_input[j]
        if i is not None:
            out_specs.append(in_specs[i])
        elif t is None:
            out_specs.append(ShardingSpec.replicated(len(traced.out_leaves[j].shape)))
        else:
            out_specs.append(solution.tensor_spec(t))
    constraints = pins(graph, solution, skip=rewritten_nodes) + grad_pins
    return SpmdLayout(mesh_shape=solution.mesh.shape, axis_names=MESH_AXIS_NAMES, roles=tuple(roles),
                      in_specs=tuple(in_specs), out_specs=tuple(out_specs), shard_grads=False,
                      eqn_constraints=tuple(constraints), operand_constraints=tuple(operand_pins(graph, solution)),
                      warnings=tuple(warnings),
                      communication=communication(graph, solution, rewrites, weight, gradient_sync_weight),
                      op_plans=op_plans(traced, graph, solution, roles, weight),
                      solver=SolverReport(status=solution.ilp.status, objective=solution.objective,
                                          solve_seconds=seconds, num_nodes=solution.ilp.num_nodes,
                                          num_edges=solution.ilp.num_edges,
                                          num_variables=solution.ilp.num_variables,
                                          num_constraints=solution.ilp.num_constraints, views=tuple(views)))


def op_plans(traced: TracedStep, graph: OpGraph, solution: ShardingSolution, roles, weight) -> tuple[OpPlan, ...]:
    """One row per parameter (its layout and the resharding of it) and per heavy operator."""
    incoming: dict[int, list] = {}
    for rs in solution.reshards:
        incoming.setdefault(rs.node, []).append(rs)
    outgoing: dict[int, list] = {}
    for rs in solution.reshards:
        outgoing.setdefault(rs.tensor, []).append(rs)

    def describe(rs) -> str:
        return f"{rs.src}->{rs.dst}: " + " + ".join(str(s) for s in rs.steps if s.kind != "slice")

    rows = []
    for i, role in enumerate(roles):
        if role != "param":
            continue
        t = graph.input_tensors[i]
        moved = outgoing.get(t, [])
        times = [weight(rs.node) if graph.nodes[rs.node].kind == "op" else 1.0 for rs in moved]
        rows.append(OpPlan(name=traced.in_leaves[i].path, kind="param", shape=graph.tensors[t].shape,
                           spec=solution.tensor_spec(t), strategy="input",
                           communication="; ".join(describe(rs) for rs in moved) or "-",
                           seconds=sum(w * rs.seconds for w, rs in zip(times, moved))))
    for node in graph.nodes:
        if node.primitive not in REPORTED_PRIMITIVES:
            continue
        s = solution.strategies[node.id]
        parts = [str(c) for c in s.collectives] + [describe(rs) for rs in incoming.get(node.id, [])]
        seconds = weight(node.id) * (s.cost + sum(rs.seconds for rs in incoming.get(node.id, [])))
        rows.append(OpPlan(name=node.name, kind=node.primitive, shape=graph.tensors[node.outputs[0]].shape,
                           spec=s.out_specs[0], strategy=s.name, communication="; ".join(parts) or "-",
                           seconds=seconds))
    return tuple(rows)
