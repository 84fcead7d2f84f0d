"""Cross-mesh resharding (Alpa dissertation 3.6): move a tensor laid out as A on mesh X to layout B on mesh Y.

Planning is plain data (:func:`plan_resharding`):

1. *Tile correspondence.* Every device of a mesh holds one tile (a box of the tensor) given by the spec: a
   tensor dim split over mesh axes ``(a, b)`` is cut into ``n_a * n_b`` blocks, block index
   ``i_a * n_b + i_b`` (major axis first), as in GSPMD and :meth:`ShardingSpec.shard_shape`.
2. *Send/recv.* Every destination tile is cut into the pieces that intersect source tiles; each piece is
   sent by one source replica (chosen round-robin over the replicas, to spread the load).
3. *Local all-gather rewrite.* When B replicates a tile over ``r`` destination devices, the tile is sent
   across meshes once, split into ``r`` slices (one per replica, along its largest dim when it divides),
   and the replicas then all-gather the slices inside mesh Y. Cross-mesh bytes: each byte of each distinct
   destination tile, once.

:func:`reshard` executes a plan on local devices: every piece is sliced on its source device and copied to
its destination device; tiles are assembled on the device; the result is a ``jax.Array`` on mesh Y. The two
halves, :func:`pieces_to_send` and :func:`assemble_received`, also serve the Ray backend, where sender and
receiver are different processes.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from alpa_like.compiler.sharding_spec import ShardingSpec

Box = tuple[tuple[int, int], ...]
"""Per tensor dim, [start, stop)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """A tensor's layout: the device ids of a logical mesh (row-major grid) and a spec on it."""

    device_ids: tuple[tuple[int, ...], ...]
    """The logical mesh as a 2-D grid of device ids (a 1-D mesh is one row)."""
    spec: ShardingSpec

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (len(self.device_ids), len(self.device_ids[0]))

    def tiles(self, shape: Sequence[int]) -> dict[int, Box]:
        """Device id -> the box of the tensor it holds."""
        n0, n1 = self.mesh_shape
        tile_shape = self.spec.shard_shape(shape, (n0, n1))
        out = {}
        for i0, i1 in itertools.product(range(n0), range(n1)):
            coords = (i0, i1)
            box = []
            for dim, axes in enumerate(self.spec.axes):
                block = 0
                for a in axes:
                    block = block * self.mesh_shape[a] + coords[a]
                box.append((block * tile_shape[dim], (block + 1) * tile_shape[dim]))
            out[self.device_ids[i0][i1]] = tuple(box)
        return out


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Send ``box`` (global tensor coordinates) from ``src`` to ``dst`` across meshes."""

    src: int
    dst: int
    box: Box
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class LocalAllGather:
    """After the transfers, ``devices`` (replicas of one destination tile) exchange their slices."""

    devices: tuple[int, ...]
    tile: Box
    slices: tuple[Box, ...]
    """The slice each device received, in the order of ``devices``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReshardingPlan:
    shape: tuple[int, ...]
    itemsize: int
    src: MeshLayout
    dst: MeshLayout
    transfers: tuple[Transfer, ...]
    all_gathers: tuple[LocalAllGather, ...]

    @property
    def cross_mesh_bytes(self) -> int:
        return sum(t.num_bytes for t in self.transfers)

    def estimated_seconds(self, bandwidth: float, latency: float, local_bandwidth: float | None = None) -> float:
        """Alpha-beta time: the busiest receiving device's transfers, then the local all-gathers."""
        per_dst: dict[int, float] = {}
        for t in self.transfers:
            per_dst[t.dst] = per_dst.get(t.dst, 0.0) + latency + t.num_bytes / bandwidth
        cross = max(per_dst.values(), default=0.0)
        local_bw = local_bandwidth or bandwidth
        gather = max((latency + _box_bytes(g.tile, self.itemsize) * (len(g.devices) - 1) / len(g.devices) / local_bw
                      for g in self.all_gathers), default=0.0)
        return cross + gather

    def serial_seconds(self, bandwidth: float, latency: float) -> float:
        """Alpha-beta time when every copy runs one after the other (one driver thread issuing them on one
        host whose devices share its cores and memory, as :func:`reshard` does on local devices): each
        transfer, then each device's copy of every other replica's slice in the local all-gathers, pays
        ``latency + bytes / bandwidth``."""
        copies = [t.num_bytes for t in self.transfers]
        for g in self.all_gathers:
            for d in g.devices:
                copies.extend(_box_bytes(s, self.itemsize) for o, s in zip(g.devices, g.slices) if o != d)
        return sum(latency + b / bandwidth for b in copies)


def _box_bytes(box: Box, itemsize: int) -> int:
    return math.prod(b - a for a, b in box) * itemsize


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _split(box: Box, parts: int) -> list[Box]:
    """Cut ``box`` into ``parts`` equal slices along its largest dim that ``parts`` divides (else one
    slice per part is not possible: every part gets the whole box)."""
    dims = sorted(range(len(box)), key=lambda d: -(box[d][1] - box[d][0]))
    for d in dims:
        lo, hi = box[d]
        if (hi - lo) % parts == 0 and hi - lo >= parts:
            step = (hi - lo) // parts
            return [box[:d] + ((lo + k * step, lo + (k + 1) * step),) + box[d + 1:] for k in range(parts)]
    return [box] * parts


