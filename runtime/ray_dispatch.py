"""The Ray backend's fixed costs, measured on its workers, for the simulator to price a plan run on Ray
(:class:`~alpa_like.runtime.simulator.DispatchCosts`).

Three tiny programs run on two of the backend's worker actors, each step timed on the driver from its
``run_step`` calls until both workers answered (the median of ``repeats`` steps after one warm-up):

* empty: neither worker has an instruction: the step's own cost (``step_seconds``);
* loads: the first worker ``LOAD`` s :data:`LOADS` scalar constants: ``instruction_seconds`` is the step's
  time over the empty one's, per instruction;
* receive: the first worker ``LOAD`` s one scalar and sends it, the second ``RECV`` s it:
  ``transfer_seconds`` is what the step takes over the empty step and its two instructions (a parcel's
  actor call between the workers and their handling of it), at least 0.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from alpa_like.runtime.instructions import PER_STEP, Instruction, Op
from alpa_like.runtime.ray_worker import MeshInfo, WorkerProgram
from alpa_like.runtime.simulator import DispatchCosts

LOADS = 32
"""Instructions of the loads program."""
_MESHES = (MeshInfo(logical_shape=(1, 1), device_ids=((0,),)), MeshInfo(logical_shape=(1, 1), device_ids=((1,),)))


def _program(mesh: int, instructions: Sequence[Instruction] = (), *, sends=None, constants=None) -> WorkerProgram:
    return WorkerProgram(mesh=mesh, meshes=_MESHES, instructions=tuple(instructions), pieces={},
                         sends=sends or {}, input_specs={}, constants=constants or {}, num_micro_batches=1,
                         outputs=())


def dispatch_programs() -> dict[str, tuple[WorkerProgram, WorkerProgram]]:
    """The empty, loads and receive programs of the module docstring, one per worker."""
    scalars = {v: np.zeros((), np.float32) for v in range(LOADS)}
    loads = [Instruction(Op.LOAD, 0, (v, PER_STEP)) for v in range(LOADS)]
    key = (0, PER_STEP)
    return {"empty": (_program(0), _program(1)),
            "loads": (_program(0, loads, constants=scalars), _program(1)),
            "receive": (_program(0, [Instruction(Op.LOAD, 0, key)], sends={key: (1,)}, constants={0: scalars[0]}),
                        _program(1, [Instruction(Op.RECV, 1, key, src_mesh=0)]))}


def costs_from_steps(empty: float, loads: float, receive: float, num_loads: int = LOADS) -> DispatchCosts:
    """The :class:`DispatchCosts` of the three programs' median step seconds (module docstring)."""
    per_instruction = max(0.0, (loads - empty) / num_loads)
    return DispatchCosts(step_seconds=max(0.0, empty), instruction_seconds=per_instruction,
                         transfer_seconds=max(0.0, receive - empty - 2 * per_instruction))


def measure_dispatch_costs(cluster: Any, workers: Sequence[Any], repeats: int = 20) -> DispatchCosts:
    """Runs the programs of :func:`dispatch_programs` on ``workers`` (two distinct worker actors of the
    :class:`~alpa_like.runtime.ray_backend.RayCluster` ``cluster``, e.g. an executable's first two meshes')
    and returns the costs :func:`costs_from_steps` derives from their median step times."""
    import ray
    if len(workers) != 2 or workers[0] is workers[1]:
        raise ValueError(f"measure_dispatch_costs: workers must be two distinct worker actors, got {len(workers)}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"measure_dispatch_costs: repeats must be an int >= 1, got {repeats!r}")
    medians = {}
    for name, programs in dispatch_programs().items():
        exe = cluster.new_executable_id()
        ray.get([w.load_program.remote(exe, p, list(workers)) for w, p in zip(workers, programs, strict=True)])
        times = []
        for step in range(repeats + 1):
            start = time.perf_counter()
            ray.get([w.run_step.remote(exe, step, {}, [], [], []) for w in workers])
            times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times[1:])
        ray.get([w.unload_program.remote(exe) for w in workers])
    return costs_from_steps(medians["empty"], medians["loads"], medians["receive"])
