"""What a pipeline's stage programs do with their gradients, worked out before a step runs (both backends):
the phases each stage runs (its backward split into ``B`` and ``W`` for a zero-bubble schedule), which
gradients a stage keeps as per-device partial sums until the step's mean instead of all-reducing them every
micro-batch, and the layouts those partial sums take."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jax.extend.core import Literal
from alpa_like.compiler import jax_compat
from alpa_like.compiler.backward_split import PHASES_SPLIT, WEIGHT, pins_after_split, split_backwards
from alpa_like.compiler.gradient_sync import NONE, DeferredGradients, deferrable_gradients
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.micro_batch_keys import seeds_keys
from alpa_like.compiler.propagation import follow_layouts
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.stage_construction import StageProgram, ValueId
from alpa_like.compiler.stage_sharding import StageSharding
from alpa_like.runtime.spmd import pins_after_inlining


def inline_backward_remat(program: StageProgram) -> tuple[StageProgram, frozenset]:
    """``program`` with the ``jax.checkpoint`` blocks of its backward pieces inlined as JAX lowers them
    (:func:`~alpa_like.compiler.jax_compat.inline_remat`: ``remat_layer=True``'s and the user's), so that
    :func:`deferred_gradients` sees the weight gradients their bodies compute; and the values the bodies
    compute, which the ILP gave no layout (it pins a block at its results). A block that makes a key from a
    seed stays a call (see :mod:`~alpa_like.runtime.spmd`)."""
    pieces, unpinned = dict(program.pieces), set()
    for key, piece in program.pieces.items():
        jaxpr = piece.jaxpr.jaxpr
        inlined = jax_compat.inline_remat(jaxpr, keep=seeds_keys) if key[1] == BACKWARD else jaxpr
        if inlined is not jaxpr:
            pieces[key] = dataclasses.replace(piece, jaxpr=piece.jaxpr.replace(jaxpr=inlined))
            kept = {id(e) for e in jaxpr.eqns}
            unpinned.update(v for e in inlined.eqns if id(e) not in kept for v in e.outvars)
    return dataclasses.replace(program, pieces=pieces), frozenset(unpinned)


def _pins_moved(program: StageProgram, stage: int, sharding: StageSharding) -> StageSharding:
    """``sharding`` with its pins moved onto ``stage``'s pieces once their checkpoint blocks are inlined
    (:func:`~alpa_like.runtime.spmd.pins_after_inlining`)."""
    eqns = [e for phase in stage_phases(program, stage) for e in program.piece(stage, phase).jaxpr.jaxpr.eqns]
    return dataclasses.replace(sharding,
                               value_pins=tuple(pins_after_inlining(sharding.value_pins, eqns, operands=False)),
                               operand_pins=tuple(pins_after_inlining(sharding.operand_pins, eqns, operands=True)))


def deferred_gradients(program: StageProgram, stage: int, sharding: StageSharding, mesh_shape: tuple[int, ...],
                       unpinned: frozenset = frozenset(), arrivals: dict | None = None,
                       kept_whole: frozenset = frozenset()) -> DeferredGradients:
    """The gradients of ``stage``'s backward piece (its ``W`` when split: :func:`gradient_phase`) whose mesh
    all-reduce can wait for the step's mean: accumulated values that no piece reads
    (:func:`~alpa_like.compiler.gradient_sync.deferrable_gradients`).
    The layouts are the ILP's; ``unpinned`` values (inside inlined checkpoint blocks) get those that follow
    (:func:`~alpa_like.compiler.propagation.follow_forward`) from them and from the ``arrivals``' (the
    stage's inputs from other meshes and the step, as they are laid out there) through the stage's forward,
    whose outputs the backward reads, and its backward. ``kept_whole``: gradients not to defer."""
    piece = program.piece(stage, gradient_phase(program, stage))
    read = {v for p in program.pieces.values() for v in p.inputs}
    gradients = [program.values[src] for src, dst in program.accumulated
                 if src in piece.outputs and src not in read and dst not in program.per_example
                 and src not in kept_whole]
    operand_specs = {(id(eqn), k): spec for eqn, k, spec in sharding.operand_pins}
    specs = {**sharding.input_specs, **sharding.output_specs}
    if unpinned and len(mesh_shape) <= 2:  # the strategies behind follow_forward know 1-D and 2-D meshes
        known = dict(arrivals or {})
        for phase in _computing(program, stage):  # the forward's outputs are the backward's residuals
            part = program.piece(stage, phase)
            jaxpr = part.jaxpr.jaxpr
            given = {var: known[v] for var, v in zip(jaxpr.invars, part.inputs, strict=True) if v in known}
            followed = follow_layouts(jaxpr.eqns, {**given, **specs}, mesh_shape)
            known.update((v, followed[var]) for var, v in zip(jaxpr.outvars, part.outputs, strict=True)
                         if not isinstance(var, Literal) and var in followed)
        specs = {**{v: spec for v, spec in followed.items() if v in unpinned}, **specs}
    return deferrable_gradients(piece.jaxpr.jaxpr.eqns, gradients, piece.jaxpr.jaxpr.outvars, specs, operand_specs,
                                mesh_shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradientDeferral:
    """A pipeline's gradient reduction deferred to the step's mean (:func:`defer_gradients`); without
    ``deferred``, nothing is deferred."""

    program: StageProgram
    """The stage program with its backward pieces' checkpoint blocks inlined (:func:`inline_backward_remat`)."""
    stage_shardings: tuple[StageSharding, ...]
    """The ILP's pins, moved onto the inlined pieces."""
    deferred: dict[int, DeferredGradients] = dataclasses.field(default_factory=dict)
    """Per stage, the gradients its backward piece outputs as stacks of partial sums."""
    stack_specs: dict[ValueId, tuple[int, ShardingSpec | None]] = dataclasses.field(default_factory=dict)
    """Accumulator of a stack -> (its stage, the layout of its step mean; None: XLA's choice)."""

    def piece_deferred(self, stage: int, phase: str) -> DeferredGradients:
        """The gradients piece ``(stage, phase)`` outputs as stacks: its stage's, on its gradient phase's piece
        (:func:`gradient_phase`)."""
        return self.deferred.get(stage, NONE) if phase == gradient_phase(self.program, stage) else NONE

    def pinned(self, stage: int) -> bool:
        """Whether ``stage``'s pieces have the ILP's layouts pinned inside them."""
        return stage < len(self.stage_shardings) and bool(self.stage_shardings[stage].value_pins)


