"""A call of a parallelized SPMD step whose arguments already have the compiled signature and layouts goes
through JAX's own call path (no Python work per leaf); anything else takes the checked path."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import alpa_like as al
from alpa_like.compiler.trace import TracedStep
from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state


@pytest.fixture
def counted(monkeypatch):
    """How many calls flattened and checked their arguments leaf by leaf."""
    calls = []
    original = TracedStep.flatten_args
    monkeypatch.setattr(TracedStep, "flatten_args", lambda self, args: calls.append(1) or original(self, args))
    return calls


@pytest.mark.parametrize("method", [al.DataParallel(), al.Zero3Parallel(num_micro_batches=2), al.ShardParallel()],
                         ids=["data", "zero3", "shard"])
def test_laid_out_arguments_take_jaxs_call_path(method, counted):
    step = al.parallelize(make_train_step(mlp_loss), method=method, donate_argnums=(0,))
    state, batch = mlp_state(), mlp_batch(np.random.default_rng(0))
    state, _ = step(state, batch)  # host arrays and a Python int: the checked path lays them out
    checked = len(counted)
    for seed in range(1, 4):
        state, metrics = step(state, mlp_batch(np.random.default_rng(seed)))
    assert len(counted) == checked  # the state came back in its layout: no per-leaf work
    assert np.isfinite(float(metrics["loss"]))


def test_other_shapes_layouts_and_static_values_still_take_effect(counted):
    def scaled(state, batch, scale):
        loss, grads = al.value_and_grad(lambda p, b: scale * mlp_loss(p, b))(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    step = al.parallelize(scaled, method=al.DataParallel(), static_argnums=(2,))
    state, batch = mlp_state(), mlp_batch(np.random.default_rng(0))
    state, _ = step(state, batch, 1.0)
    _, loss1 = step(state, batch, 1.0)
    _, loss2 = step(state, batch, 2.0)  # a new static value: its own executable
    np.testing.assert_allclose(float(loss2), 2 * float(loss1), rtol=1e-6)
    _, loss_small = step(state, mlp_batch(np.random.default_rng(0), batch_size=16), 1.0)  # a new shape
    assert step.num_compilations == 3 and np.isfinite(float(loss_small))
    elsewhere = jax.device_put(state, NamedSharding(jax.make_mesh((8,), ("d",)), PartitionSpec()))
    elsewhere = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[3]), elsewhere)
    _, loss = step(elsewhere, batch, 1.0)  # committed to another layout: moved, then run
    np.testing.assert_allclose(float(loss), float(loss1), rtol=1e-6)
