"""Flax's own train steps run unchanged with micro-batches: a per-example aux (the logits) comes back with the
full batch's rows in order, and the metrics computed after the gradient from it and the batch's labels equal
``jax.jit``'s.

Two steps written as Flax's examples write them: :func:`classifier_step` (lm1b / wmt: a padding mask made
from the batch before the gradient, the logits as aux, summed metrics after it) and :func:`batch_norm_step`
(imagenet: the BatchNorm statistics and the logits as aux, mean metrics after it).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.runtime.instructions import Op
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps

NUM_CLASSES = 10


class Classifier(nn.Module):
    """A two-layer MLP classifier; the boundary marks its two pipeline layers (ignored by the SPMD methods)."""

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(32)(x))
        al.mark_pipeline_boundary()
        return nn.Dense(NUM_CLASSES)(x)


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(32)(x)))
        al.mark_pipeline_boundary()
        return nn.Dense(NUM_CLASSES)(x)


class BatchNormState(train_state.TrainState):
    batch_stats: Any


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def compute_weighted_metrics(logits, labels, weights):
    """lm1b's ``compute_metrics``: sums over the examples, and their count."""
    correct = jnp.argmax(logits, -1) == labels
    return {"loss": jnp.sum(cross_entropy(logits, labels) * weights), "accuracy": jnp.sum(correct * weights),
            "denominator": jnp.sum(weights), "predictions": jnp.argmax(logits, -1)}


def classifier_step(state, batch):
    weights = jnp.where(batch["label"] > 0, 1.0, 0.0)  # before the gradient, from the batch alone

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        loss = jnp.mean(cross_entropy(logits, batch["label"]) * weights)
        return loss, logits
    (_, logits), grads = al.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_weighted_metrics(logits, batch["label"], weights)  # after the gradient: logits and labels
    return new_state, metrics


def compute_metrics(logits, labels):
    """imagenet's ``compute_metrics``: means over the examples."""
    return {"loss": jnp.mean(cross_entropy(logits, labels)),
            "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def batch_norm_step(state, batch):
    def loss_fn(params):
        logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                                 batch["x"], mutable=["batch_stats"])
        return jnp.mean(cross_entropy(logits, batch["label"])), (new_model_state, logits)
    (_, (new_model_state, logits)), grads = al.value_and_grad(loss_fn, has_aux=True)(state.params)
    metrics = compute_metrics(logits, batch["label"])
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


def batches(num=2, size=32):
    rng = np.random.default_rng(1)
    return [{"x": jnp.asarray(rng.normal(size=(size, 16)), jnp.float32),
             "label": jnp.asarray(rng.integers(0, NUM_CLASSES, size=size), jnp.int32)} for _ in range(num)]


def classifier_state():
    model = Classifier()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 16)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))


def batch_norm_state():
    model = BatchNormNet()
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 16)))
    return BatchNormState.create(apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1),
                                 batch_stats=variables["batch_stats"])


def batch_norm_loop(num_micro_batches):
    """:func:`batch_norm_step` with micro-batches written out: BatchNorm normalizes each micro-batch (rows j,
    j + m, ...) by its own statistics, so this loop, not the step on the full batch, is what the methods
    compute; the loss, gradients and statistics averaged, the logits put back in row order."""
    m = num_micro_batches

    def step(state, batch):
        def loss_fn(params, part):
            logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                                     part["x"], mutable=["batch_stats"])
            return jnp.mean(cross_entropy(logits, part["label"])), (new_model_state, logits)
        parts = [jax.value_and_grad(loss_fn, has_aux=True)(state.params, jax.tree.map(lambda x, j=j: x[j::m], batch))
                 for j in range(m)]
        grads = jax.tree.map(lambda *g: sum(g) / m, *[g for _, g in parts])
        stats = jax.tree.map(lambda *s: sum(s) / m, *[aux[0]["batch_stats"] for (_, aux), _ in parts])
        logits = jnp.stack([aux[1] for (_, aux), _ in parts], axis=1).reshape(-1, NUM_CLASSES)
        return state.apply_gradients(grads=grads, batch_stats=stats), compute_metrics(logits, batch["label"])
    return step


def reference(case, num_micro_batches):
    """The case's state, step, batches and its single-device jax.jit reference's states and outputs."""
    step, state = {"classifier": (classifier_step, classifier_state()),
                   "batch_norm": (batch_norm_step, batch_norm_state())}[case]
    data = batches()
    ref = batch_norm_loop(num_micro_batches) if case == "batch_norm" else step
    return step, state, data, reference_on_one_device(lambda s, b: ref(s, b), state, data)


