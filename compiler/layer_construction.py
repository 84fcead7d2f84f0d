"""Layer construction: re-emit a loss function as layers delimited by forward layer markers.

Alpa 3.5 ("operator clustering"): before differentiation, the forward computation of the loss is cut into
layers ``l_1..l_L``. Each layer's inputs pass through a ``fwd_start`` marker and its outputs through a
``fwd_end`` marker; `jax.grad` transposes those into ``bwd_start``/``bwd_end`` markers, so the backward of
every layer is delimited too and later passes can colocate a layer's forward and backward.

Where the cuts go is a function ``assign(jaxpr) -> layer of each equation`` (non-decreasing along the
equation order): :func:`manual_layers` cuts at ``al.mark_pipeline_boundary()`` calls, and the automatic
option clusters equations by FLOPs and communication (Eq. 3.6, :mod:`alpa_like.compiler.layer_clustering`).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import eqn_flops
from alpa_like.compiler.layer_clustering import DEFAULT_DELTA, cluster_layers, incoming_bytes, least_delta
from alpa_like.compiler.markers import is_marker, mark

LayerAssignment = Callable[[Jaxpr], list[int]]


@dataclasses.dataclass(frozen=True)
class Layering:
    """How :func:`alpa_like.grad` cuts the loss into layers while a pipeline method traces a step."""

    assign: LayerAssignment
    remat: bool = False


_ACTIVE: contextvars.ContextVar[Layering | None] = contextvars.ContextVar("alpa_like_layering", default=None)


@contextlib.contextmanager
def layering(option: Layering) -> Iterator[None]:
    """Within this block, ``al.grad`` applies layer construction with ``option``."""
    token = _ACTIVE.set(option)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layering() -> Layering | None:
    return _ACTIVE.get()


def manual_layers(jaxpr: Jaxpr) -> list[int]:
    """Layer of each equation: the number of pipeline-boundary markers before it.

    Raises:
      ValueError: a boundary is marked inside a call's body (a ``jax.checkpoint`` block, a ``scan``), where
        it cuts nothing.
    """
    inside = sorted({e.primitive.name for e in jaxpr.eqns if _marks_boundary_inside(e)})
    if inside:
        raise ValueError(f"al.mark_pipeline_boundary() is called inside a {'/'.join(inside)} body (jax.checkpoint "
                         "or nn.remat block, scan, cond), where it cuts nothing: mark the boundaries between "
                         "the blocks, outside them (ManualLayerOption(remat_layer=True) checkpoints each layer)")
    layer, out = 0, []
    for eqn in jaxpr.eqns:
        out.append(layer)
        if is_marker(eqn, "boundary"):
            layer += 1
    return out


def _marks_boundary_inside(eqn) -> bool:
    return any(is_marker(inner, "boundary") or _marks_boundary_inside(inner)
               for body in jax_compat.nested_jaxprs(eqn) for inner in body.eqns)


def check_assignment(jaxpr: Jaxpr, layers: Sequence[int]) -> int:
    """Validates a layer assignment; returns the number of layers."""
    if len(layers) != len(jaxpr.eqns):
        raise ValueError(f"layer assignment has {len(layers)} entries for {len(jaxpr.eqns)} equations")
    if any(b < a for a, b in zip(layers, layers[1:])):
        raise ValueError("layer assignment must be non-decreasing along the equation order")
    return (max(layers) + 1) if layers else 0


def _layer_io(jaxpr: Jaxpr, layers: Sequence[int], num_layers: int):
    """For each layer: its input Vars (defined before it) and output Vars (used after it), in order."""
    used_after: dict[Var, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in jax_compat.eqn_inputs(eqn):
            used_after[v] = max(used_after.get(v, -1), layers[i])
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            used_after[v] = num_layers  # the function's outputs: after every layer
    inputs = [jax_compat.free_vars([e for e, a in zip(jaxpr.eqns, layers, strict=True) if a == layer])
              for layer in range(num_layers)]
    outputs = [[] for _ in range(num_layers)]
    for eqn, layer in zip(jaxpr.eqns, layers, strict=True):
        outputs[layer].extend(v for v in eqn.outvars if used_after.get(v, -1) > layer)
    return inputs, outputs


def construct_layers(fun: Callable, assign: LayerAssignment, *, remat: bool = False) -> Callable:
    """``fun`` re-emitted layer by layer with ``fwd_start``/``fwd_end`` markers (and `jax.checkpoint`
    around each layer when ``remat``). Same values, same gradients."""
    def layered(*args, **kwargs):
        if kwargs:
            raise TypeError(f"with a pipeline method, pass the arguments of {getattr(fun, '__name__', fun)} "
                            f"positionally (got keywords {sorted(kwargs)})")
        closed: ClosedJaxpr
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        closed = jax_compat.inline_calls(closed)
        jaxpr = closed.jaxpr
        layers = assign(jaxpr)
        num_layers = check_assignment(jaxpr, layers)
        inputs, outputs = _layer_io(jaxpr, layers, num_layers)
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, jax.tree_util.tree_leaves(args), strict=True))
        for layer in range(num_layers):
            eqns = [e for e, a in zip(jaxpr.eqns, layers, strict=True) if a == layer and not is_marker(e, "boundary")]
            body = _layer_body(eqns, inputs[layer], outputs[layer])
            if remat:
                body = jax.checkpoint(body)
            ins = _mark_inexact([env[v] for v in inputs[layer]], "fwd_start", layer)
            outs = _mark_inexact(body(*ins), "fwd_end", layer)
            env.update(zip(outputs[layer], outs, strict=True))
        flat = [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flat)
    return layered


def _mark_inexact(values: list, kind: str, layer: int) -> list:
    """Layer markers on the floating-point values only: integer values (token ids) have no gradient, and
    marking them would put float0 tangents in the backward pass."""
    floating = [i for i, x in enumerate(values)  # result_type: a Python float argument has no dtype
                if jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact)]
    marked = mark([values[i] for i in floating], kind, layer)
    out = list(values)
    for i, x in zip(floating, marked, strict=True):
        out[i] = x
    return out


def _layer_body(eqns, inputs: Sequence[Var], outputs: Sequence[Var]) -> Callable:
    def body(*values):
        env = dict(zip(inputs, values, strict=True))
        jax_compat.eval_eqns(eqns, env)
        return [env[v] for v in outputs]
    return body


HEAVY_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


def is_heavy(eqn) -> bool:
    """A matmul or convolution, or an equation running one in a nested program (a ``jax.checkpoint`` or
    ``nn.remat`` block, a ``custom_vjp`` function, a ``scan`` over layers): one operator, which layers
    cannot cut inside."""
    return eqn.primitive.name in HEAVY_PRIMITIVES or any(
        is_heavy(e) for jaxpr in jax_compat.nested_jaxprs(eqn) for e in jaxpr.eqns)


def operator_segments(jaxpr: Jaxpr) -> list[int]:
    """Segment of each equation: one segment per heavy operator (:func:`is_heavy`), so the clustering DP sees
    one operator per matmul, convolution or block run as one call. The cheap ops between two heavy ops are
    split between them where the fewest bytes are live
    (defined before the split, read after it), the earliest such point on ties: a residual add after a
    projection joins that projection, so a layer boundary carries the sum, not both addends. Cheap ops
    before the first heavy op join it; trailing cheap ops join the last one."""
    eqns = jaxpr.eqns
    heavy = [i for i, e in enumerate(eqns) if is_heavy(e)]
    if len(heavy) < 2:
        return [0] * len(eqns)
    live = _live_bytes_before(jaxpr)
    out = [0] * len(eqns)
    start = 0
    for segment, (a, b) in enumerate(zip(heavy, heavy[1:])):
        split = min(range(a + 1, b + 1), key=lambda t: (live[t], t))  # eqns a+1..split-1 stay with heavy op a
        out[start:split] = [segment] * (split - start)
        start = split
    out[start:] = [len(heavy) - 1] * (len(eqns) - start)
    return out


# Equations whose gradient needs none of their inputs' values (linear in them, or data movement).
_NO_RESIDUALS = frozenset({"add", "add_any", "sub", "neg", "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
                           "transpose", "convert_element_type", "copy", "copy_p", "reduce_sum", "concatenate",
                           "slice", "pad", "alpa_marker"})


def recompute_savings(jaxpr: Jaxpr, segments: Sequence[int]) -> list[float]:
    """Per segment of :func:`operator_segments`, the forward FLOPs that a rematerialized layer ending with
    that segment does not recompute: its heavy operator's, when every equation after that operator in the
    segment is one whose gradient needs no input values (:data:`_NO_RESIDUALS`); else 0. The backward of a
    layer recomputes only the values its gradients read (JAX's partial evaluation of ``jax.checkpoint``), and
    a matmul's or convolution's gradients read its inputs, not its output: a layer cut right after a
    convolution, or after a projection and its residual add, does not run it twice."""
    num_segments = segments[-1] + 1 if segments else 0
    saving = [0.0] * num_segments
    heavy_seen = [False] * num_segments
    for eqn, seg in zip(jaxpr.eqns, segments, strict=True):
        if eqn.primitive.name in HEAVY_PRIMITIVES and not heavy_seen[seg]:
            heavy_seen[seg] = True
            saving[seg] = eqn_flops(eqn)
        elif heavy_seen[seg] and eqn.primitive.name not in _NO_RESIDUALS:
            saving[seg] = 0.0
    return saving


def _live_bytes_before(jaxpr: Jaxpr) -> np.ndarray:
    """``live[t]``: bytes of the values that equations ``0..t-1`` define and equations ``t..`` (or the
    outputs) read, for ``t = 0..len(eqns)``."""
    n = len(jaxpr.eqns)
    last_use: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in jax_compat.eqn_inputs(eqn):
            last_use[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            last_use[v] = n
    delta = np.zeros(n + 2)
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            if v in last_use and last_use[v] > i:
                nbytes = float(np.prod(v.aval.shape, dtype=np.float64) * jax_compat.numpy_dtype(v.aval.dtype).itemsize)
                delta[i + 1] += nbytes
                delta[last_use[v] + 1] -= nbytes
    return np.cumsum(delta)[:n + 1]


def _loop_hint(jaxpr: Jaxpr) -> str:
    """Why a loss with its layers in a loop or a checkpointed block clusters badly, or "" when it has none."""
    names = {e.primitive.name for e in jaxpr.eqns}
    loops = sorted(names & {"scan", "while", "cond"})
    hints = []
    if loops:
        hints.append(f"its {'/'.join(loops)} loop counts as one operator (layers stacked in a lax.scan or nn.scan "
                     "cannot be split into pipeline layers: unroll them, or use ShardParallel, which shards inside "
                     "the scan)")
    if names & jax_compat.REMAT_PRIMITIVES:
        hints.append("a jax.checkpoint / nn.remat block counts as one operator (checkpoint smaller blocks, such as "
                     "each layer, or drop it and pass remat_layer=True, which checkpoints each pipeline layer)")
    return "".join(f"; {h}" for h in hints)


def auto_layers(layer_num: int, delta: float | None, recompute_aware: bool = False) -> LayerAssignment:
    """The assignment of operator clustering (Eq. 3.6) into ``layer_num`` layers with slack ``delta``
    (None: Alpa's default slack :data:`DEFAULT_DELTA`, or the smallest slack that admits a clustering when
    that one does not, e.g. when one operator, like GPT's logits, is heavier than an average layer. A slack
    much tighter than the default forces cuts inside blocks, where more bytes cross). With
    ``recompute_aware`` (for layers that will be rematerialized) the clustering's tie-break counts what each
    layer recomputes (:func:`recompute_savings`)."""
    def assign(jaxpr: Jaxpr) -> list[int]:
        segments = operator_segments(jaxpr)
        num_segments = segments[-1] + 1 if segments else 0
        if num_segments < layer_num:
            raise ValueError(f"AutoLayerOption(layer_num={layer_num}): the loss has only {num_segments} "
                             f"matmul/convolution operators to cluster; use a smaller layer_num{_loop_hint(jaxpr)}")
        per_eqn = [eqn_flops(eqn) for eqn in jaxpr.eqns]
        flops = [0.0] * num_segments
        for cost, seg in zip(per_eqn, segments, strict=True):
            flops[seg] += cost
        defined = {v: segments[i] for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        edges = []
        for i, eqn in enumerate(jaxpr.eqns):
            for v in jax_compat.eqn_inputs(eqn):
                src = defined.get(v)
                if src is not None and src < segments[i]:
                    nbytes = float(np.prod(v.aval.shape, dtype=np.float64) * jax_compat.numpy_dtype(v.aval.dtype).itemsize)
                    edges.append((src, segments[i], nbytes, id(v)))
        slack = max(DEFAULT_DELTA, least_delta(flops, layer_num)) if delta is None else delta
        saving = recompute_savings(jaxpr, segments) if recompute_aware else None
        try:
            clustering = cluster_layers(flops, incoming_bytes(num_segments, edges), layer_num, slack, saving)
        except ValueError as e:  # the option is AutoLayerOption.eps; pass eps=None for the least that works
            raise ValueError(f"AutoLayerOption(layer_num={layer_num}, eps={delta}): {e} (delta is eps; eps=None "
                             f"takes the least slack that admits a clustering){_loop_hint(jaxpr)}") from None
        layer_of_segment = np.zeros(num_segments, dtype=int)
        for layer, ops in enumerate(clustering.layers):
            layer_of_segment[list(ops)] = layer
        if (message := loop_balance_warning(jaxpr, per_eqn, layer_num)) is not None:
            warnings.warn(message, stacklevel=2)
        return [int(layer_of_segment[s]) for s in segments]
    return assign


def loop_balance_warning(jaxpr: Jaxpr, per_eqn: Sequence[float], layer_num: int) -> str | None:
    """A warning when one loop (layers stacked in a ``lax.scan`` / ``nn.scan``) holds more than 1.5 times an
    even layer's share of the loss's FLOPs (``per_eqn``: each equation's): it is one operator to the
    clustering, so one layer, and the stage that runs it, takes it whole. None otherwise."""
    loops = [(cost, e.primitive.name) for e, cost in zip(jaxpr.eqns, per_eqn, strict=True)
             if e.primitive.name in ("scan", "while")]
    total = sum(per_eqn)
    if layer_num < 2 or not loops or total <= 0:
        return None
    heaviest, name = max(loops)
    if heaviest <= 1.5 * total / layer_num:
        return None
    return (f"AutoLayerOption(layer_num={layer_num}): one {name} loop holds {heaviest / total:.0%} of the loss's "
            "FLOPs and is one operator to the layer clustering, so one layer (and its pipeline stage) runs it whole: "
            "unroll the layers stacked in a lax.scan / nn.scan (a Python loop) to balance the stages")
