r"""Pipeline schedules as plain data: a tick x mesh grid of tasks, validated by a simulator.

A schedule says, for every mesh of a pipeline, in which order it runs the forward (``F``) and backward
(``B``) pass of every (stage, micro-batch). It exists once, as a :class:`Schedule`: the instruction
programs and executors read it, nothing re-implements it as a loop (STYLE principles 2, 4, 5).

Vocabulary:

- ``p`` meshes (:data:`MeshIdx`), ``v`` virtual stages per mesh, ``S = p v`` stages (:data:`StageIdx`);
  looping schedules put stage ``s`` on mesh ``s mod p`` (Megatron-LM 2.2.2, BFPP 4.1 "looping pipeline").
- ``m`` micro-batches (:data:`MicroBatchIdx`).
- A task ``2F0`` is the forward of stage 2 on micro-batch 0 (:class:`Task`).
- ``F(s, k)`` needs ``F(s-1, k)``; ``B(s, k)`` needs ``F(s, k)`` and ``B(s+1, k)``.

The grid (:attr:`Schedule.ticks`) gives every task one tick; it is what the generators emit and what the
golden files store. :meth:`Schedule.timeline` replays each mesh's order with real per-stage durations
(as soon as dependencies and the mesh allow) and is what :meth:`~Schedule.bubble_fraction`, the Chrome
trace and the plot use.

Bubble, with :math:`t_f, t_b` the forward and backward time of one micro-batch through a whole mesh
(all its ``v`` stages), :math:`t_{id} = m (t_f + t_b)` the ideal time and :math:`t_{pb}` the idle time of
a mesh (Megatron-LM 2.2.1-2.2.2, seed 002; BFPP Eq. 4 and 9, seed 004):

.. math::
   \frac{t_{pb}}{t_{id}} = \frac{p-1}{m} \ \text{(GPipe, 1F1B)}, \qquad
   \frac{t_{pb}}{t_{id}} = \frac{1}{v}\,\frac{p-1}{m} \ \text{(interleaved 1F1B, breadth-first)},

and as a fraction of the whole step, :math:`t_{pb} / (t_{id} + t_{pb})`, e.g. :math:`(p-1)/(m+p-1)` for
GPipe. Both hold exactly here for any ratio :math:`t_b / t_f` (breadth-first needs :math:`m \ge p` or
:math:`v = 1`; see :func:`~alpa_like.compiler.schedule_tables.breadth_first`).

Zero-bubble schedules (:func:`~alpa_like.compiler.schedule_tables.zb_h1`, :func:`~alpa_like.compiler.schedule_tables.zb_h2`; Qi et al., ICLR 2024) split each backward into ``B``
(input gradient) and ``W`` (weight gradients, :class:`Phase`) and fill the bubbles with ``W``.

The generators live in :mod:`~alpa_like.compiler.schedule_tables`. Example:

>>> from alpa_like.compiler.schedule_tables import one_f_one_b
>>> s = one_f_one_b(num_meshes=2, num_micro_batches=3)
>>> print(s.table())
tick  mesh0  mesh1
   0  0F0    .
   1  0F1    1F0
   2  .      1B0
   3  0B0    1F1
   4  0F2    1B1
   5  0B1    1F2
   6  .      1B2
   7  0B2    .
>>> s.bubble_fraction(), s.bubble_fraction(relative_to="ideal"), s.peak_in_flight()
(Fraction(1, 4), Fraction(1, 3), (2, 1))
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction

from alpa_like.compiler.indices import MeshIdx, MicroBatchIdx, StageIdx

Duration = int | Fraction | float
"""A task's duration in arbitrary units. Ints and Fractions give exact bubble fractions."""


class Phase(enum.StrEnum):
    """What a task computes."""

    F = "F"
    """Forward."""
    B = "B"
    """Backward: input and weight gradients; the input gradient only in a schedule that has ``W`` tasks
    (:attr:`Schedule.splits_backward`)."""
    W = "W"
    """Weight gradients of a split backward (zero-bubble schedules): needs the stage's ``B`` of the same
    micro-batch, and nothing needs it within the step."""


