"""TeraPipe at run time: pipeline (micro-batch, token slice) units through the stages of a plan.

TeraPipe (seed 000, dissertation ch. 2, Fig. 2.1) cuts the sequence of a causal language model into slices
``l_1..l_n`` and pipelines the slices, not only micro-batches. Semantics (issue 7):

* a stage's forward on slice ``i`` attends to the keys and values that the same stage computed for slices
  ``< i`` of the same sequence; they stay on that stage's mesh;
* the backward runs the slices in reverse; the gradient of slice ``j``'s keys and values is the sum of what
  every later slice's backward sent back to it plus what its own attention needs, and flows back into the
  stage's forward of slice ``j``;
* gradients equal those of the unsliced step.

**Model contract** (checked; :class:`TerapipeContractError` names what is missing):

1. the step calls ``al.grad`` or ``al.value_and_grad`` once (no ``has_aux``), on step inputs directly
   (``state.params``, ``batch``): that call's function is the *loss*;
2. every batch leaf the loss reads is ``[batch, seq, ...]`` with the same ``seq``: the runtime slices dim 1;
3. cross-token computation goes through :func:`alpa_like.nn.causal_self_attention` (found by its traced
   key/value hook), and positions come from the inputs (e.g. ``batch["position_ids"]``, which are sliced
   like the tokens), not from ``arange(seq)`` inside the model;
4. the loss is a mean over all ``batch x seq`` tokens, so a slice of ``l`` tokens of a micro-batch
   contributes its own loss with weight ``l / (seq * num_micro_batches)``.

On the first step the weighted slice losses of one batch slice (the smallest that is cut) are compared with
the loss of its whole sequences, run forward only through the same stages on their meshes: a model that
breaks 3 or 4 (say, positions from ``arange``) fails there with a clear error instead of training on a wrong
gradient.

How it runs. The step runs the scheme the plan prints, ``[(rows, [l_1, ...]), ...]``: batch slices of
possibly different sizes (section 2.3.4), each with its own token slicing. The loss is traced once per
slice *shape* ``(rows, context, length)`` with the slice's batch shapes and, as extra inputs, the keys and
values of the ``context`` earlier tokens of every attention call (:func:`alpa_like.nn.token_slice_context`);
slices of the same shape (say equal batch slices with equal token slicings) share the traced program and
its executables. The equations of each trace are assigned to the plan's stages by the layer assignment of
the full-length trace. Each (shape, stage) forward is a jitted ``jax.vjp`` on the stage's mesh that keeps
its residuals there; the backward applies it to the output cotangents. A slice's cached prefix is the
previous slice's prefix extended by that slice's own keys and values (on the stage's mesh), and in the
backward the prefix's cotangent is split back the same way. Forwards are issued unit by unit in sequence
order, backwards in reverse (Fig. 2.1): the order is the schedule :func:`alpa_like.compiler.schedule_tables.terapipe`
builds for the scheme (plain data, ``TerapipeExecutable.schedule``), issued tick by tick (JAX's asynchronous
dispatch lets the meshes overlap).

Layouts (the plan's intra-op shardings): parameters and other step inputs are placed on each stage's
mesh with the ILP's spec of that leaf for the stage (``StagePlan.inputs``), batch slices and values sent
between stages with their batch dim split over the mesh where it divides (as the pipeshard runtime's
``activation_spec``); XLA propagates these layouts through each stage executable.

Update: everything after ``al.grad`` is the step's apply-grad pieces of
:func:`alpa_like.compiler.stage_construction.build_stage_program`, each run on the mesh of the stage owning
its layers' parameters, fed with the summed gradients and loss (so no parameter crosses meshes).

Limits: by default slices with equal lengths but different contexts are different shapes, so they do not
share executables; ``share_slice_executables=True`` shares them by left-padding the cached prefix to the
longest context and masking the padding, which costs attention over the padding (tokens TeraPipe exists to
skip); the planner prices it (:func:`alpa_like.compiler.token_slicing.slice_contexts`) in the plan's estimate
and its keep-or-drop decision, but its DP optimises the unpadded cost.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var
from jax.sharding import NamedSharding

from alpa_like.compiler import jax_compat
from alpa_like.compiler.layer_slicing import APPLY
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.stage_construction import StageProgram
from alpa_like.compiler.token_slicing import BatchSlices, check_batch_slices, format_scheme, slice_contexts
from alpa_like.compiler.tracing_hooks import TokenSliceContext, grad_hook, token_slice_context
from alpa_like.runtime.mesh import make_mesh, named_sharding
from alpa_like.runtime.pipeshard_runtime import MESH_AXES, activation_spec
from alpa_like.compiler.schedule_tables import terapipe
from alpa_like.compiler.schedules import Phase, Schedule, Task

__all__ = ["TerapipeContractError", "LossCall", "find_loss_call", "TerapipeExecutable", "slice_starts"]


class TerapipeContractError(ValueError):
    """The step or its model does not follow the TeraPipe contract (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class LossCall:
    """The step's one ``al.grad`` / ``al.value_and_grad`` call, found by tracing the step."""

    loss_fn: Callable
    with_value: bool
    arg_tree: Any
    """Tree structure of the loss's positional arguments."""
    sources: tuple[int, ...]
    """Per loss-argument leaf: its index among the step's flat inputs."""
    differentiated: tuple[bool, ...]
    """Per loss-argument leaf: whether it is in ``argnums``."""
    grad_order: tuple[int, ...]
    """Loss-argument leaves in the order of the gradient pytree's leaves."""
    grad_tree: Any


def _flat_step(fun: Callable, args: Sequence[Any], traced) -> Callable:
    def call(flat):
        dynamic = jax.tree_util.tree_unflatten(traced.in_tree, flat)
        full = list(args)
        for i, value in zip(traced.dynamic_argnums, dynamic, strict=True):
            full[i] = value
        return fun(*full)
    return call


def find_loss_call(fun: Callable, args: Sequence[Any], traced) -> LossCall:
    """Traces ``fun`` once to find its ``al.grad`` call (contract point 1)."""
    calls: list[LossCall] = []
    step = _flat_step(fun, args, traced)

    def probe(*flat):
        index = {id(x): k for k, x in enumerate(flat)}

        def hook(loss_fn, loss_args, kwargs, *, argnums, has_aux, with_value, jax_kwargs):
            if kwargs or jax_kwargs or has_aux:
                raise TerapipeContractError(
                    "pipeline_schedule='terapipe' needs al.grad/al.value_and_grad(loss)(*args) with positional "
                    f"arguments, no has_aux and no extra options; got keywords {sorted(kwargs)}, "
                    f"has_aux={has_aux}, options {sorted(jax_kwargs)}")
            leaves, tree = jax.tree_util.tree_flatten(tuple(loss_args))
            sources = [index.get(id(x)) for x in leaves]
            if any(s is None for s in sources):
                raise TerapipeContractError(
                    "pipeline_schedule='terapipe' needs the loss (the function given to al.grad) to be called on "
                    "step inputs directly (e.g. state.params and batch), not on values computed inside the step")
            nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
            nums = tuple(n % len(loss_args) for n in nums)
            counts = [len(jax.tree_util.tree_leaves(a)) for a in loss_args]
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
            differentiated = [False] * len(leaves)
            grad_order = []
            for n in nums:
                for k in range(offsets[n], offsets[n + 1]):
                    differentiated[k] = True
                    grad_order.append(k)
            grads_like = loss_args[nums[0]] if isinstance(argnums, int) else tuple(loss_args[n] for n in nums)
            calls.append(LossCall(loss_fn=loss_fn, with_value=with_value, arg_tree=tree,
                                  sources=tuple(sources), differentiated=tuple(differentiated),
                                  grad_order=tuple(grad_order), grad_tree=jax.tree_util.tree_structure(grads_like)))
            real = (jax.value_and_grad if with_value else jax.grad)(loss_fn, argnums=argnums)
            return real(*loss_args)

        with grad_hook(hook):
            return step(list(flat))

    jax.make_jaxpr(probe)(*[jax.ShapeDtypeStruct(l.shape, v.aval.dtype)  # the jaxpr's: a typed key's is no string
                            for l, v in zip(traced.in_leaves, traced.closed_jaxpr.jaxpr.invars, strict=True)])
    if len(calls) != 1:
        raise TerapipeContractError(f"pipeline_schedule='terapipe' needs the step to call al.grad or "
                                    f"al.value_and_grad exactly once; it calls them {len(calls)} times")
    return calls[0]


def slice_starts(lengths: Sequence[int]) -> tuple[int, ...]:
    """Context length of every slice: ``(0, l_1, l_1 + l_2, ...)``."""
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(lengths)[:-1]]))


