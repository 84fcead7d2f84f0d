"""The parallel plan: plain, frozen data that says what the compiler decided.

A :class:`ParallelPlan` is produced before anything runs (``al.plan``) or when a step is compiled
(``exe.plan``). It prints as a table a user can act on, and round-trips exactly through JSON::

    text = plan.to_json()
    assert al.ParallelPlan.from_json(text) == plan
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from alpa_like.cluster import ClusterSpec
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.token_slicing import format_scheme

ROLES = ("param", "optimizer_state", "state", "batch", "output")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorPlan:
    """How one input or output leaf of the step is laid out on its stage's mesh."""

    path: str
    """Pytree path, e.g. ``state.params.block_0.attn.qkv.kernel`` or ``out.1.loss``."""
    shape: tuple[int, ...]
    dtype: str
    role: str
    """One of ROLES: ``param`` (differentiated by al.grad), ``optimizer_state`` (other state leaves when
    parameters are known), ``state`` (other non-batch inputs), ``batch``, ``output``."""
    spec: ShardingSpec | None
    """Alpa notation per tensor dim (S0, S1, S01, R); None when XLA chooses (outputs only)."""
    bytes_per_device: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype, "role": self.role,
                "spec": None if self.spec is None else str(self.spec), "bytes_per_device": self.bytes_per_device}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorPlan:
        shape = tuple(d["shape"])
        spec = None if d["spec"] is None else ShardingSpec.from_str(d["spec"], ndim=len(shape))
        return cls(path=d["path"], shape=shape, dtype=d["dtype"], role=d["role"], spec=spec,
                   bytes_per_device=d["bytes_per_device"])


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
    def from_dict(cls, d: Mapping[str, Any]) -> CommEstimate:
        return cls(kind=d["kind"], mesh_axes=tuple(d["mesh_axes"]), num_bytes=d["num_bytes"],
                   seconds=d["seconds"], what=d["what"])


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
    def from_dict(cls, d: Mapping[str, Any]) -> OpPlan:
        shape = tuple(d["shape"])
        return cls(name=d["name"], kind=d["kind"], shape=shape, spec=ShardingSpec.from_str(d["spec"], ndim=len(shape)),
                   strategy=d["strategy"], communication=d["communication"], seconds=d["seconds"])


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
    def from_dict(cls, d: Mapping[str, Any]) -> PlanCandidate:
        return cls(logical_mesh_shape=tuple(d["logical_mesh_shape"]), cost_model=d["cost_model"],
                   weight_update_sharding=d["weight_update_sharding"], objective=d["objective"], measured_seconds=d["measured_seconds"], same_as=d["same_as"],
                   chosen=d["chosen"])


