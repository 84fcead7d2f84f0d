"""How long planning takes, where the time goes, and whether the plans stay the same.

Three parts, each a list of cases planned with the bench's settings (``python -m alpa_like.bench``: FP16 GPT
with per-layer remat, batch 1024, Eq. 3.6 layers, ``AutoStageOption``, simulated p3.16xlarge, the simulated
backend settling the DP's estimates):

* ``--cases``: each case traced and planned once, with the planner's breakdown (trace and layers, intra-op
  solves with their count and cache hits, stage DP with its DP runs, the simulated choice); default GPT-39B on
  64 GPUs at 64 micro-batches;
* ``--suite``: the whole ``python -m alpa_like.bench gpt`` suite (every row, every micro-batch count it
  tries, the Megatron-LM grid), its total wall time;
* ``--large``: a 96-layer GPT-175B-like model (``opt-175b``: hidden 12288, 96 heads, sequence 2048) on a
  large simulated cluster (default 1,024 GPUs).

``--submesh-shape-space`` sets :attr:`AutoStageOption.submesh_shape_space` for every case (default ``auto``:
every submesh shape up to 8 nodes, the power-of-two whole-node meshes beyond); the table names the space
each case searched. ``--reference FILE`` compares every planned case with the plans recorded in FILE (the
rows of an earlier run's JSON, with the same cost model) and reports each difference (the exit status is then
1). The machine's load (``os.getloadavg``) is recorded before and after each part: timings on a shared machine
are only as good as that load.

    python examples/benchmarks/planning.py                                # GPT-39B on 64 GPUs
    python examples/benchmarks/planning.py --suite --out results/planning.json
    python examples/benchmarks/planning.py --cases gpt-350m:1 gpt-1.3b:4 moe-2.4b:8 wresnet-2b:8 --reference plans.json
    python examples/benchmarks/planning.py --cases --large --large-gpus 1024
    python examples/benchmarks/planning.py --cases gpt-39b:64 opt-175b:256 --submesh-shape-space power_of_two
"""
import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import write_results  # noqa: E402

from alpa_like.bench import ours, suites, workloads  # noqa: E402
from alpa_like.compiler.options import AutoStageOption  # noqa: E402
from alpa_like.pipeshard import plan_and_profile  # noqa: E402

