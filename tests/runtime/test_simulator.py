"""The simulated backend runs the same instruction programs against the cost model's clock."""
import collections
import dataclasses
import functools

import pytest

import alpa_like as al
from alpa_like.runtime.simulator import simulate
from alpa_like.compiler.schedules import Phase
from tests.runtime.test_pipeshard_runtime import TWO_STAGES, gpt_case, stages, train_step_for


def executable(schedule, num_micro_batches=4):
    loss_fn, state, batches = gpt_case()
    method = al.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option=al.AutoLayerOption(layer_num=4),
                                  stage_option=TWO_STAGES, pipeline_schedule=schedule)
    return al.parallelize(train_step_for(loss_fn), method=method).get_executable(state, batches[0])


def idealised(plan, seconds_per_stage=1.0, shared_host_compute=False):
    """Equal stages, free communication and apply-grad, devices that compute independently: the textbook
    pipeline."""
    cluster = dataclasses.replace(plan.cluster, peak_flops=1e30, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30,
                                  intra_node_latency=0.0, inter_node_latency=0.0,
                                  shared_host_compute=shared_host_compute, memory_bandwidth=None, launch_overhead=0.0)
    stages = tuple(dataclasses.replace(s, compute_seconds=seconds_per_stage, communication=()) for s in plan.stages)
    return dataclasses.replace(plan, cluster=cluster, stages=stages)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_idealised_pipeline_has_the_textbook_bubble(schedule):
    exe = executable(schedule, num_micro_batches=4)
    sim = simulate(idealised(exe.plan), exe.program, exe.programs)
    p, m = 2, 4
    assert sim.timeline.bubble_fraction("ideal") == pytest.approx((p - 1) / m)
    assert sim.step_seconds == pytest.approx((m + p - 1) * 1.0 / m)  # (m + p - 1)(t_f + t_b), t_f + t_b = 1 s / m


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_meshes_sharing_the_host_cores_take_turns(schedule):
    """Virtual CPU devices: no two RUNs of one host overlap, and each computes with all 8 devices' worth of
    the host (twice its 4-device mesh), so the step is every RUN back to back: p stages x m micro-batches x
    (t_f + t_b) / 2 = 2 x 4 x 1/8 s (the idealised apply-grad is free)."""
    exe = executable(schedule, num_micro_batches=4)
    assert exe.plan.cluster.shared_host_compute  # ClusterSpec.local() on CPU devices
    sim = simulate(idealised(exe.plan, shared_host_compute=True), exe.program, exe.programs)
    assert sim.step_seconds == pytest.approx(1.0)
    spans = sorted(sim.timeline.spans, key=lambda s: s.start)
    assert all(a.end <= b.start + 1e-12 for a, b in zip(spans, spans[1:]))


def test_simulated_timeline_respects_dependencies_and_mesh_order():
    exe = executable("1f1b")
    sim = simulate(exe.plan, exe.program, exe.programs)
    spans = {(s.task.stage, s.task.micro_batch, s.task.phase): s for s in sim.timeline.spans}
    for (stage, mb, phase), span in spans.items():
        if phase is Phase.F and stage > 0:
            assert span.start >= spans[(stage - 1, mb, Phase.F)].end
        if phase is Phase.B and stage < 1:
            assert span.start >= spans[(stage + 1, mb, Phase.B)].end
    for mesh in range(2):
        mine = sorted((s for s in sim.timeline.spans if s.mesh == mesh), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(mine, mine[1:]))
    assert sim.step_seconds >= max(sim.busy_seconds) and sim.transfer_seconds > 0


def test_calibrated_simulation_uses_measured_durations():
    from alpa_like.runtime.simulator import measured_durations

    exe = executable("gpipe", num_micro_batches=4)
    spans = [(0, "RUN 0F0", 0.0, 1.0), (0, "RUN 0F1", 1.0, 2.0), (1, "RUN 1F0", 1.0, 2.0), (0, "RUN 0B0", 2.0, 4.0),
             (1, "RUN 1B0", 4.0, 6.0), (0, "RUN 0A", 6.0, 6.0), (1, "RUN 1A", 6.0, 6.0)]
    measured = measured_durations(exe.programs, spans)
    assert measured == {"RUN 0F": 1.0, "RUN 1F": 1.0, "RUN 0B": 2.0, "RUN 1B": 2.0, "RUN 0A": 0.0, "RUN 1A": 0.0}
    sim = simulate(idealised(exe.plan), exe.program, exe.programs, measured)
    p, m = 2, 4
    assert sim.step_seconds == pytest.approx((m + p - 1) * 3.0)  # GPipe: (m + p - 1)(t_f + t_b)


