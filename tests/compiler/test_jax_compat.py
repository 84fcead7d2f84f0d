"""compiler/jax_compat: the jaxpr internals that differ between the JAX versions alpa-like runs on."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from alpa_like.compiler import jax_compat


def test_scan_counts_of_a_traced_scan():
    def f(w, c, xs):
        return jax.lax.scan(lambda carry, x: (carry * w + x, carry), c, xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3), jnp.ones((5, 3)))
    scan = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")
    consts, carries = jax_compat.scan_counts(scan)
    assert (consts, carries) == (1, 1)
    assert len(scan.invars) == consts + carries + 1


def test_scan_counts_from_a_flat_tree_of_groups():
    """jax 0.11 gives the groups as ``ft_in`` (consts, carry, xs) instead of two counts."""
    groups = SimpleNamespace(unpack=lambda: ((None, None), (None,), (None, None, None)))
    eqn = SimpleNamespace(params={"ft_in": groups, "length": 4})
    assert jax_compat.scan_counts(eqn) == (2, 1)
