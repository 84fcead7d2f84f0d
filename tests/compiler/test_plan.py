"""ParallelPlan: printing (layers folded whatever their naming, the method summarised), exact JSON round trip,
the roles of the step's leaves, and planning from shapes alone (al.plan)."""
import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.sliced_step import slice_step
from alpa_like.compiler.trace import LeafInfo
from alpa_like.compiler.input_roles import is_prng_key
from alpa_like.models import gpt
from alpa_like.compiler.plan import OpPlan, TensorPlan
from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state


def gpt_state_shapes(config, tx=None):
    """A TrainState of ShapeDtypeStructs: nothing is allocated, whatever the model size."""
    params = gpt.gpt_param_shapes(config)
    tx = tx or optax.adam(1e-4)
    return jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=tx), params)


def gpt_step(config):
    return make_train_step(gpt.gpt_loss(gpt.GPTModel(config)))


@pytest.fixture(scope="module")
def mlp_plan():
    exe = al.parallelize(make_train_step(mlp_loss), method=al.Zero2Parallel(num_micro_batches=2)).get_executable(
        mlp_state(), mlp_batch(np.random.default_rng(0)))
    return exe.plan


def test_json_round_trip_is_exact(mlp_plan):
    text = mlp_plan.to_json()
    again = al.ParallelPlan.from_json(text)
    assert again == mlp_plan
    assert again.to_json() == text
    json.loads(text)  # plain JSON, no reprs of callables


def test_from_json_rejects_garbage():
    with pytest.raises(ValueError, match="not JSON"):
        al.ParallelPlan.from_json("{nope")


def test_printed_plan_shows_what_a_user_acts_on(mlp_plan):
    text = str(mlp_plan)
    assert "Zero2Parallel(num_micro_batches=2)" in text
    assert "state.params.dense_0.kernel" in text and "P(None, None)" in text
    assert "state.opt_state.0.mu.dense_0.kernel" in text
    assert "batch.x" in text and "S0R" in text and "P('data', None)" in text
    assert "estimated iteration time" in text
    assert "reduce-scatter" in text and "gradient synchronisation" in text


def test_plan_tensor_lookup_names_missing_paths(mlp_plan):
    assert mlp_plan.tensor("batch.x").role == "batch"
    with pytest.raises(KeyError, match="no tensor 'batch.z'"):
        mlp_plan.tensor("batch.z")


def test_plan_from_shapes_for_a_64_gpu_cluster_allocates_nothing():
    config = models.get_config("gpt-39b")
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=8)
    state = gpt_state_shapes(config)
    batch = gpt.gpt_batch_shapes(config, 1024)
    plan = al.plan(gpt_step(config), state, batch, method=al.Zero3Parallel(), cluster=cluster)
    assert plan.num_devices == 64
    stage = plan.stages[0]
    assert stage.submesh_shape == (8, 8) and stage.logical_mesh_shape == (64,)
    params = [t for t in stage.inputs if t.role == "param"]
    num_params = sum(int(np.prod(t.shape)) for t in params)
    assert 35e9 < num_params < 43e9
    # ZeRO-3 shards params and both Adam moments 64 ways: about 3 * 4 bytes * P / 64 per device.
    state_bytes = sum(t.bytes_per_device for t in stage.inputs if t.role != "batch")
    assert state_bytes == pytest.approx(12 * num_params / 64, rel=0.02)
    # Compute at V100 peak: Megatron's 6 * P * tokens rule is within the FLOP counter's extras.
    tokens = 1024 * config.seq_len
    assert stage.flops == pytest.approx(6 * num_params * tokens, rel=0.35)
    assert plan.estimated_iteration_time > stage.compute_seconds
    # Layer leaves fold into one row each: the table stays short for 48 layers.
    assert "block_* " in str(plan) or "block_*." in str(plan)
    assert len(str(plan).splitlines()) < 200
    assert al.ParallelPlan.from_json(plan.to_json()) == plan


def test_data_parallel_plan_predicts_one_gradient_all_reduce():
    config = models.get_config("gpt-350m")
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=2)
    plan = al.plan(gpt_step(config), gpt_state_shapes(config), gpt.gpt_batch_shapes(config, 64),
                   method=al.DataParallel(), cluster=cluster)
    (comm,) = plan.stages[0].communication
    param_bytes = sum(t.bytes_per_device for t in plan.stages[0].inputs if t.role == "param")
    assert comm.kind == "all-reduce" and comm.num_bytes == param_bytes
    # Over 16 devices on 2 nodes, the two-level all-reduce: a reduce-scatter inside each node, 8 rings of
    # 2 devices across the nodes on an eighth of the bytes each (each at a device's share of the node's
    # link), an all-gather inside the node.
    inside = cluster.intra_node_latency + 7 / 8 * param_bytes / cluster.intra_node_bandwidth
    across = cluster.inter_node_latency + 2 * 1 / 2 * (param_bytes / 8) / cluster.inter_node_bandwidth
    assert comm.seconds == pytest.approx(2 * inside + across, rel=1e-9)
    # One ring over all 16 would move 2 * 15/16 of the bytes across, at the node's whole link.
    ring = cluster.inter_node_latency + 2 * 15 / 16 * param_bytes / (8 * cluster.inter_node_bandwidth)
    assert comm.seconds < ring


