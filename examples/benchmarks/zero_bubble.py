"""Zero-bubble schedules beside 1F1B and interleaved 1F1B: simulated GPT rows and a measured run.

1. **Simulated** (Alpa Table 3.6 GPT sizes at batch 1024, on their p3.16xlarge GPU counts): each model
   planned as ``--stages`` equal stages (``UniformStageOption``) under each schedule, the plan's instruction
   programs run on the simulated backend. Columns: iteration time, bubble fraction (the timeline's idle
   share of meshes x step), and the plan's peak memory per device of each stage (Eq. 3.5 with the
   schedule's micro-batches in flight: 1F1B's ``p - s + 1`` on stage ``s``, ZB-H1's ``p`` and ZB-H2's
   ``2p - 1`` on every stage, as the stage DP prices them), and the built schedule's peak in-flight
   micro-batches per mesh (:meth:`~alpa_like.compiler.schedules.Schedule.peak_in_flight`). Interleaved 1F1B
   runs two chunks per mesh (Megatron-LM's layout).
2. **Measured** on the 8 CPU devices: ``gpt-small`` as two stages of four devices, the median step time
   of each schedule, beside its simulated time.

    python examples/benchmarks/zero_bubble.py --out results/zero_bubble.json
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from _common import use_cpu_devices, write_results  # noqa: E402

use_cpu_devices()

import pipeline  # noqa: E402  (examples/benchmarks/pipeline.py: the measured schedules)


import alpa_like as al  # noqa: E402
from alpa_like import models  # noqa: E402
from alpa_like.bench.ours import slice_workload  # noqa: E402
from alpa_like.bench.workloads import cluster_for, make_workload  # noqa: E402
from alpa_like.compiler.schedule_tables import make_schedule  # noqa: E402
from alpa_like.compiler.stage_construction import build_stage_program  # noqa: E402
from alpa_like.pipeshard import plan_sliced  # noqa: E402
from alpa_like.runtime.instructions import emit_programs  # noqa: E402
from alpa_like.runtime.stage_gradients import split_weight_gradients  # noqa: E402
from alpa_like.runtime.simulator import simulate  # noqa: E402

SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_h2", 1)]
SIMULATED = ["gpt-1.3b", "gpt-2.6b", "gpt-6.7b"]


def simulate_schedule(plan, sliced, schedule: str, virtual_stages: int):
    """``plan``'s stages run under ``schedule`` on the simulated backend, each mesh's layers cut into
    ``virtual_stages`` chunks (chunk ``s`` on mesh ``s mod p``, as ``PipeshardParallel(virtual_stages=...)``
    lays them out), a zero-bubble schedule's backwards split into B and W."""
    p = len(plan.stages)
    layers = [l for stage in plan.stages for l in stage.layer_ids]
    size = len(layers) // (p * virtual_stages)
    stage_layers = [tuple(layers[s * size:(s + 1) * size]) for s in range(p * virtual_stages)]
    stage_to_mesh = [s % p for s in range(p * virtual_stages)]
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, stage_layers,
                                  [r == "batch" for r in sliced.roles], stage_to_mesh=stage_to_mesh,
                                  after_grad=sliced.traced.after_grad)
    sched = make_schedule(schedule, num_meshes=p, num_micro_batches=plan.num_micro_batches,
                          virtual_stages=virtual_stages)
    if sched.splits_backward:
        program = split_weight_gradients(program)[0]
    programs = emit_programs(program, sched, stage_to_mesh=stage_to_mesh, free_buffers=False)
    return simulate(plan, program, programs), sched.peak_in_flight()


