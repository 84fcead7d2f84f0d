"""The rest of a training run: creating the state in the train step's layouts, and eval steps that read it
there (the methods :class:`~alpa_like.compiler.options.CreateStateParallel` and
:class:`~alpa_like.compiler.options.FollowParallel`).

``al.CreateStateParallel(train_step, batch)`` is the method of a function that makes the training state
(``create_state() -> TrainState``): under ``al.parallelize`` it runs so that every leaf of the state is born
in the layout the train step's plan loads it in, computed shard by shard on the devices that hold it (XLA
partitions the initialisers, random ones included), a pipeline stage's leaves on that stage's mesh::

    train_step = al.parallelize(train_step, method=al.PipeshardParallel(...))
    create = al.parallelize(create_state, method=al.CreateStateParallel(train_step, batch))
    state = create()              # no device or host holds the whole state of a sharded plan
    state, metrics = train_step(state, batch)   # the state is taken as it is: nothing is resharded

``al.FollowParallel(train_step, batch)`` is the method of an eval or inference step that reads the same
state (``eval_step(state, eval_batch)``, forward only): the state's leaves are taken in the train step's
layouts, so no parameter moves. Under an SPMD train step the eval step is one program on the same mesh, its
other arguments split over the mesh along dim 0 where that divides; under a pipeline it is cut into one
piece per stage mesh (:mod:`~alpa_like.runtime.follow`), run in stage order, and its outputs come back on the
last stage's mesh.

On the Ray backend both run on the pipeline train step's workers (:mod:`~alpa_like.runtime.ray_training`): the
state is made there and the driver gets ``RemoteArray`` s; an eval step's outputs come back as NumPy arrays.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from alpa_like.compiler.options import CreateStateParallel, FollowParallel


def train_executable(method: FollowParallel, state: Any):
    """The executable of ``method``'s train step for ``state`` (and ``method.batch``): its plan gives the
    layouts the followed step reads the state in."""
    if method.batch is not None:
        return train_step_for(method, state, "the eval step's state argument")
    compiled = list(method.train_step._cache.values())
    if len(compiled) != 1:
        raise ValueError(f"FollowParallel: the train step has {len(compiled)} compiled executables; pass its "
                         "batch (al.FollowParallel(train_step, batch)) to say which plan to follow")
    return compiled[0]


def compile_follow(fun: Callable, args: Sequence[Any], method: FollowParallel, *, static_argnums=(),
                   batch_argnums=(1,)):
    """The executable of the eval step ``fun(*args)`` under ``method`` (see :class:`FollowParallel`)."""
    from alpa_like.compiler.trace import trace_step
    from alpa_like.runtime.follow import ForwardPipelineExecutable
    from alpa_like.runtime.pipeshard_runtime import PipeshardExecutable
    from alpa_like.runtime.ray_backend import RayPipeshardExecutable
    from alpa_like.runtime.ray_training import RayForwardExecutable
    from alpa_like.runtime.spmd import SpmdExecutable

    argnum = method.state_argnum
    if argnum >= len(args):
        raise ValueError(f"FollowParallel: state_argnum={argnum}, but the step was called with {len(args)} "
                         "arguments")
    train = train_executable(method, args[argnum])
    traced = trace_step(fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums)
    state_leaves = [k for k, leaf in enumerate(traced.in_leaves) if leaf.arg_index == argnum]
    train_leaves = [k for k, leaf in enumerate(train.traced.in_leaves) if leaf.arg_index == argnum]
    if [traced.in_leaves[k].shape for k in state_leaves] != [train.traced.in_leaves[k].shape for k in train_leaves]:
        raise ValueError("FollowParallel: the eval step's state argument does not have the train step's state's "
                         "structure and shapes")
    if isinstance(train, PipeshardExecutable):
        train_placements = train.input_placements()
        placements = [{}] * len(traced.in_leaves)
        for k, j in zip(state_leaves, train_leaves, strict=True):
            placements[k] = train_placements[j]
        return ForwardPipelineExecutable(traced, train.meshes, placements, plan=train.plan)
    if isinstance(train, SpmdExecutable):
        return FollowSpmdExecutable(fun, traced, train, state_leaves, train_leaves, static_argnums)
    if isinstance(train, RayPipeshardExecutable):
        return RayForwardExecutable(traced, train, dict(zip(state_leaves, train_leaves, strict=True)))
    raise NotImplementedError(f"FollowParallel follows SPMD and pipeline train steps; got {type(train).__name__}")


class FollowSpmdExecutable:
    """The eval step as one program on the train step's mesh, reading the state in its layouts."""

    def __init__(self, fun, traced, train, state_leaves, train_leaves, static_argnums):
        from alpa_like.runtime.mesh import named_sharding
        from alpa_like.runtime.pipeshard_runtime import activation_spec

        self.traced = traced
        self.train_executable = train
        mesh = train.mesh
        train_shardings = train.input_shardings()
        shardings = [named_sharding(mesh, activation_spec(leaf.shape, tuple(mesh.devices.shape)))
                     for leaf in traced.in_leaves]
        for k, j in zip(state_leaves, train_leaves, strict=True):
            shardings[k] = train_shardings[j]
        self.in_shardings = tuple(shardings)
        self._state_leaves = frozenset(state_leaves)
        self.moved_state_leaves = 0
        """State leaves the last call had to move because they were not in the train step's layout."""
        closed = traced.closed_jaxpr
        self._compiled = jax.jit(lambda *flat: _eval(closed, flat), in_shardings=self.in_shardings)

    @property
    def plan(self):
        """The train step's plan, whose layouts this step reads the state in."""
        return self.train_executable.plan

    def __call__(self, *args):
        from alpa_like.runtime.mesh import has_layout
        from alpa_like.runtime.spmd import place_args
        flat = self.traced.flatten_args(args)
        self.moved_state_leaves = sum(not has_layout(flat[k], self.in_shardings[k]) for k in self._state_leaves)
        out = self._compiled(*place_args(flat, self.in_shardings))
        return jax.tree_util.tree_unflatten(self.traced.out_tree, out)


