"""A pipeline step's outputs: metrics come back on one mesh (usable together), donated inputs are donated."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_like as al
from tests.helpers import assert_trees_close, mlp_batch, mlp_loss, mlp_state, reference_on_one_device, run_steps

PIPELINE = dict(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                stage_option=al.UniformStageOption(num_stages=2))


def step_with_metrics(state, batch):
    """Metrics made on different meshes: the loss on the last stage's, a weight norm on the first's."""
    loss, grads = al.value_and_grad(mlp_loss)(state.params, batch)
    state = state.apply_gradients(grads=grads)
    return state, {"loss": loss, "w0": jnp.sum(state.params["dense_0"]["kernel"] ** 2),
                   "b1": jnp.sum(state.params["dense_1"]["bias"])}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_metrics_come_back_on_one_mesh(schedule):
    state = mlp_state(tx=optax.sgd(0.1))
    batches = [mlp_batch(np.random.default_rng(k)) for k in range(2)]
    step = al.parallelize(step_with_metrics, method=al.PipeshardParallel(pipeline_schedule=schedule, **PIPELINE))
    result, metrics = run_steps(step, state, batches)
    expected, expected_metrics = reference_on_one_device(step_with_metrics, state, batches)
    assert_trees_close(result.params, expected.params)
    devices = {frozenset(m.sharding.device_set) for m in jax.tree.leaves(metrics[-1])}
    assert len(devices) == 1
    combined = metrics[-1]["loss"] / metrics[-1]["w0"] + metrics[-1]["b1"]  # no cross-mesh device error
    np.testing.assert_allclose(combined, expected_metrics[-1]["loss"] / expected_metrics[-1]["w0"]
                               + expected_metrics[-1]["b1"], rtol=1e-5)
    # the state stays where its stages hold it: the updated kernels of the two stages on disjoint meshes
    first, last = (result.params[f"dense_{i}"]["kernel"].sharding.device_set for i in (0, 1))
    assert not first & last


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_donated_state_is_consumed_by_a_pipeline_step(schedule):
    state = mlp_state()
    batches = [mlp_batch(np.random.default_rng(k)) for k in range(3)]
    method = al.PipeshardParallel(pipeline_schedule=schedule, **PIPELINE)
    donating = al.parallelize(step_with_metrics, method=method, donate_argnums=(0,))
    keeping = al.parallelize(step_with_metrics, method=method)
    kept, _ = run_steps(keeping, state, batches)
    state = donating(state, batches[0])[0]  # its inputs now sit on their meshes, in the step's layouts
    old = state
    state, _ = donating(state, batches[1])
    exe = donating.get_executable(state, batches[2])
    assert exe.last_step.donated_buffers > keeping.get_executable(state, batches[2]).last_step.donated_buffers
    # the update of each input is made in the layout the input is loaded in, so XLA reuses every buffer
    assert all(x.is_deleted() for x in jax.tree.leaves((old.params, old.opt_state)) if isinstance(x, jax.Array))
    state, _ = donating(state, batches[2])
    assert_trees_close(state.params, kept.params, rtol=0, atol=0)
    assert_trees_close(state.opt_state, kept.opt_state, rtol=0, atol=0)
