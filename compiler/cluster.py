"""Cluster descriptions: how many devices, how fast they compute, how fast they talk.

A :class:`ClusterSpec` is plain data consumed by the planning passes: the stage DP (Alpa Eq. 3.2-3.5)
enumerates submeshes of ``num_nodes x num_devices_per_node``, ``LogicalMesh.from_cluster`` turns the
bandwidths and latencies into per-axis alpha-beta costs for the intra-op ILP (Eq. 3.1), and the simulator
prices each equation with :attr:`ClusterSpec.compute_rates` (the GPU presets' fitted model:
:data:`GPU_COMPUTE_MODEL`). Nothing here needs the devices to exist, so a 64-GPU cluster can be
planned on a laptop (``ClusterSpec.preset("p3.16xlarge", num_nodes=8)``); :meth:`ClusterSpec.local`
measures the devices of this process instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from alpa_like.compiler import fields

if TYPE_CHECKING:
    from alpa_like.compiler.flops import ComputeRates

_GIB = 2**30
_GBIT_PER_S = 1e9 / 8  # bytes/s in one Gb/s


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A homogeneous cluster of ``num_nodes`` nodes with ``num_devices_per_node`` devices each."""

    name: str
    """Human-readable name, e.g. the preset name ``"p3.16xlarge"`` or ``"local-cpu"``."""
    num_nodes: int
    """Number of nodes (hosts); >= 1."""
    num_devices_per_node: int
    """Accelerators per node; >= 1."""
    device_name: str
    """Device model, e.g. ``"V100-SXM2-16GB"``."""
    peak_flops: float
    """Peak FLOP/s of one device at the training dtype (FP16/BF16 tensor cores for GPUs)."""
    device_memory: int
    """Memory of one device, in bytes."""
    intra_node_bandwidth: float
    """Bytes/s per device, unidirectional, that a ring collective inside one node sees (NVLink)."""
    inter_node_bandwidth: float
    """Bytes/s per device, unidirectional, that a ring collective across nodes sees (the node's NICs
    shared by its devices)."""
    intra_node_latency: float
    """Seconds: fixed cost (alpha) of one collective inside a node."""
    inter_node_latency: float
    """Seconds: fixed cost (alpha) of one collective across nodes."""
    shared_host_compute: bool = False
    """True when the devices of a node are virtual and share the host's cores (XLA's CPU devices): work on
    two meshes of one node then takes turns instead of overlapping, which the simulated backend models."""
    memory_bandwidth: float | None = None
    """Bytes/s per device that an element-wise op reads plus writes while every device of the node runs one
    (the situation inside a training step). With it, each jaxpr equation costs the larger of its FLOP time
    and its memory time (:func:`~alpa_like.compiler.flops.equation_seconds`, a roofline). None: no memory
    term, FLOPs only. The GPU presets set it to their datasheet bandwidth times :data:`GPU_BANDWIDTH_SHARE`."""
    fp32_peak_flops: float | None = None
    """Peak FLOP/s of one device for a matrix product or convolution with float32 operands, at XLA's
    default precision (float32 on a V100, TF32 on an A100 or H100), or None: the same as ``peak_flops``
    (measured clusters, whose ``peak_flops`` is a float32 matmul). Alpa trains Wide-ResNet in FP32."""
    launch_overhead: float = 0.0
    """Seconds the host spends launching one compiled executable on the devices (dispatch, argument
    handling, the runtime's thunk start-up), paid once per RUN instruction by the simulated backend."""
    matmul_efficiency: float = 1.0
    """Fraction in (0, 1] of ``peak_flops`` (or ``fp32_peak_flops``) a large matrix product or convolution
    reaches (:class:`~alpa_like.compiler.flops.ComputeRates`)."""
    matmul_overhead: float = 0.0
    """Seconds every matrix product or convolution adds to its roofline time, so that small products run
    below ``matmul_efficiency`` of the peak."""
    fused_traffic: float = 1.0
    """Fraction in (0, 1] of a non-matrix equation's operand and result bytes that reaches device memory in
    a compiled (fused) program; used with ``memory_bandwidth``."""
    measured_at: str | None = None
    """When the speed fields were measured (:meth:`local`), as an ISO 8601 UTC time, e.g.
    ``"2026-11-26T07:30:00Z"``; None for presets and specs written by hand."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_devices(self) -> int:
        """Total number of devices, ``num_nodes * num_devices_per_node``."""
        return self.num_nodes * self.num_devices_per_node

    @property
    def compute_rates(self) -> ComputeRates:
        """The rates one device's work is priced at (:func:`~alpa_like.compiler.flops.jaxpr_seconds`)."""
        from alpa_like.compiler.flops import ComputeRates  # Local import: presets and JSON need no JAX.

        return ComputeRates(peak_flops=self.peak_flops, memory_bandwidth=self.memory_bandwidth,
                            fp32_peak_flops=self.fp32_peak_flops, matmul_efficiency=self.matmul_efficiency,
                            matmul_overhead=self.matmul_overhead, fused_traffic=self.fused_traffic)

    @classmethod
    def preset(cls, name: str, num_nodes: int = 1) -> ClusterSpec:
        """A named cluster of the seeds' papers (or a modern one) with ``num_nodes`` nodes.

        Args:
          name: one of ``"p3.16xlarge"`` (Alpa's and TeraPipe's AWS testbed), ``"dgx-a100"``
            (Megatron-LM's Selene), ``"h100"`` (a DGX H100-like node) and ``"h200"`` (the same with H200s).
            Every preset prices compute with the GPU model fitted to measurements of one H200
            (:data:`GPU_COMPUTE_MODEL`) and the memory bandwidth of its datasheet scaled by what the H200
            reached of its own.
          num_nodes: number of nodes, >= 1.

        Raises:
          ValueError: for an unknown name (the message lists the valid ones) or ``num_nodes < 1``.

        >>> ClusterSpec.preset("p3.16xlarge", num_nodes=8).num_devices
        64
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; valid names: {sorted(_PRESETS)}")
        if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
        return _PRESETS[name](num_nodes)

    @classmethod
    def local(cls, devices: Sequence[Any] | None = None, *, remeasure: bool = False) -> ClusterSpec:
        """The devices of this process (default ``jax.local_devices()``) as one node, with measured speed.

        The measurement is stored per machine and device set in the user's cache directory
        (:func:`cache_dir`) and read back by later calls and later processes, so that plans made on this
        machine stay the same from run to run; ``measured_at`` says when it was taken (the plan prints it).
        ``remeasure=True`` measures again and replaces the stored spec. Where the cache directory cannot be
        written, the spec is measured once per process.

        ``peak_flops`` is the best of a few timed float32 matmuls run on every device at once, per device
        (not a datasheet peak): devices that share host cores (virtual CPU devices) slow each other down,
        and a plan runs on all of them together. The intra-node bandwidth and latency are fitted to timed
        all-reduces over all the devices at two sizes, ``t = alpha + 2 (n - 1) / n * bytes / bandwidth``
        (the ring model of :class:`~alpa_like.compiler.logical_mesh.LogicalMesh`), each minus the time of
        launching a trivial program on the devices; with one device, to timed ``jax.device_put`` copies from
        the host. There is no inter-node link, so the inter-node fields repeat the intra-node ones. CPU devices
        share the host's cores (``shared_host_compute``).
        ``device_memory`` is ``device.memory_stats()["bytes_limit"]`` when the backend reports it, else
        the host's RAM divided by the device count. ``launch_overhead`` is the time of a trivial jitted program
        on every device (4 bytes each); ``memory_bandwidth`` is fitted, per device, to an element-wise
        ``x * a + b`` run on every device at once on two array sizes far beyond the caches, bytes read plus
        written over the time minus the launch (see :func:`_measure_launch_and_memory`). The measurements are
        cached per device set and take a few seconds.
        """
        import jax  # Local import: presets and JSON loading need no JAX.

        devices = tuple(jax.local_devices() if devices is None else devices)
        if not devices:
            raise ValueError("devices must not be empty")
        path = _local_cache_path(devices)
        if not remeasure:
            stored = _read_stored_spec(path)
            if stored is not None:
                return stored
        spec = cls._measure(devices)
        _store_spec(path, spec)
        return spec

    @classmethod
    def _measure(cls, devices: tuple[Any, ...]) -> ClusterSpec:
        """Measures ``devices`` now (see :meth:`local`)."""
        first = devices[0]
        peer = devices[1] if len(devices) > 1 else None
        bandwidth, latency = _measure_all_reduce(devices) if peer is not None else _measure_copy(first, None)
        launch_overhead, memory_bandwidth = _measure_launch_and_memory(devices)
        return cls(
            name=f"local-{first.platform}",
            num_nodes=1,
            num_devices_per_node=len(devices),
            device_name=str(getattr(first, "device_kind", first.platform)),
            peak_flops=_measure_concurrent_matmul_flops(devices),
            device_memory=_device_memory(first, len(devices)),
            intra_node_bandwidth=bandwidth,
            inter_node_bandwidth=bandwidth,
            intra_node_latency=latency,
            inter_node_latency=latency,
            shared_host_compute=first.platform == "cpu",
            memory_bandwidth=memory_bandwidth,
            launch_overhead=launch_overhead,
            measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )

    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-safe dict; ``ClusterSpec.from_dict(spec.to_dict()) == spec``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Inverse of :meth:`to_dict`; unknown keys, or missing keys without a default, raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        unknown = sorted(set(data) - names)
        missing = sorted(required - set(data))
        if unknown or missing:
            raise ValueError(f"ClusterSpec.from_dict: unknown keys {unknown}, missing keys {missing}")
        return cls(**data)

    def to_json(self) -> str:
        """The spec as JSON text; ``ClusterSpec.from_json(spec.to_json()) == spec``."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        """Inverse of :meth:`to_json`; text that is not a JSON object of valid fields raises ``ValueError``."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"ClusterSpec.from_json: text is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"ClusterSpec.from_json: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        """Writes :meth:`to_json` to ``path`` (atomically: a reader sees the old file or the new one)."""
        _write_atomically(os.fspath(path), self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ClusterSpec:
        """A spec written by :meth:`save` (e.g. a measured ``ClusterSpec.local()`` kept with a project, so
        that every run plans with the same cost model)."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"ClusterSpec.load: cannot read {os.fspath(path)!r} ({e.strerror})") from None
        try:
            return cls.from_json(text)
        except (ValueError, TypeError) as e:
            raise ValueError(f"ClusterSpec.load: {os.fspath(path)!r} is not a saved ClusterSpec: {e}") from None

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.num_nodes} node(s) x {self.num_devices_per_node} {self.device_name} "
            f"({self.peak_flops / 1e12:.4g} TFLOP/s, {self.device_memory / _GIB:.4g} GiB each); "
            f"intra-node {self.intra_node_bandwidth / 1e9:.4g} GB/s, {self.intra_node_latency * 1e6:.3g} us; "
            f"inter-node {self.inter_node_bandwidth / 1e9:.4g} GB/s, {self.inter_node_latency * 1e6:.3g} us"
            + ("" if self.memory_bandwidth is None else
               f"; memory {self.memory_bandwidth / 1e9:.4g} GB/s, launch {self.launch_overhead * 1e6:.3g} us")
            + ("" if (self.matmul_efficiency, self.matmul_overhead) == (1.0, 0.0) else
               f"; matmul {self.matmul_efficiency:.3g} of peak + {self.matmul_overhead * 1e6:.3g} us")
            + ("" if self.fused_traffic == 1.0 else f"; fused traffic {self.fused_traffic:.3g}")
            + ("" if self.measured_at is None else f"; measured {self.measured_at}")
        )


