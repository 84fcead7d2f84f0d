"""What the Ray backend's driver ships to its workers: every stage piece exported once with ``jax.export``
(:func:`export_piece`), and each mesh's :class:`~alpa_like.runtime.ray_worker.WorkerProgram` (its
instructions, the pieces of its stages, what it sends where: :func:`worker_programs`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from alpa_like.compiler.gradient_sync import NONE, DeferredGradients
from alpa_like.compiler.micro_batch_keys import KeyDraws
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.stage_construction import StageProgram, ValueId, micro_batch_key_draws
from alpa_like.runtime.instructions import MeshPrograms, Op
from alpa_like.compiler.stage_sharding import StageSharding
from alpa_like.runtime.pipeshard_runtime import MESH_AXES, _piece_fn, piece_hooks
from alpa_like.runtime.ray_worker import MeshInfo, ShippedPiece, WorkerProgram, load_spec
from alpa_like.runtime.stage_gradients import GradientDeferral


EXPORT_PLATFORMS = {"cpu": ("cpu",), "gpu": ("cuda",)}


def export_piece(piece, platform: str = "cpu", draws: KeyDraws = (), deferred: DeferredGradients = NONE,
                 mesh_shape: Sequence[int] = (), sharding: StageSharding | None = None) -> bytes:
    """A stage piece as serialised ``jax.export`` StableHLO for ``platform``'s workers, laid out over a mesh
    of ``mesh_shape`` (an abstract mesh: the driver needs no device of it) that the worker's jit maps onto its
    own devices; with ``draws`` it takes the micro-batch's index last
    (:func:`~alpa_like.runtime.pipeshard_runtime._piece_fn`). ``sharding``: its stage's intra-op layouts,
    pinned inside the piece as on the local backend (:func:`~alpa_like.runtime.pipeshard_runtime.piece_hooks`);
    None: XLA's propagation from the inputs' layouts. With ``deferred`` gradients (a backward piece's), those
    come out as stacks of partial sums laid out over the mesh's axes, which the worker's MEAN reduces once
    per step."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in piece.jaxpr.in_avals]
    if draws:
        avals.append(jax.ShapeDtypeStruct((), np.uint32))
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), MESH_AXES[:len(mesh_shape)],
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_shape))
    hooks = () if sharding is None else piece_hooks(sharding, deferred, mesh)
    fn = _piece_fn(piece, *hooks, deferred=deferred, mesh=mesh, draws=draws)
    exported = jax.export.export(jax.jit(fn), platforms=EXPORT_PLATFORMS[platform])(*avals)
    return bytes(exported.serialize())


def export_pieces(deferral: GradientDeferral, platform: str, num_micro_batches: int,
                  stage_mesh_shapes: Sequence[tuple[int, ...]]) -> tuple[dict[tuple[int, str], bytes], frozenset]:
    """Every piece of ``deferral``'s program exported (:func:`export_piece`) with its stage's intra-op layouts
    pinned inside, for ``num_micro_batches`` micro-batches, each stage ``q`` on a mesh of
    ``stage_mesh_shapes[q]``; and the pieces whose stage has layouts to pin."""
    program, shardings = deferral.program, dict(enumerate(deferral.stage_shardings))
    draws = micro_batch_key_draws(program, num_micro_batches)
    shipped = {key: export_piece(piece, platform, draws.get(key, ()), deferral.piece_deferred(*key),
                                 stage_mesh_shapes[key[0]], shardings.get(key[0]))
               for key, piece in program.pieces.items()}
    return shipped, frozenset(key for key in program.pieces if deferral.pinned(key[0]))


def worker_programs(program: StageProgram, programs: MeshPrograms, meshes: Sequence[MeshInfo],
                    input_specs: dict, shipped: dict[tuple[int, str], bytes],
                    num_micro_batches: int, returned: frozenset[int] = frozenset(),
                    donations: dict[int, frozenset] | None = None,
                    stack_specs: dict | None = None, value_specs: dict | None = None,
                    updated: Sequence[int | None] = (), pinned: frozenset = frozenset()) -> list[WorkerProgram]:
    """Each mesh's :class:`WorkerProgram`: its instructions, the pieces of its stages, what it sends.

    ``returned``: the step outputs that come back to the driver as values, each from the mesh that holds it
    in ``programs.outputs`` (the others stay in the workers' stores). ``donations``: index of a RUN in
    ``programs.instructions`` -> the donated inputs' buffers it donates
    (:func:`~alpa_like.runtime.pipeshard_runtime.input_donations`); a buffer the mesh also sends to another
    mesh is not donated (a background thread may still be reading it). ``stack_specs``: accumulator of a
    stack of partial sums -> (its stage, the layout of its step mean)
    (:attr:`~alpa_like.runtime.stage_gradients.GradientDeferral.stack_specs`). ``input_specs`` and
    ``value_specs``: the step inputs' layouts (:func:`mesh_input_specs`). ``updated``: per step output, the
    step input it is the new value of, or None (:func:`~alpa_like.compiler.trace.updated_inputs`): its piece
    makes it in the layout the next step loads it in (:func:`output_pins`). ``pinned``: the pieces exported
    with their stage's intra-op layouts pinned inside (:attr:`~alpa_like.runtime.ray_worker.ShippedPiece.pinned`)."""
    sends: list[dict] = [dict() for _ in meshes]
    for ins in programs.instructions:
        if ins.op is Op.RECV:
            dsts = sends[ins.src_mesh].setdefault(ins.key, ())
            if ins.mesh not in dsts:
                sends[ins.src_mesh][ins.key] = dsts + (ins.mesh,)
    out = []
    draws = micro_batch_key_draws(program, num_micro_batches)
    for k in range(len(meshes)):
        instructions = programs.program(k)
        stages = {ins.stage for ins in instructions if ins.op is Op.RUN}
        loaded = {ins.key[0] for ins in instructions if ins.op is Op.LOAD}
        constants = {v: np.asarray(c) for v, c in program.constants.items() if v in loaded}
        held = held_at_end(program, instructions)
        outputs = tuple((i, o[0]) for i, o in enumerate(programs.outputs)
                        if o is not None and o[0] in held and i not in returned)
        specs = mesh_input_specs(input_specs, value_specs, k)
        pins = output_pins(program, instructions, outputs, updated, specs, meshes[k].logical_shape)
        pieces = {key: ShippedPiece(exported=shipped[key], inputs=p.inputs, outputs=p.outputs,
                                    takes_micro_batch_index=key in draws, out_specs=pins.get(key, ()),
                                    pinned=key in pinned)
                  for key, p in program.pieces.items() if key[0] in stages}
        mine = tuple((i, o[0]) for i, o in enumerate(programs.outputs) if i in returned and o is not None and o[1] == k)
        local = {g: j for j, g in enumerate(g for g, ins in enumerate(programs.instructions) if ins.mesh == k)}
        donated = {local[g]: frozenset(keys - sends[k].keys()) for g, keys in (donations or {}).items() if g in local}
        out.append(WorkerProgram(mesh=k, meshes=tuple(meshes), instructions=instructions, pieces=pieces,
                                 sends=sends[k], input_specs=specs, constants=constants,
                                 send_specs=_send_specs(sends[k], value_specs or {}),
                                 num_micro_batches=num_micro_batches, outputs=outputs, returned=mine,
                                 donations={j: keys for j, keys in donated.items() if keys},
                                 per_example=program.per_example,
                                 stacks={dst: spec for dst, (q, spec) in (stack_specs or {}).items()
                                         if q in stages}))
    return out


