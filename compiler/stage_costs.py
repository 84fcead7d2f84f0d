r"""The stage DP's data: the cost table it reads (:class:`StageCosts`, filled by the intra-op pass) and the
stages it returns (:class:`StageChoice`, :class:`StageSolution`), with their latency, Eq. 3.2
(:func:`pipeline_latency`). The DP itself is :func:`alpa_like.compiler.stage_dp.solve_stages`.
"""
from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Callable, Sequence

import numpy as np

from alpa_like.compiler.indices import StageIdx, SubmeshIdx
from alpa_like.compiler.logical_mesh import logical_shapes as all_logical_shapes
from alpa_like.compiler.schedules import ScheduleName, schedule_name
from alpa_like.compiler.submesh import Shape

_GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class StageCosts:
    """Profiled cost of every (layer range, submesh, logical view): the input of the stage DP.

    Arrays are indexed ``[i, j, p, l]``: layers ``i..j`` (inclusive, 0-based) as one stage on submesh
    ``submeshes[p]`` viewed as ``logical_shapes[p][l]``. Entries with ``j < i`` are ignored; entries with
    ``l >= len(logical_shapes[p])`` (padding) must have ``t_intra = inf``. Arrays are copied and made
    read-only.
    """

    num_layers: int
    """``K``, the number of layers after operator clustering."""
    submeshes: tuple[Shape, ...]
    """Submesh shapes ``(n, m)`` the DP may use, distinct; see ``submesh_shapes``."""
    logical_shapes: tuple[tuple[tuple[int, int], ...], ...]
    """For each submesh, the logical views profiled (each with ``n * m`` devices); a view may appear more
    than once with different :attr:`variants`."""
    t_intra: np.ndarray
    """Seconds per micro-batch, forward plus backward, shape ``(K, K, P, L)``; ``inf`` = infeasible."""
    mem_stage: np.ndarray
    """Bytes per device of weights, gradients and optimizer state, shape ``(K, K, P, L)``."""
    mem_act: np.ndarray
    """Bytes per device of the activations one micro-batch keeps for the backward, shape ``(K, K, P, L)``."""
    variants: tuple[tuple[str, ...], ...] = ()
    """For each submesh, a label per logical view entry naming how the intra-op pass was constrained there
    (e.g. ``"params-sharded"``: a memory-lean solve beside the fastest one); () labels every entry ``""``.
    ``(logical shape, variant)`` pairs are distinct per submesh. The DP picks, per stage, the fastest entry
    that fits in memory (Eq. 3.5), so a memory-lean variant is chosen exactly where the fastest one does not
    fit."""
    boundary_saving: np.ndarray | None = None
    """Seconds per micro-batch that ``t_intra`` over-counts when a stage boundary stays inside one node,
    shape ``(K, K, P, 2)``: ``[..., 0]`` when the stage shares a node with its predecessor, ``[..., 1]`` with
    its successor. ``t_intra`` prices what a stage receives from its neighbours as if every boundary crossed
    nodes, since where the neighbours go is only known once all stages are chosen; the DP prices the
    boundaries of plans whose placement it knows (see :func:`price_placed_stages`). None: no savings."""
    nic_wait: np.ndarray | None = None
    """Seconds per micro-batch that the stage's receive from its predecessor (``[..., 0]``) or successor
    (``[..., 1]``), when that boundary crosses nodes, waits for each NIC on its way that another mesh's
    transfer in the same direction shares, shape ``(K, K, P, 2)``; added to ``t_intra`` in aligned layouts
    (see "Shared NICs" in the module docstring and :func:`price_placed_stages`). None: NICs are never
    shared."""
    step_seconds: np.ndarray | None = None
    """Seconds a stage spends once per step outside the pipelined micro-batches, shape ``(K, K, P)``: e.g.
    receiving, after the pipeline drains, the accumulated gradients of parameters that layers of other
    stages also read (a tied embedding), for its apply-grad or its replica of another stage's. The largest
    over a plan's stages is added once to Eq. 3.2's latency (the meshes do this at the same time); not part
    of the stage's ``t_intra`` (it does not pace the micro-batches): see "Per-step terms" in the module
    docstring. None: zero."""

    def __post_init__(self) -> None:
        k = self.num_layers
        if not is_int(k) or k < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {k!r}")
        submeshes = tuple(int_pair(s, "submesh") for s in self.submeshes)
        if not submeshes or len(set(submeshes)) != len(submeshes):
            raise ValueError(f"submeshes must be non-empty and distinct, got {list(self.submeshes)}")
        if len(self.logical_shapes) != len(submeshes):
            raise ValueError(f"logical_shapes needs one list per submesh ({len(submeshes)}), "
                             f"got {len(self.logical_shapes)}")
        labels = self.variants or tuple(("",) * len(v) for v in self.logical_shapes)
        if len(labels) != len(submeshes) or any(len(a) != len(b) for a, b in zip(labels, self.logical_shapes)):
            raise ValueError(f"variants needs one label per logical shape entry of each submesh, got {labels!r}")
        views = []
        for (n, m), shapes, names in zip(submeshes, self.logical_shapes, labels, strict=True):
            shapes = tuple(int_pair(v, "logical shape") for v in shapes)
            entries = list(zip(shapes, names))
            if not shapes or len(set(entries)) != len(entries) or any(a * b != n * m for a, b in shapes):
                raise ValueError(f"logical shapes of submesh {(n, m)} must be non-empty, have {n * m} devices "
                                 f"each and be distinct (per variant), got {entries}")
            views.append(shapes)
        shape = (k, k, len(submeshes), max(len(v) for v in views))
        arrays = {}
        for name in ("t_intra", "mem_stage", "mem_act"):
            array = np.array(getattr(self, name), dtype=np.float64)
            if array.shape != shape:
                raise ValueError(f"{name} must have shape (K, K, P, L) = {shape}, got {array.shape}")
            if np.isnan(array).any() or (array < 0).any():
                raise ValueError(f"{name} must hold numbers >= 0 (inf allowed), got {int(np.isnan(array).sum())}"
                                 f" NaN and {int((array < 0).sum())} negative entries")
            array.setflags(write=False)
            arrays[name] = array
        for name in ("boundary_saving", "nic_wait"):
            if getattr(self, name) is None:
                continue
            per_side = np.array(getattr(self, name), dtype=np.float64)
            if per_side.shape != shape[:3] + (2,):
                raise ValueError(f"{name} must have shape (K, K, P, 2) = {shape[:3] + (2,)}, "
                                 f"got {per_side.shape}")
            if not np.isfinite(per_side).all() or (per_side < 0).any():
                raise ValueError(f"{name} must hold finite numbers >= 0")
            per_side.setflags(write=False)
            object.__setattr__(self, name, per_side)
        if self.step_seconds is not None:
            step = np.array(self.step_seconds, dtype=np.float64)
            if step.shape != shape[:3]:
                raise ValueError(f"step_seconds must have shape (K, K, P) = {shape[:3]}, got {step.shape}")
            if not np.isfinite(step).all() or (step < 0).any():
                raise ValueError("step_seconds must hold finite numbers >= 0")
            step.setflags(write=False)
            object.__setattr__(self, "step_seconds", step)
        for p, v in enumerate(views):
            if np.isfinite(arrays["t_intra"][:, :, p, len(v):]).any():
                raise ValueError(f"t_intra[..., {p}, l] must be inf for l >= {len(v)} (submesh "
                                 f"{submeshes[p]} has {len(v)} logical shapes)")
        object.__setattr__(self, "submeshes", submeshes)
        object.__setattr__(self, "logical_shapes", tuple(views))
        object.__setattr__(self, "variants", tuple(tuple(str(x) for x in names) for names in labels))
        for name, array in arrays.items():
            object.__setattr__(self, name, array)

    @property
    def sizes(self) -> np.ndarray:
        """Devices per submesh, ``n * m``."""
        return np.array([n * m for n, m in self.submeshes], dtype=np.int64)

    def step_seconds_of(self, first: int, last: int, submesh_index: int) -> float:
        """:attr:`step_seconds` of layers ``first..last`` on submesh ``submesh_index`` (0 when None)."""
        return 0.0 if self.step_seconds is None else float(self.step_seconds[first, last, submesh_index])

    @classmethod
    def from_fn(cls, num_layers: int, submeshes: Sequence[Shape],
                cost: Callable[[int, int, Shape, tuple[int, int]], tuple[float, float, float]],
                logical_shapes: Sequence[Sequence[tuple[int, int]]] | None = None) -> StageCosts:
        """Fills the table from ``cost(first, last, submesh, logical) -> (t_intra, mem_stage, mem_act)``.

        ``logical_shapes`` defaults to every 2-D factorisation of each submesh's device count.

        >>> costs = StageCosts.from_fn(2, [(1, 1), (1, 2)], lambda i, j, sub, view: (j - i + 1.0, 0, 0))
        >>> costs.t_intra.shape, costs.logical_shapes[1]
        ((2, 2, 2, 2), ((1, 2), (2, 1)))
        """
        if logical_shapes is None:
            logical_shapes = [all_logical_shapes(n * m) for n, m in submeshes]
        width = max(len(v) for v in logical_shapes)
        shape = (num_layers, num_layers, len(submeshes), width)
        t, mem_stage, mem_act = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
        for i, j in itertools.combinations_with_replacement(range(num_layers), 2):
            for p, (sub, views) in enumerate(zip(submeshes, logical_shapes, strict=True)):
                for l, view in enumerate(views):
                    t[i, j, p, l], mem_stage[i, j, p, l], mem_act[i, j, p, l] = cost(i, j, tuple(sub),
                                                                                      tuple(view))
        return cls(num_layers=num_layers, submeshes=tuple(submeshes), logical_shapes=tuple(logical_shapes),
                   t_intra=t, mem_stage=mem_stage, mem_act=mem_act)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageChoice:
    """One stage of the answer."""

    layers: tuple[int, int]
    """``(first, last)`` layer, inclusive, 0-based."""
    submesh_index: SubmeshIdx
    submesh: Shape
    logical_shape: tuple[int, int]
    view_index: int
    """Index of the chosen entry in ``StageCosts.logical_shapes[submesh_index]`` (the ``l`` of the arrays)."""
    variant: str
    """That entry's label in :attr:`StageCosts.variants`."""
    t_intra: float
    """Seconds per micro-batch (forward + backward)."""
    memory_per_device: float
    """Peak bytes per device under the schedule: ``mem_stage + in_flight * mem_act`` (Eq. 3.5)."""
    step_seconds: float = 0.0
    """Seconds once per step outside the pipelined micro-batches (:attr:`StageCosts.step_seconds`)."""

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0] + 1

    def __str__(self) -> str:
        variant = f" ({self.variant})" if self.variant else ""
        return (f"layers {self.layers[0]}-{self.layers[1]} on {self.submesh} as {self.logical_shape}{variant}: "
                f"{self.t_intra * 1e3:.4g} ms, {self.memory_per_device / _GIB:.4g} GiB")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSolution:
    """The chosen stages in pipeline order and their predicted latency."""

    stages: tuple[StageChoice, ...]
    iteration_time: float
    """Eq. 3.2 for these stages plus the longest per-step term: ``sum(t) + (B - 1) * max(t) + max(step)``
    (:func:`pipeline_latency`), seconds."""
    t_max: float
    """Latency of the slowest stage, seconds."""
    num_micro_batches: int
    num_t_max_evaluated: int
    """DP runs spent on the t_max enumeration (0 for stages not found by the DP)."""

    @property
    def submeshes(self) -> tuple[Shape, ...]:
        """The stages' submesh shapes, ready for ``assign_devices``."""
        return tuple(stage.submesh for stage in self.stages)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(stage.num_layers for stage in self.stages)

    @classmethod
    def of(cls, stages: Sequence[StageChoice], num_micro_batches: int, num_t_max_evaluated: int = 0,
           schedule: ScheduleName | str = ScheduleName.ONE_F_ONE_B) -> StageSolution:
        """The solution made of ``stages``, its latency by :func:`pipeline_latency` under ``schedule``."""
        times = [stage.t_intra for stage in stages]
        return cls(stages=tuple(stages), iteration_time=pipeline_latency(stages, num_micro_batches, schedule),
                   t_max=max(times), num_micro_batches=num_micro_batches, num_t_max_evaluated=num_t_max_evaluated)

    def stage_of_layer(self, layer: int) -> StageIdx:
        """The stage that runs ``layer`` (0-based); ValueError if no stage holds it."""
        for q, stage in enumerate(self.stages):
            if stage.layers[0] <= layer <= stage.layers[1]:
                return StageIdx(q)
        raise ValueError(f"layer {layer!r} is not in any stage; stages hold layers 0..{self.stages[-1].layers[1]}")

    def __str__(self) -> str:
        head = (f"{len(self.stages)} stage(s), B = {self.num_micro_batches}: iteration "
                f"{self.iteration_time * 1e3:.4g} ms, slowest stage {self.t_max * 1e3:.4g} ms")
        return "\n".join([head] + [f"  stage {q}: {stage}" for q, stage in enumerate(self.stages)])


