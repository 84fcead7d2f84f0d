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

On the first step the weighted slice losses are compared with the unsliced loss on the same batch: a model
that breaks 3 or 4 (say, positions from ``arange``) fails there with a clear error instead of training on a
wrong gradient.

How it runs. The loss is traced once per token slice with the slice's batch shapes and, as extra inputs,
the keys and values of the earlier slices of every attention call (:func:`alpa_like.nn.token_slice_context`);
the equations of each trace are assigned to the plan's stages by the layer assignment of the full-length
trace (all slice traces have the same equations). Each (stage, slice) forward is a jitted ``jax.vjp`` on
the stage's mesh that keeps its residuals there; the backward applies it to the output cotangents. The
units run in the order of the ``terapipe`` schedule (:func:`alpa_like.runtime.schedules.terapipe`). Then the
step function is re-run with ``al.grad`` returning the summed gradients (and loss), which applies the
optimizer.

Limits (documented, not hidden): values are replicated over each stage's devices (the plan's intra-op
shardings are not applied on this path), and the optimizer update runs on the first stage's mesh.
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
from jax.extend.core import ClosedJaxpr, Literal, Var
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpa_like.compiler import jax_compat
from alpa_like.compiler.grad_accumulation import to_micro_batches
from alpa_like.grad import grad_hook
from alpa_like.nn import TokenSliceContext, token_slice_context
from alpa_like.runtime.schedules import Phase, Schedule, terapipe

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

    jax.make_jaxpr(probe)(*[jax.ShapeDtypeStruct(l.shape, l.dtype) for l in traced.in_leaves])
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
    """The loss of one token slice, cut into the plan's stages."""

    closed: ClosedJaxpr
    leaf_vars: tuple[Var, ...]
    """jaxpr invar of each loss-argument leaf."""
    prefix_vars: dict[Var, tuple[int, int | None, int]]
    """invar -> (attention call, earlier slice (None: the empty prefix of slice 0), 0 = keys / 1 = values)."""
    loss_var: Var
    kv_vars: tuple[tuple[Var, Var], ...]
    """Per attention call, this slice's (keys, values)."""
    parts: tuple[_StagePart, ...]
    producer: dict[Var, int]
    """Stage that computes each var that crosses stages or leaves the slice."""


def _trace_slice(call: LossCall, leaf_avals, batch_leaf: Sequence[bool], start: int, length: int,
                 earlier: Sequence[int], kv_avals, weight: float):
    """Traces the weighted loss of one slice; returns (closed jaxpr, number of prefix inputs per call)."""
    def sliced(aval, is_batch):
        if not is_batch:
            return aval
        return jax.ShapeDtypeStruct((aval.shape[0], length, *aval.shape[2:]), aval.dtype)

    leaves = [sliced(a, b) for a, b in zip(leaf_avals, batch_leaf, strict=True)]
    prefixes = []
    for k_aval, _ in kv_avals:
        b, _, h, d = k_aval.shape
        lens = list(earlier) or [0]
        prefixes.append([(jax.ShapeDtypeStruct((b, l, h, d), k_aval.dtype),
                          jax.ShapeDtypeStruct((b, l, h, d), k_aval.dtype)) for l in lens])

    def loss(leaf_values, prefix_values):
        context = TokenSliceContext(prefixes=prefix_values)
        with token_slice_context(context):
            value = call.loss_fn(*jax.tree_util.tree_unflatten(call.arg_tree, leaf_values))
        if len(context.produced) != len(kv_avals):
            raise TerapipeContractError(f"the loss calls causal_self_attention {len(context.produced)} times on a "
                                        f"slice but {len(kv_avals)} times on the whole sequence")
        return [jnp.asarray(value) * weight] + [x for kv in context.produced for x in kv]

    closed = jax_compat.inline_calls(jax.make_jaxpr(loss)(leaves, prefixes))
    return closed, [len(p) for p in prefixes]


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


