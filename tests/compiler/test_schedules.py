"""Pipeline schedules: every generator over a table of sizes (odd ones included) passes the simulator and
matches the seeds' bubble and memory formulas exactly; goldens, round trips and exports.

Bubble forms (p meshes, m micro-batches, v stages per mesh):

- "ideal": idle time over busy time, Megatron-LM's t_pb / t_id (seed 002 2.2.1-2.2.2, BFPP Eq. 4 and 9):
  (p-1)/m for GPipe and 1F1B, (p-1)/(v m) for interleaved 1F1B and breadth-first.
- "total": idle time over the whole step on every mesh, t_pb / (t_id + t_pb): (p-1)/(m+p-1) for GPipe and
  1F1B, (p-1)/(v m + p - 1) for the looping ones.

Zero-bubble schedules (ZB-H1, ZB-H2) against Table 1 of Qi et al., ICLR 2024, with their own durations
``T_F, T_B, T_W``.
"""
import doctest
import functools
import json
import os
import pathlib
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_like.compiler import schedule_tables, schedules
from alpa_like.compiler.schedule_tables import (breadth_first, gpipe, interleaved_one_f_one_b, make_schedule,
                                               one_f_one_b, zb_h1, zb_h2)
from alpa_like.compiler.schedules import (MeshIdx, Phase, Schedule, ScheduleName, Task, backward, dependencies, forward,
                                         weight_gradient)

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
REGEN = os.environ.get("ALPA_LIKE_REGEN_GOLDEN") == "1"

# (name, p, m, v): p in 1..5, m in 1..9, v in 1..3 wherever the schedule allows it.
CASES = [(name, p, m, v) for name in ScheduleName for p in range(1, 6) for m in range(1, 10) for v in range(1, 4)
         if not name.splits_backward  # the zero-bubble schedules have their own tests below
         and (v == 1 or name in (ScheduleName.INTERLEAVED_1F1B, ScheduleName.BREADTH_FIRST))
         and (m % p == 0 or name != ScheduleName.INTERLEAVED_1F1B)]
IDS = [f"{name}-p{p}-m{m}-v{v}" for name, p, m, v in CASES]


def _bf_excess(p, m, v):
    """Breadth-first idle stage-times beyond p - 1: with m < p each of the v - 1 loop-backs waits p - m."""
    return (v - 1) * max(0, p - m)


# Idle / busy (t_pb / t_id), exact for any t_b / t_f.
BUBBLE_OVER_IDEAL = {
    ScheduleName.GPIPE: lambda p, m, v: Fraction(p - 1, m),
    ScheduleName.TERAPIPE: lambda p, m, v: Fraction(p - 1, m),
    ScheduleName.ONE_F_ONE_B: lambda p, m, v: Fraction(p - 1, m),
    ScheduleName.INTERLEAVED_1F1B: lambda p, m, v: Fraction(p - 1, v * m),
    ScheduleName.BREADTH_FIRST: lambda p, m, v: Fraction(p - 1 + _bf_excess(p, m, v), v * m),
}
# Idle / (p x makespan).
BUBBLE_OF_TOTAL = {
    ScheduleName.GPIPE: lambda p, m, v: Fraction(p - 1, m + p - 1),
    ScheduleName.TERAPIPE: lambda p, m, v: Fraction(p - 1, m + p - 1),
    ScheduleName.ONE_F_ONE_B: lambda p, m, v: Fraction(p - 1, m + p - 1),
    ScheduleName.INTERLEAVED_1F1B: lambda p, m, v: Fraction(p - 1, v * m + p - 1),
    ScheduleName.BREADTH_FIRST: lambda p, m, v: Fraction(p - 1 + _bf_excess(p, m, v),
                                                         v * m + p - 1 + _bf_excess(p, m, v)),
}
# Peak (stage, micro-batch) activation stashes on mesh i. Each mesh runs its warm-up forwards w_i, then
# alternates F and B, so it peaks at w_i + 1 (or m v if the warm-up is everything):
# - GPipe and breadth-first: all forwards first, so m (v = 1) and m v;
# - 1F1B: w_i = p - 1 - i, so min(p - i, m) <= p, and min(p, m) on mesh 0 (seed 002 2.2.1);
# - interleaved (v > 1): w_i = (v-1) p + 2 (p-1-i), so min((v-1) p + 2 (p-1-i) + 1, m v); on mesh 0
#   that is ((v+1) p - 1) / v whole micro-batches, about (1 + 1/v) p against 1F1B's p (Megatron-LM 2.2.2:
#   "comparable"); v = 1 is 1F1B.
IN_FLIGHT = {
    ScheduleName.GPIPE: lambda p, m, v, i: m,
    ScheduleName.TERAPIPE: lambda p, m, v, i: m,
    ScheduleName.ONE_F_ONE_B: lambda p, m, v, i: min(p - i, m),
    ScheduleName.INTERLEAVED_1F1B: lambda p, m, v, i: (min((v - 1) * p + 2 * (p - 1 - i) + 1, m * v) if v > 1
                                                       else min(p - i, m)),
    ScheduleName.BREADTH_FIRST: lambda p, m, v, i: m * v,
}
# (forward, backward) per stage: unit ticks, Megatron's t_b = 2 t_f, and an arbitrary ratio.
DURATIONS = [(1, 1), (1, 2), (2, 3)]


