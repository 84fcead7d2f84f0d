"""Checkpoints of a training state, saved where the state lives and restored into any plan's layouts.

    al.save_checkpoint("ckpt", state, step=100)          # each device (each Ray worker) writes its own shards
    exe = train_step.get_executable(state, batch)
    state = al.restore_checkpoint("ckpt", like=exe)       # the latest step, in the step's input layouts

The arrays are written and read with orbax-checkpoint (:mod:`alpa_like.runtime.checkpoint_io`): every shard
from the device that holds it, every device reading back only its own region, so neither the driver nor any
device ever holds the whole state. A directory holds one committed checkpoint per step::

    ckpt/
      step_100/
        checkpoint.json       the step, each leaf's path, shape, dtype and the part that holds it
        plan.json             the plan (ParallelPlan.to_json), when save_checkpoint was given one
        arrays/               an orbax checkpoint of the leaves this process holds
        worker_0/ ...         on Ray: an orbax checkpoint per worker, of the leaves it holds
      .tmp-step_200-...       a save in progress, or one whose process died: ignored

A save writes into a temporary directory and renames it to ``step_<n>`` once every file is written, so a
process killed at any point leaves the earlier checkpoints as they were; nothing is ever overwritten.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from alpa_like.compiler.trace import key_to_str
from alpa_like.compiler.plan import ParallelPlan
from alpa_like.runtime.checkpoint_io import Target, read_arrays, start_write
from alpa_like.runtime.pipeshard_runtime import PipeshardExecutable
from alpa_like.runtime.spmd import SpmdExecutable

METADATA_FILE = "checkpoint.json"
PLAN_FILE = "plan.json"
DRIVER_PART = "arrays"
STEP_PREFIX = "step_"
TEMP_PREFIX = ".tmp-"
FORMAT = 1


# ------------------------------------------------------------------------------------------ the directory

def step_directory(directory: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (once committed)."""
    return Path(directory) / f"{STEP_PREFIX}{step}"


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """The steps committed in ``directory``, ascending (unfinished saves are not listed); ``[]`` when the
    directory does not exist."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        number = entry.name[len(STEP_PREFIX):]
        if entry.name.startswith(STEP_PREFIX) and number.isdigit() and entry.is_dir():
            steps.append(int(number))
    return sorted(steps)


def _check_directory(directory, who: str) -> Path:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{who}: directory must be a path (str or os.PathLike), got {type(directory).__name__}")
    root = Path(directory)
    if (root / METADATA_FILE).exists():
        raise ValueError(f"{who}: {root} is one step's checkpoint; pass the directory that holds the steps "
                         f"({root.parent})")
    return root


def _check_step(step, who: str, *, optional: bool = False) -> int | None:
    if step is None and optional:
        return None
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise TypeError(f"{who}: step must be an int >= 0{' or None' if optional else ''}, got {step!r}")
    return int(step)


def _temporary_name(step: int) -> str:
    return f"{TEMP_PREFIX}{STEP_PREFIX}{step}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove_dead_temporaries(root: Path) -> None:
    """Removes the temporary directories of saves (and deletions) whose process, on this host, is gone."""
    host = socket.gethostname()
    for entry in root.iterdir():
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        parts = entry.name.rsplit("-", 3)
        if len(parts) == 4 and parts[1] == host and parts[2].isdigit() and not _is_alive(int(parts[2])):
            shutil.rmtree(entry, ignore_errors=True)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _keep_newest(root: Path, max_to_keep: int) -> None:
    """Deletes the committed checkpoints but the ``max_to_keep`` highest steps; each is first renamed to a
    temporary name, so a process killed while deleting leaves no partial ``step_<n>``."""
    for step in checkpoint_steps(root)[:-max_to_keep]:
        doomed = root / _temporary_name(step)
        os.rename(step_directory(root, step), doomed)
        shutil.rmtree(doomed, ignore_errors=True)


# --------------------------------------------------------------------------------------------- saving

class AsyncSave:
    """A save running in the background (``save_checkpoint(..., async_save=True)``): the arrays are already
    copied off their devices, so the state may be changed or donated. :meth:`wait` returns the committed step
    directory (or raises the save's error). A later save or restore of the same directory waits for it."""

    def __init__(self, directory: Path, step: int, finish):
        self.directory, self.step = directory, step
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(finish,), name=f"checkpoint-step-{step}")
        self._thread.start()

    def _run(self, finish) -> None:
        try:
            self._result = finish()
        except BaseException as e:  # noqa: BLE001  (re-raised by wait)
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        return f"AsyncSave({str(step_directory(self.directory, self.step))!r}, done={self.done()})"