def _stage_functions(part: _StagePart):
    """Jitted forward (outputs and the vjp closure, residuals kept where computed) and backward."""
    diff = [_inexact(v.aval) for v in part.inputs]
    out_avals = [v.aval for v in part.outputs]

    def body(*values):
        env = dict(zip(part.inputs, values, strict=True))
        jax_compat.eval_eqns(part.eqns, env)
        return [env[v] for v in part.outputs]

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


class TerapipeExecutable:
    """A compiled TeraPipe step: call it like the original function."""

    def __init__(self, *, fun: Callable, args: Sequence[Any], traced, plan, layer_assign: Callable,
                 devices: Sequence[Any], token_slices: Sequence[int], check_contract: bool = True):
        self.traced = traced
        self.plan = plan
        self.num_micro_batches = plan.num_micro_batches
        self.token_slices = tuple(int(x) for x in token_slices)
        self.call = find_loss_call(fun, args, traced)
        by_id = {d.id: d for d in devices}
        self.meshes = [Mesh(np.array([by_id[i] for i in s.device_ids]), ("d",)) for s in plan.stages]
        self.shardings = [NamedSharding(m, PartitionSpec()) for m in self.meshes]
        self.num_stages = len(self.meshes)
        self.schedule: Schedule = terapipe(self.num_stages, self.num_micro_batches, len(self.token_slices))
        self._check_contract = check_contract
        self.last_step_seconds = 0.0

        leaves = [traced.in_leaves[s] for s in self.call.sources]
        self._batch_leaf = tuple(leaf.is_batch for leaf in leaves)
        m = self.num_micro_batches
        leaf_avals = [jax.ShapeDtypeStruct(((l.shape[0] // m),) + tuple(l.shape[1:]) if b else tuple(l.shape),
                                           l.dtype) for l, b in zip(leaves, self._batch_leaf, strict=True)]
        self.seq_len = _check_batch_leaves(leaves, self._batch_leaf)
        if sum(self.token_slices) != self.seq_len or min(self.token_slices) < 1:
            raise ValueError(f"token_slices {self.token_slices} must be positive lengths summing to the sequence "
                             f"length {self.seq_len}")
        kv_avals = _attention_kv_avals(self.call, leaf_avals)
        stage_of_layer = {l: q for q, s in enumerate(plan.stages) for l in s.layer_ids}
        reference, _ = _trace_slice(self.call, leaf_avals, self._batch_leaf, 0, self.seq_len, [], kv_avals, 1.0)
        layers = layer_assign(reference.jaxpr)
        if any(l not in stage_of_layer for l in layers):
            raise ValueError(f"the loss's layer assignment has layers {sorted(set(layers))}, but the plan's stages "
                             f"hold layers {sorted(stage_of_layer)}")
        eqn_stage = [stage_of_layer[l] for l in layers]
        signature = [e.primitive.name for e in reference.jaxpr.eqns]
        starts = slice_starts(self.token_slices)
        self.programs: list[_SliceProgram] = []
        self._fwd, self._bwd, self._diff_inputs = {}, {}, {}
        for i, (start, length) in enumerate(zip(starts, self.token_slices)):
            weight = length / (self.seq_len * m)
            closed, counts = _trace_slice(self.call, leaf_avals, self._batch_leaf, start, length,
                                          self.token_slices[:i], kv_avals, weight)
            stages_i = _transfer_stages(signature, eqn_stage, [e.primitive.name for e in closed.jaxpr.eqns])
            self.programs.append(self._program(closed, counts, stages_i, len(kv_avals), first=i == 0))
            for q, part in enumerate(self.programs[-1].parts):
                self._fwd[(i, q)], self._bwd[(i, q)], self._diff_inputs[(i, q)] = _stage_functions(part)
        self._apply = jax.jit(self._apply_fn(fun, args))
        self._unsliced_loss = jax.jit(lambda values: self.call.loss_fn(
            *jax.tree_util.tree_unflatten(self.call.arg_tree, values)))

    def _program(self, closed: ClosedJaxpr, counts, eqn_stage, num_calls: int, first: bool) -> _SliceProgram:
        jaxpr = closed.jaxpr
        num_leaves = len(self.call.sources)
        leaf_vars = tuple(jaxpr.invars[:num_leaves])
        prefix_vars, pos = {}, num_leaves
        for n, count in enumerate(counts):
            for j in range(count):
                for kv in (0, 1):
                    prefix_vars[jaxpr.invars[pos]] = (n, None if first else j, kv)
                    pos += 1
        outs = jaxpr.outvars
        if any(isinstance(v, Literal) for v in outs):
            raise TerapipeContractError("the loss or an attention's keys/values are constants: nothing to pipeline")
        parts, producer = _split_stages(closed, eqn_stage, self.num_stages)
        return _SliceProgram(closed=closed, leaf_vars=leaf_vars, prefix_vars=prefix_vars, loss_var=outs[0],
                             kv_vars=tuple((outs[1 + 2 * n], outs[2 + 2 * n]) for n in range(num_calls)),
                             parts=parts, producer=producer)

    def _apply_fn(self, fun: Callable, args: Sequence[Any]) -> Callable:
        step = _flat_step(fun, args, self.traced)
        call = self.call

        def apply(flat, grad_leaves, loss):
            def hook(loss_fn, loss_args, kwargs, *, argnums, has_aux, with_value, jax_kwargs):
                grads = jax.tree_util.tree_unflatten(call.grad_tree, grad_leaves)
                return (loss, grads) if with_value else grads
            with grad_hook(hook):
                return step(list(flat))
        return apply

    # ------------------------------------------------------------------------------------------------ run

    def __call__(self, *args):
        return self.run(*args)

    def run(self, *args):
        start_time = time.perf_counter()
        flat = self.traced.flatten_args(args)
        call, m, n = self.call, self.num_micro_batches, len(self.token_slices)
        leaves = [flat[s] for s in call.sources]
        starts = slice_starts(self.token_slices)
        micro = {j: to_micro_batches(jnp.asarray(x), m) for j, x in enumerate(leaves) if self._batch_leaf[j]}
        placed: dict[tuple[int, int], Any] = {}

        def leaf_on(j: int, q: int, unit):
            if self._batch_leaf[j]:
                k, i = unit
                key = (j, q, k, i)
                if key not in placed:
                    placed[key] = jax.device_put(micro[j][k][:, starts[i]:starts[i] + self.token_slices[i]],
                                                 self.shardings[q])
                return placed[key]
            if (j, q) not in placed:
                placed[(j, q)] = jax.device_put(leaves[j], self.shardings[q])
            return placed[(j, q)]

        env: dict[tuple[int, int], dict] = {}
        vjps: dict[tuple[int, int, int], Any] = {}
        cts: dict[tuple[int, int], dict] = {}
        grads: dict[int, Any] = {}
        losses = []
        for row in self.schedule.ticks:
            for task in row:
                if task is None:
                    continue
                q, k, i = int(task.stage), int(task.micro_batch), int(task.slice or 0)
                if task.phase == Phase.F:
                    self._forward(q, k, i, env, vjps, leaf_on)
                else:
                    self._backward(q, k, i, env, vjps, cts, grads, losses)
        apply_sharding = self.shardings[0]
        grad_leaves = []
        for j in call.grad_order:
            g = grads.get(j)
            grad_leaves.append(jnp.zeros(leaves[j].shape, leaves[j].dtype) if g is None else g)
        grad_leaves = [jax.device_put(g, apply_sharding) for g in grad_leaves]
        loss = sum(jax.device_put(x, apply_sharding) for x in losses)
        if self._check_contract:
            self._verify_loss(leaves, loss, apply_sharding)
        out = self._apply(jax.device_put(flat, apply_sharding), grad_leaves, loss)
        self.last_step_seconds = time.perf_counter() - start_time
        return out

    def _forward(self, q, k, i, env, vjps, leaf_on):
        prog = self.programs[i]
        part = prog.parts[q]
        local = env.setdefault((k, i), {})
        leaf_index = {v: j for j, v in enumerate(prog.leaf_vars)}
        consts = dict(zip(prog.closed.jaxpr.constvars, prog.closed.consts, strict=True))
        values = []
        for v in part.inputs:
            if v in local:
                values.append(jax.device_put(local[v], self.shardings[q]))
            elif v in leaf_index:
                values.append(leaf_on(leaf_index[v], q, (k, i)))
            elif v in prog.prefix_vars:
                call_n, j, kv = prog.prefix_vars[v]
                if i == 0:
                    values.append(jax.device_put(jnp.zeros(v.aval.shape, v.aval.dtype), self.shardings[q]))
                else:
                    source = self.programs[j]
                    values.append(env[(k, j)][source.kv_vars[call_n][kv]])
            elif v in consts:
                values.append(jax.device_put(consts[v], self.shardings[q]))
            else:
                raise RuntimeError(f"stage {q} of slice {i} reads {v}, which nothing provides")
        outs, vjp = self._fwd[(i, q)](*values)
        local.update(zip(part.outputs, outs, strict=True))
        vjps[(q, k, i)] = vjp

    def _backward(self, q, k, i, env, vjps, cts, grads, losses):
        prog = self.programs[i]
        part = prog.parts[q]
        pending = cts.setdefault((k, i), {})
        if prog.loss_var in part.outputs:
            losses.append(env[(k, i)][prog.loss_var])
            pending[prog.loss_var] = jnp.ones((), prog.loss_var.aval.dtype)
        cotangents = [pending.pop(v, None) for v in part.outputs]
        inputs_ct = self._bwd[(i, q)](vjps.pop((q, k, i)), cotangents)
        leaf_index = {v: j for j, v in enumerate(prog.leaf_vars)}
        for v, g in zip(self._diff_inputs[(i, q)], inputs_ct, strict=True):
            if v in prog.producer:
                _accumulate(pending, v, jax.device_put(g, self.shardings[prog.producer[v]]))
            elif v in leaf_index:
                j = leaf_index[v]
                if self.call.differentiated[j]:
                    grads[j] = g if j not in grads else grads[j] + jax.device_put(g, grads[j].sharding)
            elif v in prog.prefix_vars and i > 0:
                call_n, j, kv = prog.prefix_vars[v]
                _accumulate(cts.setdefault((k, j), {}), self.programs[j].kv_vars[call_n][kv], g)

    def _verify_loss(self, leaves, loss, sharding) -> None:
        """Contract points 3-4: the weighted slice losses must add up to the unsliced loss."""
        self._check_contract = False
        whole = self._unsliced_loss(jax.device_put(leaves, sharding))
        if not np.allclose(np.asarray(loss), np.asarray(whole), rtol=1e-4, atol=1e-6):
            raise TerapipeContractError(
                f"token slices {list(self.token_slices)} give loss {float(loss):.6g} but the unsliced loss is "
                f"{float(whole):.6g}: the model breaks the TeraPipe contract. Positions must come from the inputs "
                "(e.g. batch['position_ids'], sliced like the tokens; not arange(seq) inside the model), every "
                "cross-token operation must be alpa_like.nn.causal_self_attention, and the loss must be a mean "
                "over all batch x sequence tokens")


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
        raise TerapipeContractError("pipeline_schedule='terapipe' needs batch inputs [batch, seq, ...] in the loss")
    if len(set(lengths.values())) != 1:
        raise TerapipeContractError(f"pipeline_schedule='terapipe' needs every batch input to have the same "
                                    f"sequence length (dim 1); got {lengths}")
    return next(iter(lengths.values()))

