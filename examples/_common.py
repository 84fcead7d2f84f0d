"""Shared bits of the examples: 8 virtual CPU devices when no accelerator is present."""
import os


def use_cpu_devices(count: int = 8) -> None:
    """Call before importing jax: gives this process ``count`` virtual CPU devices."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
