"""Alpa's sharding specs and the cost of converting between them (dissertation §3.4.1, Tables 3.1-3.2).

A sharding spec says, for each tensor dim, which mesh axes partition it: ``R`` (replicated), ``S^0``,
``S^1``, ``S^{01}`` (both axes, axis 0 major) or ``S^{10}`` (both, axis 1 major). We write the superscripts
without decoration: ``str(spec)`` is ``"S0R"``, ``"RS01"``, ``"S1S0"``; :meth:`ShardingSpec.from_str` also
accepts the paper's ``"S^0R"`` and ``"S^{01}R"``. Vocabulary: an *axis* is a mesh axis, a *dim* a tensor
dimension.

Layout (Table 3.1): on an ``(n0, n1)`` mesh, the device at ``(i0, i1)`` holds, along a dim sharded by the
axes ``(a, b)``, block number ``i_a * n_b + i_b`` of ``n_a * n_b`` equal blocks (the first axis is major);
along ``(a,)`` it holds block ``i_a`` of ``n_a``. This is exactly ``jax.sharding.PartitionSpec``'s
convention for a tuple of axis names, so :meth:`ShardingSpec.to_partition_spec` is a renaming.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
import re
from collections.abc import Sequence
from typing import Literal

from jax.sharding import PartitionSpec

from alpa_like.compiler.logical_mesh import LogicalMesh

MESH_AXES = (0, 1)
"""Alpa's meshes are at most 2-D, so a spec may use mesh axes 0 and 1 only."""

DimAxes = tuple[int, ...]
"""The mesh axes sharding one tensor dim, major first: ``()`` is R, ``(0,)`` S^0, ``(0, 1)`` S^01."""

