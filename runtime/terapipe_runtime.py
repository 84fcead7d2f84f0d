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
the full-length trace. Each (shape, stage) becomes a forward piece (a ``jax.vjp`` that returns its
residuals) and a backward piece, lowered with the step's apply-grad pieces to the same per-mesh instruction
programs every schedule runs (:mod:`alpa_like.runtime.terapipe_programs`): a slice's cached prefix is the
previous slice's prefix extended by its own keys and values, handed on by ``CARRY`` on the stage's mesh,
and its cotangent is handed back the same way. The order is the schedule
:func:`alpa_like.compiler.schedule_tables.terapipe` builds for the scheme (plain data,
``TerapipeExecutable.schedule``); the programs run on the local backend
(:class:`~alpa_like.runtime.pipeshard_runtime.PipeshardExecutable`, which runs the step's effects) or the
Ray backend, like any schedule's.

Layouts (the plan's intra-op shardings): parameters and other step inputs are loaded on each stage's
mesh with the ILP's spec of that leaf for the stage (``StagePlan.inputs``), batch slices and values sent
between stages with their batch dim split over the mesh where it divides (as the pipeshard runtime's
``activation_spec``); XLA propagates these layouts through each stage piece.

Update: everything after ``al.grad`` is the step's apply-grad pieces of
:func:`alpa_like.compiler.stage_construction.build_stage_program`, each run on the mesh of the stage owning
its layers' parameters, fed with the step's mean gradients and loss (so no parameter crosses meshes).

Limits: by default slices with equal lengths but different contexts are different shapes, so they do not
share executables; ``share_slice_executables=True`` shares them by left-padding the cached prefix to the
longest context and masking the padding, which costs attention over the padding (tokens TeraPipe exists to
skip); the planner prices it (:func:`alpa_like.compiler.token_slicing.slice_contexts`) in the plan's estimate
and its keep-or-drop decision, but its DP optimises the unpadded cost.
"""
from __future__ import annotations

import dataclasses
import difflib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var, no_effects

from alpa_like.compiler import jax_compat
from alpa_like.compiler.layer_slicing import APPLY, FORWARD
from alpa_like.compiler.micro_batch_keys import draws_random_numbers
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.stage_construction import StageProgram, ValueId
from alpa_like.compiler.stage_sharding import StageSharding
from alpa_like.compiler.token_slicing import BatchSlices, check_batch_slices, format_scheme, slice_contexts
from alpa_like.compiler.tracing_hooks import TokenSliceContext, grad_hook, token_slice_context
from alpa_like.compiler.schedule_tables import terapipe
from alpa_like.compiler.schedules import Schedule, Task
from alpa_like.runtime.instructions import MeshPrograms
from alpa_like.runtime.mesh import named_sharding
from alpa_like.runtime.pipeshard_runtime import PipeshardExecutable, activation_spec, pad_tokens, unit_window
from alpa_like.runtime.terapipe_programs import (TokenSlicedProgram, emit_token_sliced, forward_only,
                                                 lower_token_sliced)

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
    ``(keys, values)`` prefix per attention call); returns the closed jaxpr, without the loss's sharding
    constraints (as the pipeline leaves them out of the step: each stage runs on its own submesh)."""
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
    closed = jax_compat.inline_calls(jax.make_jaxpr(loss)(leaves, prefixes, valid))
    jaxpr, _ = jax_compat.bypass_eqns_deep(closed.jaxpr, jax_compat.is_sharding_constraint)
    return closed.replace(jaxpr=jaxpr)


def _contract_rtol(loss_dtype) -> float:
    """The relative tolerance of the contract check for a loss of ``loss_dtype``: ``1e-4``, or two units in
    the last place where the dtype is coarser (a bfloat16 loss rounds each slice's loss by up to
    ``eps / 2``), so that a model within the contract passes the check in its own precision."""
    return max(1e-4, 2 * float(jnp.finfo(loss_dtype).eps))


def _attention_kv_avals(call: LossCall, leaf_avals):
    """Per attention call of the loss, the avals of its keys and values (contract point 3); each call must
    be in the loss's own jaxpr, where its keys and values can be cached, not in a call or loop body."""
    found = []

    def loss(leaf_values):
        context = TokenSliceContext(prefixes=None)
        with token_slice_context(context):
            value = call.loss_fn(*jax.tree_util.tree_unflatten(call.arg_tree, leaf_values))
        found.extend((jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
                     for k, v in context.produced)
        return value, [x for kv in context.produced for x in kv]

    jaxpr = jax.make_jaxpr(loss)(list(leaf_avals)).jaxpr
    if not found:
        raise TerapipeContractError(
            "pipeline_schedule='terapipe' needs causal attention through alpa_like.nn.causal_self_attention "
            "(the only cross-token operation token slicing can cut); the loss never calls it (a call inside a "
            "function JAX traced before, under jax.jit or jax.checkpoint, is not seen: JAX reuses its cached trace)")
    defined = {*jaxpr.invars, *(v for e in jaxpr.eqns for v in e.outvars)}  # a body's keys leak out as constvars
    if any(isinstance(v, Var) and v not in defined for v in jaxpr.outvars[-2 * len(found):]):
        raise TerapipeContractError(
            "pipeline_schedule='terapipe' caches the keys and values of each alpa_like.nn.causal_self_attention "
            "call across token slices, so the loss must make the call itself, not inside a jax.checkpoint / "
            "nn.remat, lax.scan / nn.scan or cond body: unroll scanned layers, and for rematerialization use "
            "layer_option=AutoLayerOption(..., remat_layer=True) (or ManualLayerOption(remat_layer=True)) "
            "instead of nn.remat")
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
    """A compiled TeraPipe step: call it like the original function.

    The step's token slices are lowered to instruction programs
    (:mod:`~alpa_like.runtime.terapipe_programs`) and run by a pipeline backend's executable: the local
    MPMD backend's by default, another's through ``make_executable`` (the arguments of
    :class:`~alpa_like.runtime.pipeshard_runtime.PipeshardExecutable`: ``input_specs`` per value, the first
    stage's that reads it, and ``value_specs`` per (value, mesh), each stage's)."""

    def __init__(self, *, fun: Callable, args: Sequence[Any], traced, plan, program: StageProgram,
                 layer_assign: Callable, devices: Sequence[Any] | None, batch_slices,
                 input_specs: dict[tuple[int, str], ShardingSpec], check_contract: bool = True,
                 share_contexts: bool = False, make_executable: Callable | None = None, run_effects: bool = True,
                 defer_gradient_sync: bool = False):
        if traced.after_grad is not None:
            outputs = ", ".join(traced.out_leaves[k].path for k in traced.after_grad.outputs)
            raise ValueError(f"pipeline_schedule='terapipe' reads only the loss, the gradients and the step's inputs "
                             f"after al.grad, so it cannot compute the outputs that read the batch there ({outputs}); "
                             "use another pipeline_schedule for them")
        self.traced = traced
        self.plan = plan
        self.call = find_loss_call(fun, args, traced)
        _check_update(program, self.call)
        self.num_stages = len(plan.stages)
        self.num_micro_batches = plan.num_micro_batches
        self._devices = devices
        self._make = make_executable or PipeshardExecutable
        self._run_effects = run_effects
        self.last_step_seconds = 0.0

        leaves = [traced.in_leaves[s] for s in self.call.sources]
        invars = traced.closed_jaxpr.jaxpr.invars
        self._leaf_dtypes = tuple(invars[s].aval.dtype for s in self.call.sources)  # a typed key's is no string
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
        scale = self.num_micro_batches / (self.batch_size * self.seq_len)
        self.programs: dict[tuple[int, int, int], _SliceProgram] = {}
        """Slice shape ``(rows, context, length)`` -> its loss, traced and cut into the plan's stages."""
        for unit in self.units:
            if unit.key not in self.programs:
                rows, context, length = unit.key
                closed = _trace_slice(self.call, self._leaf_avals(rows), self._batch_leaf, length, context, kv_avals,
                                      rows * length * scale, self.share_contexts)
                stages = _transfer_stages(signature, eqn_stage, [e.primitive.name for e in closed.jaxpr.eqns])
                self.programs[unit.key] = self._program(closed, stages)
        last = {k: len(lengths) - 1 for k, (_, lengths) in enumerate(self.batch_slices)}
        has_next = {key: any(u.index < last[u.batch_slice] for u in self.units if u.key == key)
                    for key in self.programs}
        self.lowered: TokenSlicedProgram = lower_token_sliced(program, self.call, self.programs, self.units,
                                                              self.num_stages, self._batch_leaf, has_next)
        """The step as one stage program: a forward and a backward piece per (slice shape, stage)."""
        self._options = {}
        if defer_gradient_sync:  # the slices' pieces have no ILP pins: the layouts follow from what arrives
            self._options = dict(defer_gradient_sync=True, stage_shardings=tuple(
                StageSharding(value_pins=(), operand_pins=(), input_specs={}, output_specs={}) for _ in range(self.lowered.program.num_stages)))
        path_to_input = {leaf.path: program.step_inputs[k] for k, leaf in enumerate(traced.in_leaves)}
        self._value_specs = {(path_to_input[path], q): spec for (q, path), spec in input_specs.items()
                             if path in path_to_input}
        self._check_unit, self._check_lowered = None, None
        if check_contract:
            self._check_unit = _contract_check_unit(self.batch_slices, self.seq_len)
        if self._check_unit is not None:
            rows, _, _ = self._check_unit.key
            closed = _trace_slice(self.call, self._leaf_avals(rows), self._batch_leaf, self.seq_len, 0, kv_avals,
                                  rows * self.seq_len * scale, self.share_contexts)
            stages = _transfer_stages(signature, eqn_stage, [e.primitive.name for e in closed.jaxpr.eqns])
            whole = {self._check_unit.key: self._program(closed, stages)}
            self._check_lowered = lower_token_sliced(program, self.call, whole, (self._check_unit,), self.num_stages,
                                                     self._batch_leaf, {self._check_unit.key: False})
        self._check_contract = self._check_unit is not None
        self._check_fns: dict[tuple[int, int], tuple[Callable, tuple[ValueId, ...]]] = {}
        self._check_layouts: dict[tuple[ValueId, int], Any] | None = None
        self.last_tasks: tuple[Task, ...] = ()
        """The tasks the last step ran, in the order of its programs."""
        self.schedule = terapipe(self.num_stages, len(self.batch_slices),
                                 tuple(len(lengths) for _, lengths in self.batch_slices))

    @property
    def schedule(self) -> Schedule:
        """The order the step runs, as plain data (:func:`alpa_like.compiler.schedule_tables.terapipe`); any
        valid TeraPipe schedule of the same units can replace it (the programs are emitted again)."""
        return self._schedule

    @schedule.setter
    def schedule(self, schedule: Schedule) -> None:
        self._schedule = schedule
        self.mesh_programs: MeshPrograms = emit_token_sliced(self.lowered, schedule, self.units)
        """Each mesh's instruction program."""
        value_specs = dict(self._value_specs)
        first = {}
        for (v, _), spec in sorted(self._value_specs.items()):
            first.setdefault(v, spec)
        extra = dict(self._options, value_specs=value_specs)  # each stage's layouts of its parameters
        self.executor = self._make(traced=self.traced, plan=self.plan, program=self.lowered.program,
                                   programs=self.mesh_programs, devices=self._devices, input_specs=first, **extra)
        """The backend's executable that runs :attr:`mesh_programs`."""

    @property
    def meshes(self):
        return self.executor.meshes

    @property
    def last_step(self):
        return self.executor.last_step

    def get_hlo_text(self) -> str:
        return self.executor.get_hlo_text()

    def input_placements(self):
        return self.executor.input_placements()

    def input_shardings(self):
        return self.executor.input_shardings()

    @property
    def num_executables(self) -> int:
        """Distinct (slice shape, stage) forward pieces (units of equal (rows, context, length) share)."""
        return len(self.programs) * self.num_stages

    def _leaf_avals(self, rows: int):
        return [jax.ShapeDtypeStruct((rows, *l.shape[1:]) if b else tuple(l.shape), dtype)
                for l, b, dtype in zip(self._leaves, self._batch_leaf, self._leaf_dtypes, strict=True)]

    def _program(self, closed: ClosedJaxpr, eqn_stage) -> _SliceProgram:
        if not self._run_effects:  # a backend that ships no host callbacks: the effects are left out
            keep = [not e.effects for e in closed.jaxpr.eqns]
            eqn_stage = [q for q, k in zip(eqn_stage, keep, strict=True) if k]
            closed = ClosedJaxpr(closed.jaxpr.replace(eqns=[e for e, k in zip(closed.jaxpr.eqns, keep, strict=True)
                                                            if k], effects=no_effects), closed.consts)
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
        if self._check_contract:
            self._verify_loss(self.traced.flatten_args(args))
        out = self.executor.run(*args)
        self.last_tasks = tuple(t for row in self._schedule.ticks for t in row if t is not None)
        self.last_step_seconds = time.perf_counter() - start_time
        return out

    def _verify_loss(self, flat) -> None:
        """Contract points 3-4, first step only: the weighted losses of the token slices of one batch slice
        (the smallest one that is cut) must add up to the loss of its whole sequences. Both run forward only
        (:func:`forward_only` pieces), through the plan's stages (on their meshes on the local backend)."""
        self._check_contract = False
        unit = self._check_unit
        mine = tuple(u for u in self.units if u.batch_slice == unit.batch_slice)
        slice_losses = self._forward_losses(self.lowered, mine, flat)
        sliced = sum(float(x) for x in slice_losses)
        whole = float(self._forward_losses(self._check_lowered, (unit,), flat)[0])
        if not np.allclose(sliced, whole, rtol=_contract_rtol(slice_losses[0].dtype), atol=1e-6):
            rows = unit.key[0]
            raise TerapipeContractError(
                f"token slicing {format_scheme(self.batch_slices)}: batch slice {unit.batch_slice} ({rows} rows, "
                f"slices {list(self.batch_slices[unit.batch_slice][1])}) gives weighted loss {sliced:.6g} "
                f"but its whole sequences give {whole:.6g}: the model breaks the TeraPipe contract. "
                "Positions must come from the "
                "inputs (e.g. batch['position_ids'], sliced like the tokens; not arange(seq) inside the model), "
                "every cross-token operation must be alpa_like.nn.causal_self_attention, and the loss must be a "
                "mean over all batch x sequence tokens")

    def _forward_losses(self, lowered: TokenSlicedProgram, units: Sequence[_Unit], flat) -> list:
        """The weighted loss of each of ``units`` (one sequence's token slices in order), forward pieces only."""
        program, P = lowered.program, self.num_stages
        given = dict(zip(program.step_inputs, flat, strict=True))
        given.update(program.constants)
        env: dict[tuple[ValueId, int], Any] = {}
        losses = []
        for n, unit in enumerate(units):
            shape = lowered.shape_index[unit.key]
            for q in range(P):
                piece = program.piece(shape * P + q, FORWARD)
                args = [self._place(v, self._check_input(lowered, v, n, units, env, given, q), q)
                        for v in piece.inputs]
                fn, outputs = self._check_piece(lowered, piece)
                env.update(((v, n), x) for v, x in zip(outputs, fn(*args), strict=True))
            losses.append(env[(lowered.loss_values[shape], n)])
        return losses

    def _check_input(self, lowered: TokenSlicedProgram, v: ValueId, n: int, units, env, given, q: int):
        unit = units[n]
        if v in lowered.batch_leaves:
            return unit_window(given[v], (unit.row_start, unit.key[0], unit.token_start, unit.key[2]))
        what = lowered.carried.get(v)
        if what is None:
            return env[(v, n)] if (v, n) in env else given[v]
        if what.kind == "valid":
            return given[lowered.zeros[("valid", unit.token_start)]]
        if unit.index <= 0:
            return given[lowered.zeros[("prefix", unit.key, q, *what.call_kv)]]
        prev = units[n - 1]
        x = env[(lowered.next_prefix[(lowered.shape_index[prev.key], q, *what.call_kv)], n - 1)]
        return pad_tokens(x, unit.key[1] - prev.key[1] - prev.key[2])

    def _check_piece(self, lowered: TokenSlicedProgram, piece) -> tuple[Callable, tuple[ValueId, ...]]:
        """The contract check's jitted forward of ``piece`` (its :func:`forward_only` form, random bits zero)
        and the values it returns."""
        key = (id(lowered), piece.stage)
        if key not in self._check_fns:
            forward = forward_only(lowered, piece.stage)
            self._check_fns[key] = (jax.jit(_with_zero_random_bits(forward.jaxpr)), forward.outputs)
        return self._check_fns[key]

    def _place(self, v: ValueId, x, q: int):
        """Value ``v`` (``x``) on stage ``q``'s mesh when the backend runs in this process, else as it is: a step
        input other than the batch in the layout the step loads it in there, any other value (a batch window
        too) as the step receives it (:func:`activation_spec`)."""
        if self._make is not PipeshardExecutable:
            return x
        if self._check_layouts is None:
            self._check_layouts = {(v, m): sharding for v, placed in zip(
                self.lowered.program.step_inputs, self.executor.input_placements(), strict=True)
                if v not in self.lowered.batch_leaves for m, sharding in placed.items()}
        mesh = self.executor.meshes[q]
        sharding = self._check_layouts.get((v, q)) or named_sharding(
            mesh, activation_spec(np.shape(x), tuple(mesh.devices.shape)))
        return jax.device_put(x, sharding)


def _with_zero_random_bits(closed: ClosedJaxpr) -> Callable:
    """``closed`` as a function whose random bits (``random_bits``, in nested ``jit`` and ``checkpoint`` calls
    too) are all zero:
    every draw then gives one value in every element (a uniform its minimum, a Bernoulli mask keeps all),
    whatever its shape, so a token slice's draws equal the rows of its whole sequence's. The contract check
    compares the two with it (forward only); a draw inside another body (``scan``, ``cond``) stays random."""
    def evaluate(jaxpr, consts, args):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            if eqn.primitive.name == "random_bits":
                outvals = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            elif jax_compat.is_call(eqn) and draws_random_numbers(eqn):
                inner = eqn.params["jaxpr"]
                outvals = evaluate(inner.jaxpr, inner.consts, invals)
            elif eqn.primitive.name in jax_compat.REMAT_PRIMITIVES and draws_random_numbers(eqn):
                outvals = evaluate(eqn.params["jaxpr"], (), invals)
            else:
                outvals = jax_compat.bind_eqn(eqn, invals)
            env.update(zip(eqn.outvars, outvals, strict=True))
        return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]
    return lambda *args: evaluate(closed.jaxpr, closed.consts, args)


def _check_update(program: StageProgram, call: LossCall) -> None:
    """What runs after al.grad reads only the loss, the gradients and the step's inputs (and what they make)."""
    expected = len(call.grad_order) + int(call.with_value)
    if len(program.accumulated) != expected:
        raise TerapipeContractError(f"al.grad's results have {len(program.accumulated)} array leaves, expected "
                                    f"{expected} (the loss and one gradient per differentiated leaf)")
    known = set(program.step_inputs) | set(program.constants) | {dst for _, dst in program.accumulated}
    applies = [program.piece(q, APPLY) for q in range(program.num_stages)]
    for piece in applies:
        known.update(piece.outputs)
    if any(v not in known for piece in applies for v in piece.inputs):
        raise TerapipeContractError(
            "pipeline_schedule='terapipe': the update (after al.grad) reads values of the loss's forward or "
            "backward pass other than al.grad's results; only the loss, gradients and step inputs can be "
            "read after al.grad on this path")
    if any(v is not None and v not in known for v in program.step_outputs):
        raise TerapipeContractError("pipeline_schedule='terapipe': the step returns a value of the loss's "
                                    "forward pass; return only al.grad's results and the updated state")


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

