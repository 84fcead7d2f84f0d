"""Cross-mesh resharding: the received data is exactly the sent tensor, each byte crosses once."""
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding

from alpa_like.compiler.sharding_spec import ShardingSpec, enumerate_specs
from alpa_like.runtime.mesh import make_mesh
from alpa_like.runtime.resharding import MeshLayout, layout_of, plan_resharding, reshard

MESHES = [((1, 4), range(0, 4)), ((2, 2), range(0, 4)), ((2, 2), range(4, 8)), ((1, 4), range(4, 8)),
          ((2, 1), range(4, 6)), ((1, 2), range(6, 8)), ((2, 4), range(0, 8)), ((1, 1), range(3, 4))]


def named(mesh_shape, device_range, spec):
    mesh = make_mesh([jax.devices()[i] for i in device_range], mesh_shape, ("x", "y"))
    return NamedSharding(mesh, spec.to_partition_spec(("x", "y")))


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([2, 4, 8])) for _ in range(ndim))
    src_mesh, dst_mesh = draw(st.sampled_from(MESHES)), draw(st.sampled_from(MESHES))
    src_spec = draw(st.sampled_from(enumerate_specs(shape, src_mesh[0]) or (ShardingSpec.replicated(ndim),)))
    dst_spec = draw(st.sampled_from(enumerate_specs(shape, dst_mesh[0]) or (ShardingSpec.replicated(ndim),)))
    return shape, src_mesh, src_spec, dst_mesh, dst_spec


@settings(max_examples=60, deadline=None)
@given(cases(), st.booleans())
def test_received_data_is_exact(case, local_all_gather):
    shape, (src_shape, src_devs), src_spec, (dst_shape, dst_devs), dst_spec = case
    src_sharding, dst_sharding = named(src_shape, src_devs, src_spec), named(dst_shape, dst_devs, dst_spec)
    value = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    x = jax.device_put(value, src_sharding)
    plan = plan_resharding(shape, 4, layout_of(src_sharding, len(shape)), layout_of(dst_sharding, len(shape)),
                           local_all_gather=local_all_gather)
    y = reshard(x, plan, dst_sharding)
    assert y.sharding == dst_sharding
    np.testing.assert_array_equal(np.asarray(y), value)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    replication = len(dst_devs) // dst_spec.num_shards(dst_shape)
    if local_all_gather and not plan.all_gathers and replication > 1:
        return  # a tile too small to split over its replicas: sent to each (checked below without rewrite)
    expected = value.nbytes if local_all_gather else value.nbytes * replication
    assert plan.cross_mesh_bytes == expected


def test_local_all_gather_sends_each_tile_once():
    # S0 on 4 devices -> replicated on 4 devices: without the rewrite every byte crosses 4 times.
    shape = (8, 8)
    src = MeshLayout(device_ids=((0, 1, 2, 3),), spec=ShardingSpec.from_str("S1R"))
    dst = MeshLayout(device_ids=((4, 5, 6, 7),), spec=ShardingSpec.from_str("RR"))
    naive = plan_resharding(shape, 4, src, dst, local_all_gather=False)
    rewritten = plan_resharding(shape, 4, src, dst)
    assert naive.cross_mesh_bytes == 4 * 8 * 8 * 4
    assert rewritten.cross_mesh_bytes == 8 * 8 * 4
    assert len(rewritten.all_gathers) == 1 and rewritten.all_gathers[0].devices == (4, 5, 6, 7)
    assert rewritten.estimated_seconds(1e9, 1e-6) < naive.estimated_seconds(1e9, 1e-6)


def test_all_gather_slices_line_up_with_the_source_tiles():
    # S0 over 4 devices -> replicated: cutting the tile along dim 0 (not its largest dim 1) lets each
    # destination device receive one whole source tile: 4 transfers instead of 16 pieces.
    shape = (4, 16, 8)
    src = MeshLayout(device_ids=((0, 1, 2, 3),), spec=ShardingSpec.from_str("S1RR"))
    plan = plan_resharding(shape, 4, src, MeshLayout(device_ids=((4, 5, 6, 7),), spec=ShardingSpec.from_str("RRR")))
    src_tiles = src.tiles(shape)
    assert len(plan.transfers) == 4
    assert all(t.box == src_tiles[t.src] for t in plan.transfers)
    assert plan.cross_mesh_bytes == 4 * 16 * 8 * 4


def test_senders_are_spread_over_source_replicas():
    src = MeshLayout(device_ids=((0, 1), (2, 3)), spec=ShardingSpec.from_str("S0R"))
    dst = MeshLayout(device_ids=((4, 5), (6, 7)), spec=ShardingSpec.from_str("S01R"))
    plan = plan_resharding((8, 4), 4, src, dst)
    senders = [t.src for t in plan.transfers]
    assert len(set(senders)) == 4, senders


def test_serial_seconds_sums_every_copy():
    # Sharded 4 ways -> sharded 4 ways on another mesh: 4 transfers of 8x2 floats, no all-gather.
    shape = (8, 8)
    src = MeshLayout(device_ids=((0, 1, 2, 3),), spec=ShardingSpec.from_str("S1R"))
    plan = plan_resharding(shape, 4, src, MeshLayout(device_ids=((4, 5, 6, 7),), spec=ShardingSpec.from_str("S1R")))
    assert plan.serial_seconds(1e3, 0.5) == pytest.approx(4 * (0.5 + 64 / 1e3))
    assert plan.estimated_seconds(1e3, 0.5) == pytest.approx(0.5 + 64 / 1e3)  # overlapped: one receiver's
    # -> replicated with the all-gather rewrite: 4 transfers of 64 B, then each of 4 devices copies 3 slices.
    gathered = plan_resharding(shape, 4, src, MeshLayout(device_ids=((4, 5, 6, 7),), spec=ShardingSpec.from_str("RR")))
    assert gathered.serial_seconds(1e3, 0.5) == pytest.approx((4 + 4 * 3) * (0.5 + 64 / 1e3))
