"""The local MPMD runtime runs pipeline plans with the same result as plain jax.jit on one device."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.models import gpt, moe
from alpa_like.runtime import hlo_stats
from alpa_like.runtime.instructions import PER_STEP, Op
from tests.helpers import (assert_trees_close, compiles_during, micro_batch_key, micro_batch_loop,
                           reference_on_one_device, run_steps, same_key)

SGD = optax.sgd(0.1, momentum=0.9)  # linear in the gradient: see tests/alpa_like/test_methods.py


def gpt_case(num_layers=4, batch_size=16):
    config = dataclasses.replace(models.get_config("gpt-tiny"), num_layers=num_layers)
    model = gpt.GPTModel(config)
    batches = [gpt.gpt_batch(config, batch_size, jax.random.PRNGKey(10 + i)) for i in range(3)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["input_ids"])["params"]
    return gpt.gpt_loss(model), train_state.TrainState.create(apply_fn=None, params=params, tx=SGD), batches


def moe_case():
    config = models.get_config("moe-tiny")
    model = moe.MoEModel(config)
    batches = [moe.moe_batch(config, 16, jax.random.PRNGKey(10 + i)) for i in range(3)]
    variables = model.init(jax.random.PRNGKey(0), batches[0]["input_ids"])
    return moe.moe_loss(model), train_state.TrainState.create(apply_fn=None, params=variables["params"], tx=SGD), batches


def mlp_loss(params, batch):
    x = batch["x"]
    for i in range(4):
        x = jnp.tanh(x @ params[f"w{i}"] + params[f"b{i}"])
        if i < 3:
            al.mark_pipeline_boundary()
    return jnp.mean((x - batch["y"]) ** 2)


def mlp_case():
    rng = np.random.default_rng(0)
    params = {}
    for i in range(4):
        params[f"w{i}"] = jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32)
        params[f"b{i}"] = jnp.zeros((16,), jnp.float32)
    batches = [{"x": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)} for _ in range(3)]
    return mlp_loss, train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2)), batches


def train_step_for(loss_fn):
    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss
    return train_step


def stages(layer_ids, physical, logical):
    return al.ManualStageOption(forward_stage_layer_ids=layer_ids, submesh_physical_shapes=physical,
                                submesh_logical_shapes=logical, show_progress=False)


TWO_STAGES = stages(((0, 1), (2, 3)), ((1, 4), (1, 4)), ((2, 2), (1, 4)))
UNEVEN = stages(((0, 1), (2,), (3,)), ((1, 2), (1, 2), (1, 4)), ((1, 2), (2, 1), (2, 2)))
FOUR = stages(((0,), (1,), (2,), (3,)), ((1, 2),) * 4, ((1, 2), (2, 1), (1, 2), (2, 1)))
CASES = {  # name: (builder, layer option, stage option, micro-batches)
    "mlp_2x4": (mlp_case, al.ManualLayerOption(), TWO_STAGES, 2),
    "gpt_2x4_mb1": (gpt_case, al.AutoLayerOption(layer_num=4), TWO_STAGES, 1),
    "gpt_uneven_mb4": (gpt_case, al.AutoLayerOption(layer_num=4), UNEVEN, 4),
    "gpt_four_mb8": (gpt_case, al.AutoLayerOption(layer_num=4), FOUR, 8),
    "moe_2x4_mb2": (moe_case, al.AutoLayerOption(layer_num=4), TWO_STAGES, 2),
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_matches_single_device_jit(case, schedule):
    build, layer_option, stage_option, num_micro_batches = CASES[case]
    loss_fn, state, batches = build()
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option=layer_option,
                                  stage_option=stage_option, pipeline_schedule=schedule)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    got_state, got_losses = run_steps(al.parallelize(step, method=method), state, batches)
    # Micro-batch sums and sharded matmuls reassociate float32 additions.
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_a_plan_chosen_from_both_layerings_runs_as_planned():
    """recompute_aware='auto' plans the step cut by both tie-breaks and runs the one it keeps."""
    loss_fn, state, batches = mlp_case()  # its boundary markers are ignored by AutoLayerOption
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=2, stage_option=TWO_STAGES, layer_option=al.AutoLayerOption(
        layer_num=4, remat_layer=True, recompute_aware="auto"))
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    got_state, got_losses = run_steps(al.parallelize(step, method=method), state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


def checkpointed_blocks_loss(params, batch):
    h = batch["x"]
    for i in range(4):
        h = jax.checkpoint(lambda w, b, h: jnp.tanh(h @ w + b))(params[f"w{i}"], params[f"b{i}"], h)
    return jnp.mean((h - batch["y"]) ** 2)


def dropout_loss(params, batch, key):
    """Dropout after each layer."""
    h = batch["x"]
    for i in range(4):
        h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
        h = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, i), 0.7, h.shape), h / 0.7, 0.0)
    return jnp.mean((h - batch["y"]) ** 2)


def dropout_step(state, batch, key):
    loss, grads = al.value_and_grad(dropout_loss)(state.params, batch, key)
    return state.apply_gradients(grads=grads), loss


def dropout_key_step(state, batch, key):
    """:func:`dropout_step` on a key split off the step's key, which the step returns (a train state's
    ``rng``): computed before al.grad, outside the loss."""
    key, sub = jax.random.split(key)
    state, loss = dropout_step(state, batch, sub)
    return state, loss, key


def dropout_loop(num_micro_batches):
    """The reference of :func:`dropout_key_step` with micro-batches: a loop over them (rows j, j + m, ...),
    micro-batch j computing from the step's key as it sees it; the step returns the key it splits off."""
    loop = micro_batch_loop(dropout_loss, num_micro_batches,
                            lambda key, j: jax.random.split(micro_batch_key(key, j))[1])

    def step(state, batch, key):
        return *loop(state, batch, key), jax.random.split(key)[0]
    return step