class ScheduleName(enum.StrEnum):
    """The pipeline schedules: what ``PipeshardParallel(pipeline_schedule=...)`` accepts, the stage DP prices
    and :func:`make_schedule` builds. A member equals its string (``ScheduleName.GPIPE == "gpipe"``) and
    prints as it (``'gpipe'``), so options and plans read the same whichever a user wrote."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    BREADTH_FIRST = "breadth_first"
    TERAPIPE = "terapipe"
    ZB_H1 = "zb_h1"
    ZB_H2 = "zb_h2"

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def is_looping(self) -> bool:
        """Whether the schedule runs several virtual stages per mesh (``virtual_stages > 1``)."""
        return self in (ScheduleName.INTERLEAVED_1F1B, ScheduleName.BREADTH_FIRST)

    @property
    def holds_every_micro_batch(self) -> bool:
        """Whether, for the activation memory of Eq. 3.5, every stage holds all ``B`` micro-batches in flight
        (GPipe, and breadth-first and TeraPipe, which run every forward of a stage before its backwards),
        rather than 1F1B's ``min(s, B)`` for the ``s``-th stage from the end (1F1B, interleaved 1F1B)."""
        return self in (ScheduleName.GPIPE, ScheduleName.BREADTH_FIRST, ScheduleName.TERAPIPE)

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as ``B`` (input gradient) and ``W`` (weight gradients):
        the zero-bubble schedules (:func:`zb_h1`, :func:`zb_h2`)."""
        return self in (ScheduleName.ZB_H1, ScheduleName.ZB_H2)

    @property
    def bubble_weight(self) -> Fraction:
        r""":math:`c` in the stage DP's latency :math:`B\,t_{max} + c\,(\sum_i t_i - t_{max})`: the fill and
        drain time as a share of a micro-batch's time through the stages. 1 for every schedule without
        ``W`` tasks (Eq. 3.2). For the zero-bubble schedules, with a stage's time split in equal thirds
        :math:`T_F = T_B = T_W` (the paper's setting, and a backward of twice the forward):
        :math:`(T_F + T_B - T_W) / (T_F + T_B + T_W) = 1/3` for ZB-H1 and
        :math:`T_F / (T_F + T_B + T_W) = 1/3` for ZB-H2 (see :func:`zb_h2`: its zero bubble needs steps that
        overlap; a step that ends together on every mesh still waits for the pipeline to fill)."""
        return Fraction(1, 3) if self.splits_backward else Fraction(1)


def schedule_name(value: object) -> ScheduleName:
    """``value`` (a :class:`ScheduleName` or its string) as a ScheduleName.

    >>> schedule_name("1f1b") is ScheduleName.ONE_F_ONE_B
    True

    Raises:
      ValueError: ``value`` names no schedule; the message lists the valid names.
    """
    try:
        return ScheduleName(value)
    except ValueError:
        raise ValueError(f"unknown schedule {value!r}; valid: {sorted(map(str, ScheduleName))}") from None


_TASK_RE = re.compile(r"(\d+)([" + "".join(Phase) + r"])(\d+)(?:\.(\d+))?")


def _is_int(x: object) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of work on one mesh: the ``phase`` of ``stage`` on ``micro_batch``.

    Printed ``{stage}{phase}{micro_batch}``, e.g. ``2F0``, and ``2F0.1`` for token slice 1 of
    micro-batch 0 (TeraPipe: :func:`terapipe`). :meth:`from_str` parses the printed form back exactly.

    >>> Task.from_str("2B10"), str(Task(StageIdx(0), MicroBatchIdx(3), Phase.F, slice=1))
    (2B10, '0F3.1')
    """

    stage: StageIdx
    micro_batch: MicroBatchIdx
    phase: Phase
    slice: int | None = None
    """Token slice of the micro-batch (TeraPipe); ``None`` = the whole sequence."""

    def __post_init__(self) -> None:
        for field in ("stage", "micro_batch") + (("slice",) if self.slice is not None else ()):
            value = getattr(self, field)
            if not _is_int(value) or value < 0:
                raise ValueError(f"Task.{field} must be an int >= 0, got {value!r}")
        if not isinstance(self.phase, Phase):
            if self.phase not in tuple(Phase):
                raise ValueError(f"Task.phase must be one of {[str(x) for x in Phase]}, got {self.phase!r}")
            object.__setattr__(self, "phase", Phase(self.phase))

    def __str__(self) -> str:
        suffix = "" if self.slice is None else f".{self.slice}"
        return f"{self.stage}{self.phase}{self.micro_batch}{suffix}"

    __repr__ = __str__

    @classmethod
    def from_str(cls, text: str) -> Task:
        """Parse ``2F0`` / ``2F0.1`` (the inverse of ``str``)."""
        match = _TASK_RE.fullmatch(text)
        if match is None:
            raise ValueError(f"not a task: {text!r}; expected <stage><phase><micro_batch>[.<slice>] with "
                             f"phase in {[str(x) for x in Phase]}, e.g. '2F0' or '2F0.1'")
        stage, phase, micro_batch, slice_ = match.groups()
        return cls(StageIdx(int(stage)), MicroBatchIdx(int(micro_batch)), Phase(phase),
                   None if slice_ is None else int(slice_))


def forward(stage: int, micro_batch: int) -> Task:
    """``F`` of (stage, micro_batch)."""
    return Task(StageIdx(stage), MicroBatchIdx(micro_batch), Phase.F)


def backward(stage: int, micro_batch: int) -> Task:
    """``B`` of (stage, micro_batch)."""
    return Task(StageIdx(stage), MicroBatchIdx(micro_batch), Phase.B)


def weight_gradient(stage: int, micro_batch: int) -> Task:
    """``W`` of (stage, micro_batch)."""
    return Task(StageIdx(stage), MicroBatchIdx(micro_batch), Phase.W)


SliceCounts = int | tuple[int, ...]
"""Token slices per micro-batch (TeraPipe): one count for every micro-batch, or one per micro-batch (the
joint batch + token slicing of TeraPipe section 2.3.4 gives batch slices their own slicings)."""


def slices_of(num_slices: SliceCounts, micro_batch: int) -> int:
    """How many token slices ``micro_batch`` has."""
    return num_slices if isinstance(num_slices, int) else num_slices[micro_batch]


def is_sliced(num_slices: SliceCounts) -> bool:
    """Whether tasks name token slices: some micro-batch has more than one (then every task names one)."""
    return (num_slices if isinstance(num_slices, int) else max(num_slices)) > 1


@functools.lru_cache(maxsize=1 << 16)
def dependencies(task: Task, num_stages: int, num_slices: SliceCounts = 1) -> tuple[Task, ...]:
    """The tasks whose outputs ``task`` reads: ``F(s-1, k)`` for ``F(s, k)``; ``F(s, k)`` (stashed
    activations) and ``B(s+1, k)`` (output gradient) for ``B(s, k)``; ``B(s, k)`` for ``W(s, k)`` (it holds
    what ``B`` read, so ``W`` needs only it).

    With token slices (TeraPipe) ``F(s, k.i)`` also reads the keys and values of ``F(s, k.(i-1))`` (and
    through it of every earlier slice), and ``B(s, k.i)`` the key/value gradients of ``B(s, k.(i+1))``."""
    s, k, i = task.stage, task.micro_batch, task.slice

    def same(stage: int, phase: Phase, slice_: int | None) -> Task:
        return Task(StageIdx(stage), k, phase, slice_)

    if task.phase == Phase.W:
        return (same(s, Phase.B, i),)
    if task.phase == Phase.F:
        deps = [same(s - 1, Phase.F, i)] if s > 0 else []
        if i is not None and i > 0:
            deps.append(same(s, Phase.F, i - 1))
        return tuple(deps)
    deps = [same(s, Phase.F, i)] + ([same(s + 1, Phase.B, i)] if s + 1 < num_stages else [])
    if i is not None and i + 1 < slices_of(num_slices, k):
        deps.append(same(s, Phase.B, i + 1))
    return tuple(deps)


# --------------------------------------------------------------------------------------------- timeline


@dataclasses.dataclass(frozen=True)
class Span:
    """When ``task`` ran on ``mesh``: ``[start, end)``."""

    task: Task
    mesh: MeshIdx
    start: Duration
    end: Duration


def _ratio(num: Duration, den: Duration) -> Duration:
    exact = all(isinstance(x, (numbers.Integral, Fraction)) for x in (num, den))
    return Fraction(num, den) if exact else num / den


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A schedule replayed with durations: every task's span, per mesh in execution order."""

    name: str
    num_meshes: int
    num_stages: int
    spans: tuple[Span, ...]
    """Sorted by (mesh, start)."""

    @property
    def makespan(self) -> Duration:
        """End of the last task (every mesh starts at 0)."""
        return max((s.end for s in self.spans), default=0)

    def busy_time(self) -> tuple[Duration, ...]:
        """Time each mesh spends running tasks."""
        busy: list[Duration] = [0] * self.num_meshes
        for span in self.spans:
            busy[span.mesh] += span.end - span.start
        return tuple(busy)

    def bubble_fraction(self, relative_to: str = "total") -> Duration:
        r"""Idle time summed over meshes, divided by

        - ``"total"``: the whole step on every mesh, :math:`p \cdot T`
          (e.g. :math:`(p-1)/(m+p-1)` for GPipe);
        - ``"ideal"``: the busy time, Megatron-LM's :math:`t_{pb} / t_{id}` (e.g. :math:`(p-1)/m`).
        """
        busy = sum(self.busy_time())
        idle = self.num_meshes * self.makespan - busy
        bases = {"total": self.num_meshes * self.makespan, "ideal": busy}
        if relative_to not in bases:
            raise ValueError(f"relative_to must be one of {sorted(bases)}, got {relative_to!r}")
        return _ratio(idle, bases[relative_to]) if bases[relative_to] else 0

    def idle_within(self) -> tuple[Duration, ...]:
        """Per mesh, its idle time between its own first start and last end: the bubble that remains when
        consecutive steps overlap (a mesh starts the next step as soon as it is done), which is how the
        zero-bubble paper counts ZB-H2's bubble."""
        spans: dict[int, list[Span]] = {}
        for span in self.spans:
            spans.setdefault(span.mesh, []).append(span)
        return tuple(max(s.end for s in own) - min(s.start for s in own) - sum(s.end - s.start for s in own)
                     if (own := spans.get(mesh)) else 0 for mesh in range(self.num_meshes))

    def to_chrome_trace(self, path: str, *, us_per_unit: float = 1000.0) -> None:
        """Write Chrome/Perfetto trace events (one track per mesh, one event per task) to ``path``."""
        from alpa_like.compiler.schedule_trace import write_chrome_trace
        write_chrome_trace(self, path, us_per_unit=us_per_unit)

    def plot(self, path: str) -> None:
        """Draw the timeline (one row per mesh) as a PNG at ``path`` (matplotlib, Agg canvas)."""
        from alpa_like.compiler.schedule_trace import plot_timeline
        plot_timeline(self, path)


def _per_stage(value: Duration | Sequence[Duration], num_stages: int, arg: str) -> tuple[Duration, ...]:
    values = (value,) * num_stages if isinstance(value, numbers.Real) else tuple(value)
    if len(values) != num_stages:
        raise ValueError(f"{arg} needs one duration per stage ({num_stages}), got {len(values)}")
    for x in values:
        if not isinstance(x, numbers.Real) or isinstance(x, bool) or not x > 0:
            raise ValueError(f"{arg} durations must be positive numbers, got {x!r}")
    return values


def _run(orders: Sequence[Sequence[Task]], num_stages: int, duration: Callable[[Task], Duration],
         num_slices: SliceCounts = 1) -> tuple[dict[Task, Duration], tuple[int, ...]]:
    """Replay per-mesh orders as soon as possible: a task starts when its mesh is free and its dependencies
    have ended. Returns the start times of the tasks that ran and, per mesh, how many of its tasks ran
    (all of them unless the orders deadlock)."""
    start: dict[Task, Duration] = {}
    end: dict[Task, Duration] = {}
    done = [0] * len(orders)
    free: list[Duration] = [0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for mesh, order in enumerate(orders):
            while done[mesh] < len(order):
                task = order[done[mesh]]
                deps = dependencies(task, num_stages, num_slices)
                if any(d not in end for d in deps):
                    break
                start[task] = max([free[mesh]] + [end[d] for d in deps])
                end[task] = free[mesh] = start[task] + duration(task)
                done[mesh] += 1
                progressed = True
    return start, tuple(done)


def ticks_from_orders(orders: Sequence[Sequence[Task]], num_stages: int, num_slices: SliceCounts = 1
                       ) -> tuple[tuple[Task | None, ...], ...]:
    """Place per-mesh orders on unit ticks, each task as early as its mesh and dependencies allow."""
    start, _ = _run(orders, num_stages, lambda task: 1, num_slices)
    num_ticks = max(start.values(), default=-1) + 1
    grid: list[list[Task | None]] = [[None] * len(orders) for _ in range(num_ticks)]
    for mesh, order in enumerate(orders):
        for task in order:
            grid[start[task]][mesh] = task
    return tuple(tuple(row) for row in grid)


# --------------------------------------------------------------------------------------------- schedule


def format_ticks(ticks: Sequence[Sequence[Task | None]], marks: Mapping[int, str] | None = None) -> str:
    """The tick x mesh grid as text, bubbles as ``.``; ``marks`` appends ``<-- ERROR: note`` to ticks."""
    marks = marks or {}
    num_meshes = max((len(row) for row in ticks), default=0)
    cells = [[("." if t is None else str(t)) for t in row] for row in ticks]
    width = max([len(f"mesh{num_meshes - 1}")] + [len(c) for row in cells for c in row])
    tick_width = max(4, len(str(len(ticks) - 1)))
    lines = ["tick".rjust(tick_width) + "  " + "  ".join(f"mesh{i}".ljust(width) for i in range(num_meshes))]
    for tick, row in enumerate(cells):
        line = str(tick).rjust(tick_width) + "  " + "  ".join(c.ljust(width) for c in row)
        lines.append(line.rstrip() + (f"  <-- ERROR: {marks[tick]}" if tick in marks else ""))
    return "\n".join(lines)


_JSON_FORMAT = "alpa_like.schedule/1"
_JSON_KEYS = ("format", "name", "num_meshes", "num_stages", "num_micro_batches", "stage_to_mesh", "ticks")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: which task each mesh runs at each tick (``None`` = bubble).

    Build one with a generator (:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_one_f_one_b`,
    :func:`breadth_first`, :func:`make_schedule`) or by hand: construction runs :meth:`validate`, so an
    invalid schedule cannot exist and consumers need not check again.
    """

    name: str
    num_meshes: int
    num_stages: int
    """``num_meshes * virtual_stages`` for the looping schedules here."""
    num_micro_batches: int
    stage_to_mesh: tuple[MeshIdx, ...]
    """Mesh of each stage."""
    ticks: tuple[tuple[Task | None, ...], ...]
    """``ticks[t][mesh]``: the task ``mesh`` runs at tick ``t`` (one tick each with unit durations)."""
    num_slices: SliceCounts = 1
    """Token slices per micro-batch (TeraPipe), one count or one per micro-batch (a tuple whose counts all
    agree is stored as the int); when any count is more than 1 every task names its slice."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"Schedule.name must be a str, got {self.name!r}")
        for field in ("num_meshes", "num_stages", "num_micro_batches"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise ValueError(f"Schedule.{field} must be an int >= 1, got {value!r}")
        object.__setattr__(self, "num_slices", _slice_counts(self.num_slices, self.num_micro_batches))
        object.__setattr__(self, "stage_to_mesh", tuple(self.stage_to_mesh))
        object.__setattr__(self, "ticks", tuple(tuple(row) for row in self.ticks))
        if len(self.stage_to_mesh) != self.num_stages or not all(
                _is_int(x) and 0 <= x < self.num_meshes for x in self.stage_to_mesh):
            raise ValueError(f"stage_to_mesh must give each of the {self.num_stages} stages a mesh in "
                             f"0..{self.num_meshes - 1}, got {list(self.stage_to_mesh)}")
        for tick, row in enumerate(self.ticks):
            if len(row) != self.num_meshes or not all(t is None or isinstance(t, Task) for t in row):
                raise ValueError(f"tick {tick} must hold {self.num_meshes} entries, each a Task or None, "
                                 f"got {row!r}")
        self.validate()

    # ------------------------------------------------------------------------------------ views

    @property
    def virtual_stages(self) -> int:
        """Stages per mesh (``v``), the most any mesh holds."""
        return max(self.stage_to_mesh.count(MeshIdx(i)) for i in range(self.num_meshes))

    @property
    def splits_backward(self) -> bool:
        """Whether the backward runs as ``B`` (input gradient) and ``W`` (weight gradients) tasks."""
        return any(t is not None and t.phase == Phase.W for row in self.ticks for t in row)

    def mesh_orders(self) -> tuple[tuple[Task, ...], ...]:
        """Each mesh's tasks in execution order (bubbles dropped)."""
        return tuple(tuple(row[mesh] for row in self.ticks if row[mesh] is not None)
                     for mesh in range(self.num_meshes))

    def table(self) -> str:
        """The tick x mesh grid as text (see the module example)."""
        return format_ticks(self.ticks)

    def to_csv(self) -> str:
        """One line per tick, ``tick,mesh0,...``; bubbles are empty cells (the golden-file format)."""
        header = ",".join(["tick"] + [f"mesh{i}" for i in range(self.num_meshes)])
        rows = [",".join([str(tick)] + ["" if t is None else str(t) for t in row])
                for tick, row in enumerate(self.ticks)]
        return "\n".join([header] + rows) + "\n"

    # ------------------------------------------------------------------------------------ checks

    def _fail(self, message: str, marks: Mapping[int, str] | None = None) -> ValueError:
        return ValueError(f"schedule {self.name!r} is invalid: {message}\n{format_ticks(self.ticks, marks)}")

    def validate(self) -> None:
        """Dry-run the schedule (done on construction); raise ``ValueError`` with the grid, the offending
        tick marked, unless

        - every (stage, micro-batch) has exactly one ``F`` and one ``B``, on the stage's mesh, and one ``W``
          too if any task is a ``W`` (:attr:`splits_backward`);
        - replaying each mesh's order, no mesh waits forever (no deadlock);
        - on the grid, every task's dependencies ran at earlier ticks (so the grid is a valid timeline
          with unit durations, one task per mesh per tick).
        """
        seen: dict[Task, int] = {}
        for tick, row in enumerate(self.ticks):
            for mesh, task in enumerate(row):
                if task is None:
                    continue
                if task.stage >= self.num_stages or task.micro_batch >= self.num_micro_batches:
                    raise self._fail(f"{task} at tick {tick} is out of range: stages 0..{self.num_stages - 1}, "
                                     f"micro-batches 0..{self.num_micro_batches - 1}", {tick: f"{task}"})
                count = slices_of(self.num_slices, task.micro_batch)
                if (task.slice is None) == is_sliced(self.num_slices) or (task.slice or 0) >= count:
                    raise self._fail(f"{task} at tick {tick} must name a token slice in 0..{count - 1}"
                                     if is_sliced(self.num_slices) else f"{task} at tick {tick} has a token slice, "
                                     "but the schedule has num_slices=1", {tick: f"{task} slice"})
                if self.stage_to_mesh[task.stage] != mesh:
                    raise self._fail(f"{task} at tick {tick} runs on mesh {mesh}, but stage {task.stage} "
                                     f"lives on mesh {self.stage_to_mesh[task.stage]}",
                                     {tick: f"{task} on the wrong mesh"})
                if task in seen:
                    raise self._fail(f"{task} runs twice, at ticks {seen[task]} and {tick}",
                                     {seen[task]: f"{task} (first)", tick: f"{task} again"})
                seen[task] = tick
        phases = tuple(Phase) if self.splits_backward else (Phase.F, Phase.B)
        missing = [task for s in range(self.num_stages) for k in range(self.num_micro_batches)
                   for i in _slice_ids(self.num_slices, k)
                   for task in (Task(StageIdx(s), MicroBatchIdx(k), phase, i) for phase in phases)
                   if task not in seen]
        if missing:
            shown = " ".join(map(str, missing[:12])) + (" ..." if len(missing) > 12 else "")
            raise self._fail(f"{len(missing)} task(s) never run: {shown}")

        orders = self.mesh_orders()
        ran, done = _run(orders, self.num_stages, lambda task: 1, self.num_slices)
        stuck = {mesh: orders[mesh][n] for mesh, n in enumerate(done) if n < len(orders[mesh])}
        if stuck:
            what = "; ".join(f"mesh{m} waits at {t} for "
                             + " ".join(str(d) for d in dependencies(t, self.num_stages, self.num_slices)
                                        if d not in ran)
                             for m, t in stuck.items())
            marks: dict[int, str] = {}
            for m, t in stuck.items():
                marks[seen[t]] = "; ".join(filter(None, [marks.get(seen[t]), f"mesh{m} stuck at {t}"]))
            raise self._fail(f"deadlock: no mesh can run its next task ({what})", marks)

        for task, tick in seen.items():
            late = [d for d in dependencies(task, self.num_stages, self.num_slices) if seen[d] >= tick]
            if late:
                needs = ", ".join(f"{d} (tick {seen[d]})" for d in late)
                raise self._fail(f"{task} at tick {tick} needs {needs}, which must run at an earlier tick",
                                 {tick: f"{task} needs {needs}"})

    # ------------------------------------------------------------------------------------ metrics

    def timeline(self, t_f: Duration | Sequence[Duration] = 1,
                 t_b: Duration | Sequence[Duration] | None = None,
                 t_w: Duration | Sequence[Duration] | None = None) -> Timeline:
        """Replay each mesh's order with per-stage durations, every task as early as its mesh and its
        dependencies allow (no communication time).

        Args:
          t_f: duration of one stage's forward on one micro-batch; one number or one per stage.
          t_b: the same for the backward; default ``2 * t_f`` (Megatron-LM Fig. 3). In a schedule that
            :attr:`splits_backward`, the input gradient alone; default ``t_f``.
          t_w: the weight gradients of a split backward; default ``t_f`` (so ``B`` and ``W`` together take
            the ``2 * t_f`` of a whole backward). Only for a schedule that splits its backward.
        """
        split = self.splits_backward
        if t_w is not None and not split:
            raise ValueError(f"t_w is for schedules with W tasks; schedule {self.name!r} has none")
        fwd = _per_stage(t_f, self.num_stages, "t_f")
        bwd = _per_stage((fwd if split else tuple(2 * x for x in fwd)) if t_b is None else t_b,
                         self.num_stages, "t_b")
        wgt = _per_stage(fwd if t_w is None else t_w, self.num_stages, "t_w")
        durations = {Phase.F: fwd, Phase.B: bwd, Phase.W: wgt}
        orders = self.mesh_orders()
        start, done = _run(orders, self.num_stages, lambda t: durations[t.phase][t.stage], self.num_slices)
        if done != tuple(len(o) for o in orders):  # unreachable: construction validated the orders
            raise RuntimeError(f"schedule {self.name!r} deadlocks\n{self.table()}")
        spans = tuple(Span(t, MeshIdx(mesh), start[t], start[t] + durations[t.phase][t.stage])
                      for mesh, order in enumerate(orders) for t in order)
        return Timeline(self.name, self.num_meshes, self.num_stages, spans)

    def bubble_fraction(self, t_f: Duration | Sequence[Duration] = 1,
                        t_b: Duration | Sequence[Duration] | None = None,
                        t_w: Duration | Sequence[Duration] | None = None, *,
                        relative_to: str = "total") -> Duration:
        """Idle / total over meshes (``relative_to="ideal"``: idle / busy) for :meth:`timeline` with these
        durations; a ``Fraction`` when the durations are ints or Fractions (see
        :meth:`Timeline.bubble_fraction`)."""
        return self.timeline(t_f, t_b, t_w).bubble_fraction(relative_to)

    def peak_in_flight(self) -> tuple[int, ...]:
        """Per mesh, the most (stage, micro-batch) pairs whose ``F`` has run and ``B`` has not (``W``, in a
        schedule that :attr:`splits_backward`: a pair counts whole until its weight gradients are made):
        the stashed activations. With ``v`` stages per mesh each pair is ``1/v`` of a mesh's layers, so a
        whole micro-batch's activations on a mesh count ``v``. Depends only on each mesh's order."""
        last = Phase.W if self.splits_backward else Phase.B
        peaks = []
        for order in self.mesh_orders():
            held = peak = 0
            for task in order:
                held += 1 if task.phase == Phase.F else -1 if task.phase == last else 0
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    # ------------------------------------------------------------------------------------ export

    def to_json(self) -> str:
        """Exact JSON (tasks as ``2F0`` strings, bubbles as ``null``); :meth:`from_json` reads it back."""
        data = {
            "format": _JSON_FORMAT, "name": self.name, "num_meshes": self.num_meshes,
            "num_stages": self.num_stages, "num_micro_batches": self.num_micro_batches,
            "stage_to_mesh": list(self.stage_to_mesh),
            "ticks": [[None if t is None else str(t) for t in row] for row in self.ticks]}
        if self.num_slices != 1:
            data["num_slices"] = self.num_slices if isinstance(self.num_slices, int) else list(self.num_slices)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Parse :meth:`to_json` output (the schedule validates on construction)."""
        data = json.loads(text)
        if not isinstance(data, dict) or sorted(set(data) - {"num_slices"}) != sorted(_JSON_KEYS) \
                or data["format"] != _JSON_FORMAT:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a schedule JSON ({_JSON_FORMAT}): expected keys {sorted(_JSON_KEYS)}, "
                             f"got {got}")
        return cls(name=data["name"], num_meshes=data["num_meshes"], num_stages=data["num_stages"],
                   num_micro_batches=data["num_micro_batches"],
                   stage_to_mesh=tuple(MeshIdx(x) for x in data["stage_to_mesh"]),
                   ticks=tuple(tuple(None if t is None else Task.from_str(t) for t in row)
                               for row in data["ticks"]), num_slices=_from_json_counts(data.get("num_slices", 1)))

    def to_chrome_trace(self, path: str, t_f: Duration | Sequence[Duration] = 1,
                        t_b: Duration | Sequence[Duration] | None = None, *,
                        us_per_unit: float = 1000.0) -> None:
        """Write the :meth:`timeline` as Chrome/Perfetto trace events (open in ui.perfetto.dev)."""
        self.timeline(t_f, t_b).to_chrome_trace(path, us_per_unit=us_per_unit)

    def plot(self, path: str, t_f: Duration | Sequence[Duration] = 1,
             t_b: Duration | Sequence[Duration] | None = None) -> None:
        """Draw the :meth:`timeline` as a PNG."""
        self.timeline(t_f, t_b).plot(path)


def _slice_counts(num_slices, num_micro_batches: int) -> SliceCounts:
    """``num_slices`` checked: an int >= 1, or one such int per micro-batch (all equal: that int)."""
    if _is_int(num_slices) and num_slices >= 1:
        return int(num_slices)
    if isinstance(num_slices, (tuple, list)) and len(num_slices) == num_micro_batches \
            and all(_is_int(x) and x >= 1 for x in num_slices):
        counts = tuple(int(x) for x in num_slices)
        return counts[0] if len(set(counts)) == 1 else counts
    raise ValueError(f"num_slices must be an int >= 1 or one such int per micro-batch ({num_micro_batches}), "
                     f"got {num_slices!r}")


def _slice_ids(num_slices: SliceCounts, micro_batch: int) -> list[int | None]:
    """The ``slice`` field of ``micro_batch``'s tasks."""
    return list(range(slices_of(num_slices, micro_batch))) if is_sliced(num_slices) else [None]


def _from_json_counts(value):
    return tuple(value) if isinstance(value, list) else value
