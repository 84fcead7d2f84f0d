"""The parallel plan: plain, frozen data that says what the compiler decided.

A :class:`ParallelPlan` is produced before anything runs (``al.plan``) or when a step is compiled
(``exe.plan``). It prints as a table a user can act on (:mod:`~alpa_like.compiler.plan_format`), and
round-trips exactly through JSON::

    text = plan.to_json()
    assert al.ParallelPlan.from_json(text) == plan
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings as python_warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from alpa_like.compiler import fields
from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.options import SELECTIONS
from alpa_like.compiler.plan_format import format_plan, memory_message
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.schedules import ScheduleName

ROLES = ("param", "optimizer_state", "state", "batch", "output")
"""What an input or output leaf of the step is (:func:`alpa_like.compiler.input_roles.input_roles`):

* ``param``: differentiated by ``al.grad`` (else: under a ``params`` path component, Flax's convention).
* ``optimizer_state``: when parameters are known, every other leaf of the non-batch arguments that is not a
  PRNG key: optax's states (``mu``/``nu`` shaped like the parameters, the ``count`` scalar) and counters the
  update advances (Flax ``TrainState.step``). ZeRO-2 and ZeRO-3 shard these.
* ``state``: PRNG keys (``TrainState`` subclasses' ``dropout_rng``, a user's ``rng``: read by the forward pass,
  not the update; typed ``key<...>`` arrays or ``uint32`` key data named like a key), and every non-batch
  leaf when no parameter is known.
* ``batch``: leaves of ``batch_argnums``, split along dim 0.
* ``output``: outputs of the step.
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorPlan:
    """How one input or output leaf of the step is laid out on its stage's mesh."""

    path: str
    """Pytree path, e.g. ``state.params.block_0.attn.qkv.kernel`` or ``out.1.loss``."""
    shape: tuple[int, ...]
    dtype: str
    role: str
    """One of :data:`ROLES`: ``param``, ``optimizer_state``, ``state`` (PRNG keys; every non-batch input when
    no parameter is known), ``batch``, ``output``."""
    spec: ShardingSpec | None
    """Alpa notation per tensor dim (S0, S1, S01, R); None when XLA chooses (outputs only)."""
    bytes_per_device: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype, "role": self.role,
                "spec": None if self.spec is None else str(self.spec), "bytes_per_device": self.bytes_per_device}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], at: str = "") -> TensorPlan:
        """Inverse of :meth:`to_dict`; a field that is missing or invalid raises ``ValueError`` naming its path
        below ``at``. The spec's mesh axes are checked against the stage by :meth:`StagePlan.from_dict`."""
        get = fields.reader(cls, d, at)
        shape = get("shape", fields.ints)
        return cls(path=get("path", fields.string), shape=shape, dtype=get("dtype", _dtype),
                   role=get("role", fields.choice, ROLES), spec=get("spec", fields.optional(_spec), len(shape)),
                   bytes_per_device=get("bytes_per_device", fields.integer))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommEstimate:
    """One modelled collective of a stage, per training step."""

    kind: str
    """all-reduce | all-gather | reduce-scatter | all-to-all | send-recv."""
    mesh_axes: tuple[int, ...]
    num_bytes: int
    """Size of the full tensor the collective operates on, summed over the step."""
    seconds: float
    what: str
    """Why it happens, e.g. ``gradient synchronisation``."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "mesh_axes": list(self.mesh_axes), "num_bytes": self.num_bytes,
                "seconds": self.seconds, "what": self.what}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], at: str = "") -> CommEstimate:
        """Inverse of :meth:`to_dict`, checked like :meth:`TensorPlan.from_dict`."""
        get = fields.reader(cls, d, at)
        return cls(kind=get("kind", fields.string), mesh_axes=get("mesh_axes", _distinct_ints),
                   num_bytes=get("num_bytes", fields.integer), seconds=get("seconds", fields.number),
                   what=get("what", fields.string))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpPlan:
    """The intra-op pass's choice for one parameter or heavy operator of a stage."""

    name: str
    """A parameter's path, or an operator's ``name_stack/primitive``."""
    kind: str
    """``param`` or the primitive name (``dot_general``, ``conv_general_dilated``, ``gather``, ...)."""
    shape: tuple[int, ...]
    """Shape of the parameter or of the operator's (first) output."""
    spec: ShardingSpec
    """Chosen layout of the parameter or of the output."""
    strategy: str
    """The parallel algorithm, e.g. ``b->0, k->1`` (Table 3.3's loop-to-mesh-axis mapping)."""
    communication: str
    """The collectives it performs and the resharding it pays, e.g. ``all-reduce(4096 B, 1)``."""
    seconds: float
    """Modelled seconds of that communication per step."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "shape": list(self.shape), "spec": str(self.spec),
                "strategy": self.strategy, "communication": self.communication, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], at: str = "") -> OpPlan:
        """Inverse of :meth:`to_dict`, checked like :meth:`TensorPlan.from_dict`."""
        get = fields.reader(cls, d, at)
        shape = get("shape", fields.ints)
        return cls(name=get("name", fields.string), kind=get("kind", fields.string), shape=shape,
                   spec=get("spec", _spec, len(shape)), strategy=get("strategy", fields.string),
                   communication=get("communication", fields.string), seconds=get("seconds", fields.number))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanCandidate:
    """One plan the intra-op pass considered under ``plan_selection="measured"``: the ILP's answer on one
    logical view under one cost model, compiled and timed on the devices."""

    logical_mesh_shape: tuple[int, ...]
    cost_model: str
    """What the ILP solved: ``"alpha-beta"`` (the cluster's latencies and bandwidths, as the objective),
    ``"bandwidth only"`` (every latency set to 0) or ``"no all-to-all"`` (resharding priced as all-gathers
    then a slice)."""
    weight_update_sharding: bool
    """Whether the post-ILP all-reduce -> reduce-scatter + all-gather rewrite was applied."""
    objective: float
    """Eq. 3.1 objective of this plan under the cluster's alpha-beta costs, in seconds."""
    measured_seconds: float | None
    """Median measured seconds of one step; None when the plan is the same program as candidate
    ``same_as`` (timed once, there)."""
    same_as: int | None = None
    """Index of the earlier candidate with the same per-device layout of every pinned value."""
    chosen: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"logical_mesh_shape": list(self.logical_mesh_shape), "cost_model": self.cost_model,
                "weight_update_sharding": self.weight_update_sharding, "objective": self.objective, "measured_seconds": self.measured_seconds, "same_as": self.same_as,
                "chosen": self.chosen}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], at: str = "") -> PlanCandidate:
        """Inverse of :meth:`to_dict`, checked like :meth:`TensorPlan.from_dict`."""
        get = fields.reader(cls, d, at)
        return cls(logical_mesh_shape=get("logical_mesh_shape", _logical_mesh_shape),
                   cost_model=get("cost_model", fields.string),
                   weight_update_sharding=get("weight_update_sharding", fields.boolean),
                   objective=get("objective", fields.number),
                   measured_seconds=get("measured_seconds", fields.optional(fields.number)),
                   same_as=get("same_as", fields.optional(fields.integer)), chosen=get("chosen", fields.boolean))


