"""Gradients summed across layers are accumulated per layer and added once per step (Alpa's cross-layer
gradient rewrite).

A parameter used by two layers (GPT's tied embedding: the token lookup in the first layer, the logits in the
last) gets its gradient as ``add_any(a, b)`` of the two layers' contributions. Left as traced, that sum runs
in the backward of one layer, so the other layer's contribution (for GPT-6.7B a 51200 x 4096 float32 matrix,
840 MB) crosses from one pipeline stage to another once per micro-batch. Since accumulation is linear,

.. math:: \\frac{1}{B} \\sum_{mb} (a_{mb} + b_{mb}) = \\frac{1}{B} \\sum_{mb} a_{mb} + \\frac{1}{B} \\sum_{mb} b_{mb},

each contribution can be accumulated where it is produced and the sum taken once per step, after the grad
marker (in apply-grad), so only the accumulated contribution moves, once per step. Exact in real arithmetic;
in floating point the summation order differs (as between any two accumulation orders).
"""
from __future__ import annotations

from collections.abc import Sequence

from jax.extend.core import Jaxpr, JaxprEqn, Var

from alpa_like.compiler.layer_slicing import Piece
from alpa_like.compiler.markers import is_marker


def split_cross_layer_grad_sums(jaxpr: Jaxpr, pieces: Sequence[Piece | None]) -> Jaxpr:
    """``jaxpr`` with every grad-marker input of the form ``add_any(a, b)`` whose operands come from
    different layers (per ``pieces``, from :func:`~alpa_like.compiler.layer_slicing.slice_layers`) rewritten:
    the marker accumulates ``a`` and ``b`` separately and ``add_any`` of the two means follows the marker.
    Nested sums (``add_any(add_any(a, b), c)``) are split all the way down. Returns ``jaxpr`` itself when
    nothing qualifies; re-slice the result (its equations changed)."""
    eqns = list(jaxpr.eqns)
    grad_index = next((i for i, e in enumerate(eqns) if is_marker(e, "grad")), None)
    if grad_index is None:
        return jaxpr
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    uses: dict[Var, int] = {}
    for e in eqns:
        for v in e.invars:
            if isinstance(v, Var):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            uses[v] = uses.get(v, 0) + 1

    def layers_of(v) -> set[int] | None:
        """The layers whose compute-grad equations produce the summands of ``v``, or None if ``v`` is not
        such a value."""
        i = producer.get(v) if isinstance(v, Var) else None
        if i is None or i > grad_index or pieces[i] is None:
            return None
        return {pieces[i].layer}

    def split(v) -> tuple[list, list[JaxprEqn]]:
        """The summands ``v`` splits into and the add_any equations that were dropped to split it."""
        i = producer.get(v) if isinstance(v, Var) else None
        if i is None or eqns[i].primitive.name != "add_any" or uses.get(v, 0) != 1 or i > grad_index:
            return [v], []
        operands = eqns[i].invars
        layers = [layers_of(x) for x in operands]
        if any(layer is None for layer in layers) or len(set().union(*layers)) < 2:
            return [v], []
        summands, dropped = [], [eqns[i]]
        for x in operands:
            parts, more = split(x)
            summands += parts
            dropped += more
        return summands, dropped

    marker = eqns[grad_index]
    new_in, new_out, after, dropped = [], [], [], set()
    for inp, out in zip(marker.invars, marker.outvars, strict=True):
        summands, removed = split(inp)
        if not removed:
            new_in.append(inp)
            new_out.append(out)
            continue
        dropped.update(id(e) for e in removed)
        means = [Var(s.aval) for s in summands]
        new_in += summands
        new_out += means
        total = means[0]
        template = removed[0]
        for k, mean in enumerate(means[1:], 1):
            result = out if k == len(means) - 1 else Var(out.aval)
            after.append(template.replace(invars=[total, mean], outvars=[result]))
            total = result
    if not dropped:
        return jaxpr
    rewritten = [e for e in eqns[:grad_index] if id(e) not in dropped]
    rewritten.append(marker.replace(invars=new_in, outvars=new_out))
    rewritten += after + eqns[grad_index + 1:]
    return Jaxpr(constvars=jaxpr.constvars, invars=jaxpr.invars, outvars=jaxpr.outvars, eqns=rewritten,
                 effects=jaxpr.effects, debug_info=jaxpr.debug_info)
