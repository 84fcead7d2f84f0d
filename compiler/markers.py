"""Marker primitives: identity ops that tag values in a traced step for the compiler.

`marker_p` is one identity primitive with a ``kind`` parameter:

* ``"param"``: the leaves that :func:`alpa_like.grad` differentiates with respect to. The compiler walks
  back from these markers to the step's inputs to learn which inputs are model parameters (ZeRO methods
  shard the others as optimizer state).
* ``"grad"``: the values :func:`alpa_like.grad` returns (gradients, and the value and aux of
  ``value_and_grad``). Everything before this marker is compute-grad (run once per micro-batch), everything
  after it is apply-grad (Alpa dissertation 3.5, "the grad marker").

A marker is the identity for evaluation, lowering and batching; its JVP passes tangents through unmarked, so
differentiating through a ``"param"`` marker gives exactly the gradient of the unmarked function.
"""
from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

MARKER_KINDS = ("param", "grad")

marker_p = Primitive("alpa_marker")
marker_p.multiple_results = True


def _marker_impl(*values, kind):
    del kind  # Unused: the identity.
    return values


def _marker_abstract_eval(*avals, kind):
    del kind  # Unused.
    return avals


def _marker_lowering(ctx, *values, kind):
    del ctx, kind  # Unused: lowers to nothing.
    return values


def _marker_jvp(primals, tangents, *, kind):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return marker_p.bind(*primals, kind=kind), tangents


def _marker_batch(values, dims, *, kind):
    return marker_p.bind(*values, kind=kind), dims


marker_p.def_impl(_marker_impl)
marker_p.def_abstract_eval(_marker_abstract_eval)
mlir.register_lowering(marker_p, _marker_lowering)
ad.primitive_jvps[marker_p] = _marker_jvp
batching.primitive_batchers[marker_p] = _marker_batch


def mark(tree, kind: str):
    """Returns ``tree`` unchanged, with every array leaf passed through one ``marker_p`` of ``kind``."""
    if kind not in MARKER_KINDS:
        raise ValueError(f"marker kind must be one of {MARKER_KINDS}, got {kind!r}")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    marked = marker_p.bind(*leaves, kind=kind)
    return jax.tree_util.tree_unflatten(treedef, marked)


def is_marker(eqn, kind: str | None = None) -> bool:
    """True for a ``marker_p`` equation (of ``kind``, when given)."""
    return eqn.primitive is marker_p and (kind is None or eqn.params["kind"] == kind)
