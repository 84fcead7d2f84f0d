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
