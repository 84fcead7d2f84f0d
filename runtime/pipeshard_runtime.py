"""The local MPMD backend: run a pipeline plan's instruction programs on disjoint sets of local devices.

One process drives every mesh. Stage pieces are jitted once per mesh (XLA compiles them on the first step);
buffers live on their mesh as ``jax.Array``s; a RUN donates the per-micro-batch buffers whose last use it is
(the ``FREE`` that follows it in the program), so XLA may reuse their memory for the piece's outputs, unless a
buffer is shared: a LOAD's ``device_put`` keeps the source's buffer on a device where the source already holds
the shard the layout asks for (a replicated batch slice on the slice's own device, for one), and that buffer
belongs to the micro-batch slice that other meshes still LOAD;
``RECV`` moves a buffer between meshes with the resharding plan of :mod:`alpa_like.runtime.resharding`. JAX's asynchronous dispatch lets meshes compute concurrently
while the driver walks the global instruction order. When the program replicates an update on several meshes
(a tied embedding: :func:`~alpa_like.compiler.stage_construction.replicated_updates`), the step returns one
mesh's copy and keeps the others until the next step, whose LOAD of that very array on those meshes takes
their own copy instead of copying it across meshes (:attr:`StepStats.own_copy_loads`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from alpa_like.compiler import jax_compat
from alpa_like.compiler.grad_accumulation import from_micro_batches, to_micro_batches
from alpa_like.compiler.micro_batch_keys import KeyDraws, fold_micro_batch_index
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.gradient_sync import NONE, DeferredGradients
from alpa_like.compiler.stage_construction import StageProgram, ValueId, micro_batch_key_draws
from alpa_like.compiler.stage_sharding import StageSharding
from alpa_like.compiler.trace import updated_inputs
from alpa_like.runtime.accumulation import FusedAccumulation
from alpa_like.runtime.instructions import PER_STEP, Instruction, MeshPrograms, Op, buffer_key
from alpa_like.runtime.mesh import has_layout, make_mesh, named_sharding
from alpa_like.runtime.resharding import layout_of, plan_resharding, reshard
from alpa_like.runtime.partial_sums import eval_piece, stacked_pins, step_means
from alpa_like.runtime.spmd import is_deleted, pin_hook
from alpa_like.runtime.stage_gradients import GradientDeferral, defer_gradients, stage_phases

MESH_AXES = ("x", "y")


def activation_spec(shape: Sequence[int], mesh_shape: Sequence[int]) -> ShardingSpec:
    """Layout of a value received from another mesh (or a batch read on a mesh): dim 0 (the micro-batch)
    split over every mesh axis if that divides it, else over the first single axis that does; the rest
    replicated. Axes of size 1 split nothing and are left out (so the spec is one a strategy names).

    >>> str(activation_spec((8, 3), (2, 4))), str(activation_spec((4, 3), (2, 4))), str(activation_spec((3,), (8,)))
    ('S01R', 'S0R', 'R')
    >>> str(activation_spec((4, 3), (1, 4)))
    'S1R'
    """
    if not shape:
        return ShardingSpec.replicated(0)
    every = tuple(a for a in range(len(mesh_shape)) if mesh_shape[a] > 1)
    if not every:
        return ShardingSpec.replicated(len(shape))
    for axes in (every, *((a,) for a in every if (a,) != every)):
        shards = math.prod(mesh_shape[a] for a in axes)
        if shards > 1 and shape[0] % shards == 0:
            return ShardingSpec(axes=(axes,) + ((),) * (len(shape) - 1))
    return ShardingSpec.replicated(len(shape))


@dataclasses.dataclass
class StepStats:
    """Where the last step's time went."""

    seconds: float = 0.0
    instructions: int = 0
    bytes_moved: int = 0
    """Bytes sent across meshes by RECV."""
    donated_buffers: int = 0
    """Buffers a RUN donated to XLA (their last use; see the module docstring)."""
    own_copy_loads: int = 0
    """Per-step LOADs of a value the previous step returned that the mesh took from its own copy (a
    replicated update: :attr:`~alpa_like.runtime.instructions.MeshPrograms.output_copies`) instead of
    copying it from the mesh the step returned it from."""
    op_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """With ``profile=True``: seconds per instruction kind, each instruction waited for (so the rest of
    ``seconds`` is the driver's own work)."""
    spans: list[tuple[int, str, float, float]] = dataclasses.field(default_factory=list)
    """With ``profile=True``: (mesh, instruction, start, end) in seconds from the start of the step."""
    peak_live_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    """With ``track_memory=True``: per mesh, the most bytes of live arrays (``jax.live_arrays()``: the
    caller's too, e.g. the state it passed in) one of its devices held after any instruction."""

    @property
    def driver_seconds(self) -> float:
        return self.seconds - sum(self.op_seconds.values())


