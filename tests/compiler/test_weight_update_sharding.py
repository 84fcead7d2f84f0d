"""The post-ILP weight-update sharding's latency rule (the rewrite itself is tested through ShardParallel in
tests/alpa_like/test_shard_parallel.py)."""
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.weight_update_sharding import latency_bound

MESH = LogicalMesh(shape=(2, 4), alpha=(1e-5, 1e-5), beta=(1e-9, 1e-9))


def test_a_parameter_is_latency_bound_when_its_all_gather_moves_less_than_alpha_worth_of_bytes():
    # All-gather over 4 devices moves 3/4 of the bytes: the wire time equals alpha at 4/3 * alpha / beta bytes.
    threshold = 4 / 3 * 1e-5 / 1e-9
    assert latency_bound(0.9 * threshold, (1,), MESH)
    assert not latency_bound(1.1 * threshold, (1,), MESH)
    # Over both axes (8 devices) 7/8 of the bytes move.
    both = 8 / 7 * 1e-5 / 1e-9
    assert latency_bound(0.9 * both, (0, 1), MESH) and not latency_bound(1.1 * both, (0, 1), MESH)
    free = LogicalMesh(shape=(2, 4), alpha=(0.0, 0.0), beta=(1e-9, 1e-9))
    assert not latency_bound(4.0, (1,), free)
