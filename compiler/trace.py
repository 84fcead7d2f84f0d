"""Trace a training step into a flat ClosedJaxpr with named input and output leaves.

This is the first pass of the pipeline (ARCHITECTURE.md "trace"): it validates the user's arguments,
names every leaf by its pytree path (``state.params.dense.kernel``, ``batch.x``), traces the step with
`jax.make_jaxpr` (arrays or ShapeDtypeStructs: nothing is allocated or run), inlines nested ``jit`` calls,
drops the equations the outputs do not need (XLA would, so no pass should price them), and finds which
inputs are model parameters from the ``"param"`` markers of :func:`alpa_like.grad`.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.grad_accumulation import AfterGrad, after_grad
from alpa_like.compiler.layer_construction import layering
from alpa_like.compiler.markers import is_marker

_SCALAR_TYPES = (bool, int, float, complex, np.generic)
# Unary ops through which a parameter marker still identifies its input leaf.
_VIEW_PRIMITIVES = frozenset({"convert_element_type", "copy", "copy_p"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafInfo:
    """One array leaf of the step's inputs or outputs."""

    path: str
    """Readable pytree path, rooted at the argument name (``state.params.dense.kernel``) or ``out``."""
    shape: tuple[int, ...]
    dtype: str
    """JAX's name of the dtype (``float32``; ``key<fry>`` for a typed PRNG key)."""
    itemsize: int
    """Bytes per element."""
    arg_index: int
    """Position of the top-level argument (inputs) or output element (outputs; -1 for a single output)."""
    is_batch: bool = False
    """True for leaves of the arguments in ``batch_argnums`` (split along dim 0)."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class TracedStep:
    """The step as plain data: a flat jaxpr over the dynamic argument leaves, and what each leaf is."""

    closed_jaxpr: ClosedJaxpr
    in_leaves: tuple[LeafInfo, ...]
    out_leaves: tuple[LeafInfo, ...]
    in_tree: Any
    """PyTreeDef of the tuple of dynamic (non-static) arguments."""
    out_tree: Any
    dynamic_argnums: tuple[int, ...]
    param_mask: tuple[bool, ...]
    """Per input leaf: True when an ``al.grad`` call differentiates with respect to it."""
    after_grad: AfterGrad | None = None
    """With micro-batches, the outputs computed after al.grad from the full batch (per-example aux, the
    batch's labels), traced for the full batch; None when there are none."""

    def flatten_args(self, args: Sequence[Any]) -> list[Any]:
        """The leaves of the dynamic arguments of a call, in ``in_leaves`` order.

        Raises:
          ValueError: the pytree structure is not the one this step was traced with, a leaf's shape or
            dtype differs from the traced one (the message names the leaf and both), or a leaf is a deleted
            array (donated to an earlier call).
          TypeError: a leaf is a ``jax.ShapeDtypeStruct`` (a step runs on arrays).
        """
        if len(args) <= max(self.dynamic_argnums, default=-1):
            raise ValueError(f"the executable takes {max(self.dynamic_argnums) + 1} positional arguments, "
                             f"got {len(args)}")
        flat, tree = jax.tree_util.tree_flatten(tuple(args[i] for i in self.dynamic_argnums))
        if tree != self.in_tree:
            raise ValueError(f"arguments have pytree structure {tree}, but this executable was compiled for "
                             f"{self.in_tree}")
        for leaf, info in zip(flat, self.in_leaves, strict=True):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise TypeError(f"argument leaf {info.path} is a jax.ShapeDtypeStruct: running a step needs arrays "
                                "(shapes are enough to plan and compile it: al.plan, get_executable)")
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise ValueError(f"step input {info.path} is a deleted array (donated to or deleted by an earlier "
                                 "call?): pass a live array")
            if _differs(leaf, info):
                raise ValueError(
                    f"argument leaf {info.path} has shape {tuple(np.shape(leaf))} and dtype "
                    f"{getattr(leaf, 'dtype', type(leaf).__name__)}, but this executable was compiled for "
                    f"shape {info.shape} and dtype {info.dtype}; call the parallelized function itself "
                    "(it compiles once per input signature) or get an executable for these shapes")
        return flat


def updated_inputs(in_leaves: Sequence[LeafInfo], out_leaves: Sequence[LeafInfo]) -> list[int | None]:
    """Per output leaf, the input leaf it is the new value of, or None (a metric, a loss, an aux).

    An output updates an input when their paths agree below the root (``out.0.params.w`` and
    ``state.params.w``; ``out.params.w`` for a step returning only the state) and so do their shapes and
    dtypes.

    >>> leaf = lambda path: LeafInfo(path=path, shape=(2,), dtype="float32", itemsize=4, arg_index=0)
    >>> updated_inputs([leaf("state.params.w"), leaf("batch.x")],
    ...                [leaf("out.0.params.w"), leaf("out.1.loss"), leaf("out.params.w")])
    [0, None, 0]
    """
    by_rest = {}
    for k, leaf in enumerate(in_leaves):
        by_rest.setdefault((below_root(leaf.path), leaf.shape, leaf.dtype), k)
    by_path = [next((by_rest[key] for rest in updated_paths(leaf.path)
                     if (key := (rest, leaf.shape, leaf.dtype)) in by_rest), None) for leaf in out_leaves]
    nested = arguments_in_outputs(in_leaves, out_leaves)
    return [k if k is not None else n for k, n in zip(by_path, nested, strict=True)]


def arguments_in_outputs(in_leaves: Sequence[LeafInfo], out_leaves: Sequence[LeafInfo]) -> list[int | None]:
    """Per output leaf, the input leaf it is the new value of when a subtree of the output (the leaves below
    one of its pytree nodes) has the structure of a whole input argument: the same paths below both roots,
    shapes and dtypes; else None. The shallowest such subtree wins. The output itself and its top-level
    tuple elements may match any argument (``return new_state, metrics``); deeper subtrees match only
    arguments of several leaves (``return {"state": new_state, "loss": loss}``), as one scalar's structure
    says nothing about which input it updates.

    >>> leaf = lambda path, arg=0: LeafInfo(path=path, shape=(2,), dtype="float32", itemsize=4, arg_index=arg)
    >>> arguments_in_outputs([leaf("state.w"), leaf("state.v"), leaf("lr", 1)],
    ...                      [leaf(f"out.{p}", -1) for p in ("state.w", "state.v", "loss", "lr")])
    [0, 1, None, None]
    """
    by_arg: dict[int, dict[tuple, int]] = {}
    for k, leaf in enumerate(in_leaves):
        rest = leaf.path.split(".", 1)[1] if "." in leaf.path else ""
        by_arg.setdefault(leaf.arg_index, {})[(rest, leaf.shape, leaf.dtype)] = k
    subtrees: dict[tuple[str, ...], list[tuple[int, tuple]]] = {}
    for j, leaf in enumerate(out_leaves):
        parts = leaf.path.split(".")[1:]
        for depth in range(len(parts) + 1):
            subtrees.setdefault(tuple(parts[:depth]), []).append((j, (".".join(parts[depth:]), leaf.shape,
                                                                      leaf.dtype)))
    top_level = 1 if any(leaf.arg_index >= 0 for leaf in out_leaves) else 0
    match: list[int | None] = [None] * len(out_leaves)
    for prefix in sorted(subtrees, key=len):
        members = subtrees[prefix]
        keys = {key for _, key in members}
        if any(match[j] is not None for j, _ in members) or len(keys) != len(members):
            continue
        table = next((t for t in by_arg.values() if keys == t.keys() and (len(t) > 1 or len(prefix) <= top_level)),
                     None)
        if table is not None:
            for j, key in members:
                match[j] = table[key]
    return match


def _element_index(out: tuple | list, key: Any) -> int:
    """The position in the step's output tuple (a NamedTuple's too) of its element ``key``."""
    return key.idx if hasattr(key, "idx") else type(out)._fields.index(key.name)


def below_root(path: str) -> str:
    """An input leaf's path below its argument's name: ``state.params.w`` -> ``params.w``."""
    return path.split(".", 1)[-1]


def updated_paths(output_path: str) -> list[str]:
    """The input paths below the root (:func:`below_root`) that an output leaf may be the new value of: its
    own path below ``out``, and below ``out`` and a tuple position (``out.0.params.w`` -> ``0.params.w``,
    ``params.w``)."""
    parts = output_path.split(".")[1:]
    return [".".join(parts)] + ([".".join(parts[1:])] if len(parts) > 1 and parts[0].isdigit() else [])


def _differs(leaf: Any, info: LeafInfo) -> bool:
    """Whether an argument leaf's shape or dtype is not the traced ``info``'s. Python scalars are checked by
    shape only (their dtype follows JAX's weak typing)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return info.shape != ()
    return tuple(np.shape(leaf)) != info.shape or str(_canonical_dtype(dtype)) != info.dtype


def _canonical_dtype(dtype: Any) -> Any:
    """The dtype JAX computes a leaf of ``dtype`` in (``int64`` -> ``int32`` without ``jax_enable_x64``),
    as ``jax.jit`` converts a NumPy array or scalar it is given."""
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def key_to_str(key) -> str:
    """One pytree path entry as a readable name."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_to_str(root: str, path: Sequence[Any]) -> str:
    return ".".join([root, *(key_to_str(k) for k in path)])


def argument_names(fn: Callable, num_args: int) -> list[str]:
    """Names of the first ``num_args`` positional parameters of ``fn`` (``args[i]`` where unknown)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i].name if i < len(params) else f"args[{i}]" for i in range(num_args)]


def leaf_aval(leaf: Any, path: str) -> jax.ShapeDtypeStruct:
    """The abstract value of one argument leaf; a clear TypeError for anything that is not an array."""
    if isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)) or isinstance(
            getattr(leaf, "aval", None), jax.ShapeDtypeStruct):  # the last: e.g. a Ray backend RemoteArray
        shape, dtype = leaf.shape, leaf.dtype
    elif isinstance(leaf, _SCALAR_TYPES):
        shape, dtype = (), np.asarray(leaf).dtype
    else:
        dtype = None
    if dtype is not None and not any(jax.dtypes.issubdtype(dtype, kind)
                                     for kind in (jax.dtypes.extended, np.number, np.bool_)):
        raise TypeError(f"argument leaf {path} has dtype {dtype}, which JAX cannot compute with (numbers and "
                        "bools only); pass non-array values through static_argnums or leave them out of the "
                        "step's inputs")
    if dtype is not None:
        return jax.ShapeDtypeStruct(tuple(shape), _canonical_dtype(dtype))
    raise TypeError(
        f"argument leaf {path} must be an array (jax.Array, numpy array, ShapeDtypeStruct or Python "
        f"number), got {type(leaf).__name__} {leaf!r:.60}; pass non-array values through static_argnums "
        "or leave them out of the step's inputs")


def micro_batch_aval(aval: jax.ShapeDtypeStruct, path: str, num_micro_batches: int) -> jax.ShapeDtypeStruct:
    """The aval of one micro-batch of a batch leaf (dim 0 divided by ``num_micro_batches``)."""
    if not aval.shape:
        raise ValueError(f"batch leaf {path} is a scalar; batch_argnums leaves need a batch dim 0 "
                         "(move scalars to another argument)")
    if aval.shape[0] % num_micro_batches:
        raise ValueError(f"batch leaf {path} has {aval.shape[0]} rows in dim 0, which is not divisible by "
                         f"num_micro_batches={num_micro_batches}")
    return jax.ShapeDtypeStruct((aval.shape[0] // num_micro_batches, *aval.shape[1:]), aval.dtype)


def check_batch_rows(leaves: Sequence[LeafInfo]) -> None:
    """Micro-batch ``j`` takes rows ``j, j + m, ...`` of every batch leaf, so they must all have the same
    number of rows (dim 0) for the rows of one example to stay together."""
    rows = {}
    for leaf in leaves:
        if leaf.is_batch and leaf.shape:
            rows.setdefault(leaf.shape[0], leaf.path)
    if len(rows) > 1:
        listed = ", ".join(f"{path} has {n}" for n, path in rows.items())
        raise ValueError(f"batch leaves must share their number of rows (dim 0) to be split into micro-batches: "
                         f"{listed}; move leaves that are not per-example out of batch_argnums")


def flatten_inputs(fn: Callable, args: Sequence[Any], static_argnums: Sequence[int],
                   batch_argnums: Sequence[int]) -> tuple[list[jax.ShapeDtypeStruct], list[LeafInfo], Any]:
    """Flattens the dynamic arguments: their avals, their LeafInfos and the PyTreeDef of their tuple."""
    names = argument_names(fn, len(args))
    dynamic = [i for i in range(len(args)) if i not in static_argnums]
    avals, infos = [], []
    for i in dynamic:
        for key_path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            path = path_to_str(names[i], key_path)
            aval = leaf_aval(leaf, path)
            avals.append(aval)
            infos.append(LeafInfo(path=path, shape=tuple(aval.shape), dtype=str(aval.dtype),
                                  itemsize=jax_compat.numpy_dtype(aval.dtype).itemsize, arg_index=i,
                                  is_batch=i in batch_argnums))
    in_tree = jax.tree_util.tree_structure(tuple(args[i] for i in dynamic))
    return avals, infos, in_tree


def marked_param_inputs(closed: ClosedJaxpr) -> tuple[bool, ...]:
    """Per jaxpr invar: True when it reaches a ``"param"`` marker through view ops only."""
    jaxpr = closed.jaxpr
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    mask = [False] * len(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if not is_marker(eqn, "param"):
            continue
        for var in jax_compat.eqn_inputs(eqn):
            while var in producer and producer[var].primitive.name in _VIEW_PRIMITIVES:
                inputs = jax_compat.eqn_inputs(producer[var])
                if len(inputs) != 1:
                    break
                var = inputs[0]
            if isinstance(var, Var) and var in invar_index:
                mask[invar_index[var]] = True
    return tuple(mask)


def trace_step(fn: Callable, args: Sequence[Any], *, static_argnums: Sequence[int] = (),
               batch_argnums: Sequence[int] = (), num_micro_batches: int = 1) -> TracedStep:
    """Traces ``fn(*args)`` into a :class:`TracedStep`; static arguments are closed over.

    With ``num_micro_batches > 1`` the jaxpr is traced for one micro-batch (batch leaves with
    ``rows / num_micro_batches`` rows), the shape gradient accumulation runs it at; ``in_leaves`` keep the
    full shapes. Outputs that read the full batch after al.grad (metrics from per-example aux and the
    labels) are traced again for the full batch (``after_grad``) and have their full shapes in ``out_leaves``.

    Raises:
      TypeError: an argument leaf is not an array.
      ValueError: an argnum is out of range.
    """
    for name, nums in (("static_argnums", static_argnums), ("batch_argnums", batch_argnums)):
        for i in nums:
            if not 0 <= i < len(args):
                hint = " (a step without a batch argument: batch_argnums=())" if name == "batch_argnums" else ""
                raise ValueError(f"{name} contains {i}, but the step was called with {len(args)} "
                                 f"positional arguments (valid: 0..{len(args) - 1}){hint}")
    overlap = set(static_argnums) & set(batch_argnums)
    if overlap:
        raise ValueError(f"arguments {sorted(overlap)} are both in static_argnums and batch_argnums")
    full_avals, in_leaves, in_tree = flatten_inputs(fn, args, static_argnums, batch_argnums)
    avals = full_avals
    if num_micro_batches > 1:
        check_batch_rows(in_leaves)
        avals = [micro_batch_aval(a, leaf.path, num_micro_batches) if leaf.is_batch else a
                 for a, leaf in zip(avals, in_leaves, strict=True)]
    dynamic_argnums = tuple(i for i in range(len(args)) if i not in static_argnums)

    def flat_fn(*flat):
        dyn = jax.tree_util.tree_unflatten(in_tree, flat)
        full = list(args)
        for i, value in zip(dynamic_argnums, dyn, strict=True):
            full[i] = value
        return fn(*full)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
    # markers stay: a misplaced one (a pipeline boundary outside the loss) is an error the later passes name
    closed = jax_compat.without_dead_code(jax_compat.inline_calls(closed), keep=is_marker)

    def trace_full_batch():
        with layering(None):  # what it is for runs after al.grad; the layers are the micro-batch trace's
            full = jax.make_jaxpr(flat_fn)(*full_avals)
        return jax_compat.without_dead_code(jax_compat.inline_calls(full), keep=is_marker)

    after = (after_grad(closed, [leaf.is_batch for leaf in in_leaves], trace_full_batch)
             if num_micro_batches > 1 else None)
    full_shapes = {} if after is None else dict(zip(after.outputs, after.jaxpr.out_avals, strict=True))
    out_leaves = []
    out_is_tuple = isinstance(out_shape, (tuple, list))
    for k, (key_path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(out_shape)[0]):
        leaf = full_shapes.get(k, leaf)
        out_leaves.append(LeafInfo(path=path_to_str("out", key_path), shape=tuple(leaf.shape),
                                   dtype=str(leaf.dtype), itemsize=jax_compat.numpy_dtype(leaf.dtype).itemsize,
                                   arg_index=(_element_index(out_shape, key_path[0]) if out_is_tuple and key_path
                                              else -1)))
    param_mask = marked_param_inputs(closed)
    differentiated = [leaf.path for leaf, p in zip(in_leaves, param_mask, strict=True) if p and leaf.is_batch]
    if differentiated and num_micro_batches > 1:
        raise ValueError(f"al.grad differentiates the batch leaf {differentiated[0]}: with num_micro_batches > 1 "
                         "each micro-batch's gradient covers its own rows only, and al.grad's results are "
                         "averaged over micro-batches; use num_micro_batches=1 for gradients with respect to "
                         "the batch")
    return TracedStep(closed_jaxpr=closed, in_leaves=tuple(in_leaves), out_leaves=tuple(out_leaves),
                      in_tree=in_tree, out_tree=jax.tree_util.tree_structure(out_shape),
                      dynamic_argnums=dynamic_argnums, param_mask=param_mask, after_grad=after)
