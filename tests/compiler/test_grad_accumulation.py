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
from tests.helpers import (assert_trees_close, make_train_step, micro_batch_key, micro_batch_loop, mlp_apply,
                           mlp_batch, mlp_loss, mlp_state, same_key)


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


def _run_traced(step, m=2):
    """``step`` as make_step_fn runs it with ``m`` micro-batches, and under jax.jit, on the MLP's state and batch."""
    state, batch = mlp_state(), mlp_batch(np.random.default_rng(1))
    traced, mask = _trace(step, m)
    step_fn = make_step_fn(traced.closed_jaxpr, mask, num_micro_batches=m, after_grad=traced.after_grad)
    got = jax.tree.unflatten(traced.out_tree, jax.jit(step_fn)(*jax.tree.leaves((state, batch))))
    return got, jax.jit(step)(state, batch)


def test_the_batch_read_after_al_grad_is_the_full_batch():
    def step(state, batch):
        padding = jnp.where(batch["y"] > 0, 1.0, 0.0)  # from the batch alone, before al.grad
        grads = al.grad(mlp_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {"y": jnp.mean(batch["y"]), "padding": jnp.sum(padding),
                                                    "x": batch["x"]}

    traced, mask = _trace(step)
    split = split_at_grad_marker(traced.closed_jaxpr, mask)
    assert len(split.full_outputs) == 3 and traced.after_grad.outputs == split.full_outputs
    assert {leaf.path: leaf.shape for leaf in traced.out_leaves}["out.1.x"] == (32, 16)  # the full batch's rows
    got, want = _run_traced(step)
    assert_trees_close(got, want)


def hidden_step(read_after):
    """A step that computes hidden activations per micro-batch outside the loss, for the loss, and returns
    ``read_after(hidden)`` as its second output."""
    def step(state, batch):
        hidden = jnp.tanh(batch["x"] @ state.params["dense_0"]["kernel"])

        def loss_fn(params):
            return jnp.mean(hidden @ params["dense_1"]["kernel"]) ** 2
        grads = al.grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), read_after(hidden)
    return step


def test_a_value_computed_per_micro_batch_from_the_parameters_is_rejected_after_al_grad():
    traced, mask = _trace(hidden_step(jnp.mean))
    with pytest.raises(ValueError, match="`reduce_sum` outside al.grad uses the batch through a value computed per "
                                         "micro-batch from the batch and other inputs"):
        split_at_grad_marker(traced.closed_jaxpr, mask)
    traced, mask = _trace(hidden_step(lambda hidden: hidden))
    with pytest.raises(ValueError, match="the step returns a value computed per micro-batch from the batch and "
                                         "other inputs"):
        split_at_grad_marker(traced.closed_jaxpr, mask)


