"""A step is planned and compiled from shapes (``jax.ShapeDtypeStruct`` pytrees) and then runs on arrays."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_like as al
from tests.helpers import (assert_trees_close, make_train_step, mlp_batch, mlp_loss, mlp_state,
                           reference_on_one_device, run_steps)

METHODS = [al.DataParallel(num_micro_batches=2), al.Zero2Parallel(), al.Zero3Parallel(), al.ShardParallel(),
           al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                stage_option=al.UniformStageOption(num_stages=2))]
IDS = ["data", "zero2", "zero3", "shard", "pipeshard"]


def shapes_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_executable_from_shapes_runs_on_arrays(method):
    state = mlp_state(tx=optax.sgd(0.1))
    batches = [mlp_batch(np.random.default_rng(k)) for k in range(2)]
    step = al.parallelize(make_train_step(mlp_loss), method=method)
    exe = step.get_executable(shapes_of(state), shapes_of(batches[0]))
    assert step.get_executable(state, batches[0]) is exe  # the same signature: one compilation
    result, _ = run_steps(exe, state, batches)
    expected, _ = reference_on_one_device(make_train_step(mlp_loss), state, batches)
    assert_trees_close(result.params, expected.params)
    with pytest.raises(TypeError, match=r"argument leaf batch\.x is a jax\.ShapeDtypeStruct: running a step "
                                        r"needs arrays"):
        exe(state, {**batches[0], "x": jax.ShapeDtypeStruct((32, 16), jnp.float32)})
