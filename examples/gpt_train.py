"""Train a small GPT on synthetic tokens with an automatically planned or chosen parallel method.

    python examples/gpt_train.py                       # DataParallel on 8 CPU devices
    python examples/gpt_train.py --method zero3 --micro-batches 2
    python examples/gpt_train.py --method megatron     # hand-written Megatron specs on a 2x4 mesh
    python examples/gpt_train.py --cluster ray --method pipeshard --stages 2   # on a local Ray, one actor per mesh
    python examples/gpt_train.py --checkpoint-dir ckpt --save-every 5            # saves steps 5, 10
    python examples/gpt_train.py --checkpoint-dir ckpt --resume --steps 20       # goes on from step 10

The state is created in the train step's layouts (al.CreateStateParallel: no device holds all of a sharded
state). Prints the plan, the loss of every step and the step time. With --checkpoint-dir the state is saved every
--save-every steps and after the last one (keeping the newest three); --resume restores the latest checkpoint
of that directory, in the step's own layouts, and trains from its step on.
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
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like import models  # noqa: E402
from alpa_like.models import gpt  # noqa: E402
from alpa_like.models.sharding import megatron_specs  # noqa: E402


def write_timeline(executable, prefix: str) -> None:
    """The schedule's timeline under the cost model (simulated backend) as a Chrome trace and a PNG."""
    from alpa_like.runtime.simulator import simulate

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    # the Ray backend receives values in the activation layout, simulate's default (it has no value_specs)
    sim = simulate(executable.plan, executable.program, executable.programs,
                   value_specs=getattr(executable, "value_specs", None))
    sim.timeline.to_chrome_trace(prefix + ".json", us_per_unit=1e6)
    sim.timeline.plot(prefix + ".png")
    print(executable.programs.table().splitlines()[0])
    print(f"schedule timeline (simulated, {sim.step_seconds * 1e3:.3f} ms per step, bubble "
          f"{sim.timeline.bubble_fraction():.1%}): {prefix}.json (chrome://tracing, ui.perfetto.dev), {prefix}.png\n")


def counting_batch(config, batch_size: int, key):
    """Learnable synthetic text: each row counts up from a random start with a random stride (1-4), so the
    loss falls as the model learns to read the stride from the context."""
    start_key, stride_key = jax.random.split(key)
    start = jax.random.randint(start_key, (batch_size, 1), 0, config.vocab_size)
    stride = jax.random.randint(stride_key, (batch_size, 1), 1, 5)
    tokens = (start + stride * jnp.arange(config.seq_len + 1)) % config.vocab_size
    return {"input_ids": tokens[:, :-1].astype(jnp.int32), "labels": tokens[:, 1:].astype(jnp.int32)}


METHOD_NAMES = ("data", "zero2", "zero3", "megatron", "shard", "pipeshard")


def make_method(name: str, micro_batches: int, state, schedule: str = "1f1b", num_layers: int = 4,
                stages: int = 0):
    if name == "data":
        return al.DataParallel(num_micro_batches=micro_batches)
    if name == "zero2":
        return al.Zero2Parallel(num_micro_batches=micro_batches)
    if name == "zero3":
        return al.Zero3Parallel(num_micro_batches=micro_batches)
    if name == "megatron":
        return al.ManualShardParallel(mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
                                      in_specs=(megatron_specs(state), P("data")),
                                      num_micro_batches=micro_batches)
    if name == "shard":
        return al.ShardParallel(num_micro_batches=micro_batches)
    if name == "pipeshard":
        stage_option = (al.UniformStageOption(num_stages=stages) if stages else al.AutoStageOption())
        return al.PipeshardParallel(num_micro_batches=max(micro_batches, 2),
                                    layer_option=al.AutoLayerOption(layer_num=num_layers),
                                    stage_option=stage_option, pipeline_schedule=schedule)
    raise ValueError(f"--method must be one of {METHOD_NAMES}; got {name!r}")


