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

:func:`reshard` executes a plan on local devices with few dispatches, since on one host each costs more than
copying a small piece: one executable per source device cuts all its pieces, one batched ``device_put``
copies them, one executable per destination tile assembles its pieces, and one collective executable per
replica group runs its local all-gather; the result is a ``jax.Array`` on mesh Y. The two halves,
:func:`pieces_to_send` and :func:`assemble_received`, also serve the Ray backend, where sender and receiver
are different processes.
"""
from __future__ import annotations

import dataclasses
import functools
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
        """Alpha-beta time when every copy runs one after the other (devices that share one host's cores
        and memory, as XLA's CPU devices do): each transfer, then each device's copy of every other replica's
        slice in the local all-gathers, pays ``latency + bytes / bandwidth``."""
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


def _split(box: Box, parts: int, source_tiles: Sequence[Box] = ()) -> list[Box]:
    """Cut ``box`` into ``parts`` equal slices along one dim that ``parts`` divides (else one slice per part
    is not possible: every part gets the whole box). Of those dims, the one whose slices intersect the fewest
    ``source_tiles`` pieces (slices that line up with the source's tiles arrive whole), then the largest."""
    def slices_along(d):
        lo, hi = box[d]
        step = (hi - lo) // parts
        return [box[:d] + ((lo + k * step, lo + (k + 1) * step),) + box[d + 1:] for k in range(parts)]

    def pieces(d):
        return sum(_intersect(s, t) is not None for s in slices_along(d) for t in source_tiles)

    dims = [d for d in range(len(box)) if (box[d][1] - box[d][0]) % parts == 0 and box[d][1] - box[d][0] >= parts]
    if not dims:
        return [box] * parts
    return slices_along(min(dims, key=lambda d: (pieces(d), -(box[d][1] - box[d][0]), d)))


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
        slices = _split(tile, len(devices), tuple(holders)) if local_all_gather and len(devices) > 1 else [tile] * len(devices)
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


def _window(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of the tile ``origin``."""
    return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def _slices(window: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in window)


def reshard(x: jax.Array, plan: ReshardingPlan, dst_sharding: jax.sharding.NamedSharding) -> jax.Array:
    """Executes ``plan`` on local devices: returns ``x`` laid out as ``plan.dst`` (``dst_sharding``). The
    pieces are cut by one executable per source device, copied in one batched ``device_put``, assembled by one
    executable per destination tile and all-gathered by one executable per replica group."""
    devices = {d.id: d for d in jax.devices()}
    src_data = {s.device.id: s.data for s in x.addressable_shards}
    sent = pieces_to_send(plan, src_data)
    flat = [(dst, box, piece) for dst, pieces in sent.items() for box, piece in pieces]
    copies = jax.device_put([piece for _, _, piece in flat], [devices[dst] for dst, _, _ in flat])
    received: dict[int, list[tuple[Box, jax.Array]]] = {}
    for (dst, box, _), copy in zip(flat, copies, strict=True):
        received.setdefault(dst, []).append((box, copy))
    order = [d.id for d in dst_sharding.mesh.devices.flat]
    return assemble_received(plan, received, x.dtype, devices, order, dst_sharding)


def pieces_to_send(plan: ReshardingPlan, src_data) -> dict[int, list[tuple[Box, object]]]:
    """Step 2 of the plan on the sending side: per destination device id, the (box, data) pieces cut from
    the source tiles ``src_data`` (source device id -> its tile, a jax or numpy array; a jax tile is cut by
    one executable for all its pieces)."""
    src_tiles = plan.src.tiles(plan.shape)
    cuts: dict[int, list[Transfer]] = {}
    for t in plan.transfers:
        if t.box != src_tiles[t.src]:
            cuts.setdefault(t.src, []).append(t)
    cut_pieces = {}
    for src, transfers in cuts.items():
        windows = tuple(_window(t.box, src_tiles[src]) for t in transfers)
        data = src_data[src]
        parts = (_cutter(windows)(data) if isinstance(data, jax.Array)
                 else tuple(data[_slices(w)] for w in windows))
        cut_pieces.update(zip(transfers, parts, strict=True))
    out: dict[int, list[tuple[Box, object]]] = {}
    for t in plan.transfers:
        piece = cut_pieces[t] if t in cut_pieces else src_data[t.src]
        out.setdefault(t.dst, []).append((t.box, piece))
    return out


def assemble_received(plan: ReshardingPlan, received: dict[int, list[tuple[Box, jax.Array]]], dtype,
                      devices: dict, order: Sequence[int], dst_sharding: jax.sharding.Sharding) -> jax.Array:
    """Step 3 of the plan on the receiving side: assembles each destination tile from the pieces its device
    received (already on that device), runs the local all-gathers (one collective executable per replica
    group), and returns the array laid out as ``dst_sharding``. ``devices`` maps the plan's device ids to
    devices; ``order`` lists the plan's device ids of ``dst_sharding``'s mesh in its flat order."""
    dst_tiles = plan.dst.tiles(plan.shape)
    gather_of = {d: g for g in plan.all_gathers for d in g.devices}
    tiles: dict[int, jax.Array] = {}
    for device, box in dst_tiles.items():
        if device not in gather_of:
            tiles[device] = _assemble(box, received.get(device, []), dtype)
    for g in plan.all_gathers:
        slices = [_assemble(s, received.get(d, []), dtype) for d, s in zip(g.devices, g.slices)]
        tiles.update(zip(g.devices, _all_gather(g, [devices[d] for d in g.devices], slices), strict=True))
    return jax.make_array_from_single_device_arrays(plan.shape, dst_sharding, [tiles[d] for d in order])


def _assemble(box: Box, parts: list[tuple[Box, jax.Array]], dtype) -> jax.Array:
    """The tile ``box`` from pieces that cover it exactly, all on one device (one executable)."""
    if len(parts) == 1 and parts[0][0] == box:
        return parts[0][1]
    shape = tuple(hi - lo for lo, hi in box)
    windows = tuple(_window(piece_box, box) for piece_box, _ in parts)
    return _assembler(shape, np.dtype(dtype).name, windows)(*(data for _, data in parts))


def _all_gather(group: LocalAllGather, devices: Sequence[jax.Device], slices: Sequence[jax.Array]) -> list[jax.Array]:
    """The replicas' slices (distinct equal cuts of the tile along one dim, in device order, as
    :func:`plan_resharding` makes them) all-gathered: one collective on a 1-D mesh of the group's devices. Returns the whole tile on each device, in order."""
    cut_dim = next(d for d, (a, b) in enumerate(zip(group.slices[0], group.slices[-1])) if a != b)
    mesh = jax.sharding.Mesh(np.array(devices), ("replicas",))
    spec = [None] * len(group.tile)
    spec[cut_dim] = "replicas"
    shape = tuple(hi - lo for lo, hi in group.tile)
    cut = jax.make_array_from_single_device_arrays(
        shape, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)), list(slices))
    whole = _gatherer(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(cut)
    by_device = {s.device: s.data for s in whole.addressable_shards}
    return [by_device[d] for d in devices]


@functools.lru_cache(maxsize=None)
def _cutter(windows: tuple[Box, ...]):
    return jax.jit(lambda tile: tuple(tile[_slices(w)] for w in windows))


@functools.lru_cache(maxsize=None)
def _assembler(shape: tuple[int, ...], dtype: str, windows: tuple[Box, ...]):
    def assemble(*parts):
        tile = jnp.zeros(shape, dtype)
        for window, data in zip(windows, parts, strict=True):
            tile = tile.at[_slices(window)].set(data)
        return tile
    return jax.jit(assemble)


@functools.lru_cache(maxsize=None)
def _gatherer(replicated: jax.sharding.NamedSharding):
    return jax.jit(lambda x: x, out_shardings=replicated)


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
