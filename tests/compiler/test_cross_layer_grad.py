"""Tied weights: the cross-layer gradient sum moves after accumulation (compiler/cross_layer_grad.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.compiler import jax_compat
from alpa_like.compiler.cross_layer_grad import split_cross_layer_grad_sums
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, slice_layers
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.stage_construction import build_stage_program
from alpa_like.models import gpt
from alpa_like.compiler.sliced_step import slice_step
from jax.extend.core import ClosedJaxpr


def tiny_gpt_sliced(num_micro_batches=2, layer_num=2):
    config = models.get_config("gpt-tiny")
    params = gpt.gpt_param_shapes(config)
    state = jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.sgd(0.1)),
                           params)

    def step(state, batch):
        loss, grads = al.value_and_grad(gpt.gpt_loss(gpt.GPTModel(config)))(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    method = al.PipeshardParallel(num_micro_batches=num_micro_batches,
                                  layer_option=al.AutoLayerOption(layer_num=layer_num),
                                  stage_option=al.AutoStageOption(show_progress=False))
    return slice_step(method, step, (state, gpt.gpt_batch_shapes(config, 8)), static_argnums=(),
                      batch_argnums=(1,))


def grad_marker(jaxpr):
    return next(e for e in jaxpr.eqns if is_marker(e, "grad"))


def cross_layer_sums(jaxpr, pieces):
    """Grad-marker inputs made by add_any of values from different layers."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    found = []
    for v in grad_marker(jaxpr).invars:
        i = producer.get(v)
        if i is not None and jaxpr.eqns[i].primitive.name == "add_any":
            layers = {pieces[producer[x]].layer for x in jaxpr.eqns[i].invars if x in producer}
            if len(layers) > 1:
                found.append(v)
    return found


@pytest.fixture(scope="module")
def sliced():
    return tiny_gpt_sliced()


def test_the_tied_embedding_gradient_is_accumulated_per_layer(sliced):
    # Before the rewrite the traced step has one such sum (wte: lookup in layer 0, logits in the last layer).
    raw = jax_compat.bypass_eqns(sliced.traced.closed_jaxpr.jaxpr, lambda e: is_marker(e, "param"))
    raw_pieces = slice_layers(raw)
    assert len(cross_layer_sums(raw, raw_pieces)) == 1
    assert cross_layer_sums(sliced.jaxpr, sliced.pieces) == []
    marker = grad_marker(sliced.jaxpr)
    assert len(marker.invars) == len(grad_marker(raw).invars) + 1
    # The sum now runs once per step, in apply-grad, reading the two means.
    index = {id(e): i for i, e in enumerate(sliced.jaxpr.eqns)}
    means = set(marker.outvars)
    sums = [e for e in sliced.jaxpr.eqns if e.primitive.name == "add_any" and set(e.invars) <= means]
    assert len(sums) == 1 and sliced.pieces[index[id(sums[0])]].phase == APPLY


def test_no_stage_receives_another_stages_gradient_contribution_per_micro_batch(sliced):
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, [[0], [1]],
                                  [r == "batch" for r in sliced.roles])
    wte_shape = (models.get_config("gpt-tiny").vocab_size, models.get_config("gpt-tiny").hidden_size)
    backward0 = program.piece(0, BACKWARD)
    from_stage1 = [v for v in backward0.inputs if program.home.get(v) == 1]
    assert all(program.values[v].aval.shape != wte_shape for v in from_stage1)


def test_the_rewritten_step_computes_the_same_function(sliced):
    raw = jax_compat.bypass_eqns(sliced.traced.closed_jaxpr.jaxpr, lambda e: is_marker(e, "param"))
    consts = sliced.traced.closed_jaxpr.consts
    rng = np.random.default_rng(0)
    args = []
    for v in raw.invars:
        if jnp.issubdtype(v.aval.dtype, jnp.integer):
            args.append(jnp.asarray(rng.integers(0, 64, v.aval.shape), v.aval.dtype))
        else:
            args.append(jnp.asarray(rng.normal(size=v.aval.shape), v.aval.dtype))
    before = jax_compat.eval_closed_jaxpr(ClosedJaxpr(raw, consts), *args)
    after = jax_compat.eval_closed_jaxpr(ClosedJaxpr(sliced.jaxpr, consts), *args)
    for a, b in zip(before, after, strict=True):
        # a + b versus the same two addends summed after the (identity) grad marker: the same float ops.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_step_without_cross_layer_sums_is_returned_unchanged(sliced):
    assert split_cross_layer_grad_sums(sliced.jaxpr, sliced.pieces) is sliced.jaxpr