class PipeshardExecutable:
    """A compiled pipeline step: call it like the original function."""

    def __init__(self, *, traced, plan, program: StageProgram, programs: MeshPrograms, devices: Sequence[Any],
                 input_specs: dict[int, ShardingSpec], stage_shardings: Sequence[StageSharding] | None = None,
                 value_specs: dict[tuple[ValueId, int], ShardingSpec] | None = None,
                 defer_gradient_sync: bool = False, donate_flat: Sequence[int] = ()):
        """``input_specs``: the layout of step inputs (parameters) on every mesh that loads them;
        ``stage_shardings``: per stage, the ILP's layouts pinned inside its pieces (None: XLA propagates from
        the inputs' layouts); ``value_specs``: ``(value, mesh) -> spec`` of what a mesh loads or receives
        (default: :func:`activation_spec`); ``defer_gradient_sync`` (needs ``stage_shardings``): gradients
        whose all-reduce can wait are accumulated as stacks of partial sums and reduced once per step
        (:mod:`alpa_like.compiler.gradient_sync`); ``donate_flat``: the flat input leaves the step may donate
        (``donate_argnums``): each is donated to the last RUN that reads it on its mesh
        (:func:`input_donations`)."""
        self.traced = traced
        self.plan = plan
        self.num_micro_batches = plan.num_micro_batches
        by_id = {d.id: d for d in devices}
        self.meshes = [make_mesh([by_id[i] for i in stage.device_ids], stage.logical_mesh_shape, MESH_AXES)
                       for stage in plan.stages]
        self._input_specs = input_specs
        self.value_specs = dict(value_specs or {})
        self.programs = programs
        deferral = GradientDeferral(program=program, stage_shardings=tuple(stage_shardings or ()))
        if defer_gradient_sync and stage_shardings:
            deferral = defer_gradients(program, stage_shardings, [tuple(m.devices.shape) for m in self.meshes],
                                       programs.stage_to_mesh, self._load_spec)
        self._deferral = deferral
        self.program = program = deferral.program
        self.stage_shardings = stage_shardings = deferral.stage_shardings
        self.deferred: dict[int, DeferredGradients] = {q: deferral.deferred.get(q, NONE)
                                                      for q in range(len(stage_shardings))}
        """Per stage, the gradients its backward piece outputs as stacks of partial sums."""
        self._stack_targets: dict[ValueId, Any] = {
            dst: None if spec is None else named_sharding(self.meshes[programs.stage_to_mesh[q]], spec)
            for dst, (q, spec) in deferral.stack_specs.items()}
        """Accumulators of stacks -> the sharding of their step mean (None: XLA's choice)."""
        self._hooks: dict[tuple[int, str], tuple] = {}
        for q, sharding in enumerate(stage_shardings):
            mesh = self.meshes[programs.stage_to_mesh[q]]
            for phase in stage_phases(program, q):
                mine = deferral.piece_deferred(q, phase)
                self._hooks[(q, phase)] = (*piece_hooks(sharding, mine, mesh), mine, mesh)
        self._draws = micro_batch_key_draws(program, self.num_micro_batches)
        """(stage, phase) -> the piece's draws from per-step keys: it takes the micro-batch's index last."""
        self._jitted: dict[tuple, Any] = {}
        self._fused: dict[tuple, Any] = {}
        self._ran: dict[tuple[int, str], tuple[Any, tuple]] = {}
        """(stage, phase) -> the jitted function its first RUN called and that call's argument specs (weak types
        included): lowering them again finds the step's executable in jax's cache (get_hlo_text)."""
        self._reshard_plans: dict[tuple, Any] = {}
        self._indices: dict[tuple[int, int], jax.Array] = {}
        self._own_copies: dict[int, tuple[Any, dict[int, Any]]] = {}
        """id of an array the last step returned -> (that array, {mesh: the same value on that mesh})."""
        self._shared_loads: list[jax.Array] = []
        """This step's LOADed micro-batch buffers that share a device buffer with their source: never donated
        (held, so that their ids are not recycled while the step runs)."""
        self._input_names = {v: leaf.path for v, leaf in zip(program.step_inputs, traced.in_leaves, strict=True)}
        self._input_donations = input_donations(programs, program, [program.step_inputs[k] for k in donate_flat])
        """Instruction index of a RUN -> the step inputs' per-step buffers it donates."""
        layouts = self._return_layouts(updated_inputs(traced.in_leaves, traced.out_leaves))
        self._out_pins, pinned = self._output_pins(layouts)
        """(stage, phase) -> per piece output, the layout it is made in (None: XLA's choice): the new value of a
        step input in the layout its mesh loads the input in, so that donation reuses the input's buffers and
        the next step loads it as it is."""
        self._output_shardings = {k: sharding for k, sharding in layouts.items() if k not in pinned}
        """Output index -> the sharding the step moves it to at its end (those its piece does not make there)."""
        self.last_step = StepStats()

    def __call__(self, *args):
        return self.run(*args)

    @property
    def num_piece_executables(self) -> int:
        """How many jitted stage-piece functions exist (one per piece, donation pattern and fused
        accumulation): stops growing after the first two steps."""
        return len(self._jitted) + len(self._fused)

    def run(self, *args, profile: bool = False, track_memory: bool = False):
        """One step. With ``profile`` every instruction is waited for and timed, with ``track_memory`` the live
        bytes on each mesh are summed after every instruction (:attr:`StepStats.peak_live_bytes`); both are
        slower, for measurement."""
        start = time.perf_counter()
        flat = self.traced.flatten_args(args)
        stats = StepStats()
        buffers: list[dict] = [dict() for _ in self.meshes]
        accumulators: list[dict] = [dict() for _ in self.meshes]
        inputs = dict(zip(self.program.step_inputs, flat, strict=True))
        inputs.update(self.program.constants)
        micro = {}
        instructions = self.programs.instructions
        i = 0
        while i < len(instructions):
            ins = instructions[i]
            donated_inputs = self._input_donations.get(i, frozenset())
            i += 1
            stats.instructions += 1
            t0 = time.perf_counter() if profile else 0.0
            if ins.op is Op.RUN:  # fused with the ACC instructions that follow it
                accs, frees = [], []
                while i < len(instructions) and instructions[i].op in (Op.ACC, Op.FREE):
                    (accs if instructions[i].op is Op.ACC else frees).append(instructions[i])
                    i += 1
                stats.instructions += len(accs) + len(frees)
                stats.donated_buffers += self._run(ins, accs, buffers, accumulators, freed={f.key for f in frees},
                                                   donated_inputs=donated_inputs)
                for key in (*(f.key for f in frees), *donated_inputs):
                    buffers[ins.mesh].pop(key, None)
            elif ins.op is Op.MEAN:
                group = [ins]
                while i < len(instructions) and instructions[i].op is Op.MEAN:
                    group.append(instructions[i])
                    i += 1
                stats.instructions += len(group) - 1
                self._mean(group, buffers, accumulators)
            else:
                self._execute(ins, buffers, inputs, micro, stats)
            if profile:
                jax.block_until_ready((buffers[ins.mesh], accumulators[ins.mesh]))  # a RUN may only accumulate
                t1 = time.perf_counter()
                stats.op_seconds[str(ins.op)] = stats.op_seconds.get(str(ins.op), 0.0) + t1 - t0
                stats.spans.append((ins.mesh, str(ins), t0 - start, t1 - start))
            if track_memory:  # waits for each instruction; the walk over the live arrays counts as driver time
                jax.block_until_ready((buffers[ins.mesh], accumulators[ins.mesh]))
                for mesh, held in live_bytes_per_mesh(self.meshes).items():
                    stats.peak_live_bytes[mesh] = max(stats.peak_live_bytes.get(mesh, 0), held)
        self._shared_loads = []  # not kept past the step, like its micro-batch slices
        outputs = []
        copies = self.programs.output_copies or ((),) * len(self.programs.outputs)
        self._own_copies = {}
        for k, (out, others) in enumerate(zip(self.programs.outputs, copies, strict=True)):
            if out is None:
                outputs.append(self.program.literal_outputs[k])
            else:
                key, mesh = out
                outputs.append(buffers[mesh][key])
                if (target := self._output_shardings.get(k)) is not None and not has_layout(outputs[-1], target):
                    outputs[-1] = jax.device_put(outputs[-1], target)
                if others:  # kept (with the array, so its id is not recycled) for the next step's LOADs
                    self._own_copies[id(outputs[-1])] = (outputs[-1], {m: buffers[m][key] for m in others})
        stats.seconds = time.perf_counter() - start
        self.last_step = stats
        return jax.tree_util.tree_unflatten(self.traced.out_tree, outputs)

    def input_placements(self) -> tuple[dict[int, NamedSharding], ...]:
        """Per flat input leaf (``traced.in_leaves``), the meshes that load it, each with the layout it loads
        it in (in the order of their first LOAD); empty for a leaf no mesh reads."""
        meshes: dict[ValueId, list[int]] = {}
        for ins in self.programs.instructions:
            if ins.op is Op.LOAD and ins.mesh not in meshes.setdefault(ins.key[0], []):
                meshes[ins.key[0]].append(ins.mesh)
        return tuple({m: self._load_sharding(v, leaf.shape, m) for m in meshes.get(v, ())}
                     for v, leaf in zip(self.program.step_inputs, self.traced.in_leaves, strict=True))

    def input_shardings(self) -> tuple[NamedSharding | None, ...]:
        """Per flat input leaf (``traced.in_leaves``), the layout the step loads it in on the first mesh that
        loads it (an argument already laid out so is taken as it is there), or None when no mesh reads it."""
        return tuple(next(iter(placed.values()), None) for placed in self.input_placements())

    def _output_pins(self, layouts: dict[int, NamedSharding]) -> tuple[dict, set[int]]:
        """The pieces' output pins that make each output in its layout (``layouts``: output index ->
        sharding) where its piece runs on that layout's mesh, and the outputs they cover."""
        made = {(v, self.programs.stage_to_mesh[stage]): (stage, phase)
                for (stage, phase), piece in self.program.pieces.items() for v in piece.outputs}
        targets, pinned = [], set()
        for k, target in layouts.items():
            (v, _), mesh = self.programs.outputs[k]
            where = made.get((v, mesh))
            if where is None or target.device_set != set(self.meshes[mesh].devices.flat):
                continue
            targets.append((where, v, target))
            pinned.add(k)
        return self.program.output_slots(targets), pinned

    def _return_layouts(self, sources: Sequence[int | None]) -> dict[int, NamedSharding]:
        """Per output, given the input each one updates (:func:`~alpa_like.compiler.trace.updated_inputs`),
        where the step returns it: the new value of an input in the layout its mesh loads the input in (so that
        the next step, or a donation, takes it as it is); a value that updates no input (a metric, a loss, an
        aux) replicated on the last stage's mesh, so that the outputs of one step can be combined."""
        loaded = {(ins.key[0], ins.mesh) for ins in self.programs.instructions if ins.op is Op.LOAD}
        metrics = NamedSharding(self.meshes[self.programs.stage_to_mesh[-1]], jax.sharding.PartitionSpec())
        out = {}
        for k, (where, source) in enumerate(zip(self.programs.outputs, sources, strict=True)):
            if where is None:
                continue
            if source is None:
                out[k] = metrics
                continue
            v, mesh = self.program.step_inputs[source], where[1]
            if (v, mesh) in loaded:
                out[k] = self._load_sharding(v, self.traced.out_leaves[k].shape, mesh)
        return out

    # ------------------------------------------------------------------------------------------ execution

    def _run(self, ins: Instruction, accs: list[Instruction], buffers, accumulators, freed=frozenset(),
             donated_inputs=frozenset()) -> int:
        """RUN, and the ACCs of its outputs inside the same jitted call (:class:`FusedAccumulation`).

        ``freed``: keys the program frees right after this RUN; those among its inputs are donated, and so are
        ``donated_inputs`` (donated step inputs read here for the last time on the mesh).
        Returns the number of donated buffers.
        """
        mesh_buffers, acc = buffers[ins.mesh], accumulators[ins.mesh]
        piece = self.program.piece(ins.stage, ins.phase)
        rows = [a for a in accs if a.target in self.program.per_example]
        accs = [a for a in accs if a not in rows]
        keys = [buffer_key(mesh_buffers, v, ins.micro_batch) for v in piece.inputs]
        args = [mesh_buffers[k] for k in keys]
        if (ins.stage, ins.phase) in self._draws:
            args.append(self._micro_batch_index(ins.mesh, ins.micro_batch))
        held = self._held_elsewhere(acc)
        donate = donated_positions(keys, freed, [id(x) in held for x in args], donated_inputs)
        if accs:
            position = {v: k for k, v in enumerate(piece.outputs)}
            fused = self._fused_call(ins.stage, ins.phase, tuple(position[a.key[0]] for a in accs), donate)
            specs = None if (ins.stage, ins.phase) in self._ran else arg_specs(args)
            with _quiet_unusable_donations():
                outs, sums = fused([acc.get(a.target) for a in accs], *args)
            if specs is not None:
                fn, leading = fused.first_call
                self._ran[(ins.stage, ins.phase)] = (fn, (*leading, *specs))
            acc.update({a.target: x for a, x in zip(accs, sums, strict=True)})
        else:
            fn = self._piece_executable(ins.stage, ins.phase, donate)
            if (ins.stage, ins.phase) not in self._ran:
                self._ran[(ins.stage, ins.phase)] = (fn, tuple(arg_specs(args)))
            with _quiet_unusable_donations():
                outs = fn(*args)
        for v, x in zip(piece.outputs, outs, strict=True):
            mesh_buffers[(v, ins.micro_batch)] = x
        for a in rows:  # a per-example value: this micro-batch's rows, put together by MEAN
            acc.setdefault(a.target, {})[a.key[1]] = mesh_buffers[a.key]
        return len(donate)

    def _held_elsewhere(self, accumulators: dict) -> set[int]:
        """Ids of the arrays a RUN must not donate: LOADed micro-batch buffers that share a device buffer with
        the slice they were put from (:func:`shares_buffers`: the slice itself when it is already in place)
        and ``accumulators``' values. Every one is alive while the set is used, so no id is a recycled one
        (donation, and with it the executable a RUN uses, stays the same from step to step)."""
        return {id(x) for x in self._shared_loads} | {id(x) for x in accumulators.values()} | {
            id(x) for rows in accumulators.values() if isinstance(rows, dict) for x in rows.values()}

    def _piece_executable(self, stage: int, phase: str, donate: tuple[int, ...] = ()):
        fn = self._jitted.get((stage, phase, donate))
        if fn is None:
            piece = self.program.piece(stage, phase)
            fn = self._jitted[(stage, phase, donate)] = jax.jit(
                _piece_fn(piece, *self._hooks.get((stage, phase), ()), draws=self._draws.get((stage, phase), ()),
                          out_pins=self._out_pins.get((stage, phase), ())),
                donate_argnums=donate)
        return fn

    def _fused_call(self, stage: int, phase: str, slots: tuple[int, ...], donate: tuple[int, ...]
                    ) -> FusedAccumulation:
        fused = self._fused.get((stage, phase, slots, donate))
        if fused is None:
            fused = self._fused[(stage, phase, slots, donate)] = FusedAccumulation(
                _piece_fn(self.program.piece(stage, phase), *self._hooks.get((stage, phase), ()),
                          draws=self._draws.get((stage, phase), ()), out_pins=self._out_pins.get((stage, phase), ())),
                slots, donate, open_totals=self._deferral.pinned(stage))
        return fused

    def _micro_batch_index(self, mesh: int, micro_batch: int) -> jax.Array:
        """The index a piece folds into its per-step random keys, as a uint32 scalar on ``mesh``."""
        index = self._indices.get((mesh, micro_batch))
        if index is None:
            index = self._indices[(mesh, micro_batch)] = jax.device_put(
                np.uint32(micro_batch), NamedSharding(self.meshes[mesh], jax.sharding.PartitionSpec()))
        return index

    def _mean(self, group: list[Instruction], buffers, accumulators) -> None:
        for mesh in sorted({ins.mesh for ins in group}):
            rows = [ins for ins in group if ins.mesh == mesh and ins.key[0] in self.program.per_example]
            buffers[mesh].update((ins.key, gather_rows(accumulators[mesh].pop(ins.key[0]))) for ins in rows)
            mine = [ins for ins in group if ins.mesh == mesh and ins not in rows]
            stacked = [ins for ins in mine if ins.key[0] in self._stack_targets]
            plain = [ins for ins in mine if ins.key[0] not in self._stack_targets]
            stack_means, plain_means = step_means(
                [accumulators[mesh].pop(ins.key[0]) for ins in stacked],
                tuple(self._stack_targets[ins.key[0]] for ins in stacked),
                [accumulators[mesh].pop(ins.key[0]) for ins in plain], self.num_micro_batches)
            buffers[mesh].update({ins.key: x for ins, x in zip(stacked + plain, stack_means + plain_means,
                                                               strict=True)})

    def _execute(self, ins: Instruction, buffers, inputs, micro, stats: StepStats) -> None:
        mesh_buffers = buffers[ins.mesh]
        if ins.op is Op.LOAD:
            v, mb = ins.key
            value = inputs[v]
            name = self._input_names.get(v, str(v))
            if is_deleted(value):
                raise ValueError(f"step input {name} is a deleted array (donated to or deleted by an earlier "
                                 "call?): pass a live array")
            if ins.window is not None:
                if (v, ins.window) not in micro:
                    micro[(v, ins.window)] = unit_window(value, ins.window)
                value = micro[(v, ins.window)]
            elif mb != PER_STEP:
                if v not in micro:
                    micro[v] = _split_micro_batches(jax.numpy.asarray(value), self.num_micro_batches)
                value = micro[v][mb]
                if is_deleted(value):
                    raise RuntimeError(f"micro-batch {mb} of step input {name} was deleted before mesh {ins.mesh} "
                                       "loaded it: a RUN donated a buffer the slice shares")
            elif (own := self._own_copies.get(id(value))) is not None and own[0] is value and ins.mesh in own[1]:
                value = own[1][ins.mesh]
                stats.own_copy_loads += 1
            if not isinstance(value, (jax.Array, np.ndarray)):  # a scalar: strongly typed, as the step was traced
                value = np.asarray(value)
            elif getattr(value, "weak_type", False):
                value = value.astype(value.dtype)
            target = self._load_sharding(v, np.shape(value), ins.mesh)
            loaded = value if has_layout(value, target) else jax.device_put(value, target)
            if mb != PER_STEP and shares_buffers(loaded, value):
                self._shared_loads.append(loaded)
            mesh_buffers[ins.key] = loaded
        elif ins.op is Op.RECV:
            x = buffers[ins.src_mesh][ins.key]
            mesh_buffers[ins.key] = self._move(x, ins.key[0], ins.mesh, stats)
        elif ins.op is Op.FREE:
            mesh_buffers.pop(ins.key, None)
        elif ins.op is Op.CARRY:
            mesh_buffers[ins.key] = carried = pad_tokens(mesh_buffers[ins.source], ins.pad)
            if ins.source[1] == PER_STEP and carried is mesh_buffers[ins.source]:
                self._shared_loads.append(carried)  # a per-step constant's buffer: never donated
        else:
            raise AssertionError(f"unexpected instruction {ins}")

    def _load_spec(self, value_id, shape, mesh_index: int) -> ShardingSpec:
        spec = self.value_specs.get((value_id, mesh_index), self._input_specs.get(value_id))
        if spec is None or spec.ndim != len(shape):
            spec = activation_spec(shape, tuple(self.meshes[mesh_index].devices.shape))
        return spec

    def _load_sharding(self, value_id, shape, mesh_index: int) -> NamedSharding:
        return named_sharding(self.meshes[mesh_index], self._load_spec(value_id, shape, mesh_index))

    def _move(self, x: jax.Array, value_id: ValueId, mesh_index: int, stats: StepStats) -> jax.Array:
        mesh = self.meshes[mesh_index]
        spec = self.value_specs.get((value_id, mesh_index)) or activation_spec(x.shape, tuple(mesh.devices.shape))
        dst = named_sharding(mesh, spec)
        key = (x.shape, str(x.dtype), x.sharding, dst)
        plan = self._reshard_plans.get(key)
        if plan is None:
            plan = plan_resharding(x.shape, x.dtype.itemsize, layout_of(x.sharding, x.ndim), layout_of(dst, x.ndim))
            self._reshard_plans[key] = plan
        stats.bytes_moved += plan.cross_mesh_bytes
        return reshard(x, plan, dst)

    def get_hlo_text(self) -> str:
        """The compiled HLO of every stage piece as its first RUN compiled it (with the accumulation fused in
        and the donations of that RUN, if it had them), for the layouts of the first step (which must have run:
        pieces compile on it; this compiles nothing)."""
        if not self._ran:
            raise RuntimeError("get_hlo_text: run one step first (stage pieces compile on the first step)")
        texts = []
        for (stage, phase), (fn, specs) in self._ran.items():
            texts.append(f"// stage {stage} {phase}\n{fn.lower(*specs).compile().as_text()}")
        return "\n".join(texts)


