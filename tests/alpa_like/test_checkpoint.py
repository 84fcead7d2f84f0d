"""Checkpoints: round trips, restore into other plans and backends, exact resume in a new process, a save
killed midway, max_to_keep, async saves and bad input."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import alpa_like as al
from alpa_like import checkpoint
from alpa_like.runtime.ray_backend import RemoteArray
from tests.runtime.test_pipeshard_runtime import FOUR, TWO_STAGES, mlp_case, train_step_for

REPO = Path(__file__).resolve().parents[2]
PIPELINE = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(), stage_option=TWO_STAGES)
METHODS = {
    "pipeline_2_stages": PIPELINE,
    "pipeline_4_stages": al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                              stage_option=FOUR),
    "zero3": al.Zero3Parallel(),
    "shard_2x4": al.ShardParallel(auto_sharding_option=al.AutoShardingOption(logical_mesh_shape=(2, 4))),
    "data": al.DataParallel(),
    "data_2_micro_batches": al.DataParallel(num_micro_batches=2),
}


def assert_same_values(actual, expected):
    """Bit-identical leaves and the same pytree structure."""
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree_util.tree_leaves(expected),
                            strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=jax.tree_util.keystr(path))


def expected_shardings(exe):
    """The layout the step takes each state leaf in (what a restore into ``exe`` must give)."""
    layouts = exe.input_shardings()
    return [layouts[k] for k, leaf in enumerate(exe.traced.in_leaves) if leaf.arg_index == 0]


@pytest.fixture(scope="module")
def mlp():
    loss_fn, state, batches = mlp_case()
    return train_step_for(loss_fn), state, batches


@pytest.fixture(scope="module")
def pipeline_checkpoint(mlp, tmp_path_factory):
    """A state after one step of the 2-stage pipeline (each leaf on its stage's mesh), saved as step 1."""
    step, state, batches = mlp
    state1, _ = al.parallelize(step, method=PIPELINE)(state, batches[0])
    directory = tmp_path_factory.mktemp("pipeline_checkpoint")
    al.save_checkpoint(directory, state1, 1)
    return directory, state1


# -------------------------------------------------------------------------------------------- round trips

def mixed_state():
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return {
        "w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8), NamedSharding(mesh, P("x", "y"))),
        "b": jax.device_put(jnp.ones(6, jnp.bfloat16), NamedSharding(mesh, P())),
        "host": np.arange(5, dtype=np.int32),
        "count": 3,
        "key": jax.random.split(jax.random.key(7), 8),
    }


def test_round_trip_into_shardings_and_onto_the_host(tmp_path):
    state = mixed_state()
    path = al.save_checkpoint(tmp_path, state, 5)
    assert path == tmp_path / "step_5" and al.checkpoint_steps(tmp_path) == [5]
    mesh = jax.make_mesh((8,), ("z",), axis_types=(jax.sharding.AxisType.Auto,))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), state)
    like["w"] = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "z")))
    like["key"] = jax.ShapeDtypeStruct((8,), state["key"].dtype, sharding=NamedSharding(mesh, P("z")))
    restored = al.restore_checkpoint(tmp_path, like=like)
    assert restored["w"].sharding == like["w"].sharding
    assert isinstance(restored["host"], np.ndarray) and restored["b"].dtype == ml_dtypes.bfloat16
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(state["key"])
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
    restored["key"], state["key"] = (jax.random.key_data(x) for x in (restored["key"], state["key"]))
    assert_same_values(restored, state)
    on_host = al.restore_checkpoint(tmp_path)  # like=None: nested dicts of NumPy arrays
    assert sorted(on_host) == sorted(state) and isinstance(on_host["w"], np.ndarray)
    np.testing.assert_array_equal(on_host["w"], np.asarray(state["w"]))


def test_plan_is_saved_beside_the_arrays(mlp, tmp_path):
    step, state, batches = mlp
    exe = al.parallelize(step, method=PIPELINE).get_executable(state, batches[0])
    al.save_checkpoint(tmp_path, state, 0, plan=exe.plan)
    text = (tmp_path / "step_0" / "plan.json").read_text()
    assert al.ParallelPlan.from_json(text).to_json() == exe.plan.to_json()
    assert checkpoint.read_plan(tmp_path).to_json() == exe.plan.to_json()
    metadata = json.loads((tmp_path / "step_0" / "checkpoint.json").read_text())
    assert metadata["step"] == 0 and metadata["leaves"][1]["keys"] == ["params", "b0"]


# ---------------------------------------------------------------------------------- restore into other plans

