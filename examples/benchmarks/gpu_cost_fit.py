"""Fits the GPU compute model (``ComputeRates``: matmul efficiency and overhead, fused traffic, memory
bandwidth, launch overhead) to measurements of one GPU, and checks the fitted model on held-out steps.

Reads a measurement folder written by ``gpu_costs.py`` and ``gpu.py`` on the GPU (``--data``, default the
committed H200 measurements): ``gpu_costs.json`` (matmul rates by shape, bandwidth, kernels),
``gpu_steps.json`` (``jax.jit`` training steps of many shapes) and optionally ``gpu.json`` (GPT-1.3B).

1. From the micro-benchmarks: the memory bandwidth (median of the element-wise and row-sum rates over arrays
   of 256 MiB and more), the launch overhead (the fastest call of a jitted program: dispatch bound), and the
   matrix units' achievable rate: ``t = max(F / R, bytes / bandwidth) + t0`` least-squares fitted (relative
   error) to the 16-bit products that run longer than the dispatch bound; ``matmul_efficiency = R / peak``.
2. On the training steps named in :data:`TRAIN`: ``matmul_overhead`` and ``fused_traffic`` least-squares
   fitted (relative error) to the steps' measured times, each step priced by the per-equation model of
   :func:`alpa_like.compiler.flops.jaxpr_seconds` on its traced jaxpr.
3. Every step (fitted and held out) planned with ``al.plan`` (DataParallel on one device) on a cluster with
   the fitted rates and on the GPU's preset: predicted vs measured, and the largest held-out error.

Prints the tables, writes JSON (``--out``, default the data folder's ``gpu_cost_fit.json``).

    python examples/benchmarks/gpu_cost_fit.py
"""
import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from _common import use_cpu_devices, write_results  # noqa: E402

use_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from scipy.optimize import least_squares  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like.compiler.flops import ComputeRates, jaxpr_seconds  # noqa: E402

DATA = Path(__file__).parent / "data" / "h200"
PRESET = "h200"
TRAIN = ("gpt h512 l4 s512 v8192 b8 float16", "gpt h1024 l4 s1024 v51200 b8 float16",
         "gpt h1024 l4 s256 v51200 b32 float16", "gpt h2048 l2 s1024 v51200 b8 float16",
         "gpt h2048 l4 s512 v51200 b4 float16")
"""The steps the two step-level terms are fitted to; every other measured step is held out."""
DISPATCH_BOUND = 60e-6
"""Matrix products faster than this are bound by the host's dispatch of one call, not by the device."""
LARGE_ARRAY = 256 * 2**20


# --------------------------------------------------------------------------------------- fitting (pure)

def fit_bandwidth(rows: list[dict]) -> float:
    """Bytes/s: the median rate of the bandwidth rows that move at least ``LARGE_ARRAY`` bytes."""
    rates = [r["bytes"] / r["seconds"] for r in rows if r["bytes"] >= LARGE_ARRAY]
    if not rates:
        raise ValueError(f"no bandwidth row moves >= {LARGE_ARRAY} bytes")
    return statistics.median(rates)


def fit_matmul_rate(rows: list[dict], bandwidth: float) -> tuple[float, float, float]:
    """``(R, t0, largest relative error)`` of ``t = max(flops / R, bytes / bandwidth) + t0`` least-squares
    fitted (relative error) to ``rows`` (dicts with flops, bytes, seconds)."""
    flops = np.array([r["flops"] for r in rows])
    nbytes = np.array([r["bytes"] for r in rows])
    seconds = np.array([r["seconds"] for r in rows])

    def predict(x):
        return np.maximum(flops / (x[0] * 1e12), nbytes / bandwidth) + x[1] * 1e-6

    start = [float(np.max(flops / seconds)) / 1e12, 1.0]
    fit = least_squares(lambda x: (predict(x) - seconds) / seconds, start, bounds=([1e-3, 0], [np.inf, np.inf]))
    return fit.x[0] * 1e12, fit.x[1] * 1e-6, float(np.max(np.abs(predict(fit.x) - seconds) / seconds))


def step_terms(closed_jaxpr, rates: ComputeRates) -> tuple[float, float, float]:
    """``(M, N, O)`` with ``jaxpr_seconds(closed_jaxpr, rates') == M + N * matmul_overhead + O *
    fused_traffic`` for ``rates'`` = ``rates`` with those two fields: the model is linear in both wherever a
    non-matrix equation is memory-bound (it always is at a GPU's FLOP rate), so three evaluations give it."""
    def seconds(overhead, traffic):
        return jaxpr_seconds(closed_jaxpr, dataclasses.replace(rates, matmul_overhead=overhead,
                                                               fused_traffic=traffic))
    full = seconds(0.0, 1.0)
    products = (seconds(1e-6, 1.0) - full) / 1e-6
    other = 2 * (full - seconds(0.0, 0.5))
    return full - other, products, other


def fit_step_terms(terms: list[tuple[float, int, float, float]]) -> tuple[float, float]:
    """``(matmul_overhead, fused_traffic)`` least-squares fitted (relative error) to steps given as
    ``(M, N, O, measured seconds)`` of :func:`step_terms`: the model is ``M + N * overhead + O * traffic``."""
    a = np.array(terms, dtype=float)

    def residual(x):
        return (a[:, 0] + a[:, 1] * x[0] * 1e-6 + a[:, 2] * x[1] - a[:, 3]) / a[:, 3]

    fit = least_squares(residual, [1.0, 0.5], bounds=([0, 1e-6], [np.inf, 1.0]))
    return fit.x[0] * 1e-6, float(fit.x[1])


# ------------------------------------------------------------------------------------------------ steps

