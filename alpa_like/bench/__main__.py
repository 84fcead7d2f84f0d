"""``python -m alpa_like.bench``: the benchmark suite.

    python -m alpa_like.bench gpt --cluster p3.16xlarge            # Table 3.6 vs Megatron-LM, simulated
    python -m alpa_like.bench moe --plot                           # Table 3.7 vs ZeRO-2/3, expert parallel
    python -m alpa_like.bench wresnet --ablations                  # Table 3.8, equal layer/operator, Fig. 3.8
    python -m alpa_like.bench opt --models opt-125m opt-1.3b       # any subset of a suite
    python -m alpa_like.bench gpt --backend local                  # measured on this machine's devices
    python -m alpa_like.bench opt --backend ray                    # measured on a local 2-node Ray cluster
    python -m alpa_like.bench repro                                # the seeds' numbers reproduced
    python -m alpa_like.bench docs                                 # docs/benchmarks.md from results/

Each suite prints a progress bar per case and a table, and writes its JSON rows to
``results/bench_<suite>[_<backend>].json`` (``--out`` to change); ``--plot`` also writes a PNG chart.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

from alpa_like.compiler.optional_imports import require

SUITES = ("gpt", "moe", "wresnet", "opt")
COMMANDS = SUITES + ("repro", "docs")
CLUSTERS = ("p3.16xlarge", "dgx-a100", "h100", "h200")
BACKEND_NAMES = ("simulate", "local", "ray")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m alpa_like.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=COMMANDS, help="a suite, 'repro' or 'docs'")
    parser.add_argument("--cluster", default="p3.16xlarge", choices=CLUSTERS,
                        help="ClusterSpec preset the simulated backend plans for (default p3.16xlarge)")
    parser.add_argument("--backend", default="simulate", choices=BACKEND_NAMES,
                        help="simulate: plan and simulate the suite's sizes; local/ray: run small models and measure")
    parser.add_argument("--address", help="--backend ray: the Ray cluster's address (host:port or 'auto'); "
                        "default: a local cluster of 2 Ray nodes started for the run")
    parser.add_argument("--models", nargs="*", help="only these models of the suite")
    parser.add_argument("--micro-batches", type=int, help="micro-batches of our plans (default per suite)")
    parser.add_argument("--ablations", action="store_true", help="add intra-op-only and inter-op-only plans")
    parser.add_argument("--recompute-aware-layers", action="store_true",
                        help="Eq. 3.6's tie-break counts what rematerialized layers recompute "
                             "(AutoLayerOption.recompute_aware)")
    parser.add_argument("--plot", action="store_true", help="write a PNG chart beside the JSON")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measured method (local/ray)")
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--update", action="store_true",
                        help="replace only these models' rows in an existing results file (each row keeps the "
                             "command that made it)")
    parser.add_argument("--results-dir", default="results", help="where results are written and read")
    args = parser.parse_args(argv)
    if args.micro_batches is not None and args.micro_batches < 1:
        parser.error(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.address is not None and args.backend != "ray":
        parser.error(f"--address is for --backend ray, got --backend {args.backend}")
    if args.command in ("repro", "docs") and args.backend != "simulate":
        parser.error(f"{args.command} has no --backend (it is analytic / reads saved results)")
    return args


def _progress(items, desc):
    tqdm = require("tqdm", "python -m alpa_like.bench's progress bars").tqdm
    return tqdm(items, desc=desc, unit="case", file=sys.stderr, dynamic_ncols=True)


def run_simulated(args) -> int:
    from alpa_like.bench import report, suites

    cases = suites.suite_cases(args.command, args.models, args.micro_batches, args.recompute_aware_layers)
    rows = []
    bar = _progress(cases, f"{args.command} on {args.cluster}")
    for case in bar:
        bar.set_postfix_str(str(case))
        rows.append(suites.run_case(case, args.cluster, ablations=args.ablations))
    command = "python -m alpa_like.bench " + " ".join(sys.argv[1:])
    for row in rows:
        row["command"] = command
    out = args.out or os.path.join(args.results_dir, f"bench_{args.command}.json")
    if args.update and os.path.exists(out):
        rows = report.merge_rows(out, rows, [c.model for c in suites.suite_cases(args.command)])
    lines = report.table(rows)
    print(f"\n{args.command} suite, simulated {args.cluster} (TFLOP/s per GPU; {rows[0]['flops_formula']} FLOPs)")
    print(report.format_terminal(lines))
    print(f"wrote {report.write_json(out, rows, suite=args.command, cluster=args.cluster, backend='simulate')}")
    if args.plot:
        png = os.path.splitext(out)[0] + ".png"
        print(f"wrote {report.plot(rows, png, f'{args.command}: simulated {args.cluster}')}")
    return 0


def run_measured(args) -> int:
    from alpa_like.bench import backends, report

    runner = backends.BACKENDS[args.backend]
    if args.backend == "ray":
        runner = functools.partial(runner, address=args.address)
    workload = backends.local_workload(args.command)
    rows = []
    bar = _progress(backends.measured_methods(workload), f"{workload.name} on {args.backend}")
    for method in bar:
        bar.set_postfix_str(type(method).__name__)
        try:
            m = runner(workload, method, args.steps)
        except backends.BackendUnavailable as e:
            print(f"skipped: {e}", file=sys.stderr)
            continue
        rows.append({"suite": args.command, "model": workload.name, "batch": workload.global_batch,
                     "backend": args.backend, "command": "python -m alpa_like.bench " + " ".join(sys.argv[1:]),
                     **m.summary()})
    lines = [["method", "devices", "measured ms", "predicted ms", "predicted/measured", "measured TFLOP/s per device"]]
    lines += [[r["method"], f"{r['num_devices']} on {r['num_nodes']} node(s)", f"{r['measured_s'] * 1e3:.1f}",
               f"{r['predicted_s'] * 1e3:.2f}", f"{r['predicted_over_measured']:.2f}",
               f"{r['measured_tflops_per_device']:.4f}"] for r in rows]
    print(f"\n{workload.name}, batch {workload.global_batch}, {args.backend} backend, median of {args.steps} steps")
    print(report.format_terminal(lines))
    for r in rows:
        if r["measured_s_by_kind"]:
            kinds = ", ".join(f"{kind} {seconds * 1e3:.1f} ({r['predicted_s_by_kind'].get(kind, 0.0) * 1e3:.1f})"
                              for kind, seconds in sorted(r["measured_s_by_kind"].items()))
            print(f"{r['method']}, one profiled step, ms per instruction kind over all meshes, measured "
                  f"(predicted): {kinds}")
    out = args.out or os.path.join(args.results_dir, f"bench_{args.command}_{args.backend}.json")
    print(f"wrote {report.write_json(out, rows, suite=args.command, backend=args.backend)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "local":  # before jax is imported: the 8 virtual CPU devices of the tests
        flag = "--xla_force_host_platform_device_count=8"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    if args.command == "repro":
        from alpa_like.bench import repro
        return repro.main(args)
    if args.command == "docs":
        from alpa_like.bench import docs
        return docs.main(args)
    if args.backend == "simulate":
        return run_simulated(args)
    return run_measured(args)


if __name__ == "__main__":
    sys.exit(main())