@pytest.mark.parametrize("target", ["zero3", "shard_2x4", "pipeline_4_stages"])
def test_pipeline_checkpoint_restores_into_another_plan(mlp, pipeline_checkpoint, target):
    """Saved by a 2-stage pipeline (each leaf on its stage's 4 devices), restored in the layouts another plan's
    step takes its state in: equal values, and the step's first call moves nothing."""
    step, _, batches = mlp
    directory, saved = pipeline_checkpoint
    f = al.parallelize(step, method=METHODS[target])
    exe = f.get_executable(saved, batches[1])
    restored = al.restore_checkpoint(directory, like=exe)
    assert_same_values(restored, saved)
    for leaf, sharding in zip(jax.tree_util.tree_leaves(restored), expected_shardings(exe), strict=True):
        assert leaf.sharding == sharding
    after_restore, _ = exe(restored, batches[1])
    after_saved, _ = exe(saved, batches[1])
    assert_same_values(after_restore, after_saved)


def test_spmd_checkpoint_restores_into_a_pipeline(mlp, tmp_path):
    step, state, batches = mlp
    state1, _ = al.parallelize(step, method=METHODS["data"])(state, batches[0])
    al.save_checkpoint(tmp_path, state1, 1)
    exe = al.parallelize(step, method=PIPELINE).get_executable(state1, batches[1])
    restored = al.restore_checkpoint(tmp_path, like=exe)
    assert_same_values(restored, state1)
    assert [x.sharding for x in jax.tree_util.tree_leaves(restored)] == expected_shardings(exe)


# ------------------------------------------------------------------------------------ exact resume, kills

RESUME_CHILD = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import alpa_like as al
    from tests.alpa_like.test_checkpoint import METHODS
    from tests.runtime.test_pipeshard_runtime import mlp_case, train_step_for

    source, target, method, first, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    loss_fn, state, batches = mlp_case()
    f = al.parallelize(train_step_for(loss_fn), method=METHODS[method])
    state = al.restore_checkpoint(source, like=f.get_executable(state, batches[0]))
    for i in range(first, first + count):
        state, _ = f(state, batches[i % len(batches)])
    al.save_checkpoint(target, state, first + count)
""")


def run_child(script: str, *args, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.parametrize("method", ["data_2_micro_batches", "pipeline_2_stages"])
def test_resume_in_a_new_process_is_exact(mlp, tmp_path, method):
    """N steps, save; a new process restores and runs M more: bit-identical to N + M uninterrupted steps."""
    step, state, batches = mlp
    f = al.parallelize(step, method=METHODS[method])
    n, m = 2, 2
    for i in range(n):
        state, _ = f(state, batches[i % len(batches)])
    al.save_checkpoint(tmp_path / "first", state, n)
    for i in range(n, n + m):
        state, _ = f(state, batches[i % len(batches)])
    child = run_child(RESUME_CHILD, tmp_path / "first", tmp_path / "resumed", method, n, m)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    resumed = al.restore_checkpoint(tmp_path / "resumed", like=f.get_executable(state, batches[0]))
    assert int(resumed.step) == n + m
    assert_same_values(resumed, state)


KILL_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    import alpa_like as al
    from alpa_like import checkpoint
    from alpa_like.runtime import checkpoint_io

    directory, where = sys.argv[1], sys.argv[2]

    def state(step):
        return {"big": np.full((4, 1024, 1024), step, np.float32), "step": np.int32(step)}

    al.save_checkpoint(directory, state(1), 1)
    al.save_checkpoint(directory, state(2), 2)

    def signal_and_hang(*args, **kwargs):
        print("inside the save", flush=True)
        time.sleep(600)

    if where == "writing":  # the array files are being written in the background
        checkpoint_io.PendingWrite.wait = signal_and_hang
    else:  # everything written, the step directory not yet renamed
        checkpoint._commit = signal_and_hang
    al.save_checkpoint(directory, state(3), 3)
""")


