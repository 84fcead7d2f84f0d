"""Slice a traced step with layer markers into per-layer forward, backward and apply-grad pieces.

After layer construction (:mod:`alpa_like.compiler.layer_construction`) the step jaxpr contains, for each
layer ``l``, a forward region ``fwd_start(l) .. fwd_end(l)`` and a backward region ``bwd_start(l) ..
bwd_end(l)``, then the grad marker, then apply-grad. :func:`slice_layers` gives every equation a
:class:`Piece`: the equations inside a region belong to it; glue outside regions (the gradient seed, sums of
gradients of shared parameters) joins the region of its first consumer, or failing that of its last
producer; apply-grad equations join the layer whose backward produced the gradients they read (the optimizer
update is placed with the parameters it updates, Alpa 3.5), and those that read no gradient join their
first consumer's layer. :func:`layer_summaries` then gives the numbers
the stage DP needs per layer: FLOPs, parameter leaves, and activation bytes kept from forward to backward.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import eqn_flops
from alpa_like.compiler.markers import is_marker

FORWARD, BACKWARD, APPLY = "fwd", "bwd", "apply"


@dataclasses.dataclass(frozen=True, order=True)
class Piece:
    """Where an equation runs: layer ``layer``, phase fwd | bwd | apply."""

    layer: int
    phase: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSummary:
    """What the stage DP needs to know about one layer."""

    layer: int
    forward_flops: float
    backward_flops: float
    apply_flops: float
    param_inputs: tuple[int, ...]
    """Indices of the step's input leaves that are parameters first used by this layer's forward."""
    param_bytes: int
    activation_bytes: int
    """Bytes produced by the forward and read by the backward of this layer (per micro-batch); parameters
    passed through the layer's markers are not activations."""


def _nbytes(var: Var) -> int:
    aval = var.aval
    return int(math.prod(aval.shape)) * jax_compat.numpy_dtype(aval.dtype).itemsize


def _region_pieces(eqns: Sequence[JaxprEqn]) -> list[Piece | None]:
    pieces: list[Piece | None] = []
    current: Piece | None = None
    for eqn in eqns:
        if is_marker(eqn) and eqn.params["kind"] in ("fwd_start", "bwd_start"):
            current = Piece(eqn.params["layer"], FORWARD if eqn.params["kind"] == "fwd_start" else BACKWARD)
        pieces.append(current)
        if is_marker(eqn) and eqn.params["kind"] in ("fwd_end", "bwd_end"):
            current = None
    return pieces


def slice_layers(jaxpr: Jaxpr) -> list[Piece | None]:
    """The :class:`Piece` of every equation (None for equations that feed nothing, i.e. dead code). An effect
    (``jax.debug.print``, ``jax.debug.callback``) and what it reads are live: it runs in the piece of its
    region, or, outside the layers, with the values it reads.

    Raises:
      ValueError: the jaxpr has no layer markers (the step did not call al.grad under a pipeline method).
    """
    eqns = jaxpr.eqns
    if not any(is_marker(e, "fwd_start") for e in eqns):
        raise ValueError("the step has no pipeline layers: call al.grad / al.value_and_grad in it (plain "
                         "jax.grad cannot be cut into layers)")
    effects = {i for i, e in enumerate(eqns) if e.effects}
    live = jax_compat.ancestors(eqns, [*jaxpr.outvars, *(v for i in effects for v in jax_compat.eqn_inputs(eqns[i]))])
    live |= effects
    pieces = _region_pieces(eqns)
    grad_index = next((i for i, e in enumerate(eqns) if is_marker(e, "grad")), len(eqns))
    consumers: dict[Var, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in jax_compat.eqn_inputs(eqn):
            consumers.setdefault(v, []).append(i)
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}

    # Glue before the grad marker: first consumer's piece (walking backwards so chains resolve), else the
    # last producer's piece.
    for i in reversed(range(grad_index)):
        if pieces[i] is None:
            users = [pieces[j] for v in eqns[i].outvars for j in consumers.get(v, ()) if j < grad_index]
            users = [p for p in users if p is not None]
            pieces[i] = min(users, key=_region_order) if users else None
    for i in range(grad_index):
        if pieces[i] is None:
            sources = [pieces[producer[v]] for v in jax_compat.eqn_inputs(eqns[i]) if v in producer]
            sources = [p for p in sources if p is not None]
            pieces[i] = max(sources, key=_region_order) if sources else Piece(0, FORWARD)
    if grad_index < len(eqns):
        pieces[grad_index] = Piece(_last_layer(pieces), APPLY)
        grad_eqn = eqns[grad_index]
        grad_layer = {out: pieces[producer[inp]].layer if inp in producer and pieces[producer[inp]] else 0
                      for inp, out in zip(grad_eqn.invars, grad_eqn.outvars, strict=True)}
        for i in range(grad_index + 1, len(eqns)):
            layers = [grad_layer[v] for v in jax_compat.eqn_inputs(eqns[i]) if v in grad_layer]
            if layers:
                pieces[i] = Piece(max(layers), APPLY)
                for v in eqns[i].outvars:
                    grad_layer.setdefault(v, pieces[i].layer)
        # Apply-grad equations that read no gradient (optimizer state scaled before it meets one, shared
        # scalars such as Adam's step count) join their first consumer's layer, so each layer's optimizer
        # state is read where that layer's update runs.
        for i in reversed(range(grad_index + 1, len(eqns))):
            if pieces[i] is None:
                users = [pieces[j].layer for v in eqns[i].outvars for j in consumers.get(v, ())
                         if pieces[j] is not None]
                pieces[i] = Piece(min(users) if users else 0, APPLY)
    return [p if i in live else None for i, p in enumerate(pieces)]  # dead code runs nowhere


