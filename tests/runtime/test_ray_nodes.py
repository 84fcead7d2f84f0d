"""Ray nodes as the planner sees them, the node of every mesh of a plan, and the driver's view of a lost worker:
pure functions on ``ray.nodes()``-shaped data, no Ray started."""
import dataclasses
import doctest
from types import SimpleNamespace

import numpy as np
import pytest

import alpa_like as al
from alpa_like.compiler.layer_slicing import FORWARD
from alpa_like.runtime.ray_startup import connect_ray, is_loopback_address
from alpa_like.runtime.ray_nodes import (HEAD_RESOURCE, HeadWatch, RayNode, answering, busiest_host, choose_nodes,
                                         cluster_nodes, cpu_worker_env, died_at, head_text, host_spec, mesh_nodes,
                                         one_node_meshes, with_placements, WorkerPings, mark_silent, not_silent,
                                         SILENT_SECONDS)
from alpa_like.runtime.instructions import Instruction, Op
from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state


def ray_node(node_id, address="10.0.0.1", alive=True, head=False, port=None, **resources):
    node = {"Alive": alive, "NodeID": node_id, "NodeManagerAddress": address,
            "Resources": {**resources, **({HEAD_RESOURCE: 1.0} if head else {})}}
    return node if port is None else {**node, "NodeManagerPort": port}


NODES = [ray_node("cc", "10.0.0.2", CPU=4.0, GPU=2.0), ray_node("bb", "10.0.0.2", CPU=8.0, GPU=4.0),
         ray_node("dd", "10.0.0.3", alive=False, CPU=4.0), ray_node("aa", "10.0.0.9", head=True, CPU=2.0)]


def test_nodes_are_the_alive_ones_with_devices_head_first_then_by_address_and_id():
    cpu = cluster_nodes(NODES, "cpu")
    assert [(n.index, n.node_id, n.num_devices, n.is_head) for n in cpu] == [
        (0, "aa", 2, True), (1, "bb", 8, False), (2, "cc", 4, False)]
    gpu = cluster_nodes(NODES, "gpu")  # the head has no GPU
    assert [(n.node_id, n.num_devices) for n in gpu] == [("bb", 4), ("cc", 2)]
    assert str(gpu[0]) == "Ray node 0 (10.0.0.2, id bb)"


def test_devices_per_node_default_to_the_fewest_and_a_bigger_request_names_both_counts():
    cpu, gpu = cluster_nodes(NODES, "cpu"), cluster_nodes(NODES, "gpu")
    assert choose_nodes(cpu, "cpu") == (cpu, 2)
    assert choose_nodes(cpu, "cpu", num_nodes=2, num_devices_per_node=16) == (cpu[:2], 16)  # virtual CPU devices
    assert choose_nodes(gpu, "gpu", num_nodes=1) == (gpu[:1], 4)
    with pytest.raises(ValueError, match="num_nodes=4, but the Ray cluster has 3 alive nodes with CPU resources"):
        choose_nodes(cpu, "cpu", num_nodes=4)
    with pytest.raises(ValueError, match=r"num_devices_per_node=4, but Ray node 1 \(10.0.0.2, id cc\) has 2 GPUs"):
        choose_nodes(gpu, "gpu", num_devices_per_node=4)
    with pytest.raises(ValueError, match="no alive node with GPU resources"):
        choose_nodes((), "gpu")


def fake_plan(num_nodes, per_node, *device_ids):
    cluster = SimpleNamespace(num_nodes=num_nodes, num_devices_per_node=per_node)
    return SimpleNamespace(cluster=cluster, stages=[SimpleNamespace(device_ids=ids, submesh_shape=(1, len(ids)))
                                                    for ids in device_ids])


