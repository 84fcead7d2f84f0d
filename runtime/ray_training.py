"""The rest of a training run on the Ray backend: creating the state on the workers, eval steps there, and
checkpoints written by the workers that hold the arrays (:func:`save_remote_arrays`) and read back by the
workers that load them (:func:`restore_step_inputs`).

:class:`RayCreateStateExecutable` runs a ``create_state()`` function (``al.CreateStateParallel``) where a
pipeline train step loads its state: per mesh, the function restricted to the state leaves that mesh loads
is exported (``jax.export``) and run by the mesh's worker, with each output made in the layout the worker's
LOAD puts it in (GSPMD partitions the computation, random initialisers included, from those layouts); the
results stay in the worker's store. The driver gets :class:`~alpa_like.runtime.ray_backend.RemoteArray` s
and never holds a parameter; the train step then takes every leaf in place.

:class:`RayForwardExecutable` runs an eval / inference step (``al.FollowParallel``) on the same workers: the step is
cut into one forward piece per mesh (:func:`~alpa_like.compiler.forward_pieces.forward_pieces`, a state leaf
read on a mesh that loads it), and the pieces become a one-micro-batch instruction program (LOAD, RECV,
RUN) run by a :class:`~alpa_like.runtime.ray_backend.RayPipeshardExecutable`, so values move worker to
worker as the train pipeline moves them, the state is read where it lives, and the outputs come back as
NumPy arrays like a step's metrics.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.forward_pieces import ForwardPiece, forward_pieces
from alpa_like.compiler.layer_slicing import FORWARD
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.compiler.stage_construction import StagePiece, StageProgram, ValueId
from alpa_like.compiler.trace import TracedStep, leaf_aval
from alpa_like.runtime.instructions import PER_STEP, Instruction, MeshPrograms, Op
from alpa_like.runtime.ray_backend import RayPipeshardExecutable, RemoteArray, _actor_id
from alpa_like.runtime.ray_programs import EXPORT_PLATFORMS


class RayCreateStateExecutable:
    """``create_state(*args)`` run on the workers of a Ray pipeline train step, each state leaf made on the
    meshes that load it, in their LOAD layout (see the module docstring).

    Args:
      fun: ``create_state``; its arguments (e.g. a key) are sent from the driver at each call.
      args: example arguments (arrays or ``jax.ShapeDtypeStruct`` s).
      train: the train step's executable.
      state_leaves: the flat input leaves of ``train`` that make up the state, in pytree order.
    """

    def __init__(self, fun: Callable, args: Sequence[Any], train: RayPipeshardExecutable,
                 state_leaves: Sequence[int]):
        out_shape = jax.eval_shape(fun, *args)
        leaves, self.out_tree = jax.tree.flatten(out_shape)
        if len(leaves) != len(state_leaves):
            raise ValueError(f"CreateStateParallel: create_state returns {len(leaves)} array leaves, but the train "
                             f"step's state has {len(state_leaves)}")
        self.train_executable = train
        self.avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        placements = train.input_placements()
        self.placements = [placements[j] or {0: ShardingSpec.replicated(len(x.shape))}  # unread: on mesh 0
                           for j, x in zip(state_leaves, leaves, strict=True)]
        """Per state leaf, the meshes that make it, each with its layout there."""
        flat, self._in_tree = jax.tree.flatten(tuple(args))
        self._in_avals = [leaf_aval(x, f"create_state's argument leaf {k}") for k, x in enumerate(flat)]
        platforms = EXPORT_PLATFORMS[train.cluster.platform]
        self._programs: list[tuple[int, list[int], bytes]] = []
        for mesh in sorted({m for placed in self.placements for m in placed}):
            members = [k for k, placed in enumerate(self.placements) if mesh in placed]
            run = _leaves_at(fun, self._in_tree, members)
            exported = jax.export.export(jax.jit(run), platforms=platforms)(*self._in_avals)
            self._programs.append((mesh, members, bytes(exported.serialize())))

    @property
    def plan(self):
        """The train step's plan, whose layouts this step makes the state in."""
        return self.train_executable.plan

    def __call__(self, *args):
        train = self.train_executable
        cluster = train.cluster
        if cluster.closed:
            raise RuntimeError("this executable's Ray backend was shut down; call the parallelized function again "
                               "after al.init(cluster='ray') to recompile")
        sent = self._host_args(args)
        replicas: list[list] = [[] for _ in self.placements]
        calls = []
        for mesh, members, exported in self._programs:
            worker = train.workers[mesh]
            outputs = []
            for k in members:
                handle = cluster.new_handle()
                outputs.append((handle, self.placements[k][mesh]))
                replicas[k].append((worker, handle))
            calls.append((worker, worker.create_handles.remote(train.exe_id, exported, sent, outputs,
                                                               cluster.take_frees(worker))))
        # made first: if a worker fails, dropping them frees what the others made
        values = [RemoteArray(a.shape, a.dtype, r, cluster) for a, r in zip(self.avals, replicas, strict=True)]
        cluster.wait_all(calls, "creating the state")
        return jax.tree.unflatten(self.out_tree, values)

    def _host_args(self, args: Sequence[Any]) -> list:
        """The flat arguments as the driver sends them (:func:`_host_arg`), checked against the compiled ones.

        Raises:
          TypeError: a leaf is a ``jax.ShapeDtypeStruct``.
          ValueError: the pytree structure, or a leaf's shape or dtype, is not the compiled one.
        """
        flat, tree = jax.tree.flatten(tuple(args))
        if tree != self._in_tree:
            raise ValueError(f"create_state's arguments have pytree structure {tree}, but it was compiled for "
                             f"{self._in_tree}")
        for k, (x, aval) in enumerate(zip(flat, self._in_avals, strict=True)):
            if isinstance(x, jax.ShapeDtypeStruct):
                raise TypeError(f"create_state's argument leaf {k} is a jax.ShapeDtypeStruct: creating the state "
                                "needs arrays")
            got = leaf_aval(x, f"create_state's argument leaf {k}")
            if (got.shape, got.dtype) != (aval.shape, aval.dtype):
                raise ValueError(f"create_state's argument leaf {k} has shape {got.shape} {got.dtype}; it was "
                                 f"compiled for {aval.shape} {aval.dtype}")
        return [_host_arg(x, aval.dtype) for x, aval in zip(flat, self._in_avals, strict=True)]


