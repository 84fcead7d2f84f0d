"""Post-ILP: all-reduce -> reduce-scatter + all-gather for gradients whose update can be sharded.

Dissertation §3.4.2: "we also apply a set of post-ILP communication optimizations, such as replacing
all-reduce with reduce-scatter and all-gather, whenever applicable, because the latter reduces the number of
replicated tensors and corresponding computations, while keeping the communication volume the same. This
achieves the effect of weight update sharding or ZeRO optimizer."

For each parameter the pass finds, on the operator graph:

* its update path: the element-wise operators of the parameter's shape between the gradient (a value of
  the ``"grad"`` marker) and the new parameter (the step output that replaces it), and the optimizer-state
  inputs (Adam's moments) read on that path;
* the mesh axes over which the gradient was all-reduced (collectives of the chosen strategies of the
  operators that produce it) and on which the parameter is replicated.

On those axes the gradient and the optimizer state are split as well (one more mesh axis on the largest
dim it divides): the all-reduce becomes a reduce-scatter, the update runs on a shard, and the new parameter
is all-gathered back to its layout. Same bytes (``2 (n-1)/n M`` either way), ``1/n`` of the optimizer
state and update compute per device.

Parameters so small that their all-gather is latency-bound (:func:`latency_bound`) are left alone: there
the rewrite adds a collective's latency per step and saves almost no memory.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from alpa_like.compiler.auto_sharding import ShardingSolution
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.op_graph import OpGraph, gradient_producers
from alpa_like.compiler.propagation import ELEMENTWISE
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.strategies import make_spec, shards


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightUpdateSharding:
    """The rewrite for one parameter."""

    param_input: int
    """Jaxpr input index of the parameter."""
    spec: ShardingSpec
    """Layout of the gradient and the optimizer state after the rewrite."""
    axes: tuple[int, ...]
    """Mesh axes added to the parameter's own layout (the all-reduce axes turned into reduce-scatters)."""
    state_inputs: tuple[int, ...]
    """Jaxpr input indices of the optimizer state on the update path."""
    grad_pins: tuple[tuple[int, int], ...]
    """(marker equation index, operand position) of the gradient values to pin to ``spec``."""
    grad_nodes: tuple[int, ...]
    """Graph nodes whose all-reduces (over ``axes``) become reduce-scatters."""
    update_tensors: tuple[int, ...] = ()
    """Tensors computed on the update path (new moments, the new parameter, ...): laid out as ``spec``."""


def update_path(graph: OpGraph, output_tensor: int, shape: tuple[int, ...]) -> tuple[set[int], set[int]]:
    """(input tensors, gradient tensors) reached backwards from a new parameter through element-wise
    operators of ``shape``; the walk stops at values of the ``"grad"`` marker."""
    inputs, grads, _ = update_walk(graph, output_tensor, shape)
    return inputs, grads


def update_walk(graph: OpGraph, output_tensor: int, shape: tuple[int, ...]) -> tuple[set[int], set[int], set[int]]:
    """:func:`update_path` plus the tensors computed on the path (the third set)."""
    inputs, grads, seen, computed = set(), set(), set(), set()
    stack = [output_tensor]
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if any(kind == "grad" for _, _, kind in graph.markers.get(t, ())):
            grads.add(t)
            continue
        node = graph.nodes[graph.tensors[t].producer]
        if node.kind == "input":
            inputs.add(t)
            continue
        if node.kind != "op" or node.primitive not in ELEMENTWISE:
            continue
        computed.add(t)
        stack.extend(x for x in node.operands if x is not None and graph.tensors[x].shape == shape)
    return inputs, grads, computed


def add_axes(spec: ShardingSpec, shape: Sequence[int], axes: Sequence[int],
             mesh_shape: tuple[int, ...]) -> ShardingSpec | None:
    """``spec`` with ``axes`` also splitting one dim (an unsharded one first, then the largest) that the
    total number of shards divides; None if no dim can take them."""
    extra = math.prod(mesh_shape[a] for a in axes)
    order = sorted(range(len(shape)), key=lambda d: (bool(spec.axes[d]), -shape[d], d))
    for d in order:
        have = math.prod(mesh_shape[a] for a in spec.axes[d])
        if shape[d] % (have * extra) == 0:
            return make_spec([tuple(a) + tuple(axes) if i == d else a for i, a in enumerate(spec.axes)])
    return None


def latency_bound(num_bytes: float, axes: tuple[int, ...], mesh: LogicalMesh) -> bool:
    """Whether gathering ``num_bytes`` over ``axes`` takes less time on the wire than its latency ``alpha``.

    There the rewrite does not pay: the extra all-gather per step costs about ``alpha`` more than the
    all-reduce it splits (which XLA also combines with the other gradients'), while the optimizer state and
    update compute it shards are below ``alpha * bandwidth`` bytes.
    """
    axis = axes[0] if len(axes) == 1 else axes
    no_latency = mesh.without_latency()
    transfer = no_latency.all_gather_cost(num_bytes, axis)
    return transfer < mesh.all_gather_cost(num_bytes, axis) - transfer


def plan_weight_update_sharding(graph: OpGraph, solution: ShardingSolution, param_inputs: Sequence[int],
                                output_to_input: Sequence[int | None]) -> tuple[WeightUpdateSharding, ...]:
    """The rewrite for every parameter where it applies (see the module docstring).

    Args:
      graph: the operator graph the solution is for.
      solution: the ILP's choice.
      param_inputs: jaxpr input indices of the parameters.
      output_to_input: per step output, the input it replaces (None if none).
    """
    mesh_shape = solution.mesh.shape
    new_value = {i: j for j, i in enumerate(output_to_input) if i is not None}
    rewrites = []
    for i in param_inputs:
        j = new_value.get(i)
        out = graph.output_tensors[j] if j is not None else None
        if out is None:
            continue
        p_tensor = graph.input_tensors[i]
        shape = graph.tensors[p_tensor].shape
        p_spec = solution.tensor_spec(p_tensor)
        inputs, grads, computed = update_walk(graph, out, shape)
        if not grads:
            continue
        producers = set().union(*(gradient_producers(graph, g) for g in grads))
        used = {a for dim in p_spec.axes for a in dim}
        reduced = {a for n in producers for c in solution.strategies[n].collectives if c.kind == "all-reduce"
                   for a in c.axes}
        axes = tuple(sorted(a for a in reduced if a not in used and mesh_shape[a] > 1))
        if not axes:
            continue
        spec = add_axes(p_spec, shape, axes, mesh_shape)
        if spec is None or latency_bound(graph.tensors[p_tensor].nbytes / shards(p_spec, mesh_shape), axes,
                                         solution.mesh):
            continue
        states = tuple(sorted(graph.nodes[graph.tensors[t].producer].input_index for t in inputs
                              if t != p_tensor))
        pins = tuple((eqn, pos) for g in grads for eqn, pos, kind in graph.markers[g] if kind == "grad")
        rewrites.append(WeightUpdateSharding(param_input=i, spec=spec, axes=axes, state_inputs=states,
                                             grad_pins=pins, grad_nodes=tuple(sorted(producers)),
                                             update_tensors=tuple(sorted(computed))))
    return tuple(rewrites)
