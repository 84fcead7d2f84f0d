"""Measurements that a GPU cost model is fitted to and checked on: matmul rates by shape, memory bandwidth,
the cost of one more kernel in a program, and whole training steps of many model shapes under ``jax.jit``.

Runs on whatever ``jax.devices()[0]`` is, with only jax, flax, optax and numpy installed. Four parts, each
written to the JSON (``--out``) as soon as it is done, each bounded by ``--time-budget`` (seconds from the
start; a part or case not started by then is left out and listed as skipped):

1. ``matmuls``: ``jnp.dot`` / batched ``dot_general`` of many shapes in float16, bfloat16 and float32
   (JAX's default precision), each one jitted program called back to back without waiting (the device
   queue hides the host's dispatch once a call runs longer than the dispatch); seconds per call, the best of
   three batches of calls.
2. ``bandwidth``: an element-wise ``x * a + b`` (one fused kernel; bytes = read + written) and a row sum,
   over arrays from 4 MiB to 1 GiB.
3. ``kernels``: one program of ``n`` dependent 16x16 matmuls for n = 1 and n = 129: the slope is the cost of
   one more kernel inside an executable.
4. ``steps``: one SGD training step under ``jax.jit`` (float16 activations unless named, float32
   parameters, donated state) for each case of :func:`step_cases` (GPTs of many widths, depths, sequence
   lengths, batches and vocabularies; MoEs; Wide-ResNets); milliseconds per step (median of three rounds),
   compile seconds, and XLA's own count of FLOPs and bytes and of kernels in the compiled program.

The cases are named, plain data, so ``gpu_cost_fit.py`` rebuilds each step's program on any machine from
the JSON and prices it with the cost model.

    python examples/benchmarks/gpu_costs.py --out results/gpu_costs.json
    python examples/benchmarks/gpu_costs.py --parts matmuls kernels --time-budget 30    # a CPU smoke run
"""
import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent))
from _common import write_results  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

from alpa_like import models  # noqa: E402
from alpa_like.models import gpt, moe, wide_resnet  # noqa: E402

PARTS = ("matmuls", "bandwidth", "kernels", "steps")
DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
MIN_BATCH_SECONDS = 0.05
"""A timed batch of calls runs at least this long."""


# -------------------------------------------------------------------------------------------- the cases

def matmul_shapes() -> list[tuple[int, int, int, int]]:
    """``(batch, m, k, n)`` of the timed matrix products (``batch == 0``: a plain 2-D product): squares,
    a transformer's projections (tokens x h -> 3h, 4h, h, vocabulary) and its attention's batched
    products (heads x s x d x s, heads x s x s x d)."""
    squares = [(0, s, s, s) for s in (128, 256, 512, 1024, 2048, 4096, 8192)]
    projections = [(0, t, h, n) for t in (512, 4096, 16384) for h in (768, 2048, 4096)
                   for n in (3 * h, 4 * h)]
    projections += [(0, t, 4 * h, h) for t in (512, 4096, 16384) for h in (768, 2048, 4096)]
    projections += [(0, t, h, 51200) for t in (1024, 8192) for h in (1024, 2560)]
    attention = [(b, s, d, s) for b in (32, 256) for s in (256, 1024, 2048) for d in (64, 128)]
    attention += [(b, s, s, d) for b in (32, 256) for s in (256, 1024) for d in (64, 128)]
    return squares + projections + attention