def _validate(spec: ClusterSpec) -> None:
    """Raises ValueError naming the first field that is out of range (speeds and sizes finite)."""
    if not isinstance(spec.name, str) or not spec.name:
        raise fields.invalid("name", "a non-empty string", spec.name)
    fields.string(spec.device_name, "device_name")
    if spec.measured_at is not None and not isinstance(spec.measured_at, str):
        raise fields.invalid("measured_at", "null or an ISO 8601 time string", spec.measured_at)
    fields.boolean(spec.shared_host_compute, "shared_host_compute")
    for field in ("num_nodes", "num_devices_per_node", "device_memory"):
        fields.integer(getattr(spec, field), field, 1)
    for field in ("peak_flops", "intra_node_bandwidth", "inter_node_bandwidth"):
        fields.number(getattr(spec, field), field, positive=True)
    for field in ("memory_bandwidth", "fp32_peak_flops"):
        fields.optional(fields.number)(getattr(spec, field), field, positive=True)
    for field in ("intra_node_latency", "inter_node_latency", "launch_overhead", "matmul_overhead"):
        fields.number(getattr(spec, field), field)
    for field in ("matmul_efficiency", "fused_traffic"):
        value = getattr(spec, field)
        fields.number(value, field, positive=True)
        if value > 1:
            raise fields.invalid(field, "a number in (0, 1]", value)