def test_run_costs_are_the_pieces_roofline_plus_one_launch():
    """With a memory bandwidth, each RUN lasts launch + the roofline of its own piece's jaxpr (work split over
    the mesh's devices) + its share of the stage's intra-op communication; the kinds add up to that."""
    from alpa_like.compiler.flops import ComputeRates, jaxpr_seconds
    from alpa_like.compiler.layer_slicing import APPLY, BACKWARD, FORWARD

    exe = executable("gpipe", num_micro_batches=2)
    base = idealised(exe.plan)
    cluster = dataclasses.replace(base.cluster, peak_flops=1e9, memory_bandwidth=1e8, launch_overhead=1e-3)
    plan = dataclasses.replace(base, cluster=cluster)
    sim = simulate(plan, exe.program, exe.programs)
    expected = {}
    for phase, kind in ((FORWARD, "RUN F"), (BACKWARD, "RUN B"), (APPLY, "RUN A")):
        per_run = [1e-3 + jaxpr_seconds(exe.program.piece(q, phase).jaxpr, ComputeRates(1e9, 1e8),
                                        len(plan.stages[exe.programs.stage_to_mesh[q]].device_ids))
                   for q in range(exe.program.num_stages)]
        expected[kind] = sum(per_run) * (1 if phase == APPLY else 2)
    for kind, seconds in expected.items():
        assert sim.seconds_by_kind[kind] == pytest.approx(seconds)
    assert expected["RUN B"] > expected["RUN F"] > 2e-3  # the pieces are not free
    f = {s.task.stage: s.end - s.start for s in sim.timeline.spans if s.task.phase is Phase.F}
    assert f[0] == pytest.approx(1e-3 + jaxpr_seconds(exe.program.piece(0, FORWARD).jaxpr, ComputeRates(1e9, 1e8),
                                                       len(plan.stages[exe.programs.stage_to_mesh[0]].device_ids)))


def test_instruction_kinds():
    from alpa_like.runtime.simulator import instruction_kind, measured_seconds_by_kind

    assert [instruction_kind(t) for t in ("RUN 12F3", "RUN 0B", "RUN 1A", "RECV v3@1 <- mesh 0", "FREE v2")] == [
        "RUN F", "RUN B", "RUN A", "RECV", "FREE"]
    assert measured_seconds_by_kind([(0, "RUN 0F0", 0.0, 1.0), (1, "RUN 1F0", 1.0, 3.0), (0, "LOAD v1", 0, .5)]) == {
        "RUN F": 3.0, "LOAD": 0.5}


@pytest.mark.parametrize("shared_host_compute", [False, True])
def test_state_loads_are_free_on_gpus_and_batch_loads_always_pay(shared_host_compute):
    """Parameters and optimizer state stay on their mesh between steps on devices with their own memory: their
    per-step LOAD costs nothing; a micro-batch's inputs pay latency + bytes / bandwidth. With shared host
    cores (virtual CPU devices) every LOAD pays, as measured. ``trace=True`` lists every instruction."""
    exe = executable("1f1b")
    plan = idealised(exe.plan, shared_host_compute=shared_host_compute)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, intra_node_bandwidth=1e9,
                                                                 intra_node_latency=1e-6))
    sim = simulate(plan, exe.program, exe.programs, trace=True)
    loads = [(text, end - start) for _, text, start, end in sim.instruction_spans if text.startswith("LOAD")]
    per_step = [d for text, d in loads if "@" not in text]
    per_micro_batch = [d for text, d in loads if "@" in text]
    assert per_step and per_micro_batch
    assert all(d >= 1e-6 for d in per_micro_batch)
    assert all((d == 0.0) != shared_host_compute for d in per_step)
    runs = sorted((s.start, s.end) for s in sim.timeline.spans)
    traced = sorted((start, end) for _, text, start, end in sim.instruction_spans
                    if text.startswith("RUN") and not text.split()[1].rstrip("0123456789").endswith("A"))
    assert traced == runs