def step_cases() -> list[dict[str, Any]]:
    """Every timed training step as plain data: ``family`` (gpt, moe, wresnet), ``base`` (a config name),
    ``overrides`` of its fields, ``batch_size`` and ``dtype`` (of the activations)."""
    def g(h, layers, heads, seq, batch, vocab=51200, dtype="float16"):
        return {"family": "gpt", "base": "gpt-350m", "batch_size": batch, "dtype": dtype,
                "overrides": {"hidden_size": h, "num_layers": layers, "num_heads": heads, "seq_len": seq,
                              "vocab_size": vocab}}
    gpts = [
        g(512, 4, 8, 512, 8, vocab=8192), g(768, 4, 12, 1024, 8), g(1024, 4, 16, 1024, 8),
        g(1024, 2, 16, 2048, 4), g(1024, 4, 16, 256, 32), g(1536, 2, 16, 1024, 8, vocab=32000),
        g(2048, 2, 32, 1024, 8), g(2048, 4, 16, 512, 4), g(2048, 2, 32, 2048, 2), g(2048, 2, 32, 1024, 1),
        g(2560, 2, 32, 1024, 8), g(3072, 2, 24, 1024, 4), g(4096, 2, 32, 1024, 8), g(4096, 2, 32, 512, 2),
        g(1024, 4, 16, 1024, 8, dtype="bfloat16"), g(2048, 2, 32, 1024, 8, dtype="float32"),
        g(768, 8, 12, 1024, 16), g(5120, 1, 40, 1024, 4),
    ]

    def m(h, layers, heads, experts, batch, group=2048):
        return {"family": "moe", "base": "moe-380m", "batch_size": batch, "dtype": "float16",
                "overrides": {"hidden_size": h, "num_layers": layers, "num_heads": heads,
                              "num_experts": experts, "expert_group_size": group}}
    moes = [m(768, 2, 16, 8, 8), m(1024, 2, 16, 16, 8), m(2048, 2, 32, 16, 4)]

    def w(layers, base, width, batch, image=224, dtype="float16"):
        return {"family": "wresnet", "base": "wresnet-250m", "batch_size": batch, "dtype": dtype,
                "overrides": {"num_layers": layers, "base_channels": base, "width_factor": width,
                              "image_size": image}}
    wresnets = [w(26, 64, 2, 32), w(50, 160, 2, 16), w(26, 128, 4, 16, image=112)]
    return gpts[:8] + moes[:1] + wresnets[:1] + gpts[8:] + moes[1:] + wresnets[1:]


def case_name(case: dict[str, Any]) -> str:
    c = case_config(case)
    if case["family"] == "wresnet":
        shape = f"l{c.num_layers} c{c.base_channels} w{c.width_factor} img{c.image_size}"
    else:
        shape = f"h{c.hidden_size} l{c.num_layers} s{c.seq_len} v{c.vocab_size}"
        if case["family"] == "moe":
            shape += f" e{c.num_experts}"
    return f"{case['family']} {shape} b{case['batch_size']} {case['dtype']}"


def case_config(case: dict[str, Any]):
    """The model config of ``case``: its base config with the overrides and the activation dtype."""
    return dataclasses.replace(models.get_config(case["base"]), dtype=DTYPES[case["dtype"]], **case["overrides"])


def build_step(case: dict[str, Any], rng: jax.Array, grad=jax.value_and_grad):
    """``(step, state, batch)`` of ``case``: ``step(state, batch) -> (state, loss)``, plain SGD, unjitted,
    differentiating with ``grad`` (``jax.value_and_grad`` or ``al.value_and_grad``); ``state`` and
    ``batch`` are arrays (on the default device)."""
    config = case_config(case)
    init_rng, batch_rng = jax.random.split(rng)
    if case["family"] == "wresnet":
        model = wide_resnet.WideResNet(config)
        batch = wide_resnet.wresnet_batch(config, case["batch_size"], batch_rng)
        variables = jax.jit(lambda r, x: model.init(r, x, train=False))(init_rng, batch["images"])
        loss_fn = wide_resnet.wresnet_loss(model)
        state = _sgd_state(variables["params"], {"batch_stats": variables.get("batch_stats", {})})

        def step(state, batch):
            (loss, stats), grads = grad(loss_fn, has_aux=True)(
                state.params, state.extra["batch_stats"], batch)
            return state.apply_gradients(grads=grads).replace(extra={"batch_stats": stats}), loss
        return step, state, batch
    if case["family"] == "moe":
        model, loss_fn = moe.MoEModel(config), None
        batch = moe.moe_batch(config, case["batch_size"], batch_rng)
        loss_fn = moe.moe_loss(model)
    else:
        model = gpt.GPTModel(config)
        batch = gpt.gpt_batch(config, case["batch_size"], batch_rng)
        loss_fn = gpt.gpt_loss(model)
    params = jax.jit(lambda r, ids: model.init(r, ids)["params"])(init_rng, batch["input_ids"])
    state = _sgd_state(params, {})

    def step(state, batch):
        loss, grads = grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss
    return step, state, batch


