"""Data-parallel baselines: ZeRO-2, ZeRO-3 and DeepSpeed-style expert parallelism for MoE.

All are priced with the cost model our own plans use, on the same cluster:

* compute: the traced step with per-layer recomputation (the same sliced jaxpr the stage DP sees, so every
  system does the same arithmetic), each equation priced as our plans price it
  (:func:`~alpa_like.compiler.flops.equation_seconds` at ``ClusterSpec.compute_rates``: a float32 matrix
  product at the FP32 rate), spread over all ``N`` devices, plus the optimizer update over ``N`` (ZeRO
  shards it);
* communication: ``al.plan`` with :class:`~alpa_like.Zero2Parallel` / :class:`~alpa_like.Zero3Parallel`
  gives the gradient reduce-scatter, the all-gather of updated (ZeRO-2) or used (ZeRO-3, per micro-batch)
  parameters; each is priced with the cluster's alpha-beta links as the cheaper of one ring and NCCL's
  hierarchical form (:func:`collective_seconds`: a ring over several nodes would pay every byte at one
  device's share of the node's network link);
* expert parallelism (DeepSpeed-MoE, Alpa's MoE baseline; Alpa's artifact reports DeepSpeed's ZeRO-2 with
  expert parallelism, ``osdi22_artifact/deepspeed/README.md``): the experts of every MoE layer are split over
  ``EP`` devices (each device holds ``E / EP`` whole experts; the ``N / EP`` EP groups each hold all of
  them), everything else is ZeRO-2 data parallel over all ``N``, and expert gradients are ZeRO-2 reduced
  over the ``N / EP`` replicas of each expert; each MoE layer moves its dispatched tokens with an all-to-all
  over the ``EP`` group twice in the forward (dispatch, combine), twice in the backward and twice in the
  recomputed forward (priced knowing which pieces stay inside a node, :func:`collective_seconds`). ``EP``
  and the micro-batch count are grid-searched (every ``EP`` dividing ``E`` and ``N``), as Alpa grid-searched
  DeepSpeed's parallelism degrees. Gradients are reduced once per step (real
  ZeRO-2 reduces every micro-batch's: this favours the baseline). DeepSpeed's tensor model parallelism of
  the dense layers is not modelled; it would split the dense part, which is small next to the experts
  (MoE-10B: 0.5 of 10.2 billion parameters);
* memory: parameters and gradients (sharded as the method says), optimizer state over ``N`` (whatever the
  workload's optimizer: Adafactor for MoE, ``workloads.OPTIMIZERS``), and the activations each device
  keeps for its share of one micro-batch; the number of gradient-accumulation micro-batches is the
  smallest power of two that fits (the fewest ZeRO-3 gathers).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

import alpa_like as al
from alpa_like.compiler.cluster import ClusterSpec
from alpa_like.compiler.flops import ComputeRates
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD
from alpa_like.compiler.logical_mesh import LogicalMesh

from alpa_like.bench.workloads import Workload, piece_seconds

BASELINES = ("zero2", "zero3", "expert parallel")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaselineResult:
    name: str
    step_seconds: float | None
    """None when no micro-batch count fits in memory."""
    num_micro_batches: int | None
    memory_per_device: float
    compute_seconds: float
    communication_seconds: float
    detail: str = ""

    def summary(self) -> dict:
        return {"baseline": self.name, "step_s": self.step_seconds, "micro_batches": self.num_micro_batches,
                "memory_gib": self.memory_per_device / 2**30, "compute_s": self.compute_seconds,
                "communication_s": self.communication_seconds, "detail": self.detail}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTotals:
    """What the baselines need from the sliced step, for the whole global batch."""

    step_flops: float
    """Forward and backward (with recomputation) of every layer, over the global batch."""
    apply_flops: float
    activation_bytes_per_sequence: float
    """Kept from forward to backward, summed over layers."""
    step_seconds: float
    """``step_flops`` on one device, each equation at its rate without the per-product overhead
    (:func:`~alpa_like.bench.workloads.piece_seconds`)."""
    apply_seconds: float
    """``apply_flops`` on one device, likewise."""
    fixed_seconds: float = 0.0
    """The per-product overheads (``ComputeRates.matmul_overhead``) of the whole step: every device runs each
    product's kernel however the work is split."""

    def compute_seconds(self, num_devices: int) -> float:
        """The whole step's arithmetic split evenly over ``num_devices`` (data parallel, ZeRO-sharded update),
        plus the per-product overheads each device pays."""
        return (self.step_seconds + self.apply_seconds) / num_devices + self.fixed_seconds


