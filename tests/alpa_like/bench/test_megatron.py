"""The Megatron-LM baseline: its configuration grid, its cost model and the grid search."""
import dataclasses

import pytest

import alpa_like as al
from alpa_like.bench import megatron
from alpa_like.bench.megatron import (LayerSeconds, MegatronConfig, TransformerCosts, enumerate_configs, estimate,
                                      grid_search,
                                      load_seconds, replay, shared_parameters,
                                      tied_sync_seconds)

GIB = 2**30


def uniform_costs(num_layers=4, fwd=1e12, heads=4, param_bytes=1e8, activation_bytes=1e6, recompute=True):
    return TransformerCosts(forward_flops=(fwd,) * num_layers, backward_flops=(2 * fwd,) * num_layers,
                            apply_flops=(1e6,) * num_layers, param_bytes=(param_bytes,) * num_layers,
                            optimizer_bytes=(2 * param_bytes,) * num_layers,
                            activation_bytes=(activation_bytes,) * num_layers, hidden_bytes=1e6, num_heads=heads,
                            recompute=recompute)


def cluster(nodes=1, per_node=4, bandwidth=100e9, latency=1e-5, memory=16 * GIB):
    return al.ClusterSpec(name="test", num_nodes=nodes, num_devices_per_node=per_node, device_name="x",
                          peak_flops=100e12, device_memory=memory, intra_node_bandwidth=bandwidth,
                          inter_node_bandwidth=bandwidth / 10, intra_node_latency=latency,
                          inter_node_latency=10 * latency)


def test_grid_matches_a_hand_enumeration():
    got = {(c.t, c.p, c.d, c.b, c.v) for c in enumerate_configs(
        num_devices=4, devices_per_node=4, num_layers=4, num_heads=4, global_batch=8, micro_batch_sizes=(1, 2),
        virtual_stages=(1, 2))}
    expected = {(1, 1, 4, 1, 1), (1, 1, 4, 2, 1),
                (1, 2, 2, 1, 1), (1, 2, 2, 1, 2), (1, 2, 2, 2, 1), (1, 2, 2, 2, 2),
                (1, 4, 1, 1, 1), (1, 4, 1, 2, 1),  # v=2 would need 8 chunks of 4 layers
                (2, 1, 2, 1, 1), (2, 1, 2, 2, 1),
                (2, 2, 1, 1, 1), (2, 2, 1, 1, 2), (2, 2, 1, 2, 1), (2, 2, 1, 2, 2),
                (4, 1, 1, 1, 1), (4, 1, 1, 2, 1)}
    assert got == expected


def test_grid_respects_heads_node_size_and_interleaving_rules():
    configs = enumerate_configs(num_devices=16, devices_per_node=8, num_layers=12, num_heads=6, global_batch=48)
    assert configs
    for c in configs:
        m = c.num_micro_batches(48)
        assert c.t * c.p * c.d == 16 and 8 % c.t == 0 and 6 % c.t == 0 and 12 % c.p == 0
        assert 48 % (c.b * c.d) == 0
        assert c.v == 1 or (c.p > 1 and m % c.p == 0 and 12 % (c.p * c.v) == 0)
    assert {c.t for c in configs} == {1, 2}  # 4 and 8 do not divide 6 heads
    assert any(c.v > 1 for c in configs)


def test_1f1b_closed_form_textbook_case():
    """Two stages, no communication cost: (m + p - 1)(t_f + t_b) plus the optimizer update."""
    costs = uniform_costs()
    fast = cluster(per_node=2, bandwidth=1e30, latency=0.0)
    est = estimate(MegatronConfig(t=1, p=2, d=1, b=1), costs, fast, global_batch=8)
    t_f, t_b = 2 * 1e12 / 100e12, 2 * 2e12 / 100e12
    apply = 2 * 1e6 / 100e12
    assert est.num_micro_batches == 8
    assert est.step_seconds == pytest.approx((8 + 2 - 1) * (t_f + t_b) + apply, rel=1e-9)
    assert replay(est) == pytest.approx(est.step_seconds, rel=1e-9)


