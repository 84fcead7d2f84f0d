"""The same pipeline plan on the Ray and the local backends: step time, driver calls, bytes between meshes.

A small GPT is planned as two stages on a 1 x 4 cluster (two (1, 2) meshes, 1F1B) with ``ManualStageOption``,
so both backends run the very same stage programs, instruction programs and resharding plans. The local
backend runs them in this process on 4 virtual CPU devices; the Ray backend on two worker actors (one per
mesh, 2 virtual CPU devices each) of a local Ray started by this script. Side by side, in one run:

* step: median wall time of a step, each step waited for (the local backend's outputs are blocked on, the Ray
  backend returns when every worker has finished), state passed from step to step (handles on Ray); the
  two backends take turns step by step, so the shared machine's load hits both alike;
* driver calls: remote calls per step on Ray (one per worker); on the local backend, the instructions the
  driver walks (each a dispatch);
* between meshes: bytes the resharding plans of the RECVs move across meshes per step (worker to worker on
  Ray); inputs moved: on Ray, bytes of step inputs held on one worker and sent to another that loads them
  (the local backend's device_put of the same values is not counted by it);
* driver sent / received: on Ray, bytes the driver sent (the batch and call arguments) and received.

    python examples/benchmarks/ray_backend.py --out results/ray_backend.json
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import use_cpu_devices, write_results  # noqa: E402

use_cpu_devices()

import jax  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like import models  # noqa: E402
from alpa_like.models import gpt  # noqa: E402

NUM_DEVICES = 4


def alternate_steps(runs, state, batches):
    """Warms every (step function, wait) pair up (compiles), then runs them in turn on each batch, so the
    machine's load (shared cores) hits both alike. Returns per run the step seconds and the last loss."""
    states, times, losses = [], [[] for _ in runs], [None] * len(runs)
    for f, wait in runs:
        new_state, loss = f(state, batches[0])
        wait((new_state, loss))
        states.append(new_state)
    for batch in batches[1:]:
        for k, (f, wait) in enumerate(runs):
            start = time.perf_counter()
            states[k], loss = f(states[k], batch)
            wait((states[k], loss))
            times[k].append(time.perf_counter() - start)
            losses[k] = float(loss)
    return times, losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="results/ray_backend.json")
    args = parser.parse_args()
    config = models.get_config(args.model)
    model = gpt.GPTModel(config)
    batches = [gpt.gpt_batch(config, args.batch_size, jax.random.PRNGKey(i)) for i in range(args.steps + 1)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["input_ids"])["params"]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    loss_fn = gpt.gpt_loss(model)

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    half = config.num_layers // 2
    method = al.PipeshardParallel(
        num_micro_batches=args.micro_batches, layer_option=al.AutoLayerOption(layer_num=config.num_layers),
        stage_option=al.ManualStageOption(
            forward_stage_layer_ids=(tuple(range(half)), tuple(range(half, config.num_layers))),
            submesh_physical_shapes=((1, 2), (1, 2)), submesh_logical_shapes=((2, 1), (2, 1)),
            show_progress=False),
        pipeline_schedule="1f1b")

    al.init("local", devices=jax.devices()[:NUM_DEVICES])
    local = al.parallelize(train_step, method=method)
    local_exe = local.get_executable(state, batches[0])  # keeps running after the backend switch below
    al.init(cluster="ray", num_nodes=1, num_devices_per_node=NUM_DEVICES)
    ray_f = al.parallelize(train_step, method=method)
    ray_exe = ray_f.get_executable(state, batches[0])
    (local_times, ray_times), (local_loss, ray_loss) = alternate_steps(
        [(local_exe, jax.block_until_ready), (ray_exe, lambda _: None)], state, batches)
    local_stats, ray_stats = local_exe.last_step, ray_exe.last_step
    al.shutdown()

    rows = [
        {"backend": "local", "step_ms": statistics.median(local_times) * 1e3, "driver_calls": local_stats.instructions,
         "bytes_between_meshes": local_stats.bytes_moved, "inputs_moved_bytes": None, "driver_sent_bytes": None, "driver_received_bytes": None,
         "final_loss": local_loss},
        {"backend": "ray", "step_ms": statistics.median(ray_times) * 1e3, "driver_calls": ray_stats.driver_calls,
         "bytes_between_meshes": ray_stats.worker_bytes, "inputs_moved_bytes": ray_stats.input_bytes,
         "driver_sent_bytes": ray_stats.driver_sent_bytes,
         "driver_received_bytes": ray_stats.driver_received_bytes, "final_loss": ray_loss},
    ]
    ratio = rows[1]["step_ms"] / rows[0]["step_ms"]
    print(f"{args.model}, batch {args.batch_size}, {args.micro_batches} micro-batches, 1F1B, meshes (1,2)+(1,2); "
          f"median of {args.steps} steps")
    print(f"{'backend':8} {'step ms':>9} {'driver calls':>13} {'B between meshes':>17} {'inputs moved B':>15} "
          f"{'driver sent B':>14} {'driver recv B':>14} {'final loss':>11}")
    for r in rows:
        moved, sent, recv = ("-" if r[k] is None else r[k]
                             for k in ("inputs_moved_bytes", "driver_sent_bytes", "driver_received_bytes"))
        print(f"{r['backend']:8} {r['step_ms']:9.1f} {r['driver_calls']:13d} {r['bytes_between_meshes']:17d} "
              f"{moved:>15} {sent:>14} {recv:>14} {r['final_loss']:11.5f}")
    print(f"Ray / local step time: {ratio:.2f}x (target <= 1.5x)")
    write_results(args.out, rows + [{"ray_over_local": ratio, "model": args.model, "batch_size": args.batch_size,
                                     "micro_batches": args.micro_batches, "steps": args.steps}])


if __name__ == "__main__":
    main()
