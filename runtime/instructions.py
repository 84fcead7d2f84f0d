"""Static instruction programs: emitted once from a stage program and a schedule, executed every step.

Every value the pipeline computes is a buffer named ``(ValueId, micro_batch)`` (``micro_batch = -1`` for
per-step values: parameters, optimizer state, accumulated gradients, apply-grad results). The driver emits
one global instruction list, in schedule order; each mesh's program is the projection of that list on the
mesh. Instructions:

* ``LOAD v@mb``: the driver puts a step input (or one micro-batch of a batch leaf) on the mesh; ``LOAD v`` of
  a batch leaf puts the whole batch there, for an apply-grad that reads it;
* ``RECV v@mb <- mesh k``: cross-mesh resharding of a buffer another mesh computed;
* ``RUN qPmb``: stage ``q``'s piece ``P`` (F, B or A = apply-grad; W = the weight gradients of a backward
  split for a zero-bubble schedule, :func:`~alpa_like.compiler.backward_split.split_backwards`) on
  micro-batch ``mb``;
* ``ACC v@mb -> w``: adds a gradient (or loss) of one micro-batch into accumulator ``w``; a per-example
  value (``StageProgram.per_example``: an aux such as logits) is kept as micro-batch ``mb``'s rows instead;
* ``MEAN w``: divides an accumulator by the number of micro-batches (after the last backward); a per-example
  value's rows are put back together in the full batch's order
  (:func:`~alpa_like.compiler.grad_accumulation.from_micro_batches`);
* ``FREE v@mb``: the buffer's last use on this mesh is done.

Token-sliced programs (TeraPipe: :mod:`~alpa_like.runtime.terapipe_programs`) name a unit (a batch slice's
token slice) where others name a micro-batch, and add:

* ``LOAD v@u [rows r0:r1, tokens t0:t1]``: a batch leaf's rows and tokens of unit ``u`` (``window``);
* ``CARRY w@u -> v@u'``: hands buffer ``w@u`` (``source``; a per-step constant when its micro-batch is
  ``PER_STEP``) to unit ``u'`` as ``v@u'`` on the same mesh, with ``pad`` zeros added on the left of its
  token dim (dim 1; a negative ``pad`` drops that many leading tokens): a key/value prefix forward to the
  next token slice, its cotangent back to the previous one.

Buffers are freed as soon as their last reader on the mesh has run, so the memory a mesh holds follows the
schedule (its peak in-flight activations).
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

from alpa_like.compiler.backward_split import WEIGHT
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.stage_construction import StageProgram, ValueId, apply_order
from alpa_like.compiler.schedules import Phase, Schedule, is_sliced, slices_of

PER_STEP = -1
Key = tuple[ValueId, int]


class Op(enum.StrEnum):
    LOAD = "LOAD"
    RECV = "RECV"
    RUN = "RUN"
    ACC = "ACC"
    MEAN = "MEAN"
    FREE = "FREE"
    CARRY = "CARRY"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a mesh program (see the module docstring)."""

    op: Op
    mesh: int
    key: Key | None = None
    """The buffer read or written (LOAD, RECV, ACC source, MEAN, FREE)."""
    stage: int | None = None
    phase: str | None = None
    micro_batch: int | None = None
    src_mesh: int | None = None
    """RECV: the mesh that holds the buffer."""
    target: ValueId | None = None
    """ACC: the accumulator (the grad marker's output)."""
    source: Key | None = None
    """CARRY: the buffer handed on."""
    window: tuple[int, int, int, int] | None = None
    """A token-sliced LOAD: (first row, rows, first token, tokens) of the batch leaf."""
    pad: int = 0
    """CARRY: zeros added on the left of dim 1 (negative: leading entries dropped)."""

    def __str__(self) -> str:
        if self.op is Op.RUN:
            phase = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W", APPLY: "A"}[self.phase]
            return f"RUN {self.stage}{phase}{'' if self.micro_batch == PER_STEP else self.micro_batch}"
        buf = f"v{self.key[0]}" + ("" if self.key[1] == PER_STEP else f"@{self.key[1]}")
        if self.op is Op.RECV:
            return f"RECV {buf} <- mesh {self.src_mesh}"
        if self.op is Op.ACC:
            return f"ACC {buf} -> v{self.target}"
        if self.op is Op.CARRY:
            src = f"v{self.source[0]}" + ("" if self.source[1] == PER_STEP else f"@{self.source[1]}")
            return f"CARRY {src} -> {buf}" + (f" pad {self.pad}" if self.pad else "")
        if self.window is not None:
            r, rows, t, length = self.window
            return f"LOAD {buf} [rows {r}:{r + rows}, tokens {t}:{t + length}]"
        return f"{self.op} {buf}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshPrograms:
    """The global instruction order and each mesh's program."""

    instructions: tuple[Instruction, ...]
    num_meshes: int
    stage_to_mesh: tuple[int, ...]
    outputs: tuple[tuple[Key, int] | None, ...]
    """Per step output: its buffer and the mesh holding it (None for a literal output)."""
    output_copies: tuple[tuple[int, ...], ...] = ()
    """Per step output: the other meshes that hold the same buffer (a replicated update,
    :func:`~alpa_like.compiler.stage_construction.replicated_updates`); a runtime may keep their copies for
    the next step's LOAD of the value the step returned. Empty: none anywhere."""
    unit_shares: tuple[float, ...] = ()
    """A token-sliced schedule's (TeraPipe's): per unit (micro-batch ``k``'s token slice ``i`` is unit
    ``sum(slices of k' < k) + i``, the ``micro_batch`` of its instructions' buffers), the share of an
    average micro-batch's work it does, ``rows * length * M / (B * S)``. Empty: every micro-batch does one."""
    units: tuple[tuple[int, int], ...] = ()
    """A token-sliced schedule's: per unit, its (micro-batch, token slice). Empty: no token slices."""
    stage_of: tuple[int, ...] = ()
    """Per stage of the program, the pipeline stage whose work its pieces do (TeraPipe's programs run one
    variant of each stage per slice shape: :mod:`~alpa_like.runtime.terapipe_programs`). Empty: itself."""

    def program(self, mesh: int) -> tuple[Instruction, ...]:
        return tuple(i for i in self.instructions if i.mesh == mesh)

    def table(self) -> str:
        """Each mesh's program, one column per mesh, in global order."""
        width = 24
        lines = ["".join(f"mesh {k}".ljust(width) for k in range(self.num_meshes))]
        for ins in self.instructions:
            lines.append(" " * (width * ins.mesh) + str(ins))
        return "\n".join(lines)


