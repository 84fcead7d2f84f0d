"""Zero-bubble schedules (ZB-H1, ZB-H2) run each stage's backward as a ``B`` piece (input gradients) and a
``W`` piece (weight gradients) on the local runtime and the simulator, with jax.jit's result on one device."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_like as al
from alpa_like.compiler.backward_split import WEIGHT, without_dead_positions
from alpa_like.compiler.flops import jaxpr_flops
from alpa_like.compiler.layer_slicing import BACKWARD
from alpa_like.compiler.schedule_tables import make_schedule
from alpa_like.compiler.schedules import Phase
from alpa_like.pipeshard import compile_pipeshard
from alpa_like.runtime import hlo_stats
from alpa_like.runtime.instructions import Instruction, Op, emit_programs
from alpa_like.runtime.simulator import simulate
from tests.helpers import assert_trees_close, micro_batch_loop, reference_on_one_device, run_steps
from tests.runtime.test_pipeshard_runtime import (FOUR, SGD, TWO_STAGES, UNEVEN, gpt_case, live_micro_batches, mlp_case,
                                                 moe_case, stages, train_step_for)

CASES = {  # name: (builder, layer option, stage option, micro-batches, schedule)
    "mlp_2_stages_mb2_h1": (mlp_case, al.ManualLayerOption(), TWO_STAGES, 2, "zb_h1"),
    "mlp_remat_2_stages_mb4_h2": (mlp_case, al.ManualLayerOption(remat_layer=True), TWO_STAGES, 4, "zb_h2"),
    "gpt_3_stages_mb4_h1": (gpt_case, al.AutoLayerOption(layer_num=4), UNEVEN, 4, "zb_h1"),
    "gpt_4_stages_mb8_h2": (gpt_case, al.AutoLayerOption(layer_num=4), FOUR, 8, "zb_h2"),
    "moe_2_stages_mb4_h1": (moe_case, al.AutoLayerOption(layer_num=4), TWO_STAGES, 4, "zb_h1"),
}


def method_for(case: str, schedule: str | None = None) -> al.PipeshardParallel:
    """The case's method, under its own schedule or ``schedule``."""
    _, layer_option, stage_option, num_micro_batches, own = CASES[case]
    return al.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option=layer_option,
                                stage_option=stage_option, pipeline_schedule=schedule or own)


SLOW = {"gpt_3_stages_mb4_h1", "moe_2_stages_mb4_h1"}  # 25-35 s each on 2 shared cores


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in sorted(CASES)])
def test_zero_bubble_schedules_match_jit(case):
    loss_fn, state, batches = CASES[case][0]()
    step = train_step_for(loss_fn)
    f = al.parallelize(step, method=method_for(case))
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    got_state, got_losses = run_steps(f, state, batches)
    # Micro-batch sums and sharded matmuls reassociate float32 additions.
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    exe = f.get_executable(state, batches[0])
    runs = [str(i).split()[1].lstrip("0123456789") for i in exe.programs.instructions if i.op is Op.RUN]
    assert sum(text.startswith("W") for text in runs) == exe.program.num_stages * exe.num_micro_batches
    # Weight gradients come out of W: every accumulated gradient is a W output (the loss stays in F).
    made_by_w = {v for (q, phase), piece in exe.program.pieces.items() if phase == WEIGHT for v in piece.outputs}
    made_by_b = {v for (q, phase), piece in exe.program.pieces.items() if phase == BACKWARD for v in piece.outputs}
    accumulated = {src for src, _ in exe.program.accumulated}
    assert accumulated & made_by_w and not accumulated & made_by_b


def test_checkpointed_layers_compute_their_weight_gradients_in_w():
    """remat_layer=True: each layer's backward is a jax.checkpoint call; inlined before the split, its weight
    gradient contractions run in W (a call kept whole would run in B, which needs its input cotangent)."""
    loss_fn, state, batches = mlp_case()
    f = al.parallelize(train_step_for(loss_fn), method=method_for("mlp_remat_2_stages_mb4_h2"))
    exe = f.get_executable(state, batches[0])
    dots = []
    for q in range(exe.program.num_stages):
        b, w = (exe.program.piece(q, phase).jaxpr.jaxpr for phase in (BACKWARD, WEIGHT))
        assert not any(e.primitive.name in ("checkpoint", "remat") for e in (*b.eqns, *w.eqns))
        dots.append([sum(e.primitive.name == "dot_general" for e in p.eqns) for p in (b, w)])
    # The first stage's B has nothing to compute (no stage waits for its input's cotangent): its W recomputes
    # both layers (2), makes the cotangent between them (1) and both weight gradients (2). The second's B
    # recomputes its layers and makes the input cotangents (2 + 2); its W only the weight gradients.
    assert dots == [[0, 5], [4, 2]]


