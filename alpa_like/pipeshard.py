"""``PipeshardParallel``: pipeline stages on submeshes (inter-op DP) with intra-op sharding inside each.

Planning (Alpa dissertation 3.5, Alg. 2), each step a pass of :mod:`alpa_like.compiler`::

    trace the step under layer construction  (al.grad cuts the loss: AutoLayerOption -> Eq. 3.6 clustering,
                                              ManualLayerOption -> al.mark_pipeline_boundary())
    slice_layers / layer_summaries           (per-layer forward, backward, apply-grad; FLOPs, params, activations)
    profile_stage_costs                      (intra-op ILP per layer and (submesh, logical mesh): t_intra table)
    solve_stages                             (Eq. 3.2-3.5 with the t_max enumeration; or the manual/uniform stages)
    assign_devices                           (submeshes onto the cluster, larger first, neighbours close)
    -> ParallelPlan

``al.plan`` stops at the plan; calling a parallelized step also builds the per-stage programs
(:mod:`alpa_like.compiler.stage_construction`), the schedule (:mod:`alpa_like.compiler.schedules`) and the
static instruction programs, and runs them on the local MPMD backend
(:mod:`alpa_like.runtime.pipeshard_runtime`).
"""
from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler import jax_compat
from alpa_like.compiler.auto_sharding import PassOptions
from alpa_like.compiler.cross_layer_grad import split_cross_layer_grad_sums
from alpa_like.compiler.grad_accumulation import grad_markers, split_at_grad_marker
from alpa_like.compiler.layer_construction import layering
from alpa_like.compiler.layer_slicing import layer_summaries, slice_layers
from alpa_like.compiler.logical_mesh import logical_shapes
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.stage_dp import (StageChoice, StageCosts, StageSolution, micro_batches_in_flight,
                                         pipeline_latency, price_placed_stages,
                                         solve_stages)
from alpa_like.compiler.stage_construction import build_stage_program, micro_batch_key_draws
from alpa_like.compiler.stage_profiling import StageProfile, apply_phase_inputs, profile_stage_costs
from alpa_like.compiler.stage_sharding import StageSharding, stage_shardings
from alpa_like.compiler.submesh import assign_devices, submesh_shapes
from alpa_like.compiler.terapipe_planning import attention_fractions, choose_token_slicing
from alpa_like.compiler.trace import TracedStep, trace_step
from alpa_like.compiler.input_roles import input_roles
from alpa_like.compiler.options import AutoStageOption, ManualStageOption, PipeshardParallel, StageOption
from alpa_like.compiler.plan import CommEstimate, ParallelPlan, StagePlan, TensorPlan
from alpa_like.runtime.instructions import emit_programs
from alpa_like.runtime.pipeshard_runtime import PipeshardExecutable
from alpa_like.compiler.schedules import ScheduleName, make_schedule
from alpa_like.runtime.simulator import simulate
from alpa_like.runtime.terapipe_runtime import TerapipeExecutable
from alpa_like.compiler.token_slicing import check_batch_slices, token_slicing_scheme

Shape = tuple[int, int]


