"""The data-parallel baselines: DeepSpeed-style expert parallelism's grid, memory and bad input."""
import dataclasses
import math

import jax
import numpy as np
import pytest

from alpa_like.bench import baselines, ours
from alpa_like.bench.workloads import cluster_for, make_workload

from alpa_like.compiler.flops import ComputeRates, eqn_flops
from alpa_like.compiler.logical_mesh import LogicalMesh


@pytest.fixture(scope="module")
def tiny_moe():
    workload = make_workload("moe-tiny", 8)
    sliced = ours.slice_workload(workload, ours.pipeshard_method(workload, 2))
    return workload, baselines.step_totals(sliced, workload, 2, cluster_for(4).compute_rates)


def test_step_seconds_price_each_equation_at_its_rate():
    workload = make_workload("moe-tiny", 8)
    sliced = ours.slice_workload(workload, ours.pipeshard_method(workload, 2))
    peak = 1e12
    flat = baselines.step_totals(sliced, workload, 2, ComputeRates(peak_flops=peak))
    # one rate for everything: the seconds are the FLOPs at that rate
    assert flat.step_seconds == pytest.approx(flat.step_flops / peak)
    assert flat.apply_seconds == pytest.approx(flat.apply_flops / peak)
    assert flat.compute_seconds(4) == pytest.approx((flat.step_flops + flat.apply_flops) / (4 * peak))
    # at a 10x slower FP32 rate the step costs 9x the FLOPs of its float32 matrix products (the MoE gating's
    # einsums, some inside remat) more, per micro-batch
    fp32 = ComputeRates(peak_flops=peak, fp32_peak_flops=peak / 10)
    slow = baselines.step_totals(sliced, workload, 2, fp32)

    def fp32_flops(eqns):
        total = 0.0
        for e in eqns:
            assert e.primitive.name not in ("scan", "while", "cond")  # every nested program runs once
            if e.primitive.name in ("remat2", "jit", "custom_jvp_call"):
                body = e.params.get("jaxpr") or e.params["call_jaxpr"]
                total += fp32_flops(getattr(body, "jaxpr", body).eqns)
            elif fp32.flop_rate(e) < peak:
                total += eqn_flops(e)
        return total
    gating = fp32_flops(e for e, p in zip(sliced.jaxpr.eqns, sliced.pieces) if p is not None and p.phase != "apply")
    assert gating > 0
    assert slow.step_seconds == pytest.approx(flat.step_seconds + 2 * gating * 9 / peak)
    assert slow.step_flops == flat.step_flops


def test_gpt_steps_have_no_float32_matrix_products():
    # the Megatron-LM baseline prices GPT's FLOPs at peak_flops: right only while none runs at the FP32 rate
    workload = make_workload("gpt-tiny", 8)
    sliced = ours.slice_workload(workload, ours.pipeshard_method(workload, 2))
    flat = baselines.step_totals(sliced, workload, 2, ComputeRates(peak_flops=1e12))
    slow = baselines.step_totals(sliced, workload, 2, ComputeRates(peak_flops=1e12, fp32_peak_flops=1e11))
    assert (slow.step_seconds, slow.apply_seconds) == (flat.step_seconds, flat.apply_seconds)


def test_expert_parallel_degrees_divide_experts_and_devices():
    assert baselines.expert_parallel_degrees(32, 16) == [1, 2, 4, 8, 16]
    assert baselines.expert_parallel_degrees(48, 32) == [1, 2, 4, 8, 16]
    assert baselines.expert_parallel_degrees(4, 1) == [1]


def test_expert_parallel_memory_is_experts_split_by_ep_and_zero2_shards(tiny_moe):
    workload, totals = tiny_moe
    cluster = cluster_for(4)
    state = workload.args[0]
    leaves = jax.tree.leaves(state.params)
    size = lambda x: math.prod(x.shape) * np.dtype(x.dtype).itemsize
    expert = sum(size(x) for x in leaves if len(x.shape) == 3 and x.shape[0] == 4)
    dense = sum(size(x) for x in leaves) - expert
    optimizer = sum(size(x) for x in jax.tree.leaves(state.opt_state))
    assert expert > 0 and dense > 0
    for ep in (1, 2, 4):
        for m in (1, 2):
            result = baselines.expert_parallel_estimate(workload, totals, cluster, ep, m)
            expected = (dense + expert / ep + (dense + expert) / 4 + optimizer / 4
                        + totals.activation_bytes_per_sequence * 8 / (4 * m))
            assert result.memory_per_device == pytest.approx(expected)
            assert result.num_micro_batches == m and result.detail.startswith(f"EP={ep}")


def test_expert_parallel_baseline_is_the_fastest_fitting_grid_point(tiny_moe):
    workload, totals = tiny_moe
    cluster = cluster_for(4)
    grid = [baselines.expert_parallel_estimate(workload, totals, cluster, ep, m) for ep in (1, 2, 4) for m in (1, 2)]
    best = baselines.expert_parallel_baseline(workload, totals, cluster)
    assert best.step_seconds == min(r.step_seconds for r in grid)
    # splitting the experts over the devices holds less per device than replicating them
    full = baselines.expert_parallel_estimate(workload, totals, cluster, 4, 1)
    none = baselines.expert_parallel_estimate(workload, totals, cluster, 1, 1)
    assert full.memory_per_device < none.memory_per_device


