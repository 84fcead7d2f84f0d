"""Splitting a step at the grad marker, and its clear errors."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_like as al
from alpa_like.compiler.grad_accumulation import make_step_fn, split_at_grad_marker, to_micro_batches
from alpa_like.compiler.trace import trace_step
from tests.helpers import assert_trees_close, make_train_step, mlp_batch, mlp_loss, mlp_state


def _trace(step, m=2):
    traced = trace_step(step, (mlp_state(), mlp_batch(np.random.default_rng(0))), batch_argnums=(1,),
                        num_micro_batches=m)
    return traced, [leaf.is_batch for leaf in traced.in_leaves]


def test_split_puts_the_loss_in_the_loop_and_the_optimizer_after_it():
    traced, mask = _trace(make_train_step(mlp_loss))
    split = split_at_grad_marker(traced.closed_jaxpr, mask)
    loop = {e.primitive.name for e in split.per_micro_batch}
    after = {e.primitive.name for e in split.apply}
    assert "dot_general" in loop and "tanh" in loop
    assert "dot_general" not in after and "sqrt" in after  # Adam's update
    eqns = traced.closed_jaxpr.jaxpr.eqns
    assert len(split.hoisted) + len(split.per_micro_batch) + len(split.apply) + 1 <= len(eqns)


def test_strided_micro_batches():
    x = jnp.arange(8)
    np.testing.assert_array_equal(to_micro_batches(x, 2), [[0, 2, 4, 6], [1, 3, 5, 7]])


def test_accumulated_step_function_equals_full_batch():
    step = make_train_step(mlp_loss)
    state, batch = mlp_state(), mlp_batch(np.random.default_rng(1))
    traced, mask = _trace(step, m=4)
    flat = jax.tree.leaves((state, batch))
    out = jax.jit(make_step_fn(traced.closed_jaxpr, mask, num_micro_batches=4))(*flat)
    want = jax.tree.leaves(jax.jit(step)(state, batch))
    for a, b in zip(out, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_batch_use_outside_the_grad_is_rejected():
    def step(state, batch):
        grads = al.grad(mlp_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), jnp.mean(batch["y"])

    traced, mask = _trace(step)
    with pytest.raises(ValueError, match="outside al.grad uses the batch"):
        split_at_grad_marker(traced.closed_jaxpr, mask)


def test_two_grad_calls_are_rejected():
    def step(state, batch):
        g1 = al.grad(mlp_loss)(state.params, batch)
        g2 = al.grad(mlp_loss)(state.params, batch)
        return jax.tree.map(jnp.add, g1, g2)

    traced, mask = _trace(step)
    with pytest.raises(ValueError, match="exactly one al.grad"):
        split_at_grad_marker(traced.closed_jaxpr, mask)


def dropout_loss(params, batch, key):
    keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
    return mlp_loss(params, {"x": jnp.where(keep, batch["x"], 0.0), "y": batch["y"]})


def dropout_step(state, batch, key):
    return state.apply_gradients(grads=al.grad(dropout_loss)(state.params, batch, key))


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_random_numbers_drawn_from_a_per_step_key_are_drawn_per_micro_batch(make_key):
    """A mask drawn from a key alone does not depend on the batch; it is drawn in the micro-batch loop, from
    the key with the micro-batch's index folded in, so that micro-batches do not share a mask. The step then
    equals the loop a user would write: micro-batch j (rows j, j + m, ...) with ``fold_in(key, j)``."""
    state, batch, key = mlp_state(tx=optax.sgd(0.1)), mlp_batch(np.random.default_rng(0)), make_key(3)
    traced = trace_step(dropout_step, (state, batch, key), batch_argnums=(1,), num_micro_batches=2)
    mask = [leaf.is_batch for leaf in traced.in_leaves]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split = split_at_grad_marker(traced.closed_jaxpr, mask)
    assert "random_bits" in {e.primitive.name for e in split.per_micro_batch}
    assert "random_bits" not in {e.primitive.name for e in split.hoisted}
    assert [e.primitive.name for e, _ in split.folded_keys] == ["random_bits"]

    got = jax.tree.unflatten(traced.out_tree, jax.jit(make_step_fn(traced.closed_jaxpr, mask, num_micro_batches=2))(
        *jax.tree.leaves((state, batch, key))))

    def loop(key_of):  # the step as a loop over the two strided micro-batches
        grads = [al.grad(dropout_loss)(state.params, jax.tree.map(lambda x, j=j: x[j::2], batch), key_of(j))
                 for j in range(2)]
        return state.apply_gradients(grads=jax.tree.map(lambda a, b: (a + b) / 2, *grads))
    assert_trees_close(got.params, loop(lambda j: jax.random.fold_in(key, j)).params, rtol=1e-5, atol=1e-6)
    shared = loop(lambda j: key).params  # one mask for both micro-batches: what the step must not compute
    assert not np.allclose(got.params["dense_0"]["kernel"], shared["dense_0"]["kernel"], atol=1e-4)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_draws_inside_a_checkpointed_block_are_shared_by_the_micro_batches_with_a_warning(make_key):
    """jax.checkpoint / nn.remat: JAX draws the forward's mask outside the block and recomputes it inside it
    for the backward, from the block's key operand. Folding the index into the draw's key would give the
    backward another mask (a key split inside the block): nothing is folded, the micro-batches share the
    mask (a warning says so), and the gradients are those of one consistent mask per micro-batch."""
    def loss_fn(params, batch, key):
        return dropout_loss(params, batch, jax.random.split(key)[1])

    def step(state, batch, key):
        return state.apply_gradients(grads=al.grad(jax.checkpoint(loss_fn))(state.params, batch, key))

    state, batch, key = mlp_state(tx=optax.sgd(0.1)), mlp_batch(np.random.default_rng(0)), make_key(3)
    traced = trace_step(step, (state, batch, key), batch_argnums=(1,), num_micro_batches=2)
    mask = [leaf.is_batch for leaf in traced.in_leaves]
    with pytest.warns(UserWarning, match="inside .*checkpoint.* bodies: every micro-batch draws the same"):
        split = split_at_grad_marker(traced.closed_jaxpr, mask)
    assert not split.folded_keys
    with warnings.catch_warnings():  # make_step_fn splits again: the same warning
        warnings.simplefilter("ignore")
        step_fn = make_step_fn(traced.closed_jaxpr, mask, num_micro_batches=2)
    got = jax.tree.unflatten(traced.out_tree, jax.jit(step_fn)(*jax.tree.leaves((state, batch, key))))
    grads = [al.grad(loss_fn)(state.params, jax.tree.map(lambda x, j=j: x[j::2], batch), key) for j in range(2)]
    expected = state.apply_gradients(grads=jax.tree.map(lambda a, b: (a + b) / 2, *grads))
    assert_trees_close(got.params, expected.params, rtol=1e-5, atol=1e-6)


def test_random_numbers_also_read_after_the_gradient_stay_per_step_with_a_warning():
    """Numbers the step also uses after al.grad must be one value: they stay drawn once per step, and a
    warning says that the micro-batches share them."""
    def step(state, batch, key):
        noise = jax.random.normal(key, (16, 16))
        grads = al.grad(lambda p, b: dropout_loss(p, {"x": b["x"] + noise, "y": b["y"]}, key))(state.params, batch)
        return state.apply_gradients(grads=grads), jnp.sum(noise)

    traced = trace_step(step, (mlp_state(), mlp_batch(np.random.default_rng(0)), jax.random.key(0)),
                        batch_argnums=(1,), num_micro_batches=2)
    with pytest.warns(UserWarning, match=r"shapes \(16, 16\)\) are drawn once per step"):
        split = split_at_grad_marker(traced.closed_jaxpr, [leaf.is_batch for leaf in traced.in_leaves])
    assert len(split.folded_keys) == 1  # the dropout mask, read by the loss only, is still per micro-batch
    with warnings.catch_warnings():  # no random numbers: no warning
        warnings.simplefilter("error")
        traced, mask = _trace(make_train_step(mlp_loss))
        assert not split_at_grad_marker(traced.closed_jaxpr, mask).folded_keys


def test_per_example_aux_is_rejected_and_parameter_shaped_results_are_gradients():
    def loss_with_predictions(params, batch):
        return mlp_loss(params, batch), {"mean": jnp.mean(batch["x"]), "rows": batch["x"][:, 0]}

    def step(state, batch):
        (loss, aux), grads = al.value_and_grad(loss_with_predictions, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads=grads), aux["mean"], aux["rows"]

    traced, mask = _trace(step)
    with pytest.raises(ValueError, match=r"returns a value of shape \(16,\) whose dim 0 is a micro-batch's 16 rows"):
        split_at_grad_marker(traced.closed_jaxpr, mask)
    # a 16 x 32 weight's gradient has 16 = the micro-batch's rows in dim 0: shaped like its parameter, it is one
    traced, mask = _trace(make_train_step(mlp_loss))
    assert any(v.aval.shape == (16, 32) for v in split_at_grad_marker(traced.closed_jaxpr, mask).marker.invars)


def test_integer_aux_is_rejected():
    def loss_with_count(params, batch):
        return mlp_loss(params, batch), jnp.sum(batch["x"] > 0)

    def step(state, batch):
        (loss, count), grads = al.value_and_grad(loss_with_count, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads=grads), count

    traced, mask = _trace(step)
    with pytest.raises(ValueError, match="must be floating point"):
        split_at_grad_marker(traced.closed_jaxpr, mask)
