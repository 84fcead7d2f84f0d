"""Cross-mesh resharding on the 8 CPU devices: our plan executed by ``reshard`` beside ``jax.device_put``.

For a GPT activation (micro-batch, sequence, hidden) on a (1, 4) mesh of devices 0-3, moved to a (1, 4) or
(2, 2) mesh of devices 4-7 in several layouts, it prints the plan (copies between meshes, local
all-gathers, bytes) and the median wall time of executing it with ``runtime.resharding.reshard`` and of
XLA's own path, ``jax.device_put`` to the destination sharding (not a plan: the reference for what one host
can do), each checked to give the same array.

    python examples/benchmarks/resharding.py --out results/resharding.json
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import use_cpu_devices, write_results  # noqa: E402

use_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from alpa_like.runtime.mesh import make_mesh  # noqa: E402
from alpa_like.runtime.resharding import layout_of, plan_resharding, reshard  # noqa: E402

CASES = [  # (source spec on (1, 4), destination mesh shape, destination spec)
    (P("y"), (1, 4), P("y")),
    (P("y"), (1, 4), P()),
    (P("y"), (1, 4), P(None, "y")),
    (P(None, "y"), (1, 4), P()),
    (P("y"), (2, 2), P("x", "y")),
    (P("y"), (2, 2), P()),
]


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4,128,128", help="tensor shape, comma separated")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="results/resharding.json")
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split(","))
    devices = jax.devices()
    src_mesh = make_mesh(devices[:4], (1, 4), ("x", "y"))
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    rows = []
    print(f"{'source':18} {'destination':24} {'copies':>6} {'gathers':>7} {'MB':>6} {'reshard ms':>10} "
          f"{'device_put ms':>13} {'ratio':>6}")
    for src_spec, dst_shape, dst_spec in CASES:
        src = NamedSharding(src_mesh, src_spec)
        dst = NamedSharding(make_mesh(devices[4:], dst_shape, ("x", "y")), dst_spec)
        x = jax.device_put(value, src)
        plan = plan_resharding(shape, 4, layout_of(src, len(shape)), layout_of(dst, len(shape)))
        for out in (reshard(x, plan, dst), jax.device_put(x, dst)):
            np.testing.assert_array_equal(np.asarray(out), value)
        ours = median_seconds(lambda: reshard(x, plan, dst), args.repeats)
        xla = median_seconds(lambda: jax.device_put(x, dst), args.repeats)
        row = {"shape": shape, "src": f"(1,4) {src_spec}", "dst": f"{dst_shape} {dst_spec}",
               "copies": len(plan.transfers), "all_gathers": len(plan.all_gathers),
               "cross_mesh_bytes": plan.cross_mesh_bytes, "reshard_s": ours, "device_put_s": xla}
        rows.append(row)
        print(f"{row['src']:18} {row['dst']:24} {row['copies']:>6} {row['all_gathers']:>7} "
              f"{plan.cross_mesh_bytes / 1e6:>6.2f} {ours * 1e3:>10.2f} {xla * 1e3:>13.2f} {ours / xla:>6.1f}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