@functools.cache
def build(name, p, m, v):
    """Schedules are frozen, so each case is generated (and validated) once per session."""
    return make_schedule(name, p, m, virtual_stages=v)


@pytest.mark.parametrize("name,p,m,v", CASES, ids=IDS)
def test_schedule_is_valid_and_complete(name, p, m, v):
    s = build(name, p, m, v)
    s.validate()
    assert (s.name, s.num_meshes, s.num_stages, s.num_micro_batches, s.virtual_stages) == (name, p, p * v, m, v)
    assert s.stage_to_mesh == tuple(st_ % p for st_ in range(p * v))
    tasks = [t for row in s.ticks for t in row if t is not None]
    assert len(tasks) == len(set(tasks)) == 2 * p * v * m


@pytest.mark.parametrize("name,p,m,v", CASES, ids=IDS)
def test_bubble_fraction_matches_the_seed_formulas(name, p, m, v):
    s = build(name, p, m, v)
    ideal, total = BUBBLE_OVER_IDEAL[name](p, m, v), BUBBLE_OF_TOTAL[name](p, m, v)
    assert total == ideal / (1 + ideal)
    for fwd, bwd in DURATIONS:
        assert s.bubble_fraction(fwd, bwd, relative_to="ideal") == ideal, (fwd, bwd)
        assert s.bubble_fraction(fwd, bwd) == total, (fwd, bwd)
    # Megatron-LM 2.2.2: a chunk takes t_f / v and t_b / v; the fractions do not change.
    assert s.bubble_fraction(Fraction(1, v), Fraction(2, v), relative_to="ideal") == ideal
    assert s.bubble_fraction() == total  # defaults: t_f = 1, t_b = 2 t_f


@pytest.mark.parametrize("p,m,v", [(p, m, v) for name, p, m, v in CASES
                                   if name == ScheduleName.BREADTH_FIRST and m >= p])
def test_breadth_first_bubble_is_bfpp_eq9_when_m_at_least_p(p, m, v):
    assert breadth_first(p, m, v).bubble_fraction(relative_to="ideal") == Fraction(p - 1, m * v)


@pytest.mark.parametrize("name,p,m,v", CASES, ids=IDS)
def test_peak_in_flight_matches_the_formulas(name, p, m, v):
    peaks = build(name, p, m, v).peak_in_flight()
    assert peaks == tuple(IN_FLIGHT[name](p, m, v, i) for i in range(p))


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 6) for m in range(1, 10)])
def test_one_f_one_b_holds_at_most_p_micro_batches(p, m):
    peaks = one_f_one_b(p, m).peak_in_flight()
    assert max(peaks) <= p and peaks[0] == min(p, m)
    assert gpipe(p, m).peak_in_flight() == (m,) * p


