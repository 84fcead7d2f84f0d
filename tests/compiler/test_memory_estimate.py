"""peak_live_bytes: the largest set of values held at once, in program order."""
import doctest

import jax
import jax.numpy as jnp

from alpa_like.compiler import memory_estimate
from alpa_like.compiler.memory_estimate import peak_live_bytes


def _every_value(jaxpr):
    return set(jaxpr.invars) | {v for e in jaxpr.eqns for v in e.outvars}


def test_a_chain_holds_two_values_at_a_time():
    closed = jax.make_jaxpr(lambda x: jnp.exp(jnp.sin(jnp.cos(x))))(jnp.zeros(100))
    assert peak_live_bytes(closed.jaxpr, _every_value(closed.jaxpr)) == 2 * 400


def test_values_kept_for_a_later_reader_add_up():
    """Forward values read again at the end (the activations a backward reads) stay live together."""
    def f(x):
        a = jnp.sin(x)
        b = jnp.cos(a)
        c = jnp.exp(b)
        return a * b * c

    closed = jax.make_jaxpr(f)(jnp.zeros(10))
    # x dies at sin; then a, b, c are live together with a * b: 4 arrays of 40 bytes
    assert peak_live_bytes(closed.jaxpr, _every_value(closed.jaxpr)) == 4 * 40


def test_only_counted_values_are_counted():
    closed = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.zeros((4, 8)), jnp.zeros((8, 16)))
    x, w = closed.jaxpr.invars
    assert peak_live_bytes(closed.jaxpr, {x}) == 4 * 8 * 4
    assert peak_live_bytes(closed.jaxpr, set()) == 0
    counted = {v for e in closed.jaxpr.eqns for v in e.outvars}
    assert peak_live_bytes(closed.jaxpr, counted) == 2 * 4 * 16 * 4


def test_doctests():
    assert doctest.testmod(memory_estimate).failed == 0
