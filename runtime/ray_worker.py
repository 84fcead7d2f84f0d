"""The Ray backend's worker: one actor per mesh host runs its mesh's static instruction program.

The driver (:mod:`alpa_like.runtime.ray_backend`) ships each worker, once, a :class:`WorkerProgram`: its mesh's
projection of the global instruction list (:class:`~alpa_like.runtime.instructions.MeshPrograms`), the stage
pieces it runs as ``jax.export`` StableHLO bytes, and the layout of every mesh. A training step is then one
``run_step`` call per worker. Cross-mesh values never pass through the driver:

* a worker that writes a buffer another mesh ``RECV``s cuts it into the pieces of the resharding plan
  (:func:`~alpa_like.runtime.resharding.plan_resharding`, with the local all-gather rewrite) and hands them to
  the receiver as the argument of a ``deliver`` actor call: Ray inlines a small parcel in the call and puts a
  large one in its object store once, fetching it onto the receiver's node before the call runs (a background
  thread sends, so the worker keeps dispatching its own program);
* the receiver's ``deliver`` (on one of Ray's threads, while its step runs on) puts the pieces on its
  devices and assembles them (:func:`~alpa_like.runtime.resharding.assemble_received`), including the local
  all-gathers; the ``RECV`` waits for the assembled array (or the error assembling it raised).

Step outputs stay in the worker's handle store (``fetch`` and ``free`` act on it); a handle passed back as a
step input is used in place, or sent worker to worker when another mesh loads it.

Faults: any exception inside a step is re-raised as :class:`WorkerStepError` naming the mesh and the
instruction; the index of the instruction being executed is also written to a small memory-mapped progress
file, so the driver can name the instruction when the worker process dies.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.stage_construction import ValueId
from alpa_like.runtime.instructions import PER_STEP, Instruction, Key, Op, buffer_key
from alpa_like.runtime.resharding import MeshLayout, plan_resharding

RECV_POLL_SECONDS = 0.2


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshInfo:
    """One mesh of a plan: its logical shape and its devices' plan-wide ids (row-major grid)."""

    logical_shape: tuple[int, int]
    device_ids: tuple[tuple[int, ...], ...]

    @property
    def flat_ids(self) -> tuple[int, ...]:
        return tuple(i for row in self.device_ids for i in row)

    def layout(self, spec: ShardingSpec) -> MeshLayout:
        return MeshLayout(device_ids=self.device_ids, spec=spec)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShippedPiece:
    """A stage piece as ``jax.export`` bytes, with the value ids of its inputs and outputs."""

    exported: bytes
    inputs: tuple[ValueId, ...]
    outputs: tuple[ValueId, ...]
    takes_micro_batch_index: bool = False
    """The piece draws random numbers from per-step keys: it takes the micro-batch's index (uint32) last."""
    out_specs: tuple[ShardingSpec | None, ...] = ()
    """Per output, the layout the worker's compiled call makes it in (None, or empty for all: XLA's choice):
    the new state in the layout the next step's LOAD puts it in
    (:func:`~alpa_like.runtime.ray_programs.output_pins`)."""
    pinned: bool = False
    """The intra-op pass's layouts are pinned inside the piece (:func:`~alpa_like.runtime.ray_programs.export_piece`):
    a RUN that accumulates its outputs starts its totals in the layouts its first compile gives them
    (:class:`~alpa_like.runtime.accumulation.FusedAccumulation`'s open totals)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerProgram:
    """Everything a worker needs to run its mesh's part of every step (shipped once)."""

    mesh: int
    meshes: tuple[MeshInfo, ...]
    instructions: tuple[Instruction, ...]
    pieces: dict[tuple[int, str], ShippedPiece]
    """The pieces of the stages on this mesh."""
    sends: dict[Key, tuple[int, ...]]
    """Buffers this mesh writes that other meshes RECV: key -> receiving meshes."""
    send_specs: dict[tuple[ValueId, int], ShardingSpec] = dataclasses.field(default_factory=dict)
    """(value, receiving mesh) -> the layout the plan gives it there (else :func:`activation_spec`'s)."""
    input_specs: dict[ValueId, ShardingSpec]
    constants: dict[ValueId, np.ndarray]
    num_micro_batches: int
    outputs: tuple[tuple[int, Key], ...]
    """(step output index, buffer) of the outputs this mesh holds at the end of a step."""
    returned: tuple[tuple[int, Key], ...] = ()
    """(step output index, buffer) of the outputs this mesh returns in its step report as host values (the
    step's metrics: outputs that are the new value of no input)."""
    donations: dict[int, frozenset] = dataclasses.field(default_factory=dict)
    """Index of a RUN in ``instructions`` -> the donated step inputs' buffers it reads for the last time:
    the RUN donates them and the worker drops them (and the stored handle they were loaded from)."""
    per_example: frozenset[ValueId] = frozenset()
    """Accumulators of per-example values (``StageProgram.per_example``): ACC keeps each micro-batch's rows,
    MEAN puts them back together in the full batch's row order."""
    stacks: dict[ValueId, ShardingSpec | None] = dataclasses.field(default_factory=dict)
    """Accumulators of stacks of partial sums (gradients whose reduction waits for the step's mean:
    :mod:`~alpa_like.compiler.gradient_sync`) -> the layout of their mean (None: XLA's choice). MEAN sums
    each stack once per step."""


