"""Submesh shapes for the stage DP and their placement on the physical cluster (Alpa dissertation §3.5.2).

The stage DP (Eq. 3.3) assigns every pipeline stage a submesh ``(n, m)`` of the ``N x M`` cluster mesh
(``N`` nodes with ``M`` devices each) and only requires ``sum_i n_i * m_i == N * M``. That suffices
because the shapes are restricted to

* one-dimensional submeshes ``(1, 1), (1, 2), (1, 4), ..., (1, M)`` inside one node, and
* two-dimensional submeshes ``(2, M), (3, M), ..., (N, M)`` made of whole nodes,

and any multiset of these shapes whose sizes sum to ``N * M`` can be placed on the cluster without
overlap (the covering theorem of Appendix 3.11). :func:`assign_devices` is the constructive side of that
theorem: it turns the DP's shapes into device ids.

Devices are numbered ``device = node * M + local`` (``local`` in ``0..M-1``), as in
:meth:`alpa_like.compiler.logical_mesh.LogicalMesh.from_cluster`.

**M not a power of two.** Appendix 3.11 assumes ``M = 2^m``, and Alpa's own implementation rejects other
``M``. Offering every power of two up to ``M`` would break the theorem: on a ``2 x 6`` cluster three
``(1, 4)`` meshes sum to 12 devices but at most one fits in a 6-device node. We therefore offer the powers of
two that *divide* ``M``, plus ``(1, M)`` itself: for ``M = 6`` the one-dimensional shapes are ``(1, 1),
(1, 2), (1, 6)``; for ``M = 12`` they are ``(1, 1), (1, 2), (1, 4), (1, 12)``. With every size dividing
``M`` and each dividing the next, the theorem's pairing argument still goes through, and
:func:`assign_devices` still always succeeds. For ``M = 2^m`` this is exactly the dissertation's list.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

Shape = tuple[int, int]
"""A submesh shape ``(n, m)``: ``n`` nodes times ``m`` devices per node."""


SHAPE_SPACES = ("all", "power_of_two")
"""The submesh shape spaces of :func:`submesh_shapes` (Alpa's ``submesh_physical_shape_space`` names)."""


def submesh_shapes(num_nodes: int, devices_per_node: int, space: str = "all") -> tuple[Shape, ...]:
    """The submesh shapes the stage DP may choose from, smallest first (Alpa §3.5.2, Alg. 2 line 7).

    ``(1, 2^p)`` for every power of two dividing ``devices_per_node``, then ``(1, M)``, then
    ``(2, M), ..., (N, M)`` (see the module docstring for ``M`` that is not a power of two). With
    ``space="power_of_two"`` the whole-node meshes are only ``(2, M), (4, M), (8, M), ...`` up to ``N``
    nodes: a subset of the full list, so the covering theorem and :func:`assign_devices` still hold for any
    multiset of them that sums to ``N * M``.

    Args:
      num_nodes: ``N`` >= 1.
      devices_per_node: ``M`` >= 1.
      space: one of :data:`SHAPE_SPACES`.

    Returns:
      Distinct shapes in increasing number of devices.

    Raises:
      ValueError: if an argument is not an int >= 1.

    >>> submesh_shapes(2, 8)
    ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8))
    >>> submesh_shapes(1, 6)
    ((1, 1), (1, 2), (1, 6))
    >>> submesh_shapes(6, 8, "power_of_two")
    ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8))
    """
    n_nodes, per_node = _check_cluster(num_nodes, devices_per_node)
    if space not in SHAPE_SPACES:
        raise ValueError(f"space must be one of {SHAPE_SPACES}, got {space!r}")
    one_dim = []
    size = 1
    while size < per_node and per_node % size == 0:
        one_dim.append((1, size))
        size *= 2
    one_dim.append((1, per_node))
    whole = range(2, n_nodes + 1) if space == "all" else (2**k for k in range(1, n_nodes.bit_length()))
    return tuple(one_dim) + tuple((n, per_node) for n in whole)


def assign_devices(submeshes: Sequence[Shape], num_nodes: int,
                   devices_per_node: int) -> tuple[tuple[int, ...], ...]:
    """Places the stages' submeshes on the cluster so that they cover it exactly (Alpa §3.5.2, App. 3.11).

    Placement, in three steps:

    1. *Whole-node meshes* (``m == M``, including ``(1, M)``) take whole nodes.
    2. *Partial-node meshes* (``(1, m)`` with ``m < M``) are grouped into nodes. First we try to cut them,
       in stage order, into consecutive runs of exactly ``M`` devices, so that neighbouring stages share a
       node (fast links). If that fails, they are packed largest first (ties in stage order) into nodes one
       after another: this is the constructive proof of the covering theorem and always succeeds when the
       sizes sum to a multiple of ``M``. Inside a node a run is laid out largest first, so every ``(1, m)``
       mesh starts at a local offset that is a multiple of ``m`` (aligned) and never crosses a node.
    3. The resulting units (each whole-node mesh, each packed node) get node ids in pipeline order, ordered
       by their first stage, so that consecutive stages sit on consecutive nodes.

    Args:
      submeshes: the stages' shapes in pipeline order; each must be one of
        ``submesh_shapes(num_nodes, devices_per_node)``.
      num_nodes: ``N``.
      devices_per_node: ``M``.

    Returns:
      For each submesh, in the order given, its device ids (``node * M + local``), row-major: node by node,
      increasing local index within a node.

    Raises:
      ValueError: if a shape is not an allowed submesh shape, or the sizes do not sum to ``N * M``.

    >>> assign_devices([(1, 2), (1, 4), (1, 2), (1, 8)], 2, 8)
    ((4, 5), (0, 1, 2, 3), (6, 7), (8, 9, 10, 11, 12, 13, 14, 15))
    """
    n_nodes, per_node = _check_cluster(num_nodes, devices_per_node)
    allowed = submesh_shapes(n_nodes, per_node)
    shapes = []
    for shape in submeshes:
        pair = tuple(shape) if isinstance(shape, (tuple, list)) else None
        if pair is None or len(pair) != 2 or pair not in allowed:
            raise ValueError(f"submesh {shape!r} is not a valid submesh shape of a {n_nodes} x {per_node} "
                             f"cluster; valid shapes: {list(allowed)}")
        shapes.append((int(pair[0]), int(pair[1])))
    total = sum(n * m for n, m in shapes)
    if total != n_nodes * per_node:
        raise ValueError(f"submeshes {shapes} have {total} devices in total but the {n_nodes} x {per_node} "
                         f"cluster has {n_nodes * per_node}; they must cover it exactly")

    whole = [(stage,) for stage, (_, m) in enumerate(shapes) if m == per_node]
    partial = [stage for stage, (_, m) in enumerate(shapes) if m < per_node]
    packed = _runs_in_stage_order(partial, shapes, per_node) or _pack_largest_first(partial, shapes, per_node)
    units = sorted(whole + packed, key=min)  # Pipeline order: by each unit's first stage.

    devices: list[tuple[int, ...]] = [()] * len(shapes)
    node = 0
    for unit in units:
        if len(unit) == 1 and shapes[unit[0]][1] == per_node:
            n = shapes[unit[0]][0]
            devices[unit[0]] = tuple(range(node * per_node, (node + n) * per_node))
            node += n
            continue
        offset = 0
        for stage in sorted(unit, key=lambda s: -shapes[s][1]):  # Largest first: keeps offsets aligned.
            m = shapes[stage][1]
            devices[stage] = tuple(range(node * per_node + offset, node * per_node + offset + m))
            offset += m
        node += 1
    return tuple(devices)


def _runs_in_stage_order(stages: list[int], shapes: list[Shape], per_node: int) -> list[tuple[int, ...]] | None:
    """Cuts ``stages`` (in order) into consecutive runs of exactly ``per_node`` devices, or None."""
    runs, run, filled = [], [], 0
    for stage in stages:
        run.append(stage)
        filled += shapes[stage][1]
        if filled > per_node:
            return None
        if filled == per_node:
            runs.append(tuple(run))
            run, filled = [], 0
    return runs if not run else None


def _pack_largest_first(stages: list[int], shapes: list[Shape], per_node: int) -> list[tuple[int, ...]]:
    """Packs ``(1, m)`` meshes largest first into nodes; exact because every ``m`` divides the larger ones.

    NOTE: after sorting by decreasing ``m``, the devices already used in the current node are a sum of
    multiples of ``m``, hence a multiple of ``m``, and ``m`` divides ``per_node``: the mesh fits without
    crossing the node boundary. With a total that is a multiple of ``per_node``, every node ends up full.
    """
    runs, run, filled = [], [], 0
    for stage in sorted(stages, key=lambda s: -shapes[s][1]):
        run.append(stage)
        filled += shapes[stage][1]
        if filled == per_node:
            runs.append(tuple(run))
            run, filled = [], 0
    if run:  # Unreachable when the caller checked the total; kept to fail closed.
        raise ValueError(f"partial-node submeshes {[shapes[s] for s in stages]} do not fill whole nodes "
                         f"of {per_node} devices")
    return runs


def _check_cluster(num_nodes: object, devices_per_node: object) -> tuple[int, int]:
    for name, value in (("num_nodes", num_nodes), ("devices_per_node", devices_per_node)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(num_nodes), int(devices_per_node)
