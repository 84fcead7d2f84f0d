"""How a plan reads: the table ``print(plan)`` shows (:func:`format_plan`), with the method summarised in its
header (:func:`method_summary`), leaves that differ only in a layer number folded into one row
(:func:`fold_names`), and the memory verdict (:func:`memory_message`).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from alpa_like.compiler.options import OPTION_CLASSES
from alpa_like.compiler.schedules import ScheduleName
from alpa_like.compiler.token_slicing import format_scheme
from alpa_like.compiler.trace import below_root, updated_paths

if TYPE_CHECKING:
    from alpa_like.compiler.plan import OpPlan, ParallelPlan, SolverReport, StagePlan, TensorPlan
    from alpa_like.compiler.sharding_spec import ShardingSpec


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _candidates_text(report: SolverReport) -> str:
    """The measured plan selection: one row per candidate plan."""
    distinct = sum(c.same_as is None for c in report.candidates)
    rows = []
    for i, c in enumerate(report.candidates):
        measured = f"same program as #{c.same_as}" if c.measured_seconds is None else format_seconds(
            c.measured_seconds)
        rows.append([str(i), "x".join(map(str, c.logical_mesh_shape)), c.cost_model,
                     "on" if c.weight_update_sharding else "off", format_seconds(c.objective), measured,
                     "chosen" if c.chosen else ""])
    head = (f"  plan selection: measured, {len(report.candidates)} candidates ({distinct} distinct programs) "
            f"compiled and timed on the devices in {report.selection_seconds:.1f} s")
    return head + "\n" + format_table(["#", "view", "cost model", "weight-update sharding", "objective",
                                        "measured step", ""], rows, indent="    ")


_METHOD_CHARS = 200


def method_summary(method: str, limit: int = _METHOD_CHARS) -> str:
    """A method's repr without the options left at their defaults, at most ``limit`` characters (cut with
    ``...``): the plan's header, while ``ParallelPlan.method`` keeps the whole repr.

    An option is left out when its value reads as the summary of its field's default in the method or
    option dataclass of that name (:data:`~alpa_like.compiler.options.OPTION_CLASSES`; nested options are
    summarised the same way); text that is not such a repr is only cut.

    >>> method_summary("ShardParallel(num_micro_batches=1, auto_sharding_option=AutoShardingOption("
    ...                "solver_time_limit=60.0, solver='cbc'))")
    "ShardParallel(auto_sharding_option=AutoShardingOption(solver='cbc'))"
    """
    try:
        summary = _call_summary(method, ast.parse(method, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        summary = method
    return summary if len(summary) <= limit else summary[:limit - 3] + "..."


def _call_summary(text: str, node: ast.expr) -> str:
    """The source of ``node`` in ``text``, a keyword-only call of an option dataclass without the keywords
    at their defaults."""
    source = ast.get_source_segment(text, node) or ""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return source
    defaults = _option_defaults(node.func.id)
    kept = []
    for keyword in node.keywords:
        value = _call_summary(text, keyword.value)
        if keyword.arg is None:
            kept.append(f"**{value}")
        elif defaults.get(keyword.arg) != value:
            kept.append(f"{keyword.arg}={value}")
    return f"{node.func.id}({', '.join(kept)})"


_OPTION_CLASSES: dict[str, type] = {cls.__name__: cls for cls in OPTION_CLASSES}
"""The method and option dataclasses whose reprs plans hold, by name."""


@functools.cache
def _option_defaults(name: str) -> dict[str, str]:
    """Summaries of the default of every field of the option dataclass ``name`` that has one."""
    cls = _OPTION_CLASSES.get(name)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return {}
    defaults = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        text = repr(default)
        try:
            defaults[f.name] = _call_summary(text, ast.parse(text, mode="eval").body)
        except SyntaxError:  # a repr that is not an expression, e.g. <function ...>: always shown
            continue
    return defaults


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Left-aligned text columns separated by two spaces."""
    widths = [max(len(str(r[i])) for r in (headers, *rows)) for i in range(len(headers))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in (headers, *rows)]
    return "\n".join(indent + line for line in lines)


def partition_spec_str(spec: ShardingSpec | None, axis_names: Sequence[str]) -> str:
    if spec is None:
        return "chosen by XLA"
    if not spec.axes:
        return "P()"
    return str(spec.to_partition_spec(tuple(axis_names)))


_NAMED_NUMBER = re.compile(r"(.*[A-Za-z]_)([0-9]+)")
_SLOT = "\0"


def layer_template(name: str) -> tuple[str, tuple[str, ...]]:
    """``name`` with its layer numbers cut out, and the numbers, so that the layers of one model fold into one
    row whatever their naming: the ``3`` of a ``block_3`` or ``layers_3`` component (Flax) anywhere, and a
    whole numeric component (the ``0`` of ``h.0.attn``, Hugging Face's pytree paths and name stacks) below the
    first level. A numeric component right under the root is an argument's or output's position (the ``1`` of
    ``out.1.loss``), never a layer. Components are separated by ``.`` (paths) or ``/`` (name stacks). The
    numbers' places in the template are marked by ``_SLOT``.
    """
    parts = re.split(r"([./])", name)  # components at even positions, separators between them
    numbers = []
    for i in range(0, len(parts), 2):
        named = _NAMED_NUMBER.fullmatch(parts[i])
        if named:
            numbers.append(named.group(2))
            parts[i] = named.group(1) + _SLOT
        elif re.fullmatch(r"[0-9]+", parts[i]) and i >= 4:
            numbers.append(parts[i])
            parts[i] = _SLOT
    return "".join(parts), tuple(numbers)


