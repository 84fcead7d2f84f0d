"""Cross-mesh resharding on the Ray backend between meshes on two nodes and on one node, beside raw
``ray.put`` / ``ray.get`` of the same bytes between the same nodes.

The script starts a local cluster of two Ray nodes (:class:`~alpa_like.runtime.ray_local_cluster.LocalCluster`:
each node its own raylet and object store, talking over loopback) and the Ray backend on it. For each pair of
nodes (0 -> 1: across nodes; 0 -> 0: within node 0):

* resharding: two of the backend's worker actors (one per mesh, a (2, 1) mesh of 2 virtual CPU devices each)
  run a program per step: mesh 0 ``LOAD`` s ``--buffers`` float32 arrays held in its store, sending each to
  mesh 1 cut into its resharding plan's pieces (the argument of one actor call: inlined in the call when
  small, else one object in the object store; the buffers queued while a call is being made share the
  next), and mesh 1 ``RECV`` s each and assembles it on its devices: the code path of every pipeline
  ``RECV``. One buffer per step is a transfer's latency; several are a pipeline step's stream of
  activations, one per micro-batch;
* raw: two plain actors on the same nodes: one ``ray.put`` s ``--buffers`` arrays of the same bytes (one
  object each) in one call, the other ``ray.get`` s them all in one call.

Each step is timed on the driver from its calls to both actors until both have answered; the two kinds
take turns step by step (so the shared machine's load hits both alike), each step starting
:data:`SETTLE_SECONDS` after the previous one answered (Ray frees a step's objects and references after its
calls answered: without the pause that work lands in the next step's time, the other kind's), and the
table shows the median of ``--repeats`` steps of each kind per size and the throughput (bytes moved /
time). Sizes are MiB per buffer, fractions allowed (``--sizes 0.03125`` is 32 KiB: the fixed cost of a
transfer).

    python examples/benchmarks/ray_transfer.py --buffers 1 8 --out results/ray_transfer.json
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

MESHES = (MeshInfo(logical_shape=(2, 1), device_ids=((0,), (1,))),
          MeshInfo(logical_shape=(2, 1), device_ids=((2,), (3,))))
COLUMNS = 1024
SETTLE_SECONDS = 0.01
"""The pause before each timed transfer (module docstring)."""


def program(mesh: int, instructions, *, sends=None, outputs=()) -> WorkerProgram:
    return WorkerProgram(mesh=mesh, meshes=MESHES, instructions=tuple(instructions), pieces={}, sends=sends or {},
                         input_specs={}, constants={}, num_micro_batches=1, outputs=outputs)


class Resharding:
    """Mesh 0 -> mesh 1 transfers of ``buffers`` copies of one array per step on two worker actors of the Ray
    backend (see the module docstring)."""

    def __init__(self, backend, workers, array: np.ndarray, buffers: int):
        import ray
        self.backend, self.workers = backend, workers
        keys = [(v, PER_STEP) for v in range(buffers)]
        self.keep, self.move = backend.new_executable_id(), backend.new_executable_id()
        loads = [Instruction(Op.LOAD, 0, key) for key in keys]
        outputs = tuple((0, key) for key in keys)
        programs = {self.keep: [program(0, loads, outputs=outputs), program(1, [])],
                    self.move: [program(0, loads, sends={key: (1,) for key in keys}),
                                program(1, [Instruction(Op.RECV, 1, key, src_mesh=0) for key in keys],
                                        outputs=outputs)]}
        ray.get([w.load_program.remote(exe, p, workers) for exe, ps in programs.items()
                 for w, p in zip(workers, ps, strict=True)])
        self.held = [backend.new_handle() for _ in keys]
        stored = {v: ("ref", [ray.put(array)]) for v in range(buffers)}
        ray.get([workers[0].run_step.remote(self.keep, 0, stored, self.held, [], []),
                 workers[1].run_step.remote(self.keep, 0, {}, [], [], [])])
        self.step, self.received = 0, []

    def __call__(self) -> None:
        import ray
        self.step += 1
        frees, self.received = self.received, [self.backend.new_handle() for _ in self.held]
        inputs = {v: ("handle", h) for v, h in enumerate(self.held)}
        ray.get([self.workers[0].run_step.remote(self.move, self.step, inputs, [], [], []),
                 self.workers[1].run_step.remote(self.move, self.step, {}, self.received, [], frees)])

    def fetch(self) -> list[np.ndarray]:
        import ray
        return ray.get([self.workers[1].fetch.remote(h) for h in self.received])


class Probe:
    """A plain actor: ``put`` stores its arrays in the object store (one object each), ``get`` reads them."""

    def __init__(self, nbytes: int, buffers: int):
        self.arrays = [np.ones(nbytes // 4, np.float32) for _ in range(buffers)]

    def put(self) -> list:
        import ray
        return [ray.put(a) for a in self.arrays]

    def get(self, refs: list) -> int:
        import ray
        return sum(a.nbytes for a in ray.get(refs))


def probes(backend, src: int, dst: int, nbytes: int, buffers: int):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    make = [ray.remote(Probe).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        backend.nodes[node].node_id, soft=False)).remote(nbytes, buffers) for node in (src, dst)]
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


def measure(backend, src: int, dst: int, mib: float, buffers: int, repeats: int) -> dict:
    import ray
    array = np.arange(int(mib * 2**20) // 4, dtype=np.float32).reshape(-1, COLUMNS)
    workers = backend.acquire([(src, 2), (dst, 2)])
    move = Resharding(backend, workers, array, buffers)
    sender, receiver = probes(backend, src, dst, array.nbytes, buffers)
    reshard_s, raw_s = alternate([move, lambda: ray.get(receiver.get.remote(sender.put.remote()))], repeats)
    for received in move.fetch():
        np.testing.assert_array_equal(received, array)
    for actor in (sender, receiver):
        ray.kill(actor)
    nbytes = array.nbytes * buffers
    return {"nodes": f"{src} -> {dst}", "across_nodes": src != dst, "mib": mib, "buffers": buffers,
            "resharding_ms": reshard_s * 1e3, "raw_ms": raw_s * 1e3, "resharding_gb_s": nbytes / reshard_s / 1e9,
            "raw_gb_s": nbytes / raw_s / 1e9, "ratio": raw_s / reshard_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64], help="MiB per buffer")
    parser.add_argument("--buffers", type=int, nargs="+", default=[1], help="buffers moved per step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="results/ray_transfer.json")
    args = parser.parse_args()
    rows = []
    with LocalCluster(num_nodes=2, num_cpus_per_node=2, object_store_memory=1024 * 2**20) as cluster:
        al.init(cluster="ray", address=cluster.address)
        backend = api._backend.ray
        for src, dst in ((0, 1), (0, 0)):
            for buffers in args.buffers:
                for mib in args.sizes:
                    rows.append(measure(backend, src, dst, mib, buffers, args.repeats))
        al.shutdown()
    print(f"median of {args.repeats} steps; ratio = resharding throughput / raw put+get throughput")
    print(f"{'nodes':7} {'buffers':>7} {'MiB':>7} {'resharding ms':>14} {'raw ms':>9} {'resharding GB/s':>16} "
          f"{'raw GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['nodes']:7} {r['buffers']:7d} {r['mib']:7g} {r['resharding_ms']:14.1f} {r['raw_ms']:9.1f} "
              f"{r['resharding_gb_s']:16.2f} {r['raw_gb_s']:9.2f} {r['ratio']:6.2f}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