DEFAULT_CASES = ("gpt-39b:64",)


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages (``uptime``'s)."""
    return [round(x, 2) for x in os.getloadavg()]


def parse_case(text: str) -> tuple[str, int, int]:
    """``model:gpus[:micro_batches]`` -> (model, gpus, micro-batches; default the bench's 64)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"a case is model:gpus[:micro_batches], got {text!r}")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 64


def plan_signature(plan) -> dict:
    """What makes two plans the same: every stage's layers, submesh, logical mesh, devices and input
    shardings, and the estimated iteration time."""
    stages = []
    for s in plan.stages:
        specs = json.dumps([t.to_dict() for t in s.inputs], sort_keys=True)
        stages.append({"layers": [s.layer_ids[0], s.layer_ids[-1]], "submesh": list(s.submesh_shape),
                       "logical": list(s.logical_mesh_shape), "first_device": s.device_ids[0],
                       "inputs_sha": hashlib.sha256(specs.encode()).hexdigest()[:16]})
    return {"stages": stages, "estimated_iteration_time": plan.estimated_iteration_time}


def same_plan(a: dict, b: dict, rtol: float = 1e-9) -> bool:
    """Equal stages and estimated times within ``rtol``."""
    ta, tb = a["estimated_iteration_time"], b["estimated_iteration_time"]
    return a["stages"] == b["stages"] and abs(ta - tb) <= rtol * max(abs(ta), abs(tb))


def plan_case(model: str, gpus: int, micro_batches: int, show_progress: bool = True,
              submesh_shape_space: str = "auto") -> dict:
    """Traces and plans one case as the bench does; its time, breakdown and plan signature."""
    workload = workloads.make_workload(model, suites.GLOBAL_BATCH.get(model.split("-")[0], 1024))
    cluster = workloads.cluster_for(gpus)
    option = AutoStageOption(show_progress=show_progress, submesh_shape_space=submesh_shape_space)
    method = ours.pipeshard_method(workload, micro_batches, stage_option=option)
    row = {"model": model, "gpus": gpus, "micro_batches": micro_batches, "load_before": load(),
           "submesh_shape_space": option.shape_space(cluster.num_nodes)}
    start = time.perf_counter()
    sliced = ours.slice_workload(workload, method)
    try:
        with ours.cyclic_gc_paused():
            plan, profile, solution = plan_and_profile(method, sliced, cluster)
    except ValueError as e:
        row.update(error=str(e), planning_s=time.perf_counter() - start, load_after=load())
        return row
    row.update(planning_s=time.perf_counter() - start, breakdown_s=dict(plan.compile_times),
               layers=len(sliced.summaries), solves=profile.num_solves, pairs=profile.num_pairs,
               jobs=profile.num_jobs, cache_hits=profile.cache_hits, dp_runs=solution.num_t_max_evaluated,
               plan=plan_signature(plan), load_after=load())
    return row


def run_suite() -> dict:
    """The ``gpt`` suite of ``python -m alpa_like.bench`` in this process: total and per-row seconds."""
    row = {"suite": "gpt", "load_before": load()}
    start = time.perf_counter()
    cases = suites.suite_cases("gpt")
    rows = [suites.run_case(case, "p3.16xlarge") for case in cases]
    row.update(total_s=time.perf_counter() - start, load_after=load(),
               case_s={r["model"]: r["case_seconds"] for r in rows},
               ours_s={r["model"]: r["ours"]["auto"].get("simulated_s") for r in rows})
    return row


def compare(rows: list[dict], reference: list[dict]) -> list[str]:
    """Differences between the plans of ``rows`` and the reference rows of the same case."""
    by_case = {(r["model"], r["gpus"], r["micro_batches"]): r for r in reference if "plan" in r}
    problems = []
    for r in rows:
        ref = by_case.get((r.get("model"), r.get("gpus"), r.get("micro_batches")))
        if ref is None or "plan" not in r:
            continue
        if not same_plan(r["plan"], ref["plan"]):
            problems.append(f"{r['model']} on {r['gpus']} GPUs, {r['micro_batches']} micro-batches: plan "
                            f"{r['plan']} differs from the reference {ref['plan']}")
    return problems


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['model']:10} {r['gpus']:>5} {r['micro_batches']:>5} {r['submesh_shape_space']:>12}  no plan "
              f"({r['planning_s']:.1f} s): "
              f"{r['error'][:120]}")
        return
    breakdown = ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown_s"].items())
    stages = r["plan"]["stages"]
    print(f"{r['model']:10} {r['gpus']:>5} {r['micro_batches']:>5} {r['submesh_shape_space']:>12} "
          f"{r['layers']:>6} {len(stages):>6} "
          f"{r['plan']['estimated_iteration_time']:>9.3f} {r['planning_s']:>8.1f}  solves {r['solves']} "
          f"(hits {r['cache_hits']}), DP runs {r['dp_runs']}; {breakdown}; load {r['load_before']} -> "
          f"{r['load_after']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=None,
                        help="model:gpus[:micro_batches] (default gpt-39b:64; give none with --suite/--large "
                             "to skip)")
    parser.add_argument("--suite", action="store_true", help="time the whole bench gpt suite")
    parser.add_argument("--large", action="store_true", help="plan opt-175b on --large-gpus GPUs")
    parser.add_argument("--large-gpus", type=int, default=1024)
    parser.add_argument("--reference", help="JSON of an earlier run whose plans each case must equal")
    parser.add_argument("--submesh-shape-space", default="auto", choices=("auto", "all", "power_of_two"),
                        help="AutoStageOption.submesh_shape_space of every case")
    parser.add_argument("--quiet", action="store_true", help="no planner progress on stderr")
    parser.add_argument("--out", default="results/planning.json")
    args = parser.parse_args()
    texts = DEFAULT_CASES if args.cases is None else args.cases
    cases = [parse_case(t) for t in texts]
    if args.large:
        cases.append(("opt-175b", args.large_gpus, 64))
    rows, problems = [], []
    header = (f"{'model':10} {'GPUs':>5} {'B':>5} {'shapes':>12} {'layers':>6} {'stages':>6} {'iter (s)':>9} "
              f"{'plan (s)':>8}  "
              "breakdown")
    for model, gpus, m in cases:
        print(f"== {model} on {gpus} simulated V100s, {m} micro-batches, load {load()}", file=sys.stderr)
        row = plan_case(model, gpus, m, show_progress=not args.quiet,
                        submesh_shape_space=args.submesh_shape_space)
        rows.append(row)
        print(header)
        print_row(row)
    if args.suite:
        print(f"== the gpt suite, load {load()}", file=sys.stderr)
        suite = run_suite()
        rows.append(suite)
        print(f"gpt suite: {suite['total_s']:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in suite['case_s'].items())}); "
              f"load {suite['load_before']} -> {suite['load_after']}")
    if args.reference:
        reference = json.loads(Path(args.reference).read_text())
        problems += compare(rows, reference["rows"] if isinstance(reference, dict) else reference)
    for p in problems:
        print("DIFFERENT:", p)
    write_results(args.out, rows)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