def test_layer_seconds_and_launches_price_the_chunks_like_our_plans():
    """Per layer: b/t of its per-sequence split seconds, b times its repeated ones, plus its products'
    overheads; per chunk run: one launch."""
    seconds = LayerSeconds(forward=(1e-3,) * 4, backward=(2e-3,) * 4, apply=(1e-5,) * 4,
                           forward_repeated=(3e-4,) * 4, backward_repeated=(5e-4,) * 4, apply_repeated=(1e-7,) * 4,
                           forward_fixed=(1e-4,) * 4, backward_fixed=(2e-4,) * 4, apply_fixed=(3e-6,) * 4)
    costs = dataclasses.replace(uniform_costs(), seconds=seconds)
    fast = dataclasses.replace(cluster(per_node=4, bandwidth=1e30, latency=0.0), launch_overhead=5e-5)
    est = estimate(MegatronConfig(t=2, p=2, d=1, b=2), costs, fast, global_batch=8)
    t_f = 2 * (2 * (1e-3 / 2 + 3e-4) + 1e-4) + 5e-5  # two layers per stage
    t_b = 2 * (2 * (2e-3 / 2 + 5e-4) + 2e-4) + 5e-5
    apply = 2 * (1e-5 / 2 + 1e-7 + 3e-6) + 5e-5
    assert est.num_micro_batches == 4
    assert est.step_seconds == pytest.approx((4 + 2 - 1) * (t_f + t_b) + apply, rel=1e-9)
    assert replay(est) == pytest.approx(est.step_seconds, rel=1e-9)
    with pytest.raises(ValueError, match="seconds.forward must have one entry per layer"):
        dataclasses.replace(costs, seconds=dataclasses.replace(seconds, forward=(1e-3,)))


@pytest.mark.parametrize("config", [MegatronConfig(t=1, p=4, d=1, b=1), MegatronConfig(t=1, p=2, d=1, b=2, v=2),
                                    MegatronConfig(t=1, p=2, d=1, b=1, v=4), MegatronConfig(t=2, p=2, d=1, b=1, v=2)])
def test_closed_form_equals_schedule_replay_for_equal_stages(config):
    costs = uniform_costs(num_layers=8)
    free = estimate(config, costs, cluster(per_node=config.t * config.p, bandwidth=1e30, latency=0.0), global_batch=8)
    assert replay(free) == pytest.approx(free.step_seconds, rel=1e-9)
    # With sends the end stages are a little faster (nothing to send one way): the closed form, which
    # charges every micro-batch the slowest stage, is an upper bound within a send per micro-batch.
    est = estimate(config, costs, cluster(per_node=config.t * config.p), global_batch=8)
    assert est.step_seconds - 8 * 2 * 1e-5 * config.v <= replay(est) <= est.step_seconds


def test_interleaving_shrinks_the_bubble_by_v():
    costs = uniform_costs(num_layers=8)
    fast = cluster(per_node=4, bandwidth=1e30, latency=0.0)
    plain = estimate(MegatronConfig(t=1, p=4, d=1, b=1), costs, fast, 8)
    looped = estimate(MegatronConfig(t=1, p=4, d=1, b=1, v=2), costs, fast, 8)
    work = plain.pipeline_seconds / (8 + 3)  # one micro-batch on one stage
    assert plain.pipeline_seconds - 8 * work == pytest.approx(3 * work)
    assert looped.pipeline_seconds - 8 * work == pytest.approx(3 * work / 2)


def test_search_returns_the_fastest_fitting_configuration():
    costs = uniform_costs(num_layers=8, param_bytes=2 * GIB)
    spec = cluster(nodes=2, per_node=4)
    search = grid_search(costs, spec, global_batch=32)
    fitting = [e for e in search.evaluated if e.fits]
    assert search.best is not None and search.best.fits
    assert search.best.step_seconds == min(e.step_seconds for e in fitting)
    assert 0 < search.num_fitting < len(search.evaluated)  # 8 layers x 2 GiB x 4 bytes-per-byte do not fit unsplit


