"""LogicalMesh: alpha-beta collective costs in closed form, views of a cluster's submesh (Alpa §3.4.1)."""
import dataclasses
import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler import logical_mesh as logical_mesh_module
from alpa_like.compiler.logical_mesh import LogicalMesh, logical_shapes

A0, A1 = 3e-5, 2e-6  # axis 0 slow (inter-node-like), axis 1 fast: wrong-axis bugs change the numbers
B0, B1 = 1e-9, 1e-11
MESH = LogicalMesh(shape=(2, 4), alpha=(A0, A1), beta=(B0, B1))
M = 2.0**20


def test_logical_shapes():
    assert logical_shapes(8) == ((1, 8), (2, 4), (4, 2), (8, 1))
    assert logical_shapes(16) == ((1, 16), (2, 8), (4, 4), (8, 2), (16, 1))  # Alpa §3.4.1's example
    assert logical_shapes(1) == ((1, 1),)
    assert logical_shapes(6) == ((1, 6), (2, 3), (3, 2), (6, 1))
    with pytest.raises(ValueError, match="num_devices"):
        logical_shapes(0)


@pytest.mark.parametrize("axis, n, alpha, beta", [(0, 2, A0, B0), (1, 4, A1, B1), ((0, 1), 8, A0, B0)])
def test_closed_form_costs(axis, n, alpha, beta):
    assert MESH.all_reduce_cost(M, axis) == pytest.approx(alpha + 2 * (n - 1) / n * M * beta)
    assert MESH.all_gather_cost(M, axis) == pytest.approx(alpha + (n - 1) / n * M * beta)
    assert MESH.reduce_scatter_cost(M, axis) == pytest.approx(alpha + (n - 1) / n * M * beta)
    assert MESH.all_to_all_cost(M, axis) == pytest.approx(alpha + (n - 1) / n**2 * M * beta)
    assert MESH.axis_size(axis) == n


def test_both_axes_use_the_slower_axis():
    fast_first = LogicalMesh(shape=(2, 4), alpha=(1e-6, 5e-6), beta=(1e-12, 1e-9))
    assert fast_first.all_gather_cost(M, (0, 1)) == pytest.approx(5e-6 + 7 / 8 * M * 1e-9)
    assert fast_first.all_gather_cost(M, (1, 0)) == fast_first.all_gather_cost(M, (0, 1))
    assert fast_first.all_gather_cost(M, (1,)) == fast_first.all_gather_cost(M, 1)


def test_table_3_3_all_reduce_costs():
    """Table 3.3 #2 (i->0, k->1): all-reduce(M/n0, 1); #7 (k->{0,1}): all-reduce(M, {0,1})."""
    n0, n1 = MESH.shape
    assert MESH.all_reduce_cost(M / n0, 1) == pytest.approx(A1 + 2 * (n1 - 1) / n1 * (M / n0) * B1)
    assert MESH.all_reduce_cost(M, (0, 1)) == pytest.approx(A0 + 2 * 7 / 8 * M * B0)


def test_axis_of_size_one_is_free():
    mesh = LogicalMesh(shape=(1, 8), alpha=(1.0, 1.0), beta=(1.0, 1.0))
    for cost in (mesh.all_reduce_cost, mesh.all_gather_cost, mesh.reduce_scatter_cost, mesh.all_to_all_cost):
        assert cost(M, 0) == 0.0
        assert cost(M, 1) > 0.0
    assert LogicalMesh(shape=(1,), alpha=(1.0,), beta=(1.0,)).all_reduce_cost(M, 0) == 0.0


def test_one_dimensional_mesh():
    mesh = LogicalMesh(shape=(8,), alpha=(1e-6,), beta=(1e-9,))
    assert mesh.num_devices == 8 and mesh.ndim == 1
    assert mesh.all_gather_cost(M, 0) == pytest.approx(1e-6 + 7 / 8 * M * 1e-9)
    with pytest.raises(ValueError, match=r"axis must be 0 for a mesh of shape \(8,\), got 1"):
        mesh.all_gather_cost(M, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(shape=(2, 2, 2), alpha=(0.0,) * 3, beta=(0.0,) * 3), "shape must be 1 or 2 ints"),
    (dict(shape=(0, 4), alpha=(0.0, 0.0), beta=(0.0, 0.0)), "shape must be 1 or 2 ints"),
    (dict(shape=(2, 4), alpha=(0.0,), beta=(0.0, 0.0)), "alpha must have one entry per mesh axis"),
    (dict(shape=(2, 4), alpha=(0.0, 0.0), beta=(0.0, -1.0)), "beta must hold numbers >= 0"),
])
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LogicalMesh(**kwargs)