def _host_arg(x: Any, dtype) -> np.ndarray | tuple[np.ndarray, str]:
    """An argument leaf, exported as ``dtype``, as the driver sends it (the form of
    :func:`~alpa_like.runtime.ray_worker.host_value`: a typed PRNG key as its data and impl name)."""
    if jax_compat.is_prng_key(dtype):
        return jax_compat.key_data_and_impl(x)
    return np.asarray(x, dtype=dtype)


def _leaves_at(fun: Callable, in_tree, members: Sequence[int]) -> Callable:
    """``fun`` of flat arguments (``in_tree``), returning only its flat output leaves at ``members`` (XLA drops
    the others' work)."""
    def run(*flat):
        leaves = jax.tree.leaves(fun(*jax.tree.unflatten(in_tree, flat)))
        return [leaves[k] for k in members]
    return run


# --------------------------------------------------------------------------------------------- eval steps

class RayForwardExecutable:
    """An eval / inference step on the workers of a Ray pipeline train step, reading its state in place:
    call it like the original function; its outputs come back as NumPy arrays.

    Args:
      traced: the eval step, traced on the whole batch.
      train: the train step's executable.
      state_leaves: eval flat input leaf -> the train step's flat input leaf it is (the state).
    """

    def __init__(self, traced: TracedStep, train: RayPipeshardExecutable, state_leaves: Mapping[int, int]):
        self.traced = traced
        self.train_executable = train
        closed = traced.closed_jaxpr
        placements = train.input_placements()
        train_specs = train.worker_programs[0].input_specs
        invars = closed.jaxpr.invars
        held = {invars[k]: sorted(placements[j]) for k, j in state_leaves.items() if placements[j]}
        self.pieces: list[ForwardPiece] = forward_pieces(closed, held)
        program, programs = forward_programs(closed, self.pieces, held, len(train.meshes))
        specs = {program.step_inputs[k]: train_specs[train.program.step_inputs[j]]
                 for k, j in state_leaves.items() if train.program.step_inputs[j] in train_specs}
        self._state_leaves = frozenset(state_leaves)
        self.runner = RayPipeshardExecutable(
            traced=traced, plan=dataclasses.replace(train.plan, num_micro_batches=1), program=program,
            programs=programs, input_specs=specs, cluster=train.cluster,
            returned=frozenset(k for k, out in enumerate(programs.outputs) if out is not None))
        self.workers = self.runner.workers
        self.moved_state_leaves = 0
        """State leaves the last call sent to a mesh that reads them (from the driver or another worker)
        because they were not already there: 0 when the state is the train step's."""

    @property
    def plan(self):
        """The train step's plan, whose layouts this step reads the state in."""
        return self.train_executable.plan

    def __call__(self, *args):
        outputs = self.runner(*args)
        routes = self.runner.last_step.input_routes
        self.moved_state_leaves = sum(any(kind != "handle" for kind in routes.get(k, ())) for k in self._state_leaves)
        return outputs

    @property
    def last_step(self):
        """The last call's :class:`~alpa_like.runtime.ray_backend.RayStepStats`."""
        return self.runner.last_step


