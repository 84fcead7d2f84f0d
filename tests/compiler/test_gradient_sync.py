"""Which gradients can be reduced once per step, and the partial-sum rewrite computes them exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_like.compiler.gradient_sync import deferrable_gradients, stacked_spec
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.runtime.mesh import make_mesh, named_sharding
from alpa_like.runtime.partial_sums import eval_piece, reduce_stack

S0 = ShardingSpec.from_str("S0R")  # rows (the batch) split over mesh axis 0


def analyse(fn, args, specs, gradients=None, mesh_shape=(4, 1), hoisted=0):
    """``fn``'s jaxpr analysed with its first ``hoisted`` equations computed before the piece."""
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    var_specs = {v: s for v, s in zip(jaxpr.invars, specs, strict=True) if s is not None}
    outputs = jaxpr.outvars
    grads = outputs if gradients is None else [outputs[k] for k in gradients]
    return closed, deferrable_gradients(jaxpr.eqns[hoisted:], grads, outputs, var_specs, {}, mesh_shape,
                                        before=jaxpr.eqns[:hoisted])


def xt_dy(x, dy):
    """``x^T dy`` contracting the rows (the batch) directly, as a weight gradient's ``dot_general`` does."""
    return jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))


def linear_grads(x, dy):
    return xt_dy(x, dy), jnp.sum(dy, axis=0)


def test_weight_and_bias_gradients_of_a_batch_split_layer_are_deferred():
    x, dy = jnp.ones((8, 3)), jnp.ones((8, 5))
    closed, deferred = analyse(linear_grads, (x, dy), (S0, S0))
    assert set(deferred.outputs) == set(closed.jaxpr.outvars)
    assert set(deferred.outputs.values()) == {(0,)}
    assert {s.stack for s in deferred.sources.values()} == {4}


def test_nothing_is_deferred_when_the_contracted_dim_is_not_split():
    x, dy = jnp.ones((8, 3)), jnp.ones((8, 5))
    rep = ShardingSpec.replicated(2)
    _, deferred = analyse(linear_grads, (x, dy), (rep, rep))
    assert not deferred


@pytest.mark.parametrize("fn", [
    lambda x, dy: jnp.tanh(xt_dy(x, dy)),  # not linear in the partial sums
    lambda x, dy: (lambda g: g * g)(xt_dy(x, dy)),  # the square of a partial sum
    lambda x, dy: xt_dy(x, dy) + 1.0,  # adds a whole value to every partial sum
])
def test_a_gradient_that_is_not_linear_in_the_partial_sums_keeps_its_all_reduce(fn):
    _, deferred = analyse(fn, (jnp.ones((8, 3)), jnp.ones((8, 5))), (S0, S0))
    assert not deferred


def test_a_value_on_the_way_that_is_also_read_elsewhere_keeps_the_gradient_whole():
    def fn(x, dy):
        g = xt_dy(x, dy)
        return g * 2.0, jnp.sum(g)
    _, deferred = analyse(fn, (jnp.ones((8, 3)), jnp.ones((8, 5))), (S0, S0), gradients=[0])
    assert not deferred


def test_linear_steps_after_the_contraction_are_lifted():
    def fn(x, dy, scale):
        g = xt_dy(x, dy).astype(jnp.bfloat16).astype(jnp.float32)
        return (jnp.transpose(g) * scale + jnp.transpose(xt_dy(x, dy))).reshape(-1)
    _, deferred = analyse(fn, (jnp.ones((8, 3)), jnp.ones((8, 5)), jnp.float32(0.5)),
                          (S0, S0, ShardingSpec.replicated(0)))
    assert len(deferred.outputs) == 1 and len(deferred.sources) == 2


