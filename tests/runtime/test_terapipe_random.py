"""Random draws in the loss under TeraPipe: each unit (a micro-batch's token slice) folds its index into the
step's keys, as the other schedules fold each micro-batch's, so no two units share a mask."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.compiler.micro_batch_keys import fold_key
from tests.helpers import assert_trees_close
from tests.runtime.test_pipeshard_runtime import stages

B, S, D = 4, 8, 8
ONE_STAGE = dict(layer_option=al.AutoLayerOption(layer_num=1), stage_option=stages(((0,),), ((1, 8),), ((1, 8),)))


def attention_loss(params, batch, mask):
    """One causal attention layer, ``mask`` (or all kept) dropping its outputs at rate 0.5."""
    h = jnp.tanh(batch["x"] @ params["w0"])
    q, k, v = ((h @ params[n]).reshape(*h.shape[:2], 1, D) for n in ("wq", "wk", "wv"))
    a = al.nn.causal_self_attention(q, k, v).reshape(h.shape)
    out = jnp.tanh(jnp.where(mask, a / 0.5, 0.0) @ params["w1"])
    return jnp.mean((out - batch["y"]) ** 2)


def dropout_step(state, batch, key):
    loss, grads = al.value_and_grad(lambda p, b, k: attention_loss(p, b, jax.random.bernoulli(
        k, 0.5, b["x"].shape)))(state.params, batch, key)
    return state.apply_gradients(grads=grads), loss


def masked_step(state, batch, mask):
    loss, grads = jax.value_and_grad(attention_loss)(state.params, batch, mask)
    return state.apply_gradients(grads=grads), loss


def case():
    keys = jax.random.split(jax.random.key(0), 7)
    params = {n: jax.random.normal(k, (D, D)) / np.sqrt(D) for n, k in zip(("w0", "wq", "wk", "wv", "w1"), keys)}
    batch = {"x": jax.random.normal(keys[5], (B, S, D)), "y": jax.random.normal(keys[6], (B, S, D))}
    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)), batch


def unit_masks(units, key) -> np.ndarray:
    """The step's mask as TeraPipe draws it: unit ``u``'s rows and tokens from ``key`` with ``u`` folded in."""
    mask = np.zeros((B, S, D), bool)
    for u, unit in enumerate(units):
        rows, _, length = unit.key
        mask[unit.row_start:unit.row_start + rows, unit.token_start:unit.token_start + length] = \
            jax.random.bernoulli(fold_key(key, jnp.uint32(u)), 0.5, (rows, length, D))
    return mask


def test_each_token_slice_of_each_micro_batch_draws_its_own_mask():
    """Two micro-batches cut into slices (5, 3): four units, unit ``u`` (``exe.units`` order) drawing from
    ``fold_in(key, u)`` (unit 0 from the key itself); the step equals jax.jit's with those masks, and a
    warning says how the draws are folded. The first step's contract check (whole sequences against their
    slices) holds with the draws in the loss."""
    state, batch = case()
    key = jax.random.key(3)
    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="terapipe", token_slices=(5, 3),
                                  **ONE_STAGE)
    parallel = al.parallelize(dropout_step, method=method)
    with pytest.warns(UserWarning, match="folds each unit's index") as record:
        exe = parallel.get_executable(state, batch, key)
    assert not any("repeat" in str(w.message) for w in record)
    assert [(u.batch_slice, u.token_start) for u in exe.units] == [(0, 0), (0, 5), (1, 0), (1, 5)]
    mask = unit_masks(exe.units, key)
    tiles = [mask[u.row_start:u.row_start + 2, u.token_start:u.token_start + 3] for u in exe.units]
    assert all(not np.array_equal(a, b) for n, a in enumerate(tiles) for b in tiles[n + 1:])
    expected = jax.jit(masked_step)(state, batch, mask)
    got = parallel(state, batch, key)
    assert_trees_close(got[1], expected[1], rtol=1e-5, atol=1e-6)
    assert_trees_close(got[0].params, expected[0].params, rtol=1e-5, atol=1e-6)
