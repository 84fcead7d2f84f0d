"""Run a forward-only step (eval, inference) on a pipeline plan's meshes, reading the train state in place.

The step is cut into one piece per mesh (:func:`~alpa_like.compiler.forward_pieces.forward_pieces`); each
piece is jitted for its mesh and the pieces run in mesh order. A state leaf is taken on a mesh that holds it,
in the layout the train step loads it in there, so a state the train step returned moves nowhere; values one
piece makes for a later one move with ``jax.device_put`` (dim 0 split over the mesh where it divides, as the
train pipeline sends activations). The step's outputs come back on the last piece's mesh, replicated, so
that they can be combined.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal
from jax.sharding import NamedSharding, PartitionSpec

from alpa_like.compiler import jax_compat
from alpa_like.compiler.forward_pieces import ForwardPiece, forward_pieces
from alpa_like.compiler.trace import TracedStep
from alpa_like.runtime.mesh import has_layout, named_sharding
from alpa_like.runtime.pipeshard_runtime import activation_spec


class ForwardPipelineExecutable:
    """A forward-only step placed on a pipeline's meshes: call it like the original function."""

    def __init__(self, traced: TracedStep, meshes: Sequence[Any], placements: Sequence[Mapping[int, NamedSharding]],
                 plan=None):
        """``placements``: per flat input leaf, the meshes holding it with its layout there (empty for the
        batch and other inputs, which go where a piece reads them); ``plan``: the train step's plan, whose
        layouts the state is read in (``exe.plan``)."""
        self.traced = traced
        self.plan = plan
        self.meshes = list(meshes)
        jaxpr = traced.closed_jaxpr.jaxpr
        self._placements = {v: dict(p) for v, p in zip(jaxpr.invars, placements, strict=True) if p}
        self.pieces: list[ForwardPiece] = forward_pieces(
            traced.closed_jaxpr, {v: sorted(p) for v, p in self._placements.items()})
        self._constants = dict(zip(jaxpr.constvars, traced.closed_jaxpr.consts, strict=True))
        self._jitted = [jax.jit(_piece_fn(piece)) for piece in self.pieces]
        last = self.pieces[-1].mesh if self.pieces else 0
        self._output_sharding = NamedSharding(self.meshes[last], PartitionSpec())
        self.moved_state_leaves = 0
        """State leaves the last call had to move because they were not in the train step's layout."""

    def __call__(self, *args):
        env = dict(zip(self.traced.closed_jaxpr.jaxpr.invars, self.traced.flatten_args(args), strict=True))
        env.update(self._constants)
        self.moved_state_leaves = 0
        for piece, fn in zip(self.pieces, self._jitted, strict=True):
            outs = fn(*(self._on_mesh(v, env[v], piece.mesh) for v in piece.inputs))
            env.update(zip(piece.outputs, outs, strict=True))
        outputs = [v.val if isinstance(v, Literal) else jax.device_put(env[v], self._output_sharding)
                   for v in self.traced.closed_jaxpr.jaxpr.outvars]
        return jax.tree_util.tree_unflatten(self.traced.out_tree, outputs)

    def _on_mesh(self, var, value, mesh: int):
        """``value`` of ``var`` as piece ``mesh`` takes it: a state leaf in its layout there, another value
        where it already is on that mesh, else moved there."""
        placed = self._placements.get(var, {})
        if mesh in placed:
            target = placed[mesh]
            if not has_layout(value, target):
                self.moved_state_leaves += 1
                return jax.device_put(value, target)
            return value
        devices = set(self.meshes[mesh].devices.flat)
        if isinstance(value, jax.Array) and value.sharding.device_set == devices:
            return value
        if placed:  # a state leaf read where the train step does not load it
            self.moved_state_leaves += 1
        spec = activation_spec(np.shape(value), self.meshes[mesh].devices.shape)
        return jax.device_put(value, named_sharding(self.meshes[mesh], spec))


def _piece_fn(piece: ForwardPiece):
    def run(*args):
        return jax_compat.eval_closed_jaxpr(piece.jaxpr, *args)
    return run
