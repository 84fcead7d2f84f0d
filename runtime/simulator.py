"""The simulated backend: run the instruction programs against a clock instead of devices.

Every mesh has a clock. An instruction starts when its mesh is free and its inputs are ready, and lasts:

* ``RUN qFmb`` / ``RUN qBmb``: the stage's modelled time per micro-batch (the plan's compute plus intra-op
  communication, divided over the micro-batches), split 1 : 2 between forward and backward as in
  Megatron-LM's analysis (a backward split into ``B`` and ``W``, ``RUN qWmb``, shares its part by the
  pieces' FLOPs); ``RUN qA``: the stage's apply-grad FLOPs at the device peak. When the cluster
  has a ``memory_bandwidth``, the compute part of every RUN is instead the roofline of the piece's own
  jaxpr (:func:`~alpa_like.compiler.flops.jaxpr_seconds`: per equation the larger of FLOP time and memory
  time, work split over the mesh's devices), so element-wise work is priced and forward and backward get
  their own costs; every RUN also pays the cluster's ``launch_overhead`` (one executable launch);
* ``RECV``: the resharding plan's alpha-beta time between the two meshes (:func:`transfer_cost`). Between
  meshes on different nodes the bytes go through the source node's and the destination node's NICs, each
  moving ``num_devices_per_node * inter_node_bandwidth`` bytes/s per direction whichever of the node's
  devices use it; every node's NIC, inbound and outbound, is a resource (:class:`NicBook`): a RECV holds
  the NICs it uses, and transfers through one NIC take turns in the programs' order (serialised: two meshes
  of one node receiving from other nodes at the same time take twice as long together, the first finishing
  after one transfer's time, not both after two), a later one filling the gaps the earlier ones leave. A
  RECV lasts from its first byte to its last, so a RECV interrupted by another's includes the wait. With
  ``shared_host_compute`` a RECV's copies are summed, not overlapped
  (:meth:`~alpa_like.runtime.resharding.ReshardingPlan.serial_seconds`: one host's cores do every copy),
  over the inter-node link's per-device share when the meshes' nodes differ, and no NIC is modelled;
* a token-sliced program (TeraPipe: :attr:`~alpa_like.runtime.instructions.MeshPrograms.unit_shares`): a
  forward or backward RUN, a RECV and a per-unit LOAD of a unit (one token slice of a micro-batch) take its
  share of the micro-batch's time (``rows * length`` tokens over an average micro-batch's); the programs a
  TeraPipe step runs have one variant of each stage per slice shape (``MeshPrograms.stage_of``), each priced
  as its stage, and ``CARRY`` (a buffer handed to the next token slice on the mesh) takes no time;
* ``LOAD``: host-to-device bytes at the intra-node bandwidth; ``ACC``, ``MEAN``, ``FREE``: free. On a
  cluster whose devices have their own compute (no ``shared_host_compute``: GPUs), a per-step LOAD of a
  non-batch input (parameters, optimizer state) onto a mesh whose own apply-grad updates it
  (:func:`~alpa_like.compiler.stage_construction.updating_stages`), or that no apply-grad updates, is free:
  a training loop passes each step the state the previous one returned, which stays in device memory
  (``jax.device_put`` of an array already on its devices does not copy), and the Megatron-LM baseline's
  replay has no such load either. A per-step LOAD onto a mesh whose apply-grad does not update the value
  while another mesh's does (GPT's tied word embedding when its update is not replicated: the first
  stage's lookup reads it, the logits' stage updates it) is a copy from that mesh, priced like a RECV
  (:func:`transfer_seconds`); it waits for nothing of this step, as the value was ready when the previous
  step ended. (The local runtime replicates such updates,
  :func:`~alpa_like.compiler.stage_construction.replicated_updates`: the meshes then exchange gradient
  parts by RECV and load nothing from each other.) Batch inputs always pay.
  With ``shared_host_compute`` (XLA's CPU devices) every LOAD pays host-to-device, as measured
  (``examples/benchmarks/pipeline.py``).

A runtime whose instructions cost more than their devices' work and bytes (the Ray backend: a Python worker
interprets each instruction, a RECV's parcel is an actor call and an object in Ray's object store, a step is
the driver's calls and the workers' reports) is priced with its :class:`DispatchCosts`: every RUN, RECV and
LOAD lasts ``instruction_seconds`` longer, a RECV's bytes leave ``transfer_seconds`` after the sending mesh
wrote them (the parcel's latency, which the receiving mesh waits for only when it is not busy elsewhere), and
the step lasts ``step_seconds`` longer.

When the cluster's devices share their host's cores (``ClusterSpec.shared_host_compute``: XLA's virtual
CPU devices), each node also has a clock: RUN, RECV and LOAD instructions of different meshes on one node
take turns instead of overlapping, and a RUN computes with the whole node (``num_devices_per_node`` devices
worth of ``peak_flops``, the per-device rate with every device busy), not only its mesh's devices.

The result is a :class:`~alpa_like.compiler.schedules.Timeline` of the RUN instructions (so the measured and
simulated timelines export and plot the same way) and the predicted step time.
"""
from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

