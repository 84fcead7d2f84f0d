"""causal_self_attention against a naive per-query loop, plus its shape checks and named scope."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_like.nn import ATTENTION_SCOPE, causal_self_attention


def naive_attention(q, k, v, mask=None):
    """Loop over batch, head and query; query i sees keys 0 .. i + (S_k - S_q)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, heads, dim = q.shape
    kv_len = k.shape[1]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                visible = [
                    j
                    for j in range(kv_len)
                    if j <= i + kv_len - q_len and (mask is None or mask[b, h, i, j])
                ]
                scores = np.array([q[b, i, h] @ k[b, j, h] / math.sqrt(dim) for j in visible])
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                out[b, i, h] = sum(p * v[b, j, h] for p, j in zip(probs, visible, strict=True))
    return out


def _qkv(seed, batch, q_len, kv_len, heads, dim):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, q_len, heads, dim))
    k = jax.random.normal(keys[1], (batch, kv_len, heads, dim))
    v = jax.random.normal(keys[2], (batch, kv_len, heads, dim))
    return q, k, v


# (batch, q_len, kv_len, heads, head_dim); q_len < kv_len is a token slice attending to its prefix.
CASES = [(1, 1, 1, 1, 1), (2, 5, 5, 3, 4), (1, 7, 7, 2, 8), (2, 3, 8, 2, 4)]


@pytest.mark.parametrize("shape", CASES)
def test_matches_naive_loop(shape):
    q, k, v = _qkv(0, *shape)
    np.testing.assert_allclose(jax.jit(causal_self_attention)(q, k, v), naive_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_extra_mask_is_anded_with_causal_mask():
    q, k, v = _qkv(1, 2, 6, 6, 2, 4)
    mask = np.random.default_rng(0).random((2, 2, 6, 6)) < 0.6
    mask[..., 0] = True  # every query keeps at least one visible key
    got = causal_self_attention(q, k, v, mask=jnp.asarray(mask))
    np.testing.assert_allclose(got, naive_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_causal_future_keys_do_not_matter():
    q, k, v = _qkv(2, 1, 6, 6, 2, 4)
    out = causal_self_attention(q, k, v)
    k2, v2 = k.at[:, 4:].set(7.0), v.at[:, 4:].set(-3.0)
    out2 = causal_self_attention(q, k2, v2)
    np.testing.assert_array_equal(out[:, :4], out2[:, :4])
    assert not np.allclose(out[:, 4:], out2[:, 4:])


def test_jit_and_bfloat16_keep_dtype():
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(3, 2, 4, 4, 2, 8))
    out = jax.jit(causal_self_attention)(q, k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    ref = naive_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2)  # bf16 has 8 mantissa bits


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    yield from _equations(getattr(sub, "jaxpr", sub))


def test_float16_products_and_their_gradients_stay_float16():
    """The cost model runs a product with a float32 operand at a GPU's FP32 rate: in FP16 attention neither
    the two products nor the four of their gradients may take a float32 operand (as in Megatron-LM)."""
    q, k, v = (x.astype(jnp.float16) for x in _qkv(5, 2, 4, 4, 2, 8))
    loss = lambda q, k, v: causal_self_attention(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    dots = [e for e in _equations(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 6
    assert {str(x.aval.dtype) for e in dots for x in e.invars} == {"float16"}


def test_named_scope_marks_the_equations():
    q, k, v = _qkv(4, 1, 3, 3, 1, 2)
    jaxpr = jax.make_jaxpr(causal_self_attention)(q, k, v).jaxpr
    scoped = [e for e in jaxpr.eqns if ATTENTION_SCOPE in str(e.source_info.name_stack)]
    assert {e.primitive.name for e in scoped} >= {"dot_general", "exp"}


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((1, 2, 2), (1, 2, 2), (1, 2, 2)), r"q must have 4 dims"),
        (((1, 2, 2, 4), (1, 2, 2, 4), (1, 3, 2, 4)), r"k and v must have the same shape"),
        (((1, 2, 2, 4), (1, 2, 3, 4), (1, 2, 3, 4)), r"k must have batch, heads, head_dim = \(1, 2, 4\)"),
        (((1, 4, 2, 4), (1, 2, 2, 4), (1, 2, 2, 4)), r"must be >= q sequence length 4"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    q, k, v = (jnp.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        causal_self_attention(q, k, v)


def test_token_slice_context_attends_to_the_cached_prefix():
    """Slice 1 of a sequence with slice 0's keys/values as prefix equals the last rows of full attention."""
    from alpa_like.nn import TokenSliceContext, token_slice_context
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 7, 2, 4)), jnp.float32) for _ in range(3))
    full = causal_self_attention(q, k, v)
    context = TokenSliceContext(prefixes=[[(k[:, :3], v[:, :3])]])
    with token_slice_context(context):
        tail = causal_self_attention(q[:, 3:], k[:, 3:], v[:, 3:])
    np.testing.assert_allclose(tail, full[:, 3:], rtol=1e-5, atol=1e-6)
    assert len(context.produced) == 1 and context.produced[0][0].shape == (2, 4, 2, 4)
    with token_slice_context(TokenSliceContext()), pytest.raises(ValueError, match="mask"):
        causal_self_attention(q, k, v, mask=jnp.ones((7, 7), bool))
