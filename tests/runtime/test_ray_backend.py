"""The Ray backend runs the local backend's plans on worker actors with the same results.

Every test here uses the session's local Ray (``ray_session``) and a 1 node x 4 device Ray backend: each
mesh of a plan is one worker actor with its own virtual CPU devices. The workers share a persistent XLA
compilation cache (a temporary directory), so re-made workers do not compile the same pieces again.
"""
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.pipeshard import compile_pipeshard
from alpa_like.runtime import hlo_stats
from alpa_like.compiler.trace import updated_inputs
from alpa_like.runtime.instructions import Op
from alpa_like.runtime.mesh import named_sharding
from alpa_like.runtime.ray_backend import RayStepError, RemoteArray
from alpa_like.runtime.ray_programs import held_at_end, worker_programs
from alpa_like.runtime.ray_worker import MeshInfo
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps
from tests.runtime.test_pipeshard_runtime import (assert_matches_dropout_loop, dropout_key_step, gpt_case, mlp_case,
                                                 stages, train_step_for)

pytestmark = pytest.mark.ray

NUM_DEVICES = 4
MESHES = {  # name: stage option on a 1 x 4 cluster
    "2_meshes": stages(((0, 1), (2, 3)), ((1, 2), (1, 2)), ((2, 1), (1, 2))),
    "3_meshes": stages(((0, 1), (2,), (3,)), ((1, 2), (1, 1), (1, 1)), ((2, 1), (1, 1), (1, 1))),
}
# Planning on this machine's measured devices moves with its load (a lower measured latency makes the ILP
# split the hidden dimension instead of the batch); a test of what a plan compiles to plans on these numbers.
# The Ray backend measures its own cluster, so the ``fixed_cluster`` fixture does not reach it: pass this as
# ``al.parallelize(..., cluster=FIXED_CLUSTER)``.
FIXED_CLUSTER = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge"), num_devices_per_node=NUM_DEVICES)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla_cache"))


def init_ray(cache_dir):
    al.init(cluster="ray", num_nodes=1, num_devices_per_node=NUM_DEVICES, compilation_cache_dir=cache_dir)


@pytest.fixture(scope="module")
def ray_backend(ray_session, cache_dir):
    init_ray(cache_dir)
    yield
    al.shutdown()


def method_for(meshes: str, schedule: str = "1f1b", num_micro_batches: int = 2, manual: bool = False):
    layers = al.ManualLayerOption() if manual else al.AutoLayerOption(layer_num=4)
    return al.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option=layers,
                                stage_option=MESHES[meshes], pipeline_schedule=schedule)


def run_on_local_backend(step, method, state, batches):
    """The same plan on the local backend (4 of this process's devices), for comparison."""
    exe = compile_pipeshard(method, step, (state, batches[0]), static_argnums=(), batch_argnums=(1,),
                            devices=jax.devices()[:NUM_DEVICES])
    return run_steps(exe, state, batches)


