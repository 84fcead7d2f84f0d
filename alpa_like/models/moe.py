"""GShard mixture-of-experts decoder: a GPT decoder whose every ``moe_every``-th MLP is a top-2 MoE layer.

Sizes are Alpa's MoE benchmark (Alpa, dissertation ch. 3, Table 3.7). Routing follows GShard (Lepikhin et
al. 2020, Algorithm 1): tokens are split into groups of ``expert_group_size``; in each group every token
goes to its top-1 expert and then its top-2 expert while the expert has room, with

.. math::

    C = \\left\\lceil \\mathrm{capacity\\_factor} \\cdot \\frac{2 S}{E} \\right\\rceil

slots per expert per group (S tokens per group, E experts). GShard's Algorithm 1 sets ``C = 2S/E``, so
``capacity_factor`` defaults to 1.0 (Alpa's benchmark uses the same). Second-expert routing is
deterministic (GShard's optional random second-expert policy is not implemented).

All expert computation is einsums over an explicit expert dimension ``e``: dispatch and combine tensors
are ``[groups g, tokens s, experts e, capacity c]`` and expert weights ``[e, hidden, ffn]``, so a sharding
pass can split ``e`` (expert parallelism) with an all-to-all.

The auxiliary load-balancing loss of every MoE layer is ``sow``n into the ``"aux_loss"`` collection;
:func:`moe_loss` adds ``aux_loss_coef`` times their sum to the cross entropy.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa_like.models.common import check_positive_int, mean_cross_entropy, variable_shapes
from alpa_like.models.gpt import (
    Batch,
    GPTConfig,
    GPTModel,
    LossFn,
    gpt_batch,
    gpt_batch_shapes,
)

__all__ = [
    "AUX_LOSS_COLLECTION",
    "MOE_CONFIGS",
    "MOE_TABLE_3_7_GPUS",
    "MoEConfig",
    "MoELayer",
    "MoEModel",
    "Routing",
    "expert_capacity",
    "group_size",
    "moe_batch",
    "moe_batch_shapes",
    "moe_loss",
    "moe_param_shapes",
    "top2_gating",
]

AUX_LOSS_COLLECTION = "aux_loss"
"""Flax collection holding one load-balancing loss per MoE layer."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(GPTConfig):
    """A :class:`GPTConfig` plus the GShard expert layer settings."""

    num_experts: int
    """Experts E per MoE layer (>= 2 for top-2 routing)."""
    expert_group_size: int = 2048
    """Tokens per routing group S; capacity is per group. A smaller batch uses one group of all tokens."""
    capacity_factor: float = 1.0
    """Multiplies GShard's capacity 2S/E (1.0 = GShard Algorithm 1)."""
    moe_every: int = 2
    """Block i uses experts when ``i % moe_every == moe_every - 1`` (every second block by default)."""
    aux_loss_coef: float = 0.01
    """Weight of the summed load-balancing losses in :func:`moe_loss`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_positive_int(
            owner,
            num_experts=self.num_experts,
            expert_group_size=self.expert_group_size,
            moe_every=self.moe_every,
        )
        if self.num_experts < 2:
            raise ValueError(f"{owner}.num_experts must be >= 2 for top-2 gating, got {self.num_experts}")
        if not self.capacity_factor > 0:
            raise ValueError(f"{owner}.capacity_factor must be > 0, got {self.capacity_factor!r}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"{owner}.aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has an expert MLP."""
        return layer % self.moe_every == self.moe_every - 1


def _moe(hidden: int, layers: int, heads: int, experts: int) -> MoEConfig:
    """A row of Alpa Table 3.7: sequence 1024, vocabulary 32,000, expert groups of 2048 tokens.

    The MLP width is 8h (``mlp_ratio=8``), as in Alpa's MoE benchmark: with 4h the table's parameter
    counts are not reached (e.g. 214M instead of 380M for the first row).
    """
    return MoEConfig(
        vocab_size=32000,
        seq_len=1024,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        mlp_ratio=8,
        num_experts=experts,
    )