def arg_specs(arrays) -> list[jax.ShapeDtypeStruct]:
    """Shape, dtype, layout and weak type of each of ``arrays`` (jax arrays or numpy scalars): the key jax's
    cache looks a call up by, so lowering a jitted function on them again finds the call's executable."""
    return [jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None),
                                 weak_type=getattr(x, "weak_type", False))  # a typed key array has no weak type
            for x in arrays]


def donated_positions(keys: Sequence[tuple], freed, shared: Sequence[bool],
                      donated_inputs=frozenset()) -> tuple[int, ...]:
    """Positions of a RUN's inputs it may donate, each read once by the RUN: per-micro-batch buffers
    (``keys[k][1] != PER_STEP``) that the program frees right after the RUN (``freed``) and that nothing else
    holds (``shared[k]`` false), and the donated step inputs it reads for the last time (``donated_inputs``).

    >>> donated_positions([("a", 0), ("w", PER_STEP), ("b", 0), ("c", 0)], {("a", 0), ("c", 0)},
    ...                   [False, False, False, True])
    (0,)
    >>> donated_positions([("a", 0), ("w", PER_STEP)], set(), [False, False], {("w", PER_STEP)})
    (1,)
    """
    return tuple(k for k, key in enumerate(keys) if keys.count(key) == 1 and (
        key in donated_inputs or (key[1] != PER_STEP and key in freed and not shared[k])))


