"""GPT / OPT decoder-only transformer (pre-LayerNorm, learned positions, tied embeddings).

The model sizes are those of Alpa's GPT benchmark (Alpa, dissertation ch. 3, Table 3.6) and of the published
OPT family. Parameter count follows Megatron-LM Eq. 2 (PTD-P paper, section 5.1):

.. math::

    P = 12 l h^2 \\left(1 + \\frac{13}{12h} + \\frac{V + s}{12 l h}\\right)

which counts per layer the QKV and output projections (``4h^2 + 4h``), the 4h MLP (``8h^2 + 5h``) and two
LayerNorms (``4h``), plus the token and position embeddings; the final LayerNorm (``2h``) is the only
parameter it leaves out.

Example:
  >>> import jax
  >>> config = GPT_CONFIGS["gpt-tiny"]
  >>> model = GPTModel(config)
  >>> batch = gpt_batch(config, batch_size=2, rng=jax.random.key(0))
  >>> params = model.init(jax.random.key(1), batch["input_ids"])["params"]
  >>> model.apply({"params": params}, batch["input_ids"]).shape
  (2, 16, 64)
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa_like.compiler.markers import mark_pipeline_boundary
from alpa_like.models.common import (
    check_float_dtype,
    check_positive_int,
    mean_cross_entropy,
    variable_shapes,
)
from alpa_like.nn import causal_self_attention

__all__ = [
    "GPTConfig",
    "GPT_CONFIGS",
    "OPT_CONFIGS",
    "GPT_TABLE_3_6_GPUS",
    "GPTBlock",
    "GPTModel",
    "MLP",
    "SelfAttention",
    "default_position_ids",
    "gpt_batch",
    "gpt_batch_shapes",
    "gpt_loss",
    "gpt_param_shapes",
    "megatron_num_params",
]

Batch = dict[str, jax.Array]
LossFn = Callable[[Any, Batch], jax.Array]

_INIT_STD = 0.02
"""Standard deviation of the normal initialiser of every weight matrix and embedding (GPT-2's)."""


PIPELINE_BOUNDARIES = ("none", "block", "sublayer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT/OPT decoder. Validated on construction (ValueError names the bad field)."""

    vocab_size: int
    """Number of token ids V; the tied embedding is [V, hidden_size]."""
    seq_len: int
    """Maximum sequence length s: rows of the learned position embedding."""
    hidden_size: int
    """Model width h."""
    num_layers: int
    """Number of transformer blocks l."""
    num_heads: int
    """Attention heads; must divide hidden_size."""
    mlp_ratio: int = 4
    """MLP inner width as a multiple of hidden_size (4 for GPT/OPT)."""
    dtype: Any = jnp.float32
    """Compute dtype of activations; parameters are always float32, softmax and loss float32."""
    pipeline_boundaries: str = "none"
    """Where the forward calls ``al.mark_pipeline_boundary()`` (layers for ``ManualLayerOption``; no effect
    otherwise): ``"none"``; ``"block"``: after every block, so the blocks and the final LayerNorm with the
    logits are ``num_layers + 1`` layers; ``"sublayer"``: also between a block's attention and its MLP,
    ``2 num_layers + 1`` layers (an MoE model's expert MLP is several times its attention: finer layers let
    the stage DP balance stages)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_positive_int(
            owner,
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            mlp_ratio=self.mlp_ratio,
        )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"{owner}.hidden_size must be divisible by num_heads={self.num_heads}, "
                f"got hidden_size={self.hidden_size}"
            )
        check_float_dtype(owner, self.dtype)
        if self.pipeline_boundaries not in PIPELINE_BOUNDARIES:
            raise ValueError(f"{owner}.pipeline_boundaries must be one of {PIPELINE_BOUNDARIES}, "
                             f"got {self.pipeline_boundaries!r}")

    @property
    def head_dim(self) -> int:
        """hidden_size // num_heads."""
        return self.hidden_size // self.num_heads


def _gpt(hidden: int, layers: int, heads: int) -> GPTConfig:
    """A row of Alpa Table 3.6: sequence 1024, vocabulary 51,200."""
    return GPTConfig(vocab_size=51200, seq_len=1024, hidden_size=hidden, num_layers=layers, num_heads=heads)


def _opt(hidden: int, layers: int, heads: int) -> GPTConfig:
    """A published OPT size (Zhang et al. 2022, Table 1): sequence 2048, vocabulary 50,272."""
    return GPTConfig(vocab_size=50272, seq_len=2048, hidden_size=hidden, num_layers=layers, num_heads=heads)


GPT_CONFIGS: dict[str, GPTConfig] = {
    # Alpa Table 3.6 (name = parameter count of the paper).
    "gpt-350m": _gpt(1024, 24, 16),
    "gpt-1.3b": _gpt(2048, 24, 32),
    "gpt-2.6b": _gpt(2560, 32, 32),
    "gpt-6.7b": _gpt(4096, 32, 32),
    "gpt-15b": _gpt(5120, 48, 32),
    "gpt-39b": _gpt(8192, 48, 64),
    # Test and demo sizes.
    "gpt-tiny": GPTConfig(vocab_size=64, seq_len=16, hidden_size=32, num_layers=2, num_heads=4),
    "gpt-small": GPTConfig(vocab_size=1024, seq_len=128, hidden_size=128, num_layers=4, num_heads=4),
}
"""Alpa Table 3.6 GPT models plus ``gpt-tiny`` (tests) and ``gpt-small`` (~0.9M params, demos)."""

OPT_CONFIGS: dict[str, GPTConfig] = {
    # OPT's position table has 2 extra offset rows and opt-350m projects 1024 <-> 512 around the
    # embedding; both are ignored here (well under 1% of the parameters).
    "opt-125m": _opt(768, 12, 12),
    "opt-350m": _opt(1024, 24, 16),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-2.7b": _opt(2560, 32, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
    "opt-175b": _opt(12288, 96, 96),
}
"""The published OPT sizes (layers/heads/hidden), as pre-LN GPT decoders with learned positions."""

GPT_TABLE_3_6_GPUS: dict[str, int] = {
    "gpt-350m": 1,
    "gpt-1.3b": 4,
    "gpt-2.6b": 8,
    "gpt-6.7b": 16,
    "gpt-15b": 32,
    "gpt-39b": 64,
}
"""GPUs used for each GPT model in Alpa Table 3.6 (weak scaling, batch 1024)."""


def megatron_num_params(config: GPTConfig) -> float:
    """Megatron-LM Eq. 2: ``12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))`` (excludes the final LayerNorm)."""
    l, h = config.num_layers, config.hidden_size
    v, s = config.vocab_size, config.seq_len
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


def _dense(features: int, dtype: Any, name: str) -> nn.Dense:
    """A biased Dense layer with GPT-2's normal(0.02) kernel initialiser."""
    return nn.Dense(features, dtype=dtype, kernel_init=nn.initializers.normal(_INIT_STD), name=name)


class SelfAttention(nn.Module):
    """Multi-head causal self-attention: fused QKV projection, :func:`causal_self_attention`, output.

    The fused projection's features are head-major, ``(heads, 3, head_dim)`` (Megatron-LM's layout): a split
    of them into contiguous blocks (tensor parallelism) gives each device whole heads with their q, k and v,
    so the split passes through the reshape to the heads dim instead of needing the features whole."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        batch, seq, _ = x.shape
        qkv = _dense(3 * cfg.hidden_size, cfg.dtype, "qkv")(x)
        qkv = qkv.reshape(batch, seq, cfg.num_heads, 3, cfg.head_dim)
        out = causal_self_attention(qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2])
        return _dense(cfg.hidden_size, cfg.dtype, "out")(out.reshape(batch, seq, cfg.hidden_size))


class MLP(nn.Module):
    """Position-wise ``Dense(mlp_ratio * h) -> GELU -> Dense(h)``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        y = nn.gelu(_dense(cfg.mlp_ratio * cfg.hidden_size, cfg.dtype, "fc_in")(x))
        return _dense(cfg.hidden_size, cfg.dtype, "fc_out")(y)


class GPTBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    ``mlp`` is a factory called as ``mlp(name="mlp")`` that builds the position-wise sublayer; ``None``
    means the dense :class:`MLP`. The MoE model passes an expert layer here, so the block itself never
    knows which model family it belongs to.
    """

    config: GPTConfig
    mlp: Callable[..., nn.Module] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = x + SelfAttention(cfg, name="attn")(nn.LayerNorm(dtype=cfg.dtype, name="ln_1")(x))
        if cfg.pipeline_boundaries == "sublayer":
            mark_pipeline_boundary()
        make_mlp = self.mlp if self.mlp is not None else functools.partial(MLP, cfg)
        x = x + make_mlp(name="mlp")(nn.LayerNorm(dtype=cfg.dtype, name="ln_2")(x))
        if cfg.pipeline_boundaries != "none":
            mark_pipeline_boundary()
        return x


def default_position_ids(input_shape: tuple[int, int]) -> jax.Array:
    """``arange(seq)`` broadcast to ``[batch, seq]`` (int32)."""
    return jnp.broadcast_to(jnp.arange(input_shape[1], dtype=jnp.int32), input_shape)


def _check_inputs(config: GPTConfig, input_ids: jax.Array, position_ids: jax.Array | None) -> jax.Array:
    """Validate ids and return position ids broadcast to ``input_ids.shape``."""
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(
            f"input_ids must be an int array [batch, seq], got shape {tuple(input_ids.shape)} "
            f"dtype {input_ids.dtype}"
        )
    if input_ids.shape[1] > config.seq_len:
        raise ValueError(
            f"input_ids sequence length must be <= config.seq_len={config.seq_len}, got {input_ids.shape[1]}"
        )
    if position_ids is None:
        return default_position_ids(input_ids.shape)
    try:
        return jnp.broadcast_to(position_ids, input_ids.shape)
    except ValueError:
        raise ValueError(
            f"position_ids must broadcast to input_ids shape {tuple(input_ids.shape)}, "
            f"got {tuple(position_ids.shape)}"
        ) from None


class GPTModel(nn.Module):
    """Decoder-only transformer; params are ``{'wte', 'wpe', 'block_0', ..., 'ln_f'}``.

    ``__call__(input_ids, position_ids=None)`` maps int ``[batch, seq]`` ids to float ``[batch, seq,
    vocab]`` logits (``config.dtype``). ``position_ids`` (broadcastable to ``[batch, seq]``) default to
    ``arange(seq)``; pass offsets to run a later slice of a sequence (TeraPipe). Values must lie in
    ``[0, seq_len)``; out-of-range ids are not checked (they are traced values) and give NaN embeddings.
    The output layer is tied: ``logits = h @ wte.T``, there is no separate LM-head parameter.
    """

    config: GPTConfig

    @nn.nowrap
    def block_mlp(self, layer: int) -> Callable[..., nn.Module] | None:
        """MLP factory of block ``layer`` (``None``: dense). Subclasses override this one hook."""
        del layer  # Unused: every GPT block is dense.
        return None

    @nn.compact
    def __call__(self, input_ids: jax.Array, position_ids: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        position_ids = _check_inputs(cfg, input_ids, position_ids)
        init = nn.initializers.normal(_INIT_STD)
        wte = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, embedding_init=init, name="wte")
        wpe = nn.Embed(cfg.seq_len, cfg.hidden_size, dtype=cfg.dtype, embedding_init=init, name="wpe")
        x = wte(input_ids) + wpe(position_ids)
        for i in range(cfg.num_layers):
            x = GPTBlock(cfg, mlp=self.block_mlp(i), name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
        return wte.attend(x)


def gpt_loss(model: nn.Module) -> LossFn:
    """Return ``loss_fn(params, batch) -> scalar``: mean next-token cross entropy over all tokens.

    ``batch = {"input_ids": int32 [B, S], "labels": int32 [B, S]}`` where ``labels`` are the inputs
    shifted left by one (see :func:`gpt_batch`), plus optionally ``"position_ids"`` (int32 [B, S]; default
    ``arange(S)``). Averaging the loss of equal micro-batches gives the full-batch loss. With
    ``position_ids`` in the batch the loss follows the TeraPipe contract (positions come from the inputs,
    attention is :func:`alpa_like.nn.causal_self_attention`, the loss is a mean over every token).
    """

    def loss_fn(params: Any, batch: Batch) -> jax.Array:
        logits = model.apply({"params": params}, batch["input_ids"], batch.get("position_ids"))
        return mean_cross_entropy(logits, batch["labels"])

    return loss_fn


def gpt_batch(config: GPTConfig, batch_size: int, rng: jax.Array, *, position_ids: bool = False) -> Batch:
    """Uniformly random tokens ``{"input_ids", "labels"}`` (int32 [batch_size, seq_len]).

    ``labels[:, t] == input_ids[:, t + 1]``: both are windows of one random ``seq_len + 1`` sequence.
    With ``position_ids``, the batch also carries ``"position_ids"`` (``arange(seq_len)`` per row), which
    token slicing (``pipeline_schedule="terapipe"``) needs.
    """
    check_positive_int("gpt_batch", batch_size=batch_size)
    tokens = jax.random.randint(rng, (batch_size, config.seq_len + 1), 0, config.vocab_size, jnp.int32)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if position_ids:
        batch["position_ids"] = default_position_ids((batch_size, config.seq_len))
    return batch


def gpt_batch_shapes(config: GPTConfig, batch_size: int, *,
                     position_ids: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """``ShapeDtypeStruct`` version of :func:`gpt_batch`, for planning without data."""
    check_positive_int("gpt_batch_shapes", batch_size=batch_size)
    ids = jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32)
    return {"input_ids": ids, "labels": ids, **({"position_ids": ids} if position_ids else {})}


def gpt_param_shapes(config: GPTConfig) -> Any:
    """Parameter pytree of ``GPTModel(config)`` as ``ShapeDtypeStruct``s; nothing is allocated."""
    ids = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    return variable_shapes(GPTModel(config), ids)["params"]
