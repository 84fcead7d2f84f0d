"""Cross-mesh resharding on the Ray backend between meshes on two nodes and on one node, beside raw
``ray.put`` / ``ray.get`` of the same bytes between the same nodes.

The script starts a local cluster of two Ray nodes (:class:`~alpa_like.runtime.ray_local_cluster.LocalCluster`:
each node its own raylet and object store, talking over loopback) and the Ray backend on it. For each pair of
nodes (0 -> 1: across nodes; 0 -> 0: within node 0):

* resharding: two of the backend's worker actors (one per mesh, a (2, 1) mesh of 2 virtual CPU devices each)
  run a one-instruction program per step: mesh 0 ``LOAD`` s a float32 array held in its store, which sends it
  to mesh 1 cut into its resharding plan's pieces (the argument of one actor call: inlined in the call when
  small, else one object in the object store), and mesh 1 ``RECV`` s it and assembles it on its devices: the
  code path of every pipeline ``RECV``;
* raw: two plain actors on the same nodes: one ``ray.put`` s an array of the same bytes, the other
  ``ray.get`` s it.

Each transfer is timed on the driver from its calls to both actors until both have answered; the two kinds
take turns transfer by transfer (so the shared machine's load hits both alike), each transfer starting
:data:`SETTLE_SECONDS` after the previous one answered (Ray frees a transfer's objects and references after
its calls answered: without the pause that work lands in the next transfer's time, the other kind's), and
the table shows the median of ``--repeats`` transfers of each kind per size and the throughput (bytes /
time). Sizes are MiB, fractions allowed (``--sizes 0.03125`` is 32 KiB: the fixed cost of a transfer).

    python examples/benchmarks/ray_transfer.py --out results/ray_transfer.json
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import write_results  # noqa: E402

import numpy as np  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like import api  # noqa: E402
from alpa_like.runtime.instructions import PER_STEP, Instruction, Op  # noqa: E402
from alpa_like.runtime.ray_local_cluster import LocalCluster  # noqa: E402
from alpa_like.runtime.ray_worker import MeshInfo, WorkerProgram  # noqa: E402

KEY = (0, PER_STEP)
"""The one buffer moved: step input 0."""
MESHES = (MeshInfo(logical_shape=(2, 1), device_ids=((0,), (1,))),
          MeshInfo(logical_shape=(2, 1), device_ids=((2,), (3,))))
COLUMNS = 1024
SETTLE_SECONDS = 0.01
"""The pause before each timed transfer (module docstring)."""


def program(mesh: int, instructions, *, sends=None, outputs=()) -> WorkerProgram:
    return WorkerProgram(mesh=mesh, meshes=MESHES, instructions=tuple(instructions), pieces={}, sends=sends or {},
                         input_specs={}, constants={}, num_micro_batches=1, outputs=outputs)


class Resharding:
    """Mesh 0 -> mesh 1 transfers of one array on two worker actors of the Ray backend (see the module
    docstring)."""

    def __init__(self, backend, workers, array: np.ndarray):
        import ray
        self.backend, self.workers = backend, workers
        self.keep, self.move = backend.new_executable_id(), backend.new_executable_id()
        load = Instruction(Op.LOAD, 0, KEY)
        programs = {self.keep: [program(0, [load], outputs=((0, KEY),)), program(1, [])],
                    self.move: [program(0, [load], sends={KEY: (1,)}),
                                program(1, [Instruction(Op.RECV, 1, KEY, src_mesh=0)], outputs=((0, KEY),))]}
        ray.get([w.load_program.remote(exe, p, workers) for exe, ps in programs.items()
                 for w, p in zip(workers, ps, strict=True)])
        self.held = backend.new_handle()
        ray.get([workers[0].run_step.remote(self.keep, 0, {0: ("ref", [ray.put(array)])}, [self.held], [], []),
                 workers[1].run_step.remote(self.keep, 0, {}, [], [], [])])
        self.step, self.received = 0, None

    def __call__(self) -> None:
        import ray
        self.step += 1
        frees = [] if self.received is None else [self.received]
        self.received = self.backend.new_handle()
        ray.get([self.workers[0].run_step.remote(self.move, self.step, {0: ("handle", self.held)}, [], [], []),
                 self.workers[1].run_step.remote(self.move, self.step, {}, [self.received], [], frees)])

    def fetch(self) -> np.ndarray:
        import ray
        return ray.get(self.workers[1].fetch.remote(self.received))


class Probe:
    """A plain actor: ``put`` stores its array in the object store, ``get`` reads one."""

    def __init__(self, nbytes: int):
        self.array = np.ones(nbytes // 4, np.float32)

    def put(self) -> list:
        import ray
        return [ray.put(self.array)]

    def get(self, refs: list) -> int:
        import ray
        return ray.get(refs[0]).nbytes


def probes(backend, src: int, dst: int, nbytes: int):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    make = [ray.remote(Probe).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        backend.nodes[node].node_id, soft=False)).remote(nbytes) for node in (src, dst)]
    return make[0], make[1]


def alternate(fns, repeats: int, settle: float = SETTLE_SECONDS) -> list[float]:
    """Median seconds of each of ``fns`` over ``repeats`` calls after a warm-up call, the functions taking turns
    call by call, so the shared machine's load hits them alike; each timed call starts ``settle`` seconds after
    the previous one returned."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, kept in zip(fns, times, strict=True):
            time.sleep(settle)
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def measure(backend, src: int, dst: int, mib: float, repeats: int) -> dict:
    import ray
    array = np.arange(int(mib * 2**20) // 4, dtype=np.float32).reshape(-1, COLUMNS)
    workers = backend.acquire([(src, 2), (dst, 2)])
    move = Resharding(backend, workers, array)
    sender, receiver = probes(backend, src, dst, array.nbytes)
    reshard_s, raw_s = alternate([move, lambda: ray.get(receiver.get.remote(sender.put.remote()))], repeats)
    np.testing.assert_array_equal(move.fetch(), array)
    for actor in (sender, receiver):
        ray.kill(actor)
    return {"nodes": f"{src} -> {dst}", "across_nodes": src != dst, "mib": mib, "resharding_ms": reshard_s * 1e3,
            "raw_ms": raw_s * 1e3, "resharding_gb_s": array.nbytes / reshard_s / 1e9,
            "raw_gb_s": array.nbytes / raw_s / 1e9, "ratio": raw_s / reshard_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64], help="MiB per transfer")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="results/ray_transfer.json")
    args = parser.parse_args()
    rows = []
    with LocalCluster(num_nodes=2, num_cpus_per_node=2, object_store_memory=1024 * 2**20) as cluster:
        al.init(cluster="ray", address=cluster.address)
        backend = api._backend.ray
        for src, dst in ((0, 1), (0, 0)):
            for mib in args.sizes:
                rows.append(measure(backend, src, dst, mib, args.repeats))
        al.shutdown()
    print(f"median of {args.repeats} transfers; ratio = resharding throughput / raw put+get throughput")
    print(f"{'nodes':7} {'MiB':>5} {'resharding ms':>14} {'raw ms':>9} {'resharding GB/s':>16} {'raw GB/s':>9} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['nodes']:7} {r['mib']:5g} {r['resharding_ms']:14.1f} {r['raw_ms']:9.1f} "
              f"{r['resharding_gb_s']:16.2f} {r['raw_gb_s']:9.2f} {r['ratio']:6.2f}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