class WorkerStepError(RuntimeError):
    """A step failed on a worker: names the mesh and the instruction."""

    def __init__(self, mesh: int, index: int, instruction: str, cause: str):
        super().__init__(f"mesh {mesh}: instruction #{index} `{instruction}` failed: {cause}")
        self.mesh, self.index, self.instruction, self.cause = mesh, index, instruction, cause

    def __reduce__(self):
        return (WorkerStepError, (self.mesh, self.index, self.instruction, self.cause))


class StepAborted(RuntimeError):
    """The driver aborted the step (another mesh failed)."""


def host_value(x) -> np.ndarray | tuple[np.ndarray, str]:
    """An array as the driver receives it: a NumPy array; a typed PRNG key, which NumPy cannot hold, as
    (key data, impl name)."""
    from alpa_like.compiler import jax_compat
    return jax_compat.key_data_and_impl(x) if jax_compat.is_prng_key(x.dtype) else np.asarray(x)


def load_spec(input_specs: dict[ValueId, ShardingSpec], value: ValueId, shape: Sequence[int],
              mesh_shape: tuple[int, int]) -> ShardingSpec:
    """The layout a LOAD puts a step input in: the plan's spec for parameters, else the activation layout
    (the local backend's rule, :meth:`PipeshardExecutable._load_sharding`)."""
    from alpa_like.runtime.pipeshard_runtime import activation_spec
    spec = input_specs.get(value)
    if spec is None or spec.ndim != len(shape):
        spec = activation_spec(shape, mesh_shape)
    return spec


