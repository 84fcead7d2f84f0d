"""Every SPMD method equals plain jax.jit on one device (MLP and tiny GPT, 3 steps)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import alpa_like as al
from alpa_like import models
from alpa_like.models import gpt, wide_resnet
from tests.helpers import (assert_trees_close, make_train_step, micro_batch_key, micro_batch_loop, mlp_batch,
                           mlp_loss, mlp_state, reference_on_one_device, run_steps, same_key, wresnet_tiny)

# One table: every method under test, crossed with the models below (optax alias_test style).
MANUAL_2D = al.ManualShardParallel(
    mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
    in_specs=(None, P("data")))
METHODS = {
    "data": al.DataParallel(),
    "data_mb2": al.DataParallel(num_micro_batches=2),
    "zero2": al.Zero2Parallel(),
    "zero2_mb2": al.Zero2Parallel(num_micro_batches=2),
    "zero3": al.Zero3Parallel(),
    "zero3_mb4": al.Zero3Parallel(num_micro_batches=4),
    "manual_2d": MANUAL_2D,
    "manual_2d_mb2": al.ManualShardParallel(mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
                                            in_specs=(None, P("data")), num_micro_batches=2),
}
PIPESHARD_MB2 = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                     stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
"""Two stages of one layer each, two micro-batches: the pipeline in the tests of random numbers and effects."""


def _mlp_case():
    rng = np.random.default_rng(1)
    batches = [mlp_batch(rng) for _ in range(3)]
    return make_train_step(mlp_loss), mlp_state(), batches


def _gpt_case():
    config = models.get_config("gpt-tiny")
    model = gpt.GPTModel(config)
    params = model.init(jax.random.PRNGKey(0), gpt.gpt_batch(config, 2, jax.random.PRNGKey(1))["input_ids"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params["params"] if "params" in params
                                          else params, tx=optax.sgd(0.1, momentum=0.9))
    batches = [gpt.gpt_batch(config, 32, jax.random.PRNGKey(10 + i)) for i in range(3)]
    return make_train_step(gpt.gpt_loss(model)), state, batches


# (case builder, atol). GPT trains with SGD + momentum, whose update is linear in the gradient: with Adam,
# elements whose gradient is at float32 noise level (e.g. the key-projection bias, analytically zero by the
# softmax's shift invariance) get updates of size lr * sign(noise), which no tolerance can bound.
CASES = {"mlp": (_mlp_case, 1e-6), "gpt": (_gpt_case, 1e-6)}


@pytest.mark.parametrize("model", sorted(CASES))
@pytest.mark.parametrize("method_name", sorted(METHODS))
def test_method_matches_single_device_jit(model, method_name):
    build, atol = CASES[model]
    step, state, batches = build()
    ref_state, ref_metrics = reference_on_one_device(step, state, batches)
    par_state, par_metrics = run_steps(al.parallelize(step, method=METHODS[method_name]), state, batches)
    # Sharded matmuls and micro-batch sums reassociate float32 additions: 1e-5 relative after 3 Adam steps.
    assert_trees_close(par_state.params, ref_state.params, rtol=1e-5, atol=atol)
    assert_trees_close(par_state.opt_state, ref_state.opt_state, rtol=1e-5, atol=atol)
    assert_trees_close(par_metrics, ref_metrics, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("num_micro_batches", [1, 2, 4])
def test_gradient_accumulation_gives_the_same_update(num_micro_batches):
    # SGD: the update is the gradient itself, so any accumulation error shows directly.
    step = make_train_step(mlp_loss)
    state = mlp_state(tx=optax.sgd(0.1))
    batch = mlp_batch(np.random.default_rng(3), batch_size=64)
    ref_state, ref_metrics = reference_on_one_device(step, state, [batch])
    f = al.parallelize(step, method=al.DataParallel(num_micro_batches=num_micro_batches))
    new_state, metrics = f(state, batch)
    assert_trees_close(new_state.params, ref_state.params, rtol=1e-5, atol=1e-7)
    assert_trees_close(metrics, ref_metrics[0], rtol=1e-5, atol=1e-7)


def test_plain_jax_grad_works_without_micro_batches():
    step = make_train_step(mlp_loss, grad_fn=jax.grad)
    state = mlp_state()
    batches = [mlp_batch(np.random.default_rng(i)) for i in range(2)]
    ref_state, _ = reference_on_one_device(step, state, batches)
    for method in (al.DataParallel(), al.Zero2Parallel(), al.Zero3Parallel()):
        par_state, _ = run_steps(al.parallelize(step, method=method), state, batches)
        assert_trees_close(par_state.params, ref_state.params)


def test_plain_jax_grad_with_micro_batches_is_a_clear_error():
    step = make_train_step(mlp_loss, grad_fn=jax.grad)
    f = al.parallelize(step, method=al.DataParallel(num_micro_batches=2))
    with pytest.raises(ValueError, match="use al.grad"):
        f(mlp_state(), mlp_batch(np.random.default_rng(0)))


def test_zero_methods_shard_what_they_promise():
    step = make_train_step(mlp_loss)
    args = (mlp_state(), mlp_batch(np.random.default_rng(0)))
    zero2 = al.parallelize(step, method=al.Zero2Parallel()).get_executable(*args).plan
    zero3 = al.parallelize(step, method=al.Zero3Parallel()).get_executable(*args).plan
    data = al.parallelize(step, method=al.DataParallel()).get_executable(*args).plan
    kernel, mu = "state.params.dense_0.kernel", "state.opt_state.0.mu.dense_0.kernel"
    assert str(data.tensor(kernel).spec) == "RR" and str(data.tensor(mu).spec) == "RR"
    assert str(zero2.tensor(kernel).spec) == "RR" and str(zero2.tensor(mu).spec) != "RR"
    assert str(zero3.tensor(kernel).spec) != "RR" and str(zero3.tensor(mu).spec) != "RR"
    assert data.tensor("batch.x").spec.axes[0] == (0,)
    # The new state keeps the input layout, so the next step needs no resharding.
    assert zero3.tensor("out.0.params.dense_0.kernel").spec == zero3.tensor(kernel).spec
    assert zero2.stages[0].memory_per_device < data.stages[0].memory_per_device
    assert zero3.stages[0].memory_per_device < zero2.stages[0].memory_per_device


def test_data_parallel_all_reduces_the_gradients_once():
    exe = al.parallelize(make_train_step(mlp_loss), method=al.DataParallel(num_micro_batches=2)).get_executable(
        mlp_state(), mlp_batch(np.random.default_rng(0)))
    kinds = [c.kind for c in exe.collectives()]
    assert "all-reduce" in kinds
    assert "all-gather" not in kinds
    (comm,) = exe.plan.stages[0].communication
    assert comm.kind == "all-reduce" and comm.what == "gradient synchronisation"
    param_bytes = sum(t.bytes_per_device for t in exe.plan.stages[0].inputs if t.role == "param")
    assert comm.num_bytes == param_bytes


@pytest.mark.parametrize("method_name", ["data_mb2", "zero2_mb2", "zero3_mb4", "manual_2d_mb2"])
def test_micro_batches_synchronise_the_gradients_once_per_step(method_name):
    # GPT's gradients include an embedding's scatter-add into a zero table hoisted out of the micro-batch
    # loop, a position embedding indexed by an iota, and the tied output projection's matmul; the manual 2-D
    # mesh leaves its "model" axis idle
    step, state, batches = _gpt_case()
    exe = al.parallelize(step, method=METHODS[method_name]).get_executable(state, batches[0])
    collectives = exe.collectives()
    assert [c.kind for c in collectives if c.in_loop_body] == []
    assert "all-reduce" in {c.kind for c in collectives if not c.in_loop_body}


def _dropout_loss(params, batch, key):
    key = jax.random.fold_in(key, 7)
    keep = jax.random.bernoulli(key, 0.7, (batch["x"].shape[0], 32))
    h = jnp.where(keep, jnp.tanh(batch["x"] @ params["dense_0"]["kernel"] + params["dense_0"]["bias"]) / 0.7, 0.0)
    return jnp.mean((h @ params["dense_1"]["kernel"] + params["dense_1"]["bias"] - batch["y"]) ** 2)


@pytest.mark.parametrize("method", [
    METHODS["data_mb2"], METHODS["zero3_mb4"], al.ShardParallel(num_micro_batches=2),
    al.ManualShardParallel(mesh_shape=(2, 4), mesh_axis_names=("data", "model"), in_specs=(None, P("data"), None),
                           num_micro_batches=2)], ids=lambda m: type(m).__name__)
def test_each_micro_batch_draws_its_own_dropout_mask(method):
    """The step with a per-step key equals, on one device under jax.jit, the loop over micro-batches whose
    micro-batch j (rows j, j + m, ...) computes from the step's key as it sees it (``fold_in(key, j)``, j > 0)."""
    m = method.num_micro_batches

    def step(state, batch, key):
        loss, grads = al.value_and_grad(_dropout_loss)(state.params, batch, key)
        return state.apply_gradients(grads=grads), loss

    state, key = jax.device_put((mlp_state(tx=optax.sgd(0.1)), jax.random.key(5)), jax.devices()[0])
    batches = [jax.device_put(mlp_batch(np.random.default_rng(i)), jax.devices()[0]) for i in range(2)]
    parallel, reference = al.parallelize(step, method=method), jax.jit(micro_batch_loop(_dropout_loss, m))
    got, expected = state, state
    for i, batch in enumerate(batches):
        got, got_loss = parallel(got, batch, jax.random.fold_in(key, i))
        expected, expected_loss = reference(expected, batch, jax.random.fold_in(key, i))
        assert_trees_close(got_loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_trees_close(got.params, expected.params, rtol=1e-5, atol=1e-6)


class _RematDropoutBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dropout(0.3, deterministic=False)(jnp.tanh(nn.Dense(x.shape[-1])(x)))


class _RematDropoutNet(nn.Module):
    """Flax's common case: nn.remat blocks with nn.Dropout, which splits its key inside the block."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.remat(_RematDropoutBlock)(name=f"block_{i}")(x)
        return nn.Dense(8)(x)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
@pytest.mark.parametrize("method", [al.DataParallel(num_micro_batches=2), PIPESHARD_MB2],
                         ids=lambda m: type(m).__name__)
def test_flax_remat_blocks_with_dropout_draw_their_own_masks_per_micro_batch(method, make_key):
    model = _RematDropoutNet()
    batch = mlp_batch(np.random.default_rng(3))
    params = model.init(jax.random.PRNGKey(0), batch["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    def loss_fn(params, batch, key):
        out = model.apply({"params": params}, batch["x"], rngs={"dropout": key})
        return jnp.mean((out - batch["y"]) ** 2)

    def step(state, batch, key):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch, key)
        return state.apply_gradients(grads=grads), loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no micro-batches share a mask
        got = al.parallelize(step, method=method)(state, batch, make_key(9))
    state, batch = jax.device_put((state, batch), jax.devices()[0])
    want = jax.jit(micro_batch_loop(loss_fn, 2))(state, batch, make_key(9))
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    shared = jax.jit(micro_batch_loop(loss_fn, 2, same_key))(state, batch, make_key(9))[0].params
    assert not np.allclose(got[0].params["Dense_0"]["kernel"], shared["Dense_0"]["kernel"], atol=1e-5)


@pytest.mark.parametrize("method", [al.DataParallel(num_micro_batches=2), al.Zero2Parallel(num_micro_batches=2),
                                    al.ShardParallel(num_micro_batches=2)], ids=lambda m: type(m).__name__)
def test_weight_gradients_inside_checkpointed_blocks_are_synchronised_once_per_step(method, fixed_cluster):
    """A jax.checkpoint / nn.remat block's backward computes its weight gradients inside the block: the
    block is inlined as JAX lowers it (an optimization barrier on its operands, then its body: see
    tests/compiler/test_trace.py), so those gradients are kept as partial sums in the loop too. Planned on
    fixed_cluster: under load, ShardParallel's ILP on ClusterSpec.local() once split an activation instead
    (a full-suite run found its all-reduce in the loop)."""
    def block(w, h):
        return jnp.tanh(h @ w)

    def outer_block(w0, w1, h):  # a checkpointed block with another inside: deferred too
        return jax.checkpoint(block)(w1, jnp.tanh(h @ w0))

    def loss_fn(params, batch):
        h = jax.checkpoint(block)(params["w0"], batch["x"])
        h = jax.checkpoint(outer_block)(params["w1"], params["w2"], h)
        return jnp.mean((h - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32) for i in range(3)}
    batch = {k: jnp.asarray(rng.normal(size=(16, 16)), jnp.float32) for k in ("x", "y")}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    step = make_train_step(loss_fn)
    parallel = al.parallelize(step, method=method)
    got = parallel(state, batch)
    assert_trees_close(got, jax.jit(step)(*jax.device_put((state, batch), jax.devices()[0])), rtol=1e-5, atol=1e-6)
    exe = parallel.get_executable(state, batch)
    assert not [c for c in exe.collectives() if c.in_loop_body]
    assert sum(c.result_bytes for c in exe.collectives()) >= 3 * 16 * 16 * 4  # the gradients, once per step


@pytest.mark.parametrize("method", [al.DataParallel(num_micro_batches=2), al.ShardParallel(num_micro_batches=2),
                                    PIPESHARD_MB2], ids=lambda m: type(m).__name__)
def test_an_aux_of_the_masks_is_averaged_over_the_micro_batches(method):
    """An aux computed from the key alone (the mask's keep rate) comes from each micro-batch's own mask and is
    averaged like the loss by every method, not taken from micro-batch 0."""
    def loss_fn(params, batch, key):
        keep = jax.random.bernoulli(key, 0.7, (32,))
        h = jnp.where(keep, jnp.tanh(batch["x"] @ params["dense_0"]["kernel"]) / 0.7, 0.0)
        loss = jnp.mean((h @ params["dense_1"]["kernel"] - batch["y"]) ** 2)
        return loss, jnp.mean(keep.astype(jnp.float32))

    def step(params, batch, key):
        return al.value_and_grad(loss_fn, has_aux=True)(params, batch, key)

    params, batch, key = mlp_state().params, mlp_batch(np.random.default_rng(0)), jax.random.key(8)
    (loss, rate), _ = al.parallelize(step, method=method)(params, batch, key)
    parts = [loss_fn(params, jax.tree.map(lambda x, j=j: x[j::2], batch), micro_batch_key(key, j)) for j in range(2)]
    assert parts[0][1] != parts[1][1]
    np.testing.assert_allclose(float(rate), (parts[0][1] + parts[1][1]) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(loss), (parts[0][0] + parts[1][0]) / 2, rtol=1e-5)


@pytest.mark.parametrize("method", [al.DataParallel(num_micro_batches=2), PIPESHARD_MB2],
                         ids=lambda m: type(m).__name__)
def test_a_key_seeded_inside_a_checkpointed_block_folds_nothing_in_every_method(method):
    """A key made from a seed inside a jax.checkpoint body: the forward's copy of it is made outside the
    block, the backward's inside, where no fold can reach it; so nothing is folded (a warning says so), and
    the methods that inline checkpointed blocks to defer their gradients keep such a block a call (inlined,
    its forward and backward would draw different masks: wrong gradients)."""
    def seeded_dropout(h, seed):
        return jnp.where(jax.random.bernoulli(jax.random.key(seed), 0.7, h.shape), h / 0.7, 0.0)

    def loss_fn(params, batch, key, seed):
        h = jax.checkpoint(seeded_dropout)(jnp.tanh(batch["x"] @ params["dense_0"]["kernel"]), seed)
        h = jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0)
        return jnp.mean((h @ params["dense_1"]["kernel"] - batch["y"]) ** 2)

    def step(state, batch, key, seed):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch, key, seed)
        return state.apply_gradients(grads=grads), loss

    state, batch = mlp_state(tx=optax.sgd(0.1)), mlp_batch(np.random.default_rng(0))
    args = (jax.random.key(3), jnp.uint32(5))
    with pytest.warns(UserWarning, match="draws random numbers from a key that is neither"):
        got = al.parallelize(step, method=method)(state, batch, *args)
    assert_trees_close(got, micro_batch_loop(loss_fn, 2, same_key)(state, batch, *args), rtol=1e-5, atol=1e-6)


def test_convolution_weight_gradients_are_synchronised_once_per_step():
    # (their partial sums are checked against the whole gradient in tests/compiler/test_gradient_sync.py)
    config, variables, loss_fn = wresnet_tiny()

    def step(params, stats, batch):
        (loss, _), grads = al.value_and_grad(loss_fn, has_aux=True)(params, stats, batch)
        return grads, loss
    args = (variables["params"], variables["batch_stats"], wide_resnet.wresnet_batch(config, 16, jax.random.PRNGKey(1)))
    exe = al.parallelize(step, method=al.DataParallel(num_micro_batches=2), batch_argnums=(2,)).get_executable(*args)
    in_loop = [c for c in exe.collectives() if c.in_loop_body]
    # BatchNorm's sums over the micro-batch remain in the loop; no convolution's result is reduced there
    assert in_loop and not any("conv_general_dilated" in c.line for c in in_loop)
    kernel_bytes = sum(k.size * 4 for k in jax.tree.leaves(variables["params"]) if k.ndim == 4)
    assert sum(c.result_bytes for c in exe.collectives() if not c.in_loop_body) >= kernel_bytes


@pytest.mark.parametrize("method", [al.DataParallel(num_micro_batches=2), al.ShardParallel(num_micro_batches=2),
                                    PIPESHARD_MB2], ids=lambda m: type(m).__name__)
def test_debug_callbacks_fire_with_micro_batches(method):
    """In the loss once per micro-batch, after al.grad once per step (the pipeline: in the stage pieces of
    the values they read, on the local backend)."""
    seen = []

    def loss_fn(params, batch):
        jax.debug.callback(lambda total: seen.append(("micro-batch", float(total))), jnp.sum(batch["x"]))
        return mlp_loss(params, batch)

    def step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        jax.debug.callback(lambda value: seen.append(("step", float(value))), loss)
        return state.apply_gradients(grads=grads), loss
    state, batch = mlp_state(), mlp_batch(np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no sharding rule" warning for the callbacks
        _, loss = al.parallelize(step, method=method)(state, batch)
    jax.effects_barrier()
    assert [what for what, _ in seen] == ["micro-batch", "micro-batch", "step"]
    assert seen[0][1] + seen[1][1] == pytest.approx(float(jnp.sum(batch["x"])), abs=1e-4)
    assert seen[2][1] == pytest.approx(float(loss))


def test_a_grouped_convolution_on_a_2d_manual_mesh_is_a_warning():
    def loss_fn(kernel, batch):  # depthwise: one group per channel
        y = jax.lax.conv_general_dilated(batch["x"], kernel, (1, 1), "VALID", feature_group_count=4,
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(y ** 2)

    def step(kernel, batch):
        return kernel - 0.1 * al.grad(loss_fn)(kernel, batch)
    args = (jnp.ones((3, 3, 1, 4)), {"x": jnp.ones((16, 6, 6, 4))})
    with pytest.warns(UserWarning, match="grouped .* convolution on a 2-D mesh"):
        al.parallelize(step, method=al.ManualShardParallel(
            mesh_shape=(2, 4), mesh_axis_names=("data", "model"), in_specs=(None, P("data")))).get_executable(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        al.parallelize(step, method=al.ManualShardParallel(
            mesh_shape=(8, 1), mesh_axis_names=("data", "model"), in_specs=(None, P("data")))).get_executable(*args)


def test_manual_logical_axis_rules_map_to_mesh_axes():
    rules = (("batch", "data"), ("hidden", "model"), ("embed", None), ("out", None))
    state, batches = mlp_state(), [mlp_batch(np.random.default_rng(i)) for i in range(2)]
    state_specs = state.replace(  # a prefix of the state: None (replicated) covers a whole subtree
        step=None, opt_state=None,
        params={"dense_0": {"kernel": P("embed", "hidden"), "bias": P("hidden")},
                "dense_1": {"kernel": P("hidden", "out"), "bias": None}})
    method = al.ManualShardParallel(mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
                                    in_specs=(state_specs, P("batch")), logical_axis_rules=rules)
    step = make_train_step(mlp_loss)
    f = al.parallelize(step, method=method)
    plan = f.get_executable(state, batches[0]).plan
    assert str(plan.tensor("state.params.dense_0.kernel").spec) == "RS1"
    assert str(plan.tensor("state.params.dense_1.kernel").spec) == "S1R"
    assert str(plan.tensor("batch.x").spec) == "S0R"
    ref_state, _ = reference_on_one_device(step, state, batches)
    par_state, _ = run_steps(f, state, batches)
    assert_trees_close(par_state.params, ref_state.params)