@pytest.mark.slow
# each mesh count with one schedule (~60 s a case): the schedules' instruction orders are tested on the
# local backend, which runs the same programs
@pytest.mark.parametrize("meshes,schedule", [("2_meshes", "gpipe"), ("3_meshes", "1f1b")])
def test_gpt_matches_local_backend_and_jit(ray_backend, meshes, schedule):
    loss_fn, state, batches = gpt_case()
    batches = batches[:2]
    step = train_step_for(loss_fn)
    method = method_for(meshes, schedule)
    f = al.parallelize(step, method=method)
    got_state, got_losses = run_steps(f, state, batches)
    exe = f.get_executable(got_state, batches[0])
    assert len({id(w) for w in exe.workers}) == len(MESHES[meshes].submesh_physical_shapes)
    assert all(isinstance(x, RemoteArray) for x in jax.tree_util.tree_leaves(got_state.params))
    local_state, local_losses = run_on_local_backend(step, method, state, batches)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    # Same pieces and micro-batch sums on both backends; sharded matmuls reassociate float32 additions
    # against the single-device reference.
    assert_trees_close(got_state.params, local_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, local_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_each_micro_batch_draws_its_own_dropout_mask(ray_backend):
    """The shipped pieces take the micro-batch's index for their draws from per-step keys (typed keys cross
    jax.export), as on the local backend. Typed keys also travel: from the driver, from mesh to mesh (the key
    split off on mesh 0 for mesh 1's dropout), and back as the step's output."""
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=4),
                                  stage_option=MESHES["2_meshes"])
    assert_matches_dropout_loop(al.parallelize(dropout_key_step, method=method), num_micro_batches=2)


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "every micro-batch"])
def test_data_parallel_meshes_reduce_gradients_once_per_step(ray_backend, defer):
    # 64 rows per micro-batch against 16 x 16 weights: the ILP splits the batch over each mesh's 2 devices
    # (planned on the fixed cluster, so that the load of this machine does not move the choice). Deferred,
    # the shipped backward pieces keep per-device partial sums of the weight and bias gradients and the
    # worker's MEAN reduces them once per step, as on the local backend.
    loss_fn, state, _ = mlp_case()
    rng = np.random.default_rng(1)
    batches = [{"x": jnp.asarray(rng.normal(size=(256, 16)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)} for _ in range(2)]
    state = state.replace(tx=optax.sgd(0.1, momentum=0.9), opt_state=optax.sgd(0.1, momentum=0.9).init(state.params))
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=al.ManualLayerOption(),
                                  stage_option=MESHES["2_meshes"], defer_gradient_sync=defer)
    step = train_step_for(loss_fn)
    parallel = al.parallelize(step, method=method, cluster=FIXED_CLUSTER)
    got_state, got_losses = run_steps(parallel, state, batches)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    exe = parallel.get_executable(got_state, batches[0])
    reduced = {q: b for (q, phase), b in hlo_stats.reduced_bytes_by_piece(exe.get_hlo_text()).items() if phase == "bwd"}
    grad_bytes = 2 * (16 * 16 + 16) * 4  # two layers' weight and bias per stage
    if defer:
        assert {q: len(d.outputs) for q, d in exe.deferred.items()} == {0: 4, 1: 4}
        assert reduced == {0: 0, 1: 0}
    else:
        assert reduced == {0: grad_bytes, 1: grad_bytes}


def _collectives_by_piece(hlo_text: str) -> dict[str, list[tuple[str, int]]]:
    pieces = hlo_text.split("// stage ")[1:]
    return {text.split("\n", 1)[0]: sorted((c.kind, c.result_bytes) for c in hlo_stats.collectives(text))
            for text in pieces}


def test_the_workers_run_the_plans_layouts(ray_backend):
    """A stage the intra-op pass splits Megatron-style (4 rows per micro-batch against 512 x 512 weights: the
    first weight split by rows, the second by columns) runs with the collectives of the local backend's
    pieces for the same plan: its pins inside the shipped pieces and its layouts of the received and loaded
    values, not XLA's propagation from the inputs (which gathers the weights and all-reduces their
    gradients)."""
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(512, 512)) / 16, jnp.float32) for i in range(4)}

    def loss_fn(params, batch):
        x = batch["x"]
        for i in range(4):
            x = jnp.tanh(x @ params[f"w{i}"])
            if i == 1:
                al.mark_pipeline_boundary()
        return jnp.mean((x - batch["y"]) ** 2)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    batches = [{k: jnp.asarray(rng.normal(size=(8, 512)), jnp.float32) for k in "xy"} for _ in range(2)]
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=stages(((0,), (1,)), ((1, 2), (1, 2)), ((1, 2), (1, 2))))
    step = train_step_for(loss_fn)
    f = al.parallelize(step, method=method, cluster=FIXED_CLUSTER)
    got_state, _ = run_steps(f, state, batches)
    local = compile_pipeshard(method, step, (state, batches[0]), static_argnums=(), batch_argnums=(1,),
                              devices=jax.devices()[:NUM_DEVICES], cluster=FIXED_CLUSTER)
    local_state, _ = run_steps(local, state, batches)
    assert [str(t.spec) for t in local.plan.stages[0].inputs if t.path.endswith(("w0", "w1"))] == ["S1R", "RS1"]
    got = _collectives_by_piece(f.get_executable(got_state, batches[0]).get_hlo_text())
    assert got == _collectives_by_piece(local.get_hlo_text())
    assert got["0 fwd"] == [("all-reduce", 4 * 512 * 4)]  # the row-split weight's partial products, once
    assert_trees_close(got_state.params, local_state.params, rtol=1e-5, atol=1e-6)


