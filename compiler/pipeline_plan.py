"""The pipeline plan: the chosen stages placed on the cluster and written down as a :class:`ParallelPlan`,
and TeraPipe's token slicing on them.

:func:`plan_of_stages` places the stages' submeshes (:func:`~alpa_like.compiler.submesh.assign_devices`:
larger first, neighbours close) and lists each stage's parameters with the specs its layers' intra-op
solutions chose; :func:`plan_token_slicing` runs the TeraPipe DP
(:mod:`~alpa_like.compiler.terapipe_planning`) on the stages the stage DP chose.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.options import PipeshardParallel
from alpa_like.compiler.plan import CommEstimate, ParallelPlan, StagePlan, TensorPlan
from alpa_like.compiler.sliced_step import SlicedStep
from alpa_like.compiler.stage_costs import StageChoice, StageSolution
from alpa_like.compiler.stage_profiling import LayerCost, StageProfile
from alpa_like.compiler.submesh import assign_devices
from alpa_like.compiler.terapipe_planning import attention_fractions, choose_token_slicing
from alpa_like.compiler.token_slicing import check_batch_slices, token_slicing_scheme
from alpa_like.compiler.trace import TracedStep


def plan_of_stages(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec, profile: StageProfile,
                   stages: Sequence[StageChoice], iteration_time: float) -> ParallelPlan:
    """The plan of the stage DP's ``stages`` (placed by :func:`~alpa_like.compiler.submesh.assign_devices`,
    each with its layers' ILP solutions from ``profile``), estimated at ``iteration_time``; no compile times."""
    devices = assign_devices([c.submesh for c in stages], cluster.num_nodes, cluster.num_devices_per_node)
    planned = tuple(_stage_plan(q, choice, devices[q], sliced.traced, sliced.summaries, profile,
                                method.num_micro_batches) for q, choice in enumerate(stages))
    return ParallelPlan(method=repr(method), num_micro_batches=method.num_micro_batches, cluster=cluster,
                        stages=planned, pipeline_schedule=method.pipeline_schedule,
                        estimated_iteration_time=float(iteration_time), warnings=tuple(sliced.warnings))