def _eval(closed, flat):
    from alpa_like.compiler import jax_compat
    return jax_compat.eval_closed_jaxpr(closed, *flat)


def _train_args(method: CreateStateParallel | FollowParallel, state: Any) -> tuple:
    """The train step's arguments: ``method``'s batch and other arguments, ``state`` in the state's place."""
    rest = [method.batch, *method.other_args]
    return (*rest[:method.state_argnum], state, *rest[method.state_argnum:])


def train_step_for(method: CreateStateParallel | FollowParallel, state: Any, what: str):
    """The executable of ``method``'s train step for ``state`` (``what`` names where it comes from) and its
    batch. A state the train step fails to trace with is a ValueError naming both pytree structures when the
    train step has compiled executables and none takes a state of ``state``'s structure (the error the trace
    raised is its cause); else the trace's own error."""
    try:
        return method.train_step.get_executable(*_train_args(method, abstract(state)))
    except Exception as e:
        known = _compiled_state_structures(method)
        mine = jax.tree_util.tree_structure(state)
        if known and mine not in known:
            raise ValueError(f"{type(method).__name__}: the train step cannot take {what} as its state (argument "
                             f"{method.state_argnum}): it has pytree structure {mine}, the train step was "
                             f"compiled for {known[0]} ({type(e).__name__} in the train step: {e})") from e
        raise


def _compiled_state_structures(method: CreateStateParallel | FollowParallel) -> list:
    """The pytree structures of the state (argument ``method.state_argnum``) of the train step's compiled
    executables."""
    out = []
    for exe in method.train_step._cache.values():
        traced = exe.traced
        if method.state_argnum in traced.dynamic_argnums:
            out.append(traced.in_tree.children()[traced.dynamic_argnums.index(method.state_argnum)])
    return out


