"""``PipeshardParallel``'s code generation: the planned pipeline built into the executables a runtime runs.

Planning is the compiler's (:func:`alpa_like.compiler.pipeline.plan_pipeline`: trace, layers, intra-op
profile, stage DP, placement, TeraPipe's token DP); ``al.plan`` stops there (:func:`plan_pipeshard`). Calling
a parallelized step also builds, from the plan, the per-stage programs
(:mod:`alpa_like.compiler.stage_construction`) with their shardings, the schedule
(:mod:`alpa_like.compiler.schedules`) and the static instruction programs
(:mod:`alpa_like.runtime.instructions`), and hands them to a runtime: the local MPMD backend
(:mod:`alpa_like.runtime.pipeshard_runtime`), the Ray backend, or the TeraPipe runtime
(:mod:`alpa_like.runtime.terapipe_runtime`). The planner settles the stage DP's estimates on the simulated
backend (:func:`simulated_seconds`).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.options import PipeshardParallel
from alpa_like.compiler import pipeline
from alpa_like.compiler.plan import ParallelPlan
from alpa_like.compiler.schedule_tables import make_schedule
from alpa_like.compiler.schedules import ScheduleName, schedule_name
from alpa_like.compiler.sliced_step import SlicedStep
from alpa_like.compiler.stage_construction import build_stage_program, micro_batch_key_draws
from alpa_like.compiler.stage_costs import StageSolution
from alpa_like.compiler.stage_profiling import StageProfile
from alpa_like.compiler.stage_sharding import StageSharding, stage_shardings
from alpa_like.compiler.token_slicing import token_slicing_scheme
from alpa_like.runtime.instructions import emit_programs
from alpa_like.runtime.pipeshard_runtime import PipeshardExecutable
from alpa_like.runtime.stage_gradients import split_weight_gradients
from alpa_like.runtime.simulator import simulate
from alpa_like.runtime.terapipe_runtime import TerapipeExecutable


def plan_pipeshard(method: PipeshardParallel, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
                   batch_argnums: Sequence[int], cluster: ClusterSpec) -> ParallelPlan:
    """Plans ``fun(*args)`` with ``method`` on ``cluster`` (nothing is allocated or run)."""
    return pipeline.plan_pipeline(method, fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums,
                                  cluster=cluster, simulate=simulated_seconds).plan


def plan_sliced(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec,
                progress: pipeline.Progress | None = None) -> ParallelPlan:
    """The passes after slicing on an already sliced step, the simulated backend settling the DP's estimates."""
    return plan_and_profile(method, sliced, cluster, progress)[0]


def plan_and_profile(method: PipeshardParallel, sliced: SlicedStep, cluster: ClusterSpec,
                     progress: pipeline.Progress | None = None) -> tuple[ParallelPlan, StageProfile, StageSolution]:
    """:func:`plan_sliced`, also returning the intra-op profile and the stages the plan comes from."""
    return pipeline.plan_and_profile(method, sliced, cluster, simulate=simulated_seconds, progress=progress)


def simulated_seconds(plan: ParallelPlan, sliced: SlicedStep) -> float:
    """Seconds per step of ``plan`` on the simulated backend (:func:`simulate_plan`)."""
    return simulate_plan(plan, sliced).step_seconds


def simulate_plan(plan: ParallelPlan, sliced: SlicedStep, **options):
    """``plan``'s per-mesh instruction programs (one stage per mesh) on the simulated backend
    (:func:`~alpa_like.runtime.simulator.simulate`, which ``options`` go to): a
    :class:`~alpa_like.runtime.simulator.Simulation`. The programs are emitted without FREEs, which take no
    time on the simulated clock.

    The planner uses it where the stage DP's cost is an estimate the simulator resolves: when the DP's plans
    under the pricings of :func:`~alpa_like.compiler.stage_choice.estimate_tables` differ, each is simulated and
    the fastest is kept (:func:`simulated_seconds`). A TeraPipe plan's programs run its token slicing
    (``plan.token_slicing``: one unit per batch and token slice, each priced at its share of a micro-batch's
    work, :attr:`~alpa_like.runtime.instructions.MeshPrograms.unit_shares`)."""
    stage_to_mesh = list(range(len(plan.stages)))
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, [s.layer_ids for s in plan.stages],
                                  [r == "batch" for r in sliced.roles], stage_to_mesh=stage_to_mesh,
                                  after_grad=sliced.traced.after_grad)
    name = plan.pipeline_schedule or ScheduleName.ONE_F_ONE_B
    slicing = plan.token_slicing if name == ScheduleName.TERAPIPE else ()
    if schedule_name(name).splits_backward:
        program = split_weight_gradients(program)[0]
    sched = make_schedule(name, num_meshes=len(plan.stages), num_micro_batches=plan.num_micro_batches,
                          num_slices=tuple(len(lengths) for _, lengths in slicing) or 1)
    programs = emit_programs(program, sched, stage_to_mesh=stage_to_mesh, free_buffers=False, token_slicing=slicing)
    return simulate(plan, program, programs, **options)


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


