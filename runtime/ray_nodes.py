"""The nodes of a Ray cluster as the planner and the Ray backend see them, and where each mesh of a plan runs.

``al.init(cluster="ray")`` reads the cluster's alive nodes (``ray.nodes()``) once:

* a node counts when the GCS lists it alive and its raylet accepts a connection (:func:`answering`: the GCS
  lists a lost node as alive until its health checks fail, tens of seconds later);
* a node's devices come from its Ray resources: ``GPU`` on the ``"gpu"`` platform, ``CPU`` on ``"cpu"``
  (``ray start --num-cpus N``: N virtual XLA CPU devices); nodes with none (e.g. a GPU cluster's CPU-only head)
  are left out;
* nodes are numbered head first, then by address and node id, so a plan's node ``k`` is the same Ray node for
  every executable of the backend;
* the planner's :class:`~alpa_like.compiler.cluster.ClusterSpec` has ``num_nodes`` of them (default: all) and
  ``num_devices_per_node`` devices each (default: the fewest any of them has);
* on CPU, nodes at one address share one machine's cores and memory: the spec's device speed is that of a
  device while every plan device of the busiest machine is busy (:func:`host_spec`), so that the nodes of a
  machine, each computing with its devices' share (the simulator's node clocks), add up to the machine.

A plan's device ``d`` is on node ``d // num_devices_per_node`` of its cluster (as the stage DP numbers them,
:mod:`~alpa_like.compiler.submesh`); :func:`mesh_nodes` gives the node of every stage's mesh and refuses a
plan that needs more nodes or devices than the Ray cluster has. An automatic stage option plans one-node
meshes only (:func:`one_node_meshes`). The backend pins each mesh's actor to its node
(``NodeAffinitySchedulingStrategy``, not soft) and prints the node in ``exe.plan`` (:func:`with_placements`).

Losses: a lost worker node's workers die with it; where each was comes from its progress record
(:func:`died_at`). A lost head takes the GCS with it (actors, objects and the node table), so no Ray call of
the driver answers any more: the backend's waits probe the GCS's port (:class:`HeadWatch`) and fail fast,
naming the head.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.options import AutoStageOption
from alpa_like.compiler.plan import ParallelPlan, StagePlan
from alpa_like.compiler.submesh import submesh_shapes

DEVICE_RESOURCES = {"cpu": "CPU", "gpu": "GPU"}
"""The Ray resource that counts a node's devices, per platform."""
HEAD_RESOURCE = "node:__internal_head__"
"""The resource Ray gives the head node only."""
PROBE_SECONDS = 2.0
"""How long :func:`answering` waits for a raylet to accept a connection."""
HEAD_CHECK_SECONDS = 2.0
"""How often a :class:`HeadWatch` probes the GCS while the driver waits."""
PING_SECONDS = 1.0
"""How often :class:`WorkerPings` asks a worker the driver waits for what it is doing."""
SILENT_SECONDS = 120.0
"""How long :func:`not_silent` leaves out a node where a worker left a ping unanswered (Ray's health checks mark
a lost node dead within it)."""
_silent_since: dict[str, float] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayNode:
    """One node of the Ray cluster, as the backend uses it."""

    index: int
    """The node's number in the plan's cluster (device ``d`` of a plan is on node ``d // devices per node``)."""
    node_id: str
    """Ray's node id (hex)."""
    address: str
    """The node's IP address (``NodeManagerAddress``)."""
    num_devices: int
    """Devices the node offers (its ``GPU`` or ``CPU`` resource)."""
    is_head: bool = False

    def __str__(self) -> str:
        return f"Ray node {self.index} ({self.address}, id {self.node_id[:8]}{', head' if self.is_head else ''})"


def node_devices(resources: Mapping[str, float], platform: str) -> int:
    """The devices a node with Ray ``resources`` offers on ``platform`` (:data:`DEVICE_RESOURCES`)."""
    if platform not in DEVICE_RESOURCES:
        raise ValueError(f"platform must be one of {tuple(DEVICE_RESOURCES)}, got {platform!r}")
    return int(resources.get(DEVICE_RESOURCES[platform], 0))


