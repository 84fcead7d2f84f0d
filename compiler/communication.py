"""What a sharding plan communicates per step, collective by collective: the rows of a plan's communication table.

Shared by the SPMD plan (:mod:`alpa_like.shard_parallel`) and each pipeline stage's plan
(:mod:`alpa_like.compiler.pipeline_plan`), so that both report bytes weighted as the ILP's objective (Eq. 3.1)
weights their seconds: an operator's collectives as often as the operator runs, gradient synchronisation as
often as the gradients are reduced.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from alpa_like.compiler.auto_sharding import ShardingSolution, without_latency
from alpa_like.compiler.op_graph import OpGraph
from alpa_like.compiler.plan import CommEstimate
from alpa_like.compiler.strategies import Collective, shards
from alpa_like.compiler.weight_update_sharding import WeightUpdateSharding


COMBINED = "gradient synchronisation (combined into one all-reduce)"


def predicted_collectives(graph: OpGraph, solution: ShardingSolution, rewrites: Sequence[WeightUpdateSharding],
                          weight=lambda n: 1.0, sync_weight: float = 1.0) -> list[tuple[Collective, float, str]]:
    """Every collective the plan performs per step: (collective, times per step, why).

    Strategy collectives of the operators that compute a gradient are ``gradient synchronisation``; those
    of rewritten gradients become reduce-scatters, plus one all-gather of the updated parameter. The
    all-reduces XLA combines (``solution.combined``) are ``combined gradient synchronisation``
    (:func:`communication` prices their latency once). Gradient synchronisation runs ``sync_weight`` times
    per run of its operator (``1 / m`` when micro-batches accumulate partial sums).
    """
    mesh = solution.mesh
    rewritten = {n: r for r in rewrites for n in r.grad_nodes}
    out = []
    for node in graph.nodes:
        r = rewritten.get(node.id)
        for c in solution.strategies[node.id].collectives:
            if r is not None and c.kind == "all-reduce" and set(c.axes) <= set(r.axes):
                out.append((dataclasses.replace(c, kind="reduce-scatter"), weight(node.id) * sync_weight,
                            "gradient synchronisation"))
            elif c.kind == "all-reduce" and node.id in solution.combined:
                out.append((c, weight(node.id) * sync_weight, COMBINED))
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


def communication(graph, solution, rewrites, weight, sync_weight: float = 1.0, *,
                  latency_once: bool = False) -> tuple[CommEstimate, ...]:
    """:func:`predicted_collectives` summed per (kind, mesh axes, why); combined all-reduces pay their bytes
    each and one latency per group (as XLA runs them: one all-reduce per set of mesh axes), or with
    ``latency_once`` one latency in all, the largest, as the ILP's objective prices them."""
    totals: dict[tuple, list[float]] = {}
    no_latency = without_latency(solution.mesh)
    largest = (0.0, None)  # with latency_once: the largest combined latency and its group
    for c, times, what in predicted_collectives(graph, solution, rewrites, weight, sync_weight):
        key = (c.kind, c.axes, what)
        entry = totals.setdefault(key, [0.0, 0.0])
        entry[0] += times * c.num_bytes
        if what == COMBINED:
            latency = times * (c.seconds(solution.mesh) - c.seconds(no_latency))
            if latency_once:
                largest = max(largest, (latency, key), key=lambda pair: pair[0])
                latency = 0.0
            entry[1] += times * c.seconds(no_latency) + (0.0 if entry[1] else latency)
        else:
            entry[1] += times * c.seconds(solution.mesh)
    if largest[1] is not None:
        totals[largest[1]][1] += largest[0]
    return tuple(CommEstimate(kind=kind, mesh_axes=axes, num_bytes=int(round(b)), seconds=float(s), what=what)
                 for (kind, axes, what), (b, s) in totals.items())
