"""ShardingSpec notation (Table 3.1), PartitionSpec conversion and resharding costs (Table 3.2)."""
import dataclasses
import doctest
import itertools
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from alpa_like.compiler import sharding_spec as sharding_spec_module
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.sharding_spec import (ReshardStep, ShardingSpec, describe_resharding, enumerate_specs,
                                              resharding_cost)

S = ShardingSpec.from_str


# ------------------------------------------------------------------ notation

@pytest.mark.parametrize("text, axes", [
    ("RR", ((), ())), ("S0R", ((0,), ())), ("RS1", ((), (1,))), ("S1S0", ((1,), (0,))),
    ("RS01", ((), (0, 1))), ("S10R", ((1, 0), ())), ("R", ((),)), ("", ()), ("RS0RS1", ((), (0,), (), (1,))),
])
def test_str_and_from_str(text, axes):
    spec = ShardingSpec(axes=axes)
    assert str(spec) == text
    assert S(text) == spec
    assert eval(repr(spec)) == spec  # noqa: S307 - the repr parses back


@pytest.mark.parametrize("paper, compact", [("S^0R", "S0R"), ("S^{01}R", "S01R"), ("R S^1", "RS1"),
                                            ("RS^0S^1", "RS0S1")])
def test_from_str_accepts_the_papers_notation(paper, compact):
    assert S(paper) == S(compact)


@pytest.mark.parametrize("text, match", [
    ("S", "cannot parse sharding spec 'S' at 'S'"),
    ("RX", "cannot parse sharding spec 'RX' at 'X'"),
    ("S00", "mesh axis 0 shards more than one dim"),
    ("S0S0", "mesh axis 0 shards more than one dim"),
    ("S2R", r"axes\[0\] must be a tuple of mesh axes from \(0, 1\)"),
])
def test_from_str_errors(text, match):
    with pytest.raises(ValueError, match=match):
        S(text)


def test_from_str_checks_ndim():
    assert S("S0R", ndim=2).ndim == 2
    assert S("", ndim=0).ndim == 0
    with pytest.raises(ValueError, match=r"sharding spec 'S0R' has 2 dims, expected ndim=3"):
        S("S0R", ndim=3)


def test_constructor_normalises_and_validates():
    assert ShardingSpec(axes=[[0], []]) == S("S0R")
    assert ShardingSpec(axes=((np.int64(1),),)) == S("S1")
    with pytest.raises(ValueError, match="axes must be a sequence"):
        ShardingSpec(axes="S0R")
    with pytest.raises(dataclasses.FrozenInstanceError):
        S("RR").axes = ()  # type: ignore[misc]


def test_replicated():
    assert ShardingSpec.replicated(3) == S("RRR")
    assert ShardingSpec.replicated(0) == S("")
    with pytest.raises(ValueError, match="ndim"):
        ShardingSpec.replicated(-1)


# ------------------------------------------------------------------ shapes and validity

def test_is_valid():
    assert S("S0S1").is_valid((2, 4)) and S("S01R").is_valid((2, 4))
    assert S("S0R").is_valid((8,))
    assert not S("RS1").is_valid((8,))
    assert S("S0S1").is_valid(LogicalMesh(shape=(2, 2), alpha=(0, 0), beta=(0, 0)))


def test_shards_and_shard_shape():
    assert S("S0S1").dim_shards((2, 4)) == (2, 4)
    assert S("RS10").dim_shards((2, 4)) == (1, 8)
    assert S("S01R").num_shards((2, 4)) == 8
    assert S("S0R").num_shards((2, 4)) == 2  # the other factor 4 is replication
    assert S("S0S1").shard_shape((8, 12), (2, 4)) == (4, 3)
    assert S("").shard_shape((), (2, 4)) == ()
    with pytest.raises(ValueError, match=r"dim 1 of size 6 is not divisible by its 4 shards \(S0S1 on mesh"):
        S("S0S1").shard_shape((8, 6), (2, 4))
    with pytest.raises(ValueError, match=r"shape \(8,\) has 1 dims but the sharding spec has 2"):
        S("S0S1").shard_shape((8,), (2, 4))
    with pytest.raises(ValueError, match=r"uses a mesh axis that mesh_shape \(8,\) does not have"):
        S("S1R").num_shards((8,))
    with pytest.raises(ValueError, match="mesh_shape must be 1 or 2 ints"):
        S("S0R").num_shards((2, 2, 2))


