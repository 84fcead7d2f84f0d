"""FusedAccumulation: a piece's run with its outputs' accumulation fused in, compiled once."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from alpa_like.runtime.accumulation import FusedAccumulation
from tests.helpers import compiles_during


def piece(w, x):
    """Three outputs: one sharded like ``x``'s rows, ``-x`` (``-0.0`` where ``x`` is 0) and a scalar."""
    return [x @ w, -x, jnp.sum(x)]


def sharded_inputs(rng):
    """A weight and three inputs on a mesh of 4 devices; the first input's first row is 0."""
    mesh = jax.make_mesh((4,), ("x",))
    w = jax.device_put(rng.normal(size=(8, 8)).astype(np.float32), NamedSharding(mesh, P()))
    xs = rng.normal(size=(3, 16, 8)).astype(np.float32)
    xs[0, 0] = 0.0  # -x holds a row of -0.0
    return mesh, w, [jax.device_put(x, NamedSharding(mesh, P("x"))) for x in xs]


def test_totals_start_at_the_first_output_bit_for_bit_and_the_call_compiles_once():
    mesh, w, xs = sharded_inputs(np.random.default_rng(0))
    fused = FusedAccumulation(piece, slots=(0, 1))
    totals = [None, None]

    def three_calls():
        nonlocal totals
        for x in xs:
            _, totals = fused(totals, w, x)
    assert compiles_during(three_calls, "jit(run)") == 1
    np.testing.assert_array_equal(np.asarray(totals[0]), np.asarray(xs[0] @ w + xs[1] @ w + xs[2] @ w))
    assert totals[0].sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 2)
    outs, started = fused([None, None], w, xs[0])
    for out, total in zip(outs[:2], started, strict=True):
        np.testing.assert_array_equal(np.asarray(total), np.asarray(out))
        assert np.array_equal(np.signbit(np.asarray(total)), np.signbit(np.asarray(out)))
    assert np.signbit(np.asarray(started[1])[0]).all()


def test_arguments_the_compile_did_not_see_run_through_jit():
    mesh, w, xs = sharded_inputs(np.random.default_rng(1))
    fused = FusedAccumulation(piece, slots=(0, 2))
    _, totals = fused([None, None], w, xs[0])
    replicated = jax.device_put(xs[1], NamedSharding(mesh, P()))  # another layout of the same input
    got = []
    assert compiles_during(lambda: got.append(fused(totals, w, replicated)), "jit(run)") == 1  # jit's compile
    _, totals = got[0]
    np.testing.assert_allclose(np.asarray(totals[0]), np.asarray(xs[0] @ w + xs[1] @ w), rtol=1e-6)
    np.testing.assert_allclose(float(totals[1]), float(jnp.sum(xs[0]) + jnp.sum(xs[1])), rtol=1e-6)


def test_without_open_totals_a_first_call_runs_the_piece_unfused_and_its_outputs_are_the_totals():
    _, w, xs = sharded_inputs(np.random.default_rng(2))
    fused = FusedAccumulation(piece, slots=(0,), open_totals=False)
    outs, totals = fused([None], w, xs[0])
    assert totals[0] is outs[0] and fused.first_call[1] == []
    _, totals = fused(totals, w, xs[1])
    np.testing.assert_allclose(np.asarray(totals[0]), np.asarray(xs[0] @ w + xs[1] @ w), rtol=1e-6)
