"""TeraPipe (seed 000, dissertation ch. 2): the paper's tables on the simulated cluster, and a measured run.

Three parts, printed side by side and written as JSON:

1. **Table 2.1** settings on a simulated p3.16xlarge cluster: the per-slice stage time is the analytic Eq. 2.9
   model of :func:`alpa_like.compiler.terapipe_cost.analytic_slice_costs` (FLOPs at ``efficiency`` x peak,
   the utilisation floor of Fig. 2.3 as a device's work per layer, so a layer split over 8 GPUs needs 8x the
   tokens to saturate them; Megatron all-reduces inside a node; the stage-to-stage send across nodes when a
   stage fills its node, over NVLink when a node holds several stages), plus the data-parallel gradient
   all-reduce once per iteration (:func:`~alpa_like.compiler.terapipe_cost.data_parallel_sync_seconds`).
   Two parameters are calibrated on ONE row (``--calibrate-row``, default 5): the device ``efficiency`` on
   its "without TeraPipe" latency, then the floor (GFLOP per device and layer forward, a power of 2) on
   its "with TeraPipe" latency; every other number is a prediction. "Without" is the best batch slicing
   of whole sequences; "with" is the joint batch + token DP (section 2.3.4) over batch-slice sizes
   1, 2, 4 (the paper's solutions all use 1). Token lengths are searched in steps of 8 tokens (the paper's
   schemes are all multiples of 8).
2. **Table 2.3**: the DP's slicing versus the best uniform slicing (4 ... 128 equal slices), settings 8
   and 9, under the same model.
3. **Measured on the 8 CPU devices**: a small GPT with long sequences and batch 1 on 4 stages of 2 devices,
   1F1B (whole sequences) versus ``pipeline_schedule="terapipe"``, and TeraPipe with
   ``share_slice_executables=True`` ("shared": equal-length slices share one executable per stage, their
   cached keys/values padded to the longest context; fewer compiles, more attention work). The token slices
   come from the DP on a *measured* Eq. 2.9 model: one GPT block (forward + backward) timed on the DP's whole
   grid (slice lengths and contexts in 128-token steps), 2 warm-up runs per point, then ``ROUNDS`` rounds
   timing every point once in shuffled order. The model (``t(i, 0)`` tabulated per length, the context term
   fitted by least squares) is fitted on the points with contexts 0, 256, 512, ... and on every slice that
   ends the sequence (24 of the 36 points at 1024 tokens) with the medians of the even rounds, and scored
   on the other points with the medians of the odd rounds: the held-out error. The even- vs odd-round
   medians on those points give the error no model can beat (timing noise); the interquartile range of a
   point's runs / its median is printed too.
   Two fits: Eq. 2.9's bilinear context term over every fitted point ("plane"), and the same with the slice
   that ends the sequence tabulated ("last tabulated", used for the DP): power-of-two key lengths run slower
   on this CPU (see compiler/terapipe_cost.fit_slice_costs). The measured grid also prices the DP's slices
   with and without the shared executables' padding.

    python examples/benchmarks/terapipe.py --steps 6 --out results/terapipe.json
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import alpa_like as al  # noqa: E402
from alpa_like.compiler.terapipe_cost import (analytic_slice_costs, data_parallel_sync_seconds,  # noqa: E402
                                              fit_slice_costs, time_slice_grid)
from alpa_like.compiler.terapipe_planning import choose_token_slicing  # noqa: E402
from alpa_like.compiler.token_slicing import (format_scheme, slice_cost_table, solve_joint_slicing,  # noqa: E402
                                              solve_token_slicing, uniform_slicing)
from alpa_like.models import gpt  # noqa: E402
from alpa_like.nn import TokenSliceContext, token_slice_context  # noqa: E402

L = 2048
GRAIN = 8
ROUNDS = 10  # timed rounds per grid point in part 3 (split into even and odd halves)
# (row, model, layers N, hidden H, GPUs, batch B, data, pipe, op, paper without, paper scheme, paper with)
TABLE_2_1 = [
    (1, "1B", 24, 2048, 192, 128, 8, 24, 1, 1.517, "[776, 640, 632]", 1.254),
    (2, "1B", 24, 2048, 192, 72, 2, 12, 8, 1.018, "same", 1.018),
    (3, "1B", 24, 2048, 192, 72, 1, 24, 8, 0.913, "same", 0.913),
    (4, "13B", 40, 5120, 320, 32, 2, 20, 8, 2.637, "[1024, 1024]", 1.891),
    (5, "13B", 40, 5120, 320, 32, 1, 40, 8, 1.863, "[704, 688, 656]", 1.328),
    (6, "44B", 96, 6144, 384, 8, 4, 96, 1, 13.319, "[64x26, 56x6, 48]", 7.103),
    (7, "44B", 96, 6144, 384, 8, 2, 24, 8, 4.311, "[368, 384, 384, 368, 256, 288]", 2.771),
    (8, "44B", 96, 6144, 384, 8, 1, 48, 8, 2.662, "[384, 384, 368, 320, 296, 296]", 1.111),
    (9, "175B", 96, 12288, 384, 2, 1, 96, 4, 9.990, "[120x4, 112x6, 104x8, 64]", 1.481),
    (10, "175B", 96, 12288, 384, 2, 1, 48, 8, 5.822, "[128x16]", 1.160),
]
TABLE_2_3 = {8: (1.241, 1.111), 9: (1.547, 1.481)}  # best uniform, DP (paper)


def slice_model(row, calibration, batch):
    _, _, n, h, _, _, _, pipe, op, *_ = row
    efficiency, saturation = calibration
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=max(1, row[4] // 8))
    return analytic_slice_costs(cluster, seq_len=L, hidden=h, layers_per_stage=n // pipe, batch=batch,
                                op_degree=op, efficiency=efficiency, saturation_flops=saturation,
                                cross_node=op >= cluster.num_devices_per_node)


def grained_table(model):
    """Slice costs in units of GRAIN tokens."""
    return slice_cost_table(lambda k, c: model.slice_time(k * GRAIN, c * GRAIN), L // GRAIN)


def predict(row, calibration, token_slicing=True):
    """Joint DP latency and scheme for one Table 2.1 row."""
    per_pipeline = row[5] // row[6]
    sizes = [b for b in (1, 2, 4) if b <= per_pipeline] if token_slicing else range(1, per_pipeline + 1)
    tables = {}
    for b in sizes:
        model = slice_model(row, calibration, b)
        if token_slicing:
            tables[b] = grained_table(model)
        else:  # one "token" = the whole sequence
            tables[b] = slice_cost_table(lambda k, c, m=model: m.slice_time(k * L, c * L), 1)
    solution = solve_joint_slicing(tables, per_pipeline, row[7], epsilon=1e-4)
    scale = GRAIN if token_slicing else L
    scheme = [(b, tuple(x * scale for x in ls)) for b, ls in solution.batch_slices]
    return solution.latency + sync_seconds(row), format_scheme(scheme)


def sync_seconds(row):
    """The data-parallel gradient all-reduce after the pipeline (same with and without token slicing)."""
    _, _, n, h, gpus, _, data, pipe, op, *_ = row
    cluster = al.ClusterSpec.preset("p3.16xlarge", num_nodes=max(1, gpus // 8))
    return data_parallel_sync_seconds(cluster, hidden=h, layers_per_stage=n // pipe, op_degree=op, data_parallel=data)


def calibrate(row) -> tuple[float, float]:
    """(efficiency, saturation_flops): the efficiency (fraction of peak) at which the row's 'without
    TeraPipe' latency is the paper's (whole sequences of 2048 tokens never hit the floor), then the floor
    (GFLOP per device and layer forward, a power of 2 from 0.25 to 256) whose "with TeraPipe" latency is
    closest to the paper's."""
    lo, hi = 0.01, 1.0
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        if predict(row, (mid, 1.0), token_slicing=False)[0] > row[9]:
            lo = mid
        else:
            hi = mid
    efficiency = (lo * hi) ** 0.5
    floors = [1e9 * 2**i for i in range(-2, 9)]  # 0.25 .. 256 GFLOP per device and layer forward
    errors = [abs(predict(row, (efficiency, f))[0] - row[11]) for f in floors]
    return efficiency, floors[int(np.argmin(errors))]


