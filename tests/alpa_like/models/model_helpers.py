"""Helpers shared by the model tests."""
import re

import jax
import optax


def key(seed: int) -> jax.Array:
    """A PRNG key for tests. threefry (the default) takes seconds to compile per initialiser on this
    CPU, rbg a fraction of that; the models do not depend on the key implementation."""
    return jax.random.key(seed, impl="unsafe_rbg")


def name_to_count(name: str) -> float:
    """'gpt-1.3b' -> 1.3e9, 'opt-125m' -> 125e6."""
    size = re.fullmatch(r"[a-z]+-([\d.]+)([mb])", name)
    assert size, name
    return float(size[1]) * {"m": 1e6, "b": 1e9}[size[2]]


def adam_losses(loss_fn, params, batch, steps=5, lr=1e-2):
    """Losses of ``steps`` jitted Adam steps on one batch (the value before each update)."""
    opt = optax.adam(lr)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = opt.init(params), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses
