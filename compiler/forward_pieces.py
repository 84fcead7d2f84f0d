"""Cut a forward-only step (an eval or inference step) into one piece per mesh of a pipeline plan.

An eval step reads the train step's state where the train step's plan keeps it: each leaf on the mesh(es)
of the stage(s) that read it. :func:`forward_pieces` places every equation of the eval step on a mesh and
groups them into one piece per mesh, so that the step runs stage by stage on the same meshes with no
parameter moved: an equation runs on the last mesh among those its inputs call for, where an input made by
another equation calls for its producer's mesh, a state leaf for the first mesh that holds it, and the batch
(available everywhere) for none. Dependencies then never go from a later mesh to an earlier one, so the
equations sorted by mesh (stably) are still in an order that runs, and each mesh's piece runs once, after
the pieces of the meshes before it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax.extend.core import ClosedJaxpr, Literal, Var

from alpa_like.compiler import jax_compat


@dataclasses.dataclass(frozen=True)
class ForwardPiece:
    """The equations of one mesh, as a closed jaxpr over the values it reads."""

    mesh: int
    jaxpr: ClosedJaxpr
    inputs: tuple[Var, ...]
    """Values of the step's jaxpr it reads (its invars' order): inputs, constants, other pieces' outputs."""
    outputs: tuple[Var, ...]
    """Values it makes that later pieces or the step's outputs read."""


def equation_meshes(closed: ClosedJaxpr, held: Mapping[Var, Sequence[int]]) -> list[int]:
    """The mesh of every equation (see the module docstring); ``held``: per step input that lives on
    meshes (a state leaf), the meshes holding it. Equations that read neither go to mesh 0.

    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda w0, w1, x: jnp.tanh(x @ w0) @ w1)(jnp.ones((2, 2)), jnp.ones((2, 2)),
    ...                                                                   jnp.ones((3, 2)))
    >>> w0, w1, x = closed.jaxpr.invars
    >>> equation_meshes(closed, {w0: [0], w1: [1]})
    [0, 0, 1]
    """
    made: dict[Var, int] = {}
    meshes = []
    for eqn in closed.jaxpr.eqns:
        wanted = [made[v] if v in made else min(held[v]) for v in jax_compat.eqn_inputs(eqn)
                  if v in made or held.get(v)]
        mesh = max(wanted, default=0)
        meshes.append(mesh)
        made.update((v, mesh) for v in eqn.outvars)
    return meshes


def forward_pieces(closed: ClosedJaxpr, held: Mapping[Var, Sequence[int]]) -> list[ForwardPiece]:
    """One :class:`ForwardPiece` per mesh that runs equations, in mesh order."""
    jaxpr = closed.jaxpr
    meshes = equation_meshes(closed, held)
    later_reads: dict[int, set[Var]] = {}
    for mesh, eqn in zip(meshes, jaxpr.eqns, strict=True):
        later_reads.setdefault(mesh, set()).update(jax_compat.eqn_inputs(eqn))
    outvars = {v for v in jaxpr.outvars if isinstance(v, Var)}
    pieces = []
    for mesh in sorted(set(meshes)):
        eqns = [e for m, e in zip(meshes, jaxpr.eqns, strict=True) if m == mesh]
        made = {v for e in eqns for v in e.outvars}
        read_after = outvars.union(*(reads for m, reads in later_reads.items() if m > mesh))
        inputs = tuple(jax_compat.free_vars(eqns))
        outputs = tuple(v for e in eqns for v in e.outvars if v in read_after and v in made)
        sub = jax_compat.subjaxpr(eqns, inputs, outputs)
        pieces.append(ForwardPiece(mesh=mesh, jaxpr=ClosedJaxpr(sub, []), inputs=inputs,
                                   outputs=outputs))
    return pieces


def literal_outputs(closed: ClosedJaxpr) -> dict[int, object]:
    """Outputs of the step that are literals, by position: no piece makes them."""
    return {k: v.val for k, v in enumerate(closed.jaxpr.outvars) if isinstance(v, Literal)}
