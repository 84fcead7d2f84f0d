"""The stage option's part of pipeline planning: which (submesh, logical mesh) pairs the intra-op pass
profiles, and how the stages are chosen from the resulting cost table.

* :class:`~alpa_like.compiler.options.AutoStageOption`: every submesh shape of the cluster (or those given)
  with its logical views; the stage DP (:func:`~alpa_like.compiler.stage_dp.solve_stages`), optionally over
  equal layer lengths only (Alpa's "equal layer" ablation, :func:`equal_layer_costs`).
* :class:`~alpa_like.compiler.options.ManualStageOption` and
  :class:`~alpa_like.compiler.options.UniformStageOption`: the stages given, priced for their placement and
  memory as the DP prices its own.

Where the DP's table can only estimate a cost, :func:`estimate_tables` gives its alternatives for the planner
to settle by simulation (:func:`~alpa_like.compiler.pipeline.plan_and_profile`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.indices import SubmeshIdx
from alpa_like.compiler.logical_mesh import logical_shapes
from alpa_like.compiler.options import (AutoStageOption, ManualLayerOption, ManualStageOption, PipeshardParallel,
                                        Shape, StageOption, UniformStageOption)
from alpa_like.compiler.schedules import ScheduleName
from alpa_like.compiler.stage_costs import StageChoice, StageCosts, StageSolution, pipeline_latency
from alpa_like.compiler.stage_dp import micro_batches_in_flight, solve_stages
from alpa_like.compiler.stage_placement import price_placed_stages
from alpa_like.compiler.stage_profiling import StageProfile
from alpa_like.compiler.submesh import submesh_shapes


def check_layers_for_stages(method: PipeshardParallel, num_layers: int) -> None:
    """ValueError naming the cause when ``method``'s stage option asks for several stages of a step that
    ``ManualLayerOption`` left as one layer (it found no ``al.mark_pipeline_boundary()`` call)."""
    option = method.stage_option
    asked = (len(option.forward_stage_layer_ids) if isinstance(option, ManualStageOption)
             else option.num_stages if isinstance(option, UniformStageOption) else 1)
    if num_layers == 1 and asked > 1 and isinstance(method.layer_option, ManualLayerOption):
        raise ValueError(f"ManualLayerOption found no al.mark_pipeline_boundary() call in the step, so the step is "
                         f"one layer, but {type(option).__name__} asks for {asked} stages: call "
                         "al.mark_pipeline_boundary() between the layers of the loss, or cut it with "
                         "AutoLayerOption(layer_num=...)")


def candidate_meshes(option: StageOption, cluster: ClusterSpec,
                     num_layers: int) -> tuple[list[Shape], list[list[Shape]]]:
    """The (submesh, logical views) pairs the intra-op pass must profile for ``option``: the submesh shapes,
    and per submesh its logical views."""
    n, m = cluster.num_nodes, cluster.num_devices_per_node
    if isinstance(option, AutoStageOption):
        submeshes = list(option.submesh_shapes or submesh_shapes(n, m, option.shape_space(n)))
        views = [logical_shapes(a * b) for a, b in submeshes]
        if option.logical_shape_space == "single_node_model_parallel":
            views = [[(x, y) for x, y in v if m % y == 0 and y <= b] for v, (_, b) in zip(views, submeshes)]
        return submeshes, views
    if isinstance(option, ManualStageOption):
        _check_manual(option, num_layers)
        pairs = list(dict.fromkeys(zip(map(tuple, option.submesh_physical_shapes),
                                       map(tuple, option.submesh_logical_shapes))))
        submeshes = list(dict.fromkeys(p for p, _ in pairs))
        return submeshes, [[v for p, v in pairs if p == s] for s in submeshes]
    sub = option.submesh_physical_shape or _uniform_submesh(option.num_stages, n, m)
    views = [option.submesh_logical_shape] if option.submesh_logical_shape else logical_shapes(sub[0] * sub[1])
    return [tuple(sub)], [list(views)]


def _uniform_submesh(num_stages: int, n: int, m: int) -> Shape:
    """The submesh of each of ``num_stages`` equal stages on an ``n x m`` cluster; else a ValueError."""
    if n % num_stages == 0:
        return (n // num_stages, m)
    if n == 1 and m % num_stages == 0:
        return (1, m // num_stages)
    raise ValueError(f"UniformStageOption(num_stages={num_stages}) cannot split a {n} x {m} cluster evenly; "
                     "give submesh_physical_shape")


def _check_manual(option: ManualStageOption, num_layers: int) -> None:
    """ValueError unless ``option`` gives each of the ``num_layers`` layers once, in order, with one
    physical and one logical shape per stage."""
    ids = [l for stage in option.forward_stage_layer_ids for l in stage]
    if ids != list(range(num_layers)):
        raise ValueError(f"ManualStageOption.forward_stage_layer_ids must list layers 0..{num_layers - 1} in order, "
                         f"each once, as consecutive runs; got {option.forward_stage_layer_ids}")
    count = len(option.forward_stage_layer_ids)
    if len(option.submesh_physical_shapes) != count or len(option.submesh_logical_shapes) != count:
        raise ValueError(f"ManualStageOption needs one physical and one logical shape per stage ({count}), got "
                         f"{len(option.submesh_physical_shapes)} and {len(option.submesh_logical_shapes)}")


def choose_stages(method: PipeshardParallel, costs: StageCosts, cluster: ClusterSpec) -> StageSolution:
    """The stages of ``method.stage_option`` on the cost table: the stage DP's (Eq. 3.2-3.5, every layer
    length or equal ones), or the stages given by hand (manual, uniform) priced as the DP prices its own."""
    option, b = method.stage_option, method.num_micro_batches
    shape = (cluster.num_nodes, cluster.num_devices_per_node)
    if isinstance(option, AutoStageOption):
        def solve(table: StageCosts) -> StageSolution:
            return solve_stages(table, shape, b, cluster.device_memory, epsilon=option.epsilon,
                                schedule=method.pipeline_schedule)
        if not option.equal_layers:
            return solve(costs)
        solutions, errors = [], []
        for per in (k for k in range(1, costs.num_layers + 1) if costs.num_layers % k == 0):
            try:
                solutions.append(solve(equal_layer_costs(costs, per)))
            except ValueError as e:  # this stage length does not cover the cluster or does not fit
                errors.append(f"{per} layers per stage: {str(e).splitlines()[0]}")
        if not solutions:
            raise ValueError("equal_layers: no stage length gives a plan; " + "; ".join(errors))
        return min(solutions, key=lambda sol: sol.iteration_time)
    if isinstance(option, ManualStageOption):
        layout = [((ids[0], ids[-1]), tuple(p), tuple(v)) for ids, p, v in zip(
            option.forward_stage_layer_ids, option.submesh_physical_shapes, option.submesh_logical_shapes)]
        return _fixed_solution(costs, layout, b, choose_view=False, cluster=cluster,
                               schedule=method.pipeline_schedule)
    if costs.num_layers % option.num_stages:
        raise ValueError(f"UniformStageOption(num_stages={option.num_stages}) needs a layer count divisible by "
                         f"it; the step has {costs.num_layers} layers")
    per = costs.num_layers // option.num_stages
    layout = [((q * per, q * per + per - 1), costs.submeshes[0], None) for q in range(option.num_stages)]
    return _fixed_solution(costs, layout, b, choose_view=True, cluster=cluster,
                           schedule=method.pipeline_schedule)


def equal_layer_costs(costs: StageCosts, layers_per_stage: int) -> StageCosts:
    """``costs`` with every stage that is not ``layers_per_stage`` layers starting at a multiple of it made
    infeasible (``t_intra = inf``), so the stage DP cuts equal stages only."""
    k = costs.num_layers
    if not isinstance(layers_per_stage, int) or layers_per_stage < 1 or k % layers_per_stage:
        raise ValueError(f"layers_per_stage must be an int dividing the {k} layers, got {layers_per_stage!r}")
    first, last = np.arange(k)[:, None], np.arange(k)[None, :]
    keep = (first % layers_per_stage == 0) & (last - first + 1 == layers_per_stage)
    return dataclasses.replace(costs, t_intra=np.where(keep[:, :, None, None], costs.t_intra, np.inf))


def _fixed_solution(costs: StageCosts, layout, num_micro_batches: int, choose_view: bool,
                    cluster: ClusterSpec, schedule: ScheduleName) -> StageSolution:
    """Evaluates Eq. 3.2 for stages given by hand, priced for their placement as the DP prices its own.
    Per stage, among the entries of its logical view (or of every view, for uniform stages) the fastest that
    fits in memory (Eq. 3.5 with the micro-batches the ``schedule`` keeps in flight there, as the DP counts
    them), else the one needing the least."""
    device_memory = cluster.device_memory
    held = micro_batches_in_flight(schedule, len(layout), num_micro_batches)[::-1]  # first stage first
    stages = []
    for q, ((i, j), sub, view) in enumerate(layout):
        p = costs.submeshes.index(sub)
        views = costs.logical_shapes[p]
        options = [e for e, v in enumerate(views) if choose_view or v == view]
        memory = {e: float(costs.mem_stage[i, j, p, e] + held[q] * costs.mem_act[i, j, p, e]) for e in options}
        fitting = [e for e in options if memory[e] <= device_memory]
        e = (min(fitting, key=lambda e: costs.t_intra[i, j, p, e]) if fitting
             else min(options, key=memory.__getitem__))
        stages.append(StageChoice(layers=(i, j), submesh_index=SubmeshIdx(p), submesh=sub, logical_shape=views[e],
                                  view_index=e, variant=costs.variants[p][e],
                                  t_intra=float(costs.t_intra[i, j, p, e]), memory_per_device=memory[e],
                                  step_seconds=costs.step_seconds_of(i, j, p)))
    stages = price_placed_stages(costs, stages, cluster.num_devices_per_node)
    t = [s.t_intra for s in stages]
    return StageSolution(stages=tuple(stages), iteration_time=pipeline_latency(stages, num_micro_batches, schedule),
                         t_max=max(t), num_micro_batches=num_micro_batches, num_t_max_evaluated=0)


def settles_estimates(method: PipeshardParallel) -> bool:
    """Whether the planner simulates the DP's plans under :func:`estimate_tables`: the simulated backend
    runs the schedule (one stage per mesh; not TeraPipe) and the DP chose the stages."""
    return (method.virtual_stages == 1 and method.pipeline_schedule != ScheduleName.TERAPIPE
            and isinstance(method.stage_option, AutoStageOption))


def estimate_tables(method: PipeshardParallel, profile: StageProfile, cluster: ClusterSpec,
                    solution: StageSolution) -> list[tuple[StageCosts, StageSolution | None]]:
    """The stage DP's table under each pricing of what it can only estimate, with the DP's solution on it
    (None when nothing fits); the first is the main table and its ``solution``. The planner simulates the
    distinct plans and keeps the fastest.

    * Shared NICs: ``nic_wait`` is an expected wait, high where transfers never collide (a GPT's equal
      stages under 1F1B take turns without waiting) and right where they do (Wide-ResNet's uneven stages):
      the table without it.
    * Senders on fewer nodes: a stage of several nodes receives at its own NICs in the table, but a
      neighbour inside one node sends through one
      (:func:`~alpa_like.compiler.stage_profiling.sender_limited_extra`): each table above with that extra,
      solved only when the table's own plan has a stage the extra applies to (otherwise that plan is also
      the best under the extra, which raises no other plan below its old cost)."""
    costs, limited = profile.costs, profile.sender_limited
    tables: list[tuple[StageCosts, StageSolution | None]] = [(costs, solution)]
    if costs.nic_wait is not None and costs.nic_wait.any():
        blind = dataclasses.replace(costs, nic_wait=None)
        tables.append((blind, _solve_or_none(method, blind, cluster)))
    for table, found in list(tables):
        if found is not None and any(
                limited[s.layers[0], s.layers[1], s.submesh_index] > 0 for s in found.stages):
            pessimistic = dataclasses.replace(table, t_intra=table.t_intra + limited[..., None])
            tables.append((pessimistic, _solve_or_none(method, pessimistic, cluster)))
    return tables


def _solve_or_none(method: PipeshardParallel, costs: StageCosts, cluster: ClusterSpec) -> StageSolution | None:
    """:func:`choose_stages`, or None when no plan fits under this pricing."""
    try:
        return choose_stages(method, costs, cluster)
    except ValueError:  # no plan fits under this pricing
        return None
