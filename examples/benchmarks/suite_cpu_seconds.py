"""CPU seconds of one GPT-suite row (``python -m alpa_like.bench gpt``'s ``run_case``), with the bench's two
speed-ups (``after``) or without them (``before``: FREE instructions emitted before simulating, Python's cyclic
garbage collector left on). Wall time on a shared machine follows the other jobs; CPU seconds (this process
plus its ILP worker processes) much less. Prints one JSON line per run, with the row's simulated steps so
that the two modes can be checked to give the same results.

    python examples/benchmarks/suite_cpu_seconds.py gpt-15b before
    python examples/benchmarks/suite_cpu_seconds.py gpt-15b after
"""
import argparse
import contextlib
import json
import resource
import time

from alpa_like.bench import ours, suites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model of the gpt suite, e.g. gpt-15b")
    parser.add_argument("mode", choices=("before", "after"))
    args = parser.parse_args()
    if args.mode == "before":
        emit = ours.emit_programs
        ours.emit_programs = lambda *a, **k: emit(*a, **{**k, "free_buffers": True})
        ours.cyclic_gc_paused = contextlib.nullcontext
    case = suites.suite_cases("gpt", [args.model])[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    row = suites.run_case(case, "p3.16xlarge")
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    auto = row["ours"]["auto"]
    print(json.dumps({"model": args.model, "mode": args.mode, "wall_s": round(time.perf_counter() - start, 1),
                      "cpu_s": round(time.process_time() - cpu_start + workers.ru_utime + workers.ru_stime, 1),
                      "children_cpu_s": round(workers.ru_utime + workers.ru_stime, 1),
                      "simulated_s": auto["simulated_s"], "tried": auto["micro_batches_tried"]}))


if __name__ == "__main__":
    main()