_pending: dict[str, AsyncSave] = {}
_pending_lock = threading.Lock()


def _wait_for_pending(root: Path) -> None:
    """Waits for this process's background save into ``root``, if one runs (its error is the save's own:
    reported by its AsyncSave.wait, not here)."""
    with _pending_lock:
        pending = _pending.pop(str(root.resolve()), None)
    if pending is not None:
        pending._thread.join()


def _state_leaves(state, who: str) -> list[tuple[tuple[str, ...], Any]]:
    """``state``'s leaves with their paths (as tuples of names); a clear error for what is not an array."""
    from alpa_like.runtime.ray_backend import RemoteArray
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = tuple(key_to_str(k) for k in path)
        name = _display(keys)
        if isinstance(leaf, RemoteArray):
            if not leaf.is_alive:
                raise ValueError(f"{who}: state leaf {name} is a RemoteArray of a Ray backend that was shut down "
                                 "(al.shutdown()): its data is gone; save before shutting the backend down")
        elif isinstance(leaf, jax.Array) and leaf.is_deleted():  # before orbax starts writing: it would hang
            raise ValueError(f"{who}: state leaf {name} is a deleted array (donated to or deleted by an earlier "
                             "call?): save the live state the step returned")
        elif isinstance(leaf, (bool, int, float, complex, np.number, np.bool_)):
            leaf = np.asarray(leaf, dtype=jax.dtypes.canonicalize_dtype(np.asarray(leaf).dtype))
        elif not isinstance(leaf, (jax.Array, np.ndarray)):
            raise TypeError(f"{who}: state leaf {name} must be an array (jax.Array, numpy array, RemoteArray or "
                            f"Python number), got {type(leaf).__name__}")
        out.append((keys, leaf))
    return out


def _display(keys: Sequence[str]) -> str:
    return ".".join(keys) if keys else "(the state itself)"


