"""A logical device mesh with per-axis alpha-beta collective costs (Alpa dissertation §3.4.1).

"A device mesh is a 2-dimensional logical view of a set of physical devices [...] Devices can communicate
along the first mesh dimension and the second mesh dimension with different bandwidths." A submesh of
2 nodes x 8 GPUs can be viewed as a 2x8, 1x16, 4x4, 8x2 or 16x1 mesh; the stage DP (Eq. 3.3) compiles
every view, and the intra-op ILP (Eq. 3.1) prices each collective with the costs defined here.

Vocabulary: an *axis* is a mesh axis (0 or 1); a *dim* is a tensor dimension.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alpa_like.compiler.cluster import ClusterSpec

Axis = int | tuple[int, ...]
"""A mesh axis argument: ``0``, ``1`` or ``(0, 1)`` (both axes as one ring)."""


def logical_shapes(num_devices: int) -> tuple[tuple[int, int], ...]:
    """All 2-D factorisations ``(n0, n1)`` with ``n0 * n1 == num_devices``, by increasing ``n0``.

    >>> logical_shapes(8)
    ((1, 8), (2, 4), (4, 2), (8, 1))
    """
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
    return tuple((n0, num_devices // n0) for n0 in range(1, num_devices + 1) if num_devices % n0 == 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogicalMesh:
    """A 1-D or 2-D logical mesh whose axis ``i`` has latency ``alpha[i]`` and inverse bandwidth ``beta[i]``.

    Every collective below is a ring over the ``n`` devices of one mesh axis, with Alpa's alpha-beta
    model: one fixed ``alpha`` per collective plus ``beta`` seconds per byte on the busiest link.

    ``num_bytes`` is always the size of the FULL tensor the collective operates on within one group of
    devices along the axis: the buffer that is all-reduced, the output of an all-gather, the input of a
    reduce-scatter, and for an all-to-all the union of the ``n`` per-device buffers (``n`` times what one
    device holds). An axis of size 1 has nothing to communicate and costs 0.

    ``axis=(0, 1)`` is one ring over all ``n0 * n1`` devices, priced with ``joint_alpha`` and ``joint_beta``
    where given, else with the slower axis' alpha and beta (the axis with the larger beta, ties broken by the
    larger alpha): a ring over both axes must cross the slower links. Table 3.3 #7 (``all-reduce(M, {0, 1})``)
    uses it. An all-reduce, all-gather or reduce-scatter over ``(0, 1)`` costs the cheaper of that ring and
    the two-level form (:meth:`_two_level_cost`).
    """

    shape: tuple[int, ...]
    """Devices along each mesh axis: ``(n,)`` or ``(n0, n1)``."""
    alpha: tuple[float, ...]
    """Seconds of fixed cost per collective along each axis."""
    beta: tuple[float, ...]
    """Seconds per byte (inverse bandwidth) along each axis."""
    all_to_all_beta: tuple[float, ...] | None = None
    """Seconds per byte of an all-to-all along each axis; None: ``beta``. Every device of an all-to-all sends
    at once, so across nodes each sees only its own share of the node's link, where a ring's one crossing
    pair sees the pooled share of its group's devices on the node."""
    joint_alpha: float | None = None
    """Seconds of fixed cost of a ring over both axes; None: the slower axis' alpha."""
    joint_beta: float | None = None
    """Seconds per byte of a ring over both axes; None: the slower axis' beta. A ring over all the devices
    of a multi-node submesh crosses the network through every device of a node at once, so it sees the
    node's whole link (:func:`crossing_bandwidth`), not one device's share of it."""

    def __post_init__(self) -> None:
        shape, alpha, beta = tuple(self.shape), tuple(self.alpha), tuple(self.beta)
        if len(shape) not in (1, 2) or not all(_is_int(n) and n >= 1 for n in shape):
            raise ValueError(f"shape must be 1 or 2 ints >= 1, got {self.shape!r}")
        for name, values in (("alpha", alpha), ("beta", beta)):
            if len(values) != len(shape):
                raise ValueError(f"{name} must have one entry per mesh axis ({len(shape)}), got {values!r}")
            if not all(_is_number(v) and v >= 0 for v in values):
                raise ValueError(f"{name} must hold numbers >= 0, got {values!r}")
        if self.all_to_all_beta is not None:
            values = tuple(self.all_to_all_beta)
            if len(values) != len(shape) or not all(_is_number(v) and v >= 0 for v in values):
                raise ValueError(f"all_to_all_beta must be None or one number >= 0 per mesh axis ({len(shape)}), "
                                 f"got {self.all_to_all_beta!r}")
            object.__setattr__(self, "all_to_all_beta", tuple(float(v) for v in values))
        for name in ("joint_alpha", "joint_beta"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value >= 0 and len(shape) == 2):
                raise ValueError(f"{name} must be None or a number >= 0 on a 2-D mesh, got {value!r}")
            object.__setattr__(self, name, None if value is None else float(value))
        object.__setattr__(self, "shape", tuple(int(n) for n in shape))
        object.__setattr__(self, "alpha", tuple(float(v) for v in alpha))
        object.__setattr__(self, "beta", tuple(float(v) for v in beta))

    @property
    def num_devices(self) -> int:
        """Number of devices in the mesh, the product of ``shape``."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        """Number of mesh axes (1 or 2)."""
        return len(self.shape)

    @classmethod
    def from_cluster(cls, cluster: ClusterSpec, submesh_shape: tuple[int, int],
                     logical_shape: tuple[int, ...]) -> LogicalMesh:
        """The logical view ``logical_shape`` of a ``submesh_shape = (n_nodes, n_devices_per_node)`` submesh.

        Devices are numbered row-major: device ``g = node * n_devices_per_node + local``, and logical
        position ``(i0, i1)`` holds device ``g = i0 * l1 + i1`` (for a 1-D view ``(l,)``, position ``i``
        holds device ``i``). A group along axis 1 is the contiguous run ``i0 * l1 .. i0 * l1 + l1 - 1``; a
        group along axis 0 is the strided set ``i1, i1 + l1, ...``. An axis whose groups contain devices
        of more than one node gets the cluster's inter-node latency and the bandwidth a ring with that many
        devices on each node sees across nodes (:func:`crossing_bandwidth`), otherwise the intra-node ones;
        a ring over both axes of a multi-node submesh has every device of the submesh's nodes, ``joint_alpha``
        and ``joint_beta``. For a ``(2, 8)`` submesh: views ``(2, 8)``, ``(4, 4)``, ``(8, 2)`` put axis 0
        across nodes (with 1, 2 and 4 devices of a group on each node) and axis 1 inside a node;
        ``(1, 16)`` puts axis 1 across nodes (8 devices of the group on each node).

        Args:
          cluster: supplies bandwidths (bytes/s; beta is their inverse) and latencies (alpha).
          submesh_shape: ``(n_nodes, n_devices_per_node)`` as in Alpa's stage DP (§3.5.2); must fit in
            ``cluster``.
          logical_shape: ``(l0, l1)`` (or ``(l,)``) with the same number of devices as the submesh.
        """
        n_nodes, per_node = _check_submesh(cluster, submesh_shape)
        logical_shape = _as_tuple(logical_shape)
        if (logical_shape is None or len(logical_shape) not in (1, 2)
                or not all(_is_int(n) and n >= 1 for n in logical_shape)
                or math.prod(logical_shape) != n_nodes * per_node):
            raise ValueError(f"logical_shape must be 1 or 2 ints >= 1 with product {n_nodes * per_node} "
                             f"(the submesh {submesh_shape}), got {logical_shape!r}")
        alpha, beta, all_to_all_beta = [], [], []
        for axis in range(len(logical_shape)):
            on_one_node = _group_devices_per_node(logical_shape, axis, per_node)
            inter = on_one_node is not None
            bandwidth = crossing_bandwidth(cluster, on_one_node) if inter else cluster.intra_node_bandwidth
            alpha.append(cluster.inter_node_latency if inter else cluster.intra_node_latency)
            beta.append(1.0 / bandwidth)
            all_to_all_beta.append(1.0 / (cluster.inter_node_bandwidth if inter else cluster.intra_node_bandwidth))
        joint = {}
        if len(logical_shape) == 2 and n_nodes > 1:
            joint = {"joint_alpha": cluster.inter_node_latency,
                     "joint_beta": 1.0 / crossing_bandwidth(cluster, per_node)}
        return cls(shape=logical_shape, alpha=tuple(alpha), beta=tuple(beta), all_to_all_beta=tuple(all_to_all_beta),
                   **joint)

    def without_latency(self) -> LogicalMesh:
        """This mesh with every latency (``alpha``, ``joint_alpha``) 0 and the bandwidth terms kept."""
        return dataclasses.replace(self, alpha=(0.0,) * self.ndim,
                                   joint_alpha=None if self.joint_alpha is None else 0.0)

    def axis_size(self, axis: Axis) -> int:
        """Devices in one group along ``axis`` (``n0 * n1`` for ``(0, 1)``)."""
        return math.prod(self.shape[a] for a in self._axes(axis))

    def all_reduce_cost(self, num_bytes: float, axis: Axis) -> float:
        r"""Ring all-reduce of a ``num_bytes`` buffer held by every device of the group.

        .. math:: \alpha + 2 \frac{n - 1}{n} \, \mathrm{bytes} \, \beta

        Over both axes of a 2-D mesh, the cheaper of that ring and the two-level form
        (:meth:`_two_level_cost`): a reduce-scatter along the faster axis, an all-reduce of each device's
        ``1 / n_fast`` share along the slower one, an all-gather along the faster axis.
        """
        ring = self._ring_cost(num_bytes, axis, lambda n: 2.0 * (n - 1) / n)
        return min(ring, self._two_level_cost("all-reduce", num_bytes, axis))

    def all_gather_cost(self, num_bytes: float, axis: Axis) -> float:
        r"""Ring all-gather whose gathered output (on every device) is ``num_bytes``; each holds ``1/n``.

        .. math:: \alpha + \frac{n - 1}{n} \, \mathrm{bytes} \, \beta

        Over both axes of a 2-D mesh, the cheaper of that ring and the two-level form: an all-gather of the
        ``1 / n_fast`` shares along the slower axis, then of the whole along the faster one.
        """
        ring = self._ring_cost(num_bytes, axis, lambda n: (n - 1) / n)
        return min(ring, self._two_level_cost("all-gather", num_bytes, axis))

    def reduce_scatter_cost(self, num_bytes: float, axis: Axis) -> float:
        r"""Ring reduce-scatter of a ``num_bytes`` input per device; each keeps ``1/n`` of the sum.

        .. math:: \alpha + \frac{n - 1}{n} \, \mathrm{bytes} \, \beta

        Over both axes of a 2-D mesh, the cheaper of that ring and the two-level form: a reduce-scatter along
        the faster axis, then of each device's ``1 / n_fast`` share along the slower one.
        """
        ring = self._ring_cost(num_bytes, axis, lambda n: (n - 1) / n)
        return min(ring, self._two_level_cost("reduce-scatter", num_bytes, axis))

    def _two_level_cost(self, kind: str, num_bytes: float, axis: Axis) -> float:
        """The hierarchical form of an all-reduce, all-gather or reduce-scatter over both axes of a 2-D mesh
        (inf for one axis, or where an axis has size 1): each step is a ring along one axis, the step along
        the slower axis (larger beta) on ``1 / n_fast`` of the bytes, ``n_fast`` such rings at once. Across
        nodes it moves only that share per device, as NCCL's tree all-reduce and the hierarchical collectives
        of the baselines (``bench.baselines.collective_seconds``) do; a reduce-scatter followed by an all-gather
        costs what the all-reduce does, as for rings (the post-ILP weight-update sharding relies on it)."""
        axes = self._axes(axis)
        if len(axes) < 2 or min(self.shape) == 1:
            return math.inf
        fast = min(axes, key=lambda a: (self.beta[a], self.alpha[a], -a))
        slow, share = 1 - fast, num_bytes / self.shape[fast]
        if kind == "all-reduce":
            return (self.reduce_scatter_cost(num_bytes, fast) + self.all_reduce_cost(share, slow)
                    + self.all_gather_cost(num_bytes, fast))
        if kind == "reduce-scatter":
            return self.reduce_scatter_cost(num_bytes, fast) + self.reduce_scatter_cost(share, slow)
        return self.all_gather_cost(share, slow) + self.all_gather_cost(num_bytes, fast)

    def all_to_all_cost(self, num_bytes: float, axis: Axis) -> float:
        r"""All-to-all within a group whose ``n`` devices together hold ``num_bytes`` (``num_bytes / n`` each).

        Each device keeps ``1/n`` of its buffer and sends the other ``(n - 1)/n`` of it, i.e.
        ``(n - 1) / n^2 * bytes``, over its own link (links used concurrently, no ring forwarding):

        .. math:: \alpha + \frac{n - 1}{n^2} \, \mathrm{bytes} \, \beta

        Table 3.2 writes all-to-all costs by the per-device buffer ``x = bytes / n``
        (``all-to-all(M / n_0, 0)`` for ``S^0R -> RS^0``); the formula above is ``(n - 1)/n * x * beta``
        in those terms. Alpa's implementation multiplies this by an empirical ``n / 2`` penalty; we do not.
        ``all_to_all_beta`` replaces ``beta`` where given.
        """
        return self._ring_cost(num_bytes, axis, lambda n: (n - 1) / n**2, self.all_to_all_beta)

    def _ring_cost(self, num_bytes: float, axis: Axis, volume_factor,
                   betas: tuple[float, ...] | None = None) -> float:
        """``alpha + volume_factor(n) * num_bytes * beta`` on ``axis``, or 0 when ``n == 1``; with ``betas``,
        those per-axis betas (and no joint ring) instead of ``beta``."""
        if not _is_number(num_bytes) or num_bytes < 0:
            raise ValueError(f"num_bytes must be a number >= 0, got {num_bytes!r}")
        axes = self._axes(axis)
        n = math.prod(self.shape[a] for a in axes)
        if n == 1:
            return 0.0
        if betas is None:
            if len(axes) == 2 and self.joint_beta is not None:
                alpha = self.joint_alpha if self.joint_alpha is not None else max(self.alpha)
                return alpha + volume_factor(n) * num_bytes * self.joint_beta
            betas = self.beta
        slowest = max(axes, key=lambda a: (betas[a], self.alpha[a]))
        return self.alpha[slowest] + volume_factor(n) * num_bytes * betas[slowest]

    def _axes(self, axis: Axis) -> tuple[int, ...]:
        """Normalises ``axis`` to a sorted tuple of distinct valid mesh axes; ValueError otherwise."""
        axes = (axis,) if _is_int(axis) else axis
        if (not isinstance(axes, tuple) or not axes or not all(_is_int(a) and 0 <= a < self.ndim for a in axes)
                or len(set(axes)) != len(axes)):
            valid = "0" if self.ndim == 1 else "0, 1 or (0, 1)"
            raise ValueError(f"axis must be {valid} for a mesh of shape {self.shape}, got {axis!r}")
        return tuple(sorted(axes))

    def __str__(self) -> str:
        axes = ", ".join(f"axis {i}: n={n} alpha={a:.3g}s beta={b:.3g}s/B"
                         for i, (n, a, b) in enumerate(zip(self.shape, self.alpha, self.beta, strict=True)))
        joint = ""
        if self.joint_beta is not None:
            alpha = max(self.alpha) if self.joint_alpha is None else self.joint_alpha
            joint = f", both axes: alpha={alpha:.3g}s beta={self.joint_beta:.3g}s/B"
        return f"LogicalMesh{self.shape} ({axes}{joint})"


def _check_submesh(cluster: ClusterSpec, submesh_shape: tuple[int, int]) -> tuple[int, int]:
    """Validates ``submesh_shape`` against ``cluster``; returns it as ``(n_nodes, n_devices_per_node)``."""
    shape = _as_tuple(submesh_shape)
    if (shape is None or len(shape) != 2
            or not all(_is_int(n) and n >= 1 for n in shape)
            or shape[0] > cluster.num_nodes or shape[1] > cluster.num_devices_per_node):
        raise ValueError(f"submesh_shape must be (n_nodes, n_devices_per_node) within the cluster's "
                         f"({cluster.num_nodes}, {cluster.num_devices_per_node}), got {submesh_shape!r}")
    return int(shape[0]), int(shape[1])


def _as_tuple(value: object) -> tuple | None:
    """``value`` as a tuple if it is a list or tuple, else None."""
    return tuple(value) if isinstance(value, (list, tuple)) else None


def crossing_bandwidth(cluster: ClusterSpec, devices_per_node: int) -> float:
    """Bytes/s a ring over devices of several nodes sees across them when ``devices_per_node`` of its devices
    are on each node: their shares of the node's network link (``inter_node_bandwidth`` each) pooled, as
    NCCL spreads one ring's traffic over channels through every NIC, and at most the intra-node link."""
    return min(devices_per_node * cluster.inter_node_bandwidth, cluster.intra_node_bandwidth)


def _group_devices_per_node(logical_shape: tuple[int, ...], axis: int, per_node: int) -> int | None:
    """None when every group of devices along ``axis`` of a row-major ``logical_shape`` is inside one node,
    else the fewest devices a group spanning nodes has on one of its nodes."""
    shape = logical_shape if len(logical_shape) == 2 else (1, logical_shape[0])
    axis = axis if len(logical_shape) == 2 else 1
    n0, n1 = shape
    if axis == 1:
        groups = ([i0 * n1 + i1 for i1 in range(n1)] for i0 in range(n0))
    else:
        groups = ([i0 * n1 + i1 for i0 in range(n0)] for i1 in range(n1))
    counts = [collections.Counter(g // per_node for g in group) for group in groups]
    spanning = [min(c.values()) for c in counts if len(c) > 1]
    return min(spanning) if spanning else None


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
