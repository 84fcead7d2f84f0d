"""The public entry points: ``init``, ``shutdown``, ``parallelize`` and ``plan``."""
from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.trace import argument_names, leaf_aval, path_to_str
from alpa_like.compiler.options import METHODS, CreateStateParallel, DataParallel, FollowParallel, PipeshardParallel
from alpa_like.methods import spmd_layout
from alpa_like.compiler.plan import ParallelPlan
from alpa_like.compiler.plan_format import memory_message
from alpa_like.compiler.pipeline import plan_spmd
from alpa_like.compiler.spmd_planning import spmd_plan
from alpa_like.runtime.pipeshard_runtime import PipeshardExecutable
from alpa_like.runtime.spmd import InputsNotLaidOut, SpmdExecutable, compile_spmd
from alpa_like.pipeshard import compile_pipeshard, plan_pipeshard
from alpa_like.training import compile_create_state, compile_follow

CLUSTER_KINDS = ("local", "ray")
Executable = SpmdExecutable | PipeshardExecutable
"""What ``get_executable`` returns: one SPMD program, or a pipeline's stage programs."""


@dataclasses.dataclass
class _Backend:
    kind: str
    devices: tuple[Any, ...]
    ray: Any = None
    """For ``"ray"``: the :class:`~alpa_like.runtime.ray_backend.RayCluster`."""


_backend: _Backend | None = None
_generation = 0
"""Counts init() calls: executables compiled for an earlier backend are not reused."""


def init(cluster: str = "local", *, devices: Sequence[Any] | None = None, address: str | None = None,
         num_nodes: int | None = None, num_devices_per_node: int | None = None, **ray_options) -> None:
    """Chooses where parallelized functions run.

    Args:
      cluster: ``"local"`` (default): the devices of this process, each stage on a disjoint set of them.
        ``"ray"``: a Ray cluster, one worker actor per pipeline mesh (PipeshardParallel steps only).
      devices: for ``"local"``, the devices to use (default: all of ``jax.devices()``).
      address: for ``"ray"``: ``None`` uses the Ray this process is connected to, or starts a local one;
        ``"host:port"`` (or ``"auto"``) connects to a running cluster.
      num_nodes, num_devices_per_node: for ``"ray"``: the cluster plans are made for (default: the Ray
        cluster's node count when ``address`` is given, else 1; ``len(jax.devices())``).
      ray_options: for ``"ray"``: ``platform`` ("cpu" | "gpu"), ``step_timeout`` (seconds, default 600),
        ``startup_timeout`` (seconds, default 180), ``compilation_cache_dir`` (JAX's persistent compilation
        cache for the workers), ``ping_timeout`` (seconds a worker may leave a ping unanswered during a step,
        default 10); see :class:`~alpa_like.runtime.ray_backend.RayCluster`.
    """
    global _backend, _generation
    if cluster not in CLUSTER_KINDS:
        raise ValueError(f"al.init: cluster must be one of {CLUSTER_KINDS}, got {cluster!r}")
    if cluster == "local" and (address is not None or num_nodes is not None or num_devices_per_node is not None
                               or ray_options):
        raise ValueError("al.init: address, num_nodes, num_devices_per_node and Ray options need cluster='ray'")
    shutdown()
    _generation += 1
    if cluster == "ray":
        from alpa_like.runtime.ray_backend import RayCluster
        if devices is not None:
            raise ValueError("al.init(cluster='ray'): devices is for cluster='local' (Ray workers own theirs)")
        _backend = _Backend(kind=cluster, devices=(), ray=RayCluster(
            address=address, num_nodes=num_nodes, num_devices_per_node=num_devices_per_node, **ray_options))
        return
    _backend = _Backend(kind=cluster, devices=jax.devices() if devices is None else check_devices(devices))


