"""The Ray backend on a cluster of several real Ray nodes (:class:`LocalCluster`: each node its own raylet and
object store, all on this machine, talking over loopback).

A process holds one Ray connection at a time, so the module's cluster replaces the session's local Ray
(``ray_session``) while the module runs: the fixture shuts that Ray down first and starts it again after.
"""
import dataclasses
import re
import threading
import time

import jax
import numpy as np
import psutil
import pytest

import alpa_like as al
from alpa_like import api
from alpa_like.runtime.instructions import Op
from alpa_like.runtime.ray_backend import RayStepError
from alpa_like.runtime.ray_nodes import PING_SECONDS
from alpa_like.runtime.ray_startup import start_local_ray
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps
from tests.runtime.test_pipeshard_runtime import mlp_case, stages, train_step_for

pytestmark = pytest.mark.ray

DEVICES_PER_NODE = 2
ONE_MESH_PER_NODE = stages(((0, 1), (2, 3)), ((1, DEVICES_PER_NODE),) * 2, ((DEVICES_PER_NODE, 1),) * 2)


def ray_processes() -> set[int]:
    """This process's descendants (Ray's node and worker processes among them)."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from alpa_like.runtime.ray_local_cluster import LocalCluster
    al.shutdown()
    restart = ray.is_initialized()  # the session's local Ray: one Ray per process
    if restart:
        ray.shutdown()
    before = ray_processes()
    local = LocalCluster(num_nodes=2, num_cpus_per_node=DEVICES_PER_NODE)
    yield local
    al.shutdown()
    local.shutdown()
    deadline = time.monotonic() + 30
    while ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes() - before, "processes of the local cluster left running"
    if restart:
        start_local_ray(num_cpus=2, startup_timeout=180)


def test_meshes_run_on_the_plan_nodes_and_a_pipeline_across_nodes_equals_jit(cluster):
    import ray
    al.init(cluster="ray", address=cluster.address)
    try:
        backend = api._backend.ray
        assert (backend.num_nodes, backend.num_devices_per_node) == (2, DEVICES_PER_NODE)  # from the nodes' CPUs
        assert [n.node_id for n in backend.nodes] == [n.node_id for n in cluster.nodes]  # head first
        # both nodes share this machine: its speed per device with all 4 devices busy, measured on the driver
        assert backend.spec() == dataclasses.replace(al.ClusterSpec.local(jax.devices()[:4]), name="ray-cpu",
                                                     num_nodes=2, num_devices_per_node=DEVICES_PER_NODE)
        loss_fn, state, batches = mlp_case()
        step = train_step_for(loss_fn)
        f = al.parallelize(step, method=al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                                             stage_option=ONE_MESH_PER_NODE))
        got, _ = run_steps(f, state, batches[:2])
        exe = f.get_executable(got, batches[0])
        assert exe.mesh_nodes == (0, 1)
        placed = [ray.get(w.info.remote())["node_id"] for w in exe.workers]
        assert placed == [backend.nodes[k].node_id for k in exe.mesh_nodes]
        printed = str(exe.plan)
        for k in exe.mesh_nodes:
            assert f"on {backend.nodes[k]}" in printed
        assert exe.last_step.worker_bytes > 0  # activations and gradients crossed nodes
        ref, _ = reference_on_one_device(step, state, batches[:2])
        assert_trees_close(got.params, ref.params, rtol=1e-5, atol=1e-6)
    finally:
        al.shutdown()


def test_a_task_pinned_to_a_node_measures_that_many_cpu_devices_there(cluster):
    """The measurement for a driver without the machine's device count: a Ray task with its own XLA CPU
    devices on the node, returning its :meth:`ClusterSpec.local`."""
    from alpa_like.runtime.ray_nodes import measure_on_node
    al.init(cluster="ray", address=cluster.address)
    try:
        node = api._backend.ray.nodes[1]
        spec = measure_on_node(node, 3, xla_flags="", timeout=120)
        assert (spec.num_devices_per_node, spec.shared_host_compute, spec.device_name) == (3, True, "cpu")
    finally:
        al.shutdown()


def test_more_nodes_or_devices_than_the_cluster_has_are_refused(cluster):
    with pytest.raises(ValueError, match="num_nodes=3, but the Ray cluster has 2 alive nodes with CPU resources"):
        al.init(cluster="ray", address=cluster.address, num_nodes=3)
    al.init(cluster="ray", address=cluster.address)
    try:
        loss_fn, state, batches = mlp_case()
        one_node_of_four = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge"), num_devices_per_node=4)
        f = al.parallelize(train_step_for(loss_fn), cluster=one_node_of_four, method=al.PipeshardParallel(
            num_micro_batches=2, layer_option=al.ManualLayerOption(),
            stage_option=stages(((0, 1), (2, 3)), ((1, 2),) * 2, ((2, 1),) * 2)))
        with pytest.raises(ValueError, match="the plan needs 4 devices per node, but the Ray backend's nodes have 2"):
            f.get_executable(state, batches[0])
    finally:
        al.shutdown()


def test_the_benchmark_runs_on_every_node_of_a_given_cluster(cluster):
    """``python -m alpa_like.bench opt --backend ray --address ...``'s run: the automatic plan spans both
    nodes and its measured step comes with the simulator's prediction, which includes the Ray backend's fixed
    costs measured on the executable's workers, and with one profiled step's seconds per instruction kind
    beside the simulator's."""
    from alpa_like.bench import backends
    workload = backends.local_workload("opt")
    method = backends.measured_methods(workload)[0]
    m = backends.run_ray(workload, method, steps=1, address=cluster.address)
    assert (m.num_nodes, m.num_devices) == (2, 2 * DEVICES_PER_NODE)
    assert m.measured_seconds > 0 and m.predicted_seconds > 0
    assert set(m.dispatch) == {"step_seconds", "instruction_seconds", "transfer_seconds"}
    assert m.dispatch["step_seconds"] > 0 and m.predicted_seconds > m.predicted_without_dispatch_seconds > 0
    assert {"RUN", "LOAD", "RECV"} <= set(m.measured_seconds_by_kind) <= set(m.predicted_seconds_by_kind)
    assert all(seconds > 0 for seconds in m.measured_seconds_by_kind.values())


