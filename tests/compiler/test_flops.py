"""FLOP counts: closed forms for matmul, batched matmul, convolution and scan."""
import jax
import jax.numpy as jnp
import pytest

from alpa_like.compiler.flops import jaxpr_bytes, jaxpr_flops, jaxpr_seconds


def test_matmul_and_batched_matmul():
    assert jaxpr_flops(jax.make_jaxpr(jnp.matmul)(jnp.ones((4, 8)), jnp.ones((8, 16)))) == 2 * 4 * 8 * 16
    bmm = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6)))
    assert jaxpr_flops(bmm) == 2 * 3 * 4 * 5 * 6


def test_convolution():
    conv = jax.make_jaxpr(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))(jnp.ones((2, 8, 8, 3)),
                                                                        jnp.ones((3, 3, 3, 5)))
    assert jaxpr_flops(conv) == 2 * (2 * 8 * 8 * 5) * (3 * 3 * 3)


def test_scan_body_counts_length_times_and_elementwise_counts_outputs():
    def f(x, w):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=7)[0]
    assert jaxpr_flops(jax.make_jaxpr(f)(jnp.ones((2, 4)), jnp.ones((4, 4)))) == 7 * 2 * 2 * 4 * 4
    assert jaxpr_flops(jax.make_jaxpr(jnp.tanh)(jnp.ones((10, 10)))) == 100


def test_bytes_are_operands_and_results_and_shape_changes_move_nothing():
    x = jnp.ones((10, 10), jnp.float32)
    assert jaxpr_bytes(jax.make_jaxpr(jnp.tanh)(x)) == 2 * 400
    assert jaxpr_bytes(jax.make_jaxpr(lambda a: a.reshape(100))(x)) == 0
    assert jaxpr_bytes(jax.make_jaxpr(jnp.matmul)(x, x)) == 3 * 400

    def f(c):
        return jax.lax.scan(lambda c, _: (jnp.sin(c), None), c, None, length=5)[0]
    assert jaxpr_bytes(jax.make_jaxpr(f)(x)) == 5 * 2 * 400


def test_roofline_prices_matmuls_by_flops_and_elementwise_work_by_bytes():
    """A 256^3 matmul (33.6 MFLOP, 786 kB) at 1 TFLOP/s and 100 GB/s is compute-bound (33.6 us > 7.9 us); the
    tanh of its result (65,536 FLOPs, 524 kB) is memory-bound (5.2 us > 0.07 us)."""
    a = jnp.ones((256, 256), jnp.float32)
    closed = jax.make_jaxpr(lambda x: jnp.tanh(x @ x))(a)
    matmul, tanh = 2 * 256**3 / 1e12, 2 * 256 * 256 * 4 / 100e9
    assert jaxpr_seconds(closed, 1e12, 100e9) == pytest.approx(matmul + tanh)
    assert jaxpr_seconds(closed, 1e12, None) == pytest.approx(jaxpr_flops(closed) / 1e12)