@pytest.mark.parametrize("axis", [2, -1, (0, 0), (), "0", (0, 1, 2)])
def test_bad_axis(axis):
    with pytest.raises(ValueError, match=r"axis must be 0, 1 or \(0, 1\)"):
        MESH.all_reduce_cost(M, axis)


def test_bad_num_bytes():
    with pytest.raises(ValueError, match="num_bytes"):
        MESH.all_gather_cost(-1.0, 0)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MESH.shape = (8, 1)  # type: ignore[misc]


P3 = ClusterSpec.preset("p3.16xlarge", num_nodes=2)
INTRA = (P3.intra_node_latency, 1 / P3.intra_node_bandwidth)
INTER = (P3.inter_node_latency, 1 / P3.inter_node_bandwidth)


@pytest.mark.parametrize("submesh, logical, axis_links", [
    ((2, 8), (2, 8), (INTER, INTRA)),
    ((2, 8), (1, 16), (INTRA, INTER)),   # axis 0 has size 1: one group of one device
    ((2, 8), (4, 4), (INTER, INTRA)),
    ((2, 8), (8, 2), (INTER, INTRA)),
    ((2, 8), (16, 1), (INTER, INTRA)),
    ((2, 8), (16,), (INTER,)),
    ((1, 8), (2, 4), (INTRA, INTRA)),
    ((1, 4), (4, 1), (INTRA, INTRA)),
    ((2, 4), (4, 2), (INTER, INTRA)),    # half nodes: device g is on node g // 4
])
def test_from_cluster_assigns_inter_node_links(submesh, logical, axis_links):
    mesh = LogicalMesh.from_cluster(P3, submesh, logical)
    assert mesh.shape == logical
    assert mesh.num_devices == submesh[0] * submesh[1]
    assert tuple(zip(mesh.alpha, mesh.beta, strict=True)) == axis_links


def test_from_cluster_costs_match_hand_computation():
    mesh = LogicalMesh.from_cluster(ClusterSpec.preset("dgx-a100", num_nodes=2), (2, 8), (2, 8))
    # Axis 0 pairs GPU k of node 0 with GPU k of node 1 over its own 200 Gb/s HDR card.
    assert mesh.all_reduce_cost(1e9, 0) == pytest.approx(10e-6 + 2 * 0.5 * 1e9 / 25e9)
    assert mesh.all_reduce_cost(1e9, 1) == pytest.approx(5e-6 + 2 * 7 / 8 * 1e9 / 300e9)


@pytest.mark.parametrize("submesh, logical, match", [
    ((2, 8), (4, 8), "logical_shape must be 1 or 2 ints >= 1 with product 16"),
    ((2, 8), (2, 2, 4), "logical_shape"),
    ((3, 8), (3, 8), r"submesh_shape must be .* within the cluster's \(2, 8\)"),
    ((1, 16), (1, 16), "submesh_shape"),
    ((0, 8), (1, 8), "submesh_shape"),
])
def test_from_cluster_validation(submesh, logical, match):
    with pytest.raises(ValueError, match=match):
        LogicalMesh.from_cluster(P3, submesh, logical)


sizes = st.integers(1, 8)
betas = st.floats(0, 1e-6)
alphas = st.floats(0, 1e-3)
nbytes = st.floats(0, 1e12)


@given(n0=sizes, n1=sizes, a=st.tuples(alphas, alphas), b=st.tuples(betas, betas), x=nbytes,
       axis=st.sampled_from([0, 1, (0, 1)]))
def test_ring_identities(n0, n1, a, b, x, axis):
    mesh = LogicalMesh(shape=(n0, n1), alpha=a, beta=b)
    gather, scatter, reduce = mesh.all_gather_cost(x, axis), mesh.reduce_scatter_cost(x, axis), \
        mesh.all_reduce_cost(x, axis)
    alpha = 0.0 if mesh.axis_size(axis) == 1 else max(
        (b[i], a[i]) for i in ((0, 1) if axis == (0, 1) else (axis,)))[1]
    # A ring all-reduce is a reduce-scatter followed by an all-gather of the same buffer.
    assert reduce == pytest.approx(gather + scatter - alpha, rel=1e-9, abs=1e-15)
    assert 0.0 <= mesh.all_to_all_cost(x, axis) <= gather == scatter <= reduce
    assert mesh.all_gather_cost(2 * x, axis) >= gather


def test_doctests():
    assert doctest.testmod(logical_mesh_module).failed == 0