def traced_step(case: dict, grad=jax.value_and_grad):
    """``(step, state_shapes, batch_shapes)`` of a gpu_costs case, from shapes alone."""
    import gpu_costs

    holder = {}

    def init(rng):
        holder["step"], state, batch = gpu_costs.build_step(case, rng, grad=grad)
        return state, batch
    state, batch = jax.eval_shape(init, jax.random.PRNGKey(0))
    return holder["step"], state, batch


def measured_steps(data: Path) -> list[dict]:
    """``{"name", "case", "step_s"}`` of every timed step in ``gpu_steps.json`` and, when present, of
    ``gpu.json``'s ``jax.jit`` row (GPT of its --model at its --batch-size and --dtype)."""
    rows = json.loads((data / "gpu_steps.json").read_text())["rows"]["steps"]
    steps = [{"name": r["name"], "case": r["case"], "step_s": r["step_s"]} for r in rows if "step_s" in r]
    if (data / "gpu.json").exists():
        gpu = json.loads((data / "gpu.json").read_text())["rows"]
        jit = next((r for r in gpu.get("timing", ()) if r["variant"] == "jax.jit" and "step_s" in r), None)
        if jit is not None:
            c = gpu["timing_case"]
            case = {"family": "gpt", "base": c["model"], "batch_size": c["batch_size"], "dtype": c["dtype"],
                    "overrides": {}}
            steps.append({"name": f"{c['model']} b{c['batch_size']} {c['dtype']}", "case": case,
                          "step_s": jit["step_s"]})
    return steps


def planned_seconds(case: dict, cluster: al.ClusterSpec) -> float:
    """The plan's predicted step time for ``case`` under DataParallel on ``cluster`` (one device)."""
    step, state, batch = traced_step(case, grad=al.value_and_grad)
    plan = al.plan(step, state, batch, method=al.DataParallel(), cluster=cluster)
    return plan.estimated_iteration_time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--preset", default=PRESET, help="the GPU's ClusterSpec preset (its datasheet peak)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    data = Path(args.data)
    micro = json.loads((data / "gpu_costs.json").read_text())["rows"]
    preset = al.ClusterSpec.preset(args.preset)
    bandwidth = fit_bandwidth(micro["bandwidth"])
    launch = min(r["seconds"] for r in micro["matmuls"])
    fits = {}
    for label, dtypes, peak in (("16-bit", ("float16", "bfloat16"), preset.peak_flops),
                                ("float32", ("float32",), preset.fp32_peak_flops)):
        rows = [r for r in micro["matmuls"] if r["dtype"] in dtypes and r["seconds"] > DISPATCH_BOUND]
        rate, t0, worst = fit_matmul_rate(rows, bandwidth)
        fits[label] = {"rate": rate, "efficiency": rate / peak, "t0": t0, "max_error": worst, "rows": len(rows)}
    efficiency = fits["16-bit"]["efficiency"]
    print(f"device {micro['device']['device_kind']}, jax {micro['device']['jax']}; preset {args.preset}")
    print(f"bandwidth {bandwidth / 1e12:.3f} TB/s; launch (the fastest call) {launch * 1e6:.1f} us")
    for label, f in fits.items():
        print(f"matmul {label}: {f['rate'] / 1e12:.0f} TFLOP/s = {f['efficiency']:.3f} of peak, t0 {f['t0'] * 1e6:.1f} us"
              f" per call, max error {f['max_error']:.1%} over {f['rows']} products")

    rates = dataclasses.replace(preset.compute_rates, memory_bandwidth=bandwidth, matmul_efficiency=efficiency,
                                matmul_overhead=0.0, fused_traffic=1.0)
    steps = measured_steps(data)
    for s in steps:
        step, state, batch = traced_step(s["case"])
        s["terms"] = step_terms(jax.make_jaxpr(step)(state, batch), rates)
    train = [(*s["terms"], s["step_s"]) for s in steps if s["name"] in TRAIN]
    overhead, traffic = fit_step_terms(train)
    print(f"fitted on {len(train)} steps: matmul_overhead {overhead * 1e6:.1f} us, fused_traffic {traffic:.3f}")

    fitted = dataclasses.replace(preset, num_devices_per_node=1, memory_bandwidth=bandwidth,
                                 matmul_efficiency=efficiency, matmul_overhead=overhead,
                                 fused_traffic=traffic, launch_overhead=launch)
    as_preset = dataclasses.replace(preset, num_devices_per_node=1)
    print(f"\n{'step':44} {'set':>8} {'measured ms':>11} {'fitted ms':>10} {'error':>7} {'preset ms':>10} {'error':>7}")
    for s in steps:
        s["fitted_s"] = planned_seconds(s["case"], fitted)
        s["preset_s"] = planned_seconds(s["case"], as_preset)
        s["set"] = "fit" if s["name"] in TRAIN else "held out"
        print(f"{s['name']:44} {s['set']:>8} {s['step_s'] * 1e3:>11.2f} {s['fitted_s'] * 1e3:>10.2f} "
              f"{s['fitted_s'] / s['step_s'] - 1:>+7.1%} {s['preset_s'] * 1e3:>10.2f} {s['preset_s'] / s['step_s'] - 1:>+7.1%}")
    held = [abs(s["fitted_s"] / s["step_s"] - 1) for s in steps if s["set"] == "held out"]
    print(f"largest held-out error: {max(held):.1%} over {len(held)} steps")
    results = {"device": micro["device"], "preset": args.preset, "bandwidth": bandwidth, "launch_overhead": launch,
               "matmul": fits, "matmul_efficiency": efficiency, "matmul_overhead": overhead,
               "fused_traffic": traffic, "train": list(TRAIN), "max_held_out_error": max(held),
               "steps": [{k: v for k, v in s.items() if k != "terms"} for s in steps]}
    write_results(args.out or str(data / "gpu_cost_fit.json"), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