def test_free_communication_and_ample_memory_avoid_the_pipeline_bubble():
    spec = cluster(nodes=2, per_node=4, bandwidth=1e30, latency=0.0, memory=10**6 * GIB)
    best = grid_search(uniform_costs(num_layers=8), spec, global_batch=64).best
    # No bubble (p = 1); with free all-reduces the only other difference is the optimizer update, which
    # tensor parallelism splits t ways and data parallelism repeats: the largest t in a node wins.
    assert (best.config.t, best.config.p, best.config.d) == (4, 1, 2)
    work = 8 * 3e12 * 64 / (8 * 100e12)
    assert best.step_seconds == pytest.approx(work + 8 * 1e6 / (4 * 100e12), rel=1e-9)


def test_no_fitting_configuration_gives_none():
    search = grid_search(uniform_costs(param_bytes=64 * GIB), cluster(), global_batch=8)
    assert search.best is None and search.num_fitting == 0 and search.evaluated


def test_tensor_parallelism_pays_its_all_reduces():
    costs = uniform_costs()
    spec = cluster(per_node=2)
    with_tp = estimate(MegatronConfig(t=2, p=1, d=1, b=1), costs, spec, 4)
    no_comm = estimate(MegatronConfig(t=2, p=1, d=1, b=1), costs, cluster(per_node=2, bandwidth=1e30, latency=0.0), 4)
    per_all_reduce = 1e-5 + 2 * (1 / 2) * 1e6 / 100e9
    assert with_tp.pipeline_seconds - no_comm.pipeline_seconds == pytest.approx(4 * 4 * (2 + 4) * per_all_reduce)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="uses 8 devices, the cluster has 4"):
        estimate(MegatronConfig(t=2, p=2, d=2, b=1), uniform_costs(), cluster(), 8)
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        enumerate_configs(num_devices=4, devices_per_node=4, num_layers=4, num_heads=0, global_batch=8)
    with pytest.raises(ValueError, match="one entry per layer"):
        dataclasses.replace(uniform_costs(), apply_flops=(1.0,))


def test_tied_parameters_are_all_reduced_between_first_and_last_stage():
    """A 4-layer model whose first and last layer share 8e8 bytes (a tied embedding), p = 2 stages of t * d = 4
    devices on two 4-device nodes: after the pipeline both stages all-reduce ``1/t`` of it across nodes, a
    two-party ring: 2 latencies + (2 - 1) / 2 * 2 * bytes / t / inter-node bandwidth; it adds to the step."""
    c = cluster(nodes=2, per_node=4)
    plain = uniform_costs()
    tied = dataclasses.replace(plain, shared_params=((8e8, (0, 3)),))
    config = MegatronConfig(t=2, p=2, d=2, b=1)
    expected = 2 * c.inter_node_latency + 8e8 / 2 / c.inter_node_bandwidth
    assert tied_sync_seconds(c, config, tied) == pytest.approx((expected, expected))
    gap = estimate(config, tied, c, 8).step_seconds - estimate(config, plain, c, 8).step_seconds
    assert gap == pytest.approx(expected)
    # One stage holds both layers: nothing to reduce. Two stages on one node: the NVLink price.
    assert tied_sync_seconds(c, MegatronConfig(t=4, p=1, d=2, b=1), tied) == (0.0,)
    one_node = cluster(nodes=1, per_node=8)
    assert tied_sync_seconds(one_node, config, tied)[0] == pytest.approx(
        2 * one_node.intra_node_latency + 8e8 / 2 / one_node.intra_node_bandwidth)
    # Stages of t * d = 2 ranks, two per node: the stage's 2 ranks have the node's NIC, 4 shares, to themselves.
    small = MegatronConfig(t=1, p=4, d=2, b=1)
    across = 2 * c.inter_node_latency + 8e8 / (4 / 2 * c.inter_node_bandwidth)
    assert tied_sync_seconds(c, small, tied) == pytest.approx((across, 0.0, 0.0, across))
    with pytest.raises(ValueError, match="shared_params"):
        dataclasses.replace(plain, shared_params=((1.0, (0,)),))