TABLE_3_1 = {  # spec: (dim-0 slice, dim-1 slice) on devices 0..3 of [[0, 1], [2, 3]], N = M = 4
    "RR": [((0, 4), (0, 4))] * 4,
    "S0S1": [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 2)), ((2, 4), (2, 4))],
    "S1S0": [((0, 2), (0, 2)), ((2, 4), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (2, 4))],
    "S0R": [((0, 2), (0, 4)), ((0, 2), (0, 4)), ((2, 4), (0, 4)), ((2, 4), (0, 4))],
    "S1R": [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((0, 2), (0, 4)), ((2, 4), (0, 4))],
    "RS0": [((0, 4), (0, 2)), ((0, 4), (0, 2)), ((0, 4), (2, 4)), ((0, 4), (2, 4))],
    "RS1": [((0, 4), (0, 2)), ((0, 4), (2, 4)), ((0, 4), (0, 2)), ((0, 4), (2, 4))],
    "S01R": [((0, 1), (0, 4)), ((1, 2), (0, 4)), ((2, 3), (0, 4)), ((3, 4), (0, 4))],
    "RS01": [((0, 4), (0, 1)), ((0, 4), (1, 2)), ((0, 4), (2, 3)), ((0, 4), (3, 4))],
}


def _tile(spec, shape, mesh_shape, coord):
    """[start, stop) per dim held by the device at ``coord`` (Table 3.1's layout, written independently)."""
    box = []
    for size, dim_axes in zip(shape, spec.axes, strict=True):
        block, pieces = 0, 1
        for a in dim_axes:
            block, pieces = block * mesh_shape[a] + coord[a], pieces * mesh_shape[a]
        box.append((block * size // pieces, (block + 1) * size // pieces))
    return tuple(box)


def _jax_tiles(spec, shape, mesh_shape):
    """The tiles JAX assigns to the devices of a row-major mesh under ``spec.to_partition_spec``."""
    names = ("x", "y")[:len(mesh_shape)]
    devices = np.array(jax.devices()[:math.prod(mesh_shape)]).reshape(mesh_shape)
    sharding = NamedSharding(Mesh(devices, names), spec.to_partition_spec(names))
    index_map = sharding.devices_indices_map(shape)
    return [tuple((s.start or 0, size if s.stop is None else s.stop) for s, size in zip(index_map[d], shape))
            for d in devices.flat]


@pytest.mark.parametrize("text", sorted(TABLE_3_1))
def test_table_3_1_layouts(text):
    coords = list(itertools.product(range(2), range(2)))
    assert [_tile(S(text), (4, 4), (2, 2), c) for c in coords] == TABLE_3_1[text]
    assert _jax_tiles(S(text), (4, 4), (2, 2)) == TABLE_3_1[text]


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (8,)])
def test_layout_agrees_with_jax(mesh_shape):
    shape = (8, 16, 8)
    specs = [ShardingSpec(axes=a) for a in _all_axes(len(shape), len(mesh_shape))]
    coords = list(itertools.product(*map(range, mesh_shape)))
    for spec in specs:
        assert _jax_tiles(spec, shape, mesh_shape) == [_tile(spec, shape, mesh_shape, c) for c in coords], spec


# ------------------------------------------------------------------ PartitionSpec

@pytest.mark.parametrize("text, pspec", [
    ("S0R", P("x", None)), ("RS1", P(None, "y")), ("S01", P(("x", "y"),)), ("S10R", P(("y", "x"), None)),
    ("S1S0", P("y", "x")), ("RR", P(None, None)), ("", P()),
])
def test_partition_spec(text, pspec):
    assert S(text).to_partition_spec(("x", "y")) == pspec
    assert ShardingSpec.from_partition_spec(pspec, ("x", "y"), S(text).ndim) == S(text)


def test_from_partition_spec_pads_and_validates():
    assert ShardingSpec.from_partition_spec(P("y"), ("x", "y"), 3) == S("S1RR")
    assert ShardingSpec.from_partition_spec(P((), "x"), ("x", "y"), 2) == S("RS0")
    with pytest.raises(ValueError, match=r"pspec entry 'z' is not None, an axis name or a tuple"):
        ShardingSpec.from_partition_spec(P("z"), ("x", "y"), 1)
    with pytest.raises(ValueError, match="more than ndim=1"):
        ShardingSpec.from_partition_spec(P("x", None), ("x", "y"), 1)
    with pytest.raises(ValueError, match="pspec entry"):
        ShardingSpec.from_partition_spec(P(P.UNCONSTRAINED), ("x", "y"), 1)


def test_to_partition_spec_validates_names():
    with pytest.raises(ValueError, match=r"axis_names \('x',\) do not name every mesh axis used by RS1"):
        S("RS1").to_partition_spec(("x",))
    with pytest.raises(ValueError, match="axis_names must be distinct strings"):
        S("S0").to_partition_spec(("x", "x"))