def tied_programs(replicate: bool):
    """The 2-stage tied model's plan and programs (``tests.runtime.test_pipeshard_runtime.tied_case``), with
    the tied update on the last stage only (``replicate=False``) or on both (what the runtime runs)."""
    from alpa_like.compiler.stage_construction import build_stage_program
    from alpa_like.compiler.sliced_step import slice_step
    from alpa_like.runtime.instructions import emit_programs
    from alpa_like.compiler.schedule_tables import make_schedule
    from tests.runtime.test_pipeshard_runtime import TIED_STAGES, tied_case

    loss_fn, state, batches = tied_case()
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=TIED_STAGES, pipeline_schedule="1f1b")
    step = train_step_for(loss_fn)
    exe = al.parallelize(step, method=method).get_executable(state, batches[0])
    sliced = slice_step(method, step, (state, batches[0]), static_argnums=(), batch_argnums=(1,))
    program = build_stage_program(sliced.closed_jaxpr, sliced.pieces, [(0,), (1,)], [r == "batch" for r in sliced.roles],
                                  stage_to_mesh=[0, 1] if replicate else None)
    programs = emit_programs(program, make_schedule("1f1b", num_meshes=2, num_micro_batches=2), [0, 1])
    return exe.plan, program, programs


def tied_simulation(replicate: bool, shared_host_compute: bool, bandwidth: float, latency: float):
    plan, program, programs = tied_programs(replicate)
    plan = idealised(plan, shared_host_compute=shared_host_compute)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, intra_node_bandwidth=bandwidth,
                                                                 intra_node_latency=latency))
    w = next(v for v in program.step_inputs if program.values[v].aval.shape == (16, 32))
    return program, programs, w, simulate(plan, program, programs, trace=True)


@pytest.mark.parametrize("shared_host_compute", [False, True])
def test_a_tied_parameter_is_copied_from_the_mesh_that_updates_it(shared_host_compute):
    """``w`` is read by both stages; its apply-grad (which reads the old ``w``) runs on mesh 1, where the last
    of its gradients is made. At the next step mesh 0's LOAD of ``w`` is then a copy from mesh 1, priced like
    a RECV between the two layouts: each of mesh 0's 4 devices gets its quarter of ``w`` (dim 0 split over
    the mesh on both sides), ``latency + bytes / 4 / bandwidth``, and mesh 0's first forward waits for it.
    Mesh 1's LOAD of ``w`` and every other per-step LOAD are free (resident state). With shared host cores
    every LOAD is a host-to-device copy of the whole value."""
    from alpa_like.compiler.stage_construction import updating_stages

    bandwidth, latency = 1e9, 1e-6
    program, _, w, sim = tied_simulation(False, shared_host_compute, bandwidth, latency)
    assert updating_stages(program)[w] == {1}
    loads = {(mesh, text): (start, end) for mesh, text, start, end in sim.instruction_spans if text.startswith("LOAD")}
    nbytes = 16 * 32 * 4
    start, end = loads[(0, f"LOAD v{w}")]
    if shared_host_compute:
        assert end - start == pytest.approx(latency + nbytes / bandwidth)
        return
    assert end - start == pytest.approx(latency + nbytes / 4 / bandwidth)
    first_forward = min(s.start for s in sim.timeline.spans if s.mesh == 0)
    assert first_forward >= end
    assert loads[(1, f"LOAD v{w}")][1] - loads[(1, f"LOAD v{w}")][0] == 0.0
    others = [e - s for (mesh, text), (s, e) in loads.items() if "@" not in text and text != f"LOAD v{w}"]
    assert others and all(d == 0.0 for d in others)