class MeshWorker:
    """A Ray actor owning the devices of one mesh host (``ray.remote(MeshWorker)`` in the backend).

    Args:
      jax_config: ``jax.config`` values to set.
      progress_path: the progress record's file, in the driver's temporary directory; kept only where that
        directory exists (a worker on the driver's host), else the worker keeps no record.
    """

    def __init__(self, jax_config: dict[str, Any], progress_path: str | None = None):
        import jax
        for name, value in jax_config.items():
            jax.config.update(name, value)
        self._devices = jax.devices()
        self._store: dict[int, Any] = {}
        self._loaded: dict[int, _LoadedProgram] = {}
        self._mailbox: dict[tuple, list] = {}
        self._aborted: set[tuple[int, int]] = set()
        self._finished: dict[int, int] = {}
        """Executable -> the last step this worker ran (steps count up per executable)."""
        self._send_failures: dict[tuple[int, int], BaseException] = {}
        """(executable, step) -> the error of a send of this worker's, which its RECVs raise instead of waiting."""
        self._cond = threading.Condition()
        self._sender = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sender")
        self._fault: tuple[int, str] | None = None
        self._saves: dict[str, Any] = {}
        """Checkpoint path -> its write in progress (:meth:`start_save`)."""
        self._where = "idle"
        self._progress = None
        if progress_path and os.path.isdir(os.path.dirname(progress_path)):  # else: the driver is on another host
            self._progress = np.memmap(progress_path, dtype=np.int64, mode="w+", shape=(3,))
            self._progress[:] = -1

    # ------------------------------------------------------------------------------------ setup and handles

    def info(self) -> dict:
        """The worker's process id, devices, platform and Ray node id (where Ray placed it)."""
        import jax
        import ray
        return {"pid": os.getpid(), "num_devices": len(self._devices), "platform": jax.default_backend(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def load_program(self, exe_id: int, program: WorkerProgram, peers: Sequence[Any]) -> int:
        """Deserialises the pieces and keeps the program; returns the number of pieces."""
        self._loaded[exe_id] = _LoadedProgram(program, peers, self._devices)
        return len(program.pieces)

    def hlo_text(self, exe_id: int) -> str:
        """The compiled HLO of executable ``exe_id``'s pieces on this worker (:meth:`_LoadedProgram.hlo_text`)."""
        return self._loaded[exe_id].hlo_text()

    def unload_program(self, exe_id: int) -> None:
        self._loaded.pop(exe_id, None)
        with self._cond:
            self._drop_parcels(exe_id)

    def fetch(self, handle: int) -> np.ndarray | tuple[np.ndarray, str]:
        """The stored array, as :func:`host_value` gives it."""
        if handle not in self._store:
            raise KeyError(f"handle {handle} is not stored on this worker: its array was freed or donated to a "
                           "step (donate_argnums)")
        return host_value(self._store[handle])

    def free(self, handles: Sequence[int]) -> None:
        for h in handles:
            self._store.pop(h, None)

    def num_handles(self) -> int:
        return len(self._store)

    def missing(self, handles: Sequence[int]) -> list[int]:
        """The handles among ``handles`` this worker does not hold (freed, donated, or never stored)."""
        return [h for h in handles if h not in self._store]

    def where(self) -> str:
        """What the worker is doing now (answered while a step runs: the actor is threaded)."""
        return self._where

    def set_fault(self, instruction_index: int | None, kind: str = "raise") -> None:
        """Testing hook: at instruction ``instruction_index`` of the next steps, ``"raise"`` an error,
        ``"exit"`` the process, ``"stall"`` (sleep until killed) or ``"pause"`` (wait until the driver aborts the
        step)."""
        if kind not in ("raise", "exit", "stall", "pause"):
            raise ValueError(f"set_fault: kind must be 'raise', 'exit', 'stall' or 'pause', got {kind!r}")
        self._fault = None if instruction_index is None else (instruction_index, kind)

    # ---------------------------------------------------------------------------------------- checkpoints

    def start_save(self, path: str, handles: dict[str, int]) -> None:
        """Starts writing the stored arrays ``handles`` (orbax key -> handle) from this worker's devices as one
        orbax checkpoint at ``path``; returns once they are copied off the devices (a later step may then drop
        or donate them). :meth:`finish_save` waits for the files."""
        from alpa_like.runtime.checkpoint_io import start_write
        self._saves[path] = start_write(path, {key: self._store[h] for key, h in handles.items()})

    def finish_save(self, path: str) -> dict[str, str]:
        """Waits for the files of :meth:`start_save` at ``path``; returns the typed PRNG keys' impl names."""
        return self._saves.pop(path).wait()

    def restore_handles(self, exe_id: int, items: Sequence[tuple]) -> int:
        """Reads checkpointed arrays into this worker's store, each in its layout on executable ``exe_id``'s
        mesh: ``items`` are (new handle, checkpoint path, orbax key, Target without a sharding, ShardingSpec).
        Returns how many it read."""
        from alpa_like.runtime.checkpoint_io import read_arrays
        loaded = self._loaded[exe_id]
        by_path: dict[str, list] = {}
        for handle, path, key, target, spec in items:
            target = dataclasses.replace(target, sharding=loaded.sharding(spec))
            by_path.setdefault(path, []).append((handle, key, target))
        for path, group in by_path.items():
            read = read_arrays(path, {key: target for _, key, target in group})
            for handle, key, _ in group:
                self._store[handle] = read[key]
        return len(items)

    # ------------------------------------------------------------------------------------- created state

    def create_handles(self, exe_id: int, exported: bytes, args: Sequence, outputs: Sequence[tuple[int, ShardingSpec]],
                       frees: Sequence[int] = ()) -> int:
        """Runs the ``jax.export`` ed function ``exported`` on executable ``exe_id``'s mesh and keeps its results:
        output ``j`` is made in layout ``outputs[j][1]`` (GSPMD partitions the computation from those layouts)
        and stored as handle ``outputs[j][0]``. ``args``: its arguments as :func:`host_value` gives them;
        ``frees``: handles the driver dropped. Returns how many it made."""
        import jax
        self.free(frees)
        loaded = self._loaded[exe_id]
        function = jax.export.deserialize(bytearray(exported))
        values = jax.jit(function.call, out_shardings=[loaded.sharding(spec) for _, spec in outputs])(
            *(jax.random.wrap_key_data(x[0], impl=x[1]) if isinstance(x, tuple) else x for x in args))
        jax.block_until_ready(values)
        self._store.update(zip((h for h, _ in outputs), values, strict=True))
        return len(outputs)

    # ----------------------------------------------------------------------------------- worker to worker

    def deliver(self, exe_id: int, step: int, keys: Sequence, parcel: list) -> None:
        """Called by a peer: a parcel holding the buffers ``keys`` (in order, as :meth:`_StepRun._pieces`
        cuts them), which this worker will RECV (or LOAD) in ``step`` of executable ``exe_id``. The parcel is
        the call's argument: Ray inlines a small one in the call and puts a large one in the object store
        once, fetching it onto this node before the call runs. Each buffer is assembled on this mesh's
        devices here, on the calling thread, and mailed as ``("value", array)`` as soon as it is, so its RECV
        need not wait for the rest of the parcel; an error assembling it is mailed as ``("error", exception)``
        for the RECV to raise."""
        if len(keys) != len(parcel):
            raise ValueError(f"deliver: {len(keys)} keys for {len(parcel)} buffers in the parcel")
        if step <= self._finished.get(exe_id, -1):  # its step ended (aborted) without it: nothing will RECV it
            return
        loaded = self._loaded.get(exe_id)
        for key, item in zip(keys, parcel, strict=True):
            arrived = _arrival(loaded, exe_id, item)
            with self._cond:
                if step > self._finished.get(exe_id, -1):
                    self._mailbox[(exe_id, step, key)] = arrived
                    self._cond.notify_all()

    def _drop_parcels(self, exe_id: int, last_step: float = math.inf) -> None:
        """Removes the mailed buffers of executable ``exe_id`` for steps up to ``last_step`` (every step by
        default); the caller holds ``self._cond``."""
        for stale in [k for k in self._mailbox if k[0] == exe_id and k[1] <= last_step]:
            del self._mailbox[stale]

    def abort(self, exe_id: int, step: int) -> None:
        with self._cond:
            self._aborted.add((exe_id, step))
            self._cond.notify_all()

    def _wait_for(self, exe_id: int, step: int, key) -> tuple[str, Any]:
        """The mailed ``(kind, payload)`` of buffer ``key`` in ``step`` (:meth:`deliver`), once it arrives;
        raises when the driver aborts the step or this worker's own send failed."""
        with self._cond:
            while (exe_id, step, key) not in self._mailbox:
                if (exe_id, step) in self._aborted:
                    raise StepAborted(f"step {step} aborted by the driver while waiting for {key}")
                failed = self._send_failures.get((exe_id, step))
                if failed is not None:  # this worker's own send failed: its peers would wait forever
                    raise failed
                self._cond.wait(RECV_POLL_SECONDS)
            return self._mailbox.pop((exe_id, step, key))

    # ----------------------------------------------------------------------------------------- one step

    def run_step(self, exe_id: int, step: int, inputs: dict, out_handles: Sequence[int],
                 handle_sends: Sequence[tuple[int, int, ValueId]], frees: Sequence[int], profile: bool = False) -> dict:
        """Runs this mesh's program once.

        Args:
          inputs: value id -> ``("ref", [object ref])`` (an array the driver put), ``("handle", h)`` (in this
            worker's store) or ``("peer", None)`` (another worker sends it).
          out_handles: the handle id of each of this mesh's outputs (``WorkerProgram.outputs`` order).
          handle_sends: (handle, receiving mesh, value id): stored arrays other meshes LOAD this step.
          frees: handles the driver dropped.
          profile: wait for each instruction and time it (slower, for measurement).

        Returns:
          A small report: seconds, bytes sent to peers, instructions run, buffers donated, under
          ``"outputs"`` the values of this mesh's ``WorkerProgram.returned`` outputs (:func:`host_value`), and
          with ``profile`` under ``"spans"`` each instruction's (text, start, end) in seconds from the start of
          this call (a RUN's span includes the ACC and FREE instructions fused with it).
        """
        import jax
        start = time.perf_counter()
        self.free(frees)
        loaded = self._loaded[exe_id]
        run = _StepRun(self, loaded, exe_id, step, start if profile else None)
        try:
            for h, dst, v in handle_sends:
                run.send_input(self._store[h], dst, v)
            run.flush()
            run.execute(inputs)
            outputs = [run.buffers[key] for _, key in loaded.program.outputs]
            jax.block_until_ready(outputs)
            returned = {k: host_value(run.buffers[key]) for k, key in loaded.program.returned}
            run.finish_sends()
        except WorkerStepError:
            raise
        except BaseException as e:  # noqa: BLE001  (re-raised with the mesh and the instruction)
            raise WorkerStepError(loaded.program.mesh, run.index, run.current, f"{type(e).__name__}: {e}") from None
        finally:
            self._where = "idle"
            with self._cond:
                self._aborted.discard((exe_id, step))
                self._send_failures.pop((exe_id, step), None)
                self._finished[exe_id] = max(step, self._finished.get(exe_id, -1))
                self._drop_parcels(exe_id, step)  # an aborted step's parcels: their device memory goes now
        self._store.update(zip(out_handles, outputs, strict=True))
        return {"mesh": loaded.program.mesh, "seconds": time.perf_counter() - start,
                "bytes_sent": run.bytes_sent, "input_bytes_sent": run.input_bytes_sent, "instructions": run.count,
                "donated_buffers": run.donated, "input_relayouts": run.relayouts, "outputs": returned,
                **({} if run.spans is None else {"spans": run.spans})}


class _LoadedProgram:
    """A worker program with its pieces deserialised and jitted on the worker's mesh."""

    def __init__(self, program: WorkerProgram, peers: Sequence[Any], devices: Sequence[Any]):
        import jax
        from alpa_like.runtime.mesh import make_mesh
        from alpa_like.runtime.pipeshard_runtime import MESH_AXES
        self.program = program
        self.peers = list(peers)
        info = program.meshes[program.mesh]
        size = len(info.flat_ids)
        if size > len(devices):
            raise ValueError(f"mesh {program.mesh} needs {size} devices; this worker has {len(devices)}")
        self.mesh = make_mesh(devices[:size], info.logical_shape, MESH_AXES)
        self.device_of = dict(zip(info.flat_ids, self.mesh.devices.flat, strict=True))
        self.global_id = {d.id: g for g, d in self.device_of.items()}
        self.exported = {key: jax.export.deserialize(bytearray(p.exported)) for key, p in program.pieces.items()}
        self.shardings: dict[ShardingSpec, Any] = {}
        self.out_shardings = {key: self.pinned_outputs(p.out_specs) for key, p in program.pieces.items()}
        """Per piece, its ``out_shardings`` (None: every output in XLA's choice of layout)."""
        self.jitted = {key: jax.jit(e.call, out_shardings=self.out_shardings[key]) for key, e in self.exported.items()}
        self.donating: dict[tuple, Any] = {}
        self.fused: dict[tuple, Any] = {}
        self.plans: dict[tuple, Any] = {}
        self.ran: dict[tuple[int, str], tuple[Any, tuple]] = {}
        """Per piece, the jitted function its first RUN called and that call's argument specs."""

    def assemble(self, payload: dict):
        """A received buffer (a parcel item of :meth:`_StepRun._pieces`) on this mesh, laid out as its
        destination spec: its pieces put on their devices (on CPU a view of the object store's memory where
        the alignment allows) and assembled by the resharding plan."""
        import jax
        from alpa_like.runtime.resharding import assemble_received
        plan = self.plan(payload["shape"], payload["dtype"], payload["src_mesh"], payload["src_spec"],
                         self.program.mesh, payload["dst_spec"])
        boxes, pieces, devices = [], [], []
        for dst, items in payload["pieces"].items():
            for box, piece in items:
                boxes.append((dst, box))
                pieces.append(piece)
                devices.append(self.device_of[dst])
        received: dict[int, list] = {}
        for (dst, box), x in zip(boxes, jax.device_put(pieces, devices), strict=True):
            received.setdefault(dst, []).append((box, x))
        info = self.program.meshes[self.program.mesh]
        x = assemble_received(plan, received, np.dtype(payload["dtype"]), self.device_of, info.flat_ids,
                              self.sharding(payload["dst_spec"]))
        return x if payload["key_impl"] is None else jax.random.wrap_key_data(x, impl=payload["key_impl"])

    def hlo_text(self) -> str:
        """The compiled HLO of every piece as its first RUN compiled it (read from jax's cache, no compile)."""
        return "\n".join(f"// stage {stage} {phase}\n{fn.lower(*specs).compile().as_text()}"
                         for (stage, phase), (fn, specs) in self.ran.items())

    def sharding(self, spec: ShardingSpec):
        """The ``NamedSharding`` of ``spec`` on this mesh (made once per spec)."""
        sharding = self.shardings.get(spec)
        if sharding is None:
            from alpa_like.runtime.mesh import named_sharding
            sharding = self.shardings[spec] = named_sharding(self.mesh, spec)
        return sharding

    def pinned_outputs(self, specs: Sequence[ShardingSpec | None]) -> list | None:
        """``out_shardings`` for a piece whose outputs are made in ``specs`` (:attr:`ShippedPiece.out_specs`)
        on this mesh: a ``NamedSharding`` per pinned output, None for the others; None when none is pinned."""
        if not any(spec is not None for spec in specs):
            return None
        return [None if spec is None else self.sharding(spec) for spec in specs]

    def call(self, key: tuple[int, str], donate: tuple[int, ...] = ()):
        """The piece ``key`` jitted (its pinned outputs made in their layouts), donating its inputs at
        positions ``donate``."""
        if not donate:
            return self.jitted[key]
        fn = self.donating.get((key, donate))
        if fn is None:
            import jax
            fn = self.donating[(key, donate)] = jax.jit(self.exported[key].call, donate_argnums=donate,
                                                        out_shardings=self.out_shardings[key])
        return fn

    def accumulating(self, key: tuple[int, str], slots: tuple[int, ...], donate: tuple[int, ...] = ()):
        """The piece ``key`` (its pinned outputs made in their layouts) with the sums of its outputs at
        ``slots`` into running totals fused in (:class:`~alpa_like.runtime.accumulation.FusedAccumulation`:
        a piece without the intra-op layouts pinned inside runs its first RUN unfused), donating the inputs at
        positions ``donate``."""
        fn = self.fused.get((key, slots, donate))
        if fn is None:
            from alpa_like.runtime.accumulation import FusedAccumulation
            fn = self.fused[(key, slots, donate)] = FusedAccumulation(
                self.exported[key].call, slots, donate, out_shardings=self.out_shardings[key],
                open_totals=self.program.pieces[key].pinned)
        return fn

    def plan(self, shape, dtype, src_mesh: int, src_spec: ShardingSpec, dst_mesh: int, dst_spec: ShardingSpec):
        key = (tuple(shape), str(dtype), src_mesh, src_spec, dst_mesh, dst_spec)
        plan = self.plans.get(key)
        if plan is None:
            meshes = self.program.meshes
            plan = self.plans[key] = plan_resharding(shape, np.dtype(dtype).itemsize, meshes[src_mesh].layout(src_spec),
                                                     meshes[dst_mesh].layout(dst_spec))
        return plan


class _StepRun:
    """The state of one step on one worker."""

    def __init__(self, worker: MeshWorker, loaded: _LoadedProgram, exe_id: int, step: int,
                 profile_start: float | None = None):
        self.worker, self.loaded, self.exe_id, self.step = worker, loaded, exe_id, step
        self.profile_start = profile_start
        """The step's start (``time.perf_counter``) when it is profiled, else None."""
        self.spans: list[tuple[str, float, float]] | None = None if profile_start is None else []
        self.program = loaded.program
        self.buffers: dict[Key, Any] = {}
        self.accumulators: dict[ValueId, Any] = {}
        self.micro: dict[ValueId, Any] = {}
        self.sends: list[concurrent.futures.Future] = []
        self.outbox: dict[int, list] = {}  # receiving mesh -> [(key, array, dst spec)] not yet flushed
        self.queued: dict[int, list] = {}  # the same, flushed and not yet taken by the sender thread
        self.queue_lock = threading.Lock()
        self.bytes_sent = 0
        """Cross-mesh bytes of the RECVs this mesh serves (the local backend's ``bytes_moved``)."""
        self.input_bytes_sent = 0
        """Cross-mesh bytes of stored step inputs (handles) sent to the meshes that LOAD them."""
        self.donated = 0
        """Buffers of donated step inputs the RUNs donated (``WorkerProgram.donations``)."""
        self.relayouts = 0
        """LOADs of a stored array (a handle) not already in the layout the LOAD puts it in."""
        self.index, self.current, self.count = -1, "(before the first instruction)", 0

    # ---------------------------------------------------------------------------------------- the program

    def execute(self, inputs: dict) -> None:
        instructions = self.program.instructions
        i = 0
        while i < len(instructions):
            self.flush()
            ins = instructions[i]
            self._enter(i, ins)
            begin = time.perf_counter() if self.spans is not None else 0.0
            i = self._execute_at(i, ins, inputs)
            if self.spans is not None:
                self._record(ins, begin)
        self.flush()

    def _execute_at(self, i: int, ins: Instruction, inputs: dict) -> int:
        """Runs instruction ``i`` (``ins``) with the instructions fused with it; returns the next index."""
        instructions = self.program.instructions
        donated = self.program.donations.get(i, frozenset())
        i += 1
        if ins.op is Op.RUN:  # fused with the ACC/FREE instructions that follow it, as in the local backend
            accs, frees = [], []
            while i < len(instructions) and instructions[i].op in (Op.ACC, Op.FREE):
                (accs if instructions[i].op is Op.ACC else frees).append(instructions[i])
                i += 1
            self._run(ins, accs, donated)
            for free in frees:
                self.buffers.pop(free.key, None)
            self._drop_donated(donated, inputs)
            self.count += 1 + len(accs) + len(frees)
            return i
        if ins.op is Op.MEAN:
            group = [ins]
            while i < len(instructions) and instructions[i].op is Op.MEAN:
                group.append(instructions[i])
                i += 1
            self._mean(group)
            self.count += len(group)
            return i
        if ins.op is Op.LOAD:
            self._load(ins, inputs)
        elif ins.op is Op.RECV:
            self._recv(ins)
        elif ins.op is Op.FREE:
            self.buffers.pop(ins.key, None)
        elif ins.op is Op.CARRY:
            self._carry(ins)
        else:
            raise AssertionError(f"unexpected instruction {ins}")
        self.count += 1
        return i

    def _record(self, ins: Instruction, begin: float) -> None:
        """Profiling: waits for this mesh's buffers, then records ``ins``'s span from the step's start."""
        import jax
        jax.block_until_ready((self.buffers, self.accumulators))
        end = time.perf_counter()
        self.spans.append((str(ins), begin - self.profile_start, end - self.profile_start))

    def _enter(self, index: int, ins: Instruction) -> None:
        self.index, self.current = index, str(ins)
        worker = self.worker
        worker._where = f"step {self.step} instruction #{index} `{ins}`"
        if worker._progress is not None:
            worker._progress[:] = (self.exe_id, self.step, index)
        if worker._fault is not None and worker._fault[0] == index:
            kind = worker._fault[1]
            if kind == "exit":
                os._exit(1)
            if kind == "stall":
                while True:
                    time.sleep(1.0)
            if kind == "pause":  # a buffer that never comes: StepAborted once the driver aborts the step
                worker._wait_for(self.exe_id, self.step, ("pause",))
            raise RuntimeError("fault injected by set_fault")

    def _wrote(self, key: Key) -> None:
        from alpa_like.runtime.pipeshard_runtime import activation_spec
        for dst in self.program.sends.get(key, ()):
            x = self.buffers[key]
            spec = self.program.send_specs.get((key[0], dst)) or activation_spec(
                x.shape, self.program.meshes[dst].logical_shape)
            self.outbox.setdefault(dst, []).append((key, x, spec))

    def _run(self, ins: Instruction, accs: list[Instruction], donated=frozenset()) -> None:
        """RUN, and the ACCs of its outputs fused in (:meth:`_LoadedProgram.accumulating`), donating the
        inputs whose buffers are in ``donated``."""
        from alpa_like.runtime.pipeshard_runtime import arg_specs, donated_positions
        piece = self.program.pieces[(ins.stage, ins.phase)]
        buffers, acc = self.buffers, self.accumulators
        rows = [a for a in accs if a.target in self.program.per_example]
        accs = [a for a in accs if a not in rows]
        keys = [buffer_key(buffers, v, ins.micro_batch) for v in piece.inputs]
        args = [buffers[key] for key in keys]
        donate = donated_positions(keys, (), [False] * len(keys), donated) if donated else ()
        self.donated += len(donate)
        if piece.takes_micro_batch_index:
            args.append(np.uint32(ins.micro_batch))
        specs = None if (ins.stage, ins.phase) in self.loaded.ran else tuple(arg_specs(args))  # for hlo_text
        if accs:
            position = {v: k for k, v in enumerate(piece.outputs)}
            fused = self.loaded.accumulating((ins.stage, ins.phase), tuple(position[a.key[0]] for a in accs), donate)
            outs, sums = fused([acc.get(a.target) for a in accs], *args)
            acc.update({a.target: x for a, x in zip(accs, sums, strict=True)})
            if specs is not None:
                fn, leading = fused.first_call
                self.loaded.ran[(ins.stage, ins.phase)] = (fn, (*leading, *specs))
        else:
            fn = self.loaded.call((ins.stage, ins.phase), donate)
            if specs is not None:
                self.loaded.ran[(ins.stage, ins.phase)] = (fn, specs)
            outs = fn(*args)
        for v, x in zip(piece.outputs, outs, strict=True):
            buffers[(v, ins.micro_batch)] = x
        for a in rows:  # a per-example value: this micro-batch's rows, put together by MEAN
            acc.setdefault(a.target, {})[a.key[1]] = buffers[a.key]
        for v in piece.outputs:
            self._wrote((v, ins.micro_batch))

    def _drop_donated(self, donated, inputs: dict) -> None:
        """Forgets the donated step inputs' buffers ``donated``: this step's, and the stored handle or
        received value each was loaded from."""
        for key in donated:
            self.buffers.pop(key, None)
            kind, payload = inputs.get(key[0], (None, None))
            if kind == "handle":
                self.worker._store.pop(payload, None)
            if kind is not None:
                inputs[key[0]] = ("donated", None)

    def _mean(self, group: list[Instruction]) -> None:
        from alpa_like.runtime.partial_sums import step_means
        from alpa_like.runtime.pipeshard_runtime import gather_rows
        for ins in [ins for ins in group if ins.key[0] in self.program.per_example]:
            self.buffers[ins.key] = gather_rows(self.accumulators.pop(ins.key[0]))
            self._wrote(ins.key)
        group = [ins for ins in group if ins.key[0] not in self.program.per_example]
        stacked = [ins for ins in group if ins.key[0] in self.program.stacks]
        plain = [ins for ins in group if ins.key[0] not in self.program.stacks]
        specs = [self.program.stacks[ins.key[0]] for ins in stacked]
        stack_means, plain_means = step_means(
            [self.accumulators.pop(ins.key[0]) for ins in stacked],
            tuple(None if spec is None else self.loaded.sharding(spec) for spec in specs),
            [self.accumulators.pop(ins.key[0]) for ins in plain], self.program.num_micro_batches)
        for ins, x in zip(stacked + plain, stack_means + plain_means, strict=True):
            self.buffers[ins.key] = x
            self._wrote(ins.key)

    def _load(self, ins: Instruction, inputs: dict) -> None:
        import jax
        from alpa_like.runtime.pipeshard_runtime import _split_micro_batches
        v, mb = ins.key
        kind = None
        if v in self.program.constants:
            value = self.program.constants[v]
        else:
            kind, payload = inputs[v]
            if kind == "ref":
                import ray
                value = ray.get(payload[0])
                if len(payload) > 1:  # a typed PRNG key's data and impl (jax_compat.key_data_and_impl)
                    value = jax.random.wrap_key_data(value, impl=payload[1])
                inputs[v] = ("value", value)
            elif kind == "handle":
                value = self.worker._store[payload]
            elif kind == "peer":
                value = self._receive(("input", v))
                inputs[v] = ("value", value)
            elif kind == "value":
                value = payload
            else:
                raise AssertionError(kind)
        if ins.window is not None:  # a token-sliced unit's rows and tokens
            from alpa_like.runtime.pipeshard_runtime import unit_window
            if (v, ins.window) not in self.micro:
                self.micro[(v, ins.window)] = unit_window(value, ins.window)
            value = self.micro[(v, ins.window)]
        elif mb != PER_STEP:
            if v not in self.micro:
                self.micro[v] = _split_micro_batches(jax.numpy.asarray(value), self.program.num_micro_batches)
            value = self.micro[v][mb]
        shape = np.shape(value)
        info = self.program.meshes[self.program.mesh]
        sharding = self.loaded.sharding(load_spec(self.program.input_specs, v, shape, info.logical_shape))
        if kind == "handle" and mb == PER_STEP and not value.sharding.is_equivalent_to(sharding, len(shape)):
            self.relayouts += 1
        self.buffers[ins.key] = jax.device_put(value, sharding)
        self._wrote(ins.key)

    def _carry(self, ins: Instruction) -> None:
        """CARRY: a buffer handed to another unit on this mesh, its token dim padded or trimmed."""
        from alpa_like.runtime.pipeshard_runtime import pad_tokens
        self.buffers[ins.key] = pad_tokens(self.buffers[ins.source], ins.pad)
        self._wrote(ins.key)

    def _recv(self, ins: Instruction) -> None:
        self.buffers[ins.key] = self._receive(ins.key)
        self._wrote(ins.key)

    # ------------------------------------------------------------------------------------ transfers

    def send_input(self, x, dst: int, v: ValueId) -> None:
        """Queues a stored array for mesh ``dst``, which LOADs it as input ``v`` (sent by ``flush``)."""
        spec = load_spec(self.program.input_specs, v, x.shape, self.program.meshes[dst].logical_shape)
        self.outbox.setdefault(dst, []).append((("input", v), x, spec))

    def flush(self) -> None:
        """Hands what the last instruction queued to the sender thread (:meth:`_send_queued`)."""
        if not self.outbox:
            return
        with self.queue_lock:
            for dst, items in self.outbox.items():
                self.queued.setdefault(dst, []).extend(items)
        self.outbox = {}
        self.sends.append(self.worker._sender.submit(self._send_queued))

    def _send_queued(self) -> None:
        """On the sender thread: sends every buffer queued so far, one parcel (one object, one actor call) per
        receiving mesh, so the buffers queued while the previous parcels were being sent travel together."""
        with self.queue_lock:
            queued, self.queued = self.queued, {}
        try:
            for dst, items in queued.items():
                self._send_parcel(dst, items)
        except BaseException as e:  # its next wait for a parcel raises it (else finish_sends, at the step's end)
            worker = self.worker
            with worker._cond:
                worker._send_failures[(self.exe_id, self.step)] = e
                worker._cond.notify_all()
            raise

    def _send_parcel(self, dst: int, items: list) -> None:
        parcel = [self._pieces(x, dst, spec, is_input=key[0] == "input") for key, x, spec in items]
        self.loaded.peers[dst].deliver.remote(self.exe_id, self.step, [key for key, _, _ in items], parcel)

    def _pieces(self, x, dst: int, dst_spec: ShardingSpec, is_input: bool) -> dict:
        """One buffer cut into the pieces its resharding plan sends to mesh ``dst``."""
        import jax
        from alpa_like.compiler import jax_compat
        from alpa_like.runtime.resharding import pieces_to_send
        src_spec = _spec_of(x, self.loaded)
        key_impl = None
        if jax_compat.is_prng_key(x.dtype):  # typed keys travel as their key data
            key_impl = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
            src_spec, dst_spec = (ShardingSpec(axes=spec.axes + ((),)) for spec in (src_spec, dst_spec))
        plan = self.loaded.plan(x.shape, x.dtype, self.program.mesh, src_spec, dst, dst_spec)
        target = self.loaded.sharding(src_spec)
        if not x.sharding.is_equivalent_to(target, x.ndim):
            x = jax.device_put(x, target)
        src_data = {self.loaded.global_id[s.device.id]: np.asarray(s.data) for s in x.addressable_shards}
        if is_input:
            self.input_bytes_sent += plan.cross_mesh_bytes
        else:
            self.bytes_sent += plan.cross_mesh_bytes
        return {"shape": tuple(x.shape), "dtype": str(x.dtype), "src_mesh": self.program.mesh,
                "src_spec": src_spec, "dst_spec": dst_spec, "pieces": pieces_to_send(plan, src_data),
                "key_impl": key_impl}

    def _receive(self, key):
        """The array of buffer ``key`` another mesh sent this step, as :meth:`MeshWorker.deliver` assembled it
        on this mesh."""
        kind, payload = self.worker._wait_for(self.exe_id, self.step, key)
        if kind == "error":
            raise payload
        return payload

    def finish_sends(self) -> None:
        for future in self.sends:
            future.result()


def _arrival(loaded: _LoadedProgram | None, exe_id: int, item: dict) -> tuple[str, Any]:
    """What :meth:`MeshWorker.deliver` mails for one parcel item: ``("value", array)`` assembled on
    ``loaded``'s mesh, or ``("error", exception)``."""
    if loaded is None:
        return "error", RuntimeError(f"a parcel arrived for executable {exe_id}, which this worker has not loaded")
    try:
        return "value", loaded.assemble(item)
    except Exception as e:  # noqa: BLE001  (raised by the RECV that waits for it, naming the instruction)
        return "error", e


def _spec_of(x, loaded: _LoadedProgram) -> ShardingSpec:
    """The ShardingSpec of an array on the worker's mesh (replicated when it is laid out otherwise)."""
    import jax
    from alpa_like.runtime.pipeshard_runtime import MESH_AXES
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == loaded.mesh:
        return ShardingSpec.from_partition_spec(sharding.spec, MESH_AXES, x.ndim)
    return ShardingSpec.replicated(x.ndim)
