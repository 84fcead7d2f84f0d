"""The Ray backend of the MPMD runtime: the driver side.

``al.init(cluster="ray")`` makes a :class:`RayCluster`. Compiling a pipeline step plans it for the cluster's
``num_nodes x num_devices_per_node`` devices exactly as the local backend does (same stage program, schedule,
static instruction programs, resharding plans), then builds a :class:`RayPipeshardExecutable`:

* one :class:`~alpa_like.runtime.ray_worker.MeshWorker` actor per mesh host (a mesh of the plan lives on one
  node, and its actor is pinned to that Ray node, :mod:`~alpa_like.runtime.ray_nodes`; actors are pooled per
  (node, device count) and reused by later executables of the same cluster). On
  CPU each actor gets its own ``--xla_force_host_platform_device_count`` through its ``runtime_env``, set
  before it imports jax. On GPU (``platform="gpu"``) an actor asks Ray for ``num_gpus`` devices and uses the
  GPUs Ray assigns (``CUDA_VISIBLE_DEVICES``); that path cannot run on this machine and is untested.
* Stage programs ship once: every stage piece is exported on the driver with ``jax.export`` (StableHLO,
  exported for one device) and serialised; the worker deserialises it and calls it under ``jax.jit`` on its
  mesh, where GSPMD partitions it from the input layouts, as the local backend's ``jax.jit`` of the same
  piece does. Export carries everything a piece needs here (no host callbacks, no custom partitioning), so
  the jaxpr is not shipped.
* A step is one ``run_step`` call per worker. Tensors move worker to worker through the Ray object store
  (see :mod:`alpa_like.runtime.ray_worker`); the driver sends only the batch (and step inputs that are
  still driver arrays, e.g. the first step's state) and receives small reports.
* Step outputs that are new values of step inputs (the state) stay on the workers as :class:`RemoteArray`
  handles; the others (metrics, the loss) come back as NumPy arrays in the workers' step reports.
* ``donate_argnums``: a worker donates a donated step input at the last RUN that reads it on its mesh and
  drops its stored copy (:func:`~alpa_like.runtime.pipeshard_runtime.input_donations`).

Faults: the driver waits on the workers' object refs with ``ray.wait`` timeouts; a worker that raises or dies
becomes a :class:`RayStepError` naming the mesh and the instruction (and, for a worker that died or whose
node was lost, the Ray node); the other workers are aborted, so the call never hangs. A lost head node (the GCS)
answers no Ray call: while a step waits the driver probes the GCS port
(:class:`~alpa_like.runtime.ray_nodes.HeadWatch`) and raises a :class:`RayStepError` naming the head. The
executable is then unusable: ``al.shutdown()`` and ``al.init(...)`` start afresh, on the nodes then alive.

The local Ray (``address=None`` and no Ray running): :func:`~alpa_like.runtime.ray_startup.start_local_ray`
starts a new single-node cluster whose every server listens on loopback only (node IP 127.0.0.1, no
dashboard), with Ray's token authentication as Ray sets it for a new local cluster, and retries a start that
timed out (see ``docs/ray.md``). What ships to the workers is built by :mod:`~alpa_like.runtime.ray_programs`.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
import os
import pickle
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler import jax_compat
from alpa_like.compiler.optional_imports import require
from alpa_like.compiler.stage_construction import StageProgram
from alpa_like.compiler.trace import updated_inputs
from alpa_like.runtime.instructions import MeshPrograms, Op
from alpa_like.compiler.gradient_sync import DeferredGradients
from alpa_like.compiler.stage_sharding import StageSharding
from alpa_like.runtime.pipeshard_runtime import input_donations
from alpa_like.runtime.stage_gradients import GradientDeferral, defer_gradients
from alpa_like.runtime.ray_nodes import (HeadWatch, RayNode, answering, choose_nodes, cluster_nodes, cpu_worker_env,
                                          died_at, head_text, host_spec, local_cpu_devices, measure_on_node,
                                          mesh_nodes, not_silent, ray_pings, silent_worker, wait_all,
                                          with_placements)
from alpa_like.runtime.ray_programs import export_pieces, mesh_load_spec, worker_programs
from alpa_like.runtime.ray_startup import connect_ray, start_local_ray
from alpa_like.runtime.ray_worker import MeshInfo, MeshWorker, WorkerStepError

PLATFORMS = ("cpu", "gpu")
POLL_SECONDS = 0.5
ABORT_GRACE_SECONDS = 5.0
FREE_BATCH = 256


_CONSEQUENCES = {"StepAborted", "OwnerDiedError", "ObjectLostError", "ObjectFetchTimedOutError",
                 "ReferenceCountingAssertionError", "RayActorError", "ActorDiedError", "ActorUnavailableError"}
"""Error types a worker sees when a peer failed first."""


class RayStepError(RuntimeError):
    """A step failed on the Ray backend (the message names the mesh and the instruction)."""


@dataclasses.dataclass
class RayStepStats:
    """What the last step cost, measured on the driver."""

    seconds: float = 0.0
    driver_calls: int = 0
    """Remote calls the driver made for the step (one ``run_step`` per worker)."""
    driver_sent_bytes: int = 0
    """Bytes the driver sent: pickled call arguments plus arrays it put in the object store."""
    driver_received_bytes: int = 0
    """Bytes the driver received: the pickled worker reports."""
    driver_received_types: tuple[str, ...] = ()
    """Type names of the numbers in the received reports (arrays come back only as the step's metric
    outputs, under ``"outputs"``)."""
    worker_bytes: int = 0
    """Bytes the RECVs moved between workers (the resharding plans' cross-mesh bytes; the local backend's
    ``bytes_moved``)."""
    input_bytes: int = 0
    """Bytes of step inputs held as handles on one worker and sent to another that loads them."""
    inputs_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    """Step inputs sent as ``ref`` (a driver array), ``handle`` (already on the loading worker) or ``peer``
    (sent by the worker holding it)."""
    worker_seconds: tuple[float, ...] = ()
    donated_buffers: int = 0
    """Buffers of donated step inputs (``donate_argnums``) the workers' RUNs donated."""
    input_routes: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Flat input leaf -> how each mesh that loads it got it (``ref``, ``handle`` or ``peer``, as in
    :attr:`inputs_by_kind`)."""
    input_relayouts: int = 0
    """LOADs of a stored step input (a handle) that was not in the layout the LOAD puts it in, so the worker laid
    it out again on its mesh (none for a state made by ``al.CreateStateParallel``)."""
    op_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """With ``run(..., profile=True)``: seconds per instruction kind summed over the workers, each instruction
    waited for (as :attr:`~alpa_like.runtime.pipeshard_runtime.StepStats.op_seconds`)."""
    spans: list[tuple[int, str, float, float]] = dataclasses.field(default_factory=list)
    """With ``run(..., profile=True)``: (mesh, instruction, start, end) in seconds from the start of that mesh's
    worker's step call (each worker's own clock: the driver's calls reach the workers at different times)."""