def test_what_the_step_computes_from_the_batch_and_the_parameters_after_al_grad_is_the_full_batch_value():
    def step(state, batch):
        features = jnp.tanh(batch["x"] @ state.params["dense_0"]["kernel"])  # before al.grad, not for it
        grads = al.grad(mlp_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {"features": jnp.sum(features),
                                                    "after": jnp.sum(mlp_apply(state.params, batch["x"]))}

    got, want = _run_traced(step)
    assert_trees_close(got, want)


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


def _loop(loss_fn, state, batch, key, key_of=micro_batch_key):
    """The next state of the step as the loop over its two strided micro-batches (``micro_batch_loop``)."""
    return micro_batch_loop(loss_fn, 2, key_of)(state, batch, key)[0]


def _split_and_run(step, state, batch, key, m=2):
    traced = trace_step(step, (state, batch, key), batch_argnums=(1,), num_micro_batches=m)
    mask = [leaf.is_batch for leaf in traced.in_leaves]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of shared random numbers
        split = split_at_grad_marker(traced.closed_jaxpr, mask)
        step_fn = make_step_fn(traced.closed_jaxpr, mask, num_micro_batches=m)
    got = jax.tree.unflatten(traced.out_tree, jax.jit(step_fn)(*jax.tree.leaves((state, batch, key))))
    return traced, split, got


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_random_numbers_drawn_from_a_per_step_key_are_drawn_per_micro_batch(make_key):
    """A mask drawn from a key alone does not depend on the batch; it is drawn in the micro-batch loop, from
    the key as the micro-batch sees it, so that micro-batches do not share a mask. The step then equals the
    loop a user would write: micro-batch j (rows j, j + m, ...) with the key ``fold_in(key, j)`` (j > 0)."""
    state, batch, key = mlp_state(tx=optax.sgd(0.1)), mlp_batch(np.random.default_rng(0)), make_key(3)
    traced, split, got = _split_and_run(dropout_step, state, batch, key)
    assert "random_bits" in {e.primitive.name for e in split.per_micro_batch}
    assert "random_bits" not in {e.primitive.name for e in split.hoisted}
    key_var = traced.closed_jaxpr.jaxpr.invars[-1]
    assert {e.invars[k] for e, folds in split.folded_keys for k, _ in folds} == {key_var}  # folded where it enters
    assert_trees_close(got.params, _loop(dropout_loss, state, batch, key).params,
                       rtol=1e-5, atol=1e-6)
    shared = _loop(dropout_loss, state, batch, key, same_key).params  # one mask for both micro-batches
    assert not np.allclose(got.params["dense_0"]["kernel"], shared["dense_0"]["kernel"], atol=1e-4)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_draws_inside_a_checkpointed_block_are_drawn_per_micro_batch(make_key):
    """jax.checkpoint / nn.remat: JAX draws the forward's mask outside the block and recomputes it inside it
    for the backward, from the block's key operand (here split inside the block). Both start from the step's
    key as the micro-batch sees it, so each micro-batch has its own mask and the gradient of that mask
    (folding at the draw's key instead would give the recomputed backward another mask)."""
    def loss_fn(params, batch, key):
        return dropout_loss(params, batch, jax.random.split(key)[1])

    def step(state, batch, key):
        return state.apply_gradients(grads=al.grad(jax.checkpoint(loss_fn))(state.params, batch, key))

    state, batch, key = mlp_state(tx=optax.sgd(0.1)), mlp_batch(np.random.default_rng(0)), make_key(3)
    _, split, got = _split_and_run(step, state, batch, key)
    assert {"checkpoint", "remat2"} & {e.primitive.name for e, _ in split.folded_keys}  # the backward's block
    assert_trees_close(got.params, _loop(loss_fn, state, batch, key).params,
                       rtol=1e-5, atol=1e-6)
    shared = _loop(loss_fn, state, batch, key, same_key).params
    assert not np.allclose(got.params["dense_0"]["kernel"], shared["dense_0"]["kernel"], atol=1e-4)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_draws_in_a_scan_over_layers_with_the_key_split_per_layer_are_drawn_per_micro_batch(make_key):
    """A scan over layers (nn.scan), each layer remat'd and drawing from a key it splits off the carry."""
    def loss_fn(params, batch, key):
        def layer(carry, _):
            h, k = carry
            k, sub = jax.random.split(k)
            keep = jax.random.bernoulli(sub, 0.8, h.shape)
            return (jnp.where(keep, jnp.tanh(h @ params["w"]) / 0.8, 0.0), k), None
        (h, _), _ = jax.lax.scan(jax.checkpoint(layer), (batch["x"], key), None, length=3)
        return jnp.mean((h - batch["x"]) ** 2)

    def step(state, batch, key):
        return state.apply_gradients(grads=al.grad(loss_fn)(state.params, batch, key))

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32)}
    state = mlp_state(tx=optax.sgd(0.1)).replace(params=params, opt_state=optax.sgd(0.1).init(params))
    batch, key = {"x": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)}, make_key(5)
    _, _, got = _split_and_run(step, state, batch, key)
    assert_trees_close(got.params, _loop(loss_fn, state, batch, key).params,
                       rtol=1e-5, atol=1e-6)
    shared = _loop(loss_fn, state, batch, key, same_key).params
    assert not np.allclose(got.params["w"], shared["w"], atol=1e-5)


