"""The benchmark workloads: a model config, its training step and shapes, and the cluster it runs on.

A :class:`Workload` is everything planning needs (``al.plan(workload.train_step, *workload.args, ...)``)
built from shapes only, so Table 3.6's GPT-39B on 64 simulated GPUs costs no memory. GPT/OPT and MoE use
FP16 activations with FP32 parameters and per-layer recomputation, as Alpa's benchmark does; Wide-ResNet
trains in FP32 (Alpa §3.8). The optimizer is Adam, except for MoE: see :data:`OPTIMIZERS`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import alpa_like as al
from alpa_like import models
from alpa_like.bench import megatron
from alpa_like.bench.megatron import HiddenState, LayerSeconds, TransformerCosts
from alpa_like.compiler.flops import ComputeRates, equation_seconds
from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD, LayerSummary
from alpa_like.models import gpt, moe, wide_resnet


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One model at one global batch size, as shapes."""

    name: str
    family: str
    """``gpt`` (also OPT), ``moe`` or ``wresnet``."""
    config: Any
    global_batch: int
    train_step: Callable
    args: tuple
    """``(state, batch)`` as ``ShapeDtypeStruct`` pytrees (or arrays, for the local backend)."""
    num_layers: int
    """Layers of the step: handed to ``AutoLayerOption`` (transformer blocks, or bottleneck blocks for
    Wide-ResNet), or made by the model's own boundaries under ``manual_layers``. GPT/OPT and MoE get one more
    for the tied logits (:func:`logits_to_block_flops`: GPT-6.7B 1.0, GPT-39B
    0.51), so that Eq. 3.6 can cut between blocks, where one hidden state crosses, rather than shift cuts into
    a block to balance the logits' FLOPs; the stage DP may still put them with the last block. (MoE-10B with
    one layer per block had cuts inside blocks: a layer boundary carrying 4.7 hidden states, and a residual
    gradient skipping the MoE feed-forward's layer into the one before it.)"""
    remat: bool
    recompute_aware: bool = False
    """``AutoLayerOption.recompute_aware``: with ``remat``, Eq. 3.6's tie-break counts what layers recompute
    (``python -m alpa_like.bench wresnet --recompute-aware-layers``)."""
    manual_layers: bool = False
    """Layers end at the model's ``al.mark_pipeline_boundary()`` calls (``ManualLayerOption``) instead of
    Eq. 3.6's clustering. MoE marks every block's attention and MLP apart (``pipeline_boundaries=
    "sublayer"``): an expert MLP is several times its attention (MoE-10B: 0.72 against 0.10 TFLOP per
    micro-batch of 4 sequences, a dense MLP 0.31), so whole blocks are too coarse to balance stages. MoE-10B
    on 16 GPUs: 6.22 s with a layer per block (and Eq. 3.6), 5.81 s with sublayers."""


def cluster_for(num_gpus: int, preset: str = "p3.16xlarge") -> al.ClusterSpec:
    """``num_gpus`` devices of ``preset``: whole nodes, or part of one node below a node's size."""
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus must be an int >= 1, got {num_gpus!r}")
    one = al.ClusterSpec.preset(preset)
    per_node = one.num_devices_per_node
    if num_gpus < per_node:
        return dataclasses.replace(one, num_devices_per_node=num_gpus)
    if num_gpus % per_node:
        raise ValueError(f"{num_gpus} GPUs is not a whole number of {preset} nodes ({per_node} GPUs each)")
    return al.ClusterSpec.preset(preset, num_nodes=num_gpus // per_node)


def micro_batch_count_error(workload: Workload, num_micro_batches: int) -> str | None:
    """Why the step of ``workload`` cannot be split into ``num_micro_batches`` micro-batches without changing
    the model, or None: the count must divide the global batch, and an MoE micro-batch must hold whole
    routing groups of ``expert_group_size`` tokens (a micro-batch of fewer tokens is routed as one smaller
    group, whose expert capacity ``2 S / E`` is smaller: another model, with other FLOPs).

    >>> moe_10b = make_workload("moe-10b", 1024)
    >>> micro_batch_count_error(moe_10b, 512) is None
    True
    >>> micro_batch_count_error(moe_10b, 1024)
    'a micro-batch of 1024 tokens is less than one routing group (expert_group_size=2048)'
    """
    if workload.global_batch % num_micro_batches:
        return f"{num_micro_batches} micro-batches do not divide the global batch {workload.global_batch}"
    if workload.family == "moe":
        c = workload.config
        tokens = workload.global_batch // num_micro_batches * c.seq_len
        if tokens < c.expert_group_size:
            return (f"a micro-batch of {tokens} tokens is less than one routing group "
                    f"(expert_group_size={c.expert_group_size})")
    return None


OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "gpt": lambda: optax.adam(1e-4),
    "wresnet": lambda: optax.adam(1e-4),
    "moe": lambda: optax.adafactor(1e-3),
}
"""The optimizer of each family, the same for our plans and every baseline of its suite. MoE trains with
Adafactor (factored second moments, no first moment: its state is under 0.2% of the parameters' bytes,
0.06% for MoE-70B, instead of Adam's 200%), because Alpa's MoE comparison does: the Alpa artifact's DeepSpeed instructions
(``osdi22_artifact/deepspeed/README.md`` in the Alpa repository) say DeepSpeed was patched with "the
AdaFactor optimizer ... used for MoE training". With Adam, MoE-70B's parameters, gradients and two moments
alone (16 bytes per parameter) exceed the 16 GiB of a V100 on 64 GPUs, whatever the plan."""


