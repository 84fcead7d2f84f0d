"""The suites: which models on how many GPUs, and what each row compares.

* ``gpt``: Alpa Table 3.6 (batch 1024). Ours against the best Megatron-LM 3D configuration.
* ``opt``: the OPT family at batch 1024 (2M tokens), on the GPU counts of :data:`OPT_GPUS`; as ``gpt``.
* ``moe``: Alpa Table 3.7 (batch 1024). Ours against ZeRO-2, ZeRO-3 and DeepSpeed-style expert parallelism.
* ``wresnet``: Alpa Table 3.8 (batch 1536). Ours against the equal-layer and equal-operator ablations
  (Fig. 3.9), and the stage shapes of the 16-GPU plan (the dissertation's case study: 4, 4, 8 GPUs).

``--ablations`` adds intra-op-only and inter-op-only plans (Fig. 3.8) to every row.
"""
from __future__ import annotations

import dataclasses
import time

from alpa_like import models
from alpa_like.bench import baselines, megatron, ours
from alpa_like.bench.flops import megatron_step_flops, tflops_per_device
from alpa_like.bench.workloads import Workload, cluster_for, make_workload, micro_batch_count_error, transformer_costs

SUITE_NAMES = ("gpt", "moe", "wresnet", "opt")
OPT_GPUS = {"opt-125m": 1, "opt-350m": 1, "opt-1.3b": 4, "opt-2.7b": 8, "opt-6.7b": 16, "opt-13b": 32,
            "opt-30b": 64, "opt-66b": 128, "opt-175b": 256}
"""GPUs per OPT model: weak scaling like Table 3.6 (175B needs at least 168 V100-16GB for its state alone)."""
GLOBAL_BATCH = {"gpt": 1024, "opt": 1024, "moe": 1024, "wresnet": 1536}
MICRO_BATCHES = {"gpt": 64, "opt": 64, "moe": 64, "wresnet": 32}
"""Micro-batches of every plan of a row (ablations, equal-layer) unless :data:`AUTO_MICRO_BATCHES` says
otherwise."""
AUTO_MICRO_BATCHES = {"gpt": (32, 256, 512, 1024), "opt": (32, 256, 512, 1024), "moe": (64, 128, 256),
                      "wresnet": (24, 32)}
"""The micro-batch counts a row's plans try, keeping the fastest simulated plan: our automatic plan on every
suite, and on ``wresnet`` the equal-layer and equal-operator ablations too (Fig. 3.9 compares stage
partitionings, so each gets its best count from the same grid).

Transformers: the Megatron-LM baseline picks its micro-batch size from a grid too (down to one sequence, i.e.
1024 micro-batches per pipeline), and a deep pipeline's bubble shrinks with more micro-batches (GPT-6.7B on 16
GPUs: 31.99 s at 64, 31.17 s at 256, 30.74 s at 512, the count Megatron-LM's best configuration uses); a
one-stage plan has no bubble and pays a host load per micro-batch, so few are best (GPT-350M on one GPU:
25.5612 s at 32, 25.5616 s at 64, as Megatron-LM's best, b=32, i.e. 32 micro-batches); the expert-parallel
baseline grid-searches its micro-batches as well. MoE stops at 256: MoE-10B on 16 GPUs simulated 6.13, 6.02
and 5.81 s at 64, 128 and 256 micro-batches (33 sublayers; with a layer per block 6.64, 6.69, 6.22 and 6.44 s
at 64-512), and above 512 a micro-batch holds less than one routing group
(:func:`~alpa_like.bench.workloads.micro_batch_count_error`).

Wide-ResNet: 24 and 32, the grid of Alpa's own Wide-ResNet search suite (micro-batches of 64 and 48 images).
At 64 micro-batches a micro-batch of 24 images splits evenly over no mesh of 16 or more devices, so a stage
spanning two nodes cannot be purely data parallel."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    suite: str
    model: str
    gpus: int
    global_batch: int
    num_micro_batches: int
    auto_micro_batches: tuple[int, ...] = ()
    """Micro-batch counts the plans of :data:`AUTO_MICRO_BATCHES` try (the fastest is kept); () means
    ``num_micro_batches``."""
    recompute_aware: bool = False
    """Eq. 3.6's clustering counts recomputation (``AutoLayerOption.recompute_aware``) for every plan of the
    row that uses it (not equal operator); only for workloads with per-layer remat."""

    def __str__(self) -> str:
        return f"{self.model} on {self.gpus} GPUs"


def suite_cases(suite: str, models_filter: list[str] | None = None, micro_batches: int | None = None,
                recompute_aware: bool = False) -> list[Case]:
    """The rows of ``suite`` (optionally only ``models_filter``)."""
    if suite not in SUITE_NAMES:
        raise ValueError(f"suite must be one of {SUITE_NAMES}, got {suite!r}")
    table = {"gpt": models.GPT_TABLE_3_6_GPUS, "moe": models.MOE_TABLE_3_7_GPUS,
             "wresnet": models.WRESNET_TABLE_3_8_GPUS, "opt": OPT_GPUS}[suite]
    if models_filter:
        unknown = sorted(set(models_filter) - set(table))
        if unknown:
            raise ValueError(f"--models: {unknown} not in the {suite} suite; valid: {list(table)}")
    m = micro_batches or MICRO_BATCHES[suite]
    tried = (m,) if micro_batches else AUTO_MICRO_BATCHES.get(suite, (m,))
    return [Case(suite=suite, model=name, gpus=gpus, global_batch=GLOBAL_BATCH[suite], num_micro_batches=m,
                 auto_micro_batches=tried, recompute_aware=recompute_aware)
            for name, gpus in table.items() if not models_filter or name in models_filter]


def step_flops(workload: Workload, totals: baselines.StepTotals) -> float:
    """The FLOPs a row's TFLOP/s divides: Megatron-LM Eq. 3 for GPT/OPT, the traced step otherwise."""
    c = workload.config
    if workload.family == "gpt":
        return megatron_step_flops(batch_size=workload.global_batch, seq_len=c.seq_len, num_layers=c.num_layers,
                                   hidden_size=c.hidden_size, vocab_size=c.vocab_size)
    return totals.step_flops