# ---------------------------------------------------------------------------------------------------
# Presets. Bandwidths are per device and unidirectional; a node's NICs are shared by its devices.
# Latencies are order-of-magnitude assumptions (the seeds give none): ~5 us for an NCCL collective over
# NVLink, ~10 us over InfiniBand RDMA, ~50 us over TCP/Ethernet.
# ---------------------------------------------------------------------------------------------------


GPU_COMPUTE_MODEL: dict[str, float] = {
    "matmul_efficiency": 0.805,
    "matmul_overhead": 22.9e-6,
    "fused_traffic": 0.133,
    "launch_overhead": 24.5e-6,
}
"""The compute terms of every GPU preset, fitted by ``examples/benchmarks/gpu_cost_fit.py`` to one NVIDIA
H200 running jax 0.11.2 (``examples/benchmarks/data/h200``): large 16-bit matrix products reached 0.805 of
the datasheet peak, each matrix product of a training step added 22.9 us, a fused program moved 0.133 of the
non-matrix equations' unfused bytes, and the fastest call of a jitted program took 24.5 us. Fitted on five
GPT steps; on the six held out (GPTs, an MoE, a Wide-ResNet, GPT-1.3B) the plans' predictions are within
10%. Other GPUs are not measured: they take the same terms with their own datasheet rates."""
GPU_BANDWIDTH_SHARE = 4.18 / 4.8
"""Share of the datasheet memory bandwidth element-wise ops and row sums over 256 MiB and more reached on the
H200 (4.18 of 4.8 TB/s); the presets' ``memory_bandwidth`` is their datasheet bandwidth times this."""


