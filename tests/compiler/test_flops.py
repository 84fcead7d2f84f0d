"""FLOP counts: closed forms for matmul, batched matmul, convolution and scan."""
import jax
import jax.numpy as jnp

from alpa_like.compiler.flops import eqn_flops, jaxpr_flops


def test_matmul_and_batched_matmul():
    assert jaxpr_flops(jax.make_jaxpr(jnp.matmul)(jnp.ones((4, 8)), jnp.ones((8, 16)))) == 2 * 4 * 8 * 16
    bmm = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6)))
    assert jaxpr_flops(bmm) == 2 * 3 * 4 * 5 * 6


def test_convolution():
    conv = jax.make_jaxpr(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))(jnp.ones((2, 8, 8, 3)),
                                                                        jnp.ones((3, 3, 3, 5)))
    assert jaxpr_flops(conv) == 2 * (2 * 8 * 8 * 5) * (3 * 3 * 3)


def test_strided_convolution_gradients_cost_what_the_forward_costs():
    # d loss / d input of a stride-2 convolution is a convolution over the input-dilated gradient: 3/4 of
    # its window taps meet inserted zeros, which a GPU library does not multiply.
    def loss(x, w):
        return jax.lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")).sum()
    x, w = jnp.ones((8, 32, 32, 16)), jnp.ones((3, 3, 16, 32))
    forward = 2 * (8 * 16 * 16 * 32) * (3 * 3 * 16)
    convs = [e for e in jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr.eqns
             if e.primitive.name == "conv_general_dilated"]
    assert sorted(tuple(e.params["lhs_dilation"]) for e in convs) == [(1, 1), (1, 1), (2, 2)]
    assert [eqn_flops(e) for e in convs] == [forward] * 3


def test_scan_body_counts_length_times_and_elementwise_counts_outputs():
    def f(x, w):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=7)[0]
    assert jaxpr_flops(jax.make_jaxpr(f)(jnp.ones((2, 4)), jnp.ones((4, 4)))) == 7 * 2 * 2 * 4 * 4
    assert jaxpr_flops(jax.make_jaxpr(jnp.tanh)(jnp.ones((10, 10)))) == 100


# --- the per-equation roofline ----------------------------------------------------------------------

import pytest  # noqa: E402

from alpa_like.compiler.flops import (  # noqa: E402
    ComputeRates, eqn_bytes, equation_seconds, jaxpr_bytes, jaxpr_seconds)


def test_scatter_and_reduce_are_priced_by_their_shapes_not_their_combiner():
    # their jaxpr parameter adds two scalars; the equation itself touches whole arrays
    x, i = jnp.ones((1000, 8)), jnp.arange(10)
    scatter = jax.make_jaxpr(lambda x, i: x.at[i].add(1.0))(x, i).jaxpr.eqns[-1]
    assert scatter.primitive.name == "scatter-add"
    assert eqn_flops(scatter) == 1000 * 8
    assert eqn_bytes(scatter) == 2 * 1000 * 8 * 4 + sum(
        v.aval.size * v.aval.dtype.itemsize for v in scatter.invars[1:])
    custom = jax.make_jaxpr(lambda x: jax.lax.reduce(x, 0.0, lambda a, b: a + 2 * b, (0,)))(x).jaxpr.eqns[-1]
    assert custom.primitive.name == "reduce" and eqn_flops(custom) == 8


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
    rates = ComputeRates(flops, bw)
    assert equation_seconds(mm, rates) == pytest.approx(max(2 * 64**3 / flops, 3 * 64 * 64 * 4 / bw))
    assert equation_seconds(tanh, rates) == pytest.approx(2 * 4096 * 4 / bw)  # memory-bound
    # Each equation's maximum, summed: not the maximum of the sums.
    expected = 2 * 64**3 / flops + 2 * 4096 * 4 / bw
    assert jaxpr_seconds(jaxpr, rates) == pytest.approx(expected)
    assert jaxpr_seconds(jaxpr, rates, num_devices=4) == pytest.approx(expected / 4)


def test_without_memory_bandwidth_the_roofline_is_the_flop_model():
    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]
    jaxpr = jax.make_jaxpr(f)(jnp.ones((8, 16)), jnp.ones((16, 16)))
    assert jaxpr_seconds(jaxpr, ComputeRates(1e9), num_devices=2) == pytest.approx(jaxpr_flops(jaxpr) / 2e9)
    # The scan body is priced per equation, ``length`` times.
    body_mm = 2 * 8 * 16 * 16 / 1e9
    body_tanh = 2 * 8 * 16 * 4 / 1e6
    assert jaxpr_seconds(jaxpr, ComputeRates(1e9, 1e6)) == pytest.approx(
        5 * (max(body_mm, 4 * (8 * 16 + 16 * 16 + 8 * 16) / 1e6) + body_tanh))