def plan_resharding(shape: Sequence[int], itemsize: int, src: MeshLayout, dst: MeshLayout,
                    *, local_all_gather: bool = True) -> ReshardingPlan:
    """The send/recv plan from ``src`` to ``dst`` (see the module docstring)."""
    shape = tuple(shape)
    src_tiles, dst_tiles = src.tiles(shape), dst.tiles(shape)
    holders: dict[Box, list[int]] = {}
    for device, box in src_tiles.items():
        holders.setdefault(box, []).append(device)
    replicas: dict[Box, list[int]] = {}
    for device, box in dst_tiles.items():
        replicas.setdefault(box, []).append(device)
    transfers, gathers, turn = [], [], 0
    for tile, devices in replicas.items():
        slices = _split(tile, len(devices)) if local_all_gather and len(devices) > 1 else [tile] * len(devices)
        distinct = local_all_gather and len(devices) > 1 and len(set(slices)) == len(devices)
        if not distinct:
            slices = [tile] * len(devices)
        for device, piece_box in zip(devices, slices, strict=True):
            for src_box, src_devices in holders.items():
                piece = _intersect(piece_box, src_box)
                if piece is None:
                    continue
                sender = src_devices[turn % len(src_devices)]
                turn += 1
                transfers.append(Transfer(src=sender, dst=device, box=piece, num_bytes=_box_bytes(piece, itemsize)))
        if distinct:
            gathers.append(LocalAllGather(devices=tuple(devices), tile=tile, slices=tuple(slices)))
    return ReshardingPlan(shape=shape, itemsize=itemsize, src=src, dst=dst, transfers=tuple(transfers),
                          all_gathers=tuple(gathers))


def _local(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def reshard(x: jax.Array, plan: ReshardingPlan, dst_sharding: jax.sharding.NamedSharding) -> jax.Array:
    """Executes ``plan`` on local devices: returns ``x`` laid out as ``plan.dst`` (``dst_sharding``)."""
    devices = {d.id: d for d in jax.devices()}
    src_data = {s.device.id: s.data for s in x.addressable_shards}
    received = {dst: [(box, jax.device_put(piece, devices[dst])) for box, piece in pieces]
                for dst, pieces in pieces_to_send(plan, src_data).items()}
    order = [d.id for d in dst_sharding.mesh.devices.flat]
    return assemble_received(plan, received, x.dtype, devices, order, dst_sharding)


def pieces_to_send(plan: ReshardingPlan, src_data) -> dict[int, list[tuple[Box, object]]]:
    """Step 2 of the plan on the sending side: per destination device id, the (box, data) pieces cut from
    the source tiles ``src_data`` (source device id -> its tile, a jax or numpy array)."""
    src_tiles = plan.src.tiles(plan.shape)
    out: dict[int, list[tuple[Box, object]]] = {}
    for t in plan.transfers:
        whole = t.box == src_tiles[t.src]
        piece = src_data[t.src] if whole else src_data[t.src][_local(t.box, src_tiles[t.src])]
        out.setdefault(t.dst, []).append((t.box, piece))
    return out


def assemble_received(plan: ReshardingPlan, received: dict[int, list[tuple[Box, jax.Array]]], dtype,
                      devices: dict, order: Sequence[int], dst_sharding: jax.sharding.Sharding) -> jax.Array:
    """Step 3 of the plan on the receiving side: assembles each destination tile from the pieces its device
    received (already on that device), runs the local all-gathers, and returns the array laid out as
    ``dst_sharding``. ``devices`` maps the plan's device ids to devices; ``order`` lists the plan's device
    ids of ``dst_sharding``'s mesh in its flat order."""
    dst_tiles = plan.dst.tiles(plan.shape)
    gather_of = {d: g for g in plan.all_gathers for d in g.devices}
    tiles: dict[int, jax.Array] = {}
    for device, box in dst_tiles.items():
        if device in gather_of:
            continue
        tiles[device] = _assemble(box, received.get(device, []), dtype, devices[device])
    for g in plan.all_gathers:
        slices = {d: _assemble(s, received.get(d, []), dtype, devices[d]) for d, s in zip(g.devices, g.slices)}
        for d in g.devices:
            parts = [(s, jax.device_put(slices[o], devices[d])) for o, s in zip(g.devices, g.slices)]
            tiles[d] = _assemble(g.tile, parts, dtype, devices[d])
    return jax.make_array_from_single_device_arrays(plan.shape, dst_sharding, [tiles[d] for d in order])


def _assemble(box: Box, parts: list[tuple[Box, jax.Array]], dtype, device) -> jax.Array:
    """The tile ``box`` on ``device`` from pieces that cover it exactly."""
    if len(parts) == 1 and parts[0][0] == box:
        return parts[0][1]
    with jax.default_device(device):
        tile = jnp.zeros(tuple(hi - lo for lo, hi in box), dtype)
        for piece_box, data in parts:
            tile = tile.at[_local(piece_box, box)].set(data)
    return tile


def layout_of(sharding: jax.sharding.NamedSharding, ndim: int) -> MeshLayout:
    """The MeshLayout of a NamedSharding on a 1-D or 2-D mesh."""
    grid = np.vectorize(lambda d: d.id)(sharding.mesh.devices)
    if grid.ndim == 1:
        grid = grid[None, :]
        names = ("__unit__", *sharding.mesh.axis_names)
    else:
        names = tuple(sharding.mesh.axis_names)
    spec = ShardingSpec.from_partition_spec(sharding.spec, names, ndim)
    return MeshLayout(device_ids=tuple(tuple(int(v) for v in row) for row in grid), spec=spec)