@pytest.mark.parametrize("name,p,m,v", CASES, ids=IDS)
def test_grid_is_the_unit_duration_timeline_and_json_round_trips(name, p, m, v):
    s = build(name, p, m, v)
    spans = s.timeline(1, 1).spans
    assert {span.task: (span.start, span.mesh) for span in spans} == {
        t: (tick, mesh) for tick, row in enumerate(s.ticks) for mesh, t in enumerate(row) if t is not None}
    assert s.timeline(1, 1).makespan == len(s.ticks)
    again = Schedule.from_json(s.to_json())
    assert again == s and again.to_json() == s.to_json()


@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (3, 5), (4, 8)])
def test_gpipe_and_1f1b_are_the_looping_schedules_with_one_stage_per_mesh(p, m):
    assert gpipe(p, m).ticks == breadth_first(p, m, 1).ticks
    if m % p == 0:
        assert one_f_one_b(p, m).ticks == interleaved_one_f_one_b(p, m, 1).ticks


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_timeline_respects_dependencies_and_mesh_order(case, data):
    name, p, m, v = case
    s = build(name, p, m, v)
    fwd = data.draw(st.lists(st.integers(1, 5), min_size=p * v, max_size=p * v))
    bwd = data.draw(st.lists(st.integers(1, 9), min_size=p * v, max_size=p * v))
    spans = s.timeline(fwd, bwd).spans
    end = {span.task: span.end for span in spans}
    orders = s.mesh_orders()
    for mesh in range(p):
        mine = [span for span in spans if span.mesh == mesh]
        assert tuple(span.task for span in mine) == orders[mesh]
        previous_end = 0
        for span in mine:  # as soon as possible: the mesh is free and every input is ready
            duration = (fwd if span.task.phase == Phase.F else bwd)[span.task.stage]
            assert span.end - span.start == duration
            assert span.start == max([previous_end] + [end[d] for d in dependencies(span.task, s.num_stages)])
            previous_end = span.end


# ------------------------------------------------------------------------------------------------ goldens

GOLDENS = [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("interleaved_1f1b", 2, 4, 1), ("breadth_first", 2, 4, 1),
           ("interleaved_1f1b", 2, 4, 2), ("breadth_first", 2, 4, 2),
           ("zb_h1", 2, 4, 1), ("zb_h1", 4, 8, 1), ("zb_h2", 2, 4, 1), ("zb_h2", 4, 8, 1)]


@pytest.mark.parametrize("name,p,m,v", GOLDENS, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in GOLDENS])
def test_tick_grid_matches_golden(name, p, m, v):
    """Goldens are CSV, one row per tick (``tick,mesh0,mesh1``, bubbles empty). Regenerate only with
    ``ALPA_LIKE_REGEN_GOLDEN=1``; a missing golden fails."""
    path = GOLDEN_DIR / f"{name}_p{p}_m{m}_v{v}.csv"
    now = build(name, p, m, v).to_csv()
    if REGEN:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(now)
    if not path.exists():
        pytest.fail(f"missing golden {path}; write it with ALPA_LIKE_REGEN_GOLDEN=1 and review the diff")
    want, got = path.read_text().splitlines(), now.splitlines()
    diff = [f"  row {i}: golden {w!r} != now {g!r}" for i, (w, g) in enumerate(zip(want, got)) if w != g]
    diff += [f"  row {i}: golden {w!r}, now missing" for i, w in enumerate(want[len(got):], len(got))]
    diff += [f"  row {i}: golden missing, now {g!r}" for i, g in enumerate(got[len(want):], len(want))]
    assert not diff, (f"{path.name} differs in {len(diff)} rows (ALPA_LIKE_REGEN_GOLDEN=1 to accept):\n"
                      + "\n".join(diff))


# ------------------------------------------------------------------------------------------------ errors


def test_interleaved_needs_m_divisible_by_p():
    with pytest.raises(ValueError, match=r"interleaved_1f1b needs num_micro_batches divisible by num_meshes.*"
                                         r"got num_micro_batches=5, num_meshes=2.*"
                                         r"valid num_micro_batches are 2, 4, 6, ... \(breadth_first accepts any\)"):
        interleaved_one_f_one_b(2, 5, 2)
    assert breadth_first(2, 5, 2).num_micro_batches == 5  # breadth-first accepts any m


