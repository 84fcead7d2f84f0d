"""Standalone neural-network functions shared by the bundled models.

Only functions that a compiler pass must be able to recognise live here. Today that is
:func:`causal_self_attention`: TeraPipe token slicing (TeraPipe, dissertation ch. 2) cuts the sequence
dimension of a transformer, which is only legal for an operator whose cross-token dependence is known to be
causal. Every bundled attention layer therefore goes through this one function, whose body is wrapped in
``jax.named_scope("causal_self_attention")`` so that its equations can be found in a traced Jaxpr.

While the TeraPipe runtime traces one token slice of a step (:func:`token_slice_context`), each call also
attends to the keys and values that the same call produced on the earlier slices of the sequence (passed in
as inputs of the traced slice), and reports its own keys and values (outputs of the traced slice).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from alpa_like.compiler.tracing_hooks import (ATTENTION_SCOPE, TokenSliceContext, active_token_slice,
                                              token_slice_context)

__all__ = ["ATTENTION_SCOPE", "causal_self_attention", "TokenSliceContext", "token_slice_context"]



def _with_prefix(k: jax.Array, v: jax.Array, mask):
    """k, v extended by the cached prefix of the active token slice (if any), and the key mask (None, or
    the real keys when the prefix is padded: ``[1, 1, 1, P + S_k]``)."""
    context = active_token_slice()
    if context is None:
        return k, v, mask
    k, v = _concat_prefix(context, k, v, mask)
    if context.prefix_valid is None or context.prefixes is None:
        return k, v, None
    padded = k.shape[1] - context.produced[-1][0].shape[1]  # P: prefix tokens before this slice's keys
    real = jnp.arange(k.shape[1]) >= padded - context.prefix_valid
    return k, v, real[None, None, None, :]


def _concat_prefix(context: TokenSliceContext, k: jax.Array, v: jax.Array, mask) -> tuple[jax.Array, jax.Array]:
    if mask is not None:
        raise ValueError("causal_self_attention(mask=...) is not supported with pipeline_schedule='terapipe': "
                         "a mask spans the whole sequence, token slices see only part of it")
    call = len(context.produced)
    context.produced.append((k, v))
    if context.prefixes is None:
        return k, v
    if call >= len(context.prefixes):
        raise ValueError(f"token slice traced {call + 1} attention calls, but its cache has {len(context.prefixes)}")
    pairs = list(context.prefixes[call])
    if not pairs:
        return k, v
    return (jnp.concatenate([pk for pk, _ in pairs] + [k], axis=1),
            jnp.concatenate([pv for _, pv in pairs] + [v], axis=1))


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Raise ValueError unless q, k, v are [batch, seq, heads, head_dim] with compatible sizes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dims [batch, seq, heads, head_dim], got shape {tuple(x.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    b, q_len, h, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
        raise ValueError(
            f"k must have batch, heads, head_dim = {(b, h, d)} like q, got k shape {tuple(k.shape)}"
        )
    if k.shape[1] < q_len:
        raise ValueError(
            f"k/v sequence length must be >= q sequence length {q_len} (queries are the last "
            f"q_len positions of the key sequence), got {k.shape[1]}"
        )


def causal_self_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None
) -> jax.Array:
    r"""Scaled dot-product attention with a causal mask, softmax in float32.

    .. math::

        \mathrm{out}_{b,i,h} = \sum_{j \le i + (S_k - S_q)}
            \mathrm{softmax}_j\!\left(\frac{q_{b,i,h} \cdot k_{b,j,h}}{\sqrt{d}}\right) v_{b,j,h}

    Query ``i`` sits at absolute position ``S_k - S_q + i`` of the key sequence, so with ``S_q == S_k``
    this is ordinary causal self-attention, and with ``S_q < S_k`` the queries are the last slice of the
    sequence attending to the cached prefix plus themselves (what a TeraPipe token slice needs).

    Args:
      q: queries, ``[batch, S_q, heads, head_dim]``.
      k: keys, ``[batch, S_k, heads, head_dim]`` with ``S_k >= S_q``.
      v: values, same shape as ``k``.
      mask: optional boolean array broadcastable to ``[batch, heads, S_q, S_k]``; ``True`` means "may
        attend". It is ANDed with the causal mask. A query row whose every key is masked out yields the
        uniform average of the values of that row (no NaNs).

    Returns:
      ``[batch, S_q, heads, head_dim]`` in the dtype of ``q``. The two products run in the inputs' dtype;
      the scaling, mask and softmax in float32 whatever the input dtype.

    Raises:
      ValueError: if the shapes are not as described.

    Examples:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> causal_self_attention(x, x, x).shape
      (1, 3, 2, 4)
    """
    _check_qkv(q, k, v)
    with jax.named_scope(ATTENTION_SCOPE):
        k, v, mask = _with_prefix(k, v, mask)
        q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
        # The product in the inputs' dtype, so that it and its gradients run on 16-bit matrix units for 16-bit
        # inputs (as Megatron-LM's FP16 attention does); the scores in float32 from here on.
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
        allowed = q_pos >= jnp.arange(kv_len)[None, :]
        if mask is not None:
            allowed = jnp.logical_and(allowed, mask)
        scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return out.astype(q.dtype)