def assert_matches_dropout_loop(parallel, num_micro_batches):
    """``parallel`` (a :func:`dropout_key_step`) against :func:`dropout_loop` under jax.jit on one device,
    two steps, each on the key the step before returned."""
    _, state, batches = mlp_case()
    state = state.replace(tx=SGD, opt_state=SGD.init(state.params))
    reference = jax.jit(dropout_loop(num_micro_batches))
    got, got_key = state, jax.random.key(7)
    expected, expected_key = jax.device_put((state, got_key), jax.devices()[0])
    for batch in batches[:2]:
        got, got_loss, got_key = parallel(got, batch, got_key)
        expected, expected_loss, expected_key = reference(expected, jax.device_put(batch, jax.devices()[0]),
                                                          expected_key)
        assert_trees_close(got_loss, expected_loss, rtol=1e-5, atol=1e-6)
    fetched = got_key.fetch() if hasattr(got_key, "fetch") else got_key  # a RemoteArray on the Ray backend
    np.testing.assert_array_equal(jax.random.key_data(fetched), jax.random.key_data(expected_key))
    assert_trees_close(got.params, expected.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", ["checkpointed blocks", "dropout with a typed key", "dropout with a raw key"])
def test_user_remat_blocks_and_dropout_keys_run_in_a_pipeline(model):
    """What Flax models bring: blocks under jax.checkpoint (nn.remat; each is one operator of Eq. 3.6) and a
    PRNG key argument (a typed key<fry> or a raw uint32 key) read by every layer."""
    _, state, batches = mlp_case()
    if model == "checkpointed blocks":
        def step(state, batch):
            loss, grads = al.value_and_grad(checkpointed_blocks_loss)(state.params, batch)
            return state.apply_gradients(grads=grads), loss
        args = [(b,) for b in batches]
    else:
        step = dropout_step
        make_key = jax.random.key if model == "dropout with a typed key" else jax.random.PRNGKey
        args = [(b, make_key(i)) for i, b in enumerate(batches)]
    # one micro-batch: a dropout mask drawn for a micro-batch is not the rows of the full batch's mask
    method = al.PipeshardParallel(num_micro_batches=2 if model == "checkpointed blocks" else 1,
                                  layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
    parallel, reference = al.parallelize(step, method=method), jax.jit(step)
    got, expected = state, state
    for a in args:
        got, got_loss = parallel(got, *a)
        expected, expected_loss = reference(expected, *a)
        assert_trees_close(got_loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_trees_close(got.params, expected.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_micro_batch_draws_its_own_dropout_mask(schedule):
    """With micro-batches, the pipeline folds micro-batch j's index into the key of every draw from a per-step
    key, as the SPMD methods do (tests/alpa_like/test_methods.py): no two micro-batches share a mask. The key
    the step returns is computed by a forward piece (every micro-batch computes the same): micro-batch 0's."""
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False),
                                  pipeline_schedule=schedule)
    assert_matches_dropout_loop(al.parallelize(dropout_key_step, method=method), num_micro_batches=2)


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_a_value_made_before_al_grad_and_read_after_it_runs(num_micro_batches):
    """A value the step computes before al.grad without the batch, read in the loss and after al.grad (here a
    scale), is computed by a forward piece with every micro-batch; the update and the output read micro-batch
    0's, so no mesh reads it before it is computed."""
    _, state, batches = mlp_case()
    state = state.replace(tx=SGD, opt_state=SGD.init(state.params))

    def step(state, batch, scale):
        factor = jnp.sin(scale)
        loss, grads = al.value_and_grad(lambda p, b: factor * mlp_loss(p, b))(state.params, batch)
        return state.apply_gradients(grads=jax.tree.map(lambda g: g / factor, grads)), loss, factor

    method = al.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
    got = al.parallelize(step, method=method)(state, batches[0], jnp.float32(0.5))
    expected = jax.jit(step)(state, batches[0], jnp.float32(0.5))
    assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_python_float_argument_of_the_loss_is_accepted():
    """al.value_and_grad(loss)(params, batch, 0.5): the layer markers skip it like any non-float value (it has
    no dtype)."""
    _, state, batches = mlp_case()
    state = state.replace(tx=SGD, opt_state=SGD.init(state.params))

    def step(state, batch):
        loss, grads = al.value_and_grad(lambda p, b, scale: scale * mlp_loss(p, b))(state.params, batch, 0.5)
        return state.apply_gradients(grads=grads), loss

    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
    assert_trees_close(al.parallelize(step, method=method)(state, batches[0]), jax.jit(step)(state, batches[0]),
                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_dropout_inside_checkpointed_blocks_is_drawn_per_micro_batch(make_key):
    """Draws inside jax.checkpoint bodies, from a key made in the block: forward and recomputed backward start
    from the step's key as the micro-batch sees it, so each micro-batch has its own masks and the gradients
    are those masks' (folding at the draw instead would give the backward another mask)."""
    def block(w, b, h, key):
        keep = jax.random.bernoulli(jax.random.split(key)[1], 0.7, h.shape)  # the draw's key made in the block
        return jnp.where(keep, jnp.tanh(h @ w + b) / 0.7, 0.0)

    def loss_fn(params, batch, key):
        h = batch["x"]
        for i in range(4):
            h = jax.checkpoint(block)(params[f"w{i}"], params[f"b{i}"], h, jax.random.fold_in(key, i))
        return jnp.mean((h - batch["y"]) ** 2)

    def step(state, batch, key):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch, key)
        return state.apply_gradients(grads=grads), loss

    _, state, batches = mlp_case()
    state = state.replace(tx=SGD, opt_state=SGD.init(state.params))
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no micro-batches share a mask
        got = al.parallelize(step, method=method)(state, batches[0], make_key(1))
    want = jax.jit(micro_batch_loop(loss_fn, 2))(state, batches[0], make_key(1))
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    shared = jax.jit(micro_batch_loop(loss_fn, 2, same_key))(state, batches[0], make_key(1))[0].params["w0"]
    assert not np.allclose(got[0].params["w0"], shared, atol=1e-5)


def wide_mlp_loss(params, batch):
    x = batch["x"]
    for i in range(4):
        x = jnp.tanh(x @ params[f"w{i}"])
        if i < 3:
            al.mark_pipeline_boundary()
    return jnp.mean((x - batch["y"]) ** 2)


def test_stage_pieces_compile_the_collectives_their_layers_ilp_chose(fixed_cluster):
    # Weights dominate (512 x 512 against 4 rows per micro-batch), so the ILP avoids all-reducing gradients:
    # on stage 0 it gathers the small activations instead, on stage 1 it splits the weights Megatron-style
    # (one activation all-reduce forward, one backward). Left to propagate from the parameters' layouts, XLA
    # all-reduced stage 0's 2 MiB of weight gradients in every backward instead. Planned on fixed_cluster: on
    # ClusterSpec.local() the latency measured under load once moved stage 0's choice (a full-suite run).
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(512, 512)) / 20, jnp.float32) for i in range(4)}
    batches = [{"x": jnp.asarray(rng.normal(size=(8, 512)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(8, 512)), jnp.float32)} for _ in range(2)]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=SGD)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=stages(((0, 1), (2, 3)), ((1, 4), (1, 4)), ((1, 4), (2, 2))))
    step = train_step_for(wide_mlp_loss)
    parallel = al.parallelize(step, method=method)
    exe = parallel.get_executable(state, batches[0])
    got_state, got_losses = run_steps(parallel, state, batches)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    texts = []  # the pieces as the first step compiled them: reading their text compiles nothing
    assert compiles_during(lambda: texts.append(exe.get_hlo_text())) == 0
    pieces = hlo_stats.reduced_bytes_by_piece(texts[0])
    all_reduced = [sum(b for (q, phase), b in pieces.items() if q == stage and phase in ("fwd", "bwd"))
                   for stage in (0, 1)]
    predicted = [sum(c.num_bytes for c in s.communication
                     if c.kind == "all-reduce" and c.what == "operator collectives") for s in exe.plan.stages]
    assert predicted[0] == 0 and predicted[1] > 0
    # stage 1's pieces also all-reduce the loss (a float32 scalar) every micro-batch, which the plan counts
    # with the gradients it synchronises once per step (al.value_and_grad marks the loss with them)
    loss_bytes = 4 * method.num_micro_batches
    assert [b * method.num_micro_batches for b in all_reduced] == [predicted[0], predicted[1] + loss_bytes]