def test_a_looping_schedule_runs_each_chunk_with_its_meshs_layouts(ray_backend):
    """interleaved_1f1b with 2 chunks per mesh: chunk ``s`` on mesh ``s mod 2``, each shipped with its layers'
    layouts on that mesh's logical view ((2, 1) and (1, 2)): the local backend's collectives."""
    loss_fn, state, batches = mlp_case()
    method = al.PipeshardParallel(num_micro_batches=4, layer_option=al.ManualLayerOption(),
                                  stage_option=MESHES["2_meshes"], pipeline_schedule="interleaved_1f1b",
                                  virtual_stages=2)
    step = train_step_for(loss_fn)
    f = al.parallelize(step, method=method, cluster=FIXED_CLUSTER)
    got_state, got_losses = run_steps(f, state, batches[:2])
    exe = f.get_executable(got_state, batches[0])
    assert [sorted({q for q, _ in p.pieces}) for p in exe.worker_programs] == [[0, 2], [1, 3]]
    assert all(p.pinned for w in exe.worker_programs for p in w.pieces.values())
    local = compile_pipeshard(method, step, (state, batches[0]), static_argnums=(), batch_argnums=(1,),
                              devices=jax.devices()[:NUM_DEVICES], cluster=FIXED_CLUSTER)
    run_steps(local, state, batches[:1])
    assert _collectives_by_piece(exe.get_hlo_text()) == _collectives_by_piece(local.get_hlo_text())
    ref_state, ref_losses = reference_on_one_device(step, state, batches[:2])
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_each_stage_piece_compiles_once_on_its_worker(ray_backend):
    """The shipped pieces carry their stage's intra-op layouts, so a piece whose outputs are accumulated
    compiles with the accumulation fused in on its first micro-batch already, not once without it first
    (as on the local backend); the next step compiles no piece."""
    import ray

    def listen(worker):
        import collections
        import jax
        compiled = worker.compiled_in_test = collections.Counter()

        def on(event, duration, **kwargs):
            compiled[kwargs.get("fun_name")] += event == "/jax/core/compile/backend_compile_duration"
        jax.monitoring.register_event_duration_secs_listener(on)

    def piece_compiles(worker):  # a piece's call ("call": the exported piece, "run": with its sums fused in)
        count = worker.compiled_in_test["jit(call)"] + worker.compiled_in_test["jit(run)"]
        worker.compiled_in_test.clear()
        return count

    loss_fn, state, batches = mlp_case()
    batches = [{k: v[:24] for k, v in b.items()} for b in batches[:2]]  # shapes no other test compiles (cache)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=MESHES["2_meshes"], pipeline_schedule="1f1b")
    f = al.parallelize(train_step_for(loss_fn), method=method, cluster=FIXED_CLUSTER)
    exe = f.get_executable(state, batches[0])
    assert all(p.pinned for w in exe.worker_programs for p in w.pieces.values())
    ray.get([w.__ray_call__.remote(listen) for w in exe.workers])
    state, _ = f(state, batches[0])
    assert sum(ray.get([w.__ray_call__.remote(piece_compiles) for w in exe.workers])) == len(exe.program.pieces) == 6
    f(state, batches[1])
    assert sum(ray.get([w.__ray_call__.remote(piece_compiles) for w in exe.workers])) == 0


