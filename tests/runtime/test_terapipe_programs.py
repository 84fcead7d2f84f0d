"""TeraPipe lowered to the pipeline's instruction programs (runtime/terapipe_programs.py): the local backend
runs them like any schedule's, with the step's effects, and their programs carry prefixes between slices."""
import dataclasses
import warnings

import jax
import pytest

import alpa_like as al
from alpa_like.compiler.layer_slicing import BACKWARD, FORWARD
from alpa_like.runtime import hlo_stats
from alpa_like.runtime.instructions import Op
from alpa_like.runtime.pipeshard_runtime import PipeshardExecutable
from alpa_like.runtime.terapipe_programs import forward_only
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps
from tests.runtime.test_pipeshard_runtime import stages, train_step_for
from tests.runtime.test_terapipe_runtime import FOUR_ROW_SLICES, gpt_case

TWO_LAYERS = dict(layer_option=al.AutoLayerOption(layer_num=2),
                  stage_option=stages(((0,), (1,)), ((1, 4),) * 2, ((1, 4),) * 2))


@pytest.mark.slow  # four XLA compiles per slice shape and stage, and the contract check's forwards: ~40 s
@FOUR_ROW_SLICES
def test_terapipe_runs_as_instruction_programs_on_the_local_backend():
    """Two meshes, two micro-batches of slices (10, 6): the step is the local backend's executable running
    programs that LOAD token windows and CARRY each slice's key/value prefix to the next slice (and its
    cotangent back); parameters after three SGD steps equal jax.jit's."""
    loss_fn, state, batches = gpt_case(num_layers=2, batch_size=8)
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="terapipe", token_slices=(10, 6),
                                  **TWO_LAYERS)
    parallel = al.parallelize(step, method=method)
    exe = parallel.get_executable(state, batches[0])
    assert isinstance(exe.executor, PipeshardExecutable)
    instructions = exe.mesh_programs.instructions
    carries = [ins for ins in instructions if ins.op is Op.CARRY and ins.source[1] != -1]
    assert {(ins.source[1], ins.key[1]) for ins in carries} == {(0, 1), (1, 0), (2, 3), (3, 2)}  # both ways
    windows = {ins.window for ins in instructions if ins.op is Op.LOAD and ins.window}
    assert windows == {(0, 4, 0, 10), (0, 4, 10, 6), (4, 4, 0, 10), (4, 4, 10, 6)}
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    got_state, got_losses = run_steps(parallel, state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # one XLA compile of a one-layer GPT per piece: ~25 s
def test_an_effect_in_the_loss_runs_once_per_token_slice():
    """A jax.debug.callback in the loss fires once per unit's forward (a micro-batch's token slice), as the
    other schedules fire theirs once per micro-batch, each seeing the slice's tokens; no warning says it is
    left out."""
    loss_fn, state, batches = gpt_case(num_layers=1, batch_size=2)
    seen = []

    def loss_with_effect(params, batch):
        jax.debug.callback(lambda ids: seen.append(ids.shape), batch["input_ids"])
        return loss_fn(params, batch)
    method = al.PipeshardParallel(num_micro_batches=1, pipeline_schedule="terapipe", token_slices=(12, 4),
                                  layer_option=al.AutoLayerOption(layer_num=1),
                                  stage_option=stages(((0,),), ((1, 8),), ((1, 8),)))
    parallel = al.parallelize(train_step_for(loss_with_effect), method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        state, _ = parallel(state, batches[0])  # the first step also runs the contract check's forwards
    jax.effects_barrier()
    seen.clear()
    parallel(state, batches[1])
    jax.effects_barrier()
    assert sorted(seen) == [(2, 4), (2, 12)]


@pytest.mark.slow  # four slice-shape pieces per mesh on 4-device meshes: ~50 s
@FOUR_ROW_SLICES
def test_terapipe_reduces_gradients_once_per_step():
    """Data-parallel meshes (each unit's 4 rows split over a mesh's 4 devices): the backward pieces of every
    slice shape keep their weight gradients as stacks of partial sums (layouts followed from what the
    pieces load and receive, the slices having no ILP pins; the forward's residuals keep the layouts the
    forward gives them), summed once per step by MEAN: no backward piece all-reduces anything, against ~59 KB
    of weight gradients each piece reduces without deferral (the final LayerNorm's bias among them, whose
    gradient reads the logits' cotangent times the forward's transposed word embedding)."""
    loss_fn, state, batches = gpt_case(num_layers=2, batch_size=8)
    batches = batches[:2]
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="terapipe", token_slices=(10, 6),
                                  **TWO_LAYERS)
    parallel = al.parallelize(step, method=method)
    got_state, got_losses = run_steps(parallel, state, batches)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    exe = parallel.get_executable(got_state, batches[0])
    reduced = {q: b for (q, phase), b in hlo_stats.reduced_bytes_by_piece(exe.get_hlo_text()).items() if phase == "bwd"}
    assert {q: len(d.outputs) > 0 for q, d in exe.executor.deferred.items() if q < 4} == dict.fromkeys(range(4), True)
    assert reduced == dict.fromkeys(range(4), 0)


def test_the_programs_that_run_are_priced_by_the_simulator():
    """The programs a TeraPipe step runs (one variant of each stage per slice shape, CARRYs between token
    slices) on the simulated backend: with equal stages, equal slices and free communication the step is
    GPipe's over the m n units, (m n + p - 1)(t_f + t_b)/n, as for the plan's programs (test_simulator)."""
    from alpa_like.runtime.simulator import simulate
    from tests.runtime.test_simulator import idealised

    loss_fn, state, batches = gpt_case(num_layers=2)
    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="terapipe", token_slices=(8, 8),
                                  **TWO_LAYERS)
    exe = al.parallelize(train_step_for(loss_fn), method=method).get_executable(state, batches[0])
    sim = simulate(idealised(exe.plan), exe.lowered.program, exe.mesh_programs)
    p, m, n = 2, 2, 2
    assert sim.step_seconds == pytest.approx((m * n + p - 1) * 1.0 / (m * n))
    assert sim.timeline.bubble_fraction("ideal") == pytest.approx((p - 1) / (m * n))
    assert sorted(str(s.task) for s in sim.timeline.spans if s.mesh == 1) == sorted(
        f"1{phase}{k}.{i}" for phase in "FB" for k in range(m) for i in range(n))