"""How the intra-op pass picks its plan among the logical views (``AutoShardingOption.plan_selection``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SolverReport:
    """How the intra-op ILP (Eq. 3.1) of a stage was solved."""

    status: str
    """``optimal``, ``time limit (best feasible)``, ``heuristic (...)`` or ``infeasible``."""
    objective: float
    """Eq. 3.1 objective of the chosen logical mesh: modelled communication seconds per step."""
    solve_seconds: float
    """Seconds spent in the pass for the chosen mesh (strategies, costs and CBC)."""
    num_nodes: int
    num_edges: int
    num_variables: int
    num_constraints: int
    views: tuple[tuple[tuple[int, ...], float], ...] = ()
    """Every logical mesh shape tried, with its objective (with ``selection="objective"`` the cheapest is
    used)."""
    selection: str = "objective"
    """How the plan was picked, one of :data:`SELECTIONS`: the lowest objective, or the fastest measured
    of ``candidates``."""
    candidates: tuple[PlanCandidate, ...] = ()
    """With ``selection="measured"``: every plan considered, its objective and measured step time."""
    selection_seconds: float = 0.0
    """With ``selection="measured"``: wall seconds of the whole selection (every candidate's ILP solve,
    compilation and timing)."""

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "objective": self.objective, "solve_seconds": self.solve_seconds,
                "num_nodes": self.num_nodes, "num_edges": self.num_edges, "num_variables": self.num_variables,
                "num_constraints": self.num_constraints,
                "views": [[list(shape), objective] for shape, objective in self.views],
                "selection": self.selection, "candidates": [c.to_dict() for c in self.candidates],
                "selection_seconds": self.selection_seconds}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], at: str = "") -> SolverReport:
        """Inverse of :meth:`to_dict`, checked like :meth:`TensorPlan.from_dict`; ``same_as`` must name an
        earlier candidate."""
        get = fields.reader(cls, d, at)
        candidates = get("candidates", fields.sequence, PlanCandidate.from_dict)
        for i, c in enumerate(candidates):
            if c.same_as is not None and c.same_as >= i:
                raise fields.invalid(fields.join(at, f"candidates[{i}].same_as"),
                                     f"null or the index of an earlier candidate (< {i})", c.same_as)
        return cls(status=get("status", fields.string), objective=get("objective", fields.number),
                   solve_seconds=get("solve_seconds", fields.number), num_nodes=get("num_nodes", fields.integer),
                   num_edges=get("num_edges", fields.integer), num_variables=get("num_variables", fields.integer),
                   num_constraints=get("num_constraints", fields.integer),
                   views=get("views", fields.sequence, _view), selection=get("selection", fields.choice, SELECTIONS),
                   candidates=candidates, selection_seconds=get("selection_seconds", fields.number))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage (an SPMD method has exactly one, holding every layer)."""

    stage_id: int
    layer_ids: tuple[int, ...]
    submesh_shape: tuple[int, int]
    """(nodes, devices per node) of the physical submesh, as in Alpa's stage DP."""
    logical_mesh_shape: tuple[int, ...]
    mesh_axis_names: tuple[str, ...]
    device_ids: tuple[int, ...]
    """Device ids when compiled on real devices; empty for a plan-only result."""
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    communication: tuple[CommEstimate, ...]
    flops: float
    """FLOPs of one training step on this stage, all devices together."""
    compute_seconds: float
    memory_per_device: int
    """Bytes per device of the stage's state: the step's inputs as laid out (parameters, optimizer state,
    batch) for an SPMD method; Eq. 3.5's ``mem_stage`` (parameters, gradients, optimizer state) for a pipeline
    stage. Activations excluded: :attr:`peak_memory_per_device` adds them."""
    ops: tuple[OpPlan, ...] = ()
    """The intra-op pass's choice per parameter and heavy operator (empty for hand-written methods)."""
    solver: SolverReport | None = None
    """How the intra-op ILP was solved (None for hand-written methods)."""
    peak_memory_per_device: int | None = None
    """Bytes one device of the stage needs at the step's peak, estimated
    (:mod:`~alpa_like.compiler.memory_estimate`: Eq. 3.5 for a pipeline stage); None: not estimated."""
    placement: str = ""
    """Where the backend runs the stage's mesh, e.g. ``Ray node 1 (10.0.0.2, id 3f63b52c)``; empty when the
    backend does not say (plan-only results, the local backend)."""

    @property
    def communication_seconds(self) -> float:
        return sum(c.seconds for c in self.communication)

    def to_dict(self) -> dict[str, Any]:
        return {"stage_id": self.stage_id, "layer_ids": list(self.layer_ids),
                "submesh_shape": list(self.submesh_shape), "logical_mesh_shape": list(self.logical_mesh_shape),
                "mesh_axis_names": list(self.mesh_axis_names), "device_ids": list(self.device_ids),
                "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs],
                "communication": [c.to_dict() for c in self.communication], "flops": self.flops,
                "compute_seconds": self.compute_seconds, "memory_per_device": self.memory_per_device,
                "ops": [o.to_dict() for o in self.ops],
                "solver": None if self.solver is None else self.solver.to_dict(),
                "peak_memory_per_device": self.peak_memory_per_device, "placement": self.placement}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], at: str = "") -> StagePlan:
        """Inverse of :meth:`to_dict`, checked like :meth:`TensorPlan.from_dict`, and the fields against each
        other: one axis name per logical mesh axis, as many devices in the logical mesh as in the submesh
        (and in ``device_ids`` when listed), specs and collectives on the logical mesh's axes."""
        get = fields.reader(cls, d, at)
        stage = cls(stage_id=get("stage_id", fields.integer), layer_ids=get("layer_ids", _distinct_ints),
                    submesh_shape=get("submesh_shape", fields.ints, 1, (2,)),
                    logical_mesh_shape=get("logical_mesh_shape", _logical_mesh_shape),
                    mesh_axis_names=get("mesh_axis_names", fields.sequence, fields.string),
                    device_ids=get("device_ids", _distinct_ints),
                    inputs=get("inputs", fields.sequence, TensorPlan.from_dict),
                    outputs=get("outputs", fields.sequence, TensorPlan.from_dict),
                    communication=get("communication", fields.sequence, CommEstimate.from_dict),
                    flops=get("flops", fields.number), compute_seconds=get("compute_seconds", fields.number),
                    memory_per_device=get("memory_per_device", fields.integer),
                    ops=get("ops", fields.sequence, OpPlan.from_dict),
                    solver=get("solver", fields.optional(SolverReport.from_dict)),
                    peak_memory_per_device=get("peak_memory_per_device", fields.optional(fields.integer)),
                    placement=get("placement", fields.string))
        _check_stage_mesh(stage, at)
        return stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """Everything the compiler decided for one step and one input signature."""

    method: str
    """The method's repr, e.g. ``DataParallel(num_micro_batches=2)`` (the printed plan shows it without the
    options left at their defaults: :func:`~alpa_like.compiler.plan_format.method_summary`)."""
    num_micro_batches: int
    """Micro-batches the step runs; under TeraPipe with token slicing, the scheme's batch slices
    (``len(token_slicing)``, which the joint DP of section 2.3.4 may make differ from the method's)."""
    cluster: ClusterSpec
    stages: tuple[StagePlan, ...]
    pipeline_schedule: ScheduleName | None
    """The pipeline's schedule; None for a single-stage (SPMD) plan."""
    estimated_iteration_time: float
    """Seconds per step under the cost model: compute at peak FLOP/s plus modelled communication."""
    warnings: tuple[str, ...] = ()
    compile_times: tuple[tuple[str, float], ...] = ()
    """Seconds spent planning, by step (e.g. trace and layers, intra-op solves, stage DP, other)."""
    token_slicing: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """TeraPipe: (batch-slice size, token slice lengths) of every batch slice; empty: no token slicing."""
    iteration_time_without_token_slicing: float | None = None
    """TeraPipe: the predicted iteration time of the same stages without token slicing."""

    @property
    def num_devices(self) -> int:
        return sum(s.submesh_shape[0] * s.submesh_shape[1] for s in self.stages)

    @property
    def memory_shortfall(self) -> int:
        """Bytes per device the most memory-hungry stage needs beyond ``cluster.device_memory`` (0: the
        plan fits, or no stage's memory was estimated)."""
        peaks = [s.peak_memory_per_device for s in self.stages if s.peak_memory_per_device is not None]
        return max([0, *(p - self.cluster.device_memory for p in peaks)])

    @property
    def fits(self) -> bool:
        """Whether every stage's estimated peak memory fits in one device of ``cluster``."""
        return self.memory_shortfall == 0

    @property
    def cannot_fit(self) -> bool:
        """Whether some stage's state alone (``memory_per_device``, no estimate in it) is more than a device
        holds: then no run of the plan fits, whatever the activations turn out to need."""
        return any(s.memory_per_device > self.cluster.device_memory for s in self.stages)

    def check_fits(self) -> None:
        """Raises ``ValueError`` naming the missing bytes per device when the plan cannot fit
        (:attr:`cannot_fit`); warns when only its estimated peak does not (:attr:`fits`: the estimate counts
        activations as the traced program holds them, and XLA may hold fewer)."""
        if self.cannot_fit:
            raise ValueError(memory_message(self))
        if not self.fits:
            python_warnings.warn(memory_message(self), stacklevel=3)

    def tensor(self, path: str) -> TensorPlan:
        """The TensorPlan of the input or output leaf at ``path``."""
        for stage in self.stages:
            for t in (*stage.inputs, *stage.outputs):
                if t.path == path:
                    return t
        known = [t.path for s in self.stages for t in s.inputs][:8]
        raise KeyError(f"no tensor {path!r} in the plan; inputs include {known}")

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "num_micro_batches": self.num_micro_batches,
                "cluster": self.cluster.to_dict(), "stages": [s.to_dict() for s in self.stages],
                "pipeline_schedule": None if self.pipeline_schedule is None else str(self.pipeline_schedule),
                "estimated_iteration_time": self.estimated_iteration_time, "warnings": list(self.warnings),
                "compile_times": [[name, seconds] for name, seconds in self.compile_times],
                "token_slicing": [[b, list(ls)] for b, ls in self.token_slicing],
                "iteration_time_without_token_slicing": self.iteration_time_without_token_slicing}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], at: str = "") -> ParallelPlan:
        """Inverse of :meth:`to_dict`. Every field, at every level, is checked: a missing, unknown or invalid
        one raises ``ValueError`` naming its path, e.g. ``stages[1].inputs[3].shape: expected a list of ints
        >= 0, got "abc"``. Fields added after a plan was saved take their defaults."""
        get = fields.reader(cls, d, at)
        stages = get("stages", fields.sequence, StagePlan.from_dict)
        schedule = get("pipeline_schedule", fields.optional(fields.choice), _SCHEDULES)
        schedule = None if schedule is None else ScheduleName(schedule)
        _check_stages(stages, schedule, at)
        return cls(method=get("method", fields.string), num_micro_batches=get("num_micro_batches", fields.integer, 1),
                   cluster=get("cluster", _cluster), stages=stages, pipeline_schedule=schedule,
                   estimated_iteration_time=get("estimated_iteration_time", fields.number),
                   warnings=get("warnings", fields.sequence, fields.string),
                   compile_times=get("compile_times", fields.sequence, _compile_time),
                   token_slicing=get("token_slicing", fields.sequence, _batch_slice),
                   iteration_time_without_token_slicing=get("iteration_time_without_token_slicing",
                                                            fields.optional(fields.number)))

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ParallelPlan:
        """Inverse of :meth:`to_json`; text that is not JSON, or not a valid plan (see :meth:`from_dict`),
        raises ``ValueError``."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, too deep, an int of over 4300 digits
            raise ValueError(f"ParallelPlan.from_json: text is not JSON ({e})") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"ParallelPlan.from_json: {e}") from None

    def table(self, *, group_layers: bool = True) -> str:
        """The readable form; ``group_layers`` folds leaves that differ only in a layer number into one row."""
        return format_plan(self, group_layers=group_layers)

    def __str__(self) -> str:
        return self.table()


# ------------------------------------------------------------------------------------------- validation

_KEY_DTYPE = re.compile(r"key<\w+>")
_SCHEDULES = tuple(name.value for name in ScheduleName)


def _dtype(value: Any, at: str) -> str:
    """The name of a dtype a JAX array has: numpy's and ml_dtypes' (``float32``, ``bfloat16``, ``int4``) or a
    typed PRNG key's (``key<fry>``)."""
    if isinstance(value, str) and (_KEY_DTYPE.fullmatch(value) or _is_array_dtype_name(value)):
        return value
    raise fields.invalid(at, "a dtype name such as float32, bfloat16 or key<fry>", value)


