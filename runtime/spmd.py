"""Compile and run a single-stage (SPMD) plan on local devices with `jax.jit` and GSPMD."""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Var
from jax.sharding import NamedSharding

from alpa_like.compiler import jax_compat
from alpa_like.compiler.grad_accumulation import make_step_fn, split_at_grad_marker
from alpa_like.compiler.gradient_sync import NONE, DeferredGradients, deferrable_gradients
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.micro_batch_keys import seeds_keys
from alpa_like.compiler.propagation import follow_layouts
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.trace import TracedStep
from alpa_like.compiler.spmd_layout import SpmdLayout, batch_axes, largest_dim_spec
from alpa_like.runtime import hlo_stats, partial_sums
from alpa_like.runtime.mesh import has_layout, make_mesh, named_sharding


def _pin_grads_hook(mesh, data_axes: Sequence[int]) -> jax_compat.EqnHook:
    """Pins each gradient (value of the grad marker) to its largest dim split over the data axes, so
    XLA reduce-scatters the gradients and updates a shard (ZeRO)."""
    num_shards = math.prod(mesh.devices.shape[a] for a in data_axes)

    def hook(eqn, outvals):
        if not is_marker(eqn, "grad"):
            return outvals
        out = []
        for v in outvals:
            spec = largest_dim_spec(v.shape, num_shards, axis=data_axes[0])
            out.append(jax.lax.with_sharding_constraint(v, named_sharding(mesh, spec)))
        return out
    return hook


def pin_hook(mesh, pins: Sequence[tuple[Any, int, ShardingSpec]]) -> jax_compat.EqnHook:
    """An equation hook (:func:`~alpa_like.compiler.jax_compat.eval_eqns`) that pins value ``k`` of equation
    ``eqn`` to ``spec`` for each ``(eqn, k, spec)`` of ``pins``: its outputs when used as ``hook``, its
    operands as that equation reads them when used as ``operand_hook``."""
    pinned: dict[int, dict[int, NamedSharding]] = {}
    for eqn, k, spec in pins:
        pinned.setdefault(id(eqn), {})[k] = named_sharding(mesh, spec)

    def hook(eqn, values):
        mine = pinned.get(id(eqn))
        if not mine:
            return values
        return [jax.lax.with_sharding_constraint(v, mine[k]) if k in mine else v for k, v in enumerate(values)]
    return hook


def _chain_hooks(hooks: Sequence[jax_compat.EqnHook]) -> jax_compat.EqnHook | None:
    if not hooks:
        return None

    def hook(eqn, outvals):
        for h in hooks:
            outvals = h(eqn, outvals)
        return outvals
    return hook


def deferred_gradients(closed: ClosedJaxpr, layout: SpmdLayout, batch_mask: Sequence[bool],
                       value_pins: Sequence = (), operand_pins: Sequence = (),
                       inlined: frozenset = frozenset()) -> DeferredGradients:
    """The results of al.grad (gradients, a mean loss) whose all-reduce over the mesh can wait for the last
    micro-batch: the per-micro-batch equations keep them as stacks of per-shard partial sums
    (:func:`~alpa_like.compiler.gradient_sync.deferrable_gradients`), summed once per step. Exact algebra;
    only the order of float additions changes.

    The analysis reads the layouts of values: the intra-op pass's pins (``value_pins``, ``operand_pins``:
    ``(eqn, k, spec)`` on ``closed``'s equations) when it made them, with the layouts that follow from them
    for the ``inlined`` values (computed in checkpoint blocks, which the ILP pins only at their results);
    otherwise the layouts that follow from the leaves' (:func:`~alpa_like.compiler.propagation.follow_forward`:
    data parallelism's batch split), leaving out the leaves gathered whole for compute (ZeRO-3's parameters).
    """
    if len(layout.mesh_shape) > 2:  # the strategies behind follow_forward know 1-D and 2-D meshes
        return NONE
    split = split_at_grad_marker(closed, batch_mask)
    eqns = closed.jaxpr.eqns
    var_specs = {v: spec for v, spec, role in zip(closed.jaxpr.invars, layout.in_specs, layout.roles, strict=True)
                 if role not in layout.gathered_roles}
    if value_pins:
        var_specs.update({eqn.outvars[k]: spec for eqn, k, spec in value_pins})
        if inlined:
            followed = follow_layouts(eqns, var_specs, layout.mesh_shape)
            var_specs.update({v: spec for v, spec in followed.items() if v in inlined and v not in var_specs})
    else:
        var_specs = follow_layouts(eqns, var_specs, layout.mesh_shape)
    operand_specs = {(id(eqn), k): spec for eqn, k, spec in operand_pins}
    results = [v for v in split.marker.invars if isinstance(v, Var)]
    return deferrable_gradients(split.per_micro_batch, results, results, var_specs, operand_specs,
                                tuple(layout.mesh_shape), before=split.hoisted)


