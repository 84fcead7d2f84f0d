"""GShard MoE: top-2 routing against a loop reference, capacity, aux loss, model, training, tables."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_like.models import (
    MOE_CONFIGS,
    MOE_TABLE_3_7_GPUS,
    MoEModel,
    expert_capacity,
    moe_batch,
    moe_batch_shapes,
    moe_loss,
    moe_param_shapes,
    num_params,
    top2_gating,
)
from alpa_like.models.moe import AUX_LOSS_COLLECTION, group_size
from tests.alpa_like.models.model_helpers import adam_losses, key, name_to_count

TINY = MOE_CONFIGS["moe-tiny"]


def reference_routing(logits: np.ndarray, capacity: int):
    """GShard Algorithm 1 by loops: per group, all top-1 choices in token order, then all top-2 choices."""
    groups, tokens, experts = logits.shape
    gates = np.exp(logits - logits.max(-1, keepdims=True))
    gates /= gates.sum(-1, keepdims=True)
    combine = np.zeros((groups, tokens, experts, capacity))
    for g in range(groups):
        order = np.argsort(-gates[g], axis=-1, kind="stable")
        used = np.zeros(experts, int)
        for choice in (0, 1):
            for s in range(tokens):
                e1, e2 = order[s, 0], order[s, 1]
                e = order[s, choice]
                if used[e] < capacity:
                    combine[g, s, e, used[e]] = gates[g, s, e] / (gates[g, s, e1] + gates[g, s, e2])
                    used[e] += 1
    return combine


def check_routing(logits: np.ndarray, capacity: int) -> None:
    """Capacity and top-2 invariants, then equality with the loop reference."""
    routing = jax.jit(top2_gating, static_argnums=1)(jnp.asarray(logits), capacity)
    dispatch = np.asarray(routing.dispatch)
    assert dispatch.sum(axis=1).max() <= 1, "a slot holds at most one token"
    assert dispatch.sum(axis=(1, 3)).max() <= capacity, "an expert receives at most `capacity` tokens"
    assert dispatch.sum(axis=(2, 3)).max() <= 2, "a token goes to at most 2 experts"
    assert dispatch.sum(axis=3).max() <= 1, "a token takes at most one slot of an expert"
    expected = reference_routing(logits.astype(np.float64), capacity)
    np.testing.assert_allclose(routing.combine, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dispatch, expected > 0)


# (groups, tokens, experts, capacity): no drops, drops of second choices, drops of first choices.
ROUTING_CASES = [(1, 1, 2, 1), (2, 8, 4, 4), (1, 12, 3, 2), (3, 7, 5, 1), (1, 10, 6, 20)]


@pytest.mark.parametrize(("groups", "tokens", "experts", "capacity"), ROUTING_CASES)
def test_top2_gating_matches_loop_reference(groups, tokens, experts, capacity):
    logits = np.random.default_rng(tokens).normal(size=(groups, tokens, experts)).astype(np.float32)
    check_routing(logits, capacity)


# One token's logits: distinct multiples of 0.1, so its float32 gates have no ties and the loop
# reference is unambiguous.
_TOKEN_LOGITS = st.lists(st.integers(-30, 30), min_size=4, max_size=4, unique=True)


@settings(max_examples=30, deadline=None)
@given(
    # One shape (2 groups, 12 tokens, 4 experts), so the jitted gating compiles once per capacity.
    logits=st.lists(_TOKEN_LOGITS, min_size=24, max_size=24).map(
        lambda rows: (np.array(rows, np.float32) / 10).reshape(2, 12, 4)
    ),
    capacity=st.sampled_from([1, 3, 6]),
)
def test_top2_gating_respects_capacity_for_any_logits(logits, capacity):
    check_routing(logits, capacity)


def test_aux_loss_is_one_when_balanced_and_large_when_collapsed():
    experts = 4
    balanced = top2_gating(20.0 * jnp.eye(experts)[None], capacity=2).aux_loss
    collapsed = top2_gating(jnp.tile(20.0 * jnp.eye(experts)[:1], (experts, 1))[None], capacity=2).aux_loss
    np.testing.assert_allclose(balanced, 1.0, rtol=1e-4)
    np.testing.assert_allclose(collapsed, experts, rtol=1e-4)


def test_expert_capacity_is_gshard_formula():
    assert expert_capacity(16, 4) == 8  # 2 * 16 / 4
    assert expert_capacity(10, 4) == 5
    assert expert_capacity(3, 4) == 2  # ceil(1.5)
    assert expert_capacity(16, 4, capacity_factor=2.0) == 16
    assert expert_capacity(2048, 64, 1.0) == math.ceil(2 * 2048 / 64)


def test_group_size_uses_all_tokens_of_a_small_batch_and_rejects_ragged():
    assert group_size(32, 16) == 16
    assert group_size(8, 16) == 8
    with pytest.raises(ValueError, match=r"40 tokens must be a multiple of expert_group_size=16"):
        group_size(40, 16)


@pytest.fixture(scope="module")
def tiny():
    """(model, params, batch, logits, aux-loss state) of moe-tiny, applied once under jit."""
    model = MoEModel(TINY)
    batch = moe_batch(TINY, batch_size=2, rng=key(0))
    params = jax.jit(model.init)(key(1), batch["input_ids"])["params"]
    apply = jax.jit(lambda p, ids: model.apply({"params": p}, ids, mutable=[AUX_LOSS_COLLECTION]))
    logits, state = apply(params, batch["input_ids"])
    return model, params, batch, logits, state


def test_model_shapes_params_and_aux_collection(tiny):
    _, params, _, logits, state = tiny
    assert logits.shape == (2, TINY.seq_len, TINY.vocab_size) and logits.dtype == jnp.float32
    assert set(params) == {"wte", "wpe", "block_0", "block_1", "ln_f"}
    assert set(params["block_0"]["mlp"]) == {"fc_in", "fc_out"}  # dense block
    moe = params["block_1"]["mlp"]  # moe_every=2: the second block has experts
    ffn = TINY.mlp_ratio * TINY.hidden_size
    assert jax.tree.map(jnp.shape, moe) == {
        "gate": (TINY.hidden_size, TINY.num_experts),
        "wi": (TINY.num_experts, TINY.hidden_size, ffn),
        "wo": (TINY.num_experts, ffn, TINY.hidden_size),
    }
    aux = jax.tree.leaves(state[AUX_LOSS_COLLECTION])
    assert len(aux) == 1 and np.isfinite(aux[0]) and float(aux[0]) >= 1.0 - 1e-5


def test_loss_is_cross_entropy_plus_aux_and_decreases_with_adam_under_jit(tiny):
    model, params, batch, logits, state = tiny
    losses = adam_losses(moe_loss(model), params, batch)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    aux = sum(jax.tree.leaves(state[AUX_LOSS_COLLECTION]))
    np.testing.assert_allclose(losses[0], cross_entropy + TINY.aux_loss_coef * aux, rtol=1e-5)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses


def test_batch_shapes_match_batch():
    batch = moe_batch(TINY, batch_size=3, rng=key(2))
    shapes = moe_batch_shapes(TINY, 3)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), batch) == jax.tree.map(lambda x: (x.shape, x.dtype), shapes)


@pytest.mark.parametrize("name", list(MOE_TABLE_3_7_GPUS))
def test_param_count_matches_table_3_7_name(name):
    # 10%: the rows land within 5% of their names with an 8h expert MLP (Alpa's benchmark setting).
    count = num_params(moe_param_shapes(MOE_CONFIGS[name]))
    assert abs(count / name_to_count(name) - 1) < 0.10, count


def test_table_3_7_rows():
    rows = {n: (c.hidden_size, c.num_layers, c.num_heads, c.num_experts) for n, c in MOE_CONFIGS.items()}
    assert rows["moe-380m"] == (768, 8, 16, 8) and rows["moe-70b"] == (2048, 32, 32, 64)
    assert {(MOE_CONFIGS[n].seq_len, MOE_CONFIGS[n].vocab_size) for n in MOE_TABLE_3_7_GPUS} == {(1024, 32000)}
    assert list(MOE_TABLE_3_7_GPUS.values()) == [1, 4, 8, 16, 32, 64]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_experts": 1}, r"MoEConfig.num_experts must be >= 2 for top-2 gating, got 1"),
        ({"capacity_factor": 0.0}, r"MoEConfig.capacity_factor must be > 0, got 0.0"),
        ({"moe_every": 0}, r"MoEConfig.moe_every must be a positive int, got 0"),
        ({"hidden_size": 30}, r"MoEConfig.hidden_size must be divisible by num_heads=4"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **kwargs)