def _gpu_model(datasheet_bandwidth: float) -> dict[str, float]:
    """The compute-model fields of a GPU preset whose datasheet memory bandwidth is ``datasheet_bandwidth``."""
    return {"memory_bandwidth": datasheet_bandwidth * GPU_BANDWIDTH_SHARE, **GPU_COMPUTE_MODEL}


def _p3_16xlarge(num_nodes: int) -> ClusterSpec:
    """AWS p3.16xlarge: the Alpa (dissertation §3.8) and TeraPipe (§2.5) testbed."""
    return ClusterSpec(
        name="p3.16xlarge",
        num_nodes=num_nodes,
        # Alpa §3.8: "8 NVIDIA V100 16 GB GPUs" per node, "connected via NVLink".
        num_devices_per_node=8,
        device_name="V100-SXM2-16GB",
        # NVIDIA V100 datasheet: 125 TFLOP/s FP16 tensor-core peak (SXM2). Alpa trains GPT/MoE in FP16.
        peak_flops=125e12,
        # NVIDIA V100 datasheet: 15.7 TFLOP/s FP32 (SXM2); a V100 has no TF32, so float32 products run there.
        fp32_peak_flops=15.7e12,
        device_memory=16 * _GIB,
        # NVIDIA V100 datasheet: NVLink 2.0, 300 GB/s bidirectional per GPU -> 150 GB/s unidirectional.
        intra_node_bandwidth=150e9,
        # Alpa §3.8: "25Gbps cross-node bandwidth" per node (one ENA NIC), shared by the 8 GPUs.
        inter_node_bandwidth=25 * _GBIT_PER_S / 8,
        intra_node_latency=5e-6,
        inter_node_latency=50e-6,  # TCP over Ethernet (no EFA on p3.16xlarge).
        **_gpu_model(900e9),  # NVIDIA V100 datasheet: 900 GB/s HBM2.
    )


