"""Submesh shapes and their placement: the covering theorem of Alpa's Appendix 3.11, constructively."""
import doctest
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_like.compiler import submesh as submesh_module
from alpa_like.compiler.submesh import assign_devices, submesh_shapes

CLUSTERS = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (3, 2), (1, 8), (2, 4), (2, 8), (3, 8), (4, 8), (8, 8),
            (1, 6), (2, 6), (3, 12), (2, 3), (5, 1)]


def _check_placement(shapes, n_nodes, per_node, devices):
    """Every device exactly once; whole nodes for (n, M); one node and aligned for (1, m < M)."""
    assert len(devices) == len(shapes)
    flat = [d for mesh in devices for d in mesh]
    assert sorted(flat) == list(range(n_nodes * per_node))
    for (n, m), mesh in zip(shapes, devices, strict=True):
        assert len(mesh) == n * m
        assert list(mesh) == list(range(mesh[0], mesh[0] + n * m))  # Contiguous, row-major.
        if m == per_node:
            assert mesh[0] % per_node == 0  # Starts a node.
        else:
            assert n == 1
            assert mesh[0] // per_node == mesh[-1] // per_node  # Inside one node.
            assert (mesh[0] % per_node) % m == 0  # Aligned to its size.


def _multisets(total, sizes_desc):
    """All multisets (as non-increasing lists) of ``sizes_desc`` summing to ``total``."""
    if total == 0:
        yield []
        return
    for index, size in enumerate(sizes_desc):
        if size <= total:
            for rest in _multisets(total - size, sizes_desc[index:]):
                yield [size, *rest]


def test_shapes_of_the_dissertation():
    assert submesh_shapes(8, 8) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8), (5, 8), (6, 8),
                                    (7, 8), (8, 8))
    assert submesh_shapes(1, 1) == ((1, 1),)
    assert submesh_shapes(3, 1) == ((1, 1), (2, 1), (3, 1))
    assert submesh_shapes(1, 4) == ((1, 1), (1, 2), (1, 4))


def test_power_of_two_space_keeps_whole_node_meshes_of_power_of_two_nodes():
    assert submesh_shapes(8, 8, "power_of_two") == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8))
    assert submesh_shapes(12, 8, "power_of_two")[-2:] == ((4, 8), (8, 8))
    assert submesh_shapes(1, 8, "power_of_two") == submesh_shapes(1, 8)
    assert submesh_shapes(2, 6, "power_of_two") == submesh_shapes(2, 6)
    assert set(submesh_shapes(128, 8, "power_of_two")) < set(submesh_shapes(128, 8))
    with pytest.raises(ValueError, match=r"space must be one of \('all', 'power_of_two'\), got 'powers'"):
        submesh_shapes(2, 8, "powers")


@pytest.mark.parametrize("n_nodes, per_node", [(3, 2), (5, 1), (6, 4), (3, 8)])
def test_every_power_of_two_multiset_is_placed(n_nodes, per_node):
    """A multiset of the power-of-two space's shapes covering the cluster is placed exactly (a subset of the
    full space, so the covering theorem holds)."""
    shapes = submesh_shapes(n_nodes, per_node, "power_of_two")
    by_size = {n * m: (n, m) for n, m in shapes}
    count = 0
    for sizes in _multisets(n_nodes * per_node, sorted(by_size, reverse=True)):
        multiset = [by_size[s] for s in sizes]
        for order in (multiset, multiset[::-1]):
            _check_placement(order, n_nodes, per_node, assign_devices(order, n_nodes, per_node))
            count += 1
    assert count > 0


def test_non_power_of_two_devices_per_node_keeps_divisors():
    assert submesh_shapes(2, 6) == ((1, 1), (1, 2), (1, 6), (2, 6))
    assert submesh_shapes(1, 12) == ((1, 1), (1, 2), (1, 4), (1, 12))
    assert submesh_shapes(1, 3) == ((1, 1), (1, 3))
    # (1, 4) is left out for M = 6: three of them sum to 12 = 2 x 6 devices but cannot be placed.
    with pytest.raises(ValueError, match=r"\(1, 4\) is not a valid submesh shape of a 2 x 6 cluster"):
        assign_devices([(1, 4)] * 3, 2, 6)