_PHASE_OF = {Phase.F: FORWARD, Phase.B: BACKWARD, Phase.W: WEIGHT}


def emit_programs(program: StageProgram, schedule: Schedule, stage_to_mesh: Sequence[int], *,
                  free_buffers: bool = True,
                  token_slicing: Sequence[tuple[int, Sequence[int]]] = ()) -> MeshPrograms:
    """The instruction programs that run ``program`` under ``schedule`` (see the module docstring).

    Args:
      program: the stages' pieces.
      schedule: a validated schedule whose stages are the program's stages.
      stage_to_mesh: the mesh of each stage.
      free_buffers: emit the ``FREE`` instructions (a runtime needs them; the simulated backend's clock, on
        which a FREE takes no time, gives the same step without them, and they are most of a long program's
        instructions).
      token_slicing: for a token-sliced schedule (TeraPipe), the batch slices ``(rows, (lengths...))``
        its micro-batches are: each (micro-batch, token slice) task runs on its own unit's buffers, whose
        share of a micro-batch's work is :attr:`MeshPrograms.unit_shares`.
    """
    if schedule.num_stages != program.num_stages:
        raise ValueError(f"schedule has {schedule.num_stages} stages, the program {program.num_stages}")
    split = any(phase == WEIGHT for _, phase in program.pieces)
    if schedule.splits_backward != split:
        raise ValueError(f"schedule {schedule.name!r} {'has' if schedule.splits_backward else 'has no'} W tasks "
                         f"but the program's backwards are {'' if split else 'not '}split into B and W pieces "
                         "(alpa_like.compiler.backward_split.split_backwards)")
    per_micro_batch = set(program.batch_inputs)
    for (_, phase), piece in program.pieces.items():
        if phase != APPLY:
            per_micro_batch.update(piece.outputs)
    step_inputs = set(program.step_inputs) | set(program.constants)
    accumulator_of = dict(program.accumulated)
    where: dict[Key, set[int]] = {}
    out: list[Instruction] = []

    def key_of(v: ValueId, mb: int) -> Key:
        """The buffer of ``v`` that micro-batch ``mb`` (or the step, ``PER_STEP``) reads or writes. A
        per-micro-batch value read once per step (by an apply piece, or as the step's output) is one the
        forward pieces compute without the batch (a key split off before al.grad, a scalar read in the loss
        and after it), the same for every micro-batch (``grad_accumulation.split_at_grad_marker`` rejects
        one that depends on the batch): micro-batch 0's. A batch leaf read once per step is the whole batch."""
        if v not in per_micro_batch or mb == PER_STEP and v in program.batch_inputs:
            return (v, PER_STEP)
        return (v, 0 if mb == PER_STEP else mb)

    def make_available(v: ValueId, mb: int, mesh: int) -> None:
        key = key_of(v, mb)
        holders = where.setdefault(key, set())
        if mesh in holders:
            return
        if v in step_inputs and v not in per_micro_batch or v in program.batch_inputs:
            out.append(Instruction(Op.LOAD, mesh, key=key))
        elif holders:
            src = min(holders, key=lambda k: (k != stage_to_mesh[program.home.get(v, 0)], k))
            out.append(Instruction(Op.RECV, mesh, key=key, src_mesh=src))
        else:
            raise ValueError(f"value v{v} (micro-batch {mb}) is read on mesh {mesh} before it is computed; "
                             "the schedule does not respect the pieces' data flow")
        holders.add(mesh)

    # Per piece, the inputs still to check at each run: all of them the first time, then only the
    # per-micro-batch ones (a per-step input, once made available on the mesh, stays there).
    to_check: dict[tuple[int, str], tuple[ValueId, ...]] = {}

    def run(stage: int, phase: str, mb: int) -> None:
        mesh = stage_to_mesh[stage]
        piece = program.piece(stage, phase)
        checked = (stage, phase) in to_check
        for v in to_check[(stage, phase)] if checked else piece.inputs:
            holders = where.get(key_of(v, mb))
            if holders is None or mesh not in holders:
                make_available(v, mb, mesh)
        if not checked:
            to_check[(stage, phase)] = tuple(v for v in piece.inputs if v in per_micro_batch)
        out.append(Instruction(Op.RUN, mesh, stage=stage, phase=phase, micro_batch=mb))
        for v in piece.outputs:
            key = key_of(v, mb)
            where.setdefault(key, set()).add(mesh)
            if v in accumulator_of:
                out.append(Instruction(Op.ACC, mesh, key=key, target=accumulator_of[v]))

    first_unit, shares = unit_offsets(schedule, token_slicing)
    for row in schedule.ticks:
        for task in row:
            if task is not None:
                run(task.stage, _PHASE_OF[task.phase], first_unit[task.micro_batch] + (task.slice or 0))
    for src, dst in program.accumulated:
        mesh = stage_to_mesh[program.home.get(src, 0)]
        out.append(Instruction(Op.MEAN, mesh, key=(dst, PER_STEP)))
        where.setdefault((dst, PER_STEP), set()).add(mesh)
    for stage in apply_order(program):
        run(stage, APPLY, PER_STEP)
    def returned_input(v: ValueId) -> None:
        if v in program.batch_inputs:  # the step returns a batch leaf as it is
            make_available(v, PER_STEP, stage_to_mesh[-1])
        elif v in step_inputs:  # a state leaf no piece reads, returned as it is: loaded on its home mesh
            make_available(v, PER_STEP, stage_to_mesh[program.home.get(v, 0)])

    outputs, copies = step_output_places(program, where, key_of, returned_input)
    instructions = _insert_frees(out, program, {o for o in outputs if o}, key_of) if free_buffers else out
    return MeshPrograms(instructions=tuple(instructions),
                        num_meshes=schedule.num_meshes, stage_to_mesh=tuple(stage_to_mesh), outputs=tuple(outputs),
                        output_copies=tuple(copies) if any(copies) else (), unit_shares=shares,
                        units=tuple((k, i) for k, first in enumerate(first_unit)
                                    for i in range(slices_of(schedule.num_slices, k))) if shares else ())


