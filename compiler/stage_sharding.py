"""Each pipeline stage's intra-op plan as the runtime applies it, from its layers' ILP solutions.

The stage DP prices a stage on ``(submesh, logical mesh)`` with the ILP solution of each of its layers
(:mod:`~alpa_like.compiler.stage_profiling`). This module turns those solutions into what the runtime needs
to make XLA follow them inside the stage's pieces (as :class:`~alpa_like.shard_parallel.ShardParallel` does
for a whole step):

* value pins: every value a layer computes gets ``with_sharding_constraint`` to its ILP layout where it is
  produced (:func:`~alpa_like.compiler.auto_sharding.pins`);
* operand pins: each heavy operator (matmul, convolution, gather, scatter) reads its operands in the
  layouts its chosen strategy needs (:func:`~alpa_like.compiler.auto_sharding.operand_pins`);
* the layout in which the stage wants each value it reads from outside its layers (received from another
  mesh, a batch leaf or a parameter loaded onto the mesh): the ILP's input spec of its first reader;
* the layout of each value its layers produce, so that a transfer between meshes is planned between the
  layouts the two stages actually hold.

Layers of the same structure share one solve (the profile's cache); a solution's equation and input indices
are positions in the layer's own jaxpr, which are the same for every layer of that structure, so they map
to each layer's equations by position. Between two layers of one stage the value keeps its producer's layout
and the reader's operand pin reshards it: the resharding the stage DP does not price (its t_intra adds up
the layers' own solutions).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jax.extend.core import Jaxpr, JaxprEqn, Var

from alpa_like.compiler.layer_slicing import Piece
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.stage_profiling import LayerCost, layer_jaxpr

Pin = tuple[JaxprEqn, int, ShardingSpec]
"""(equation, output or operand index, spec)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSharding:
    """The ILP's layouts inside one stage (see the module docstring)."""

    value_pins: tuple[Pin, ...]
    operand_pins: tuple[Pin, ...]
    input_specs: dict[Var, ShardingSpec] = dataclasses.field(repr=False)
    """Values the stage's layers read but do not compute -> the layout the first reader's ILP chose."""
    output_specs: dict[Var, ShardingSpec] = dataclasses.field(repr=False)
    """Values the stage's layers compute -> their pinned layout."""
    unpinned: frozenset[Var] = dataclasses.field(default=frozenset(), repr=False)
    """Values of the stage's pieces that no pin names because they were inside a checkpoint block when the
    ILP solved (set once the blocks are inlined, before a backward is split into ``B`` and ``W``): their
    layouts follow from the pinned ones."""


def stage_shardings(jaxpr: Jaxpr, pieces: Sequence[Piece | None], stage_layers: Sequence[Sequence[int]],
                    layer_cost: Callable[[int, int], LayerCost]) -> tuple[StageSharding, ...]:
    """Per stage, its :class:`StageSharding`.

    Args:
      jaxpr: the sliced step's jaxpr (the one the stage program is built from).
      pieces: its :class:`Piece` per equation.
      stage_layers: the layer ids of each stage.
      layer_cost: ``layer_cost(stage, layer)``: the layer's :class:`LayerCost` on the stage's chosen
        ``(submesh, logical mesh)`` entry.
    """
    out = []
    for q, layers in enumerate(stage_layers):
        value_pins, operand_pins = [], []
        inputs: dict[Var, ShardingSpec] = {}
        outputs: dict[Var, ShardingSpec] = {}
        produced: set[Var] = set()
        for layer in layers:
            closed, _ = layer_jaxpr(jaxpr, pieces, layer)
            cost = layer_cost(q, layer)
            eqns = closed.jaxpr.eqns
            produced.update(v for e in eqns for v in e.outvars)
            for i, k, spec in cost.value_pins:
                value_pins.append((eqns[i], k, spec))
                outputs[eqns[i].outvars[k]] = spec
            operand_pins += [(eqns[i], k, spec) for i, k, spec in cost.operand_pins]
            for var, spec in zip(closed.jaxpr.invars, cost.input_specs, strict=True):
                inputs.setdefault(var, spec)
        external = {v: s for v, s in inputs.items() if v not in produced}
        out.append(StageSharding(value_pins=tuple(value_pins), operand_pins=tuple(operand_pins),
                                 input_specs=external, output_specs=outputs))
    return tuple(out)