def input_donations(programs: MeshPrograms, program: StageProgram,
                    donated: Sequence[ValueId]) -> dict[int, frozenset]:
    """Where a step donates its ``donated`` inputs (``donate_argnums``' leaves): instruction index of a RUN
    -> the per-step buffers of those inputs it reads for the last time on its mesh. An input is donated
    only where one mesh loads it (a copy other meshes load later must stay) and the step does not return it.
    """
    wanted = set(donated)
    loads: dict[ValueId, set[int]] = {}
    for ins in programs.instructions:
        if ins.op is Op.LOAD and ins.key[1] == PER_STEP and ins.key[0] in wanted:
            loads.setdefault(ins.key[0], set()).add(ins.mesh)
    returned = {out[0] for out in programs.outputs if out is not None}
    last: dict[tuple, int] = {}
    for i, ins in enumerate(programs.instructions):
        if ins.op is Op.RUN:
            for v in program.piece(ins.stage, ins.phase).inputs:
                if len(loads.get(v, ())) == 1:
                    last[(v, PER_STEP)] = i
        elif ins.op is Op.RECV and ins.key in last:  # sent on from this mesh: read later
            last.pop(ins.key)
    by_run: dict[int, set] = {}
    for key, i in last.items():
        if key not in returned:
            by_run.setdefault(i, set()).add(key)
    return {i: frozenset(keys) for i, keys in by_run.items()}