def test_a_send_across_nodes_has_the_nic_of_the_stages_ranks():
    """p = 4 stages of t * d = 2 ranks on two 4-device nodes: stage 0 sends to stage 1 over NVLink, stage 1
    to stage 2 across nodes, each of the d = 2 replicas' 1/t of the activation through the node's NIC, which
    moves 4 shares and serves only the stage's 2 ranks: 2 shares each (our plans are priced the same)."""
    c = cluster(nodes=2, per_node=4)
    est = estimate(MegatronConfig(t=1, p=4, d=2, b=1), uniform_costs(), c, 8)
    hidden = 1e6
    inside = c.intra_node_latency + hidden / c.intra_node_bandwidth
    across = c.inter_node_latency + hidden / (4 / 2 * c.inter_node_bandwidth)
    assert est.forward_sends[0].seconds == pytest.approx(inside) and not est.forward_sends[0].nics
    assert est.forward_sends[1].seconds == pytest.approx(across)
    assert est.forward_sends[1].nics == {(0, "out"), (1, "in")}
    assert est.backward_sends[2].nics == {(1, "out"), (0, "in")} and est.forward_sends[3] is None
    # Stages filling their node (t * d = 4): each rank has its own share, the whole NIC over the 4 ranks.
    full = estimate(MegatronConfig(t=2, p=2, d=2, b=1), uniform_costs(), c, 8)
    free = estimate(MegatronConfig(t=2, p=2, d=2, b=1), uniform_costs(), dataclasses.replace(
        c, inter_node_bandwidth=1e30, inter_node_latency=0.0), 8)
    assert full.forward_sends[0].seconds - free.forward_sends[0].seconds == pytest.approx(
        c.inter_node_latency + hidden / 2 / c.inter_node_bandwidth)


def test_gpt_tied_embedding_is_found_in_the_first_and_last_layer():
    from alpa_like.bench import ours
    from alpa_like.bench.workloads import make_workload, transformer_costs
    from alpa_like.compiler.options import AutoLayerOption

    workload = make_workload("gpt-tiny", 8)
    sliced = ours.slice_workload(workload, ours.pipeshard_method(
        workload, 2, layer_option=AutoLayerOption(layer_num=3, eps=None)))
    config = workload.config
    embedding = config.vocab_size * config.hidden_size * 4  # float32 parameters
    assert embedding in [b for b, _ in shared_parameters(sliced.jaxpr, sliced.pieces,
                                                         [r == "param" for r in sliced.roles])]
    assert transformer_costs(sliced, workload, 2).shared_params == ((float(embedding), (0, 1)),)


def test_gpt_batch_inputs_are_loaded_by_the_chunks_that_read_them():
    """gpt-tiny's step reads its tokens in the first layer and its labels in the last; per sequence each is
    ``seq_len`` int32s. The chunk reading one pays a latency plus ``b`` sequences of it at the intra-node
    bandwidth in its forward, as the simulated backend prices our plans' LOADs."""
    from alpa_like.bench import ours
    from alpa_like.bench.workloads import make_workload, transformer_costs
    from alpa_like.compiler.options import AutoLayerOption

    workload = make_workload("gpt-tiny", 8)
    sliced = ours.slice_workload(workload, ours.pipeshard_method(
        workload, 2, layer_option=AutoLayerOption(layer_num=3, eps=None)))
    costs = transformer_costs(sliced, workload, 2)
    per_sequence = workload.config.seq_len * 4.0
    assert sorted(costs.batch_inputs) == [(per_sequence, (0,)), (per_sequence, (costs.num_layers - 1,))]
    c = cluster()
    one_load = c.intra_node_latency + 2 * per_sequence / c.intra_node_bandwidth
    assert load_seconds(c, costs, range(0, 1), 2) == pytest.approx(one_load)
    assert load_seconds(c, costs, range(0, costs.num_layers), 2) == pytest.approx(2 * one_load)
    config = MegatronConfig(t=1, p=1, d=4, b=2)
    unloaded = dataclasses.replace(costs, batch_inputs=())
    gap = (estimate(config, costs, c, 64).stage_forward_seconds[0]
           - estimate(config, unloaded, c, 64).stage_forward_seconds[0])
    assert gap == pytest.approx(2 * one_load)
    with pytest.raises(ValueError, match="batch_inputs"):
        dataclasses.replace(costs, batch_inputs=((1.0, ()),))