# ------------------------------------------------------------------ enumeration

def test_enumerate_gives_table_3_1():
    assert {str(s) for s in enumerate_specs((4, 4), (2, 2))} == set(TABLE_3_1)
    assert len(enumerate_specs((4, 4), (2, 2))) == 9
    assert enumerate_specs((4, 4), (2, 2))[0] == S("RR")


def test_enumerate_skips_size_one_axes_and_uneven_dims():
    assert [str(s) for s in enumerate_specs((8, 3), (1, 4))] == ["RR", "S1R"]
    assert [str(s) for s in enumerate_specs((6, 16), (8,))] == ["RR", "RS0"]
    assert [str(s) for s in enumerate_specs((), (2, 4))] == [""]
    assert [str(s) for s in enumerate_specs((16,), (2, 4))] == ["R", "S1", "S0", "S01"]
    assert enumerate_specs((4, 4), (1, 1)) == (S("RR"),)


# ------------------------------------------------------------------ resharding: Table 3.2

def _mesh(n0, n1):
    return LogicalMesh(shape=(n0, n1), alpha=(4e-5, 3e-6), beta=(2e-9, 5e-11))


SHAPE, ITEMSIZE = (16, 32), 4
M = 16 * 32 * 4


def _ag(mesh, x, axis):  # Table 3.2's all-gather(x, axis): x is the gathered bytes
    n = mesh.shape[axis]
    return mesh.alpha[axis] + (n - 1) / n * x * mesh.beta[axis]


def _a2a(mesh, x, axis):  # Table 3.2's all-to-all(x, axis): x is the bytes on each device
    n = mesh.shape[axis]
    return mesh.alpha[axis] + (n - 1) / n * x * mesh.beta[axis]


TABLE_3_2 = [  # (row, src, dst, closed-form cost on mesh (n0, n1))
    (1, "RR", "S0S1", lambda m, n0, n1: 0.0),
    (2, "S0R", "RR", lambda m, n0, n1: _ag(m, M, 0)),
    (3, "S0S1", "S0R", lambda m, n0, n1: _ag(m, M / n0, 1)),
    (4, "S0R", "RS0", lambda m, n0, n1: _a2a(m, M / n0, 0)),
    (5, "S0S1", "S01R", lambda m, n0, n1: _a2a(m, M / (n0 * n1), 1)),
]


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4)])
@pytest.mark.parametrize("row, src, dst, expected", TABLE_3_2, ids=[f"row{r[0]}" for r in TABLE_3_2])
def test_table_3_2(row, src, dst, expected, mesh_shape):
    mesh = _mesh(*mesh_shape)
    assert resharding_cost(S(src), S(dst), SHAPE, ITEMSIZE, mesh) == pytest.approx(expected(mesh, *mesh_shape))
    del row


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4)])
def test_table_3_2_plans(mesh_shape):
    n0, n1 = mesh_shape
    mesh = _mesh(n0, n1)

    def plan(src, dst):
        return [(s.kind, s.axis, s.num_bytes) for s in describe_resharding(S(src), S(dst), SHAPE, ITEMSIZE, mesh)]

    assert plan("RR", "S0S1") == [("slice", 0, M), ("slice", 1, M / n0)]
    assert plan("S0R", "RR") == [("all-gather", 0, M)]
    assert plan("S0S1", "S0R") == [("all-gather", 1, M / n0)]
    assert plan("S0R", "RS0") == [("all-to-all", 0, M)]            # M / n0 on each device
    assert plan("S0S1", "S01R") == [("all-to-all", 1, M / n0)]     # M / (n0 n1) on each device
    assert plan("S0R", "S0R") == []


def test_general_cases():
    n0, n1 = 2, 4
    mesh = _mesh(n0, n1)

    def cost(src, dst):
        return resharding_cost(S(src), S(dst), SHAPE, ITEMSIZE, mesh)

    # Un-shard both axes of one dim, innermost first.
    assert cost("S01R", "RR") == pytest.approx(_ag(mesh, M / n0, 1) + _ag(mesh, M, 0))
    # Slice first (free), then gather: the gather moves the smaller tile.
    assert cost("S0R", "RS1") == pytest.approx(_ag(mesh, M / n1, 0))
    # Swap the axes of two dims: one axis must be gathered, then the other moves.
    swap = min(_ag(mesh, M / n1, 0) + _a2a(mesh, M / n1, 1), _ag(mesh, M / n0, 1) + _a2a(mesh, M / n0, 0))
    assert cost("S0S1", "S1S0") == pytest.approx(swap)
    # Axis order within a dim matters: S01 -> S10 gathers both axes and slices again.
    assert cost("S01R", "S10R") == pytest.approx(_ag(mesh, M / n0, 1) + _ag(mesh, M, 0))
    steps = describe_resharding(S("S01R"), S("S10R"), SHAPE, ITEMSIZE, mesh)
    assert [str(s) for s in steps] == ["all-gather(1024 B, axis 1, dim 0)", "all-gather(2048 B, axis 0, dim 0)",
                                       "slice(2048 B, axis 1, dim 0)", "slice(512 B, axis 0, dim 0)"]


