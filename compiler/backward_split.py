"""Split a stage's backward into ``B`` (input gradients) and ``W`` (weight gradients), for the zero-bubble
schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

A stage's backward piece (:mod:`~alpa_like.compiler.stage_construction`) reads the stage's parameters, the
residuals its forward kept and the cotangents of its outputs, and returns the cotangents of its inputs (which
the previous stage's backward waits for) and its parameters' gradients (which only the grad marker's
accumulation waits for). :func:`split_backward` cuts its equations in two:

* ``B``: the equations the input cotangents depend on (and those with effects, with what they read); it
  also returns the values of its own that ``W`` reads (the cotangents feeding a weight-gradient
  contraction ``x^T dy``): the *saved* values;
* ``W``: every other live equation (the weight-gradient contractions, bias sums...), reading the backward's
  inputs (residuals, parameters) and the saved values.

No equation runs in both and none is added, so their FLOPs add up to the backward's live equations' FLOPs
exactly. Identity equations that carry several values (the layer markers ``alpa_marker``, an
``optimization_barrier``) are cut position by position: a marker's input-cotangent positions go to ``B``,
its weight-gradient positions to ``W`` (the ``bwd_end`` marker of a layer carries both). A call (``jit``,
``checkpoint``, ``scan``) is one equation: when ``B`` needs one of its results, all of it runs in ``B``.

:func:`split_backwards` applies the split to every stage of a
:class:`~alpa_like.compiler.stage_construction.StageProgram`: each stage's ``BACKWARD`` piece becomes its ``B``
piece and a :data:`WEIGHT` piece is added.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, JaxprEqn, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.stage_construction import StagePiece, StageProgram, ValueId

WEIGHT = "wgt"
"""The phase of a stage's weight-gradient piece (``W``); its input-gradient piece (``B``) keeps
:data:`~alpa_like.compiler.layer_slicing.BACKWARD`."""

_POSITIONAL_PRIMITIVES = frozenset({"optimization_barrier"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardSplit:
    """A backward jaxpr cut into ``b`` and ``w`` (see the module docstring).

    ``b`` reads the backward's invars at ``b_inputs`` and returns its outvars at ``b_outputs`` (the input
    gradients asked for, and any other output ``b`` computes anyway: a gradient that is a value ``B`` needs
    costs ``W`` nothing), then the saved values it does not return already; ``w`` reads the backward's
    invars at ``w_inputs``, then the saved values, ``b``'s outputs at ``saved_from``, and returns the
    backward's outvars at ``w_outputs``. ``b_outputs`` and ``w_outputs`` partition the backward's outvar
    positions."""

    b: ClosedJaxpr
    w: ClosedJaxpr
    b_inputs: tuple[int, ...]
    b_outputs: tuple[int, ...]
    w_inputs: tuple[int, ...]
    w_outputs: tuple[int, ...]
    saved_from: tuple[int, ...]

    @property
    def saved(self) -> tuple[Var, ...]:
        """The saved values: ``w``'s last invars, ``b``'s outvars at ``saved_from`` (the same Vars)."""
        return tuple(self.w.jaxpr.invars[len(self.w_inputs):])


def _is_positional(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is an identity whose output ``k`` is its input ``k`` (so it can be cut by position)."""
    return (is_marker(eqn) or eqn.primitive.name in _POSITIONAL_PRIMITIVES) and len(eqn.invars) == len(
        eqn.outvars) and not eqn.effects


def _restricted(eqn: JaxprEqn, positions: Sequence[int]) -> JaxprEqn:
    """The positional ``eqn`` on its ``positions`` only (a marker keeps its names of those positions)."""
    params = dict(eqn.params)
    if params.get("names"):
        params["names"] = tuple(params["names"][k] for k in positions)
    return eqn.replace(invars=[eqn.invars[k] for k in positions], outvars=[eqn.outvars[k] for k in positions],
                       params=params)


Unit = tuple[int, int]
"""An equation's index and a position of its outputs (-1: all of them, for an equation cut as a whole)."""


def _units(eqns: Sequence[JaxprEqn]) -> tuple[dict[Var, Unit], dict[Unit, list[Var]]]:
    """Who makes each Var (a unit), and what each unit reads."""
    producer: dict[Var, Unit] = {}
    reads: dict[Unit, list[Var]] = {}
    for i, eqn in enumerate(eqns):
        if _is_positional(eqn):
            for k, (inp, out) in enumerate(zip(eqn.invars, eqn.outvars, strict=True)):
                producer[out] = (i, k)
                reads[(i, k)] = [inp] if isinstance(inp, Var) else []
        else:
            producer.update((v, (i, -1)) for v in eqn.outvars)
            reads[(i, -1)] = jax_compat.eqn_inputs(eqn)
    return producer, reads


