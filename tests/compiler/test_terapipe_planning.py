"""Token slicing in planning: closed-form cases of the stage-time model and the plan it prints."""
import jax
import numpy as np
import pytest

import alpa_like as al
from alpa_like.compiler.terapipe_planning import choose_token_slicing, stage_slice_costs
from alpa_like.models import gpt


def test_token_only_floor_model_has_a_closed_form():
    """rho = 0, floor s = L/4, K = 4: four slices of s tokens, each T/4: T + 3 T/4 versus 4 T unsliced."""
    decision = choose_token_slicing([2.0] * 4, [0.0] * 4, 64, 1, 1, saturation_tokens=16)
    assert decision.batch_slices == ((1, (16, 16, 16, 16)),)
    assert decision.latency == pytest.approx(1.75 * 2.0)
    assert decision.latency_unsliced == pytest.approx(4 * 2.0)


def test_no_slicing_kept_when_it_does_not_help():
    """One stage, no attention: slices of >= s tokens cost the same in sum and shorter ones more (the floor),
    so the plan keeps whole sequences. (With attention, slicing also skips the masked half of each block.)"""
    decision = choose_token_slicing([1.0], [0.0], 32, 2, 4, saturation_tokens=8)
    assert decision.batch_slices == ()
    assert decision.latency == decision.latency_unsliced


def test_stage_cost_is_the_stage_time_for_the_whole_sequence():
    cost = stage_slice_costs(3.0, 0.25, 128, saturation_tokens=32)
    assert float(cost(128, 0)) == pytest.approx(3.0)
    assert float(cost(8, 0)) == pytest.approx(float(cost(32, 0)) - 3.0 * 0.25 * (32 * 32 - 8 * 8) / 128**2)


def gpt_plan(**method_options):
    config = gpt.GPTConfig(vocab_size=1024, seq_len=512, hidden_size=256, num_layers=8, num_heads=8)
    model = gpt.GPTModel(config)
    params = gpt.gpt_param_shapes(config)
    batch = gpt.gpt_batch_shapes(config, 8, position_ids=True)

    def step(params, batch):
        grads = al.grad(gpt.gpt_loss(model))(params, batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    method = al.PipeshardParallel(num_micro_batches=8, layer_option=al.AutoLayerOption(layer_num=8, eps=None),
                                  stage_option=al.UniformStageOption(num_stages=8, submesh_physical_shape=(1, 1),
                                                                     submesh_logical_shape=(1, 1),
                                                                     show_progress=False),
                                  pipeline_schedule="terapipe", **method_options)
    return al.plan(step, params, batch, method=method, cluster=al.ClusterSpec.preset("p3.16xlarge", num_nodes=1))


def test_token_slices_must_cover_the_sequence():
    with pytest.raises(ValueError, match="must sum to the sequence length 512"):
        gpt_plan(token_slices=(256, 128))


def test_plan_prints_the_token_slicing_scheme():
    plan = gpt_plan()
    assert plan.token_slicing, "8 stages, 8 sequences of 512 tokens: slicing must pay off"
    lengths = plan.token_slicing[0][1]
    assert sum(lengths) == 512 and len(plan.token_slicing) == 8
    assert list(lengths) == sorted(lengths, reverse=True)
    assert plan.estimated_iteration_time < plan.iteration_time_without_token_slicing
    assert f"[(1, {list(lengths)})] x 8" in str(plan)
    assert al.ParallelPlan.from_json(plan.to_json()).token_slicing == plan.token_slicing