@pytest.mark.parametrize("defer, remat", [(True, False), (False, False), (True, True)],
                         ids=["deferred", "every micro-batch", "deferred, remat layers"])
def test_data_parallel_stages_reduce_gradients_once_per_step(defer, remat, fixed_cluster):
    # 64 rows per micro-batch against 16 x 16 weights: the ILP splits the batch over each stage's 4 devices
    # (on the fixed cluster: under load, this machine's measured latency once made it keep the batch whole).
    # remat_layer=True: each layer's backward is a jax.checkpoint call computing its weight gradients inside,
    # inlined as JAX lowers it (stage_gradients.inline_backward_remat) so that they are deferred too.
    loss_fn, state, _ = mlp_case()
    rng = np.random.default_rng(1)
    batches = [{"x": jnp.asarray(rng.normal(size=(256, 16)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)} for _ in range(2)]
    state = state.replace(tx=SGD, opt_state=SGD.init(state.params))
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=al.ManualLayerOption(remat_layer=remat),
                                  stage_option=stages(((0, 1), (2, 3)), ((1, 4), (1, 4)), ((1, 4), (4, 1))),
                                  defer_gradient_sync=defer)
    step = train_step_for(loss_fn)
    parallel = al.parallelize(step, method=method)
    exe = parallel.get_executable(state, batches[0])
    got_state, got_losses = run_steps(parallel, state, batches)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    reduced = {q: b for (q, phase), b in hlo_stats.reduced_bytes_by_piece(exe.get_hlo_text()).items() if phase == "bwd"}
    grad_bytes = 2 * (16 * 16 + 16) * 4  # two layers' weight and bias per stage
    if remat:  # the ILP's pins on the checkpoint calls moved onto the inlined pieces' equations
        run = {id(e) for piece in exe.program.pieces.values() for e in piece.jaxpr.jaxpr.eqns}
        assert all(id(e) in run for s in exe.stage_shardings for e, _, _ in (*s.value_pins, *s.operand_pins))
    # the plan's bytes per step are the gradients' once per step when deferred, once per micro-batch if not;
    # the last stage's include the loss, a float32 scalar that al.value_and_grad marks with the gradients
    syncs = 1 if defer else method.num_micro_batches
    assert [sum(c.num_bytes for c in s.communication) for s in exe.plan.stages] == [syncs * grad_bytes,
                                                                                   syncs * (grad_bytes + 4)]
    if defer:  # every weight and bias gradient leaves the backward as per-device partial sums
        assert {q: len(d.outputs) for q, d in exe.deferred.items()} == {0: 4, 1: 4}
        assert reduced == {0: 0, 1: 0}
    else:
        assert reduced == {0: grad_bytes, 1: grad_bytes}