def _region_order(piece: Piece) -> tuple[int, int]:
    """Execution order of regions: forward layers ascending, then backward layers descending."""
    return (0, piece.layer) if piece.phase == FORWARD else (1, -piece.layer)


def _last_layer(pieces: Sequence[Piece | None]) -> int:
    return max(p.layer for p in pieces if p is not None)


def layer_summaries(jaxpr: Jaxpr, pieces: Sequence[Piece | None], param_mask: Sequence[bool]) -> list[LayerSummary]:
    """Per-layer FLOPs, parameters and activation bytes (see :class:`LayerSummary`)."""
    num_layers = _last_layer(pieces) + 1
    flops = np.zeros((num_layers, 3))
    phase_index = {FORWARD: 0, BACKWARD: 1, APPLY: 2}
    for eqn, piece in zip(jaxpr.eqns, pieces, strict=True):
        if piece is not None:
            flops[piece.layer, phase_index[piece.phase]] += eqn_flops(eqn)
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:  # a parameter seen through markers (param, layer boundaries) is still that leaf
        if is_marker(eqn):
            for inp, out in zip(eqn.invars, eqn.outvars, strict=True):
                if isinstance(inp, Var) and inp in invar_index:
                    invar_index[out] = invar_index[inp]
    params: list[list[int]] = [[] for _ in range(num_layers)]
    seen = set()
    activations = np.zeros(num_layers, dtype=np.int64)
    defined = {v: p for e, p in zip(jaxpr.eqns, pieces, strict=True) for v in e.outvars}
    counted = set()
    for eqn, piece in zip(jaxpr.eqns, pieces, strict=True):
        if piece is None or is_marker(eqn, "param"):
            continue
        for v in jax_compat.eqn_inputs(eqn):
            k = invar_index.get(v)
            if k is not None and param_mask[k] and k not in seen and piece.phase == FORWARD:
                seen.add(k)
                params[piece.layer].append(k)
            source = defined.get(v)
            is_param = k is not None and param_mask[k]  # per step, counted with the weights, not per micro-batch
            if (piece.phase == BACKWARD and not is_param and source is not None and source.phase == FORWARD
                    and source.layer == piece.layer and v not in counted):
                counted.add(v)
                activations[piece.layer] += _nbytes(v)
    return [LayerSummary(layer=l, forward_flops=float(flops[l, 0]), backward_flops=float(flops[l, 1]),
                         apply_flops=float(flops[l, 2]), param_inputs=tuple(params[l]),
                         param_bytes=sum(_nbytes(jaxpr.invars[k]) for k in params[l]),
                         activation_bytes=int(activations[l]))
            for l in range(num_layers)]
