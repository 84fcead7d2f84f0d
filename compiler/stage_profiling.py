"""Per-layer costs on every (submesh, logical mesh), from the intra-op pass: the t_intra table of Alg. 2.

Alpa (Alg. 2) compiles and profiles every (layer range, submesh, logical mesh). We instead run the intra-op
ILP on each layer's compute-grad piece (forward + backward of one micro-batch) once per logical mesh, and
build the table of a layer range by adding its layers:

.. math::

    t_\\text{intra}(i..j, \\text{mesh}) = \\sum_{l=i}^{j} \\Big( \\frac{\\text{FLOP}_l}{n \\cdot \\text{peak}}
        + \\text{comm}_\\text{ILP}(l, \\text{mesh}) \\Big)

which omits the resharding of the activations between consecutive layers of one stage (an approximation:
the layers' ILPs are solved separately). Layers with the same structure (the blocks of a transformer)
share one solve: the cache key is the layer's equations (primitive, parameters, shapes) and the mesh, so the
same (layer, submesh, logical shape) is never solved twice. Independent solves run in parallel worker
processes (forked, so they inherit the layers' jaxprs; they only build and solve ILPs and never touch the
XLA runtime), one per core; where ``fork`` is not available they run on a thread pool.

Three variants per (layer, logical mesh), Alpa's per-stage memory budget made cheap: the fastest solve
(``variant ""``); when that one leaves some parameter less than fully sharded, a memory-lean solve
(``"params-sharded"``) in which every parameter must be split over as many of the mesh's devices as its
shape allows (the ILP then chooses between tensor parallelism and gathering the weights, ZeRO-3 style);
and, on meshes where that is four devices or more, one in between (``"params-half-sharded"``): every
parameter split over at least half that many (Megatron-LM's layout on a ``(d, t)`` view, weights split
over the tensor axis and replicated over the data axis, is one such solution). The stage DP keeps them as
entries of the logical-view axis and takes, per stage, the fastest that fits (Eq. 3.5); so a large model
is not declared out of memory because every layer's fastest layout replicates its weights, nor pays for
sharding every weight over every device when half would fit.

Memory per device (Eq. 3.5 inputs): ``mem_stage`` = parameters and gradients under the ILP's specs (a
parameter several of the stage's layers read, once: :func:`shared_param_overcount`) plus the optimizer state
sharded over all the mesh's devices (weight-update sharding, on by default as in Alpa), and the state of the
updates replicated onto the stage (:func:`replica_state_bytes`: a tied embedding's moments on the first stage);
``mem_act`` = the activations a micro-batch keeps from forward to backward, divided over the mesh's
devices (an estimate: each layer's activations are split by its batch or tensor parallelism).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler import jax_compat
from alpa_like.compiler.communication import communication
from alpa_like.compiler.plan import CommEstimate
from alpa_like.compiler.auto_sharding import (
    PassOptions,
    ShardingSolution,
    auto_shard,
    operand_pins,
    pins,
    prepare,
    restricted_inputs,
    solve_prepared,
)
from alpa_like.compiler.flops import ComputeRates, jaxpr_seconds
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD, LayerSummary, Piece
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.op_graph import build_op_graph
from alpa_like.compiler.sharding_spec import ShardingSpec, enumerate_specs
from alpa_like.compiler.stage_construction import update_of
from alpa_like.compiler.stage_costs import StageCosts
from alpa_like.compiler.strategies import nbytes

Shape = tuple[int, int]
PARAMS_SHARDED = "params-sharded"
"""The variant label of the memory-lean solves (see the module docstring)."""
PARAMS_HALF_SHARDED = "params-half-sharded"
"""The variant label of the solves in between (see the module docstring)."""
VARIANTS = ("", PARAMS_HALF_SHARDED, PARAMS_SHARDED)
"""Every variant, fastest first: :func:`_solve_job` returns one solve per entry, in this order."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One layer on one (submesh, logical mesh), per micro-batch."""

    compute_seconds: float
    comm_seconds: float
    """Eq. 3.1's objective of the layer: its operators' collectives and resharding (and replicated work)."""
    communication: tuple[CommEstimate, ...]
    """The collectives and resharding behind ``comm_seconds`` per (kind, mesh axes, why), weighted as the
    objective weights them (:func:`~alpa_like.compiler.communication.communication`): gradient synchronisation
    deferred to once per step counts ``1 / B`` per micro-batch."""
    param_bytes_per_device: float
    """Parameters under the ILP's specs (gradients take as much again)."""
    input_specs: tuple[ShardingSpec, ...]
    """The ILP's spec of each input of the layer's jaxpr."""
    value_pins: tuple[tuple[int, int, ShardingSpec], ...] = ()
    """(equation index in the layer's jaxpr, output index, spec): the ILP's layout of each value where it is
    produced (:func:`~alpa_like.compiler.auto_sharding.pins`)."""
    operand_pins: tuple[tuple[int, int, ShardingSpec], ...] = ()
    """(equation index, operand index, spec): the layouts the heavy operators' chosen strategies read
    (:func:`~alpa_like.compiler.auto_sharding.operand_pins`)."""

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds


def layer_jaxpr(jaxpr: Jaxpr, pieces: Sequence[Piece | None], layer: int) -> tuple[ClosedJaxpr, list[int]]:
    """The compute-grad equations (forward and backward) of ``layer`` as a ClosedJaxpr of its own, and for
    each of its inputs the index of the step input it is (-1 for values computed elsewhere)."""
    return layer_jaxprs(jaxpr, pieces, [layer])[0]


