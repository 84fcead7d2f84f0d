"""The benchmark workloads: GPT gets one layer per block plus one for the logits; Megatron-LM's baseline
still sees one layer per block."""
from alpa_like.bench import ours
from alpa_like.bench.workloads import logits_to_block_flops, make_workload, transformer_costs
from alpa_like.pipeshard import AutoLayerOption


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


def test_gpt_gets_a_layer_for_the_logits_only_when_they_cost_about_a_block():
    assert make_workload("gpt-6.7b", 1024).num_layers == 33  # V / (12 h + 2 s) = 51200 / 51200
    assert make_workload("gpt-39b", 1024).num_layers == 48  # 0.51: the logits join the last block
    assert make_workload("gpt-tiny", 8).num_layers == 2
    assert round(logits_to_block_flops(make_workload("gpt-39b", 1024).config), 2) == 0.51
