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
    if axis != (0, 1):  # over both axes the two-level form is cheaper here (test_two_level_forms)
        assert MESH.all_reduce_cost(M, axis) == pytest.approx(alpha + 2 * (n - 1) / n * M * beta)
        assert MESH.all_gather_cost(M, axis) == pytest.approx(alpha + (n - 1) / n * M * beta)
        assert MESH.reduce_scatter_cost(M, axis) == pytest.approx(alpha + (n - 1) / n * M * beta)
    assert MESH.all_to_all_cost(M, axis) == pytest.approx(alpha + (n - 1) / n**2 * M * beta)
    assert MESH.axis_size(axis) == n


def test_both_axes_use_the_slower_axis():
    fast_first = LogicalMesh(shape=(2, 4), alpha=(1e-6, 5e-6), beta=(1e-12, 1e-9))
    assert fast_first.all_to_all_cost(M, (0, 1)) == pytest.approx(5e-6 + 7 / 64 * M * 1e-9)
    assert fast_first.all_gather_cost(8.0, (0, 1)) == pytest.approx(5e-6 + 7 / 8 * 8.0 * 1e-9)  # one alpha wins
    assert fast_first.all_gather_cost(M, (1, 0)) == fast_first.all_gather_cost(M, (0, 1))
    assert fast_first.all_gather_cost(M, (1,)) == fast_first.all_gather_cost(M, 1)


def test_table_3_3_all_reduce_costs():
    """Table 3.3 #2 (i->0, k->1): all-reduce(M/n0, 1); #7 (k->{0,1}): all-reduce(M, {0,1}), here the
    two-level form: reduce-scatter on the fast axis 1, all-reduce of a quarter on axis 0, all-gather on 1."""
    n0, n1 = MESH.shape
    assert MESH.all_reduce_cost(M / n0, 1) == pytest.approx(A1 + 2 * (n1 - 1) / n1 * (M / n0) * B1)
    two_level = (A1 + 3 / 4 * M * B1) + (A0 + 2 * 1 / 2 * (M / 4) * B0) + (A1 + 3 / 4 * M * B1)
    assert two_level < A0 + 2 * 7 / 8 * M * B0
    assert MESH.all_reduce_cost(M, (0, 1)) == pytest.approx(two_level)


def test_two_level_forms():
    """Over both axes with axis 1 fast: reduce-scatter on axis 1 then on axis 0 over a quarter; all-gather the
    reverse; a reduce-scatter plus an all-gather cost what the all-reduce does, and one more latency."""
    scatter = (A1 + 3 / 4 * M * B1) + (A0 + 1 / 2 * (M / 4) * B0)
    assert MESH.reduce_scatter_cost(M, (0, 1)) == pytest.approx(scatter)
    assert MESH.all_gather_cost(M, (0, 1)) == pytest.approx(scatter)
    assert scatter < A0 + 7 / 8 * M * B0
    both = MESH.reduce_scatter_cost(M, (0, 1)) + MESH.all_gather_cost(M, (0, 1))
    assert both == pytest.approx(MESH.all_reduce_cost(M, (0, 1)) + A0)


def test_all_reduce_over_both_axes_is_one_ring_where_that_is_cheaper():
    even = LogicalMesh(shape=(2, 4), alpha=(1e-6, 1e-6), beta=(1e-9, 1e-9))  # two levels: 3 alphas, same bytes
    assert even.all_reduce_cost(M, (0, 1)) == pytest.approx(1e-6 + 2 * 7 / 8 * M * 1e-9)
    tiny = 8.0  # latency-bound: one ring's one alpha beats three
    assert MESH.all_reduce_cost(tiny, (0, 1)) == pytest.approx(A0 + 2 * 7 / 8 * tiny * B0)
    fast_first = LogicalMesh(shape=(4, 2), alpha=(A1, A0), beta=(B1, B0))  # the fast axis is found either way
    assert fast_first.all_reduce_cost(M, (0, 1)) == pytest.approx(MESH.all_reduce_cost(M, (0, 1)))


