"""runtime.spmd.place_args: arguments already on their sharding are passed through, the rest moved."""
import jax
import numpy as np

from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.runtime.mesh import make_mesh, named_sharding
from alpa_like.runtime.spmd import place_args


def test_place_args_keeps_placed_leaves_and_moves_the_others():
    mesh = make_mesh(jax.devices(), (8,), ("d",))
    split = named_sharding(mesh, ShardingSpec(axes=((0,), ())))
    whole = named_sharding(mesh, ShardingSpec.replicated(1))
    placed = jax.device_put(np.arange(16.0).reshape(8, 2), split)
    elsewhere = jax.device_put(np.arange(4.0), jax.devices()[3])
    host = np.ones((8, 2), np.float32)
    out = place_args([placed, elsewhere, host], [split, whole, split])
    assert out[0] is placed  # nothing to move: the same array object
    assert out[1].sharding == whole and out[2].sharding == split
    np.testing.assert_array_equal(np.asarray(out[1]), np.arange(4.0))
    np.testing.assert_array_equal(np.asarray(out[2]), host)


def test_place_args_with_nothing_to_move_returns_the_same_leaves():
    mesh = make_mesh(jax.devices(), (2, 4), ("x", "y"))
    s = named_sharding(mesh, ShardingSpec(axes=((1,),)))
    leaves = [jax.device_put(np.arange(8.0), s) for _ in range(3)]
    assert all(a is b for a, b in zip(place_args(leaves, [s] * 3), leaves, strict=True))
