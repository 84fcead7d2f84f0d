"""Benchmark of the intra-op ILP (Alpa dissertation Eq. 3.1): problem size and solve time, and the step time
of its plans beside hand-written ones.

Part 1 (shapes only, nothing allocated): for one GPT layer and the GPT-1.3B / 2.6B / 6.7B training steps
(Adam, micro-batch ``--batch`` sequences of 1024 tokens) on p3.16xlarge clusters of 8 and 16 V100s, every
logical view of the devices: graph nodes, ILP nodes / edges / variables / constraints, seconds per phase
(trace, strategies + costs + solve as wall time and as this process's CPU time, which other jobs on a
shared machine do not inflate, and the solver alone) and the objective. Each view starts cold: the pass's
memoised strategies and resharding costs are cleared first.

Part 2 (8 CPU devices): measured seconds per training step of ShardParallel's plan, chosen by the objective
(the default) and by timing its candidates (``plan_selection="measured"``), beside DataParallel,
Zero2Parallel, Zero3Parallel and a Megatron-style ManualShardParallel (2-way data x 4-way tensor
parallelism) for gpt-tiny and gpt-small, all run side by side in this process with
:func:`alpa_like.timing.time_interleaved`: each round runs every method once in a freshly shuffled order
(seeded), each step timed until its new state is ready, with Python's garbage collector paused; median per
method and its ratio to the best hand-written method's median. A second, separately compiled DataParallel
("control") runs in the same rounds: its ratio to DataParallel is what machine noise alone does to two
identical programs (a fixed rotation, used before, always ran each method right after the same other method
and showed identical programs up to 45% apart under load).

    python examples/benchmarks/ilp.py                     # both parts, JSON to results/ilp.json
    python examples/benchmarks/ilp.py --models gpt-1.3b --devices 8 --skip-step-time
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like import models  # noqa: E402
from alpa_like.compiler.auto_sharding import PassOptions, alias_pairs, auto_shard, clear_caches  # noqa: E402
from alpa_like.compiler.logical_mesh import LogicalMesh, logical_shapes  # noqa: E402
from alpa_like.compiler.op_graph import build_op_graph  # noqa: E402
from alpa_like.compiler.trace import trace_step  # noqa: E402
from alpa_like.compiler.input_roles import match_outputs_to_inputs  # noqa: E402
from alpa_like.models import gpt  # noqa: E402
from alpa_like.timing import time_interleaved  # noqa: E402


def train_step(model):
    loss_fn = gpt.gpt_loss(model)

    def step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}
    return step


def state_shapes(config):
    params = gpt.gpt_param_shapes(config)
    return jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-4)),
                          params)


# ----------------------------------------------------------------------------------------------- part 1

def ilp_size(name: str, config, num_devices: int, batch: int, solver: str, time_limit: float) -> list[dict]:
    """One row per logical view: sizes and seconds of each phase of the pass."""
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=max(1, num_devices // 8))
    model = gpt.GPTModel(config)
    start = time.perf_counter()
    traced = trace_step(train_step(model), (state_shapes(config), gpt.gpt_batch_shapes(config, batch)),
                        batch_argnums=(1,))
    graph = build_op_graph(traced.closed_jaxpr, [leaf.path for leaf in traced.in_leaves])
    trace_seconds = time.perf_counter() - start
    aliases = alias_pairs(graph, match_outputs_to_inputs(traced))
    rows = []
    for shape in logical_shapes(num_devices):
        mesh = LogicalMesh.from_cluster(cluster, (cluster.num_nodes, cluster.num_devices_per_node), shape)
        clear_caches()
        start, cpu_start = time.perf_counter(), time.process_time()
        solution = auto_shard(graph, mesh, PassOptions(rates=cluster.compute_rates, solver=solver,
                                                       solver_time_limit=time_limit), aliases=aliases)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        ilp = solution.ilp
        rows.append({"model": name, "layers": config.num_layers, "devices": num_devices, "view": list(shape),
                     "equations": len(traced.closed_jaxpr.jaxpr.eqns), "graph_nodes": len(graph.nodes),
                     "ilp_nodes": ilp.num_nodes, "ilp_edges": ilp.num_edges, "variables": ilp.num_variables,
                     "constraints": ilp.num_constraints, "trace_seconds": trace_seconds,
                     "solve_seconds": ilp.solve_seconds, "pass_seconds": total, "pass_cpu_seconds": cpu, "status": ilp.status,
                     "objective_seconds": solution.objective, "solver": solver})
        print(f"  {name:10s} {num_devices:3d} dev view {shape[0]:2d}x{shape[1]:<2d}  nodes {ilp.num_nodes:5d}  "
              f"edges {ilp.num_edges:5d}  vars {ilp.num_variables:7d}  cons {ilp.num_constraints:6d}  "
              f"trace {trace_seconds:5.2f}s  pass {total:6.2f}s (cpu {cpu:5.2f}s, solver {ilp.solve_seconds:6.2f}s)  "
              f"{ilp.status:8s} objective {solution.objective * 1e3:9.3f} ms", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- part 2

def megatron_specs(state):
    """Megatron-LM's tensor parallelism on the "model" axis: QKV and fc_in column-split, out and fc_out
    row-split; everything else (embeddings, LayerNorms, biases of row-split layers) replicated. Adam's moments
    mirror the parameters."""
    def spec(path, leaf):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        name = ".".join(keys)
        if name.endswith(("qkv.kernel", "fc_in.kernel")):
            return P(None, "model")
        if name.endswith(("qkv.bias", "fc_in.bias")):
            return P("model")
        if name.endswith(("attn.out.kernel", "fc_out.kernel")):
            return P("model", None)
        return P()
    params = jax.tree_util.tree_map_with_path(spec, state.params)
    adam, rest = state.opt_state[0], state.opt_state[1:]
    opt = (adam._replace(count=P(), mu=params, nu=params), *jax.tree.map(lambda _: P(), rest))
    return state.replace(step=P(), params=params, opt_state=opt)


def hlo_collectives(exe) -> dict[str, tuple[int, int]]:
    """Collective kind -> (count, result bytes per device) in the compiled step."""
    out: dict[str, tuple[int, int]] = {}
    for c in exe.collectives():
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + 1, b + c.result_bytes)
    return out


CONTROL = "DataParallel (control)"
"""A second compile of DataParallel, timed like the others and left out of the best hand-written method."""
ILP = "ShardParallel (ILP)"
ILP_MEASURED = "ShardParallel (ILP, measured)"


def selection_report(exe) -> dict:
    """How the ILP's plan was picked: the objective per view, and with the measured selection every
    candidate's objective and measured step."""
    solver = exe.plan.stages[0].solver
    return {"selection": solver.selection, "selection_seconds": solver.selection_seconds,
            "views": [[list(v), o] for v, o in solver.views],
            "candidates": [c.to_dict() for c in solver.candidates]}


