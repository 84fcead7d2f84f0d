"""The Megatron-LM baseline: 3D parallelism (tensor t, pipeline p, data d) chosen by grid search.

Megatron-LM (seed 002) partitions a transformer by hand: every layer's matmuls are split over ``t``
devices inside a node (two all-reduces of the hidden state in the forward, two in the backward, two more
when the forward is recomputed), the layers are cut into ``p`` equal pipeline stages (or ``p * v`` equal
chunks, chunk ``k`` on stage ``k mod p``, for the interleaved schedule), and the whole is replicated ``d``
times with a gradient all-reduce at the end of the step. Ranks are ordered tensor, then data, then
pipeline (Megatron's default), so a stage holds ``t * d`` consecutive devices.

The cost model is the one our own planner uses, so the comparison is like for like:

* compute: the traced layers' equations (:class:`TransformerCosts`, taken from the same sliced step the stage
  DP sees) priced by the cluster's compute model as our plans' are (:class:`LayerSeconds`; FLOPs at the
  device's peak for costs given as FLOPs alone, e.g. the analytic ones of the reproductions). Tensor
  parallelism divides by ``t`` only the work inside its parallel regions (the matrix products, the heads'
  attention, the MLP's GeLU, the vocabulary-parallel embedding and cross-entropy); the work on the full
  hidden state between them (LayerNorms, residual adds, row-parallel output biases, the position embedding)
  every rank repeats (:func:`repeated_on_every_rank`). The analytic FLOPs count matrix products only, all
  of them split;
* launches: each chunk's forward, backward and optimizer update pays ``ClusterSpec.launch_overhead``, as each
  RUN of our plans does on the simulated backend;
* communication: the alpha-beta model of :class:`~alpa_like.compiler.logical_mesh.LogicalMesh` on the
  same :class:`~alpa_like.compiler.cluster.ClusterSpec` (tensor all-reduces on the ``t`` axis, the gradient
  all-reduce on the ``d`` axis of the gradients each rank holds, ``1/t`` of the split weights' and all of
  the whole ones', point-to-point sends between stages, across nodes with Megatron's scatter/gather
  optimisation: ``1/t`` of the bytes per rank, a node's whole NIC shared by the stage's ranks on it, as our
  own plans are priced);
* batch inputs: each chunk whose layers read a batch input (the first, the tokens; the last, the labels)
  loads its micro-batch slice from the host before the forward (:func:`load_seconds`), as our plans do;
* tied parameters: a parameter read by layers of several pipeline stages (GPT's word embedding, read by
  the first layer and by the logits) has its gradient all-reduced between those stages after the pipeline
  drains, before the optimizer step (Megatron-LM's "embedding group" of first and last stage,
  ``megatron/core/distributed/finalize_model_grads.py``), ``1/t`` of it per rank (the embedding is split
  over the vocabulary, ``VocabParallelEmbedding``), over the inter-node link when the stages are on
  different nodes. Our own plans pay the same transfer (the apply-grad of the tied parameter receives the
  other stage's accumulated gradient; :func:`~alpa_like.compiler.stage_profiling.received_per_step`);
* pipeline: Alpa Eq. 3.2 generalised to ``v`` chunks per device,

  .. math:: T = m \\max_q W_q + \\frac{1}{v}\\Big(\\sum_q W_q - \\max_q W_q\\Big)

  with ``W_q`` the forward plus backward time of one micro-batch on stage ``q``, its sends included
  (Megatron-LM §2.2.2: a bubble of ``(p - 1) / v`` micro-batch times). :func:`replay` runs the real schedule
  on the clock of our own plans' simulated backend (:mod:`~alpa_like.runtime.simulator`): a chunk's input
  is received by its stage just before the chunk runs, and a receive across nodes holds the NICs of the
  nodes it leaves and enters (:class:`~alpa_like.runtime.simulator.NicBook`), so two stages of one node
  receiving across nodes at the same time take turns, as our plans' stages do;
* memory (Alpa Eq. 3.5, 1F1B): parameters and gradients and optimizer state of the split weights divided
  over ``t``, those of the parameters every tensor-parallel rank holds whole (LayerNorm scales and biases,
  row-parallel output biases, the position table: :attr:`TransformerCosts.replicated_param_bytes`) whole on
  each rank (no ZeRO: Megatron-LM of the seeds replicates them all over ``d``), plus ``min(p - q, m)``
  micro-batches of activations on stage ``q``, divided over ``t``. A tied parameter is held, with its
  gradient and optimizer state, by every stage whose layers read it (the embedding group's first and last
  stage keep a copy each: :func:`replica_state_bytes`), as our own plans count it.

:func:`grid_search` evaluates every configuration of :func:`enumerate_configs` (``t`` dividing the GPUs
per node and the number of heads, ``p`` dividing the layers, micro-batch sizes ``b``, and ``v > 1`` when the
interleaved schedule is possible: ``m mod p = 0`` and ``p v`` dividing the layers) with the closed form and
keeps the fastest that fits in memory; :func:`best_replayed` replays the few fastest and keeps the fastest
replayed (what the benchmark suite reports).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jax.extend.core import Literal

from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import MATRIX_PRIMITIVES, ComputeRates, equation_seconds, nested_total
from alpa_like.compiler.layer_slicing import FORWARD
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.stage_profiling import inbound_bandwidth
from alpa_like.compiler.schedule_tables import make_schedule
from alpa_like.compiler.schedules import Phase, ScheduleName, dependencies
from alpa_like.runtime.simulator import Nic, NicBook

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
VIRTUAL_STAGES = (1, 2, 4, 8)
REPLAY_LIMIT = 200_000
"""Most forward/backward tasks :func:`replay` simulates; larger schedules use the closed form."""
REPLAYED_CANDIDATES = 8
"""How many of the closed form's fastest fitting configurations :func:`best_replayed` replays."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HiddenState:
    """The hidden state ``[b, s, h]`` of one traced micro-batch: what tells Megatron-LM's tensor-parallel
    regions from the work every rank repeats (:func:`repeated_on_every_rank`)."""

    sequences: int
    """``b``: sequences of the micro-batch the step was traced on."""
    seq_len: int
    """``s``: tokens per sequence (rows of the learned position embedding)."""
    hidden_size: int
    """``h``."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HiddenState.{f.name} must be an int >= 1, got {value!r}")

    def is_whole(self, shape: tuple[int, ...]) -> bool:
        """Whether an array of ``shape`` is one every tensor-parallel rank holds whole: a scalar, the hidden
        state ``[b, s, h]`` or a per-token statistic of it (``[b, s]``, ``[b, s, 1]``), a vector over the
        hidden size (``[h]``, ``[1, h]``, ``[1, 1, h]``: a LayerNorm's scale or bias, a row-parallel output
        bias) or the position table (``[s, h]``, ``[1, s, h]``). When ``s == h`` a ``[h, h]`` weight has the
        position table's shape and counts as whole too."""
        b, s, h = self.sequences, self.seq_len, self.hidden_size
        return tuple(shape) in {(), (b, s), (b, s, 1), (b, s, h), (h,), (1, h), (1, 1, h), (s, h), (1, s, h)}


