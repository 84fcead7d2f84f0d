"""Per-stage forward/backward/apply programs compute exactly the step (sequential reference executor)."""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.compiler import jax_compat
from alpa_like.compiler.layer_construction import layering
from alpa_like.compiler.layer_slicing import slice_layers
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.stage_construction import build_stage_program
from alpa_like.compiler.trace import trace_step
from alpa_like.models import gpt
from tests.reference import run_sequentially


def tiny_gpt(num_layers=4):
    config = dataclasses.replace(models.get_config("gpt-tiny"), num_layers=num_layers)
    model = gpt.GPTModel(config)
    batch = gpt.gpt_batch(config, 8, jax.random.PRNGKey(1))
    params = model.init(jax.random.PRNGKey(0), batch["input_ids"])["params"]
    # SGD + momentum: linear in the gradient (see tests/alpa_like/test_methods.py on Adam and zero gradients).
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1, momentum=0.9))
    loss_fn = gpt.gpt_loss(model)

    def step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss
    return step, state, batch


def stage_program(step, args, stage_layers, num_micro_batches, layer_num):
    with layering(al.AutoLayerOption(layer_num=layer_num).layering()):
        traced = trace_step(step, args, batch_argnums=(1,), num_micro_batches=num_micro_batches)
    jaxpr = jax_compat.bypass_eqns(traced.closed_jaxpr.jaxpr, lambda e: is_marker(e, "param"))
    closed = jax.extend.core.ClosedJaxpr(jaxpr, traced.closed_jaxpr.consts)
    program = build_stage_program(closed, slice_layers(jaxpr), stage_layers,
                                  [leaf.is_batch for leaf in traced.in_leaves])
    return program, traced


@pytest.mark.parametrize("stage_layers,num_micro_batches", [
    ([[0, 1], [2, 3]], 1), ([[0, 1], [2, 3]], 4), ([[0], [1], [2], [3]], 2), ([[0], [1, 2, 3]], 8)])
def test_stage_program_equals_the_step(stage_layers, num_micro_batches):
    step, state, batch = tiny_gpt()
    program, traced = stage_program(step, (state, batch), stage_layers, num_micro_batches, layer_num=4)
    flat = jax.tree.leaves((state, batch))
    got = jax.jit(lambda *xs: run_sequentially(program, xs, num_micro_batches))(*flat)
    want = jax.tree.leaves(jax.jit(step)(state, batch))
    for a, b in zip(got, want, strict=True):
        # Micro-batch sums reassociate float32 additions.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_values_live_with_their_stage():
    step, state, batch = tiny_gpt()
    program, traced = stage_program(step, (state, batch), [[0, 1], [2, 3]], 2, layer_num=4)
    paths = {program.step_inputs[k]: leaf.path for k, leaf in enumerate(traced.in_leaves)}
    home = {paths[v]: q for v, q in program.home.items() if v in paths}
    assert home["state.params.block_0.attn.qkv.kernel"] == 0
    assert home["state.params.block_3.mlp.fc_in.kernel"] == 1
    assert home["batch.input_ids"] == 0 and home["batch.labels"] == 1
    for q in range(2):
        assert program.piece(q, "fwd").jaxpr.jaxpr.eqns and program.piece(q, "bwd").jaxpr.jaxpr.eqns