class RemoteArray:
    """A step output that lives on a Ray worker: shape and dtype here, the data there.

    ``np.asarray(x)`` fetches it (once, then cached); passing it to the next step uses it in place (or sends it
    worker to worker); dropping the last reference frees it on the workers (batched with the next call).
    A value several meshes hold at the end of the step (e.g. one another mesh received) keeps a replica on
    each, so every one of them can load it in place.
    """

    __slots__ = ("shape", "dtype", "replicas", "_cluster", "_value", "donated", "__weakref__")

    def __init__(self, shape, dtype, replicas: Sequence[tuple[Any, int]], cluster: RayCluster):
        self.shape, self.dtype = tuple(shape), dtype if jax_compat.is_prng_key(dtype) else np.dtype(dtype)
        self.replicas = tuple(replicas)
        """(worker actor, handle id) of each copy."""
        self._cluster, self._value = cluster, None
        self.donated = False
        """Given to a step that donates it (``donate_argnums``): its data on the workers is gone."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def aval(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    @property
    def is_alive(self) -> bool:
        """Whether the data still exists on the workers (false once its Ray backend is shut down)."""
        return not self._cluster.closed

    def mark_donated(self, consumed: Callable[[Any, int], bool] = lambda actor, handle: False) -> None:
        """Its data is gone (a step donated it): every replica is released but those ``consumed(actor, handle)``
        (the one a worker donated in place, already dropped there)."""
        for actor, handle in self.replicas:
            if not consumed(actor, handle):
                self._cluster.release(actor, handle)
        self.replicas, self.donated, self._value = (), True, None

    def fetch(self) -> np.ndarray | jax.Array:
        """The value (a typed PRNG key comes back as a ``jax.random.key`` array)."""
        if self.donated:
            raise RuntimeError(f"{self!r} was donated to a step (donate_argnums): its data is gone")
        if self._value is None:
            self._value = from_host(self._cluster.fetch(*self.replicas[0]))
        return self._value

    def __array__(self, dtype=None, copy=None):
        value = self.fetch()
        return value if dtype is None else value.astype(dtype)

    def __float__(self) -> float:
        return float(self.fetch())

    def __int__(self) -> int:
        return int(self.fetch())

    def __repr__(self) -> str:
        return f"RemoteArray(shape={self.shape}, dtype={self.dtype}, replicas={len(self.replicas)})"

    def __del__(self):
        cluster = getattr(self, "_cluster", None)
        if cluster is not None:
            try:
                for actor, handle in self.replicas:
                    cluster.release(actor, handle)
            except Exception:  # noqa: BLE001  (interpreter shutdown: Ray is already gone)
                pass


def _actor_id(actor) -> str:
    return actor._actor_id.hex()


class RayCluster:
    """A connection to a Ray cluster and the worker actors the backend made on it.

    Args:
      address: ``None``: the Ray this process is connected to, else ``RAY_ADDRESS``, else a new local Ray
        (:func:`start_local_ray`: loopback only); ``"host:port"`` or ``"auto"``: that running cluster, as its
        owner started it (:func:`connect_ray`).
      num_nodes, num_devices_per_node: the cluster plans are made for; default: every alive node with devices
        (``GPU``, or ``CPU`` on the cpu platform), each with the fewest devices any of them has
        (:mod:`~alpa_like.runtime.ray_nodes`). Plan node ``k`` runs on :attr:`nodes` ``[k]``.
      platform: ``"cpu"`` or ``"gpu"`` (default: JAX's default backend).
      step_timeout: seconds a step may take (``None``: no limit).
      ping_timeout: seconds a worker the driver waits for may leave a ping unanswered before the wait fails
        naming its mesh and node (a frozen or unreachable machine; :class:`~.ray_nodes.WorkerPings`; ``None``:
        no pings).
      startup_timeout: seconds starting the local Ray, a worker actor or an executable's programs may take.
      compilation_cache_dir: JAX's persistent compilation cache for the workers.
    """

    def __init__(self, *, address: str | None = None, num_nodes: int | None = None,
                 num_devices_per_node: int | None = None, platform: str | None = None,
                 step_timeout: float | None = 600.0, startup_timeout: float = 180.0,
                 compilation_cache_dir: str | None = None, ping_timeout: float | None = 10.0):
        ray = require("ray", "al.init(cluster='ray')")
        for name, value in (("num_nodes", num_nodes), ("num_devices_per_node", num_devices_per_node)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"al.init(cluster='ray'): {name} must be an int >= 1, got {value!r}")
        platform = platform or ("gpu" if jax.default_backend() == "gpu" else "cpu")
        if platform not in PLATFORMS:
            raise ValueError(f"al.init(cluster='ray'): platform must be one of {PLATFORMS}, got {platform!r}")
        if step_timeout is not None and not _is_positive_seconds(step_timeout):
            raise ValueError(f"al.init(cluster='ray'): step_timeout must be > 0 seconds or None, got {step_timeout!r}")
        if ping_timeout is not None and not _is_positive_seconds(ping_timeout):
            raise ValueError(f"al.init(cluster='ray'): ping_timeout must be > 0 seconds or None, got {ping_timeout!r}")
        if not (_is_positive_seconds(startup_timeout) and math.isfinite(startup_timeout)):
            raise ValueError(f"al.init(cluster='ray'): startup_timeout must be a finite number of seconds > 0, got "
                             f"{startup_timeout!r}")
        self.started_ray = False
        address = address or os.environ.get("RAY_ADDRESS")
        if not ray.is_initialized():
            if address is None:
                start_local_ray(num_cpus=max(2, os.cpu_count() or 2), startup_timeout=startup_timeout)
            else:
                connect_ray(address)
            self.started_ray = True
        self.platform = platform
        try:
            alive = answering(not_silent([n for n in ray.nodes() if n.get("Alive")]))
            self.nodes, self.num_devices_per_node = choose_nodes(cluster_nodes(alive, platform), platform,
                                                                 num_nodes, num_devices_per_node)
            """The Ray nodes plans are made for (:mod:`~alpa_like.runtime.ray_nodes`): node ``k`` of a plan
            runs on ``nodes[k]``."""
        except BaseException:  # no backend object owns the Ray it started: stop it here
            if self.started_ray:
                ray.shutdown()
            raise
        self.num_nodes = len(self.nodes)
        gcs = ray.get_runtime_context().gcs_address
        self.head_watch = HeadWatch(gcs, head_text(self.nodes, gcs))
        """Probed while a step waits: a lost head fails the step at once (:class:`~.ray_nodes.HeadWatch`)."""
        self.step_timeout, self.ping_timeout = step_timeout, ping_timeout
        self.compilation_cache_dir = compilation_cache_dir
        self.startup_timeout = startup_timeout
        self._actors: dict[tuple[int, int, int], Any] = {}
        self._progress_files: dict[str, str] = {}
        self._pending_frees: dict[str, list[int]] = {}
        self._by_id: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._handles = itertools.count()
        self._exe_ids = itertools.count()
        self.temp_dir = tempfile.mkdtemp(prefix="alpa_like_ray_")
        """The workers' progress files; removed by :meth:`shutdown` (or when the backend is collected)."""
        self._remove_temp_dir = weakref.finalize(self, shutil.rmtree, self.temp_dir, ignore_errors=True)
        self._measured: ClusterSpec | None = None
        self.closed = False

    def wait_all(self, calls: Sequence[tuple[Any, Any]], what: str) -> list:
        """:func:`~.ray_nodes.wait_all` of (worker, call) pairs under this backend's step and ping timeouts."""
        return wait_all(calls, what, timeout=self.step_timeout, ping_timeout=self.ping_timeout, node_of=self.node_of)

    def node_of(self, actor) -> RayNode | None:
        """The Ray node a worker actor of this backend runs on."""
        return next((self.nodes[key[0]] for key, a in self._actors.items() if a is actor), None)

    def spec(self) -> ClusterSpec:
        """The cluster for the planner: this many nodes and devices, with measured device speed. GPU: the
        driver's first device (the workers run on the same kind of device). CPU: every device of the busiest
        machine busy at once (:func:`~alpa_like.runtime.ray_nodes.host_spec`; Ray nodes at one address share
        a machine), measured once per backend."""
        if self._measured is None:
            import ray
            self._measured = ClusterSpec.local(jax.devices()[:1]) if self.platform == "gpu" else host_spec(
                self.nodes, self.num_devices_per_node, driver_node_id=ray.get_runtime_context().get_node_id(),
                driver_devices=local_cpu_devices(), measure_on=functools.partial(
                    measure_on_node, xla_flags=os.environ.get("XLA_FLAGS", ""), timeout=self.startup_timeout))
        return dataclasses.replace(self._measured, name=f"ray-{self.platform}", num_nodes=self.num_nodes,
                                   num_devices_per_node=self.num_devices_per_node)

    # ------------------------------------------------------------------------------------------- actors

    def acquire(self, meshes: Sequence[tuple[int, int]]) -> list[Any]:
        """One actor per (node, device count) mesh, distinct within the list, pinned to ``nodes[node]``;
        reused across calls."""
        import ray
        used: dict[tuple[int, int], int] = {}
        actors, fresh = [], []
        for node, size in meshes:
            slot = used.get((node, size), 0)
            used[(node, size)] = slot + 1
            key = (node, size, slot)
            if key not in self._actors:
                self._actors[key] = self._start_actor(node, size, len(self._actors))
                fresh.append(key)
            actors.append(self._actors[key])
        if fresh:
            refs = [self._actors[k].info.remote() for k in fresh]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.startup_timeout)
            if len(ready) < len(refs):
                raise RuntimeError(f"Ray backend: {len(refs) - len(ready)} worker actor(s) did not start within "
                                   f"{self.startup_timeout:.0f} s (is the cluster big enough? "
                                   f"ray.cluster_resources()={ray.cluster_resources()})")
            for key, info in zip(fresh, ray.get(refs), strict=True):
                if info["num_devices"] < key[1]:
                    raise RuntimeError(f"Ray backend: the worker for node {key[0]} has {info['num_devices']} "
                                       f"devices, the mesh needs {key[1]}")
                if info["node_id"] != self.nodes[key[0]].node_id:
                    raise RuntimeError(f"Ray backend: the worker for {self.nodes[key[0]]} runs on Ray node "
                                       f"{info['node_id'][:8]}")
        return actors

    def _start_actor(self, node: int, size: int, number: int):
        import ray
        options: dict[str, Any] = {"max_concurrency": 16, "num_cpus": 0}
        env = {"PYTHONUNBUFFERED": "1"}
        if self.platform == "cpu":
            env.update(cpu_worker_env(size, os.environ.get("XLA_FLAGS", "")))
        else:  # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigns.
            options["num_gpus"] = size
        options["runtime_env"] = {"env_vars": env}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.nodes[node].node_id, soft=False)
        progress = os.path.join(self.temp_dir, f"worker{number}.progress")
        config = {"jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
                  "jax_enable_x64": jax.config.jax_enable_x64}
        if self.compilation_cache_dir:  # JAX's persistent cache: workers skip XLA compiles seen before
            config.update(jax_compilation_cache_dir=self.compilation_cache_dir,
                          jax_persistent_cache_min_compile_time_secs=0.0)
        actor = ray.remote(MeshWorker).options(**options).remote(config, progress)
        self._by_id[_actor_id(actor)] = actor
        self._progress_files[_actor_id(actor)] = progress
        return actor

    @property
    def actors(self) -> list[Any]:
        return list(self._actors.values())

    def progress_of(self, actor) -> tuple[int, int, int] | None:
        """(executable, step, instruction index) the worker last entered, from its progress file (None when
        the file is not readable from here, e.g. the worker ran on another node)."""
        path = self._progress_files.get(_actor_id(actor))
        try:
            values = np.fromfile(path, dtype=np.int64, count=3)
        except (OSError, TypeError, ValueError):
            return None
        return tuple(int(v) for v in values) if len(values) == 3 else None

    # ------------------------------------------------------------------------------------------ handles

    def new_handle(self) -> int:
        return next(self._handles)

    def new_executable_id(self) -> int:
        return next(self._exe_ids)

    def release(self, actor, handle: int) -> None:
        if self.closed:
            return
        with self._lock:
            pending = self._pending_frees.setdefault(_actor_id(actor), [])
            pending.append(handle)
            full = len(pending) >= FREE_BATCH
        if full:
            self.flush_frees()

    def take_frees(self, actor) -> list[int]:
        with self._lock:
            return self._pending_frees.pop(_actor_id(actor), [])

    def flush_frees(self) -> None:
        """Frees, now, every handle dropped on the driver (normally piggybacked on the next step)."""
        with self._lock:
            pending, self._pending_frees = self._pending_frees, {}
        for actor_id, handles in pending.items():
            if handles:
                self._by_id[actor_id].free.remote(handles)

    def fetch(self, actor, handle: int) -> np.ndarray:
        import ray
        if self.closed:
            raise RuntimeError("RemoteArray: its Ray backend was shut down (al.shutdown()); the data is gone")
        return ray.get(actor.fetch.remote(handle))

    def shutdown(self) -> None:
        """Kills every actor this backend made, removes its :attr:`temp_dir`, and shuts Ray down in this process
        when this backend started or connected it (a cluster started elsewhere keeps running)."""
        import ray
        self.closed = True
        for actor in self._actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  (already dead)
                pass
        self._actors.clear()
        self._remove_temp_dir()
        if self.started_ray:
            ray.shutdown()