def repeated_on_every_rank(eqn, hidden: HiddenState) -> bool:
    """Whether Megatron-LM's tensor parallelism (seed 002, §2.3; no sequence parallelism) repeats the
    primitive equation ``eqn`` on each of the ``t`` ranks rather than splitting it over them.

    Split (inside a tensor-parallel region): every matrix product (the column-parallel QKV and first MLP
    projections, the row-parallel output projections, the vocabulary-parallel logits, and their gradients),
    and every equation reading or writing an array that carries a split dimension: the heads (scores,
    causal mask, softmax, weighted sum), the MLP's ``4h`` (its column-parallel bias, GeLU), the QKV's
    ``3h``, the vocabulary (``VocabParallelEmbedding``'s lookup, the cross-entropy's softmax), or a split
    weight (its casts and transposes).

    Repeated (on the full hidden state between the regions): an equation whose arrays are all whole on
    every rank (:meth:`HiddenState.is_whole`): the LayerNorms with their per-token statistics, the residual
    adds, the row-parallel output biases, the dropouts after the attention and MLP outputs, the position
    embedding's lookup and its add to the token embedding, the per-token loss once the vocabulary-parallel
    reductions are done, and all their gradients; in the optimizer step, the update of those whole
    parameters (LayerNorm scales and biases, row-parallel biases, the position table).

    A pipeline marker is no work (False). A nested equation (``jit``, ``checkpoint``, ...) is neither:
    classify its body's equations (:func:`repeated_seconds` does)."""
    if jax_compat.nested_jaxprs(eqn):
        raise ValueError(f"repeated_on_every_rank: eqn must be a primitive equation, got the nested "
                         f"{eqn.primitive.name!r}")
    if eqn.primitive.name in MATRIX_PRIMITIVES or is_marker(eqn):
        return False
    arrays = [v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(getattr(v, "aval", None), "shape")]
    return all(hidden.is_whole(a.shape) for a in arrays)