def forward_programs(closed: ClosedJaxpr, pieces: Sequence[ForwardPiece], held: Mapping[Var, Sequence[int]],
                     num_meshes: int) -> tuple[StageProgram, MeshPrograms]:
    """The forward pieces as a one-micro-batch stage program (stage ``m`` = the piece of mesh ``m``) and its
    instructions: per piece, in mesh order, a LOAD of each step input or constant it reads, a RECV of each
    value an earlier piece made, then its RUN. An output that no piece makes (a step input) is loaded on a
    mesh that holds it (``held``), else on the last piece's mesh."""
    jaxpr = closed.jaxpr
    ids: dict[Var, ValueId] = {}

    def vid(v: Var) -> ValueId:
        return ids.setdefault(v, ValueId(len(ids)))

    step_inputs = tuple(vid(v) for v in jaxpr.invars)
    constants = {vid(v): c for v, c in zip(jaxpr.constvars, closed.consts, strict=True)}
    where: dict[Var, int] = {}
    instructions: list[Instruction] = []
    stage_pieces: dict[tuple[int, str], StagePiece] = {}

    def load(v: Var, mesh: int) -> None:
        instructions.append(Instruction(Op.LOAD, mesh, key=(vid(v), PER_STEP)))

    for piece in pieces:
        for v in piece.inputs:
            if v in where:
                instructions.append(Instruction(Op.RECV, piece.mesh, key=(vid(v), PER_STEP), src_mesh=where[v]))
            else:
                load(v, piece.mesh)
        instructions.append(Instruction(Op.RUN, piece.mesh, stage=piece.mesh, phase=FORWARD, micro_batch=PER_STEP))
        where.update(dict.fromkeys(piece.outputs, piece.mesh))
        stage_pieces[(piece.mesh, FORWARD)] = StagePiece(
            stage=piece.mesh, phase=FORWARD, jaxpr=piece.jaxpr, inputs=tuple(vid(v) for v in piece.inputs),
            outputs=tuple(vid(v) for v in piece.outputs))
    last = pieces[-1].mesh if pieces else 0
    outputs, step_outputs, literals = [], [], {}
    for k, v in enumerate(jaxpr.outvars):
        if isinstance(v, Literal):
            outputs.append(None)
            step_outputs.append(None)
            literals[k] = v.val
            continue
        if v not in where:
            where[v] = min(held.get(v) or [last])
            load(v, where[v])
        outputs.append(((vid(v), PER_STEP), where[v]))
        step_outputs.append(vid(v))
    program = StageProgram(num_stages=num_meshes, pieces=stage_pieces, values=tuple(ids), step_inputs=step_inputs,
                           batch_inputs=frozenset(), step_outputs=tuple(step_outputs), literal_outputs=literals,
                           constants=constants, accumulated=(), home={})
    programs = MeshPrograms(instructions=tuple(instructions), num_meshes=num_meshes,
                            stage_to_mesh=tuple(range(num_meshes)), outputs=tuple(outputs))
    return program, programs