def _send_specs(sends: dict, value_specs: dict) -> dict:
    """(value, receiving mesh) -> its layout there in ``value_specs``, for the buffers of ``sends``."""
    return {(v, dst): value_specs[(v, dst)] for (v, _), dsts in sends.items() for dst in dsts
            if (v, dst) in value_specs}


def output_pins(program: StageProgram, instructions: Sequence, outputs: Sequence[tuple[int, tuple]],
                updated: Sequence[int | None], specs: dict[ValueId, ShardingSpec],
                mesh_shape: tuple[int, int]) -> dict[tuple[int, str], tuple[ShardingSpec | None, ...]]:
    """Per piece a mesh program RUNs, the layout each of its outputs is made in (None: XLA's choice).

    ``outputs``: the (step output index, buffer) the mesh holds at the end of a step
    (:attr:`~alpa_like.runtime.ray_worker.WorkerProgram.outputs`); ``updated``: per step output, the step input
    it is the new value of, or None. An output that is the new value of an input the mesh LOADs, made by a
    piece the mesh runs, is made in the layout that LOAD puts the input in (``specs``: the mesh's
    :func:`mesh_input_specs`, on a mesh of ``mesh_shape``), so the next step takes it as it is and a donated
    input's buffers can hold it (the local backend's output pins,
    :meth:`~alpa_like.runtime.pipeshard_runtime.PipeshardExecutable._output_pins`)."""
    loaded = {ins.key[0] for ins in instructions if ins.op is Op.LOAD}
    made = {v: (ins.stage, ins.phase) for ins in instructions if ins.op is Op.RUN
            for v in program.piece(ins.stage, ins.phase).outputs}
    targets = []
    for k, (v, _) in outputs:
        source = updated[k] if k < len(updated) else None
        where = made.get(v)
        if source is None or where is None or program.step_inputs[source] not in loaded:
            continue
        targets.append((where, v, load_spec(specs, program.step_inputs[source], program.values[v].aval.shape,
                                            mesh_shape)))
    return program.output_slots(targets)


def mesh_input_specs(input_specs: dict[ValueId, ShardingSpec],
                     value_specs: dict[tuple[ValueId, int], ShardingSpec] | None, mesh: int) -> dict:
    """The layouts ``mesh`` loads step inputs in: ``input_specs`` (value -> spec, on every mesh) with
    ``value_specs``' ``(value, mesh) -> spec`` for this mesh over them (a parameter several stages read,
    each in its own layout: TeraPipe's per-stage specs)."""
    return {**input_specs, **{v: spec for (v, m), spec in (value_specs or {}).items() if m == mesh}}


def mesh_load_spec(input_specs: dict, value_specs: dict | None, meshes: Sequence[MeshInfo]
                   ) -> Callable[[ValueId, tuple, int], ShardingSpec]:
    """``(value, shape, mesh) -> spec``: the layout a worker loads or receives a value in
    (:func:`~alpa_like.runtime.ray_worker.load_spec` of :func:`mesh_input_specs`)."""
    specs = [mesh_input_specs(input_specs, value_specs, k) for k in range(len(meshes))]

    def spec(value, shape, mesh: int) -> ShardingSpec:
        return load_spec(specs[mesh], value, shape, meshes[mesh].logical_shape)
    return spec


def held_at_end(program: StageProgram, instructions: Sequence) -> set:
    """The buffers a mesh program holds when it ends: written (RUN, MEAN, LOAD, RECV) and not freed."""
    held = set()
    for ins in instructions:
        if ins.op is Op.RUN:
            held.update((v, ins.micro_batch) for v in program.piece(ins.stage, ins.phase).outputs)
        elif ins.op in (Op.MEAN, Op.LOAD, Op.RECV, Op.CARRY):
            held.add(ins.key)
        elif ins.op is Op.FREE:
            held.discard(ins.key)
    return held