@dataclasses.dataclass(frozen=True)
class _StagePart:
    eqns: tuple
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]


@dataclasses.dataclass(frozen=True)
class _SliceProgram:
    """The loss of one token slice shape ``(rows, context, length)``, cut into the plan's stages."""

    closed: ClosedJaxpr
    leaf_vars: tuple[Var, ...]
    """jaxpr invar of each loss-argument leaf."""
    prefix_vars: dict[Var, tuple[int, int]]
    """invar -> (attention call, 0 = keys / 1 = values) of the cached prefix (``context`` tokens)."""
    loss_var: Var
    kv_vars: tuple[tuple[Var, Var], ...]
    """Per attention call, this slice's (keys, values)."""
    parts: tuple[_StagePart, ...]
    producer: dict[Var, int]
    """Stage that computes each var that crosses stages or leaves the slice."""
    valid_var: Var | None = None
    """With shared contexts: the invar holding how many of the padded prefix's tokens are real."""


def _trace_slice(call: LossCall, leaf_avals, batch_leaf: Sequence[bool], length: int, context: int, kv_avals,
                 weight: float, padded: bool = False):
    """Traces the weighted loss of one slice of ``length`` tokens after ``context`` cached tokens (one
    ``(keys, values)`` prefix per attention call); returns the closed jaxpr."""
    def sliced(aval, is_batch):
        if not is_batch:
            return aval
        return jax.ShapeDtypeStruct((aval.shape[0], length, *aval.shape[2:]), aval.dtype)

    leaves = [sliced(a, b) for a, b in zip(leaf_avals, batch_leaf, strict=True)]
    rows = next(a.shape[0] for a, b in zip(leaf_avals, batch_leaf, strict=True) if b)
    prefixes = [[(jax.ShapeDtypeStruct((rows, context, *k.shape[2:]), k.dtype),
                  jax.ShapeDtypeStruct((rows, context, *v.shape[2:]), v.dtype))] for k, v in kv_avals]

    def loss(leaf_values, prefix_values, valid):
        slice_context = TokenSliceContext(prefixes=prefix_values, prefix_valid=valid)
        with token_slice_context(slice_context):
            value = call.loss_fn(*jax.tree_util.tree_unflatten(call.arg_tree, leaf_values))
        if len(slice_context.produced) != len(kv_avals):
            raise TerapipeContractError(f"the loss calls causal_self_attention {len(slice_context.produced)} times "
                                        f"on a slice but {len(kv_avals)} times on the whole sequence")
        return [jnp.asarray(value) * weight] + [x for kv in slice_context.produced for x in kv]

    valid = jax.ShapeDtypeStruct((), jnp.int32) if padded else None
    return jax_compat.inline_calls(jax.make_jaxpr(loss)(leaves, prefixes, valid))