def check_devices(devices: Sequence[Any]) -> tuple[Any, ...]:
    """``devices`` as a tuple, checked: JAX devices of this process, each once, of one platform.

    Raises:
      TypeError: ``devices`` is not a sequence of ``jax.Device``.
      ValueError: it is empty, repeats a device, or mixes platforms.
    """
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(f"al.init: devices must be a sequence of jax devices (e.g. jax.devices()[:4]), "
                        f"got {type(devices).__name__}")
    devices = tuple(devices)
    if not devices:
        raise ValueError("al.init: devices must not be empty")
    for k, d in enumerate(devices):
        if not isinstance(d, jax.Device):
            raise TypeError(f"al.init: devices[{k}] must be a jax device (an element of jax.devices()), "
                            f"got {type(d).__name__} {d!r:.60}")
    seen: dict[Any, int] = {}
    for k, d in enumerate(devices):
        if d in seen:
            raise ValueError(f"al.init: devices[{k}] repeats devices[{seen[d]}] ({d}); each device may be "
                             "given once")
        seen[d] = k
    platforms = sorted({d.platform for d in devices})
    if len(platforms) > 1:
        raise ValueError(f"al.init: devices must share one platform, got {platforms}")
    return devices


def shutdown() -> None:
    """Forgets the backend (for Ray: kills every worker actor it made); the next parallelized call (or
    ``init``) starts a new one."""
    global _backend
    if _backend is not None and _backend.ray is not None:
        _backend.ray.shutdown()
    _backend = None


def backend_devices() -> tuple[Any, ...]:
    """The devices of the current backend (initialising ``"local"`` on first use)."""
    if _backend is None:
        init("local")
    assert _backend is not None
    return _backend.devices


def _check_method(method: Any) -> Any:
    if method is None:
        return DataParallel()
    if not isinstance(method, METHODS):
        names = ", ".join(m.__name__ for m in METHODS)
        raise TypeError(f"method must be one of {names} (an instance, e.g. al.DataParallel()), "
                        f"got {method!r}")
    return method


def _check_argnums(name: str, argnums: int | Sequence[int]) -> tuple[int, ...]:
    """``argnums`` as a tuple of non-negative ints (a bool is not an argument number)."""
    if isinstance(argnums, bool) or not isinstance(argnums, (int, Sequence)) or isinstance(argnums, str):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {argnums!r}")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in nums):
        raise ValueError(f"{name} must be non-negative ints (not bools), got {argnums!r}")
    return nums


def as_cluster(cluster: ClusterSpec | str | os.PathLike | None) -> ClusterSpec | None:
    """A ``cluster`` argument as a :class:`ClusterSpec` (loading a saved one from its path), or None."""
    if cluster is None or isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, (str, os.PathLike)):
        return ClusterSpec.load(cluster)
    raise TypeError(f"cluster must be an al.ClusterSpec or the path of a saved one (ClusterSpec.save), got "
                    f"{type(cluster).__name__}")


def _check_cluster_devices(cluster: ClusterSpec, num_devices: int, where: str) -> None:
    if cluster.num_devices != num_devices:
        raise ValueError(f"cluster {cluster.name!r} has {cluster.num_devices} devices ({cluster.num_nodes} x "
                         f"{cluster.num_devices_per_node}), but {where} are {num_devices}: a plan runs on the "
                         "devices it was made for (use al.plan to plan for another cluster)")


def _signature(fun: Callable, args: Sequence[Any], static_argnums: Sequence[int]) -> Hashable:
    """Cache key: pytree structure, shapes and dtypes of the dynamic arguments, values of the static ones."""
    names = argument_names(fun, len(args))
    key = []
    for i, arg in enumerate(args):
        if i in static_argnums:
            try:
                hash(arg)
            except TypeError:
                raise TypeError(f"static argument {i} ({names[i]}) must be hashable, got "
                                f"{type(arg).__name__}") from None
            key.append(("static", arg))
            continue
        leaves, tree = jax.tree_util.tree_flatten_with_path(arg)
        avals = tuple(leaf_aval(leaf, path_to_str(names[i], path)) for path, leaf in leaves)
        key.append((jax.tree_util.tree_structure(arg), tuple((a.shape, str(a.dtype)) for a in avals)))
    return tuple(key)


