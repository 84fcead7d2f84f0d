"""The benchmark workloads: GPT gets one layer per block plus one for the logits; Megatron-LM's baseline
still sees one layer per block."""
from alpa_like.bench import ours
from alpa_like.bench.workloads import make_workload, transformer_costs


def test_megatron_sees_one_layer_per_block_with_the_logits_folded_into_the_last():
    workload = make_workload("gpt-tiny", 8)
    assert workload.num_layers == workload.config.num_layers + 1
    sliced = ours.slice_workload(workload, ours.pipeshard_method(workload, 2))
    assert len(sliced.summaries) == 3
    costs = transformer_costs(sliced, workload, 2)
    assert costs.num_layers == 2
    per = 8 / 2
    s = sliced.summaries
    assert costs.forward_flops[0] == s[0].forward_flops / per
    assert costs.forward_flops[1] == (s[1].forward_flops + s[2].forward_flops) / per
    assert costs.param_bytes[1] == s[1].param_bytes + s[2].param_bytes
    assert sum(costs.backward_flops) * per == sum(x.backward_flops for x in s)