def test_plan_is_frozen(mlp_plan):
    with pytest.raises(dataclasses.FrozenInstanceError):
        mlp_plan.num_micro_batches = 4


def test_spmd_compute_is_the_steps_roofline_when_the_cluster_has_a_memory_bandwidth():
    # On XLA's CPU devices (ClusterSpec.local() measures a memory bandwidth) element-wise work is
    # memory-bound: the estimate is each equation's max(FLOP time, byte time) over the devices, the same
    # roofline the pipeline simulator and the stage profiler use; without a bandwidth, FLOPs at peak.
    from alpa_like.compiler.flops import jaxpr_flops, jaxpr_seconds
    from alpa_like.compiler.trace import trace_step
    step, state, batch = make_train_step(mlp_loss), mlp_state(), mlp_batch(np.random.default_rng(0))
    closed = trace_step(step, (state, batch)).closed_jaxpr
    gpu = al.ClusterSpec.preset("p3.16xlarge", num_nodes=1)
    cpu = dataclasses.replace(gpu, peak_flops=2e10, memory_bandwidth=3e9)
    for cluster in (gpu, cpu):
        plan = al.plan(step, state, batch, method=al.DataParallel(), cluster=cluster)
        expected = jaxpr_seconds(closed, cluster.compute_rates, cluster.num_devices)
        assert plan.stages[0].compute_seconds == pytest.approx(expected, rel=1e-9)
    assert plan.stages[0].compute_seconds > jaxpr_flops(closed) / (8 * cpu.peak_flops)


# ------------------------------------------------------------------------------------ readable third-party plans

def tensor(path, shape=(8, 8), role="param", spec="RR"):
    return TensorPlan(path=path, shape=shape, dtype="float32", role=role,
                      spec=None if spec is None else ShardingSpec.from_str(spec), bytes_per_device=4)


def table_rows(plan):
    """The tensor column of the printed plan's first stage table."""
    lines = plan.table().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  tensor "))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("  ") or line.startswith("  (") or line.endswith(":"):  # the next section
            break
        rows.append(line.split("  ")[1])
    return rows


def with_tensors(plan, inputs, outputs=()):
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], inputs=tuple(inputs),
                                                                 outputs=tuple(outputs)),))


def test_repeated_layers_fold_into_one_row_whatever_their_naming(mlp_plan):
    hf = "state.params.transformer.h.{}.attn.c_attn.kernel"
    plan = with_tensors(mlp_plan, [
        *(tensor(hf.format(i)) for i in range(3)),                                 # Hugging Face: h.0, h.1, ...
        *(tensor(f"state.params.layers_{i}.kernel") for i in range(2)),            # Flax: layers_0, layers_1
        *(tensor(f"state.opt_state.0.mu.transformer.h.{i}.attn.c_attn.kernel", role="optimizer_state")
          for i in range(3)),
        tensor("state.params.h.0.w", shape=(8, 8)), tensor("state.params.h.1.w", shape=(8, 16)),
    ], outputs=[tensor("out.1.loss", shape=(), role="output", spec=""),
                tensor("out.2.loss", shape=(), role="output", spec="")])
    assert table_rows(plan) == [
        "state.params.transformer.h.*.attn.c_attn.kernel (x3)",
        "state.params.layers_*.kernel (x2)",
        "state.opt_state.0.mu.transformer.h.*.attn.c_attn.kernel (x3)",  # optax's chain index is not a layer
        "state.params.h.0.w", "state.params.h.1.w",                          # shapes differ: not one row
        "out.1.loss", "out.2.loss",                                          # an output's position, not a layer
    ]
    assert "state.params.transformer.h.2.attn.c_attn.kernel" in plan.table(group_layers=False)


def test_repeated_operators_fold_by_name_stack(mlp_plan):
    spec = ShardingSpec.from_str("S0R")
    ops = [OpPlan(name=f"transpose(jvp(FlaxGPT2Module))/transformer/h/{i}/attn/dot_general", kind="dot_general",
                  shape=(8, 8), spec=spec, strategy="i->0", communication="-", seconds=1e-3) for i in range(4)]
    stage = dataclasses.replace(mlp_plan.stages[0], ops=tuple(ops))
    text = dataclasses.replace(mlp_plan, stages=(stage,)).table()
    assert "transpose(jvp(FlaxGPT2Module))/transformer/h/*/attn/dot_general (x4)" in text
    assert "4.000 ms" in text  # seconds summed over the folded layers