def test_a_key_made_from_a_seed_in_the_step_is_folded_and_one_from_a_seed_inside_a_body_warns():
    def loss_fn(params, batch, seed):
        return dropout_loss(params, batch, jax.random.key(seed))

    def step(state, batch, seed):
        return state.apply_gradients(grads=al.grad(loss_fn)(state.params, batch, seed))

    state, batch, seed = mlp_state(tx=optax.sgd(0.1)), mlp_batch(np.random.default_rng(0)), jnp.uint32(4)
    _, split, got = _split_and_run(step, state, batch, seed)
    assert [e.primitive.name for e, _ in split.folded_keys] == ["random_bits"]  # reads random_seed's key
    want = _loop(loss_fn, state, batch, seed, same_key)  # every micro-batch draws the step's masks
    want_folded = _loop(dropout_loss, state, batch, jax.random.key(seed))
    assert_trees_close(got.params, want_folded.params, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got.params["dense_0"]["kernel"], want.params["dense_0"]["kernel"], atol=1e-4)

    def seeded_inside(state, batch, seed):  # the key is made inside a checkpoint body: nothing is folded
        return state.apply_gradients(grads=al.grad(jax.checkpoint(loss_fn))(state.params, batch, seed))
    traced = trace_step(seeded_inside, (state, batch, seed), batch_argnums=(1,), num_micro_batches=2)
    mask = [leaf.is_batch for leaf in traced.in_leaves]
    with pytest.warns(UserWarning, match="draws random numbers from a key that is neither an argument"):
        assert not split_at_grad_marker(traced.closed_jaxpr, mask).folded_keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step_fn = make_step_fn(traced.closed_jaxpr, mask, num_micro_batches=2)
    got = jax.tree.unflatten(traced.out_tree, jax.jit(step_fn)(*jax.tree.leaves((state, batch, seed))))
    assert_trees_close(got.params, want.params, rtol=1e-5, atol=1e-6)  # forward and backward: the same masks


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


def test_a_per_example_aux_comes_back_in_the_full_batch_row_order():
    def loss_with_predictions(params, batch):
        return mlp_loss(params, batch), {"mean": jnp.mean(batch["x"]), "rows": batch["x"][:, 0],
                                         "argmax": jnp.argmax(mlp_apply(params, batch["x"]), -1)}

    def step(state, batch):
        (loss, aux), grads = al.value_and_grad(loss_with_predictions, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads=grads), aux

    traced, mask = _trace(step, m=4)
    split = split_at_grad_marker(traced.closed_jaxpr, mask)
    names = split.marker.params["names"]
    assert sorted(names[p] for p in split.per_example) == ["aux['argmax']", "aux['rows']"]  # an integer one too
    got, want = _run_traced(step, m=4)
    assert_trees_close(got, want)
    # a 16 x 32 weight's gradient has 16 = the micro-batch's rows in dim 0: a gradient, averaged
    traced, mask = _trace(make_train_step(mlp_loss))
    split = split_at_grad_marker(traced.closed_jaxpr, mask)
    assert any(v.aval.shape == (16, 32) for v in split.marker.invars) and not split.per_example


def test_per_example_aux_is_found_for_al_grad_and_al_value_and_grad():
    def loss_with_tuple(params, batch):
        return mlp_loss(params, batch), (jnp.mean(batch["x"]), mlp_apply(params, batch["x"]))

    def value_and_grad_step(state, batch):
        (loss, (mean, logits)), grads = al.value_and_grad(loss_with_tuple, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads=grads), mean, logits

    def grad_step(state, batch):
        grads, (mean, logits) = al.grad(loss_with_tuple, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads=grads), mean, logits

    for step in (value_and_grad_step, grad_step):
        traced, mask = _trace(step)
        split = split_at_grad_marker(traced.closed_jaxpr, mask)
        assert [split.marker.params["names"][p] for p in split.per_example] == ["aux[1]"]
        got, want = _run_traced(step)
        assert_trees_close(got, want)


def test_integer_aux_is_rejected():
    def loss_with_count(params, batch):
        return mlp_loss(params, batch), jnp.sum(batch["x"] > 0)

    def step(state, batch):
        (loss, count), grads = al.value_and_grad(loss_with_count, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads=grads), count

    traced, mask = _trace(step)
    with pytest.raises(ValueError, match=r"returns aux of dtype int32; .* must be floating point"):
        split_at_grad_marker(traced.closed_jaxpr, mask)
