"""Exports of a schedule :class:`~alpa_like.compiler.schedules.Timeline`: Chrome/Perfetto trace events and a
PNG drawing. Both read only the timeline's spans, so measured timelines can use them too."""
from __future__ import annotations

import json

from alpa_like.compiler.optional_imports import require
from alpa_like.compiler.schedules import Phase, Timeline

# Megatron-LM Fig. 3/4 colours: forward blue, backward green (weight gradients of a split backward
# orange); later local stages (chunks) lighter.
_COLOURS = {Phase.F: ((0.12, 0.35, 0.75), (0.55, 0.72, 0.95)),
            Phase.B: ((0.15, 0.55, 0.25), (0.60, 0.85, 0.62)),
            Phase.W: ((0.80, 0.45, 0.10), (0.95, 0.75, 0.50))}


def _shade(phase: Phase, chunk: int, chunks: int) -> tuple[float, float, float]:
    dark, light = _COLOURS[phase]
    w = chunk / (chunks - 1) if chunks > 1 else 0.0
    return tuple(d + w * (lt - d) for d, lt in zip(dark, light))  # type: ignore[return-value]


def chrome_trace_events(timeline: Timeline, *, us_per_unit: float = 1000.0) -> list[dict]:
    """Trace events: one complete (``"X"``) event per task on track ``tid = mesh`` of process 0, plus
    metadata (``"M"``) events naming the process and the tracks. Times are ``us_per_unit`` us per unit."""
    if not us_per_unit > 0:
        raise ValueError(f"us_per_unit must be positive, got {us_per_unit!r}")
    events: list[dict] = [{"ph": "M", "pid": 0, "tid": 0, "name": "process_name",
                           "args": {"name": f"schedule {timeline.name}"}}]
    events += [{"ph": "M", "pid": 0, "tid": mesh, "name": "thread_name", "args": {"name": f"mesh{mesh}"}}
               for mesh in range(timeline.num_meshes)]
    for span in timeline.spans:
        task = span.task
        events.append({
            "ph": "X", "pid": 0, "tid": int(span.mesh), "name": str(task),
            "cat": "forward" if task.phase == Phase.F else "backward",
            "ts": float(span.start) * us_per_unit, "dur": float(span.end - span.start) * us_per_unit,
            "args": {"stage": int(task.stage), "micro_batch": int(task.micro_batch), "phase": str(task.phase),
                     "start": str(span.start), "end": str(span.end)}})
    return events


def write_chrome_trace(timeline: Timeline, path: str, *, us_per_unit: float = 1000.0) -> None:
    """Write :func:`chrome_trace_events` as ``{"traceEvents": [...]}`` JSON to ``path``."""
    with open(path, "w") as f:
        json.dump({"traceEvents": chrome_trace_events(timeline, us_per_unit=us_per_unit),
                   "displayTimeUnit": "ms"}, f)


def plot_timeline(timeline: Timeline, path: str) -> None:
    """Draw one row per mesh (mesh 0 on top), one box per task labelled with its micro-batch; forward blue,
    backward green, a mesh's later stages lighter; idle time stays white. Writes a PNG to ``path``."""
    require("matplotlib", "plot_timeline")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    makespan = float(timeline.makespan) or 1.0
    fig = Figure(figsize=(min(4 + 0.35 * makespan, 40), 0.8 + 0.45 * timeline.num_meshes), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for span in timeline.spans:
        task, start, width = span.task, float(span.start), float(span.end - span.start)
        chunk = task.stage // timeline.num_meshes
        colour = _shade(task.phase, chunk, max(timeline.num_stages // timeline.num_meshes, 1))
        ax.broken_barh([(start, width)], (span.mesh - 0.4, 0.8), facecolors=colour, edgecolors="black",
                       linewidth=0.5)
        ax.text(start + width / 2, span.mesh, str(task.micro_batch), ha="center", va="center", fontsize=7,
                color="white" if 2 * chunk < max(timeline.num_stages // timeline.num_meshes, 1) else "black")
    ax.set_xlim(0, makespan)
    ax.set_ylim(timeline.num_meshes - 0.5, -0.5)
    ax.set_yticks(range(timeline.num_meshes), [f"mesh{i}" for i in range(timeline.num_meshes)])
    ax.set_xlabel("time")
    bubble = float(timeline.bubble_fraction())
    ax.set_title(f"{timeline.name}: {timeline.num_stages} stages on {timeline.num_meshes} meshes, "
                 f"bubble {bubble:.1%} of the step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
