"""FLOP counts of jaxpr equations, for the compute term of the cost model.

Matrix products and convolutions count 2 FLOPs per multiply-add; every other primitive counts one FLOP per
output element (a lower bound that keeps elementwise-heavy stages from looking free). Nested jaxprs
(``jit``, ``custom_jvp_call``, ``scan``, ``while``, ``cond``, ``checkpoint``) are counted through their
bodies; a ``scan`` body counts ``length`` times, a ``while`` body once (its trip count is unknown) and a
``cond`` its most expensive branch.
"""
from __future__ import annotations

import math

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

_FREE = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
                   "alpa_marker", "copy", "copy_p", "iota", "stop_gradient", "transpose", "slice",
                   "dynamic_slice", "concatenate", "pad", "select_n"})


def _size(aval) -> int:
    return math.prod(getattr(aval, "shape", ()))


def dot_general_flops(eqn: JaxprEqn) -> float:
    """2 * (output elements) * (contracted size): Alpa's and Megatron's convention."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in lhs_contract)
    return 2.0 * _size(eqn.outvars[0].aval) * contracted


def conv_flops(eqn: JaxprEqn) -> float:
    """2 * (output elements) * (kernel spatial size) * (input features per group)."""
    rhs_shape = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    rhs_spec = dn.rhs_spec  # (out feature dim, in feature dim, *spatial dims)
    kernel = math.prod(rhs_shape[d] for d in rhs_spec[2:]) * rhs_shape[rhs_spec[1]]
    return 2.0 * _size(eqn.outvars[0].aval) * kernel


def _sub_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
    subs = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                subs.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                subs.append(item)
    return subs


def eqn_flops(eqn: JaxprEqn) -> float:
    """FLOPs of one equation (see the module docstring)."""
    name = eqn.primitive.name
    if name == "dot_general":
        return dot_general_flops(eqn)
    if name == "conv_general_dilated":
        return conv_flops(eqn)
    subs = _sub_jaxprs(eqn)
    if subs:
        costs = [jaxpr_flops(j) for j in subs]
        if name == "cond":
            return max(costs)
        scale = eqn.params.get("length", 1) if name == "scan" else 1
        return scale * sum(costs)
    if name in _FREE:
        return 0.0
    return float(sum(_size(v.aval) for v in eqn.outvars))


def jaxpr_flops(jaxpr: Jaxpr | ClosedJaxpr) -> float:
    """Total FLOPs of a jaxpr."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return sum(eqn_flops(e) for e in jaxpr.eqns)