def test_nothing_fits_gives_no_step_time(tiny_moe):
    workload, totals = tiny_moe
    cluster = dataclasses.replace(cluster_for(4), device_memory=1)
    result = baselines.expert_parallel_baseline(workload, totals, cluster)
    assert result.step_seconds is None and "does not fit at any EP and micro-batch count" in result.detail


def test_bad_expert_parallel_degree_is_a_clear_error(tiny_moe):
    workload, totals = tiny_moe
    with pytest.raises(ValueError, match="ep must divide both the 4 experts and the 4 devices, got 3"):
        baselines.expert_parallel_estimate(workload, totals, cluster_for(4), 3, 1)
    with pytest.raises(ValueError, match="expert parallelism needs an MoE workload, got 'gpt'"):
        baselines.expert_parallel_baseline(make_workload("gpt-tiny", 8), totals, cluster_for(4))


def test_collectives_inside_a_node_are_one_ring():
    cluster = cluster_for(8)
    mesh = LogicalMesh.from_cluster(cluster, (1, 8), (8,))
    for kind, price in (("all-reduce", mesh.all_reduce_cost), ("reduce-scatter", mesh.reduce_scatter_cost),
                        ("all-gather", mesh.all_gather_cost)):
        assert baselines.collective_seconds(kind, 1e9, cluster, 8, 8) == pytest.approx(price(1e9, 0))


def test_collectives_across_nodes_send_one_share_per_device_across():
    """Two nodes of 8: the hierarchical all-reduce of B bytes is a reduce-scatter and an all-gather inside
    the node (7/8 B each over NVLink) and an all-reduce of B/8 across the 2 nodes (2 * 1/2 * B/8 at one
    device's share of the network), far below one ring's 2 * 15/16 * B at that share."""
    cluster = cluster_for(16)
    b, inter, intra = 8e9, 1 / cluster.inter_node_bandwidth, 1 / cluster.intra_node_bandwidth
    a_in, a_out = cluster.intra_node_latency, cluster.inter_node_latency
    expected = 2 * (a_in + 7 / 8 * b * intra) + a_out + 2 * (1 / 2) * (b / 8) * inter
    assert baselines.collective_seconds("all-reduce", b, cluster, 16, 8) == pytest.approx(expected)
    assert expected < a_out + 2 * 15 / 16 * b * inter
    assert baselines.collective_seconds("reduce-scatter", b, cluster, 16, 8) == pytest.approx(
        a_in + 7 / 8 * b * intra + a_out + 1 / 2 * (b / 8) * inter)
    with pytest.raises(ValueError, match="kind must be all-reduce, reduce-scatter, all-gather or all-to-all, "
                                         "got 'broadcast'"):
        baselines.collective_seconds("broadcast", b, cluster, 16, 8)


def test_all_to_all_inside_a_node_is_the_logical_mesh_price():
    cluster = cluster_for(16)
    mesh = LogicalMesh.from_cluster(cluster, (1, 8), (8,))
    assert baselines.collective_seconds("all-to-all", 1e9, cluster, 8, 8) == pytest.approx(mesh.all_to_all_cost(1e9, 0))


def test_all_to_all_across_nodes_sends_only_the_other_nodes_pieces_across():
    """16 devices on 2 nodes, each holding B/16: it sends 8 of its 16 pieces (B/256 each) to the other node at
    one device's share of the NIC and 7 inside its node over NVLink at the same time; a ring over the 16
    would send all 15 at the network share."""
    cluster = cluster_for(16)
    b, inter, intra = 8e9, 1 / cluster.inter_node_bandwidth, 1 / cluster.intra_node_bandwidth
    expected = cluster.inter_node_latency + max(8 * b / 256 * inter, 7 * b / 256 * intra)
    assert baselines.collective_seconds("all-to-all", b, cluster, 16, 8) == pytest.approx(expected)
    assert expected < cluster.inter_node_latency + 15 * b / 256 * inter
    # four nodes: 24 of the 32 pieces cross
    big = cluster_for(32)
    assert baselines.collective_seconds("all-to-all", b, big, 32, 8) == pytest.approx(
        big.inter_node_latency + 24 * b / 32**2 * inter)


def test_expert_parallel_all_to_all_is_priced_per_node(tiny_moe):
    """Two nodes of 2 devices: EP=4 spans both nodes and holds each expert once (no expert gradient to
    reduce), so its communication is the dense ZeRO-2 reduce-scatter and all-gather over the 4 devices plus
    six all-to-alls per MoE layer and micro-batch at collective_seconds' node-aware price of the dispatched
    slots (2 per token, capacity factor 1, FP16)."""
    workload, totals = tiny_moe
    cluster = dataclasses.replace(cluster_for(4), num_nodes=2, num_devices_per_node=2)
    config, m = workload.config, 2
    leaves = jax.tree.leaves(workload.args[0].params)
    dense = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves
                if not (len(x.shape) == 3 and x.shape[0] == config.num_experts))
    tokens = workload.global_batch * config.seq_len / (4 * m)
    dispatched = tokens * 2 * config.capacity_factor * config.hidden_size * 2
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    expected = (baselines.collective_seconds("reduce-scatter", dense, cluster, 4, 2)
                + baselines.collective_seconds("all-gather", dense, cluster, 4, 2)
                + 6 * moe_layers * m * baselines.collective_seconds("all-to-all", dispatched * 4, cluster, 4, 2))
    result = baselines.expert_parallel_estimate(workload, totals, cluster, 4, m)
    assert moe_layers > 0 and result.communication_seconds == pytest.approx(expected)
