"""``ShardParallel``: Alpa's intra-operator auto-sharding of a whole training step on one device mesh.

The pipeline (dissertation §3.4, each step in :mod:`alpa_like.compiler`)::

    traced step -> build_op_graph            (merge trivial operators, inline custom_jvp/vjp/checkpoint)
                -> for each logical view of the mesh (8 devices: 1x8, 2x4, 4x2, 8x1):
                       auto_shard            (strategies, Table 3.2 resharding costs, Eq. 3.1 with CBC)
                -> the cheapest view
                -> plan_weight_update_sharding   (post-ILP all-reduce -> reduce-scatter + all-gather)
                -> SpmdLayout                (in/out specs, with_sharding_constraint on heavy operators)

Example::

    method = al.ShardParallel(auto_sharding_option=al.AutoShardingOption(logical_mesh_shape=(2, 4)))
    train_step = al.parallelize(train_step, method=method)
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time
import warnings
from collections.abc import Sequence

from alpa_like.cluster import ClusterSpec
from alpa_like.compiler.auto_sharding import (
    PINNED_PRIMITIVES,
    PassOptions,
    ShardingSolution,
    alias_pairs,
    auto_shard,
    operand_pins,
    pins,
)
from alpa_like.compiler.grad_accumulation import split_at_grad_marker
from alpa_like.compiler.ilp import DEFAULT_SOLVER, SOLVERS
from alpa_like.compiler.logical_mesh import LogicalMesh, logical_shapes
from alpa_like.compiler.op_graph import CONTROL_FLOW, OpGraph, build_op_graph
from alpa_like.compiler.sharding_spec import ShardingSpec, enumerate_specs
from alpa_like.compiler.strategies import Collective, shards
from alpa_like.compiler.trace import TracedStep
from alpa_like.compiler.weight_update_sharding import WeightUpdateSharding, plan_weight_update_sharding
from alpa_like.methods import SpmdLayout, _check_micro_batches, input_roles, match_outputs_to_inputs
from alpa_like.plan import CommEstimate, OpPlan, SolverReport

MESH_AXIS_NAMES = ("x", "y")
"""Names of the two logical mesh axes in the compiled program (mesh axis 0 is ``x``)."""

REPORTED_PRIMITIVES = PINNED_PRIMITIVES | CONTROL_FLOW
"""Operators listed one by one in the plan."""


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoShardingOption:
    """Knobs of the intra-op pass (Alpa's ``AutoShardingOption``)."""

    memory_budget_per_device: float | None = None
    """Bytes per device that the tensors live at any point of the step may use; None: no limit."""
    allow_all_to_all: bool = True
    """Allow all-to-all for resharding (Table 3.2 #4, #5); False prices it as all-gather then slice."""
    prefer_reduce_scatter: bool = True
    """Post-ILP: turn a gradient's all-reduce into reduce-scatter + all-gather and shard its optimizer
    state and update (weight-update sharding / ZeRO), as Alpa does by default."""
    force_batch_dim_to_mesh_axis: int | None = None
    """Shard dim 0 of every batch leaf on this mesh axis (0 or 1) when it has more than one device;
    None lets the ILP choose."""
    solver_time_limit: float = 60.0
    """Seconds the solver may spend per logical view; it then keeps its best solution (see the plan's status)."""
    logical_mesh_shape: tuple[int, int] | None = None
    """Use only this logical view (n0, n1) of the devices instead of trying all of them."""
    solver: str = DEFAULT_SOLVER
    """MILP solver: ``"highs"`` (default: HiGHS via scipy, LP relaxation first) or ``"cbc"`` (PuLP's bundled CBC,
    as Alpa)."""

    def __post_init__(self):
        budget = self.memory_budget_per_device
        if budget is not None and (not isinstance(budget, numbers.Real) or isinstance(budget, bool)
                                   or not budget > 0):
            raise ValueError(f"memory_budget_per_device must be a number of bytes > 0 or None, got {budget!r}")
        for name in ("allow_all_to_all", "prefer_reduce_scatter"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        axis = self.force_batch_dim_to_mesh_axis
        if axis is not None and (not _is_int(axis) or axis not in (0, 1)):
            raise ValueError(f"force_batch_dim_to_mesh_axis must be 0, 1 or None, got {axis!r}")
        limit = self.solver_time_limit
        if not isinstance(limit, numbers.Real) or isinstance(limit, bool) or not limit > 0:
            raise ValueError(f"solver_time_limit must be a number of seconds > 0, got {limit!r}")
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {self.solver!r}")
        shape = self.logical_mesh_shape
        if shape is not None and (not isinstance(shape, tuple) or len(shape) != 2
                                  or not all(_is_int(n) and n >= 1 for n in shape)):
            raise ValueError(f"logical_mesh_shape must be a tuple (n0, n1) of ints >= 1 or None, got {shape!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardParallel:
    """Intra-operator parallelism chosen by Alpa's ILP (Eq. 3.1) over one mesh of all devices."""

    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""
    auto_sharding_option: AutoShardingOption = AutoShardingOption()
    """Knobs of the intra-op pass."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)
        if not isinstance(self.auto_sharding_option, AutoShardingOption):
            raise TypeError(f"auto_sharding_option must be an al.AutoShardingOption, got "
                            f"{type(self.auto_sharding_option).__name__}")

    def layout(self, traced: TracedStep, cluster: ClusterSpec) -> SpmdLayout:
        """Runs the intra-op pass (see the module docstring) and returns the layout to compile."""
        option = self.auto_sharding_option
        views = _views(option.logical_mesh_shape, cluster)
        roles, warns = input_roles(traced)
        graph = build_op_graph(traced.closed_jaxpr, [leaf.path for leaf in traced.in_leaves])
        if graph.unsupported:
            message = (f"ShardParallel: no sharding rule for primitive(s) {', '.join(graph.unsupported)}; they are "
                       "computed replicated")
            warnings.warn(message, stacklevel=2)
            warns += (message,)
        output_to_input = match_outputs_to_inputs(traced)
        weights = _node_weights(traced, graph, self.num_micro_batches)
        tried = []
        for shape in views:
            mesh = LogicalMesh.from_cluster(cluster, (cluster.num_nodes, cluster.num_devices_per_node), shape)
            options = PassOptions(memory_budget=option.memory_budget_per_device,
                                  allow_all_to_all=option.allow_all_to_all,
                                  input_candidates=_batch_candidates(traced, graph, roles, mesh, option),
                                  solver_time_limit=float(option.solver_time_limit), solver=option.solver,
                                  peak_flops=cluster.peak_flops, node_weights=weights)
            start = time.perf_counter()
            solution = auto_shard(graph, mesh, options, aliases=alias_pairs(graph, output_to_input))
            tried.append((solution, time.perf_counter() - start))
        solution, seconds = min(tried, key=lambda x: x[0].objective)
        if solution.ilp.status != "optimal":
            warns += (f"intra-op ILP on mesh {solution.mesh.shape}: {solution.ilp.status}",)
        params = [i for i, r in enumerate(roles) if r == "param"]
        rewrites = (plan_weight_update_sharding(graph, solution, params, output_to_input)
                    if option.prefer_reduce_scatter else ())
        return realize(traced, graph, solution, rewrites, roles, output_to_input, weights,
                       views=tuple((s.mesh.shape, s.objective) for s, _ in tried), seconds=seconds,
                       warnings=warns)


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
            weights: Sequence[float] | None, *, views, seconds: float, warnings: Sequence[str]) -> SpmdLayout:
    """The :class:`SpmdLayout` that makes XLA follow ``solution`` (and the weight-update sharding)."""
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
                      communication=communication(graph, solution, rewrites, weight),
                      op_plans=op_plans(traced, graph, solution, roles, weight),
                      solver=SolverReport(status=solution.ilp.status, objective=solution.objective,
                                          solve_seconds=seconds, num_nodes=solution.ilp.num_nodes,
                                          num_edges=solution.ilp.num_edges,
                                          num_variables=solution.ilp.num_variables,
                                          num_constraints=solution.ilp.num_constraints, views=tuple(views)))


def predicted_collectives(graph: OpGraph, solution: ShardingSolution, rewrites: Sequence[WeightUpdateSharding],
                          weight=lambda n: 1.0) -> list[tuple[Collective, float, str]]:
    """Every collective the plan performs per step: (collective, times per step, why).

    Strategy collectives of the operators that compute a gradient are ``gradient synchronisation``; those
    of rewritten gradients become reduce-scatters, plus one all-gather of the updated parameter.
    """
    mesh = solution.mesh
    rewritten = {n: r for r in rewrites for n in r.grad_nodes}
    out = []
    for node in graph.nodes:
        r = rewritten.get(node.id)
        for c in solution.strategies[node.id].collectives:
            if r is not None and c.kind == "all-reduce" and set(c.axes) <= set(r.axes):
                out.append((dataclasses.replace(c, kind="reduce-scatter"), weight(node.id),
                            "gradient synchronisation"))
            else:
                what = "gradient synchronisation" if r is not None else "operator collectives"
                out.append((c, weight(node.id), what))
    for r in rewrites:
        t = graph.input_tensors[r.param_input]
        local = graph.tensors[t].nbytes / shards(solution.tensor_spec(t), mesh.shape)
        out.append((Collective(kind="all-gather", axes=r.axes, num_bytes=local), 1.0, "updated parameters gathered"))
    for rs in solution.reshards:
        times = weight(rs.node) if graph.nodes[rs.node].kind == "op" else 1.0
        for step in rs.steps:
            if step.kind != "slice":
                out.append((Collective(kind=step.kind, axes=(step.axis,), num_bytes=step.num_bytes), times,
                            "resharding"))
    return out


def communication(graph, solution, rewrites, weight) -> tuple[CommEstimate, ...]:
    """:func:`predicted_collectives` summed per (kind, mesh axes, why)."""
    totals: dict[tuple, list[float]] = {}
    for c, times, what in predicted_collectives(graph, solution, rewrites, weight):
        entry = totals.setdefault((c.kind, c.axes, what), [0.0, 0.0])
        entry[0] += times * c.num_bytes
        entry[1] += times * c.seconds(solution.mesh)
    return tuple(CommEstimate(kind=kind, mesh_axes=axes, num_bytes=int(round(b)), seconds=float(s), what=what)
                 for (kind, axes, what), (b, s) in totals.items())


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
