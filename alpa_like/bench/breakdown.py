"""``python -m alpa_like.bench.breakdown``: where one row's step goes, and what-if plans on chosen submeshes.

For one model on one simulated cluster this plans our automatic plan, the equal-layer ablation and, for each
``--restrict`` set of submesh shapes, the stage DP allowed only those shapes (e.g. ``2x8``: every stage
spans two whole nodes), all from one traced step and simulated the same way as the suites. Per plan it
prints the simulated and DP-predicted step, the simulator's summed seconds per instruction kind (``RUN``:
compute plus intra-op communication; ``RECV``: activations between stages) and, per stage, the compute,
intra-op communication and busy seconds. A restricted DP's plan is the best of its space under the same
cost model, so comparing it with the automatic plan shows whether the DP missed a better plan there.

    python -m alpa_like.bench.breakdown wresnet-6.8b --gpus 32 --restrict 2x8 --restrict 1x8,2x8

``--plan`` prices one given plan instead of searching (``ManualStageOption``: layers per stage, submeshes,
logical meshes), e.g. Alpa's 16-GPU Wide-ResNet case study (stages of 4, 4 and 8 GPUs):

    python -m alpa_like.bench.breakdown wresnet-4b --gpus 16 --plan 4,4,8@1x4,1x4,1x8@1x4,1x4,2x4

``--near SLACK --top N`` asks whether the DP misses a plan that simulates faster: it lists every aligned
contiguous plan (:func:`near_optimal_stages`) whose stages each take at most ``SLACK`` times the DP's slowest
stage, prices them with the DP's own table (Eq. 3.2) and simulates the ``N`` cheapest:

    python -m alpa_like.bench.breakdown moe-10b --gpus 16 --micro-batches 256 --near 1.1 --top 30
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np



def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"2x8,1x8"`` -> ``((2, 8), (1, 8))``.

    >>> parse_shapes("2x8,1x4")
    ((2, 8), (1, 4))
    """
    shapes = []
    for part in text.split(","):
        try:
            a, b = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--restrict takes submesh shapes like 2x8 or 1x8,2x8, got {text!r}") from None
        shapes.append((a, b))
    return tuple(shapes)


def parse_plan(text: str) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """``"LAYERS@SUBMESHES@LOGICAL"`` -> (layers per stage, submesh shapes, logical mesh shapes), one entry
    per stage in each.

    >>> parse_plan("4,4,8@1x4,1x4,1x8@1x4,1x4,2x4")
    ((4, 4, 8), ((1, 4), (1, 4), (1, 8)), ((1, 4), (1, 4), (2, 4)))
    """
    parts = text.split("@")
    try:
        if len(parts) != 3:
            raise ValueError
        layers = tuple(int(x) for x in parts[0].split(","))
        submeshes, logical = parse_shapes(parts[1]), parse_shapes(parts[2])
    except ValueError:
        raise ValueError(f"--plan takes LAYERS@SUBMESHES@LOGICAL like 4,4,8@1x4,1x4,1x8@1x4,1x4,2x4, got {text!r}") from None
    if not len(layers) == len(submeshes) == len(logical) or min(layers) < 1:
        raise ValueError(f"--plan needs one positive layer count, submesh and logical mesh per stage, got {text!r}")
    for (a, b), (x, y) in zip(submeshes, logical):
        if a * b != x * y:
            raise ValueError(f"--plan: logical mesh {x}x{y} does not have the {a * b} devices of submesh {a}x{b}")
    return layers, submeshes, logical


def manual_option(layers: tuple[int, ...], submeshes, logical):
    """The ``ManualStageOption`` of :func:`parse_plan`'s fields: stage ``q`` takes the next ``layers[q]``
    layers in order."""
    from alpa_like.compiler.options import ManualStageOption

    ends = [sum(layers[:q + 1]) for q in range(len(layers))]
    ids = tuple(tuple(range(end - n, end)) for n, end in zip(layers, ends))
    return ManualStageOption(forward_stage_layer_ids=ids, submesh_physical_shapes=tuple(submeshes),
                             submesh_logical_shapes=tuple(logical), show_progress=False)