def test_each_mesh_runs_on_the_node_of_its_devices_and_a_plan_bigger_than_the_cluster_is_refused():
    nodes = cluster_nodes(NODES, "cpu")
    assert mesh_nodes(fake_plan(2, 2, (2, 3), (0, 1)), nodes, 2) == (1, 0)
    assert mesh_nodes(fake_plan(3, 1, (0,), (1,), (2,)), nodes, 2) == (0, 1, 2)  # the plan's own devices per node
    with pytest.raises(ValueError, match="the plan needs 4 nodes, but the Ray cluster has 3"):
        mesh_nodes(fake_plan(4, 1, (0,), (1,), (2,), (3,)), nodes, 2)
    with pytest.raises(ValueError, match="the plan needs 4 devices per node, but the Ray backend's nodes have 2"):
        mesh_nodes(fake_plan(1, 4, (0, 1), (2, 3)), nodes, 2)
    with pytest.raises(NotImplementedError, match=r"stage 0's mesh \(1, 2\) spans nodes \[0, 1\].*submesh_shapes"):
        mesh_nodes(fake_plan(2, 2, (1, 2), (0, 3)), nodes, 2)


def test_automatic_stages_on_several_nodes_use_one_node_meshes():
    auto = al.PipeshardParallel(num_micro_batches=2, stage_option=al.AutoStageOption(show_progress=False))
    two_nodes = dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge"), num_nodes=2, num_devices_per_node=4)
    assert one_node_meshes(auto, two_nodes).stage_option.submesh_shapes == ((1, 1), (1, 2), (1, 4))
    one_node = dataclasses.replace(two_nodes, num_nodes=1)
    given = dataclasses.replace(auto, stage_option=al.AutoStageOption(submesh_shapes=((2, 4),)))
    manual = dataclasses.replace(auto, stage_option=al.ManualStageOption(
        forward_stage_layer_ids=((0,), (1,)), submesh_physical_shapes=((1, 4),) * 2,
        submesh_logical_shapes=((4, 1),) * 2))
    assert one_node_meshes(auto, one_node) is auto
    assert one_node_meshes(given, two_nodes) is given and one_node_meshes(manual, two_nodes) is manual


@pytest.fixture(scope="module")
def plan():
    step = al.parallelize(make_train_step(mlp_loss), method=al.DataParallel())
    return step.get_executable(mlp_state(), mlp_batch(np.random.default_rng(0))).plan


def test_the_printed_plan_names_the_node_of_each_mesh_and_json_keeps_it(plan):
    node = RayNode(index=1, node_id="3f63b52c4bd2d3a9", address="10.0.0.2", num_devices=8)
    placed = with_placements(plan, [None, node], [1])
    assert "on Ray node 1 (10.0.0.2, id 3f63b52c)" in str(placed)
    assert "on Ray node" not in str(plan)
    assert al.ParallelPlan.from_json(placed.to_json()) == placed
    without = placed.to_dict()
    del without["stages"][0]["placement"]  # a plan file written before the field existed
    assert al.ParallelPlan.from_dict(without) == plan


def test_nodes_at_one_address_share_a_machine_and_the_busiest_machine_counts_the_plan_devices_of_all():
    nodes = cluster_nodes([ray_node("a", "127.0.0.1", head=True, CPU=2.0), ray_node("b", "127.0.0.1", CPU=2.0),
                           ray_node("c", "10.0.0.5", CPU=8.0)], "cpu")
    node, devices = busiest_host(nodes, 2)
    assert (node.node_id, devices) == ("a", 4)
    assert busiest_host(nodes[2:], 2) == (nodes[2], 2)


def _fake_spec(num_devices, label):
    return al.ClusterSpec(name=label, num_nodes=1, num_devices_per_node=num_devices, device_name="cpu",
                          peak_flops=1e9, device_memory=2**30, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9,
                          intra_node_latency=0.0, inter_node_latency=0.0, shared_host_compute=True)


@pytest.mark.parametrize("driver, driver_devices, expected", [
    ("a", 8, ("driver", 4)),        # on the machine, with devices to spare: every device of the machine at once
    ("a", 2, ("node a", 4)),        # too few devices on the driver: a task on the machine measures
    ("elsewhere", 8, ("node a", 4)),  # a driver off the machine measures nothing of it
])
def test_cpu_speed_is_measured_with_every_device_of_the_busiest_machine_busy(driver, driver_devices, expected):
    """Two Ray nodes of 2 CPU devices at one address share one machine's cores: the speed per device is
    measured with all 4 busy, on the driver when it runs there with 4 CPU devices, else on the machine."""
    nodes = cluster_nodes([ray_node("a", "127.0.0.1", head=True, CPU=2.0), ray_node("b", "127.0.0.1", CPU=2.0)],
                          "cpu")
    cpus = [SimpleNamespace(platform="cpu", id=i) for i in range(driver_devices)]

    def local(devices):
        assert list(devices) == cpus[:len(devices)]
        return _fake_spec(len(devices), "driver")

    spec = host_spec(nodes, 2, driver_node_id=driver, driver_devices=cpus, local=local,
                     measure_on=lambda node, n: _fake_spec(n, f"node {node.node_id}"))
    assert (spec.name, spec.num_devices_per_node) == expected


