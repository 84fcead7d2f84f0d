"""FLOP counts of jaxpr equations, for the compute term of the cost model.

Matrix products and convolutions count 2 FLOPs per multiply-add; every other primitive counts one FLOP per
output element (a lower bound that keeps elementwise-heavy stages from looking free). Nested jaxprs
(``jit``, ``custom_jvp_call``, ``scan``, ``while``, ``cond``, ``checkpoint``) are counted through their
bodies; a ``scan`` body counts ``length`` times, a ``while`` body once (its trip count is unknown) and a
``cond`` its most expensive branch.

:func:`equation_seconds` turns one equation into time with a roofline: the larger of its FLOPs at the
device's FLOP/s and its memory traffic (operand plus result bytes, :func:`eqn_bytes`) at the device's
memory bandwidth. Element-wise and data-movement equations, which a FLOP count prices at (almost) zero, are
memory-bound on CPUs and GPUs alike.
"""
from __future__ import annotations

import math

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

_FREE = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
                   "alpa_marker", "copy", "copy_p", "iota", "stop_gradient", "transpose", "slice",
                   "dynamic_slice", "concatenate", "pad", "select_n"})


# Equations that only relabel a buffer (no bytes move once XLA has compiled them).
_NO_TRAFFIC = frozenset({"reshape", "squeeze", "expand_dims", "alpa_marker", "stop_gradient", "iota"})


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


def _nested_total(eqn: JaxprEqn, costs: list[float]) -> float:
    """An equation's cost from its nested jaxprs' ``costs``: a ``cond`` its most expensive branch, a ``scan``
    its body ``length`` times, anything else (``jit``, ``while`` once, ``checkpoint``...) their sum."""
    if eqn.primitive.name == "cond":
        return max(costs)
    return (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1) * sum(costs)


def eqn_flops(eqn: JaxprEqn) -> float:
    """FLOPs of one equation (see the module docstring)."""
    name = eqn.primitive.name
    if name == "dot_general":
        return dot_general_flops(eqn)
    if name == "conv_general_dilated":
        return conv_flops(eqn)
    subs = _sub_jaxprs(eqn)
    if subs:
        return _nested_total(eqn, [jaxpr_flops(j) for j in subs])
    if name in _FREE:
        return 0.0
    return float(sum(_size(v.aval) for v in eqn.outvars))


def jaxpr_flops(jaxpr: Jaxpr | ClosedJaxpr) -> float:
    """Total FLOPs of a jaxpr."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return sum(eqn_flops(e) for e in jaxpr.eqns)


def _nbytes(aval) -> int:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (typed PRNG keys): their key data
        itemsize = getattr(dtype, "itemsize", 0) or 0
    return _size(aval) * itemsize


def eqn_bytes(eqn: JaxprEqn) -> float:
    """Bytes one equation reads and writes: its operands' plus its results' sizes (a nested jaxpr counts its
    body's equations, with the same trip-count rules as :func:`eqn_flops`). Relabelling equations
    (reshape, squeeze, markers) move nothing. This is an upper bound on a fused program's traffic (XLA
    fuses element-wise chains and keeps intermediates in cache) and the quantity XLA's own cost analysis
    reports as "bytes accessed" for unfused HLO."""
    name = eqn.primitive.name
    subs = _sub_jaxprs(eqn)
    if subs:
        return _nested_total(eqn, [jaxpr_bytes(j) for j in subs])
    if name in _NO_TRAFFIC:
        return 0.0
    return float(sum(_nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval")))


def jaxpr_bytes(jaxpr: Jaxpr | ClosedJaxpr) -> float:
    """Total bytes read and written by the equations of a jaxpr (see :func:`eqn_bytes`)."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return sum(eqn_bytes(e) for e in jaxpr.eqns)


def equation_seconds(eqn: JaxprEqn, peak_flops: float, memory_bandwidth: float | None,
                     num_devices: float = 1.0) -> float:
    """Roofline time of one equation whose work is split evenly over ``num_devices`` devices:
    ``max(flops / (n * peak_flops), bytes / (n * memory_bandwidth))``, or the FLOP term alone when
    ``memory_bandwidth`` is None (no memory term). A nested jaxpr (scan, jit, remat, cond) is priced
    equation by equation inside, so a body's memory-bound and compute-bound parts do not hide each other.

    Args:
      eqn: a jaxpr equation.
      peak_flops: FLOP/s of one device (``ClusterSpec.peak_flops``), > 0.
      memory_bandwidth: bytes/s of one device's memory with every device busy
        (``ClusterSpec.memory_bandwidth``), > 0, or None.
      num_devices: devices sharing the work, > 0.
    """
    if peak_flops <= 0 or num_devices <= 0 or (memory_bandwidth is not None and memory_bandwidth <= 0):
        raise ValueError(f"equation_seconds: peak_flops, memory_bandwidth and num_devices must be > 0, got "
                         f"{peak_flops!r}, {memory_bandwidth!r}, {num_devices!r}")
    subs = _sub_jaxprs(eqn)
    if subs:
        return _nested_total(eqn, [jaxpr_seconds(j, peak_flops, memory_bandwidth, num_devices) for j in subs])
    compute = eqn_flops(eqn) / (num_devices * peak_flops)
    if memory_bandwidth is None:
        return compute
    return max(compute, eqn_bytes(eqn) / (num_devices * memory_bandwidth))


def jaxpr_seconds(jaxpr: Jaxpr | ClosedJaxpr, peak_flops: float, memory_bandwidth: float | None,
                  num_devices: float = 1.0) -> float:
    """Sum of :func:`equation_seconds` over a jaxpr's equations (XLA runs them one after another)."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return sum(equation_seconds(e, peak_flops, memory_bandwidth, num_devices) for e in jaxpr.eqns)