def _is_array_dtype_name(name: str) -> bool:
    """Whether ``name`` is the canonical name of a numeric or boolean dtype (not ``<f4``, ``object``, ``U``)."""
    try:
        with python_warnings.catch_warnings():
            python_warnings.simplefilter("ignore")  # numpy warns about deprecated aliases such as "a"
            dtype = np.dtype(name)
    except (TypeError, ValueError):
        return False
    numeric = dtype.kind in "biufc" or (dtype.kind == "V" and not dtype.name.startswith("void"))  # ml_dtypes
    return numeric and dtype.name == name


def _spec(value: Any, at: str, ndim: int) -> ShardingSpec:
    """A sharding spec string (``"S0R"``) of a tensor with ``ndim`` dims."""
    if isinstance(value, str):
        try:
            return ShardingSpec.from_str(value, ndim=ndim)
        except ValueError:
            pass
    example = "a scalar's is the empty string" if ndim == 0 else "e.g. " + json.dumps("S0" + "R" * (ndim - 1))
    raise fields.invalid(at, f"a sharding spec of {ndim} dims ({example})", value)


def _distinct_ints(value: Any, at: str) -> tuple[int, ...]:
    """A list of distinct ints >= 0 (layer ids, device ids, mesh axes)."""
    ids = fields.ints(value, at)
    if len(set(ids)) != len(ids):
        raise fields.invalid(at, "a list of distinct ints >= 0", value)
    return ids


