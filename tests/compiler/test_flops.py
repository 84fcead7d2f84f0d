"""FLOP counts: closed forms for matmul, batched matmul, convolution and scan."""
import jax
import jax.numpy as jnp

from alpa_like.compiler.flops import jaxpr_flops


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
