"""Our system on a workload: the automatic plan (and its ablations), simulated with the cost model.

Each function takes a step already traced and cut into layers (:func:`slice_workload`), so the ablations of
the dissertation's Figs. 3.8-3.9 re-run only the passes they change:

* ``auto``: Alpa's full search (operator clustering, stage DP over submeshes and logical meshes, ILP);
* ``intra-op only``: one stage on the whole cluster (the ILP alone);
* ``inter-op only``: every stage on one device (the stage DP alone, no intra-op parallelism);
* ``equal layer``: the stage DP restricted to stages of one common number of layers, the best over every
  such number; the DP still chooses each stage's submesh and logical mesh (Fig. 3.9: "Equal layer restricts
  our DP algorithm to use the same number of layers for all stages");
* ``equal operator``: layers holding equal numbers of operators instead of Eq. 3.6's clustering, then the
  full stage DP (Fig. 3.9).

A case with no plan (nothing fits in memory, too few layers for the devices) is a result, not a crash: the
returned :class:`PlanResult` holds the planner's message.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.layer_construction import Layering, operator_segments
from alpa_like.compiler.options import AutoLayerOption, AutoStageOption, ManualLayerOption, PipeshardParallel
from alpa_like.compiler.sliced_step import SlicedStep, slice_step
from alpa_like.pipeshard import plan_sliced, simulate_plan
from alpa_like.compiler.plan import ParallelPlan

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
    seconds_by_kind: dict[str, float] | None = None
    """The simulation's summed instruction durations per kind (``RUN F``, ``RUN B``, ``RUN A``, ``RECV``,
    ...) over all meshes: where the step's device time goes."""
    busy_seconds: tuple[float, ...] | None = None
    """Per stage (mesh), the simulated seconds spent in RUN instructions."""

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
                "memory_per_device_gib": [s.peak_memory_per_device / 2**30 for s in stages],
                "stage_compute_s": [s.compute_seconds for s in stages],
                "stage_intra_op_s": [s.communication_seconds for s in stages],
                "planning_s": self.planning_seconds, "seconds_by_kind": self.seconds_by_kind,
                "busy_s": list(self.busy_seconds) if self.busy_seconds is not None else None}


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
                     layer_option: AutoLayerOption | ManualLayerOption | None = None) -> PipeshardParallel:
    if layer_option is None:
        layer_option = (ManualLayerOption(remat_layer=workload.remat) if workload.manual_layers else
                        AutoLayerOption(layer_num=workload.num_layers, eps=None, remat_layer=workload.remat,
                                        recompute_aware=workload.recompute_aware))
    return PipeshardParallel(
        num_micro_batches=num_micro_batches,
        layer_option=layer_option,
        stage_option=stage_option or AutoStageOption(show_progress=False))


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (restored after): tracing a large step and emitting and
    simulating long instruction programs create millions of objects that live to the end, and each
    generation-2 collection would walk all of them again. Reference counting still frees everything else."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def slice_workload(workload: Workload, method: PipeshardParallel) -> SlicedStep:
    with cyclic_gc_paused():
        return slice_step(method, workload.train_step, workload.args, static_argnums=(), batch_argnums=(1,))


def plan_method(variant: str, method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec) -> PlanResult:
    """Plans ``sliced`` with ``method`` on ``cluster`` and simulates the plan; ``variant`` labels the result."""
    start = time.perf_counter()
    try:
        with cyclic_gc_paused():
            plan = plan_sliced(method, sliced, cluster)
    except ValueError as e:  # no plan fits, or the variant cannot split this cluster
        return PlanResult(variant=variant, plan=None, simulated_seconds=None,
                          planning_seconds=time.perf_counter() - start, error=str(e))
    with cyclic_gc_paused():
        simulation = simulate_plan(plan, sliced)
    return PlanResult(variant=variant, plan=plan, simulated_seconds=simulation.step_seconds,
                      planning_seconds=time.perf_counter() - start + sliced.seconds,
                      seconds_by_kind=dict(simulation.seconds_by_kind), busy_seconds=simulation.busy_seconds)


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
        return plan_method(variant, method, sliced, cluster)
    method = pipeshard_method(workload, num_micro_batches)
    sliced = sliced or slice_workload(workload, method)
    if variant == "auto":
        return plan_method(variant, method, sliced, cluster)
    if variant == "intra-op only":
        option = AutoStageOption(submesh_shapes=((n, m),), show_progress=False)
        return plan_method(variant, dataclasses.replace(method, stage_option=option), sliced, cluster)
    if variant == "inter-op only":
        option = AutoStageOption(submesh_shapes=((1, 1),), show_progress=False)
        return plan_method(variant, dataclasses.replace(method, stage_option=option), sliced, cluster)
    option = AutoStageOption(equal_layers=True, show_progress=False)
    return plan_method(variant, dataclasses.replace(method, stage_option=option), sliced, cluster)