def step_totals(sliced: Any, workload: Workload, num_micro_batches: int, rates: ComputeRates) -> StepTotals:
    """Totals of a step sliced with ``num_micro_batches`` micro-batches (``ours.slice_workload``), its
    seconds at ``rates`` (``ClusterSpec.compute_rates``)."""
    per_mb = sum(s.forward_flops + s.backward_flops for s in sliced.summaries)
    sequences = workload.global_batch / num_micro_batches
    seconds = {FORWARD: 0.0, BACKWARD: 0.0, APPLY: 0.0}
    fixed = dict(seconds)
    for (_, phase), piece in piece_seconds(sliced, rates).items():
        seconds[phase] += piece.scaled
        fixed[phase] += piece.fixed
    return StepTotals(step_flops=per_mb * num_micro_batches, apply_flops=sum(s.apply_flops for s in sliced.summaries),
                      activation_bytes_per_sequence=sum(s.activation_bytes for s in sliced.summaries) / sequences,
                      step_seconds=(seconds[FORWARD] + seconds[BACKWARD]) * num_micro_batches,
                      apply_seconds=seconds[APPLY],
                      fixed_seconds=(fixed[FORWARD] + fixed[BACKWARD]) * num_micro_batches + fixed[APPLY])


def _micro_batch_counts(global_batch: int, num_devices: int) -> list[int]:
    per_device = global_batch // num_devices
    return [m for m in (2**k for k in range(0, 20)) if m <= per_device and per_device % m == 0]


def collective_seconds(kind: str, num_bytes: float, cluster: ClusterSpec, group_size: int, per_node: int) -> float:
    r"""One all-reduce, reduce-scatter, all-gather or all-to-all (``num_bytes`` as :class:`LogicalMesh` counts
    them) over a group of ``group_size`` devices with ``per_node`` of them on each of its nodes: the cheaper of
    one ring over the whole group and the form that knows the nodes (NCCL's hierarchical collectives), priced
    with the same alpha-beta links:

    * all-reduce: reduce-scatter inside each node on the whole buffer, all-reduce of its ``1 / per_node``
      share across the nodes (the node's devices each run one across-node ring at the same time, sharing the
      node's NICs), all-gather inside the node;
    * reduce-scatter: inside the node, then across the nodes on ``1 / per_node``; all-gather: the reverse;
    * all-to-all: each device sends its buffer ``x = num_bytes / group_size`` in ``group_size`` pieces, one
      per device, directly (no forwarding). The ``group_size - per_node`` pieces for other nodes cross the
      network, every device of a node at once, so each at one device's share of the NIC; the ``per_node - 1``
      pieces for its own node go over the intra-node links at the same time:

      .. math:: \alpha_{inter} + \max\Big(\frac{n - n_{node}}{n} x \beta_{inter},
                \frac{n_{node} - 1}{n} x \beta_{intra}\Big)

    The first three are :class:`LogicalMesh`'s collectives over both axes of the ``(nodes, per_node)`` view
    of the group (one ring or its two-level form, whichever is cheaper: the mesh our own plans are priced on).
    A ring over devices of several nodes crosses them at the pooled share of its ``per_node`` devices
    (:func:`~alpa_like.compiler.logical_mesh.crossing_bandwidth`) but moves every byte across; the
    hierarchical form sends only ``1 / per_node`` of them across; an all-to-all priced as one ring over the group
    (:meth:`LogicalMesh.all_to_all_cost`) would also send the pieces that stay in the node across it."""
    if kind not in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all"):
        raise ValueError(f"kind must be all-reduce, reduce-scatter, all-gather or all-to-all, got {kind!r}")
    if group_size % per_node:
        raise ValueError(f"group_size {group_size} must be a multiple of per_node {per_node}")
    nodes = group_size // per_node
    mesh = LogicalMesh.from_cluster(cluster, (nodes, per_node), (nodes, per_node))
    if kind != "all-to-all":
        price = {"all-reduce": mesh.all_reduce_cost, "reduce-scatter": mesh.reduce_scatter_cost,
                 "all-gather": mesh.all_gather_cost}[kind]
        return price(num_bytes, (0, 1))
    flat = mesh.all_to_all_cost(num_bytes, (0, 1))
    if nodes == 1:
        return flat
    piece = num_bytes / group_size**2  # one device's piece for one other device
    inter, intra = 1.0 / cluster.inter_node_bandwidth, 1.0 / cluster.intra_node_bandwidth
    return min(flat, cluster.inter_node_latency + max((group_size - per_node) * piece * inter,
                                                      (per_node - 1) * piece * intra))