def layer_jaxprs(jaxpr: Jaxpr, pieces: Sequence[Piece | None],
                 layers: Sequence[int]) -> list[tuple[ClosedJaxpr, list[int]]]:
    """:func:`layer_jaxpr` of each of ``layers``, reading the step's equations once for all of them."""
    def compute_layer(p: Piece | None) -> int | None:
        return p.layer if p is not None and p.phase in (FORWARD, BACKWARD) else None

    owners = [compute_layer(p) for p in pieces]
    readers: dict[Var, set[int | None]] = {}
    for e, owner in zip(jaxpr.eqns, owners, strict=True):
        for v in jax_compat.eqn_inputs(e):
            readers.setdefault(v, set()).add(owner)
    step_outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    step_index = {v: i for i, v in enumerate(jaxpr.invars)}
    out = []
    for layer in layers:
        eqns = [e for e, owner in zip(jaxpr.eqns, owners, strict=True) if owner == layer]
        invars = jax_compat.free_vars(eqns)
        outvars = [v for e in eqns for v in e.outvars
                   if v in step_outputs or any(r != layer for r in readers.get(v, ()))]
        closed = ClosedJaxpr(jax_compat.subjaxpr(eqns, invars, outvars), [])
        out.append((closed, [step_index.get(v, -1) for v in invars]))
    return out


def structure_key(closed: ClosedJaxpr) -> str:
    """Equal for layers with the same equations, parameters and shapes (variable names aside)."""
    names: dict[Var, int] = {}

    def name(v) -> str:
        if isinstance(v, Literal):
            return f"lit:{v.val!r}"
        return f"v{names.setdefault(v, len(names))}:{v.aval.str_short()}"

    def param(p) -> str:
        if isinstance(p, (ClosedJaxpr, Jaxpr)):
            return str(p)  # printed with canonical variable names
        if isinstance(p, (tuple, list)):
            return "(" + ",".join(param(x) for x in p) + ")"
        if callable(p) and not isinstance(p, type):
            return f"fn:{getattr(p, '__name__', type(p).__name__)}"  # no memory addresses
        return repr(p)

    parts = [" ".join(name(v) for v in closed.jaxpr.invars)]
    for eqn in closed.jaxpr.eqns:
        params = sorted((k, param(p)) for k, p in eqn.params.items()
                        if not (is_marker(eqn) and k == "layer"))  # layer i and layer j can be alike
        parts.append(f"{eqn.primitive.name}{params}({' '.join(name(v) for v in eqn.invars)})->"
                     f"{' '.join(name(v) for v in eqn.outvars)}")
    parts.append(" ".join(name(v) for v in closed.jaxpr.outvars))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def sharded_param_candidates(closed: ClosedJaxpr, param_inputs: Sequence[bool], mesh: LogicalMesh,
                             fraction: int = 1) -> dict[int, tuple[ShardingSpec, ...]]:
    """Per parameter input of ``closed`` with two or more dims, the specs that split it over at least
    ``1 / fraction`` of the most devices its shape allows on ``mesh`` (``fraction=1``: the
    ``"params-sharded"`` variant; ``2``: the ``"params-half-sharded"`` one). Vectors (biases, norm scales)
    stay free: their memory is a row of a matrix's, and splitting one that every device reads whole only
    adds a gather per use."""
    candidates = {}
    for k, (var, is_param) in enumerate(zip(closed.jaxpr.invars, param_inputs, strict=True)):
        if is_param and len(var.aval.shape) >= 2:
            specs = enumerate_specs(var.aval.shape, mesh.shape)
            most = max(spec.num_shards(mesh.shape) for spec in specs)
            candidates[k] = tuple(spec for spec in specs if spec.num_shards(mesh.shape) * fraction >= most)
    return candidates


def is_params_sharded(cost: LayerCost, candidates: dict[int, tuple[ShardingSpec, ...]]) -> bool:
    """Whether ``cost``'s parameter specs are already among ``candidates`` (the lean variant would repeat it)."""
    return all(cost.input_specs[k] in specs for k, specs in candidates.items())


def profile_layer(closed: ClosedJaxpr, param_inputs: Sequence[bool], mesh: LogicalMesh, rates: ComputeRates,
                  options: PassOptions) -> LayerCost:
    """Runs the intra-op pass on one layer and returns its cost on ``mesh`` (``options.input_candidates``
    constrains the layer's inputs, e.g. to :func:`sharded_param_candidates`)."""
    return layer_cost(closed, param_inputs, mesh, rates, auto_shard(build_op_graph(closed), mesh, options),
                      options.gradient_sync_weight)