def test_a_cpu_worker_gets_its_own_device_count_and_keeps_the_other_xla_flags():
    env = cpu_worker_env(4, "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    assert env == {"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4",
                   "JAX_PLATFORMS": "cpu"}


def test_raylets_that_refuse_a_connection_are_left_out():
    refused = {("10.0.0.2", 7)}

    def connect(address, timeout):
        if address in refused:
            raise ConnectionRefusedError
        return SimpleNamespace(close=lambda: None)
    nodes = [ray_node("a", "10.0.0.1", port=7), ray_node("b", "10.0.0.2", port=7), ray_node("c", "10.0.0.2")]
    assert [n["NodeID"] for n in answering(nodes, connect=connect)] == ["a", "c"]  # c: no port to probe


PROGRAM = [Instruction(Op.LOAD, 0, (3, -1)), Instruction(Op.RUN, 0, stage=0, phase=FORWARD, micro_batch=0)]


@pytest.mark.parametrize("progress,step,expected", [
    ((5, 2, 1), 2, "at instruction #1 `RUN 0F0`"),
    ((5, 1, 1), 2, "before its first instruction of step 2 (it had entered #1 of step 1)"),
    ((4, 2, 1), 2, "(instruction unknown: no progress record of this executable readable from the driver)"),
    (None, 2, "(instruction unknown: no progress record of this executable readable from the driver)"),
])
def test_a_lost_worker_is_placed_by_its_progress_record(progress, step, expected):
    assert died_at(progress, 5, step, PROGRAM) == expected


def test_a_head_that_refuses_connections_is_named_as_lost_at_the_next_probe():
    """The watch probes the GCS port at most every ``every`` seconds; a refused (or timed-out) connection is a
    message naming the head node and its GCS; a bad address is a ValueError."""
    now, probes, refuse = [0.0], [], [False]

    def connect(address, timeout):
        probes.append((address, timeout))
        if refuse[0]:
            raise ConnectionRefusedError(111, "Connection refused")
        return SimpleNamespace(close=lambda: None)
    head = RayNode(index=0, node_id="aabbccddee", address="10.0.0.1", num_devices=2, is_head=True)
    text = head_text([head], "10.0.0.1:6379")
    assert text == "the head node (Ray node 0 (10.0.0.1, id aabbccdd, head), GCS at 10.0.0.1:6379)"
    assert head_text([], "10.0.0.1:6379") == "the head node (GCS at 10.0.0.1:6379)"  # no devices on the head
    watch = HeadWatch("10.0.0.1:6379", text, every=2.0, timeout=1.0, connect=connect, clock=lambda: now[0])
    now[0] = 1.0
    assert watch.lost() is None and probes == []  # not due yet
    now[0] = 2.0
    assert watch.lost() is None and probes == [(("10.0.0.1", 6379), 1.0)]
    refuse[0] = True
    now[0] = 3.0
    assert watch.lost() is None and len(probes) == 1
    now[0] = 4.0
    lost = watch.lost()
    assert lost.startswith(f"{text} does not answer (ConnectionRefusedError: ") and "cannot continue" in lost
    with pytest.raises(ValueError, match="gcs_address must be 'host:port', got 'nowhere'"):
        HeadWatch("nowhere", text)


class FakeWorkers:
    """Pings answered by hand: ``answer(mesh, text)`` answers that mesh's ping out (handles are numbers)."""

    def __init__(self):
        self.sent: list[int] = []
        self.answers: dict[int, object] = {}

    def send(self, mesh: int) -> int:
        self.sent.append(mesh)
        return len(self.sent) - 1

    def answer(self, mesh: int, answer) -> None:
        self.answers[max(h for h, m in enumerate(self.sent) if m == mesh)] = answer

    def collect(self, handles: list) -> dict:
        return {h: self.answers.pop(h) for h in handles if h in self.answers}


