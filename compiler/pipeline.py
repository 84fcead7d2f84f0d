"""The compiler's paths, each one function that reads as its list of passes.

SPMD (one mesh of all devices; :func:`plan_spmd`)::

    trace_step            the step -> ClosedJaxpr, leaves with their paths and roles
    layout                the method's layout of every leaf on one mesh: data parallel, ZeRO, hand-written
                          specs, or the intra-op ILP (Eq. 3.1, ShardParallel)
    spmd_plan             the layout priced as a one-stage ParallelPlan

Pipeline (Alpa dissertation 3.5, Alg. 2; :func:`plan_pipeline`, once per layering the layer option asks for)::

    slice_step            trace under layer construction, split at al.grad, cut into layers and summarise them
    candidate_meshes      the (submesh, logical mesh) pairs the stage option allows
    profile_stage_costs   intra-op ILP per layer and pair: the t_intra table
    choose_stages         the stage DP (Eq. 3.2-3.5 with the t_max enumeration), or the stages given
    plan_of_stages        submeshes placed on the cluster (assign_devices), each stage's ILP specs: a ParallelPlan
    estimate_tables       where the DP's table only estimates, its alternatives' plans simulated, the fastest kept
    plan_token_slicing    TeraPipe only: the token DP on the chosen stages

Both return plain data: the plan, and what code generation needs to build the executables (the traced step
and its layout; the sliced step, the intra-op profile and the stage DP's solution). The API hands them to a
runtime (:mod:`alpa_like.runtime.spmd`; :mod:`alpa_like.pipeshard` for the pipeline runtimes). Nothing here
allocates or runs anything: the simulated backend that settles the pipeline's estimates comes in as
``simulate`` (a function of a plan and its sliced step), since the compiler imports no runtime.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from alpa_like.compiler.auto_sharding import PassOptions
from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.options import ALL_SHAPES_MAX_NODES, AutoStageOption, PipeshardParallel
from alpa_like.compiler.pipeline_plan import plan_of_stages, plan_token_slicing
from alpa_like.compiler.plan import ParallelPlan
from alpa_like.compiler.schedules import ScheduleName
from alpa_like.compiler.sliced_step import SlicedStep, slice_step
from alpa_like.compiler.spmd_layout import SpmdLayout
from alpa_like.compiler.spmd_planning import spmd_plan
from alpa_like.compiler.stage_choice import (candidate_meshes, check_layers_for_stages, choose_stages, estimate_tables,
                                             settles_estimates)
from alpa_like.compiler.stage_costs import StageSolution
from alpa_like.compiler.stage_profiling import StageProfile, profile_stage_costs
from alpa_like.compiler.trace import TracedStep, trace_step

StepSimulator = Callable[[ParallelPlan, SlicedStep], float]
"""Seconds per step of a pipeline plan on the simulated backend (``alpa_like.pipeshard.simulated_seconds``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpmdPlanned:
    """A planned SPMD step: what code generation compiles (the traced step and its layout) and the plan."""

    traced: TracedStep
    layout: SpmdLayout
    plan: ParallelPlan


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelinePlanned:
    """A planned pipeline step: the method with the layer option it was sliced with, and what planning built."""

    method: PipeshardParallel
    sliced: SlicedStep
    plan: ParallelPlan
    profile: StageProfile
    """The intra-op pass's solutions per layer and (submesh, logical mesh): the stages' shardings."""
    solution: StageSolution
    """The stages the plan is made of, as the stage DP (or the stage option) chose them."""


def plan_spmd(method: Any, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
              batch_argnums: Sequence[int], cluster: ClusterSpec, layout: Callable[[TracedStep], SpmdLayout],
              device_ids: Sequence[int] = ()) -> SpmdPlanned:
    """Plans ``fun(*args)`` with an SPMD ``method`` on one mesh of ``cluster``'s devices.

    Args:
      layout: the method's layout of a traced step (``alpa_like.methods.spmd_layout`` bound to the method).
      device_ids: the devices the plan names (empty: a plan for a cluster this process does not hold).
    """
    traced = trace_step(fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums,
                        num_micro_batches=method.num_micro_batches)
    chosen = layout(traced)
    plan = spmd_plan(method, traced, chosen, cluster, device_ids=device_ids)
    return SpmdPlanned(traced=traced, layout=chosen, plan=plan)


def plan_pipeline(method: PipeshardParallel, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
                  batch_argnums: Sequence[int], cluster: ClusterSpec,
                  simulate: StepSimulator | None = None) -> PipelinePlanned:
    """Plans ``fun(*args)`` with ``method`` on ``cluster``: the pipeline's passes (module docstring) once per
    layer option of ``method.layer_option.choices()``, keeping the plan of the lowest estimated iteration
    time (a layering without a plan is skipped; when none has one, the first one's error is raised).

    ``simulate``: the simulated backend, to settle what the stage DP can only estimate; None keeps the DP's
    plan."""
    progress = Progress(method.stage_option.show_progress)
    choices = method.layer_option.choices()
    best, first_error = None, None
    for k, option in enumerate(choices):
        candidate = dataclasses.replace(method, layer_option=option)
        which = ("" if len(choices) == 1 else
                 f" (layering {k + 1}/{len(choices)}: recompute_aware={option.recompute_aware})")
        progress.step("step 1/4: tracing the step and cutting it into layers" + which)
        try:
            sliced = slice_step(candidate, fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums)
            plan, profile, solution = plan_and_profile(candidate, sliced, cluster, simulate=simulate,
                                                       progress=progress)
        except ValueError as e:
            if len(choices) == 1:
                raise
            progress.step(f"no plan with this layering: {e}")
            first_error = first_error or e
            continue
        if best is None or plan.estimated_iteration_time < best.plan.estimated_iteration_time:
            best = PipelinePlanned(method=candidate, sliced=sliced, plan=plan, profile=profile, solution=solution)
    if best is None:
        raise first_error
    if len(choices) > 1:
        progress.step(f"kept the layering with recompute_aware={best.method.layer_option.recompute_aware} "
                      f"({best.plan.estimated_iteration_time:.4g} s per iteration)")
    return best


def plan_sliced(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec, *,
                simulate: StepSimulator | None = None, progress: Progress | None = None) -> ParallelPlan:
    """The passes after slicing, on an already sliced step: its plan."""
    return plan_and_profile(method, sliced, cluster, simulate=simulate, progress=progress)[0]


def plan_and_profile(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec, *,
                     simulate: StepSimulator | None = None,
                     progress: Progress | None = None) -> tuple[ParallelPlan, StageProfile, StageSolution]:
    """:func:`plan_sliced`, also returning the intra-op profile and the stages the plan comes from. The plan's
    ``compile_times`` say how long each pass took."""
    progress = progress or Progress(method.stage_option.show_progress)
    times: dict[str, float] = {"trace and layers": sliced.seconds}
    with _timed(times, "intra-op solves"):
        check_layers_for_stages(method, len(sliced.summaries))
        submeshes, views = candidate_meshes(method.stage_option, cluster, len(sliced.summaries))
        profile = _profile(method, sliced, cluster, submeshes, views, progress)
    progress.step(f"step 3/4: stage DP; the intra-op pass took {times['intra-op solves']:.1f} s: "
                  f"{_solves_text(profile)}")
    with _timed(times, "stage DP"):
        solution = choose_stages(method, profile.costs, cluster)
    with _timed(times, "other"):
        plan = plan_of_stages(method, sliced, cluster, profile, solution.stages, solution.iteration_time)
    if simulate is not None and settles_estimates(method):
        plan, solution = _settle_estimates(method, sliced, cluster, profile, plan, solution, simulate, progress,
                                           times)
    progress.step(f"step 4/4: done: {len(plan.stages)} stages, layers per stage {solution.layers_per_stage}")
    progress.breakdown(times, profile, solution)
    plan = dataclasses.replace(plan, compile_times=tuple(times.items()))
    if method.pipeline_schedule == ScheduleName.TERAPIPE:
        with _timed(times, "token DP"):
            plan = plan_token_slicing(method, sliced, solution, plan)
        plan = dataclasses.replace(plan, compile_times=plan.compile_times + (("token DP", times["token DP"]),))
    return plan, profile, solution


def _profile(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec, submeshes, views,
             progress: Progress) -> StageProfile:
    """The intra-op pass on every layer and (submesh, logical mesh) pair, with the method's intra-op options.

    A layer's memory (Eq. 3.5's ``mem_stage`` is its sum over a stage's layers) is every parameter leaf its
    forward and backward read, under the ILP's specs, twice (values and gradients), plus the optimizer state
    its apply phase reads: the leaves of ``sliced.optimizer_inputs`` that are not parameters (``sliced.roles``,
    as the Megatron-LM baseline counts optimizer state). A parameter two layers read (a tied word embedding:
    the first layer's lookup, the last layer's logits) is counted in both, since stages holding either hold a
    copy and its gradient; the apply phase that updates it also reads it, and it is not counted there again.
    A stage holding both layers (the whole model) counts it once
    (:func:`~alpa_like.compiler.stage_profiling.shared_param_overcount`).
    """
    traced, summaries = sliced.traced, sliced.summaries
    pairs = sum(len(v) for v in views) * len(summaries)
    progress.step(f"step 2/4: intra-op pass on {len(summaries)} layers x {sum(len(v) for v in views)} "
                  f"(submesh, logical mesh) pairs = {pairs}; {_space_text(method.stage_option, cluster, submeshes)}")
    deferred = method.defer_gradient_sync and method.pipeline_schedule != ScheduleName.TERAPIPE
    option = method.auto_sharding_option
    options = PassOptions(solver=option.solver, solver_time_limit=option.solver_time_limit,
                          allow_all_to_all=option.allow_all_to_all, rates=cluster.compute_rates,
                          gradient_sync_weight=1.0 / method.num_micro_batches if deferred else 1.0)
    param_mask = [r == "param" for r in sliced.roles]
    optimizer_bytes = [sum(traced.in_leaves[i].nbytes for i in inputs if not param_mask[i])
                       for inputs in sliced.optimizer_inputs]
    return profile_stage_costs(sliced.jaxpr, sliced.pieces, summaries, param_mask, optimizer_bytes, cluster,
                               submeshes, views, options,
                               max_workers=getattr(method.stage_option, "max_workers", None),
                               progress=progress.solves())


def _settle_estimates(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec, profile: StageProfile,
                      plan: ParallelPlan, solution: StageSolution, simulate: StepSimulator, progress: Progress,
                      times: dict[str, float]) -> tuple[ParallelPlan, StageSolution]:
    """The fastest on the simulated backend of the plans the DP gives under the pricings of
    :func:`~alpa_like.compiler.stage_choice.estimate_tables` (``plan`` when they agree); the time spent goes
    into ``times`` when there is more than one pricing."""
    start = time.perf_counter()
    tables = estimate_tables(method, profile, cluster, solution)
    if len(tables) == 1:
        return plan, solution
    plans = {_layout(solution): (plan, solution)}
    for _, other in tables[1:]:
        if other is not None and _layout(other) not in plans:
            plans[_layout(other)] = (plan_of_stages(method, sliced, cluster, profile, other.stages,
                                                    other.iteration_time), other)
    if len(plans) > 1:
        progress.step(f"step 3b/4: the DP's tables for what it estimates give {len(plans)} plans: simulating them")
        plan, solution = min(plans.values(), key=lambda chosen: simulate(chosen[0], sliced))
    times["simulated choice"] = time.perf_counter() - start
    return plan, solution


def _space_text(option, cluster: ClusterSpec, submeshes) -> str:
    """The submesh shapes searched, in words."""
    shapes = ", ".join(f"({a}, {b})" for a, b in submeshes)
    if not isinstance(option, AutoStageOption) or option.submesh_shapes is not None:
        return f"submeshes {shapes}"
    space = option.shape_space(cluster.num_nodes)
    if space == option.submesh_shape_space:
        return f"submesh shape space {space!r}: {shapes}"
    bound = "at most" if space == "all" else "more than"
    return (f"submesh shape space {space!r} (submesh_shape_space='auto' on {bound} {ALL_SHAPES_MAX_NODES} nodes; "
            f"'all' searches every (n, {cluster.num_devices_per_node})): {shapes}")


def _solves_text(profile: StageProfile) -> str:
    """The intra-op pass's counts in words."""
    return (f"{profile.num_solves} ILP solves of {profile.num_jobs} distinct (layer structure, logical mesh) "
            f"problems for {profile.num_pairs} (layer, submesh, logical mesh) entries ({profile.cache_hits} "
            f"reused)")


def _layout(solution: StageSolution) -> tuple:
    """What makes two solutions the same plan: each stage's layers, submesh and logical view."""
    return tuple((s.layers, s.submesh, s.view_index) for s in solution.stages)


@contextlib.contextmanager
def _timed(times: dict[str, float], name: str) -> Iterator[None]:
    """Records the seconds the block takes as ``times[name]``."""
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start


LONG_PLANNING_SECONDS = 60.0
"""Planning that takes longer prints its breakdown (:meth:`Progress.breakdown`) even without progress."""


class Progress:
    """Planning progress on stderr: numbered steps with elapsed time, and a bar for the intra-op solves."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.perf_counter()

    def breakdown(self, times: dict[str, float], profile: StageProfile, solution: StageSolution) -> None:
        """One line: the seconds of every pass, the intra-op pass's counts and the stage DP's runs; printed
        with progress, or when planning took longer than :data:`LONG_PLANNING_SECONDS`."""
        total = sum(times.values())
        if not self.enabled and total <= LONG_PLANNING_SECONDS:
            return
        parts = [f"{name} {seconds:.1f} s" for name, seconds in times.items()]
        print(f"[alpa_like] planning took {total:.1f} s: {', '.join(parts)}; {_solves_text(profile)}; "
              f"{solution.num_t_max_evaluated} stage DP runs", file=sys.stderr, flush=True)

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