def save_checkpoint(directory: str | os.PathLike, state, step: int, *, plan: ParallelPlan | None = None,
                    max_to_keep: int | None = None, async_save: bool = False) -> Path | AsyncSave:
    """Saves ``state`` as the checkpoint of ``step`` in ``directory``.

    Every array is written by the devices that hold its shards (a Ray step's ``RemoteArray`` s by the worker
    that holds them, into its own part of the step directory); the driver never gathers the state. The step
    directory appears atomically once every file is written: a process killed during a save leaves every
    earlier checkpoint restorable and no ``step_<n>`` of the unfinished one.

    Args:
      directory: the directory of the run's checkpoints (created if needed). On a multi-node Ray cluster it
        must be a file system every node sees.
      state: a pytree of arrays (``jax.Array`` s on any devices and shardings, NumPy arrays, ``RemoteArray`` s,
        Python numbers).
      step: the step number, an int >= 0; a step already saved in ``directory`` is an error.
      plan: a :class:`ParallelPlan` saved beside the arrays (``plan.json``), to re-create the layout with
        :meth:`ParallelPlan.from_json`.
      max_to_keep: after the save commits, delete the oldest checkpoints so that the ``max_to_keep`` highest
        steps remain (None: keep all).
      async_save: return as soon as the arrays are copied off their devices and write the files in the
        background; a later save or restore of ``directory`` waits for it.

    Returns:
      The committed step directory, or with ``async_save`` an :class:`AsyncSave` whose ``wait()`` returns it.

    Raises:
      ValueError: ``step`` is already saved in ``directory``; a ``RemoteArray`` of a shut-down Ray backend.
      TypeError: a bad argument, or a state leaf that is not an array.
    """
    who = "save_checkpoint"
    root = _check_directory(directory, who)
    step = _check_step(step, who)
    if plan is not None and not isinstance(plan, ParallelPlan):
        raise TypeError(f"{who}: plan must be an al.ParallelPlan (e.g. exe.plan) or None, got {type(plan).__name__}")
    if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                    or max_to_keep < 1):
        raise ValueError(f"{who}: max_to_keep must be an int >= 1 or None, got {max_to_keep!r}")
    leaves = _state_leaves(state, who)
    root.mkdir(parents=True, exist_ok=True)
    _wait_for_pending(root)
    final = step_directory(root, step)
    if final.exists():
        raise ValueError(f"{who}: {final} already exists: a checkpoint is never overwritten (save another step, "
                         "or delete that directory first)")
    _remove_dead_temporaries(root)
    temporary = root / _temporary_name(step)
    temporary.mkdir()
    try:
        writes, parts = _start_writes(temporary, leaves)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise

    def finish() -> Path:
        try:
            key_impls = {}
            for write in writes:
                key_impls.update(write.wait())
            records = [_leaf_record(keys, leaf, parts[str(k)], key_impls.get(str(k)))
                       for k, (keys, leaf) in enumerate(leaves)]
            metadata = {"format": FORMAT, "step": step, "leaves": records}
            (temporary / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
            if plan is not None:
                (temporary / PLAN_FILE).write_text(plan.to_json())
            _commit(temporary, final, who)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        if max_to_keep is not None:
            _keep_newest(root, max_to_keep)
        return final

    if not async_save:
        return finish()
    pending = AsyncSave(root, step, finish)
    with _pending_lock:
        _pending[str(root.resolve())] = pending
    return pending


def _commit(temporary: Path, final: Path, who: str) -> None:
    """Makes a written step directory the checkpoint ``final``, atomically (one rename)."""
    if final.exists():
        raise ValueError(f"{who}: {final} appeared while this save ran: a checkpoint is never overwritten")
    os.rename(temporary, final)


def _start_writes(temporary: Path, leaves) -> tuple[list, dict[str, str]]:
    """Starts writing the leaves, each under its index as orbax key: the ones this process holds as the
    ``arrays`` part, each Ray worker's into its own part. Returns (pending writes, key -> part)."""
    from alpa_like.runtime.ray_backend import RemoteArray
    from alpa_like.runtime.ray_training import save_remote_arrays
    local = {str(k): leaf for k, (_, leaf) in enumerate(leaves) if not isinstance(leaf, RemoteArray)}
    remote = {str(k): leaf for k, (_, leaf) in enumerate(leaves) if isinstance(leaf, RemoteArray)}
    writes, parts = [], {}
    if local:
        writes.append(start_write(str(temporary / DRIVER_PART), local))
        parts.update(dict.fromkeys(local, DRIVER_PART))
    if remote:
        write = save_remote_arrays(remote, str(temporary))
        writes.append(write)
        parts.update(write.parts)
    return writes, parts


def _leaf_record(keys, leaf, part: str, key_impl: str | None) -> dict:
    return {"keys": list(keys), "shape": list(np.shape(leaf)), "dtype": str(leaf.dtype), "part": part,
            "key_impl": key_impl}


# ------------------------------------------------------------------------------------------ restoring

@dataclasses.dataclass(frozen=True)
class _Wanted:
    """What a restore produces: per leaf its path, shape, dtype and where it goes, and the pytree."""

    paths: tuple[str, ...]
    """Dotted, below the state's root (``params.dense.kernel``)."""
    avals: tuple[jax.ShapeDtypeStruct, ...]
    shardings: tuple[jax.sharding.Sharding | None, ...]
    """None: a host NumPy array."""
    treedef: Any
    ray_executable: Any = None
    """A Ray executable whose workers read the leaves they load (flat index = leaf index)."""


def restore_checkpoint(directory: str | os.PathLike, like=None, step: int | None = None, *, argnum: int = 0):
    """Restores a checkpoint of :func:`save_checkpoint` into the layouts ``like`` asks for.

    Each device reads only the region of each array it holds in the target layout, which may be any plan's:
    a state saved under one method, mesh or backend restores under any other.

    Args:
      directory: the directory the checkpoints were saved in.
      like: what to restore into:

        * an executable (``train_step.get_executable(state, batch)``): the state argument (``argnum``) in the
          layouts the step takes it in, so its first call moves nothing. On the Ray backend the leaves are read
          by the workers that load them and come back as ``RemoteArray`` s.
        * a pytree of ``jax.ShapeDtypeStruct`` s (or arrays): each leaf in its ``sharding``, or as a host NumPy
          array where it has none.
        * None: host NumPy arrays in nested dicts keyed by the saved paths' names.
      step: the step to restore (default: the highest committed one).
      argnum: with an executable ``like``: the position of the state among the step's arguments.

    Raises:
      FileNotFoundError: no such directory, no committed checkpoint in it, or no such step.
      ValueError: a partial step directory; ``like`` has another structure, shape or dtype (the message names
        the first leaf that differs, its saved and wanted shapes).
      TypeError: ``like`` is none of the above.
    """
    who = "restore_checkpoint"
    root = _check_directory(directory, who)
    step = _check_step(step, who, optional=True)
    if root.is_dir():
        _wait_for_pending(root)
    path = _find_step(root, step, who)
    metadata = _read_metadata(path, who)
    wanted = None if like is None else _wanted(like, argnum, who)
    records = metadata["leaves"]
    if wanted is not None:
        _check_matches(records, wanted, path, who)
    values = _read_leaves(path, records, wanted)
    if wanted is None:
        return _nested([r["keys"] for r in records], values)
    return jax.tree_util.tree_unflatten(wanted.treedef, values)


def _find_step(root: Path, step: int | None, who: str) -> Path:
    if not root.is_dir():
        raise FileNotFoundError(f"{who}: no checkpoint directory {root}")
    steps = checkpoint_steps(root)
    if step is None:
        if not steps:
            unfinished = sorted(e.name for e in root.iterdir() if e.name.startswith(TEMP_PREFIX))
            note = f" (unfinished saves, ignored: {', '.join(unfinished)})" if unfinished else ""
            raise FileNotFoundError(f"{who}: {root} holds no committed checkpoint{note}")
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"{who}: {root} has no checkpoint of step {step} (committed steps: {steps})")
    return step_directory(root, step)


