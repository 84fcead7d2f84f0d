"""Our system on a workload: the automatic plan (and its ablations), simulated with the cost model.

Each function takes a step already traced and cut into layers (:func:`slice_workload`), so the ablations of
the dissertation's Figs. 3.8-3.9 re-run only the passes they change:

* ``auto``: Alpa's full search (operator clustering, stage DP over submeshes and logical meshes, ILP);
* ``intra-op only``: one stage on the whole cluster (the ILP alone);
* ``inter-op only``: every stage on one device (the stage DP alone, no intra-op parallelism);
* ``equal layer``: equal layers on equal submeshes, the best over every stage count (Fig. 3.9);
* ``equal operator``: layers holding equal numbers of operators instead of Eq. 3.6's clustering, then the
  full stage DP (Fig. 3.9).

A case with no plan (nothing fits in memory, too few layers for the devices) is a result, not a crash: the
returned :class:`PlanResult` holds the planner's message.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from alpa_like.cluster import ClusterSpec
from alpa_like.compiler.layer_construction import Layering, operator_segments
from alpa_like.compiler.stage_construction import build_stage_program
from alpa_like.pipeshard import (AutoLayerOption, AutoStageOption, PipeshardParallel, SlicedStep, UniformStageOption,
                                 plan_sliced, slice_step)
from alpa_like.plan import ParallelPlan
from alpa_like.runtime.instructions import emit_programs
from alpa_like.runtime.schedules import make_schedule
from alpa_like.runtime.simulator import simulate

from alpa_like.bench.workloads import Workload

VARIANTS = ("auto", "intra-op only", "inter-op only", "equal layer", "equal operator")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanResult:
    """A planned and simulated variant, or why there is no plan."""

    variant: str
    plan: ParallelPlan | None
    simulated_seconds: float | None
    """The plan's instruction programs run on the simulated backend's clock."""
    planning_seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.plan is not None

    def summary(self) -> dict:
        """JSON-safe fields for a results row."""
        if self.plan is None:
            return {"variant": self.variant, "error": self.error, "planning_s": self.planning_seconds}
        stages = self.plan.stages
        return {"variant": self.variant, "stages": len(stages), "layers_per_stage": [len(s.layer_ids) for s in stages],
                "submeshes": [list(s.submesh_shape) for s in stages],
                "logical_meshes": [list(s.logical_mesh_shape) for s in stages],
                "dp_predicted_s": self.plan.estimated_iteration_time, "simulated_s": self.simulated_seconds,
                "memory_per_device_gib": [s.memory_per_device / 2**30 for s in stages],
                "planning_s": self.planning_seconds}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EqualOperatorLayerOption(AutoLayerOption):
    """Layers of equal operator counts (each matmul/convolution with the cheap ops before it is one
    operator), the "equal operator" ablation of Alpa Fig. 3.9, instead of Eq. 3.6's clustering."""

    def layering(self) -> Layering:
        return Layering(assign=equal_operator_layers(self.layer_num), remat=self.remat_layer)