@pytest.mark.parametrize("n_nodes, per_node", CLUSTERS)
def test_every_multiset_is_placed_exhaustive(n_nodes, per_node):
    """Every multiset of allowed shapes: in all stage orders up to 5 stages, else increasing and decreasing."""
    shapes = submesh_shapes(n_nodes, per_node)
    by_size = {n * m: (n, m) for n, m in shapes}
    count = 0
    for sizes in _multisets(n_nodes * per_node, sorted(by_size, reverse=True)):
        multiset = [by_size[s] for s in sizes]
        small = len(multiset) <= 5
        orders = set(itertools.permutations(multiset)) if small else {tuple(multiset), tuple(multiset[::-1])}
        for order in orders:
            _check_placement(order, n_nodes, per_node, assign_devices(order, n_nodes, per_node))
            count += 1
    assert count > 0


@settings(max_examples=150, deadline=None)
@given(data=st.data(), cluster=st.sampled_from(CLUSTERS))
def test_covering_theorem(data, cluster):
    """App. 3.11: any sequence of allowed shapes whose sizes sum to N * M is placed exactly."""
    n_nodes, per_node = cluster
    shapes = submesh_shapes(n_nodes, per_node)
    left, chosen = n_nodes * per_node, []
    while left:
        fitting = [s for s in shapes if s[0] * s[1] <= left]
        shape = data.draw(st.sampled_from(fitting))
        chosen.append(shape)
        left -= shape[0] * shape[1]
    chosen = data.draw(st.permutations(chosen))
    _check_placement(chosen, n_nodes, per_node, assign_devices(chosen, n_nodes, per_node))


def test_neighbouring_stages_share_a_node_and_follow_pipeline_order():
    devices = assign_devices([(1, 4), (1, 4), (2, 8), (1, 8)], 4, 8)
    assert devices == (tuple(range(0, 4)), tuple(range(4, 8)), tuple(range(8, 24)), tuple(range(24, 32)))
    # Stages 0-2 fill node 0 in stage order, stages 3-4 node 1: no stage pair split across nodes needlessly.
    devices = assign_devices([(1, 4), (1, 2), (1, 2), (1, 4), (1, 4)], 2, 8)
    nodes = [mesh[0] // 8 for mesh in devices]
    assert nodes == [0, 0, 0, 1, 1]


def test_largest_first_when_stage_order_cannot_fill_nodes():
    # In stage order: 4 + 2 + 4 overflows a node of 8, so the meshes are packed largest first.
    shapes = [(1, 4), (1, 2), (1, 4), (1, 2), (1, 4)]
    devices = assign_devices(shapes, 2, 8)
    _check_placement(shapes, 2, 8, devices)
    assert devices[0] == (0, 1, 2, 3) and devices[2] == (4, 5, 6, 7)  # Largest first, ties in stage order.


def test_errors_name_the_offending_values():
    with pytest.raises(ValueError, match=r"have 12 devices in total but the 2 x 8 cluster has 16"):
        assign_devices([(1, 8), (1, 4)], 2, 8)
    with pytest.raises(ValueError, match=r"\(2, 4\) is not a valid submesh shape.*valid shapes: \[\(1, 1\)"):
        assign_devices([(2, 4), (1, 8)], 2, 8)
    with pytest.raises(ValueError, match=r"\(3, 8\) is not a valid"):
        assign_devices([(3, 8)], 2, 8)
    with pytest.raises(ValueError, match="not a valid submesh shape"):
        assign_devices([8], 1, 8)
    with pytest.raises(ValueError, match="num_nodes must be an int >= 1, got 0"):
        submesh_shapes(0, 8)
    with pytest.raises(ValueError, match="devices_per_node must be an int >= 1, got 2.0"):
        assign_devices([(1, 1)], 1, 2.0)


def test_doctests():
    assert doctest.testmod(submesh_module).failed == 0