def _stage_plan(q: int, choice: StageChoice, device_ids, traced: TracedStep, summaries, profile: StageProfile,
                num_micro_batches: int) -> StagePlan:
    """The StagePlan of one chosen stage: its layers' parameters with the ILP's specs, times per step.

    Optimizer state is not listed leaf by leaf: it is counted in ``memory_per_device`` (Eq. 3.5's
    ``mem_stage``: parameters, gradients, optimizer state) as sharded over the stage's devices (weight-update
    sharding); ``peak_memory_per_device`` adds the activations the schedule keeps in flight."""
    first, last = choice.layers
    p = choice.submesh_index
    v = choice.view_index
    mesh_shape = choice.logical_shape
    costs = [profile.layer_costs[(l, p, v)] for l in range(first, last + 1)]
    inputs, comm_seconds, compute, flops = [], 0.0, 0.0, 0.0
    for l, cost in zip(range(first, last + 1), costs, strict=True):
        comm_seconds += cost.comm_seconds * num_micro_batches
        compute += cost.compute_seconds * num_micro_batches
        s = summaries[l]
        flops += (s.forward_flops + s.backward_flops) * num_micro_batches + s.apply_flops
        for k in s.param_inputs:
            leaf = traced.in_leaves[k]
            spec = profile.input_spec(l, p, v, k)
            shards = 1 if spec is None else spec.num_shards(mesh_shape)
            inputs.append(TensorPlan(path=leaf.path, shape=leaf.shape, dtype=leaf.dtype, role="param", spec=spec,
                                     bytes_per_device=leaf.nbytes // shards))
    communication = stage_communication(costs, num_micro_batches, comm_seconds)
    state_bytes = int(profile.costs.mem_stage[first, last, p, v])
    return StagePlan(stage_id=q, layer_ids=tuple(range(first, last + 1)), submesh_shape=tuple(choice.submesh),
                     logical_mesh_shape=tuple(mesh_shape), mesh_axis_names=("x", "y"),
                     device_ids=tuple(device_ids), inputs=tuple(inputs), outputs=(), communication=communication,
                     flops=flops, compute_seconds=compute, memory_per_device=state_bytes,
                     peak_memory_per_device=int(choice.memory_per_device))


OTHER_COMMUNICATION = "the rest of the ILP's objective (Eq. 3.1): replicated work, all-reduce latencies"


def stage_communication(layer_costs: Sequence[LayerCost], num_micro_batches: int,
                        seconds: float) -> tuple[CommEstimate, ...]:
    """A stage's collectives per step: its layers' (per micro-batch) summed per (kind, mesh axes, why) over
    ``num_micro_batches`` runs, and a last row ``"other"`` with what ``seconds`` (the stage's Eq. 3.1
    objective per step, which the stage DP priced and the simulator reads) holds beyond them, so that the
    rows add up to it. The layers' rows price their combined gradient all-reduces as the objective does (one
    latency in all); only combined all-reduces inside a loop body (which the rows repeat) can take the rows
    past the objective, and then there is no ``"other"`` row."""
    totals: dict[tuple, list[float]] = {}
    for cost in layer_costs:
        for c in cost.communication:
            entry = totals.setdefault((c.kind, c.mesh_axes, c.what), [0.0, 0.0])
            entry[0] += c.num_bytes * num_micro_batches
            entry[1] += c.seconds * num_micro_batches
    rows = [CommEstimate(kind=kind, mesh_axes=axes, num_bytes=int(round(b)), seconds=s, what=what)
            for (kind, axes, what), (b, s) in totals.items()]
    rest = seconds - sum(c.seconds for c in rows)
    if rest > 1e-9 * max(seconds, 1e-30):
        rows.append(CommEstimate(kind="other", mesh_axes=(), num_bytes=0, seconds=rest, what=OTHER_COMMUNICATION))
    return tuple(rows)


def plan_token_slicing(method: PipeshardParallel, sliced: SlicedStep, solution: StageSolution,
                       plan: ParallelPlan) -> ParallelPlan:
    """The TeraPipe DP after the stage DP (:mod:`alpa_like.compiler.terapipe_planning`): keeps token slicing
    only where it lowers the predicted time. The plan's estimate is the stage DP's, scaled by the token
    model's ratio of sliced to unsliced latency."""
    batch_leaves = [leaf for leaf in sliced.traced.in_leaves if leaf.is_batch and len(leaf.shape) > 1]
    if not batch_leaves:
        return dataclasses.replace(plan, warnings=plan.warnings + (
            "terapipe: no batch input has a sequence dim (dim 1); no token slicing",))
    seq_len, batch = batch_leaves[0].shape[1], batch_leaves[0].shape[0]
    rows = batch // method.num_micro_batches
    fixed = None
    if method.token_slices is not None:
        fixed = token_slicing_scheme(method.token_slices, method.num_micro_batches, rows)
        check_batch_slices(fixed, batch, seq_len)
    stage_layers = [tuple(range(s.layers[0], s.layers[1] + 1)) for s in solution.stages]
    fractions = attention_fractions(sliced.jaxpr, sliced.pieces, stage_layers)
    decision = choose_token_slicing([s.t_intra for s in solution.stages], fractions, seq_len,
                                    method.num_micro_batches, rows, fixed=fixed,
                                    shared_contexts=method.share_slice_executables)
    scale = decision.latency / decision.latency_unsliced if decision.latency_unsliced > 0 else 1.0
    # The plan says what will run: with token slicing the step's micro-batches are the scheme's batch slices.
    micro_batches = len(decision.batch_slices) if decision.batch_slices else plan.num_micro_batches
    return dataclasses.replace(plan, token_slicing=decision.batch_slices, num_micro_batches=micro_batches,
                               estimated_iteration_time=plan.estimated_iteration_time * scale,
                               iteration_time_without_token_slicing=plan.estimated_iteration_time)