@pytest.mark.parametrize("where", ["writing", "committing"])
def test_a_save_killed_midway_leaves_every_earlier_checkpoint(tmp_path, where):
    child = run_child(KILL_CHILD, tmp_path, where)
    line = child.stdout.readline()
    if line.strip() != "inside the save":
        child.kill()
        pytest.fail(f"the child did not reach the save: {line!r} {child.communicate()[1]}")
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    assert al.checkpoint_steps(tmp_path) == [1, 2]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step_3")]
    assert len(leftovers) == 1
    for step in (1, 2):
        restored = al.restore_checkpoint(tmp_path, step=step)
        assert restored["step"] == step and np.all(restored["big"] == step)
    assert al.restore_checkpoint(tmp_path)["step"] == 2  # the latest committed one
    al.save_checkpoint(tmp_path, {"big": np.zeros(2), "step": np.int32(3)}, 3)  # clears the dead save's files
    assert al.checkpoint_steps(tmp_path) == [1, 2, 3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ------------------------------------------------------------------------------------- max_to_keep, async

def test_max_to_keep_deletes_the_oldest_after_a_commit(tmp_path):
    for step in range(1, 5):
        al.save_checkpoint(tmp_path, {"x": np.full(3, step)}, step, max_to_keep=2)
    assert al.checkpoint_steps(tmp_path) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    np.testing.assert_array_equal(al.restore_checkpoint(tmp_path)["x"], [4, 4, 4])


def test_async_save_copies_the_arrays_before_it_returns(tmp_path):
    x = jax.device_put(jnp.arange(16.0), jax.devices()[0])
    pending = al.save_checkpoint(tmp_path, {"x": x}, 1, async_save=True)
    assert isinstance(pending, checkpoint.AsyncSave)
    x.delete()  # e.g. donated to the next step
    second = al.save_checkpoint(tmp_path, {"x": np.ones(2)}, 2, async_save=True, max_to_keep=2)
    assert pending.done()  # the second save waited for the first
    assert second.wait() == tmp_path / "step_2" and pending.wait() == tmp_path / "step_1"
    np.testing.assert_array_equal(al.restore_checkpoint(tmp_path, step=1)["x"], np.arange(16.0))


def test_async_save_error_comes_from_wait(tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint, "_commit", fail)
    pending = al.save_checkpoint(tmp_path, {"x": np.ones(2)}, 1, async_save=True)
    with pytest.raises(OSError, match="disk full"):
        pending.wait()
    assert al.checkpoint_steps(tmp_path) == [] and not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------- bad input

def test_restore_into_another_shape_names_the_leaf(tmp_path):
    al.save_checkpoint(tmp_path, {"params": {"w": np.ones((4, 8), np.float32)}}, 1)
    like = {"params": {"w": jax.ShapeDtypeStruct((4, 16), jnp.float32)}}
    with pytest.raises(ValueError, match=r"leaf params\.w: saved shape \(4, 8\) float32, wanted shape \(4, 16\) "
                                         r"float32"):
        al.restore_checkpoint(tmp_path, like=like)


@pytest.mark.parametrize("like,message", [
    ({"params": {"v": jax.ShapeDtypeStruct((4, 8), jnp.float32)}},
     r"leaf 0 is params\.w \(4, 8\) float32 in the checkpoint but params\.v \(4, 8\) float32 in the state"),
    ({"params": {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32), "z": jax.ShapeDtypeStruct((2,), jnp.float32)}},
     r"it has 1 leaves; the state's leaf params\.z \(2,\) float32 is not in it"),
    ({}, r"the state has 0 leaves; the checkpoint's leaf params\.w \(4, 8\) float32 is not in it"),
    ({"params": {"w": jax.ShapeDtypeStruct((4, 8), jnp.int32)}}, r"saved shape \(4, 8\) float32, wanted shape"),
])
def test_restore_into_another_structure_names_the_first_leaf_that_differs(tmp_path, like, message):
    al.save_checkpoint(tmp_path, {"params": {"w": np.ones((4, 8), np.float32)}}, 1)
    with pytest.raises(ValueError, match=message):
        al.restore_checkpoint(tmp_path, like=like)


def test_missing_or_partial_checkpoints_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no checkpoint directory {tmp_path / 'none'}"):
        al.restore_checkpoint(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="holds no committed checkpoint"):
        al.restore_checkpoint(tmp_path)
    al.save_checkpoint(tmp_path, {"x": np.ones(2)}, 1)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 7 \(committed steps: \[1\]\)"):
        al.restore_checkpoint(tmp_path, step=7)
    with pytest.raises(ValueError, match="is one step's checkpoint; pass the directory that holds the steps"):
        al.restore_checkpoint(tmp_path / "step_1")
    os.remove(tmp_path / "step_1" / "arrays" / "_CHECKPOINT_METADATA")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'step_1'} is not a complete checkpoint: its part arrays/"):
        al.restore_checkpoint(tmp_path)
    (tmp_path / "step_2").mkdir()
    with pytest.raises(ValueError, match=rf"{tmp_path / 'step_2'} is not a complete checkpoint: cannot read "
                                         "checkpoint.json"):
        al.restore_checkpoint(tmp_path)


