"""The array I/O of checkpoints: a flat dict of arrays as one orbax-checkpoint PyTree checkpoint.

Orbax writes every shard from the device that holds it (through tensorstore, each replicated shard once) and
reads back only the region each target device needs, so no array is ever gathered whole on one device or on
the host. The driver (:mod:`alpa_like.checkpoint`) and the Ray workers
(:meth:`~alpa_like.runtime.ray_worker.MeshWorker.save_handles`) both write and read with these functions.

Typed PRNG keys, which orbax does not store, are written as their key data; the impl's name comes back to
the caller, which passes it to :func:`read_arrays` again.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from alpa_like.compiler import jax_compat
from alpa_like.compiler.optional_imports import require

CHECKPOINT_FEATURE = "al.save_checkpoint / al.restore_checkpoint"


@dataclasses.dataclass(frozen=True)
class Target:
    """What to read one array into."""

    shape: tuple[int, ...]
    dtype: Any
    """The array's dtype (a typed PRNG key's: its ``key<...>`` dtype)."""
    sharding: jax.sharding.Sharding | None = None
    """The devices and layout to read into; None: a host NumPy array."""
    key_impl: str | None = None
    """For a typed PRNG key: the impl's name (the array on disk is its key data)."""


def key_data_sharding(sharding: jax.sharding.Sharding, ndim: int) -> jax.sharding.Sharding:
    """The sharding of a key array's data (one more trailing dim, not split) for a key array's ``sharding``."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec, None))
    return sharding


class PendingWrite:
    """A write whose device-to-host copies are done (the arrays may be changed or deleted); :meth:`wait`
    returns once every file is written."""

    def __init__(self, checkpointer, key_impls: dict[str, str]):
        self._checkpointer, self.key_impls = checkpointer, key_impls

    def wait(self) -> dict[str, str]:
        """Waits for the files; returns ``{orbax key: impl name}`` of the typed PRNG keys written."""
        if self._checkpointer is not None:
            try:
                self._checkpointer.wait_until_finished()
            finally:
                self._checkpointer.close()
                self._checkpointer = None
        return self.key_impls


def start_write(path: str, arrays: Mapping[str, Any]) -> PendingWrite:
    """Starts writing ``arrays`` (orbax key -> ``jax.Array`` or NumPy array) as one checkpoint at ``path``,
    which must not exist. Returns when the arrays have been copied off their devices."""
    ocp = require("orbax.checkpoint", CHECKPOINT_FEATURE, package="orbax-checkpoint")
    items, key_impls = {}, {}
    for key, x in arrays.items():
        if jax_compat.is_prng_key(getattr(x, "dtype", np.float32)):
            key_impls[key] = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        items[key] = x
    checkpointer = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())
    try:
        checkpointer.save(path, args=ocp.args.PyTreeSave(items))
    except BaseException:
        checkpointer.close()
        raise
    return PendingWrite(checkpointer, key_impls)


def write_arrays(path: str, arrays: Mapping[str, Any]) -> dict[str, str]:
    """Writes ``arrays`` at ``path`` (:func:`start_write`) and waits; returns the PRNG keys' impl names."""
    return start_write(path, arrays).wait()


def _key_data_shape(impl: str) -> tuple[int, ...]:
    """The trailing dims one key of the PRNG impl named ``impl`` adds to its key data (``(2,)`` for threefry)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape


def read_arrays(path: str, targets: Mapping[str, Target]) -> dict[str, Any]:
    """Reads the arrays ``targets`` names (orbax key -> :class:`Target`) from the checkpoint at ``path``, each
    into its target's sharding (only the shards each device holds) or onto the host; other arrays of the
    checkpoint are not read."""
    ocp = require("orbax.checkpoint", CHECKPOINT_FEATURE, package="orbax-checkpoint")
    items, restore_args = {}, {}
    for key, t in targets.items():
        shape = t.shape + _key_data_shape(t.key_impl) if t.key_impl else t.shape
        dtype = np.uint32 if t.key_impl else t.dtype
        if t.sharding is None:
            items[key] = jax.ShapeDtypeStruct(shape, dtype)
            restore_args[key] = ocp.RestoreArgs(restore_type=np.ndarray)
        else:
            sharding = key_data_sharding(t.sharding, len(t.shape)) if t.key_impl else t.sharding
            items[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            restore_args[key] = ocp.ArrayRestoreArgs(sharding=sharding)
    with ocp.PyTreeCheckpointer() as checkpointer:
        read = checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=items, restore_args=restore_args,
                                                                      partial_restore=True))
    out = {}
    for key, t in targets.items():
        x = read[key]
        if t.key_impl:
            x = jax.random.wrap_key_data(x, impl=t.key_impl)
            if t.sharding is not None:
                x = jax.device_put(x, t.sharding)
        out[key] = x
    return out