def pipeline_latency(stages: Sequence[StageChoice], num_micro_batches: int,
                     schedule: ScheduleName | str = ScheduleName.ONE_F_ONE_B) -> float:
    """Eq. 3.2 for these stages plus the longest of their per-step terms, which run at the same time on their
    own meshes: ``sum(t) + (B - 1) * max(t) + max(step)``. Under a zero-bubble schedule the fill and drain
    is the schedule's share ``c`` of it (:attr:`~alpa_like.compiler.schedules.ScheduleName.bubble_weight`):
    ``c * sum(t) + (B - c) * max(t) + max(step)``; with ``S`` equal stages of time ``t`` that is the
    paper's ``B t + (S - 1)(T_F + T_B - T_W)`` for ZB-H1 with ``T_F = T_B = T_W = t / 3``.

    >>> a = StageChoice(layers=(0, 0), submesh_index=SubmeshIdx(0), submesh=(1, 1), logical_shape=(1, 1),
    ...                 view_index=0, variant="", t_intra=2.0, memory_per_device=0.0)
    >>> pipeline_latency([a, dataclasses.replace(a, layers=(1, 1), t_intra=1.0, step_seconds=0.5)], 4)
    9.5
    """
    times = [stage.t_intra for stage in stages]
    weight = float(schedule_name(schedule).bubble_weight)
    return (weight * sum(times) + (num_micro_batches - weight) * max(times)
            + max(stage.step_seconds for stage in stages))


def int_pair(value: object, what: str) -> tuple[int, int]:
    """``value`` as a pair of ints >= 1; else a ValueError naming ``what``."""
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(is_int(v) and v >= 1 for v in value)):
        raise ValueError(f"{what} must be a pair of ints >= 1, got {value!r}")
    return int(value[0]), int(value[1])


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