def fold_names(names: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Groups of ``names`` that differ only in layer numbers (:func:`layer_template`): ``(shown name, indices of
    the members)`` in order of first appearance. A group of two or more shows ``*`` where its members' numbers
    differ and ``(xN)`` after the name; a name alone is shown as it is.

    >>> fold_names(["p.h.0.w", "p.h.1.w", "p.layers_0", "p.layers_2", "out.1.loss", "out.2.loss"])
    [('p.h.*.w (x2)', [0, 1]), ('p.layers_* (x2)', [2, 3]), ('out.1.loss', [4]), ('out.2.loss', [5])]
    """
    groups: dict[str, list[int]] = {}
    templates = [layer_template(name) for name in names]
    for i, (template, _) in enumerate(templates):
        groups.setdefault(template, []).append(i)
    folded = []
    for template, members in groups.items():
        if len(members) == 1:
            folded.append((names[members[0]], members))
            continue
        columns = zip(*(templates[i][1] for i in members), strict=True)
        shown = [numbers[0] if len(set(numbers)) == 1 else "*" for numbers in columns]
        pieces = template.split(_SLOT)
        name = pieces[0] + "".join(n + piece for n, piece in zip(shown, pieces[1:], strict=True))
        folded.append((f"{name} (x{len(members)})", members))
    return folded


def _fold(items: Sequence[Any], name_of, key_of, group_layers: bool) -> list[tuple[str, list[Any]]]:
    """``(shown name, members)`` of ``items`` folded by :func:`fold_names` among items of equal ``key_of``."""
    if not group_layers:
        return [(name_of(x), [x]) for x in items]
    by_key: dict[Any, list[Any]] = {}
    for x in items:
        by_key.setdefault(key_of(x), []).append(x)
    rows = []
    for members in by_key.values():
        rows += [(name, [members[i] for i in ids]) for name, ids in fold_names([name_of(m) for m in members])]
    first = {id(x): i for i, x in enumerate(items)}
    return sorted(rows, key=lambda row: first[id(row[1][0])])


def _tensor_rows(tensors: Sequence[TensorPlan], axis_names: Sequence[str], group_layers: bool):
    """One row per tensor, leaves that differ only in a layer number and agree in shape, dtype, role and spec
    folded into one (bytes summed)."""
    def key(t: TensorPlan):
        return t.shape, t.dtype, t.role, None if t.spec is None else str(t.spec)
    rows = []
    for path, members in _fold(tensors, lambda t: t.path, key, group_layers):
        t = members[0]
        rows.append([path, "x".join(map(str, t.shape)) or "scalar", t.dtype, t.role,
                     "-" if t.spec is None else (str(t.spec) or "scalar"),
                     partition_spec_str(t.spec, axis_names), format_bytes(t.bytes_per_device * len(members))])
    return rows


def mirrored_outputs(stage: StagePlan) -> list[TensorPlan]:
    """Outputs laid out exactly like the input they update (``out.0.params.w`` like ``state.params.w``)."""
    inputs = {(below_root(t.path), t.shape, t.spec) for t in stage.inputs}
    return [t for t in stage.outputs if any((rest, t.shape, t.spec) in inputs for rest in updated_paths(t.path))]


def _op_rows(ops: Sequence[OpPlan], group_layers: bool) -> list[OpPlan]:
    """Ops that differ only in a layer number folded into one row (seconds summed, name marked ``xN``)."""
    def key(o: OpPlan):
        return o.kind, o.shape, str(o.spec), o.strategy, o.communication
    return [members[0] if len(members) == 1 else
            dataclasses.replace(members[0], name=name, seconds=sum(m.seconds for m in members))
            for name, members in _fold(ops, lambda o: o.name, key, group_layers)]


def memory_message(plan: ParallelPlan) -> str:
    """One line on the plan's peak memory per device against the cluster's device memory."""
    peaks = [s.peak_memory_per_device for s in plan.stages if s.peak_memory_per_device is not None]
    if not peaks:
        return "memory per device not estimated"
    capacity = plan.cluster.device_memory
    head = (f"peak memory per device {format_bytes(max(peaks))} (estimated) of {format_bytes(capacity)}")
    if plan.fits:
        return f"{head}: fits"
    worst = max(range(len(plan.stages)), key=lambda q: plan.stages[q].peak_memory_per_device or -1)
    where = f" on stage {worst}" if len(plan.stages) > 1 else ""
    state = max(s.memory_per_device for s in plan.stages)
    certain = (f"; its state alone needs {format_bytes(state)} per device" if plan.cannot_fit
               else "; its state fits, so this rests on the activation estimate")
    others = " or ".join(m for m in ("Zero3Parallel", "ShardParallel") if not plan.method.startswith(f"{m}("))
    return (f"{head}: does NOT fit; {format_bytes(plan.memory_shortfall)} ({plan.memory_shortfall} bytes) "
            f"more per device needed{where}{certain} (use more devices, more micro-batches, a sharding method "
            f"such as {others}, or a cluster with more memory per device)")


def format_plan(plan: ParallelPlan, *, group_layers: bool = True) -> str:
    c = plan.cluster
    lines = [f"ParallelPlan  {method_summary(plan.method)}",
             f"  cluster: {c.name}, {c.num_nodes} node(s) x {c.num_devices_per_node} {c.device_name}"
             + (f", measured {c.measured_at}" if c.measured_at else ""),
             f"  schedule: {plan.pipeline_schedule or 'none (single stage)'}, "
             f"micro-batches: {plan.num_micro_batches}, stages: {len(plan.stages)}",
             f"  estimated iteration time: {format_seconds(plan.estimated_iteration_time)}",
             f"  memory: {memory_message(plan)}"]
    if plan.compile_times:
        total = sum(seconds for _, seconds in plan.compile_times)
        parts = ", ".join(f"{name} {format_seconds(seconds)}" for name, seconds in plan.compile_times)
        lines.append(f"  planning time: {format_seconds(total)} ({parts})")
    if plan.pipeline_schedule == ScheduleName.TERAPIPE:
        scheme = format_scheme(plan.token_slicing) if plan.token_slicing else "none (whole sequences)"
        without = plan.iteration_time_without_token_slicing
        lines.append(f"  token slicing (TeraPipe): {scheme}"
                     + (f"; without it: {format_seconds(without)}" if without is not None else ""))
    lines += [f"  warning: {w}" for w in plan.warnings]
    for s in plan.stages:
        contiguous = all(b == a + 1 for a, b in zip(s.layer_ids, s.layer_ids[1:]))
        layers = ("all" if not s.layer_ids else f"{s.layer_ids[0]}-{s.layer_ids[-1]}" if contiguous
                  else ",".join(map(str, s.layer_ids)))
        lines.append("")
        lines.append(f"Stage {s.stage_id}: layers {layers}, submesh {s.submesh_shape}, logical mesh "
                     f"{s.logical_mesh_shape} axes {s.mesh_axis_names}"
                     + (f", devices {list(s.device_ids)}" if s.device_ids else "")
                     + (f", on {s.placement}" if s.placement else ""))
        lines.append(f"  compute {format_seconds(s.compute_seconds)} ({s.flops:.3g} FLOP), communication "
                     f"{format_seconds(s.communication_seconds)}, inputs per device "
                     f"{format_bytes(s.memory_per_device)}")
        headers = ["tensor", "shape", "dtype", "role", "spec", "partition spec", "per device"]
        mirrored = mirrored_outputs(s)
        mirrored_ids = {id(t) for t in mirrored}
        shown = [t for t in s.outputs if id(t) not in mirrored_ids]
        if s.inputs or shown:
            lines.append(format_table(headers, _tensor_rows([*s.inputs, *shown], s.mesh_axis_names, group_layers)))
        else:
            lines.append("  tensors: no per-tensor layouts recorded (layouts are left to XLA: e.g. a looping schedule "
                         "re-deals the layers after the intra-op pass chose layouts for its stages)")
        if mirrored:
            lines.append(f"  ({len(mirrored)} outputs are laid out like the inputs they update and are not listed)")
        if s.solver is not None:
            v = s.solver
            views = ", ".join(f"{'x'.join(map(str, shape))}: {format_seconds(obj)}" for shape, obj in v.views)
            lines.append(f"  intra-op ILP: {v.status}, objective {format_seconds(v.objective)}, solved in "
                         f"{v.solve_seconds:.2f} s ({v.num_nodes} nodes, {v.num_edges} edges, {v.num_variables} "
                         f"variables, {v.num_constraints} constraints)" + (f"; views {views}" if views else ""))
            if v.candidates:
                lines.append(_candidates_text(v))
        if s.ops:
            lines.append("  chosen strategies (parameters and heavy operators):")
            rows = [[o.name, o.kind, "x".join(map(str, o.shape)) or "scalar", str(o.spec) or "scalar",
                     o.strategy, format_seconds(o.seconds), o.communication] for o in _op_rows(s.ops, group_layers)]
            lines.append(format_table(["name", "kind", "shape", "spec", "strategy", "time", "communication"],
                                      rows, indent="    "))
        if s.communication:
            lines.append("  communication per step:")
            rows = [[c.kind, f"axes {c.mesh_axes}" if c.mesh_axes else "-", format_bytes(c.num_bytes),
                     format_seconds(c.seconds), c.what] for c in s.communication]
            lines.append(format_table(["collective", "mesh axes", "bytes", "time", "why"], rows, indent="    "))
    return "\n".join(lines)