def live_bytes_per_mesh(meshes: Sequence[Any]) -> dict[int, int]:
    """Per mesh, the bytes of this process's live arrays on the mesh's device that holds the most (each
    shard counted on its device: a replicated array on every device of its mesh)."""
    per_device: dict[Any, int] = {}
    for x in jax.live_arrays():
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return {k: max(per_device.get(d, 0) for d in mesh.devices.flat) for k, mesh in enumerate(meshes)}


def shares_buffers(a: jax.Array, b: jax.Array) -> bool:
    """Whether the arrays hold a device buffer in common. ``jax.device_put`` returns a new array around the
    source's own buffer on every device where the source already holds the shard the new layout asks for, so
    two distinct arrays may share memory, and donating one deletes the other.

    >>> x = jax.device_put(jax.numpy.ones(3), jax.devices()[0])
    >>> mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    >>> y = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    >>> y is x, shares_buffers(y, x), shares_buffers(y + 0, x)
    (False, True, False)
    """
    mine = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in mine for s in b.addressable_shards)


@contextlib.contextmanager
def _quiet_unusable_donations():
    """Silences JAX's "Some donated buffers were not usable" (at compile time): a RUN donates every
    per-micro-batch input at its last use so that it is freed early; XLA reuses those that match an output
    and the others are dropped by the FREE that follows anyway."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


def unit_window(value, window: tuple[int, int, int, int]):
    """Rows ``[r, r + rows)`` and tokens ``[t, t + length)`` (dims 0 and 1) of a batch leaf: a token-sliced
    LOAD's ``window`` ``(r, rows, t, length)``."""
    r, rows, t, length = window
    return jax.numpy.asarray(value)[r:r + rows, t:t + length]


