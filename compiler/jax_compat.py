"""The one place that touches JAX's jaxpr internals (jax 0.10 and 0.11): evaluation and call inlining.

Everything else in the compiler goes through these functions, so a JAX upgrade changes this file only.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, JaxprEqn, Literal, Var

# Primitives whose body is a plain call of an inner ClosedJaxpr in params["jaxpr"] (inputs map 1:1).
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})

EqnHook = Callable[[JaxprEqn, list[Any]], list[Any]]
"""``hook(eqn, values) -> values``: replaces an equation's outputs (or, as an operand hook, its operands)."""


def numpy_dtype(dtype) -> np.dtype:
    """``dtype`` as a NumPy dtype; JAX's extended dtypes (typed PRNG keys, ``key<fry>``), which NumPy cannot
    interpret, become the opaque ``V<itemsize>`` of their storage, so byte counts stay exact."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return np.dtype(f"V{dtype.itemsize}")
    return np.dtype(dtype)


def is_prng_key(dtype) -> bool:
    """True for a typed PRNG key dtype (``jax.random.key``'s ``key<fry>``), which NumPy cannot hold."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_data_and_impl(key) -> tuple[np.ndarray, str]:
    """A typed PRNG key array as NumPy key data and its impl's name, for ``jax.random.wrap_key_data``."""
    return np.asarray(jax.random.key_data(key)), str(jax.random.key_impl(key))


def is_call(eqn: JaxprEqn) -> bool:
    """True when ``eqn`` is a nested ``jit``-like call that can be inlined."""
    return eqn.primitive.name in CALL_PRIMITIVES and isinstance(eqn.params.get("jaxpr"), ClosedJaxpr)


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Applies ``eqn``'s primitive to ``invals`` (keeping its name stack); returns a list of outputs."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def eval_eqns(eqns: Sequence[JaxprEqn], env: dict[Var, Any], *, inline_calls: bool = False,
              hook: EqnHook | None = None, operand_hook: EqnHook | None = None) -> dict[Var, Any]:
    """Evaluates ``eqns`` in order, reading and writing ``env`` (a map from Var to value); returns env.

    With ``inline_calls`` nested ``jit`` calls are evaluated equation by equation (so that tracing this
    evaluation gives a flat jaxpr). ``hook(eqn, outvals)`` may replace the outputs of any top-level eqn,
    ``operand_hook(eqn, invals)`` its operands as that equation alone sees them (``env`` keeps the originals).
    """
    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in eqns:
        invals = [read(v) for v in eqn.invars]
        if operand_hook is not None:
            invals = operand_hook(eqn, invals)
        if inline_calls and is_call(eqn):
            inner = eqn.params["jaxpr"]
            outvals = eval_closed_jaxpr(inner, *invals, inline_calls=True)
        else:
            outvals = bind_eqn(eqn, invals)
        if hook is not None:
            outvals = hook(eqn, outvals)
        for var, val in zip(eqn.outvars, outvals, strict=True):
            env[var] = val
    return env


def eval_closed_jaxpr(closed: ClosedJaxpr, *args, inline_calls: bool = False,
                      hook: EqnHook | None = None, operand_hook: EqnHook | None = None) -> list[Any]:
    """Evaluates ``closed`` on ``args`` with :func:`eval_eqns`; returns the list of outputs."""
    jaxpr = closed.jaxpr
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    eval_eqns(jaxpr.eqns, env, inline_calls=inline_calls, hook=hook, operand_hook=operand_hook)
    return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]


def inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Returns an equivalent ClosedJaxpr with every nested ``jit`` call inlined (by re-tracing)."""
    if not any(is_call(e) for e in closed.jaxpr.eqns):
        return closed
    avals = [v.aval for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *xs: eval_closed_jaxpr(closed, *xs, inline_calls=True))(*avals)


REMAT_PRIMITIVES = frozenset({"checkpoint", "remat", "remat2"})


def inline_remat(jaxpr: Jaxpr, keep: Callable[[JaxprEqn], bool] = lambda eqn: False) -> Jaxpr:
    """``jaxpr`` with every ``jax.checkpoint`` / ``nn.remat`` call (nested ones too, not those in a loop or a
    cond) inlined the way JAX lowers one: an optimization barrier on its operands (unless
    ``prevent_cse=False``), so that XLA does not merge the recomputation with the forward, then its body with
    fresh variables. The call's results keep their
    variables, and every other equation stays the same object (pins made by ``id(eqn)`` still apply).
    Passes that read top-level equations then see the body's (the weight gradients of a checkpointed block's
    backward). Calls that ``keep`` names stay calls."""
    if not any(e.primitive.name in REMAT_PRIMITIVES for e in jaxpr.eqns):
        return jaxpr
    alias: dict[Var, Any] = {}  # a call's result that its body passes through -> what it passes

    def read(v):
        return alias.get(v, v) if isinstance(v, Var) else v

    eqns = []
    for eqn in jaxpr.eqns:
        if alias and any(isinstance(v, Var) and v in alias for v in eqn.invars):
            eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
        body = inlinable_body(eqn) if eqn.primitive.name in REMAT_PRIMITIVES and not keep(eqn) else None
        if body is None or body.consts or body.jaxpr.constvars:
            eqns.append(eqn)
            continue
        operands = list(eqn.invars)
        variables = [k for k, v in enumerate(operands) if isinstance(v, Var)]
        if variables and eqn.params.get("prevent_cse", True):
            fenced = [Var(operands[k].aval) for k in variables]
            eqns.append(eqn.replace(primitive=_optimization_barrier(), params={}, effects=frozenset(),
                                    invars=[operands[k] for k in variables], outvars=fenced))
            for k, v in zip(variables, fenced, strict=True):
                operands[k] = v
        eqns.extend(_body_eqns(inline_remat(body.jaxpr, keep), operands, eqn.outvars, alias))  # nested blocks too
    return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])


def _body_eqns(body: Jaxpr, operands: Sequence[Any], results: Sequence[Var], alias: dict[Var, Any]) -> list:
    """The equations of ``body`` reading ``operands`` for its invars, with fresh variables for its own values
    and ``results`` for its outputs (a body may be shared by several calls); ``alias`` gets the results the
    body passes through from its operands or literals."""
    names: dict[Var, Any] = dict(zip(body.invars, operands, strict=True))
    named_result: dict[Var, Var] = {}
    for out, result in zip(body.outvars, results, strict=True):
        if isinstance(out, Var) and out not in names and out not in named_result and not _is_dropped(result):
            named_result[out] = result
    eqns = []
    for inner in body.eqns:
        outvars = [named_result[v] if v in named_result else Var(v.aval) for v in inner.outvars]
        eqns.append(inner.replace(invars=[names.get(v, v) if isinstance(v, Var) else v for v in inner.invars],
                                  outvars=outvars))
        names.update(zip(inner.outvars, outvars, strict=True))
    for out, result in zip(body.outvars, results, strict=True):
        value = names.get(out, out) if isinstance(out, Var) else out
        if value is not result and not _is_dropped(result):
            alias[result] = value
    return eqns


def _is_dropped(var) -> bool:
    """True for the ``_`` of a result nothing reads (JAX's DropVar)."""
    return type(var).__name__ == "DropVar"


@functools.cache
def _optimization_barrier():
    return jax.make_jaxpr(jax.lax.optimization_barrier)(0.0).jaxpr.eqns[0].primitive


def debug_info(name: str, num_in: int, num_out: int) -> DebugInfo:
    """A DebugInfo for a jaxpr the compiler builds itself."""
    return DebugInfo("alpa_like", name, tuple(f"in{i}" for i in range(num_in)),
                     tuple(f"out{i}" for i in range(num_out)))


def subjaxpr(eqns: Sequence[JaxprEqn], invars: Sequence[Var], outvars: Sequence[Var]) -> Jaxpr:
    """A Jaxpr made of ``eqns`` reading ``invars`` and returning ``outvars`` (no constvars)."""
    return Jaxpr(constvars=[], invars=list(invars), outvars=list(outvars), eqns=list(eqns),
                 effects=frozenset().union(*(e.effects for e in eqns)),
                 debug_info=debug_info("subjaxpr", len(invars), len(outvars)))


def eqn_inputs(eqn: JaxprEqn) -> list[Var]:
    """The Var (non-literal) inputs of ``eqn``."""
    return [v for v in eqn.invars if isinstance(v, Var)]


# Primitives whose body computes exactly the primal outputs from the operands (inputs map 1:1 to the
# body's invars): their bodies can be analysed in place of the call. ``scan``, ``while`` and ``cond`` are
# not among them (their bodies run a data-dependent number of times or conditionally).
INLINABLE_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint",
                                  "remat", "remat2", "closed_call", "core_call", "jit", "pjit"})