def train_state_shapes(family: str, params: Any) -> train_state.TrainState:
    """``TrainState`` shapes of ``params`` with the family's optimizer (:data:`OPTIMIZERS`)."""
    if family not in OPTIMIZERS:
        raise ValueError(f"family must be one of {sorted(OPTIMIZERS)}, got {family!r}")
    tx = OPTIMIZERS[family]()
    return jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=tx), params)


def loss_train_step(loss_fn: Callable) -> Callable:
    """``train_step(state, batch)``: ``al.value_and_grad`` of ``loss_fn`` and the state's optimizer update."""
    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss
    return train_step


def make_workload(name: str, global_batch: int, recompute_aware: bool = False) -> Workload:
    """The workload of a named config (any of ``models.ALL_CONFIG_TABLES``) at ``global_batch``; with
    ``recompute_aware``, its Eq. 3.6 layers count recomputation (:attr:`Workload.recompute_aware`)."""
    workload = _named_workload(name, global_batch)
    if not recompute_aware:
        return workload
    if not workload.remat or workload.manual_layers:
        raise ValueError(f"--recompute-aware-layers: {name} has no per-layer remat with Eq. 3.6 layers")
    return dataclasses.replace(workload, recompute_aware=True)


def _named_workload(name: str, global_batch: int) -> Workload:
    config = models.get_config(name)
    if isinstance(config, models.MoEConfig):
        config = dataclasses.replace(config, dtype=jnp.float16, pipeline_boundaries="sublayer")
        state = train_state_shapes("moe", moe.moe_param_shapes(config))
        return Workload(name=name, family="moe", config=config, global_batch=global_batch,
                        train_step=loss_train_step(moe.moe_loss(moe.MoEModel(config))),
                        args=(state, moe.moe_batch_shapes(config, global_batch)),
                        num_layers=2 * config.num_layers + 1, remat=True, manual_layers=True)
    if isinstance(config, models.GPTConfig):
        config = dataclasses.replace(config, dtype=jnp.float16)
        state = train_state_shapes("gpt", gpt.gpt_param_shapes(config))
        return Workload(name=name, family="gpt", config=config, global_batch=global_batch,
                        train_step=loss_train_step(gpt.gpt_loss(gpt.GPTModel(config))),
                        args=(state, gpt.gpt_batch_shapes(config, global_batch)),
                        num_layers=config.num_layers + 1, remat=True)
    return _wresnet_workload(name, config, global_batch)


def _wresnet_workload(name: str, config: models.WResNetConfig, global_batch: int) -> Workload:
    params, batch_stats = wide_resnet.wresnet_param_shapes(config)
    loss_fn = wide_resnet.wresnet_loss(wide_resnet.WideResNet(config))
    state = {"train": train_state_shapes("wresnet", params), "batch_stats": batch_stats}

    def train_step(state, batch):
        (loss, new_stats), grads = al.value_and_grad(loss_fn, has_aux=True)(
            state["train"].params, state["batch_stats"], batch)
        return {"train": state["train"].apply_gradients(grads=grads), "batch_stats": new_stats}, loss

    return Workload(name=name, family="wresnet", config=config, global_batch=global_batch, train_step=train_step,
                    args=(state, wide_resnet.wresnet_batch_shapes(config, global_batch)),
                    num_layers=sum(config.stage_sizes), remat=True)  # as Alpa's Wide-ResNet search suite


