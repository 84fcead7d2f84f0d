"""What a user asks for: the parallelization methods and the options of the compiler's passes.

Each is a frozen dataclass, checked when it is made (a bad value is a ``ValueError`` or ``TypeError`` naming
the field and what it must be), with no logic of its own; the passes that read them live elsewhere:

* one mesh (SPMD): :class:`DataParallel`, :class:`Zero2Parallel`, :class:`Zero3Parallel` and
  :class:`ManualShardParallel`, laid out by :mod:`alpa_like.methods`; :class:`ShardParallel` with its
  :class:`AutoShardingOption`, the intra-op ILP of :mod:`alpa_like.shard_parallel`;
* a pipeline: :class:`PipeshardParallel` with a layer option (:class:`AutoLayerOption`,
  :class:`ManualLayerOption`) and a stage option (:class:`AutoStageOption`, :class:`ManualStageOption`,
  :class:`UniformStageOption`), planned by :func:`alpa_like.compiler.pipeline.plan_pipeline` and built by
  :mod:`alpa_like.pipeshard`;
* the rest of a training run: :class:`CreateStateParallel` and :class:`FollowParallel`
  (:mod:`alpa_like.training`).

Users name them through ``alpa_like`` (``al.PipeshardParallel(...)``). They sit on the compiler's floor
because the pipeline of passes reads them and plans print them (:func:`alpa_like.compiler.plan.method_summary`).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Any

from alpa_like.compiler.ilp import DEFAULT_SOLVER, SOLVERS
from alpa_like.compiler.layer_construction import Layering, auto_layers, manual_layers
from alpa_like.compiler.schedules import ScheduleName
from alpa_like.compiler.submesh import SHAPE_SPACES
from alpa_like.compiler.token_slicing import is_token_lengths

if TYPE_CHECKING:
    from alpa_like.compiler.plan import ParallelPlan

Shape = tuple[int, int]
SELECTIONS = ("objective", "measured")
"""How :class:`ShardParallel` picks its plan among the logical views (:attr:`AutoShardingOption.plan_selection`)."""

def _check_micro_batches(num_micro_batches: Any) -> None:
    if not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be a positive int, got {num_micro_batches!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataParallel:
    """Batch sharded over all devices along dim 0; parameters and state replicated."""

    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Zero2Parallel:
    """DataParallel with optimizer state and gradients sharded (ZeRO stage 2, Alpa's weight-update sharding)."""

    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Zero3Parallel:
    """Zero2Parallel with the parameters sharded too (ZeRO stage 3 / fully sharded data parallel)."""

    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManualShardParallel:
    """A device mesh and partition specs written by hand, the way pjit / MaxText users write them.

    Example::

        method = al.ManualShardParallel(
            mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
            in_specs=(state_specs, PartitionSpec("data")),      # one pytree prefix per positional argument
        )
        # or with logical names, mapped by rules (unmatched names are an error):
        method = al.ManualShardParallel(
            mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
            in_specs=(state_logical_specs, PartitionSpec("batch")),
            logical_axis_rules=(("batch", "data"), ("mlp", "model"), ("embed", None)),
        )
    """

    mesh_shape: tuple[int, ...]
    """Devices per mesh axis; the product must equal the number of devices."""
    mesh_axis_names: tuple[str, ...]
    """One name per mesh axis."""
    in_specs: tuple[Any, ...]
    """One entry per positional argument of the step: a pytree prefix of it whose leaves are
    PartitionSpec (or None for replicated). Entries for static arguments are ignored."""
    out_specs: Any = None
    """A pytree prefix of the output with PartitionSpec leaves; None keeps the input's spec for outputs that
    mirror an input argument (e.g. the new train state) and lets XLA choose the rest."""
    logical_axis_rules: tuple[tuple[str, Any], ...] | None = None
    """(logical name, mesh axis name | tuple of names | None) pairs: PartitionSpec entries of in_specs and
    out_specs are then logical names. Duplicate names are an error."""
    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)
        if not self.mesh_shape or any(not isinstance(n, int) or n < 1 for n in self.mesh_shape):
            raise ValueError(f"mesh_shape must be a tuple of positive ints, got {self.mesh_shape!r}")
        if len(self.mesh_axis_names) != len(self.mesh_shape):
            raise ValueError(f"mesh_axis_names {self.mesh_axis_names!r} must name each of the "
                             f"{len(self.mesh_shape)} axes of mesh_shape {self.mesh_shape!r}")
        if len(self.mesh_shape) > 2:
            raise ValueError(f"mesh_shape {self.mesh_shape!r} has {len(self.mesh_shape)} axes; logical meshes are "
                             "1-D or 2-D (Alpa's S0/S1 notation)")
        if len(set(self.mesh_axis_names)) != len(self.mesh_axis_names):
            raise ValueError(f"mesh_axis_names has duplicates: {self.mesh_axis_names!r}")
        if self.logical_axis_rules is not None:
            names = [name for name, _ in self.logical_axis_rules]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"logical_axis_rules has duplicate logical names {dup}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoShardingOption:
    """Knobs of the intra-op pass (Alpa's ``AutoShardingOption``)."""

    memory_budget_per_device: float | None = None
    """Bytes per device that the tensors live at any point of the step may use; None: no limit."""
    allow_all_to_all: bool = True
    """Allow all-to-all for resharding (Table 3.2 #4, #5); False prices it as all-gather then slice."""
    prefer_reduce_scatter: bool = True
    """Post-ILP: turn a gradient's all-reduce into reduce-scatter + all-gather and shard its optimizer
    state and update (weight-update sharding / ZeRO), as Alpa does by default."""
    force_batch_dim_to_mesh_axis: int | None = None
    """Shard dim 0 of every batch leaf on this mesh axis (0 or 1) when it has more than one device;
    None lets the ILP choose."""
    solver_time_limit: float = 60.0
    """Seconds the solver may spend per logical view; it then keeps its best solution (see the plan's status)."""
    logical_mesh_shape: tuple[int, int] | None = None
    """Use only this logical view (n0, n1) of the devices instead of trying all of them."""
    solver: str = DEFAULT_SOLVER
    """MILP solver: ``"highs"`` (default: HiGHS via scipy, LP relaxation first) or ``"cbc"`` (PuLP's bundled CBC,
    as Alpa)."""
    plan_selection: str = "objective"
    """How the plan is picked among the logical views: ``"objective"`` (default), the lowest Eq. 3.1
    objective; ``"measured"``, the fastest on the devices of its candidates (each view's plan under each of
    :data:`COST_MODELS`, with and without the weight-update sharding when ``prefer_reduce_scatter``), each
    compiled and timed at compile time (see the module docstring; this costs
    one compilation per distinct candidate). ``al.plan`` runs nothing, so there it falls back to
    ``"objective"`` with a warning in the plan."""
    measure_rounds: int = 10
    """``plan_selection="measured"``: timing rounds, each running every distinct candidate once in a
    shuffled order, after one warm-up run each; a candidate's time is its median."""

    def __post_init__(self):
        budget = self.memory_budget_per_device
        if budget is not None and (not isinstance(budget, numbers.Real) or isinstance(budget, bool)
                                   or not budget > 0):
            raise ValueError(f"memory_budget_per_device must be a number of bytes > 0 or None, got {budget!r}")
        for name in ("allow_all_to_all", "prefer_reduce_scatter"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        axis = self.force_batch_dim_to_mesh_axis
        if axis is not None and (not _is_int(axis) or axis not in (0, 1)):
            raise ValueError(f"force_batch_dim_to_mesh_axis must be 0, 1 or None, got {axis!r}")
        limit = self.solver_time_limit
        if not isinstance(limit, numbers.Real) or isinstance(limit, bool) or not limit > 0:
            raise ValueError(f"solver_time_limit must be a number of seconds > 0, got {limit!r}")
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {self.solver!r}")
        shape = self.logical_mesh_shape
        if shape is not None and (not isinstance(shape, tuple) or len(shape) != 2
                                  or not all(_is_int(n) and n >= 1 for n in shape)):
            raise ValueError(f"logical_mesh_shape must be a tuple (n0, n1) of ints >= 1 or None, got {shape!r}")
        if self.plan_selection not in SELECTIONS:
            raise ValueError(f"plan_selection must be one of {SELECTIONS}, got {self.plan_selection!r}")
        if not _is_int(self.measure_rounds) or self.measure_rounds < 1:
            raise ValueError(f"measure_rounds must be an int >= 1, got {self.measure_rounds!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardParallel:
    """Intra-operator parallelism chosen by Alpa's ILP (Eq. 3.1) over one mesh of all devices."""

    num_micro_batches: int = 1
    """Gradient accumulation steps inside one training step (needs al.grad when > 1)."""
    auto_sharding_option: AutoShardingOption = AutoShardingOption()
    """Knobs of the intra-op pass."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)
        if not isinstance(self.auto_sharding_option, AutoShardingOption):
            raise TypeError(f"auto_sharding_option must be an al.AutoShardingOption, got "
                            f"{type(self.auto_sharding_option).__name__}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoLayerOption:
    """Cut the loss into ``layer_num`` layers by operator clustering (Eq. 3.6)."""

    layer_num: int
    """Number of layers L (the stage DP groups them into stages)."""
    eps: float | None = None
    """delta of Eq. 3.6: each layer has at most (1 + eps) x the average FLOPs. None (the default): Alpa's 0.6,
    or the smallest slack that admits a clustering when 0.6 does not (an operator heavier than an average
    layer, like a large vocabulary's logits, makes 0.6 infeasible). A number is kept as it is: a clustering it
    does not admit is an error that names the least slack that would do."""
    remat_layer: bool = False
    """Recompute each layer's forward in its backward (`jax.checkpoint` per layer)."""
    recompute_aware: bool | str = False
    """With ``remat_layer``: Eq. 3.6's tie-break prefers, among the clusterings of optimal communication, layers
    ending where less is recomputed, after a convolution or matmul whose output the backward does not read
    (:func:`~alpa_like.compiler.layer_construction.recompute_savings`). Fewer FLOPs, but such cuts carry more
    bytes (the operator's output beside the residual), which a pipeline across nodes pays: off by default.
    ``"auto"``: plan the step with both tie-breaks and keep the plan of the lower estimated iteration time
    (twice the planning; layers are cut before the cluster is known, so only the plans can tell)."""

    def __post_init__(self):
        if self.recompute_aware not in (False, True, "auto"):
            raise ValueError(f"AutoLayerOption.recompute_aware must be False, True or 'auto', got "
                             f"{self.recompute_aware!r}")
        if self.recompute_aware and not self.remat_layer:
            raise ValueError(f"AutoLayerOption.recompute_aware={self.recompute_aware!r} needs remat_layer=True "
                             "(without rematerialization no layer recomputes anything)")
        if not isinstance(self.layer_num, int) or self.layer_num < 1:
            raise ValueError(f"AutoLayerOption.layer_num must be an int >= 1, got {self.layer_num!r}")
        if self.eps is not None and not self.eps >= 0:
            raise ValueError(f"AutoLayerOption.eps must be >= 0 or None, got {self.eps!r}")

    def choices(self) -> tuple[AutoLayerOption, ...]:
        """The layer options planning tries: both tie-breaks for ``recompute_aware="auto"``, else this one."""
        if self.recompute_aware == "auto":
            return (dataclasses.replace(self, recompute_aware=False), dataclasses.replace(self, recompute_aware=True))
        return (self,)

    def layering(self) -> Layering:
        if self.recompute_aware == "auto":
            raise ValueError("AutoLayerOption(recompute_aware='auto') is two layerings: plan each of choices()")
        return Layering(assign=auto_layers(self.layer_num, self.eps, self.recompute_aware), remat=self.remat_layer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManualLayerOption:
    """Layers end where the loss calls ``al.mark_pipeline_boundary()``."""

    remat_layer: bool = False
    """Recompute each layer's forward in its backward (`jax.checkpoint` per layer)."""

    def choices(self) -> tuple[ManualLayerOption]:
        return (self,)

    def layering(self) -> Layering:
        return Layering(assign=manual_layers, remat=self.remat_layer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoStageOption:
    """Choose stages, submeshes and logical meshes with the stage DP (Eq. 3.2-3.5)."""

    submesh_shapes: tuple[Shape, ...] | None = None
    """Restrict the submesh shapes the DP may use to these; None: the shapes of ``submesh_shape_space``."""
    submesh_shape_space: str = "auto"
    """Without ``submesh_shapes``: ``"all"``: (1,1), (1,2), (1,4)..(1,M), (2,M)..(N,M); ``"power_of_two"``:
    the whole-node meshes only (2,M), (4,M), (8,M).. (Alpa's default); ``"auto"``: ``"all"`` on clusters of
    at most :data:`ALL_SHAPES_MAX_NODES` nodes, ``"power_of_two"`` on larger ones, where the intra-op
    solves and the stage DP grow with every shape."""
    logical_shape_space: str = "all"
    """Logical views profiled per submesh: ``"all"`` 2-D factorisations, or ``"single_node_model_parallel"``:
    only views whose second axis fits inside a node (b divides M), as Alpa's default benchmark setting."""
    epsilon: float = 1e-6
    """Seconds: t_max candidates closer than this are solved once (the pruned enumeration's step)."""
    max_workers: int | None = None
    """Workers for the intra-op solves; None: one per core. Forked processes, else threads (no ``fork``, or a
    process connected to Ray, whose forked children can hang)."""
    show_progress: bool = True
    """Print planning progress to stderr."""
    equal_layers: bool = False
    """Alpa's "equal layer" ablation (Fig. 3.9): the DP may only cut stages of one common number of layers
    (every number dividing the layers is tried, the best plan kept); it still chooses the submeshes and
    logical meshes."""

    def __post_init__(self):
        spaces = ("all", "single_node_model_parallel")
        if self.logical_shape_space not in spaces:
            raise ValueError(f"AutoStageOption.logical_shape_space must be one of {spaces}, got "
                             f"{self.logical_shape_space!r}")
        if self.submesh_shape_space not in ("auto",) + SHAPE_SPACES:
            raise ValueError(f"AutoStageOption.submesh_shape_space must be one of {('auto',) + SHAPE_SPACES}, "
                             f"got {self.submesh_shape_space!r}")
        if self.submesh_shapes is not None and self.submesh_shape_space != "auto":
            raise ValueError(f"AutoStageOption takes submesh_shapes or submesh_shape_space, not both (got "
                             f"{self.submesh_shapes!r} and {self.submesh_shape_space!r})")

    def shape_space(self, num_nodes: int) -> str:
        """The submesh shape space on a cluster of ``num_nodes`` nodes (``"auto"`` resolved)."""
        if self.submesh_shape_space != "auto":
            return self.submesh_shape_space
        return "all" if num_nodes <= ALL_SHAPES_MAX_NODES else "power_of_two"


ALL_SHAPES_MAX_NODES = 8
"""``AutoStageOption(submesh_shape_space="auto")`` searches every whole-node mesh up to this many nodes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManualStageOption:
    """Stages written by hand: layer ids, physical submesh and logical mesh of each stage."""

    forward_stage_layer_ids: tuple[tuple[int, ...], ...]
    """Per stage, its consecutive layer ids, e.g. ((0, 1), (2, 3))."""
    submesh_physical_shapes: tuple[Shape, ...]
    """Per stage, (nodes, devices per node); they must cover the cluster."""
    submesh_logical_shapes: tuple[Shape, ...]
    """Per stage, the 2-D logical view of its devices."""
    show_progress: bool = True

    def __post_init__(self):
        for name in ("forward_stage_layer_ids", "submesh_physical_shapes", "submesh_logical_shapes"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or not value:
                raise ValueError(f"ManualStageOption.{name} must be a non-empty tuple (one entry per stage), "
                                 f"got {value!r}")
            object.__setattr__(self, name, tuple(tuple(entry) if isinstance(entry, (tuple, list)) else entry
                                                 for entry in value))
        for q, (physical, logical) in enumerate(zip(self.submesh_physical_shapes, self.submesh_logical_shapes)):
            _check_shape(f"ManualStageOption.submesh_physical_shapes[{q}]", physical)
            _check_shape(f"ManualStageOption.submesh_logical_shapes[{q}]", logical)
            if physical[0] * physical[1] != logical[0] * logical[1]:
                raise ValueError(f"ManualStageOption.submesh_logical_shapes[{q}] = {logical} must view the "
                                 f"{physical[0] * physical[1]} devices of submesh_physical_shapes[{q}] = {physical}")

    @classmethod
    def from_plan(cls, plan: ParallelPlan, show_progress: bool = True) -> ManualStageOption:
        """The stages of a saved pipeshard ``plan`` (``ParallelPlan.from_json``) as a stage option, to run the
        step on them again without the stage DP (the intra-op pass still runs on each stage)."""
        if not plan.stages or any(not s.layer_ids for s in plan.stages):
            raise ValueError("ManualStageOption.from_plan needs a PipeshardParallel plan (its stages list their "
                             "layers); this plan has none")
        if any(list(s.layer_ids) != list(range(s.layer_ids[0], s.layer_ids[-1] + 1)) for s in plan.stages):
            raise ValueError("ManualStageOption.from_plan: the plan's meshes hold non-consecutive layers (a "
                             "looping schedule with virtual_stages > 1 deals them round-robin), which "
                             "ManualStageOption cannot express")
        return cls(forward_stage_layer_ids=tuple(tuple(s.layer_ids) for s in plan.stages),
                   submesh_physical_shapes=tuple(tuple(s.submesh_shape) for s in plan.stages),
                   submesh_logical_shapes=tuple(tuple(s.logical_mesh_shape) for s in plan.stages),
                   show_progress=show_progress)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UniformStageOption:
    """``num_stages`` stages with equal numbers of layers on equal submeshes; the logical mesh of each is
    the cheapest under the intra-op pass unless given."""

    num_stages: int
    submesh_physical_shape: Shape | None = None
    """None: the cluster split evenly, (1, M / s) per stage within a node or (N / s, M) across nodes."""
    submesh_logical_shape: Shape | None = None
    show_progress: bool = True

    def __post_init__(self):
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or self.num_stages < 1:
            raise ValueError(f"UniformStageOption.num_stages must be an int >= 1, got {self.num_stages!r}")
        for name in ("submesh_physical_shape", "submesh_logical_shape"):
            shape = getattr(self, name)
            if shape is not None:
                object.__setattr__(self, name, _check_shape(f"UniformStageOption.{name}", shape, or_none=True))


StageOption = AutoStageOption | ManualStageOption | UniformStageOption


def _check_shape(name: str, shape: Any, or_none: bool = False) -> Shape:
    """``shape`` as a tuple when it is a pair of ints >= 1 (a submesh or logical mesh shape); else an error
    naming the option field ``name``."""
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2 and all(isinstance(d, int) and d >= 1
                                                                          for d in shape)):
        raise ValueError(f"{name} must be {'None or ' if or_none else ''}a pair of ints >= 1, got {shape!r}")
    return tuple(shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipeshardParallel:
    """Pipeline parallelism over submeshes, with intra-op parallelism inside each stage (Alpa)."""

    num_micro_batches: int = 1
    """Micro-batches per step (B of Eq. 3.2)."""
    layer_option: AutoLayerOption | ManualLayerOption = AutoLayerOption(layer_num=2)
    stage_option: StageOption = AutoStageOption()
    pipeline_schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    """A :class:`~alpa_like.compiler.schedules.ScheduleName` or its string: ``"gpipe"``, ``"1f1b"``,
    ``"interleaved_1f1b"``, ``"breadth_first"`` or ``"terapipe"``."""
    auto_sharding_option: AutoShardingOption = AutoShardingOption(solver="highs")
    """Options of the intra-op pass run on every layer and mesh."""
    virtual_stages: int = 1
    """Layer chunks per mesh for the looping schedules (``interleaved_1f1b``, ``breadth_first``): the
    layers are cut into ``meshes x virtual_stages`` equal chunks and chunk ``s`` runs on mesh ``s mod p``
    (Megatron-LM's interleaved layout). 1 for the other schedules."""
    token_slices: tuple[int, ...] | tuple[tuple[int, tuple[int, ...]], ...] | None = None
    """``pipeline_schedule="terapipe"`` only. Token slice lengths of every sequence (summing to its length),
    e.g. ``(776, 640, 632)``, used for every micro-batch; or a whole batch + token slicing (section 2.3.4) as
    plans print it, ``((rows, (lengths...)), ...)`` with rows summing to the batch size, e.g.
    ``((2, (8, 8)), (1, (16,)))``. None: the TeraPipe DP chooses (see ``ParallelPlan.token_slicing``)."""
    defer_gradient_sync: bool = True
    """Reduce each stage's gradients over its mesh once per step (Alpa, Megatron-LM) instead of in every
    backward: the backward pieces accumulate per-shard partial sums of the gradients that allow it
    (:mod:`alpa_like.compiler.gradient_sync`), reduced by the step's mean. False: every backward
    all-reduces its gradients (GSPMD's default for a whole-array output). The local and the Ray backends."""
    share_slice_executables: bool = False
    """``pipeline_schedule="terapipe"`` only. True: token slices of equal length (and rows) share one
    executable per stage whatever their context: each reads its cached keys/values left-padded to the longest
    context among them, the padding masked out of the attention (results equal; fewer compiles, but the
    attention then also spans the padding, which the plan's predicted time includes). False: one executable
    per (rows, context, length)."""

    def __post_init__(self):
        _check_micro_batches(self.num_micro_batches)
        try:
            schedule = ScheduleName(self.pipeline_schedule)
        except ValueError:
            raise ValueError(f"pipeline_schedule must be one of {tuple(map(str, ScheduleName))}, got "
                             f"{self.pipeline_schedule!r}") from None
        object.__setattr__(self, "pipeline_schedule", schedule)
        if self.defer_gradient_sync not in (False, True):
            raise ValueError(f"defer_gradient_sync must be a bool, got {self.defer_gradient_sync!r}")
        if self.share_slice_executables not in (False, True):
            raise ValueError(f"share_slice_executables must be a bool, got {self.share_slice_executables!r}")
        if self.share_slice_executables and self.pipeline_schedule != ScheduleName.TERAPIPE:
            raise ValueError("share_slice_executables needs pipeline_schedule='terapipe', got "
                             f"{self.pipeline_schedule!r}")
        if self.token_slices is not None:
            if self.pipeline_schedule != ScheduleName.TERAPIPE:
                raise ValueError(f"token_slices needs pipeline_schedule='terapipe', got {self.pipeline_schedule!r}")
            if not is_token_lengths(self.token_slices) and not (
                    isinstance(self.token_slices, tuple) and self.token_slices and all(
                        isinstance(p, tuple) and len(p) == 2 and is_token_lengths((p[0],)) and is_token_lengths(p[1])
                        for p in self.token_slices)):
                raise ValueError(f"token_slices must be a non-empty tuple of ints >= 1 or of (rows, (lengths...)) "
                                 f"pairs with ints >= 1, got {self.token_slices!r}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be an int >= 1, got {self.virtual_stages!r}")
        if self.virtual_stages > 1 and not self.pipeline_schedule.is_looping:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs a looping schedule "
                             f"('interleaved_1f1b' or 'breadth_first'), got {self.pipeline_schedule!r}")
        if self.auto_sharding_option.plan_selection != "objective":
            raise ValueError("auto_sharding_option.plan_selection='measured' is ShardParallel's; the stage DP "
                             "compares the intra-op objectives of its candidates (use plan_selection='objective')")
        if not isinstance(self.layer_option, (AutoLayerOption, ManualLayerOption)):
            raise TypeError(f"layer_option must be AutoLayerOption or ManualLayerOption, got {self.layer_option!r}")
        if not isinstance(self.stage_option, (AutoStageOption, ManualStageOption, UniformStageOption)):
            raise TypeError("stage_option must be AutoStageOption, ManualStageOption or UniformStageOption, got "
                            f"{self.stage_option!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class CreateStateParallel:
    """Creates a train step's state argument in the layouts that step's plan takes it in
    (:mod:`alpa_like.training`).

    Args:
      train_step: the ``al.parallelize``-d train step the state is made for.
      batch: the train step's arguments after the state (arrays or ``jax.ShapeDtypeStruct`` s): its plan
        depends on their shapes.
      state_argnum: which argument of ``train_step`` the created value is (default 0).
    """

    train_step: Any
    batch: Any
    other_args: tuple = ()
    """More arguments of ``train_step`` after ``batch``, as they will be passed."""
    state_argnum: int = 0

    num_micro_batches = 1  # what parallelize reads of every method

    def __post_init__(self):
        _check_train_step(self)


@dataclasses.dataclass(frozen=True, eq=False)
class FollowParallel:
    """Runs an eval / inference step in the layouts of a train step's state (see :mod:`alpa_like.training`).

    Args:
      train_step: the ``al.parallelize``-d train step whose state the step reads.
      batch: the train step's arguments after the state (arrays or ``jax.ShapeDtypeStruct`` s), which pick
        its plan; None: the train step's one compiled executable.
      state_argnum: the position of the state in both steps' arguments (default 0).
    """

    train_step: Any
    batch: Any = None
    other_args: tuple = ()
    """More arguments of ``train_step`` after ``batch``."""
    state_argnum: int = 0

    num_micro_batches = 1  # the eval step runs on the whole batch at once

    def __post_init__(self):
        _check_train_step(self)


def _check_train_step(method: CreateStateParallel | FollowParallel) -> None:
    """``method.train_step`` is an ``al.parallelize``-d function (it has ``get_executable``) and
    ``method.state_argnum`` an int >= 0; else an error naming the field."""
    who = type(method).__name__
    if not callable(getattr(method.train_step, "get_executable", None)):
        raise TypeError(f"{who}: train_step must be an al.parallelize-d function, got "
                        f"{type(method.train_step).__name__}")
    argnum = method.state_argnum
    if isinstance(argnum, bool) or not isinstance(argnum, int) or argnum < 0:
        raise ValueError(f"{who}: state_argnum must be an int >= 0, got {argnum!r}")


SPMD_METHODS = (DataParallel, Zero2Parallel, Zero3Parallel, ManualShardParallel, ShardParallel)
"""The methods that lay a step out on one mesh of all devices."""
METHODS = (*SPMD_METHODS, PipeshardParallel, CreateStateParallel, FollowParallel)
"""Every method ``al.parallelize`` accepts."""
OPTION_CLASSES = (*METHODS, AutoShardingOption, AutoLayerOption, ManualLayerOption, AutoStageOption,
                  ManualStageOption, UniformStageOption)
"""Every method and option dataclass: the names a plan's ``method`` repr is written in."""