def near_optimal_stages(costs, cluster_shape: tuple[int, int], num_micro_batches: int, device_memory: float,
                        t_max_bound: float) -> list[tuple[float, tuple]]:
    """Every plan of the stage DP's space laid out aligned in pipeline order
    (:func:`~alpa_like.compiler.stage_placement.contiguous_offsets`) whose stages each take at most ``t_max_bound``
    seconds per micro-batch once placed, as ``(Eq. 3.2 latency, stages)`` sorted by latency: each stage on
    the fastest logical view that fits in memory as the ``s``-th stage from the end (Eq. 3.5, 1F1B), priced for
    its layout (:func:`~alpa_like.compiler.stage_placement.price_placed_stages`) and by
    :func:`~alpa_like.compiler.stage_costs.pipeline_latency`, exactly as the DP prices its answer.

    >>> from alpa_like.compiler.stage_costs import StageCosts
    >>> costs = StageCosts.from_fn(2, [(1, 1), (1, 2)], lambda i, j, sub, view: ((j - i + 1.0) / sub[1], 0, 0),
    ...                            logical_shapes=[[(1, 1)], [(1, 2)]])
    >>> [(t, [s.layers for s in stages]) for t, stages in near_optimal_stages(costs, (1, 2), 4, 1.0, 1.0)]
    [(4.0, [(0, 1)]), (5.0, [(0, 0), (1, 1)])]
    """
    from alpa_like.compiler.indices import SubmeshIdx
    from alpa_like.compiler.stage_costs import StageChoice, pipeline_latency
    from alpa_like.compiler.stage_placement import price_placed_stages

    nodes, per_node = cluster_shape
    total, layers = nodes * per_node, costs.num_layers
    saving = costs.boundary_saving if costs.boundary_saving is not None else np.zeros(
        (layers, layers, len(costs.submeshes), 2))
    fastest = np.where(np.isfinite(costs.t_intra), costs.t_intra, np.inf).min(axis=-1)
    layouts = []

    def extend(first: int, offset: int, chosen: tuple) -> None:
        if first == layers or offset == total:
            if first == layers and offset == total:
                layouts.append(chosen)
            return
        for p, (a, b) in enumerate(costs.submeshes):
            size = a * b
            if offset + size > total or offset % min(size, per_node) or (a == 1 and offset % per_node + b > per_node):
                continue
            for last in range(first, layers):
                if fastest[first, last, p] - saving[first, last, p].sum() <= t_max_bound:
                    extend(last + 1, offset + size, chosen + ((first, last, p),))

    extend(0, 0, ())
    plans = []
    for layout in layouts:
        stages = []
        for q, (first, last, p) in enumerate(layout):
            held = min(len(layout) - q, num_micro_batches)
            memory = costs.mem_stage[first, last, p] + held * costs.mem_act[first, last, p]
            t = np.where(memory <= device_memory, costs.t_intra[first, last, p], np.inf)
            view = int(np.argmin(t))
            if not np.isfinite(t[view]):
                break
            stages.append(StageChoice(layers=(first, last), submesh_index=SubmeshIdx(p), submesh=costs.submeshes[p],
                                      logical_shape=costs.logical_shapes[p][view], view_index=view,
                                      variant=costs.variants[p][view] if costs.variants else "",
                                      t_intra=float(t[view]), memory_per_device=float(memory[view]),
                                      step_seconds=costs.step_seconds_of(first, last, p)))
        else:
            placed = price_placed_stages(costs, stages, per_node)
            if max(s.t_intra for s in placed) <= t_max_bound:
                plans.append((pipeline_latency(placed, num_micro_batches), placed))
    return sorted(plans, key=lambda item: item[0])


