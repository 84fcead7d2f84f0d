"""Eq. 2.9 cost models: least-squares fit, the analytic model's utilisation floor and causal growth."""
import numpy as np
import pytest

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.terapipe_cost import (SliceTimings, analytic_slice_costs, data_parallel_sync_seconds,
                                              fit_slice_costs, measured_slice_costs, slice_grid, time_slice_grid,
                                              transformer_layer_flops)
from alpa_like.compiler.token_slicing import slice_cost_table, solve_token_slicing


def synthetic(i, j):
    return 1e-3 + 2e-5 * i + (3e-6 + 1e-7 * i + 4e-6 * j + 5e-8 * i * j) * (j > 0)


def test_fit_recovers_a_linear_context_term_exactly():
    samples = [(i, j, synthetic(i, j)) for i in (1, 4, 16, 32) for j in {0, 3, 10, 32 - i} if i + j <= 32]
    model = fit_slice_costs(32, samples)
    np.testing.assert_allclose(model.context_coefficients, (3e-6, 1e-7, 4e-6, 5e-8), rtol=1e-6, atol=1e-12)
    assert model.fit_error < 1e-9
    i, j = np.array([5, 7, 20]), np.array([0, 9, 12])
    np.testing.assert_allclose(model.slice_time(i, j), synthetic(i, j), rtol=1e-9)


def test_measured_model_reports_its_fit_error():
    calls = []
    model = measured_slice_costs(lambda i, j: calls.append((i, j)), 16, lengths=[1, 8, 16], repeats=1)
    assert (16, 0) in calls and (8, 8) in calls
    assert model.seq_len == 16 and model.fit_error >= 0
    assert {(i, j) for i, j, _, _ in model.fit_points} == set(calls)


def test_grid_timing_warms_up_then_times_every_point_once_per_shuffled_round():
    calls = []
    points = slice_grid(16, [4, 8], [4])
    assert points == [(4, 0), (4, 4), (8, 0), (8, 4)]
    assert slice_grid(16, [4, 8], [4], last_slice=True) == [(4, 0), (4, 4), (4, 12), (8, 0), (8, 4), (8, 8)]
    timings = time_slice_grid(lambda i, j: calls.append((i, j)), points, repeats=5, warmup=2)
    assert calls[:8] == [p for p in points for _ in range(2)]  # warm-up: each point twice, in grid order
    rounds = [calls[8 + 4 * r: 12 + 4 * r] for r in range(5)]
    assert all(sorted(r) == points for r in rounds) and len({tuple(r) for r in rounds}) > 1
    assert all(len(t) == 5 for t in timings.runs.values())
    assert [(i, j) for i, j, _ in timings.medians()] == points
    with pytest.raises(ValueError, match="repeats"):
        time_slice_grid(lambda i, j: None, points, repeats=0)


def test_halves_split_the_rounds_and_held_out_errors_score_a_model():
    """Even and odd rounds are two independent measurements of every point; a model fitted on one half is
    scored on points held out of its fit, against the other half."""
    timings = SliceTimings(runs={(4, 0): (1.0, 2.0, 3.0, 4.0, 5.0), (4, 4): (2.0, 2.0, 4.0, 4.0, 6.0)})
    even, odd = timings.halves()
    assert even.runs == {(4, 0): (1.0, 3.0, 5.0), (4, 4): (2.0, 4.0, 6.0)}
    assert odd.runs == {(4, 0): (2.0, 4.0), (4, 4): (2.0, 4.0)}
    with pytest.raises(ValueError, match="at least 2"):
        SliceTimings(runs={(4, 0): (1.0,)}).halves()
    model = fit_slice_costs(32, [(i, j, synthetic(i, j)) for i in (1, 8, 32) for j in (0, 8, 24) if i + j <= 32])
    held_out = [(4, 12, synthetic(4, 12)), (16, 4, 2 * synthetic(16, 4))]
    np.testing.assert_allclose(model.relative_errors(held_out), [0.0, -0.5], atol=1e-9)


def test_tabulated_last_slice_takes_a_step_the_plane_cannot():
    """Costs on Eq. 2.9's plane except slices ending the sequence (i + j = L), which pay a step (the
    power-of-two key-length aliasing measured on CPU): with the last slice tabulated, the plane is recovered
    exactly and the last slice is exact at every measured length."""
    def stepped(i, j):
        return synthetic(i, j) + 5e-4 * (i + j == 32) * (j > 0)

    points = slice_grid(32, [2, 4, 8, 16, 32], [3, 10], last_slice=True)
    samples = [(i, j, stepped(i, j)) for i, j in points]
    plain = fit_slice_costs(32, samples)
    tabulated = fit_slice_costs(32, samples, tabulate_last_slice=True)
    assert plain.context_fit_error > 0.05
    np.testing.assert_allclose(tabulated.context_coefficients, (3e-6, 1e-7, 4e-6, 5e-8), rtol=1e-6, atol=1e-12)
    assert tabulated.fit_error < 1e-9 and tabulated.context_fit_error < 1e-9
    assert tabulated.slice_time(8, 24) == pytest.approx(stepped(8, 24))
    assert tabulated.slice_time(8, 20) == pytest.approx(synthetic(8, 20))  # not the last slice: the plane
    assert tabulated.slice_time(32, 0) == pytest.approx(synthetic(32, 0))
    with pytest.raises(ValueError, match="tabulate_last_slice needs samples"):
        fit_slice_costs(32, [(4, 0, 1.0), (4, 3, 2.0)], tabulate_last_slice=True)