def first_run_on(exe, mesh: int) -> int:
    return next(i for i, ins in enumerate(exe.worker_programs[mesh].instructions) if ins.op is Op.RUN)


def test_a_node_lost_between_steps_is_a_named_error_in_time(cluster):
    import ray
    loss_fn, state, batches = mlp_case()
    f = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=2, layer_option=al.ManualLayerOption(), stage_option=ONE_MESH_PER_NODE))
    al.init(cluster="ray", address=cluster.address)
    try:
        state1, _ = f(state, batches[0])
        node = api._backend.ray.nodes[1]
        worker = psutil.Process(ray.get(f.get_executable(state1, batches[1]).workers[1].info.remote())["pid"])
        cluster.remove_node(cluster.node(node.node_id))
        worker.wait(30)  # exits once its raylet is gone: the node is lost before the next step starts
        start = time.monotonic()
        with pytest.raises(RayStepError, match=rf"step 1: the worker of mesh 1 on Ray node 1 \(127\.0\.0\.1, id "
                                               rf"{node.node_id[:8]}\) \w+( \w+)? before its first instruction of "
                                               r"step 1 \(it had entered #\d+ of step 0\)"):
            f(state1, batches[1])
        assert time.monotonic() - start < 30
    finally:
        al.shutdown()
        cluster.add_node()


@pytest.mark.slow
def test_a_lost_node_is_a_named_error_in_time_and_training_resumes_from_the_checkpoint(cluster, tmp_path):
    """The stage DP places meshes on both nodes; node 1's processes are killed while its mesh is inside a step;
    the driver names the mesh, the node and the instruction within 30 s; on the node left, al.init re-plans and
    the run continues from its checkpoint to the parameters plain jax.jit reaches."""
    import ray
    loss_fn, state, batches = mlp_case()
    step = train_step_for(loss_fn)
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=al.AutoStageOption(show_progress=False))  # one-node meshes on Ray
    f = al.parallelize(step, method=method)
    al.init(cluster="ray", address=cluster.address)
    state1, _ = f(state, batches[0])
    al.save_checkpoint(tmp_path, state1, 1)
    exe = f.get_executable(state1, batches[1])
    mesh = exe.mesh_nodes.index(1)
    victim, node = exe.workers[mesh], api._backend.ray.nodes[1]
    index = first_run_on(exe, mesh)
    ray.get(victim.set_fault.remote(index, "stall"))

    def remove_node_when_stalled():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if f"instruction #{index} " in ray.get(victim.where.remote()):
                cluster.remove_node(cluster.node(node.node_id))
                return
            time.sleep(0.05)

    killer = threading.Thread(target=remove_node_when_stalled, daemon=True)
    killer.start()
    start = time.monotonic()
    instruction = exe.worker_programs[mesh].instructions[index]
    with pytest.raises(RayStepError, match=rf"the worker of mesh {mesh} on Ray node 1 \(127\.0\.0\.1, id "
                                           rf"{node.node_id[:8]}\) \w+( \w+)? at instruction #{index} "
                                           rf"`{instruction}`"):
        f(state1, batches[1])
    assert time.monotonic() - start < 30
    killer.join(30)
    al.shutdown()

    al.init(cluster="ray", address=cluster.address)
    try:
        assert api._backend.ray.num_nodes == 1
        exe = f.get_executable(state1, batches[1])
        assert set(exe.mesh_nodes) == {0}
        restored = al.restore_checkpoint(tmp_path, like=exe)
        got, _ = run_steps(f, restored, batches[1:])
        got = jax.tree.map(np.asarray, got)
    finally:
        al.shutdown()
        cluster.add_node()  # the module's cluster has two nodes again
    ref, _ = reference_on_one_device(step, state, batches)
    assert_trees_close(got.params, ref.params, rtol=1e-5, atol=1e-6)