@pytest.mark.slow
def test_one_stage_on_all_devices_with_deferred_gradients_runs_step_after_step():
    # Regression: the step's mean reduced each of gpt-small's ~40 deferred gradients in its own collective
    # executable; dispatched back to back on 8 CPU devices they exhausted XLA's host threads and the third
    # or fourth step deadlocked in an all-reduce (XLA aborts after 40 s). One executable per mesh now.
    # gpt-tiny with gpt-small's 12 layers has as many gradients, and compiles and runs faster.
    config = dataclasses.replace(models.get_config("gpt-tiny"), num_layers=models.get_config("gpt-small").num_layers)
    model = gpt.GPTModel(config)
    batches = [gpt.gpt_batch(config, 8, jax.random.PRNGKey(10 + i)) for i in range(4)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["input_ids"])["params"]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=SGD)
    step = train_step_for(gpt.gpt_loss(model))
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=config.num_layers),
                                  stage_option=stages((tuple(range(config.num_layers)),), ((1, 8),), ((1, 8),)))
    got_state, got_losses = run_steps(al.parallelize(step, method=method), state, batches)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)


def live_micro_batches(exe, mesh):
    """Peak number of distinct micro-batches whose buffers are alive on ``mesh``, following the program's
    writes (RUN outputs, LOAD, RECV) and FREEs: the activation memory the program holds."""
    live, peak = set(), 0
    for ins in exe.programs.program(mesh):
        if ins.op is Op.RUN and ins.micro_batch != PER_STEP:
            live.update((v, ins.micro_batch) for v in exe.program.piece(ins.stage, ins.phase).outputs)
        elif ins.op in (Op.LOAD, Op.RECV) and ins.key[1] != PER_STEP:
            live.add(ins.key)
        elif ins.op is Op.FREE:
            live.discard(ins.key)
        peak = max(peak, len({mb for _, mb in live}))
    return peak