from alpa_like.compiler import jax_compat
from alpa_like.compiler.backward_split import WEIGHT
from alpa_like.compiler.flops import jaxpr_flops, jaxpr_seconds
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.stage_construction import StageProgram, updating_stages
from alpa_like.runtime.instructions import PER_STEP, MeshPrograms, Op
from alpa_like.runtime.pipeshard_runtime import activation_spec
from alpa_like.runtime.resharding import MeshLayout, plan_resharding
from alpa_like.compiler.indices import MeshIdx, MicroBatchIdx, StageIdx
from alpa_like.compiler.schedules import Phase, Span, Task, Timeline

_FORWARD_SHARE = 1 / 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchCosts:
    """Fixed seconds a runtime adds to the instructions it runs, beyond the devices' work and the bytes'
    transfer time (the Ray backend's: :func:`~alpa_like.runtime.ray_dispatch.measure_dispatch_costs`).
    Every field is a finite number >= 0."""

    step_seconds: float = 0.0
    """Once per step: the driver's calls to the workers and their reports."""
    instruction_seconds: float = 0.0
    """Per RUN, RECV and LOAD: the worker interpreting it and dispatching its work."""
    transfer_seconds: float = 0.0
    """Per RECV: the latency of a parcel between two workers, from the sender's write to the first byte at
    the receiver (an actor call, the object store)."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"DispatchCosts: {field.name} must be a finite number of seconds >= 0, "
                                 f"got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Simulation:
    step_seconds: float
    timeline: Timeline
    """The RUN instructions of forward and backward, in seconds."""
    busy_seconds: tuple[float, ...]
    """Per mesh: time spent in RUN instructions."""
    transfer_seconds: float
    """Sum of RECV durations."""
    seconds_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)
    """Summed durations per instruction kind (:func:`instruction_kind`: ``RUN F``, ``RUN B``, ``RUN A``,
    ``RECV``, ``LOAD``, ...), to set beside a profiled step's measured ones."""
    instruction_spans: tuple[tuple[int, str, float, float], ...] | None = None
    """With ``simulate(..., trace=True)``: ``(mesh, text, start, end)`` of every RUN, RECV and LOAD, the
    format of a profiled step's spans (:func:`measured_durations`)."""


def _mesh_layout(stage_plan, shape, spec=None) -> MeshLayout:
    """The layout of a value of ``shape`` on a stage's mesh: ``spec``, or :func:`activation_spec`'s."""
    n0, n1 = stage_plan.logical_mesh_shape
    ids = stage_plan.device_ids
    grid = tuple(tuple(ids[i * n1:(i + 1) * n1]) for i in range(n0))
    return MeshLayout(device_ids=grid, spec=spec or activation_spec(shape, (n0, n1)))


