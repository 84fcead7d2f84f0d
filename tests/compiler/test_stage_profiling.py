"""Per-layer intra-op profiling for the stage DP: structural de-duplication, range sums, and the memory-lean
``"params-sharded"`` variant that lets large models fit (Eq. 3.5)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.compiler.auto_sharding import PassOptions
from alpa_like.compiler.stage_costs import StageCosts
from alpa_like.compiler.stage_dp import solve_stages
from tests.reference import brute_force_stages
from alpa_like.compiler.stage_profiling import (PARAMS_HALF_SHARDED, PARAMS_SHARDED, ReceivedValues, boundary_saving,
                                               profile_stage_costs, receive_seconds, received_per_micro_batch,
                                               sender_limited_extra, shared_nic_wait)
from alpa_like.compiler.sliced_step import slice_step

HIDDEN, ROWS, LAYERS = 1024, 8192, 4


def mlp_loss(params, batch):
    x = batch["x"]
    for i in range(LAYERS):
        x = jnp.tanh(x @ params[f"w{i}"])
        if i < LAYERS - 1:
            al.mark_pipeline_boundary()
    return jnp.mean(x ** 2)


def train_step(state, batch):
    loss, grads = al.value_and_grad(mlp_loss)(state.params, batch)
    return state.apply_gradients(grads=grads), loss


def sliced_mlp(num_micro_batches=1):
    """Four equal (HIDDEN x HIDDEN) layers on a large batch: activations dominate, so the fastest layout is
    data parallel with replicated weights."""
    params = {f"w{i}": jax.ShapeDtypeStruct((HIDDEN, HIDDEN), jnp.float32) for i in range(LAYERS)}
    state = jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-3)),
                           params)
    batch = {"x": jax.ShapeDtypeStruct((ROWS, HIDDEN), jnp.float32)}
    method = al.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option=al.ManualLayerOption(),
                                  stage_option=al.AutoStageOption(show_progress=False))
    return method, slice_step(method, train_step, (state, batch), static_argnums=(), batch_argnums=(1,))


@pytest.fixture(scope="module")
def sliced_profile_inputs():
    return sliced_mlp(num_micro_batches=4)[1]


def profile_on_p3(sliced, submeshes, logical_shapes, **kwargs):
    """``profile_stage_costs`` of a sliced step on a p3.16xlarge, every input's bytes its optimizer state's."""
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    param_mask = [r == "param" for r in sliced.roles]
    optimizer_bytes = [sum(sliced.traced.in_leaves[i].nbytes for i in inputs) for inputs in sliced.optimizer_inputs]
    return profile_stage_costs(sliced.jaxpr, sliced.pieces, sliced.summaries, param_mask, optimizer_bytes, cluster,
                               submeshes, logical_shapes, PassOptions(rates=cluster.compute_rates), **kwargs)


@pytest.fixture(scope="module")
def profile(sliced_profile_inputs):
    return profile_on_p3(sliced_profile_inputs, [(1, 1), (1, 2)], [[(1, 1)], [(1, 2)]])


def test_the_table_lists_a_params_sharded_twin_for_multi_device_submeshes(profile):
    costs = profile.costs
    assert costs.logical_shapes == (((1, 1),), ((1, 2), (1, 2)))
    assert costs.variants == (("",), ("", PARAMS_SHARDED))


def test_float32_layers_are_priced_at_the_fp32_rate(profile):
    """The MLP is float32: on a V100 (p3.16xlarge) its matmuls run at 15.7 TFLOP/s, not the 125 of FP16 (the
    layer's time is its products at that rate, plus their overheads and the element-wise traffic)."""
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    matmuls = 3 * 2 * (ROWS // 4) * HIDDEN * HIDDEN  # forward, input gradient, weight gradient; 4 micro-batches
    at_fp32 = matmuls / (cluster.fp32_peak_flops * cluster.matmul_efficiency)
    assert at_fp32 <= profile.layer_costs[(1, 0, 0)].compute_seconds <= 1.2 * at_fp32


def test_the_lean_variant_shards_every_weight_and_costs_time_not_memory(profile):
    weight = HIDDEN * HIDDEN * 4
    for layer in range(LAYERS):
        fastest, lean = profile.layer_costs[(layer, 1, 0)], profile.layer_costs[(layer, 1, 1)]
        assert fastest.param_bytes_per_device == weight  # data parallel: replicated
        assert lean.param_bytes_per_device == weight / 2
        assert lean.seconds >= fastest.seconds
    assert (profile.costs.mem_stage[:, :, 1, 1] < profile.costs.mem_stage[:, :, 1, 0]).all(where=np.triu(
        np.ones((LAYERS, LAYERS), bool)))


def test_meshes_of_four_devices_add_a_half_sharded_variant_between_the_two(sliced_profile_inputs):
    """On a (2, 2) view the fastest solve replicates the weights (data parallel), the lean one splits each
    over all 4 devices, and the one in between over at least 2 (here exactly 2: the cheapest such layout):
    its memory lies between theirs and its time is at most the lean one's (the lean layout meets its limit
    too, so the ILP could have chosen it)."""
    profile = profile_on_p3(sliced_profile_inputs, [(1, 2), (1, 4)], [[(1, 2)], [(2, 2)]])
    assert profile.costs.variants == (("", PARAMS_SHARDED), ("", PARAMS_HALF_SHARDED, PARAMS_SHARDED))
    weight = HIDDEN * HIDDEN * 4
    for layer in range(LAYERS):
        fastest, half, lean = (profile.layer_costs[(layer, 1, e)] for e in range(3))
        assert (fastest.param_bytes_per_device, half.param_bytes_per_device, lean.param_bytes_per_device) == (
            weight, weight / 2, weight / 4)
        assert fastest.seconds <= half.seconds <= lean.seconds


def boundary_receive_seconds(i, j, devices, cluster, num_micro_batches=4):
    """Closed form for the MLP chain: a stage of layers i..j receives the activation of layer i - 1 in the
    forward and the gradient from layer j + 1 in the backward, each (ROWS / m, HIDDEN) float32, spread over
    its devices; one latency per value (one node: intra-node links)."""
    values = (i > 0) + (j < LAYERS - 1)
    activation = ROWS // num_micro_batches * HIDDEN * 4
    return values * (cluster.intra_node_latency + activation / (devices * cluster.intra_node_bandwidth))


def test_a_layer_range_receives_its_boundary_activation_and_gradient_once_each(sliced_profile_inputs):
    sliced = sliced_profile_inputs
    received = received_per_micro_batch(sliced.jaxpr, sliced.pieces, LAYERS)
    activation = ROWS // 4 * HIDDEN * 4
    for i in range(LAYERS):
        for j in range(i, LAYERS):
            values = (i > 0) + (j < LAYERS - 1)
            assert received.count[i, j] == values, (i, j)
            assert received.num_bytes[i, j] == values * activation, (i, j)
            assert list(received.neighbour_count[i, j]) == [i > 0, j < LAYERS - 1], (i, j)
            assert list(received.neighbour_bytes[i, j]) == [(i > 0) * activation, (j < LAYERS - 1) * activation]


def two_layer_receives() -> ReceivedValues:
    """Layers 0..1 as one stage receive two values of 4 MB, one from each neighbouring layer."""
    neighbours = np.zeros((2, 2, 2))
    neighbours[0, 1] = 1
    return ReceivedValues(num_bytes=np.array([[0.0, 8e6], [0.0, 0.0]]), count=np.array([[0, 2], [0, 0]]),
                          neighbour_bytes=neighbours * 4e6, neighbour_count=neighbours)


def test_a_boundary_inside_a_node_saves_the_difference_of_the_links():
    """A neighbour inside the node sends over the stage's NVLink links (4 devices: 4 x 150 GB/s) instead of
    the node's whole NIC (8 x 25 Gb/s / 8), and one intra-node latency instead of an inter-node one."""
    two = al.ClusterSpec.preset("p3.16xlarge", num_nodes=2)
    saving = boundary_saving(two_layer_receives(), [1, 4], two)
    assert saving.shape == (2, 2, 2, 2)
    per_side = (two.inter_node_latency - two.intra_node_latency
                + 4e6 * (1 / (8 * two.inter_node_bandwidth) - 1 / (4 * two.intra_node_bandwidth)))
    assert saving[0, 1, 1] == pytest.approx([per_side, per_side])
    assert (saving[0, 0] == 0).all()
    one = al.ClusterSpec.preset("p3.16xlarge")
    assert (boundary_saving(two_layer_receives(), [1, 4], one) == 0).all()


def test_shared_nic_wait_is_half_the_neighbours_bytes_over_the_receiving_nics():
    """Per side, half the time the 4 MB from the adjacent layer hold the receiving node's whole NIC (8
    shares of 25 Gb/s for a mesh inside one node, 16 for one over two nodes), no latency: the mean wait of
    two equal transfers taking turns. Zero on one node and for a range that receives nothing."""
    received = two_layer_receives()
    four = al.ClusterSpec.preset("p3.16xlarge", num_nodes=4)
    wait = shared_nic_wait(received, [1, 4, 16], four)
    assert wait.shape == (2, 2, 3, 2)
    node, two_nodes = 4e6 / (8 * four.inter_node_bandwidth), 4e6 / (16 * four.inter_node_bandwidth)
    assert wait[0, 1] == pytest.approx(0.5 * np.array([[node, node], [node, node], [two_nodes, two_nodes]]))
    assert (wait[0, 0] == 0).all()
    bandwidth_part = receive_seconds(received, [1, 4, 16], four)[0, 1] - 2 * four.inter_node_latency
    assert 2 * wait[0, 1].sum(axis=-1) == pytest.approx(bandwidth_part)
    assert (shared_nic_wait(received, [1, 4], al.ClusterSpec.preset("p3.16xlarge")) == 0).all()


def test_receive_time_uses_the_receiving_nodes_whole_nics_on_a_multi_node_cluster():
    """One node: the bytes spread over the stage's devices' NVLink links. Several nodes: a stage inside one
    node receives through the node's whole NIC (8 devices' share of it), whatever its size; a stage over
    two nodes through both NICs (16 shares)."""
    received = two_layer_receives()
    one = al.ClusterSpec.preset("p3.16xlarge")
    four = al.ClusterSpec.preset("p3.16xlarge", num_nodes=4)
    local = receive_seconds(received, [1, 4], one)
    cross = receive_seconds(received, [1, 4, 8, 16], four)
    assert local[0, 1, 1] == pytest.approx(2 * one.intra_node_latency + 8e6 / (4 * one.intra_node_bandwidth))
    node = 2 * four.inter_node_latency + 8e6 / (8 * four.inter_node_bandwidth)
    assert cross[0, 1] == pytest.approx([node, node, node, 2 * four.inter_node_latency
                                         + 8e6 / (16 * four.inter_node_bandwidth)])
    assert local[0, 0, 0] == 0.0


def test_a_sender_inside_one_node_limits_a_multi_node_receiver_to_one_nic():
    """The 8 MB from both neighbouring layers, received by a stage over two (four) nodes from neighbours
    inside one node each: one NIC's time (8 shares of 25 Gb/s) instead of two (four) NICs'; nothing more for
    stages inside one node, nor on a one-node cluster."""
    four = al.ClusterSpec.preset("p3.16xlarge", num_nodes=4)
    extra = sender_limited_extra(two_layer_receives(), [1, 8, 16, 32], four)
    assert extra.shape == (2, 2, 4)
    nic = 8 * four.inter_node_bandwidth
    assert extra[0, 1] == pytest.approx([0.0, 0.0, 8e6 / nic - 8e6 / (2 * nic), 8e6 / nic - 8e6 / (4 * nic)])
    limited = receive_seconds(two_layer_receives(), [8, 16], four)[0, 1] + extra[0, 1, 1:3]
    assert limited[0] == pytest.approx(limited[1])  # as slow as a receiver inside one node
    assert (sender_limited_extra(two_layer_receives(), [1, 8], al.ClusterSpec.preset("p3.16xlarge")) == 0).all()


def test_a_range_costs_the_sum_of_its_layers_plus_what_it_receives(profile):
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    for (i, j) in [(0, 0), (0, 3), (1, 2), (3, 3)]:
        for p, e in [(0, 0), (1, 0), (1, 1)]:
            expected = (sum(profile.layer_costs[(l, p, e)].seconds for l in range(i, j + 1))
                        + boundary_receive_seconds(i, j, p + 1, cluster))
            assert profile.costs.t_intra[i, j, p, e] == pytest.approx(expected, rel=1e-9)


def test_the_dp_on_the_profiled_table_with_receives_equals_brute_force(profile):
    """The receive term is part of the table the DP minimises over, so the DP stays exact with it."""
    for batches in (1, 4):
        dp = solve_stages(profile.costs, (1, 2), batches, 2**40, epsilon=0.0)
        brute = brute_force_stages(profile.costs, (1, 2), batches, 2**40)
        assert dp.iteration_time == pytest.approx(brute.iteration_time, rel=1e-12)
        assert dp.layers_per_stage == brute.layers_per_stage


def test_equal_layers_are_solved_once(profile):
    """Layers 1 and 2 have the same equations: they share every solve (layers 0 and 3 differ: the batch
    input and the loss)."""
    assert profile.layer_costs[(1, 1, 0)] is profile.layer_costs[(2, 1, 0)]
    assert profile.num_solves < 2 * profile.num_pairs


def lean_budget(costs):
    """Bytes per device of all four layers as one stage on (1, 2) under the lean variant (1F1B holds one
    micro-batch in the last stage)."""
    return float(costs.mem_stage[0, LAYERS - 1, 1, 1] + costs.mem_act[0, LAYERS - 1, 1, 1])


def test_the_dp_takes_the_lean_variant_exactly_where_nothing_else_fits(profile):
    """With the lean one-stage plan's memory as the budget and 4 micro-batches, no plan of fastest entries
    fits (one stage: replicated weights; two one-device stages: the first holds 2 micro-batches)."""
    costs, budget = profile.costs, lean_budget(profile.costs)
    solution = solve_stages(costs, (1, 2), 4, budget)
    assert [(s.layers, s.submesh, s.variant) for s in solution.stages] == [((0, 3), (1, 2), PARAMS_SHARDED)]
    fastest_only = StageCosts(num_layers=LAYERS, submeshes=costs.submeshes, logical_shapes=[[(1, 1)], [(1, 2)]],
                              t_intra=costs.t_intra[..., :1], mem_stage=costs.mem_stage[..., :1],
                              mem_act=costs.mem_act[..., :1])
    with pytest.raises(ValueError, match="no pipeline plan fits"):
        solve_stages(fastest_only, (1, 2), 4, budget)


def test_plan_shards_every_weight_when_replicated_weights_do_not_fit(profile):
    method, _ = sliced_mlp(num_micro_batches=4)
    params = {f"w{i}": jax.ShapeDtypeStruct((HIDDEN, HIDDEN), jnp.float32) for i in range(LAYERS)}
    state = jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-3)),
                           params)
    batch = {"x": jax.ShapeDtypeStruct((ROWS, HIDDEN), jnp.float32)}
    cluster = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge"), num_devices_per_node=2,
                                  device_memory=int(lean_budget(profile.costs)) + 1)
    plan = al.plan(train_step, state, batch, method=method, cluster=cluster)
    assert [s.submesh_shape for s in plan.stages] == [(1, 2)], plan
    for t in plan.stages[0].inputs:
        assert t.spec.num_shards(plan.stages[0].logical_mesh_shape) == 2, plan
    assert plan.stages[0].peak_memory_per_device <= cluster.device_memory


