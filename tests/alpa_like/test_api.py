"""parallelize: caching per signature, static and donated arguments, pytrees, bad input, init/shutdown."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_like as al
from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state


@pytest.fixture
def args():
    return mlp_state(), mlp_batch(np.random.default_rng(0))


def test_compiles_once_per_signature_and_recompiles_on_a_new_batch_shape(args):
    state, batch = args
    f = al.parallelize(make_train_step(mlp_loss))
    state, _ = f(state, batch)
    state, _ = f(state, mlp_batch(np.random.default_rng(1)))
    assert f.num_compilations == 1
    state, _ = f(state, mlp_batch(np.random.default_rng(2), batch_size=64))
    assert f.num_compilations == 2
    assert f.get_executable(state, batch) is f.get_executable(state, batch)


def test_static_argument_is_compiled_in_and_keys_the_cache():
    def scaled_loss(params, batch, scale):
        return scale * mlp_loss(params, batch)

    def step(state, batch, scale):
        loss, grads = al.value_and_grad(scaled_loss)(state.params, batch, scale)
        return state.apply_gradients(grads=grads), loss

    state, batch = mlp_state(), mlp_batch(np.random.default_rng(0))
    f = al.parallelize(step, static_argnums=(2,))
    _, loss1 = f(state, batch, 1.0)
    _, loss2 = f(state, batch, 2.0)
    np.testing.assert_allclose(float(loss2), 2 * float(loss1), rtol=1e-6)
    assert f.num_compilations == 2
    with pytest.raises(TypeError, match=r"static argument 2 \(scale\) must be hashable"):
        f(state, batch, [1.0])


def test_donated_state_is_consumed(args):
    state, batch = args
    state = jax.device_put(state, jax.devices()[0])
    f = al.parallelize(make_train_step(mlp_loss), donate_argnums=(0,))
    state = jax.tree.map(lambda x: x, state)
    kernel = state.params["dense_0"]["kernel"]
    # The first call reshards the single-device input (a copy, which is donated); the second call donates
    # the step's own replicated output, which must then be deleted.
    state, _ = f(state, batch)
    kernel = state.params["dense_0"]["kernel"]
    new_state, _ = f(state, batch)
    assert kernel.is_deleted()
    assert not new_state.params["dense_0"]["kernel"].is_deleted()


@pytest.mark.parametrize("method", [al.DataParallel(), al.ShardParallel()], ids=["data", "shard"])
def test_a_donated_state_passed_again_is_named(args, method):
    """The step's own output, donated to a call, passed again: an error naming a leaf (XLA's CPU client
    crashed the process when the compiled step was handed the donated buffers)."""
    state, batch = args
    f = al.parallelize(make_train_step(mlp_loss), method=method, donate_argnums=(0,))
    state, _ = f(state, batch)  # the step's layouts: the next calls take it as it is
    f(state, batch)
    with pytest.raises(ValueError, match=r"step input state\.\S+ is a deleted array \(donated to or deleted"):
        f(state, batch)
    with pytest.raises(ValueError, match=r"step input state\.\S+ is a deleted array"):
        f.get_executable(state, batch)(state, batch)


def test_dict_and_tuple_pytrees(args):
    def step(params, batch):
        loss, grads = al.value_and_grad(mlp_loss)(params, batch)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new, (loss, {"norm": sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))})

    state, batch = args
    new, (loss, extra) = al.parallelize(step)(state.params, batch)
    ref_new, (ref_loss, ref_extra) = jax.jit(step)(state.params, batch)
    assert jax.tree.structure(new) == jax.tree.structure(ref_new)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(float(extra["norm"]), float(ref_extra["norm"]), rtol=1e-5)


def test_non_array_leaf_is_named(args):
    state, batch = args
    bad = dict(batch, note="hello")
    with pytest.raises(TypeError, match=r"batch\.note must be an array"):
        al.parallelize(make_train_step(mlp_loss))(state, bad)


def test_batch_not_divisible_by_the_mesh_is_named(args):
    state, _ = args
    batch = mlp_batch(np.random.default_rng(0), batch_size=12)
    with pytest.raises(ValueError, match=r"batch leaf batch\.x has 12 rows.*8 devices"):
        al.parallelize(make_train_step(mlp_loss))(state, batch)
    with pytest.raises(ValueError, match=r"batch\.x has 12 rows.*num_micro_batches=8"):
        al.parallelize(make_train_step(mlp_loss), method=al.DataParallel(num_micro_batches=8))(state, batch)


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(TypeError, match="method must be one of DataParallel, Zero2Parallel"):
        al.parallelize(make_train_step(mlp_loss), method="data")
    with pytest.raises(ValueError, match="num_micro_batches must be a positive int"):
        al.DataParallel(num_micro_batches=0)


def test_bad_argnums_are_named(args):
    with pytest.raises(ValueError, match="static_argnums"):
        al.parallelize(make_train_step(mlp_loss), static_argnums=(-1,))
    with pytest.raises(ValueError, match=r"batch_argnums contains 5"):
        al.parallelize(make_train_step(mlp_loss), batch_argnums=(5,))(*args)
    with pytest.raises(TypeError, match="pass arguments positionally"):
        al.parallelize(make_train_step(mlp_loss))(state=args[0], batch=args[1])
    with pytest.raises(ValueError, match=r"called with 1 positional arguments .*a step without a batch argument: "
                                         r"batch_argnums=\(\)"):
        al.parallelize(lambda state: state, method=al.DataParallel())(args[0])


def test_manual_specs_are_checked(args):
    from jax.sharding import PartitionSpec as P
    step = make_train_step(mlp_loss)
    with pytest.raises(ValueError, match="mesh_shape \\(2, 2\\) has 4 devices, but 8"):
        al.parallelize(step, method=al.ManualShardParallel(mesh_shape=(2, 2), mesh_axis_names=("a", "b"),
                                                           in_specs=(None, P("a"))))(*args)
    other_state = mlp_state(tx=optax.sgd(0.1))  # another tx: a TrainState's static field
    with pytest.raises(ValueError, match=r"in_specs\[0\] is not a pytree prefix of the argument it describes "
                                         r"\(Mismatch custom dataclass node data.*build the specs from") as raised:
        al.parallelize(step, method=al.ManualShardParallel(mesh_shape=(8,), mesh_axis_names=("data",), in_specs=(
            jax.tree.map(lambda x: P(), other_state), P("data"))))(*args)
    assert len(str(raised.value)) < 800  # not the whole argument
    with pytest.raises(ValueError, match="names mesh axis 'batch'"):
        al.parallelize(step, method=al.ManualShardParallel(mesh_shape=(8,), mesh_axis_names=("data",),
                                                           in_specs=(None, P("batch"))))(*args)
    with pytest.raises(ValueError, match=r"spec P\('a', 'a'\) for batch.x uses mesh axis 'a' twice"):
        al.parallelize(step, method=al.ManualShardParallel(mesh_shape=(2, 4), mesh_axis_names=("a", "b"),
                                                           in_specs=(None, P("a", "a"))))(*args)
    with pytest.raises(ValueError, match="has no rule"):
        al.parallelize(step, method=al.ManualShardParallel(
            mesh_shape=(8,), mesh_axis_names=("data",), in_specs=(None, P("batch")),
            logical_axis_rules=(("length", None),)))(*args)
    with pytest.raises(ValueError, match="duplicate logical names \\['batch'\\]"):
        al.ManualShardParallel(mesh_shape=(8,), mesh_axis_names=("data",), in_specs=(None, None),
                               logical_axis_rules=(("batch", "data"), ("batch", None)))
    small_state = mlp_state(sizes=(16, 32, 4))
    small_args = (small_state, mlp_batch(np.random.default_rng(0), sizes=(16, 32, 4)))
    specs = small_state.replace(params={"dense_0": None, "dense_1": {"kernel": None, "bias": P("data")}},
                                opt_state=None, step=None)
    with pytest.raises(ValueError, match=r"splits dim 0 of state\.params\.dense_1\.bias \(size 4\) into 8"):
        al.parallelize(step, method=al.ManualShardParallel(
            mesh_shape=(8,), mesh_axis_names=("data",), in_specs=(specs, P("data"))))(*small_args)


def test_init_rejects_unknown_cluster_kinds():
    with pytest.raises(ValueError, match=r"cluster must be one of \('local', 'ray'\)"):
        al.init("slurm")
    al.init("local", devices=jax.devices()[:4])
    try:
        exe = al.parallelize(make_train_step(mlp_loss)).get_executable(
            mlp_state(), mlp_batch(np.random.default_rng(0)))
        assert exe.plan.stages[0].logical_mesh_shape == (4,)
    finally:
        al.shutdown()


@pytest.mark.parametrize("name", ["static_argnums", "donate_argnums", "batch_argnums"])
@pytest.mark.parametrize("argnums", [True, False, (True,), (0, False), "1", 1.0])
def test_argnums_reject_bools_and_non_ints(name, argnums):
    with pytest.raises((TypeError, ValueError), match=name):
        al.parallelize(make_train_step(mlp_loss), **{name: argnums})


@pytest.mark.parametrize("devices, error, match", [
    (["a", "b"], TypeError, r"devices\[0\] must be a jax device .*got str 'a'"),
    ("cpu", TypeError, "devices must be a sequence of jax devices"),
    ([jax.devices()[0]] * 8, ValueError, r"devices\[1\] repeats devices\[0\]"),
    ([jax.devices()[0], jax.devices()[1], jax.devices()[0]], ValueError, r"devices\[2\] repeats devices\[0\]"),
    ([], ValueError, "devices must not be empty"),
])
def test_init_checks_the_devices(devices, error, match):
    try:
        with pytest.raises(error, match=match):
            al.init("local", devices=devices)
    finally:
        al.shutdown()


@pytest.mark.parametrize("method", [al.DataParallel(), al.PipeshardParallel(
    num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
    stage_option=al.UniformStageOption(num_stages=2))], ids=["data", "pipeshard"])
def test_executable_called_with_other_shapes_names_the_leaf(args, method):
    state, batch = args
    exe = al.parallelize(make_train_step(mlp_loss), method=method).get_executable(state, batch)
    wider = {**batch, "x": jnp.zeros((16, 16), jnp.float32)}
    with pytest.raises(ValueError, match=r"argument leaf batch\.x has shape \(16, 16\) and dtype float32, but "
                                         r"this executable was compiled for shape \(32, 16\)"):
        exe(state, wider)
    retyped = {**batch, "y": batch["y"].astype(jnp.float16)}
    with pytest.raises(ValueError, match=r"batch\.y has shape \(32, 8\) and dtype float16, .*dtype float32"):
        exe(state, retyped)


def test_parallelize_plans_for_the_given_cluster(args, tmp_path):
    """A pinned cluster makes the cost model, and so the plan, the same from run to run; a saved one loads
    from its path; one of another size is an error naming both device counts."""
    state, batch = args
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    for method in (al.ShardParallel(), al.DataParallel()):
        exe = al.parallelize(make_train_step(mlp_loss), method=method, cluster=cluster).get_executable(state, batch)
        assert exe.plan.cluster == cluster
    cluster.save(tmp_path / "cluster.json")
    exe = al.parallelize(make_train_step(mlp_loss), cluster=tmp_path / "cluster.json").get_executable(state, batch)
    assert exe.plan.cluster == cluster
    pipe = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                stage_option=al.UniformStageOption(num_stages=2))
    exe = al.parallelize(make_train_step(mlp_loss), method=pipe, cluster=str(tmp_path / "cluster.json")
                         ).get_executable(state, batch)
    assert exe.plan.cluster == cluster
    with pytest.raises(ValueError, match=r"cluster 'p3.16xlarge' has 16 devices \(2 x 8\), but the local "
                                         r"backend's devices \(al.init\) are 8"):
        al.parallelize(make_train_step(mlp_loss), cluster=al.ClusterSpec.preset("p3.16xlarge", num_nodes=2))(
            state, batch)
    with pytest.raises(TypeError, match="cluster must be an al.ClusterSpec or the path"):
        al.parallelize(make_train_step(mlp_loss), cluster=8)
    with pytest.raises(ValueError, match="cannot read"):
        al.parallelize(make_train_step(mlp_loss), cluster=tmp_path / "missing.json")


def test_executable_reports_hlo_costs_and_memory(args):
    exe = al.parallelize(make_train_step(mlp_loss)).get_executable(*args)
    assert "all-reduce" in exe.get_hlo_text()
    assert exe.cost_analysis()["flops"] > 0
    assert exe.memory_analysis().argument_size_in_bytes > 0