Nic = tuple[int, str]
"""A node's network interface in one direction: ``(node, "in")`` or ``(node, "out")``."""


def transfer_seconds(plan, aval, src_mesh: int, dst_mesh: int, src_spec=None, dst_spec=None) -> float:
    """Seconds to move a value of ``aval`` from mesh ``src_mesh`` to mesh ``dst_mesh`` of ``plan`` when no
    other transfer uses the links (:func:`transfer_cost`)."""
    return transfer_cost(plan, aval, src_mesh, dst_mesh, src_spec, dst_spec)[0]


def transfer_cost(plan, aval, src_mesh: int, dst_mesh: int, src_spec=None,
                  dst_spec=None) -> tuple[float, frozenset[Nic]]:
    r"""The seconds to move a value of ``aval`` from mesh ``src_mesh`` to mesh ``dst_mesh`` of ``plan``
    (between the two layouts ``src_spec`` / ``dst_spec``, or :func:`activation_spec`'s) and the NICs the move
    holds for that long.

    * Meshes on the same nodes: the resharding plan's alpha-beta time over the intra-node links (the busiest
      receiving device, then the local all-gathers); no NIC.
    * Meshes on different nodes, devices with their own compute (GPUs): each piece that crosses nodes
      leaves through its source node's NIC and enters through its destination node's, and a node's NIC moves
      ``num_devices_per_node * inter_node_bandwidth`` bytes/s each way whichever of its devices send or
      receive (:func:`~alpa_like.compiler.stage_profiling.inbound_bandwidth`):

      .. math:: t = \max_d (\text{pieces into } d) \, \alpha_{inter}
                    + \max_{n, dir} \frac{\text{bytes through } (n, dir)}{M \, B_{inter}} + t_{gather}

      (pieces between devices of one node, if a layout has any, pay the intra-node link on their device);
      the NICs used are returned so that :func:`simulate` can make other transfers wait for them.
    * With ``shared_host_compute`` (XLA's CPU devices, one host's cores do every copy): the copies are
      summed (:meth:`~alpa_like.runtime.resharding.ReshardingPlan.serial_seconds`), over the inter-node
      link when the meshes' nodes differ; no NIC, as measured (``examples/benchmarks/pipeline.py``)."""
    cluster = plan.cluster
    per_node = cluster.num_devices_per_node
    src_plan, dst_plan = plan.stages[src_mesh], plan.stages[dst_mesh]
    reshard = plan_resharding(aval.shape, jax_compat.numpy_dtype(aval.dtype).itemsize,
                              _mesh_layout(src_plan, aval.shape, src_spec), _mesh_layout(dst_plan, aval.shape, dst_spec))
    cross = {d // per_node for d in src_plan.device_ids} != {d // per_node for d in dst_plan.device_ids}
    bandwidth = cluster.inter_node_bandwidth if cross else cluster.intra_node_bandwidth
    latency = cluster.inter_node_latency if cross else cluster.intra_node_latency
    if cluster.shared_host_compute:
        return reshard.serial_seconds(bandwidth, latency), frozenset()
    if not cross:
        return reshard.estimated_seconds(bandwidth, latency, cluster.intra_node_bandwidth), frozenset()
    per_device: dict[int, float] = {}
    through: dict[Nic, int] = {}
    for t in reshard.transfers:
        src_node, dst_node = t.src // per_node, t.dst // per_node
        if src_node == dst_node:
            seconds = cluster.intra_node_latency + t.num_bytes / cluster.intra_node_bandwidth
        else:
            seconds = cluster.inter_node_latency
            through[(src_node, "out")] = through.get((src_node, "out"), 0) + t.num_bytes
            through[(dst_node, "in")] = through.get((dst_node, "in"), 0) + t.num_bytes
        per_device[t.dst] = per_device.get(t.dst, 0.0) + seconds
    nic_seconds = max(through.values(), default=0) / (per_node * cluster.inter_node_bandwidth)
    gather = dataclasses.replace(reshard, transfers=()).estimated_seconds(bandwidth, latency,
                                                                          cluster.intra_node_bandwidth)
    return max(per_device.values(), default=0.0) + nic_seconds + gather, frozenset(through)


class NicBook:
    """When each NIC is busy: per NIC, sorted disjoint ``[start, end)`` intervals. Transfers through one
    NIC take turns, in the programs' order (serialised, not sharing its bandwidth): a transfer uses its NICs
    whenever all of them are free of the transfers booked before it, from its ready time, in as many
    pieces as that takes (work-conserving: a transfer booked earlier but ready later does not hold it back,
    and a gap too short for the whole transfer still carries part of it).

    >>> book = NicBook()
    >>> book.take(frozenset({(0, "in")}), 1.0, 1.0)
    (1.0, 2.0)
    >>> book.take(frozenset({(0, "in"), (1, "out")}), 0.0, 1.5)  # [0, 1) and [2, 2.5)
    (0.0, 2.5)
    """

    def __init__(self):
        self._starts: dict[Nic, list[float]] = {}
        self._ends: dict[Nic, list[float]] = {}

    def _busy_until(self, nic: Nic, t: float) -> tuple[float | None, float]:
        """``(end of the interval holding t or None, start of the next interval after t or inf)``."""
        starts, ends = self._starts.get(nic, []), self._ends.get(nic, [])
        k = bisect.bisect_right(ends, t)  # the first interval ending after t
        if k == len(starts):
            return None, math.inf
        return (ends[k], starts[k]) if starts[k] <= t else (None, starts[k])

    def take(self, nics: frozenset[Nic], ready: float, duration: float) -> tuple[float, float]:
        """Books ``duration`` seconds on every NIC of ``nics`` from ``ready`` on; returns the first piece's
        start and the last piece's end."""
        if not nics or duration <= 0:
            return ready, ready + max(duration, 0.0)
        t, remaining, pieces = ready, duration, []
        while True:
            nxt = math.inf
            for nic in nics:
                end, following = self._busy_until(nic, t)
                if end is not None:
                    break
                nxt = min(nxt, following)
            else:
                if t + remaining <= nxt:  # the rest fits before the next booked interval
                    pieces.append((t, t + remaining))
                    break
                pieces.append((t, nxt))
                remaining -= nxt - t
                t = nxt
                continue
            t = end  # inside a booked interval of one NIC: skip past it and look again
        for nic in nics:
            starts, ends = self._starts.setdefault(nic, []), self._ends.setdefault(nic, [])
            for a, b in pieces:
                k = bisect.bisect_right(starts, a)
                starts.insert(k, a)
                ends.insert(k, b)
        return pieces[0][0], pieces[-1][1]


class _NoNics:
    """A :class:`NicBook` whose NICs are never busy."""

    @staticmethod
    def take(nics, ready: float, duration: float) -> tuple[float, float]:
        return ready, ready + max(duration, 0.0)


def measured_durations(programs: MeshPrograms, spans) -> dict[str, float]:
    """Median measured seconds per instruction text without its micro-batch (``RUN 0F``, ``RECV v12``),
    from the spans of a profiled step (``PipeshardExecutable.run(..., profile=True)``)."""
    samples: dict[str, list[float]] = {}
    for _, text, start, end in spans:
        samples.setdefault(_strip_micro_batch(text), []).append(end - start)
    return {k: float(np.median(v)) for k, v in samples.items()}


def instruction_kind(text: str) -> str:
    """``RUN F`` / ``RUN B`` / ``RUN A`` for a RUN instruction's text (forward, backward, apply-grad), else
    the op name (``RECV``, ``LOAD``, ``ACC``, ...)."""
    head = text.split(" <-")[0].split()
    if not head:
        return ""
    if head[0] == "RUN" and len(head) > 1:
        phase = head[1].lstrip("0123456789")[:1]
        return f"RUN {phase}"
    return head[0]


_RUN_KIND = {FORWARD: "RUN F", BACKWARD: "RUN B", WEIGHT: "RUN W", APPLY: "RUN A"}
_SPAN_PHASE = {FORWARD: Phase.F, BACKWARD: Phase.B, WEIGHT: Phase.W}


def _phase_shares(program: StageProgram, stage: int) -> list[tuple[str, float]]:
    """Per piece of ``stage``, the share of a micro-batch's modelled time it takes: forward and backward
    1 : 2, a backward split into ``B`` and ``W`` (:func:`~alpa_like.compiler.backward_split.split_backwards`)
    sharing the backward's two thirds in proportion to their jaxprs' FLOPs (which add up to the backward's);
    the apply-grad none (it is priced from its own jaxpr)."""
    if (stage, WEIGHT) not in program.pieces:
        return [(FORWARD, _FORWARD_SHARE), (BACKWARD, 1 - _FORWARD_SHARE), (APPLY, 0.0)]
    b, w = (jaxpr_flops(program.piece(stage, phase).jaxpr) for phase in (BACKWARD, WEIGHT))
    b_share = b / (b + w) if b + w else 0.5
    return [(FORWARD, _FORWARD_SHARE), (BACKWARD, (1 - _FORWARD_SHARE) * b_share),
            (WEIGHT, (1 - _FORWARD_SHARE) * (1 - b_share)), (APPLY, 0.0)]


_OP_KIND = {op: op.value for op in Op}


def _kind(ins) -> str:
    """:func:`instruction_kind` of ``str(ins)``, without formatting the text."""
    return _RUN_KIND[ins.phase] if ins.op is Op.RUN else _OP_KIND[ins.op]


def measured_seconds_by_kind(spans) -> dict[str, float]:
    """Summed measured seconds per :func:`instruction_kind` from a profiled step's spans."""
    totals: dict[str, float] = {}
    for _, text, start, end in spans:
        kind = instruction_kind(text)
        totals[kind] = totals.get(kind, 0.0) + (end - start)
    return totals


def _strip_micro_batch(text: str) -> str:
    head = text.split(" <-")[0]
    if head.startswith("RUN "):
        return head.rstrip("0123456789")
    return head.split("@")[0]


def simulate(plan, program: StageProgram, programs: MeshPrograms,
             measured: dict[str, float] | None = None, value_specs: dict | None = None,
             trace: bool = False, nic_contention: bool = True,
             dispatch: DispatchCosts | None = None) -> Simulation:
    """Runs ``programs`` on the clock described in the module docstring. With ``measured`` (from
    :func:`measured_durations`) RUN, RECV and LOAD take their measured median durations instead of the
    cost model's: the schedule and the dependencies are then the only model (a calibrated simulation).
    ``value_specs``: ``(value, mesh) -> spec`` of the values the meshes hold (an executable's
    ``value_specs``: the layouts its stages' ILP solutions give them); a RECV is planned between those
    layouts, :func:`activation_spec`'s where none is given. ``trace``: also return every RUN, RECV and LOAD
    as a span (:attr:`Simulation.instruction_spans`). ``nic_contention=False``: every transfer has its NICs
    to itself (a what-if: how much of the step is transfers waiting for each other). ``dispatch``: the
    runtime's fixed costs (:class:`DispatchCosts`), added to the modelled durations (a measured duration
    already holds them)."""
    if dispatch is not None and not isinstance(dispatch, DispatchCosts):
        raise TypeError(f"simulate: dispatch must be a DispatchCosts or None, got {type(dispatch).__name__}")
    dispatch = dispatch or DispatchCosts()
    per_instruction, per_transfer = dispatch.instruction_seconds, dispatch.transfer_seconds
    value_specs = value_specs or {}
    cluster = plan.cluster
    m = plan.num_micro_batches
    per_node = cluster.num_devices_per_node
    nodes_of = [frozenset(d // per_node for d in plan.stages[mesh].device_ids) for mesh in range(programs.num_meshes)]
    node_clock = dict.fromkeys(range(cluster.num_nodes), 0.0)
    nic_book = NicBook() if nic_contention else _NoNics()
    stage_time = {}
    stage_of = programs.stage_of or tuple(range(program.num_stages))
    for q in range(program.num_stages):
        mesh = programs.stage_to_mesh[q]
        stage_plan = plan.stages[mesh]
        chunks = len({stage_of[s] for s, on in enumerate(programs.stage_to_mesh) if on == mesh})
        devices = len(stage_plan.device_ids)
        # With shared host cores a mesh computes with every core of its hosts while the others wait.
        speedup = (cluster.num_devices_per_node * len(nodes_of[mesh]) / devices if cluster.shared_host_compute
                   else 1.0)
        per_mb = (stage_plan.compute_seconds / speedup + stage_plan.communication_seconds) / m / chunks
        comm_per_mb = stage_plan.communication_seconds / m / chunks
        for phase, share in _phase_shares(program, q):
            # FLOP-only, or a slice shape's variant (its jaxpr is one unit's): the plan's time split 1 : 2
            if phase != APPLY and (cluster.memory_bandwidth is None or programs.stage_of):
                seconds = per_mb * share
            else:
                seconds = (jaxpr_seconds(program.piece(q, phase).jaxpr, cluster.compute_rates, devices * speedup)
                           + comm_per_mb * share)
            stage_time[(q, phase)] = seconds + cluster.launch_overhead
    updated_on = {v: frozenset(programs.stage_to_mesh[q] for q in stages)
                  for v, stages in updating_stages(program).items()}
    clock = [0.0] * programs.num_meshes
    ready: dict[tuple[int, tuple], float] = {}
    spans, busy, transfers = [], [0.0] * programs.num_meshes, 0.0
    traced: list[tuple[int, str, float, float]] | None = [] if trace else None
    by_kind: dict[str, float] = {}
    shared = cluster.shared_host_compute
    moves: dict[tuple[int, int, int], tuple[float, frozenset[Nic]]] = {}
    shares = programs.unit_shares

    def move_cost(v: int, src: int, dst: int) -> tuple[float, frozenset[Nic]]:
        """:func:`transfer_cost` of value ``v`` from mesh ``src`` to ``dst`` (the same for every
        micro-batch: computed once per triple; when it runs depends on the NICs' bookings)."""
        if (v, src, dst) not in moves:
            moves[(v, src, dst)] = transfer_cost(plan, program.values[v].aval, src, dst,
                                                 value_specs.get((v, src)), value_specs.get((v, dst)))
        return moves[(v, src, dst)]

    def hosts(ins) -> frozenset[int]:
        """The nodes whose shared cores ``ins`` occupies (none when devices compute independently)."""
        if not shared:
            return frozenset()
        return nodes_of[ins.mesh] | (nodes_of[ins.src_mesh] if ins.op is Op.RECV else frozenset())

    for ins in programs.instructions:
        op = ins.op
        if op is Op.FREE:  # takes no time: only its (zero) total per kind
            by_kind.setdefault("FREE", 0.0)
            continue
        mesh = ins.mesh
        start, duration = clock[mesh], 0.0
        if op is Op.RUN:
            piece = program.piece(ins.stage, ins.phase)
            mb = ins.micro_batch
            for v in piece.inputs:
                key = (v, mb) if (mesh, (v, mb)) in ready else (v, PER_STEP)
                start = max(start, ready.get((mesh, key), 0.0))
            if shared:
                start = max([start, *(node_clock[n] for n in hosts(ins))])
            duration = stage_time[(ins.stage, ins.phase)]
            if shares and mb != PER_STEP:
                duration *= shares[mb]
            duration += per_instruction
            if measured is not None:
                duration = measured.get(_strip_micro_batch(str(ins)), duration)
            for v in piece.outputs:
                ready[(mesh, (v, mb))] = start + duration
            busy[mesh] += duration
            if ins.phase != APPLY:
                phase = _SPAN_PHASE[ins.phase]
                k, i = programs.units[mb] if shares else (mb, None)
                task = Task(StageIdx(stage_of[ins.stage]), MicroBatchIdx(k), phase, i)
                spans.append(Span(task, MeshIdx(mesh), start, start + duration))
        elif op is Op.RECV:
            duration, nics = move_cost(ins.key[0], ins.src_mesh, mesh)
            if shares and ins.key[1] != PER_STEP:
                duration *= shares[ins.key[1]]
            latency, fixed = per_transfer, per_instruction  # the parcel's latency; the worker's own part
            if measured is not None and (text := _strip_micro_batch(str(ins))) in measured:
                duration, latency, fixed = measured[text], 0.0, 0.0
            start = max([start, ready.get((ins.src_mesh, ins.key), 0.0) + latency,
                         *(node_clock[n] for n in hosts(ins))])
            first, end = nic_book.take(nics, start + fixed, duration)
            start, duration = first - fixed, end - first + fixed  # the worker's part just before the first byte
            transfers += duration
            ready[(mesh, ins.key)] = start + duration
        elif op is Op.LOAD:
            start = max([start, *(node_clock[n] for n in hosts(ins))])
            nics: frozenset[Nic] = frozenset()
            aval = program.values[ins.key[0]].aval
            nbytes = math.prod(aval.shape) * jax_compat.numpy_dtype(aval.dtype).itemsize
            if ins.key[1] != PER_STEP:
                nbytes = nbytes * (shares[ins.key[1]] if shares else 1) // m
            v = ins.key[0]
            if shared or ins.key[1] != PER_STEP or v in program.batch_inputs:
                duration = cluster.intra_node_latency + nbytes / cluster.intra_node_bandwidth
            elif not (owners := updated_on.get(v)) or mesh in owners:  # resident state
                duration = 0.0
            else:  # the previous step's apply-grad left the value on another mesh
                duration, nics = move_cost(v, min(owners), mesh)
            duration += per_instruction
            if measured is not None:
                duration = measured.get(_strip_micro_batch(str(ins)), duration)
            start, end = nic_book.take(nics, start, duration)
            duration = end - start
            ready[(mesh, ins.key)] = start + duration
        elif op is Op.ACC or op is Op.MEAN:
            start = max(start, ready.get((mesh, ins.key), start))
            ready[(mesh, ins.key)] = start
        elif op is Op.CARRY:  # a buffer handed to another unit on the mesh: takes no time
            start = max(start, ready.get((mesh, ins.source), start))
            ready[(mesh, ins.key)] = start
        clock[mesh] = start + duration
        kind = _kind(ins)
        by_kind[kind] = by_kind.get(kind, 0.0) + duration
        if op is Op.RUN or op is Op.RECV or op is Op.LOAD:
            if shared:
                node_clock.update(dict.fromkeys(hosts(ins), start + duration))
            if traced is not None:
                traced.append((mesh, str(ins), start, start + duration))
    timeline = Timeline(name=plan.pipeline_schedule or "pipeline", num_meshes=programs.num_meshes,
                        num_stages=len(set(stage_of)), spans=tuple(sorted(spans, key=lambda s: (s.mesh, s.start))))
    return Simulation(step_seconds=max(clock) + dispatch.step_seconds, timeline=timeline, busy_seconds=tuple(busy),
                      transfer_seconds=transfers, seconds_by_kind=by_kind,
                      instruction_spans=None if traced is None else tuple(traced))