def test_plan_header_summarises_the_method_and_the_json_keeps_its_repr(mlp_plan):
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=al.AutoLayerOption(layer_num=4),
                                  stage_option=al.AutoStageOption(show_progress=False))
    plan = dataclasses.replace(mlp_plan, method=repr(method))
    assert len(repr(method)) > 300
    header = str(plan).splitlines()[0]
    assert header == ("ParallelPlan  PipeshardParallel(num_micro_batches=4, layer_option=AutoLayerOption("
                      "layer_num=4), stage_option=AutoStageOption(show_progress=False))")
    assert al.ParallelPlan.from_json(plan.to_json()).method == repr(method)
    assert str(mlp_plan).splitlines()[0] == "ParallelPlan  Zero2Parallel(num_micro_batches=2)"
    cut = str(dataclasses.replace(mlp_plan, method="Custom(" + "x" * 400 + ")")).splitlines()[0]
    assert len(cut) < 250 and cut.endswith("...")


# ------------------------------------------------------------------------------------------------- roles

class DropoutState(train_state.TrainState):
    dropout_rng: Any


def dropout_loss(params, batch, rng):
    x = batch["x"]
    for i, name in enumerate(sorted(params)):
        x = jnp.tanh(x @ params[name])
        x = jnp.where(jax.random.bernoulli(jax.random.fold_in(rng, i), 0.9, x.shape), x / 0.9, 0.0)
        if i == 0:
            al.mark_pipeline_boundary()
    return jnp.mean(x ** 2)


def dropout_step(state, batch):
    rng, new_rng = jax.random.split(state.dropout_rng)
    loss, grads = al.value_and_grad(dropout_loss)(state.params, batch, rng)
    return state.apply_gradients(grads=grads).replace(dropout_rng=new_rng), loss


def dropout_case(key):
    params = {f"w{i}": jax.ShapeDtypeStruct((8, 8), jnp.float32) for i in range(2)}
    state = jax.eval_shape(lambda p: DropoutState.create(apply_fn=None, params=p, tx=optax.adam(1e-3),
                                                         dropout_rng=key), params)
    return state, {"x": jax.ShapeDtypeStruct((16, 8), jnp.float32)}


@pytest.mark.parametrize("key", [jax.random.PRNGKey(0), jax.random.key(0)], ids=["raw uint32", "typed"])
def test_a_train_states_dropout_key_is_state_not_optimizer_state(key):
    state, batch = dropout_case(key)
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    for method in (al.DataParallel(), al.Zero2Parallel()):
        roles = {t.path: t.role for t in al.plan(dropout_step, state, batch, method=method,
                                                  cluster=cluster).stages[0].inputs}
        assert roles["state.dropout_rng"] == "state"
        assert roles["state.step"] == roles["state.opt_state.0.count"] == "optimizer_state"
        assert roles["state.opt_state.0.mu.w0"] == roles["state.opt_state.0.nu.w1"] == "optimizer_state"
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=al.AutoStageOption(show_progress=False))
    sliced = slice_step(method, dropout_step, (state, batch), static_argnums=(), batch_argnums=(1,))
    roles = {leaf.path: role for leaf, role in zip(sliced.traced.in_leaves, sliced.roles, strict=True)}
    assert roles["state.dropout_rng"] == "state" and roles["state.opt_state.0.mu.w0"] == "optimizer_state"
    plan = al.plan(dropout_step, state, batch, method=method, cluster=cluster)
    assert all(t.role == "param" for s in plan.stages for t in s.inputs)  # a pipeline plan lists parameters


def test_prng_keys_are_told_by_dtype_or_by_uint32_key_data_named_like_a_key():
    def leaf(path, shape, dtype):
        return LeafInfo(path=path, shape=shape, dtype=dtype, itemsize=4, arg_index=0)
    assert is_prng_key(leaf("state.rng", (), "key<fry>"))
    assert is_prng_key(leaf("state.dropout_rng", (2,), "uint32"))
    assert is_prng_key(leaf("state.opt_state.1.rng_key", (2,), "uint32"))  # optax.add_noise
    assert not is_prng_key(leaf("state.opt_state.0.count", (), "int32"))
    assert not is_prng_key(leaf("state.opt_state.0.histogram", (2,), "uint32"))
    assert not is_prng_key(leaf("state.dropout_rng", (3,), "uint32"))
