"""Train steps written with libraries other than the bundled models, as their users write them, against jax.jit
on one device: Flax NNX models (``nnx.split`` / ``nnx.merge`` in a pure step, ``nnx.Optimizer``), and the state
such steps carry besides parameters (random-number streams, counters, running statistics) through a pipeline.
Parameters are compared after two SGD steps (see tests/helpers.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_like as al
from tests.helpers import assert_trees_close, mlp_apply, mlp_batch, mlp_params, reference_on_one_device, run_steps

nnx = pytest.importorskip("flax.nnx")

SIZES = (16, 32, 32, 8)


def _pipeline(num_micro_batches: int) -> al.PipeshardParallel:
    return al.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option=al.AutoLayerOption(layer_num=2),
                                stage_option=al.UniformStageOption(num_stages=2))


def _batches(rng):
    return [mlp_batch(rng, 32, sizes=SIZES) for _ in range(2)]


def _plain(tree):
    """``tree`` with typed keys as their raw bits, for comparing."""
    def raw(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return jax.tree.map(raw, tree)


def _compare(step, state, batches, method):
    got, got_out = run_steps(al.parallelize(step, method=method), state, batches)
    want, want_out = reference_on_one_device(step, state, batches)
    assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, want)
    assert_trees_close(_plain(got), _plain(want))
    assert_trees_close(got_out, want_out)


class _NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(SIZES[0], SIZES[1], rngs=rngs)
        self.norm = nnx.LayerNorm(SIZES[1], rngs=rngs)
        self.l2 = nnx.Linear(SIZES[1], SIZES[2], rngs=rngs)
        self.l3 = nnx.Linear(SIZES[2], SIZES[3], rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.l2(jax.nn.relu(self.norm(self.l1(x)))))
        return self.l3(x)


def _nnx_step(graphdef, tx):
    """The NNX way without nnx transforms: the model merged from its parameter state inside the loss."""
    def loss_fn(params, batch):
        return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

    def step(state, batch):
        params, opt_state = state
        loss, grads = al.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


@pytest.mark.parametrize("method", [al.ShardParallel(num_micro_batches=2), al.Zero2Parallel()],
                         ids=["shard", "zero2"])
def test_nnx_split_merge_step(method):
    graphdef, params = nnx.split(_NNXNet(nnx.Rngs(0)), nnx.Param)
    tx = optax.sgd(0.1)
    _compare(_nnx_step(graphdef, tx), (params, tx.init(params)), _batches(np.random.default_rng(0)), method)


def test_nnx_optimizer_in_a_pipeline():
    """``nnx.Optimizer`` updated inside a pure step; the model's random-number stream is carried, unread."""
    model = _NNXNet(nnx.Rngs(0))
    model.rngs = nnx.Rngs(dropout=1)  # a stream the step does not draw from: returned as it is
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        inner, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params):
            return jnp.mean((nnx.merge(inner, params, rest)(batch["x"]) - batch["y"]) ** 2)
        loss, grads = al.value_and_grad(loss_fn)(params)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    _compare(step, state, _batches(np.random.default_rng(1)), _pipeline(2))


def _step_with_extra(loss_fn):
    """A step over ``(params, extra)``: ``loss_fn(params, extra, batch) -> (loss, new extra)``, SGD."""
    def step(state, batch):
        params, extra = state
        (loss, extra), grads = al.value_and_grad(loss_fn, has_aux=True)(params, extra, batch)
        return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), extra), loss
    return step


def _mse(params, batch):
    return jnp.mean((mlp_apply(params, batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("extra", [jnp.ones(3), jax.random.key(0)], ids=["float", "key"])
def test_pipeline_returns_an_unread_state_leaf_as_it_is(extra):
    def step(state, batch):
        params, extra = state
        loss, grads = al.value_and_grad(_mse)(params, batch)
        return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), extra), loss

    rng = np.random.default_rng(2)
    _compare(step, (mlp_params(rng, SIZES), extra), _batches(rng), _pipeline(2))


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_pipeline_grad_aux_that_is_a_step_input(num_micro_batches):
    """al.value_and_grad's aux is a leaf of the state as it came in (NNX's unchanged random-number key)."""
    rng = np.random.default_rng(3)
    step = _step_with_extra(lambda params, extra, batch: (_mse(params, batch) * extra[0], extra))
    _compare(step, (mlp_params(rng, SIZES), jnp.ones(3)), _batches(rng), _pipeline(num_micro_batches))


def test_pipeline_grad_aux_that_is_a_closed_over_constant():
    """al.value_and_grad's aux is an array the step closes over, returned as it is."""
    table = jnp.arange(6.0).reshape(2, 3)

    def step(params, batch):
        (loss, aux), grads = al.value_and_grad(lambda p, b: (_mse(p, b), table), has_aux=True)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss, "aux": aux}

    rng = np.random.default_rng(5)
    _compare(step, mlp_params(rng, SIZES), _batches(rng), _pipeline(2))


@pytest.mark.parametrize("extra", [jnp.int32(0), jax.random.key(0)], ids=["count", "key"])
def test_pipeline_single_micro_batch_grad_aux_keeps_its_dtype(extra):
    """With one micro-batch al.grad's aux is returned as it is: an integer count stays one, a key splits."""
    def loss_fn(params, extra, batch):
        if jnp.issubdtype(extra.dtype, jnp.integer):
            return _mse(params, batch), extra + 1
        return _mse(params, batch), jax.random.split(extra)[0]

    rng = np.random.default_rng(4)
    _compare(_step_with_extra(loss_fn), (mlp_params(rng, SIZES), extra), _batches(rng), _pipeline(1))
