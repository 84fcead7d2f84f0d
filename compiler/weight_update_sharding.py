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
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from alpa_like.compiler.auto_sharding import ShardingSolution
from alpa_like.compiler.op_graph import OpGraph
from alpa_like.compiler.propagation import ELEMENTWISE
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.strategies import make_spec


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


def update_path(graph: OpGraph, output_tensor: int, shape: tuple[int, ...]) -> tuple[set[int], set[int]]:
    """(input tensors, gradient tensors) reached backwards from a new parameter through element-wise
    operators of ``shape``; the walk stops at values of the ``"grad"`` marker."""
    inputs, grads, seen = set(), set(), set()
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
        stack.extend(x for x in node.operands if x is not None and graph.tensors[x].shape == shape)
    return inputs, grads


def gradient_producers(graph: OpGraph, grad_tensor: int) -> set[int]:
    """Nodes that compute a gradient: backwards from it through merged (trivial) operators of the same
    number of elements, including the first non-merged operators reached."""
    size = math.prod(graph.tensors[grad_tensor].shape)
    nodes, stack = set(), [graph.tensors[grad_tensor].producer]
    while stack:
        n = stack.pop()
        node = graph.nodes[n]
        if n in nodes or node.kind != "op":
            continue
        nodes.add(n)
        if node.follow is None:
            continue
        stack.extend(graph.tensors[x].producer for x in node.operands
                     if x is not None and math.prod(graph.tensors[x].shape) == size)
    return nodes


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
        inputs, grads = update_path(graph, out, shape)
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
        if spec is None:
            continue
        states = tuple(sorted(graph.nodes[graph.tensors[t].producer].input_index for t in inputs
                              if t != p_tensor))
        pins = tuple((eqn, pos) for g in grads for eqn, pos, kind in graph.markers[g] if kind == "grad")
        rewrites.append(WeightUpdateSharding(param_input=i, spec=spec, axes=axes, state_inputs=states,
                                             grad_pins=pins, grad_nodes=tuple(sorted(producers))))
    return tuple(rewrites)