def _dgx_a100(num_nodes: int) -> ClusterSpec:
    """NVIDIA DGX A100 80 GB: Megatron-LM PTD-P's Selene nodes (seed 002, §5)."""
    return ClusterSpec(
        name="dgx-a100",
        num_nodes=num_nodes,
        # Megatron-LM §5: "8 NVIDIA 80-GB A100 GPUs, connected to each other by NVLink and NVSwitch".
        num_devices_per_node=8,
        device_name="A100-SXM4-80GB",
        # Megatron-LM §5: "The peak device throughput of an A100 GPU with 16-bit precision is 312 teraFLOP/s".
        peak_flops=312e12,
        # NVIDIA A100 datasheet: 156 TFLOP/s TF32 tensor core (dense), XLA's default for float32 products.
        fp32_peak_flops=156e12,
        device_memory=80 * _GIB,
        # NVIDIA A100 datasheet: NVLink 3 (NVSwitch), 600 GB/s bidirectional per GPU -> 300 GB/s.
        intra_node_bandwidth=300e9,
        # Megatron-LM §5: "eight NVIDIA Mellanox 200Gbps HDR InfiniBand HCAs" per node: one per GPU.
        inter_node_bandwidth=200 * _GBIT_PER_S,
        intra_node_latency=5e-6,
        inter_node_latency=10e-6,
        **_gpu_model(2.039e12),  # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e.
    )


def _h100(num_nodes: int) -> ClusterSpec:
    """A DGX H100-like node: 8 x H100 SXM 80 GB, NVLink 4, 8 x 400 Gb/s NDR InfiniBand."""
    return ClusterSpec(
        name="h100",
        num_nodes=num_nodes,
        num_devices_per_node=8,  # NVIDIA DGX H100 datasheet: 8 x H100 SXM5 80 GB.
        device_name="H100-SXM5-80GB",
        # NVIDIA H100 datasheet: 1,979 TFLOP/s BF16 "with sparsity" -> 989 TFLOP/s dense.
        peak_flops=989e12,
        # NVIDIA H100 datasheet: 989 TFLOP/s TF32 "with sparsity" -> 494.5 TFLOP/s dense.
        fp32_peak_flops=494.5e12,
        device_memory=80 * _GIB,
        # NVIDIA H100 datasheet: NVLink 4, 900 GB/s bidirectional per GPU -> 450 GB/s.
        intra_node_bandwidth=450e9,
        # NVIDIA DGX H100 datasheet: 8 x ConnectX-7 400 Gb/s (NDR) compute NICs: one per GPU.
        inter_node_bandwidth=400 * _GBIT_PER_S,
        intra_node_latency=5e-6,
        inter_node_latency=10e-6,
        **_gpu_model(3.35e12),  # NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3.
    )


def _h200(num_nodes: int) -> ClusterSpec:
    """A DGX H200-like node: the H100 preset with H200 SXM 141 GB devices (the H100's compute rates)."""
    return dataclasses.replace(
        _h100(num_nodes),
        name="h200",
        device_name="H200-SXM-141GB",
        device_memory=140 * _GIB,  # NVIDIA H200 datasheet: 141 GB HBM3e (nvidia-smi: 143,771 MiB).
        **_gpu_model(4.8e12),  # NVIDIA H200 datasheet: 4.8 TB/s.
    )


_PRESETS: dict[str, Callable[[int], ClusterSpec]] = {
    "p3.16xlarge": _p3_16xlarge,
    "dgx-a100": _dgx_a100,
    "h100": _h100,
    "h200": _h200,
}


# ---------------------------------------------------------------------------------------------------
# Measurements for ClusterSpec.local(). Cached per device: planning calls local() many times.
# ---------------------------------------------------------------------------------------------------

_MATMUL_N = 256  # 2 * 256^3 = 34 MFLOP per call: milliseconds on a CPU core, microseconds on a GPU.
_COPY_BYTES = 4 * 2**20  # "a few MB" for the bandwidth measurement.
_REPEATS = 5


def _best_time(fn: Callable[[], Any], repeats: int = _REPEATS) -> float:
    """Minimum wall time over ``repeats`` calls of ``fn`` (which must block until its result is ready)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


@functools.cache
def _measure_matmul_flops(device: Any) -> float:
    """FLOP/s of a jitted float32 ``(n, n) @ (n, n)`` on ``device`` (best of a few runs)."""
    import jax
    import numpy as np

    a = jax.device_put(np.ones((_MATMUL_N, _MATMUL_N), np.float32), device)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()  # Compile outside the timing.
    seconds = _best_time(lambda: matmul(a, a).block_until_ready())
    return 2.0 * _MATMUL_N**3 / seconds


@functools.cache
def _measure_concurrent_matmul_flops(devices: tuple[Any, ...]) -> float:
    """Per-device FLOP/s of a jitted float32 ``(n, n) @ (n, n)`` on every device of ``devices`` at once."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(devices) == 1:
        return _measure_matmul_flops(devices[0])
    mesh = Mesh(np.array(devices), ("d",))
    a = jax.device_put(np.ones((len(devices) * _MATMUL_N, _MATMUL_N), np.float32),
                       NamedSharding(mesh, PartitionSpec("d")))
    b = jax.device_put(np.ones((_MATMUL_N, _MATMUL_N), np.float32), NamedSharding(mesh, PartitionSpec()))
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()  # Compile outside the timing.
    seconds = _best_time(lambda: matmul(a, b).block_until_ready())
    return 2.0 * _MATMUL_N**3 / seconds


_ALL_REDUCE_BYTES = (4 * 2**10, 4 * 2**20)  # per device: latency-bound and bandwidth-bound


@functools.cache
def _measure_all_reduce(devices: tuple[Any, ...]) -> tuple[float, float]:
    """(bytes/s, latency s) fitted to ring all-reduces over ``devices`` (see :meth:`ClusterSpec.local`)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    spec = PartitionSpec("d")

    def program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

    all_reduce = program(lambda v: jax.lax.psum(v, "d"))
    overhead = _measure_launch(devices)
    times = []
    for num_bytes in _ALL_REDUCE_BYTES:
        x = jax.device_put(np.ones((n, num_bytes // 4), np.float32), NamedSharding(mesh, spec))
        all_reduce(x).block_until_ready()
        times.append(max(_best_time(lambda: all_reduce(x).block_until_ready(), repeats=3 * _REPEATS) - overhead,
                         1e-7))
    (small, big), (t_small, t_big) = _ALL_REDUCE_BYTES, times
    volume = 2.0 * (n - 1) / n
    seconds_per_byte = max((t_big - t_small) / (volume * (big - small)), 1e-13)
    latency = max(t_small - volume * small * seconds_per_byte, 1e-7)
    return 1.0 / seconds_per_byte, latency


_STREAM_BYTES = 8 * 2**20  # per device: beyond a core's caches, the size of a step's larger activations


@functools.cache
def _measure_launch(devices: tuple[Any, ...]) -> float:
    """Seconds to launch a program on every device of ``devices``: the best time of a jitted ``v + 1`` on
    one float32 per device."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d"))
    launch = jax.jit(lambda v: v + 1.0)
    tiny = jax.device_put(np.ones((len(devices), 1), np.float32), sharding)
    launch(tiny).block_until_ready()
    return _best_time(lambda: launch(tiny).block_until_ready(), repeats=3 * _REPEATS)