@pytest.fixture(scope="module")
def tied_gpt():
    """gpt-tiny cut into layers (its word embedding tied to the logits), and the embedding's FP32 bytes."""
    from alpa_like.bench import ours
    from alpa_like.bench.workloads import make_workload

    workload = make_workload("gpt-tiny", 8)
    sliced = ours.slice_workload(workload, ours.pipeshard_method(
        workload, 2, layer_option=al.AutoLayerOption(layer_num=3, eps=None)))
    return sliced, workload.config.vocab_size * workload.config.hidden_size * 4


def test_the_tied_embedding_gradient_is_received_once_per_step_by_the_last_layers_stage(tied_gpt):
    """GPT ties the word embedding (layer 0) to the logits (the last layer): the apply-grad, with the last
    layer, adds the gradient layer 0 accumulated, so a stage holding the last layer but not layer 0 receives
    it once per step; a stage holding both, or not the last layer, does not."""
    from alpa_like.compiler.stage_profiling import received_per_step

    sliced, embedding = tied_gpt
    k = len(sliced.summaries)
    received = received_per_step(sliced.jaxpr, sliced.pieces, k)
    for first in range(1, k):
        assert embedding <= received.num_bytes[first, k - 1] < 2 * embedding
    assert received.num_bytes[0, k - 1] == 0
    assert received.num_bytes[0, :k - 1].max() < embedding