def answering(nodes: Sequence[Mapping[str, Any]], timeout: float = PROBE_SECONDS,
              connect: Callable[..., Any] = socket.create_connection) -> list[Mapping[str, Any]]:
    """The nodes of ``ray.nodes()`` whose raylet accepts a TCP connection (at ``NodeManagerAddress:
    NodeManagerPort``) within ``timeout`` seconds, probed in parallel; a node without that address is kept.

    Ray's GCS marks a node dead only after its health checks fail (tens of seconds by default), so right after
    a node is lost ``ray.nodes()`` still lists it as alive; ``al.init`` must not plan for it.
    """
    def answers(node) -> bool:
        if "NodeManagerPort" not in node or "NodeManagerAddress" not in node:
            return True
        try:
            connect((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout).close()
            return True
        except OSError:
            return False
    if not nodes:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        return [n for n, ok in zip(nodes, pool.map(answers, nodes), strict=True) if ok]


def cluster_nodes(nodes: Sequence[Mapping[str, Any]], platform: str) -> tuple[RayNode, ...]:
    """The alive nodes of ``ray.nodes()`` that have devices on ``platform``, numbered head first, then by
    address and node id.

    >>> nodes = [{"Alive": True, "NodeID": "bb", "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 4.0}},
    ...          {"Alive": False, "NodeID": "cc", "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 4.0}},
    ...          {"Alive": True, "NodeID": "aa", "NodeManagerAddress": "10.0.0.1",
    ...           "Resources": {"CPU": 2.0, HEAD_RESOURCE: 1.0}}]
    >>> [str(n) for n in cluster_nodes(nodes, "cpu")]
    ['Ray node 0 (10.0.0.1, id aa, head)', 'Ray node 1 (10.0.0.2, id bb)']
    >>> cluster_nodes(nodes, "gpu")
    ()
    """
    alive = [n for n in nodes if n.get("Alive")]
    usable = [n for n in alive if node_devices(n.get("Resources", {}), platform) > 0]
    usable.sort(key=lambda n: (HEAD_RESOURCE not in n.get("Resources", {}), n.get("NodeManagerAddress", ""),
                               n["NodeID"]))
    return tuple(RayNode(index=k, node_id=n["NodeID"], address=n.get("NodeManagerAddress", "?"),
                         num_devices=node_devices(n.get("Resources", {}), platform),
                         is_head=HEAD_RESOURCE in n.get("Resources", {}))
                 for k, n in enumerate(usable))


def choose_nodes(nodes: Sequence[RayNode], platform: str, num_nodes: int | None = None,
                 num_devices_per_node: int | None = None) -> tuple[tuple[RayNode, ...], int]:
    """The nodes plans are made for and the devices per node: the first ``num_nodes`` of ``nodes`` (default:
    all), each with ``num_devices_per_node`` devices (default: the fewest any of them offers).

    On ``"cpu"`` an explicit ``num_devices_per_node`` may exceed a node's ``CPU`` resource (the devices are
    virtual XLA CPU devices); on ``"gpu"`` it may not.

    Raises:
      ValueError: naming both counts, when the cluster has no node with devices, fewer nodes than
        ``num_nodes``, or (on GPU) a chosen node with fewer devices than ``num_devices_per_node``.
    """
    resource = DEVICE_RESOURCES[platform]
    if not nodes:
        raise ValueError(f"al.init(cluster='ray'): the Ray cluster has no alive node with {resource} resources "
                         f"(platform={platform!r})")
    wanted = len(nodes) if num_nodes is None else num_nodes
    if wanted > len(nodes):
        raise ValueError(f"al.init(cluster='ray'): num_nodes={wanted}, but the Ray cluster has {len(nodes)} alive "
                         f"nodes with {resource} resources")
    chosen = tuple(nodes[:wanted])
    fewest = min(chosen, key=lambda n: n.num_devices)
    per_node = fewest.num_devices if num_devices_per_node is None else num_devices_per_node
    if platform == "gpu" and per_node > fewest.num_devices:
        raise ValueError(f"al.init(cluster='ray'): num_devices_per_node={per_node}, but {fewest} has "
                         f"{fewest.num_devices} GPUs")
    return chosen, per_node


def busiest_host(nodes: Sequence[RayNode], num_devices_per_node: int) -> tuple[RayNode, int]:
    """The first of ``nodes`` on the machine that runs the most plan devices, and that count: nodes at one
    :attr:`RayNode.address` share a machine, each running ``num_devices_per_node`` devices of the plans.

    >>> nodes = [RayNode(index=k, node_id=f"n{k}", address=a, num_devices=2)
    ...          for k, a in enumerate(["10.0.0.1", "10.0.0.2", "10.0.0.2"])]
    >>> node, devices = busiest_host(nodes, 2)
    >>> (node.index, devices)
    (1, 4)
    """
    if not nodes:
        raise ValueError("busiest_host: no nodes")
    per_address = collections.Counter(n.address for n in nodes)
    address = max(per_address, key=per_address.__getitem__)  # ties: the first address in ``nodes`` order
    return next(n for n in nodes if n.address == address), per_address[address] * num_devices_per_node


def host_spec(nodes: Sequence[RayNode], num_devices_per_node: int, *, driver_node_id: str | None,
              driver_devices: Sequence[Any], measure_on: Callable[[RayNode, int], ClusterSpec],
              local: Callable[[tuple[Any, ...]], ClusterSpec] = ClusterSpec.local) -> ClusterSpec:
    """The measured CPU devices of a Ray cluster: :meth:`ClusterSpec.local` of as many XLA CPU devices as the
    busiest machine runs (:func:`busiest_host`), all busy at once, so every speed is per device while the
    machine's cores and memory are shared by all of them.

    Measured on the driver's ``driver_devices`` (its CPU devices) when the driver's Ray node
    (``driver_node_id``) is on that machine and has that many, else by ``measure_on(node, count)`` on the
    machine's first node (:func:`measure_on_node`). ``local``: the driver's measurement (for tests).
    """
    node, count = busiest_host(nodes, num_devices_per_node)
    on_host = any(n.node_id == driver_node_id and n.address == node.address for n in nodes)
    cpus = tuple(d for d in driver_devices if d.platform == "cpu")
    if on_host and len(cpus) >= count:
        return local(cpus[:count])
    return measure_on(node, count)


def local_cpu_devices() -> tuple[Any, ...]:
    """This process's XLA CPU devices (none where JAX runs without its CPU backend)."""
    import jax
    try:
        return tuple(jax.devices("cpu"))
    except RuntimeError:
        return ()


def cpu_worker_env(num_devices: int, xla_flags: str) -> dict[str, str]:
    """The environment of a worker process with ``num_devices`` XLA CPU devices: the driver's ``xla_flags``
    with its device count replaced (set before the worker imports jax)."""
    flags = " ".join(f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={num_devices}".strip(),
            "JAX_PLATFORMS": "cpu"}


def measure_on_node(node: RayNode, num_devices: int, *, xla_flags: str, timeout: float) -> ClusterSpec:
    """:meth:`ClusterSpec.local` of ``num_devices`` XLA CPU devices, measured by a Ray task pinned to ``node``
    (stored on that machine like any local measurement, so a later call reads it back).

    Raises:
      RuntimeError: the task did not finish within ``timeout`` seconds.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    task = ray.remote(_measure_local).options(
        num_cpus=0, runtime_env={"env_vars": cpu_worker_env(num_devices, xla_flags)},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
    ref = task.remote(num_devices)
    ready, _ = ray.wait([ref], timeout=timeout)
    if not ready:
        ray.cancel(ref, force=True)
        raise RuntimeError(f"Ray backend: measuring {num_devices} CPU devices on {node} took over {timeout:.0f} s")
    return ClusterSpec.from_dict(ray.get(ref))


def _measure_local(num_devices: int) -> dict[str, Any]:
    import jax
    return ClusterSpec.local(tuple(jax.devices()[:num_devices])).to_dict()


def mesh_nodes(plan: ParallelPlan, nodes: Sequence[RayNode], num_devices_per_node: int) -> tuple[int, ...]:
    """The node of each stage's mesh: device ``d`` of the plan is on node ``d // M``, ``M`` the devices per node
    of the plan's cluster.

    Raises:
      ValueError: naming both counts, when the plan's cluster has more nodes than ``nodes`` or more devices per
        node than ``num_devices_per_node`` (the Ray backend's).
      NotImplementedError: a stage's mesh spans nodes (one actor runs a mesh; a multi-host mesh would need
        ``jax.distributed``).
    """
    cluster = plan.cluster
    if cluster.num_nodes > len(nodes):
        raise ValueError(f"Ray backend: the plan needs {cluster.num_nodes} nodes, but the Ray cluster has "
                         f"{len(nodes)} (al.init(cluster='ray', num_nodes=...))")
    if cluster.num_devices_per_node > num_devices_per_node:
        raise ValueError(f"Ray backend: the plan needs {cluster.num_devices_per_node} devices per node, but the "
                         f"Ray backend's nodes have {num_devices_per_node}")
    return tuple(_stage_node(q, stage, cluster.num_devices_per_node) for q, stage in enumerate(plan.stages))


def _stage_node(q: int, stage: StagePlan, per_node: int) -> int:
    node_ids = sorted({i // per_node for i in stage.device_ids})
    if len(node_ids) != 1:
        raise NotImplementedError(
            f"Ray backend: stage {q}'s mesh {stage.submesh_shape} spans nodes {node_ids}; a mesh must fit on one "
            f"node (one actor per mesh; multi-host meshes need jax.distributed): give one-node submesh shapes "
            f"(n = 1, m <= {per_node}) to ManualStageOption or AutoStageOption(submesh_shapes=...)")
    return node_ids[0]


def one_node_meshes(method: Any, cluster: ClusterSpec) -> Any:
    """``method`` as the Ray backend plans it on ``cluster``: an ``AutoStageOption`` that lists no submesh shapes
    of its own gets the one-node shapes ``(1, 1), (1, 2), ..., (1, M)``, since one actor runs each mesh on one
    node; any other method, and any cluster of one node, is returned as it is."""
    stage = getattr(method, "stage_option", None)
    if cluster.num_nodes == 1 or not isinstance(stage, AutoStageOption) or stage.submesh_shapes is not None:
        return method
    shapes = submesh_shapes(1, cluster.num_devices_per_node)
    return dataclasses.replace(method, stage_option=dataclasses.replace(stage, submesh_shapes=shapes))


def with_placements(plan: ParallelPlan, nodes: Sequence[RayNode], stage_nodes: Sequence[int]) -> ParallelPlan:
    """``plan`` with each stage's :attr:`~alpa_like.compiler.plan.StagePlan.placement` naming its Ray node."""
    stages = tuple(dataclasses.replace(s, placement=str(nodes[k])) for s, k in zip(plan.stages, stage_nodes,
                                                                                    strict=True))
    return dataclasses.replace(plan, stages=stages)


def died_at(progress: tuple[int, int, int] | None, exe_id: int, step: int | None,
            instructions: Sequence[Any]) -> str:
    """Where a lost worker was, from its progress record (executable, step, instruction index): the
    instruction of ``step`` it had entered, else between steps, else unknown."""
    if progress is None or progress[0] != exe_id:
        return "(instruction unknown: no progress record of this executable readable from the driver)"
    if progress[1] == step and progress[2] >= 0:
        return f"at instruction #{progress[2]} `{instructions[progress[2]]}`"
    if step is not None and progress[1] < step:
        return f"before its first instruction of step {step} (it had entered #{progress[2]} of step {progress[1]})"
    return "(instruction unknown)"


def head_text(nodes: Sequence[RayNode], gcs_address: str) -> str:
    """The head as messages name it: its :class:`RayNode` when the plans use it, and its GCS address."""
    head = next((n for n in nodes if n.is_head), None)
    return f"the head node ({head}, GCS at {gcs_address})" if head else f"the head node (GCS at {gcs_address})"


class HeadWatch:
    """Whether the Ray cluster's head still answers: its GCS port accepts a TCP connection within ``timeout``
    seconds. :meth:`lost` probes at most every ``every`` seconds (else it answers None at once).

    Args:
      gcs_address: ``"host:port"`` of the GCS (``ray.get_runtime_context().gcs_address``).
      head: how messages name the head (:func:`head_text`).
    """

    def __init__(self, gcs_address: str, head: str, *, every: float = HEAD_CHECK_SECONDS,
                 timeout: float = PROBE_SECONDS, connect: Callable[..., Any] = socket.create_connection,
                 clock: Callable[[], float] = time.monotonic):
        host, _, port = gcs_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"HeadWatch: gcs_address must be 'host:port', got {gcs_address!r}")
        self.where, self.head = (host.strip("[]"), int(port)), head
        self.every, self.timeout, self.connect, self.clock = every, timeout, connect, clock
        self._next = clock() + every

    def lost(self) -> str | None:
        """None while the head answers (or before the next probe is due), else a message naming the head."""
        now = self.clock()
        if now < self._next:
            return None
        self._next = now + self.every
        try:
            self.connect(self.where, timeout=self.timeout).close()
            return None
        except OSError as e:
            return (f"{self.head} does not answer ({type(e).__name__}: {e}): the Ray cluster is gone with its GCS, "
                    "and with it every worker and object of this job; the driver cannot continue. Start the "
                    "cluster again, then al.init(cluster='ray', address=...) and restore the last checkpoint (a "
                    "driver on the head machine is lost with it; Ray ends a driver whose GCS stays unreachable "
                    "for 60 s)")