def test_a_forward_only_run_compiles_no_residuals():
    """The first step's contract check runs forward pieces alone: forward_only keeps what forwards read (the
    values later stages receive, the next prefixes, the weighted losses) and drops the vjp's residuals that
    only backward pieces read, with the equations only they need: the check compiles the forward alone."""
    loss_fn, state, batches = gpt_case(num_layers=2)
    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="terapipe", token_slices=(8, 8),
                                  **TWO_LAYERS)
    exe = al.parallelize(train_step_for(loss_fn), method=method).get_executable(state, batches[0])
    tp = exe.lowered
    pieces = tp.program.pieces
    forward_reads = {v for (_, phase), p in pieces.items() if phase == FORWARD for v in p.inputs}
    backward_reads = {v for (_, phase), p in pieces.items() if phase == BACKWARD for v in p.inputs}
    for stage in range(len(tp.shape_index) * exe.num_stages):
        piece, forward = tp.program.piece(stage, FORWARD), forward_only(tp, stage)
        residuals = set(piece.outputs) & backward_reads
        assert residuals and not residuals & set(forward.outputs)
        assert set(forward.outputs) == set(piece.outputs) & (
            forward_reads | set(tp.next_prefix.values()) | set(tp.loss_values.values()))
        assert len(forward.jaxpr.jaxpr.outvars) == len(forward.outputs)
        assert len(forward.jaxpr.jaxpr.eqns) < len(piece.jaxpr.jaxpr.eqns)
        assert forward.inputs == piece.inputs


def test_planning_prices_the_executed_programs_within_a_few_percent(fixed_cluster):
    """simulate_plan prices a TeraPipe plan from the plan's programs (emit_programs with its token slicing),
    the step runs exe.mesh_programs; on GPT-tiny the two simulated steps differ by the tied embedding's
    handling (the last mesh loads the word embedding and runs a piece summing its two gradients), ~2-4%."""
    from alpa_like import pipeshard
    from alpa_like.compiler import pipeline
    from alpa_like.runtime.simulator import simulate

    loss_fn, state, batches = gpt_case(num_layers=2, batch_size=8)
    step, args = train_step_for(loss_fn), (state, batches[0])
    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="terapipe", token_slices=(10, 6),
                                  **TWO_LAYERS)
    planned = pipeline.plan_pipeline(method, step, args, static_argnums=(), batch_argnums=(1,),
                                     cluster=fixed_cluster, simulate=pipeshard.simulated_seconds)
    exe = al.parallelize(step, method=method).get_executable(*args)
    plan = dataclasses.replace(planned.plan, token_slicing=exe.batch_slices)
    priced = pipeshard.simulate_plan(plan, planned.sliced).step_seconds
    executed = simulate(exe.plan, exe.lowered.program, exe.mesh_programs).step_seconds
    assert priced < executed < 1.05 * priced