MOE_CONFIGS: dict[str, MoEConfig] = {
    "moe-380m": _moe(768, 8, 16, 8),
    "moe-1.3b": _moe(768, 16, 16, 16),
    "moe-2.4b": _moe(1024, 16, 16, 16),
    "moe-10b": _moe(1536, 16, 16, 32),
    "moe-27b": _moe(2048, 16, 32, 48),
    "moe-70b": _moe(2048, 32, 32, 64),
    "moe-tiny": MoEConfig(
        vocab_size=64,
        seq_len=16,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_experts=4,
        expert_group_size=16,
    ),
}
"""Alpa Table 3.7 MoE models plus ``moe-tiny`` (tests)."""

MOE_TABLE_3_7_GPUS: dict[str, int] = {
    "moe-380m": 1,
    "moe-1.3b": 4,
    "moe-2.4b": 8,
    "moe-10b": 16,
    "moe-27b": 32,
    "moe-70b": 64,
}
"""GPUs used for each MoE model in Alpa Table 3.7 (weak scaling, batch 1024)."""


def expert_capacity(tokens_per_group: int, num_experts: int, capacity_factor: float = 1.0) -> int:
    """GShard capacity ``ceil(capacity_factor * 2 * tokens_per_group / num_experts)`` slots per expert."""
    return math.ceil(capacity_factor * 2 * tokens_per_group / num_experts)


def group_size(num_tokens: int, expert_group_size: int) -> int:
    """Tokens per routing group: ``expert_group_size``, or all tokens when there are fewer.

    Raises:
      ValueError: if ``num_tokens`` is not a multiple of the group size.
    """
    size = min(num_tokens, expert_group_size)
    if num_tokens % size:
        raise ValueError(
            f"batch * seq = {num_tokens} tokens must be a multiple of expert_group_size="
            f"{expert_group_size}"
        )
    return size


class Routing(NamedTuple):
    """Output of :func:`top2_gating` for ``G`` groups of ``S`` tokens, ``E`` experts, capacity ``C``."""

    combine: jax.Array
    """float32 [G, S, E, C]: gate weight of token s in slot c of expert e (0 where not routed)."""
    dispatch: jax.Array
    """bool [G, S, E, C]: token s occupies slot c of expert e. Each slot holds <= 1 token, each token
    occupies <= 2 slots (in different experts)."""
    aux_loss: jax.Array
    """float32 scalar: GShard load-balancing loss ``E^2 * mean_{g,e}(fraction routed_e * mean gate_e)``,
    equal to 1 for perfectly uniform routing."""