def defer_gradients(program: StageProgram, stage_shardings: Sequence[StageSharding],
                    mesh_shapes: Sequence[tuple[int, ...]], stage_to_mesh: Sequence[int],
                    load_spec: Callable[[ValueId, tuple, int], ShardingSpec]) -> GradientDeferral:
    """Which gradients every stage's backward piece keeps as stacks of partial sums, reduced once per step
    (:func:`deferred_gradients`), for the local and the Ray backend alike.

    Args:
      program: the stage program.
      stage_shardings: per stage, the ILP's layouts.
      mesh_shapes: per mesh, its logical shape.
      stage_to_mesh: the mesh of each stage.
      load_spec: ``(value, shape, mesh) -> spec``: the layout a mesh loads or receives a value in.
    """
    program, unpinned = inline_backward_remat(program)
    unpinned = unpinned.union(*(s.unpinned for s in stage_shardings))
    shardings = tuple(_pins_moved(program, q, sharding) for q, sharding in enumerate(stage_shardings))
    deferred, stack_specs = {}, {}

    def find(q: int, kept_whole: frozenset = frozenset()) -> DeferredGradients:
        mine = unpinned if has_ilp_layouts(shardings[q]) else stage_values(program, q)
        arrivals = arrival_specs(program, stage_to_mesh, q, load_spec) if mine else {}
        return deferred_gradients(program, q, shardings[q], tuple(mesh_shapes[stage_to_mesh[q]]), mine, arrivals,
                                  kept_whole)
    deferred = {q: find(q) for q in range(len(shardings))}
    kept_whole: set[ValueId] = set()
    while mixed := mixed_accumulations(program, deferred) - kept_whole:
        # An accumulator takes all its sources' gradients as stacks or none (several slice shapes' pieces).
        kept_whole |= mixed
        again = {q for src in mixed for (q, phase), p in program.pieces.items()
                 if phase == gradient_phase(program, q) and src in p.outputs}
        deferred.update({q: find(q, frozenset(kept_whole)) for q in again})
    for q, sharding in enumerate(shardings):
        found = deferred[q]
        pinned = {var: spec for eqn, k, spec in sharding.value_pins for var in eqn.outvars[k:k + 1]}
        for src, dst in program.accumulated:
            var = program.values[src]
            if var in found.outputs:
                stack_specs[dst] = (q, pinned.get(var))
    return GradientDeferral(program=program, stage_shardings=shardings, deferred=deferred, stack_specs=stack_specs)


def mixed_accumulations(program: StageProgram, deferred: dict[int, DeferredGradients]) -> set[ValueId]:
    """The gradients accumulated into an accumulator that another source adds to as a whole value while
    this one is a stack of partial sums, or the reverse (each backward piece's deferral decided alone)."""
    made_by = {v: q for (q, phase), p in program.pieces.items() if phase == BACKWARD for v in p.outputs}
    by_target: dict[ValueId, list[tuple[ValueId, bool]]] = {}
    for src, dst in program.accumulated:
        if src in made_by:
            stacked = program.values[src] in deferred[made_by[src]].outputs
            by_target.setdefault(dst, []).append((src, stacked))
    return {src for sources in by_target.values() if len({s for _, s in sources}) > 1 for src, _ in sources}


