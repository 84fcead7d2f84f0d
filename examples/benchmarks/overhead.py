"""Host overhead of a parallelized step: each method beside ``jax.jit`` of the same step on one device.

On one device every method compiles the program ``jax.jit`` compiles, so any difference in step time is
host work around the call (argument checks, layout checks, flattening). Each round times ``--steps`` calls
of every variant in turn (interleaved, so the machine's load hits all alike); the table gives the median
over rounds of each variant's time per step and its ratio to ``jax.jit`` in the same round.

A second table measures the pipeline runtime's driver: a two-stage ``PipeshardParallel`` step of a small
GPT on the 8 CPU devices, profiled (every instruction waited for), its Python time per instruction and
that time's share of the step.

    python examples/benchmarks/overhead.py --out results/overhead.json
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import seconds_per_step, use_cpu_devices, write_results  # noqa: E402

use_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like import models  # noqa: E402
from alpa_like.models import gpt  # noqa: E402


def mlp_case(width: int, depth: int, batch_size: int):
    """A ``depth``-layer MLP regression step, its state and batch."""
    rng = np.random.default_rng(0)
    params = {f"dense_{i}": {"kernel": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32),
                             "bias": jnp.zeros((width,), jnp.float32)} for i in range(depth)}

    def loss_fn(params, batch):
        x = batch["x"]
        for i in range(depth):
            x = jnp.tanh(x @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"])
        return jnp.mean((x - batch["y"]) ** 2)

    batch = {"x": jnp.asarray(rng.normal(size=(batch_size, width)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(batch_size, width)), jnp.float32)}
    return loss_fn, params, batch


def gpt_case(name: str, batch_size: int):
    config = models.get_config(name)
    model = gpt.GPTModel(config)
    batch = gpt.gpt_batch(config, batch_size, jax.random.PRNGKey(1))
    params = model.init(jax.random.PRNGKey(0), batch["input_ids"])["params"]
    return gpt.gpt_loss(model), params, batch


def make_step(loss_fn, grad=al.value_and_grad):
    def train_step(state, batch):
        loss, grads = grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss
    return train_step


def method_overhead(case_name: str, case, rounds: int, steps: int) -> list[dict]:
    """One row per method: median seconds per step and median ratio to jax.jit over interleaved rounds."""
    loss_fn, params, batch = case
    device = jax.devices()[0]
    al.init("local", devices=[device])
    batch = jax.device_put(batch, device)
    variants = {"jax.jit": jax.jit(make_step(loss_fn, jax.value_and_grad), donate_argnums=0)}
    for method in (al.DataParallel(), al.Zero2Parallel(), al.Zero3Parallel(), al.ShardParallel()):
        variants[type(method).__name__] = al.parallelize(make_step(loss_fn), method=method, donate_argnums=(0,))
    states = {}
    for name, step in variants.items():  # compile, and put each state in its step's layout
        state = train_state.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.copy, params),
                                              tx=optax.sgd(1e-3))
        for _ in range(3):
            state, _ = step(state, batch)
        states[name] = state
    seconds = {name: [] for name in variants}
    for _ in range(rounds):
        for name, step in variants.items():
            per_step, states[name] = seconds_per_step(step, states[name], batch, steps)
            seconds[name].append(per_step)
    al.shutdown()
    jit = seconds["jax.jit"]
    return [{"case": case_name, "variant": name, "leaves": len(jax.tree.leaves(states[name])),
             "step_s": statistics.median(times),
             "ratio_to_jit": statistics.median(t / j for t, j in zip(times, jit, strict=True))}
            for name, times in seconds.items()]


def pipeline_driver(model: str, batch_size: int, micro_batches: int, steps: int) -> dict:
    """The local pipeline runtime's Python time per instruction on a two-stage step of ``model``."""
    loss_fn, params, batch = gpt_case(model, batch_size)
    config = models.get_config(model)
    method = al.PipeshardParallel(num_micro_batches=micro_batches,
                                  layer_option=al.AutoLayerOption(layer_num=config.num_layers),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    step = al.parallelize(make_step(loss_fn), method=method)
    for _ in range(2):
        state, loss = step(state, batch)
    exe = step.get_executable(state, batch)
    per_step, state = seconds_per_step(step, state, batch, steps)
    drivers, shares = [], []
    for _ in range(3):
        exe.run(state, batch, profile=True)
        stats = exe.last_step
        drivers.append(stats.driver_seconds / stats.instructions)
        shares.append(stats.driver_seconds / stats.seconds)
    return {"case": f"{model} pipeline, 2 stages x 4 devices, {micro_batches} micro-batches",
            "step_s": per_step, "instructions": exe.last_step.instructions,
            "driver_us_per_instruction": statistics.median(drivers) * 1e6,
            "driver_share_of_profiled_step": statistics.median(shares)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="results/overhead.json")
    args = parser.parse_args()
    cases = {"mlp 7 x 64, batch 32": mlp_case(64, 7, 32), "gpt-small, batch 8": gpt_case("gpt-small", 8)}
    rows = []
    for name, case in cases.items():
        steps = args.steps if name.startswith("mlp") else max(args.steps // 20, 5)
        rows += method_overhead(name, case, args.rounds, steps)
    print(f"one CPU device, median of {args.rounds} interleaved rounds")
    print(f"{'case':24} {'variant':16} {'leaves':>6} {'ms/step':>9} {'vs jit':>7}")
    for r in rows:
        print(f"{r['case']:24} {r['variant']:16} {r['leaves']:>6} {r['step_s'] * 1e3:>9.3f} {r['ratio_to_jit']:>7.3f}")
    pipe = pipeline_driver("gpt-small", 16, 4, steps=5)
    print(f"\n{pipe['case']}: {pipe['step_s'] * 1e3:.1f} ms/step, {pipe['instructions']} instructions, driver "
          f"{pipe['driver_us_per_instruction']:.1f} us/instruction, {pipe['driver_share_of_profiled_step']:.1%} "
          "of the profiled step")
    write_results(args.out, {"methods": rows, "pipeline_driver": pipe})


if __name__ == "__main__":
    main()