def step_output_places(program: StageProgram, where: dict[Key, set[int]], key_of: Callable[[ValueId, int], Key],
                       returned_input: Callable[[ValueId], None]) -> tuple[list, list]:
    """Per step output of ``program``: the ``(buffer key, mesh)`` the step returns it from (the lowest mesh
    holding it in ``where``) and the other meshes holding a copy, ``None`` and ``()`` for a dropped output.
    An output no instruction has made is offered to ``returned_input`` first (a step input returned as it
    is, which that loads where the emitter wants it); if it is still nowhere, a ValueError names it."""
    outputs, copies = [], []
    for v in program.step_outputs:
        if v is None:
            outputs.append(None)
            copies.append(())
            continue
        key = key_of(v, PER_STEP)
        if key not in where:
            returned_input(v)
        holders = where.get(key)
        if not holders:
            raise ValueError(f"step output v{v} is never computed")
        outputs.append((key, min(holders)))
        copies.append(tuple(sorted(holders - {min(holders)})))
    return outputs, copies


def unit_offsets(schedule: Schedule, token_slicing: Sequence[tuple[int, Sequence[int]]] = ()):
    """Per micro-batch of ``schedule``, the index of its first unit (its first token slice's buffers), and
    per unit its share of an average micro-batch's work: ``rows * length * M / (B * S)`` of
    ``token_slicing``'s batch slices, else equal slices of equal micro-batches (empty when nothing is
    sliced: a unit is a micro-batch).

    >>> from alpa_like.compiler.schedule_tables import terapipe
    >>> unit_offsets(terapipe(2, 2, (2, 1)), ((1, (12, 4)), (1, (16,))))
    ((0, 2), (0.75, 0.25, 1.0))
    >>> unit_offsets(terapipe(2, 2, 2))
    ((0, 2), (0.5, 0.5, 0.5, 0.5))
    """
    counts = [slices_of(schedule.num_slices, k) for k in range(schedule.num_micro_batches)]
    first = tuple(sum(counts[:k]) for k in range(len(counts)))
    if token_slicing:
        if tuple(len(lengths) for _, lengths in token_slicing) != tuple(counts):
            raise ValueError(f"token_slicing {tuple(token_slicing)} does not match the schedule's token slices "
                             f"per micro-batch {tuple(counts)}")
        tokens = sum(rows * sum(lengths) for rows, lengths in token_slicing)
        return first, tuple(rows * length * len(counts) / tokens for rows, lengths in token_slicing
                            for length in lengths)
    if not is_sliced(schedule.num_slices):
        return first, ()
    return first, tuple(1 / count for count in counts for _ in range(count))