def test_one_dimensional_and_trivial_axes():
    ring = LogicalMesh(shape=(8,), alpha=(1e-5,), beta=(1e-9,))
    assert resharding_cost(S("S0R"), S("RS0"), SHAPE, ITEMSIZE, ring) == pytest.approx(1e-5 + 7 / 64 * M * 1e-9)
    flat = LogicalMesh(shape=(1, 4), alpha=(1.0, 1e-5), beta=(1.0, 1e-9))
    assert resharding_cost(S("RS01"), S("RS1"), SHAPE, ITEMSIZE, flat) == 0.0  # axis 0 splits nothing
    assert describe_resharding(S("S0R"), S("RR"), SHAPE, ITEMSIZE, flat) == ()


def test_resharding_validation():
    mesh = _mesh(2, 4)
    with pytest.raises(ValueError, match=r"src=S1R uses a mesh axis that the mesh of shape \(8,\)"):
        resharding_cost(S("S1R"), S("RR"), SHAPE, ITEMSIZE, LogicalMesh(shape=(8,), alpha=(0,), beta=(0,)))
    with pytest.raises(ValueError, match="different ndim"):
        resharding_cost(S("S0R"), S("S0"), SHAPE, ITEMSIZE, mesh)
    with pytest.raises(ValueError, match=r"shape \(16,\) has 1 dims but the sharding spec has 2"):
        resharding_cost(S("S0R"), S("RR"), (16,), ITEMSIZE, mesh)
    with pytest.raises(ValueError, match="itemsize"):
        resharding_cost(S("S0R"), S("RR"), SHAPE, 0, mesh)
    with pytest.raises(ValueError, match="mesh must be a LogicalMesh"):
        resharding_cost(S("S0R"), S("RR"), SHAPE, ITEMSIZE, (2, 4))
    with pytest.raises(ValueError, match="dst must be a ShardingSpec"):
        resharding_cost(S("S0R"), "RR", SHAPE, ITEMSIZE, mesh)


# ------------------------------------------------------------------ properties

def _all_axes(ndim, mesh_ndim):
    """Every spec of an ``ndim`` tensor on a ``mesh_ndim`` mesh, both axis orders included."""
    out = set()
    for dims in itertools.product([None, *range(ndim)], repeat=mesh_ndim):
        for order in itertools.permutations(range(mesh_ndim)):
            axes = [[] for _ in range(ndim)]
            for a in order:
                if dims[a] is not None:
                    axes[dims[a]].append(a)
            out.add(tuple(map(tuple, axes)))
    return sorted(out)


@st.composite
def spec_and_mesh(draw, max_ndim=3):
    """A mesh shape, a tensor shape divisible by every spec on it, and two specs."""
    mesh_shape = draw(st.sampled_from([(2, 2), (2, 4), (4, 2), (1, 4), (3, 2), (8,), (1,)]))
    ndim = draw(st.integers(0, max_ndim))
    specs = [ShardingSpec(axes=a) for a in _all_axes(ndim, len(mesh_shape))]
    shape = tuple(draw(st.integers(1, 3)) * math.prod(mesh_shape) for _ in range(ndim))
    return mesh_shape, shape, draw(st.sampled_from(specs)), draw(st.sampled_from(specs))


@st.composite
def logical_mesh(draw, mesh_shape):
    costs = st.tuples(*[st.floats(0, 1e-3)] * len(mesh_shape))
    return LogicalMesh(shape=mesh_shape, alpha=draw(costs),
                       beta=draw(st.tuples(*[st.floats(1e-12, 1e-6)] * len(mesh_shape))))


@given(spec_and_mesh(max_ndim=5))
def test_str_round_trip(case):
    _, _, spec, _ = case
    assert S(str(spec), ndim=spec.ndim) == spec
    assert eval(repr(spec)) == spec  # noqa: S307