def abstract(tree: Any) -> Any:
    """``tree`` with every array leaf replaced by a ``jax.ShapeDtypeStruct`` (other leaves kept)."""
    def shape_of(x):
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
        return x
    return jax.tree.map(shape_of, tree)


def state_shardings(exe: Any, argnum: int) -> list[jax.sharding.Sharding | None]:
    """The layouts the executable takes the leaves of its argument ``argnum`` in (flat, in pytree order)."""
    shardings = exe.input_shardings()
    return [s for s, leaf in zip(shardings, exe.traced.in_leaves, strict=True) if leaf.arg_index == argnum]


def compile_create_state(fun: Callable, args: Sequence[Any], method: CreateStateParallel):
    """The executable of ``create_state(*args)`` under ``method``: :class:`CreateStateExecutable`, or on the Ray
    backend a :class:`~alpa_like.runtime.ray_training.RayCreateStateExecutable` (the state is made on the
    train step's workers; the driver holds none of it)."""
    from alpa_like.runtime.ray_backend import RayPipeshardExecutable
    from alpa_like.runtime.ray_training import RayCreateStateExecutable

    train = train_step_for(method, jax.eval_shape(fun, *args), "what create_state returns")
    if isinstance(train, RayPipeshardExecutable):
        state = [k for k, leaf in enumerate(train.traced.in_leaves) if leaf.arg_index == method.state_argnum]
        return RayCreateStateExecutable(fun, args, train, state)
    return CreateStateExecutable(fun, args, method)


class CreateStateExecutable:
    """``create_state`` compiled to make each leaf in its layout: one jitted program per device set (a
    pipeline stage's mesh), each computing only that set's leaves."""

    def __init__(self, fun: Callable, args: Sequence[Any], method: CreateStateParallel):
        out_shape = jax.eval_shape(fun, *args)
        self.train_executable = method.train_step.get_executable(*_train_args(method, abstract(out_shape)))
        leaves, self.out_tree = jax.tree.flatten(out_shape)
        shardings = state_shardings(self.train_executable, method.state_argnum)
        if len(shardings) != len(leaves):
            raise ValueError(f"CreateStateParallel: create_state returns {len(leaves)} array leaves, but the train "
                             f"step's argument {method.state_argnum} has {len(shardings)}")
        groups: dict[frozenset, list[int]] = {}
        for k, sharding in enumerate(shardings):
            if sharding is None:  # a leaf the step does not read: beside the first leaf that has a layout
                sharding = next((s for s in shardings if s is not None), None)
                shardings[k] = None if sharding is None else _replicated_like(sharding)
            groups.setdefault(frozenset(() if shardings[k] is None else shardings[k].device_set), []).append(k)
        self.shardings = tuple(shardings)
        self._programs = [(members, jax.jit(_selecting(fun, members),
                                            out_shardings=[shardings[k] for k in members]))
                          for members in groups.values()]
        self.fun = fun

    @property
    def plan(self):
        """The train step's plan, whose layouts this step makes the state in."""
        return self.train_executable.plan

    def __call__(self, *args):
        values: list[Any] = [None] * len(self.shardings)
        for members, program in self._programs:
            for k, x in zip(members, program(*args), strict=True):
                values[k] = x
        return jax.tree.unflatten(self.out_tree, values)

    def memory_analysis(self, *args) -> list[Any]:
        """XLA's per-device memory figures (argument, output, temp bytes) of each program, for these
        arguments of ``create_state``."""
        return [program.lower(*args).compile().memory_analysis() for _, program in self._programs]


def _selecting(fun: Callable, members: Sequence[int]) -> Callable:
    """``fun`` returning only its flat output leaves at ``members`` (XLA drops the others' work)."""
    def run(*args):
        leaves = jax.tree.leaves(fun(*args))
        return [leaves[k] for k in members]
    return run


def _replicated_like(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding
