"""al.CreateStateParallel and al.FollowParallel on the Ray backend: the state is made on the workers in the
train step's LOAD layouts, and an eval step reads it there.

The tests use the session's local Ray (``ray_session``) and one 1 node x 4 device Ray backend for the module:
the 4-layer MLP's two stages on two meshes of two devices, one worker actor each.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.runtime.ray_backend import RemoteArray
from tests.helpers import assert_trees_close, reference_on_one_device
from tests.runtime.test_pipeshard_runtime import mlp_case, mlp_loss, train_step_for
from tests.runtime.test_ray_backend import init_ray, method_for

pytestmark = pytest.mark.ray

METHOD = method_for("2_meshes", manual=True)


@pytest.fixture(scope="module")
def ray_backend_4(ray_session, tmp_path_factory):
    init_ray(str(tmp_path_factory.mktemp("xla_cache")))
    yield
    al.shutdown()


def create_state(key):
    """The pipeline tests' MLP state, its weights drawn from ``key`` (a user's ``model.init(key)``)."""
    params = {}
    for i, k in enumerate(jax.random.split(key, 4)):
        params[f"w{i}"] = jax.random.normal(k, (16, 16)) / 4
        params[f"b{i}"] = jnp.zeros((16,))
    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))


def eval_step(state, batch):
    """The MLP's forward pass (no pipeline markers: the train step's plan places it)."""
    x = batch["x"]
    for i in range(4):
        x = jnp.tanh(x @ state.params[f"w{i}"] + state.params[f"b{i}"])
    return {"loss": jnp.mean((x - batch["y"]) ** 2), "out": x}


def state_routes(exe):
    """How each mesh that loads a state leaf got it in the executable's last step."""
    routes = exe.last_step.input_routes
    return {routes[k] for k, leaf in enumerate(exe.traced.in_leaves) if leaf.arg_index == 0 and k in routes}


def test_state_is_created_on_the_workers_and_taken_in_place(ray_backend_4):
    _, _, batches = mlp_case()
    step = al.parallelize(train_step_for(mlp_loss), method=METHOD)
    create = al.parallelize(create_state, method=al.CreateStateParallel(step, batches[0]))
    key = jax.random.key(3)
    state = create(key)
    leaves = jax.tree.leaves(state)
    assert all(isinstance(x, RemoteArray) and x._value is None for x in leaves)  # the driver holds no value
    exe = step.get_executable(state, batches[0])
    assert create.get_executable(key).plan is exe.plan  # the plan whose layouts it makes
    placements = [p for p, leaf in zip(exe.input_placements(), exe.traced.in_leaves) if leaf.arg_index == 0]
    assert [len(x.replicas) for x in leaves] == [max(1, len(p)) for p in placements]  # on each loading mesh
    result, loss = step(state, batches[0])
    stats = exe.last_step
    assert state_routes(exe) <= {("handle",), ("handle", "handle")}  # no state leaf sent by the driver or a peer
    assert stats.input_relayouts == 0 and stats.input_bytes == 0  # each LOAD found its leaf in its layout
    expected = jax.jit(create_state)(key)
    assert_trees_close(state, expected, rtol=0, atol=0)  # the numbers of the one-device create_state
    reference, reference_loss = reference_on_one_device(train_step_for(mlp_loss), expected, batches[:1])
    assert_trees_close(result.params, reference.params)
    np.testing.assert_allclose(loss, reference_loss[0], rtol=1e-5)
    with pytest.raises(TypeError, match="create_state's argument leaf 0 is a jax.ShapeDtypeStruct"):
        create(jax.ShapeDtypeStruct((), key.dtype))
    with pytest.raises(ValueError, match=r"create_state's argument leaf 0 has shape \(2,\) key<fry>; it was "
                                         r"compiled for \(\) key<fry>"):
        create.get_executable(key)(jax.random.split(key))


def test_a_state_made_in_other_layouts_is_laid_out_again_by_the_load(ray_backend_4):
    """The counter the test above reads: leaves made replicated where the plan shards them are counted."""
    _, _, batches = mlp_case()
    step = al.parallelize(train_step_for(mlp_loss), method=METHOD)
    create = al.parallelize(create_state, method=al.CreateStateParallel(step, batches[0])).get_executable(
        jax.random.key(0))
    meshes = create.train_executable.meshes
    sharded = sum(spec.num_shards(meshes[m].logical_shape) > 1 for placed in create.placements
                  for m, spec in placed.items())
    assert sharded > 0  # the plan shards some state leaves (a LOAD of each counts)
    create.placements = [{m: spec.replicated(spec.ndim) for m, spec in placed.items()}
                         for placed in create.placements]
    state = create(jax.random.key(0))
    step(state, batches[0])
    assert step.get_executable(state, batches[0]).last_step.input_relayouts == sharded


def test_eval_step_reads_the_state_where_it_lives(ray_backend_4):
    _, _, batches = mlp_case()
    step = al.parallelize(train_step_for(mlp_loss), method=METHOD)
    state = al.parallelize(create_state, method=al.CreateStateParallel(step, batches[0]))(jax.random.key(1))
    state, _ = step(state, batches[0])
    evaluate = al.parallelize(eval_step, method=al.FollowParallel(step, batches[0]))
    metrics = evaluate(state, batches[1])
    exe = evaluate.get_executable(state, batches[1])
    assert [piece.mesh for piece in exe.pieces] == [0, 1]  # forward only, one piece per train mesh
    assert exe.moved_state_leaves == 0 and state_routes(exe) == {("handle",)}
    assert exe.plan is step.get_executable(state, batches[0]).plan
    assert exe.last_step.worker_bytes > 0  # the activation went worker to worker
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(metrics))
    host_state = jax.tree.map(np.asarray, state)
    expected = jax.jit(eval_step)(host_state, batches[1])
    assert_trees_close(metrics, expected)
    state, _ = step(state, batches[1])  # the train step still takes its state in place
    assert state_routes(step.get_executable(state, batches[1])) <= {("handle",), ("handle", "handle")}
    metrics = evaluate(jax.tree.map(np.asarray, state), batches[2])  # a driver state: every read leaf is sent
    assert exe.moved_state_leaves == len(jax.tree.leaves(state.params))
    assert_trees_close(metrics, jax.jit(eval_step)(jax.tree.map(np.asarray, state), batches[2]))