def equal_operator_layers(layer_num: int) -> Callable:
    """Layer assignment splitting the operators (:func:`operator_segments`) into ``layer_num`` runs whose
    sizes differ by at most one."""
    def assign(jaxpr) -> list[int]:
        segments = operator_segments(jaxpr)
        count = segments[-1] + 1 if segments else 0
        if count < layer_num:
            raise ValueError(f"equal-operator layering into {layer_num} layers needs at least that many "
                             f"matmul/convolution operators; the loss has {count}")
        return [min(layer_num - 1, s * layer_num // count) for s in segments]
    return assign


def pipeshard_method(workload: Workload, num_micro_batches: int, stage_option=None,
                     layer_option: AutoLayerOption | None = None) -> PipeshardParallel:
    return PipeshardParallel(
        num_micro_batches=num_micro_batches,
        layer_option=layer_option or AutoLayerOption(layer_num=workload.num_layers, eps=None,
                                                     remat_layer=workload.remat),
        stage_option=stage_option or AutoStageOption(show_progress=False))


def slice_workload(workload: Workload, method: PipeshardParallel) -> SlicedStep:
    return slice_step(method, workload.train_step, workload.args, static_argnums=(), batch_argnums=(1,))


def simulate_plan(plan: ParallelPlan, sliced: SlicedStep, num_micro_batches: int, schedule: str = "1f1b") -> float:
    """The plan's per-mesh instruction programs on the simulated backend (``runtime.simulator``)."""
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, [s.layer_ids for s in plan.stages],
                                  [r == "batch" for r in sliced.roles])
    sched = make_schedule(schedule, num_meshes=len(plan.stages), num_micro_batches=num_micro_batches)
    programs = emit_programs(program, sched, stage_to_mesh=list(range(len(plan.stages))))
    return simulate(plan, program, programs).step_seconds


def _plan(variant: str, method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec) -> PlanResult:
    start = time.perf_counter()
    try:
        plan = plan_sliced(method, sliced, cluster)
    except ValueError as e:  # no plan fits, or the variant cannot split this cluster
        return PlanResult(variant=variant, plan=None, simulated_seconds=None,
                          planning_seconds=time.perf_counter() - start, error=str(e))
    fixed = isinstance(method.stage_option, UniformStageOption)  # the stage DP checks Eq. 3.5 itself
    worst = max(_memory_with_in_flight(plan, sliced, method.num_micro_batches)) if fixed else 0.0
    if worst > cluster.device_memory:  # fixed stages are not checked by the planner (no Eq. 3.5)
        return PlanResult(variant=variant, plan=None, simulated_seconds=None,
                          planning_seconds=time.perf_counter() - start,
                          error=f"the {variant} stages need {worst / 2**30:.2f} GiB per device with 1F1B's "
                                f"activations in flight (Eq. 3.5), more than the "
                                f"{cluster.device_memory / 2**30:.4g} GiB of a device")
    simulated = simulate_plan(plan, sliced, method.num_micro_batches, method.pipeline_schedule)
    return PlanResult(variant=variant, plan=plan, simulated_seconds=simulated,
                      planning_seconds=time.perf_counter() - start + sliced.seconds)


def _memory_with_in_flight(plan: ParallelPlan, sliced: SlicedStep, num_micro_batches: int) -> list[float]:
    """Per stage, Eq. 3.5's memory under 1F1B: the plan's figure (state plus one micro-batch of activations)
    plus the activations of the ``min(S - q, m) - 1`` further micro-batches stage ``q`` of ``S`` holds, with
    activations divided over the stage's devices as the stage DP does."""
    out = []
    for q, stage in enumerate(plan.stages):
        devices = stage.submesh_shape[0] * stage.submesh_shape[1]
        act = sum(sliced.summaries[l].activation_bytes for l in stage.layer_ids) / devices
        held = min(len(plan.stages) - q, num_micro_batches)
        out.append(stage.memory_per_device + (held - 1) * act)
    return out


def plan_variant(variant: str, workload: Workload, cluster: ClusterSpec, num_micro_batches: int,
                 sliced: SlicedStep | None = None) -> PlanResult:
    """Plans and simulates one variant (one of VARIANTS); ``sliced`` (from :func:`slice_workload` with the
    default layer option) is reused when given."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    n, m = cluster.num_nodes, cluster.num_devices_per_node
    if variant == "equal operator":
        method = pipeshard_method(workload, num_micro_batches, layer_option=EqualOperatorLayerOption(
            layer_num=workload.num_layers, remat_layer=workload.remat))
        start = time.perf_counter()
        try:
            sliced = slice_workload(workload, method)
        except ValueError as e:
            return PlanResult(variant=variant, plan=None, simulated_seconds=None,
                              planning_seconds=time.perf_counter() - start, error=str(e))
        return _plan(variant, method, sliced, cluster)
    method = pipeshard_method(workload, num_micro_batches)
    sliced = sliced or slice_workload(workload, method)
    if variant == "auto":
        return _plan(variant, method, sliced, cluster)
    if variant == "intra-op only":
        option = AutoStageOption(submesh_shapes=((n, m),), show_progress=False)
        return _plan(variant, dataclasses.replace(method, stage_option=option), sliced, cluster)
    if variant == "inter-op only":
        option = AutoStageOption(submesh_shapes=((1, 1),), show_progress=False)
        return _plan(variant, dataclasses.replace(method, stage_option=option), sliced, cluster)
    return _best_equal_layer(method, sliced, cluster)


def _best_equal_layer(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec) -> PlanResult:
    """Equal layers per stage on equal submeshes, the fastest over every stage count that divides both the
    layers and the cluster evenly."""
    start = time.perf_counter()
    num_layers, devices = len(sliced.summaries), cluster.num_devices
    best, errors = None, []
    for stages in range(1, min(num_layers, devices) + 1):
        if num_layers % stages or devices % stages:
            continue
        option = UniformStageOption(num_stages=stages, show_progress=False)
        result = _plan("equal layer", dataclasses.replace(method, stage_option=option), sliced, cluster)
        if result.ok and (best is None or result.simulated_seconds < best.simulated_seconds):
            best = result
        elif not result.ok:
            errors.append(f"{stages} stages: {result.error.splitlines()[0]}")
    seconds = time.perf_counter() - start
    if best is None:
        return PlanResult(variant="equal layer", plan=None, simulated_seconds=None, planning_seconds=seconds,
                          error="; ".join(errors) or "no stage count divides the layers and devices")
    return dataclasses.replace(best, planning_seconds=seconds)