def test_unknown_schedule_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown schedule 'zigzag'; valid: "
                                         r"\['1f1b', 'breadth_first', 'gpipe', 'interleaved_1f1b', 'terapipe', 'zb_h1', "
                                         r"'zb_h2'\]"):
        make_schedule("zigzag", 2, 4)


@pytest.mark.parametrize("call,match", [
    (lambda: gpipe(0, 4), r"num_meshes must be a positive int \(1, 2, 3, ...\), got 0"),
    (lambda: one_f_one_b(2, -1), r"num_micro_batches must be a positive int .*got -1"),
    (lambda: breadth_first(2, 4, 0), r"virtual_stages must be a positive int .*got 0"),
    (lambda: interleaved_one_f_one_b(2, 2.0, 2), r"num_micro_batches must be a positive int .*got 2.0"),
    (lambda: gpipe(True, 4), r"num_meshes must be a positive int .*got True"),
    (lambda: make_schedule("1f1b", 2, 4, virtual_stages=2),
     r"1f1b has one stage per mesh: virtual_stages must be 1, got 2 \(looping schedules: "
     r"\['breadth_first', 'interleaved_1f1b'\]\)"),
    (lambda: gpipe(2, 2).bubble_fraction(relative_to="busy"), r"relative_to must be one of \['ideal', 'total'\]"),
    (lambda: gpipe(2, 2).timeline(t_f=[1, 2, 3]), r"t_f needs one duration per stage \(2\), got 3"),
    (lambda: gpipe(2, 2).timeline(t_b=0), r"t_b durations must be positive numbers, got 0"),
    (lambda: Task.from_str("2X0"), r"not a task: '2X0'; expected <stage><phase><micro_batch>\[\.<slice>\]"),
    (lambda: Schedule.from_json('{"name": "x"}'), r"not a schedule JSON"),
])
def test_bad_arguments_fail_with_the_valid_options(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def grid(*rows):
    """Ticks from rows like ``"0F0 ."`` (``.`` is a bubble)."""
    return tuple(tuple(None if cell == "." else Task.from_str(cell) for cell in row.split()) for row in rows)


def two_mesh(*rows, m=1):
    return Schedule(name="hand", num_meshes=2, num_stages=2, num_micro_batches=m,
                    stage_to_mesh=(MeshIdx(0), MeshIdx(1)), ticks=grid(*rows))


@pytest.mark.parametrize("rows,m,match,marked", [
    (("0F0 .", "0B0 1F0", ". 1B0"), 1,
     r"0B0 at tick 1 needs 1B0 \(tick 2\), which must run at an earlier tick", "   1  0B0    1F0  <-- ERROR"),
    (("0F0 1F0", ". 1B0", "0B0 ."), 1, r"1F0 at tick 0 needs 0F0 \(tick 0\)", "   0  0F0    1F0  <-- ERROR"),
    (("0F0 .", ". 1F0", ". 1B0"), 1, r"1 task\(s\) never run: 0B0", None),
    (("0F0 .", ". 1F0", ". 1B0", "0B0 .", "0F0 ."), 1, r"0F0 runs twice, at ticks 0 and 4",
     "   4  0F0    .  <-- ERROR"),
    (("1F0 0F0",), 1, r"1F0 at tick 0 runs on mesh 0, but stage 1 lives on mesh 1", "<-- ERROR: 1F0 on the wrong"),
    (("0F0 .", ". 1F2"), 1, r"1F2 at tick 1 is out of range", "<-- ERROR: 1F2"),
    # mesh1 starts with 1F1, which waits for 0F1, which mesh0 runs only after 0B0, which needs 1B0: a cycle.
    (("0F0 1F1", "0B0 1F0", "0F1 1B0", "0B1 1B1"), 2,
     r"deadlock: no mesh can run its next task \(mesh0 waits at 0B0 for 1B0; mesh1 waits at 1F1 for 0F1\)",
     "   0  0F0    1F1  <-- ERROR: mesh1 stuck at 1F1\n   1  0B0    1F0  <-- ERROR: mesh0 stuck at 0B0"),
])
def test_validate_reports_the_grid_with_the_offending_tick(rows, m, match, marked):
    with pytest.raises(ValueError, match=match) as info:
        two_mesh(*rows, m=m)  # construction validates
    message = str(info.value)
    assert "tick  mesh0  mesh1" in message
    if marked:
        assert marked in message, message


def test_schedule_rejects_malformed_grids_on_construction():
    with pytest.raises(ValueError, match=r"tick 0 must hold 2 entries"):
        two_mesh("0F0")
    with pytest.raises(ValueError, match=r"stage_to_mesh must give each of the 2 stages a mesh in 0..1"):
        Schedule(name="x", num_meshes=2, num_stages=2, num_micro_batches=1, stage_to_mesh=(0, 2), ticks=())


# ------------------------------------------------------------------------------------------- round trips


@given(stage=st.integers(0, 10_000), micro_batch=st.integers(0, 10_000), phase=st.sampled_from(list(Phase)),
       slice_=st.none() | st.integers(0, 100))
def test_task_str_round_trips(stage, micro_batch, phase, slice_):
    task = Task(stage, micro_batch, phase, slice_)
    assert Task.from_str(str(task)) == task and repr(task) == str(task)


def test_task_prints_compactly():
    assert str(Task(2, 0, Phase.F)) == "2F0" and str(Task(2, 0, Phase.B, slice=1)) == "2B0.1"
    assert Task.from_str("12B3") == Task(12, 3, Phase.B)


def test_table_and_doctests():
    assert gpipe(2, 2).table().splitlines() == [
        "tick  mesh0  mesh1", "   0  0F0    .", "   1  0F1    1F0", "   2  .      1F1", "   3  .      1B0",
        "   4  0B0    1B1", "   5  0B1    ."]
    assert doctest.testmod(schedules).failed == 0
    assert doctest.testmod(schedule_tables).failed == 0


# ------------------------------------------------------------------------------------------------ exports


def test_chrome_trace_has_one_event_per_task_on_one_track_per_mesh(tmp_path):
    s = interleaved_one_f_one_b(3, 6, 2)
    path = tmp_path / "trace.json"
    s.to_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    tasks = [e for e in events if e["ph"] == "X"]
    assert len(tasks) == 2 * s.num_stages * s.num_micro_batches
    assert {e["name"] for e in tasks} == {str(t) for row in s.ticks for t in row if t is not None}
    assert sorted(e["args"]["name"] for e in events if e["name"] == "thread_name") == ["mesh0", "mesh1", "mesh2"]
    for e in tasks:
        assert e["tid"] == s.stage_to_mesh[Task.from_str(e["name"]).stage] and e["dur"] > 0


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    breadth_first(2, 3, 2).plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("p,m,n", [(1, 1, 3), (2, 1, 2), (3, 2, 3), (4, 3, 5)])
def test_terapipe_schedule_is_gpipe_over_token_slices(p, m, n):
    """TeraPipe runs m * n (micro-batch, slice) units like GPipe's micro-batches: bubble (p-1)/(m n);
    backwards of a sequence run in reverse slice order (their key/value gradients flow backwards)."""
    s = make_schedule("terapipe", p, m, num_slices=n)
    assert s.num_slices == n
    assert s.bubble_fraction(relative_to="ideal") == Fraction(p - 1, m * n)
    for order in s.mesh_orders():
        backs = [t for t in order if t.phase == Phase.B]
        for k in range(m):
            assert [t.slice for t in backs if t.micro_batch == k] == list(reversed(range(n)))
    assert Schedule.from_json(s.to_json()) == s
    assert Task(0, 0, Phase.B, 1) in dependencies(Task(0, 0, Phase.B, 0), p, n)


def test_terapipe_schedule_rejects_a_slice_out_of_order():
    s = make_schedule("terapipe", 2, 1, num_slices=2)
    rows = [list(r) for r in s.ticks]
    rows[0][0], rows[1][0] = rows[1][0], rows[0][0]  # 0F0.1 before 0F0.0
    with pytest.raises(ValueError, match="mesh0 waits at 0F0.1 for 0F0.0"):
        Schedule(name="bad", num_meshes=2, num_stages=2, num_micro_batches=1, stage_to_mesh=(0, 1),
                 ticks=rows, num_slices=2)
    with pytest.raises(ValueError, match="num_slices"):
        make_schedule("gpipe", 2, 1, num_slices=2)


def test_terapipe_schedule_with_a_slice_count_per_micro_batch():
    """Batch slices with their own token slicings (TeraPipe 2.3.4): micro-batch 0 in 3 slices, 1 whole (one
    slice, named 1.0), 2 in 2 slices; GPipe over the 6 units, each sequence's backwards in reverse."""
    s = make_schedule("terapipe", 2, 3, num_slices=(3, 1, 2))
    assert s.num_slices == (3, 1, 2)
    orders = s.mesh_orders()
    assert [str(t) for t in orders[0]] == ["0F0.0", "0F0.1", "0F0.2", "0F1.0", "0F2.0", "0F2.1",
                                           "0B2.1", "0B2.0", "0B1.0", "0B0.2", "0B0.1", "0B0.0"]
    assert s.bubble_fraction(relative_to="ideal") == Fraction(1, 6)
    assert dependencies(Task(0, 1, Phase.B, 0), 2, (3, 1, 2)) == (Task(0, 1, Phase.F, 0), Task(1, 1, Phase.B, 0))
    assert Task(0, 0, Phase.B, 2) in dependencies(Task(0, 0, Phase.B, 1), 2, (3, 1, 2))
    assert Schedule.from_json(s.to_json()) == s
    assert make_schedule("terapipe", 2, 2, num_slices=(2, 2)).num_slices == 2  # equal counts: the int
    with pytest.raises(ValueError, match=r"one such int per micro-batch \(3\)"):
        make_schedule("terapipe", 2, 3, num_slices=(3, 1))
    rows = [[t for t in row] for row in s.ticks]
    rows[3][0] = Task(0, 1, Phase.F, 1)  # micro-batch 1 has one slice
    with pytest.raises(ValueError, match=r"0F1.1 at tick 3 must name a token slice in 0..0"):
        Schedule(name="bad", num_meshes=2, num_stages=2, num_micro_batches=3, stage_to_mesh=(0, 1), ticks=rows,
                 num_slices=(3, 1, 2))


def test_schedule_names_read_as_their_strings():
    assert ScheduleName("1f1b") is ScheduleName.ONE_F_ONE_B and ScheduleName.GPIPE == "gpipe"
    assert repr(ScheduleName.BREADTH_FIRST) == "'breadth_first'"  # options and plans print the user's string
    assert {name for name in ScheduleName if name.is_looping} == {ScheduleName.INTERLEAVED_1F1B,
                                                                  ScheduleName.BREADTH_FIRST}


# ------------------------------------------------------------------------------------------ zero bubble

# Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), Table 1, for p meshes and m >= p micro-batches.
ZB_CASES = [(p, m) for p in range(1, 6) for m in range(p, 12)]
# (T_F, T_B, T_W): the paper's equal times, and times with T_W <= T_F, T_B where its formulas still hold.
ZB_DURATIONS = [(1, 1, 1), (2, 2, 1), (3, 2, 1), (2, 3, 1)]


@pytest.mark.parametrize("p,m", ZB_CASES)
def test_zb_h1_bubble_and_memory_are_the_papers(p, m):
    """ZB-H1: step time minus busy time = (p-1)(T_F + T_B - T_W) on every mesh (1F1B: (p-1)(T_F + T_B +
    T_W)), and 1F1B's peak, p micro-batches (from F to W), on every mesh."""
    s = zb_h1(p, m)
    tasks = [t for row in s.ticks for t in row if t is not None]
    assert s.splits_backward and len(tasks) == len(set(tasks)) == 3 * p * m
    for f, b, w in ZB_DURATIONS:
        timeline = s.timeline(f, b, w)
        assert timeline.makespan - m * (f + b + w) == (p - 1) * (f + b - w), (f, b, w)
    assert s.bubble_fraction() == Fraction(p - 1, 3 * m + p - 1)  # equal times: (p-1) / (3m + p - 1)
    assert s.peak_in_flight() == (p,) * p
    assert max(s.peak_in_flight()) == max(one_f_one_b(p, m).peak_in_flight())


@pytest.mark.parametrize("p,m", ZB_CASES)
def test_zb_h2_bubble_and_memory_are_the_papers(p, m):
    """ZB-H2: the first mesh idles (p-1)(T_F + T_B - 2 T_W) between its first and last task (zero with equal
    times, every mesh, once m >= 2p - 1: the parallelogram) and holds 2p - 1 micro-batches; a synchronised
    step waits (p-1) T_F to fill, as long as ZB-H1's with equal times."""
    s = zb_h2(p, m)
    assert s.splits_backward and sum(t is not None for row in s.ticks for t in row) == 3 * p * m
    for f, b, w in ZB_DURATIONS:
        if m >= 2 * p - 1:
            assert s.timeline(f, b, w).idle_within()[0] == (p - 1) * (f + b - 2 * w), (f, b, w)
    if m >= 2 * p - 1:
        assert s.timeline().idle_within() == (0,) * p
    assert s.timeline().makespan == 3 * m + p - 1 == zb_h1(p, m).timeline().makespan
    assert s.peak_in_flight() == (min(2 * p - 1, m),) * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 5)])