def _slots(mask: jax.Array, offset: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Position of each routed token in its expert's buffer, dropping those beyond ``capacity``.

    Args:
      mask: int32 [G, S, E] one-hot routing choice.
      offset: int32 [G, 1, E] slots already taken in each expert.

    Returns:
      (kept mask [G, S, E], slot one-hot [G, S, E, C]).
    """
    position = jnp.cumsum(mask, axis=1) - mask + offset
    kept = mask * (position < capacity)
    slot = jnp.sum(position * kept, axis=-1)
    return kept, kept[..., None] * jax.nn.one_hot(slot, capacity, dtype=jnp.int32)[:, :, None, :]


def top2_gating(logits: jax.Array, capacity: int) -> Routing:
    """GShard top-2 routing (Algorithm 1) of gate logits [G, S, E] into ``capacity`` slots per expert.

    Tokens are served in order within a group: all first choices before any second choice, so a token
    only loses its top-1 expert when ``capacity`` earlier tokens chose it first. Gates of the two choices
    are renormalised to sum to 1 before dropping.
    """
    check_positive_int("top2_gating", capacity=capacity)
    num_experts = logits.shape[-1]
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    mask1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), num_experts, dtype=jnp.int32)
    second = jnp.argmax(jnp.where(mask1 > 0, -1.0, gates), axis=-1)  # gates >= 0: -1 excludes the top-1
    mask2 = jax.nn.one_hot(second, num_experts, dtype=jnp.int32)
    fraction_routed = jnp.mean(mask1.astype(jnp.float32), axis=1)
    aux_loss = jnp.mean(fraction_routed * jnp.mean(gates, axis=1)) * num_experts**2
    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = gate1 + gate2
    kept1, slot1 = _slots(mask1, jnp.zeros_like(mask1[:, :1]), capacity)
    kept2, slot2 = _slots(mask2, jnp.sum(kept1, axis=1, keepdims=True), capacity)
    combine = (gate1 / denom)[..., None, None] * slot1 + (gate2 / denom)[..., None, None] * slot2
    return Routing(combine=combine, dispatch=(slot1 + slot2) > 0, aux_loss=aux_loss)


class MoELayer(nn.Module):
    """Top-2 mixture of GELU experts replacing a dense MLP; input and output [batch, seq, hidden].

    Parameters: ``gate`` [hidden, E], ``wi`` [E, hidden, ffn], ``wo`` [E, ffn, hidden] (no biases, as in
    Alpa's benchmark). Gating runs in float32. Tokens dropped by both choices contribute zero (the
    residual connection of the block carries them).
    """

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        batch, seq, hidden = x.shape
        ffn, experts = cfg.mlp_ratio * hidden, cfg.num_experts
        tokens = group_size(batch * seq, cfg.expert_group_size)
        capacity = expert_capacity(tokens, experts, cfg.capacity_factor)
        init = nn.initializers.normal(0.02)
        w_gate = self.param("gate", init, (hidden, experts), jnp.float32)
        wi = self.param("wi", init, (experts, hidden, ffn), jnp.float32).astype(cfg.dtype)
        wo = self.param("wo", init, (experts, ffn, hidden), jnp.float32).astype(cfg.dtype)

        xg = x.reshape(-1, tokens, hidden)
        routing = top2_gating(jnp.einsum("gsm,me->gse", xg.astype(jnp.float32), w_gate), capacity)
        self.sow(AUX_LOSS_COLLECTION, "load_balancing", routing.aux_loss)
        expert_in = jnp.einsum("gsec,gsm->egcm", routing.dispatch.astype(cfg.dtype), xg)
        h = nn.gelu(jnp.einsum("egcm,emf->egcf", expert_in, wi))
        expert_out = jnp.einsum("egcf,efm->egcm", h, wo)
        y = jnp.einsum("gsec,egcm->gsm", routing.combine.astype(cfg.dtype), expert_out)
        return y.reshape(batch, seq, hidden)


class MoEModel(GPTModel):
    """:class:`GPTModel` whose blocks with ``config.is_moe_layer(i)`` use :class:`MoELayer` as MLP.

    Same parameter layout (``block_i/mlp`` holds ``gate``, ``wi``, ``wo`` in MoE blocks) and call
    signature; applying it also produces the ``"aux_loss"`` collection (pass ``mutable=["aux_loss"]``).
    """

    config: MoEConfig

    @nn.nowrap
    def block_mlp(self, layer: int) -> Callable[..., nn.Module] | None:
        """:class:`MoELayer` for MoE blocks, ``None`` (dense MLP) for the others."""
        return functools.partial(MoELayer, self.config) if self.config.is_moe_layer(layer) else None


def moe_loss(model: MoEModel) -> LossFn:
    """Return ``loss_fn(params, batch) -> scalar``: cross entropy + ``aux_loss_coef * sum(aux losses)``.

    The batch is as for :func:`alpa_like.models.gpt.gpt_loss`.
    """
    coef = model.config.aux_loss_coef

    def loss_fn(params: Any, batch: Batch) -> jax.Array:
        logits, state = model.apply({"params": params}, batch["input_ids"], mutable=[AUX_LOSS_COLLECTION])
        aux = sum(jax.tree.leaves(state.get(AUX_LOSS_COLLECTION, {})), jnp.float32(0))
        return mean_cross_entropy(logits, batch["labels"]) + coef * aux

    return loss_fn


def moe_batch(config: MoEConfig, batch_size: int, rng: jax.Array) -> Batch:
    """Random next-token batch, as :func:`alpa_like.models.gpt.gpt_batch`."""
    return gpt_batch(config, batch_size, rng)


def moe_batch_shapes(config: MoEConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """``ShapeDtypeStruct`` version of :func:`moe_batch`."""
    return gpt_batch_shapes(config, batch_size)


def moe_param_shapes(config: MoEConfig) -> Any:
    """Parameter pytree of ``MoEModel(config)`` as ``ShapeDtypeStruct``s; nothing is allocated."""
    ids = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    return variable_shapes(MoEModel(config), ids)["params"]
