"""Every test sees 8 virtual CPU devices: the flag must be set before jax is imported."""
import atexit
import os
import shutil
import tempfile

# The tests' programs are tiny and compiled once or twice each, so compiling is most of the suite's time:
# LLVM's optimisation level 0 compiles them faster (about 25% on a pipeline test, 2.4x on the Wide-ResNet
# init's truncated normals) and computes the same IEEE results. Only the tests run this way; the demo and
# the benchmarks compile as users do.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session, cold at the start: tests that build the same pieces
# (one model under several schedules, the single-device references, Flax's op-by-op init) compile them once
# instead of once per test. Keyed by the compiled HLO, so a hit is the same program. Set through the
# environment so that the pytest-xdist workers and the Ray workers the session starts share it; the process
# that made it removes it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="alpa-like-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
# ClusterSpec.local() stores its measurement in the user's cache directory; the tests keep theirs in one
# directory of their own, shared by the xdist workers in the same way, so that every test of a session plans
# with the same measured cluster and nothing is left in the user's cache.
if "ALPA_LIKE_CACHE_DIR" not in os.environ:
    _CLUSTER_CACHE = tempfile.mkdtemp(prefix="alpa-like-tests-cache-")
    atexit.register(shutil.rmtree, _CLUSTER_CACHE, ignore_errors=True)
    os.environ["ALPA_LIKE_CACHE_DIR"] = _CLUSTER_CACHE
# A size limit turns on the cache's file lock: without it a process may read an entry another one is still
# writing (an empty or truncated file, which JAX reports as a warning, an error where a test escalates them).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 * 2**30))
# With the lock, every write lists and reads the whole cache under it (JAX's LRU eviction): a write to a cache
# of 2,000 entries holds the lock for about 0.14 s, so only the compiles that cost more than that are kept.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402  (after the flag on purpose)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """With pytest-xdist workers (`make test`), the tests that use Ray run in one worker (``--dist
    loadgroup``), so the session starts one local Ray cluster, not one per worker."""
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert len(jax.devices()) == 8, "tests need 8 virtual CPU devices (XLA_FLAGS)"


@pytest.fixture(scope="session")
def ray_session():
    """One small local Ray for the whole test session (tests marked ``ray`` use it)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():  # as the backend starts one: loopback only
        from alpa_like.runtime.ray_startup import start_local_ray
        start_local_ray(num_cpus=2, startup_timeout=180)
    yield ray
    ray.shutdown()


@pytest.fixture
def fixed_cluster(monkeypatch):
    """Plans for one p3.16xlarge node instead of ``ClusterSpec.local()``'s measurements of this (shared,
    loaded) machine, so that a test's plan does not move with the load (the ILP's choices depend on the
    measured latency and bandwidth). The Ray backend measures its cluster itself: a Ray test passes
    ``al.parallelize(..., cluster=tests.runtime.test_ray_backend.FIXED_CLUSTER)`` instead."""
    import alpa_like as al
    cluster = al.ClusterSpec.preset("p3.16xlarge")
    monkeypatch.setattr(al.ClusterSpec, "local", classmethod(lambda cls, devices=None: cluster))
    return cluster
