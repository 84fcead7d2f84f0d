"""Every SPMD method against ``jax.jit`` on the accelerator at hand: correctness, step time, the cost model.

Runs on whatever ``jax.devices()`` is (GPUs, else 8 virtual CPU devices) with only jax, flax, optax, numpy
and scipy installed:

1. Correctness: a few SGD steps of a small GPT (``--check-model``, float32, matmul precision "highest")
   under each method on all devices against ``jax.jit`` on one device; the parameters must match to
   ``rtol=1e-5, atol=1e-6`` (the methods split the batch's gradient sum over devices, so the summation order
   differs from the reference's).
2. Timing: ``jax.jit`` and each method on ``--timing-devices`` devices (default 1) training ``--model``
   (default GPT-1.3B, float16 activations, float32 parameters, SGD) at ``--batch-size``; every variant is
   compiled once, then each round runs ``--steps`` steps of every variant in turn (interleaved, so the
   machine's state hits all alike), the state passed from variant to variant. The table gives the median
   milliseconds per step over rounds, the ratio to ``jax.jit`` in the same round, the achieved TFLOP/s per
   device (Megatron-LM's analytic FLOPs without recomputation: ``alpa_like.bench.flops.gpt_step_flops``)
   and the cost model's predicted step time (``plan.estimated_iteration_time``) for a cluster of the timed
   devices: the datasheet preset of the GPU family (``"h100"``, ``"h200"``, ``"dgx-a100"``,
   ``"p3.16xlarge"`` for V100) with the memory JAX may use on the device, else ``ClusterSpec.local``
   (measured), and its estimated peak memory per device. A method whose estimate exceeds the device's
   memory (which ``parallelize`` refuses) is run anyway, under the same cluster with the estimate as its
   memory, and marked; a variant that fails to run (e.g. out of memory) is reported with its error.

The JSON (``--out``) holds the device, the jax version and every number; it is written after each part.
``--time-budget`` (default 270 s) bounds the run: no variant is compiled and no round started after it. The
exit status is 1 when a method fails the check.

    pip install --no-deps --no-build-isolation -e . && python examples/benchmarks/gpu.py
    python examples/benchmarks/gpu.py --model gpt-small --batch-size 8     # a CPU smoke run
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import seconds_per_step, use_cpu_devices, write_results  # noqa: E402

use_cpu_devices()
# GPT-1.3B at batch 8 needs most of an 80 GB device; JAX's default preallocation is 75% of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like import models  # noqa: E402
from alpa_like.bench.flops import gpt_step_flops  # noqa: E402
from alpa_like.models import gpt  # noqa: E402
from alpa_like.models.sharding import megatron_specs  # noqa: E402

METHODS = ("DataParallel", "Zero2Parallel", "Zero3Parallel", "ShardParallel", "ManualShardParallel")
DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
RTOL, ATOL = 1e-5, 1e-6
"""Correctness tolerance (float32; the summation order of the batch's gradient differs across devices)."""
CHECK_LEARNING_RATE = 0.1
TIMING_LEARNING_RATE = 1e-4
GPU_PRESETS = (("H100", "h100"), ("H200", "h200"), ("A100", "dgx-a100"), ("V100", "p3.16xlarge"))
"""(substring of ``device_kind``, ClusterSpec preset)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-1.3b", help="GPT config timed (alpa_like.models.GPT_CONFIGS)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES), help="activation dtype of --model")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--timing-devices", type=int, default=1, help="devices the methods are timed on")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="methods timed")
    parser.add_argument("--check-methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="methods checked against jax.jit")
    parser.add_argument("--check-model", default="gpt-tiny", help="GPT config of the correctness check")
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--check-batch-size", type=int, default=8)
    parser.add_argument("--time-budget", type=float, default=270.0,
                        help="seconds from the start after which no further variant is compiled and no further "
                             "round is started (at least one round always runs)")
    parser.add_argument("--out", default="results/gpu.json")
    args = parser.parse_args(argv)
    if not args.time_budget > 0:
        parser.error(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    for name in ("batch_size", "steps", "rounds", "timing_devices", "check_steps", "check_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("model", "check_model"):
        try:
            config = models.get_config(getattr(args, name))
        except ValueError as e:
            parser.error(f"--{name.replace('_', '-')}: {e}")
        if type(config) is not models.GPTConfig:  # MoEConfig subclasses it; gpt.GPTModel cannot run one
            parser.error(f"--{name.replace('_', '-')} must name a GPT config, got {getattr(args, name)!r}")
    if args.timing_devices > len(jax.devices()):
        parser.error(f"--timing-devices {args.timing_devices} exceeds the {len(jax.devices())} devices present")
    return args


# ------------------------------------------------------------------------------------------------ pieces

def gpt_case(name: str, dtype, batch_size: int, device):
    """``(config, loss_fn, params, batch)`` of GPT ``name`` with ``dtype`` activations, on ``device``."""
    config = dataclasses.replace(models.get_config(name), dtype=dtype)
    model = gpt.GPTModel(config)
    batch = jax.device_put(gpt.gpt_batch(config, batch_size, jax.random.PRNGKey(1)), device)
    init = jax.jit(lambda key, ids: model.init(key, ids)["params"])  # on the device of its (committed) inputs
    return config, gpt.gpt_loss(model), init(jax.device_put(jax.random.PRNGKey(0), device), batch["input_ids"]), batch


def make_step(loss_fn, grad):
    """``step(state, batch) -> (state, loss)`` with ``grad`` (al.value_and_grad or jax.value_and_grad)."""
    def train_step(state, batch):
        loss, grads = grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss
    return train_step


def sgd_state(params, learning_rate: float, device=None) -> train_state.TrainState:
    """A plain-SGD TrainState whose step count is an int32 array (not weakly typed), as every variant's output
    state has it, so that a step compiles once; on ``device`` when given."""
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(learning_rate))
    state = state.replace(step=jnp.zeros((), jnp.int32))
    return state if device is None else jax.device_put(state, device)


def make_method(name: str, num_devices: int, state):
    """The method called ``name`` for ``num_devices`` devices; ManualShardParallel gets Megatron-LM's specs on
    a (data, model) mesh with 2 model devices when the count is even, else 1."""
    if name != "ManualShardParallel":
        return getattr(al, name)()
    model = 2 if num_devices > 1 and num_devices % 2 == 0 else 1
    return al.ManualShardParallel(mesh_shape=(num_devices // model, model), mesh_axis_names=("data", "model"),
                                  in_specs=(megatron_specs(state), P("data")))


def cluster_for(devices) -> al.ClusterSpec:
    """The cost model's cluster for ``devices`` (one node): a GPU family's preset with the memory JAX may use
    on the device, else the measured ``ClusterSpec.local``."""
    kind = devices[0].device_kind
    preset = next((p for key, p in GPU_PRESETS if key in kind), None)
    if devices[0].platform != "gpu" or preset is None:
        return al.ClusterSpec.local(devices)
    spec = al.ClusterSpec.preset(preset)
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    return dataclasses.replace(spec, num_devices_per_node=len(devices), device_name=kind,
                               device_memory=int(limit or spec.device_memory))


def relayout(tree, shardings):
    """``tree`` placed as ``shardings`` (no copy where a leaf already lies that way)."""
    return jax.device_put(tree, shardings, may_alias=True)


# ------------------------------------------------------------------------------------------- correctness

def check_methods(args, devices) -> list[dict]:
    """One row per method: the largest parameter difference to ``jax.jit`` on one device after
    ``--check-steps`` SGD steps, and whether every parameter is within (RTOL, ATOL)."""
    _, loss_fn, params, batch = gpt_case(args.check_model, jnp.float32, args.check_batch_size, devices[0])
    host_params, host_batch = jax.device_get(params), jax.device_get(batch)
    rows = []
    with jax.default_matmul_precision("highest"):
        reference = run_steps(jax.jit(make_step(loss_fn, jax.value_and_grad)),
                              sgd_state(params, CHECK_LEARNING_RATE, devices[0]), batch, args.check_steps)
        al.init("local", devices=devices)
        cluster = cluster_for(devices)
        try:
            for name in args.check_methods:
                state = sgd_state(host_params, CHECK_LEARNING_RATE)
                row = {"method": name, "devices": len(devices)}
                try:
                    step = al.parallelize(make_step(loss_fn, al.value_and_grad),
                                          method=make_method(name, len(devices), state), cluster=cluster)
                    row.update(compare(run_steps(step, state, host_batch, args.check_steps), reference))
                except Exception as e:  # noqa: BLE001  (reported; the other methods are still checked)
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
                rows.append(row)
        finally:
            al.shutdown()
    return rows


def run_steps(step, state, batch, steps: int):
    for _ in range(steps):
        state, _ = step(state, batch)
    return jax.device_get(state.params)


def compare(got, want) -> dict:
    """The largest absolute parameter difference and the largest ``|got - want| / (ATOL + RTOL |want|)``
    (``np.allclose``'s test: at most 1 passes)."""
    pairs = [(np.asarray(g, np.float64), np.asarray(w, np.float64))
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    diff = max(float(np.max(np.abs(g - w))) for g, w in pairs)
    ratio = max(float(np.max(np.abs(g - w) / (ATOL + RTOL * np.abs(w)))) for g, w in pairs)
    return {"max_abs_diff": diff, "max_diff_over_tolerance": ratio, "ok": ratio <= 1.0}


# ------------------------------------------------------------------------------------------------- timing

def time_methods(args, devices, deadline: float) -> tuple[dict, list[dict]]:
    """The timed case's description and one row per variant (``jax.jit`` first); variants not compiled by
    ``deadline`` (``time.perf_counter()`` seconds) are reported as skipped, and rounds stop there."""
    config, loss_fn, params, batch = gpt_case(args.model, DTYPES[args.dtype], args.batch_size, devices[0])
    flops = gpt_step_flops(batch_size=args.batch_size, seq_len=config.seq_len, num_layers=config.num_layers,
                           hidden_size=config.hidden_size, vocab_size=config.vocab_size, recompute=False)
    cluster = cluster_for(devices)
    case = {"model": args.model, "dtype": args.dtype, "batch_size": args.batch_size, "devices": len(devices),
            "flops_per_step": flops, "cluster": str(cluster), "steps_per_round": args.steps}

    def fresh_state():
        return sgd_state(gpt_case(args.model, DTYPES[args.dtype], args.batch_size, devices[0])[2],
                         TIMING_LEARNING_RATE, devices[0])

    state = sgd_state(params, TIMING_LEARNING_RATE, devices[0])
    del params
    al.init("local", devices=devices)
    try:
        steps, layouts, rows = {}, {}, {}
        for name in ("jax.jit", *args.methods):  # one compile each; a step's output state is its input layout
            rows[name] = {"variant": name}
            if time.perf_counter() > deadline:
                rows[name]["error"] = f"skipped: --time-budget {args.time_budget:g} s spent"
                continue
            try:
                steps[name], state = first_step(name, loss_fn, state, batch, cluster, rows[name])
                layouts[name] = jax.tree.map(lambda x: x.sharding, state)
            except Exception as e:  # noqa: BLE001  (a variant that fails, e.g. out of memory, is reported)
                rows[name]["error"] = f"{type(e).__name__}: {e}"[:2000]
                steps.pop(name, None)
                if any(x.is_deleted() for x in jax.tree.leaves(state)):  # donated to the failed step
                    state = fresh_state()
        seconds = {name: [] for name in steps}
        for r in range(args.rounds):
            if r and time.perf_counter() > deadline:
                break
            for name, step in steps.items():
                state = relayout(state, layouts[name])
                per_step, state = seconds_per_step(step, state, batch, args.steps)
                seconds[name].append(per_step)
    finally:
        al.shutdown()
    for name, times in seconds.items():
        row = rows[name]
        row.update(step_s=statistics.median(times), round_step_s=times,
                   tflops_per_device=flops / statistics.median(times) / len(devices) / 1e12)
        if "jax.jit" in seconds:
            row["ratio_to_jit"] = statistics.median(t / j for t, j in zip(times, seconds["jax.jit"]))
        if "predicted_step_s" in row:
            row["predicted_over_measured"] = row["predicted_step_s"] / row["step_s"]
    stats = devices[0].memory_stats() or {}
    case["device_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    case["device_bytes_limit"] = stats.get("bytes_limit")
    return case, list(rows.values())


def first_step(name: str, loss_fn, state, batch, cluster: al.ClusterSpec, row: dict):
    """Builds variant ``name``, runs (and compiles) its first step; returns ``(step, new_state)`` and fills
    ``row`` with the compile time and, for a method, its plan's predicted step time and peak memory.

    A method whose plan's estimated peak memory exceeds ``cluster.device_memory`` (which ``parallelize``
    refuses) runs under the same cluster with the estimate as its memory instead, so that the estimate can be
    judged against the run; ``row["estimate_exceeds_device_memory"]`` then says so.
    """
    if name == "jax.jit":
        step = jax.jit(make_step(loss_fn, jax.value_and_grad), donate_argnums=0)
    else:
        method = make_method(name, cluster.num_devices, state)
        fn = make_step(loss_fn, al.value_and_grad)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan's own "does not fit" warning: reported in the row
            plan = al.plan(fn, state, batch, method=method, cluster=cluster)
        row["estimate_exceeds_device_memory"] = not plan.fits
        if not plan.fits:
            peak = max(s.peak_memory_per_device for s in plan.stages if s.peak_memory_per_device is not None)
            cluster = dataclasses.replace(cluster, device_memory=int(peak) + 1)
        step = al.parallelize(fn, method=method, donate_argnums=(0,), cluster=cluster)
    start = time.perf_counter()
    state, loss = step(state, batch)
    jax.block_until_ready(loss)
    row["compile_and_first_step_s"] = time.perf_counter() - start
    if name != "jax.jit":
        plan = step.get_executable(state, batch).plan
        row["predicted_step_s"] = plan.estimated_iteration_time
        row["predicted_peak_memory_bytes"] = plan.stages[0].peak_memory_per_device
    return step, state


# -------------------------------------------------------------------------------------------------- report

def device_info() -> dict:
    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": d.device_kind, "num_devices": len(jax.devices()),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": sys.version.split()[0]}


def print_check(rows: list[dict], args) -> None:
    print(f"\ncorrectness: {args.check_model} float32, SGD, {args.check_steps} steps, matmul precision highest; "
          f"each method on {rows[0]['devices'] if rows else 0} device(s) vs jax.jit on 1 "
          f"(rtol={RTOL}, atol={ATOL})")
    print(f"{'method':22} {'max |diff|':>11} {'diff/tol':>9}  ok")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:22} failed: {r['error'].splitlines()[0][:150]}")
            continue
        print(f"{r['method']:22} {r['max_abs_diff']:>11.2e} {r['max_diff_over_tolerance']:>9.3f}  "
              f"{'yes' if r['ok'] else 'NO'}")


def print_timing(case: dict, rows: list[dict], args) -> None:
    rounds = max((len(r.get("round_step_s", ())) for r in rows), default=0)
    print(f"\ntiming: {case['model']} {case['dtype']} batch {case['batch_size']}, SGD, {case['devices']} "
          f"device(s), median of {rounds} interleaved rounds x {args.steps} steps; "
          f"{case['flops_per_step'] / 1e12:.3g} TFLOP per step")
    print(f"cost model cluster: {case['cluster']}")
    print(f"{'variant':22} {'compile s':>9} {'ms/step':>9} {'vs jit':>7} {'TFLOP/s':>8} {'predicted ms':>12} "
          f"{'pred/meas':>9} {'est. GiB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:22} failed: {r['error'].splitlines()[0][:150]}")
            continue
        pred, ratio, mem = r.get("predicted_step_s"), r.get("ratio_to_jit"), r.get("predicted_peak_memory_bytes")
        print(f"{r['variant']:22} {r['compile_and_first_step_s']:>9.1f} {r['step_s'] * 1e3:>9.2f} "
              f"{'-' if ratio is None else format(ratio, '.3f'):>7} {r['tflops_per_device']:>8.3g} "
              f"{'-' if pred is None else format(pred * 1e3, '.2f'):>12} "
              f"{'-' if pred is None else format(r['predicted_over_measured'], '.2f'):>9} "
              f"{'-' if mem is None else format(mem / 2**30, '.2f'):>8}"
              f"{'  (estimate > device memory: run anyway)' if r.get('estimate_exceeds_device_memory') else ''}")
    peak, limit = case.get("device_peak_bytes_in_use"), case.get("device_bytes_limit")
    if peak is not None:
        print(f"device peak memory in use over the run: {peak / 2**30:.2f} GiB"
              f"{'' if limit is None else f' of {limit / 2**30:.2f} GiB'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    info = device_info()
    print(f"{info['num_devices']} x {info['device_kind']} ({info['platform']}), jax {info['jax']}")
    results = {"device": info, "args": vars(args)}
    results["check"] = check_methods(args, jax.devices())
    print_check(results["check"], args)
    write_results(args.out, results)
    results["timing_case"], results["timing"] = time_methods(args, jax.devices()[:args.timing_devices],
                                                             deadline=start + args.time_budget)
    print_timing(results["timing_case"], results["timing"], args)
    results["wall_s"] = time.perf_counter() - start
    write_results(args.out, results)
    print(f"total {results['wall_s']:.0f} s")
    return 0 if all(r["ok"] for r in results["check"]) else 1


if __name__ == "__main__":
    sys.exit(main())
