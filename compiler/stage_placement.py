"""Where a plan's stages run, for pricing: the aligned contiguous layout of its submeshes, the stage
boundaries that stay inside a node, and the nodes whose NICs two meshes share (see "Boundaries inside a
node" and "Shared NICs" in :mod:`alpa_like.compiler.stage_dp`); :class:`AlignedLayouts` holds the same per
(submesh, devices left) for the stage DP.
"""
from __future__ import annotations

import dataclasses
import functools
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


@dataclasses.dataclass(frozen=True)
class AlignedLayouts:
    """Eq. 3.3 over aligned contiguous layouts (see :func:`price_placed_stages`), for the stage DP's
    ``_placed_dp``.

    In the DP a stage chosen with ``d`` devices left for itself and the stages after it starts at device
    ``N * M - d``, so whether it is aligned, which of its boundaries stay inside a node and whether it is the
    first or last mesh of a shared node (``shared_nodes``) depend on ``(p, d)`` only: ``aligned[p, d]``,
    ``inside_before[p, d]``, ``inside_after[p, d]``, ``first_shared[p, d]``, ``last_shared[p, d]``.
    ``nic`` is None when no plan can share a NIC (fewer than 3 nodes, no partial-node submesh, or no
    ``nic_wait``).
    """

    saving: np.ndarray
    nic: np.ndarray | None
    aligned: np.ndarray
    inside_before: np.ndarray
    inside_after: np.ndarray
    first_shared: np.ndarray
    last_shared: np.ndarray

    @classmethod
    def of(cls, costs: StageCosts, num_devices: int, per_node: int) -> AlignedLayouts | None:
        sizes = costs.sizes[:, None]
        start = np.broadcast_to(num_devices - np.arange(num_devices + 1)[None, :], (len(sizes), num_devices + 1))
        end = start + sizes
        middle = (sizes < per_node) & (start // per_node >= 1) & (start // per_node <= num_devices // per_node - 2)
        first_shared, last_shared = middle & (start % per_node == 0), middle & (end % per_node == 0)
        nic = costs.nic_wait
        if nic is None or not nic.any() or not first_shared.any():
            nic = None
        saving = costs.boundary_saving
        if (saving is None or not saving.any()) and nic is None:
            return None
        return cls(saving=np.zeros(costs.t_intra.shape[:3] + (2,)) if saving is None else saving, nic=nic,
                   aligned=(end <= num_devices) & (start % np.minimum(sizes, per_node) == 0),
                   inside_before=(start % per_node != 0), inside_after=(end % per_node != 0),
                   first_shared=first_shared, last_shared=last_shared)

    def stage_seconds(self, k, rows: np.ndarray, seconds: np.ndarray, columns: np.ndarray | None = None
                      ) -> np.ndarray:
        """``[row, d]``: the time of stage ``(k..i, p)`` for each flat ``row = i * P + p`` (``k`` one first
        layer, or one per row) starting with ``d`` devices left (``d`` in ``columns``; None: every ``d``),
        with its inside-node savings and the shared NIC of its own node (not yet those of its neighbours'
        nodes: :meth:`extra`); inf where it is misaligned."""
        last, mesh = np.divmod(rows, self.saving.shape[2])
        saving = self.saving[k, last, mesh]
        placed = np.maximum(seconds[:, None] - saving[:, :1] * take(self.inside_before, mesh, columns)
                            - saving[:, 1:] * take(self.inside_after, mesh, columns), 0.0)
        if self.nic is not None:
            nic = self.nic[k, last, mesh]
            placed = (placed + nic[:, :1] * take(self.first_shared, mesh, columns)
                      + nic[:, 1:] * take(self.last_shared, mesh, columns))
        return np.where(take(self.aligned, mesh, columns), placed, np.inf)

    @functools.cached_property
    def column_groups(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(meshes, columns)`` pairs covering every submesh once: the device counts ``d`` at which those
        meshes' stages can start aligned (a stage of ``m < M`` devices every ``m``-th device, a whole-node
        stage every ``M``-th), so a DP level computes each mesh's stages at those ``d`` only (elsewhere they
        are inf)."""
        groups: dict[bytes, list[int]] = {}
        for p, row in enumerate(self.aligned):
            groups.setdefault(row.tobytes(), []).append(p)
        return [(np.asarray(meshes), np.flatnonzero(self.aligned[meshes[0]])) for meshes in groups.values()]

    def extra(self, k, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[row, 1]`` each: what stage ``(k..i, p)`` waits when the node before it (side 0) or after it
        (side 1) is shared: its :attr:`StageCosts.nic_wait`."""
        last, mesh = np.divmod(rows, self.saving.shape[2])
        nic = self.nic[k, last, mesh]
        return nic[:, :1], nic[:, 1:]


def take(table: np.ndarray, rows: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
    """``table[rows]`` restricted to ``columns`` (all of them when None): ``[len(rows), len(columns)]``."""
    return table[rows] if columns is None else table[np.ix_(rows, columns)]
