"""The benchmark workloads: GPT gets one layer per block plus one for the logits; Megatron-LM's baseline
still sees one layer per block."""
import pytest

import alpa_like as al
from alpa_like.bench import ours
from alpa_like.compiler.flops import equation_seconds
from alpa_like.compiler.layer_slicing import BACKWARD, FORWARD
from alpa_like.bench.workloads import logits_to_block_flops, make_workload, micro_batch_count_error, transformer_costs
from alpa_like.compiler.options import AutoLayerOption


def test_megatron_sees_one_layer_per_block_with_the_logits_folded_into_the_last():
    workload = make_workload("gpt-tiny", 8)
    method = ours.pipeshard_method(workload, 2, layer_option=AutoLayerOption(layer_num=3, eps=None))
    sliced = ours.slice_workload(workload, method)
    assert len(sliced.summaries) == 3
    costs = transformer_costs(sliced, workload, 2)
    assert costs.num_layers == 2
    per = 8 / 2
    s = sliced.summaries
    assert costs.forward_flops[0] == s[0].forward_flops / per
    assert costs.forward_flops[1] == (s[1].forward_flops + s[2].forward_flops) / per
    assert costs.param_bytes[1] == s[1].param_bytes + s[2].param_bytes
    assert sum(costs.backward_flops) * per == sum(x.backward_flops for x in s)


def test_megatron_layer_seconds_add_up_to_the_step_priced_by_the_compute_model():
    workload = make_workload("gpt-tiny", 8)
    method = ours.pipeshard_method(workload, 2, layer_option=AutoLayerOption(layer_num=3, eps=None))
    sliced = ours.slice_workload(workload, method)
    rates = al.ClusterSpec.preset("h200").compute_rates
    seconds = transformer_costs(sliced, workload, 2, rates).seconds
    assert len(seconds.forward) == 2
    for phase, name in ((FORWARD, "forward"), (BACKWARD, "backward")):
        priced = sum(equation_seconds(e, rates) for e, p in zip(sliced.jaxpr.eqns, sliced.pieces) if p and p.phase == phase)
        # one micro-batch of 4 sequences on one device: the scaled part 4 times, each product's overhead once
        assert seconds.chunk(name, range(2), 4, 1) == pytest.approx(priced, rel=1e-12)
    assert seconds.chunk("forward", range(2), 4, 2) < seconds.chunk("forward", range(2), 4, 1)
    assert all(f > 0 for f in seconds.forward_fixed)  # the blocks' matmuls pay their overhead


def test_gpt_gets_a_layer_for_the_logits():
    assert make_workload("gpt-6.7b", 1024).num_layers == 33
    assert make_workload("gpt-39b", 1024).num_layers == 49
    assert make_workload("gpt-tiny", 8).num_layers == 3
    assert round(logits_to_block_flops(make_workload("gpt-6.7b", 1024).config), 2) == 1.0
    assert round(logits_to_block_flops(make_workload("gpt-39b", 1024).config), 2) == 0.51


def test_gpt_39b_layers_are_its_blocks_and_the_logits():
    """With Eq. 3.6's default slack every cut falls between blocks, where one hidden state crosses: one
    layer per block (the embedding with the first) and the logits alone."""
    workload = make_workload("gpt-39b", 1024)
    sliced = ours.slice_workload(workload, ours.pipeshard_method(workload, 64))
    flops = [s.forward_flops for s in sliced.summaries]
    assert len(flops) == 49
    assert max(flops[:48]) == pytest.approx(min(flops[:48]), rel=0.01)
    assert flops[48] / flops[1] == pytest.approx(logits_to_block_flops(workload.config), rel=0.05)


def test_moe_10b_layers_are_its_sublayers_and_the_logits():
    """MoE marks its own layers (``pipeline_boundaries="sublayer"``): every block's attention, every block's
    MLP, and the logits, 33 layers for MoE-10B's 16 blocks. The attentions cost the same, an expert MLP
    (every other block) more than twice a dense one. Each layer receives exactly one hidden state
    (``tokens x hidden`` FP16) from each neighbour per micro-batch (its input, and its output's gradient)
    (the first and the last have one neighbour) and beside them only FP32 scalars (the MoE layers'
    auxiliary load-balancing losses, which the last layer adds up, and their cotangents)."""
    from alpa_like.compiler.stage_profiling import received_per_micro_batch

    workload = make_workload("moe-10b", 1024)
    assert workload.num_layers == 33 and workload.manual_layers
    sliced = ours.slice_workload(workload, ours.pipeshard_method(workload, 256))
    c = workload.config
    assert len(sliced.summaries) == 33
    flops = [s.forward_flops for s in sliced.summaries]
    attention, dense, expert = flops[2:32:2], [flops[l] for l in range(1, 32, 2) if not c.is_moe_layer(l // 2)], \
        [flops[l] for l in range(1, 32, 2) if c.is_moe_layer(l // 2)]
    assert len(dense) == len(expert) == 8
    assert max(attention) == pytest.approx(min(attention), rel=1e-6)
    assert min(expert) > 2 * max(dense) > 2 * max(attention)
    received = received_per_micro_batch(sliced.jaxpr, sliced.pieces, len(sliced.summaries))
    hidden = 1024 // 256 * c.seq_len * c.hidden_size * 2
    for l in range(33):
        expected = [0 if l == 0 else hidden, 0 if l == 32 else hidden]
        assert all(0 <= b - e <= 4 for b, e in zip(received.neighbour_bytes[l, l], expected)), l
        assert 0 <= received.num_bytes[l, l] - sum(expected) <= 4 * 8  # the 8 MoE layers' scalars at most


def _tree_bytes(tree) -> int:
    import math

    import jax
    import numpy as np
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def test_moe_trains_with_adafactor_whose_state_is_under_one_percent_of_the_parameters():
    """Alpa's MoE comparison uses Adafactor (workloads.OPTIMIZERS); with Adam MoE-70B's parameters, gradients
    and two moments (16 bytes each) exceed a 16 GiB V100 on 64 GPUs before any activation."""
    state = make_workload("moe-70b", 1024).args[0]
    params, optimizer = _tree_bytes(state.params), _tree_bytes(state.opt_state)
    assert optimizer < 0.01 * params
    num_params = params / 4  # float32
    assert 16 * num_params / 64 > 16 * 2**30 > (params + params + optimizer) / 64


def test_gpt_and_wide_resnet_keep_adam():
    gpt_state = make_workload("gpt-tiny", 8).args[0]
    assert _tree_bytes(gpt_state.opt_state) == pytest.approx(2 * _tree_bytes(gpt_state.params), abs=64)
    wresnet_state = make_workload("wresnet-tiny", 8).args[0]["train"]
    assert _tree_bytes(wresnet_state.opt_state) == pytest.approx(2 * _tree_bytes(wresnet_state.params), abs=64)


def test_micro_batch_counts_must_divide_the_batch_and_keep_whole_moe_routing_groups():
    import dataclasses

    gpt = make_workload("gpt-tiny", 8)
    assert micro_batch_count_error(gpt, 8) is None
    assert micro_batch_count_error(gpt, 3) == "3 micro-batches do not divide the global batch 8"
    moe = make_workload("moe-tiny", 8)  # 16 tokens per sequence
    moe = dataclasses.replace(moe, config=dataclasses.replace(moe.config, expert_group_size=32))
    assert micro_batch_count_error(moe, 4) is None  # 2 sequences: one whole group of 32 tokens
    assert micro_batch_count_error(moe, 8) == ("a micro-batch of 16 tokens is less than one routing group "
                                               "(expert_group_size=32)")
