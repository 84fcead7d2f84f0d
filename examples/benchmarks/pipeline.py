"""Pipeline schedules on the 8 CPU devices: measured step time, simulated time, driver overhead, bubble.

For each schedule it plans a small GPT as two stages of four devices each (``UniformStageOption``), runs
it, and prints, side by side in one run:

* measured: median wall time of a step (asynchronous dispatch, as in training);
* simulated: the same instruction programs on the cost model's clock for ``ClusterSpec.local()``;
* calibrated: the same simulation with each instruction's measured duration (from the profiled step), so
  only the schedule and dependencies are modelled;
* executables / driver: from a profiled step where every instruction is waited for: time inside RUN and
  RECV instructions versus the driver's own Python work;
* bubble: the simulated timeline's idle fraction;
* per instruction kind (RUN F / B / A, RECV, ACC, ...): the profiled step's summed durations beside the
  simulator's, to show where the measured time goes that the cost model does not see.

    python examples/benchmarks/pipeline.py --out results/pipeline.json
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
from alpa_like.runtime.simulator import measured_durations, measured_seconds_by_kind, simulate  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("breadth_first", 2)]


def measure_schedules(model_name: str, batch_size: int, micro_batches: int, steps: int,
                      schedules=SCHEDULES) -> tuple[list[dict], al.ClusterSpec]:
    """One row per ``(schedule, virtual stages)`` of ``schedules``: ``model_name`` planned as two stages of
    four CPU devices, measured (median of ``steps`` steps), simulated, calibrated and profiled (module
    docstring); and the cluster the plans were made for (``ClusterSpec.local()``)."""
    config = models.get_config(model_name)
    model = gpt.GPTModel(config)
    batch = gpt.gpt_batch(config, batch_size, jax.random.PRNGKey(1))
    params = model.init(jax.random.PRNGKey(0), batch["input_ids"])["params"]
    loss_fn = gpt.gpt_loss(model)

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    rows = []
    for schedule, virtual in schedules:
        method = al.PipeshardParallel(
            num_micro_batches=micro_batches, layer_option=al.AutoLayerOption(layer_num=config.num_layers),
            stage_option=al.UniformStageOption(num_stages=2, show_progress=False), pipeline_schedule=schedule,
            virtual_stages=virtual)
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
        step = al.parallelize(train_step, method=method)
        exe = step.get_executable(state, batch)
        for _ in range(2):  # compile and warm up
            state, loss = step(state, batch)
        jax.block_until_ready(loss)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, loss = step(state, batch)
            jax.block_until_ready((state, loss))
            times.append(time.perf_counter() - start)
        exe.run(state, batch, profile=True)
        prof = exe.last_step
        sim = simulate(exe.plan, exe.program, exe.programs, value_specs=exe.value_specs)
        calibrated = simulate(exe.plan, exe.program, exe.programs, measured_durations(exe.programs, prof.spans),
                              value_specs=exe.value_specs)
        measured = statistics.median(times)
        in_exe = prof.op_seconds.get("RUN", 0.0) + prof.op_seconds.get("RECV", 0.0)
        rows.append({"schedule": schedule, "virtual_stages": virtual, "measured_s": measured,
                     "simulated_s": sim.step_seconds, "simulated_over_measured": sim.step_seconds / measured,
                     "calibrated_s": calibrated.step_seconds,
                     "calibrated_over_measured": calibrated.step_seconds / measured,
                     "profiled_step_s": prof.seconds, "executables_s": in_exe, "driver_s": prof.driver_seconds,
                     "driver_share": prof.driver_seconds / prof.seconds, "bubble": float(sim.timeline.bubble_fraction()),
                     "op_seconds": prof.op_seconds, "instructions": prof.instructions,
                     "measured_by_kind_s": measured_seconds_by_kind(prof.spans),
                     "simulated_by_kind_s": dict(sim.seconds_by_kind)})
        print(f"{schedule}: {measured * 1e3:.1f} ms", file=sys.stderr)
    return rows, exe.plan.cluster


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="results/pipeline.json")
    args = parser.parse_args()
    rows, cluster = measure_schedules(args.model, args.batch_size, args.micro_batches, args.steps)
    print(f"{args.model}, batch {args.batch_size}, {args.micro_batches} micro-batches, 2 stages x 4 CPU devices, "
          f"median of {args.steps} steps")
    print(f"{'schedule':18} {'v':>2} {'measured ms':>12} {'simulated ms':>13} {'sim/meas':>9} "
          f"{'calibrated ms':>14} {'cal/meas':>9} {'exec ms':>8} {'driver ms':>10} {'driver %':>9} {'bubble':>7}")
    for r in rows:
        print(f"{r['schedule']:18} {r['virtual_stages']:>2} {r['measured_s'] * 1e3:>12.1f} {r['simulated_s'] * 1e3:>13.2f} "
              f"{r['simulated_over_measured']:>9.2f} {r['calibrated_s'] * 1e3:>14.1f} "
              f"{r['calibrated_over_measured']:>9.2f} {r['executables_s'] * 1e3:>8.1f} {r['driver_s'] * 1e3:>10.1f} "
              f"{r['driver_share']:>9.1%} {r['bubble']:>7.1%}")
    print(f"\nper instruction kind, summed over the step (profiled: each instruction waited for), ms; "
          f"cost model: {cluster.peak_flops / 1e9:.3g} GFLOP/s and {cluster.memory_bandwidth / 1e9:.3g} GB/s "
          f"per device, launch {cluster.launch_overhead * 1e6:.0f} us")
    print(f"{'schedule':18} {'kind':6} {'measured':>9} {'simulated':>10} {'sim/meas':>9}")
    for r in rows:
        measured, simulated = r["measured_by_kind_s"], r["simulated_by_kind_s"]
        for kind in sorted(set(measured) | set(simulated)):
            m, s = measured.get(kind, 0.0), simulated.get(kind, 0.0)
            print(f"{r['schedule']:18} {kind:6} {m * 1e3:>9.1f} {s * 1e3:>10.1f} "
                  f"{(f'{s / m:.2f}' if m > 0 else '-'):>9}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