def _optimizer_state_bytes(sliced: Any) -> int:
    """Bytes of the optimizer state a sliced step's apply phases read, each leaf once: the leaves of
    ``sliced.optimizer_inputs`` less every parameter (a layer's apply phase also reads parameters of another
    layer, such as a tied word embedding the last layer's logits share with the first)."""
    leaves = {i for inputs in sliced.optimizer_inputs for i in inputs if sliced.roles[i] != "param"}
    return sum(sliced.traced.in_leaves[i].nbytes for i in leaves)


def transformer_costs(sliced: Any, workload: Workload, num_micro_batches: int,
                      rates: ComputeRates | None = None) -> TransformerCosts:
    """Per-sequence layer costs of a sliced GPT/MoE step (``alpa_like.compiler.sliced_step.slice_step``), whose
    layers were traced on micro-batches of ``global_batch / num_micro_batches`` sequences; with ``rates``
    (``ClusterSpec.compute_rates``), also each layer's time under that compute model."""
    per = workload.global_batch / num_micro_batches
    summaries = _fold_surplus_layers(sliced.summaries, workload.config.num_layers)
    # Optimizer state in proportion to each layer's parameters (Adam keeps two moments per parameter).
    # Not ``sliced.optimizer_inputs``: that attributes nearly all of it to the first layer's apply phase.
    total_optimizer = _optimizer_state_bytes(sliced)
    total_params = sum(s.param_bytes for s in summaries)
    optimizer = [total_optimizer * s.param_bytes / total_params for s in summaries]
    config = workload.config
    hidden = HiddenState(sequences=workload.global_batch // num_micro_batches, seq_len=config.seq_len,
                         hidden_size=config.hidden_size)
    replicated = [megatron.whole_parameter_bytes(sliced.jaxpr, s.param_inputs, hidden) for s in summaries]
    return TransformerCosts(
        forward_flops=tuple(s.forward_flops / per for s in summaries),
        backward_flops=tuple(s.backward_flops / per for s in summaries),
        apply_flops=tuple(float(s.apply_flops) for s in summaries),
        param_bytes=tuple(float(s.param_bytes) for s in summaries),
        optimizer_bytes=tuple(float(b) for b in optimizer),
        activation_bytes=tuple(s.activation_bytes / per for s in summaries),
        replicated_param_bytes=tuple(replicated),
        replicated_optimizer_bytes=tuple(total_optimizer * r / total_params for r in replicated),
        hidden_bytes=float(config.seq_len * config.hidden_size * np.dtype(config.dtype).itemsize),
        num_heads=config.num_heads, recompute=workload.remat,
        shared_params=_folded_shared_params(sliced, config.num_layers),
        batch_inputs=_folded_batch_inputs(sliced, config.num_layers, per),
        seconds=None if rates is None else layer_seconds(sliced, config.num_layers, hidden, rates))


class PieceSeconds(NamedTuple):
    """The compute time of one ``(layer, phase)`` piece of a sliced step (:func:`piece_seconds`)."""

    scaled: float
    """Seconds of its equations without the per-product overhead."""
    fixed: float
    """Seconds the per-product overhead adds (``matmul_overhead`` times its products: paid by every device,
    whatever the split)."""
    repeated: float
    """The part of ``scaled`` that each of Megatron-LM's tensor-parallel ranks repeats
    (:func:`~alpa_like.bench.megatron.repeated_seconds`); 0 when no hidden state was given."""


def piece_seconds(sliced: Any, rates: ComputeRates,
                  hidden: HiddenState | None = None) -> dict[tuple[int, str], PieceSeconds]:
    """Per ``(layer, phase)`` piece of a sliced step: the seconds of its equations at ``rates``
    (:func:`~alpa_like.compiler.flops.equation_seconds`) as :class:`PieceSeconds`; with ``hidden`` (the
    micro-batch's hidden state the step was traced on), also the part tensor parallelism repeats."""
    plain = dataclasses.replace(rates, matmul_overhead=0.0)
    totals: dict[tuple[int, str], PieceSeconds] = {}
    for eqn, piece in zip(sliced.jaxpr.eqns, sliced.pieces, strict=True):
        if piece is None:
            continue
        scaled = equation_seconds(eqn, plain)
        repeated = 0.0 if hidden is None else megatron.repeated_seconds(eqn, plain, hidden)
        before = totals.get((piece.layer, piece.phase), PieceSeconds(0.0, 0.0, 0.0))
        totals[(piece.layer, piece.phase)] = PieceSeconds(before.scaled + scaled,
                                                          before.fixed + equation_seconds(eqn, rates) - scaled,
                                                          before.repeated + repeated)
    return totals