def test_a_replicated_tied_update_loads_nothing_across_meshes_and_exchanges_gradient_parts():
    """With the tied update replicated on both meshes (what the runtime runs), every per-step LOAD is free
    on GPUs and each mesh receives the other's accumulated gradient part of ``w``, one RECV each way, priced
    like any RECV: ``latency + bytes / 4 / bandwidth`` (dim 0 split over the 4 devices on both sides)."""
    from alpa_like.compiler.stage_construction import updating_stages

    bandwidth, latency = 1e9, 1e-6
    program, programs, w, sim = tied_simulation(True, False, bandwidth, latency)
    assert updating_stages(program)[w] == {0, 1}
    per_step_loads = [e - s for _, text, s, e in sim.instruction_spans if text.startswith("LOAD") and "@" not in text]
    assert per_step_loads and all(d == 0.0 for d in per_step_loads)
    parts = {dst for src, dst in program.accumulated if program.values[src].aval.shape == (16, 32)}
    recvs = {(mesh, text): e - s for mesh, text, s, e in sim.instruction_spans
             if text.startswith("RECV") and "@" not in text and int(text[6:].split()[0]) in parts}
    assert {mesh for mesh, _ in recvs} == {0, 1} and len(recvs) == 2
    assert all(d == pytest.approx(latency + 16 * 32 * 4 / 4 / bandwidth) for d in recvs.values())


def _frees_by_definition(instructions, program, keep, key_of):
    """The FREEs :func:`~alpa_like.runtime.instructions.emit_programs` must insert, from their definition:
    each per-micro-batch buffer ``(mesh, key)`` that is not a step output is freed right after the last
    instruction that reads it on ``mesh`` (a RUN's input, an ACC, a RECV into ``mesh``), writes it there (a
    RUN's output) or copies it from ``mesh`` (a RECV from it); FREEs after one instruction sorted by mesh, key."""
    from alpa_like.runtime.instructions import PER_STEP, Instruction, Op

    last = {}
    for i, ins in enumerate(instructions):
        touched = []
        if ins.op is Op.RUN and ins.micro_batch != PER_STEP:
            piece = program.piece(ins.stage, ins.phase)
            touched += [(ins.mesh, key_of(v, ins.micro_batch)) for v in piece.inputs + piece.outputs]
        if ins.op in (Op.ACC, Op.RECV):
            touched.append((ins.mesh, ins.key))
        if ins.op is Op.RECV:
            touched.append((ins.src_mesh, ins.key))
        for place in touched:
            if place[1][1] != PER_STEP:
                last[place] = i
    kept = {key for key, _ in keep}
    out = []
    for i, ins in enumerate(instructions):
        out.append(ins)
        out += [Instruction(Op.FREE, mesh, key=key) for (mesh, key), j in sorted(last.items()) if j == i and key not in kept]
    return out


@pytest.mark.parametrize("case", ["gpt 1f1b", "gpt gpipe", "tied"])
def test_frees_follow_each_buffers_last_use(case):
    """The programs' FREEs are the ones their definition gives (``_frees_by_definition``), on a 2-stage GPT
    under two schedules and on the 2-stage tied model whose update is replicated (RECVs of gradient parts)."""
    from alpa_like.runtime.instructions import PER_STEP, Op

    if case == "tied":
        _, program, programs = tied_programs(True)
    else:
        exe = executable(case.split()[1])
        program, programs = exe.program, exe.programs
    per_micro_batch = set(program.batch_inputs)
    for (_, phase), piece in program.pieces.items():
        if phase != "apply":
            per_micro_batch.update(piece.outputs)

    def key_of(v, mb):
        return (v, mb) if v in per_micro_batch else (v, PER_STEP)

    bare = [ins for ins in programs.instructions if ins.op is not Op.FREE]
    assert len(bare) < len(programs.instructions)
    keep = {o for o in programs.outputs if o}
    assert list(programs.instructions) == _frees_by_definition(bare, program, keep, key_of)