def part1(calibrate_row: int):
    row = next(r for r in TABLE_2_1 if r[0] == calibrate_row)
    calibration = calibrate(row)
    print(f"\n(1) Table 2.1 on a simulated p3.16xlarge cluster; efficiency {calibration[0]:.3f} x peak and "
          f"utilisation floor {calibration[1] / 1e9:g} GFLOP per device and layer calibrated on row {calibrate_row} only")
    head = (f"{'#':>2} {'model':>5} {'D/P/O':>9} {'paper w/o':>9} {'pred w/o':>8} {'err':>6} {'paper w/':>8} "
            f"{'pred w/':>7} {'err':>6} {'paper x':>7} {'pred x':>6}  scheme found (paper's)")
    print(head)
    rows = []
    for r in TABLE_2_1:
        without, _ = predict(r, calibration, token_slicing=False)
        with_tp, scheme = predict(r, calibration)
        err_wo, err_w = without / r[9] - 1, with_tp / r[11] - 1
        print(f"{r[0]:>2} {r[1]:>5} {f'{r[6]}/{r[7]}/{r[8]}':>9} {r[9]:>9.3f} {without:>8.3f} {err_wo:>+6.0%} "
              f"{r[11]:>8.3f} {with_tp:>7.3f} {err_w:>+6.0%} {r[9] / r[11]:>7.2f} {without / with_tp:>6.2f}  "
              f"{scheme} ({r[10]})")
        rows.append({"row": r[0], "model": r[1], "data": r[6], "pipe": r[7], "op": r[8],
                     "paper_without_s": r[9], "predicted_without_s": without, "paper_with_s": r[11],
                     "predicted_with_s": with_tp, "scheme": scheme, "paper_scheme": r[10],
                     "calibration_row": r[0] == calibrate_row})
    return calibration, rows