class _Progress:
    """Planning progress on stderr: numbered steps with elapsed time, and a bar for the intra-op solves."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.perf_counter()

    def step(self, text: str) -> None:
        if self.enabled:
            print(f"[alpa_like] {time.perf_counter() - self.start:7.1f}s  {text}", file=sys.stderr, flush=True)

    def solves(self) -> Callable[[int, int], None]:
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.perf_counter()
            if self.enabled and (done == total or now - last[0] > 2.0):
                last[0] = now
                print(f"[alpa_like] {now - self.start:7.1f}s    intra-op solves {done}/{total}", file=sys.stderr,
                      flush=True)
        return report


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlicedStep:
    """A step traced under layer construction and cut into per-layer pieces (what planning and the runtime
    share)."""

    traced: TracedStep
    jaxpr: Any
    """The step jaxpr with parameter markers bypassed."""
    pieces: tuple
    roles: tuple[str, ...]
    warnings: tuple[str, ...]
    summaries: tuple
    optimizer_inputs: tuple[tuple[int, ...], ...]
    seconds: float

    @property
    def closed_jaxpr(self):
        return ClosedJaxpr(self.jaxpr, self.traced.closed_jaxpr.consts)


def _without_effects(sliced: SlicedStep, where: str) -> SlicedStep:
    """``sliced`` with its effects (``jax.debug.print``, ``jax.debug.callback``) out of the pieces, for a
    runtime that cannot run them (``where``); a warning names them. The local backend runs them."""
    eqns = sliced.jaxpr.eqns
    effects = sorted({e.primitive.name for e in eqns if e.effects})
    if not effects:
        return sliced
    warnings.warn(f"PipeshardParallel does not run the step's {', '.join(effects)} (jax.debug.print / "
                  f"jax.debug.callback) {where}; the local backend (al.init('local')) and the SPMD methods "
                  "run them", stacklevel=4)
    return dataclasses.replace(sliced, pieces=tuple(None if e.effects else p
                                                    for e, p in zip(eqns, sliced.pieces, strict=True)))


def slice_step(method: PipeshardParallel, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
               batch_argnums: Sequence[int]) -> SlicedStep:
    """Traces ``fun(*args)`` under ``method``'s layer option (one micro-batch) and slices it into layers.

    Gradients summed across layers are split per layer (:mod:`~alpa_like.compiler.cross_layer_grad`) except
    under the ``terapipe`` schedule, whose runtime differentiates each token slice itself and reads al.grad's
    results one per differentiated leaf."""
    start = time.perf_counter()
    with layering(method.layer_option.layering()):
        traced = trace_step(fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums,
                            num_micro_batches=method.num_micro_batches)
    if any(is_marker(e, "boundary") for e in traced.closed_jaxpr.jaxpr.eqns):
        raise ValueError("al.mark_pipeline_boundary() was called outside the function al.grad differentiates, "
                         "where it cuts nothing: call it inside the loss, between two layers' forward code")
    markers = grad_markers(traced.closed_jaxpr)
    if len(markers) > 1:
        raise ValueError(f"PipeshardParallel needs exactly one al.grad / al.value_and_grad call in the step (its "
                         f"loss is what the pipeline cuts into layers), found {len(markers)}")
    if markers and method.num_micro_batches > 1:  # a value computed from the batch after al.grad: an error
        split_at_grad_marker(traced.closed_jaxpr, [leaf.is_batch for leaf in traced.in_leaves])
    # Parameter markers have done their job (param_mask); without them each layer reads its own parameters.
    jaxpr = jax_compat.bypass_eqns(traced.closed_jaxpr.jaxpr, lambda e: is_marker(e, "param"))
    pieces = slice_layers(jaxpr)
    split = jaxpr
    if method.pipeline_schedule != ScheduleName.TERAPIPE:
        split = split_cross_layer_grad_sums(jaxpr, pieces)  # tied weights: accumulate per layer, add per step
    if split is not jaxpr:
        jaxpr, pieces = split, slice_layers(split)
    roles, warnings = input_roles(traced)
    summaries = layer_summaries(jaxpr, pieces, [r == "param" for r in roles])
    batch = {i for i, r in enumerate(roles) if r == "batch"}
    optimizer_inputs = tuple(tuple(sorted(apply_phase_inputs(jaxpr, pieces, l) - set(s.param_inputs) - batch))
                             for l, s in enumerate(summaries))
    return SlicedStep(traced=traced, jaxpr=jaxpr, pieces=tuple(pieces), roles=tuple(roles), warnings=warnings,
                      summaries=tuple(summaries), optimizer_inputs=optimizer_inputs,
                      seconds=time.perf_counter() - start)


def plan_pipeshard(method: PipeshardParallel, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
                   batch_argnums: Sequence[int], cluster: ClusterSpec) -> ParallelPlan:
    """Plans ``fun(*args)`` with ``method`` on ``cluster`` (nothing is allocated or run)."""
    return _slice_and_plan(method, fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums,
                           cluster=cluster).plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Planned:
    """A planned step: the method with the layer option it was sliced with, and what planning built."""

    method: PipeshardParallel
    sliced: SlicedStep
    plan: ParallelPlan
    profile: StageProfile
    solution: StageSolution


def _slice_and_plan(method: PipeshardParallel, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
                    batch_argnums: Sequence[int], cluster: ClusterSpec) -> _Planned:
    """Steps 1-4 of planning, once per layer option of ``method.layer_option.choices()``; the plan of the
    lowest estimated iteration time is kept (a layering without a plan is skipped; when none has one, the
    first one's error is raised)."""
    progress = _Progress(method.stage_option.show_progress)
    choices = method.layer_option.choices()
    best, first_error = None, None
    for k, option in enumerate(choices):
        candidate = dataclasses.replace(method, layer_option=option)
        which = ("" if len(choices) == 1 else
                 f" (layering {k + 1}/{len(choices)}: recompute_aware={option.recompute_aware})")
        progress.step("step 1/4: tracing the step and cutting it into layers" + which)
        try:
            sliced = slice_step(candidate, fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums)
            plan, profile, solution = _plan_and_profile(candidate, sliced, cluster, progress)
        except ValueError as e:
            if len(choices) == 1:
                raise
            progress.step(f"no plan with this layering: {e}")
            first_error = first_error or e
            continue
        if best is None or plan.estimated_iteration_time < best.plan.estimated_iteration_time:
            best = _Planned(method=candidate, sliced=sliced, plan=plan, profile=profile, solution=solution)
    if best is None:
        raise first_error
    if len(choices) > 1:
        progress.step(f"kept the layering with recompute_aware={best.method.layer_option.recompute_aware} "
                      f"({best.plan.estimated_iteration_time:.4g} s per iteration)")
    return best


def plan_sliced(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec,
                progress: _Progress | None = None) -> ParallelPlan:
    """Steps 2-4 of planning on an already sliced step."""
    return _plan_and_profile(method, sliced, cluster, progress)[0]


def _plan_and_profile(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec,
                      progress: _Progress | None = None) -> tuple[ParallelPlan, StageProfile, StageSolution]:
    """:func:`plan_sliced`, also returning the profile and the stage DP's solution the plan comes from."""
    progress = progress or _Progress(method.stage_option.show_progress)
    traced, jaxpr, pieces, summaries = sliced.traced, sliced.jaxpr, sliced.pieces, sliced.summaries
    param_mask = [r == "param" for r in sliced.roles]
    optimizer_bytes = [sum(traced.in_leaves[i].nbytes for i in inputs) for inputs in sliced.optimizer_inputs]
    times: dict[str, float] = {"trace and layers": sliced.seconds}

    t1 = time.perf_counter()
    submeshes, views = _candidate_meshes(method.stage_option, cluster, len(summaries))
    pairs = sum(len(v) for v in views) * len(summaries)
    progress.step(f"step 2/4: intra-op pass on {len(summaries)} layers x {sum(len(v) for v in views)} "
                  f"(submesh, logical mesh) pairs = {pairs}")
    deferred = method.defer_gradient_sync and method.pipeline_schedule != ScheduleName.TERAPIPE
    options = PassOptions(solver=method.auto_sharding_option.solver,
                          solver_time_limit=method.auto_sharding_option.solver_time_limit,
                          allow_all_to_all=method.auto_sharding_option.allow_all_to_all,
                          rates=cluster.compute_rates,
                          gradient_sync_weight=1.0 / method.num_micro_batches if deferred else 1.0)
    profile = profile_stage_costs(
        jaxpr, pieces, summaries, param_mask, optimizer_bytes, cluster, submeshes, views, options,
        max_workers=getattr(method.stage_option, "max_workers", None), progress=progress.solves())
    times["intra-op solves"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    progress.step(f"step 3/4: stage DP ({profile.num_solves} distinct solves for {profile.num_pairs} pairs)")
    solution = _solve(method, profile.costs, cluster)
    times["stage DP"] = time.perf_counter() - t2

    def build(chosen: StageSolution) -> ParallelPlan:
        return plan_of_stages(method, sliced, cluster, profile, chosen.stages, chosen.iteration_time)

    t3 = time.perf_counter()
    plan = build(solution)
    times["other"] = time.perf_counter() - t3
    t4 = time.perf_counter()
    tables = _estimate_tables(method, profile, cluster, solution) if _settles_estimates(method) else []
    if len(tables) > 1:
        plans = {_layout(solution): (plan, solution)}
        for _, other in tables[1:]:
            if other is not None and _layout(other) not in plans:
                plans[_layout(other)] = (build(other), other)
        if len(plans) > 1:
            progress.step(f"step 3b/4: the DP's tables for what it estimates give {len(plans)} plans: "
                          "simulating them")
            plan, solution = min(plans.values(), key=lambda chosen: simulate_plan(chosen[0], sliced).step_seconds)
        times["simulated choice"] = time.perf_counter() - t4
    progress.step(f"step 4/4: done: {len(plan.stages)} stages, layers per stage {solution.layers_per_stage}")
    plan = dataclasses.replace(plan, compile_times=tuple(times.items()))
    if method.pipeline_schedule == ScheduleName.TERAPIPE:
        t4 = time.perf_counter()
        plan = _plan_token_slicing(method, sliced, solution, plan)
        plan = dataclasses.replace(plan, compile_times=plan.compile_times + (("token DP", time.perf_counter() - t4),))
    return plan, profile, solution


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


def _settles_estimates(method: PipeshardParallel) -> bool:
    """Whether the planner simulates the DP's plans under :func:`_estimate_tables`: the simulated backend
    runs the schedule (one stage per mesh; not TeraPipe) and the DP chose the stages."""
    return (method.virtual_stages == 1 and method.pipeline_schedule != ScheduleName.TERAPIPE
            and isinstance(method.stage_option, AutoStageOption))


def _estimate_tables(method: PipeshardParallel, profile: StageProfile, cluster: ClusterSpec,
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
    try:
        return _solve(method, costs, cluster)
    except ValueError:  # no plan fits under this pricing
        return None


def _layout(solution: StageSolution) -> tuple:
    return tuple((s.layers, s.submesh, s.view_index) for s in solution.stages)


def simulate_plan(plan: ParallelPlan, sliced: SlicedStep, **options):
    """``plan``'s per-mesh instruction programs (one stage per mesh) on the simulated backend
    (:func:`~alpa_like.runtime.simulator.simulate`, which ``options`` go to): a
    :class:`~alpa_like.runtime.simulator.Simulation`. The programs are emitted without FREEs, which take no
    time on the simulated clock.

    The planner uses it where the stage DP's cost is an estimate the simulator resolves: when the DP's plans
    under the pricings of :func:`_estimate_tables` differ, each is simulated and the fastest is kept."""
    stage_to_mesh = list(range(len(plan.stages)))
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, [s.layer_ids for s in plan.stages],
                                  [r == "batch" for r in sliced.roles], stage_to_mesh=stage_to_mesh,
                                  after_grad=sliced.traced.after_grad)
    sched = make_schedule(plan.pipeline_schedule or ScheduleName.ONE_F_ONE_B, num_meshes=len(plan.stages),
                          num_micro_batches=plan.num_micro_batches)
    programs = emit_programs(program, sched, stage_to_mesh=stage_to_mesh, free_buffers=False)
    return simulate(plan, program, programs, **options)


def _plan_token_slicing(method: PipeshardParallel, sliced: SlicedStep, solution: StageSolution,
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


def _candidate_meshes(option: StageOption, cluster: ClusterSpec, num_layers: int):
    """The (submesh, logical views) pairs the intra-op pass must profile for ``option``."""
    n, m = cluster.num_nodes, cluster.num_devices_per_node
    if isinstance(option, AutoStageOption):
        submeshes = list(option.submesh_shapes or submesh_shapes(n, m))
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
    if n % num_stages == 0:
        return (n // num_stages, m)
    if n == 1 and m % num_stages == 0:
        return (1, m // num_stages)
    raise ValueError(f"UniformStageOption(num_stages={num_stages}) cannot split a {n} x {m} cluster evenly; "
                     "give submesh_physical_shape")


def _check_manual(option: ManualStageOption, num_layers: int) -> None:
    ids = [l for stage in option.forward_stage_layer_ids for l in stage]
    if ids != list(range(num_layers)):
        raise ValueError(f"ManualStageOption.forward_stage_layer_ids must list layers 0..{num_layers - 1} in order, "
                         f"each once, as consecutive runs; got {option.forward_stage_layer_ids}")
    count = len(option.forward_stage_layer_ids)
    if len(option.submesh_physical_shapes) != count or len(option.submesh_logical_shapes) != count:
        raise ValueError(f"ManualStageOption needs one physical and one logical shape per stage ({count}), got "
                         f"{len(option.submesh_physical_shapes)} and {len(option.submesh_logical_shapes)}")


def _solve(method: PipeshardParallel, costs: StageCosts, cluster: ClusterSpec) -> StageSolution:
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
        stages.append(StageChoice(layers=(i, j), submesh_index=p, submesh=sub, logical_shape=views[e],
                                  view_index=e, variant=costs.variants[p][e],
                                  t_intra=float(costs.t_intra[i, j, p, e]), memory_per_device=memory[e],
                                  step_seconds=costs.step_seconds_of(i, j, p)))
    stages = price_placed_stages(costs, stages, cluster.num_devices_per_node)
    t = [s.t_intra for s in stages]
    return StageSolution(stages=tuple(stages), iteration_time=pipeline_latency(stages, num_micro_batches),
                         t_max=max(t), num_micro_batches=num_micro_batches, num_t_max_evaluated=0)


def _stage_plan(q: int, choice: StageChoice, device_ids, traced: TracedStep, summaries, profile: StageProfile,
                num_micro_batches: int) -> StagePlan:
    """The StagePlan of one chosen stage: its layers' parameters with the ILP's specs, times per step.

    Optimizer state is not listed leaf by leaf: it is counted in ``memory_per_device`` as sharded over the
    stage's devices (weight-update sharding)."""
    first, last = choice.layers
    p = choice.submesh_index
    v = choice.view_index
    mesh_shape = choice.logical_shape
    inputs, comm_seconds, comm_bytes, compute, flops = [], 0.0, 0.0, 0.0, 0.0
    for l in range(first, last + 1):
        cost = profile.layer_costs[(l, p, v)]
        comm_seconds += cost.comm_seconds * num_micro_batches
        comm_bytes += cost.comm_bytes * num_micro_batches
        compute += cost.compute_seconds * num_micro_batches
        s = summaries[l]
        flops += (s.forward_flops + s.backward_flops) * num_micro_batches + s.apply_flops
        for k in s.param_inputs:
            leaf = traced.in_leaves[k]
            spec = profile.input_spec(l, p, v, k)
            shards = 1 if spec is None else spec.num_shards(mesh_shape)
            inputs.append(TensorPlan(path=leaf.path, shape=leaf.shape, dtype=leaf.dtype, role="param", spec=spec,
                                     bytes_per_device=leaf.nbytes // shards))
    communication = (CommEstimate(kind="intra-op", mesh_axes=(0, 1), num_bytes=int(comm_bytes), seconds=comm_seconds,
                                  what="collectives and resharding chosen by the ILP, all micro-batches"),)
    return StagePlan(stage_id=q, layer_ids=tuple(range(first, last + 1)), submesh_shape=tuple(choice.submesh),
                     logical_mesh_shape=tuple(mesh_shape), mesh_axis_names=("x", "y"),
                     device_ids=tuple(device_ids), inputs=tuple(inputs), outputs=(), communication=communication,
                     flops=flops, compute_seconds=compute, memory_per_device=int(choice.memory_per_device),
                     peak_memory_per_device=int(choice.memory_per_device))


def compile_pipeshard(method: PipeshardParallel, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
                      batch_argnums: Sequence[int], devices: Sequence[Any] | None, cluster: ClusterSpec | None = None,
                      make_executable: Callable = PipeshardExecutable, donate_argnums: Sequence[int] = ()):
    """Plans ``fun(*args)`` on ``devices`` (or ``cluster``) and builds the executable that runs the plan:
    the local MPMD backend's by default, another backend's through ``make_executable`` (same arguments).
    ``donate_argnums``' leaves are donated by the pipeline schedules of both backends; the TeraPipe schedule
    does not donate (with a warning)."""
    if method.pipeline_schedule == ScheduleName.TERAPIPE and make_executable is not PipeshardExecutable:
        raise NotImplementedError("pipeline_schedule='terapipe' runs on the local backend only (al.init('local'))")
    if make_executable is not PipeshardExecutable:  # other backends all-reduce gradients in every backward
        method = dataclasses.replace(method, defer_gradient_sync=False)
    planned = _slice_and_plan(method, fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums,
                              cluster=cluster or ClusterSpec.local(devices))
    method, sliced, plan, profile, solution = (planned.method, planned.sliced, planned.plan, planned.profile,
                                               planned.solution)
    if donate_argnums and method.pipeline_schedule == ScheduleName.TERAPIPE:
        warnings.warn("donate_argnums is not applied under the TeraPipe schedule: the step's inputs stay "
                      "allocated while it runs", stacklevel=3)
    if method.pipeline_schedule == ScheduleName.TERAPIPE:
        return _compile_terapipe(method, fun, args, _without_effects(sliced, "under the TeraPipe schedule"),
                                 plan, devices)
    if make_executable is not PipeshardExecutable:
        sliced = _without_effects(sliced, "on the Ray backend (jax.export ships no host callbacks)")
    stage_layers, stage_to_mesh = [s.layer_ids for s in plan.stages], list(range(len(plan.stages)))
    if method.virtual_stages > 1:
        plan, stage_layers, stage_to_mesh = _loop_layers(plan, len(sliced.summaries), method.virtual_stages)

    def layer_cost(q: int, layer: int):  # every layer was profiled on every mesh's (submesh, logical view)
        choice = solution.stages[stage_to_mesh[q]]
        return profile.layer_costs[(layer, choice.submesh_index, choice.view_index)]
    shardings = stage_shardings(sliced.jaxpr, sliced.pieces, stage_layers, layer_cost)
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, stage_layers,
                                  [r == "batch" for r in sliced.roles], stage_to_mesh=stage_to_mesh,
                                  after_grad=sliced.traced.after_grad)
    schedule = make_schedule(method.pipeline_schedule, num_meshes=len(plan.stages),
                             num_micro_batches=method.num_micro_batches, virtual_stages=method.virtual_stages)
    programs = emit_programs(program, schedule, stage_to_mesh=stage_to_mesh)
    path_to_input = {leaf.path: program.step_inputs[k] for k, leaf in enumerate(sliced.traced.in_leaves)}
    input_specs = {path_to_input[t.path]: t.spec for s in plan.stages for t in s.inputs
                   if t.spec is not None and t.path in path_to_input}
    extra = dict(donate_flat=[k for k, leaf in enumerate(sliced.traced.in_leaves) if leaf.arg_index in donate_argnums])
    if make_executable is PipeshardExecutable:
        extra.update(stage_shardings=shardings, value_specs=value_specs(program, shardings, stage_to_mesh),
                     defer_gradient_sync=method.defer_gradient_sync)
    return make_executable(traced=sliced.traced, plan=plan, program=program, programs=programs,
                           devices=devices, input_specs=input_specs, **extra)


def value_specs(program, shardings: Sequence[StageSharding], stage_to_mesh: Sequence[int]) -> dict:
    """``(value, mesh) -> spec``: the layout each stage's ILP gives the values its mesh reads from outside its
    layers (what it loads or receives) and those its layers produce (what it sends)."""
    vid = {v: i for i, v in enumerate(program.values)}
    out = {}
    for q, sharding in enumerate(shardings):
        mesh = stage_to_mesh[q]
        for var, spec in (*sharding.output_specs.items(), *sharding.input_specs.items()):
            if var in vid:
                out.setdefault((vid[var], mesh), spec)
    return out


def _optimizer_state_specs(param_specs: dict, in_leaves) -> dict:
    """Per (stage, path) of an optimizer-state leaf that mirrors a parameter (same shape, path ending with the
    parameter's path below its ``params`` tree, as optax's moments do), the parameter's spec on that stage:
    the update then keeps the plan's layout of the parameter instead of following the state's."""
    out = {}
    for (q, path), spec in param_specs.items():
        relative = path.split(".params.", 1)[-1]
        shape = next((leaf.shape for leaf in in_leaves if leaf.path == path), None)
        for leaf in in_leaves:
            if (leaf.path != path and leaf.shape == shape and not leaf.is_batch
                    and leaf.path.endswith("." + relative) and (q, leaf.path) not in param_specs):
                out[(q, leaf.path)] = spec
    return out


def _compile_terapipe(method: PipeshardParallel, fun: Callable, args: Sequence[Any], sliced: SlicedStep,
                      plan: ParallelPlan, devices: Sequence[Any]) -> TerapipeExecutable:
    """The TeraPipe runtime on the plan's stages with the method's token slices (every micro-batch) or the
    plan's batch + token slicing."""
    if method.virtual_stages != 1:
        raise ValueError("pipeline_schedule='terapipe' runs one stage per mesh (virtual_stages=1)")
    batch_leaves = [leaf for leaf in sliced.traced.in_leaves if leaf.is_batch and len(leaf.shape) > 1]
    if not batch_leaves:
        raise ValueError("pipeline_schedule='terapipe' needs a batch input [batch, seq, ...]")
    batch, seq = batch_leaves[0].shape[0], batch_leaves[0].shape[1]
    rows = batch // method.num_micro_batches
    if method.token_slices is not None:
        scheme = token_slicing_scheme(method.token_slices, method.num_micro_batches, rows)
    else:
        scheme = plan.token_slicing or ((rows, (seq,)),) * method.num_micro_batches
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, [s.layer_ids for s in plan.stages],
                                  [r == "batch" for r in sliced.roles])
    if micro_batch_key_draws(program, num_micro_batches=2):  # any draw from a per-step key in the loss
        warnings.warn("pipeline_schedule='terapipe' runs the loss once per token slice and micro-batch with the "
                      "same keys: a dropout mask drawn from a per-step key repeats in every slice and micro-batch "
                      "(the other schedules draw one per micro-batch)", stacklevel=4)
    specs = {(q, t.path): t.spec for q, s in enumerate(plan.stages) for t in s.inputs if t.spec is not None}
    specs.update(_optimizer_state_specs(specs, sliced.traced.in_leaves))
    return TerapipeExecutable(fun=fun, args=args, traced=sliced.traced, plan=plan, program=program,
                              layer_assign=method.layer_option.layering().assign, devices=devices,
                              batch_slices=scheme, input_specs=specs,
                              share_contexts=method.share_slice_executables)


def _loop_layers(plan: ParallelPlan, num_layers: int, virtual_stages: int):
    """Megatron-LM's interleaved layout on the plan's meshes: ``p * v`` equal layer chunks, chunk ``s`` on
    mesh ``s mod p``. Returns the plan with each mesh's layers updated (parameters keep no hand-picked
    layout), the chunks' layers and their meshes."""
    p = len(plan.stages)
    chunks = p * virtual_stages
    if num_layers % chunks:
        raise ValueError(f"virtual_stages={virtual_stages} on {p} meshes needs the layer count to be a multiple "
                         f"of {chunks}; the step has {num_layers} layers (change layer_num)")
    size = num_layers // chunks
    stage_layers = [tuple(range(s * size, (s + 1) * size)) for s in range(chunks)]
    stage_to_mesh = [s % p for s in range(chunks)]
    stages = tuple(dataclasses.replace(
        stage, inputs=(), layer_ids=tuple(l for s, layers in enumerate(stage_layers) if s % p == q for l in layers))
        for q, stage in enumerate(plan.stages))
    return dataclasses.replace(plan, stages=stages), stage_layers, stage_to_mesh
