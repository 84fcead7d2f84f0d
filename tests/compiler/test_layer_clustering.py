"""Operator clustering (Alpa Eq. 3.6) against brute force, and the incoming-bytes helper against its definition."""
import doctest
import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_like.compiler import layer_clustering as layer_clustering_module
from alpa_like.compiler.layer_clustering import cluster_layers, incoming_bytes


def naive_incoming_bytes(num_ops, edges):
    """By the definition: values produced before ``i`` with a consumer in ``i..k``, each value once."""
    values = {}
    for number, edge in enumerate(edges):
        key = edge[3] if len(edge) == 4 else ("edge", number)
        producer, _, nbytes = edge[:3]
        values.setdefault(key, (producer, nbytes, set()))[2].add(edge[1])
    comm = np.zeros((num_ops, num_ops))
    for i, k in itertools.combinations_with_replacement(range(num_ops), 2):
        comm[i, k] = sum(nbytes for producer, nbytes, consumers in values.values()
                         if producer < i and any(i <= c <= k for c in consumers))
    return comm


def brute_force(flops, comm, num_layers, delta, end_saving=None):
    """(least max incoming bytes, least FLOP variance among those) over every clustering, or None; with
    ``end_saving``, the variance of the layers' step FLOPs ``4 f - saving at the layer's last operator``."""
    n, total = len(flops), float(sum(flops))
    bound = (1 + delta) * total / num_layers
    best = None
    for cuts in itertools.combinations(range(1, n), num_layers - 1):
        bounds = (0, *cuts, n)
        layer_flops = [float(sum(flops[a:b])) for a, b in zip(bounds, bounds[1:])]
        if max(layer_flops) > bound * (1 + 1e-9):
            continue
        costs = layer_flops if end_saving is None else [4 * f - end_saving[b - 1]
                                                          for f, b in zip(layer_flops, bounds[1:])]
        key = (max(comm[a, b - 1] for a, b in zip(bounds, bounds[1:])), float(np.sum(np.square(costs))))
        if best is None or key[0] < best[0] or (key[0] == best[0] and key[1] < best[1] - 1e-9):
            best = key
    return best


@st.composite
def graphs(draw, max_ops=9):
    n = draw(st.integers(1, max_ops))
    flops = draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))
    edges = []
    if n > 1:
        for _ in range(draw(st.integers(0, 2 * n))):
            producer = draw(st.integers(0, n - 2))
            consumer = draw(st.integers(producer + 1, n - 1))
            edges.append((producer, consumer, float(draw(st.integers(0, 5)))))
        for name in range(draw(st.integers(0, 2))):  # Values with several consumers.
            producer = draw(st.integers(0, n - 2))
            consumers = draw(st.lists(st.integers(producer + 1, n - 1), min_size=1, max_size=3))
            nbytes = float(draw(st.integers(1, 5)))
            edges += [(producer, c, nbytes, f"v{name}") for c in consumers]
    return n, flops, edges


@settings(max_examples=150, deadline=None)
@given(graph=graphs())
def test_incoming_bytes_matches_definition(graph):
    n, _, edges = graph
    np.testing.assert_array_equal(incoming_bytes(n, edges), naive_incoming_bytes(n, edges))