def layer_cost(closed: ClosedJaxpr, param_inputs: Sequence[bool], mesh: LogicalMesh, rates: ComputeRates,
               solution: ShardingSolution, gradient_sync_weight: float = 1.0) -> LayerCost:
    """The :class:`LayerCost` of the layer ``closed`` under the intra-op pass's ``solution`` on ``mesh``
    (``gradient_sync_weight``: :attr:`~alpa_like.compiler.auto_sharding.PassOptions.gradient_sync_weight`).

    Its compute time is the per-equation roofline :func:`~alpa_like.compiler.flops.jaxpr_seconds` with the
    work split evenly over the mesh's devices (FLOPs alone when ``rates.memory_bandwidth`` is None)."""
    param_bytes = 0.0
    for spec, var, is_param in zip(solution.input_specs(), closed.jaxpr.invars, param_inputs, strict=True):
        if is_param:
            param_bytes += nbytes(var.aval) / spec.num_shards(mesh.shape)
    graph = solution.graph
    collectives = communication(graph, solution, (), weight=lambda n: graph.nodes[n].repeat,
                                sync_weight=gradient_sync_weight, latency_once=True)
    return LayerCost(compute_seconds=jaxpr_seconds(closed, rates, mesh.num_devices),
                     comm_seconds=float(solution.objective), communication=collectives,
                     param_bytes_per_device=param_bytes, input_specs=tuple(solution.input_specs()),
                     value_pins=tuple(pins(solution.graph, solution)),
                     operand_pins=tuple(operand_pins(solution.graph, solution)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageProfile:
    """What profiling produced: the DP's table and the per-layer results behind it."""

    costs: StageCosts
    layer_costs: dict[tuple[int, int, int], LayerCost] = dataclasses.field(repr=False)
    """(layer, submesh index, entry index) -> the layer's cost there; the entry indexes
    ``costs.logical_shapes[submesh]`` / ``costs.variants[submesh]``."""
    layer_inputs: tuple[tuple[int, ...], ...]
    """Per layer, the step input index of each input of its jaxpr (-1: computed by another layer)."""
    num_pairs: int
    """(layer, submesh, logical shape) pairs in the table."""
    num_jobs: int
    """Distinct (layer structure, mesh) problems prepared; the other ``num_pairs - num_jobs`` (layer, submesh,
    logical shape) entries reuse one of them (:attr:`cache_hits`)."""
    num_solves: int
    """ILP solves run: one per distinct (layer structure, mesh) after de-duplication, and one more for each
    memory variant that differs from the solve before it (:func:`_solve_job`)."""
    seconds: float
    sender_limited: np.ndarray
    """``[i, j, p]``: :func:`sender_limited_extra`, what ``costs.t_intra`` leaves out when the stage's
    neighbours sit inside one node each."""

    @property
    def cache_hits(self) -> int:
        """Table entries answered by a problem prepared for another entry: another layer of the same
        structure, another submesh with the same logical mesh, or another memory variant of the entry."""
        return self.num_pairs - self.num_jobs

    def input_spec(self, layer: int, submesh: int, entry: int, step_input: int) -> ShardingSpec | None:
        """The ILP's spec of step input ``step_input`` inside ``layer`` (None if the layer does not read it)."""
        inputs = self.layer_inputs[layer]
        if step_input not in inputs:
            return None
        return self.layer_costs[(layer, submesh, entry)].input_specs[inputs.index(step_input)]


def profile_stage_costs(jaxpr: Jaxpr, pieces: Sequence[Piece | None], summaries: Sequence[LayerSummary],
                        param_mask: Sequence[bool], optimizer_bytes: Sequence[float], cluster: ClusterSpec,
                        submeshes: Sequence[Shape], logical_shapes: Sequence[Sequence[Shape]],
                        options: PassOptions, *, max_workers: int | None = None,
                        progress: Callable[[int, int], None] | None = None,
                        memory_variants: bool = True, share_solves: bool = True) -> StageProfile:
    """The :class:`StageCosts` table of Alg. 2 (see the module docstring) and the layer costs behind it.

    Args:
      optimizer_bytes: per layer, bytes of optimizer state of its parameters (all devices together).
      max_workers: workers (default: one per core): forked processes where :func:`fork_is_safe`, else threads.
      progress: called as ``progress(done, total)`` after each distinct (layer, mesh) job.
      memory_variants: also profile the ``"params-sharded"`` variant on submeshes of more than one device,
        and the ``"params-half-sharded"`` one on submeshes of four or more. The table then lists each such
        submesh's views two or three times (``costs.variants`` says which is which).
      share_solves: layers of one structure on one mesh share a solve (the module docstring); False solves
        every layer on its own (the same table, slower: a reference for tests).
    """
    start = time.perf_counter()
    num_layers = len(summaries)
    layers = layer_jaxprs(jaxpr, pieces, range(num_layers))
    keys = [structure_key(closed) for closed, _ in layers]
    marker = next((e for e in jaxpr.eqns if is_marker(e, "grad")), None)
    gradients = set() if marker is None else {v for v in marker.invars if isinstance(v, Var)}
    gradient_outputs = [frozenset(k for k, v in enumerate(closed.jaxpr.outvars) if v in gradients)
                        for closed, _ in layers]
    entries = [[(tuple(view), variant) for variant in _variants(sub[0] * sub[1], memory_variants)
                for view in views] for sub, views in zip(submeshes, logical_shapes, strict=True)]
    jobs: dict[tuple, tuple[int, LogicalMesh]] = {}
    pair_job = {}
    for l in range(num_layers):
        _, inputs = layers[l]
        param_key = tuple(i >= 0 and param_mask[i] for i in inputs)
        for p, sub in enumerate(submeshes):
            for e, (view, variant) in enumerate(entries[p]):
                mesh = LogicalMesh.from_cluster(cluster, tuple(sub), view)
                key = (keys[l] if share_solves else l, param_key, gradient_outputs[l], mesh)
                jobs.setdefault(key, (l, mesh))
                pair_job[(l, p, e)] = (key, variant)
    job_keys = list(jobs)
    context = _SolveContext(layers=layers, gradient_outputs=gradient_outputs,
                            jobs=[jobs[k] for k in job_keys], param_mask=tuple(param_mask),
                            rates=cluster.compute_rates,
                            options=options, memory_variants=memory_variants)
    results: dict[tuple, tuple[LayerCost, ...]] = {}
    num_solves = 0
    for index, variants, solves in _run_solves(context, max_workers, progress):
        results[job_keys[index]] = variants
        num_solves += solves

    def cost_of(pair) -> LayerCost:
        key, variant = pair_job[pair]
        return results[key][VARIANTS.index(variant)]

    width = max(len(e) for e in entries)
    shape = (num_layers, len(submeshes), width)
    t_layer, mem_layer, act_layer = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    for (l, p, e) in pair_job:
        cost = cost_of((l, p, e))
        n = submeshes[p][0] * submeshes[p][1]
        t_layer[l, p, e] = cost.seconds
        mem_layer[l, p, e] = 2 * cost.param_bytes_per_device + optimizer_bytes[l] / n
        act_layer[l, p, e] = summaries[l].activation_bytes / n
    received = received_per_micro_batch(jaxpr, pieces, num_layers)
    devices = [a * b for a, b in submeshes]
    t_intra = _range_sums(t_layer) + receive_seconds(received, devices, cluster)[..., None]
    saving = boundary_saving(received, devices, cluster)
    nic = shared_nic_wait(received, devices, cluster)
    step_seconds = (receive_seconds(received_per_step(jaxpr, pieces, num_layers), devices, cluster)
                    + receive_seconds(replica_received_per_step(jaxpr, pieces, num_layers), devices, cluster))
    replica_state = replica_state_bytes(jaxpr, pieces, num_layers)[:, :, None, None] / np.asarray(
        devices, dtype=np.float64)[None, None, :, None]
    mem_stage = _range_sums(mem_layer) + replica_state - shared_param_overcount(
        layers, param_mask, lambda l, p, e: cost_of((l, p, e)).input_specs, entries, shape)
    costs = StageCosts(num_layers=num_layers, submeshes=tuple(map(tuple, submeshes)),
                       boundary_saving=saving, nic_wait=nic, step_seconds=step_seconds,
                       logical_shapes=tuple(tuple(view for view, _ in e) for e in entries),
                       variants=tuple(tuple(variant for _, variant in e) for e in entries),
                       t_intra=t_intra, mem_stage=mem_stage,
                       mem_act=_range_sums(act_layer))
    return StageProfile(costs=costs, layer_costs={pair: cost_of(pair) for pair in pair_job},
                        layer_inputs=tuple(tuple(inputs) for _, inputs in layers), num_pairs=len(pair_job),
                        num_jobs=len(job_keys), num_solves=num_solves, seconds=time.perf_counter() - start,
                        sender_limited=sender_limited_extra(received, devices, cluster))


@dataclasses.dataclass(frozen=True)
class _SolveContext:
    """What every solve needs; forked workers inherit it through :data:`_FORKED`."""

    layers: list
    gradient_outputs: list[frozenset[int]]
    """Per layer, the indices of its jaxpr's outputs that are gradients (:attr:`PassOptions.gradient_outputs`)."""
    jobs: list[tuple[int, LogicalMesh]]
    param_mask: tuple[bool, ...]
    rates: ComputeRates
    options: PassOptions
    memory_variants: bool
    graphs: dict = dataclasses.field(default_factory=dict)
    """Layer -> its op graph, built on a process's first job of the layer (each worker fills its own)."""

    def graph(self, layer: int):
        """The op graph of ``layer``'s jaxpr (:func:`~alpa_like.compiler.op_graph.build_op_graph`), built once
        per process: the jobs of one layer on different meshes read the same graph."""
        if layer not in self.graphs:
            self.graphs[layer] = build_op_graph(self.layers[layer][0])
        return self.graphs[layer]


_FORKED: _SolveContext | None = None


def _variants(num_devices: int, memory_variants: bool) -> tuple[str, ...]:
    """The variants profiled on a submesh of ``num_devices`` devices (see the module docstring)."""
    if not memory_variants or num_devices == 1:
        return ("",)
    return VARIANTS if num_devices >= 4 else ("", PARAMS_SHARDED)


def _solve_job(context: _SolveContext, index: int) -> tuple[int, tuple[LayerCost, ...], int]:
    """Per entry of :data:`VARIANTS`, the solve of job ``index``: the fastest, and its twins with the
    parameters limited to :func:`sharded_param_candidates` (half, then fully sharded); a twin whose limit
    the previous solve already meets, or that its mesh does not profile (:func:`_variants`), is that solve
    again. Also the number of ILPs solved. The twins are the fastest solve's ILP restricted
    (:func:`~alpa_like.compiler.auto_sharding.solve_prepared`), so strategies and costs are built once per
    job."""
    l, mesh = context.jobs[index]
    closed, inputs = context.layers[l]
    params = [i >= 0 and context.param_mask[i] for i in inputs]
    options = dataclasses.replace(context.options, gradient_outputs=context.gradient_outputs[l])
    prepared = prepare(context.graph(l), mesh, options)
    solved = [layer_cost(closed, params, mesh, context.rates, solve_prepared(prepared), options.gradient_sync_weight)]
    profiled = _variants(mesh.num_devices, context.memory_variants)
    for variant, fraction in ((PARAMS_HALF_SHARDED, 2), (PARAMS_SHARDED, 1)):
        candidates = sharded_param_candidates(closed, params, mesh, fraction)
        if variant not in profiled or is_params_sharded(solved[-1], candidates):
            solved.append(solved[-1])
            continue
        if restricted_inputs(prepared, candidates) is not None:
            twin = solve_prepared(prepared, candidates)
        else:  # the options limit some parameter to specs without these: the twin is its own problem
            limited = dataclasses.replace(options, input_candidates={**options.input_candidates, **candidates})
            twin = auto_shard(prepared.graph, mesh, limited)
        solved.append(layer_cost(closed, params, mesh, context.rates, twin, options.gradient_sync_weight))
    return index, tuple(solved), len({id(cost) for cost in solved})


def _solve_forked(index: int):
    return _solve_job(_FORKED, index)


def fork_is_safe() -> bool:
    """Whether the solves may run in forked processes: the platform has ``fork`` and this process is not
    connected to Ray. ``ray.init`` starts gRPC threads whose locks a forked child inherits held, so a child of
    a Ray driver may hang (ray-project/ray#59661); the JAX threads are harmless, as the children never touch
    XLA."""
    ray = sys.modules.get("ray")  # not imported here: only a process that imported it can be connected
    return "fork" in multiprocessing.get_all_start_methods() and (ray is None or not ray.is_initialized())


def _run_solves(context: _SolveContext, max_workers: int | None, progress):
    """Yields ``_solve_job`` results as they finish, from forked processes where :func:`fork_is_safe`, else
    from threads."""
    global _FORKED
    total = len(context.jobs)
    workers = max(1, min(max_workers or os.cpu_count() or 1, total))
    if workers == 1:
        for done, index in enumerate(range(total), 1):
            yield _solve_job(context, index)
            if progress is not None:
                progress(done, total)
        return
    if fork_is_safe():
        _FORKED = context
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        submit = functools.partial(pool.submit, _solve_forked)
    else:
        pool = concurrent.futures.ThreadPoolExecutor(workers)
        submit = functools.partial(pool.submit, _solve_job, context)
    try:
        with warnings.catch_warnings():  # JAX warns on every fork; the workers never touch XLA.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            futures = [submit(index) for index in range(total)]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            yield future.result()
            if progress is not None:
                progress(done, total)
    finally:
        pool.shutdown(cancel_futures=True)
        _FORKED = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReceivedValues:
    """What a layer range receives from other layers in one micro-batch's forward and backward."""

    num_bytes: np.ndarray
    """``[i, j]``: bytes of the distinct values that layers ``i..j`` read and another layer produces."""
    count: np.ndarray
    """``[i, j]``: how many such values (each is one transfer, one latency)."""
    neighbour_bytes: np.ndarray
    """``[i, j, 0]``: the part of ``num_bytes`` produced by layer ``i - 1`` (on the stage before, whatever
    it holds); ``[i, j, 1]``: by layer ``j + 1`` (on the stage after)."""
    neighbour_count: np.ndarray
    """``[i, j, 0 or 1]``: how many of ``count`` come from layer ``i - 1``, from layer ``j + 1``."""


def received_per_micro_batch(jaxpr: Jaxpr, pieces: Sequence[Piece | None], num_layers: int) -> ReceivedValues:
    """The values each layer range ``i..j`` receives per micro-batch when it is a pipeline stage: every
    value produced by the compute-grad equations (forward or backward) of a layer outside the range and read
    by the compute-grad equations of a layer inside it, counted once however many layers inside read it.
    (Step inputs are loaded, not received; apply-grad reads accumulated values once per step.)"""
    producer_layer = {v: p.layer for e, p in zip(jaxpr.eqns, pieces, strict=True)
                      if p is not None and p.phase in (FORWARD, BACKWARD) for v in e.outvars}
    readers: dict[Var, set[int]] = {}
    for e, p in zip(jaxpr.eqns, pieces, strict=True):
        if p is None or p.phase not in (FORWARD, BACKWARD):
            continue
        for v in jax_compat.eqn_inputs(e):
            if v in producer_layer and producer_layer[v] != p.layer:
                readers.setdefault(v, set()).add(p.layer)
    return _received_by_ranges(producer_layer, readers, num_layers)


def received_per_step(jaxpr: Jaxpr, pieces: Sequence[Piece | None], num_layers: int) -> ReceivedValues:
    """The values each layer range ``i..j`` receives once per step when it is a pipeline stage: values that
    the apply-grad equations of a layer inside it read and a layer outside it produced, counted once. A
    gradient accumulated over micro-batches (an output of the grad marker) is produced by the layer that
    produced the marker's input (the runtime accumulates it there), so a parameter read by layers of two
    stages (a tied embedding) has its apply-grad, which runs with the last of its gradients' layers, receive
    the other stage's accumulated gradient."""
    producer_layer = _made_in(jaxpr, pieces)
    readers: dict[Var, set[int]] = {}
    for e, p in zip(jaxpr.eqns, pieces, strict=True):
        if p is None or p.phase != APPLY or is_marker(e, "grad"):
            continue
        for v in jax_compat.eqn_inputs(e):
            if v in producer_layer and producer_layer[v] != p.layer:
                readers.setdefault(v, set()).add(p.layer)
    return _received_by_ranges(producer_layer, readers, num_layers)


def _made_in(jaxpr: Jaxpr, pieces: Sequence[Piece | None]) -> dict[Var, int]:
    """The layer that makes each value once per step: an equation's outputs are made by its layer; a gradient
    accumulated over micro-batches (a grad marker's output) by the layer that made the marker's input (the
    runtime accumulates it there)."""
    made_in: dict[Var, int] = {}
    for e, p in zip(jaxpr.eqns, pieces, strict=True):
        if p is not None and not is_marker(e, "grad"):
            made_in.update(dict.fromkeys(e.outvars, p.layer))
    for e in jaxpr.eqns:
        if is_marker(e, "grad"):
            made_in.update((o, made_in[i]) for i, o in zip(e.invars, e.outvars, strict=True)
                           if isinstance(i, Var) and i in made_in)
    return made_in


def _replicated_updates(jaxpr: Jaxpr, pieces: Sequence[Piece | None], num_layers: int):
    """Yields ``(v, replica, needed)`` for every step input ``v`` that the forward or backward of some layer
    range reads while only the apply-grad of layers outside it updates it
    (:func:`~alpa_like.compiler.stage_construction.replicated_updates`): ``replica[i, j]`` says which ranges
    run a copy of its update, ``needed`` are the equations of that update
    (:func:`~alpa_like.compiler.stage_construction.update_of` within the updating layers' apply-grads)."""
    invars = set(jaxpr.invars)
    updated_in: dict[Var, set[int]] = {}
    readers: dict[Var, set[int]] = {}
    for e, p in zip(jaxpr.eqns, pieces, strict=True):
        if p is None or is_marker(e, "grad"):
            continue
        for v in jax_compat.eqn_inputs(e):
            if v in invars:
                (updated_in if p.phase == APPLY else readers).setdefault(v, set()).add(p.layer)
    step_outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    first, last = np.meshgrid(np.arange(num_layers), np.arange(num_layers), indexing="ij")
    for v, layers in updated_in.items():
        replica = _ranges_holding(readers.get(v, ()), first, last) & ~_ranges_holding(layers, first, last)
        if not replica.any():
            continue
        update = [e for e, p in zip(jaxpr.eqns, pieces, strict=True)
                  if p is not None and p.phase == APPLY and p.layer in layers and not is_marker(e, "grad")]
        yield v, replica, [update[i] for i in update_of(v, update, step_outputs)]


def replica_received_per_step(jaxpr: Jaxpr, pieces: Sequence[Piece | None], num_layers: int) -> ReceivedValues:
    """What each layer range ``i..j`` receives once per step for the updates replicated onto it
    (:func:`~alpa_like.compiler.stage_construction.replicated_updates`): for every step input that the
    forward or backward of a layer inside reads and that the apply-grad of layers outside only updates (the
    tied word embedding of a GPT: read by the first layer's lookup, updated with the logits), the stage runs
    that update too, after receiving the values the update reads that layers outside the range made (the
    gradient part accumulated with the logits), counted once. Without the replica the stage would instead
    load the updated value from the other stage's mesh at the next step: for a parameter read by two
    stages, the same bytes (one gradient part of the parameter's shape), later in the step.

    A value the update reads is made by the layer of its equation, or for an accumulated gradient (a grad
    marker output) by the layer that made the marker's input (:func:`_replicated_updates`)."""
    made_in = _made_in(jaxpr, pieces)
    first, last = np.meshgrid(np.arange(num_layers), np.arange(num_layers), indexing="ij")
    received: dict[Var, np.ndarray] = {}
    for _, replica, needed in _replicated_updates(jaxpr, pieces, num_layers):
        for g in jax_compat.free_vars(needed):
            if g in made_in:
                received[g] = received.get(g, False) | (replica & ~_ranges_holding((made_in[g],), first, last))
    num_bytes, count = np.zeros((num_layers, num_layers)), np.zeros((num_layers, num_layers))
    for g, mask in received.items():
        num_bytes += mask * nbytes(g.aval)
        count += mask
    zeros = np.zeros((num_layers, num_layers, 2))
    return ReceivedValues(num_bytes=num_bytes, count=count, neighbour_bytes=zeros, neighbour_count=zeros.copy())


def replica_state_bytes(jaxpr: Jaxpr, pieces: Sequence[Piece | None], num_layers: int) -> np.ndarray:
    """``[i, j]``: bytes of step state that layer range ``i..j`` holds only for the updates replicated onto
    it (:func:`_replicated_updates`): the other step inputs its copy of each update reads (a tied embedding's
    Adam moments), counted once. ``optimizer_bytes`` of :func:`profile_stage_costs` gives
    them to the layer whose apply-grad owns them, so without this a stage holding a replica would be planned
    without its moments (Eq. 3.5's ``mem_stage``)."""
    invars = set(jaxpr.invars)
    held: dict[Var, np.ndarray] = {}
    for v, replica, needed in _replicated_updates(jaxpr, pieces, num_layers):
        for s in jax_compat.free_vars(needed):
            if s in invars and s is not v:
                held[s] = held.get(s, False) | replica
    total = np.zeros((num_layers, num_layers))
    for s, mask in held.items():
        total += mask * nbytes(s.aval)
    return total


def _received_by_ranges(producer_layer: dict[Var, int], readers: dict[Var, set[int]],
                        num_layers: int) -> ReceivedValues:
    """For every layer range ``i..j``: the values some layer inside reads (``readers``) and a layer outside
    produces (``producer_layer``), each counted once."""
    first, last = np.meshgrid(np.arange(num_layers), np.arange(num_layers), indexing="ij")
    num_bytes, count = np.zeros((num_layers, num_layers)), np.zeros((num_layers, num_layers))
    neighbour_bytes, neighbour_count = np.zeros((num_layers, num_layers, 2)), np.zeros((num_layers, num_layers, 2))
    for v, layers in readers.items():
        a = producer_layer[v]
        received = _ranges_holding(layers, first, last) & ~_ranges_holding((a,), first, last)
        size = nbytes(v.aval)
        num_bytes += received * size
        count += received
        for side, adjacent in enumerate((first == a + 1, last == a - 1)):
            neighbour_bytes[..., side] += (received & adjacent) * size
            neighbour_count[..., side] += received & adjacent
    return ReceivedValues(num_bytes=num_bytes, count=count, neighbour_bytes=neighbour_bytes,
                          neighbour_count=neighbour_count)


def _ranges_holding(layers, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """``[i, j]``: whether the layer range ``i..j`` holds one of ``layers`` (``first`` / ``last``: every
    range's first and last layer, as grids)."""
    mask = np.zeros(first.shape, dtype=bool)
    for layer in layers:
        mask |= (first <= layer) & (layer <= last)
    return mask


def inbound_bandwidth(devices: Sequence[int], cluster: ClusterSpec) -> np.ndarray:
    """Bytes/s at which a submesh of ``devices[p]`` devices receives from another node: its nodes' whole
    NICs, ``max(devices, M) * cluster.inter_node_bandwidth`` with ``M`` devices per node (the preset's
    bandwidth is one device's share of its node's NIC). A mesh inside one node gets the whole NIC of its
    node; a mesh spanning ``n`` nodes gets ``n`` NICs, each serving that node's devices of the mesh.

    This is the NIC of a receiving mesh alone. Two meshes of one node receiving across nodes at the same time
    (in 1F1B a node's first stage receives activations while its last receives gradients) share it, and a
    sender on fewer nodes than the receiver is limited by its own NICs; the simulated backend models both
    (each node's NIC is a resource there, :mod:`~alpa_like.runtime.simulator`). The stage DP estimates the
    first for aligned layouts from :func:`shared_nic_wait` (see "Shared NICs" in
    :mod:`~alpa_like.compiler.stage_dp`)."""
    sizes = np.asarray(devices, dtype=np.float64)
    return np.maximum(sizes, cluster.num_devices_per_node) * cluster.inter_node_bandwidth


def receive_seconds(received: ReceivedValues, devices: Sequence[int], cluster: ClusterSpec) -> np.ndarray:
    """``[i, j, p]``: per micro-batch, the time a stage of layers ``i..j`` on a submesh of ``devices[p]``
    devices spends receiving its inputs from the other stages: one alpha per value plus its bytes. On a
    one-node cluster the bytes are spread over the stage's devices (the runtime splits a received
    activation's micro-batch dim over the mesh, and the simulated backend charges the busiest receiving
    device) at the intra-node bandwidth; on a multi-node cluster they go through the receiving nodes' NICs,
    :func:`inbound_bandwidth` (the node's whole NIC for a mesh inside one node, not its devices' share).

    A table entry does not know where :func:`~alpa_like.compiler.submesh.assign_devices` will put the
    stage's neighbours, so on a multi-node cluster every stage boundary is priced as if it crossed nodes; the
    DP takes back :func:`boundary_saving` for the boundaries of a plan that stay inside a node. Against the
    simulated RECV time (which uses the real placement) this is an upper bound for one transfer at a time
    from a sender on at least as many nodes; it is low when a sender on fewer nodes limits a multi-node
    receiver, or when the receiving node's NIC is busy with another mesh's transfer (see
    :func:`inbound_bandwidth`: the simulator charges both). Alpa's Eq. 3.3 has no such term (its profiled
    ``t_intra`` covers the stage alone); the simulated backend charges these RECVs on the receiving mesh, so
    without it the DP ranks plans by a time they do not have."""
    if cluster.num_nodes > 1:
        bandwidth, latency = inbound_bandwidth(devices, cluster), cluster.inter_node_latency
    else:
        bandwidth = np.asarray(devices, dtype=np.float64) * cluster.intra_node_bandwidth
        latency = cluster.intra_node_latency
    return received.count[..., None] * latency + received.num_bytes[..., None] / bandwidth[None, None, :]


def sender_limited_extra(received: ReceivedValues, devices: Sequence[int], cluster: ClusterSpec) -> np.ndarray:
    """``[i, j, p]``: how much longer than :func:`receive_seconds` a stage of layers ``i..j`` on a submesh of
    ``devices[p]`` devices spends, per micro-batch, receiving its neighbours' adjacent layers' values
    (``neighbour_bytes``) when each neighbour sits inside one node: a sender's single NIC then limits what
    the stage's ``n`` NICs could take in, ``bytes * (1 / NIC - 1 / (n NICs))``. Zero for a submesh inside
    one node (its own NIC is the limit) and on a one-node cluster.

    Upper bound for a stage of several nodes (a neighbour on as many nodes costs nothing more) that the stage
    DP's table cannot tighten: it does not know the neighbours' sizes. The planner solves the DP with and
    without it and simulates the plans (``alpa_like.compiler.stage_choice.estimate_tables``). Wide-ResNet-13B
    on 64 GPUs: a (2, 8) stage between two (1, 8) stages received for 4.94 s per step, the table said 2.47 s."""
    if cluster.num_nodes == 1:
        return np.zeros(received.num_bytes.shape + (len(devices),))
    one_node = inbound_bandwidth([cluster.num_devices_per_node], cluster)
    per_byte = np.maximum(1.0 / one_node - 1.0 / inbound_bandwidth(devices, cluster), 0.0)
    return received.neighbour_bytes.sum(axis=-1)[:, :, None] * per_byte[None, None, :]


def boundary_saving(received: ReceivedValues, devices: Sequence[int], cluster: ClusterSpec) -> np.ndarray:
    """``[i, j, p, side]``: how much less of :func:`receive_seconds` a stage of layers ``i..j`` on a submesh
    of ``devices[p]`` devices spends when its boundary with the stage before (``side = 0``) or after
    (``side = 1``) stays inside a node: what it receives from that neighbour's adjacent layer, priced over the
    intra-node links of its devices (``devices * intra_node_bandwidth``) instead of the NICs
    (:func:`inbound_bandwidth`) (:attr:`~alpa_like.compiler.stage_costs.StageCosts.boundary_saving`). Values
    from farther layers keep the inter-node price. Zero on a one-node cluster, and never negative."""
    if cluster.num_nodes == 1:
        return np.zeros(received.neighbour_bytes.shape[:2] + (len(devices), 2))
    sizes = np.asarray(devices, dtype=np.float64)
    latency = cluster.inter_node_latency - cluster.intra_node_latency
    per_byte = 1.0 / inbound_bandwidth(devices, cluster) - 1.0 / (sizes * cluster.intra_node_bandwidth)
    saving = (received.neighbour_count[:, :, None, :] * latency
              + received.neighbour_bytes[:, :, None, :] * per_byte[None, None, :, None])
    return np.maximum(saving, 0.0)


def shared_nic_wait(received: ReceivedValues, devices: Sequence[int], cluster: ClusterSpec) -> np.ndarray:
    """``[i, j, p, side]``: how long a stage of layers ``i..j`` on a submesh of ``devices[p]`` devices is
    expected to wait, per micro-batch, for each shared NIC on the way of what it receives across nodes from
    the stage before (``side = 0``: the adjacent layer ``i - 1``'s values) or after (``side = 1``: layer
    ``j + 1``'s) (:attr:`~alpa_like.compiler.stage_costs.StageCosts.nic_wait`): half the time those bytes hold
    the receiving nodes' NICs (:func:`inbound_bandwidth`), latencies excluded.

    Why half: a shared NIC carries one other transfer in the same direction every micro-batch (see "Shared
    NICs" in :mod:`~alpa_like.compiler.stage_dp`), and the simulated backend makes the two take turns
    (:class:`~alpa_like.runtime.simulator.NicBook`). Two transfers of ``T`` ready together finish after
    ``T`` and ``2 T``, in an order the DP does not know, so each is charged the mean, ``1.5 T``; the other
    transfer's size is not known either, and this one's stands for it. Measured: Wide-ResNet-6.8B's first
    stage waits 0.031 s per micro-batch for node 1's outbound NIC, half its own 0.062 s. Zero on a one-node
    cluster (no NIC)."""
    if cluster.num_nodes == 1:
        return np.zeros(received.neighbour_bytes.shape[:2] + (len(devices), 2))
    per_byte = 0.5 / inbound_bandwidth(devices, cluster)
    return received.neighbour_bytes[:, :, None, :] * per_byte[None, None, :, None]


def shared_param_overcount(layers: Sequence[tuple[ClosedJaxpr, list[int]]], param_mask: Sequence[bool],
                           input_specs: Callable[[int, int, int], Sequence[ShardingSpec]],
                           entries: Sequence[Sequence[tuple[tuple[int, ...], str]]],
                           shape: tuple[int, int, int]) -> np.ndarray:
    """``[i, j, p, e]``: bytes per device that summing the layers' parameters and gradients over the range
    ``i..j`` counts more than once, on entry ``e`` (logical view, variant) of submesh ``p``. A parameter
    several layers read (a tied word embedding: the first layer's lookup, the last layer's logits) is in each
    of their counts; a stage holding several of them holds one copy and one gradient, the largest of their
    layouts, so the others are subtracted from Eq. 3.5's ``mem_stage``.

    ``layers``: :func:`layer_jaxprs`; ``input_specs(l, p, e)``: the ILP's spec of each of layer ``l``'s inputs
    on that entry; ``shape``: (layers, submeshes, entries of the widest submesh)."""
    num_layers = shape[0]
    readers: dict[int, list[tuple[int, int]]] = {}
    for l, (_, inputs) in enumerate(layers):
        for k, i in enumerate(inputs):
            if i >= 0 and param_mask[i]:
                readers.setdefault(i, []).append((l, k))
    overcount = np.zeros((num_layers, *shape))
    for reads in (r for r in readers.values() if len(r) > 1):
        held = np.zeros((len(reads), *shape[1:]))  # bytes per device of the value and its gradient, per reader
        for row, (l, k) in enumerate(reads):
            size = nbytes(layers[l][0].jaxpr.invars[k].aval)
            for p, views in enumerate(entries):
                for e, (view, _) in enumerate(views):
                    held[row, p, e] = 2 * size / input_specs(l, p, e)[k].num_shards(tuple(view))
        layer_of = np.array([l for l, _ in reads])
        for first in range(num_layers):
            for last in range(first, num_layers):
                inside = held[(first <= layer_of) & (layer_of <= last)]
                if len(inside) > 1:
                    overcount[first, last] += inside.sum(axis=0) - inside.max(axis=0)
    return overcount


def _range_sums(per_layer: np.ndarray) -> np.ndarray:
    """``out[i, j] = sum(per_layer[i..j])`` for ``j >= i`` (inf below the diagonal), over trailing axes."""
    num_layers = per_layer.shape[0]
    out = np.full((num_layers, num_layers, *per_layer.shape[1:]), np.inf)
    for i in range(num_layers):
        out[i, i:] = np.cumsum(per_layer[i:], axis=0)
    return out


def apply_phase_inputs(jaxpr: Jaxpr, pieces: Sequence[Piece | None], layer: int) -> set[int]:
    """Step input indices read by ``layer``'s apply-grad equations (its optimizer state, among others)."""
    index = {v: i for i, v in enumerate(jaxpr.invars)}
    return {index[v] for e, p in zip(jaxpr.eqns, pieces, strict=True)
            if p is not None and p.layer == layer and p.phase == APPLY
            for v in jax_compat.eqn_inputs(e) if v in index}