def inlinable_body(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The body of a call-like ``eqn`` whose invars map 1:1 to the eqn's operands, or None."""
    if eqn.primitive.name not in INLINABLE_PRIMITIVES:
        return None
    for key in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, ClosedJaxpr):
            inner = body
            break
        if isinstance(body, Jaxpr):
            inner = ClosedJaxpr(body, ())
            break
    else:
        return None
    if len(inner.jaxpr.invars) != len(eqn.invars) or len(inner.jaxpr.outvars) != len(eqn.outvars):
        return None
    return inner


# Primitives whose jaxpr parameter combines two elements (a scatter's update, a reduction's monoid): not a
# nested program, the equation works on whole arrays.
COMBINER_PRIMITIVES = frozenset({"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                                 "scatter-max", "reduce", "reduce_window", "select_and_scatter"})


def nested_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
    """The nested programs an equation runs (a call's body, a loop's body, a cond's branches); none for a
    primitive whose jaxpr only combines elements (:data:`COMBINER_PRIMITIVES`)."""
    if eqn.primitive.name in COMBINER_PRIMITIVES:
        return []
    subs = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                subs.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                subs.append(item)
    return subs


def scan_counts(eqn: JaxprEqn) -> tuple[int, int]:
    """``(consts, carries)`` of a ``scan`` equation, whose operands are its constants, then its carries, then
    the scanned inputs (the body's invars likewise). jax 0.10 gives the two counts as the parameters
    ``num_consts`` and ``num_carry``; jax 0.11 replaced them with ``ft_in``, a flat tree of the three groups."""
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = (len(group) for group in params["ft_in"].unpack())
    return consts, carries


def body_operands(eqn: JaxprEqn) -> list[tuple[Jaxpr, list[Any], list[Any]]]:
    """Each nested program of a call, loop or cond ``eqn``, with what its invars read (per invar: the eqn's
    operand, a Var or Literal) and what its outvars become (per outvar: the eqn's outvar, or None: a while
    loop's condition). Empty for primitives it does not know (a body then stays opaque)."""
    name, operands, outs = eqn.primitive.name, list(eqn.invars), list(eqn.outvars)
    if name == "while":
        nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = operands[nc + nb:]
        return [(eqn.params["body_jaxpr"].jaxpr, operands[nc:], outs),
                (eqn.params["cond_jaxpr"].jaxpr, operands[:nc] + carry, [None])]
    if name == "cond":
        return [(branch.jaxpr, operands[1:], outs) for branch in eqn.params["branches"]]
    if name == "scan":  # operands and outvars in the body's order (consts, carry, xs -> carry, ys)
        return [(eqn.params["jaxpr"].jaxpr, operands, outs)]
    body = inlinable_body(eqn)
    return [] if body is None else [(body.jaxpr, operands, outs)]


def name_stack(eqn: JaxprEqn) -> str:
    """The eqn's source name stack as text, e.g. ``transpose(jvp(GPTModel))/block_0/attn``."""
    return str(eqn.source_info.name_stack)


def bypass_eqns(jaxpr: Jaxpr, drop: Callable[[JaxprEqn], bool]) -> Jaxpr:
    """``jaxpr`` without the identity equations ``drop`` selects: their outputs are replaced by their
    inputs everywhere (position by position)."""
    alias: dict[Var, Any] = {}

    def read(v):
        return alias.get(v, v) if isinstance(v, Var) else v

    eqns = []
    for eqn in jaxpr.eqns:
        if drop(eqn):
            for inp, out in zip(eqn.invars, eqn.outvars, strict=True):
                alias[out] = read(inp)
            continue
        eqns.append(eqn.replace(invars=[read(v) for v in eqn.invars]))
    return Jaxpr(constvars=jaxpr.constvars, invars=jaxpr.invars, outvars=[read(v) for v in jaxpr.outvars],
                 eqns=eqns, effects=jaxpr.effects, debug_info=jaxpr.debug_info)


def is_sharding_constraint(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a ``with_sharding_constraint`` (an identity on values)."""
    return eqn.primitive.name == "sharding_constraint"


def bypass_eqns_deep(jaxpr: Jaxpr, drop: Callable[[JaxprEqn], bool]) -> tuple[Jaxpr, int]:
    """:func:`bypass_eqns` in ``jaxpr`` and in every program nested in it (call, loop and cond bodies; see
    :func:`nested_jaxprs`), and how many equations it dropped; ``jaxpr`` itself when none."""
    dropped = 0

    def rewrite(item):
        nonlocal dropped
        if not isinstance(item, (ClosedJaxpr, Jaxpr)):
            return item
        inner, count = bypass_eqns_deep(item.jaxpr if isinstance(item, ClosedJaxpr) else item, drop)
        dropped += count
        if not count:
            return item
        return ClosedJaxpr(inner, item.consts) if isinstance(item, ClosedJaxpr) else inner

    eqns = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in COMBINER_PRIMITIVES:
            params = {k: type(v)(rewrite(x) for x in v) if type(v) in (tuple, list) else rewrite(v)
                      for k, v in eqn.params.items()}
            if dropped and any(not _same(params[k], v) for k, v in eqn.params.items()):
                eqn = eqn.replace(params=params)
        eqns.append(eqn)
    here = sum(map(drop, eqns))
    if not dropped and not here:
        return jaxpr, 0
    return bypass_eqns(jaxpr.replace(eqns=eqns), drop), dropped + here


def _same(a, b) -> bool:
    """``a is b``, element by element for tuples and lists."""
    if type(a) in (tuple, list) and type(b) in (tuple, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


def ancestors(eqns: Sequence[JaxprEqn], targets: Sequence[Any]) -> set[int]:
    """Indices of ``eqns`` that the ``targets`` (Vars; literals ignored) depend on: the live equations
    when ``targets`` are the outputs."""
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    needed: set[int] = set()
    stack = [v for v in targets if isinstance(v, Var)]
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in needed:
            continue
        needed.add(i)
        stack.extend(eqn_inputs(eqns[i]))
    return needed


def without_dead_code(closed: ClosedJaxpr, keep: Callable[[JaxprEqn], bool] = lambda eqn: False) -> ClosedJaxpr:
    """``closed`` without the equations its outputs do not depend on (a loss the step discards), as XLA drops
    them; equations with effects (callbacks, prints), those ``keep`` names, and what they read are kept."""
    eqns = closed.jaxpr.eqns
    kept_anyway = [e for e in eqns if e.effects or keep(e)]
    live = ancestors(eqns, list(closed.jaxpr.outvars) + [v for e in kept_anyway for v in eqn_inputs(e)])
    kept = [e for i, e in enumerate(eqns) if i in live or e.effects or keep(e)]
    if len(kept) == len(eqns):
        return closed
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=kept))


def free_vars(eqns: Sequence[JaxprEqn]) -> list[Var]:
    """The Vars ``eqns`` read without defining them, in order of first use: the inputs of the group."""
    defined = {v for e in eqns for v in e.outvars}
    inputs: dict[Var, None] = {}
    for eqn in eqns:
        for v in eqn_inputs(eqn):
            if v not in defined:
                inputs.setdefault(v)
    return list(inputs)