def buffer_key(buffers, v: ValueId, micro_batch: int) -> Key:
    """The key of the buffer of ``v`` that a RUN for ``micro_batch`` reads on a mesh holding ``buffers``:
    the micro-batch's own, else the step's, else micro-batch 0's (a value the forward pieces compute
    without the batch, read once per step: see ``key_of`` in :func:`emit_programs`)."""
    for key in ((v, micro_batch), (v, PER_STEP)):
        if key in buffers:
            return key
    return (v, 0)


def _insert_frees(instructions: list[Instruction], program: StageProgram, keep: set, key_of) -> list[Instruction]:
    """Adds ``FREE`` after the last use of each per-micro-batch buffer on each mesh (step inputs, outputs
    and accumulators stay): the last instruction that reads it on the mesh (a RUN's input, an ACC, a RECV
    into the mesh), writes it there (a RUN's output) or copies it from the mesh (a RECV from it)."""
    touched: dict[tuple[int, str], tuple[ValueId, ...]] = {}  # per piece: its per-micro-batch inputs and outputs
    last: dict[tuple[int, Key], int] = {}
    run, acc, recv = Op.RUN, Op.ACC, Op.RECV
    for i, ins in enumerate(instructions):
        op = ins.op
        if op is run:
            mb = ins.micro_batch
            if mb == PER_STEP:  # it writes per-step keys; it may read micro-batch 0's buffers (key_of)
                for v in program.pieces[(ins.stage, ins.phase)].inputs:
                    if (key := key_of(v, PER_STEP))[1] != PER_STEP:
                        last[(ins.mesh, key)] = i
                continue
            piece_key = (ins.stage, ins.phase)
            values = touched.get(piece_key)
            if values is None:
                piece = program.pieces[piece_key]
                values = touched[piece_key] = (tuple(v for v in piece.inputs if key_of(v, 0)[1] != PER_STEP)
                                               + piece.outputs)
            mesh = ins.mesh
            for v in values:
                last[(mesh, (v, mb))] = i
        elif (op is acc or op is recv) and ins.key[1] != PER_STEP:
            last[(ins.mesh, ins.key)] = i
            if op is recv:
                last[(ins.src_mesh, ins.key)] = i
    frees: dict[int, list[tuple[int, Key]]] = {}
    kept = {key for key, _ in keep}
    for place, i in last.items():
        if place[1] not in kept:
            frees.setdefault(i, []).append(place)
    result, done = [], 0
    for i in sorted(frees):
        result.extend(instructions[done:i + 1])
        result.extend(Instruction(Op.FREE, mesh, key=key) for mesh, key in sorted(frees[i]))
        done = i + 1
    result.extend(instructions[done:])
    return result