def test_joint_ring_and_all_to_all_links():
    mesh = LogicalMesh(shape=(2, 4), alpha=(A0, A1), beta=(B0, B1), joint_alpha=7e-6, joint_beta=1e-10,
                       all_to_all_beta=(1e-8, 1e-11))
    assert mesh.all_gather_cost(M, (0, 1)) == pytest.approx(7e-6 + 7 / 8 * M * 1e-10)
    assert mesh.all_gather_cost(M, 0) == MESH.all_gather_cost(M, 0)
    assert mesh.all_to_all_cost(M, 0) == pytest.approx(A0 + 1 / 4 * M * 1e-8)
    assert mesh.all_to_all_cost(M, (0, 1)) == pytest.approx(A0 + 7 / 64 * M * 1e-8)  # the slower axis' link
    free = mesh.without_latency()
    assert (free.alpha, free.joint_alpha, free.beta, free.joint_beta) == ((0.0, 0.0), 0.0, (B0, B1), 1e-10)
    assert MESH.without_latency().joint_alpha is None


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
    (dict(shape=(2, 4), alpha=(0.0, 0.0), beta=(0.0, 0.0), all_to_all_beta=(1.0,)),
     r"all_to_all_beta must be None or one number >= 0 per mesh axis \(2\)"),
    (dict(shape=(8,), alpha=(0.0,), beta=(0.0,), joint_beta=1.0), "joint_beta must be None or a number >= 0 on a 2-D"),
    (dict(shape=(2, 4), alpha=(0.0, 0.0), beta=(0.0, 0.0), joint_alpha=-1.0), "joint_alpha must be None"),
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
NIC = 25e9 / 8  # Alpa §3.8: one 25 Gb/s link per p3.16xlarge node, shared by its 8 GPUs


def inter(devices_on_a_node: int) -> tuple[float, float]:
    """A ring with that many of its devices on each node pools their shares of the node's link."""
    return P3.inter_node_latency, 1 / (devices_on_a_node * NIC / 8)


@pytest.mark.parametrize("submesh, logical, axis_links", [
    ((2, 8), (2, 8), (inter(1), INTRA)),
    ((2, 8), (1, 16), (INTRA, inter(8))),   # axis 0 has size 1: one group of one device
    ((2, 8), (4, 4), (inter(2), INTRA)),    # groups {i, i + 4, i + 8, i + 12}: two on each node
    ((2, 8), (8, 2), (inter(4), INTRA)),
    ((2, 8), (16, 1), (inter(8), INTRA)),
    ((2, 8), (16,), (inter(8),)),
    ((1, 8), (2, 4), (INTRA, INTRA)),
    ((1, 4), (4, 1), (INTRA, INTRA)),
    ((2, 4), (4, 2), (inter(2), INTRA)),    # half nodes: device g is on node g // 4
])
def test_from_cluster_assigns_inter_node_links(submesh, logical, axis_links):
    mesh = LogicalMesh.from_cluster(P3, submesh, logical)
    assert mesh.shape == logical
    assert mesh.num_devices == submesh[0] * submesh[1]
    assert mesh.alpha == tuple(alpha for alpha, _ in axis_links)
    assert mesh.beta == pytest.approx(tuple(beta for _, beta in axis_links))
    # Every device of an all-to-all sends at once: across nodes each has only its own share.
    device_share = tuple(1 / P3.inter_node_bandwidth if link != INTRA else link[1] for link in axis_links)
    assert mesh.all_to_all_beta == pytest.approx(device_share)


def test_from_cluster_ring_over_both_axes_has_the_nodes_whole_links():
    mesh = LogicalMesh.from_cluster(P3, (2, 8), (2, 8))
    assert (mesh.joint_alpha, mesh.joint_beta) == pytest.approx((P3.inter_node_latency, 1 / NIC))
    assert LogicalMesh.from_cluster(P3, (1, 8), (2, 4)).joint_beta is None
    size = 400.69 * 2**20  # a GPT's gradients, data parallel over 16 GPUs on 2 nodes
    ring = P3.inter_node_latency + 2 * 15 / 16 * size / NIC
    two_level = (2 * (P3.intra_node_latency + 7 / 8 * size / P3.intra_node_bandwidth)
                 + P3.inter_node_latency + 2 * 1 / 2 * (size / 8) / (NIC / 8))
    assert two_level < ring
    assert mesh.all_reduce_cost(size, (0, 1)) == pytest.approx(two_level)
    assert mesh.all_gather_cost(size, (0, 1)) == pytest.approx(
        P3.inter_node_latency + 1 / 2 * (size / 8) / (NIC / 8) + P3.intra_node_latency
        + 7 / 8 * size / P3.intra_node_bandwidth)
    flat = LogicalMesh.from_cluster(P3, (2, 8), (1, 16))  # the same 16 devices as one ring
    assert flat.all_reduce_cost(size, 1) == pytest.approx(ring)


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
    # A ring all-reduce is a reduce-scatter followed by an all-gather of the same buffer; over both axes
    # the two-level forms may be cheaper.
    if axis == (0, 1):
        assert reduce <= (gather + scatter - alpha) * (1 + 1e-9) + 1e-15
    else:
        assert reduce == pytest.approx(gather + scatter - alpha, rel=1e-9, abs=1e-15)
    assert gather == scatter <= reduce
    assert 0.0 <= mesh.all_to_all_cost(x, axis)
    assert mesh.all_gather_cost(2 * x, axis) >= gather


def test_doctests():
    assert doctest.testmod(logical_mesh_module).failed == 0