def pad_tokens(x, pad: int):
    """``x`` with ``pad`` zeros added before its dim-1 entries (``pad < 0``: its first ``-pad`` dropped): a
    CARRY's (:mod:`~alpa_like.runtime.instructions`)."""
    if pad == 0:
        return x
    return _pad_tokens(x, pad)


@functools.partial(jax.jit, static_argnums=1)
def _pad_tokens(x, pad: int):
    if pad < 0:
        return x[:, -pad:]
    return jax.numpy.pad(x, [(0, 0), (pad, 0)] + [(0, 0)] * (x.ndim - 2))


@functools.partial(jax.jit, static_argnums=1)
def _split_micro_batches(x, count: int):
    return tuple(to_micro_batches(x, count))


@jax.jit
def _from_micro_batches(*rows):
    return from_micro_batches(jax.numpy.stack(rows))


def gather_rows(rows: dict[int, jax.Array]) -> jax.Array:
    """A per-example value of the full batch from its micro-batches' values (micro-batch -> its rows), in the
    full batch's row order (:func:`~alpa_like.compiler.grad_accumulation.from_micro_batches`)."""
    return _from_micro_batches(*(rows[mb] for mb in sorted(rows)))


def piece_hooks(sharding: StageSharding, deferred: DeferredGradients, mesh) -> tuple:
    """The ``(hook, operand_hook)`` that pin the intra-op pass's layouts (``sharding``'s value and operand
    pins) inside a piece of its stage on ``mesh`` (a concrete or an abstract mesh of the stage's logical
    shape), the values ``deferred`` computes as stacks of partial sums pinned to their stacked layouts."""
    return pin_hook(mesh, stacked_pins(sharding.value_pins, deferred)), pin_hook(mesh, sharding.operand_pins)


