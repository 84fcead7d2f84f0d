"""FLOP counts of jaxpr equations, for the compute term of the cost model.

Matrix products and convolutions count 2 FLOPs per multiply-add; every other primitive counts one FLOP per
output element (a lower bound that keeps elementwise-heavy stages from looking free). Nested jaxprs
(``jit``, ``custom_jvp_call``, ``scan``, ``while``, ``cond``, ``checkpoint``) are counted through their
bodies; a ``scan`` body counts ``length`` times, a ``while`` body once (its trip count is unknown) and a
``cond`` its most expensive branch.

:func:`equation_seconds` turns one equation into time with a roofline: the larger of its FLOPs at the
device's FLOP/s and its memory traffic (operand plus result bytes, :func:`eqn_bytes`) at the device's
memory bandwidth. Element-wise and data-movement equations, which a FLOP count prices at (almost) zero, are
memory-bound on CPUs and GPUs alike. A matrix product or convolution runs on the device's matrix units
at the rate of its operands' precision (:class:`ComputeRates`): a V100's tensor cores take 16-bit operands
(125 TFLOP/s) and its float32 products run at 15.7 TFLOP/s.

Three terms make the roofline match a compiled program on a GPU (fitted to measurements by
``examples/benchmarks/gpu_cost_fit.py``): a large matrix product reaches ``matmul_efficiency`` of the
datasheet rate, every matrix product or convolution adds ``matmul_overhead`` seconds (so the achieved rate
falls for small shapes: ``F / (F / R + overhead)``), and XLA's fusion keeps most intermediates of an
element-wise chain on chip, so a non-matrix equation moves ``fused_traffic`` of its unfused bytes.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from alpa_like.compiler import jax_compat

_FREE = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
                   "alpa_marker", "copy", "copy_p", "iota", "stop_gradient", "transpose", "slice",
                   "dynamic_slice", "concatenate", "pad", "select_n", "optimization_barrier"})


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
    """2 * (output elements) * (kernel spatial size) * (input features per group) / (input dilation).

    An input (lhs) dilation of ``d`` puts ``d - 1`` zeros between the input's elements along a spatial
    dimension, so only ``1 / prod(d)`` of the window's taps meet an input element. That is how the gradient
    of a strided convolution with respect to its input is expressed (a transposed convolution), and a GPU
    library computes it without multiplying by the zeros: the same FLOPs as the forward convolution."""
    rhs_shape = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    rhs_spec = dn.rhs_spec  # (out feature dim, in feature dim, *spatial dims)
    kernel = math.prod(rhs_shape[d] for d in rhs_spec[2:]) * rhs_shape[rhs_spec[1]]
    input_dilation = math.prod(eqn.params.get("lhs_dilation") or (1,))
    return 2.0 * _size(eqn.outvars[0].aval) * kernel / input_dilation


def nested_total(eqn: JaxprEqn, costs: list[float]) -> float:
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
    subs = jax_compat.nested_jaxprs(eqn)
    if subs:
        return nested_total(eqn, [jaxpr_flops(j) for j in subs])
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
    subs = jax_compat.nested_jaxprs(eqn)
    if subs:
        return nested_total(eqn, [jaxpr_bytes(j) for j in subs])
    if name in _NO_TRAFFIC:
        return 0.0
    return float(sum(_nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval")))


def jaxpr_bytes(jaxpr: Jaxpr | ClosedJaxpr) -> float:
    """Total bytes read and written by the equations of a jaxpr (see :func:`eqn_bytes`)."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return sum(eqn_bytes(e) for e in jaxpr.eqns)