def node_processes(cluster, node_id: str) -> list[psutil.Process]:
    """A node's raylet (with its object store) and every process it started (its workers among them)."""
    raylet = psutil.Process(cluster.node(node_id).all_processes["raylet"][0].process.pid)
    return [raylet, *raylet.children(recursive=True)]


def test_a_frozen_node_is_a_named_error_in_time(cluster, tmp_path):
    """Node 1's processes are stopped (SIGSTOP) while its mesh is inside a step: its connections stay open, as
    those of a machine whose power or network is gone, and Ray would mark the node dead only after its health
    checks (about a minute). The driver's pings name the mesh, the node and the instruction first; a checkpoint
    of the state it holds is named the same way; al.init then leaves the frozen node out, and training runs on
    the node left."""
    import signal
    import ray
    loss_fn, state, batches = mlp_case()
    f = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
        num_micro_batches=2, layer_option=al.ManualLayerOption(), stage_option=ONE_MESH_PER_NODE))
    al.init(cluster="ray", address=cluster.address, ping_timeout=4.0)
    node = api._backend.ray.nodes[1]
    frozen = []
    try:
        state1, _ = f(state, batches[0])
        exe = f.get_executable(state1, batches[1])
        victim, index = exe.workers[1], first_run_on(exe, 1)
        ray.get(victim.set_fault.remote(index, "stall"))

        def freeze_when_stalled():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if f"instruction #{index} " in ray.get(victim.where.remote()):
                    time.sleep(2 * PING_SECONDS)  # the driver's pings have seen it there
                    frozen.extend(node_processes(cluster, node.node_id))
                    for process in frozen:
                        process.send_signal(signal.SIGSTOP)
                    return
                time.sleep(0.05)

        freezer = threading.Thread(target=freeze_when_stalled, daemon=True)
        freezer.start()
        start = time.monotonic()
        instruction = exe.worker_programs[1].instructions[index]
        with pytest.raises(RayStepError, match=rf"step 1: the worker of mesh 1 on Ray node 1 \(127\.0\.0\.1, id "
                                               rf"{node.node_id[:8]}\) has not answered a ping for \d+ s \(its last "
                                               rf"answer: step 1 instruction #{index} `{re.escape(str(instruction))}`"
                                               r"\): a frozen or unreachable machine"):
            f(state1, batches[1])
        assert time.monotonic() - start < 30
        freezer.join(30)
        assert frozen
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"copying the checkpoint's arrays: the worker on Ray node 1 "
                                               rf"\(127\.0\.0\.1, id {node.node_id[:8]}\) has not answered a ping"):
            al.save_checkpoint(tmp_path, state1, 1)
        assert time.monotonic() - start < 30
        al.shutdown()
        with pytest.warns(UserWarning, match=rf"Ray node {node.node_id[:8]} \(127\.0\.0\.1\) is left out"):
            al.init(cluster="ray", address=cluster.address)
        assert [n.node_id for n in api._backend.ray.nodes] == [cluster.nodes[0].node_id]
        again = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
            num_micro_batches=2, layer_option=al.ManualLayerOption(),
            stage_option=al.AutoStageOption(show_progress=False)))  # re-planned for the node left
        got, _ = run_steps(again, state, batches[:2])
        ref, _ = reference_on_one_device(train_step_for(loss_fn), state, batches[:2])
        assert_trees_close(got.params, ref.params, rtol=1e-5, atol=1e-6)
    finally:
        for process in frozen:
            process.send_signal(signal.SIGCONT)
        al.shutdown()
        cluster.remove_node(cluster.node(node.node_id))
        cluster.add_node()  # the module's cluster has two healthy nodes again