def test_a_stage_holding_the_lookup_but_not_the_logits_receives_their_embedding_gradient_once_per_step(tied_gpt):
    """GPT's word embedding is read by layer 0's lookup and the last layer's logits and updated with the last
    layer. The update is replicated on a stage holding layer 0 but not the last layer, which first receives
    the gradient part the logits accumulated: exactly one value of the embedding's bytes. No other range
    receives anything for a replica (every other parameter and optimizer state is updated with the layer that
    reads it; a range holding the last layer receives layer 0's part through ``received_per_step``)."""
    from alpa_like.compiler.stage_profiling import replica_received_per_step

    sliced, embedding = tied_gpt
    k = len(sliced.summaries)
    received = replica_received_per_step(sliced.jaxpr, sliced.pieces, k)
    first, last = np.meshgrid(np.arange(k), np.arange(k), indexing="ij")
    expected = (first == 0) & (last < k - 1)
    np.testing.assert_array_equal(received.num_bytes, np.where(expected, embedding, 0))
    np.testing.assert_array_equal(received.count, expected.astype(float))


def test_a_stage_holding_a_replicated_update_holds_its_optimizer_state(tied_gpt):
    """The stage holding GPT's lookup but not the logits runs its own copy of the embedding's Adam update, so
    it holds the embedding's two moments besides the parameter its layers read: Eq. 3.5's ``mem_stage`` must
    count them. (Adam's step count is not among them: the update reads the incremented count that another
    layer's apply-grad makes, a received value.) No other range holds replica state."""
    from alpa_like.compiler.stage_profiling import replica_state_bytes

    sliced, embedding = tied_gpt
    k = len(sliced.summaries)
    held = replica_state_bytes(sliced.jaxpr, sliced.pieces, k)
    first, last = np.meshgrid(np.arange(k), np.arange(k), indexing="ij")
    np.testing.assert_array_equal(held, np.where((first == 0) & (last < k - 1), 2 * embedding, 0))


