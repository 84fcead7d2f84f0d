"""Peak live bytes per mesh of a pipeline step, with and without ``donate_argnums=(0,)``.

A small GPT as two stages of four CPU devices each, for each schedule. A step is run as in a training loop
(``state, loss = step(state, batch)``: the caller holds the old state while the step runs) and measured:
after every instruction the bytes of all live arrays on each device are summed (the caller's state included),
and the largest per device of each mesh over the step is reported. With donation the step makes each update
in the buffers of the state it was given, so the old and the new state are not both held.

    python examples/benchmarks/pipeline_donation.py --out results/pipeline_donation.json
"""
import argparse
import dataclasses
import sys
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

SCHEDULES = ("gpipe", "1f1b")


def peak_bytes(config, batch_size: int, micro_batches: int, schedule: str, donate: bool) -> dict:
    """Per mesh, the peak live bytes of a profiled step (after two warm-up steps), and the state's bytes."""
    model = gpt.GPTModel(config)
    batch = gpt.gpt_batch(config, batch_size, jax.random.PRNGKey(1))
    params = model.init(jax.random.PRNGKey(0), batch["input_ids"])["params"]
    loss_fn = gpt.gpt_loss(model)

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    method = al.PipeshardParallel(
        num_micro_batches=micro_batches, layer_option=al.AutoLayerOption(layer_num=config.num_layers),
        stage_option=al.UniformStageOption(num_stages=2, show_progress=False), pipeline_schedule=schedule)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    del params
    step = al.parallelize(train_step, method=method, donate_argnums=(0,) if donate else ())
    for _ in range(2):  # compile; then the state sits on its meshes in the step's layouts
        state, loss = step(state, batch)
    jax.block_until_ready((state, loss))
    exe = step.get_executable(state, batch)
    state, loss = exe.run(state, batch, track_memory=True)
    stats = exe.last_step
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    return {"peak_live_bytes": dict(stats.peak_live_bytes), "donated_buffers": stats.donated_buffers,
            "state_bytes": state_bytes}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--hidden-size", type=int, default=512,
                        help="the model's hidden size (default 512: a state larger than the activations)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--out", default="results/pipeline_donation.json")
    args = parser.parse_args()
    config = dataclasses.replace(models.get_config(args.model), hidden_size=args.hidden_size, seq_len=args.seq_len)
    rows = []
    for schedule in SCHEDULES:
        without = peak_bytes(config, args.batch_size, args.micro_batches, schedule, donate=False)
        with_donation = peak_bytes(config, args.batch_size, args.micro_batches, schedule, donate=True)
        for mesh in sorted(without["peak_live_bytes"]):
            a, b = without["peak_live_bytes"][mesh], with_donation["peak_live_bytes"][mesh]
            rows.append({"schedule": schedule, "mesh": mesh, "peak_without_bytes": a, "peak_with_bytes": b,
                         "saved_bytes": a - b, "with_over_without": b / a,
                         "donated_buffers_without": without["donated_buffers"],
                         "donated_buffers_with": with_donation["donated_buffers"],
                         "state_bytes": without["state_bytes"]})
    mib = 2**20
    print(f"{args.model} with hidden size {args.hidden_size}, sequence {args.seq_len}, batch {args.batch_size}, "
          f"{args.micro_batches} micro-batches, 2 stages x 4 CPU devices; "
          f"state {rows[0]['state_bytes'] / mib:.1f} MiB in all")
    print(f"{'schedule':10} {'mesh':>4} {'peak/device without MiB':>24} {'with MiB':>9} {'saved MiB':>10} "
          f"{'with/without':>13} {'donated buffers':>16}")
    for r in rows:
        print(f"{r['schedule']:10} {r['mesh']:>4} {r['peak_without_bytes'] / mib:>17.1f} "
              f"{r['peak_with_bytes'] / mib:>14.1f} {r['saved_bytes'] / mib:>10.1f} {r['with_over_without']:>13.3f} "
              f"{r['donated_buffers_without']:>7} -> {r['donated_buffers_with']:<6}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