class _State(train_state.TrainState):
    extra: Any = None


def _sgd_state(params, extra) -> _State:
    state = _State.create(apply_fn=None, params=params, tx=optax.sgd(1e-4), extra=extra)
    return state.replace(step=jnp.zeros((), jnp.int32))


# ---------------------------------------------------------------------------------------------- timing

def seconds_per_call(fn, *args) -> float:
    """Seconds per call of ``fn(*args)`` called back to back (results dropped), the best of three batches
    long enough to time (``MIN_BATCH_SECONDS``)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - start, 1e-6)
    calls = max(1, min(1000, int(MIN_BATCH_SECONDS / one)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
        del out
    return best


def time_matmuls(deadline: float) -> list[dict]:
    rows = []
    key = jax.random.PRNGKey(0)
    for dtype_name in ("float16", "bfloat16", "float32"):
        for b, m, k, n in matmul_shapes():
            if time.perf_counter() > deadline:
                return rows
            dtype = DTYPES[dtype_name]
            lhs_shape, rhs_shape = ((b, m, k), (b, k, n)) if b else ((m, k), (k, n))
            lhs = jax.random.normal(key, lhs_shape, dtype)
            rhs = jax.random.normal(jax.random.fold_in(key, 1), rhs_shape, dtype)
            fn = jax.jit(jnp.matmul)
            seconds = seconds_per_call(fn, lhs, rhs)
            flops = 2.0 * max(b, 1) * m * k * n
            nbytes = (lhs.size + rhs.size + max(b, 1) * m * n) * lhs.dtype.itemsize
            rows.append({"dtype": dtype_name, "batch": b, "m": m, "k": k, "n": n, "seconds": seconds,
                         "flops": flops, "bytes": nbytes, "tflops": flops / seconds / 1e12})
            del lhs, rhs
    return rows


def time_bandwidth(deadline: float) -> list[dict]:
    rows = []
    for log2 in range(20, 29):  # float32 elements: 4 MiB .. 1 GiB
        if time.perf_counter() > deadline:
            break
        x = jnp.ones((2 ** (log2 - 10), 1024), jnp.float32) * 0.5
        for op, fn, nbytes in (("axpb", jax.jit(lambda x: x * 1.5 + 0.25), 2 * x.nbytes),
                               ("row_sum", jax.jit(lambda x: jnp.sum(x, axis=1)), x.nbytes + x.nbytes // 1024)):
            seconds = seconds_per_call(fn, x)
            rows.append({"op": op, "elements": x.size, "bytes": nbytes, "seconds": seconds,
                         "gb_per_s": nbytes / seconds / 1e9})
        del x
    return rows


def time_kernels() -> list[dict]:
    """Seconds of one program of ``n`` dependent 16x16 float32 matmuls, for two ``n``."""
    rows = []
    for n in (1, 129):
        ws = jax.random.normal(jax.random.PRNGKey(2), (n, 16, 16), jnp.float32) * 0.1
        x = jnp.ones((16, 16), jnp.float32)

        def chain(x, ws, n=n):
            for i in range(n):
                x = jnp.tanh(x @ ws[i])
            return x
        rows.append({"dependent_matmuls": n, "seconds": seconds_per_call(jax.jit(chain), x, ws)})
    per_kernel = (rows[1]["seconds"] - rows[0]["seconds"]) / (rows[1]["dependent_matmuls"] - 1)
    return rows + [{"seconds_per_extra_matmul": per_kernel}]


def kernel_count(compiled) -> int:
    """Instructions of the compiled program's entry computation that launch work (fusions, library calls,
    copies, collectives, loops), not the bookkeeping ones."""
    bookkeeping = ("parameter(", "get-tuple-element(", "tuple(", "constant(", "bitcast(", "ROOT tuple")
    entry, count = False, 0
    for line in compiled.as_text().splitlines():
        if line.startswith("ENTRY"):
            entry = True
            continue
        if entry:
            if line.startswith("}"):
                break
            if "=" in line and not any(b in line for b in bookkeeping):
                count += 1
    return count


def time_steps(deadline: float, cases: list[dict], rounds: int = 3) -> list[dict]:
    rows = []
    for i, case in enumerate(cases):
        row = {"case": case, "name": case_name(case)}
        rows.append(row)
        if time.perf_counter() > deadline:
            row["error"] = "skipped: time budget spent"
            continue
        try:
            step, state, batch = build_step(case, jax.random.PRNGKey(i))
            start = time.perf_counter()
            compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
            row["compile_s"] = time.perf_counter() - start
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            row["xla_flops"] = float((cost or {}).get("flops", float("nan")))
            row["xla_bytes_accessed"] = float((cost or {}).get("bytes accessed", float("nan")))
            row["kernels"] = kernel_count(compiled)
            state, loss = compiled(state, batch)
            jax.block_until_ready(loss)
            start = time.perf_counter()
            state, loss = compiled(state, batch)
            jax.block_until_ready(loss)
            steps = max(1, min(50, int(0.3 / max(time.perf_counter() - start, 1e-6))))
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(steps):
                    state, loss = compiled(state, batch)
                jax.block_until_ready((state, loss))
                times.append((time.perf_counter() - start) / steps)
            row.update(step_s=statistics.median(times), round_step_s=times, steps_per_round=steps)
            print(f"{row['name']:48} {row['step_s'] * 1e3:9.3f} ms  compile {row['compile_s']:5.1f} s  "
                  f"{row['kernels']} kernels", flush=True)
        except Exception as e:  # noqa: BLE001  (reported; the other cases still run)
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
            print(f"{row['name']:48} failed: {row['error'][:200]}", flush=True)
        finally:
            state = batch = compiled = None
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--time-budget", type=float, default=200.0)
    parser.add_argument("--out", default="results/gpu_costs.json")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.time_budget
    d = jax.devices()[0]
    results: dict[str, Any] = {"device": {"platform": d.platform, "device_kind": d.device_kind,
                                          "jax": jax.__version__, "python": sys.version.split()[0]}}
    print(f"{d.device_kind} ({d.platform}), jax {jax.__version__}", flush=True)
    if "kernels" in args.parts:
        results["kernels"] = time_kernels()
        print(f"one more kernel: {results['kernels'][-1]['seconds_per_extra_matmul'] * 1e6:.2f} us", flush=True)
        write_results(args.out, results)
    if "bandwidth" in args.parts:
        results["bandwidth"] = time_bandwidth(deadline)
        best = max((r["gb_per_s"] for r in results["bandwidth"]), default=float("nan"))
        print(f"bandwidth: best {best:.0f} GB/s", flush=True)
        write_results(args.out, results)
    if "matmuls" in args.parts:
        results["matmuls"] = time_matmuls(deadline)
        for dt in DTYPES:
            best = max((r["tflops"] for r in results["matmuls"] if r["dtype"] == dt), default=float("nan"))
            print(f"matmul {dt}: best {best:.0f} TFLOP/s over {len(results['matmuls'])} rows", flush=True)
        write_results(args.out, results)
    if "steps" in args.parts:
        results["steps"] = time_steps(deadline, step_cases())
    results["wall_s"] = time.perf_counter() - start
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
