"""Hugging Face Flax models, as users write their train steps around them, against jax.jit on one device.

The models come from ``transformers`` (its Flax classes, shipped until its version 5) with tiny configurations;
nothing in them knows about alpa-like: no pipeline markers, so the pipelines cut them with AutoLayerOption.
Parameters are compared after SGD steps (see tests/helpers.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from tests.helpers import assert_trees_close, micro_batch_loop, reference_on_one_device, run_steps

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 128, 16, 16


def _ids(seed: int):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)


def _next_token_loss(logits, ids):
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, ids[:, 1:, None], -1))


def _state(model):
    return train_state.TrainState.create(apply_fn=None, params=model.params, tx=optax.sgd(0.1))


def _check(loss_fn, model, method, batches):
    def step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    state = _state(model)
    got, _ = run_steps(al.parallelize(step, method=method), state, batches)
    want, _ = reference_on_one_device(step, state, batches)
    assert_trees_close(got.params, want.params, rtol=1e-5, atol=1e-6)


def test_opt_causal_lm_under_shard_parallel():
    config = transformers.OPTConfig(vocab_size=VOCAB, max_position_embeddings=2 * SEQ, hidden_size=32,
                                    num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32)
    model = transformers.FlaxOPTForCausalLM(config, seed=0, input_shape=(1, SEQ))

    def loss_fn(params, batch):
        return _next_token_loss(model(batch["ids"], params=params).logits, batch["ids"])

    _check(loss_fn, model, al.ShardParallel(), [{"ids": _ids(i)} for i in range(2)])


def test_bert_masked_lm_under_zero3():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=2 * SEQ)
    model = transformers.FlaxBertForMaskedLM(config, seed=0, input_shape=(1, SEQ))

    def loss_fn(params, batch):
        logits = model(batch["ids"], params=params, train=False).logits
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["ids"][:, :, None], -1))

    _check(loss_fn, model, al.Zero3Parallel(), [{"ids": _ids(i)} for i in range(2)])


def test_vit_classifier_on_a_two_stage_pipeline():
    config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=10)
    model = transformers.FlaxViTForImageClassification(config, seed=0, input_shape=(1, 16, 16, 3))
    rng = np.random.default_rng(0)
    batches = [{"pixels": jnp.asarray(rng.normal(size=(BATCH, 3, 16, 16)), jnp.float32),  # channels first
                "labels": jnp.asarray(rng.integers(0, 10, BATCH), jnp.int32)} for _ in range(2)]

    def loss_fn(params, batch):
        logits = model(batch["pixels"], params=params, train=False).logits
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][:, None], -1))

    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2))
    # micro-batches change nothing for this loss (a mean over independent rows): the reference is the full batch
    _check(loss_fn, model, method, batches)


def test_gpt2_with_dropout_on_a_1f1b_pipeline_matches_its_micro_batch_loop():
    """GPT-2 in training mode: dropout draws from the step's key, which each micro-batch folds as the
    micro-batch loop of tests/helpers.py does (docs/micro-batches.md)."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4)
    model = transformers.FlaxGPT2LMHeadModel(config, seed=0, input_shape=(1, SEQ))

    def loss_fn(params, batch, key):
        logits = model(batch["ids"], params=params, train=True, dropout_rng=key).logits
        return _next_token_loss(logits, batch["ids"])

    def step(state, batch, key):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch, key)
        return state.apply_gradients(grads=grads), loss

    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2), pipeline_schedule="1f1b")
    parallel, reference = al.parallelize(step, method=method), jax.jit(micro_batch_loop(loss_fn, 2))
    got = want = _state(model)
    for i in range(2):
        batch, key = {"ids": _ids(i)}, jax.random.PRNGKey(i)
        got, _ = parallel(got, batch, key)
        want, _ = reference(want, batch, key)
    assert_trees_close(got.params, want.params, rtol=1e-5, atol=1e-6)