SELECTIONS = ("objective", "measured")
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
    def from_dict(cls, d: Mapping[str, Any]) -> SolverReport:
        return cls(status=d["status"], objective=d["objective"], solve_seconds=d["solve_seconds"],
                   num_nodes=d["num_nodes"], num_edges=d["num_edges"], num_variables=d["num_variables"],
                   num_constraints=d["num_constraints"],
                   views=tuple((tuple(shape), objective) for shape, objective in d["views"]),
                   selection=d.get("selection", "objective"),
                   candidates=tuple(PlanCandidate.from_dict(c) for c in d.get("candidates", ())),
                   selection_seconds=d.get("selection_seconds", 0.0))


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
    """Bytes per device of the stage's inputs (parameters, optimizer state, batch); activations excluded (a
    pipeline stage: Eq. 3.5's estimate, activations in flight included)."""
    ops: tuple[OpPlan, ...] = ()
    """The intra-op pass's choice per parameter and heavy operator (empty for hand-written methods)."""
    solver: SolverReport | None = None
    """How the intra-op ILP was solved (None for hand-written methods)."""
    peak_memory_per_device: int | None = None
    """Bytes one device of the stage needs at the step's peak, estimated
    (:mod:`~alpa_like.compiler.memory_estimate`: Eq. 3.5 for a pipeline stage); None: not estimated."""

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
                "peak_memory_per_device": self.peak_memory_per_device}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StagePlan:
        return cls(stage_id=d["stage_id"], layer_ids=tuple(d["layer_ids"]),
                   submesh_shape=tuple(d["submesh_shape"]), logical_mesh_shape=tuple(d["logical_mesh_shape"]),
                   mesh_axis_names=tuple(d["mesh_axis_names"]), device_ids=tuple(d["device_ids"]),
                   inputs=tuple(TensorPlan.from_dict(t) for t in d["inputs"]),
                   outputs=tuple(TensorPlan.from_dict(t) for t in d["outputs"]),
                   communication=tuple(CommEstimate.from_dict(c) for c in d["communication"]),
                   flops=d["flops"], compute_seconds=d["compute_seconds"],
                   memory_per_device=d["memory_per_device"],
                   ops=tuple(OpPlan.from_dict(o) for o in d.get("ops", ())),
                   solver=None if d.get("solver") is None else SolverReport.from_dict(d["solver"]),
                   peak_memory_per_device=d.get("peak_memory_per_device"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """Everything the compiler decided for one step and one input signature."""

    method: str
    """The method's repr, e.g. ``DataParallel(num_micro_batches=2)``."""
    num_micro_batches: int
    """Micro-batches the step runs; under TeraPipe with token slicing, the scheme's batch slices
    (``len(token_slicing)``, which the joint DP of section 2.3.4 may make differ from the method's)."""
    cluster: ClusterSpec
    stages: tuple[StagePlan, ...]
    pipeline_schedule: str | None
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

    def check_fits(self) -> None:
        """Raises ``ValueError`` naming the missing bytes per device when the plan does not fit."""
        if not self.fits:
            raise ValueError(memory_message(self))

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
                "pipeline_schedule": self.pipeline_schedule,
                "estimated_iteration_time": self.estimated_iteration_time, "warnings": list(self.warnings),
                "compile_times": [[name, seconds] for name, seconds in self.compile_times],
                "token_slicing": [[b, list(ls)] for b, ls in self.token_slicing],
                "iteration_time_without_token_slicing": self.iteration_time_without_token_slicing}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParallelPlan:
        return cls(method=d["method"], num_micro_batches=d["num_micro_batches"],
                   cluster=ClusterSpec.from_dict(d["cluster"]),
                   stages=tuple(StagePlan.from_dict(s) for s in d["stages"]),
                   pipeline_schedule=d["pipeline_schedule"],
                   estimated_iteration_time=d["estimated_iteration_time"], warnings=tuple(d["warnings"]),
                   compile_times=tuple((name, seconds) for name, seconds in d.get("compile_times", ())),
                   token_slicing=tuple((b, tuple(ls)) for b, ls in d.get("token_slicing", ())),
                   iteration_time_without_token_slicing=d.get("iteration_time_without_token_slicing"))

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ParallelPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"ParallelPlan.from_json: text is not JSON ({e})") from None
        return cls.from_dict(data)

    def table(self, *, group_layers: bool = True) -> str:
        """The readable form; ``group_layers`` folds leaves that differ only in a layer number into one row."""
        return format_plan(self, group_layers=group_layers)

    def __str__(self) -> str:
        return self.table()


# ---------------------------------------------------------------------------------------------- printing