def _logical_mesh_shape(value: Any, at: str) -> tuple[int, ...]:
    """A 1-D or 2-D mesh shape of positive ints."""
    return fields.ints(value, at, 1, (1, 2))


def _pair(value: Any, at: str, what: str) -> Sequence[Any]:
    """A JSON list of two elements, described as ``what`` in the error."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise fields.invalid(at, what, value)
    return value


def _view(value: Any, at: str) -> tuple[tuple[int, ...], float]:
    """``[logical mesh shape, objective]`` of one view the intra-op pass tried."""
    shape, objective = _pair(value, at, "a [logical mesh shape, objective] pair")
    return _logical_mesh_shape(shape, f"{at}[0]"), fields.number(objective, f"{at}[1]")


def _compile_time(value: Any, at: str) -> tuple[str, float]:
    """``[planning step, seconds]``."""
    name, seconds = _pair(value, at, "a [planning step, seconds] pair")
    return fields.string(name, f"{at}[0]"), fields.number(seconds, f"{at}[1]")


def _batch_slice(value: Any, at: str) -> tuple[int, tuple[int, ...]]:
    """``[rows, token slice lengths]`` of one TeraPipe batch slice."""
    rows, lengths = _pair(value, at, "a [rows, token slice lengths] pair")
    rows, lengths = fields.integer(rows, f"{at}[0]", 1), fields.ints(lengths, f"{at}[1]", 1)
    if not lengths:
        raise fields.invalid(f"{at}[1]", "a non-empty list of ints >= 1", [])
    return rows, lengths


def _cluster(value: Any, at: str) -> ClusterSpec:
    if not isinstance(value, Mapping):
        raise fields.invalid(at, "a JSON object (a ClusterSpec)", value)
    try:
        return ClusterSpec.from_dict(value)
    except ValueError as e:
        raise ValueError(f"{at}: {e}") from None


def _check_stage_mesh(stage: StagePlan, at: str) -> None:
    """Raises ValueError naming the first field of ``stage`` that does not fit its meshes."""
    mesh_ndim = len(stage.logical_mesh_shape)
    if len(stage.mesh_axis_names) != mesh_ndim or len(set(stage.mesh_axis_names)) != mesh_ndim:
        raise fields.invalid(fields.join(at, "mesh_axis_names"),
                             f"{mesh_ndim} distinct names (one per logical mesh axis)", list(stage.mesh_axis_names))
    num_devices = math.prod(stage.submesh_shape)
    if math.prod(stage.logical_mesh_shape) != num_devices:
        raise fields.invalid(fields.join(at, "logical_mesh_shape"),
                             f"a view of the submesh's {num_devices} devices", list(stage.logical_mesh_shape))
    if stage.device_ids and len(stage.device_ids) != num_devices:
        raise fields.invalid(fields.join(at, "device_ids"), f"[] or the submesh's {num_devices} device ids",
                             list(stage.device_ids))
    for name, items in (("inputs", stage.inputs), ("outputs", stage.outputs), ("ops", stage.ops)):
        for i, t in enumerate(items):
            if t.spec is not None and not t.spec.is_valid(stage.logical_mesh_shape):
                raise fields.invalid(fields.join(at, f"{name}[{i}].spec"),
                                     f"a spec on the axes of the {mesh_ndim}-D logical mesh", str(t.spec))
    for i, c in enumerate(stage.communication):
        if any(a >= mesh_ndim for a in c.mesh_axes):
            raise fields.invalid(fields.join(at, f"communication[{i}].mesh_axes"),
                                 f"axes of the {mesh_ndim}-D logical mesh", list(c.mesh_axes))


def _check_stages(stages: Sequence[StagePlan], schedule: str | None, at: str) -> None:
    """Raises ValueError unless there are stages, numbered 0, 1, ..., with a schedule when there are several."""
    if not stages:
        raise fields.invalid(fields.join(at, "stages"), "at least one stage", [])
    for i, s in enumerate(stages):
        if s.stage_id != i:
            raise fields.invalid(fields.join(at, f"stages[{i}].stage_id"), f"{i} (its position)", s.stage_id)
    if schedule is None and len(stages) > 1:
        raise fields.invalid(fields.join(at, "pipeline_schedule"), f"a schedule name for {len(stages)} stages",
                             None)