def test_shared_solves_give_the_table_of_solving_every_layer_on_its_own(sliced_profile_inputs, profile):
    """Layers of one structure share their solves (and each process builds a layer's op graph once): the table
    and every layer's specs equal those of one solve per layer and mesh, and the shared entries are counted."""
    alone = profile_on_p3(sliced_profile_inputs, [(1, 1), (1, 2)], [[(1, 1)], [(1, 2)]], share_solves=False,
                          max_workers=1)
    for name in ("t_intra", "mem_stage", "mem_act"):
        np.testing.assert_array_equal(getattr(alone.costs, name), getattr(profile.costs, name))
    assert alone.layer_costs == profile.layer_costs
    assert (alone.num_jobs, profile.num_jobs) == (LAYERS * 2, 3 * 2)  # layers 1 and 2 alike; 2 meshes
    assert profile.cache_hits == profile.num_pairs - profile.num_jobs > alone.cache_hits


def test_layer_jaxprs_read_once_equal_each_layer_read_alone(sliced_profile_inputs):
    """Every layer's compute-grad jaxpr and inputs, extracted for all layers in one pass over the step, are
    those of the definition: its forward and backward equations, outputs read by any other equation or
    the step."""
    from alpa_like.compiler import jax_compat
    from alpa_like.compiler.layer_slicing import BACKWARD, FORWARD
    from alpa_like.compiler.stage_profiling import layer_jaxprs, structure_key

    jaxpr, pieces = sliced_profile_inputs.jaxpr, sliced_profile_inputs.pieces
    for layer, (closed, inputs) in enumerate(layer_jaxprs(jaxpr, pieces, range(LAYERS))):
        mine = [e for e, p in zip(jaxpr.eqns, pieces) if p is not None and p.layer == layer
                and p.phase in (FORWARD, BACKWARD)]
        outside = {v for e in jaxpr.eqns if not any(e is m for m in mine) for v in jax_compat.eqn_inputs(e)}
        outside |= {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
        assert closed.jaxpr.eqns == mine
        assert closed.jaxpr.outvars == [v for e in mine for v in e.outvars if v in outside]
        assert inputs == [list(jaxpr.invars).index(v) if v in jaxpr.invars else -1 for v in closed.jaxpr.invars]
        assert structure_key(closed)


def test_a_stage_holding_both_readers_of_a_tied_parameter_counts_it_once(tied_gpt):
    """GPT's word embedding is read by layer 0's lookup and the last layer's logits: a stage holding both
    holds one copy and one gradient. On one device (every layout whole) the whole model's ``mem_stage`` is
    every parameter and its gradient once plus the optimizer state; a stage of one of the two readers still
    counts the embedding, and a range of both counts it once more than neither."""
    sliced, embedding = tied_gpt
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    param_mask = [r == "param" for r in sliced.roles]
    leaves = sliced.traced.in_leaves
    optimizer_bytes = [sum(leaves[i].nbytes for i in inputs if not param_mask[i]) for inputs in sliced.optimizer_inputs]
    k = len(sliced.summaries)
    costs = profile_stage_costs(sliced.jaxpr, sliced.pieces, sliced.summaries, param_mask, optimizer_bytes, cluster,
                                [(1, 1)], [[(1, 1)]], PassOptions(rates=cluster.compute_rates), max_workers=1).costs
    params = sum(leaf.nbytes for leaf, is_param in zip(leaves, param_mask, strict=True) if is_param)
    assert costs.mem_stage[0, k - 1, 0, 0] == pytest.approx(2 * params + sum(optimizer_bytes), rel=1e-12)
    middle = costs.mem_stage[1, k - 2, 0, 0]
    assert costs.mem_stage[0, k - 2, 0, 0] - middle >= 2 * embedding  # the lookup's layer holds it
    assert costs.mem_stage[1, k - 1, 0, 0] - middle >= 2 * embedding  # the logits' layer too


def test_a_process_connected_to_ray_solves_on_threads_with_the_same_table(sliced_profile_inputs, profile,
                                                                          monkeypatch):
    """A child forked from a Ray driver can inherit gRPC's locks held by threads it does not have, and hang:
    there the solves run on threads (never in a process pool) and give the same table."""
    import concurrent.futures
    import sys
    import types

    from alpa_like.compiler.stage_profiling import fork_is_safe

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", None)  # calling it fails the test
    assert not fork_is_safe()
    threaded = profile_on_p3(sliced_profile_inputs, [(1, 1), (1, 2)], [[(1, 1)], [(1, 2)]], max_workers=2)
    for name in ("t_intra", "mem_stage", "mem_act"):
        np.testing.assert_array_equal(getattr(threaded.costs, name), getattr(profile.costs, name))
    assert threaded.layer_costs == profile.layer_costs
