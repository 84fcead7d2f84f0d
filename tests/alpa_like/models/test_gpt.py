"""GPT/OPT decoder: shapes, causality, positions, tied embeddings, training, config tables vs papers."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_like.models import (
    ALL_CONFIG_TABLES,
    GPT_CONFIGS,
    GPT_TABLE_3_6_GPUS,
    OPT_CONFIGS,
    GPTConfig,
    GPTModel,
    get_config,
    gpt_batch,
    gpt_batch_shapes,
    gpt_loss,
    gpt_param_shapes,
    megatron_num_params,
    num_params,
)

from tests.alpa_like.models.model_helpers import adam_losses, key, name_to_count

TINY = GPT_CONFIGS["gpt-tiny"]


@pytest.fixture(scope="module")
def tiny():
    """(jitted apply(params, ids, position_ids=None), model, params, batch); jit keeps tests fast."""
    model = GPTModel(TINY)
    batch = gpt_batch(TINY, batch_size=2, rng=key(0))
    params = jax.jit(model.init)(key(1), batch["input_ids"])["params"]
    apply = jax.jit(lambda params, ids, pos=None: model.apply({"params": params}, ids, pos))
    return apply, model, params, batch


def test_output_shape_and_dtype(tiny):
    apply, model, params, batch = tiny
    logits = apply(params, batch["input_ids"])
    assert logits.shape == (2, TINY.seq_len, TINY.vocab_size) and logits.dtype == jnp.float32
    bf16 = GPTModel(dataclasses.replace(TINY, dtype=jnp.bfloat16))
    assert jax.eval_shape(bf16.apply, {"params": params}, batch["input_ids"]).dtype == jnp.bfloat16


def test_param_layout_has_tied_embedding(tiny):
    _, _, params, _ = tiny
    assert set(params) == {"wte", "wpe", "block_0", "block_1", "ln_f"}
    assert params["wte"]["embedding"].shape == (TINY.vocab_size, TINY.hidden_size)
    vocab_sized = [p for p, x in jax.tree_util.tree_leaves_with_path(params) if TINY.vocab_size in x.shape]
    assert len(vocab_sized) == 1, "only wte may have a vocab-sized dim (no separate lm_head)"
    assert jax.tree.structure(params) == jax.tree.structure(gpt_param_shapes(TINY))


def test_logits_are_final_hidden_times_wte_transpose(tiny):
    apply, model, params, batch = tiny
    capture = jax.jit(
        lambda p, ids: model.apply({"params": p}, ids, capture_intermediates=lambda mdl, _: mdl.name == "ln_f")
    )
    logits, state = capture(params, batch["input_ids"])
    hidden = state["intermediates"]["ln_f"]["__call__"][0]
    np.testing.assert_allclose(logits, hidden @ params["wte"]["embedding"].T, rtol=1e-5, atol=1e-5)


def test_causal_changing_token_t_leaves_earlier_logits(tiny):
    apply, model, params, batch = tiny
    ids = batch["input_ids"]
    t = 9
    changed = ids.at[:, t].set((ids[:, t] + 1) % TINY.vocab_size)
    before = apply(params, ids)
    after = apply(params, changed)
    np.testing.assert_allclose(before[:, :t], after[:, :t], rtol=1e-6, atol=1e-6)
    assert not np.allclose(before[:, t], after[:, t])


def test_position_ids_default_and_offset(tiny):
    apply, model, params, batch = tiny
    ids = batch["input_ids"][:, :8]
    default = apply(params, ids)
    explicit = apply(params, ids, jnp.arange(8)[None, :])
    np.testing.assert_array_equal(default, explicit)
    shifted = apply(params, ids, jnp.arange(8)[None, :] + 8)
    assert not np.allclose(default, shifted)


def test_loss_is_mean_over_tokens_and_micro_batches(tiny):
    apply, model, params, batch = tiny
    loss_fn = jax.jit(gpt_loss(model))
    full = loss_fn(params, batch)
    halves = [loss_fn(params, jax.tree.map(lambda x, i=i: x[i : i + 1], batch)) for i in range(2)]
    np.testing.assert_allclose(full, np.mean(halves), rtol=1e-6)
    assert abs(float(full) - np.log(TINY.vocab_size)) < 0.5  # near-uniform predictions at init


def test_loss_decreases_with_adam_under_jit(tiny):
    apply, model, params, batch = tiny
    losses = adam_losses(gpt_loss(model), params, batch)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses


def test_batch_labels_are_inputs_shifted_by_one():
    batch = gpt_batch(TINY, batch_size=3, rng=key(5))
    np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    shapes = gpt_batch_shapes(TINY, 3)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), batch) == jax.tree.map(lambda x: (x.shape, x.dtype), shapes)


TABLE_NAMES = [n for n in {**GPT_CONFIGS, **OPT_CONFIGS} if n not in ("gpt-tiny", "gpt-small")]


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_param_count_matches_name_and_megatron_eq2(name):
    config = get_config(name)
    count = num_params(gpt_param_shapes(config))
    assert abs(count / name_to_count(name) - 1) < 0.10, count
    assert abs(count / megatron_num_params(config) - 1) < 0.01, count  # Eq. 2 omits only ln_f (2h)


def test_table_3_6_rows_and_gpus():
    assert GPT_TABLE_3_6_GPUS == {
        "gpt-350m": 1, "gpt-1.3b": 4, "gpt-2.6b": 8, "gpt-6.7b": 16, "gpt-15b": 32, "gpt-39b": 64,
    }  # fmt: skip
    rows = {n: (c.hidden_size, c.num_layers, c.num_heads) for n, c in GPT_CONFIGS.items() if n in GPT_TABLE_3_6_GPUS}
    assert rows["gpt-39b"] == (8192, 48, 64) and rows["gpt-350m"] == (1024, 24, 16)
    assert {(c.seq_len, c.vocab_size) for n, c in GPT_CONFIGS.items() if n in rows} == {(1024, 51200)}
    assert {(c.seq_len, c.vocab_size) for c in OPT_CONFIGS.values()} == {(2048, 50272)}


def test_config_fields_are_frozen_public_surface():
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    assert fields == {"vocab_size", "seq_len", "hidden_size", "num_layers", "num_heads", "mlp_ratio", "dtype",
                      "pipeline_boundaries"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.hidden_size = 3  # type: ignore[misc]


def test_config_names_are_unique_across_tables():
    names = [n for table in ALL_CONFIG_TABLES.values() for n in table]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(("boundaries", "layers"), [("block", TINY.num_layers + 1),
                                                     ("sublayer", 2 * TINY.num_layers + 1)])
def test_pipeline_boundaries_make_manual_layers_and_change_nothing_else(tiny, boundaries, layers):
    """``pipeline_boundaries`` marks layers for ``ManualLayerOption`` (after each block, and with
    ``"sublayer"`` between attention and MLP too; the logits are the last layer); the logits are the same."""
    import alpa_like as al
    from alpa_like.compiler.sliced_step import slice_step

    apply, _, params, batch = tiny
    config = dataclasses.replace(TINY, pipeline_boundaries=boundaries)
    marked = jax.jit(lambda params, ids: GPTModel(config).apply({"params": params}, ids))(params, batch["input_ids"])
    np.testing.assert_array_equal(np.asarray(marked), np.asarray(apply(params, batch["input_ids"])))
    loss = gpt_loss(GPTModel(config))

    def step(params, batch):
        return al.grad(loss)(params, batch)

    method = al.PipeshardParallel(num_micro_batches=1, layer_option=al.ManualLayerOption())
    sliced = slice_step(method, step, (params, batch), static_argnums=(), batch_argnums=(1,))
    assert len(sliced.summaries) == layers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 30}, r"hidden_size must be divisible by num_heads=4, got hidden_size=30"),
        ({"num_layers": 0}, r"GPTConfig.num_layers must be a positive int, got 0"),
        ({"dtype": jnp.int32}, r"GPTConfig.dtype must be a floating dtype"),
        ({"pipeline_boundaries": "layer"}, r"GPTConfig.pipeline_boundaries must be one of \('none', 'block', "
                                           r"'sublayer'\), got 'layer'"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **kwargs)


def test_unknown_config_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown config name 'gpt-7b'.*'gpt-350m'.*'opt-175b'.*'moe-tiny'"):
        get_config("gpt-7b")


def test_bad_inputs_raise(tiny):
    apply, model, params, batch = tiny
    with pytest.raises(ValueError, match=r"sequence length must be <= config.seq_len=16, got 17"):
        model.apply({"params": params}, jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match=r"input_ids must be an int array \[batch, seq\]"):
        model.apply({"params": params}, jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"position_ids must broadcast to input_ids shape \(2, 16\)"):
        model.apply({"params": params}, batch["input_ids"], jnp.arange(5))