def _tree_bytes(tree: Any) -> int:
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def zero_baseline(stage: int, workload: Workload, totals: StepTotals, cluster: ClusterSpec) -> BaselineResult:
    """ZeRO stage 2 or 3 over all devices (module docstring)."""
    if stage not in (2, 3):
        raise ValueError(f"ZeRO stage must be 2 or 3, got {stage!r}")
    n = cluster.num_devices
    state = workload.args[0]
    params = state["train"].params if isinstance(state, dict) else state.params
    param_bytes = _tree_bytes(params)
    compute = totals.compute_seconds(n)
    method_cls = al.Zero2Parallel if stage == 2 else al.Zero3Parallel
    name = f"zero{stage}"
    counts = _micro_batch_counts(workload.global_batch, n)
    if not counts:
        return BaselineResult(name=name, step_seconds=None, num_micro_batches=None, memory_per_device=0.0,
                              compute_seconds=compute, communication_seconds=0.0,
                              detail="batch smaller than the device count")

    def memory_at(state_bytes: float, m: int) -> float:
        return state_bytes + param_bytes / n + totals.activation_bytes_per_sequence * workload.global_batch / (n * m)

    def plan_at(m: int):
        return al.plan(workload.train_step, *workload.args, method=method_cls(num_micro_batches=m), cluster=cluster)

    plan = plan_at(1)  # the state's memory does not depend on the micro-batch count; ZeRO-3's gathers do
    state_bytes = plan.stages[0].memory_per_device
    fitting = [m for m in counts if memory_at(state_bytes, m) <= cluster.device_memory]
    m = fitting[0] if fitting else counts[-1]
    if m != 1:
        plan = plan_at(m)
    per_node = min(n, cluster.num_devices_per_node)
    comm = sum(collective_seconds(c.kind, c.num_bytes, cluster, n, per_node) for c in plan.stages[0].communication)
    return BaselineResult(name=name, step_seconds=compute + comm if fitting else None, num_micro_batches=m,
                          memory_per_device=memory_at(state_bytes, m), compute_seconds=compute,
                          communication_seconds=comm,
                          detail="" if fitting else "does not fit at any micro-batch count")


def _is_expert(leaf: Any, num_experts: int) -> bool:
    return len(leaf.shape) == 3 and leaf.shape[0] == num_experts


def expert_parallel_degrees(num_experts: int, num_devices: int) -> list[int]:
    """EP degrees DeepSpeed-MoE can use: each divides both the experts and the devices (an EP group holds
    ``E / EP`` whole experts per device and the groups tile the data-parallel devices).

    >>> expert_parallel_degrees(32, 16)
    [1, 2, 4, 8, 16]
    """
    g = math.gcd(num_experts, num_devices)
    return [k for k in range(1, g + 1) if g % k == 0]