@pytest.mark.parametrize("case", ["gpt_3_stages_mb4_h1", "moe_2_stages_mb4_h1", "mlp_remat_2_stages_mb4_h2"])
def test_b_and_w_have_the_flops_of_the_unsplit_backward(case):
    """Per stage, the traced B and W pieces' FLOPs add up to the 1F1B backward's (its live equations, once
    its checkpoint blocks are inlined: a first stage's dead input cotangent is none of them)."""
    loss_fn, state, batches = CASES[case][0]()
    step = train_step_for(loss_fn)
    split = al.parallelize(step, method=method_for(case)).get_executable(state, batches[0])
    whole = al.parallelize(step, method=method_for(case, schedule="1f1b")).get_executable(state, batches[0])
    for q in range(split.program.num_stages):
        b, w = (jaxpr_flops(split.program.piece(q, phase).jaxpr) for phase in (BACKWARD, WEIGHT))
        unsplit = whole.program.piece(q, BACKWARD).jaxpr  # inlined by the gradient deferral
        assert w > 0 and b + w == jaxpr_flops(without_dead_positions(unsplit))


def test_compiled_b_and_w_have_the_flops_of_the_unsplit_backward():
    """XLA's FLOP counts of the compiled B and W pieces add up to the compiled backward's, on stages of one
    device each (no layouts in play)."""
    loss_fn, state, batches = mlp_case()
    step = train_step_for(loss_fn)
    one_device = stages(((0, 1), (2, 3)), ((1, 1), (1, 1)), ((1, 1), (1, 1)))
    flops = {}
    for schedule in ("1f1b", "zb_h1"):
        method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                      stage_option=one_device, pipeline_schedule=schedule)
        exe = compile_pipeshard(method, step, (state, batches[0]), static_argnums=(), batch_argnums=(1,),
                                devices=jax.devices()[:2])
        run_steps(exe, state, batches[:1])
        flops[schedule] = piece_flops(exe)
    for q in (0, 1):
        assert flops["zb_h1"][(q, BACKWARD)] + flops["zb_h1"][(q, WEIGHT)] == flops["1f1b"][(q, BACKWARD)]


def piece_flops(exe) -> dict:
    """(stage, phase) -> XLA's FLOPs of the compiled piece, as the first step's first RUN of it compiled it."""
    return {key: fn.lower(*specs).compile().cost_analysis().get("flops", 0.0) for key, (fn, specs) in exe._ran.items()}