def _read_metadata(path: Path, who: str) -> dict:
    """The step's metadata, checked: every part it names is a complete orbax checkpoint."""
    try:
        metadata = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{who}: {path} is not a complete checkpoint: cannot read {METADATA_FILE} ({e})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT or not isinstance(
            metadata.get("leaves"), list):
        raise ValueError(f"{who}: {path / METADATA_FILE} is not a checkpoint description of format {FORMAT}")
    for part in sorted({r["part"] for r in metadata["leaves"]}):
        if not (path / part / "_CHECKPOINT_METADATA").is_file():
            raise ValueError(f"{who}: {path} is not a complete checkpoint: its part {part}/ is missing or "
                             "incomplete")
    return metadata


def read_plan(directory: str | os.PathLike, step: int | None = None) -> ParallelPlan | None:
    """The plan saved with a checkpoint (``save_checkpoint(..., plan=)``), or None when none was saved."""
    path = _find_step(_check_directory(directory, "read_plan"), _check_step(step, "read_plan", optional=True),
                      "read_plan")
    plan_file = path / PLAN_FILE
    return ParallelPlan.from_json(plan_file.read_text()) if plan_file.exists() else None


def _wanted(like, argnum: int, who: str) -> _Wanted:
    from alpa_like.api import ParallelizedFunc
    from alpa_like.runtime.ray_backend import RayPipeshardExecutable
    if isinstance(like, ParallelizedFunc):
        raise TypeError(f"{who}: like is the parallelized function; pass its executable for the state and a batch "
                        "(like=train_step.get_executable(state, batch)) or a pytree of ShapeDtypeStructs")
    if isinstance(like, (SpmdExecutable, PipeshardExecutable, RayPipeshardExecutable)):
        return _wanted_by_executable(like, argnum, who)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    paths, avals, shardings = [], [], []
    for path, leaf in leaves:
        keys = tuple(key_to_str(k) for k in path)
        if not isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
            raise TypeError(f"{who}: like must be an executable, a pytree of jax.ShapeDtypeStruct (with shardings) "
                            f"or None; its leaf {_display(keys)} is a {type(leaf).__name__}")
        paths.append(".".join(keys))
        avals.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        shardings.append(getattr(leaf, "sharding", None))
    return _Wanted(tuple(paths), tuple(avals), tuple(shardings), treedef)