def pins_after_inlining(pins: Sequence, inlined_eqns: Sequence, operands: bool) -> list:
    """``pins`` ``(eqn, k, spec)`` on a jaxpr's equations moved onto ``inlined_eqns``, the equations once
    :func:`~alpa_like.compiler.jax_compat.inline_remat` inlined its checkpoint calls: a pin on a call's result
    goes to the equation of its body that now computes it; one on its operand goes to its optimization
    barrier (dropped without one: ``prevent_cse=False``); pins on equations of neither are dropped."""
    kept = {id(e) for e in inlined_eqns}
    producer = {v: (e, k) for e in inlined_eqns for k, v in enumerate(e.outvars)}
    barrier_of = {}
    for e in inlined_eqns:
        if e.primitive.name == "optimization_barrier":
            barrier_of[tuple(id(v) for v in e.invars)] = e
    out = []
    for eqn, k, spec in pins:
        if id(eqn) in kept:
            out.append((eqn, k, spec))
        elif not operands and eqn.outvars[k] in producer:
            out.append((*producer[eqn.outvars[k]], spec))
        elif operands and isinstance(eqn.invars[k], Var):
            variables = [v for v in eqn.invars if isinstance(v, Var)]
            barrier = barrier_of.get(tuple(id(v) for v in variables))
            if barrier is not None:
                out.append((barrier, variables.index(eqn.invars[k]), spec))
    return out


def _micro_batch_pin(mesh, batch_specs: Sequence[ShardingSpec]) -> Callable:
    shardings = [named_sharding(mesh, s) for s in batch_specs]

    def pin(values):
        return [jax.lax.with_sharding_constraint(v, s) for v, s in zip(values, shardings, strict=True)]
    return pin


@dataclasses.dataclass
class CompiledSpmd:
    """What compiling an SPMD layout produced."""

    compiled: Any
    mesh: Any
    in_shardings: tuple[NamedSharding, ...]
    out_specs: tuple[ShardingSpec | None, ...]
    """The output specs XLA used (None where the sharding is not a NamedSharding)."""
    compile_seconds: float
    donated_argnums: tuple[int, ...] = ()
    """The step's positional arguments whose buffers the executable donates."""