class ParallelizedFunc:
    """A training step under ``@al.parallelize``: compiles once per input signature and caches."""

    def __init__(self, fun: Callable, *, method: Any, static_argnums: tuple[int, ...],
                 donate_argnums: tuple[int, ...], batch_argnums: tuple[int, ...], cluster: ClusterSpec | None = None):
        overlap = set(static_argnums) & set(donate_argnums)
        if overlap:
            raise ValueError(f"arguments {sorted(overlap)} are in both static_argnums and donate_argnums")
        self.fun = fun
        self.method = method
        self.static_argnums = static_argnums
        self.donate_argnums = donate_argnums
        self.batch_argnums = batch_argnums
        self.cluster = cluster
        """The cost model's cluster (None: :meth:`ClusterSpec.local` of the backend's devices, or the Ray
        cluster's spec)."""
        self._cache: dict[Hashable, Executable] = {}
        self._last: tuple | None = None
        """(backend generation, static argument values, executable) of the last SPMD call: tried first."""
        functools.update_wrapper(self, fun)

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError(f"{self.__name__}: pass arguments positionally (got keywords {sorted(kwargs)})")
        last = self._last
        if last is not None and last[0] == _generation and last[1] == self._static_values(args):
            try:  # the common case: the last executable's signature and layouts (JAX's C++ checks)
                return last[2].call_as_laid_out(*args)
            except InputsNotLaidOut:
                pass
        exe = self.get_executable(*args)
        if isinstance(exe, SpmdExecutable):
            self._last = (_generation, self._static_values(args), exe)
        return exe(*args)

    def _static_values(self, args) -> tuple:
        return tuple(args[i] for i in self.static_argnums if i < len(args))

    def get_executable(self, *args) -> Executable:
        """The compiled executable for these arguments (compiled now if this signature is new)."""
        backend_devices()  # initialises the default backend first: the key names its generation
        key = (_generation, _signature(self.fun, args, self.static_argnums))
        exe = self._cache.get(key)
        if exe is None:
            exe = self._compile(args)
            self._cache[key] = exe
        return exe

    def clear_cache(self) -> None:
        self._cache.clear()
        self._last = None

    @property
    def num_compilations(self) -> int:
        return len(self._cache)

    def _compile(self, args) -> Executable:
        for i in self.donate_argnums:
            if i >= len(args):
                raise ValueError(f"donate_argnums contains {i}, but the step has {len(args)} arguments")
        devices = backend_devices()
        if isinstance(self.method, CreateStateParallel):
            return compile_create_state(self.fun, args, self.method)
        if isinstance(self.method, FollowParallel):
            return compile_follow(self.fun, args, self.method, static_argnums=self.static_argnums,
                                  batch_argnums=self.batch_argnums)
        if _backend.ray is not None:
            return self._compile_ray(args)
        cluster = self.cluster or ClusterSpec.local(devices)
        _check_cluster_devices(cluster, len(devices), "the local backend's devices (al.init)")
        if isinstance(self.method, PipeshardParallel):
            exe = compile_pipeshard(self.method, self.fun, args, static_argnums=self.static_argnums,
                                    batch_argnums=self.batch_argnums, devices=devices, cluster=cluster,
                                    donate_argnums=self.donate_argnums)
            exe.plan.check_fits()  # the stage pieces compile on the first step: nothing has run
            return exe
        device_ids = [d.id for d in devices]
        planned = plan_spmd(self.method, self.fun, args, static_argnums=self.static_argnums,
                            batch_argnums=self.batch_argnums, cluster=cluster, device_ids=device_ids,
                            layout=lambda traced: spmd_layout(self.method, traced, cluster, devices=devices))
        planned.plan.check_fits()
        traced, layout = planned.traced, planned.layout
        donate_flat = [k for k, leaf in enumerate(traced.in_leaves) if leaf.arg_index in self.donate_argnums]
        compiled = compile_spmd(traced, layout, devices, num_micro_batches=self.method.num_micro_batches,
                                donate_flat=donate_flat)
        plan = spmd_plan(self.method, traced, layout, cluster, device_ids=device_ids, out_specs=compiled.out_specs)
        return SpmdExecutable(traced=traced, plan=plan, compiled=compiled)

    def _compile_ray(self, args):
        from alpa_like.runtime.ray_backend import RayPipeshardExecutable
        from alpa_like.runtime.ray_nodes import one_node_meshes
        if not isinstance(self.method, PipeshardParallel):
            raise NotImplementedError(f"al.init(cluster='ray') runs PipeshardParallel steps; got "
                                      f"{type(self.method).__name__} (use al.init('local') for SPMD methods)")
        cluster = _backend.ray
        spec = self.cluster or cluster.spec()
        _check_cluster_devices(spec, cluster.spec().num_devices, "the Ray cluster's devices")
        method = one_node_meshes(self.method, spec)  # one actor runs each mesh, on one node
        exe = compile_pipeshard(method, self.fun, args, static_argnums=self.static_argnums,
                                batch_argnums=self.batch_argnums, devices=None, cluster=spec,
                                make_executable=functools.partial(RayPipeshardExecutable, cluster=cluster),
                                donate_argnums=self.donate_argnums)
        exe.plan.check_fits()
        return exe


