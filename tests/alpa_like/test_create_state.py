"""al.CreateStateParallel: the state is born in the train step's layouts, shard by shard."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from tests.helpers import assert_trees_close, make_train_step, mlp_apply, mlp_batch, mlp_loss, reference_on_one_device

SIZES = (16, 64, 8)


def create_state(key=None):
    """A train state made from a random key, as a user's ``TrainState.create(params=model.init(...))``."""
    key = jax.random.key(0) if key is None else key
    keys = jax.random.split(key, len(SIZES) - 1)
    params = {f"dense_{i}": {"kernel": jax.random.normal(k, (a, b)) / np.sqrt(a), "bias": jnp.zeros((b,))}
              for i, (k, a, b) in enumerate(zip(keys, SIZES[:-1], SIZES[1:]))}
    return train_state.TrainState.create(apply_fn=mlp_apply, params=params, tx=optax.adam(1e-2))


def _batch(seed=0):
    return mlp_batch(np.random.default_rng(seed), sizes=SIZES)


PIPELINE = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                stage_option=al.UniformStageOption(num_stages=2))


@pytest.mark.parametrize("method", [al.Zero3Parallel(), al.DataParallel(), al.ShardParallel(), PIPELINE],
                         ids=["zero3", "data", "shard", "pipeshard"])
def test_state_is_created_in_the_train_steps_layouts(method):
    step = al.parallelize(make_train_step(mlp_loss), method=method)
    batch = _batch()
    create = al.parallelize(create_state, method=al.CreateStateParallel(step, batch))
    state = create()
    expected = jax.jit(create_state)()
    assert_trees_close(state, expected, rtol=0, atol=0)  # the same numbers as created on one device
    exe = step.get_executable(state, batch)
    assert create.get_executable().plan is exe.plan  # the plan whose layouts it makes
    wanted = [s for s, leaf in zip(exe.input_shardings(), exe.traced.in_leaves) if leaf.arg_index == 0]
    created = jax.tree.leaves(state)
    assert len(wanted) == len(created)
    for x, sharding in zip(created, wanted):  # the train step takes every leaf as it is: nothing is resharded
        assert sharding is None or x.sharding == sharding, (x.sharding, sharding)
    result, _ = step(state, batch)
    reference, _ = reference_on_one_device(make_train_step(mlp_loss), expected, [batch])
    assert_trees_close(result.params, reference.params)


def test_zero3_puts_an_eighth_of_each_sharded_leaf_on_each_device():
    step = al.parallelize(make_train_step(mlp_loss), method=al.Zero3Parallel())
    create = al.parallelize(create_state, method=al.CreateStateParallel(step, _batch()))
    state = create()
    kernel = state.params["dense_0"]["kernel"]
    for leaf in (kernel, state.opt_state[0].mu["dense_0"]["kernel"], state.opt_state[0].nu["dense_1"]["kernel"]):
        assert [s.data.nbytes for s in leaf.addressable_shards] == [leaf.nbytes // 8] * 8
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    [memory] = create.get_executable().memory_analysis()
    per_device = memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert per_device < total / 2  # no device computes the whole state (an eighth of it, and the scalars)


def test_pipeline_stages_hold_only_their_own_parameters():
    step = al.parallelize(make_train_step(mlp_loss), method=PIPELINE)
    batch = _batch()
    state = al.parallelize(create_state, method=al.CreateStateParallel(step, batch))()
    plan = step.get_executable(state, batch).plan
    meshes = [frozenset(stage.device_ids) for stage in plan.stages]
    for stage, mesh in zip(plan.stages, meshes):
        for tensor in stage.inputs:
            if tensor.role != "param":
                continue
            keys = tensor.path.split(".")[2:]  # state.params.dense_i.kernel
            leaf = state.params[keys[0]][keys[1]]
            assert {d.id for d in leaf.sharding.device_set} <= mesh, tensor.path


def test_create_state_with_a_key_argument_and_bad_input():
    step = al.parallelize(make_train_step(mlp_loss), method=al.DataParallel())
    create = al.parallelize(create_state, method=al.CreateStateParallel(step, _batch()))
    state = create(jax.random.key(3))
    assert_trees_close(state, jax.jit(create_state)(jax.random.key(3)), rtol=0, atol=0)
    with pytest.raises(TypeError, match="train_step must be an al.parallelize-d function"):
        al.CreateStateParallel(make_train_step(mlp_loss), _batch())
    with pytest.raises(ValueError, match="state_argnum must be an int >= 0, got True"):
        al.CreateStateParallel(step, _batch(), state_argnum=True)


def test_create_state_of_another_structure_is_named():
    """create_state returning the parameters alone where the train step takes a TrainState: an error naming
    both structures, not the train step's own failure to read ``state.params``."""
    step = al.parallelize(make_train_step(mlp_loss), method=al.ShardParallel())
    step(create_state(), _batch())
    create = al.parallelize(lambda: create_state().params, method=al.CreateStateParallel(step, _batch()))
    with pytest.raises(ValueError, match="CreateStateParallel: the train step cannot take what create_state "
                                         "returns as its state"):
        create()


def test_al_plan_of_a_create_state_function_points_to_the_train_step():
    step = al.parallelize(make_train_step(mlp_loss), method=al.ShardParallel())
    with pytest.raises(TypeError, match=r"al.plan: CreateStateParallel runs in its train step's plan"):
        al.plan(create_state, method=al.CreateStateParallel(step, _batch()))