@pytest.mark.parametrize("case", ["gpt 1f1b", "tied"])
def test_programs_without_frees_simulate_the_same_step(case):
    """``emit_programs(..., free_buffers=False)`` is the same program without its FREEs, and the simulated
    backend gives it the same step, spans and per-kind seconds (less the zero FREE total)."""
    from alpa_like.runtime.instructions import Op, emit_programs
    from alpa_like.compiler.schedule_tables import make_schedule

    if case == "tied":
        plan, program, programs = tied_programs(True)
        schedule = make_schedule("1f1b", num_meshes=2, num_micro_batches=2)
    else:
        exe = executable("1f1b")
        plan, program, programs = exe.plan, exe.program, exe.programs
        schedule = make_schedule("1f1b", num_meshes=2, num_micro_batches=4)
    bare = emit_programs(program, schedule, list(programs.stage_to_mesh), free_buffers=False)
    assert list(bare.instructions) == [ins for ins in programs.instructions if ins.op is not Op.FREE]
    assert len(bare.instructions) < len(programs.instructions)
    assert (bare.outputs, bare.output_copies) == (programs.outputs, programs.output_copies)
    full, lean = simulate(plan, program, programs, trace=True), simulate(plan, program, bare, trace=True)
    assert lean.step_seconds == full.step_seconds and lean.instruction_spans == full.instruction_spans
    assert lean.seconds_by_kind == {k: v for k, v in full.seconds_by_kind.items() if k != "FREE"}


@pytest.mark.parametrize("shared_host_compute", [False, True])
def test_step_totals_and_transfers_agree_with_the_traced_spans(shared_host_compute):
    """``seconds_by_kind`` is the sum of the traced spans' durations per :func:`instruction_kind` of their text
    (FREE, ACC and MEAN take no time), and every RECV lasts :func:`transfer_seconds` of its value between
    its two meshes: the simulator computes each (value, source, destination) once."""
    from alpa_like.runtime.simulator import instruction_kind, transfer_seconds

    plan, program, programs = tied_programs(True)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, shared_host_compute=shared_host_compute))
    sim = simulate(plan, program, programs, trace=True)
    totals = {}
    for _, text, start, end in sim.instruction_spans:
        totals[instruction_kind(text)] = totals.get(instruction_kind(text), 0.0) + (end - start)
    timed = {k: v for k, v in sim.seconds_by_kind.items() if k not in ("FREE", "ACC", "MEAN")}
    assert timed.keys() == totals.keys() and sim.seconds_by_kind["FREE"] == 0.0
    assert all(timed[k] == pytest.approx(totals[k]) for k in totals)
    recvs = [(ins, span) for ins, span in zip([i for i in programs.instructions if i.op.value in ("RUN", "RECV", "LOAD")],
                                              sim.instruction_spans) if ins.op.value == "RECV"]
    assert recvs
    for ins, (mesh, text, start, end) in recvs:
        assert text == str(ins) and mesh == ins.mesh
        expected = transfer_seconds(plan, program.values[ins.key[0]].aval, ins.src_mesh, ins.mesh)
        assert end - start == pytest.approx(expected, rel=1e-9) and expected > 0
@functools.cache
def mlp_executable(stage_option, schedule="1f1b", num_micro_batches=2):
    from tests.runtime.test_pipeshard_runtime import mlp_case

    loss_fn, state, batches = mlp_case()
    method = al.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option=al.ManualLayerOption(),
                                  stage_option=stage_option, pipeline_schedule=schedule)
    return al.parallelize(train_step_for(loss_fn), method=method).get_executable(state, batches[0])


def placed(plan, device_ids, num_nodes, per_node, bandwidth=1e9):
    """``plan`` idealised (free compute, intra-node links and latencies) on ``num_nodes`` nodes of
    ``per_node`` devices, each mesh on the given (cluster-wide) device ids, ``bandwidth`` per device's share
    of a node's NIC."""
    plan = idealised(plan, seconds_per_stage=0.0)
    cluster = dataclasses.replace(plan.cluster, num_nodes=num_nodes, num_devices_per_node=per_node,
                                  inter_node_bandwidth=bandwidth)
    stages = tuple(dataclasses.replace(s, device_ids=tuple(ids))
                   for s, ids in zip(plan.stages, device_ids, strict=True))
    return dataclasses.replace(plan, cluster=cluster, stages=stages)


