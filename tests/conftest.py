"""Every test sees 8 virtual CPU devices: the flag must be set before jax is imported."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the flag on purpose)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert len(jax.devices()) == 8, "tests need 8 virtual CPU devices (XLA_FLAGS)"


@pytest.fixture(scope="session")
def ray_session():
    """One small local Ray for the whole test session (tests marked ``ray`` use it)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