def compile_spmd(traced: TracedStep, layout: SpmdLayout, devices: Sequence[Any], *, num_micro_batches: int,
                 donate_flat: Sequence[int] = ()) -> CompiledSpmd:
    """jit-compiles the traced step with the layout's shardings on ``devices``."""
    start = time.perf_counter()
    mesh = make_mesh(devices, layout.mesh_shape, layout.axis_names)
    in_shardings = tuple(named_sharding(mesh, s) for s in layout.in_specs)
    out_shardings = [None if s is None else named_sharding(mesh, s) for s in layout.out_specs]
    batch_mask = [r == "batch" for r in layout.roles]
    batch_specs = [s for s, b in zip(layout.in_specs, batch_mask, strict=True) if b]
    hooks = []
    eqns = traced.closed_jaxpr.jaxpr.eqns
    data_axes = batch_axes(layout)
    if layout.shard_grads and data_axes:
        hooks.append(_pin_grads_hook(mesh, data_axes))
    closed = traced.closed_jaxpr
    value_pins = [(eqns[i], k, spec) for i, k, spec in layout.eqn_constraints]
    operand_pins = [(eqns[i], k, spec) for i, k, spec in layout.operand_constraints]
    inlined = frozenset()
    if num_micro_batches > 1:
        # the gradients a checkpointed block's backward computes are deferred too; a block that makes a key
        # from a seed stays a call, so that every method folds the same keys (micro_batch_keys.unfoldable_draws)
        closed = closed.replace(jaxpr=jax_compat.inline_remat(closed.jaxpr, keep=seeds_keys))
        now = closed.jaxpr.eqns
        value_pins = pins_after_inlining(value_pins, now, operands=False)
        operand_pins = pins_after_inlining(operand_pins, now, operands=True)
        traced_ids = {id(e) for e in eqns}
        inlined = frozenset(v for e in now if id(e) not in traced_ids for v in e.outvars)
    deferred = (deferred_gradients(closed, layout, batch_mask, value_pins, operand_pins, inlined)
                if num_micro_batches > 1 else NONE)
    if value_pins:  # values computed as stacks of partial sums are pinned to stacked layouts
        hooks.append(pin_hook(mesh, partial_sums.stacked_pins(value_pins, deferred)))
    hook = _chain_hooks(hooks)
    operand_hook = pin_hook(mesh, operand_pins) if operand_pins else None
    def deferred_eval(micro_eqns, env, micro_operand_hook):
        partial_sums.eval_eqns(micro_eqns, env, deferred, mesh, hook=hook, operand_hook=micro_operand_hook)
    micro_batch_eval = deferred_eval if deferred else None
    stack_sizes = {v: math.prod(layout.mesh_shape[a] for a in axes) for v, axes in deferred.outputs.items()}
    flat_step = make_step_fn(closed, batch_mask, num_micro_batches=num_micro_batches, eqn_hook=hook,
                        operand_hook=operand_hook,
                        on_micro_batch=_micro_batch_pin(mesh, batch_specs) if num_micro_batches > 1 else None,
                        micro_batch_eval=micro_batch_eval, stack_sizes=stack_sizes, after_grad=traced.after_grad)
    def step(*dynamic_args):  # the step's own argument pytrees: JAX's C++ call path flattens them
        return jax.tree.unflatten(traced.out_tree, flat_step(*jax.tree.leaves(dynamic_args)))

    donated = {traced.in_leaves[k].arg_index for k in donate_flat}
    jitted = jax.jit(step, in_shardings=jax.tree.unflatten(traced.in_tree, in_shardings),
                     out_shardings=jax.tree.unflatten(traced.out_tree, out_shardings),
                     donate_argnums=tuple(p for p, i in enumerate(traced.dynamic_argnums) if i in donated))
    avals = [jax.ShapeDtypeStruct(leaf.shape, v.aval.dtype)  # the jaxpr's dtype: a typed PRNG key's is no string
             for leaf, v in zip(traced.in_leaves, traced.closed_jaxpr.jaxpr.invars, strict=True)]
    compiled = jitted.lower(*jax.tree.unflatten(traced.in_tree, avals)).compile()
    out_specs = []
    for leaf, sharding in zip(traced.out_leaves, jax.tree.leaves(compiled.output_shardings), strict=True):
        if isinstance(sharding, NamedSharding):
            out_specs.append(ShardingSpec.from_partition_spec(sharding.spec, layout.axis_names, len(leaf.shape)))
        else:
            out_specs.append(None)
    return CompiledSpmd(compiled=compiled, mesh=mesh, in_shardings=in_shardings, out_specs=tuple(out_specs),
                        compile_seconds=time.perf_counter() - start, donated_argnums=tuple(sorted(donated)))


def is_deleted(x) -> bool:
    """Whether ``x`` is a jax array whose buffers were deleted (donated to an earlier call)."""
    return isinstance(x, jax.Array) and x.is_deleted()