@dataclasses.dataclass(frozen=True)
class ComputeRates:
    """How fast one device computes: the rates :func:`equation_seconds` prices an equation with."""

    peak_flops: float
    """FLOP/s of the device's matrix units at the training precision (16-bit tensor cores on GPUs); every
    FLOP that is not a float32 matrix product runs at it."""
    memory_bandwidth: float | None = None
    """Bytes/s of the device's memory with every device busy, or None: no memory term (FLOPs only)."""
    fp32_peak_flops: float | None = None
    """FLOP/s of a matrix product or convolution with a float32 (or wider) operand, or None: ``peak_flops``.
    XLA's default precision runs such a product in float32 on a V100 (no tensor cores) and in TF32 on an
    A100 or H100 (JAX's "Matmul precision" page)."""
    matmul_efficiency: float = 1.0
    """Fraction in (0, 1] of the peak rate (``peak_flops`` or ``fp32_peak_flops``) a large matrix product or
    convolution reaches."""
    matmul_overhead: float = 0.0
    """Seconds >= 0 every matrix product or convolution adds to its roofline time (its kernel's start and
    tail): what makes small products run below ``matmul_efficiency`` of the peak."""
    fused_traffic: float = 1.0
    """Fraction in (0, 1] of a non-matrix equation's operand and result bytes that reaches device memory in
    the compiled program (XLA fuses element-wise chains and keeps their intermediates on chip)."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth", "fp32_peak_flops"):
            value = getattr(self, name)
            if (value is not None or name == "peak_flops") and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"ComputeRates.{name} must be a number > 0"
                                 + ("" if name == "peak_flops" else " or None") + f", got {value!r}")
        for name in ("matmul_efficiency", "fused_traffic"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"ComputeRates.{name} must be a number in (0, 1], got {value!r}")
        if not (isinstance(self.matmul_overhead, (int, float)) and self.matmul_overhead >= 0):
            raise ValueError(f"ComputeRates.matmul_overhead must be a number >= 0, got {self.matmul_overhead!r}")

    def flop_rate(self, eqn: JaxprEqn) -> float:
        """FLOP/s for ``eqn``: for a ``dot_general`` or ``conv_general_dilated``, :attr:`matmul_efficiency`
        times :attr:`fp32_peak_flops` when an operand has 32 or more bits (and it is set), else times
        :attr:`peak_flops`; :attr:`peak_flops` for every other equation."""
        if eqn.primitive.name not in MATRIX_PRIMITIVES:
            return self.peak_flops
        if self.fp32_peak_flops is not None and any(_is_wide_float(v.aval) for v in eqn.invars[:2]):
            return self.fp32_peak_flops * self.matmul_efficiency
        return self.peak_flops * self.matmul_efficiency


MATRIX_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
"""The matrix products: the primitives priced at the matmul rate (``matmul_efficiency``, ``matmul_overhead``)."""


def _is_wide_float(aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    return dtype.kind == "f" and dtype.itemsize >= 4


def equation_seconds(eqn: JaxprEqn, rates: ComputeRates, num_devices: float = 1.0) -> float:
    """Roofline time of one equation whose work is split evenly over ``num_devices`` devices.

    A matrix product or convolution costs ``max(flops / (n * flop rate), bytes / (n * memory_bandwidth))
    + matmul_overhead`` (every device runs its own kernel); any other equation ``max(flops / (n *
    peak_flops), fused_traffic * bytes / (n * memory_bandwidth))``. Without ``rates.memory_bandwidth`` the
    memory terms drop out. The FLOP rate is :meth:`ComputeRates.flop_rate`. A nested jaxpr (scan, jit,
    remat, cond) is priced equation by equation inside, so a body's memory-bound and compute-bound parts do
    not hide each other.

    Args:
      eqn: a jaxpr equation.
      rates: the device's rates (``ClusterSpec.compute_rates``).
      num_devices: devices sharing the work, > 0.
    """
    if num_devices <= 0:
        raise ValueError(f"equation_seconds: num_devices must be > 0, got {num_devices!r}")
    subs = jax_compat.nested_jaxprs(eqn)
    if subs:
        return nested_total(eqn, [jaxpr_seconds(j, rates, num_devices) for j in subs])
    matrix = eqn.primitive.name in MATRIX_PRIMITIVES
    seconds = eqn_flops(eqn) / (num_devices * rates.flop_rate(eqn))
    if rates.memory_bandwidth is not None:
        traffic = eqn_bytes(eqn) * (1.0 if matrix else rates.fused_traffic)
        seconds = max(seconds, traffic / (num_devices * rates.memory_bandwidth))
    return seconds + rates.matmul_overhead if matrix else seconds


def jaxpr_seconds(jaxpr: Jaxpr | ClosedJaxpr, rates: ComputeRates, num_devices: float = 1.0) -> float:
    """Sum of :func:`equation_seconds` over a jaxpr's equations (XLA runs them one after another)."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return sum(equation_seconds(e, rates, num_devices) for e in jaxpr.eqns)