def layer_seconds(sliced: Any, num_blocks: int, hidden: HiddenState, rates: ComputeRates) -> LayerSeconds:
    """Each folded layer's (:func:`_fold_surplus_layers`) :func:`piece_seconds`, the scaled parts (split
    over the tensor-parallel ranks and repeated on each) per sequence (the forward and backward were traced
    on micro-batches of ``hidden.sequences`` sequences)."""
    phases = {FORWARD: "forward", BACKWARD: "backward", APPLY: "apply"}
    fields = [name + part for name in phases.values() for part in ("", "_repeated", "_fixed")]
    totals = {field: [0.0] * num_blocks for field in fields}
    for (layer, phase), piece in piece_seconds(sliced, rates, hidden).items():
        name, layer = phases[phase], min(layer, num_blocks - 1)
        totals[name][layer] += piece.scaled - piece.repeated
        totals[name + "_repeated"][layer] += piece.repeated
        totals[name + "_fixed"][layer] += piece.fixed
    per_sequence = {field: 1 if field.startswith("apply") or field.endswith("_fixed") else hidden.sequences
                    for field in fields}
    return LayerSeconds(**{field: tuple(v / per_sequence[field] for v in values) for field, values in totals.items()})


def _folded_batch_inputs(sliced: Any, num_blocks: int, sequences: float) -> tuple:
    """:func:`megatron.batch_inputs` of the sliced step (one micro-batch of ``sequences`` sequences) per
    sequence, on the folded layers (:func:`_fold_surplus_layers`)."""
    inputs = megatron.batch_inputs(sliced.jaxpr, sliced.pieces, [r == "batch" for r in sliced.roles])
    return tuple((nbytes / sequences, _fold_layers(layers, num_blocks)) for nbytes, layers in inputs)


def _folded_shared_params(sliced: Any, num_blocks: int) -> tuple:
    """:func:`megatron.shared_parameters` of the sliced step on the folded layers (:func:`_fold_surplus_layers`)."""
    shared = megatron.shared_parameters(sliced.jaxpr, sliced.pieces, [r == "param" for r in sliced.roles])
    folded = ((nbytes, _fold_layers(layers, num_blocks)) for nbytes, layers in shared)
    return tuple((nbytes, layers) for nbytes, layers in folded if len(layers) > 1)


def _fold_layers(layers, num_blocks: int) -> tuple[int, ...]:
    """Sliced layer indices on the folded layers: those past the last block are the last block's."""
    return tuple(sorted({min(l, num_blocks - 1) for l in layers}))


def logits_to_block_flops(config) -> float:
    """FLOPs of the logits per token (``2 h V``) over those of one transformer block (``2 (12 h^2 + 2 s h)``:
    the four projections and the MLP, the attention scores and their weighted sum), i.e.
    ``V / (12 h + 2 s)``.

    >>> round(logits_to_block_flops(models.get_config("gpt-6.7b")), 2)
    1.0
    """
    return config.vocab_size / (12 * config.hidden_size + 2 * config.seq_len)


def _fold_surplus_layers(summaries, num_blocks: int) -> list[LayerSummary]:
    """Megatron-LM's layers: one per transformer block, the embedding with the first and the logits with the
    last. The sliced step may have more layers than blocks (:attr:`Workload.num_layers`: the logits get
    their own); the surplus trailing layers are added into the last block's."""
    if len(summaries) <= num_blocks:
        return list(summaries)
    head, tail = list(summaries[:num_blocks - 1]), summaries[num_blocks - 1:]
    return head + [LayerSummary(layer=num_blocks - 1, forward_flops=sum(s.forward_flops for s in tail),
                                backward_flops=sum(s.backward_flops for s in tail),
                                apply_flops=sum(s.apply_flops for s in tail),
                                param_inputs=tuple(k for s in tail for k in s.param_inputs),
                                param_bytes=sum(s.param_bytes for s in tail),
                                activation_bytes=sum(s.activation_bytes for s in tail))]