def _wanted_by_executable(exe, argnum: int, who: str) -> _Wanted:
    """The leaves of the executable's argument ``argnum`` and the layouts the step takes them in."""
    from alpa_like.runtime.ray_backend import RayPipeshardExecutable
    traced = exe.traced
    if isinstance(argnum, bool) or not isinstance(argnum, int) or argnum not in traced.dynamic_argnums:
        raise ValueError(f"{who}: argnum must be one of the executable's array arguments "
                         f"{list(traced.dynamic_argnums)}, got {argnum!r}")
    flat = [k for k, leaf in enumerate(traced.in_leaves) if leaf.arg_index == argnum]
    treedef = traced.in_tree.children()[traced.dynamic_argnums.index(argnum)]
    invars = traced.closed_jaxpr.jaxpr.invars
    paths = tuple(_relative_path(traced.in_leaves[k].path) for k in flat)
    avals = tuple(jax.ShapeDtypeStruct(traced.in_leaves[k].shape, invars[k].aval.dtype) for k in flat)
    if isinstance(exe, RayPipeshardExecutable):
        shardings = (None,) * len(flat)  # read by the workers (see _read_leaves); those no mesh loads: host
        return _Wanted(paths, avals, shardings, treedef, ray_executable=(exe, tuple(flat)))
    layouts = exe.input_shardings()  # a pipeline's: on the first mesh that loads the leaf (None: no mesh)
    return _Wanted(paths, avals, tuple(layouts[k] for k in flat), treedef)


def _relative_path(path: str) -> str:
    """A traced leaf's path (``state.params.w``, rooted at the argument's name) below the root (``params.w``)."""
    return path.split(".", 1)[1] if "." in path else ""


def _check_matches(records: list[dict], wanted: _Wanted, path: Path, who: str) -> None:
    """Raises ValueError naming the first leaf where the saved state and ``wanted`` differ."""
    def describe(name, shape, dtype) -> str:
        return f"{name or '(the state itself)'} {tuple(shape)} {dtype}"

    where = f"{who}: the checkpoint {path} does not fit the state to restore into"
    for k in range(max(len(records), len(wanted.paths))):
        if k >= len(records):
            aval = wanted.avals[k]
            raise ValueError(f"{where}: it has {len(records)} leaves; the state's leaf "
                             f"{describe(wanted.paths[k], aval.shape, aval.dtype)} is not in it")
        record = records[k]
        saved = (".".join(record["keys"]), tuple(record["shape"]), record["dtype"])
        if k >= len(wanted.paths):
            raise ValueError(f"{where}: the state has {len(wanted.paths)} leaves; the checkpoint's leaf "
                             f"{describe(*saved)} is not in it")
        aval = wanted.avals[k]
        if saved[0] != wanted.paths[k]:
            raise ValueError(f"{where}: leaf {k} is {describe(*saved)} in the checkpoint but "
                             f"{describe(wanted.paths[k], aval.shape, aval.dtype)} in the state")
        if saved[1] != tuple(aval.shape) or saved[2] != str(aval.dtype):
            raise ValueError(f"{where}: leaf {saved[0] or '(the state itself)'}: saved shape {saved[1]} {saved[2]}, "
                             f"wanted shape {tuple(aval.shape)} {aval.dtype}")


def _read_leaves(path: Path, records: list[dict], wanted: _Wanted | None) -> list:
    """Every leaf's value: the parts read with their targets; with a Ray executable, the leaves its meshes
    load are read by its workers."""
    values: list[Any] = [None] * len(records)
    todo = range(len(records))
    if wanted is not None and wanted.ray_executable is not None:
        exe, flat = wanted.ray_executable
        from alpa_like.runtime.ray_training import restore_step_inputs
        remote = restore_step_inputs(exe, {flat[k]: (str(path / records[k]["part"]), str(k),
                                                     _target(records[k], None)) for k in todo})
        for k in todo:
            values[k] = remote.get(flat[k])
        todo = [k for k in todo if values[k] is None]
    by_part: dict[str, dict[str, Target]] = {}
    for k in todo:
        sharding = None if wanted is None else wanted.shardings[k]
        by_part.setdefault(records[k]["part"], {})[str(k)] = _target(records[k], sharding)
    for part, targets in sorted(by_part.items()):
        for key, value in read_arrays(str(path / part), targets).items():
            values[int(key)] = value
    return values


def _target(record: dict, sharding) -> Target:
    impl = record.get("key_impl")
    dtype = None if impl else jax.numpy.dtype(record["dtype"])
    return Target(shape=tuple(record["shape"]), dtype=dtype, sharding=sharding, key_impl=impl)


def _nested(paths: Sequence[Sequence[str]], values: Sequence[Any]):
    """Values in nested dicts keyed by their paths' names (a state that is one array: the array)."""
    if len(paths) == 1 and not paths[0]:
        return values[0]
    out: dict = {}
    for keys, value in zip(paths, values, strict=True):
        node = out
        for name in keys[:-1]:
            node = node.setdefault(name, {})
        node[keys[-1]] = value
    return out

