"""Models and cases from outside the repository (Flax examples' shapes, MaxText-style blocks, optax chains),
trained through the public API and compared with plain ``jax.jit`` on one device (tests/helpers.py)."""
import functools
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec

import alpa_like as al
from alpa_like import nn as al_nn
from alpa_like.runtime.terapipe_runtime import TerapipeContractError
from tests.helpers import assert_trees_close, make_train_step, mlp_batch, mlp_loss, mlp_params, run_steps

HIDDEN, SEQ = 8, 8


def _padded_attention_loss(params, batch):
    """Causal attention layers whose features are shifted by a ``jnp.pad`` on the feature dim (per token, so
    within TeraPipe's contract); the pad's padding value is a constant residual of the stage's vjp. Each
    layer's output is pinned, pjit-style, to rows split over all the devices (a stage has half of them)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = batch["x"]
    for name in sorted(params):
        q = (x @ params[name]).reshape(*x.shape[:2], 2, HIDDEN // 2)
        x = x + al_nn.causal_self_attention(q, q, q).reshape(x.shape)
        x = x + 0.1 * jnp.pad(x, ((0, 0), (0, 0), (1, 0)))[..., :-1]
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec("data")))
    return jnp.mean((x - batch["y"]) ** 2)


def _attention_case(seed=0):
    """Two (HIDDEN x HIDDEN) layers' parameters, SGD, one batch of ``[2, SEQ, HIDDEN]`` sequences, and TeraPipe
    over two stages with two token slices."""
    rng = np.random.default_rng(seed)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(HIDDEN, HIDDEN)) / 4, jnp.float32) for i in range(2)}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    batches = [{k: jnp.asarray(rng.normal(size=(2, SEQ, HIDDEN)), jnp.float32) for k in ("x", "y")}]
    method = al.PipeshardParallel(num_micro_batches=1, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2), pipeline_schedule="terapipe",
                                  token_slices=(4, 4))
    return state, batches, method


def test_terapipe_runs_a_stage_whose_vjp_keeps_a_constant_and_a_sharding_constraint():
    state, batches, method = _attention_case()
    step = make_train_step(_padded_attention_loss)
    with pytest.warns(UserWarning, match="leaves out 4 sharding_constraint equation"):
        got, got_metrics = run_steps(al.parallelize(step, method=method), state, batches)
    want, want_metrics = run_steps(jax.jit(step), state, batches)  # the constraints' devices: not one device
    assert_trees_close(got.params, want.params)
    assert_trees_close(got_metrics, want_metrics)


def test_terapipe_names_attention_inside_a_checkpointed_block():
    """An ``nn.remat`` / ``jax.checkpoint`` block (or a scan body) hides the keys and values TeraPipe caches."""
    def block(w, x):
        q = (x @ w).reshape(*x.shape[:2], 2, HIDDEN // 2)
        return x + al_nn.causal_self_attention(q, q, q).reshape(x.shape)

    def loss(params, batch):
        x = batch["x"]
        for name in sorted(params):
            x = jax.checkpoint(lambda w, h: block(w, h))(params[name], x)  # one function object per call: traced afresh
        return jnp.mean((x - batch["y"]) ** 2)

    state, batches, method = _attention_case()
    with pytest.raises(TerapipeContractError, match="not inside a jax.checkpoint / nn.remat, lax.scan / nn.scan"):
        al.parallelize(make_train_step(loss), method=method)(state, batches[0])


def test_terapipe_checks_a_bfloat16_loss_in_its_own_precision():
    """The contract check compares the slices' summed loss with the whole sequences' to the loss dtype's
    precision: a bfloat16 model within the contract trains."""
    state, batches, method = _attention_case(seed=1)  # slices' losses 2.00391, whole sequences' 2 (bfloat16)
    to_bf16 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.bfloat16))
    state = state.replace(params=to_bf16(state.params), opt_state=state.tx.init(to_bf16(state.params)))
    batches = to_bf16(batches)
    step = make_train_step(_padded_attention_loss)
    with pytest.warns(UserWarning, match="sharding_constraint"):
        got, got_metrics = run_steps(al.parallelize(step, method=method), state, batches)
    want, want_metrics = run_steps(jax.jit(step), state, batches)
    # bfloat16 keeps 8 bits: the slices sum their gradients in another order than the whole step
    assert_trees_close(got.params, want.params, rtol=2e-2, atol=2e-2)
    assert_trees_close(got_metrics, want_metrics, rtol=2e-2, atol=2e-2)


def test_a_key_in_the_batch_is_named_with_where_it_belongs():
    """A VAE-style step with its sampling key among the batch leaves (2 words, not one row per example)."""
    def step(state, batch):
        def loss(params):
            noise = jax.random.normal(batch["key"], batch["x"].shape)
            return jnp.mean((batch["x"] + noise) @ params["w"]) ** 2
        grads = al.grad(loss)(state.params)
        return state.apply_gradients(grads=grads)

    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones((4, 2))}, tx=optax.sgd(0.1))
    batch = {"x": jnp.ones((16, 4)), "key": jax.random.PRNGKey(0)}
    with pytest.raises(ValueError, match="batch leaf batch.key has 2 rows.*in an argument outside batch_argnums"):
        al.parallelize(step, method=al.DataParallel())(state, batch)


def _pinned_mlp_case():
    """A pjit-style MLP that pins its activations to rows split over a mesh of all the devices, inside a
    checkpointed block too: ``(step, state, batches)``."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, PartitionSpec("data"))

    def layer(p, x):
        return jax.lax.with_sharding_constraint(jnp.tanh(x @ p["kernel"] + p["bias"]), rows)

    def loss(params, batch):
        x = layer(params["dense_0"], batch["x"])
        x = jax.checkpoint(layer)(params["dense_1"], x)
        return jnp.mean((x @ params["dense_2"]["kernel"] - batch["y"]) ** 2)

    sizes = (16, 32, 32, 8)
    rng = np.random.default_rng(0)
    state = train_state.TrainState.create(apply_fn=None, params=mlp_params(rng, sizes), tx=optax.sgd(0.1))
    return make_train_step(loss), state, [mlp_batch(rng, 32, sizes) for _ in range(2)]


def test_a_pipeline_leaves_out_the_models_sharding_constraints():
    """Each pipeline stage runs on half of the devices the constraints name."""
    step, state, batches = _pinned_mlp_case()
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2))
    with pytest.warns(UserWarning, match="leaves out 4 sharding_constraint equation"):
        got, _ = run_steps(al.parallelize(step, method=method), state, batches)
    want, _ = run_steps(jax.jit(step), state, batches)  # the constraints' devices: not one device
    assert_trees_close(got.params, want.params)


def test_shard_parallel_lays_out_a_sharding_constraint_like_any_value():
    """The ILP treats a constraint as an identity instead of computing it replicated."""
    step, state, batches = _pinned_mlp_case()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no sharding rule")
        got, _ = run_steps(al.parallelize(step, method=al.ShardParallel()), state, batches)
    want, _ = run_steps(jax.jit(step), state, batches)
    assert_trees_close(got.params, want.params)


def test_a_gradient_accumulation_loop_in_the_step_is_named_under_a_pipeline():
    """A MaxText-style step that scans al.value_and_grad over its micro-batches itself."""
    def step(state, batch):
        def accumulate(total, micro_batch):
            loss, grads = al.value_and_grad(mlp_loss)(state.params, micro_batch)
            return jax.tree.map(jnp.add, total, (loss, grads)), None
        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = jax.lax.scan(accumulate, zero, jax.tree.map(lambda x: x.reshape(2, -1, *x.shape[1:]),
                                                                         batch))
        return state.apply_gradients(grads=jax.tree.map(lambda g: g / 2, grads)), loss / 2

    rng = np.random.default_rng(0)
    state = train_state.TrainState.create(apply_fn=None, params=mlp_params(rng), tx=optax.sgd(0.1))
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2))
    with pytest.raises(ValueError, match="inside a lax.scan, loop or cond body .* accumulate with num_micro_batches"):
        al.parallelize(step, method=method)(state, mlp_batch(rng))


def test_a_pipeline_over_layers_stacked_in_a_scan_says_why_one_stage_runs_them_all():
    """MaxText-style: the blocks are one ``lax.scan`` over stacked weights (as ``nn.scan`` makes them)."""
    def loss(params, batch):
        h = batch["x"] @ params["embed"]
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, params["blocks"])
        return jnp.mean((h - batch["y"]) ** 2)

    params = {"embed": jnp.zeros((4, HIDDEN)), "blocks": jnp.zeros((6, HIDDEN, HIDDEN))}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    batch = {"x": jnp.zeros((16, 4)), "y": jnp.zeros((16, HIDDEN))}
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2))
    with pytest.warns(UserWarning, match="one scan loop holds 91% of the loss's FLOPs .* unroll the layers"):
        al.plan(make_train_step(loss), state, batch, method=method, cluster=al.ClusterSpec.preset("p3.16xlarge"))


def test_a_pipeline_takes_numpy_scalars_as_jax_jit_does():
    """A state of NumPy scalars beside its parameters (a step counter and a learning rate read from a NumPy
    config): 64-bit ones compute in 32 bits, as ``jax.jit`` converts them."""
    def step(state, batch):
        loss, grads = al.value_and_grad(mlp_loss)(state["params"], batch)
        params = jax.tree.map(lambda w, g: w - state["lr"] * g, state["params"], grads)
        return {"params": params, "lr": state["lr"], "count": state["count"] + 1}, loss

    rng = np.random.default_rng(0)
    state = {"params": mlp_params(rng), "lr": np.float64(0.1), "count": np.int64(0)}
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2))
    batches = [mlp_batch(rng) for _ in range(2)]
    got, _ = run_steps(al.parallelize(step, method=method), state, batches)
    want, _ = run_steps(jax.jit(step), state, batches)
    assert_trees_close(got, want)
    assert got["count"].dtype == want["count"].dtype == jnp.int32


def test_a_string_batch_leaf_is_named():
    state = train_state.TrainState.create(apply_fn=None, params=mlp_params(np.random.default_rng(0)),
                                          tx=optax.sgd(0.1))
    batch = dict(mlp_batch(np.random.default_rng(0)), names=np.array(["a"] * 32))
    with pytest.raises(TypeError, match="argument leaf batch.names has dtype <U1, which JAX cannot compute with"):
        al.parallelize(make_train_step(mlp_loss), method=al.DataParallel())(state, batch)


class _StepOutput(typing.NamedTuple):
    state: train_state.TrainState
    loss: jax.Array


def _named_tuple_step(state, batch):
    loss, grads = al.value_and_grad(mlp_loss)(state.params, batch)
    return _StepOutput(state.apply_gradients(grads=grads), loss)


def test_a_step_returning_a_named_tuple_trains():
    rng = np.random.default_rng(0)
    state = train_state.TrainState.create(apply_fn=None, params=mlp_params(rng), tx=optax.sgd(0.1))
    batch = mlp_batch(rng)
    got = al.parallelize(_named_tuple_step, method=al.Zero3Parallel())(state, batch)
    want = jax.jit(_named_tuple_step)(state, batch)
    assert type(got) is _StepOutput
    assert_trees_close(got, want)


def _dict_step(state, batch):
    loss, grads = al.value_and_grad(mlp_loss)(state.params, batch)
    return {"state": state.apply_gradients(grads=grads), "loss": loss}


@pytest.mark.parametrize("method", [
    al.Zero3Parallel(),
    al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                         stage_option=al.UniformStageOption(num_stages=2))], ids=["zero3", "pipeline"])
def test_a_state_returned_in_a_dict_or_named_tuple_keeps_the_steps_layouts(method):
    """The new state inside the step's output container comes back in the layouts the step takes it in, so
    the next step neither moves it nor holds it whole (ZeRO-3 sharded, not replicated)."""
    rng = np.random.default_rng(0)
    state = train_state.TrainState.create(apply_fn=None, params=mlp_params(rng), tx=optax.adam(1e-2))
    batches = [mlp_batch(rng) for _ in range(2)]
    for step, new_state in ((_dict_step, lambda out: out["state"]), (_named_tuple_step, lambda out: out.state)):
        parallel = al.parallelize(step, method=method)
        got = new_state(parallel(state, batches[0]))
        layouts = parallel.get_executable(got, batches[1]).input_shardings()
        for (path, leaf), layout in zip(jax.tree_util.tree_leaves_with_path(got), layouts):
            assert leaf.sharding.is_equivalent_to(layout, leaf.ndim), (step.__name__, jax.tree_util.keystr(path))
        got = new_state(parallel(got, batches[1]))
        want = state
        for batch in batches:
            want = new_state(jax.jit(step)(want, batch))
        assert_trees_close(got, want)


def test_micro_batches_of_a_gan_step_with_two_gradient_calls_are_refused_with_what_runs():
    """A GAN step: the discriminator's gradient, its update, then the generator's gradient."""
    def gan_step(state, batch):
        def d_loss(d, g):
            fake = jax.lax.stop_gradient(batch["z"] @ g)
            return jnp.mean(jax.nn.softplus(-(batch["x"] @ d))) + jnp.mean(jax.nn.softplus(fake @ d))
        d = state["d"] - 0.1 * al.grad(d_loss)(state["d"], state["g"])
        g = state["g"] - 0.1 * al.grad(lambda g: jnp.mean(jax.nn.softplus(-(batch["z"] @ g @ d))))(state["g"])
        return {"d": d, "g": g}

    state = {"d": jnp.ones((4, 1)), "g": jnp.ones((2, 4))}
    batch = {"z": jnp.ones((16, 2)), "x": jnp.ones((16, 4))}
    with pytest.raises(ValueError, match="found 2; a step with several gradient calls .* num_micro_batches=1"):
        al.parallelize(gan_step, method=al.DataParallel(num_micro_batches=2))(state, batch)
    got = al.parallelize(gan_step, method=al.DataParallel())(state, batch)
    assert_trees_close(got, jax.jit(gan_step)(state, batch))
