"""How much memory one device needs for a step: the estimate every plan compares with the device's memory.

A pipeline stage's estimate is Alpa's Eq. 3.5 (the stage DP's ``mem_stage + in_flight * mem_act``). A
single-stage (SPMD) step needs, per device,

.. math::

    M = M_\\text{inputs} + M_\\text{grads} + \\frac{A}{N}

``M_inputs``: the step's inputs as laid out (parameters, optimizer state, batch); ``M_grads``: one gradient
per parameter, laid out like it; ``A``: the peak, in program order, of the bytes of activations (values
computed from the batch with the batch's rows in dim 0) alive at once in the traced (micro-batch) step
(:func:`peak_live_bytes`): those the forward keeps for the backward plus the working set around them,
spread over the ``N`` devices as the stage profiler spreads a layer's activations. XLA's own temporaries and the outputs of a step that does not donate its
state are not counted, so this is an estimate from below: a plan over it cannot fit.
"""
from __future__ import annotations

import math
from collections.abc import Container

from jax.extend.core import Jaxpr, Literal, Var

from alpa_like.compiler import jax_compat


def var_bytes(var: Var) -> int:
    aval = var.aval
    return int(math.prod(aval.shape)) * jax_compat.numpy_dtype(aval.dtype).itemsize


def peak_live_bytes(jaxpr: Jaxpr, counted: Container[Var]) -> int:
    """The largest total size of the ``counted`` values that ``jaxpr``'s equations, run in order, hold at
    once: a value is held from the equation that makes it to its last reader (to the end for an output).

    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x: jnp.sin(jnp.sin(x)) + x)(jnp.zeros(256))
    >>> peak_live_bytes(closed.jaxpr, set(closed.jaxpr.invars) | {v for e in closed.jaxpr.eqns for v in e.outvars})
    3072
    """
    eqns = jaxpr.eqns
    end = len(eqns)
    last_use: dict[Var, int] = {}
    for i, eqn in enumerate(eqns):
        for v in jax_compat.eqn_inputs(eqn):
            last_use[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            last_use[v] = end
    freed_after = [0] * (end + 1)
    live = peak = 0
    for v in jaxpr.invars:
        if v in counted and v in last_use:
            live += var_bytes(v)
            freed_after[last_use[v]] += var_bytes(v)
    peak = live
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            if v in counted and v in last_use:
                live += var_bytes(v)
                freed_after[last_use[v]] += var_bytes(v)
        peak = max(peak, live)
        live -= freed_after[i]
    return peak
