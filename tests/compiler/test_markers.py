"""Markers are identities that survive jit, vmap and grad; layer markers mirror into the backward pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_like.compiler.markers import is_marker, mark, mark_pipeline_boundary


def two_layer_loss(w, x):
    # As layer construction does: a layer's start marker takes every input of the layer, parameters too.
    w0, h = mark((w, x), "fwd_start", 0)
    h = mark(jnp.tanh(h @ w0), "fwd_end", 0)
    w1, h = mark((w, h), "fwd_start", 1)
    h = mark(jnp.sin(h @ w1), "fwd_end", 1)
    return jnp.sum(h)


def plain_loss(w, x):
    return jnp.sum(jnp.sin(jnp.tanh(x @ w) @ w))


def test_layer_markers_leave_values_and_gradients_unchanged():
    w, x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32), jnp.ones((2, 4))
    np.testing.assert_array_equal(jax.jit(two_layer_loss)(w, x), plain_loss(w, x))
    np.testing.assert_array_equal(jax.jit(jax.grad(two_layer_loss))(w, x), jax.jit(jax.grad(plain_loss))(w, x))
    batched = jax.vmap(two_layer_loss, in_axes=(None, 0))(w, jnp.ones((3, 2, 4)))
    assert batched.shape == (3,)


def test_backward_markers_mirror_the_forward_ones_in_reverse():
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    eqns = jax.make_jaxpr(jax.grad(two_layer_loss))(w, x).jaxpr.eqns
    order = [(e.params["kind"], e.params["layer"]) for e in eqns if is_marker(e)]
    assert order == [("fwd_start", 0), ("fwd_end", 0), ("fwd_start", 1), ("fwd_end", 1),
                     ("bwd_start", 1), ("bwd_end", 1), ("bwd_start", 0), ("bwd_end", 0)]


def test_boundary_marker_stays_in_the_traced_step():
    def f(w, x):
        h = jnp.tanh(x @ w)
        mark_pipeline_boundary()
        return jnp.sum(h @ w)
    eqns = jax.make_jaxpr(jax.grad(f))(jnp.ones((3, 3)), jnp.ones((2, 3))).jaxpr.eqns
    assert sum(is_marker(e, "boundary") for e in eqns) == 1
    assert float(jax.jit(f)(jnp.ones((3, 3)), jnp.ones((2, 3)))) == pytest.approx(
        float(jnp.sum(jnp.tanh(jnp.ones((2, 3)) @ jnp.ones((3, 3))) @ jnp.ones((3, 3)))))


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="marker kind must be one of"):
        mark(jnp.ones(2), "stage")


def test_a_marker_keeps_the_names_of_its_values_through_jit_vmap_and_grad():
    names = ("value", "aux['logits']")

    def f(x):
        value, logits = mark((jnp.sum(x), x * 2.0), "grad", names=names)
        return value + jnp.sum(logits)

    def marker_names(jaxpr):
        return [e.params["names"] for e in jaxpr.eqns if is_marker(e, "grad")]

    x = jnp.ones(3)
    assert marker_names(jax.make_jaxpr(jax.jit(f))(x).eqns[0].params["jaxpr"].jaxpr) == [names]
    assert marker_names(jax.make_jaxpr(jax.vmap(f))(jnp.ones((2, 3))).jaxpr) == [names]
    assert names in marker_names(jax.make_jaxpr(jax.grad(f))(x).jaxpr)
    assert "names" not in jax.make_jaxpr(lambda x: mark(x, "param"))(x).eqns[0].params  # only where given
    with pytest.raises(ValueError, match="names: 1 given for a tree of 2 leaves"):
        mark((x, x), "grad", names=("value",))