def test_replay_receives_before_a_chunk_and_sends_through_one_nic_take_turns():
    """1F1B on p = 2 stages, m = 2, every chunk 1 s, every send 0.5 s through one shared NIC. Mesh 1
    receives F0.0 in [1, 1.5], runs F1.0 and B1.0 until 3.5; at 3.5 both B0.0's gradient (to mesh 0) and
    F0.1's activation (to mesh 1, ready since 2) are to be received: alone each takes [3.5, 4]; through one
    NIC the second (F1.1's, later in the schedule's tick order) waits until 4. So mesh 1 ends at 6.5 instead
    of 6, and mesh 0 receives B1.1's gradient after it: 8 s instead of 7.5 s."""
    base = estimate(MegatronConfig(t=1, p=2, d=1, b=1), uniform_costs(num_layers=2), cluster(per_node=2),
                    global_batch=2)
    nic = frozenset({(0, "in")})
    send = megatron.Send(0.5, nic)
    est = dataclasses.replace(base, stage_forward_seconds=(1.0, 1.0), stage_backward_seconds=(1.0, 1.0),
                              forward_sends=(send, None), backward_sends=(None, send), sync_seconds=0.0)
    assert est.num_micro_batches == 2
    assert replay(est) == pytest.approx(8.0)
    assert replay(est, nic_contention=False) == pytest.approx(7.5)
    # Sends on disjoint NICs do not wait for each other.
    other = megatron.Send(0.5, frozenset({(1, "in")}))
    assert replay(dataclasses.replace(est, backward_sends=(None, other))) == pytest.approx(7.5)


def test_interleaved_wraparound_sends_share_nics_in_the_replay():
    """p = 3 stages of one 4-device node each, v = 2: besides the sends between neighbouring nodes, chunk
    2 -> 3 goes from node 2 back to node 0, through NICs that other chunks' sends use at the same time; the
    replay with contention is slower. Plain 1F1B on the same stages is unaffected (each NIC serves one
    stage, whose receives are sequential anyway)."""
    c = cluster(nodes=3, per_node=4)
    costs = dataclasses.replace(uniform_costs(num_layers=6), hidden_bytes=1e8)  # sends of ~2.5 ms, chunks of 10
    looped = estimate(MegatronConfig(t=1, p=3, d=4, b=1, v=2), costs, c, 48)
    assert looped.forward_sends[2].nics == {(2, "out"), (0, "in")}
    assert replay(looped) > 1.005 * replay(looped, nic_contention=False)
    plain = estimate(MegatronConfig(t=1, p=3, d=4, b=1), costs, c, 48)
    assert replay(plain) == pytest.approx(replay(plain, nic_contention=False), rel=1e-12)


def test_best_replayed_keeps_the_fastest_replayed_of_the_closed_forms_best():
    spec = cluster(nodes=2, per_node=4)
    search = grid_search(uniform_costs(num_layers=8, param_bytes=2 * GIB), spec, global_batch=32)
    est, seconds, replayed = megatron.best_replayed(search, candidates=4)
    fitting = sorted((e for e in search.evaluated if e.fits), key=lambda e: e.step_seconds)[:4]
    assert replayed and est in fitting
    assert seconds == pytest.approx(min(replay(e) for e in fitting))
    assert megatron.best_replayed(grid_search(uniform_costs(param_bytes=64 * GIB), cluster(), 8)) is None