def expert_parallel_estimate(workload: Workload, totals: StepTotals, cluster: ClusterSpec, ep: int,
                             num_micro_batches: int) -> BaselineResult:
    """DeepSpeed-MoE with ``ep``-way expert parallelism and ZeRO-2 at ``num_micro_batches`` (module
    docstring); ``step_seconds`` is None when it does not fit in device memory.

    Per device: the dense parameters and this device's ``E / EP`` experts (expert ``e`` on the devices of an
    EP group, replicated over the ``N / EP`` groups); ZeRO-2 gradient shards (dense over ``N``, each expert
    over its ``N / EP`` replicas: ``1 / N`` of all gradients) and optimizer state (``1 / N`` of the
    workload's, whatever its optimizer); one micro-batch of activations.
    """
    config, n = workload.config, cluster.num_devices
    if workload.family != "moe":
        raise ValueError(f"expert parallelism needs an MoE workload, got {workload.family!r}")
    if ep not in expert_parallel_degrees(config.num_experts, n):
        raise ValueError(f"ep must divide both the {config.num_experts} experts and the {n} devices, got {ep!r}")
    state = workload.args[0]
    e = config.num_experts
    leaves = jax.tree.leaves(state.params)
    expert_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves if _is_expert(x, e))
    dense_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves if not _is_expert(x, e))
    optimizer_bytes = _tree_bytes(state.opt_state)
    per_node = cluster.num_devices_per_node
    compute = totals.compute_seconds(n)
    # ZeRO-2: dense gradients reduce-scattered over all N, updated parameters all-gathered; expert gradients
    # the same over the N / EP replicas of each expert (an all-reduce's volume), whose group holds
    # max(1, M / EP) devices of each of its nodes (EP groups are runs of consecutive devices)
    replicas = n // ep
    replicas_per_node = math.gcd(replicas, max(1, min(n, per_node) // ep))
    sync = (collective_seconds("reduce-scatter", dense_bytes, cluster, n, min(n, per_node))
            + collective_seconds("all-gather", dense_bytes, cluster, n, min(n, per_node))
            + collective_seconds("all-reduce", expert_bytes / ep, cluster, replicas, replicas_per_node))
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    m = num_micro_batches
    tokens = workload.global_batch * config.seq_len / (n * m)
    dispatched = tokens * 2 * config.capacity_factor * config.hidden_size * np.dtype(config.dtype).itemsize
    # top-2 slots per token; an EP group is a run of consecutive devices: whole nodes when it has more than one
    # node's devices (gcd: counted as the fewest devices it can have on one node when the run straddles nodes)
    all_to_all = 6 * moe_layers * m * collective_seconds("all-to-all", dispatched * ep, cluster, ep,
                                                         math.gcd(ep, min(n, per_node)))
    memory = dense_bytes + expert_bytes / ep + (dense_bytes + expert_bytes) / n + optimizer_bytes / n \
        + totals.activation_bytes_per_sequence * workload.global_batch / (n * m)
    fits = memory <= cluster.device_memory
    return BaselineResult(name="expert parallel", step_seconds=compute + sync + all_to_all if fits else None,
                          num_micro_batches=m, memory_per_device=memory, compute_seconds=compute,
                          communication_seconds=sync + all_to_all,
                          detail=f"EP={ep}" + ("" if fits else "; does not fit"))


def expert_parallel_baseline(workload: Workload, totals: StepTotals, cluster: ClusterSpec) -> BaselineResult:
    """DeepSpeed-style expert parallelism with ZeRO-2 (module docstring): the fastest fitting estimate over
    every EP degree (:func:`expert_parallel_degrees`) and micro-batch count, as Alpa grid-searched
    DeepSpeed's parallelism degrees (§3.8.1); when nothing fits, the smallest-memory estimate with
    ``step_seconds`` None."""
    if workload.family != "moe":
        raise ValueError(f"expert parallelism needs an MoE workload, got {workload.family!r}")
    n = cluster.num_devices
    estimates = [expert_parallel_estimate(workload, totals, cluster, ep, m)
                 for ep in expert_parallel_degrees(workload.config.num_experts, n)
                 for m in _micro_batch_counts(workload.global_batch, n)]
    if not estimates:
        return BaselineResult(name="expert parallel", step_seconds=None, num_micro_batches=None,
                              memory_per_device=0.0, compute_seconds=0.0, communication_seconds=0.0,
                              detail="batch smaller than the device count")
    fitting = [r for r in estimates if r.step_seconds is not None]
    if fitting:
        return min(fitting, key=lambda r: r.step_seconds)
    closest = min(estimates, key=lambda r: r.memory_per_device)
    return dataclasses.replace(closest, detail=closest.detail.replace("does not fit",
                                                                      "does not fit at any EP and micro-batch count"))