@pytest.mark.parametrize("schedule,expected", [("gpipe", 8), ("1f1b", 2)])
def test_buffers_follow_the_schedule(schedule, expected):
    loss_fn, state, batches = gpt_case()
    method = al.PipeshardParallel(num_micro_batches=8, layer_option=al.AutoLayerOption(layer_num=4),
                                  stage_option=TWO_STAGES, pipeline_schedule=schedule)
    exe = al.parallelize(train_step_for(loss_fn), method=method).get_executable(state, batches[0])
    programs = exe.programs
    assert live_micro_batches(exe, 0) == expected
    # Every per-micro-batch buffer a mesh writes is freed on that mesh before the step ends.
    for mesh in range(2):
        written, freed = set(), set()
        for ins in programs.program(mesh):
            if ins.op in (Op.RECV, Op.LOAD) and ins.key[1] != PER_STEP:
                written.add(ins.key)
            if ins.op is Op.FREE:
                freed.add(ins.key)
        assert written <= freed


def test_programs_are_static_and_one_step_runs_no_new_compilation():
    loss_fn, state, batches = gpt_case()
    f = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=4), stage_option=TWO_STAGES))
    state, _ = f(state, batches[0])
    exe = f.get_executable(state, batches[1])
    before = exe.programs
    state, _ = f(state, batches[1])
    assert f.num_compilations == 1 and exe.programs is before
    assert exe.last_step.bytes_moved > 0 and exe.last_step.instructions == len(before.instructions)
    assert "RUN 0F0" in before.table() and "RECV" in before.table()
    hlo = exe.get_hlo_text()
    assert hlo.count("// stage") == len(exe.program.pieces) and "HloModule" in hlo