def test_a_worker_that_stops_answering_pings_is_named_after_the_timeout_with_its_last_answer():
    clock = [0.0]
    workers = FakeWorkers()
    pings = WorkerPings(workers.send, workers.collect, timeout=10.0, every=1.0, clock=lambda: clock[0])
    assert pings.silent([0, 1]) is None and workers.sent == []  # a wait shorter than `every` pings no one
    clock[0] = 1.0
    assert pings.silent([0, 1]) is None and workers.sent == [0, 1]  # both pinged at once
    workers.answer(0, "step 3 instruction #2 `RUN`")
    workers.answer(1, "idle")
    clock[0] = 1.5
    assert pings.silent([0, 1]) is None and workers.sent == [0, 1]  # answered, next ping not due yet
    clock[0] = 2.5  # a second after the answers came in
    assert pings.silent([0, 1]) is None and workers.sent == [0, 1, 0, 1]
    workers.answer(1, "step 3 instruction #5 `RECV`")  # mesh 0 falls silent from here on
    for t in (3.5, 4.5, 12.0):
        clock[0] = t
        assert pings.silent([0, 1]) is None
        workers.answer(1, "step 3 instruction #5 `RECV`")
    assert workers.sent.count(0) == 2  # one ping out at a time
    clock[0] = 12.5
    assert pings.silent([0, 1]) == (0, 10.0, "step 3 instruction #2 `RUN`")


def test_a_worker_that_never_answered_and_a_dead_one():
    clock = [0.0]
    workers = FakeWorkers()
    pings = WorkerPings(workers.send, workers.collect, timeout=5.0, every=1.0, clock=lambda: clock[0])
    clock[0] = 1.0
    pings.silent([0, 1])
    workers.answer(1, RuntimeError("actor died"))  # dead: no more pings; the step's own call names it
    clock[0] = 6.0
    assert pings.silent([0, 1]) == (0, 5.0, "no answer yet")
    clock[0] = 20.0
    assert pings.silent([1]) is None and workers.sent == [0, 1]
    assert pings.silent([]) is None  # a finished mesh is not pinged



def test_a_node_where_a_ping_went_unanswered_is_left_out_for_a_while_with_a_warning():
    nodes = [ray_node("silent-node-a", "10.0.0.7", CPU=2.0), ray_node("silent-node-b", "10.0.0.8", CPU=2.0)]
    mark_silent("silent-node-a", clock=lambda: 1000.0)
    with pytest.warns(UserWarning, match=r"Ray node silent-n \(10\.0\.0\.7\) is left out: a worker there left a "
                                         r"ping unanswered 30 s ago"):
        assert not_silent(nodes, clock=lambda: 1030.0) == nodes[1:]
    assert not_silent(nodes, clock=lambda: 1000.0 + SILENT_SECONDS) == nodes  # counted again


@pytest.mark.parametrize("bad", [0, -1.0, True, "10"])
def test_a_ping_timeout_that_is_not_positive_seconds_is_refused_before_ray_starts(bad):
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match=rf"ping_timeout must be > 0 seconds or None, got {bad!r}"):
        al.init(cluster="ray", ping_timeout=bad)

def test_a_loopback_address_is_dialled_from_loopback():
    pytest.importorskip("ray")
    calls = []
    for address in ("127.0.0.1:6379", "localhost:6379", "[::1]:6379", "10.0.0.1:6379", "auto"):
        connect_ray(address, init=lambda **kwargs: calls.append(kwargs.get("_node_ip_address")))
    assert calls == ["127.0.0.1", "127.0.0.1", "127.0.0.1", None, None]
    assert [is_loopback_address(a) for a in ("127.0.0.2:1", "example.com:1")] == [True, False]


def test_a_worker_away_from_the_drivers_host_keeps_no_progress_record(tmp_path):
    from alpa_like.runtime.ray_worker import MeshWorker
    assert MeshWorker({}, str(tmp_path / "missing" / "worker0.progress"))._progress is None
    here = MeshWorker({}, str(tmp_path / "worker0.progress"))
    assert here._progress is not None and list(here._progress) == [-1, -1, -1]


def test_doctests():
    from alpa_like.runtime import ray_nodes
    assert doctest.testmod(ray_nodes).failed == 0