def _live_units(targets: Sequence, producer: dict[Var, Unit], reads: dict[Unit, list[Var]],
                stop: set[Unit] = frozenset()) -> set[Unit]:
    """The units ``targets`` (Vars; literals ignored) depend on, not looking past ``stop``'s units."""
    live: set[Unit] = set()
    stack = [v for v in targets if isinstance(v, Var)]
    while stack:
        unit = producer.get(stack.pop())
        if unit is None or unit in live or unit in stop:
            continue
        live.add(unit)
        stack.extend(reads[unit])
    return live


def _equations(eqns: Sequence[JaxprEqn], units: set[Unit]) -> list[JaxprEqn]:
    """The equations of ``units``, in jaxpr order (a positional one restricted to its positions)."""
    out = []
    for i, eqn in enumerate(eqns):
        if (i, -1) in units:
            out.append(eqn)
            continue
        positions = [k for k in range(len(eqn.outvars)) if (i, k) in units]
        if positions:
            out.append(_restricted(eqn, positions))
    return out


def _closed(eqns: Sequence[JaxprEqn], invars: Sequence[Var], outvars: Sequence, consts: dict) -> ClosedJaxpr:
    """A ClosedJaxpr of ``eqns`` over ``invars``, closing over the constants of ``consts`` it reads."""
    read = set(jax_compat.free_vars(eqns)) | {v for v in outvars if isinstance(v, Var)}
    constvars = [v for v in consts if v in read]
    jaxpr = jax_compat.subjaxpr(eqns, invars, outvars)
    return ClosedJaxpr(jaxpr.replace(constvars=constvars), [consts[v] for v in constvars])