# ------------------------------------------------------------------------------------------- checkpoints

class RemoteWrite:
    """Checkpoint writes running on the workers that hold the arrays (:func:`save_remote_arrays`)."""

    def __init__(self, parts: dict[str, str], writers: list[tuple[Any, str]], cluster):
        self.parts = parts
        """Orbax key -> the part (subdirectory) its worker writes."""
        self._writers, self._cluster = writers, cluster

    def wait(self) -> dict[str, str]:
        """Waits for every worker's files; returns ``{orbax key: impl name}`` of the typed PRNG keys written."""
        impls: dict[str, str] = {}
        calls = [(actor, actor.finish_save.remote(path)) for actor, path in self._writers]
        for written in self._cluster.wait_all(calls, "writing the checkpoint"):
            impls.update(written)
        return impls


def save_remote_arrays(arrays: Mapping[str, RemoteArray], directory: str) -> RemoteWrite:
    """Starts writing ``arrays`` (orbax key -> RemoteArray) where they live: each worker holding some writes
    them from its own devices as one orbax checkpoint, ``directory/worker_<n>`` (n numbers the workers of this
    call). Returns once every worker has copied its arrays off its devices. No data passes through the driver;
    ``directory`` must be reachable from every worker's node."""
    by_actor: dict[str, tuple[Any, dict[str, int]]] = {}
    for key, x in arrays.items():
        actor, handle = x.replicas[0]
        by_actor.setdefault(_actor_id(actor), (actor, {}))[1][key] = handle
    parts, writers = {}, []
    for n, (actor, handles) in enumerate(by_actor.values()):
        path = os.path.join(directory, f"worker_{n}")
        parts.update(dict.fromkeys(handles, f"worker_{n}"))
        writers.append((actor, path))
    cluster = next(iter(arrays.values()))._cluster
    cluster.wait_all([(actor, actor.start_save.remote(path, handles)) for (actor, path), (_, handles)
                      in zip(writers, by_actor.values(), strict=True)], "copying the checkpoint's arrays")
    return RemoteWrite(parts, writers, cluster)


def restore_step_inputs(exe: RayPipeshardExecutable, leaves: Mapping[int, tuple[str, str, Any]]
                        ) -> dict[int, RemoteArray]:
    """Reads step inputs from checkpoint files straight onto the workers whose meshes LOAD them, each in the
    layout its LOAD puts it in (so the next step moves nothing); the driver sees no data.

    Args:
      leaves: flat input index -> (orbax checkpoint path, orbax key,
        :class:`~alpa_like.runtime.checkpoint_io.Target` without a sharding).

    Returns:
      flat input index -> the input as a :class:`RemoteArray` with a replica on each loading mesh; inputs
      that no mesh loads are left out.
    """
    if exe.cluster.closed:
        raise RuntimeError("this executable's Ray backend was shut down; restore into an executable of the "
                           "running backend")
    placements = exe.input_placements()
    items: list[list] = [[] for _ in exe.workers]
    replicas: dict[int, list] = {}
    for k, (path, key, target) in leaves.items():
        for mesh, spec in placements[k].items():
            handle = exe.cluster.new_handle()
            items[mesh].append((handle, path, key, target, spec))
            replicas.setdefault(k, []).append((exe.workers[mesh], handle))
    # made first: if a worker fails, dropping them frees what the others read
    out = {k: RemoteArray(leaves[k][2].shape, exe.program.values[exe.program.step_inputs[k]].aval.dtype,
                          reps, exe.cluster) for k, reps in replicas.items()}
    exe.cluster.wait_all([(w, w.restore_handles.remote(exe.exe_id, mine))
                          for w, mine in zip(exe.workers, items) if mine], "reading the checkpoint")
    return out