def embedding_grad(idx, dy):
    """The gradient of an embedding lookup: the rows ``dy`` added into a zero table at ``idx``."""
    dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                         scatter_dims_to_operand_dims=(0,))
    return jax.lax.scatter_add(jnp.zeros((10, 4)), idx, dy, dn, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


CASES = {  # name: (function, argument shapes (("int", shape, high) for indices), specs, mesh shape)
    "linear": (linear_grads, ((8, 3), (8, 5)), ("S0R", "S0R"), (4, 1)),
    "sequence": (lambda x, dy: (jax.lax.dot_general(x, dy, (((0, 1), (0, 1)), ((), ()))), jnp.sum(dy, axis=(0, 1))),
                 ((4, 6, 3), (4, 6, 5)), ("S0RR", "S0RR"), (2, 2)),
    "split on axis 1": (linear_grads, ((8, 3), (8, 5)), ("S1R", "S1R"), (2, 4)),
    "split on both axes": (linear_grads, ((8, 3), (8, 5)), ("S01R", "S01R"), (2, 2)),
    "batched contraction": (lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((0,), (0,)))), ((2, 8, 3), (2, 8, 5)),
                            ("RS0R", "RS0R"), (4, 1)),
    "contraction not first": (lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))), ((3, 8), (5, 8)),
                              ("RS0", "RS0"), (4, 1)),
    "embedding": (embedding_grad, (("int", (8, 1), 10), (8, 4)), ("S0R", "S0R"), (4, 1)),
    # positions (an iota, replicated) index rows of the batch: sliced like the updates
    "embedding at replicated indices": (embedding_grad, (("int", (8, 1), 10), (8, 4)), (None, "S0R"), (4, 1)),
    # a convolution's weight gradient: JAX contracts the batch as the feature dims of x and dy; one row per
    # device is the case XLA computed wrongly as a vmapped (grouped) convolution
    "convolution": (lambda x, dy: jax.lax.conv_general_dilated(x, dy, (1, 1), "VALID",
                                                               dimension_numbers=("CHWN", "IHWO", "HWNC")),
                    ((4, 5, 5, 3), (4, 3, 3, 4)), ("S0RRR", "S0RRR"), (4, 1)),
    # a position embedding's gradient: the batch summed, then added into a zero table at its positions
    "scatter after the sum": (lambda dy: embedding_grad(jnp.arange(8)[:, None] % 10, jnp.sum(dy, axis=0)),
                              ((4, 8, 4),), ("S0RR",), (4, 1)),
    "lifted": (lambda x, dy: (jnp.transpose(xt_dy(x, dy)) * 0.5 - jnp.transpose(xt_dy(x, dy))).reshape(-1),
               ((8, 3), (8, 5)), ("S0R", "S0R"), (4, 1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stacked_partial_sums_add_up_to_the_gradients(case):
    fn, shapes, texts, mesh_shape = CASES[case]
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.integers(0, s[2], size=s[1]), jnp.int32) if s[0] == "int"
            else jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    specs = [None if t is None else ShardingSpec.from_str(t) for t in texts]
    closed, deferred = analyse(fn, args, specs, mesh_shape=mesh_shape)
    assert set(deferred.outputs) == set(closed.jaxpr.outvars)
    mesh = make_mesh(jax.devices()[:mesh_shape[0] * mesh_shape[1]], mesh_shape, ("x", "y"))
    placed = [jax.device_put(a, named_sharding(mesh, s or ShardingSpec.replicated(a.ndim)))
              for a, s in zip(args, specs, strict=True)]
    stacks = jax.jit(lambda *xs: eval_piece(closed, xs, deferred, mesh))(*placed)
    expected = jax.jit(fn)(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for stack, want, var in zip(stacks, expected, closed.jaxpr.outvars, strict=True):
        axes = deferred.outputs[var]
        assert stack.shape == (int(np.prod([mesh_shape[a] for a in axes])),) + want.shape
        np.testing.assert_allclose(np.asarray(reduce_stack(stack, 1)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_an_embedding_gradient_into_a_nonzero_table_is_not_split():
    def fn(idx, dy):
        dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                             scatter_dims_to_operand_dims=(0,))
        return jax.lax.scatter_add(jnp.ones((10, 4)), idx, dy, dn)  # every partial sum would add the ones
    _, deferred = analyse(fn, (jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 4))), (S0, S0))
    assert not deferred


def test_a_zero_table_made_before_the_piece_is_known_to_be_zero():
    # the zero table of an embedding gradient does not depend on the batch: hoisted out of the loop
    args, specs = (jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 4))), (S0, S0)
    closed, _ = analyse(embedding_grad, args, specs)
    assert closed.jaxpr.eqns[0].primitive.name == "broadcast_in_dim"
    _, deferred = analyse(embedding_grad, args, specs, hoisted=1)
    assert set(deferred.outputs) == set(closed.jaxpr.outvars)


def test_stacked_spec_puts_the_stack_on_the_reduced_axes_and_takes_them_off_the_value():
    assert stacked_spec(ShardingSpec.from_str("S0R"), (0,)) == ShardingSpec.from_str("S0RR")
    assert stacked_spec(ShardingSpec.from_str("RS1"), (0,)) == ShardingSpec.from_str("S0RS1")
