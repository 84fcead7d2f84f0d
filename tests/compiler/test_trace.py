"""trace_step: leaf names, nested-jit inlining, parameter discovery through al.grad markers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_like as al
from alpa_like.compiler import jax_compat
from alpa_like.compiler.trace import trace_step
from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state


def test_leaves_are_named_by_argument_and_path():
    traced = trace_step(make_train_step(mlp_loss), (mlp_state(), mlp_batch(np.random.default_rng(0))),
                        batch_argnums=(1,))
    paths = [leaf.path for leaf in traced.in_leaves]
    assert "state.params.dense_0.kernel" in paths and "batch.x" in paths
    assert [leaf.is_batch for leaf in traced.in_leaves] == [p.startswith("batch.") for p in paths]
    assert "out.0.params.dense_1.bias" in [leaf.path for leaf in traced.out_leaves]
    assert "out.1.loss" in [leaf.path for leaf in traced.out_leaves]


def test_params_are_the_inputs_al_grad_differentiates():
    traced = trace_step(make_train_step(mlp_loss), (mlp_state(), mlp_batch(np.random.default_rng(0))),
                        batch_argnums=(1,))
    marked = {leaf.path for leaf, m in zip(traced.in_leaves, traced.param_mask, strict=True) if m}
    assert marked == {f"state.params.dense_{i}.{n}" for i in (0, 1) for n in ("kernel", "bias")}


def test_plain_jax_grad_marks_nothing():
    traced = trace_step(make_train_step(mlp_loss, grad_fn=jax.grad),
                        (mlp_state(), mlp_batch(np.random.default_rng(0))), batch_argnums=(1,))
    assert not any(traced.param_mask)


def test_nested_jit_is_inlined_and_evaluates_the_same():
    @jax.jit
    def inner(x):
        return jax.nn.relu(x) * 2

    def f(x, y):
        return jnp.sum(inner(x) * y), inner(y)

    x, y = jnp.arange(6.0).reshape(2, 3) - 2, jnp.ones((2, 3))
    traced = trace_step(f, (x, y))
    assert not any(jax_compat.is_call(e) for e in traced.closed_jaxpr.jaxpr.eqns)
    out = jax_compat.eval_closed_jaxpr(traced.closed_jaxpr, x, y)
    expected = jax.tree.leaves(f(x, y))
    for a, b in zip(out, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("prevent_cse", [True, False])
def test_checkpointed_blocks_inline_as_jax_lowers_them(prevent_cse):
    """jax_compat.inline_remat: an optimization barrier on the block's operands (JAX's lowering of a remat
    call with prevent_cse), then its body; the same values."""
    def block(w, x):  # called twice (its body may be one jaxpr shared by both calls); passes x through
        return jnp.tanh(x @ w) @ w, x

    def loss(w, x):
        h, x0 = jax.checkpoint(block, prevent_cse=prevent_cse)(w, x)
        h, _ = jax.checkpoint(block, prevent_cse=prevent_cse)(w, h)
        return jnp.sum(h * x0)

    w, x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 4)), jnp.float32)
    closed = jax.make_jaxpr(jax.grad(loss))(w, x)
    assert {"checkpoint", "remat2"} & {e.primitive.name for e in closed.jaxpr.eqns}
    inlined = closed.replace(jaxpr=jax_compat.inline_remat(closed.jaxpr))
    kept = [e for e in closed.jaxpr.eqns if e.primitive.name not in ("checkpoint", "remat2")]
    assert all(any(e is f for f in inlined.jaxpr.eqns) for e in kept)  # the same objects: pins still apply
    names = [e.primitive.name for e in inlined.jaxpr.eqns]
    assert not {"checkpoint", "remat2"} & set(names)
    assert names.count("optimization_barrier") == (2 if prevent_cse else 0)
    assert names.count("dot_general") > [e.primitive.name for e in closed.jaxpr.eqns].count("dot_general")
    np.testing.assert_allclose(jax_compat.eval_closed_jaxpr(inlined, w, x)[0], jax.grad(loss)(w, x), rtol=1e-6)


def test_what_the_outputs_do_not_need_is_dropped_and_effects_are_kept():
    def step(state, batch):
        grads = al.grad(mlp_loss)(state.params, batch)
        unused_metric = jnp.mean(jnp.abs(batch["x"]))  # XLA drops it: no pass may price it
        jax.debug.callback(lambda n: None, jnp.sum(batch["y"]))
        return state.apply_gradients(grads=grads)
    traced = trace_step(step, (mlp_state(), mlp_batch(np.random.default_rng(0))), batch_argnums=(1,))
    names = {e.primitive.name for e in traced.closed_jaxpr.jaxpr.eqns}
    assert "abs" not in names and "debug_callback" in names


def test_shape_dtype_structs_trace_without_data():
    state = jax.eval_shape(mlp_state)
    batch = jax.eval_shape(lambda: mlp_batch(np.random.default_rng(0)))
    traced = trace_step(make_train_step(mlp_loss), (state, batch), batch_argnums=(1,))
    shapes = {leaf.path: leaf.shape for leaf in traced.in_leaves}
    assert shapes["state.params.dense_0.kernel"] == (16, 32) and shapes["batch.x"] == (32, 16)


def test_micro_batch_trace_divides_the_batch_rows():
    traced = trace_step(make_train_step(mlp_loss), (mlp_state(), mlp_batch(np.random.default_rng(0))),
                        batch_argnums=(1,), num_micro_batches=4)
    x = next(v for v, leaf in zip(traced.closed_jaxpr.jaxpr.invars, traced.in_leaves) if leaf.path == "batch.x")
    assert x.aval.shape == (8, 16)
    assert next(leaf for leaf in traced.in_leaves if leaf.path == "batch.x").shape == (32, 16)


def test_micro_batches_need_batch_leaves_of_one_row_count_and_no_batch_gradient():
    state, batch = mlp_state(), mlp_batch(np.random.default_rng(0))
    uneven = {"x": batch["x"], "y": batch["y"][:16]}
    with pytest.raises(ValueError, match="must share their number of rows .* batch.x has 32, batch.y has 16"):
        trace_step(make_train_step(mlp_loss), (state, uneven), batch_argnums=(1,), num_micro_batches=2)

    def input_gradient(state, batch):  # each micro-batch would return the gradient of its own rows only
        return al.grad(mlp_loss, argnums=1)(state.params, batch)["x"]
    with pytest.raises(ValueError, match="al.grad differentiates the batch leaf batch.x: with num_micro_batches"):
        trace_step(input_gradient, (state, batch), batch_argnums=(1,), num_micro_batches=2)
    assert trace_step(input_gradient, (state, batch), batch_argnums=(1,)).param_mask[-2:] == (True, True)


def test_argnums_out_of_range_and_overlap():
    with pytest.raises(ValueError, match="static_argnums contains 3"):
        trace_step(lambda a: a, (1.0,), static_argnums=(3,))
    with pytest.raises(ValueError, match="both in static_argnums and batch_argnums"):
        trace_step(lambda a, b: a, (1.0, 2.0), static_argnums=(1,), batch_argnums=(1,))


def test_al_grad_equals_jax_grad():
    state, batch = mlp_state(), mlp_batch(np.random.default_rng(0))
    for got, want in ((al.grad(mlp_loss)(state.params, batch), jax.grad(mlp_loss)(state.params, batch)),
                      (al.value_and_grad(mlp_loss)(state.params, batch),
                       jax.value_and_grad(mlp_loss)(state.params, batch))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="argnums=5 is out of range"):
        al.grad(mlp_loss, argnums=5)(state.params, batch)


def test_flatten_args_checks_the_traced_structure():
    def step(x, batch):
        return x["a"] + batch["b"]
    traced = trace_step(step, ({"a": jnp.ones(2)}, {"b": jnp.ones(2)}))
    assert len(traced.flatten_args(({"a": jnp.zeros(2)}, {"b": jnp.zeros(2)}))) == 2
    with pytest.raises(ValueError, match="arguments have pytree structure .* but this executable was compiled for"):
        traced.flatten_args(({"a": jnp.zeros(2), "c": jnp.zeros(2)}, {"b": jnp.zeros(2)}))