def step_times(name: str, batch_size: int, steps: int, measure_rounds: int) -> list[dict]:
    config = models.get_config(name)
    model = gpt.GPTModel(config)
    variables = model.init(jax.random.PRNGKey(0), gpt.gpt_batch(config, 2, jax.random.PRNGKey(1))["input_ids"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-4))
    batches = [gpt.gpt_batch(config, batch_size, jax.random.PRNGKey(10 + i)) for i in range(2)]
    measured = al.AutoShardingOption(plan_selection="measured", measure_rounds=measure_rounds)
    methods = {
        ILP: al.ShardParallel(),
        ILP_MEASURED: al.ShardParallel(auto_sharding_option=measured),
        "DataParallel": al.DataParallel(),
        "Zero2Parallel": al.Zero2Parallel(),
        "Zero3Parallel": al.Zero3Parallel(),
        "Megatron (Manual 2x4)": al.ManualShardParallel(mesh_shape=(2, 4), mesh_axis_names=("data", "model"),
                                                        in_specs=(megatron_specs(state), P("data"))),
    }
    step = train_step(model)
    compiled = {}
    for label, method in [*methods.items(), (CONTROL, al.DataParallel())]:
        f = al.parallelize(step, method=method)
        start = time.perf_counter()
        exe = f.get_executable(state, batches[0])
        compiled[label] = (exe, time.perf_counter() - start)
    states = {label: state for label in compiled}
    counters = {label: itertools.count() for label in compiled}

    def run(label):  # one step on alternating batches, the state carried over
        exe = compiled[label][0]
        states[label], metrics = exe(states[label], batches[next(counters[label]) % 2])
        jax.block_until_ready((states[label], metrics))  # the whole step, not only its loss

    timings = time_interleaved({label: (lambda label=label: run(label)) for label in compiled}, rounds=steps)
    medians, cpu = timings.medians(), timings.cpu_medians()
    hand = min(medians[label] for label in methods if label not in (ILP, ILP_MEASURED))
    rows = []
    for label, (exe, compile_seconds) in compiled.items():
        median = medians[label]
        stage = exe.plan.stages[0]
        collectives = hlo_collectives(exe)
        flops = exe.cost_analysis().get("flops", 0.0)
        rows.append({"model": name, "batch": batch_size, "method": label, "step_seconds_median": median,
                     "cpu_seconds_median": cpu[label],
                     "ratio_to_best_hand_written": median / hand, "compile_seconds": compile_seconds,
                     "logical_mesh": list(stage.logical_mesh_shape),
                     "modelled_communication_seconds": stage.communication_seconds,
                     "hlo_collectives": collectives, "hlo_flops_per_device": flops})
        if label in (ILP, ILP_MEASURED):
            rows[-1]["plan_selection"] = selection_report(exe)
        print(f"  {name:9s} batch {batch_size:3d}  {label:29s} {median * 1e3:8.2f} ms/step  "
              f"x{median / hand:5.2f} of best hand-written  CPU {cpu[label] * 1e3:7.2f} ms  "
              f"mesh {tuple(stage.logical_mesh_shape)}  "
              f"compile {compile_seconds:5.1f}s  HLO {flops / 1e6:7.1f} MFLOP/device, "
              + ", ".join(f"{n} {k} {b / 1e3:.0f} kB" for k, (n, b) in sorted(collectives.items())), flush=True)
        if label == ILP_MEASURED:
            for c in stage.solver.candidates:
                timed = "same program as #%d" % c.same_as if c.measured_seconds is None else \
                    f"{c.measured_seconds * 1e3:8.2f} ms"
                print(f"      candidate {'x'.join(map(str, c.logical_mesh_shape)):4s} {c.cost_model:14s} "
                      f"rewrite {'on ' if c.weight_update_sharding else 'off'}  "
                      f"objective {c.objective * 1e3:8.3f} ms  measured {timed}{'  chosen' if c.chosen else ''}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/ilp.json", help="JSON output path")
    parser.add_argument("--models", default="layer,gpt-1.3b,gpt-2.6b,gpt-6.7b",
                        help="comma list of 'layer' (one gpt-1.3b layer) and GPT config names")
    parser.add_argument("--devices", default="8,16", help="comma list of device counts (p3.16xlarge nodes of 8)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step for the shapes-only part")
    parser.add_argument("--solver", default="highs", choices=["cbc", "highs"])
    parser.add_argument("--time-limit", type=float, default=300.0, help="solver seconds per view")
    parser.add_argument("--step-models", default="gpt-tiny,gpt-small", help="models timed on the CPU devices")
    parser.add_argument("--step-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--measure-rounds", type=int, default=10,
                        help="timing rounds of ShardParallel's measured plan selection")
    parser.add_argument("--skip-ilp", action="store_true")
    parser.add_argument("--skip-step-time", action="store_true")
    args = parser.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    result = {"ilp": [], "step_time": [], "solver": args.solver}
    if not args.skip_ilp:
        print("Part 1: ILP size and solve time (shapes only, p3.16xlarge)")
        for name in args.models.split(","):
            config = dataclasses.replace(models.get_config("gpt-1.3b"), num_layers=1) if name == "layer" else \
                models.get_config(name)
            for n in (int(d) for d in args.devices.split(",")):
                result["ilp"] += ilp_size(name, config, n, args.batch, args.solver, args.time_limit)
    if not args.skip_step_time:
        print(f"Part 2: measured step time on {len(jax.devices())} CPU devices")
        cluster = al.ClusterSpec.local(jax.devices())  # what the ILP plans with (measured once, cached)
        print(f"  {cluster}")
        result["local_cluster"] = cluster.to_dict()
        for name in args.step_models.split(","):
            result["step_time"] += step_times(name, args.step_batch, args.steps, args.measure_rounds)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