def near_optimal_results(sliced, method, cluster, slack: float, top: int) -> list:
    """The ``top`` cheapest plans of :func:`near_optimal_stages` (stages within ``slack`` times the DP's
    slowest stage), each simulated like the suites' plans: ``ours.PlanResult`` labelled ``near k``."""
    from alpa_like import pipeshard
    from alpa_like.bench import ours
    from alpa_like.compiler.pipeline_plan import plan_of_stages

    if not slack >= 1.0 or not isinstance(top, int) or top < 1:
        raise ValueError(f"--near takes a slack >= 1 and --top an int >= 1, got {slack!r} and {top!r}")
    start = time.perf_counter()
    with ours.cyclic_gc_paused():
        _, profile, solution = pipeshard.plan_and_profile(method, sliced, cluster)
    near = near_optimal_stages(profile.costs, (cluster.num_nodes, cluster.num_devices_per_node),
                               method.num_micro_batches, cluster.device_memory, solution.t_max * slack)
    results = []
    for k, (latency, stages) in enumerate(near[:top], 1):
        given = plan_of_stages(method, sliced, cluster, profile, stages, latency)
        with ours.cyclic_gc_paused():
            simulation = pipeshard.simulate_plan(given, sliced)
        results.append(ours.PlanResult(variant=f"near {k} of {len(near)}", plan=given,
                                       simulated_seconds=simulation.step_seconds,
                                       planning_seconds=time.perf_counter() - start,
                                       seconds_by_kind=dict(simulation.seconds_by_kind),
                                       busy_seconds=simulation.busy_seconds))
    return results


def plan_rows(model: str, gpus: int, restrictions, preset: str = "p3.16xlarge",
              num_micro_batches: int | None = None, with_auto: bool = True, plans=(),
              what_if: bool = False, near: tuple[float, int] | None = None,
              recompute_aware: bool = False) -> list[dict]:
    """One summary per plan (``auto`` and ``equal layer`` unless ``with_auto`` is False, then each
    restriction, then each of ``plans``, :func:`parse_plan`'s tuples priced as given, then with ``near =
    (slack, top)`` :func:`near_optimal_results`), as the suites write them; with ``what_if``, also
    :func:`what_if_seconds` of each plan. ``recompute_aware``: the workload's
    ``AutoLayerOption.recompute_aware``."""
    from alpa_like import models
    from alpa_like.bench import ours, suites
    from alpa_like.bench.workloads import cluster_for, make_workload
    from alpa_like.compiler.options import AutoStageOption

    config = models.get_config(model)
    suite = ("moe" if isinstance(config, models.MoEConfig) else
             "wresnet" if isinstance(config, models.WResNetConfig) else "gpt")
    workload = make_workload(model, suites.GLOBAL_BATCH[suite], recompute_aware)
    cluster = cluster_for(gpus, preset)
    m = num_micro_batches or suites.MICRO_BATCHES[suite]
    method = ours.pipeshard_method(workload, m)
    sliced = ours.slice_workload(workload, method)
    results = ([ours.plan_variant("auto", workload, cluster, m, sliced),
                ours.plan_variant("equal layer", workload, cluster, m, sliced)] if with_auto else [])
    for shapes in restrictions:
        label = "only " + ",".join(f"{a}x{b}" for a, b in shapes)
        option = AutoStageOption(submesh_shapes=shapes, show_progress=False)
        results.append(ours.plan_method(label, dataclasses.replace(method, stage_option=option), sliced, cluster))
    for layers, submeshes, logical in plans:
        label = (f"given {list(layers)} on " + ",".join(f"{a}x{b}" for a, b in submeshes)
                 + " as " + ",".join(f"{x}x{y}" for x, y in logical))
        option = manual_option(layers, submeshes, logical)
        results.append(ours.plan_method(label, dataclasses.replace(method, stage_option=option), sliced, cluster))
    if near is not None:
        results += near_optimal_results(sliced, method, cluster, *near)
    rows = [dict(r.summary(), model=model, gpus=gpus, cluster=preset, micro_batches=m) for r in results]
    if what_if:
        for row, r in zip(rows, results):
            if r.plan is not None:
                row.update(what_if_seconds(r.plan, sliced))
    return rows


def what_if_seconds(plan, sliced) -> dict[str, float]:
    """The plan's simulated step with every transfer given its NICs alone (``no_nic_contention_s``) and with
    free transfers between stages (``free_transfers_s``: infinite link bandwidths, zero latencies; the
    stages' own intra-op communication is the plan's, unchanged)."""
    from alpa_like.pipeshard import simulate_plan

    free = dataclasses.replace(plan.cluster, inter_node_bandwidth=1e30, intra_node_bandwidth=1e30,
                               inter_node_latency=0.0, intra_node_latency=0.0)
    return {"no_nic_contention_s": simulate_plan(plan, sliced, nic_contention=False).step_seconds,
            "free_transfers_s": simulate_plan(dataclasses.replace(plan, cluster=free), sliced).step_seconds}