def test_every_stage_reading_a_tied_parameter_holds_a_copy_with_its_state():
    """A 4-layer model whose first and last layer share 8e8 bytes; optimizer state is 2 bytes per parameter
    byte (uniform_costs). On p = 2 stages the last stage holds a second copy: parameter, gradient and state,
    4 bytes per byte, 3.2e9 bytes over its t ranks; one stage holding both layers holds one copy."""
    plain = uniform_costs(activation_bytes=0.0)  # every stage then holds as much as the other
    tied = dataclasses.replace(plain, shared_params=((8e8, (0, 3)),))
    assert megatron.replica_state_bytes(MegatronConfig(t=2, p=2, d=2, b=1), tied) == (0.0, 3.2e9)
    assert megatron.replica_state_bytes(MegatronConfig(t=4, p=1, d=2, b=1), tied) == (0.0,)
    c = cluster(nodes=2, per_node=4, memory=10**6 * GIB)
    config = MegatronConfig(t=2, p=2, d=2, b=1)
    gap = estimate(config, tied, c, 8).memory_per_device - estimate(config, plain, c, 8).memory_per_device
    assert gap == pytest.approx(3.2e9 / 2)


def test_parameters_held_whole_are_not_divided_over_the_tensor_parallel_ranks():
    """4 layers of 1e8 parameter bytes and 2e8 optimizer bytes, of which 1e7 and 2e7 belong to parameters every
    tensor-parallel rank holds whole (LayerNorms, row-parallel biases, the position table). A stage of 2 layers
    on t = 2 ranks holds ``(2e8 - 2e7) / 2 + 2e7`` parameter bytes and as many gradient bytes, and
    ``(4e8 - 4e7) / 2 + 4e7`` optimizer bytes per rank; with t = 1 the split makes no difference."""
    plain = uniform_costs(activation_bytes=0.0)
    whole = dataclasses.replace(plain, replicated_param_bytes=(1e7,) * 4, replicated_optimizer_bytes=(2e7,) * 4)
    c = cluster(nodes=1, per_node=4, memory=10**6 * GIB)
    split = MegatronConfig(t=2, p=2, d=1, b=1)
    params, optimizer = (2e8 - 2e7) / 2 + 2e7, (4e8 - 4e7) / 2 + 4e7
    assert estimate(split, whole, c, 8).memory_per_device == pytest.approx(2 * params + optimizer, rel=1e-12)
    assert estimate(split, plain, c, 8).memory_per_device == pytest.approx(2 * 2e8 / 2 + 4e8 / 2, rel=1e-12)
    single = MegatronConfig(t=1, p=4, d=1, b=1)
    assert estimate(single, whole, c, 8).memory_per_device == pytest.approx(2 * 1e8 + 2e8, rel=1e-12)
    assert estimate(single, plain, c, 8).memory_per_device == pytest.approx(2 * 1e8 + 2e8, rel=1e-12)


def test_the_gradient_all_reduce_moves_the_whole_parameters_gradients_in_full():
    """t = 2, d = 2, one stage of 4 layers: each rank all-reduces over ``d`` its half of the split gradients
    and all of the whole ones, ``(4e8 - 4e7) / 2 + 4e7`` bytes."""
    plain = uniform_costs(activation_bytes=0.0)
    whole = dataclasses.replace(plain, replicated_param_bytes=(1e7,) * 4, replicated_optimizer_bytes=(2e7,) * 4)
    c = cluster(nodes=1, per_node=4)
    config = MegatronConfig(t=2, p=1, d=2, b=1)
    mesh = megatron._stage_mesh(c, config)
    gap = estimate(config, whole, c, 8).sync_seconds - estimate(config, plain, c, 8).sync_seconds
    assert gap == pytest.approx(mesh.all_reduce_cost((4e8 - 4e7) / 2 + 4e7, 0) - mesh.all_reduce_cost(4e8 / 2, 0),
                                rel=1e-9)


def test_replicated_bytes_must_fit_in_their_layers():
    with pytest.raises(ValueError, match="replicated_param_bytes must have one entry per layer"):
        dataclasses.replace(uniform_costs(), replicated_param_bytes=(1.0,))
    with pytest.raises(ValueError, match="replicated_optimizer_bytes .* between 0 and the layer's optimizer_bytes"):
        dataclasses.replace(uniform_costs(), replicated_optimizer_bytes=(3e8,) * 4)