def test_a_saved_step_is_never_overwritten(tmp_path):
    al.save_checkpoint(tmp_path, {"x": np.ones(2)}, 1)
    with pytest.raises(ValueError, match="step_1 already exists: a checkpoint is never overwritten"):
        al.save_checkpoint(tmp_path, {"x": np.zeros(2)}, 1)
    np.testing.assert_array_equal(al.restore_checkpoint(tmp_path)["x"], np.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_saving_a_remote_array_of_a_shut_down_backend_says_so(tmp_path):
    closed = types.SimpleNamespace(closed=True)
    state = {"w": RemoteArray((2,), np.float32, replicas=(), cluster=closed)}
    with pytest.raises(ValueError, match="state leaf w is a RemoteArray of a Ray backend that was shut down"):
        al.save_checkpoint(tmp_path, state, 1)
    assert not list(tmp_path.iterdir())


def test_saving_a_deleted_array_says_so(tmp_path):
    """A state donated to a step is refused before any file is written (orbax's writer, started on it, failed
    and left a thread that kept the process from exiting)."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("x")))
    w.delete()
    with pytest.raises(ValueError, match="state leaf w is a deleted array"):
        al.save_checkpoint(tmp_path, {"w": w, "step": jnp.int32(3)}, 1)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("call,error,message", [
    (lambda d: al.save_checkpoint(d, {}, True), TypeError, "step must be an int >= 0, got True"),
    (lambda d: al.save_checkpoint(d, {}, -1), TypeError, "step must be an int >= 0, got -1"),
    (lambda d: al.save_checkpoint(d, {}, 1, max_to_keep=0), ValueError, "max_to_keep must be an int >= 1"),
    (lambda d: al.save_checkpoint(d, {}, 1, plan="plan"), TypeError, "plan must be an al.ParallelPlan"),
    (lambda d: al.save_checkpoint(d, {"a": "text"}, 1), TypeError, "state leaf a must be an array"),
    (lambda d: al.save_checkpoint(3, {}, 1), TypeError, "directory must be a path"),
    (lambda d: al.restore_checkpoint(d, like={"x": "text"}), TypeError, "its leaf x is a str"),
    (lambda d: al.restore_checkpoint(d, like=al.parallelize(lambda s, b: s)), TypeError,
     r"like is the parallelized function; pass its executable"),
])
def test_bad_arguments(tmp_path, call, error, message):
    al.save_checkpoint(tmp_path / "ok", {"x": np.ones(2)}, 1)
    with pytest.raises(error, match=message):
        call(tmp_path / "ok")


def test_bad_argnum_names_the_array_arguments(mlp, tmp_path, pipeline_checkpoint):
    step, state, batches = mlp
    exe = al.parallelize(step, method=METHODS["data"]).get_executable(state, batches[0])
    with pytest.raises(ValueError, match=r"argnum must be one of the executable's array arguments \[0, 1\], got 2"):
        al.restore_checkpoint(pipeline_checkpoint[0], like=exe, argnum=2)


# -------------------------------------------------------------------------------------------------- Ray

@pytest.mark.ray
def test_ray_checkpoints_are_written_by_the_workers_and_restore_anywhere(ray_session, mlp, pipeline_checkpoint,
                                                                         tmp_path):
    """A Ray step's state is saved by the workers holding it (one part each) and restored locally into
    Zero3Parallel's layouts; a local pipeline's checkpoint restores onto the Ray workers that load it."""
    step, state, batches = mlp
    directory, saved = pipeline_checkpoint
    al.init(cluster="ray", num_nodes=1, num_devices_per_node=8)
    try:
        f = al.parallelize(step, method=PIPELINE)
        exe = f.get_executable(saved, batches[1])
        on_workers = al.restore_checkpoint(directory, like=exe)
        leaves = jax.tree_util.tree_leaves(on_workers)
        assert all(isinstance(x, RemoteArray) for x in leaves) and {len(x.replicas) for x in leaves} == {1}
        assert_same_values(jax.tree.map(np.asarray, on_workers), saved)
        state2, _ = f(on_workers, batches[1])
        assert exe.last_step.inputs_by_kind["ref"] == len(jax.tree_util.tree_leaves(batches[1]))
        al.save_checkpoint(tmp_path, state2, 2)
        parts = sorted(p.name for p in (tmp_path / "step_2").iterdir() if p.is_dir())
        assert parts == ["worker_0", "worker_1"]
        fetched = jax.tree.map(np.asarray, state2)
    finally:
        al.shutdown()
    with pytest.raises(ValueError, match="RemoteArray of a Ray backend that was shut down"):
        al.save_checkpoint(tmp_path, state2, 3)
    al.init("local")
    exe = al.parallelize(step, method=METHODS["zero3"]).get_executable(saved, batches[1])
    restored = al.restore_checkpoint(tmp_path, like=exe)
    assert_same_values(restored, fetched)
    assert [x.sharding for x in jax.tree_util.tree_leaves(restored)] == expected_shardings(exe)
