"""ParallelPlan: printing, exact JSON round trip, and planning from shapes alone (al.plan)."""
import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.models import gpt
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
    # Ring all-reduce over 16 devices across 2 nodes: 2 (n-1)/n bytes over the inter-node link.
    expected = cluster.inter_node_latency + 2 * 15 / 16 * param_bytes / cluster.inter_node_bandwidth
    assert comm.seconds == pytest.approx(expected, rel=1e-9)


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
