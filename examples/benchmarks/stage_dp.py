"""Plan the GPT models of Alpa's Table 3.6 on simulated p3.16xlarge clusters, from shapes alone.

For each row (GPT-350M on 1 GPU ... GPT-39B on 64 GPUs) it runs ``al.plan`` with ``PipeshardParallel``
(automatic layers with per-layer remat, FP16 activations, stage DP on intra-op ILP costs) and prints the stages, layers per stage, submesh and
logical shapes, the predicted iteration time and the planning-time breakdown (Alpa's Table 3.5 reports
2393 s for GPT-39B on 64 GPUs).

    python examples/benchmarks/stage_dp.py                      # every row
    python examples/benchmarks/stage_dp.py --models gpt-39b --out results/stage_dp.json
"""
import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import write_results  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like import models  # noqa: E402
from alpa_like.models import gpt  # noqa: E402

GLOBAL_BATCH = 1024  # Alpa's GPT benchmark


def cluster_for(num_gpus: int) -> al.ClusterSpec:
    base = al.ClusterSpec.preset("p3.16xlarge", num_nodes=max(1, num_gpus // 8))
    return base if num_gpus >= 8 else dataclasses.replace(base, num_devices_per_node=num_gpus)


def plan_row(name: str, num_gpus: int, micro_batches: int, logical_space: str, remat: bool) -> dict:
    # FP16 activations as in Alpa's GPT benchmark (parameters and optimizer state stay float32).
    config = dataclasses.replace(models.get_config(name), dtype=jnp.float16)
    params = gpt.gpt_param_shapes(config)
    state = jax.eval_shape(
        lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-4)), params)
    batch = gpt.gpt_batch_shapes(config, GLOBAL_BATCH)
    loss_fn = gpt.gpt_loss(gpt.GPTModel(config))

    def train_step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    cluster = cluster_for(num_gpus)
    method = al.PipeshardParallel(
        num_micro_batches=micro_batches,
        layer_option=al.AutoLayerOption(layer_num=config.num_layers, eps=None, remat_layer=remat),
        stage_option=al.AutoStageOption(logical_shape_space=logical_space))
    start = time.perf_counter()
    try:
        plan = al.plan(train_step, state, batch, method=method, cluster=cluster)
    except ValueError as e:  # e.g. no plan fits in memory: report it as the row's result
        return {"model": name, "gpus": num_gpus, "micro_batches": micro_batches, "error": str(e),
                "planning_s": time.perf_counter() - start, "remat": remat}
    seconds = time.perf_counter() - start
    return {"model": name, "gpus": num_gpus, "micro_batches": micro_batches,
            "stages": len(plan.stages), "layers_per_stage": [len(s.layer_ids) for s in plan.stages],
            "submeshes": [list(s.submesh_shape) for s in plan.stages],
            "logical_meshes": [list(s.logical_mesh_shape) for s in plan.stages],
            "iteration_time_s": plan.estimated_iteration_time, "planning_s": seconds,
            "planning_breakdown_s": dict(plan.compile_times), "logical_shape_space": logical_space,
            "remat": remat, "memory_per_device_gib": [s.peak_memory_per_device / 2**30 for s in plan.stages]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(models.GPT_TABLE_3_6_GPUS))
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--logical-shape-space", default="all", choices=("all", "single_node_model_parallel"))
    parser.add_argument("--no-remat", action="store_true", help="keep every activation (no per-layer remat)")
    parser.add_argument("--out", default="results/stage_dp.json")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        gpus = models.GPT_TABLE_3_6_GPUS[name]
        print(f"== {name} on {gpus} simulated V100s", file=sys.stderr)
        rows.append(plan_row(name, gpus, args.micro_batches, args.logical_shape_space, not args.no_remat))
    header = f"{'model':10} {'GPUs':>4} {'stages':>6}  {'layers/stage':24} {'submeshes':28} {'logical':28} " \
             f"{'iter (s)':>9} {'plan (s)':>8}  breakdown"
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['model']:10} {r['gpus']:>4}  no plan ({r['planning_s']:.1f} s): {r['error'][:150]}")
            continue
        breakdown = ", ".join(f"{k} {v:.1f}" for k, v in r["planning_breakdown_s"].items())
        print(f"{r['model']:10} {r['gpus']:>4} {r['stages']:>6}  {str(r['layers_per_stage']):24} "
              f"{str([tuple(s) for s in r['submeshes']]):28.28} {str([tuple(s) for s in r['logical_meshes']]):28.28} "
              f"{r['iteration_time_s']:>9.3f} {r['planning_s']:>8.1f}  {breakdown}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