def compile_pipeshard(method: PipeshardParallel, fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int],
                      batch_argnums: Sequence[int], devices: Sequence[Any] | None, cluster: ClusterSpec | None = None,
                      make_executable: Callable = PipeshardExecutable, donate_argnums: Sequence[int] = ()):
    """Plans ``fun(*args)`` on ``devices`` (or ``cluster``) and builds the executable that runs the plan:
    the local MPMD backend's by default, another backend's through ``make_executable`` (same arguments).
    ``donate_argnums``' leaves are donated by the pipeline schedules of both backends; the TeraPipe schedule
    does not donate (with a warning)."""
    planned = pipeline.plan_pipeline(method, fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums,
                                     cluster=cluster or ClusterSpec.local(devices), simulate=simulated_seconds)
    method, sliced, plan, profile, solution = (planned.method, planned.sliced, planned.plan, planned.profile,
                                               planned.solution)
    if donate_argnums and method.pipeline_schedule == ScheduleName.TERAPIPE:
        warnings.warn("donate_argnums is not applied under the TeraPipe schedule: the step's inputs stay "
                      "allocated while it runs", stacklevel=3)
    local = make_executable is PipeshardExecutable
    if not local:
        sliced = _without_effects(sliced, "on the Ray backend (jax.export ships no host callbacks)")
    if method.pipeline_schedule == ScheduleName.TERAPIPE:
        return _compile_terapipe(method, fun, args, sliced, plan, devices, make_executable)
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
    if method.pipeline_schedule.splits_backward:  # B and W pieces, the ILP's pins moved onto them
        program, shardings = split_weight_gradients(program, shardings)
    schedule = make_schedule(method.pipeline_schedule, num_meshes=len(plan.stages),
                             num_micro_batches=method.num_micro_batches, virtual_stages=method.virtual_stages)
    programs = emit_programs(program, schedule, stage_to_mesh=stage_to_mesh)
    path_to_input = {leaf.path: program.step_inputs[k] for k, leaf in enumerate(sliced.traced.in_leaves)}
    input_specs = {path_to_input[t.path]: t.spec for s in plan.stages for t in s.inputs
                   if t.spec is not None and t.path in path_to_input}
    extra = dict(donate_flat=[k for k, leaf in enumerate(sliced.traced.in_leaves) if leaf.arg_index in donate_argnums],
                 stage_shardings=shardings, defer_gradient_sync=method.defer_gradient_sync,
                 value_specs=value_specs(program, shardings, stage_to_mesh))
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
                      plan: ParallelPlan, devices: Sequence[Any], make_executable: Callable) -> TerapipeExecutable:
    """The TeraPipe step on the plan's stages with the method's token slices (every micro-batch) or the
    plan's batch + token slicing, lowered to instruction programs that ``make_executable``'s backend runs
    (the step's effects run where that backend runs them: the local one does)."""
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
    num_units = sum(len(lengths) for _, lengths in scheme)
    if num_units > 1 and micro_batch_key_draws(program, num_micro_batches=2):  # a draw from a per-step key
        warnings.warn(f"pipeline_schedule='terapipe' folds each unit's index (a micro-batch's token slice; "
                      f"{num_units} units, in exe.units order) into the keys of the loss's random draws, as the "
                      "other schedules fold each micro-batch's: every token slice of every micro-batch draws its "
                      "own numbers (unit 0 the step's), so a dropout mask is not the rows and tokens of the "
                      "unsliced step's", stacklevel=4)
    specs = {(q, t.path): t.spec for q, s in enumerate(plan.stages) for t in s.inputs if t.spec is not None}
    specs.update(_optimizer_state_specs(specs, sliced.traced.in_leaves))
    return TerapipeExecutable(fun=fun, args=args, traced=sliced.traced, plan=plan, program=program,
                              layer_assign=method.layer_option.layering().assign, devices=devices,
                              batch_slices=scheme, input_specs=specs,
                              share_contexts=method.share_slice_executables, make_executable=make_executable,
                              run_effects=make_executable is PipeshardExecutable,
                              defer_gradient_sync=method.defer_gradient_sync)


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
