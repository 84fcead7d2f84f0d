"""Train a small MLP with every SPMD method and check it against plain jax.jit.

    python examples/mlp.py --method zero2 --micro-batches 2
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import use_cpu_devices  # noqa: E402

use_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import alpa_like as al  # noqa: E402

METHODS = {"data": al.DataParallel, "zero2": al.Zero2Parallel, "zero3": al.Zero3Parallel}


def init_params(rng, sizes):
    return [{"w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32), "b": jnp.zeros((b,))}
            for a, b in zip(sizes[:-1], sizes[1:])]


def loss_fn(params, batch):
    x = batch["x"]
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - batch["y"]) ** 2)


def train_step(state, batch):
    loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--method", choices=sorted(METHODS), default="data")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sizes = (64, 256, 256, 16)
    state = train_state.TrainState.create(apply_fn=None, params=init_params(rng, sizes), tx=optax.adam(1e-3))
    batch = {"x": jnp.asarray(rng.normal(size=(128, sizes[0])), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(128, sizes[-1])), jnp.float32)}
    step = al.parallelize(train_step, method=METHODS[args.method](num_micro_batches=args.micro_batches),
                          donate_argnums=(0,))
    print(step.get_executable(state, batch).plan)
    reference = jax.jit(train_step)
    ref_state = state
    for i in range(args.steps):
        start = time.perf_counter()
        state, loss = step(state, batch)
        loss = float(loss)
        elapsed = time.perf_counter() - start
        ref_state, ref_loss = reference(ref_state, batch)
        print(f"step {i}: loss {loss:.6f} (jax.jit: {float(ref_loss):.6f}), {elapsed * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