@settings(max_examples=200, deadline=None)
@given(graph=graphs(), data=st.data(), delta=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_clustering_equals_brute_force(graph, data, delta):
    n, flops, edges = graph
    num_layers = data.draw(st.integers(1, n))
    comm = incoming_bytes(n, edges)
    expected = brute_force(flops, comm, num_layers, delta)
    if expected is None:
        with pytest.raises(ValueError, match="pass a larger delta"):
            cluster_layers(flops, comm, num_layers, delta)
        return
    result = cluster_layers(flops, comm, num_layers, delta)
    bounds = result.boundaries
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == num_layers + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert result.layer_flops == tuple(float(sum(flops[a:b])) for a, b in zip(bounds, bounds[1:]))
    assert max(result.layer_flops) <= (1 + delta) * sum(flops) / num_layers * (1 + 1e-9)  # The balance bound.
    assert result.max_incoming_bytes == max(comm[a, b - 1] for a, b in zip(bounds, bounds[1:]))
    assert result.max_incoming_bytes == expected[0]
    assert float(np.sum(np.square(result.layer_flops))) == pytest.approx(expected[1], abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(graph=graphs(), data=st.data(), delta=st.sampled_from([0.0, 0.5, 1.0]))
def test_clustering_with_recompute_savings_equals_brute_force(graph, data, delta):
    n, flops, edges = graph
    num_layers = data.draw(st.integers(1, n))
    saving = [float(data.draw(st.integers(0, f))) for f in flops]
    comm = incoming_bytes(n, edges)
    expected = brute_force(flops, comm, num_layers, delta, saving)
    if expected is None:
        return  # the FLOP bound alone decides, as in the test without savings
    result = cluster_layers(flops, comm, num_layers, delta, end_saving=saving)
    bounds = result.boundaries
    assert result.max_incoming_bytes == expected[0]
    costs = [4 * f - saving[b - 1] for f, b in zip(result.layer_flops, bounds[1:])]
    assert float(np.sum(np.square(costs))) == pytest.approx(expected[1], abs=1e-9)


def test_recompute_savings_move_cuts_after_heavy_operators():
    # Every cut costs the same bytes. Without savings layers of 3 and 4 FLOPs win (sums of squares 9 + 16);
    # a layer ending at operator 2 recomputes 2 FLOPs less: step FLOPs 4 * 5 - 2 and 4 * 2, 18^2 + 8^2 = 388,
    # against 12^2 + 16^2 = 400 for the balanced cut.
    chain = incoming_bytes(4, [(i, i + 1, 10.0) for i in range(3)])
    assert cluster_layers([1.0, 2.0, 2.0, 2.0], chain, 2, delta=1.0).boundaries == (0, 2, 4)
    saving = [0.0, 0.0, 2.0, 0.0]
    assert cluster_layers([1.0, 2.0, 2.0, 2.0], chain, 2, delta=1.0, end_saving=saving).boundaries == (0, 3, 4)
    with pytest.raises(ValueError, match="end_saving"):
        cluster_layers([1.0, 2.0, 2.0, 2.0], chain, 2, delta=1.0, end_saving=[3.0] * 4)


def test_chain_of_equal_operators_splits_evenly():
    chain = incoming_bytes(12, [(i, i + 1, 10.0) for i in range(11)])
    assert cluster_layers([3.0] * 12, chain, 4, delta=0.0).boundaries == (0, 3, 6, 9, 12)
    # With slack every cut costs the same 10 bytes: the variance tie-break still picks the even split.
    result = cluster_layers([3.0] * 12, chain, 4, delta=0.5)
    assert result.boundaries == (0, 3, 6, 9, 12)
    assert result.max_incoming_bytes == 10.0 and result.flop_variance == 0.0
    assert [len(layer) for layer in result.layers] == [3, 3, 3, 3]


def test_a_cut_at_a_cheap_edge_is_preferred():
    edges = [(i, i + 1, 1.0 if i == 4 else 100.0) for i in range(7)]
    result = cluster_layers([1.0] * 8, incoming_bytes(8, edges), 2, delta=0.5)
    assert result.boundaries == (0, 5, 8)  # Layers of 5 and 3 operators (<= 1.5 * 4 FLOPs each).
    assert result.max_incoming_bytes == 1.0
    # Without slack the even split is forced, whatever it costs.
    assert cluster_layers([1.0] * 8, incoming_bytes(8, edges), 2, delta=0.0).boundaries == (0, 4, 8)


def test_skip_connections_count_once_per_layer():
    # Op 0's output feeds ops 2 and 3: a layer holding both receives it once.
    comm = incoming_bytes(4, [(0, 2, 7.0, "x"), (0, 3, 7.0, "x"), (0, 1, 1.0), (1, 2, 1.0), (2, 3, 1.0)])
    assert comm[2, 3] == 7.0 + 1.0
    assert comm[1, 3] == 7.0 + 1.0  # x (once) and op 0 -> op 1.
    assert comm[3, 3] == 7.0 + 1.0


def test_variance_tie_break_is_not_lexicographic():
    """FLOPs 1, 2, 2, 4, 4 and chain edges of 1, 2, 3, 5 bytes into 3 layers (delta = 1: at most 8.67 FLOPs).
    G* = 3 (cuts before ops 1, 2 or 3). For ops 0..2 in two layers a lexicographic (max, sum of squares) DP
    keeps [1] [2, 2] (max 1, 17) over [1, 2] [2] (max 2, 13), but with the last layer [4, 4] (3 bytes) both
    reach the max 3 and the second has the smaller variance: 3, 2, 8 beats 1, 4, 8."""
    comm = incoming_bytes(5, [(0, 1, 1.0), (1, 2, 2.0), (2, 3, 3.0), (3, 4, 5.0)])
    result = cluster_layers([1.0, 2.0, 2.0, 4.0, 4.0], comm, 3, delta=1.0)
    assert result.boundaries == (0, 2, 3, 5)
    assert result.max_incoming_bytes == 3.0
    assert result.layer_flops == (3.0, 2.0, 8.0)


def test_no_clustering_within_the_bound_suggests_delta():
    with pytest.raises(ValueError, match=r"into 2 layers keeps every layer within .* = 4\.4 FLOPs \(delta = 0\.1.*"
                                         r"needs delta >= 0\.25: pass a larger delta or fewer layers"):
        cluster_layers([1.0, 1.0, 1.0, 5.0], np.zeros((4, 4)), 2, delta=0.1)
    assert cluster_layers([1.0, 1.0, 1.0, 5.0], np.zeros((4, 4)), 2, delta=0.25).boundaries == (0, 3, 4)
    with pytest.raises(ValueError, match=r"needs delta >= 0\.3334"):  # 1/3, rounded up so that it suffices.
        cluster_layers([1.0, 1.0, 1.0], np.zeros((3, 3)), 2, delta=0.0)
    assert cluster_layers([1.0, 1.0, 1.0], np.zeros((3, 3)), 2, delta=0.3334).num_layers == 2


def test_bad_inputs_are_rejected_with_their_values():
    with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 3\].*got 4"):
        cluster_layers([1.0] * 3, np.zeros((3, 3)), 4, 0.1)
    with pytest.raises(ValueError, match=r"comm must have shape \(n, n\) = \(3, 3\) for 3 operators, got \(2, 2\)"):
        cluster_layers([1.0] * 3, np.zeros((2, 2)), 1, 0.1)
    with pytest.raises(ValueError, match="flops must be a non-empty 1-D sequence of finite numbers >= 0"):
        cluster_layers([1.0, -1.0], np.zeros((2, 2)), 1, 0.1)
    with pytest.raises(ValueError, match="delta must be a finite number >= 0, got -0.5"):
        cluster_layers([1.0] * 2, np.zeros((2, 2)), 1, -0.5)
    with pytest.raises(ValueError, match=r"edge \(2, 1, 4.0\): need 0 <= producer < consumer < num_ops = 3"):
        incoming_bytes(3, [(2, 1, 4.0)])
    with pytest.raises(ValueError, match=r"value 'x' has edges with different producers or sizes"):
        incoming_bytes(3, [(0, 1, 4.0, "x"), (0, 2, 5.0, "x")])
    with pytest.raises(ValueError, match="nbytes must be a finite number >= 0"):
        incoming_bytes(3, [(0, 1, -4.0)])


def test_large_graph_is_fast():
    """A 2,000-operator transformer-like chain (heavy matmuls, cheap elementwise ops, residual values that skip
    ahead) into 48 layers: the banded DP is O(n * W * L)."""
    rng = np.random.default_rng(0)
    n = 2000
    flops = np.where(np.arange(n) % 5 == 0, 100.0, 1.0) * rng.uniform(0.9, 1.1, n)
    edges = [(i, i + 1, float(rng.integers(1, 100))) for i in range(n - 1)]
    edges += [(i, min(i + 7, n - 1), 50.0, f"residual{i}") for i in range(0, n - 1, 7)]
    start = time.perf_counter()
    result = cluster_layers(flops, incoming_bytes(n, edges), 48, delta=0.1)
    elapsed = time.perf_counter() - start
    assert result.num_layers == 48
    assert max(result.layer_flops) <= 1.1 * flops.sum() / 48 * (1 + 1e-9)
    assert elapsed < 5.0, elapsed


def test_doctests():
    assert doctest.testmod(layer_clustering_module).failed == 0