def repeated_seconds(eqn, rates: ComputeRates, hidden: HiddenState) -> float:
    """Seconds (:func:`~alpa_like.compiler.flops.equation_seconds` at ``rates``) of the part of ``eqn`` that
    every tensor-parallel rank repeats (:func:`repeated_on_every_rank`), through nested jaxprs with the
    same trip-count rules as the equation's own price."""
    subs = jax_compat.nested_jaxprs(eqn)
    if subs:
        return nested_total(eqn, [sum(repeated_seconds(e, rates, hidden) for e in sub.eqns) for sub in subs])
    return equation_seconds(eqn, rates) if repeated_on_every_rank(eqn, hidden) else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSeconds:
    """Per-layer compute time under a cluster's compute model (:func:`~alpa_like.compiler.flops.
    equation_seconds`), split into the work Megatron-LM's tensor parallelism divides over its ``t`` ranks,
    the work each rank repeats (:func:`repeated_on_every_rank`) and what each kernel adds: a chunk of layers
    ``L`` running ``b`` sequences over ``t`` tensor-parallel devices takes ``sum(b * (forward[l] / t +
    forward_repeated[l]) + forward_fixed[l] for l in L)`` for its forward (every device runs each of its
    products' kernels)."""

    forward: tuple[float, ...]
    """Seconds of each layer's forward for one sequence that tensor parallelism splits, without the
    per-product overheads."""
    backward: tuple[float, ...]
    """The same for each layer's backward (with its recomputed forward when remat is on)."""
    apply: tuple[float, ...]
    """Seconds of each layer's optimizer update per step that tensor parallelism splits (the update of its
    split weights), without the per-product overheads."""
    forward_repeated: tuple[float, ...]
    """Seconds of each layer's forward for one sequence that every tensor-parallel rank repeats."""
    backward_repeated: tuple[float, ...]
    apply_repeated: tuple[float, ...]
    """The update of the parameters every rank holds whole (LayerNorms, row-parallel biases, the position
    table): small, and counted like the rest."""
    forward_fixed: tuple[float, ...]
    """Seconds each layer's forward adds per micro-batch whatever its size (``matmul_overhead`` per product)."""
    backward_fixed: tuple[float, ...]
    apply_fixed: tuple[float, ...]

    def chunk(self, phase: str, layers, sequences: float, tensor_parallel: int) -> float:
        """Seconds of ``phase`` ("forward", "backward" or "apply") of ``layers`` for ``sequences`` sequences
        (1 for apply) on each of ``tensor_parallel`` devices."""
        if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
            raise ValueError(f"LayerSeconds.chunk: tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
        split, repeated = getattr(self, phase), getattr(self, phase + "_repeated")
        fixed = getattr(self, phase + "_fixed")
        return sum(sequences * (split[l] / tensor_parallel + repeated[l]) + fixed[l] for l in layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerCosts:
    """Per-layer costs of a traced model, for one sequence (what the 3D-parallel model needs)."""

    forward_flops: tuple[float, ...]
    """FLOPs of each layer's forward for one sequence."""
    backward_flops: tuple[float, ...]
    """FLOPs of each layer's backward for one sequence (with its recomputed forward when remat is on)."""
    apply_flops: tuple[float, ...]
    """FLOPs of each layer's optimizer update, per step."""
    param_bytes: tuple[float, ...]
    optimizer_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    """Bytes each layer keeps from forward to backward for one sequence."""
    replicated_param_bytes: tuple[float, ...] | None = None
    """The part of each layer's ``param_bytes`` every tensor-parallel rank holds whole rather than ``1/t``
    of (:func:`whole_parameter_bytes`: LayerNorm scales and biases, row-parallel output biases, the position
    table); None: none of it (FLOP-only and analytic costs)."""
    replicated_optimizer_bytes: tuple[float, ...] | None = None
    """The part of each layer's ``optimizer_bytes`` that belongs to those whole parameters; None: none."""
    hidden_bytes: float
    """Bytes of one sequence's hidden state (``s * h * itemsize``): what a stage sends to the next and what a
    tensor-parallel all-reduce moves."""
    num_heads: int
    recompute: bool
    """Whether the backward recomputes the forward (two more tensor-parallel all-reduces per layer)."""
    shared_params: tuple[tuple[float, tuple[int, ...]], ...] = ()
    """``(bytes, layers)`` of every parameter that the forwards of several layers read (a tied embedding:
    the first and the last layer); its gradient is all-reduced between the stages holding those layers."""
    batch_inputs: tuple[tuple[float, tuple[int, ...]], ...] = ()
    """``(bytes per sequence, layers)`` of every batch input (tokens, labels) and the layers whose forwards
    read it: each chunk holding one of those layers loads its micro-batch slice from the host, as our own
    plans' meshes do (the simulated backend's per-micro-batch ``LOAD``)."""
    seconds: LayerSeconds | None = None
    """Each layer's time under the cluster's compute model (what our plans are priced with), or None: its
    FLOPs at ``peak_flops``."""

    def __post_init__(self):
        n = len(self.forward_flops)
        for name in ("backward_flops", "apply_flops", "param_bytes", "optimizer_bytes", "activation_bytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TransformerCosts.{name} must have one entry per layer ({n}), got "
                                 f"{len(getattr(self, name))}")
        if n < 1:
            raise ValueError("TransformerCosts needs at least one layer")
        for name, whole in (("replicated_param_bytes", "param_bytes"),
                            ("replicated_optimizer_bytes", "optimizer_bytes")):
            part, full = getattr(self, name), getattr(self, whole)
            if part is not None and (len(part) != n or any(not 0 <= r <= w for r, w in zip(part, full))):
                raise ValueError(f"TransformerCosts.{name} must have one entry per layer ({n}), each between 0 and "
                                 f"the layer's {whole}, got {part!r}")
        if self.seconds is not None:
            for f in dataclasses.fields(self.seconds):
                if len(getattr(self.seconds, f.name)) != n:
                    raise ValueError(f"TransformerCosts.seconds.{f.name} must have one entry per layer ({n}), got "
                                     f"{len(getattr(self.seconds, f.name))}")
        for nbytes, layers in self.shared_params:
            if nbytes < 0 or len(layers) < 2 or any(not 0 <= l < n for l in layers):
                raise ValueError(f"TransformerCosts.shared_params entries must be (bytes >= 0, two or more layer "
                                 f"indices in 0..{n - 1}), got {(nbytes, layers)!r}")
        for nbytes, layers in self.batch_inputs:
            if nbytes < 0 or not layers or any(not 0 <= l < n for l in layers):
                raise ValueError(f"TransformerCosts.batch_inputs entries must be (bytes >= 0, one or more layer "
                                 f"indices in 0..{n - 1}), got {(nbytes, layers)!r}")

    @property
    def num_layers(self) -> int:
        return len(self.forward_flops)

    def state_bytes_per_rank(self, layers, tensor_parallel: int) -> tuple[float, float]:
        """``(parameter bytes, optimizer bytes)`` of ``layers`` on each of ``tensor_parallel`` ranks: the split
        part divided by ``tensor_parallel``, the replicated part (:attr:`replicated_param_bytes`,
        :attr:`replicated_optimizer_bytes`) whole."""
        def per_rank(total, replicated):
            whole = 0.0 if replicated is None else sum(replicated[l] for l in layers)
            return (sum(total[l] for l in layers) - whole) / tensor_parallel + whole
        return (per_rank(self.param_bytes, self.replicated_param_bytes),
                per_rank(self.optimizer_bytes, self.replicated_optimizer_bytes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """One point of the grid: ``t * p * d`` devices, micro-batches of ``b`` sequences, ``v`` chunks per stage."""

    t: int
    p: int
    d: int
    b: int
    v: int = 1

    def num_micro_batches(self, global_batch: int) -> int:
        """``m = B / (b d)`` micro-batches per pipeline per step."""
        return global_batch // (self.b * self.d)

    @property
    def schedule(self) -> ScheduleName:
        return ScheduleName.INTERLEAVED_1F1B if self.v > 1 else ScheduleName.ONE_F_ONE_B

    def __str__(self) -> str:
        return f"t={self.t} p={self.p} d={self.d} b={self.b}" + (f" v={self.v}" if self.v > 1 else "")


@dataclasses.dataclass(frozen=True)
class Send:
    """One micro-batch's activation (or its gradient) between the stages of two adjacent chunks."""

    seconds: float
    """Alone on its links."""
    nics: frozenset[Nic]
    """The NICs it holds for that long (none inside a node): each node's of the sending stage outbound,
    of the receiving stage inbound."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronEstimate:
    """The modelled step of one configuration."""

    config: MegatronConfig
    num_micro_batches: int
    step_seconds: float
    pipeline_seconds: float
    sync_seconds: float
    """Gradient all-reduce over ``d``, that of tied parameters between stages (:func:`tied_sync_seconds`) and
    the optimizer update (after the pipeline drains)."""
    stage_forward_seconds: tuple[float, ...]
    """Per chunk (``p * v`` of them), one micro-batch's forward with its tensor all-reduces and the loads of the
    batch inputs it reads (:func:`load_seconds`), not its send."""
    stage_backward_seconds: tuple[float, ...]
    forward_sends: tuple[Send | None, ...]
    """Per chunk, its forward's output to the next chunk (None for the last)."""
    backward_sends: tuple[Send | None, ...]
    """Per chunk, its backward's input gradient to the previous chunk (None for the first)."""
    memory_per_device: float
    """Bytes on the most loaded device."""
    fits: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronSearch:
    best: MegatronEstimate | None
    """The fastest configuration that fits; None when none does."""
    evaluated: tuple[MegatronEstimate, ...]

    @property
    def num_fitting(self) -> int:
        return sum(e.fits for e in self.evaluated)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_configs(*, num_devices: int, devices_per_node: int, num_layers: int, num_heads: int,
                      global_batch: int, micro_batch_sizes: Sequence[int] = MICRO_BATCH_SIZES,
                      virtual_stages: Sequence[int] = VIRTUAL_STAGES) -> tuple[MegatronConfig, ...]:
    """Every valid Megatron-LM configuration for these sizes (see the module docstring for the rules)."""
    for name, value in (("num_devices", num_devices), ("devices_per_node", devices_per_node),
                        ("num_layers", num_layers), ("num_heads", num_heads), ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"enumerate_configs: {name} must be an int >= 1, got {value!r}")
    configs = []
    for t in _divisors(min(devices_per_node, num_devices)):
        if num_devices % t or num_heads % t:
            continue
        for p in _divisors(num_devices // t):
            d = num_devices // (t * p)
            stage = t * d
            if num_layers % p or (stage % devices_per_node and devices_per_node % stage):
                continue
            for b in micro_batch_sizes:
                if global_batch % (b * d):
                    continue
                m = global_batch // (b * d)
                for v in virtual_stages:
                    if v > 1 and (p == 1 or m % p or num_layers % (p * v)):
                        continue
                    configs.append(MegatronConfig(t=t, p=p, d=d, b=b, v=v))
    return tuple(configs)


def _stage_mesh(cluster: ClusterSpec, config: MegatronConfig) -> LogicalMesh:
    """The ``(d, t)`` view of one stage's ``t * d`` consecutive devices (axis 1 = tensor, inside a node)."""
    size, per_node = config.t * config.d, cluster.num_devices_per_node
    submesh = (1, size) if size <= per_node else (size // per_node, per_node)
    return LogicalMesh.from_cluster(cluster, submesh, (config.d, config.t))


def _nodes(stage: int, size: int, per_node: int) -> set[int]:
    return {dev // per_node for dev in range(stage * size, (stage + 1) * size)}


def _rank_nic_bandwidth(cluster: ClusterSpec, config: MegatronConfig) -> float:
    """Bytes/s across nodes for each of a stage's ``t * d`` ranks when they alone use their nodes' NICs (a
    point-to-point transfer between stages): a node's NIC moves ``M * inter_node_bandwidth``, shared by the
    stage's ranks on it, ``min(t d, M)`` (the pricing of our own plans,
    :func:`~alpa_like.compiler.stage_profiling.inbound_bandwidth`)."""
    size = config.t * config.d
    return float(inbound_bandwidth([size], cluster)[0]) / size


def _send(cluster: ClusterSpec, config: MegatronConfig, src: int, dst: int, nbytes: float) -> Send:
    """One micro-batch's activation from stage ``src`` to ``dst``: across nodes each of the ``d`` replicas'
    ``t`` ranks sends ``1/t`` of it (Megatron-LM's scatter/gather) at :func:`_rank_nic_bandwidth`, through
    the NICs of both stages' nodes."""
    size, per_node = config.t * config.d, cluster.num_devices_per_node
    src_nodes, dst_nodes = _nodes(src, size, per_node), _nodes(dst, size, per_node)
    if src_nodes != dst_nodes:
        nics = frozenset({(n, "out") for n in src_nodes} | {(n, "in") for n in dst_nodes})
        return Send(cluster.inter_node_latency + nbytes / config.t / _rank_nic_bandwidth(cluster, config), nics)
    return Send(cluster.intra_node_latency + nbytes / cluster.intra_node_bandwidth, frozenset())


def tied_sync_seconds(cluster: ClusterSpec, config: MegatronConfig, costs: TransformerCosts) -> tuple[float, ...]:
    """Per pipeline stage, the seconds it spends all-reducing the gradients of :attr:`TransformerCosts.shared_params`
    with the other stages that read them (module docstring): a ring over the ``n`` stages involved, each of the
    ``t * d`` ranks of a stage paired with the same rank of the others, ``2 (n - 1) / n`` of its ``1/t`` share
    of the bytes over the inter-node link when the stages span several nodes (at :func:`_rank_nic_bandwidth`:
    the stages' ranks alone use their nodes' NICs after the drain), plus ``2 (n - 1)`` latencies."""
    p, size, per_node = config.p, config.t * config.d, cluster.num_devices_per_node
    chunk = costs.num_layers // (p * config.v)
    seconds = [0.0] * p
    for nbytes, layers in costs.shared_params:
        stages = sorted({(l // chunk) % p for l in layers})
        n = len(stages)
        if n < 2:
            continue
        cross = len({frozenset(_nodes(q, size, per_node)) for q in stages}) > 1
        bandwidth = _rank_nic_bandwidth(cluster, config) if cross else cluster.intra_node_bandwidth
        latency = cluster.inter_node_latency if cross else cluster.intra_node_latency
        time = 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / config.t / bandwidth
        for q in stages:
            seconds[q] += time
    return tuple(seconds)


def replica_state_bytes(config: MegatronConfig, costs: TransformerCosts) -> tuple[float, ...]:
    """Per pipeline stage, the bytes (all ``t`` ranks together) of its copies of
    :attr:`TransformerCosts.shared_params`: a parameter read by layers of several stages is counted in
    ``param_bytes`` and ``optimizer_bytes`` of its first layer only, yet every other stage reading it holds
    it too, with its gradient and optimizer state (``2 + optimizer_bytes / param_bytes`` bytes per byte, the
    model's ratio)."""
    p, chunk = config.p, costs.num_layers // (config.p * config.v)
    per_byte = 2 + sum(costs.optimizer_bytes) / max(sum(costs.param_bytes), 1.0)
    held = [0.0] * p
    for nbytes, layers in costs.shared_params:
        home = (min(layers) // chunk) % p
        for q in {(l // chunk) % p for l in layers} - {home}:
            held[q] += nbytes * per_byte
    return tuple(held)


def leaf_readers(jaxpr, pieces, mask) -> dict[int, set[int]]:
    """Per input leaf selected by ``mask`` (its index in ``jaxpr.invars``): the layers whose forward
    equations read it, directly or through a marker. Leaves no forward reads are left out."""
    leaf = {v: i for i, v in enumerate(jaxpr.invars) if mask[i]}
    for eqn in jaxpr.eqns:  # a leaf seen through markers is still that leaf
        if is_marker(eqn):
            for inp, out in zip(eqn.invars, eqn.outvars, strict=True):
                if not isinstance(inp, Literal) and inp in leaf:
                    leaf[out] = leaf[inp]
    readers: dict[int, set[int]] = {}
    for eqn, piece in zip(jaxpr.eqns, pieces, strict=True):
        if piece is None or piece.phase != FORWARD or is_marker(eqn):
            continue
        for v in jax_compat.eqn_inputs(eqn):
            if v in leaf:
                readers.setdefault(leaf[v], set()).add(piece.layer)
    return readers


def _leaf_bytes(jaxpr, k: int) -> float:
    aval = jaxpr.invars[k].aval
    return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def whole_parameter_bytes(jaxpr, param_inputs: Sequence[int], hidden: HiddenState) -> float:
    """Bytes of the parameter leaves ``param_inputs`` (indices into ``jaxpr.invars``) that every tensor-parallel
    rank holds whole, by the shape rule of the compute side (:meth:`HiddenState.is_whole`): LayerNorm scales
    and biases, row-parallel output biases, the position table."""
    return sum(_leaf_bytes(jaxpr, k) for k in param_inputs if hidden.is_whole(jaxpr.invars[k].aval.shape))


def shared_parameters(jaxpr, pieces, param_mask) -> tuple[tuple[float, tuple[int, ...]], ...]:
    """``(bytes, layers)`` of every parameter leaf (``param_mask``) that forward equations of more than one
    layer read, directly or through a marker (the :attr:`TransformerCosts.shared_params` of a sliced step)."""
    return tuple((_leaf_bytes(jaxpr, k), tuple(sorted(layers)))
                 for k, layers in sorted(leaf_readers(jaxpr, pieces, param_mask).items()) if len(layers) > 1)


def batch_inputs(jaxpr, pieces, batch_mask) -> tuple[tuple[float, tuple[int, ...]], ...]:
    """``(bytes, layers)`` of every batch leaf (``batch_mask``) and the layers whose forwards read it (the
    :attr:`TransformerCosts.batch_inputs` of a sliced step, before division by the sequences it holds)."""
    return tuple((_leaf_bytes(jaxpr, k), tuple(sorted(layers)))
                 for k, layers in sorted(leaf_readers(jaxpr, pieces, batch_mask).items()))


def load_seconds(cluster: ClusterSpec, costs: TransformerCosts, layers: range, sequences: int) -> float:
    """Host-to-device time of one micro-batch of ``sequences`` sequences of the batch inputs the chunk of
    ``layers`` reads: one latency plus the bytes at the intra-node bandwidth per input, as the simulated
    backend prices our plans' ``LOAD``s."""
    return sum(cluster.intra_node_latency + sequences * nbytes / cluster.intra_node_bandwidth
               for nbytes, readers in costs.batch_inputs if any(l in layers for l in readers))


def _compute_seconds(costs: TransformerCosts, cluster: ClusterSpec, phase: str, layers, sequences: float,
                     tensor_parallel: int) -> float:
    """Seconds of ``phase`` of ``layers`` for ``sequences`` sequences over ``tensor_parallel`` devices: the
    cluster's compute model when ``costs.seconds`` holds it, else the FLOPs at ``cluster.peak_flops``."""
    if costs.seconds is not None:
        return costs.seconds.chunk(phase, layers, sequences, tensor_parallel)
    flops = getattr(costs, phase + "_flops")
    return sum(flops[l] for l in layers) * sequences / (tensor_parallel * cluster.peak_flops)


def estimate(config: MegatronConfig, costs: TransformerCosts, cluster: ClusterSpec,
             global_batch: int) -> MegatronEstimate:
    """The modelled step time and memory of ``config`` (module docstring)."""
    t, p, d, b, v = config.t, config.p, config.d, config.b, config.v
    if t * p * d != cluster.num_devices:
        raise ValueError(f"{config} uses {t * p * d} devices, the cluster has {cluster.num_devices}")
    if costs.num_layers % (p * v):
        raise ValueError(f"{config}: {costs.num_layers} layers do not split into {p * v} equal chunks")
    m = config.num_micro_batches(global_batch)
    mesh = _stage_mesh(cluster, config)
    chunks, per = p * v, costs.num_layers // (p * v)
    hidden = b * costs.hidden_bytes
    all_reduce = mesh.all_reduce_cost(hidden, 1)
    fwd_reduces, bwd_reduces = 2, 4 if costs.recompute else 2
    forward, backward, forward_sends, backward_sends = [], [], [], []
    for k in range(chunks):
        layers = range(k * per, (k + 1) * per)
        forward.append(_compute_seconds(costs, cluster, "forward", layers, b, t) + cluster.launch_overhead
                       + per * fwd_reduces * all_reduce + load_seconds(cluster, costs, layers, b))
        backward.append(_compute_seconds(costs, cluster, "backward", layers, b, t) + cluster.launch_overhead
                        + per * bwd_reduces * all_reduce)
        forward_sends.append(_send(cluster, config, k % p, (k + 1) % p, hidden) if k + 1 < chunks else None)
        backward_sends.append(_send(cluster, config, k % p, (k - 1) % p, hidden) if k > 0 else None)
    sends = [(f.seconds if f else 0.0) + (g.seconds if g else 0.0) for f, g in zip(forward_sends, backward_sends)]
    work = [sum(forward[k] + backward[k] + sends[k] for k in range(q, chunks, p)) for q in range(p)]
    pipeline = m * max(work) + (sum(work) - max(work)) / v
    sync, memory = [], []
    tied = tied_sync_seconds(cluster, config, costs)
    replicas = replica_state_bytes(config, costs)
    for q in range(p):
        layers = [l for k in range(q, chunks, p) for l in range(k * per, (k + 1) * per)]
        params, optimizer = costs.state_bytes_per_rank(layers, t)
        sync.append(mesh.all_reduce_cost(params, 0) + tied[q] + _compute_seconds(costs, cluster, "apply", layers, 1, t)
                    + cluster.launch_overhead)
        state = 2 * params + optimizer + replicas[q] / t
        activations = min(p - q, m) * b * sum(costs.activation_bytes[l] for l in layers) / t
        memory.append(state + activations)
    return MegatronEstimate(config=config, num_micro_batches=m, step_seconds=pipeline + max(sync),
                            pipeline_seconds=pipeline, sync_seconds=max(sync), stage_forward_seconds=tuple(forward),
                            stage_backward_seconds=tuple(backward), forward_sends=tuple(forward_sends),
                            backward_sends=tuple(backward_sends), memory_per_device=max(memory),
                            fits=max(memory) <= cluster.device_memory)


def grid_search(costs: TransformerCosts, cluster: ClusterSpec, global_batch: int,
                configs: Sequence[MegatronConfig] | None = None) -> MegatronSearch:
    """Evaluates every configuration (default :func:`enumerate_configs` for this cluster and model) and
    returns the fastest that fits in the cluster's device memory (ties: the first in grid order)."""
    if configs is None:
        configs = enumerate_configs(num_devices=cluster.num_devices, devices_per_node=cluster.num_devices_per_node,
                                    num_layers=costs.num_layers, num_heads=costs.num_heads, global_batch=global_batch)
    evaluated = tuple(estimate(c, costs, cluster, global_batch) for c in configs)
    fitting = [e for e in evaluated if e.fits]
    best = min(fitting, key=lambda e: e.step_seconds) if fitting else None
    return MegatronSearch(best=best, evaluated=evaluated)


def replay(est: MegatronEstimate, schedule_name: str | None = None, nic_contention: bool = True) -> float | None:
    """The step time of ``est`` with its real schedule (1F1B or interleaved 1F1B; or ``schedule_name``,
    e.g. ``"breadth_first"``, on the same chunks) replayed task by task, plus the gradient synchronisation;
    None when the schedule has more than REPLAY_LIMIT tasks (the closed form of :func:`estimate` stands then).

    The clock is that of the simulated backend running our own plans (:mod:`~alpa_like.runtime.simulator`):
    tasks in the schedule's tick order; before a task its stage receives each input another stage made
    (the chunk's :class:`Send`), from when that task ended and its stage is free, holding the stage and,
    across nodes, the send's NICs (:class:`~alpa_like.runtime.simulator.NicBook`: transfers through one NIC
    take turns); then the task runs for its chunk's time. ``nic_contention=False``: every send has its NICs to
    itself."""
    c = est.config
    if 2 * c.p * c.v * est.num_micro_batches > REPLAY_LIMIT:
        return None
    schedule = make_schedule(schedule_name or c.schedule, num_meshes=c.p, num_micro_batches=est.num_micro_batches,
                             virtual_stages=c.v)
    book = NicBook()
    stage_of = schedule.stage_to_mesh
    clock = [0.0] * c.p
    end = {}
    for row in schedule.ticks:
        for task in row:
            if task is None:
                continue
            mesh = stage_of[task.stage]
            start = clock[mesh]
            for dep in dependencies(task, schedule.num_stages):
                if stage_of[dep.stage] == mesh:
                    start = max(start, end[dep])
                    continue
                send = (est.forward_sends if dep.phase == Phase.F else est.backward_sends)[dep.stage]
                _, start = book.take(send.nics if nic_contention else frozenset(), max(start, end[dep]),
                                     send.seconds)
            forward = task.phase == Phase.F
            clock[mesh] = end[task] = start + (est.stage_forward_seconds if forward
                                               else est.stage_backward_seconds)[task.stage]
    return max(clock) + est.sync_seconds


def best_replayed(search: MegatronSearch, candidates: int = REPLAYED_CANDIDATES,
                  nic_contention: bool = True) -> tuple[MegatronEstimate, float, bool] | None:
    """Among the ``candidates`` fastest fitting configurations of ``search`` by the closed form, the one
    whose :func:`replay` is fastest: ``(estimate, step seconds, replayed)``; ``replayed`` is False when
    its schedule is too long to replay and the closed form stands. None when nothing fits."""
    fitting = sorted((e for e in search.evaluated if e.fits), key=lambda e: e.step_seconds)[:candidates]
    timed = []
    for est in fitting:
        seconds = replay(est, nic_contention=nic_contention)
        timed.append((est, est.step_seconds if seconds is None else seconds, seconds is not None))
    return min(timed, key=lambda x: x[1]) if timed else None