@pytest.mark.slow
def test_two_steps_keep_parameters_off_the_driver(ray_backend):
    loss_fn, state, batches = gpt_case()
    f = al.parallelize(train_step_for(loss_fn), method=method_for("3_meshes"))
    state1, _ = f(state, batches[0])
    exe = f.get_executable(state1, batches[1])
    state2, loss = f(state1, batches[1])
    stats = exe.last_step
    batch_leaves = jax.tree_util.tree_leaves(batches[1])
    batch_bytes = sum(np.asarray(x).nbytes for x in batch_leaves)
    param_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(state.params))
    # Every state leaf was a handle, used in place or sent worker to worker; only the batch came from here.
    assert stats.inputs_by_kind["ref"] == len(batch_leaves)
    assert stats.inputs_by_kind["handle"] + stats.inputs_by_kind["peer"] >= len(jax.tree_util.tree_leaves(state1))
    assert stats.driver_sent_bytes < batch_bytes + 16_000 < param_bytes
    # What came back: a few numbers per worker, and the loss, no state.
    assert set(stats.driver_received_types) <= {"int", "float"}
    assert stats.driver_received_bytes < 200 * stats.driver_calls + loss.nbytes + 200
    assert stats.driver_calls == 3 and stats.worker_bytes > 0
    assert isinstance(loss, np.ndarray) and np.isfinite(float(loss))
    assert all(isinstance(x, RemoteArray) for x in jax.tree_util.tree_leaves(state2))