def test_zero_bubble_beats_one_f_one_b_with_split_backward(p, m):
    """With a backward of 2 T_F split in equal halves, 1F1B's step is (m + p - 1) 3 T_F; ZB-H1 saves two
    thirds of its bubble."""
    assert one_f_one_b(p, m).timeline(1, 2).makespan - zb_h1(p, m).timeline(1, 1, 1).makespan == 2 * (p - 1)


@pytest.mark.parametrize("build_zb", [zb_h1, zb_h2])
def test_zero_bubble_needs_as_many_micro_batches_as_meshes(build_zb):
    with pytest.raises(ValueError, match="num_micro_batches >= num_meshes"):
        build_zb(4, 3)


def test_a_split_schedule_needs_every_w_after_its_b():
    """W(s, k) needs B(s, k); a W before its B, a missing W and W-less 1F1B with t_w are refused."""
    rows = [[forward(0, 0)], [weight_gradient(0, 0)], [backward(0, 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        Schedule(name="x", num_meshes=1, num_stages=1, num_micro_batches=1, stage_to_mesh=(0,), ticks=rows)
    rows = [[forward(0, 0)], [forward(0, 1)], [backward(0, 0)], [weight_gradient(0, 0)], [backward(0, 1)]]
    with pytest.raises(ValueError, match=r"1 task\(s\) never run: 0W1"):
        Schedule(name="x", num_meshes=1, num_stages=1, num_micro_batches=2, stage_to_mesh=(0,), ticks=rows)
    with pytest.raises(ValueError, match="t_w is for schedules with W tasks"):
        one_f_one_b(2, 2).timeline(1, 2, 1)
    assert Task.from_str("3W1") == weight_gradient(3, 1) and zb_h1(2, 2).to_json() == \
        Schedule.from_json(zb_h1(2, 2).to_json()).to_json()


@pytest.mark.parametrize("name", list(ScheduleName))
def test_the_memory_rule_of_a_schedule_is_what_its_first_mesh_stashes(name):
    """``holds_every_micro_batch`` (Eq. 3.5's GPipe rule in the stage DP) is true exactly for the schedules
    whose first mesh stashes the activations of every micro-batch at once."""
    p, m, v = 2, 4, 2 if name.is_looping else 1
    peak = make_schedule(name, p, m, virtual_stages=v).peak_in_flight()[0]
    assert name.holds_every_micro_batch == (peak == m * v)
