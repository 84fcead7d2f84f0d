"""Where random keys enter a micro-batch's computation, and how a micro-batch sees them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_like.compiler import jax_compat
from alpa_like.compiler.micro_batch_keys import (DERIVED, ROOT, fold_key, fold_points, key_data, key_origins,
                                                 key_roots, unfoldable_draws)


def _analyse(fn, *args):
    jaxpr = jax_compat.inline_calls(jax.make_jaxpr(fn)(*args)).jaxpr  # flat, as a traced step
    data = key_data(jaxpr)
    return jaxpr, data, key_origins(jaxpr.eqns, key_roots(jaxpr.invars, data), data)


def test_raw_key_data_is_found_through_slices_and_bodies_and_counters_are_not_keys():
    def fn(raw_keys, raw, counter):
        a = jax.random.normal(raw_keys[1], (2,))                                 # slice, squeeze, wrap
        b = jax.checkpoint(lambda k: jax.random.normal(k, (2,)))(raw)            # wrap inside a body
        c, _ = jax.lax.scan(lambda s, k: (s + jax.random.normal(k, ()), None), 0.0, raw_keys)  # scanned keys
        return a + b + c + counter.astype(jnp.float32)

    raw_keys = jax.random.split(jax.random.PRNGKey(0), 3)
    jaxpr, data, origins = _analyse(fn, raw_keys, jax.random.PRNGKey(1), jnp.uint32(7))
    keys, raw, counter = jaxpr.invars
    assert keys in data and raw in data and counter not in data
    assert data[raw].key_shape == (2,)
    assert origins[keys] == origins[raw] == ROOT and counter not in origins
    read = {eqn.invars[k] for eqn, folds in fold_points(jaxpr.eqns, origins, data) for k, _ in folds}
    assert read == {keys, raw}


def test_keys_made_from_keys_are_derived_and_a_key_from_a_seed_is_a_root():
    def fn(key, seed):
        sub = jax.random.split(key)[1]
        return jax.random.normal(sub, (2,)) + jax.random.normal(jax.random.key(seed), (2,))

    jaxpr, data, origins = _analyse(fn, jax.random.key(0), jnp.uint32(3))
    key, seed = jaxpr.invars
    assert origins[key] == ROOT and seed not in origins
    seeded = next(e for e in jaxpr.eqns if e.primitive.name == "random_seed")
    assert origins[seeded.outvars[0]] == ROOT
    split = next(e for e in jaxpr.eqns if e.primitive.name == "random_split")
    assert origins[split.outvars[0]] == DERIVED
    assert [e.primitive.name for e, _ in fold_points(jaxpr.eqns, origins, data)] == ["random_split", "random_bits"]
    assert not unfoldable_draws(jaxpr.eqns, origins, data)


def test_a_key_made_from_a_seed_inside_a_body_cannot_be_folded():
    def fn(key, seed):
        inside = jax.checkpoint(lambda s: jax.random.normal(jax.random.key(s), (2,)))(seed)
        return inside + jax.random.normal(key, (2,))

    jaxpr, data, origins = _analyse(fn, jax.random.key(0), jnp.uint32(3))
    assert [e.primitive.name for e in unfoldable_draws(jaxpr.eqns, origins, data)] in (["checkpoint"], ["remat2"])


@pytest.mark.parametrize("shape", [(), (3,)])
def test_micro_batch_zero_sees_the_key_itself_and_the_others_fold_their_index_in(shape):
    keys = jax.random.split(jax.random.key(4), 3).reshape(shape) if shape else jax.random.key(4)
    data = jax.random.key_data(keys)
    impl = jax.random.key_impl(keys)
    for j in range(3):
        want = keys if j == 0 else jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys.reshape(-1), j).reshape(shape)
        got = jax.jit(fold_key)(keys, jnp.uint32(j))
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
        raw = jax.jit(fold_key, static_argnums=2)(data, jnp.uint32(j), impl)  # key data folds as its keys
        np.testing.assert_array_equal(raw, jax.random.key_data(want))


def test_an_optimization_barrier_passes_keys_seeds_and_key_data_through_value_by_value():
    """How JAX lowers a remat call (jax_compat.inline_remat): a seed fenced by the barrier still makes a root
    key where it is seeded, and a raw key fenced with a uint32 counter is key data while the counter is not."""
    def fn(seed, raw, counter):
        seed_, raw_, counter_ = jax.lax.optimization_barrier((seed, raw, counter))
        a = jax.random.normal(jax.random.key(seed_), (2,))
        b = jax.random.normal(jax.random.wrap_key_data(raw_), (2,))
        return a + b + counter_.astype(jnp.float32)

    jaxpr, data, origins = _analyse(fn, jnp.uint32(1), jax.random.key_data(jax.random.key(2)), jnp.uint32(3))
    seed, raw, counter = jaxpr.invars
    assert raw in data and counter not in data
    assert origins[raw] == ROOT and seed not in origins and counter not in origins
    seeded = next(e for e in jaxpr.eqns if e.primitive.name == "random_seed")
    assert origins[seeded.outvars[0]] == ROOT  # made from the fenced seed: folded where it is read
