"""Cut a sliced step into per-stage programs: forward, backward and apply-grad of each pipeline stage.

Input: the step jaxpr with layer markers, the :class:`Piece` of every equation (``slice_layers``), and the
stages' layer ranges from the plan. Output: plain data the runtime executes. Each stage ``q`` gets three
:class:`StagePiece` jaxprs:

* ``forward`` (once per micro-batch): the forward regions of its layers;
* ``backward`` (once per micro-batch): the backward regions; it reads the forward's *residuals* (values the
  forward produced for the backward), kept on the stage's mesh;
* ``apply`` (once per step): its layers' apply-grad equations (the optimizer update).

Every value is named by a :data:`ValueId` (its index in :attr:`StageProgram.values`). A piece reads values
that are step inputs (parameters and optimizer state: per step; batch leaves: per micro-batch), outputs of
other pieces (maybe on another mesh: the runtime moves them), or accumulated gradients. The grad marker is
not executed: its inputs (gradients, loss, aux) are summed over micro-batches where they are produced and
divided by the number of micro-batches, and that mean is the value of its outputs (Alpa 3.5,
"gradient accumulation").
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NewType

from jax.extend.core import ClosedJaxpr, Literal, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.grad_accumulation import AfterGrad, batch_dependent, full_batch_values
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD, Piece
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.micro_batch_keys import (DERIVED, ROOT, KeyDraws, draws_random_numbers, fold_points,
                                                 foldable, key_data, key_origins, unfoldable_draws)

ValueId = NewType("ValueId", int)
PHASES = (FORWARD, BACKWARD, APPLY)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePiece:
    """One executable piece: a stage's forward, backward or apply-grad."""

    stage: int
    phase: str
    jaxpr: ClosedJaxpr
    inputs: tuple[ValueId, ...]
    outputs: tuple[ValueId, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageProgram:
    """Every stage's pieces and how values flow between them."""

    num_stages: int
    pieces: dict[tuple[int, str], StagePiece]
    """(stage, phase) -> piece; every stage has all three phases (possibly empty)."""
    values: tuple[Var, ...]
    """ValueId -> the jaxpr Var it names."""
    step_inputs: tuple[ValueId, ...]
    """ValueId of each step input leaf (jaxpr invar), in order."""
    batch_inputs: frozenset[ValueId]
    """Step inputs that are split into micro-batches."""
    step_outputs: tuple[ValueId | None, ...]
    """ValueId of each step output (None for a literal output; see ``literal_outputs``)."""
    literal_outputs: dict[int, object]
    constants: dict[ValueId, object]
    """Values closed over by the step (numpy/jax arrays), sent to whichever stage reads them."""
    accumulated: tuple[tuple[ValueId, ValueId], ...]
    """(grad-marker input, grad-marker output) pairs: the output is the micro-batch mean of the input."""
    home: dict[ValueId, int]
    """Stage whose mesh holds each value: its producer's stage, or for a step input its first reader's."""
    per_example: frozenset[ValueId] = frozenset()
    """Grad-marker outputs of ``accumulated`` that are per-example values (an aux such as logits): the
    micro-batches' values put back together in the full batch's row order
    (:func:`~alpa_like.compiler.grad_accumulation.from_micro_batches`), not averaged."""

    def piece(self, stage: int, phase: str) -> StagePiece:
        return self.pieces[(stage, phase)]

    def output_slots(self, targets: Iterable[tuple[tuple[int, str], ValueId, Any]]) -> dict[tuple[int, str], tuple]:
        """Per piece named in ``targets`` (``((stage, phase), output value, target)``), a tuple over its outputs:
        each named output's target, None for the others (the pieces' output pins: layouts to make them in)."""
        slots: dict[tuple[int, str], list] = {}
        for where, v, target in targets:
            outputs = self.piece(*where).outputs
            slots.setdefault(where, [None] * len(outputs))[outputs.index(v)] = target
        return {where: tuple(s) for where, s in slots.items()}


def stage_of_layer(stage_layers: Sequence[Sequence[int]]) -> dict[int, int]:
    return {layer: q for q, layers in enumerate(stage_layers) for layer in layers}


def build_stage_program(closed: ClosedJaxpr, pieces: Sequence[Piece | None], stage_layers: Sequence[Sequence[int]],
                        batch_mask: Sequence[bool], stage_to_mesh: Sequence[int] | None = None,
                        after_grad: AfterGrad | None = None) -> StageProgram:
    """Groups the equations by (stage, phase) and derives each group's inputs and outputs.

    Args:
      closed: the step jaxpr (parameter markers bypassed), traced for one micro-batch.
      pieces: ``slice_layers(closed.jaxpr)``.
      stage_layers: the layer ids of each stage, in pipeline order.
      batch_mask: per step input, whether it is a batch leaf.
      stage_to_mesh: the mesh of each stage. When given, the update of a step input that the forward or
        backward of stages on other meshes also read (a tied embedding) is replicated onto the first such
        stage of each of those meshes (:func:`replicated_updates`), as Megatron-LM does; None: every update
        runs once, on the stage that makes the last of its gradients.
      after_grad: the step's outputs that read the full batch after al.grad (``TracedStep.after_grad``):
        :func:`add_after_grad`.
    """
    jaxpr = closed.jaxpr
    layer_stage = stage_of_layer(stage_layers)
    marker = next((e for e in jaxpr.eqns if is_marker(e, "grad")), None)
    if marker is None:
        raise ValueError("the step has no al.grad / al.value_and_grad call: a pipeline needs one")
    ids: dict[Var, ValueId] = {}

    def vid(v: Var) -> ValueId:
        return ids.setdefault(v, ValueId(len(ids)))

    step_inputs = tuple(vid(v) for v in jaxpr.invars)
    consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    skipped, effects = _replaced_by_after_grad(jaxpr, marker, batch_mask, after_grad) if after_grad else (set(), [])
    groups: dict[tuple[int, str], list] = {(q, ph): [] for q in range(len(stage_layers)) for ph in PHASES}
    for eqn, piece in zip(jaxpr.eqns, pieces, strict=True):
        if piece is None or eqn is marker or id(eqn) in skipped:
            continue
        groups[(layer_stage[piece.layer], piece.phase)].append(eqn)
    producer_group = {v: key for key, eqns in groups.items() for e in eqns for v in e.outvars}
    if stage_to_mesh is not None:
        for q, eqns in replicated_updates(jaxpr, groups, stage_to_mesh).items():
            mine = {id(e) for e in groups[(q, APPLY)]} | {id(e) for e in eqns}
            groups[(q, APPLY)] = [e for e in jaxpr.eqns if id(e) in mine]  # jaxpr order
    unmade = set(jaxpr.invars) | set(jaxpr.constvars)
    for i, o in zip(marker.invars, marker.outvars, strict=True):  # al.grad returns a step input as it is
        if isinstance(i, Var) and i in unmade:
            ids[o] = vid(i)  # its mean over micro-batches (its rows put back together, for a batch leaf) is itself
    accumulated = tuple((vid(i), vid(o)) for i, o in zip(marker.invars, marker.outvars, strict=True)
                        if isinstance(i, Var) and i not in unmade)
    for i, o in zip(marker.invars, marker.outvars, strict=True):  # the mean lives where its input is made
        if i in producer_group:
            producer_group[o] = (producer_group[i][0], APPLY)
    outvars, per_example, values_of = list(jaxpr.outvars), frozenset(), {}
    if after_grad is not None:
        outvars, per_example, values_of = add_after_grad(
            after_grad, jaxpr, marker, groups, producer_group, ids, consts,
            effects=all(pieces[i] is not None for i in effects))  # where the step's own effects run
    readers: dict[Var, set] = {}
    for key, eqns in groups.items():
        for e in eqns:
            for v in jax_compat.eqn_inputs(e):
                readers.setdefault(v, set()).add(key)
    step_out_vars = {v for v in outvars if isinstance(v, Var)}
    marker_inputs = {v for v in marker.invars if isinstance(v, Var)}
    built = {}
    for key, eqns in groups.items():
        inputs = jax_compat.free_vars(eqns)
        outputs = [v for e in eqns for v in e.outvars
                   if v in step_out_vars or v in marker_inputs or any(r != key for r in readers.get(v, ()))]
        sub = ClosedJaxpr(jax_compat.subjaxpr(eqns, inputs, outputs), [])
        built[key] = StagePiece(stage=key[0], phase=key[1], jaxpr=sub, inputs=tuple(vid(v) for v in inputs),
                                outputs=tuple(vid(v) for v in outputs))
    home: dict[ValueId, int] = {}
    for v, (q, _) in producer_group.items():
        home[vid(v)] = q
    for v in [*jaxpr.invars, *jaxpr.constvars]:
        stages = sorted(q for q, _ in readers.get(v, ()))
        home.setdefault(vid(v), stages[0] if stages else 0)
    for v in step_out_vars:
        vid(v)
    values = [None] * len(ids)
    for v, i in ids.items():
        if values[i] is None:  # an alias (add_after_grad) names a value its first Var names
            values[i] = v
    values = [values_of.get(ValueId(i), v) for i, v in enumerate(values)]
    return StageProgram(num_stages=len(stage_layers), pieces=built, values=tuple(values), step_inputs=step_inputs,
                        batch_inputs=frozenset(i for i, b in zip(step_inputs, batch_mask, strict=True) if b),
                        step_outputs=tuple(ids[v] if isinstance(v, Var) else None for v in outvars),
                        literal_outputs={k: v.val for k, v in enumerate(outvars) if isinstance(v, Literal)},
                        constants={ids[v]: c for v, c in consts.items() if v in ids},
                        accumulated=accumulated, home=home, per_example=per_example)


def _replaced_by_after_grad(jaxpr, marker, batch_mask: Sequence[bool],
                            after_grad: AfterGrad) -> tuple[set[int], list[int]]:
    """Ids of the equations of ``jaxpr`` (traced for one micro-batch) that only its outputs at
    ``after_grad.outputs``, and the effects reading the full batch after al.grad, need: ``after_grad``
    computes those outputs, and runs those effects, for the full batch instead. Second, the positions of
    those effects."""
    eqns = jaxpr.eqns
    batch_vars = {v for v, b in zip(jaxpr.invars, batch_mask, strict=True) if b}
    full = full_batch_values(eqns, marker, batch_vars, jaxpr.constvars,
                             [after_grad.results[p] for p in after_grad.per_example])
    after = list(eqns).index(marker)
    reads_full = {i for i, e in enumerate(eqns)
                  if i > after and e.effects and any(v in full for v in jax_compat.eqn_inputs(e))}
    effects = [i for i, e in enumerate(eqns) if e.effects and i not in reads_full]
    wanted = set(after_grad.outputs)
    kept = [v for k, v in enumerate(jaxpr.outvars) if k not in wanted]
    needed = jax_compat.ancestors(eqns, kept + list(marker.invars)
                                  + [v for i in effects for v in jax_compat.eqn_inputs(eqns[i])])
    replaced = jax_compat.ancestors(eqns, [jaxpr.outvars[k] for k in wanted]
                                    + [v for i in reads_full for v in jax_compat.eqn_inputs(eqns[i])])
    return {id(eqns[i]) for i in (replaced | reads_full) - needed - set(effects)}, sorted(reads_full)


def add_after_grad(after_grad: AfterGrad, jaxpr, marker, groups: dict[tuple[int, str], list],
                   producer_group: dict, ids: dict[Var, ValueId], consts: dict,
                   effects: bool = True) -> tuple[list, frozenset, dict]:
    """Adds the equations of ``after_grad`` (the step after al.grad, traced for the full batch) to the
    apply-grad of the stage that makes al.grad's per-example results (the last stage when there are none).

    Its inputs name the step's values (``ids`` gets the aliases): a step input, a batch leaf too, is that
    input, which the apply-grad reads once per step (a batch leaf: the whole batch); al.grad's results are
    the grad marker's outputs, per-example ones put back together in the full batch's row order
    (``per_example``). Its effects (``jax.debug.print`` of a metric) are left out unless ``effects``.

    Returns: the step's outputs (``jaxpr``'s, those at ``after_grad.outputs`` replaced by ``after_grad``'s),
    the ValueIds of the per-example results, and ValueId -> the Var (with its full-batch shape) that names
    a per-example result in the program.
    """
    inner = after_grad.jaxpr.jaxpr
    n = len(jaxpr.invars)
    for k, v in enumerate(inner.invars):
        ids[v] = ids[jaxpr.invars[k]] if k < n else ids.setdefault(after_grad.results[k - n], ValueId(len(ids)))
    for v, c in zip(inner.constvars, after_grad.jaxpr.consts, strict=True):
        ids.setdefault(v, ValueId(len(ids)))
        consts[v] = c
    made_by = {o: i for i, o in zip(marker.invars, marker.outvars, strict=True)}
    stages = [producer_group[made_by[after_grad.results[p]]][0] for p in after_grad.per_example
              if made_by.get(after_grad.results[p]) in producer_group]
    q = max(stages, default=max(key[0] for key in groups))
    eqns = [e for e in inner.eqns if effects or not e.effects]
    groups[(q, APPLY)] = groups[(q, APPLY)] + eqns
    producer_group.update((v, (q, APPLY)) for e in eqns for v in e.outvars)
    for v in inner.constvars:
        producer_group.setdefault(v, (q, APPLY))
    outvars = list(jaxpr.outvars)
    for k, v in zip(after_grad.outputs, inner.outvars, strict=True):
        outvars[k] = v
    per_example = frozenset(ids[after_grad.results[p]] for p in after_grad.per_example)
    values_of = {ids[inner.invars[n + p]]: inner.invars[n + p] for p in after_grad.per_example}
    return outvars, per_example, values_of


def replicated_updates(jaxpr, groups: dict[tuple[int, str], list], stage_to_mesh: Sequence[int]) -> dict[int, list]:
    """Apply-grad equations to run again on other stages, so that no mesh loads a value another mesh updated.

    For each non-batch step input ``v`` that the apply-grad of one stage ``a`` reads (it updates ``v``) and
    the forward or backward of stages on other meshes read: the step outputs of ``a``'s apply-grad that
    depend on ``v`` (its next value), and every equation of ``a``'s apply-grad they depend on (the optimizer
    update, its state's update, the sum of ``v``'s gradient parts), go to the first reading stage of each
    other mesh as well. That stage's apply-grad then reads the gradient parts accumulated on ``a`` (a RECV),
    ``a``'s reads its parts (a RECV the other way), and both compute the same next value: Megatron-LM's
    tied embedding, updated on the first and last stages after an all-reduce of its gradient.

    Returns: stage -> the extra apply-grad equations (not yet merged, in jaxpr order).
    """
    num_stages = len(stage_to_mesh)
    invars = set(jaxpr.invars)
    step_outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    readers: dict[Var, set[int]] = {}
    for q in range(num_stages):
        for phase in (FORWARD, BACKWARD):
            for e in groups[(q, phase)]:
                for v in jax_compat.eqn_inputs(e):
                    if v in invars:
                        readers.setdefault(v, set()).add(q)
    extra: dict[int, dict[int, object]] = {}
    for a in range(num_stages):
        apply_eqns = groups[(a, APPLY)]
        updated = {v for e in apply_eqns for v in jax_compat.eqn_inputs(e) if v in invars}
        for v in updated:
            targets, meshes = [], {stage_to_mesh[a]}
            for q in sorted(readers.get(v, ())):
                if stage_to_mesh[q] not in meshes:
                    meshes.add(stage_to_mesh[q])
                    targets.append(q)
            if not targets:
                continue
            needed = update_of(v, apply_eqns, step_outputs)
            for q in targets:
                extra.setdefault(q, {}).update((id(apply_eqns[i]), apply_eqns[i]) for i in needed)
    return {q: list(eqns.values()) for q, eqns in extra.items()}


def update_of(v: Var, apply_eqns: Sequence, step_outputs: set) -> list[int]:
    """The update of step input ``v`` within ``apply_eqns`` (an apply-grad's equations, in jaxpr order):
    indices, in order, of the equations that the step outputs depending on ``v`` (its next value and its
    optimizer state's) depend on, including the gradient sums they read."""
    depends = {v}
    for e in apply_eqns:
        if depends.intersection(jax_compat.eqn_inputs(e)):
            depends.update(e.outvars)
    outputs = [o for e in apply_eqns for o in e.outvars if o in depends and o in step_outputs]
    return sorted(jax_compat.ancestors(apply_eqns, outputs))


def apply_order(program: StageProgram) -> list[int]:
    """The stages in an order in which each apply-grad runs after the apply-grads whose outputs it reads
    (stage order where that holds: a replicated update may read a value a later stage's apply-grad makes)."""
    made = {v: q for (q, phase), piece in program.pieces.items() if phase == APPLY for v in piece.outputs}
    order: list[int] = []
    pending = list(range(program.num_stages))
    while pending:
        for q in pending:
            deps = {made[v] for v in program.piece(q, APPLY).inputs if v in made} - {q}
            if deps <= set(order):
                break
        else:
            raise ValueError(f"the apply-grads of stages {pending} read each other's outputs")
        order.append(q)
        pending.remove(q)
    return order


def updating_stages(program: StageProgram) -> dict[ValueId, frozenset[int]]:
    """Per non-batch step input that some apply-grad piece reads: the stages whose apply-grad reads it.

    An optimizer update reads the old value of the parameter (or optimizer state) it replaces, so these are
    the stages that compute its next value, which the step returns from their mesh. A stage whose forward
    or backward reads the input while its own apply-grad does not (the first stage of a GPT, whose lookup
    reads the word embedding that the logits' stage updates) gets the next step's value from another mesh,
    unless the program replicates that update on it (:func:`replicated_updates`).

    NOTE: the step's outputs are not matched to its inputs (a training loop feeds the returned state back,
    but nothing in the jaxpr says which output becomes which input); reading the old value is the proxy.
    """
    readers: dict[ValueId, set[int]] = {}
    step_inputs = set(program.step_inputs) - program.batch_inputs
    for (q, phase), piece in program.pieces.items():
        if phase == APPLY:
            for v in piece.inputs:
                if v in step_inputs:
                    readers.setdefault(v, set()).add(q)
    return {v: frozenset(stages) for v, stages in readers.items()}


def micro_batch_key_draws(program: StageProgram, num_micro_batches: int) -> dict[tuple[int, str], KeyDraws]:
    """Per forward and backward piece (a split backward's ``W`` too), its equations that read key roots (the
    step's key, a key made from a seed) and those operands: the runtimes fold the micro-batch's index into them
    (:mod:`~alpa_like.compiler.micro_batch_keys`), as gradient accumulation does, so that micro-batches
    do not share a dropout mask. Pieces without any are left out, and every piece when there is one
    micro-batch (the step's own draws, as under jax.jit).

    Nothing is folded (every micro-batch draws the same numbers, as ``split_at_grad_marker`` warns) when
    drawn numbers reach an apply piece or the step's outputs (they must be one value, and the pieces that
    draw them run per micro-batch), or when a piece draws from keys the fold cannot reach
    (:func:`~alpa_like.compiler.micro_batch_keys.unfoldable_draws`)."""
    if num_micro_batches == 1:
        return {}
    stages = range(program.num_stages)
    computed = [program.piece(q, FORWARD) for q in stages] + [  # a split backward's W after its B
        piece for q in reversed(stages) for (s, phase), piece in sorted(program.pieces.items(), key=_backward_first)
        if s == q and phase not in (FORWARD, APPLY)]
    read_later = {v for (_, phase), piece in program.pieces.items() if phase == APPLY for v in piece.inputs}
    read_later |= {v for v in program.step_outputs if v is not None}
    for piece in computed:
        inner = piece.jaxpr.jaxpr
        drawn = batch_dependent(inner.eqns, {v for e in inner.eqns if draws_random_numbers(e) for v in e.outvars})
        if any(out in drawn and v in read_later for v, out in zip(piece.outputs, inner.outvars, strict=True)):
            return {}
    data = _key_data(computed)
    origins: dict[ValueId, str] = {v: DERIVED for v in program.batch_inputs}
    given_to_step = set(program.step_inputs) | set(program.constants)
    found = {}
    for piece in computed:  # in an order that computes every value before its readers
        inner = piece.jaxpr.jaxpr
        local_data = key_data(inner, [data.get(v) for v in piece.outputs])
        local_data.update((var, data[v]) for var, v in zip(inner.invars, piece.inputs, strict=True) if v in data)
        given = {var: origins.get(v, ROOT) for var, v in zip(inner.invars, piece.inputs, strict=True)
                 if v in origins or (v in given_to_step and foldable(var, local_data))}
        local = key_origins(inner.eqns, given, local_data)
        if unfoldable_draws(inner.eqns, local, local_data):
            return {}
        origins.update((v, local[var]) for var, v in zip(inner.outvars, piece.outputs, strict=True) if var in local)
        draws = fold_points(inner.eqns, local, local_data)
        if draws:
            found[(piece.stage, piece.phase)] = draws
    return found


def _backward_first(item) -> tuple:
    """Sorts ``program.pieces``' items of one stage: the backward before any other piece (a split
    backward's ``W``, which reads what its ``B`` saves)."""
    (stage, phase), _ = item
    return stage, phase != BACKWARD, phase


def _key_data(pieces: Sequence[StagePiece]) -> dict[ValueId, object]:
    """The values (across pieces) that are PRNG key data, with their impls
    (:func:`~alpa_like.compiler.micro_batch_keys.key_data` followed through every piece)."""
    data: dict[ValueId, object] = {}
    while True:
        size = len(data)
        for piece in pieces:
            inner = key_data(piece.jaxpr.jaxpr, [data.get(v) for v in piece.outputs])
            for var, v in zip(piece.jaxpr.jaxpr.invars, piece.inputs, strict=True):
                if var in inner:
                    data.setdefault(v, inner[var])
        if len(data) == size:
            return data


def _invars_in(piece: StagePiece, values: set[ValueId]) -> set[Var]:
    return {var for var, v in zip(piece.jaxpr.jaxpr.invars, piece.inputs, strict=True) if v in values}