def _piece_fn(piece, hook=None, operand_hook=None, deferred=NONE, mesh=None, *, draws: KeyDraws = (),
              out_pins: Sequence = ()):
    """The piece as a function of its inputs; ``hook`` / ``operand_hook`` pin layouts inside it
    (:func:`~alpa_like.runtime.spmd.pin_hook`); ``deferred`` gradients come out as stacks of partial sums
    (:func:`~alpa_like.runtime.partial_sums.eval_piece`). With ``draws`` (a piece's
    :func:`~alpa_like.compiler.stage_construction.micro_batch_key_draws`) it takes one more argument, the
    micro-batch's index, folded into those draws' keys. ``out_pins``: per output, a sharding it is made in
    (or None)."""
    def run(*args):
        operands = operand_hook
        if draws:
            *args, index = args
            operands = fold_micro_batch_index(draws, index, operand_hook)
        if deferred:
            outs = eval_piece(piece.jaxpr, args, deferred, mesh, hook=hook, operand_hook=operands)
        else:
            outs = jax_compat.eval_closed_jaxpr(piece.jaxpr, *args, hook=hook, operand_hook=operands)
        if out_pins:
            outs = [x if pin is None else jax.lax.with_sharding_constraint(x, pin)
                    for x, pin in zip(outs, out_pins, strict=True)]
        return outs
    return run