def run_case(case: Case, preset: str, ablations: bool = False) -> dict:
    """Plans and simulates ``case``: ours, the suite's baselines and ablations; returns one JSON row."""
    start = time.perf_counter()
    workload = make_workload(case.model, case.global_batch, case.recompute_aware)
    cluster = cluster_for(case.gpus, preset)
    m = case.num_micro_batches
    method = ours.pipeshard_method(workload, m)
    sliced = ours.slice_workload(workload, method)
    totals = baselines.step_totals(sliced, workload, m, cluster.compute_rates)
    flops = step_flops(workload, totals)
    row = {"suite": case.suite, "model": case.model, "gpus": case.gpus, "cluster": preset,
           "global_batch": case.global_batch, "micro_batches": m, "step_flops": flops,
           "flops_formula": "Megatron-LM Eq. 3" if workload.family == "gpt" else
           "traced step" + (" (with remat)" if workload.remat else "")}

    def tflops(seconds):
        return None if seconds is None else tflops_per_device(flops, seconds, case.gpus)

    variants = ["auto"]
    if case.suite == "wresnet":
        variants += ["equal layer", "equal operator"]
    if ablations:
        variants += ["intra-op only", "inter-op only"]
    row["ours"] = {}
    counts = case.auto_micro_batches or (m,)
    for variant in variants:
        if variant == "auto" or case.suite == "wresnet":
            summary = _best_plan(variant, workload, cluster, counts, m, sliced)
        else:
            summary = ours.plan_variant(variant, workload, cluster, m, sliced).summary()
        summary["tflops"] = tflops(summary.get("simulated_s"))
        row["ours"][variant] = summary
    row["baselines"] = {}
    if workload.family == "gpt":
        search = megatron.grid_search(transformer_costs(sliced, workload, m, cluster.compute_rates), cluster,
                                     case.global_batch)
        found = megatron.best_replayed(search)
        entry = {"baseline": "megatron", "configs_evaluated": len(search.evaluated), "configs_fitting": search.num_fitting,
                 "configs_replayed": min(search.num_fitting, megatron.REPLAYED_CANDIDATES)}
        if found is not None:
            best, seconds, replayed = found
            entry.update(config=str(best.config), micro_batches=best.num_micro_batches, closed_form_s=best.step_seconds,
                         step_s=seconds, simulated="schedule replay" if replayed else "closed form",
                         memory_gib=best.memory_per_device / 2**30)
        else:
            entry.update(step_s=None, detail="no configuration fits in memory")
        row["baselines"]["megatron"] = entry
    if workload.family == "moe":
        row["baselines"]["zero2"] = baselines.zero_baseline(2, workload, totals, cluster).summary()
        row["baselines"]["zero3"] = baselines.zero_baseline(3, workload, totals, cluster).summary()
        row["baselines"]["expert parallel"] = baselines.expert_parallel_baseline(workload, totals, cluster).summary()
    for entry in row["baselines"].values():
        entry["tflops"] = tflops(entry.get("step_s"))
    row["case_seconds"] = time.perf_counter() - start
    return row


def _best_plan(variant: str, workload: Workload, cluster, counts: tuple[int, ...], m: int, sliced) -> dict:
    """Our plan ``variant`` (:data:`~alpa_like.bench.ours.VARIANTS`) for each micro-batch count in ``counts``
    that keeps the model (:func:`~alpa_like.bench.workloads.micro_batch_count_error`; the step re-traced for
    each count other than ``m``); the summary of the fastest simulated one, with what every count gave."""
    results, skipped = {}, []
    for count in counts:
        error = micro_batch_count_error(workload, count)
        if error is not None:
            skipped.append(error)
            continue
        traced = sliced if count == m else ours.slice_workload(workload, ours.pipeshard_method(workload, count))
        results[count] = ours.plan_variant(variant, workload, cluster, count, traced)
    if not results:
        raise ValueError(f"no micro-batch count of {counts} splits the step of {workload.name}: " + "; ".join(skipped))
    planned = {count: r for count, r in results.items() if r.ok}
    best = min(planned, key=lambda c: planned[c].simulated_seconds) if planned else next(iter(results))
    summary = results[best].summary()
    summary["micro_batches"] = best
    summary["micro_batches_tried"] = {str(c): (r.simulated_seconds if r.ok else None) for c, r in results.items()}
    summary["planning_s"] = sum(r.planning_seconds for r in results.values())
    return summary


def best_baseline(row: dict) -> tuple[str, dict] | None:
    """The fastest baseline of a row that has a step time."""
    timed = [(k, v) for k, v in row["baselines"].items() if v.get("step_s") is not None]
    return min(timed, key=lambda kv: kv[1]["step_s"]) if timed else None