@functools.cache
def _measure_launch_and_memory(devices: tuple[Any, ...]) -> tuple[float, float]:
    """(launch seconds, memory bytes/s per device) on ``devices``, every device working at once.

    The launch time is :func:`_measure_launch`. The bandwidth is that of a jitted ``x * 3 + 1`` (one fused
    element-wise loop reading ``x`` and writing the result: 2 * 8 MB per device) over its best time minus
    the launch time. (Arrays much larger than a step's activations are slower again on CPUs: fresh result
    buffers then come from the OS page by page.)
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = len(devices)
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d"))
    overhead = _measure_launch(devices)
    stream = jax.jit(lambda x: x * 3.0 + 1.0)
    x = jax.device_put(np.ones((n, _STREAM_BYTES // 4), np.float32), sharding)
    stream(x).block_until_ready()
    seconds = _best_time(lambda: stream(x).block_until_ready(), repeats=3 * _REPEATS)
    return overhead, 2.0 * _STREAM_BYTES / max(seconds - overhead, seconds / 2)


@functools.cache
def _measure_copy(src: Any, dst: Any | None) -> tuple[float, float]:
    """(bytes/s, latency s) of ``jax.device_put`` from ``src`` to ``dst`` (host -> ``src`` if ``dst`` is None).

    Latency is the time of a 4-byte copy; bandwidth divides the big copy's bytes by its time minus that
    latency (the alpha-beta model: ``t = alpha + bytes / bandwidth``).
    """
    import jax
    import numpy as np

    big_host = np.ones(_COPY_BYTES // 4, np.float32)
    small_host = np.ones(1, np.float32)
    if dst is None:
        big, small, target = big_host, small_host, src
    else:
        big, small, target = jax.device_put(big_host, src), jax.device_put(small_host, src), dst
        jax.block_until_ready((big, small))
    jax.device_put(big, target).block_until_ready()  # Warm up.
    latency = _best_time(lambda: jax.device_put(small, target).block_until_ready())
    seconds = _best_time(lambda: jax.device_put(big, target).block_until_ready())
    return _COPY_BYTES / max(seconds - latency, seconds / 2), latency


# ---------------------------------------------------------------------------------------------------
# The stored measurements of ClusterSpec.local(), one JSON file per machine and device set.
# ---------------------------------------------------------------------------------------------------

_CACHE_ENV = "ALPA_LIKE_CACHE_DIR"


def cache_dir() -> str:
    """Where alpa-like keeps what it measures on this machine: ``$ALPA_LIKE_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/alpa_like``, else ``~/.cache/alpa_like``."""
    if os.environ.get(_CACHE_ENV):
        return os.environ[_CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "alpa_like")


def _local_cache_path(devices: Sequence[Any]) -> str:
    """The file of one device set's measurement: keyed by the host, the devices (platform, kind, ids), the
    JAX version and the XLA flags (which set, e.g., the number of virtual CPU devices)."""
    import jax

    key = json.dumps([platform.node(), jax.__version__, os.environ.get("XLA_FLAGS", ""),
                      [(d.platform, str(getattr(d, "device_kind", "")), d.id) for d in devices]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "clusters", f"local-{devices[0].platform}-{len(devices)}-{digest}.json")


_stored: dict[str, ClusterSpec] = {}
"""This process's specs by cache file: a file that cannot be written still gives one spec per process."""


def _read_stored_spec(path: str) -> ClusterSpec | None:
    """The spec stored at ``path``; None when there is none or it does not load (it is then measured again)."""
    if path in _stored:
        return _stored[path]
    try:
        spec = ClusterSpec.load(path)
    except ValueError:
        return None
    _stored[path] = spec
    return spec


def _store_spec(path: str, spec: ClusterSpec) -> None:
    _stored[path] = spec
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        spec.save(path)
    except OSError as e:
        warnings.warn(f"ClusterSpec.local: cannot store the measured cluster in {path} ({e.strerror}); plans "
                      f"in another process may differ (set {_CACHE_ENV} to a writable directory)", stacklevel=3)


def _write_atomically(path: str, text: str) -> None:
    """Writes ``text`` to a temporary file beside ``path``, then renames it over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _device_memory(device: Any, num_devices: int) -> int:
    """Bytes of ``device``: its reported limit, else this host's RAM split evenly over ``num_devices``."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:  # psutil is optional; POSIX sysconf is not available everywhere either.
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, total // num_devices)