_TOKEN = re.compile(r"R|S(\d+)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingSpec:
    """The layout of one tensor on a logical mesh: the mesh axes that shard each tensor dim.

    >>> spec = ShardingSpec.from_str("S0R")
    >>> spec.axes, str(spec), spec.shard_shape((8, 6), (2, 4))
    (((0,), ()), 'S0R', (4, 6))

    A scalar's spec has no dims; it prints as the empty string and ``from_str("")`` parses it back.
    A mesh axis may appear at most once in a spec (a tensor cannot be split twice by the same devices);
    the constructor rejects specs that repeat an axis.
    """

    axes: tuple[DimAxes, ...]
    """For each tensor dim, the mesh axes that shard it, major first (see :data:`DimAxes`)."""

    def __post_init__(self) -> None:
        if isinstance(self.axes, (str, bytes)) or not isinstance(self.axes, Sequence):
            raise ValueError(f"axes must be a sequence of tuples of mesh axes, got {self.axes!r}")
        axes = []
        for dim, dim_axes in enumerate(self.axes):
            if isinstance(dim_axes, (str, bytes)) or not isinstance(dim_axes, Sequence) or not all(
                    isinstance(a, numbers.Integral) and not isinstance(a, bool) and a in MESH_AXES
                    for a in dim_axes):
                raise ValueError(f"axes[{dim}] must be a tuple of mesh axes from {MESH_AXES}, got {dim_axes!r}")
            axes.append(tuple(int(a) for a in dim_axes))
        used = [a for dim_axes in axes for a in dim_axes]
        for a in MESH_AXES:
            if used.count(a) > 1:
                raise ValueError(f"mesh axis {a} shards more than one dim (or one dim twice) in axes={self.axes!r}")
        object.__setattr__(self, "axes", tuple(axes))
        object.__setattr__(self, "_hash", hash(self.axes))  # specs key the ILP's cost caches: hash once

    def __hash__(self) -> int:
        return self._hash

    @property
    def ndim(self) -> int:
        """Number of tensor dims."""
        return len(self.axes)

    @classmethod
    def replicated(cls, ndim: int) -> ShardingSpec:
        """The fully replicated spec ``R...R`` of an ``ndim``-dim tensor."""
        if not isinstance(ndim, numbers.Integral) or isinstance(ndim, bool) or ndim < 0:
            raise ValueError(f"ndim must be an int >= 0, got {ndim!r}")
        return cls(axes=((),) * int(ndim))

    @classmethod
    def from_str(cls, text: str, ndim: int | None = None) -> ShardingSpec:
        """Parses ``"S0R"``, ``"RS01"``, ``"S1S0"``, ``"S^{01}R"`` (``^``, braces and spaces are ignored).

        ``""`` is the spec of a scalar. With ``ndim`` given, a spec of another length raises ``ValueError``.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {text!r}")
        compact = re.sub(r"[\s^{}]", "", text)
        axes, pos = [], 0
        while pos < len(compact):
            match = _TOKEN.match(compact, pos)
            if match is None:
                raise ValueError(f"cannot parse sharding spec {text!r} at {compact[pos:]!r}: expected R or S "
                                 "followed by mesh axes, e.g. 'S0R', 'RS01'")
            axes.append(() if match.group(1) is None else tuple(int(c) for c in match.group(1)))
            pos = match.end()
        spec = cls(axes=tuple(axes))
        if ndim is not None and spec.ndim != ndim:
            raise ValueError(f"sharding spec {text!r} has {spec.ndim} dims, expected ndim={ndim}")
        return spec

    def __str__(self) -> str:
        return "".join("S" + "".join(map(str, a)) if a else "R" for a in self.axes)

    def __repr__(self) -> str:
        return f"ShardingSpec.from_str({str(self)!r})"

    def is_valid(self, mesh_shape: MeshShapeLike) -> bool:
        """Whether every mesh axis the spec uses exists in ``mesh_shape`` (each is used at most once by
        construction)."""
        ndim = len(_mesh_shape(mesh_shape))
        return all(a < ndim for dim_axes in self.axes for a in dim_axes)

    def dim_shards(self, mesh_shape: MeshShapeLike) -> tuple[int, ...]:
        """Number of blocks each tensor dim is split into (the product of its axes' mesh sizes)."""
        shape = self._checked_mesh(mesh_shape)
        return tuple(math.prod(shape[a] for a in dim_axes) for dim_axes in self.axes)

    def num_shards(self, mesh_shape: MeshShapeLike) -> int:
        """Number of distinct tiles: the product of :meth:`dim_shards`. The other ``num_devices /
        num_shards`` factor is replication."""
        return math.prod(self.dim_shards(mesh_shape))

    def shard_shape(self, shape: Sequence[int], mesh_shape: MeshShapeLike) -> tuple[int, ...]:
        """The tile each device holds. Raises ``ValueError`` naming the first dim that does not divide."""
        shape = _tensor_shape(shape, self.ndim)
        tile = []
        for dim, (size, shards) in enumerate(zip(shape, self.dim_shards(mesh_shape), strict=True)):
            if size % shards:
                raise ValueError(f"dim {dim} of size {size} is not divisible by its {shards} shards "
                                 f"({self} on mesh {_mesh_shape(mesh_shape)})")
            tile.append(size // shards)
        return tuple(tile)

    def to_partition_spec(self, axis_names: Sequence[str]) -> PartitionSpec:
        """The equivalent ``PartitionSpec`` with mesh axis ``i`` named ``axis_names[i]``.

        ``S0R`` with ``('x', 'y')`` is ``P('x', None)``; ``S01`` is ``P(('x', 'y'),)``; ``S10`` is
        ``P(('y', 'x'),)``. Every dim gets an entry (trailing ``None`` kept).
        """
        names = tuple(axis_names)
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise ValueError(f"axis_names must be distinct strings, got {axis_names!r}")
        if not self.is_valid(tuple(1 for _ in names)):
            raise ValueError(f"axis_names {names} do not name every mesh axis used by {self}")
        entries = [None if not a else names[a[0]] if len(a) == 1 else tuple(names[i] for i in a)
                   for a in self.axes]
        return PartitionSpec(*entries)

    @classmethod
    def from_partition_spec(cls, pspec: PartitionSpec, axis_names: Sequence[str], ndim: int) -> ShardingSpec:
        """Inverse of :meth:`to_partition_spec`; a ``pspec`` shorter than ``ndim`` replicates the rest."""
        names = tuple(axis_names)
        if len(pspec) > ndim:
            raise ValueError(f"pspec {pspec} has {len(pspec)} entries, more than ndim={ndim}")
        axes = []
        for entry in tuple(pspec) + (None,) * (ndim - len(pspec)):
            entry_names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            if not isinstance(entry_names, tuple) or not all(n in names for n in entry_names):
                raise ValueError(f"pspec entry {entry!r} is not None, an axis name or a tuple of axis names "
                                 f"from axis_names={names}")
            axes.append(tuple(names.index(n) for n in entry_names))
        return cls(axes=tuple(axes))

    def _checked_mesh(self, mesh_shape: MeshShapeLike) -> tuple[int, ...]:
        shape = _mesh_shape(mesh_shape)
        if not self.is_valid(shape):
            raise ValueError(f"sharding spec {self} uses a mesh axis that mesh_shape {shape} does not have")
        return shape


MeshShapeLike = tuple[int, ...] | LogicalMesh
"""A mesh shape ``(n,)`` or ``(n0, n1)``; a :class:`LogicalMesh` stands for its ``shape``."""


def enumerate_specs(shape: Sequence[int], mesh_shape: MeshShapeLike) -> tuple[ShardingSpec, ...]:
    """Every spec of a ``shape`` tensor whose sharded dims divide evenly: the ILP's candidate layouts.

    Each mesh axis either shards no dim or one dim whose size it divides; a dim sharded by both axes is
    written ``S01`` only (``S10`` is the same tiling with the devices permuted; Table 3.1 lists the
    9 specs of a matrix on a 2x2 mesh without it). A mesh axis of size 1 is never used: sharding on it
    gives the same tiles as ``R``. The replicated spec comes first.

    >>> [str(s) for s in enumerate_specs((4, 6), (2, 3))]
    ['RR', 'RS1', 'S0R', 'S0S1', 'RS0', 'RS01']
    """
    mesh = _mesh_shape(mesh_shape)
    ndim = len(_tensor_shape(shape, None))
    useful = [a for a in range(len(mesh)) if mesh[a] > 1]
    specs = []
    for dims in itertools.product([None, *range(ndim)], repeat=len(useful)):
        axes = [[] for _ in range(ndim)]
        for axis, dim in zip(useful, dims, strict=True):
            if dim is not None:
                axes[dim].append(axis)
        spec = ShardingSpec(axes=tuple(tuple(a) for a in axes))
        if all(size % shards == 0 for size, shards in zip(shape, spec.dim_shards(mesh), strict=True)):
            specs.append(spec)
    return tuple(specs)


# ---------------------------------------------------------------------------------------------------
# Resharding (Table 3.2)
# ---------------------------------------------------------------------------------------------------

StepKind = Literal["slice", "all-to-all", "all-gather"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReshardStep:
    """One step of a resharding plan: a collective (or a free local slice) on one mesh axis.

    Each step edits the spec at the *end* of a dim's axis tuple (the minor axis), which keeps every
    intermediate layout a valid spec: a slice appends a free axis to a dim, an all-gather removes the last
    axis of a dim, an all-to-all moves the last axis of one dim to the end of another.
    """

    kind: StepKind
    """``"slice"`` (local, free), ``"all-to-all"`` or ``"all-gather"``."""
    axis: int
    """The mesh axis the step runs along."""
    num_bytes: float
    """Bytes passed to :class:`LogicalMesh`'s cost method: the full tensor within one group of ``axis``
    (for ``"slice"``: the local tile before slicing)."""
    from_dim: int | None
    """The dim ``axis`` stops sharding (None for a slice)."""
    to_dim: int | None
    """The dim ``axis`` starts sharding (None for an all-gather)."""

    def cost(self, mesh: LogicalMesh) -> float:
        """Seconds on ``mesh`` by the alpha-beta model; a slice costs 0."""
        if self.kind == "all-gather":
            return mesh.all_gather_cost(self.num_bytes, self.axis)
        if self.kind == "all-to-all":
            return mesh.all_to_all_cost(self.num_bytes, self.axis)
        return 0.0

    def __str__(self) -> str:
        dims = {"slice": f"dim {self.to_dim}", "all-gather": f"dim {self.from_dim}",
                "all-to-all": f"dim {self.from_dim}->{self.to_dim}"}[self.kind]
        return f"{self.kind}({self.num_bytes:g} B, axis {self.axis}, {dims})"


def describe_resharding(src: ShardingSpec, dst: ShardingSpec, shape: Sequence[int], itemsize: int,
                        mesh: LogicalMesh) -> tuple[ReshardStep, ...]:
    """A plan of slices, all-to-alls and all-gathers that turns layout ``src`` into ``dst``.

    The plan keeps, in every dim, the longest common prefix of the source and destination axis tuples
    (those tiles are already right) and repeats, until the layout is ``dst``:

    1. **slice** a mesh axis that shards nothing onto the end of a dim that needs it next (free; done
       first because it shrinks every later collective);
    2. **all-to-all** the last axis of a dim that must lose it onto the end of the dim that needs it next
       (``(n-1)/n`` of the local tile moves, versus ``n - 1`` times the tile for gather-then-slice);
    3. otherwise **all-gather** the last axis of a dim that must lose it, trying every such dim and keeping
       the cheapest continuation (at most two choices on a 2-D mesh).

    This reproduces every row of Table 3.2, with ``M = prod(shape) * itemsize``:

    ========  ==========  ==========  ===========================================================
    #         src         dst         plan (Table 3.2 cost)
    ========  ==========  ==========  ===========================================================
    1         RR          S0S1        slice, slice (0)
    2         S0R         RR          all-gather(M, axis 0)
    3         S0S1        S0R         all-gather(M/n0, axis 1)
    4         S0R         RS0         all-to-all(M, axis 0): per-device M/n0 as in the table
    5         S0S1        S01R        all-to-all(M/n0, axis 1): per-device M/(n0 n1)
    ========  ==========  ==========  ===========================================================

    Mesh axes of size 1 are dropped from both specs first (they do not change any tile), so e.g.
    ``RS01 -> RS1`` on a ``(1, 4)`` mesh costs 0. Collectives over both axes at once (one ring of
    ``n0 * n1`` devices) are not used: gathering axis by axis moves the same volume on uniform links and
    never more on mixed ones, at one extra alpha. Tensor dims need not divide evenly: bytes are real
    numbers ``M / num_shards``.

    The rule is deliberately direct (each axis is removed at most once and never re-added elsewhere), like
    the collectives XLA's SPMD partitioner emits; it is not a search over all step sequences. Such a search
    can be cheaper on meshes with a slow and a fast axis, e.g. ``S0R -> RR`` as slice on axis 1, gather
    on axis 0, gather on axis 1 (a hierarchical all-gather). Every plan costs at most the naive
    gather-everything-then-slice route.

    Args:
      src, dst: layouts of the tensor; both must be valid on ``mesh``.
      shape: the global tensor shape; ``len(shape) == src.ndim == dst.ndim``.
      itemsize: bytes per element.
      mesh: the logical mesh whose per-axis alpha-beta costs choose between plans.

    Returns:
      The steps in execution order (empty when ``src == dst``); the ILP's report prints them.
    """
    total = _check_resharding_args(src, dst, shape, itemsize, mesh)
    return _plan(_drop_trivial_axes(src, mesh), _drop_trivial_axes(dst, mesh), total, mesh)[0]


def resharding_cost(src: ShardingSpec, dst: ShardingSpec, shape: Sequence[int], itemsize: int,
                    mesh: LogicalMesh) -> float:
    r"""Seconds to convert a ``shape`` tensor from layout ``src`` to ``dst`` on ``mesh`` (Table 3.2).

    .. math:: R(src, dst) = \sum_{\text{step} \in \text{plan}} \text{cost}(\text{step})

    where the plan is :func:`describe_resharding`'s. This is one entry of the ILP's resharding matrix
    ``R_vu`` (Eq. 3.1). ``R -> anything`` is 0 (local slicing, Table 3.2 #1), as is ``src == dst``.

    >>> mesh = LogicalMesh(shape=(2, 4), alpha=(0.0, 0.0), beta=(1.0, 1.0))
    >>> resharding_cost(ShardingSpec.from_str("S0R"), ShardingSpec.from_str("RR"), (8, 8), 4, mesh)
    128.0
    """
    try:
        return _resharding_cost(src, dst, tuple(shape), itemsize, mesh)
    except TypeError:  # unhashable arguments: let the validation below explain what is wrong
        total = _check_resharding_args(src, dst, shape, itemsize, mesh)
        return _plan(_drop_trivial_axes(src, mesh), _drop_trivial_axes(dst, mesh), total, mesh)[1]


def resharding_seconds(src: ShardingSpec, dst: ShardingSpec, num_bytes: float, mesh: LogicalMesh) -> float:
    """:func:`resharding_cost` of a tensor of ``num_bytes`` without argument checks, for callers whose
    specs were enumerated for the tensor's shape on ``mesh`` (the ILP's inner loop)."""
    if src == dst:
        return 0.0
    return _plan(_drop_trivial_axes(src, mesh), _drop_trivial_axes(dst, mesh), float(num_bytes), mesh)[1]


@functools.lru_cache(maxsize=1 << 18)
def _resharding_cost(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int,
                     mesh: LogicalMesh) -> float:
    """:func:`resharding_cost`, memoised: the ILP asks for the same (shape, spec pair, mesh) across the
    layers and solves of a planning run."""
    total = _check_resharding_args(src, dst, shape, itemsize, mesh)
    return _plan(_drop_trivial_axes(src, mesh), _drop_trivial_axes(dst, mesh), total, mesh)[1]


@functools.lru_cache(maxsize=1 << 16)
def _plan(cur: tuple[DimAxes, ...], dst: tuple[DimAxes, ...], total_bytes: float,
          mesh: LogicalMesh) -> tuple[tuple[ReshardStep, ...], float]:
    """(steps, cost) of the plan described in :func:`describe_resharding` from ``cur`` to ``dst``."""
    if cur == dst:
        return (), 0.0
    tile = total_bytes / math.prod(mesh.shape[a] for dim_axes in cur for a in dim_axes)
    forced = _next_slice(cur, dst, tile) or _next_move(cur, dst, tile, mesh)
    candidates = [forced] if forced else _gathers(cur, dst, tile, mesh)
    best: tuple[tuple[ReshardStep, ...], float] | None = None
    for step in candidates:
        rest, rest_cost = _plan(_apply(cur, step), dst, total_bytes, mesh)
        cost = step.cost(mesh) + rest_cost
        if best is None or cost < best[1]:
            best = ((step, *rest), cost)
    if best is None:  # Unreachable: a layout that differs from dst always has a slice, move or gather.
        raise RuntimeError(f"no resharding step from {cur} to {dst}")
    return best


def clear_resharding_caches() -> None:
    """Forgets the memoised resharding plans and costs (for benchmarks that measure a solve cold)."""
    _plan.cache_clear()
    _resharding_cost.cache_clear()


def _drop_trivial_axes(spec: ShardingSpec, mesh: LogicalMesh) -> tuple[DimAxes, ...]:
    """``spec.axes`` without mesh axes of size 1: they split nothing, so the tiles are the same."""
    return tuple(tuple(a for a in dim_axes if mesh.shape[a] > 1) for dim_axes in spec.axes)


def _kept(cur: DimAxes, dst: DimAxes) -> int:
    """Length of the common prefix of a dim's current and destination axes: the part already right."""
    return next((i for i, (a, b) in enumerate(zip(cur, dst)) if a != b), min(len(cur), len(dst)))


def _next_slice(cur, dst, tile: float) -> ReshardStep | None:
    """A free axis that a dim (whose current axes prefix its destination) needs next, if any."""
    used = {a for dim_axes in cur for a in dim_axes}
    for dim, (have, want) in enumerate(zip(cur, dst, strict=True)):
        if _kept(have, want) == len(have) < len(want) and want[len(have)] not in used:
            return ReshardStep(kind="slice", axis=want[len(have)], num_bytes=tile, from_dim=None, to_dim=dim)
    return None


def _next_move(cur, dst, tile: float, mesh: LogicalMesh) -> ReshardStep | None:
    """An axis at the end of a dim that must lose it, which another dim needs next, if any."""
    for dim, (have, want) in enumerate(zip(cur, dst, strict=True)):
        if len(have) > _kept(have, want):
            axis = have[-1]
            for to_dim, (to_have, to_want) in enumerate(zip(cur, dst, strict=True)):
                if to_dim != dim and to_want[:len(to_have) + 1] == (*to_have, axis):
                    return ReshardStep(kind="all-to-all", axis=axis, num_bytes=tile * mesh.shape[axis],
                                       from_dim=dim, to_dim=to_dim)
    return None


def _gathers(cur, dst, tile: float, mesh: LogicalMesh) -> list[ReshardStep]:
    """All-gathers of the last axis of every dim that must lose it."""
    return [ReshardStep(kind="all-gather", axis=have[-1], num_bytes=tile * mesh.shape[have[-1]],
                        from_dim=dim, to_dim=None)
            for dim, (have, want) in enumerate(zip(cur, dst, strict=True)) if len(have) > _kept(have, want)]


def _apply(cur: tuple[DimAxes, ...], step: ReshardStep) -> tuple[DimAxes, ...]:
    """The layout after ``step``: drop ``step.axis`` from ``from_dim``'s end, append it to ``to_dim``."""
    axes = [list(dim_axes) for dim_axes in cur]
    if step.from_dim is not None:
        axes[step.from_dim].pop()
    if step.to_dim is not None:
        axes[step.to_dim].append(step.axis)
    return tuple(tuple(a) for a in axes)


def _check_resharding_args(src, dst, shape, itemsize, mesh) -> float:
    """Validates the resharding arguments; returns the tensor's bytes ``M``."""
    if not isinstance(mesh, LogicalMesh):
        raise ValueError(f"mesh must be a LogicalMesh, got {mesh!r}")
    for name, spec in (("src", src), ("dst", dst)):
        if not isinstance(spec, ShardingSpec):
            raise ValueError(f"{name} must be a ShardingSpec, got {spec!r}")
        if not spec.is_valid(mesh.shape):
            raise ValueError(f"{name}={spec} uses a mesh axis that the mesh of shape {mesh.shape} does not have")
    shape = _tensor_shape(shape, src.ndim)
    if dst.ndim != src.ndim:
        raise ValueError(f"src={src} and dst={dst} have different ndim")
    if not isinstance(itemsize, numbers.Real) or isinstance(itemsize, bool) or not itemsize > 0:
        raise ValueError(f"itemsize must be a number of bytes > 0, got {itemsize!r}")
    return float(math.prod(shape) * itemsize)


def _mesh_shape(mesh_shape: MeshShapeLike) -> tuple[int, ...]:
    """``mesh_shape`` as a tuple of 1 or 2 ints >= 1 (a LogicalMesh gives its shape)."""
    shape = mesh_shape.shape if isinstance(mesh_shape, LogicalMesh) else mesh_shape
    if (isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or len(shape) not in (1, 2)
            or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1 for n in shape)):
        raise ValueError(f"mesh_shape must be 1 or 2 ints >= 1, got {mesh_shape!r}")
    return tuple(int(n) for n in shape)


def _tensor_shape(shape: Sequence[int], ndim: int | None) -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 0, checked against ``ndim`` when given."""
    if (isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence)
            or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise ValueError(f"shape must be a sequence of ints >= 0, got {shape!r}")
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"shape {tuple(shape)} has {len(shape)} dims but the sharding spec has {ndim}")
    return tuple(int(n) for n in shape)