def create_state(model, config, batch):
    """The training state: the model's parameters and Adam's moments."""
    params = model.init(jax.random.PRNGKey(0), batch["input_ids"])["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small", help="a name from alpa_like.models (default gpt-small)")
    parser.add_argument("--method", default="data", choices=METHOD_NAMES)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"),
                        help="pipeline schedule for --method pipeshard")
    parser.add_argument("--stages", type=int, default=0,
                        help="for --method pipeshard: force this many equal stages (0: the stage DP decides)")
    parser.add_argument("--timeline", default="results/gpt_timeline",
                        help="for --method pipeshard: path prefix of the simulated timeline (.json trace, .png)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cluster", default="local", choices=("local", "ray"),
                        help="ray: a local Ray (or RAY_ADDRESS's cluster), one worker actor per pipeline mesh")
    parser.add_argument("--checkpoint-dir", help="save checkpoints in this directory")
    parser.add_argument("--save-every", type=int, default=0,
                        help="with --checkpoint-dir: save every this many steps (0: after the last step only)")
    parser.add_argument("--resume", action="store_true",
                        help="with --checkpoint-dir: start from its latest checkpoint (if it has one)")
    args = parser.parse_args()
    if args.cluster == "ray" and args.method != "pipeshard":
        parser.error("--cluster ray runs pipeline plans: add --method pipeshard")
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        parser.error("--resume and --save-every need --checkpoint-dir")
    if args.save_every < 0:
        parser.error("--save-every must be >= 0")
    if args.checkpoint_dir and not args.resume and al.checkpoint_steps(args.checkpoint_dir):
        parser.error(f"{args.checkpoint_dir} already holds checkpoints (steps "
                     f"{al.checkpoint_steps(args.checkpoint_dir)}): add --resume to go on from the latest, or "
                     "choose another directory")

    al.init(args.cluster)
    config = models.get_config(args.model)
    model = gpt.GPTModel(config)
    batch = counting_batch(config, args.batch_size, jax.random.PRNGKey(1))

    def init_state():
        return create_state(model, config, batch)

    shapes = jax.eval_shape(init_state)  # the plan needs the state's shapes only
    print(f"{args.model}: {models.num_params(shapes.params) / 1e6:.2f} M parameters, batch {args.batch_size} x "
          f"{config.seq_len} tokens, {len(jax.devices())} devices")
    print("compiling (trace, plan, XLA) ...")

    loss_fn = gpt.gpt_loss(model)

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    step = al.parallelize(train_step, method=make_method(args.method, args.micro_batches, shapes, args.schedule,
                                                         config.num_layers, args.stages),
                          donate_argnums=(0,))
    start = time.perf_counter()
    executable = step.get_executable(shapes, batch)
    print(f"compiled in {time.perf_counter() - start:.1f} s\n")
    print(executable.plan)
    print()
    if args.method == "pipeshard":
        write_timeline(executable, args.timeline)
    first = 0
    if args.resume and al.checkpoint_steps(args.checkpoint_dir):
        first = al.checkpoint_steps(args.checkpoint_dir)[-1]
        state = al.restore_checkpoint(args.checkpoint_dir, like=executable, step=first)
        print(f"resumed from {args.checkpoint_dir} at step {first}")
    else:
        if args.resume:
            print(f"no checkpoint in {args.checkpoint_dir}: starting at step 0")
        # every leaf made in the layout the train step takes it in, shard by shard on its own devices
        state = al.parallelize(init_state, method=al.CreateStateParallel(step, batch))()
    saving = None
    for i in range(first, args.steps):
        batch = counting_batch(config, args.batch_size, jax.random.PRNGKey(100 + i))
        start = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])  # waits for the step
        print(f"step {i:3d}  loss {loss:.4f}  {(time.perf_counter() - start) * 1e3:8.1f} ms")
        done = i + 1
        if args.checkpoint_dir and ((args.save_every and done % args.save_every == 0) or done == args.steps):
            # returns once the arrays are off the devices (the next step may donate them); written meanwhile
            saving = al.save_checkpoint(args.checkpoint_dir, state, done, plan=executable.plan, max_to_keep=3,
                                        async_save=True)
    if saving is not None:
        print(f"saved {saving.wait()}")
    al.shutdown()


if __name__ == "__main__":
    main()
