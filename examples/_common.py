"""Shared bits of the examples: 8 virtual CPU devices when no accelerator is present."""
import os


def use_cpu_devices(count: int = 8) -> None:
    """Call before importing jax: gives this process ``count`` virtual CPU devices."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def write_results(path: str, rows: list) -> None:
    """Writes a benchmark's rows, with the command that made them, as JSON at ``path``."""
    import json
    import sys
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(f"wrote {out}")


def seconds_per_step(step, state, batch, steps: int):
    """Seconds per call of ``steps`` calls of ``step(state, batch) -> (state, loss)``, each fed the last
    call's state (as in training), and that state."""
    import time

    import jax

    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, loss = step(state, batch)
    jax.block_until_ready((state, loss))
    return (time.perf_counter() - start) / steps, state