def recv_spans(sim, program):
    """``(mesh, text, start, end, bytes)`` of every RECV of a traced simulation."""
    out = []
    for mesh, text, start, end in sim.instruction_spans:
        if text.startswith("RECV"):
            aval = program.values[int(text.split()[1][1:].split("@")[0])].aval
            out.append((mesh, text, start, end, aval.size * aval.dtype.itemsize))
    return out


@pytest.mark.parametrize("device_ids, num_nodes, per_node, shares", [
    (((0, 1, 2, 3), (8, 9, 10, 11)), 2, 8, 8),  # (1,4) meshes alone on their nodes: the whole NIC, 8 shares
    (((0, 1, 2, 3), (4, 5, 6, 7)), 2, 4, 4),  # meshes filling their nodes: 4 shares
    (((0, 1, 2, 3), (4, 5, 6, 7)), 4, 2, 4),  # meshes over two nodes each: two NICs of 2 shares
])
def test_a_receive_across_nodes_uses_the_whole_nics_of_its_nodes(device_ids, num_nodes, per_node, shares):
    """Two meshes on different nodes, no other traffic: every RECV of an activation or gradient of ``n``
    bytes (split over the receiving devices) lasts ``n / (shares x bandwidth)``, the NICs of the nodes
    involved at the full rate (latencies are zero here). A scalar goes to every device of the mesh, ``n``
    bytes each: ``4 n`` through the NICs."""
    exe = mlp_executable(TWO_STAGES)
    plan = placed(exe.plan, device_ids, num_nodes, per_node)
    sim = simulate(plan, exe.program, exe.programs, trace=True)
    spans = recv_spans(sim, exe.program)
    assert {mesh for mesh, *_ in spans} == {0, 1}
    for _, text, start, end, nbytes in spans:
        copies = 4 if nbytes == 4 else 1
        assert end - start == pytest.approx(copies * nbytes / (shares * 1e9)), text
    assert any(nbytes > 4 for *_, nbytes in spans)


def two_receives(device_ids, into, **options):
    """The 4-stage MLP's programs cut to two RECVs, both ready at time 0 (their senders' values are not
    computed in this program): ``into = "node 1"``: the activation into mesh 1 from mesh 0 and the gradient
    into mesh 2 from mesh 3; ``"from node 1"``: the gradient into mesh 0 from mesh 1 and the activation into
    mesh 3 from mesh 2. Returns the simulation and the two RECVs' ``(start, end, bytes)``."""
    from alpa_like.runtime.instructions import Op

    exe = mlp_executable(stages(((0,), (1,), (2,), (3,)), ((1, 2),) * 4, ((1, 2),) * 4))
    pairs = [(1, 0), (2, 3)] if into == "node 1" else [(0, 1), (3, 2)]
    chosen = [next(i for i in exe.programs.instructions if i.op is Op.RECV and (i.mesh, i.src_mesh) == pair)
              for pair in pairs]
    programs = dataclasses.replace(exe.programs, instructions=tuple(chosen))
    plan = placed(exe.plan, device_ids, num_nodes=3, per_node=4)
    sim = simulate(plan, exe.program, programs, trace=True, **options)
    return sim, [(start, end, nbytes) for _, _, start, end, nbytes in recv_spans(sim, exe.program)]


@pytest.mark.parametrize("into", ["node 1", "from node 1"])
def test_two_meshes_of_one_node_take_turns_on_its_nic(into):
    """Meshes 1 and 2 share node 1 (meshes 0 and 3 on nodes 0 and 2). Two transfers through node 1's NIC
    in the same direction at once, each ``T = n / (4 x bandwidth)`` alone, are serialised: the first in the
    programs' order takes ``[0, T]``, the second ``[T, 2T]`` (not both ``[0, 2T]`` at half the rate). With
    meshes 2 and 3 swapped (mesh 2 on node 2, mesh 3 on node 1), no NIC carries both in one direction and
    both take ``[0, T]``."""
    shared = ((0, 1), (4, 5), (6, 7), (8, 9))
    sim, ((s0, e0, n0), (s1, e1, n1)) = two_receives(shared, into)
    t0, t1 = n0 / 4e9, n1 / 4e9
    assert (s0, e0) == pytest.approx((0.0, t0))
    assert (s1, e1) == pytest.approx((t0, t0 + t1))
    assert sim.step_seconds == pytest.approx(t0 + t1)
    apart = ((0, 1), (4, 5), (8, 9), (6, 7))  # meshes 2 and 3 swap nodes: no NIC used twice in one direction
    sim, spans = two_receives(apart, into)
    assert [s for s, _, _ in spans] == [0.0, 0.0]
    assert [e for _, e, _ in spans] == pytest.approx([t0, t1])
    sim, spans = two_receives(shared, into, nic_contention=False)  # the what-if: each has the NIC alone
    assert [(s, e) for s, e, _ in spans] == [(0.0, pytest.approx(t0)), (0.0, pytest.approx(t1))]