def _is_positive_seconds(value) -> bool:
    """Whether ``value`` is a real number of seconds > 0 (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


class RayPipeshardExecutable:
    """A compiled pipeline step on the Ray backend: call it like the original function.

    A step returns the new values of its inputs (the state) as :class:`RemoteArray` s that stay on the
    workers, and its other outputs (metrics, the loss, aux values) as NumPy arrays the workers send back in
    their step reports. ``donate_flat``: the flat input leaves the step may donate (``donate_argnums``): each
    is donated by the last RUN that reads it on the mesh that loads it, and a :class:`RemoteArray` given for
    it is then :attr:`RemoteArray.donated` (a driver array was copied to the workers and stays valid).
    ``returned``: the outputs that come back as NumPy arrays (default: those that update no input).
    ``value_specs``: ``(value, mesh) -> spec``: the layout the plan gives a value a mesh loads or receives
    (the ILP's layout of what a stage reads or writes outside its layers; default: the activation layout).
    """

    def __init__(self, *, traced, plan, program: StageProgram, programs: MeshPrograms, input_specs: dict,
                 cluster: RayCluster, devices=None, donate_flat: Sequence[int] = (),
                 returned: frozenset[int] | None = None, stage_shardings: Sequence[StageSharding] | None = None,
                 defer_gradient_sync: bool = False, value_specs: dict | None = None):
        del devices  # The workers own the devices.
        self.traced, self.plan, self.program, self.programs = traced, plan, program, programs
        self.cluster = cluster
        self.num_micro_batches = plan.num_micro_batches
        self.mesh_nodes = mesh_nodes(plan, cluster.nodes, cluster.num_devices_per_node)
        """The plan's node of each mesh: mesh ``k`` runs on ``cluster.nodes[mesh_nodes[k]]``."""
        self.plan = plan = with_placements(plan, cluster.nodes, self.mesh_nodes)
        self.meshes = []
        for stage in plan.stages:
            grid = np.asarray(stage.device_ids).reshape(stage.logical_mesh_shape)
            self.meshes.append(MeshInfo(logical_shape=tuple(stage.logical_mesh_shape),
                                        device_ids=tuple(tuple(int(i) for i in row) for row in grid)))
        self.workers = cluster.acquire([(n, len(info.flat_ids)) for n, info in zip(self.mesh_nodes, self.meshes)])
        self._mesh_of_actor = {_actor_id(a): k for k, a in enumerate(self.workers)}
        self.exe_id = cluster.new_executable_id()
        deferral = GradientDeferral(program=program, stage_shardings=tuple(stage_shardings or ()))
        if defer_gradient_sync and stage_shardings:
            deferral = defer_gradients(program, stage_shardings, [m.logical_shape for m in self.meshes],
                                       programs.stage_to_mesh, mesh_load_spec(input_specs, value_specs, self.meshes))
        self.program = program = deferral.program
        self.deferred: dict[int, DeferredGradients] = dict(deferral.deferred)
        """Per stage, the gradients its backward piece outputs as stacks of partial sums, summed by the
        worker's MEAN once per step (as on the local backend)."""
        shipped, pinned = export_pieces(deferral, cluster.platform, self.num_micro_batches,
                                        [self.meshes[m].logical_shape for m in programs.stage_to_mesh])
        updated = updated_inputs(traced.in_leaves, traced.out_leaves)
        if returned is None:
            returned = frozenset(k for k, source in enumerate(updated)
                                 if source is None and programs.outputs[k] is not None)
        self._returned = returned
        """The outputs sent back in the step reports (by default those that update no input)."""
        donations = input_donations(programs, program, [program.step_inputs[k] for k in donate_flat])
        self.worker_programs = worker_programs(program, programs, self.meshes, input_specs, shipped,
                                               self.num_micro_batches, self._returned, donations,
                                               deferral.stack_specs, value_specs, updated, pinned)
        self._donated_on = {key[0]: p.mesh for p in self.worker_programs for keys in p.donations.values()
                            for key in keys}
        """Donated step input -> the mesh that donates it."""
        self.shipped_bytes = sum(len(pickle.dumps(p)) for p in self.worker_programs)
        refs = [w.load_program.remote(self.exe_id, p, self.workers)
                for w, p in zip(self.workers, self.worker_programs, strict=True)]
        self._wait(refs, "loading the stage programs", timeout=cluster.startup_timeout)
        self._loaders: dict[int, list[int]] = {}
        for ins in programs.instructions:
            if ins.op is Op.LOAD and ins.key[0] not in program.constants:
                meshes = self._loaders.setdefault(ins.key[0], [])
                if ins.mesh not in meshes:
                    meshes.append(ins.mesh)
        self._out_avals = [None if v is None else program.values[v].aval for v in program.step_outputs]
        self._steps = itertools.count()
        self.failed: str | None = None
        self.last_step = RayStepStats()
        weakref.finalize(self, _unload, self.cluster, self.workers, self.exe_id)

    def __call__(self, *args):
        return self.run(*args)

    def get_hlo_text(self) -> str:
        """The compiled HLO of every stage piece on its worker, for the layouts of its first run (a step must
        have run), as :meth:`~alpa_like.runtime.pipeshard_runtime.PipeshardExecutable.get_hlo_text` gives it."""
        texts = self._wait([w.hlo_text.remote(self.exe_id) for w in self.workers], "compiling the HLO texts",
                           timeout=self.cluster.step_timeout)
        if not any(texts):
            raise RuntimeError("get_hlo_text: run one step first (stage pieces compile on the first step)")
        return "\n".join(t for t in texts if t)

    # ------------------------------------------------------------------------------------------- a step

    def run(self, *args, profile: bool = False):
        """One step: one ``run_step`` call per worker; returns the outputs as :class:`RemoteArray` s. With
        ``profile`` every worker waits for each instruction and times it (:attr:`RayStepStats.spans`)."""
        if self.cluster.closed:
            raise RuntimeError("this executable's Ray backend was shut down; call the parallelized function "
                               "again after al.init(cluster='ray') to recompile")
        if self.failed:
            raise RuntimeError(f"this executable failed earlier ({self.failed}); call al.shutdown() and "
                               "al.init(cluster='ray') to start new workers")
        start = time.perf_counter()
        flat = self.traced.flatten_args(args)
        for x, leaf in zip(flat, self.traced.in_leaves, strict=True):
            if isinstance(x, RemoteArray) and x.donated:
                raise ValueError(f"argument leaf {leaf.path} is a RemoteArray donated to an earlier step "
                                 "(donate_argnums): its data is gone; pass the value that step returned (after a "
                                 "step interrupted once it donated its inputs, restore the last checkpoint)")
        stats = RayStepStats()
        step = next(self._steps)
        inputs, handle_sends, sent = self._route_inputs(flat, stats)
        out_handles: list[list[int]] = [[] for _ in self.workers]
        remote: dict[int, list[tuple[Any, int]]] = {}  # output index -> its replicas
        for mesh, wp in enumerate(self.worker_programs):
            for k, _ in wp.outputs:
                handle = self.cluster.new_handle()
                out_handles[mesh].append(handle)
                remote.setdefault(k, []).append((self.workers[mesh], handle))
        refs = []
        for k, worker in enumerate(self.workers):
            call = (self.exe_id, step, inputs[k], out_handles[k], handle_sends[k], self.cluster.take_frees(worker))
            sent += len(pickle.dumps(call))
            refs.append(worker.run_step.remote(*call, profile=profile))
        stats.driver_calls = len(refs)
        try:
            reports = self._wait(refs, f"step {step}", timeout=self.cluster.step_timeout, step=step)
        except RayStepError:
            raise
        except BaseException:  # a KeyboardInterrupt: the workers would go on with the step
            try:
                self._stop_interrupted(step, refs, flat, out_handles)
            except Exception:  # noqa: BLE001  (a worker lost meanwhile: the executable stays failed)
                pass
            raise
        stats.driver_received_bytes = sum(len(pickle.dumps(r)) for r in reports)
        stats.driver_received_types = tuple(sorted({type(v).__name__ for r in reports
                                                    for key, v in r.items() if key not in ("outputs", "spans")}))
        stats.driver_sent_bytes = sent
        stats.worker_bytes = sum(r["bytes_sent"] for r in reports)
        stats.input_bytes = sum(r["input_bytes_sent"] for r in reports)
        stats.worker_seconds = tuple(r["seconds"] for r in reports)
        stats.donated_buffers = sum(r["donated_buffers"] for r in reports)
        stats.input_relayouts = sum(r["input_relayouts"] for r in reports)
        for r in reports:
            for text, begin, end in r.get("spans", ()):
                stats.spans.append((r["mesh"], text, begin, end))
                kind = text.split()[0]
                stats.op_seconds[kind] = stats.op_seconds.get(kind, 0.0) + end - begin
        self._mark_donated(flat, inputs)
        values = {k: from_host(v) for r in reports for k, v in r["outputs"].items()}
        results = [values[k] if k in values else self.program.literal_outputs[k] if k not in remote else
                   RemoteArray(self._out_avals[k].shape, self._out_avals[k].dtype, remote[k], self.cluster)
                   for k in range(len(self.programs.outputs))]
        stats.seconds = time.perf_counter() - start
        self.last_step = stats
        return jax.tree_util.tree_unflatten(self.traced.out_tree, results)

    def _mark_donated(self, flat: Sequence[Any], inputs: list[dict]) -> None:
        """Marks the RemoteArrays this step donated and frees their replicas (the donating worker dropped the
        one it loaded in place)."""
        for v, x in zip(self.program.step_inputs, flat, strict=True):
            mesh = self._donated_on.get(v)
            if mesh is None or not isinstance(x, RemoteArray):
                continue
            loaded = inputs[mesh].get(v)
            x.mark_donated(lambda actor, handle: loaded == ("handle", handle)
                           and self._mesh_of_actor.get(_actor_id(actor)) == mesh)

    def _stop_interrupted(self, step: int, refs: list, flat: Sequence[Any], out_handles: list[list[int]]) -> None:
        """After the driver's wait for ``step`` was interrupted: aborts the step on every worker and waits for
        them to stop, so the next call starts from the same inputs. Inputs the step donated before it stopped
        (their data is gone) are marked donated, and its outputs are dropped. Workers that do not stop within
        :data:`ABORT_GRACE_SECONDS` (or a second interruption, or an error on the way) leave the executable
        failed."""
        import ray
        self.failed = f"step {step} was interrupted while its workers ran it"
        for worker in self.workers:
            worker.abort.remote(self.exe_id, step)
        _, running = ray.wait(refs, num_returns=len(refs), timeout=ABORT_GRACE_SECONDS)
        if running:
            self.failed += f", and {len(running)} worker(s) did not stop within {ABORT_GRACE_SECONDS:.0f} s"
            return
        for worker, handles in zip(self.workers, out_handles, strict=True):
            for handle in handles:
                self.cluster.release(worker, handle)
        arrays = [x for x in flat if isinstance(x, RemoteArray) and x.replicas]
        held: dict[str, tuple[Any, list[int]]] = {}  # actor id -> (actor, the input handles it should hold)
        for x in arrays:
            for actor, handle in x.replicas:
                held.setdefault(_actor_id(actor), (actor, []))[1].append(handle)
        gone = dict(zip(held, ray.get([actor.missing.remote(handles) for actor, handles in held.values()]),
                        strict=True))
        for x in arrays:
            if any(handle in gone[_actor_id(actor)] for actor, handle in x.replicas):
                x.mark_donated()
        self.failed = None

    def _route_inputs(self, flat: Sequence[Any], stats: RayStepStats):
        """Per worker: how it gets each input it LOADs; per worker: the stored arrays it sends to peers."""
        import ray
        inputs: list[dict] = [dict() for _ in self.workers]
        handle_sends: list[list] = [[] for _ in self.workers]
        sent = 0
        kinds = {"ref": 0, "handle": 0, "peer": 0}
        routes: dict[int, tuple[str, ...]] = {}
        for index, (v, x) in enumerate(zip(self.program.step_inputs, flat, strict=True)):
            loaders = self._loaders.get(v)
            if not loaders:
                continue
            here: dict[int, int] = {}  # mesh of this executable -> handle of its replica
            if isinstance(x, RemoteArray):
                if x._cluster is not self.cluster or self.cluster.closed:
                    raise ValueError(f"a step input is a RemoteArray of another (shut down) Ray backend: {x!r}")
                for actor, handle in x.replicas:
                    mesh = self._mesh_of_actor.get(_actor_id(actor))
                    if mesh is not None:
                        here.setdefault(mesh, handle)
                if not here:  # made by an executable on other workers: goes through the driver
                    x = x.fetch()
            if not here:
                is_key = jax_compat.is_prng_key(getattr(x, "dtype", np.float32))  # sent as data + impl name
                payload = list(jax_compat.key_data_and_impl(x)) if is_key else [np.asarray(x)]
                ref = ray.put(payload[0])
                sent += payload[0].nbytes
                for k in loaders:
                    inputs[k][v] = ("ref", [ref, *payload[1:]])
                kinds["ref"] += 1
                routes[index] = ("ref",) * len(loaders)
                continue
            holder = min(here)
            for k in loaders:
                if k in here:
                    inputs[k][v] = ("handle", here[k])
                    kinds["handle"] += 1
                else:
                    inputs[k][v] = ("peer", None)
                    handle_sends[holder].append((here[holder], k, v))
                    kinds["peer"] += 1
            routes[index] = tuple(inputs[k][v][0] for k in loaders)
        stats.inputs_by_kind, stats.input_routes = kinds, routes
        return inputs, handle_sends, sent

    def _wait(self, refs: list, what: str, *, timeout: float | None, step: int | None = None) -> list:
        """Waits for one ref per worker; turns a raising or dead worker into a RayStepError naming the mesh
        and the instruction (and aborts the others), a timeout into one naming where each worker is."""
        import ray
        pending = dict(zip(refs, range(len(refs))))
        results: list[Any] = [None] * len(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        pings = None if self.cluster.ping_timeout is None else ray_pings(self.workers, self.cluster.ping_timeout)
        while pending:
            wait = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not ready and (lost := self.cluster.head_watch.lost()):  # no Ray call answers: do not abort
                self.failed = f"Ray backend: {what}: {lost}"
                raise RayStepError(self.failed)
            for ref in ready:
                mesh = pending.pop(ref)
                try:
                    results[mesh] = ray.get(ref)
                except Exception as e:  # noqa: BLE001  (classified below)
                    self._fail(step, self._root_cause(mesh, e, pending, step, what))
            if pending and pings is not None and (silent := pings.silent(sorted(pending.values()))):
                mesh, seconds, last = silent
                worker = silent_worker(f"the worker of mesh {mesh}", self.cluster.nodes[self.mesh_nodes[mesh]],
                                       seconds, last)
                self._fail(step, f"Ray backend: {what}: {worker}")
            if pending and deadline is not None and time.monotonic() > deadline:
                where = "; ".join(f"mesh {k}: {self._where(self.workers[k])}" for k in sorted(pending.values()))
                self._fail(step, f"{what} did not finish within {timeout:.0f} s ({where})")
        return results

    def _root_cause(self, mesh: int, error: Exception, pending: dict, step: int | None, what: str) -> str:
        """The message of the failure that caused the others: a worker's error can be a consequence of a
        peer's death (its parcel is lost), so the other workers get a moment to report, and a dead worker,
        then an error of the worker's own, win over transfer errors."""
        import ray
        errors = [(mesh, error)]
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001
                errors.append((pending[ref], e))

        def rank(item):
            e = item[1]
            if isinstance(e, ray.exceptions.RayActorError):
                return 0
            cause = getattr(e, "cause", None)
            consequence = isinstance(cause, WorkerStepError) and cause.cause.split(":")[0] in _CONSEQUENCES
            return 2 if consequence else 1
        mesh, error = min(errors, key=rank)
        return self._describe_failure(mesh, error, step, what)

    def _describe_failure(self, mesh: int, error: Exception, step: int | None, what: str) -> str:
        import ray
        cause = getattr(error, "cause", None)
        if isinstance(cause, WorkerStepError):
            return f"Ray backend: {what} failed on {cause}"
        if isinstance(error, ray.exceptions.RayActorError):  # ActorUnavailableError too: a killed raylet's first
            node = self.cluster.nodes[self.mesh_nodes[mesh]]
            how = "became unreachable" if isinstance(error, ray.exceptions.ActorUnavailableError) else "died"
            at = died_at(self.cluster.progress_of(self.workers[mesh]), self.exe_id, step,
                         self.worker_programs[mesh].instructions)
            return (f"Ray backend: {what}: the worker of mesh {mesh} on {node} {how} {at}: {type(error).__name__} "
                    f"(a lost node, or a killed worker process; al.shutdown() and al.init(cluster='ray') start "
                    "afresh on the nodes alive)")
        return f"Ray backend: {what} failed on mesh {mesh}: {type(error).__name__}: {error}"

    def _where(self, worker) -> str:
        import ray
        try:
            return ray.get(worker.where.remote(), timeout=2.0)
        except Exception as e:  # noqa: BLE001
            return f"unreachable ({type(e).__name__})"

    def _fail(self, step: int | None, message: str):
        import ray
        self.failed = message
        if step is not None:
            refs = []
            for worker in self.workers:
                try:
                    refs.append(worker.abort.remote(self.exe_id, step))
                except Exception:  # noqa: BLE001  (dead worker)
                    pass
            ray.wait(refs, num_returns=len(refs), timeout=ABORT_GRACE_SECONDS)
        raise RayStepError(message)

    def input_placements(self) -> tuple[dict[int, ShardingSpec], ...]:
        """Per flat input leaf (``traced.in_leaves``), the meshes that load it, each with the layout its LOAD
        puts it in there (in the order of their first LOAD); empty for a leaf no mesh reads."""
        from alpa_like.runtime.ray_worker import load_spec
        programs, meshes = self.worker_programs, self.meshes
        return tuple({m: load_spec(programs[m].input_specs, v, leaf.shape, meshes[m].logical_shape)
                      for m in self._loaders.get(v, ())}
                     for v, leaf in zip(self.program.step_inputs, self.traced.in_leaves, strict=True))

    def worker_handles(self) -> list[int]:
        """How many arrays each worker holds (step outputs not yet dropped)."""
        import ray
        return ray.get([w.num_handles.remote() for w in self.workers])


def from_host(value) -> np.ndarray | jax.Array:
    """A value a worker sent (:func:`~alpa_like.runtime.ray_worker.host_value`) as the driver returns it: a
    writable NumPy array, or a ``jax.random.key`` array for a typed PRNG key."""
    if isinstance(value, tuple):
        return jax.random.wrap_key_data(value[0], impl=value[1])
    return np.array(value)


def _unload(cluster, workers, exe_id: int) -> None:
    """Drops an executable's programs on its workers, unless the backend is shut down (a remote call would
    then start a new local Ray, e.g. at interpreter exit)."""
    import ray
    if cluster.closed or not ray.is_initialized():
        return
    for w in workers:
        try:
            w.unload_program.remote(exe_id)
        except Exception:  # noqa: BLE001  (Ray is gone)
            pass