def place_args(flat: Sequence[Any], shardings: Sequence[NamedSharding]) -> list[Any]:
    """``flat`` with every leaf on its sharding: leaves already there (last step's outputs) are passed as
    they are, the others are moved with one batched ``jax.device_put``.

    A ``device_put`` per leaf costs ~20 us of Python and dispatch even when nothing moves, which was ~2 ms
    of a 15 ms gpt-tiny step (88 leaves).
    """
    out = list(flat)
    moves = [i for i, (x, s) in enumerate(zip(flat, shardings, strict=True))
             if not has_layout(x, s)]
    if moves:
        moved = jax.device_put([flat[i] for i in moves], [shardings[i] for i in moves])
        for i, x in zip(moves, moved, strict=True):
            out[i] = x
    return out


class InputsNotLaidOut(Exception):
    """The arguments of a call are not of the compiled signature and layouts (see
    :meth:`SpmdExecutable.call_as_laid_out`)."""


class SpmdExecutable:
    """A compiled step for one input signature: call it like the original function.

    Attributes:
      plan: the :class:`ParallelPlan` it runs.
    """

    def __init__(self, *, traced: TracedStep, plan, compiled: CompiledSpmd):
        self.traced = traced
        self.plan = plan
        self._compiled = compiled

    @property
    def mesh(self):
        return self._compiled.mesh

    @property
    def compile_seconds(self) -> float:
        return self._compiled.compile_seconds

    def __call__(self, *args):
        try:
            return self.call_as_laid_out(*args)
        except InputsNotLaidOut:
            flat = place_args(self.traced.flatten_args(args), self._compiled.in_shardings)
            return self._compiled.compiled(*jax.tree.unflatten(self.traced.in_tree, flat))

    def call_as_laid_out(self, *args):
        """The step, through JAX's own call path (its C++ checks of the arguments' types and layouts, no
        Python per leaf), when every argument already has the signature and layout the step was compiled for
        (host arrays count as laid out: they are copied in); :class:`InputsNotLaidOut` otherwise. A deleted
        array where the step donates is a ValueError naming it (:meth:`_check_donated_alive`)."""
        self._check_donated_alive(args)
        try:
            return self._compiled.compiled(*(args[i] for i in self.traced.dynamic_argnums))
        except (TypeError, ValueError, IndexError) as e:
            raise InputsNotLaidOut(str(e)) from None

    def _check_donated_alive(self, args) -> None:
        """When an argument the step donates holds a deleted array (a state donated to an earlier call), the
        ValueError of :meth:`TracedStep.flatten_args`, which names it: XLA's CPU client (jaxlib 0.10) crashes
        the process (SIGSEGV) when a compiled step that donates is handed a donated array sharded over
        several devices a second time."""
        for i in self._compiled.donated_argnums:
            if i < len(args) and any(is_deleted(x) for x in jax.tree.leaves(args[i])):
                self.traced.flatten_args(args)  # checks every leaf: the ValueError names the deleted one

    def input_shardings(self) -> tuple[NamedSharding, ...]:
        """Per flat input leaf (``traced.in_leaves``), the layout the step takes it in: an argument already
        laid out so is passed as it is."""
        return tuple(self._compiled.in_shardings)

    def get_hlo_text(self) -> str:
        """The optimized, partitioned HLO that runs on each device."""
        return self._compiled.compiled.as_text()

    def cost_analysis(self) -> dict[str, float]:
        """XLA's per-device cost analysis (flops, bytes accessed, ...)."""
        analysis = self._compiled.compiled.cost_analysis()
        return dict(analysis[0] if isinstance(analysis, (list, tuple)) else analysis)

    def memory_analysis(self):
        """XLA's per-device memory figures (argument, output, temp bytes)."""
        return self._compiled.compiled.memory_analysis()

    def collectives(self) -> list[hlo_stats.HloCollective]:
        """The collectives XLA inserted, from the compiled HLO."""
        return hlo_stats.collectives(self.get_hlo_text())