def test_a_nic_carries_one_transfer_at_a_time_in_a_pipeline():
    """1F1B over four meshes, two per node, every stage boundary across nodes. Per NIC and direction, the
    RECVs through it never run at once: their transfer times alone (:func:`transfer_seconds`) add up to no
    more than the time their spans cover (a RECV interrupted by another's spans the wait too); and the step
    is longer than with one mesh per node."""
    from alpa_like.runtime.simulator import transfer_seconds

    exe = mlp_executable(stages(((0,), (1,), (2,), (3,)), ((1, 2),) * 4, ((1, 2),) * 4), num_micro_batches=4)

    def simulated(ids, num_nodes):
        plan = placed(exe.plan, ids, num_nodes=num_nodes, per_node=4)
        plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, compute_seconds=4 * 3e-7)
                                                      for s in plan.stages))  # 0.1 us forward, 0.2 us backward
        return plan, simulate(plan, exe.program, exe.programs, trace=True)

    ids = ((0, 1), (4, 5), (2, 3), (6, 7))  # meshes 0, 2 on node 0 and 1, 3 on node 1
    plan, sim = simulated(ids, 2)
    node_of = {mesh: ids[mesh][0] // 4 for mesh in range(4)}
    spans, work = {}, {}
    for mesh, text, start, end, _ in recv_spans(sim, exe.program):
        src = int(text.split("mesh ")[1])
        if node_of[src] == node_of[mesh]:
            continue
        alone = transfer_seconds(plan, exe.program.values[int(text.split()[1][1:].split("@")[0])].aval, src, mesh)
        assert end - start >= alone - 1e-15
        for nic in ((node_of[mesh], "in"), (node_of[src], "out")):
            spans.setdefault(nic, []).append((start, end))
            work[nic] = work.get(nic, 0.0) + alone
    assert set(spans) == {(0, "in"), (1, "in"), (0, "out"), (1, "out")}
    for nic, intervals in spans.items():
        covered, reach = 0.0, -1.0
        for a, b in sorted(intervals):
            covered += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        assert work[nic] <= covered + 1e-15, nic
    _, alone = simulated(((0, 1), (4, 5), (8, 9), (12, 13)), 4)  # one mesh per node
    assert sim.step_seconds > alone.step_seconds


def test_nic_book_serialises_and_conserves_work_on_random_transfers():
    """Random transfers over 3 nodes' NICs, ready up to 400 s (where a float's step exceeds 1e-14): each
    booking ends, lasts at least its duration, and per NIC the booked pieces are disjoint and add up to the
    durations of the transfers through it."""
    import random

    from alpa_like.runtime.simulator import NicBook

    rng = random.Random(0)
    book, through = NicBook(), {}
    for _ in range(2000):
        nics = frozenset({(rng.randrange(3), "in"), (rng.randrange(3), "out")})
        ready, duration = rng.uniform(0, 400), rng.uniform(1e-3, 0.5)
        start, end = book.take(nics, ready, duration)
        assert start >= ready and end - start >= duration * (1 - 1e-9)
        for nic in nics:
            through[nic] = through.get(nic, 0.0) + duration
    for nic, total in through.items():
        starts, ends = book._starts[nic], book._ends[nic]
        assert all(e <= s for e, s in zip(ends, starts[1:]))
        assert sum(e - s for s, e in zip(starts, ends)) == pytest.approx(total, rel=1e-9)


def test_a_terapipe_plan_is_priced_by_the_simulator_over_its_token_slices():
    """TeraPipe's token-sliced schedule lowers to instruction programs with one unit per (micro-batch,
    token slice), each priced at its share of a micro-batch: with equal stages, equal slices and free
    communication the step is GPipe's over m n units, (m n + p - 1) (t_f + t_b) / n."""
    from alpa_like.compiler.sliced_step import slice_step
    from alpa_like.pipeshard import simulate_plan
    from tests.runtime.test_terapipe_runtime import gpt_case

    loss_fn, state, batches = gpt_case(num_layers=2)
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, 4),) * 2, ((1, 4),) * 2),
                                  pipeline_schedule="terapipe", token_slices=(8, 8))
    plan = al.plan(step, state, batches[0], method=method, cluster=al.ClusterSpec.preset("p3.16xlarge"))
    assert plan.token_slicing == ((2, (8, 8)),) * 2
    sliced = slice_step(method, step, (state, batches[0]), static_argnums=(), batch_argnums=(1,))
    sim = simulate_plan(idealised(plan), sliced)
    p, m, n = 2, 2, 2
    assert sim.step_seconds == pytest.approx((m * n + p - 1) * 1.0 / (m * n))
    assert sim.timeline.bubble_fraction("ideal") == pytest.approx((p - 1) / (m * n))
    assert sorted(str(s.task) for s in sim.timeline.spans if s.mesh == 0) == sorted(
        f"0{phase}{k}.{i}" for phase in "FB" for k in range(m) for i in range(n))