LOOPING = {  # name: (builder, layer option)
    "mlp": (mlp_case, al.ManualLayerOption()),
    "gpt": (gpt_case, al.AutoLayerOption(layer_num=4)),
    "moe": (moe_case, al.AutoLayerOption(layer_num=4)),
}


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "breadth_first"])
@pytest.mark.parametrize("case", sorted(LOOPING))
def test_looping_schedules_with_virtual_stages_match_jit(case, schedule):
    build, layer_option = LOOPING[case]
    loss_fn, state, batches = build()
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=layer_option,
                                  stage_option=stages(((0, 1), (2, 3)), ((1, 4), (1, 4)), ((2, 2), (4, 1))),
                                  pipeline_schedule=schedule, virtual_stages=2)
    f = al.parallelize(step, method=method)
    plan = f.get_executable(state, batches[0]).plan
    assert [s.layer_ids for s in plan.stages] == [(0, 2), (1, 3)]  # chunk s on mesh s mod 2
    assert str(plan).count("tensors: no per-tensor layouts recorded") == 2  # said, not an empty table
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    got_state, got_losses = run_steps(f, state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_runs_donate_last_uses_and_leave_the_step_inputs_alive():
    loss_fn, state, batches = gpt_case()
    f = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option=TWO_STAGES,
        pipeline_schedule="1f1b"))
    new_state, _ = f(state, batches[0])
    exe = f.get_executable(state, batches[0])
    assert exe.last_step.donated_buffers > 0
    arrays = [x for x in jax.tree.leaves((state, batches[0], new_state)) if isinstance(x, jax.Array)]
    assert arrays and not any(x.is_deleted() for x in arrays)
    f(new_state, batches[0])  # the arrays a step returned are valid inputs of the next step
    assert not any(x.is_deleted() for x in arrays)


@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_each_stage_piece_compiles_once_and_the_next_step_compiles_nothing(num_micro_batches):
    """A piece whose outputs are accumulated (the backward pieces, the last forward with the loss) compiles
    with the accumulation fused in on its first micro-batch already, not once without it first. The state's
    ``step`` is a Python int (``TrainState.create``), the next one an array: both load alike."""
    loss_fn, state, batches = mlp_case()
    assert isinstance(state.step, int)
    exe = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=num_micro_batches, layer_option=al.ManualLayerOption(), stage_option=TWO_STAGES,
        pipeline_schedule="1f1b")).get_executable(state, batches[0])
    stepped = []
    assert compiles_during(lambda: stepped.append(exe(state, batches[0])[0]), "jit(run)") == 6
    assert len(exe.program.pieces) == 6
    assert compiles_during(lambda: exe(stepped[0], batches[1])) == 0


def test_every_step_after_the_second_reuses_the_same_executables():
    # Which inputs a RUN donates is part of its executable's cache key; it must not change from step to
    # step (it once did, when ids of freed arrays were recycled, and each step recompiled three pieces).
    loss_fn, state, batches = gpt_case()
    f = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4), stage_option=TWO_STAGES,
        pipeline_schedule="1f1b"))
    exe = f.get_executable(state, batches[0])
    counts, donated = [], []
    for k in range(6):
        state, _ = exe(state, batches[k % len(batches)])
        counts.append(exe.num_piece_executables)
        donated.append(exe.last_step.donated_buffers)
    assert len(set(counts[1:])) == 1 and len(set(donated)) == 1, (counts, donated)


def _classifier_case():
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32) for i in range(4)}
    batch = {"x": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32), "y": jnp.asarray(rng.integers(0, 16, 32))}

    def loss_fn(params, batch):
        x = batch["x"]
        for i in range(4):
            x = jnp.tanh(x @ params[f"w{i}"])
            if i < 3:
                al.mark_pipeline_boundary()
        return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()
    return loss_fn, train_state.TrainState.create(apply_fn=None, params=params, tx=SGD), batch


