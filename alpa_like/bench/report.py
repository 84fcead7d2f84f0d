"""Results out: the terminal table, the JSON file, PNG charts (Fig. 3.7 style) and docs/benchmarks.md.

Everything here reads the plain JSON rows that :mod:`alpa_like.bench.suites` produces, so the charts and
the documentation can be regenerated from saved results without planning again.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from alpa_like.compiler.optional_imports import require


def write_json(path: str | Path, rows: list, **meta) -> Path:
    """Writes ``{"command": ..., **meta, "rows": rows}`` to ``path`` (parents created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python -m alpa_like.bench " + " ".join(sys.argv[1:]), **meta,
                               "rows": rows}, indent=1, default=str))
    return out


def merge_rows(path: str | Path, new_rows: list, order: Sequence[str]) -> list:
    """The rows of the results file at ``path`` with those of ``new_rows``' models replaced, in ``order``."""
    data = json.loads(Path(path).read_text())
    by_model = {r["model"]: dict(r, command=r.get("command", data.get("command"))) for r in data["rows"]}
    by_model.update({r["model"]: r for r in new_rows})
    return [by_model[m] for m in order if m in by_model]


def _fmt(value, spec=".1f", missing="-") -> str:
    return missing if value is None else format(value, spec)


def plan_text(entry: dict) -> str:
    """``2 st [13, 11] on (1,2) x2 as 1x2 x2``, or ``no plan: <first line of the planner's message>``;
    repeats of a neighbour are counted (``1 x44``), and ``, B=256`` gives the micro-batches when the row
    chose them."""
    if entry.get("error"):
        first = entry["error"].splitlines()[0]
        return "no plan: " + (first[:70] + "..." if len(first) > 70 else first)
    layers = _runs([str(n) for n in entry["layers_per_stage"]], ", ")
    subs = _runs([f"({a},{b})" for a, b in entry["submeshes"]], ",")
    logical = _runs([f"{a}x{b}" for a, b in entry["logical_meshes"]], ",")
    micro = f", B={entry['micro_batches']}" if "micro_batches" in entry else ""
    return f"{entry['stages']} st [{layers}] on {subs} as {logical}{micro}"


def _runs(items: Sequence[str], sep: str) -> str:
    """``["1", "1", "1", "2"]`` -> ``"1 x3, 2"``: consecutive repeats counted.

    >>> _runs(["3", "1", "1", "2"], ", ")
    '3, 1 x2, 2'
    """
    out: list[str] = []
    count = 0
    for k, item in enumerate(items):
        count += 1
        if k + 1 == len(items) or items[k + 1] != item:
            out.append(item if count == 1 else f"{item} x{count}")
            count = 0
    return sep.join(out)


def comparators(row: dict) -> list[tuple[str, dict]]:
    """The row's other systems, in display order: ablations of ours, then baselines."""
    others = [(name, e) for name, e in row["ours"].items() if name != "auto"]
    return others + list(row["baselines"].items())


def ratio(ours: float | None, other: float | None) -> float | None:
    """``ours / other`` of two TFLOP/s values (= the other's step time over ours); None when either is missing."""
    return None if not ours or not other else ours / other


def table(rows: Sequence[dict]) -> list[list[str]]:
    """Header and one line per row: model, GPUs, our plan and TFLOP/s, then per comparator its TFLOP/s
    (and, for Megatron-LM, its configuration) and our ratio to it."""
    names = []
    for row in rows:
        for name, _ in comparators(row):
            if name not in names:
                names.append(name)
    header = ["model", "GPUs", "our plan", "ours s", "ours TFLOP/s"]
    for name in names:
        if name == "megatron":
            header += ["Megatron-LM config", "Megatron s", "Megatron TFLOP/s", "ours/Megatron"]
        else:
            header += [f"{name} TFLOP/s", f"ours/{name}"]
    lines = [header]
    for row in rows:
        auto = row["ours"]["auto"]
        line = [row["model"], str(row["gpus"]), plan_text(auto), _fmt(auto.get("simulated_s"), ".2f"),
                _fmt(auto.get("tflops"))]
        entries = dict(comparators(row))
        for name in names:
            e = entries.get(name, {})
            tf = e.get("tflops")
            if name == "megatron":
                line += [e.get("config") or e.get("detail", "-"), _fmt(e.get("step_s"), ".2f"), _fmt(tf)]
            else:
                line.append(_fmt(tf) if tf is not None else ("no plan" if e.get("error") or "detail" in e else "-"))
            line.append(_fmt(ratio(auto.get("tflops"), tf), ".2f") + ("x" if ratio(auto.get("tflops"), tf) else ""))
        lines.append(line)
    return lines


def format_terminal(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_markdown(lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
    out += ["| " + " | ".join(cell.replace("|", "/") for cell in line) + " |" for line in lines[1:]]
    return "\n".join(out)


def plot(rows: Sequence[dict], path: str | Path, title: str) -> Path:
    """Aggregate throughput (PFLOP/s over all GPUs) against the GPU count, one line per system, as the
    dissertation's Fig. 3.7; systems without a plan at a size leave a gap."""
    matplotlib = require("matplotlib", "the benchmark report's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        entries = [("ours", row["ours"]["auto"])] + comparators(row)
        for name, e in entries:
            if e.get("tflops"):
                systems.setdefault(name, []).append((row["gpus"], e["tflops"] * row["gpus"] / 1e3))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in systems.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=name, linewidth=2.5 if name == "ours" else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("throughput (PFLOP/s, simulated)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