@given(spec_and_mesh(max_ndim=5))
def test_partition_spec_round_trip(case):
    _, _, spec, _ = case
    names = ("data", "model")
    assert ShardingSpec.from_partition_spec(spec.to_partition_spec(names), names, spec.ndim) == spec


@given(spec_and_mesh())
def test_shard_shape_times_shards_is_shape(case):
    mesh_shape, shape, spec, _ = case
    tile = spec.shard_shape(shape, mesh_shape)
    assert tuple(t * n for t, n in zip(tile, spec.dim_shards(mesh_shape), strict=True)) == shape
    assert spec.num_shards(mesh_shape) == math.prod(spec.dim_shards(mesh_shape))
    assert spec in enumerate_specs(shape, mesh_shape) or any(len(a) == 2 and a[0] > a[1] for a in spec.axes) \
        or any(mesh_shape[a] == 1 for dim_axes in spec.axes for a in dim_axes)


@settings(max_examples=200)
@given(st.data())
def test_resharding_cost_properties(data):
    mesh_shape, shape, src, dst = data.draw(spec_and_mesh())
    mesh = data.draw(logical_mesh(mesh_shape))
    itemsize = data.draw(st.sampled_from([1, 2, 4]))
    cost = resharding_cost(src, dst, shape, itemsize, mesh)
    assert cost >= 0.0
    assert resharding_cost(src, src, shape, itemsize, mesh) == 0.0
    assert resharding_cost(ShardingSpec.replicated(src.ndim), dst, shape, itemsize, mesh) == 0.0
    steps = describe_resharding(src, dst, shape, itemsize, mesh)
    assert cost == pytest.approx(sum(s.cost(mesh) for s in steps))
    assert cost <= _gather_then_slice_cost(src, dst, shape, itemsize, mesh) * (1 + 1e-9)


def _gather_then_slice_cost(src, dst, shape, itemsize, mesh):
    """The naive fallback: all-gather every axis of ``src`` (innermost first, all dims), then slice."""
    per_device, cost = math.prod(shape) * itemsize / src.num_shards(mesh.shape), 0.0
    for dim_axes in src.axes:
        for a in reversed(dim_axes):
            per_device *= mesh.shape[a]
            cost += mesh.all_gather_cost(per_device, a)
    return cost


@settings(max_examples=200)
@given(st.data())
def test_every_step_is_a_legal_collective(data):
    """Replays the plan on index boxes: each step's layout change is what its collective can produce."""
    mesh_shape, shape, src, dst = data.draw(spec_and_mesh())
    mesh = data.draw(logical_mesh(mesh_shape))
    coords = list(itertools.product(*map(range, mesh_shape)))
    cur = ShardingSpec(axes=tuple(tuple(a for a in d if mesh_shape[a] > 1) for d in src.axes))
    tile_bytes = math.prod(shape) * 4 / cur.num_shards(mesh_shape)
    for step in describe_resharding(src, dst, shape, 4, mesh):
        new = _apply(cur, step)
        for c in coords:
            old_box, new_box = _tile(cur, shape, mesh_shape, c), _tile(new, shape, mesh_shape, c)
            group = [_tile(cur, shape, mesh_shape, c[:step.axis] + (i,) + c[step.axis + 1:])
                     for i in range(mesh_shape[step.axis])]
            if step.kind == "slice":
                assert _contains(old_box, new_box)
            elif step.kind == "all-gather":
                assert new_box == _union(group) and sum(_size(b) for b in group) == _size(new_box)
            else:
                assert _contains(_union(group), new_box) and _size(new_box) == _size(old_box)
        expected = tile_bytes if step.kind == "slice" else tile_bytes * mesh_shape[step.axis]
        assert step.num_bytes == pytest.approx(expected)
        cur, tile_bytes = new, math.prod(shape) * 4 / new.num_shards(mesh_shape)
    assert [_tile(cur, shape, mesh_shape, c) for c in coords] == [_tile(dst, shape, mesh_shape, c) for c in coords]


def _apply(spec, step: ReshardStep):
    axes = [list(a) for a in spec.axes]
    if step.from_dim is not None:
        assert axes[step.from_dim][-1] == step.axis, "a step may only remove the last axis of a dim"
        axes[step.from_dim].pop()
    if step.to_dim is not None:
        axes[step.to_dim].append(step.axis)
    return ShardingSpec(axes=tuple(map(tuple, axes)))


def _contains(outer, inner):
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def _union(boxes):
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def _size(box):
    return math.prod(hi - lo for lo, hi in box)


def test_doctests():
    assert doctest.testmod(sharding_spec_module).failed == 0