def _attention_kv_avals(call: LossCall, leaf_avals):
    """Per attention call of the loss, the avals of its keys and values (contract point 3)."""
    found = []

    def loss(leaf_values):
        context = TokenSliceContext(prefixes=None)
        with token_slice_context(context):
            value = call.loss_fn(*jax.tree_util.tree_unflatten(call.arg_tree, leaf_values))
        found.extend((jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
                     for k, v in context.produced)
        return value

    jax.make_jaxpr(loss)(list(leaf_avals))
    if not found:
        raise TerapipeContractError(
            "pipeline_schedule='terapipe' needs causal attention through alpa_like.nn.causal_self_attention "
            "(the only cross-token operation token slicing can cut); the loss never calls it")
    return found


def _split_stages(closed: ClosedJaxpr, eqn_stage: Sequence[int], num_stages: int):
    jaxpr = closed.jaxpr
    last_reader: dict[Var, int] = {}
    for eqn, q in zip(jaxpr.eqns, eqn_stage, strict=True):
        for v in jax_compat.eqn_inputs(eqn):
            last_reader[v] = max(last_reader.get(v, -1), q)
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            last_reader[v] = num_stages
    parts, producer = [], {}
    for q in range(num_stages):
        eqns = [e for e, s in zip(jaxpr.eqns, eqn_stage, strict=True) if s == q]
        outputs = [v for e in eqns for v in e.outvars if last_reader.get(v, -1) > q]
        producer.update({v: q for v in outputs})
        parts.append(_StagePart(eqns=tuple(eqns), inputs=tuple(jax_compat.free_vars(eqns)), outputs=tuple(outputs)))
    return tuple(parts), producer


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _part_body(part: _StagePart):
    """The stage part's equations as a function of its inputs, returning its outputs."""
    def body(*values):
        env = dict(zip(part.inputs, values, strict=True))
        jax_compat.eval_eqns(part.eqns, env)
        return [env[v] for v in part.outputs]
    return body


def _stage_functions(part: _StagePart):
    """Jitted forward (outputs and the vjp closure, residuals kept where computed) and backward."""
    diff = [_inexact(v.aval) for v in part.inputs]
    out_avals = [v.aval for v in part.outputs]
    body = _part_body(part)

    def forward(*values):
        def f(*differentiable):
            it = iter(differentiable)
            return body(*[next(it) if d else x for x, d in zip(values, diff, strict=True)])
        return jax.vjp(f, *[x for x, d in zip(values, diff, strict=True) if d])

    def backward(vjp, cotangents):
        full = []
        for c, aval in zip(cotangents, out_avals, strict=True):
            if c is not None:
                full.append(c)
            elif _inexact(aval):
                full.append(jnp.zeros(aval.shape, aval.dtype))
            else:
                full.append(np.zeros(aval.shape, jax.dtypes.float0))
        return vjp(full)

    return jax.jit(forward), jax.jit(backward), [v for v, d in zip(part.inputs, diff, strict=True) if d]


@jax.jit
def _append_tokens(prefix, new):
    return jnp.concatenate([prefix, new], axis=1)


@functools.partial(jax.jit, static_argnums=1)
def _left_pad(prefix, tokens: int):
    return jnp.pad(prefix, [(0, 0), (tokens, 0)] + [(0, 0)] * (prefix.ndim - 2))


@functools.partial(jax.jit, static_argnums=1)
def _drop_padding(cotangent, tokens: int):
    return cotangent[:, tokens:]


@functools.partial(jax.jit, static_argnums=2)
def _split_prefix_cotangent(cotangent, carried, at: int):
    """The cotangent of a prefix ``concat(earlier prefix, keys or values of the previous slice)``, plus what
    later slices carried back to it, split at ``at`` tokens into (earlier prefix's, previous slice's)."""
    total = cotangent if carried is None else cotangent + carried
    return total[:, :at], total[:, at:]


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One (batch slice, token slice) of the step."""

    batch_slice: int
    index: int
    """Token slice within the batch slice."""
    key: tuple[int, int, int]
    """(rows, context, length): the shape of its program (units of equal key share executables)."""
    row_start: int
    token_start: int


class TerapipeExecutable:
    """A compiled TeraPipe step: call it like the original function."""

    def __init__(self, *, fun: Callable, args: Sequence[Any], traced, plan, program: StageProgram,
                 layer_assign: Callable, devices: Sequence[Any], batch_slices, input_specs: dict[tuple[int, str], ShardingSpec],
                 check_contract: bool = True, share_contexts: bool = False):
        if traced.after_grad is not None:
            outputs = ", ".join(traced.out_leaves[k].path for k in traced.after_grad.outputs)
            raise ValueError(f"pipeline_schedule='terapipe' reads only the loss, the gradients and the step's inputs "
                             f"after al.grad, so it cannot compute the outputs that read the batch there ({outputs}); "
                             "use another pipeline_schedule for them")
        self.traced = traced
        self.plan = plan
        self.call = find_loss_call(fun, args, traced)
        by_id = {d.id: d for d in devices}
        self.meshes = [make_mesh([by_id[i] for i in s.device_ids], s.logical_mesh_shape, MESH_AXES)
                       for s in plan.stages]
        self.num_stages = len(self.meshes)
        self._input_specs = dict(input_specs)
        self._check_contract = check_contract
        self.last_step_seconds = 0.0

        leaves = [traced.in_leaves[s] for s in self.call.sources]
        invars = traced.closed_jaxpr.jaxpr.invars
        self._leaf_dtypes = tuple(invars[s].aval.dtype for s in self.call.sources)  # a typed key's is no string
        self._leaf_paths = tuple(leaf.path for leaf in leaves)
        self._batch_leaf = tuple(leaf.is_batch for leaf in leaves)
        self.seq_len = _check_batch_leaves(leaves, self._batch_leaf)
        self.batch_size = next(leaf.shape[0] for leaf, b in zip(leaves, self._batch_leaf, strict=True) if b)
        self.batch_slices = check_batch_slices(batch_slices, self.batch_size, self.seq_len)
        self.share_contexts = bool(share_contexts)
        self.units = _units(self.batch_slices, self.share_contexts)
        self._leaves = leaves
        first_rows = self.batch_slices[0][0]
        kv_avals = _attention_kv_avals(self.call, self._leaf_avals(first_rows))
        self._num_attention_calls = len(kv_avals)
        stage_of_layer = {l: q for q, s in enumerate(plan.stages) for l in s.layer_ids}
        reference = _trace_slice(self.call, self._leaf_avals(first_rows), self._batch_leaf, self.seq_len, 0,
                                 kv_avals, 1.0)
        layers = layer_assign(reference.jaxpr)
        if any(l not in stage_of_layer for l in layers):
            raise ValueError(f"the loss's layer assignment has layers {sorted(set(layers))}, but the plan's stages "
                             f"hold layers {sorted(stage_of_layer)}")
        eqn_stage = [stage_of_layer[l] for l in layers]
        signature = [e.primitive.name for e in reference.jaxpr.eqns]
        self.programs: dict[tuple[int, int, int], _SliceProgram] = {}
        self._fwd, self._bwd, self._diff_inputs = {}, {}, {}
        for unit in self.units:
            if unit.key in self.programs:
                continue
            rows, context, length = unit.key
            closed = _trace_slice(self.call, self._leaf_avals(rows), self._batch_leaf, length, context, kv_avals,
                                  rows * length / (self.batch_size * self.seq_len), self.share_contexts)
            stages = _transfer_stages(signature, eqn_stage, [e.primitive.name for e in closed.jaxpr.eqns])
            self.programs[unit.key] = prog = self._program(closed, stages)
            for q, part in enumerate(prog.parts):
                self._fwd[unit.key, q], self._bwd[unit.key, q], self._diff_inputs[unit.key, q] = \
                    _stage_functions(part)
        self._update = _UpdateProgram(program, self.call, traced, self.meshes, self._sharding)
        self.schedule: Schedule = terapipe(self.num_stages, len(self.batch_slices),
                                           tuple(len(lengths) for _, lengths in self.batch_slices))
        """The order the step runs, as plain data (:func:`alpa_like.compiler.schedule_tables.terapipe`); :meth:`run`
        issues its grid tick by tick. Any valid TeraPipe schedule of the same units can replace it."""
        self.last_tasks: tuple[Task, ...] = ()
        """The tasks the last step issued, in order."""
        self._check_unit, self._check_fwd = None, {}
        if check_contract:
            self._check_unit = _contract_check_unit(self.batch_slices, self.seq_len)
        if self._check_unit is not None:
            rows, _, _ = self._check_unit.key
            closed = _trace_slice(self.call, self._leaf_avals(rows), self._batch_leaf, self.seq_len, 0, kv_avals,
                                  rows / self.batch_size, self.share_contexts)
            stages = _transfer_stages(signature, eqn_stage, [e.primitive.name for e in closed.jaxpr.eqns])
            self._check_program = self._program(closed, stages)
            self._check_fwd = {q: jax.jit(_part_body(part)) for q, part in enumerate(self._check_program.parts)}
        self._check_contract = self._check_unit is not None

    @property
    def num_executables(self) -> int:
        """Distinct (slice shape, stage) forward executables (units of equal (rows, context, length) share)."""
        return len(self._fwd)

    def _leaf_avals(self, rows: int):
        return [jax.ShapeDtypeStruct((rows, *l.shape[1:]) if b else tuple(l.shape), dtype)
                for l, b, dtype in zip(self._leaves, self._batch_leaf, self._leaf_dtypes, strict=True)]

    def _sharding(self, q: int, path: str | None, shape) -> NamedSharding:
        """Layout on stage ``q``'s mesh: the plan's (ILP's) spec of the input leaf at ``path`` if it has one,
        else the batch dim split over the mesh (as the pipeshard runtime lays out what it loads)."""
        mesh = self.meshes[q]
        spec = self._input_specs.get((q, path))
        if spec is None or spec.ndim != len(shape):
            spec = activation_spec(shape, tuple(mesh.devices.shape))
        return named_sharding(mesh, spec)

    def _program(self, closed: ClosedJaxpr, eqn_stage) -> _SliceProgram:
        jaxpr = closed.jaxpr
        num_leaves = len(self.call.sources)
        leaf_vars = tuple(jaxpr.invars[:num_leaves])
        prefix_vars = {jaxpr.invars[num_leaves + 2 * n + kv]: (n, kv)
                       for n in range(self._num_attention_calls) for kv in (0, 1)}
        valid_var = jaxpr.invars[num_leaves + 2 * self._num_attention_calls] if self.share_contexts else None
        outs = jaxpr.outvars
        if any(isinstance(v, Literal) for v in outs):
            raise TerapipeContractError("the loss or an attention's keys/values are constants: nothing to pipeline")
        parts, producer = _split_stages(closed, eqn_stage, self.num_stages)
        return _SliceProgram(closed=closed, leaf_vars=leaf_vars, prefix_vars=prefix_vars, loss_var=outs[0],
                             kv_vars=tuple((outs[1 + 2 * n], outs[2 + 2 * n])
                                           for n in range(self._num_attention_calls)),
                             parts=parts, producer=producer, valid_var=valid_var)

    # ------------------------------------------------------------------------------------------------ run

    def __call__(self, *args):
        return self.run(*args)

    def run(self, *args):
        start_time = time.perf_counter()
        flat = self.traced.flatten_args(args)
        call = self.call
        leaves = [flat[s] for s in call.sources]
        host = {j: np.asarray(x) for j, x in enumerate(leaves) if self._batch_leaf[j]}
        placed: dict[tuple, Any] = {}

        def leaf_on(j: int, q: int, unit: _Unit):
            if self._batch_leaf[j]:
                key = (j, q, unit.batch_slice, unit.index)
                if key not in placed:
                    rows, _, length = unit.key
                    part = host[j][unit.row_start:unit.row_start + rows, unit.token_start:unit.token_start + length]
                    placed[key] = jax.device_put(part, self._sharding(q, None, part.shape))
                return placed[key]
            return self._param_on(placed, flat, call.sources[j], q)

        env: dict[tuple[int, int], dict] = {}
        prefixes: dict[tuple[int, int, int, int], Any] = {}
        vjps: dict[tuple[int, int, int], Any] = {}
        cts: dict[tuple[int, int], dict] = {}
        carried: dict[tuple[int, int, int], Any] = {}
        grads: dict[int, Any] = {}
        losses: dict[int, list] = {}
        issued = []
        for row in self.schedule.ticks:
            for task in row:
                if task is None:
                    continue
                unit = self.units_by[task.micro_batch][task.slice or 0]
                if task.phase == Phase.F:
                    self._forward(task.stage, unit, env, prefixes, vjps, leaf_on)
                else:
                    self._backward(task.stage, unit, env, vjps, cts, carried, grads, losses)
                issued.append(task)
        self.last_tasks = tuple(issued)
        grad_leaves = [grads.get(j) for j in call.grad_order]
        loss = _sum_on_first([x for k in sorted(losses) for x in losses[k]])
        if self._check_contract:
            self._verify_loss(_sum_on_first(losses[self._check_unit.batch_slice]), leaf_on)
        out = self._update.run(flat, grad_leaves, loss, lambda k, q: self._param_on(placed, flat, k, q))
        self.last_step_seconds = time.perf_counter() - start_time
        return jax.tree_util.tree_unflatten(self.traced.out_tree, out)

    def _param_on(self, placed: dict, flat, k: int, q: int):
        """Step input ``k`` (a parameter, optimizer state, ...) on stage ``q``'s mesh in the plan's layout,
        placed once per step."""
        if (k, q) not in placed:
            leaf = self.traced.in_leaves[k]
            placed[(k, q)] = jax.device_put(flat[k], self._sharding(q, leaf.path, np.shape(flat[k])))
        return placed[(k, q)]

    def _forward(self, q: int, unit: _Unit, env, prefixes, vjps, leaf_on, prog: _SliceProgram | None = None):
        """Stage ``q``'s forward of ``unit``; with ``prog`` given (the contract check), forward only."""
        check = prog is not None
        prog = prog if check else self.programs[unit.key]
        part = prog.parts[q]
        k, i = unit.batch_slice, unit.index
        local = env.setdefault((k, i), {})
        leaf_index = {v: j for j, v in enumerate(prog.leaf_vars)}
        consts = dict(zip(prog.closed.jaxpr.constvars, prog.closed.consts, strict=True))
        values = []
        for v in part.inputs:
            if v in local:
                x = local[v]
                values.append(x if prog.producer.get(v) == q else
                              jax.device_put(x, self._sharding(q, None, x.shape)))
            elif v in leaf_index:
                values.append(leaf_on(leaf_index[v], q, unit))
            elif v in prog.prefix_vars:
                values.append(self._prefix(q, unit, prog.prefix_vars[v], v.aval, env, prefixes))
            elif v is prog.valid_var:
                values.append(jax.device_put(np.int32(unit.token_start), self._sharding(q, None, ())))
            elif v in consts:
                values.append(jax.device_put(consts[v], self._sharding(q, None, np.shape(consts[v]))))
            else:
                raise RuntimeError(f"stage {q} of slice {unit} reads {v}, which nothing provides")
        if check:
            local.update(zip(part.outputs, self._check_fwd[q](*values), strict=True))
            return
        outs, vjp = self._fwd[unit.key, q](*values)
        local.update(zip(part.outputs, outs, strict=True))
        vjps[(q, k, i)] = vjp

    def _prefix(self, q: int, unit: _Unit, call_kv: tuple[int, int], aval, env, prefixes):
        """Keys or values of the earlier slices of the same sequence: the previous slice's prefix extended
        by the previous slice's own keys or values (all on stage ``q``'s mesh). With shared contexts the
        program reads it left-padded with zeros to its key's context (the padding is masked out)."""
        n, kv = call_kv
        k, i = unit.batch_slice, unit.index
        if i <= 0:  # the first slice, or the contract check's whole sequences (index -1): no context
            shape = (aval.shape[0], 0, *aval.shape[2:])
            value = jax.device_put(jnp.zeros(shape, aval.dtype), self._sharding(q, None, shape))
        else:
            previous = self.programs[self.units_by[k][i - 1].key]
            value = _append_tokens(prefixes[(k, i - 1, n, kv)], env[(k, i - 1)][previous.kv_vars[n][kv]])
        prefixes[(k, i, n, kv)] = value
        padding = aval.shape[1] - value.shape[1]
        return _left_pad(value, padding) if padding else value

    @functools.cached_property
    def units_by(self) -> dict[int, list[_Unit]]:
        out: dict[int, list[_Unit]] = {}
        for unit in self.units:
            out.setdefault(unit.batch_slice, []).append(unit)
        return out

    def _backward(self, q: int, unit: _Unit, env, vjps, cts, carried, grads, losses):
        prog = self.programs[unit.key]
        part = prog.parts[q]
        k, i = unit.batch_slice, unit.index
        pending = cts.setdefault((k, i), {})
        if prog.loss_var in part.outputs:
            losses.setdefault(k, []).append(env[(k, i)][prog.loss_var])
            pending[prog.loss_var] = jnp.ones((), prog.loss_var.aval.dtype)
        cotangents = [pending.pop(v, None) for v in part.outputs]
        inputs_ct = self._bwd[unit.key, q](vjps.pop((q, k, i)), cotangents)
        leaf_index = {v: j for j, v in enumerate(prog.leaf_vars)}
        for v, g in zip(self._diff_inputs[unit.key, q], inputs_ct, strict=True):
            if v in prog.producer:
                source = prog.producer[v]
                _accumulate(pending, v, jax.device_put(g, self._sharding(source, None, g.shape)))
            elif v in leaf_index:
                j = leaf_index[v]
                if self.call.differentiated[j]:
                    grads[j] = g if j not in grads else grads[j] + jax.device_put(g, grads[j].sharding)
            elif v in prog.prefix_vars:
                n, kv = prog.prefix_vars[v]
                extra = carried.pop((k, n, kv), None)
                if i == 0:
                    continue
                if g.shape[1] != unit.token_start:  # shared contexts: drop the padding's (zero) cotangent
                    g = _drop_padding(g, g.shape[1] - unit.token_start)
                previous = self.units_by[k][i - 1]
                earlier, own = _split_prefix_cotangent(g, extra, previous.token_start)
                carried[(k, n, kv)] = earlier
                _accumulate(cts.setdefault((k, i - 1), {}), self.programs[previous.key].kv_vars[n][kv], own)

    def _verify_loss(self, sliced, leaf_on) -> None:
        """Contract points 3-4, first step only: the weighted losses of the token slices of one batch slice
        (the smallest one that is sliced) must add up to the loss of its whole sequences. The whole
        sequences run forward only, through the plan's stages on their meshes (no parameter moves, no
        backward): one extra forward of that batch slice's rows."""
        self._check_contract = False
        unit = self._check_unit
        env: dict = {}
        for q in range(self.num_stages):
            self._forward(q, unit, env, {}, None, leaf_on, prog=self._check_program)
        whole = env[(unit.batch_slice, unit.index)][self._check_program.loss_var]
        if not np.allclose(np.asarray(sliced), np.asarray(whole), rtol=1e-4, atol=1e-6):
            rows = unit.key[0]
            raise TerapipeContractError(
                f"token slicing {format_scheme(self.batch_slices)}: batch slice {unit.batch_slice} ({rows} rows, "
                f"slices {list(self.batch_slices[unit.batch_slice][1])}) gives weighted loss {float(sliced):.6g} "
                f"but its whole sequences give {float(whole):.6g}: the model breaks the TeraPipe contract. "
                "Positions must come from the "
                "inputs (e.g. batch['position_ids'], sliced like the tokens; not arange(seq) inside the model), "
                "every cross-token operation must be alpa_like.nn.causal_self_attention, and the loss must be a "
                "mean over all batch x sequence tokens")


def _sum_on_first(values):
    total = values[0]
    for x in values[1:]:
        total = total + jax.device_put(x, total.sharding)
    return total


def _contract_check_unit(batch_slices: BatchSlices, seq_len: int) -> _Unit | None:
    """The whole sequences of the smallest batch slice cut into more than one token slice, as a unit of its
    own (batch slice ``k``, index ``-1``: its inputs are cached apart from the real slices'); None when no
    batch slice is cut (the step is then the unsliced loss, nothing to check)."""
    row_starts = slice_starts([rows for rows, _ in batch_slices])
    cut = [k for k, (_, lengths) in enumerate(batch_slices) if len(lengths) > 1]
    if not cut:
        return None
    k = min(cut, key=lambda k: batch_slices[k][0])
    return _Unit(batch_slice=k, index=-1, key=(batch_slices[k][0], 0, seq_len), row_start=row_starts[k],
                 token_start=0)


def _units(batch_slices: BatchSlices, share_contexts: bool = False) -> tuple[_Unit, ...]:
    """Every (batch slice, token slice) in sequence order: the order forwards run (backwards: reversed).
    ``share_contexts``: units of equal (rows, length) get one key, whose context is the longest among them
    (their programs read the cached prefix left-padded to it; :func:`slice_contexts`, which the planner
    prices the same way)."""
    row_starts = slice_starts([rows for rows, _ in batch_slices])
    contexts = slice_contexts(batch_slices, shared=share_contexts)
    return tuple(_Unit(batch_slice=k, index=i, key=(rows, context, length), row_start=row_starts[k],
                       token_start=start)
                 for k, (rows, lengths) in enumerate(batch_slices)
                 for i, (start, context, length) in enumerate(zip(slice_starts(lengths), contexts[k], lengths)))


class _UpdateProgram:
    """Everything after ``al.grad`` (the optimizer update): the step's apply-grad pieces, each run on the
    mesh of the stage that owns its layers' parameters (as the pipeshard runtime does), fed with the
    gradients and loss the slices summed up."""

    def __init__(self, program: StageProgram, call: LossCall, traced, meshes, sharding: Callable):
        self.program = program
        self.meshes = meshes
        self._sharding = sharding
        self._step_input = {vid: k for k, vid in enumerate(program.step_inputs)}
        grad_outputs = [o for _, o in program.accumulated]
        expected = len(call.grad_order) + int(call.with_value)
        if len(program.accumulated) != expected:
            raise TerapipeContractError(f"al.grad's results have {len(program.accumulated)} array leaves, expected "
                                        f"{expected} (the loss and one gradient per differentiated leaf)")
        self._from_grad = {o: n for n, o in enumerate(grad_outputs)}
        self._with_value = call.with_value
        self._result_paths = ([None] if call.with_value else []) + [
            traced.in_leaves[call.sources[j]].path for j in call.grad_order]
        self._jitted = {q: jax.jit(_piece_fn(program.piece(q, APPLY))) for q in range(program.num_stages)}

    def run(self, flat, grad_leaves, loss, step_input_on: Callable):
        """The step's outputs, given the summed gradients (None: zero) and loss."""
        program = self.program
        results = ([loss] if self._with_value else []) + list(grad_leaves)
        env: dict[int, tuple[Any, int | None]] = {}  # value id -> (value, mesh or None)
        done, pending = set(), list(range(program.num_stages))
        while pending:
            progressed = False
            for q in list(pending):
                piece = program.piece(q, APPLY)
                args = [self._value(vid, q, flat, results, env, step_input_on) for vid in piece.inputs]
                if any(a is _MISSING for a in args):
                    continue
                outs = self._jitted[q](*args)
                env.update({vid: (x, q) for vid, x in zip(piece.outputs, outs, strict=True)})
                pending.remove(q)
                done.add(q)
                progressed = True
            if not progressed:
                raise TerapipeContractError(
                    "pipeline_schedule='terapipe': the update (after al.grad) reads values of the loss's forward or "
                    "backward pass other than al.grad's results; only the loss, gradients and step inputs can be "
                    "read after al.grad on this path")
        outputs = []
        for n, vid in enumerate(program.step_outputs):
            if vid is None:
                outputs.append(program.literal_outputs[n])
                continue
            value = self._value(vid, None, flat, results, env, step_input_on)
            if value is _MISSING:
                raise TerapipeContractError("pipeline_schedule='terapipe': the step returns a value of the loss's "
                                            "forward pass; return only al.grad's results and the updated state")
            outputs.append(value)
        return outputs

    def _value(self, vid, q, flat, results, env, step_input_on):
        """Value ``vid`` on stage ``q``'s mesh (``q`` None: wherever it is)."""
        if vid in self._from_grad:
            x = results[self._from_grad[vid]]
            if x is None:
                aval = self.program.values[vid].aval
                x = jnp.zeros(aval.shape, aval.dtype)
            if q is None:
                return x
            # A gradient in its parameter's layout (a no-op when XLA already produced it so).
            return jax.device_put(x, self._sharding(q, self._result_paths[self._from_grad[vid]], x.shape))
        if vid in self._step_input:
            k = self._step_input[vid]
            return flat[k] if q is None else step_input_on(k, q)
        if vid in self.program.constants:
            c = self.program.constants[vid]
            return c if q is None else jax.device_put(c, self._sharding(q, None, np.shape(c)))
        if vid in env:
            x, where = env[vid]
            return x if q is None or where == q else jax.device_put(x, self._sharding(q, None, x.shape))
        return _MISSING


_MISSING = object()


def _piece_fn(piece):
    def run(*args):
        return jax_compat.eval_closed_jaxpr(piece.jaxpr, *args)
    return run


def _transfer_stages(reference: Sequence[str], reference_stage: Sequence[int], names: Sequence[str]) -> list[int]:
    """Stage of every equation of a slice's trace, from the full-length trace's assignment.

    Slice traces have the same equations as the full-length one except where a size-1 dim lets JAX skip
    an equation (a one-token slice); the equations are aligned by primitive name (difflib) and an unmatched
    equation joins the stage of the equation before it (stages stay non-decreasing).
    """
    stages = [None] * len(names)
    matcher = difflib.SequenceMatcher(a=list(reference), b=list(names), autojunk=False)
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            stages[block.b + offset] = reference_stage[block.a + offset]
    out, current = [], 0
    for q in stages:
        current = current if q is None else max(current, q)
        out.append(current)
    return out


def _accumulate(store: dict, key, value) -> None:
    store[key] = value if key not in store else store[key] + value


def _check_batch_leaves(leaves, batch_mask) -> int:
    """The common sequence length (dim 1) of the batch leaves the loss reads (contract point 2)."""
    lengths = {}
    for leaf, is_batch in zip(leaves, batch_mask, strict=True):
        if is_batch:
            if len(leaf.shape) < 2:
                raise TerapipeContractError(f"pipeline_schedule='terapipe' slices every batch input along dim 1 "
                                            f"(the sequence); {leaf.path} has shape {leaf.shape}")
            lengths[leaf.path] = leaf.shape[1]
    if not lengths:
        raise TerapipeContractError("pipeline_schedule='terapipe' needs batch inputs [batch, seq, ...] among the "
                                    "arguments of the function al.grad differentiates (a batch the loss reads "
                                    "from its closure cannot be sliced): pass the batch to it, e.g. "
                                    "al.value_and_grad(loss_fn)(params, batch)")
    if len(set(lengths.values())) != 1:
        raise TerapipeContractError(f"pipeline_schedule='terapipe' needs every batch input to have the same "
                                    f"sequence length (dim 1); got {lengths}")
    return next(iter(lengths.values()))