def test_analytic_model_has_the_utilisation_floor_and_grows_with_context():
    cluster = ClusterSpec.preset("p3.16xlarge", num_nodes=1)
    model = analytic_slice_costs(cluster, seq_len=2048, hidden=2048, layers_per_stage=1, saturation_tokens=256,
                                 cross_node=False)
    t = model.slice_time
    # Below the floor only the attention (2% at 256 tokens) and the activation send grow with the slice.
    assert t(1, 0) == pytest.approx(t(256, 0), rel=0.05)
    assert t(512, 0) > 1.5 * t(256, 0)
    assert t(256, 1024) > t(256, 0)
    assert model.fit_error < 1e-6  # attention FLOPs are bilinear in (i, j): Eq. 2.9 is exact for them


def test_utilisation_floor_is_per_device_work():
    """On 8 devices a layer's per-device GEMMs are 8x narrower: the floor of 256 tokens on one device is 2048
    tokens on 8 (Fig. 2.3's floor as a device's work), so slicing a 2048-token sequence saves nothing dense."""
    cluster = ClusterSpec.preset("p3.16xlarge", num_nodes=1)
    one = analytic_slice_costs(cluster, seq_len=4096, hidden=2048, layers_per_stage=1, saturation_tokens=256,
                               cross_node=False, training=False)
    eight = analytic_slice_costs(cluster, seq_len=4096, hidden=2048, layers_per_stage=1, saturation_tokens=256,
                                 op_degree=8, cross_node=False, training=False)
    assert one.slice_time(128, 0) == pytest.approx(one.slice_time(256, 0), rel=0.05)
    # Below 2048 tokens only the Megatron all-reduces (linear in the tokens) and the attention still shrink:
    # half the tokens cost well over half the time (a proportional model: 0.5).
    assert eight.slice_time(1024, 0) > 0.7 * eight.slice_time(2048, 0)
    assert eight.slice_time(4096, 0) > 1.5 * eight.slice_time(2048, 0)
    floor = transformer_layer_flops(1, 256, 0, 2048)[0]
    same = analytic_slice_costs(cluster, seq_len=4096, hidden=2048, layers_per_stage=1, saturation_flops=floor,
                                op_degree=8, cross_node=False, training=False)
    assert same.slice_time(100, 0) == pytest.approx(eight.slice_time(100, 0), rel=1e-9)


def test_data_parallel_sync_is_a_ring_all_reduce_of_the_stage_gradients():
    cluster = ClusterSpec.preset("p3.16xlarge", num_nodes=4)
    seconds = data_parallel_sync_seconds(cluster, hidden=1024, layers_per_stage=2, op_degree=4, data_parallel=4)
    nbytes = 12 * 1024**2 * 2 / 4 * 2
    assert seconds == pytest.approx(2 * 3 / 4 * nbytes / cluster.inter_node_bandwidth + 6 * cluster.inter_node_latency)
    assert data_parallel_sync_seconds(cluster, hidden=1024, layers_per_stage=2, op_degree=4, data_parallel=1) == 0


def test_analytic_model_slices_non_increasing():
    cluster = ClusterSpec.preset("p3.16xlarge", num_nodes=8)
    model = analytic_slice_costs(cluster, seq_len=512, hidden=1024, layers_per_stage=1, saturation_tokens=32)
    lengths = solve_token_slicing(slice_cost_table(model, 512), 24, epsilon=1e-6).lengths
    assert len(lengths) > 1
    assert list(lengths) == sorted(lengths, reverse=True), lengths


def test_bad_input():
    with pytest.raises(ValueError, match="context 0"):
        fit_slice_costs(8, [(2, 3, 1.0)])
    with pytest.raises(ValueError, match="efficiency"):
        analytic_slice_costs(ClusterSpec.preset("p3.16xlarge"), seq_len=8, hidden=8, layers_per_stage=1,
                             efficiency=0)
    model = fit_slice_costs(8, [(8, 0, 1.0)])
    with pytest.raises(ValueError, match="length"):
        model.slice_time(5, 4)