def test_gpu_terms_efficiency_overhead_and_fused_traffic():
    jaxpr = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((64, 64)), jnp.ones((64, 64)))
    mm, tanh = jaxpr.jaxpr.eqns
    rates = ComputeRates(1e9, 1e8, matmul_efficiency=0.5, matmul_overhead=1e-3, fused_traffic=0.25)
    assert rates.flop_rate(mm) == 0.5e9 and rates.flop_rate(tanh) == 1e9
    # A product: its roofline at half the peak, plus the overhead (paid once per device, not split).
    mm_time = max(2 * 64**3 / 0.5e9, 3 * 64 * 64 * 4 / 1e8)
    assert equation_seconds(mm, rates) == pytest.approx(mm_time + 1e-3)
    assert equation_seconds(mm, rates, num_devices=4) == pytest.approx(mm_time / 4 + 1e-3)
    # Anything else: a quarter of its bytes.
    assert equation_seconds(tanh, rates) == pytest.approx(0.25 * 2 * 4096 * 4 / 1e8)
    # Without a memory bandwidth, the overhead stays and the traffic has no effect.
    flop_only = ComputeRates(1e9, matmul_efficiency=0.5, matmul_overhead=1e-3, fused_traffic=0.25)
    assert jaxpr_seconds(jaxpr, flop_only) == pytest.approx(2 * 64**3 / 0.5e9 + 1e-3 + 4096 / 1e9)
    fp32 = ComputeRates(125e12, fp32_peak_flops=15.7e12, matmul_efficiency=0.8)
    assert fp32.flop_rate(mm) == pytest.approx(0.8 * 15.7e12)


@pytest.mark.parametrize("kwargs", [{"matmul_efficiency": 0.0}, {"matmul_efficiency": 1.2},
                                    {"fused_traffic": 0.0}, {"fused_traffic": 1.5}, {"matmul_overhead": -1.0}])
def test_compute_rates_reject_gpu_terms_out_of_range(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ComputeRates(1e9, **kwargs)


@pytest.mark.parametrize("rates", [(0.0,), (1e9, 0.0), (1e9, None, -1.0)])
def test_compute_rates_reject_non_positive_rates(rates):
    with pytest.raises(ValueError, match="ComputeRates"):
        ComputeRates(*rates)


def test_roofline_rejects_no_devices():
    eqn = jax.make_jaxpr(jnp.tanh)(jnp.ones(3)).jaxpr.eqns[0]
    with pytest.raises(ValueError, match="num_devices"):
        equation_seconds(eqn, ComputeRates(1e9), num_devices=0)


def test_float32_matrix_products_run_at_the_fp32_rate():
    # A V100: 16-bit products on tensor cores at 125 TFLOP/s, float32 ones at 15.7, element-wise at peak.
    rates = ComputeRates(125e12, fp32_peak_flops=15.7e12)
    a16, a32 = jnp.ones((64, 32), jnp.float16), jnp.ones((64, 32), jnp.float32)
    mm_flops = 2 * 64 * 64 * 32  # [64, 32] x [64, 32]^T
    for lhs, rhs, rate in ((a16, a16, 125e12), (a32, a32, 15.7e12), (a32, a16, 15.7e12)):
        eqn = jax.make_jaxpr(lambda x, y: jax.lax.dot_general(x, y, (((1,), (1,)), ((), ()))))(lhs, rhs).jaxpr.eqns[-1]
        assert eqn.primitive.name == "dot_general"
        assert equation_seconds(eqn, rates) == pytest.approx(mm_flops / rate)
    images, kernel = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 16))
    conv = jax.make_jaxpr(lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))(images, kernel).jaxpr.eqns[0]
    assert equation_seconds(conv, rates) == pytest.approx(2 * 2 * 8 * 8 * 16 * 3 * 3 * 4 / 15.7e12)
    tanh = jax.make_jaxpr(jnp.tanh)(a32).jaxpr.eqns[0]
    assert equation_seconds(tanh, rates) == pytest.approx(64 * 32 / 125e12)
    # Without an fp32 rate (measured clusters), every FLOP runs at peak.
    assert equation_seconds(conv, ComputeRates(125e12)) == pytest.approx(2 * 2 * 8 * 8 * 16 * 3 * 3 * 4 / 125e12)