def without_dead_positions(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` without the equations (and positions of identity equations such as a layer marker) that
    neither its outputs nor its effects depend on: what XLA runs of it, as a marker lowers to nothing. A
    first stage's backward computes the cotangent of the batch only for its ``bwd_end`` marker's unused
    output; this drops it. :func:`split_backward`'s two parts have exactly this jaxpr's equations."""
    jaxpr = closed.jaxpr
    producer, reads = _units(jaxpr.eqns)
    effects = [e for e in jaxpr.eqns if e.effects]
    live = _live_units([*jaxpr.outvars, *(v for e in effects for v in jax_compat.eqn_inputs(e))], producer, reads)
    live |= {(i, -1) for i, e in enumerate(jaxpr.eqns) if e.effects}
    return closed.replace(jaxpr=jaxpr.replace(eqns=_equations(jaxpr.eqns, live)))


def split_backward(closed: ClosedJaxpr, input_gradients: Sequence[int]) -> BackwardSplit:
    """Cuts the backward ``closed`` into ``B`` and ``W`` (see the module docstring).

    Args:
      closed: a backward jaxpr (any jaxpr: nothing here is specific to gradients).
      input_gradients: the positions of ``closed``'s outvars that ``B`` returns (the input cotangents); ``W``
        returns the others.

    Returns: the :class:`BackwardSplit`. Equations with effects run in ``B``; equations no output depends on
    run in neither.

    >>> import jax, jax.numpy as jnp
    >>> def bwd(x, w, dy):  # y = tanh(x @ w): dx, dw
    ...     dz = dy * (1 - jnp.tanh(x @ w) ** 2)
    ...     return dz @ w.T, x.T @ dz
    >>> closed = jax.make_jaxpr(bwd)(jnp.ones((4, 3)), jnp.ones((3, 2)), jnp.ones((4, 2)))
    >>> split = split_backward(closed, [0])
    >>> split.b_inputs, split.w_inputs, split.saved_from, [e.primitive.name for e in split.w.jaxpr.eqns]
    ((0, 1, 2), (0,), (1,), ['transpose', 'dot_general'])
    """
    jaxpr = closed.jaxpr
    n_out = len(jaxpr.outvars)
    asked = set(input_gradients)
    if any(not isinstance(k, int) or not 0 <= k < n_out for k in asked):
        raise ValueError(f"input_gradients must be positions of the backward's {n_out} outputs; "
                         f"got {list(input_gradients)}")
    eqns, outvars = jaxpr.eqns, list(jaxpr.outvars)
    producer, reads = _units(eqns)
    effect_reads = [v for e in eqns if e.effects for v in jax_compat.eqn_inputs(e)]
    b_units = _live_units([outvars[k] for k in asked] + effect_reads, producer, reads)
    b_units |= {(i, -1) for i, e in enumerate(eqns) if e.effects}
    made_by_b = {v for unit in b_units for v in _unit_outvars(eqns, unit)}
    b_outputs = tuple(k for k, v in enumerate(outvars) if k in asked or isinstance(v, Var) and v in made_by_b)
    w_outputs = tuple(k for k in range(n_out) if k not in b_outputs)
    w_targets = [outvars[k] for k in w_outputs]
    w_eqns = _equations(eqns, _live_units(w_targets, producer, reads, stop=b_units))
    saved = list(dict.fromkeys(v for v in jax_compat.free_vars(w_eqns) if v in made_by_b))
    returned = [outvars[k] for k in b_outputs]
    b_outvars = returned + [v for v in saved if not any(v is r for r in returned)]
    b_eqns = _equations(eqns, b_units)
    invars = list(jaxpr.invars)
    b_read = set(jax_compat.free_vars(b_eqns)) | {v for v in returned if isinstance(v, Var)}
    w_read = set(jax_compat.free_vars(w_eqns)) | {v for v in w_targets if isinstance(v, Var)}
    b_inputs = tuple(k for k, v in enumerate(invars) if v in b_read)
    w_inputs = tuple(k for k, v in enumerate(invars) if v in w_read)
    consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    b = _closed(b_eqns, [invars[k] for k in b_inputs], b_outvars, consts)
    w = _closed(w_eqns, [invars[k] for k in w_inputs] + saved, w_targets, consts)
    saved_from = tuple(next(i for i, r in enumerate(b_outvars) if r is v) for v in saved)
    return BackwardSplit(b=b, w=w, b_inputs=b_inputs, b_outputs=b_outputs, w_inputs=w_inputs,
                         w_outputs=w_outputs, saved_from=saved_from)


def _unit_outvars(eqns: Sequence[JaxprEqn], unit: Unit) -> list[Var]:
    i, k = unit
    return list(eqns[i].outvars) if k == -1 else [eqns[i].outvars[k]]


def input_gradient_outputs(program: StageProgram, stage: int) -> tuple[int, ...]:
    """The positions of ``stage``'s backward outputs that its ``B`` returns: those another stage's forward or
    backward reads, or the step returns (the cotangents of the stage's input activations). The others (the
    gradients the grad marker accumulates) are ``W``'s."""
    piece = program.piece(stage, BACKWARD)
    read = {v for (q, phase), other in program.pieces.items()
            if phase in (FORWARD, BACKWARD) and q != stage for v in other.inputs}
    read.update(v for v in program.step_outputs if v is not None)
    return tuple(k for k, v in enumerate(piece.outputs) if v in read)


def split_backwards(program: StageProgram) -> StageProgram:
    """``program`` with every stage's backward cut by :func:`split_backward`: ``(q, BACKWARD)`` is stage
    ``q``'s ``B`` piece and ``(q, WEIGHT)`` its ``W`` piece, per micro-batch, ``W`` after ``B``. The saved
    values get new ValueIds (after ``program.values``), homed on their stage; ``W`` reads them and the
    backward's inputs it needs (the forward's residuals, parameters), all on the stage's mesh."""
    pieces = dict(program.pieces)
    values, home = list(program.values), dict(program.home)
    ids = {v: ValueId(i) for i, v in enumerate(values)}
    for q in range(program.num_stages):
        piece = program.piece(q, BACKWARD)
        split = split_backward(piece.jaxpr, input_gradient_outputs(program, q))
        returned = tuple(piece.outputs[k] for k in split.b_outputs)
        for var in split.b.jaxpr.outvars[len(returned):]:  # the saved values B does not return already
            ids[var] = ValueId(len(values))
            values.append(var)
            home[ids[var]] = q
        pieces[(q, BACKWARD)] = StagePiece(
            stage=q, phase=BACKWARD, jaxpr=split.b, inputs=tuple(piece.inputs[k] for k in split.b_inputs),
            outputs=returned + tuple(ids[var] for var in split.b.jaxpr.outvars[len(returned):]))
        pieces[(q, WEIGHT)] = StagePiece(
            stage=q, phase=WEIGHT, jaxpr=split.w,
            inputs=tuple(piece.inputs[k] for k in split.w_inputs) + tuple(
                pieces[(q, BACKWARD)].outputs[i] for i in split.saved_from),
            outputs=tuple(piece.outputs[k] for k in split.w_outputs))
    return dataclasses.replace(program, pieces=pieces, values=tuple(values), home=home)


def pins_after_split(pins: Sequence[tuple[JaxprEqn, int, Any]], eqns: Sequence[JaxprEqn]) -> list:
    """``pins`` ``(eqn, k, spec)`` (value ``k`` of ``eqn``: an output, or an operand, pinned to ``spec``) on
    a backward's equations moved onto ``eqns``, those of its ``B`` and ``W`` parts: a pin on an equation
    they keep stays; one on a cut identity equation (a marker) goes to the part that carries that position,
    at its new index; pins on equations of neither (dead code) are dropped."""
    kept = {id(e) for e in eqns}
    position = {v: (e, k) for e in eqns if _is_positional(e) for k, v in enumerate(e.outvars)}
    out = []
    for eqn, k, spec in pins:
        if id(eqn) in kept:
            out.append((eqn, k, spec))
        elif _is_positional(eqn) and eqn.outvars[k] in position:
            out.append((*position[eqn.outvars[k]], spec))
    return out


PHASES_SPLIT = (FORWARD, BACKWARD, WEIGHT, APPLY)
"""The phases of a program after :func:`split_backwards`, in the order a micro-batch runs them."""
