"""examples/benchmarks/gpu_cost_fit.py: each fit recovers the parameters synthetic data were made with, and
the step model is exactly linear in the two step-level terms."""
import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from alpa_like.compiler.flops import ComputeRates, jaxpr_seconds

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "benchmarks" / "gpu_cost_fit.py"


@pytest.fixture(scope="module")
def fit():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_cost_fit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_matmul_fit_recovers_rate_and_overhead(fit):
    rate, t0, bandwidth = 500e12, 7e-6, 3e12
    rows = [{"flops": 2.0 * m * k * n, "bytes": 2.0 * (m * k + k * n + m * n)} for m, k, n in
            ((4096, 4096, 4096), (8192, 1024, 8192), (256, 8192, 256), (16384, 64, 16384), (2048, 2048, 512))]
    for r in rows:
        r["seconds"] = max(r["flops"] / rate, r["bytes"] / bandwidth) + t0
    got_rate, got_t0, worst = fit.fit_matmul_rate(rows, bandwidth)
    assert got_rate == pytest.approx(rate, rel=1e-6)
    assert got_t0 == pytest.approx(t0, rel=1e-5)
    assert worst < 1e-6


def test_the_step_fit_recovers_overhead_and_traffic(fit):
    overhead, traffic = 20e-6, 0.2
    terms = [(m, n, o, m + n * overhead + o * traffic) for m, n, o in
             ((1e-3, 75, 2e-2), (5e-3, 39, 4e-2), (2e-2, 435, 0.4), (3e-4, 89, 1e-2))]
    got_overhead, got_traffic = fit.fit_step_terms(terms)
    assert got_overhead == pytest.approx(overhead, rel=1e-6)
    assert got_traffic == pytest.approx(traffic, rel=1e-6)


def test_step_terms_split_the_model_exactly(fit):
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w[0]) @ w[1]))(w)
    closed = jax.make_jaxpr(step)((jnp.ones((64, 128)), jnp.ones((128, 16))), jnp.ones((32, 64)))
    rates = ComputeRates(1e15, 1e11, matmul_efficiency=0.8)
    m, n, o = fit.step_terms(closed, rates)
    assert n == pytest.approx(5)  # two forward products, three in the backward (no input gradient of x)
    for overhead, traffic in ((0.0, 1.0), (3e-6, 0.3), (1e-5, 0.05)):
        priced = jaxpr_seconds(closed, dataclasses.replace(rates, matmul_overhead=overhead, fused_traffic=traffic))
        assert m + n * overhead + o * traffic == pytest.approx(priced, rel=1e-9)


def test_bandwidth_is_the_median_of_the_large_arrays(fit):
    rows = [{"bytes": 2**30, "seconds": 2**30 / r} for r in (3e12, 4e12, 5e12)] + [{"bytes": 2**20, "seconds": 1.0}]
    assert fit.fit_bandwidth(rows) == pytest.approx(4e12)
    with pytest.raises(ValueError, match="bandwidth"):
        fit.fit_bandwidth(rows[-1:])