def has_ilp_layouts(sharding: StageSharding) -> bool:
    """Whether the ILP laid out anything in the stage (a TeraPipe slice's re-traced pieces have no pins)."""
    return bool(sharding.value_pins or sharding.operand_pins or sharding.input_specs or sharding.output_specs)


def stage_values(program: StageProgram, stage: int) -> frozenset:
    """Every value ``stage``'s forward and backward pieces read or compute: for a stage without the ILP's
    layouts, those :func:`deferred_gradients` follows from the layouts of what arrives."""
    jaxprs = [program.piece(stage, phase).jaxpr.jaxpr for phase in (FORWARD, BACKWARD)]
    return frozenset([*(v for j in jaxprs for v in j.invars), *(v for j in jaxprs for e in j.eqns for v in e.outvars)])


def arrival_specs(program: StageProgram, stage_to_mesh: Sequence[int], stage: int,
                  load_spec: Callable[[ValueId, tuple, int], ShardingSpec]) -> dict[ValueId, ShardingSpec]:
    """The layouts of the values ``stage``'s forward and backward pieces read from other stages' meshes or
    from the step's inputs, as ``load_spec`` lays them out on the stage's mesh. A value a piece on the same
    mesh makes (the forward's residuals the backward reads; a program without home stages, TeraPipe's, names
    them only so) does not arrive."""
    mesh_index = stage_to_mesh[stage]
    made_here = {v for (q, phase), p in program.pieces.items() if stage_to_mesh[q] == mesh_index for v in p.outputs}
    out = {}
    for phase in _computing(program, stage):
        piece = program.piece(stage, phase)
        for var, v in zip(piece.jaxpr.jaxpr.invars, piece.inputs, strict=True):
            home = program.home.get(v)
            if v in made_here or (home is not None and stage_to_mesh[home] == mesh_index):
                continue  # made (or held) on this mesh: laid out as its producer's pin says, or as XLA chose
            out[v] = load_spec(v, var.aval.shape, mesh_index)
    return out


def stage_phases(program: StageProgram, stage: int) -> tuple[str, ...]:
    """The phases of ``stage``'s pieces in the order a micro-batch runs them, the apply-grad last: forward,
    backward (its ``B`` when split), ``W`` when the backward is split
    (:func:`~alpa_like.compiler.backward_split.split_backwards`), apply-grad."""
    return tuple(phase for phase in PHASES_SPLIT if (stage, phase) in program.pieces)


def _computing(program: StageProgram, stage: int) -> tuple[str, ...]:
    """:func:`stage_phases` without the apply-grad: the pieces run per micro-batch."""
    return tuple(phase for phase in stage_phases(program, stage) if phase != APPLY)


def gradient_phase(program: StageProgram, stage: int) -> str:
    """The phase of ``stage``'s piece that makes its accumulated gradients: ``W`` when its backward is split
    into ``B`` and ``W``, else the backward."""
    return WEIGHT if (stage, WEIGHT) in program.pieces else BACKWARD


def split_weight_gradients(program: StageProgram, stage_shardings: Sequence[StageSharding] = ()
                           ) -> tuple[StageProgram, tuple[StageSharding, ...]]:
    """``program`` with every stage's backward split into ``B`` (input gradients) and ``W`` (weight
    gradients) for a zero-bubble schedule (:func:`~alpa_like.compiler.backward_split.split_backwards`),
    after its checkpoint blocks are inlined (:func:`inline_backward_remat`) so that the weight gradients a
    block computes go to ``W`` (a block kept as a call runs whole in ``B``); and ``stage_shardings``' pins
    moved onto the inlined, then split pieces
    (:func:`~alpa_like.compiler.backward_split.pins_after_split`), each remembering the inlined values no
    pin names (:attr:`StageSharding.unpinned`, for :func:`defer_gradients`)."""
    program, unpinned = inline_backward_remat(program)
    moved = [_pins_moved(program, q, sharding) for q, sharding in enumerate(stage_shardings)]
    program = split_backwards(program)
    shardings = []
    for q, sharding in enumerate(moved):
        eqns = [e for phase in stage_phases(program, q) for e in program.piece(q, phase).jaxpr.jaxpr.eqns]
        shardings.append(dataclasses.replace(
            sharding, value_pins=tuple(pins_after_split(sharding.value_pins, eqns)),
            operand_pins=tuple(pins_after_split(sharding.operand_pins, eqns)), unpinned=unpinned))
    return program, tuple(shardings)
