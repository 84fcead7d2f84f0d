"""Where a plan's stages run, for pricing: the aligned contiguous layout of its submeshes, the stage
boundaries that stay inside a node, and the nodes whose NICs two meshes share (see "Boundaries inside a
node" and "Shared NICs" in :mod:`alpa_like.compiler.stage_dp`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from alpa_like.compiler.stage_costs import StageChoice, StageCosts


def contiguous_offsets(sizes: Sequence[int], devices_per_node: int) -> list[int] | None:
    """Device offsets of stages of ``sizes`` devices laid out one after another in pipeline order, or None
    when a stage would be misaligned there: a ``(1, m)`` mesh at an offset that is not a multiple of ``m``
    (it would cross a node), a mesh of whole nodes at an offset that is not a node boundary.

    For an aligned layout, :func:`~alpa_like.compiler.submesh.assign_devices` puts every stage on the
    nodes of this layout (its runs of partial-node meshes in stage order are exactly those nodes; only the
    order inside a node differs), so a boundary at an offset that is not a multiple of ``devices_per_node``
    joins two meshes of one node, and any other boundary joins meshes on different nodes.

    >>> contiguous_offsets([2, 2, 4, 8], 8), contiguous_offsets([2, 4, 2], 8)
    ([0, 2, 4, 8], None)
    """
    offsets, offset = [], 0
    for size in sizes:
        if offset % min(size, devices_per_node):
            return None
        offsets.append(offset)
        offset += size
    return offsets


def price_placed_stages(costs: StageCosts, stages: Sequence[StageChoice],
                        devices_per_node: int) -> tuple[StageChoice, ...]:
    r"""The stages with ``t_intra`` priced for where they will run.

    ``costs.t_intra`` prices every stage boundary as crossing nodes, each at a NIC of its own. When the
    plan's contiguous layout is aligned (:func:`contiguous_offsets`), a boundary that stays inside a node is
    priced at the intra-node link instead: the stage's ``t_intra`` drops by ``costs.boundary_saving`` for it.
    A boundary that crosses nodes goes out of one node's NIC and into the next one's; for each of these two
    NICs that belongs to a shared node (:func:`shared_nodes`) the receiving stage waits ``costs.nic_wait``
    for that side (see "Shared NICs" in the module docstring):

    .. math:: t = \max(0,\ t_{intra} - \textstyle\sum_{inside} saving)
                  + \sum_{crossing} (\text{shared NICs on the way}) \cdot wait.

    Otherwise the plan is placed by the covering construction, whose neighbours may sit anywhere, and keeps
    the table's price.
    """
    sizes = [s.submesh[0] * s.submesh[1] for s in stages]
    offsets = contiguous_offsets(sizes, devices_per_node)
    if offsets is None or (costs.boundary_saving is None and costs.nic_wait is None):
        return tuple(stages)
    shared = shared_nodes(sizes, devices_per_node)
    m, total = devices_per_node, sum(sizes)
    priced = []
    for q, stage in enumerate(stages):
        start, end = offsets[q], offsets[q] + sizes[q]
        index = (stage.layers[0], stage.layers[1], stage.submesh_index)
        saving = costs.boundary_saving[index] if costs.boundary_saving is not None else np.zeros(2)
        seconds = max(float(stage.t_intra - saving[0] * bool(start % m) - saving[1] * bool(end % m)), 0.0)
        if costs.nic_wait is not None:
            before = (start // m - 1 in shared) + (start // m in shared) if start % m == 0 and start > 0 else 0
            after = (end // m in shared) + ((end - 1) // m in shared) if end % m == 0 and end < total else 0
            seconds += before * float(costs.nic_wait[index][0]) + after * float(costs.nic_wait[index][1])
        priced.append(dataclasses.replace(stage, t_intra=seconds))
    return tuple(priced)


def shared_nodes(sizes: Sequence[int], devices_per_node: int) -> set[int]:
    """The nodes whose NICs two meshes of an aligned contiguous layout of ``sizes`` use at once in 1F1B:
    the nodes other than the first and the last that hold two or more meshes (their first mesh then
    receives activations from the node before while their last receives gradients from the node after,
    and they send gradients back and activations on through the node's outbound NIC likewise).

    >>> sorted(shared_nodes([8, 4, 4, 8, 8], 8)), sorted(shared_nodes([4, 4, 8, 8], 8))
    ([1], [])
    """
    offsets = contiguous_offsets(sizes, devices_per_node)
    if offsets is None:
        raise ValueError(f"sizes {list(sizes)} are not an aligned contiguous layout on nodes of "
                         f"{devices_per_node} devices")
    last_node = sum(sizes) // devices_per_node - 1
    return {start // devices_per_node for start, size in zip(offsets, sizes)
            if start % devices_per_node == 0 and size < devices_per_node
            and 0 < start // devices_per_node < last_node}