def format_rows(rows: list[dict]) -> str:
    from alpa_like.bench.report import format_terminal, plan_text

    what_if = any("no_nic_contention_s" in r for r in rows)
    lines = [["plan", "stages", "simulated s", "DP s", "RUN s (all meshes)", "RECV s (all meshes)",
              "per stage: compute + intra-op, busy s (RUNs with their launches)"]
             + (["NICs unshared s", "free transfers s"] if what_if else [])]
    for r in rows:
        if r.get("error"):
            lines.append([r["variant"], plan_text(r), "-", "-", "-", "-", "-"] + (["-", "-"] if what_if else []))
            continue
        kinds = r["seconds_by_kind"]
        run = sum(v for k, v in kinds.items() if k.startswith("RUN"))
        stages = "; ".join(f"{c:.2f}+{i:.2f}, {b:.2f}"
                           for c, i, b in zip(r["stage_compute_s"], r["stage_intra_op_s"], r["busy_s"]))
        lines.append([r["variant"], plan_text(r), f"{r['simulated_s']:.2f}", f"{r['dp_predicted_s']:.2f}",
                      f"{run:.2f}", f"{kinds.get('RECV', 0.0):.2f}", stages]
                     + ([f"{r['no_nic_contention_s']:.2f}", f"{r['free_transfers_s']:.2f}"] if what_if else []))
    return format_terminal(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alpa_like.bench.breakdown", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model of the gpt, moe or wresnet suite, e.g. wresnet-6.8b")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--restrict", action="append", default=[], metavar="SHAPES",
                        help="submesh shapes the DP may use, e.g. 2x8 or 1x8,2x8 (repeatable)")
    parser.add_argument("--plan", action="append", default=[], metavar="LAYERS@SUBMESHES@LOGICAL",
                        help="price this plan as given, e.g. 4,4,8@1x4,1x4,1x8@1x4,1x4,2x4 (repeatable)")
    parser.add_argument("--cluster", default="p3.16xlarge")
    parser.add_argument("--micro-batches", type=int)
    parser.add_argument("--only-restricted", action="store_true",
                        help="skip the auto and equal-layer plans (only --restrict and --plan)")
    parser.add_argument("--what-if", action="store_true",
                        help="also simulate each plan with unshared NICs and with free transfers between stages")
    parser.add_argument("--near", type=float, metavar="SLACK",
                        help="also simulate the aligned plans whose stages are within SLACK x the DP's slowest stage")
    parser.add_argument("--top", type=int, default=20, help="with --near: how many of them (cheapest by Eq. 3.2)")
    parser.add_argument("--recompute-aware-layers", action="store_true",
                        help="Eq. 3.6's tie-break counts recomputation (AutoLayerOption.recompute_aware)")
    parser.add_argument("--out", help="JSON path (default results/breakdown_<model>_<gpus>.json)")
    args = parser.parse_args(argv)
    try:
        restrictions = [parse_shapes(text) for text in args.restrict]
        plans = [parse_plan(text) for text in args.plan]
    except ValueError as e:
        parser.error(str(e))
    from alpa_like.bench import report

    start = time.perf_counter()
    rows = plan_rows(args.model, args.gpus, restrictions, args.cluster, args.micro_batches,
                     with_auto=not args.only_restricted, plans=plans, what_if=args.what_if,
                     near=None if args.near is None else (args.near, args.top),
                     recompute_aware=args.recompute_aware_layers)
    print(f"\n{args.model} on {args.gpus} GPUs, simulated {args.cluster} ({time.perf_counter() - start:.0f} s)")
    print(format_rows(rows))
    out = args.out or os.path.join("results", f"breakdown_{args.model}_{args.gpus}.json")
    command = "python -m alpa_like.bench.breakdown " + " ".join(sys.argv[1:] if argv is None else argv)
    path = report.write_json(out, rows, command=command, cluster=args.cluster)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