def test_dispatch_costs_delay_receives_and_add_to_instructions_and_the_step():
    """A runtime's fixed costs (the Ray backend's): on the textbook GPipe pipeline (p = 2 equal stages, free
    bytes), a parcel latency r < t_f hides in the steady state but not on the critical path's three crossings
    (stage 0's first forward -> stage 1, stage 1's first backward -> stage 0, and the tied embedding's gradient
    parts the meshes exchange, both ways at once, before their apply-grads): step = (m + p - 1)(t_f + t_b) +
    3 r; the step's own cost s adds once; each RUN, RECV and LOAD pays the per-instruction cost d."""
    from alpa_like.runtime.instructions import Op
    from alpa_like.runtime.simulator import DispatchCosts, instruction_kind

    exe = executable("gpipe", num_micro_batches=4)
    plan = idealised(exe.plan)
    p, m, r, s, d = 2, 4, 0.01, 0.5, 1e-3
    t_f_plus_t_b = 1.0 / m
    assert r < t_f_plus_t_b / 3  # t_f = (t_f + t_b) / 3
    latency = simulate(plan, exe.program, exe.programs, dispatch=DispatchCosts(transfer_seconds=r))
    assert latency.step_seconds == pytest.approx((m + p - 1) * t_f_plus_t_b + 3 * r)
    step = simulate(plan, exe.program, exe.programs, dispatch=DispatchCosts(step_seconds=s))
    assert step.step_seconds == pytest.approx((m + p - 1) * t_f_plus_t_b + s)
    base = simulate(plan, exe.program, exe.programs, nic_contention=False)
    per = simulate(plan, exe.program, exe.programs, nic_contention=False,
                   dispatch=DispatchCosts(instruction_seconds=d))
    counts = collections.Counter(instruction_kind(str(ins)) for ins in exe.programs.instructions
                                 if ins.op in (Op.RUN, Op.RECV, Op.LOAD))
    assert counts["RECV"] and counts["LOAD"]
    for kind, n in counts.items():
        assert per.seconds_by_kind[kind] == pytest.approx(base.seconds_by_kind[kind] + n * d), kind


def test_dispatch_costs_are_checked():
    from alpa_like.runtime.simulator import DispatchCosts

    with pytest.raises(ValueError, match="transfer_seconds"):
        DispatchCosts(transfer_seconds=-1.0)
    with pytest.raises(ValueError, match="step_seconds"):
        DispatchCosts(step_seconds=float("nan"))
    exe = executable("gpipe", num_micro_batches=2)
    with pytest.raises(TypeError, match="dispatch"):
        simulate(exe.plan, exe.program, exe.programs, dispatch={"step_seconds": 1.0})