LOSE_THE_HEAD = """
import os, sys, time
sys.path.insert(0, os.getcwd())
import ray
import alpa_like as al
from alpa_like import api
from alpa_like.runtime.ray_backend import RayStepError
from alpa_like.runtime.ray_local_cluster import LocalCluster
from alpa_like.runtime.ray_startup import loopback_node_ip
from tests.runtime.test_pipeshard_runtime import mlp_case, train_step_for
from tests.runtime.test_ray_multinode import ONE_MESH_PER_NODE


def report(*words):  # to a file of its own: Ray's log lines on stdout could cut into a line
    with open(REPORT, "a") as f:
        print(*words, file=f, flush=True)

cluster = LocalCluster(num_nodes=1, num_cpus_per_node=2)  # the head, on 127.0.0.1
with loopback_node_ip():  # a second node on 127.0.0.2, where the driver attaches (not the head's raylet)
    cluster._cluster.add_node(**{**cluster._node_args(), "node_ip_address": "127.0.0.2"})
    ray.init(address=cluster.address, _node_ip_address="127.0.0.2", include_dashboard=False, log_to_driver=False)
al.init(cluster="ray", address=cluster.address)
loss_fn, state, batches = mlp_case()
f = al.parallelize(train_step_for(loss_fn), method=al.PipeshardParallel(
    num_micro_batches=2, layer_option=al.ManualLayerOption(), stage_option=ONE_MESH_PER_NODE))
state1, _ = f(state, batches[0])
report("head", api._backend.ray.nodes[0])
head, other = cluster.nodes
kill_head = lambda: head.kill_all_processes(check_alive=False, allow_graceful=False)  # GCS, raylet, workers
if MID_STEP:  # the worker on the other node stalls at its first RUN; the head goes when it is there
    import threading
    exe = f.get_executable(state1, batches[1])
    mesh = exe.mesh_nodes.index(1)
    victim = exe.workers[mesh]
    index = next(i for i, ins in enumerate(exe.worker_programs[mesh].instructions) if ins.op.name == "RUN")
    ray.get(victim.set_fault.remote(index, "stall"))

    def kill_when_stalled():
        while f"instruction #{index} " not in ray.get(victim.where.remote()):
            time.sleep(0.05)
        report("stalled")
        kill_head()
    threading.Thread(target=kill_when_stalled, daemon=True).start()
else:
    kill_head()
start = time.monotonic()
try:
    f(state1, batches[1])
    report("no error")
except RayStepError as e:
    report(f"error after {time.monotonic() - start:.1f} s: {e}")
other.kill_all_processes(check_alive=False, allow_graceful=False)
deadline = time.monotonic() + 30
while cluster.processes_alive() and time.monotonic() < deadline:
    time.sleep(0.2)
report("processes left" if cluster.processes_alive() else "processes gone")
os._exit(0)  # Ray would end a driver whose GCS stays unreachable, after 60 s
"""


@pytest.mark.slow
@pytest.mark.parametrize("mid_step", [False, True], ids=["between-steps", "mid-step"])
def test_a_lost_head_node_is_a_named_error_in_time(mid_step, tmp_path):
    """A driver attached to another node's raylet (as one started elsewhere with ``--address``) loses the head
    (the GCS, its raylet and the worker of mesh 0) between steps, or during one while the other node's worker
    is inside it: the step raises a RayStepError naming the head within 30 s instead of hanging. In a process
    of its own, as it loses its Ray. (A driver attached to the head's own raylet is ended by Ray at once: see
    docs/ray.md.)"""
    import subprocess
    import sys
    report = tmp_path / "report.txt"
    script = f"MID_STEP = {mid_step}\nREPORT = {str(report)!r}\n" + LOSE_THE_HEAD
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    out = report.read_text() if report.exists() else ""
    context = f"report:\n{out}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert ("stalled" in out) == mid_step, context
    head = re.search(r"^head (Ray node 0 \(127\.0\.0\.1, id \w+, head\))$", out, re.M)
    assert head, context
    # The head check, or the call to the head's own worker failing first (both name the head node); between
    # steps the worker may be lost before or after it entered step 1.
    error = (re.search(r"^error after ([\d.]+) s: Ray backend: step 1: the head node \((.*?), GCS at "
                       r"127\.0\.0\.1:\d+\) does not answer \(\w+.*\): the Ray cluster is gone", out, re.M)
             or re.search(r"^error after ([\d.]+) s: Ray backend: step 1: the worker of mesh 0 on (.*?) became "
                          r"unreachable (at instruction #\d+|before its first instruction of step 1) ", out, re.M))
    assert error, context
    assert error.group(2) == head.group(1), context
    assert float(error.group(1)) < 30, context
    assert "processes gone" in out, context