def assert_matches(got, want):
    (got_state, got_out), (want_state, want_out) = got, want
    assert_trees_close(got_state.params, want_state.params, rtol=1e-5, atol=1e-6)
    if hasattr(want_state, "batch_stats"):
        assert_trees_close(got_state.batch_stats, want_state.batch_stats, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_out, want_out, rtol=1e-5, atol=1e-6)


SPMD_METHODS = {"data": al.DataParallel, "zero2": al.Zero2Parallel, "zero3": al.Zero3Parallel,
                "shard": al.ShardParallel}


@pytest.mark.parametrize("num_micro_batches", [2, 4])
@pytest.mark.parametrize("method", sorted(SPMD_METHODS))
@pytest.mark.parametrize("case", ["classifier", "batch_norm"])
def test_spmd_methods_run_flax_steps_unchanged(case, method, num_micro_batches):
    step, state, data, want = reference(case, num_micro_batches)
    f = al.parallelize(step, method=SPMD_METHODS[method](num_micro_batches=num_micro_batches))
    assert_matches(run_steps(f, state, data), want)


def two_stages(schedule, num_micro_batches=4):
    return al.PipeshardParallel(
        num_micro_batches=num_micro_batches, layer_option=al.ManualLayerOption(), pipeline_schedule=schedule,
        stage_option=al.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                          submesh_physical_shapes=((1, 4), (1, 4)),
                                          submesh_logical_shapes=((2, 2), (1, 4)), show_progress=False))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", ["classifier", "batch_norm"])
def test_pipeline_runs_flax_steps_unchanged(case, schedule):
    step, state, data, want = reference(case, 4)
    f = al.parallelize(step, method=two_stages(schedule))
    assert_matches(run_steps(f, state, data), want)
    exe = f.get_executable(state, data[0])
    loads = {str(ins) for ins in exe.programs.instructions if ins.op is Op.LOAD}
    label = exe.program.step_inputs[[leaf.path for leaf in exe.traced.in_leaves].index("batch.label")]
    assert f"LOAD v{label}" in loads  # the whole batch's labels, for the metrics after al.grad
    assert exe.program.per_example  # the logits: their rows put back together, not averaged


@pytest.mark.ray
def test_ray_backend_runs_a_flax_step_unchanged(ray_session):
    step, state, data, want = reference("classifier", 4)
    al.init(cluster="ray", num_nodes=1, num_devices_per_node=8)
    try:
        got_state, got_metrics = run_steps(al.parallelize(step, method=two_stages("1f1b")), state, data)
        assert_matches((got_state, got_metrics), want)
    finally:
        al.shutdown()


def test_a_callback_after_al_grad_sees_the_full_batch_metrics():
    seen = []

    def step(state, batch):
        new_state, metrics = classifier_step(state, batch)
        jax.debug.callback(lambda correct: seen.append(float(correct)), metrics["accuracy"])
        return new_state, metrics
    state, batch = classifier_state(), batches(1)[0]
    want = float(jax.jit(classifier_step)(state, batch)[1]["accuracy"])
    for method in (al.DataParallel(num_micro_batches=2), two_stages("1f1b", num_micro_batches=2)):
        seen.clear()
        al.parallelize(step, method=method)(state, batch)
        jax.effects_barrier()
        assert seen == [want]


def features_step(state, batch):
    """A value computed per micro-batch from the batch and the parameters outside the loss, read after al.grad:
    a micro-batch's features have no full-batch value there."""
    features = jnp.tanh(batch["x"] @ state.params["Dense_0"]["kernel"])

    def loss_fn(params):
        return jnp.mean(features @ params["Dense_1"]["kernel"]) ** 2
    grads = al.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), jnp.mean(features)


def test_a_value_computed_per_micro_batch_outside_the_loss_stays_an_error():
    state, batch = classifier_state(), batches(1)[0]
    for method in (al.DataParallel(num_micro_batches=2), two_stages("1f1b", num_micro_batches=2)):
        with pytest.raises(ValueError, match=r"`reduce_sum` outside al.grad uses the batch through a value computed "
                                             r"per micro-batch from the batch and other inputs"):
            al.parallelize(features_step, method=method)(state, batch)
    al.parallelize(features_step, method=al.DataParallel())(state, batch)  # one micro-batch: fine


def test_terapipe_names_the_outputs_it_cannot_compute():
    state, batch = classifier_state(), batches(1)[0]
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  pipeline_schedule="terapipe", stage_option=two_stages("1f1b").stage_option)
    with pytest.raises(ValueError, match=r"terapipe.*cannot compute the outputs that read the batch there "
                                         r"\(out\.1\.accuracy"):
        al.parallelize(classifier_step, method=method)(state, batch)