class WorkerPings:
    """Whether the workers the driver waits for still answer: a lost machine that closes no connection (its
    power or network gone, its processes stopped) leaves a step waiting until Ray's health checks mark its
    node dead, about a minute by default, while a ping finds it in ``timeout`` seconds.

    Each :meth:`silent` call pings (``send(mesh)``: a worker's ``where``) every given mesh that has no ping
    out and whose last ping answered (at first: the watch started) at least ``every`` seconds ago, so a wait
    shorter than ``every`` sends none, and names the first mesh whose ping has gone unanswered for ``timeout``
    seconds. A ping that fails (a dead worker) ends that mesh's pings: the step's own call reports the death.
    ``collect(handles)``: the answered handles among ``handles``, each with its answer (a string) or the
    exception it raised.
    """

    def __init__(self, send: Callable[[int], Any], collect: Callable[[list], dict[Any, Any]], *, timeout: float,
                 every: float = PING_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.send, self.collect = send, collect
        self.timeout, self.every, self.clock = timeout, every, clock
        self._out: dict[int, tuple[Any, float]] = {}  # mesh -> (handle, sent at)
        self._answered: dict[int, tuple[str, float]] = {}  # mesh -> (last answer, answered at)
        self._start = clock()
        self._dead: set[int] = set()

    def silent(self, meshes: Sequence[int]) -> tuple[int, float, str] | None:
        """(mesh, seconds its ping is out, its last answer or ``"no answer yet"``) for the first of ``meshes``
        silent for ``timeout`` seconds, else None (after sending the pings that are due)."""
        now = self.clock()
        out = {handle: mesh for mesh, (handle, _) in self._out.items()}
        for handle, answer in (self.collect(list(out)) if out else {}).items():
            mesh = out[handle]
            del self._out[mesh]
            if isinstance(answer, BaseException):
                self._dead.add(mesh)
            else:
                self._answered[mesh] = (answer, now)
        for mesh in meshes:
            if mesh in self._out:
                waited = now - self._out[mesh][1]
                if waited >= self.timeout:
                    return mesh, waited, self._answered.get(mesh, ("no answer yet", 0.0))[0]
            elif mesh not in self._dead and now - self._answered.get(mesh, ("", self._start))[1] >= self.every:
                self._out[mesh] = (self.send(mesh), now)
        return None


def mark_silent(node_id: str, clock: Callable[[], float] = time.monotonic) -> None:
    """Records that a worker on Ray node ``node_id`` left a ping unanswered (:class:`WorkerPings`)."""
    _silent_since[node_id] = clock()


def not_silent(nodes: Sequence[Mapping[str, Any]], clock: Callable[[], float] = time.monotonic
               ) -> list[Mapping[str, Any]]:
    """The nodes of ``ray.nodes()`` where no worker of this process left a ping unanswered in the last
    :data:`SILENT_SECONDS`: a frozen machine still accepts connections (:func:`answering`) and Ray lists it as
    alive until its health checks fail. Warns naming each node left out."""
    now, kept = clock(), []
    for node in nodes:
        since = _silent_since.get(node.get("NodeID", ""))
        if since is not None and now - since < SILENT_SECONDS:
            warnings.warn(f"al.init(cluster='ray'): Ray node {node['NodeID'][:8]} "
                          f"({node.get('NodeManagerAddress', '?')}) is left out: a worker there left a ping "
                          f"unanswered {now - since:.0f} s ago (a frozen or unreachable machine Ray has not marked "
                          f"dead yet; it is counted again after {SILENT_SECONDS:.0f} s)", stacklevel=4)
        else:
            kept.append(node)
    return kept


def silent_worker(who: str, node: RayNode | None, seconds: float, last: str) -> str:
    """What a wait says of a worker (``who``) on ``node`` that left a ping unanswered for ``seconds``, its last
    answer ``last`` (:meth:`WorkerPings.silent`); records the node (:func:`mark_silent`)."""
    if node is not None:
        mark_silent(node.node_id)
    return (f"{who} on {node or 'an unknown node'} has not answered a ping for {seconds:.0f} s (its last answer: "
            f"{last}): a frozen or unreachable machine (power or network lost, processes stopped); al.shutdown() "
            "and al.init(cluster='ray') start afresh on the nodes alive")


def wait_all(calls: Sequence[tuple[Any, Any]], what: str, *, timeout: float | None, ping_timeout: float | None,
             node_of: Callable[[Any], RayNode | None]) -> list:
    """The results of ``calls`` ((worker actor, object ref of a call to it) pairs), in order, once every one is
    ready.

    Raises:
      RuntimeError: some are not ready within ``timeout`` seconds (``None``: no limit), or a worker that still
        owes its result leaves a ping unanswered for ``ping_timeout`` seconds (:class:`WorkerPings`; ``None``:
        no pings); ``node_of(worker)`` is where it runs (:func:`silent_worker`).
    """
    import ray
    workers = [worker for worker, _ in calls]
    pending = {ref: k for k, (_, ref) in enumerate(calls)}
    pings = None if ping_timeout is None else ray_pings(workers, ping_timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = PING_SECONDS if deadline is None else min(PING_SECONDS, max(0.0, deadline - time.monotonic()))
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=left)
        for ref in ready:
            del pending[ref]
        if pending and pings is not None and (silent := pings.silent(sorted(pending.values()))):
            k, seconds, last = silent
            worker = silent_worker("the worker", node_of(workers[k]), seconds, last)
            raise RuntimeError(f"Ray backend: {what}: {worker}")
        if pending and deadline is not None and time.monotonic() >= deadline:
            raise RuntimeError(f"Ray backend: {len(pending)} worker(s) did not finish {what} within {timeout:.0f} s")
    return ray.get([ref for _, ref in calls])


def ray_pings(workers: Sequence[Any], timeout: float) -> WorkerPings:
    """:class:`WorkerPings` of the worker actors ``workers`` (one per mesh), through Ray."""
    import ray

    def collect(handles: list) -> dict[Any, Any]:
        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        answers = {}
        for handle in ready:
            try:
                answers[handle] = ray.get(handle)
            except Exception as e:  # noqa: BLE001  (a dead worker: the step's own call names it)
                answers[handle] = e
        return answers
    return WorkerPings(lambda mesh: workers[mesh].where.remote(), collect, timeout=timeout)