def test_w_folds_the_micro_batch_into_its_draws():
    """Dropout inside checkpointed blocks that read the step's key: the first stage needs no input
    cotangent, so its B is empty and its W recomputes the blocks, drawing their masks from the step's key;
    each micro-batch draws its own there too, the masks its forward drew."""
    def block(i):
        def run(w, b, h, key):
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.7, h.shape)
            return jnp.where(keep, jnp.tanh(h @ w + b) / 0.7, 0.0)
        return jax.checkpoint(run)

    def loss_fn(params, batch, key):
        h = batch["x"]
        for i in range(4):
            h = block(i)(params[f"w{i}"], params[f"b{i}"], h, key)
        return jnp.mean((h - batch["y"]) ** 2)

    def step(state, batch, key):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch, key)
        return state.apply_gradients(grads=grads), loss

    _, state, batches = mlp_case()
    state = state.replace(tx=SGD, opt_state=SGD.init(state.params))
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False),
                                  pipeline_schedule="zb_h1")
    f = al.parallelize(step, method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no micro-batches share a mask
        got = f(state, batches[0], jax.random.key(1))
    assert (0, WEIGHT) in f.get_executable(state, batches[0], jax.random.key(1))._draws
    want = jax.jit(micro_batch_loop(loss_fn, 2))(state, batches[0], jax.random.key(1))
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_weight_gradients_are_deferred_from_w(fixed_cluster):
    """Data-parallel stages: the gradients W makes leave it as partial sums, reduced once per step; neither
    B nor W all-reduces a gradient."""
    loss_fn, state, _ = mlp_case()
    rng = np.random.default_rng(1)
    batches = [{"x": jnp.asarray(rng.normal(size=(256, 16)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)} for _ in range(2)]
    state = state.replace(tx=SGD, opt_state=SGD.init(state.params))
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=al.ManualLayerOption(),
                                  stage_option=stages(((0, 1), (2, 3)), ((1, 4), (1, 4)), ((1, 4), (4, 1))),
                                  pipeline_schedule="zb_h1")
    step = train_step_for(loss_fn)
    parallel = al.parallelize(step, method=method)
    exe = parallel.get_executable(state, batches[0])
    got_state, got_losses = run_steps(parallel, state, batches)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert {q: len(d.outputs) for q, d in exe.deferred.items()} == {0: 4, 1: 4}
    reduced = {key: b for key, b in hlo_stats.reduced_bytes_by_piece(exe.get_hlo_text()).items()
               if key[1] in (BACKWARD, WEIGHT)}
    assert reduced == {(q, phase): 0 for q in (0, 1) for phase in (BACKWARD, WEIGHT)}


def test_simulator_runs_w_as_its_own_task():
    """The simulated step runs every W as a RUN of its own, priced from its piece: B and W together take
    the time of the 1F1B backward, and the timeline has a W span per stage and micro-batch."""
    loss_fn, state, batches = gpt_case()
    step = train_step_for(loss_fn)
    simulated = {}
    for schedule in ("1f1b", "zb_h1"):
        exe = al.parallelize(step, method=method_for("gpt_4_stages_mb8_h2", schedule)).get_executable(state, batches[0])
        simulated[schedule] = simulate(exe.plan, exe.program, exe.programs)
    zb, one = simulated["zb_h1"], simulated["1f1b"]
    assert sum(s.task.phase == Phase.W for s in zb.timeline.spans) == 4 * 8
    assert "RUN W" not in one.seconds_by_kind
    launches = 4 * 8 * exe.plan.cluster.launch_overhead  # one more RUN per backward
    np.testing.assert_allclose(zb.seconds_by_kind["RUN B"] + zb.seconds_by_kind["RUN W"],
                               one.seconds_by_kind["RUN B"] + launches, rtol=1e-9)


def test_instruction_programs_name_w_and_need_a_split_program():
    assert str(Instruction(Op.RUN, 0, stage=1, phase=WEIGHT, micro_batch=3)) == "RUN 1W3"
    loss_fn, state, batches = mlp_case()
    exe = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=2, layer_option=al.ManualLayerOption(), stage_option=TWO_STAGES)).get_executable(
        state, batches[0])
    with pytest.raises(ValueError, match="split into B and W"):
        emit_programs(exe.program, make_schedule("zb_h1", 2, 2), stage_to_mesh=[0, 1])


@pytest.mark.parametrize("schedule", ["zb_h1", "zb_h2"])
def test_buffers_follow_the_schedule(schedule):
    """Each mesh holds the buffers of as many micro-batches as the schedule has in flight (F to W: the
    forward's residuals live until W, ZB-H2's extra memory), and the values B saves for W are freed right
    after W."""
    loss_fn, state, batches = gpt_case()
    method = al.PipeshardParallel(num_micro_batches=8, layer_option=al.AutoLayerOption(layer_num=4),
                                  stage_option=TWO_STAGES, pipeline_schedule=schedule)
    exe = al.parallelize(train_step_for(loss_fn), method=method).get_executable(state, batches[0])
    in_flight = make_schedule(schedule, 2, 8).peak_in_flight()
    assert [live_micro_batches(exe, mesh) for mesh in (0, 1)] == list(in_flight) == (
        [2, 2] if schedule == "zb_h1" else [3, 3])
    program = exe.program
    saved = {v for (q, phase), piece in program.pieces.items() if phase == BACKWARD for v in piece.outputs
             if not any(v in other.inputs for (_, p), other in program.pieces.items() if p != WEIGHT)}
    assert saved
    instructions = exe.programs.instructions
    for i, ins in enumerate(instructions):
        if ins.op is Op.RUN and ins.phase == WEIGHT:
            after = set()
            for later in instructions[i + 1:]:
                if later.mesh == ins.mesh and later.op not in (Op.FREE, Op.ACC):
                    break
                if later.mesh == ins.mesh and later.op is Op.FREE:
                    after.add(later.key)
            read = {(v, ins.micro_batch) for v in program.piece(ins.stage, WEIGHT).inputs if v in saved}
            assert read and read <= after