def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _candidates_text(report: SolverReport) -> str:
    """The measured plan selection: one row per candidate plan."""
    distinct = sum(c.same_as is None for c in report.candidates)
    rows = []
    for i, c in enumerate(report.candidates):
        measured = f"same program as #{c.same_as}" if c.measured_seconds is None else format_seconds(
            c.measured_seconds)
        rows.append([str(i), "x".join(map(str, c.logical_mesh_shape)), c.cost_model,
                     "on" if c.weight_update_sharding else "off", format_seconds(c.objective), measured,
                     "chosen" if c.chosen else ""])
    head = (f"  plan selection: measured, {len(report.candidates)} candidates ({distinct} distinct programs) "
            f"compiled and timed on the devices in {report.selection_seconds:.1f} s")
    return head + "\n" + format_table(["#", "view", "cost model", "weight-update sharding", "objective",
                                        "measured step", ""], rows, indent="    ")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Left-aligned text columns separated by two spaces."""
    widths = [max(len(str(r[i])) for r in (headers, *rows)) for i in range(len(headers))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in (headers, *rows)]
    return "\n".join(indent + line for line in lines)


def partition_spec_str(spec: ShardingSpec | None, axis_names: Sequence[str]) -> str:
    if spec is None:
        return "chosen by XLA"
    if not spec.axes:
        return "P()"
    return str(spec.to_partition_spec(tuple(axis_names)))


_LAYER_NUMBER = re.compile(r"(?<=[A-Za-z]_)\d+(?=\.|$)")
"""The number of a layer-like path component (``block_3`` -> ``block_*``); plain indices stay."""


def _tensor_rows(tensors: Sequence[TensorPlan], axis_names: Sequence[str], group_layers: bool):
    groups: dict[tuple, list[TensorPlan]] = {}
    for t in tensors:
        key_path = _LAYER_NUMBER.sub("*", t.path) if group_layers else t.path
        key = (key_path, t.shape, t.dtype, t.role, None if t.spec is None else str(t.spec))
        groups.setdefault(key, []).append(t)
    rows = []
    for (path, shape, dtype, role, _), members in groups.items():
        if len(members) == 1:
            path = members[0].path
        else:
            path = f"{path} (x{len(members)})"
        t = members[0]
        rows.append([path, "x".join(map(str, shape)) or "scalar", dtype, role,
                     "-" if t.spec is None else (str(t.spec) or "scalar"),
                     partition_spec_str(t.spec, axis_names), format_bytes(t.bytes_per_device * len(members))])
    return rows


def mirrored_outputs(stage: StagePlan) -> list[TensorPlan]:
    """Outputs laid out exactly like the input they update (``out.0.params.w`` like ``state.params.w``)."""
    inputs = {(t.path.split(".", 1)[-1], t.shape, t.spec) for t in stage.inputs}
    mirrored = []
    for t in stage.outputs:
        parts = t.path.split(".")
        rest = ".".join(parts[2:] if len(parts) > 2 and parts[1].isdigit() else parts[1:])
        if (rest, t.shape, t.spec) in inputs:
            mirrored.append(t)
    return mirrored


_OP_LAYER_NUMBER = re.compile(r"(?<=[A-Za-z]_)\d+(?=[./]|$)")


def _op_rows(ops: Sequence[OpPlan], group_layers: bool) -> list[OpPlan]:
    """Ops that differ only in a layer number folded into one row (seconds summed, name marked ``xN``)."""
    if not group_layers:
        return list(ops)
    groups: dict[tuple, list[OpPlan]] = {}
    for o in ops:
        key = (_OP_LAYER_NUMBER.sub("*", o.name), o.kind, o.shape, str(o.spec), o.strategy, o.communication)
        groups.setdefault(key, []).append(o)
    rows = []
    for (name, *_), members in groups.items():
        first = members[0]
        if len(members) == 1:
            rows.append(first)
        else:
            rows.append(dataclasses.replace(first, name=f"{name} (x{len(members)})",
                                            seconds=sum(m.seconds for m in members)))
    return rows


def memory_message(plan: ParallelPlan) -> str:
    """One line on the plan's peak memory per device against the cluster's device memory."""
    peaks = [s.peak_memory_per_device for s in plan.stages if s.peak_memory_per_device is not None]
    if not peaks:
        return "memory per device not estimated"
    capacity = plan.cluster.device_memory
    head = (f"peak memory per device {format_bytes(max(peaks))} (estimated) of {format_bytes(capacity)}")
    if plan.fits:
        return f"{head}: fits"
    worst = max(range(len(plan.stages)), key=lambda q: plan.stages[q].peak_memory_per_device or -1)
    where = f" on stage {worst}" if len(plan.stages) > 1 else ""
    return (f"{head}: does NOT fit; {format_bytes(plan.memory_shortfall)} ({plan.memory_shortfall} bytes) "
            f"more per device needed{where} (use more devices, more micro-batches, a sharding method such as "
            "Zero3Parallel or ShardParallel, or a cluster with more memory per device)")


def format_plan(plan: ParallelPlan, *, group_layers: bool = True) -> str:
    c = plan.cluster
    lines = [f"ParallelPlan  {plan.method}",
             f"  cluster: {c.name}, {c.num_nodes} node(s) x {c.num_devices_per_node} {c.device_name}"
             + (f", measured {c.measured_at}" if c.measured_at else ""),
             f"  schedule: {plan.pipeline_schedule or 'none (single stage)'}, "
             f"micro-batches: {plan.num_micro_batches}, stages: {len(plan.stages)}",
             f"  estimated iteration time: {format_seconds(plan.estimated_iteration_time)}",
             f"  memory: {memory_message(plan)}"]
    if plan.compile_times:
        total = sum(seconds for _, seconds in plan.compile_times)
        parts = ", ".join(f"{name} {format_seconds(seconds)}" for name, seconds in plan.compile_times)
        lines.append(f"  planning time: {format_seconds(total)} ({parts})")
    if plan.pipeline_schedule == "terapipe":
        scheme = format_scheme(plan.token_slicing) if plan.token_slicing else "none (whole sequences)"
        without = plan.iteration_time_without_token_slicing
        lines.append(f"  token slicing (TeraPipe): {scheme}"
                     + (f"; without it: {format_seconds(without)}" if without is not None else ""))
    lines += [f"  warning: {w}" for w in plan.warnings]
    for s in plan.stages:
        contiguous = list(s.layer_ids) == list(range(s.layer_ids[0], s.layer_ids[-1] + 1)) if s.layer_ids else True
        layers = ("all" if not s.layer_ids else f"{s.layer_ids[0]}-{s.layer_ids[-1]}" if contiguous
                  else ",".join(map(str, s.layer_ids)))
        lines.append("")
        lines.append(f"Stage {s.stage_id}: layers {layers}, submesh {s.submesh_shape}, logical mesh "
                     f"{s.logical_mesh_shape} axes {s.mesh_axis_names}"
                     + (f", devices {list(s.device_ids)}" if s.device_ids else ""))
        lines.append(f"  compute {format_seconds(s.compute_seconds)} ({s.flops:.3g} FLOP), communication "
                     f"{format_seconds(s.communication_seconds)}, inputs per device "
                     f"{format_bytes(s.memory_per_device)}")
        headers = ["tensor", "shape", "dtype", "role", "spec", "partition spec", "per device"]
        mirrored = mirrored_outputs(s)
        mirrored_ids = {id(t) for t in mirrored}
        shown = [t for t in s.outputs if id(t) not in mirrored_ids]
        if s.inputs or shown:
            lines.append(format_table(headers, _tensor_rows([*s.inputs, *shown], s.mesh_axis_names, group_layers)))
        else:
            lines.append("  tensors: no per-tensor layouts recorded (layouts are left to XLA: e.g. a looping schedule "
                         "re-deals the layers after the intra-op pass chose layouts for its stages)")
        if mirrored:
            lines.append(f"  ({len(mirrored)} outputs are laid out like the inputs they update and are not listed)")
        if s.solver is not None:
            v = s.solver
            views = ", ".join(f"{'x'.join(map(str, shape))}: {format_seconds(obj)}" for shape, obj in v.views)
            lines.append(f"  intra-op ILP: {v.status}, objective {format_seconds(v.objective)}, solved in "
                         f"{v.solve_seconds:.2f} s ({v.num_nodes} nodes, {v.num_edges} edges, {v.num_variables} "
                         f"variables, {v.num_constraints} constraints)" + (f"; views {views}" if views else ""))
            if v.candidates:
                lines.append(_candidates_text(v))
        if s.ops:
            lines.append("  chosen strategies (parameters and heavy operators):")
            rows = [[o.name, o.kind, "x".join(map(str, o.shape)) or "scalar", str(o.spec) or "scalar",
                     o.strategy, format_seconds(o.seconds), o.communication] for o in _op_rows(s.ops, group_layers)]
            lines.append(format_table(["name", "kind", "shape", "spec", "strategy", "time", "communication"],
                                      rows, indent="    "))
        if s.communication:
            lines.append("  communication per step:")
            rows = [[c.kind, f"axes {c.mesh_axes}", format_bytes(c.num_bytes), format_seconds(c.seconds), c.what]
                    for c in s.communication]
            lines.append(format_table(["collective", "mesh axes", "bytes", "time", "why"], rows, indent="    "))
    return "\n".join(lines)