def part2(calibration):
    print("\n(2) Table 2.3: DP versus the best uniform slicing (same model; b = 1 per batch slice)")
    rows = []
    for number, (paper_uniform, paper_dp) in TABLE_2_3.items():
        r = next(x for x in TABLE_2_1 if x[0] == number)
        model = slice_model(r, calibration, 1)
        table = slice_cost_table(model, L)
        per_pipeline = r[5] // r[6]
        uniform = {}
        for n in (1, 2, 4, 8, 16, 32, 64, 128):
            lengths, _ = uniform_slicing(table, n, r[7])
            times = _times(table, lengths)
            uniform[n] = per_pipeline * sum(times) + (r[7] - 1) * max(times) + sync_seconds(r)
        best_n = min(uniform, key=uniform.get)
        dp, scheme = predict(r, calibration)
        cells = "  ".join(f"{n}:{t:.3f}" for n, t in uniform.items())
        print(f"setting {number}: uniform {cells}")
        print(f"           best uniform {best_n} slices {uniform[best_n]:.3f} s, DP {dp:.3f} s -> "
              f"{uniform[best_n] / dp:.2f}x (paper {paper_uniform / paper_dp:.2f}x: {paper_uniform} vs {paper_dp})")
        rows.append({"setting": number, "uniform_s": uniform, "best_uniform_slices": best_n, "dp_s": dp,
                     "dp_scheme": scheme, "paper_uniform_s": paper_uniform, "paper_dp_s": paper_dp})
    r = next(x for x in TABLE_2_1 if x[0] == 9)
    start = time.perf_counter()
    table = slice_cost_table(slice_model(r, calibration, 1), L)
    built = time.perf_counter() - start
    solution = solve_token_slicing(table, r[7], epsilon=1e-4)
    solved = time.perf_counter() - start - built
    print(f"DP at token granularity, L = {L}, K = {r[7]}, epsilon = 0.1 ms: table {built:.2f} s + solve "
          f"{solved:.2f} s ({solution.num_candidates} t_max candidates), {len(solution.lengths)} slices")
    rows.append({"dp_speed": {"seq_len": L, "stages": r[7], "table_s": built, "solve_s": solved,
                              "candidates": solution.num_candidates, "lengths": list(solution.lengths)}})
    # The joint DP as planning runs it with few stages (Alg. 1's K t_max stop alone was slow there): 4 equal
    # stages, 30% of their time in attention, 8 sequences of 512 tokens, batch slices of 1, 2, 4 or 8.
    start = time.perf_counter()
    decision = choose_token_slicing([1.0] * 4, [0.3] * 4, 512, 8, 1)
    planned = time.perf_counter() - start
    print(f"joint DP as planning runs it, 4 stages, 8 sequences of 512 tokens (batch slices 1, 2, 4, 8): "
          f"{planned:.2f} s (tables included), {format_scheme(decision.batch_slices)}")
    rows.append({"joint_dp_speed": {"seq_len": 512, "stages": 4, "batch": 8, "seconds": planned,
                                    "scheme": format_scheme(decision.batch_slices)}})
    return rows