def parallelize(fun: Callable | None = None, *, method: Any = None, static_argnums: int | Sequence[int] = (),
                donate_argnums: int | Sequence[int] = (), batch_argnums: int | Sequence[int] = (1,),
                cluster: ClusterSpec | str | os.PathLike | None = None):
    """Parallelizes a training step; use as ``@al.parallelize`` or ``@al.parallelize(method=...)``.

    Args:
      fun: the step, e.g. ``train_step(state, batch) -> (new_state, metrics)``; positional arguments only.
      method: how to parallelize (default ``DataParallel()``).
      static_argnums: arguments that are hashable Python values, compiled into the step.
      donate_argnums: arguments whose buffers the step may reuse for its outputs (e.g. the state).
      batch_argnums: arguments whose leaves share a batch dim 0 (split over devices and micro-batches).
      cluster: the cluster the cost model plans for: a :class:`ClusterSpec` or the path of one saved with
        :meth:`ClusterSpec.save`; it must have as many devices as the backend. Default:
        ``ClusterSpec.local()`` of the backend's devices (measured once per machine and stored), or the Ray
        cluster's spec.

    A step whose plan does not fit in the cluster's device memory (``plan.fits``) raises ``ValueError`` when it
    is compiled, naming the bytes missing per device, before anything runs.
    """
    static = _check_argnums("static_argnums", static_argnums)
    cluster = as_cluster(cluster)
    donate = _check_argnums("donate_argnums", donate_argnums)
    batch = _check_argnums("batch_argnums", batch_argnums)
    method = _check_method(method)

    def wrap(f: Callable) -> ParallelizedFunc:
        if not callable(f):
            raise TypeError(f"parallelize needs a function, got {type(f).__name__}")
        return ParallelizedFunc(f, method=method, static_argnums=static, donate_argnums=donate,
                                batch_argnums=batch, cluster=cluster)

    return wrap if fun is None else wrap(fun)


def plan(fun: Callable, *args, method: Any = None, cluster: ClusterSpec | str | os.PathLike | None = None,
         static_argnums: int | Sequence[int] = (), batch_argnums: int | Sequence[int] = (1,)) -> ParallelPlan:
    """Plans ``fun(*args)`` for ``cluster`` without allocating or running anything.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct`` pytrees. ``cluster`` defaults to the devices of this
    process; pass ``ClusterSpec.preset("p3.16xlarge", num_nodes=8)`` to plan for 64 GPUs on a laptop (or
    the path of a spec saved with :meth:`ClusterSpec.save`). The plan says whether its estimated peak memory
    fits the cluster's devices (``plan.fits``, printed with the plan); when it does not, a warning says how
    much is missing.
    """
    if isinstance(fun, ParallelizedFunc):
        fun = fun.fun
    method = _check_method(method)
    if isinstance(method, (CreateStateParallel, FollowParallel)):
        raise TypeError(f"al.plan: {type(method).__name__} runs in its train step's plan and makes none of its "
                        "own: plan the train step (al.plan(train_step, state, batch, method=...))")
    cluster = as_cluster(cluster)
    if cluster is None:
        cluster = (_backend.ray.spec() if _backend is not None and _backend.ray is not None
                   else ClusterSpec.local(backend_devices()))
    if isinstance(method, PipeshardParallel):
        result = plan_pipeshard(method, fun, args, static_argnums=_check_argnums("static_argnums", static_argnums),
                                batch_argnums=_check_argnums("batch_argnums", batch_argnums), cluster=cluster)
    else:
        result = plan_spmd(method, fun, args, static_argnums=_check_argnums("static_argnums", static_argnums),
                           batch_argnums=_check_argnums("batch_argnums", batch_argnums), cluster=cluster,
                           layout=lambda traced: spmd_layout(method, traced, cluster)).plan
    if not result.fits:
        warnings.warn(f"al.plan: {memory_message(result)}", stacklevel=2)
    return result
