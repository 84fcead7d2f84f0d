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


# --- the per-equation roofline ----------------------------------------------------------------------

import pytest  # noqa: E402

from alpa_like.compiler.flops import eqn_bytes, equation_seconds, jaxpr_bytes, jaxpr_seconds  # noqa: E402


def test_bytes_are_operands_plus_results_and_reshape_moves_nothing():
    add = jax.make_jaxpr(jnp.add)(jnp.ones((10, 10)), jnp.ones((10, 10)))
    assert eqn_bytes(add.jaxpr.eqns[0]) == 3 * 100 * 4
    half = jax.make_jaxpr(lambda x: x.astype(jnp.bfloat16))(jnp.ones((8,)))
    assert jaxpr_bytes(half) == 8 * 4 + 8 * 2
    assert jaxpr_bytes(jax.make_jaxpr(lambda x: x.reshape(4, 25))(jnp.ones((100,)))) == 0
    mm = jax.make_jaxpr(jnp.matmul)(jnp.ones((4, 8)), jnp.ones((8, 16)))
    assert jaxpr_bytes(mm) == 4 * (4 * 8 + 8 * 16 + 4 * 16)


def test_roofline_takes_the_larger_term_per_equation():
    # x @ w (2*64*64*64 FLOPs, 3*64*64*4 bytes) followed by tanh (4096 FLOPs, 2*4096*4 bytes).
    jaxpr = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((64, 64)), jnp.ones((64, 64)))
    mm, tanh = jaxpr.jaxpr.eqns
    flops, bw = 1e9, 1e8
    assert equation_seconds(mm, flops, bw) == pytest.approx(max(2 * 64**3 / flops, 3 * 64 * 64 * 4 / bw))
    assert equation_seconds(tanh, flops, bw) == pytest.approx(2 * 4096 * 4 / bw)  # memory-bound
    # Each equation's maximum, summed: not the maximum of the sums.
    expected = 2 * 64**3 / flops + 2 * 4096 * 4 / bw
    assert jaxpr_seconds(jaxpr, flops, bw) == pytest.approx(expected)
    assert jaxpr_seconds(jaxpr, flops, bw, num_devices=4) == pytest.approx(expected / 4)


def test_without_memory_bandwidth_the_roofline_is_the_flop_model():
    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]
    jaxpr = jax.make_jaxpr(f)(jnp.ones((8, 16)), jnp.ones((16, 16)))
    assert jaxpr_seconds(jaxpr, 1e9, None, num_devices=2) == pytest.approx(jaxpr_flops(jaxpr) / 2e9)
    # The scan body is priced per equation, ``length`` times.
    body_mm = 2 * 8 * 16 * 16 / 1e9
    body_tanh = 2 * 8 * 16 * 4 / 1e6
    assert jaxpr_seconds(jaxpr, 1e9, 1e6) == pytest.approx(5 * (max(body_mm, 4 * (8 * 16 + 16 * 16 + 8 * 16) / 1e6)
                                                                + body_tanh))


@pytest.mark.parametrize("args", [(0.0, 1e9, 1), (1e9, 0.0, 1), (1e9, 1e9, 0)])
def test_roofline_rejects_non_positive_rates(args):
    eqn = jax.make_jaxpr(jnp.tanh)(jnp.ones(3)).jaxpr.eqns[0]
    with pytest.raises(ValueError, match="peak_flops, memory_bandwidth and num_devices"):
        equation_seconds(eqn, *args)
