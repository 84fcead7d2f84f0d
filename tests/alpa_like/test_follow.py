"""al.FollowParallel: an eval step reads the train step's state in its layouts, forward only."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_like as al
from tests.helpers import assert_trees_close, make_train_step, mlp_apply, mlp_batch, mlp_loss, mlp_state

PIPELINE = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                stage_option=al.UniformStageOption(num_stages=2))


def eval_step(state, batch):
    logits = mlp_apply(state.params, batch["x"])
    return {"loss": jnp.mean((logits - batch["y"]) ** 2), "logits": logits,
            "count": jnp.asarray(batch["x"].shape[0], jnp.float32)}


@pytest.mark.parametrize("method", [al.DataParallel(), al.Zero3Parallel(), al.ShardParallel(), PIPELINE],
                         ids=["data", "zero3", "shard", "pipeshard"])
def test_eval_step_follows_the_train_steps_layouts(method):
    state = mlp_state(tx=optax.sgd(0.1))
    batch, eval_batch = mlp_batch(np.random.default_rng(0)), mlp_batch(np.random.default_rng(1), batch_size=8)
    train_step = al.parallelize(make_train_step(mlp_loss), method=method)
    state, _ = train_step(state, batch)
    evaluate = al.parallelize(eval_step, method=al.FollowParallel(train_step, batch))
    metrics = evaluate(state, eval_batch)
    expected = jax.jit(eval_step)(jax.device_put(state, jax.devices()[0]), eval_batch)
    assert_trees_close(metrics, expected)
    exe = evaluate.get_executable(state, eval_batch)
    assert exe.moved_state_leaves == 0  # every parameter read where the train step keeps it
    assert exe.plan is train_step.get_executable(state, batch).plan  # the plan whose layouts it reads
    assert float(metrics["loss"] / metrics["count"]) == pytest.approx(float(expected["loss"]) / 8, rel=1e-5)
    state, _ = train_step(state, batch)  # the train step still takes its state as it is
    assert_trees_close(evaluate(state, eval_batch)["loss"],
                       jax.jit(eval_step)(jax.device_put(state, jax.devices()[0]), eval_batch)["loss"])


def test_pipeline_eval_runs_one_piece_per_stage_mesh():
    state = mlp_state(tx=optax.sgd(0.1))
    batch = mlp_batch(np.random.default_rng(0))
    train_step = al.parallelize(make_train_step(mlp_loss), method=PIPELINE)
    state, _ = train_step(state, batch)
    exe = al.parallelize(eval_step, method=al.FollowParallel(train_step)).get_executable(state, batch)
    assert [piece.mesh for piece in exe.pieces] == [0, 1]


def test_follow_parallel_bad_input():
    with pytest.raises(TypeError, match="FollowParallel: train_step must be an al.parallelize-d function"):
        al.FollowParallel(eval_step)
    train_step = al.parallelize(make_train_step(mlp_loss))
    state = mlp_state()
    with pytest.raises(ValueError, match="the train step has 0 compiled executables; pass its batch"):
        al.parallelize(eval_step, method=al.FollowParallel(train_step))(state, mlp_batch(np.random.default_rng(0)))


@pytest.mark.parametrize("method", [al.ShardParallel(), PIPELINE], ids=["shard", "pipeshard"])
def test_follow_parallel_names_a_state_of_another_structure(method):
    """An eval step given the parameters where the train step takes the whole state: an error naming both
    structures, not the train step's own failure to read ``state.params`` from a dict."""
    batch = mlp_batch(np.random.default_rng(0))
    train_step = al.parallelize(make_train_step(mlp_loss), method=method)
    state, _ = train_step(mlp_state(tx=optax.sgd(0.1)), batch)
    evaluate = al.parallelize(lambda params, batch: mlp_loss(params, batch),
                              method=al.FollowParallel(train_step, batch))
    with pytest.raises(ValueError, match=r"FollowParallel: the train step cannot take the eval step's state "
                                         r"argument as its state \(argument 0\): it has pytree structure"):
        evaluate(state.params, batch)


@pytest.mark.parametrize("method", [al.ShardParallel(), PIPELINE], ids=["shard", "pipeshard"])
def test_eval_of_a_donated_state_names_the_leaf(method):
    batch = mlp_batch(np.random.default_rng(0))
    train_step = al.parallelize(make_train_step(mlp_loss), method=method, donate_argnums=(0,))
    state, _ = train_step(mlp_state(tx=optax.sgd(0.1)), batch)
    evaluate = al.parallelize(eval_step, method=al.FollowParallel(train_step, batch))
    train_step(state, batch)  # donates state
    with pytest.raises(ValueError, match=r"step input state\.\S+ is a deleted array \(donated to or deleted"):
        evaluate(state, batch)
