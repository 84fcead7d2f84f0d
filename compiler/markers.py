"""Marker primitives: identity ops that tag values in a traced step for the compiler.

`marker_p` is one identity primitive with a ``kind`` and a ``layer`` parameter:

* ``"param"``: the leaves that :func:`alpa_like.grad` differentiates with respect to. The compiler walks
  back from these markers to the step's inputs to learn which inputs are model parameters (ZeRO methods
  shard the others as optimizer state).
* ``"grad"``: the values :func:`alpa_like.grad` returns (gradients, and the value and aux of
  ``value_and_grad``). Everything before this marker is compute-grad (run once per micro-batch), everything
  after it is apply-grad (Alpa dissertation 3.5, "the grad marker"). Its ``names`` parameter holds the
  values' names as the user unpacks them (``value``, ``aux['logits']``, ``grads['w']``) for error messages.
* ``"boundary"``: :func:`mark_pipeline_boundary`, a zero-operand marker between manual layers.
* ``"fwd_start"`` / ``"fwd_end"``: the inputs and outputs of forward layer ``layer`` (layer construction).
  They are linear: their JVP marks the tangents too, and transposing gives the mirrored backward markers,
  ``fwd_end -> bwd_start`` and ``fwd_start -> bwd_end``, so the backward of layer ``i`` is delimited in the
  gradient jaxpr as well (Alpa 3.5, "forward and backward of a layer colocated").

Every marker is the identity for evaluation, lowering and batching. ``param``/``grad``/``boundary``
markers pass tangents through unmarked, so differentiating through them gives exactly the gradient of the
unmarked function.
"""
from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

PASS_THROUGH_KINDS = ("param", "grad", "boundary")
LAYER_KINDS = ("fwd_start", "fwd_end", "bwd_start", "bwd_end")
MARKER_KINDS = PASS_THROUGH_KINDS + LAYER_KINDS
_TRANSPOSED = {"fwd_start": "bwd_end", "fwd_end": "bwd_start", "bwd_start": "fwd_end", "bwd_end": "fwd_start"}

marker_p = Primitive("alpa_marker")
marker_p.multiple_results = True


def _params(kind: str, layer: int, names: tuple[str, ...] = ()) -> dict:
    """A marker's parameters; ``names`` only where given (they show in every printed jaxpr)."""
    return {"kind": kind, "layer": layer, **({"names": names} if names else {})}


def _marker_impl(*values, kind, layer, names=()):
    del kind, layer, names  # Unused: the identity.
    return values


def _marker_abstract_eval(*avals, kind, layer, names=()):
    del kind, layer, names  # Unused.
    return avals


def _marker_lowering(ctx, *values, kind, layer, names=()):
    del ctx, kind, layer, names  # Unused: lowers to nothing.
    return values


def _marker_jvp(primals, tangents, *, kind, layer, names=()):
    out = marker_p.bind(*primals, **_params(kind, layer, names))
    if kind in PASS_THROUGH_KINDS:
        return out, [ad.instantiate_zeros(t) for t in tangents]
    return out, marker_p.bind(*[ad.instantiate_zeros(t) for t in tangents], **_params(kind, layer, names))


def _marker_transpose(cotangents, *primals, kind, layer, names=()):
    cts = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cotangents]
    cts = [jax.numpy.zeros(p.aval.shape, p.aval.dtype) if type(ct) is ad.Zero else ct
           for ct, p in zip(cts, primals, strict=True)]
    return marker_p.bind(*cts, **_params(_TRANSPOSED[kind], layer, names))


def _marker_batch(values, dims, *, kind, layer, names=()):
    return marker_p.bind(*values, **_params(kind, layer, names)), dims


marker_p.def_impl(_marker_impl)
marker_p.def_abstract_eval(_marker_abstract_eval)
mlir.register_lowering(marker_p, _marker_lowering)
ad.primitive_jvps[marker_p] = _marker_jvp
ad.primitive_transposes[marker_p] = _marker_transpose
batching.primitive_batchers[marker_p] = _marker_batch


def mark(tree, kind: str, layer: int = -1, names: tuple[str, ...] = ()):
    """Returns ``tree`` unchanged, with every array leaf passed through one ``marker_p`` of ``kind``;
    ``names``: one per leaf, in ``tree_flatten`` order (the user's names of the values), or empty."""
    if kind not in MARKER_KINDS:
        raise ValueError(f"marker kind must be one of {MARKER_KINDS}, got {kind!r}")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if names and len(names) != len(leaves):
        raise ValueError(f"names: {len(names)} given for a tree of {len(leaves)} leaves")
    if not leaves:
        return tree
    marked = marker_p.bind(*leaves, **_params(kind, layer, tuple(names)))
    return jax.tree_util.tree_unflatten(treedef, marked)


def mark_pipeline_boundary() -> None:
    """Ends a pipeline layer here (for ``ManualLayerOption``): call it between layers in the forward pass."""
    marker_p.bind(kind="boundary", layer=-1)


def is_marker(eqn, kind: str | None = None) -> bool:
    """True for a ``marker_p`` equation (of ``kind``, when given)."""
    return eqn.primitive is marker_p and (kind is None or eqn.params["kind"] == kind)
