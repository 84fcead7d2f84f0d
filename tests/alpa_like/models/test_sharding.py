"""Megatron specs for GPT, and that they run and match plain jax.jit."""
import jax
import optax
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import alpa_like as al
from alpa_like import models
from alpa_like.models import gpt
from alpa_like.models.sharding import megatron_specs
from tests.helpers import assert_trees_close, make_train_step, reference_on_one_device, run_steps


def test_megatron_specs_split_columns_then_rows():
    params = gpt.gpt_param_shapes(models.get_config("gpt-tiny"))
    specs = megatron_specs(params)
    block = specs["block_0"]
    assert block["attn"]["qkv"]["kernel"] == P(None, "model") and block["attn"]["qkv"]["bias"] == P("model")
    assert block["attn"]["out"]["kernel"] == P("model", None) and block["attn"]["out"]["bias"] == P()
    assert block["mlp"]["fc_in"]["kernel"] == P(None, "model")
    assert block["mlp"]["fc_out"]["kernel"] == P("model", None)
    assert specs["wte"]["embedding"] == P("model", None) and block["ln_1"]["scale"] == P()


def test_megatron_manual_plan_matches_single_device():
    config = models.get_config("gpt-tiny")
    model = gpt.GPTModel(config)
    params = model.init(jax.random.PRNGKey(0), gpt.gpt_batch(config, 2, jax.random.PRNGKey(1))["input_ids"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params["params"],
                                          tx=optax.sgd(0.1, momentum=0.9))
    batches = [gpt.gpt_batch(config, 8, jax.random.PRNGKey(5 + i)) for i in range(2)]
    step = make_train_step(gpt.gpt_loss(model))
    method = al.ManualShardParallel(mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
                                    in_specs=(megatron_specs(state), P("data")))
    f = al.parallelize(step, method=method)
    plan = f.get_executable(state, batches[0]).plan
    assert str(plan.tensor("state.params.block_0.mlp.fc_in.kernel").spec) == "RS1"
    assert str(plan.tensor("state.opt_state.0.trace.block_0.mlp.fc_out.kernel").spec) == "S1R"
    ref, _ = reference_on_one_device(step, state, batches)
    got, _ = run_steps(f, state, batches)
    assert_trees_close(got.params, ref.params)
