"""XLA compiles of a pipeline's first and second steps on the 8 CPU devices, per schedule.

For each schedule it plans a small GPT as two stages of four devices each (``UniformStageOption``) and
counts, through ``jax.monitoring``'s backend compile events:

* pieces: the stage pieces of the step's program (forward, backward, apply-grad per stage; a zero-bubble
  schedule splits each backward in two);
* piece compiles: compiles of stage pieces (functions named ``run``) in the first step: one per piece
  when each compiles once, more when a piece compiles again (another donation pattern, or a first RUN
  without its accumulation);
* all compiles: every compile of the first step (micro-batch slicing, resharding cutters, the accumulators'
  starting values, the gradient means, ...; a first unrecorded row compiles what every row shares, such as
  the local cluster's measurement the planner reads);
* first step s: wall time of the first call, planning included;
* step 2 compiles: compiles of the second call, fed the state the first returned (0: the step's signature
  is stable).

    python examples/benchmarks/first_step.py --out results/first_step.json
"""
import argparse
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

SCHEDULES = ("gpipe", "1f1b", "zb_h1")


class Compiles:
    """Counts backend compiles while entered: all of them, and those of functions named ``run``."""

    def __enter__(self):
        self.all, self.pieces = 0, 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.all += 1
            self.pieces += kwargs.get("fun_name") == "jit(run)"


def measure(model_name: str, schedule: str, micro_batches: int, batch_size: int) -> dict:
    config = models.get_config(model_name)
    model = gpt.GPTModel(config)
    loss_fn = gpt.gpt_loss(model)
    batch = gpt.gpt_batch(config, batch_size, jax.random.PRNGKey(1))
    params = jax.jit(model.init)(jax.random.PRNGKey(0), batch["input_ids"])["params"]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    method = al.PipeshardParallel(num_micro_batches=micro_batches, pipeline_schedule=schedule,
                                  layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
    step = al.parallelize(train_step, method=method)
    with Compiles() as first:
        start = time.perf_counter()
        new_state, loss = step(state, batch)
        jax.block_until_ready((new_state, loss))
        seconds = time.perf_counter() - start
    with Compiles() as second:
        jax.block_until_ready(step(new_state, batch))
    pieces = len(step.get_executable(state, batch).program.pieces)
    return {"model": model_name, "schedule": schedule, "micro_batches": micro_batches, "pieces": pieces,
            "piece_compiles": first.pieces, "all_compiles": first.all, "first_step_s": seconds,
            "step_2_compiles": second.all}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="results/first_step.json")
    args = parser.parse_args()
    measure(args.model, args.schedules[0], args.micro_batches, args.batch_size)  # what every row shares
    rows = [measure(args.model, schedule, args.micro_batches, args.batch_size) for schedule in args.schedules]
    print(f"{args.model}, 2 stages x 4 CPU devices, {args.micro_batches} micro-batches")
    print(f"{'schedule':10} {'pieces':>6} {'piece compiles':>14} {'all compiles':>12} {'first step s':>12} "
          f"{'step 2 compiles':>15}")
    for r in rows:
        print(f"{r['schedule']:10} {r['pieces']:6d} {r['piece_compiles']:14d} {r['all_compiles']:12d} "
              f"{r['first_step_s']:12.2f} {r['step_2_compiles']:15d}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