def stage_submesh(gpus: int, stages: int, cluster) -> tuple[int, int]:
    """Each of ``stages`` equal stages' devices: part of one node, or whole nodes."""
    per_stage, per_node = gpus // stages, cluster.num_devices_per_node
    return (1, per_stage) if per_stage <= per_node else (per_stage // per_node, per_node)


def simulated_rows(args) -> list[dict]:
    rows = []
    for name in args.models:
        gpus = models.GPT_TABLE_3_6_GPUS[name]
        workload, cluster = make_workload(name, args.global_batch), cluster_for(gpus)
        sliced = None
        for schedule, virtual in SCHEDULES:
            method = al.PipeshardParallel(
                num_micro_batches=args.sim_micro_batches, pipeline_schedule=schedule, virtual_stages=virtual,
                layer_option=al.AutoLayerOption(layer_num=args.layers, remat_layer=workload.remat),
                stage_option=al.UniformStageOption(num_stages=args.stages, show_progress=False,
                                                   submesh_physical_shape=stage_submesh(gpus, args.stages, cluster)))
            start = time.perf_counter()
            sliced = sliced or slice_workload(workload, method)
            plan = plan_sliced(method, sliced, cluster)
            sim, in_flight = simulate_schedule(plan, sliced, schedule, virtual)
            rows.append({"part": "simulated", "model": name, "gpus": gpus, "stages": len(plan.stages),
                         "micro_batches": args.sim_micro_batches, "schedule": schedule, "virtual_stages": virtual,
                         "iteration_s": sim.step_seconds, "bubble": float(sim.timeline.bubble_fraction()),
                         "peak_memory_gib": [s.peak_memory_per_device / 2 ** 30 for s in plan.stages],
                         "peak_in_flight": [float(k) for k in in_flight],
                         "seconds_by_kind": dict(sim.seconds_by_kind)})
            print(f"{name} {schedule}: {sim.step_seconds:.3f} s ({time.perf_counter() - start:.0f} s to plan)",
                  file=sys.stderr)
    return rows


def measured_rows(args) -> list[dict]:
    """The schedules measured on the CPU devices (``pipeline.measure_schedules``), beside their simulated
    time and bubble."""
    measured, _ = pipeline.measure_schedules(args.model, args.batch_size, args.micro_batches, args.steps, SCHEDULES)
    return [{"part": "measured", "model": args.model, "schedule": r["schedule"],
             "virtual_stages": r["virtual_stages"], "micro_batches": args.micro_batches,
             "measured_s": r["measured_s"], "simulated_s": r["simulated_s"], "bubble": r["bubble"]}
            for r in measured]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--sim-micro-batches", type=int, default=16)
    parser.add_argument("--models", nargs="+", default=SIMULATED, choices=sorted(models.GPT_TABLE_3_6_GPUS))
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8, help="Eq. 3.6 layers of the simulated models")
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--out", default="results/zero_bubble.json")
    args = parser.parse_args()
    rows = simulated_rows(args)
    print(f"simulated: batch {args.global_batch}, {args.sim_micro_batches} micro-batches, {args.stages} equal "
          f"stages, p3.16xlarge")
    print(f"{'model':9} {'GPUs':>4} {'schedule':17} {'iteration s':>11} {'bubble':>7}  "
          f"{'peak memory per stage, GiB':27} in flight per mesh")
    for r in rows:
        peaks = " ".join(f"{g:5.2f}" for g in r["peak_memory_gib"])
        held = " ".join(f"{k:g}" for k in r["peak_in_flight"])
        print(f"{r['model']:9} {r['gpus']:>4} {r['schedule']:17} {r['iteration_s']:>11.3f} {r['bubble']:>7.1%}  "
              f"{peaks:27} {held}")
    if not args.skip_measured:
        measured = measured_rows(args)
        print(f"\nmeasured: {args.model}, batch {args.batch_size}, {args.micro_batches} micro-batches, 2 stages x 4 "
              f"CPU devices, median of {args.steps} steps")
        print(f"{'schedule':17} {'measured ms':>11} {'simulated ms':>12} {'sim bubble':>10}")
        for r in measured:
            print(f"{r['schedule']:17} {r['measured_s'] * 1e3:>11.1f} {r['simulated_s'] * 1e3:>12.1f} "
                  f"{r['bubble']:>10.1%}")
        rows += measured
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
