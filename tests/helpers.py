"""Shared test fixtures: tiny models, train steps and the single-device reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import alpa_like as al


def mlp_params(rng: np.random.Generator, sizes=(16, 32, 8)) -> dict:
    return {f"dense_{i}": {"kernel": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
                           "bias": jnp.asarray(rng.normal(size=(b,)) * 0.1, jnp.float32)}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}


def mlp_apply(params: dict, x):
    n = len(params)
    for i in range(n):
        x = x @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"]
        if i < n - 1:
            x = jnp.tanh(x)
    return x


def mlp_loss(params, batch):
    return jnp.mean((mlp_apply(params, batch["x"]) - batch["y"]) ** 2)


def mlp_batch(rng: np.random.Generator, batch_size=32, sizes=(16, 32, 8)) -> dict:
    return {"x": jnp.asarray(rng.normal(size=(batch_size, sizes[0])), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(batch_size, sizes[-1])), jnp.float32)}


def mlp_state(seed=0, tx=None, sizes=(16, 32, 8)) -> train_state.TrainState:
    params = mlp_params(np.random.default_rng(seed), sizes)
    return train_state.TrainState.create(apply_fn=mlp_apply, params=params, tx=tx or optax.adam(1e-2))


def wresnet_tiny():
    """``(config, variables, loss_fn)`` of the tiny Wide-ResNet (``loss_fn(params, stats, batch)``)."""
    from alpa_like import models
    from alpa_like.models import wide_resnet
    config = models.get_config("wresnet-tiny")
    model = wide_resnet.WideResNet(config)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((2, config.image_size, config.image_size, 3)),
                           train=False)
    return config, variables, wide_resnet.wresnet_loss(model)


def make_train_step(loss_fn, grad_fn=al.value_and_grad):
    """``step(state, batch) -> (new_state, {"loss": loss})`` with al.value_and_grad (or another grad)."""
    def train_step(state, batch):
        if grad_fn is jax.grad:
            grads = jax.grad(loss_fn)(state.params, batch)
            loss = loss_fn(state.params, batch)
        else:
            loss, grads = grad_fn(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}
    return train_step


def run_steps(step_fn, state, batches):
    metrics = []
    for batch in batches:
        state, m = step_fn(state, batch)
        metrics.append(m)
    return state, metrics


def reference_on_one_device(step_fn, state, batches):
    """The reference of every numerical test: plain jax.jit on one device."""
    device = jax.devices()[0]
    state = jax.device_put(state, device)
    batches = [jax.device_put(b, device) for b in batches]
    return run_steps(jax.jit(step_fn), state, batches)


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves = jax.tree_util.tree_leaves(expected)
    assert len(a_leaves) == len(e_leaves), (a_tree, len(e_leaves))
    for (path, a), e in zip(a_leaves, e_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def micro_batch_key(key, j: int):
    """The step's key as micro-batch ``j`` of a step split into micro-batches sees it
    (``alpa_like.compiler.micro_batch_keys``): itself for micro-batch 0, ``fold_in(key, j)`` for the others."""
    return key if j == 0 else jax.random.fold_in(key, j)


def same_key(key, j: int):
    """Every micro-batch with the step's own key: the shared-mask loop a folded step must not equal."""
    return key


def micro_batch_loop(loss_fn, num_micro_batches: int, key_of=micro_batch_key):
    """The step ``al.value_and_grad(loss_fn)`` + ``apply_gradients`` written as the loop over its micro-batches
    (micro-batch j: rows j, j + m, ..., and the key ``key_of(key, j)``), the reference of the micro-batched
    methods: ``(state, batch, key, *rest) -> (next state, mean loss)``; ``rest`` goes to ``loss_fn`` as it is."""
    m = num_micro_batches

    def run(state, batch, key, *rest):
        parts = [jax.value_and_grad(loss_fn)(state.params, jax.tree.map(lambda x, j=j: x[j::m], batch),
                                             key_of(key, j), *rest) for j in range(m)]
        loss, grads = jax.tree.map(lambda *xs: sum(xs) / m, *parts)
        return state.apply_gradients(grads=grads), loss
    return run


def compiles_during(fn, fun_name: str | None = None) -> int:
    """How many XLA compiles ``fn()`` runs (jax.monitoring's backend compile events), of functions named
    ``fun_name`` (e.g. ``"jit(run)"``) if given."""
    count = [0]

    def listen(event, duration, **kwargs):
        count[0] += (event == "/jax/core/compile/backend_compile_duration"
                     and fun_name in (None, kwargs.get("fun_name")))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return count[0]