def _times(table, lengths):
    out, c = [], 0
    for k in lengths:
        out.append(float(table[k, c]))
        c += k
    return out


def block_timer(config, layers: int):
    """``time_slice(k, c)``: forward + backward of ``layers`` GPT blocks on a slice of ``k`` tokens after
    ``c`` cached tokens, on one CPU device."""
    block = gpt.GPTBlock(config)
    params = block.init(jax.random.PRNGKey(0), jnp.zeros((1, 1, config.hidden_size)))
    compiled = {}

    def loss(params, x, prefixes):
        context = TokenSliceContext(prefixes=prefixes)
        with token_slice_context(context):
            for _ in range(layers):
                x = block.apply(params, x)
        return jnp.sum(x)

    def time_slice(k, c):
        if (k, c) not in compiled:
            h, d = config.num_heads, config.head_dim
            prefix = jnp.zeros((1, c, h, d))
            args = (params, jnp.ones((1, k, config.hidden_size)), [[(prefix, prefix)]] * layers)
            compiled[(k, c)] = (jax.jit(jax.grad(loss, argnums=(0, 1, 2))), args)
        fn, args = compiled[(k, c)]
        jax.block_until_ready(fn(*args))

    return time_slice


def part3(seq_len, steps, stages=4):
    config = gpt.GPTConfig(vocab_size=512, seq_len=seq_len, hidden_size=128, num_layers=stages, num_heads=4)
    print(f"\n(3) 8 CPU devices: GPT h={config.hidden_size} layers={config.num_layers} seq={seq_len} batch 1, "
          f"{stages} stages x 2 devices")
    grain = 128  # the DP searches slice lengths in multiples of 128 tokens: measure that whole grid
    timer = block_timer(config, config.num_layers // stages)
    grid = [(i, j) for i in range(grain, seq_len + 1, grain) for j in range(0, seq_len - i + 1, grain)]
    timings = time_slice_grid(timer, grid, repeats=ROUNDS, warmup=2)
    fit_half, test_half = timings.halves()
    fit_points = [(i, j) for i, j in grid if j % (2 * grain) == 0 or i + j == seq_len]
    held_out = [p for p in grid if p not in fit_points]
    fit_samples = [s for s in fit_half.medians() if s[:2] in fit_points]
    first, second = ({(i, j): t for i, j, t in h.medians()} for h in (fit_half, test_half))
    held_samples = [(i, j, second[(i, j)]) for i, j in held_out]
    models = {"plane": fit_slice_costs(seq_len, fit_samples),
              "last tabulated": fit_slice_costs(seq_len, fit_samples, tabulate_last_slice=True)}
    spread = timings.spread()
    floor = np.abs([first[p] / second[p] - 1 for p in held_out])
    print(f"measured Eq. 2.9 model of one stage: the DP's grid ({len(grid)} points: lengths and contexts in "
          f"{grain}-token steps), {ROUNDS} shuffled rounds; fitted on {len(fit_points)} points (contexts 0, "
          f"{2 * grain}, {4 * grain}, ... and every last slice) with the medians of the even rounds, scored on the "
          f"other {len(held_out)} points with the medians of the odd rounds")
    print(f"  timing noise: IQR / median of a point's {ROUNDS} runs max {max(spread.values()):.0%}, mean "
          f"{statistics.mean(spread.values()):.0%}; even- vs odd-round medians on the held-out points (what a "
          f"perfect model could not beat) max {floor.max():.1%}, mean {floor.mean():.1%}")
    fits = {}
    for name, m in models.items():
        held = np.abs(m.relative_errors(held_samples))
        monotone = _monotone_in_context(m, seq_len, grain)
        fits[name] = {"fit_error": m.context_fit_error, "mean_fit_error": m.mean_context_fit_error,
                      "held_out_error": float(held.max()), "mean_held_out_error": float(held.mean()),
                      "coefficients": list(m.context_coefficients), "monotone_in_context": monotone}
        print(f"  {name:>14}: fitted points max {m.context_fit_error:.1%} mean {m.mean_context_fit_error:.1%}; "
              f"held-out points max {held.max():.1%} mean {held.mean():.1%}; non-decreasing in context on the "
              f"grid: {monotone}")
    measured = {(i, j): t for i, j, t in timings.medians()}
    print(f"  {'length':>6} {'context':>7} {'median':>9} {'noise':>6} {'held out':>8} {'plane':>7} {'last tab.':>9}")
    per_point = []
    for i, j in grid:
        t = measured[(i, j)]
        reference = second[(i, j)] if (i, j) in held_out else first[(i, j)]
        errors = [float(m.relative_errors([(i, j, reference)])[0]) for m in models.values()]
        per_point.append({"length": i, "context": j, "median_s": t, "runs_s": list(timings.runs[(i, j)]),
                          "noise": spread[(i, j)],
                          "held_out": (i, j) in held_out, "plane_error": errors[0], "tabulated_error": errors[1]})
        print(f"  {i:>6} {j:>7} {t * 1e3:>7.2f}ms {spread[(i, j)]:>6.0%} {'yes' if (i, j) in held_out else '':>8} "
              f"{errors[0]:>+7.1%} {errors[1]:>+9.1%}")
    inversions = [(i, j) for i, j in grid if (i, j + grain) in measured and measured[(i, j + grain)] < measured[(i, j)]]
    print(f"  measured medians falling as the context grows by {grain}: {len(inversions)} of "
          f"{sum((i, j + grain) in measured for i, j in grid)} steps {inversions}")
    dp = {}
    for name, m in models.items():
        table = slice_cost_table(lambda k, c, m=m: m.slice_time(k * grain, c * grain), seq_len // grain)
        solution = solve_joint_slicing({1: table}, 1, stages, epsilon=1e-5)
        dp[name] = tuple(x * grain for x in solution.batch_slices[0][1])
        print(f"DP slices ({name} model): {list(dp[name])}")
    slices = dp["last tabulated"]
    on_grid = {share: _grid_latency(measured, slices, stages, share) for share in (False, True)}
    print(f"the measured grid prices {list(slices)}: {on_grid[False] * 1e3:.1f} ms per iteration (Eq. 2.4), "
          f"{on_grid[True] * 1e3:.1f} ms with shared executables (each slice at the longest context of its length)")

    gpt_model = gpt.GPTModel(config)
    batches = [gpt.gpt_batch(config, 1, jax.random.PRNGKey(i), position_ids=True) for i in range(steps + 1)]
    params = gpt_model.init(jax.random.PRNGKey(0), batches[0]["input_ids"])["params"]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(1e-2, momentum=0.9))
    loss_fn = gpt.gpt_loss(gpt_model)

    def step(state, batch):
        loss, grads = al.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    stage_option = al.UniformStageOption(num_stages=stages, submesh_physical_shape=(1, 8 // stages),
                                         submesh_logical_shape=(1, 8 // stages), show_progress=False)
    rows = []
    for name, schedule, token_slices, share in (("1f1b", "1f1b", None, False),
                                                ("terapipe", "terapipe", slices, False),
                                                ("shared", "terapipe", slices, True)):
        method = al.PipeshardParallel(num_micro_batches=1, layer_option=al.AutoLayerOption(layer_num=stages),
                                      stage_option=stage_option, pipeline_schedule=schedule,
                                      token_slices=token_slices, share_slice_executables=share)
        fn = al.parallelize(step, method=method)
        start = time.perf_counter()
        s, _ = fn(state, batches[0])
        jax.block_until_ready(s)
        first = time.perf_counter() - start
        times = []
        for b in batches[1:]:
            start = time.perf_counter()
            s, loss = fn(s, b)
            jax.block_until_ready(s)
            times.append(time.perf_counter() - start)
        stage_executables = getattr(fn.get_executable(state, batches[0]), "num_executables", None)
        rows.append({"schedule": name, "token_slices": list(token_slices or [seq_len]),
                     "terapipe_forward_executables": stage_executables,
                     "median_step_s": statistics.median(times), "steps_s": times, "first_step_s": first})
    base = rows[0]["median_step_s"]
    print(f"{'schedule':>9} {'slices':>28} {'median step':>11} {'vs 1f1b':>7}  first step incl. compile "
          f"(stage executables)")
    for r in rows:
        count = r["terapipe_forward_executables"]
        print(f"{r['schedule']:>9} {str(r['token_slices']):>28} {r['median_step_s']:>10.3f}s "
              f"{base / r['median_step_s']:>6.2f}x  {r['first_step_s']:.1f} s"
              + ("" if count is None else f" ({count} forward + {count} backward)"))
    return {"fits": fits, "timing_noise_max": max(spread.values()),
            "timing_noise_mean": statistics.mean(spread.values()),
            "split_half_floor_max": float(floor.max()), "split_half_floor_mean": float(floor.mean()),
            "grid": per_point, "context_inversions": inversions, "dp_slices": {k: list(v) for k, v in dp.items()},
            "grid_latency_s": on_grid[False], "grid_latency_shared_s": on_grid[True], "runs": rows}


def _monotone_in_context(model, seq_len: int, grain: int) -> bool:
    """Whether the model's slice cost never falls as the context grows, on the DP's grid."""
    return all(model.slice_time(i, j + grain) >= model.slice_time(i, j)
               for i in range(grain, seq_len + 1, grain) for j in range(0, seq_len - i, grain))


def _grid_latency(measured, lengths, stages: int, shared: bool) -> float:
    """Eq. 2.4 of one sequence's slices on the measured grid; ``shared``: each slice padded to the longest
    context among the slices of its length (``share_slice_executables=True``)."""
    starts = [sum(lengths[:n]) for n in range(len(lengths))]
    longest = {length: max(c for c, l in zip(starts, lengths) if l == length) for length in lengths}
    times = [measured[(l, longest[l] if shared else c)] for c, l in zip(starts, lengths)]
    return sum(times) + (stages - 1) * max(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate-row", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--out", default="results/terapipe.json")
    args = parser.parse_args()
    calibration, table_2_1 = part1(args.calibrate_row)
    table_2_3 = part2(calibration)
    measured = None if args.skip_measured else part3(args.seq_len, args.steps)
    write_results(args.out, [{"part": "table_2_1", "efficiency": calibration[0],
                              "saturation_flops": calibration[1], "rows": table_2_1},
                             {"part": "table_2_3", "rows": table_2_3},
                             {"part": "measured_cpu", "result": measured}])


if __name__ == "__main__":
    main()