def test_outputs_fetch_lazily_and_are_freed_when_dropped(ray_backend):
    loss_fn, state, batches = mlp_case()
    f = al.parallelize(train_step_for(loss_fn), method=method_for("2_meshes", manual=True))
    new_state, loss = f(state, batches[0])
    exe = f.get_executable(new_state, batches[0])
    held = sum(exe.worker_handles())
    assert held == len(jax.tree_util.tree_leaves(new_state))  # the loss came back with the step
    assert isinstance(loss, np.ndarray)
    w0 = new_state.params["w0"]
    assert isinstance(w0, RemoteArray) and w0.shape == (16, 16) and w0.dtype == np.float32
    ref_state, _ = reference_on_one_device(train_step_for(loss_fn), state, batches[:1])
    np.testing.assert_allclose(np.asarray(w0), np.asarray(ref_state.params["w0"]), rtol=1e-5, atol=1e-6)
    del new_state, loss, w0
    exe.cluster.flush_frees()
    deadline = time.monotonic() + 30
    while sum(exe.worker_handles()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(exe.worker_handles()) == 0


def test_spmd_methods_and_bad_arguments_give_clear_errors(ray_backend):
    loss_fn, state, batches = mlp_case()
    with pytest.raises(NotImplementedError, match="runs PipeshardParallel steps; got DataParallel"):
        al.parallelize(train_step_for(loss_fn), method=al.DataParallel())(state, batches[0])
    with pytest.raises(ValueError, match="need cluster='ray'"):
        al.init("local", address="127.0.0.1:6379")
    with pytest.raises(ValueError, match="num_nodes must be an int >= 1"):
        al.init(cluster="ray", num_nodes=0)


def first_run(exe, mesh: int, text: str) -> int:
    program = exe.worker_programs[mesh].instructions
    return next(i for i, ins in enumerate(program) if ins.op is Op.RUN and str(ins) == text)


def test_a_raising_worker_names_mesh_and_instruction_then_reinit_works(ray_session, cache_dir):
    import ray
    init_ray(cache_dir)
    loss_fn, state, batches = mlp_case()
    step = train_step_for(loss_fn)
    f = al.parallelize(step, method=method_for("2_meshes", manual=True))
    state1, _ = f(state, batches[0])
    exe = f.get_executable(state1, batches[1])
    index = first_run(exe, 1, "RUN 1B0")
    ray.get(exe.workers[1].set_fault.remote(index, "raise"))
    with pytest.raises(RayStepError, match=rf"mesh 1: instruction #{index} `RUN 1B0` failed: RuntimeError"):
        f(state1, batches[1])
    with pytest.raises(RuntimeError, match="failed earlier"):
        f(state1, batches[1])
    al.shutdown()
    init_ray(cache_dir)
    got, _ = run_steps(f, state, batches[:2])
    ref, _ = reference_on_one_device(step, state, batches[:2])
    assert_trees_close(got.params, ref.params, rtol=1e-5, atol=1e-6)
    al.shutdown()




@pytest.mark.parametrize("paused", ["first-run", "last-instruction"])
def test_an_interrupted_step_stops_on_its_workers_and_leaves_its_inputs_usable_or_named(ray_session, cache_dir,
                                                                                       paused):
    """A KeyboardInterrupt while the driver waits for a step (Ctrl-C): the workers abort the step before the
    interrupt propagates, and the executable stays usable. Interrupted while mesh 1 waits at its first RUN,
    nothing was donated: the next call from the same state gives jax.jit's parameters. Interrupted at mesh 1's
    last instruction, mesh 0 has finished the step and donated its inputs: the next call names them."""
    import _thread
    import ray
    init_ray(cache_dir)
    loss_fn, state, batches = mlp_case()
    step = train_step_for(loss_fn)
    f = al.parallelize(step, method=method_for("2_meshes", manual=True), donate_argnums=(0,))
    state1, _ = f(state, batches[0])
    exe = f.get_executable(state1, batches[1])
    index = (first_run(exe, 1, "RUN 1F0") if paused == "first-run"
             else len(exe.worker_programs[1].instructions) - 1)
    ray.get(exe.workers[1].set_fault.remote(index, "pause"))

    def interrupt_when_paused():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if f"instruction #{index} " in ray.get(exe.workers[1].where.remote()):
                _thread.interrupt_main()
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_when_paused, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            f(state1, batches[1])
        assert exe.failed is None
        assert ray.get([w.where.remote() for w in exe.workers]) == ["idle", "idle"]
        ray.get(exe.workers[1].set_fault.remote(None))
        if paused == "first-run":
            got, _ = run_steps(f, state1, batches[1:2])
            ref, _ = reference_on_one_device(step, state, batches[:2])
            assert_trees_close(got.params, ref.params, rtol=1e-5, atol=1e-6)
        else:
            assert any(x.donated for x in jax.tree.leaves(state1) if isinstance(x, RemoteArray))
            with pytest.raises(ValueError, match="is a RemoteArray donated to an earlier step"):
                f(state1, batches[1])
            _, loss = f(state, batches[0])  # the executable runs on
            assert np.isfinite(float(loss))
    finally:
        al.shutdown()

@pytest.mark.slow
def test_a_worker_killed_mid_step_is_a_named_error_within_30_s(ray_session, cache_dir):
    import ray
    init_ray(cache_dir)
    loss_fn, state, batches = mlp_case()
    f = al.parallelize(train_step_for(loss_fn), method=method_for("3_meshes", manual=True))
    state1, _ = f(state, batches[0])
    exe = f.get_executable(state1, batches[1])
    victim = exe.workers[1]
    index = first_run(exe, 1, "RUN 1F1")
    ray.get(victim.set_fault.remote(index, "stall"))

    def kill_when_stalled():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if f"instruction #{index} " in ray.get(victim.where.remote()):
                ray.kill(victim, no_restart=True)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_stalled, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(RayStepError, match=rf"worker of mesh 1 on Ray node 0 \(127\.0\.0\.1, id \w+, head\) died at "
                                           rf"instruction #{index} `RUN 1F1`"):
        f(state1, batches[1])
    assert time.monotonic() - start < 30
    killer.join(5)
    al.shutdown()
    init_ray(cache_dir)
    _, loss = f(state, batches[0])
    assert np.isfinite(float(loss))
    al.shutdown()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_worker_programs_project_the_global_program(schedule):
    """Without Ray: each worker gets its mesh's instructions and pieces, sends every buffer another mesh
    RECVs, and holds every step output at least once."""
    loss_fn, state, batches = mlp_case()
    method = method_for("3_meshes", schedule, num_micro_batches=4, manual=True)
    exe = compile_pipeshard(method, train_step_for(loss_fn), (state, batches[0]), static_argnums=(),
                            batch_argnums=(1,), devices=jax.devices()[:NUM_DEVICES])
    meshes = [MeshInfo(logical_shape=s.logical_mesh_shape, device_ids=(tuple(s.device_ids),)) for s in exe.plan.stages]
    shipped = {key: b"" for key in exe.program.pieces}
    programs = worker_programs(exe.program, exe.programs, meshes, {}, shipped, 4)
    recvs = {(i.src_mesh, i.key, i.mesh) for i in exe.programs.instructions if i.op is Op.RECV}
    assert recvs and recvs == {(p.mesh, key, dst) for p in programs for key, dsts in p.sends.items() for dst in dsts}
    for k, p in enumerate(programs):
        assert p.instructions == exe.programs.program(k)
        assert {stage for stage, _ in p.pieces} == {k}
    held = [{key for _, key in p.outputs} for p in programs]
    for out in exe.programs.outputs:
        if out is not None:
            assert out[0] in held[out[1]]
    # A buffer a mesh received and never freed is held there too (a replica of the output).
    for k in range(len(programs)):
        received = {i.key for i in exe.programs.program(k) if i.op is Op.RECV}
        freed = {i.key for i in exe.programs.program(k) if i.op is Op.FREE}
        assert received - freed <= held_at_end(exe.program, exe.programs.program(k))


def test_worker_programs_pin_the_new_state_as_the_local_backend_does():
    """Without Ray: the pieces that make the new state make each leaf in the layout its mesh's LOAD puts the
    leaf in, the outputs and layouts the local backend pins."""
    loss_fn, state, batches = mlp_case()
    exe = compile_pipeshard(method_for("2_meshes", manual=True), train_step_for(loss_fn), (state, batches[0]),
                            static_argnums=(), batch_argnums=(1,), devices=jax.devices()[:NUM_DEVICES])
    meshes = [MeshInfo(logical_shape=s.logical_mesh_shape, device_ids=(tuple(s.device_ids),)) for s in exe.plan.stages]
    shipped = {key: b"" for key in exe.program.pieces}
    updated = updated_inputs(exe.traced.in_leaves, exe.traced.out_leaves)
    programs = worker_programs(exe.program, exe.programs, meshes, exe._input_specs, shipped, 2,
                               value_specs=exe.value_specs, updated=updated)
    pinned = {key: [None if spec is None else named_sharding(exe.meshes[p.mesh], spec) for spec in piece.out_specs]
              for p in programs for key, piece in p.pieces.items() if piece.out_specs}
    assert pinned.keys() == exe._out_pins.keys() and pinned  # the apply-grad pieces
    for key, shardings in pinned.items():
        ndims = [exe.program.values[v].aval.ndim for v in exe.program.piece(*key).outputs]
        assert [s is None for s in shardings] == [s is None for s in exe._out_pins[key]]
        assert all(s is None or s.is_equivalent_to(t, ndim)
                   for s, t, ndim in zip(shardings, exe._out_pins[key], ndims, strict=True))
    assert sum(s is not None for shardings in pinned.values() for s in shardings) == len(jax.tree.leaves(state))


def test_a_dropped_executable_after_shutdown_makes_no_remote_call():
    # Its finalizer runs at the latest at interpreter exit; a remote call then would start a new local Ray.
    pytest.importorskip("ray")
    from types import SimpleNamespace

    from alpa_like.runtime.ray_backend import _unload

    calls = []
    worker = SimpleNamespace(unload_program=SimpleNamespace(remote=lambda exe_id: calls.append(exe_id)))
    _unload(SimpleNamespace(closed=True), [worker], 7)
    assert calls == []
