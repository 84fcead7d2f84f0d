"""Slicing a layered training step into per-layer forward, backward and apply-grad pieces."""
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import jaxpr_flops
from alpa_like.compiler.layer_construction import Layering, layering, manual_layers
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD, layer_summaries, slice_layers
from alpa_like.compiler.trace import trace_step


def loss_fn(params, batch):
    x = batch["x"]
    for i in range(3):
        x = jnp.tanh(x @ params[f"w{i}"])
        if i < 2:
            al.mark_pipeline_boundary()
    return jnp.mean(x ** 2)


def step(state, batch):
    loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss


@pytest.fixture
def traced():
    sizes = {"w0": (8, 16), "w1": (16, 16), "w2": (16, 4)}
    params = {k: jnp.ones(s) * 0.1 for k, s in sizes.items()}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    with layering(Layering(assign=manual_layers)):
        return trace_step(step, (state, {"x": jnp.ones((32, 8))}), batch_argnums=(1,))


def test_every_live_equation_gets_a_piece_in_execution_order(traced):
    pieces = slice_layers(traced.closed_jaxpr.jaxpr)
    assert {p.layer for p in pieces if p} == {0, 1, 2}
    phases = [p.phase for p in pieces if p]
    assert phases.index(APPLY) > max(i for i, ph in enumerate(phases) if ph == BACKWARD)
    assert phases[0] == FORWARD


def test_layer_summaries_split_flops_params_and_activations(traced):
    jaxpr = traced.closed_jaxpr.jaxpr
    summaries = layer_summaries(jaxpr, slice_layers(jaxpr), traced.param_mask)
    paths = [traced.in_leaves[k].path for s in summaries for k in s.param_inputs]
    assert paths == ["state.params.w0", "state.params.w1", "state.params.w2"]
    assert [s.param_bytes for s in summaries] == [8 * 16 * 4, 16 * 16 * 4, 16 * 4 * 4]
    # Forward matmul FLOPs: 2 * rows * in * out per layer; backward has the two transposed products.
    assert summaries[1].forward_flops >= 2 * 32 * 16 * 16
    assert summaries[1].backward_flops >= 2 * (2 * 32 * 16 * 16) - 2 * 32 * 16 * 16 / 2
    total = sum(s.forward_flops + s.backward_flops + s.apply_flops for s in summaries)
    assert total == pytest.approx(jaxpr_flops(jaxpr))
    # Layer 1 keeps at least its input and its tanh output (32 x 16 floats each) for the backward pass.
    assert summaries[1].activation_bytes >= 2 * 32 * 16 * 4


def test_a_step_without_layers_is_a_clear_error():
    traced = trace_step(lambda x: x * 2, (jnp.ones(3),))
    with pytest.raises(ValueError, match="no pipeline layers"):
        slice_layers(traced.closed_jaxpr.jaxpr)


def test_dead_code_gets_no_piece():
    def loss_with_dead_code(params, batch):
        jnp.sin(batch["x"]).sum()  # computed, never used
        return loss_fn(params, batch)

    def dead_step(state, batch):
        loss, grads = al.value_and_grad(loss_with_dead_code)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    sizes = {"w0": (8, 16), "w1": (16, 16), "w2": (16, 4)}
    state = train_state.TrainState.create(apply_fn=None, params={k: jnp.ones(s) for k, s in sizes.items()},
                                          tx=optax.adam(1e-3))
    with layering(Layering(assign=manual_layers)):  # jax.make_jaxpr: trace_step drops the dead code itself
        jaxpr = jax_compat.inline_calls(jax.make_jaxpr(dead_step)(state, {"x": jnp.ones((32, 8))})).jaxpr
    pieces = slice_layers(jaxpr)
    sins = [p for e, p in zip(jaxpr.eqns, pieces) if e.primitive.name == "sin"]
    assert sins == [None]


def test_each_layers_optimizer_state_is_read_by_its_own_apply_grad(traced):
    """Adam scales mu by b1 before the gradient joins it: that equation reads no gradient, yet it must run
    with layer l's update (else every layer's optimizer state would live on the first stage)."""
    jaxpr = traced.closed_jaxpr.jaxpr
    pieces = slice_layers(jaxpr)
    readers: dict[str, set[int]] = {}
    for eqn, piece in zip(jaxpr.eqns, pieces):
        if piece is not None and piece.phase == APPLY:
            for v in eqn.invars:
                if v in jaxpr.invars:
                    path = traced.in_leaves[jaxpr.invars.index(v)].path
                    readers.setdefault(path, set()).add(piece.layer)
    for layer in range(3):
        for moment in ("mu", "nu"):
            assert readers[f"state.opt_state.0.{moment}.w{layer}"] == {layer}, readers