def test_donations_xla_cannot_reuse_raise_no_warning():
    # Some inputs a RUN donates match no output in shape (the integer labels, the loss's per-row values):
    # JAX warns at compile time, but the FREE after the RUN drops them anyway: not news for users.
    loss_fn, state, batch = _classifier_case()
    single = stages(((0,), (1,), (2,), (3,)), ((1, 1), (1, 2), (1, 4), (1, 1)), ((1, 1), (1, 2), (1, 4), (1, 1)))
    f = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=4, layer_option=al.ManualLayerOption(), stage_option=single))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(state, batch)
    assert f.get_executable(state, batch).last_step.donated_buffers > 0
    assert not [w for w in caught if "donated buffers" in str(w.message)]


def test_a_profiled_step_computes_the_same_and_times_every_instruction():
    loss_fn, state, batches = gpt_case()
    f = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=4), stage_option=TWO_STAGES))
    plain_state, plain_loss = f(state, batches[0])
    exe = f.get_executable(state, batches[0])
    profiled_state, profiled_loss = exe.run(state, batches[0], profile=True)
    assert_trees_close(profiled_state.params, plain_state.params, rtol=0, atol=0)
    assert float(profiled_loss) == float(plain_loss)
    stats = exe.last_step
    assert {"RUN", "RECV", "LOAD"} <= set(stats.op_seconds)
    assert len(stats.spans) >= sum(1 for ins in exe.programs.instructions if ins.op is Op.RUN)
    assert sum(end - start for _, _, start, end in stats.spans) <= stats.seconds


def tied_loss(params, batch):
    """Two layers sharing ``w``: the first multiplies by it, the second by its transpose (a tied embedding)."""
    h = jnp.tanh(batch["x"] @ params["w"])
    al.mark_pipeline_boundary()
    out = jnp.tanh(h @ params["v"]) @ params["w"].T
    return jnp.mean((out - batch["y"]) ** 2)


def tied_case():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32),
              "v": jnp.asarray(rng.normal(size=(32, 32)) / 4, jnp.float32)}
    batches = [{"x": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)} for _ in range(3)]
    return tied_loss, train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2)), batches


TIED_STAGES = stages(((0,), (1,)), ((1, 4), (1, 4)), ((2, 2), (1, 4)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_tied_parameter_is_updated_on_both_meshes_that_read_it(schedule):
    """``w`` is read by both stages: its Adam update runs on both meshes, after each receives the gradient
    part the other accumulated, so from the second step on each mesh loads its own copy of the ``w`` (and
    of its Adam moments) that the previous step returned, and nothing is copied between meshes for them.
    The parameters match plain jax.jit after 3 steps."""
    loss_fn, state, batches = tied_case()
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=TIED_STAGES, pipeline_schedule=schedule)
    parallel = al.parallelize(step, method=method)
    exe = parallel.get_executable(state, batches[0])
    program = exe.program
    w = next(v for v in program.step_inputs if program.values[v].aval.shape == (16, 32))
    grad_parts = [dst for src, dst in program.accumulated if program.values[src].aval.shape == (16, 32)]
    assert len(grad_parts) == 2
    recvs = {(i.mesh, i.key[0]) for i in exe.programs.instructions if i.op is Op.RECV and i.key[1] == PER_STEP}
    assert {(m, v) for m in (0, 1) for v in grad_parts if program.home[v] != m} <= recvs
    assert all(w in program.piece(q, "apply").inputs for q in (0, 1))
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    got, losses, copies = state, [], []
    for batch in batches:
        got, loss = exe(got, batch)
        losses.append(loss)
        copies.append(exe.last_step.own_copy_loads)
    assert copies[0] == 0 and copies[1] == copies[2] >= 3  # w, mu_w, nu_w on the mesh the step did not return
    assert_trees_close(got.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got.opt_state, ref_state.opt_state, rtol=1e-5, atol=1e-6)
    assert_trees_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
