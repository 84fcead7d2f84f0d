"""The Ray backend's fixed costs for the simulator (:mod:`alpa_like.runtime.ray_dispatch`) and the parcels
the workers hand each other: no Ray started."""
import numpy as np
import pytest

from alpa_like.runtime.instructions import Op
from alpa_like.runtime.ray_dispatch import LOADS, costs_from_steps, dispatch_programs
from alpa_like.runtime.simulator import DispatchCosts


def test_costs_are_the_steps_over_the_empty_one():
    """step = the empty step; instruction = (loads - empty) / LOADS; transfer = receive - empty - 2
    instructions (its LOAD and RECV), never below 0."""
    costs = costs_from_steps(0.004, 0.004 + LOADS * 1e-4, 0.0075)
    assert isinstance(costs, DispatchCosts)
    assert (costs.step_seconds, costs.instruction_seconds, costs.transfer_seconds) == pytest.approx(
        (0.004, 1e-4, 0.0033))
    noisy = costs_from_steps(0.004, 0.003, 0.0035)
    assert (noisy.instruction_seconds, noisy.transfer_seconds) == (0.0, 0.0)


def test_the_programs_are_empty_loads_and_one_receive():
    programs = dispatch_programs()
    assert [len(p.instructions) for p in programs["empty"]] == [0, 0]
    assert [len(p.instructions) for p in programs["loads"]] == [LOADS, 0]
    sender, receiver = programs["receive"]
    assert [i.op for i in sender.instructions] == [Op.LOAD] and [i.op for i in receiver.instructions] == [Op.RECV]
    assert sender.sends == {sender.instructions[0].key: (1,)} and receiver.instructions[0].src_mesh == 0


def _workers(src_shape=(2, 1), dst_shape=(1, 2)):
    """A sending and a receiving worker in this process (mesh 0 LOADs step input 0 and sends it, mesh 1 RECVs
    it), the sender's ``deliver.remote`` calling the receiver's ``deliver`` directly."""
    import types

    from alpa_like.runtime.instructions import PER_STEP, Instruction
    from alpa_like.runtime.ray_worker import MeshInfo, MeshWorker, WorkerProgram
    key = (0, PER_STEP)
    meshes = (MeshInfo(logical_shape=src_shape, device_ids=((0,), (1,)) if src_shape == (2, 1) else ((0, 1),)),
              MeshInfo(logical_shape=dst_shape, device_ids=((2,), (3,)) if dst_shape == (2, 1) else ((2, 3),)))

    def program(mesh, instructions, **kw):
        return WorkerProgram(mesh=mesh, meshes=meshes, instructions=tuple(instructions), pieces={}, input_specs={},
                             constants={}, num_micro_batches=1, **kw)
    sender, receiver = MeshWorker({}), MeshWorker({})
    peer = types.SimpleNamespace(deliver=types.SimpleNamespace(remote=receiver.deliver))
    sender.load_program(7, program(0, [Instruction(Op.LOAD, 0, key)], sends={key: (1,)}, outputs=()), [None, peer])
    receiver.load_program(7, program(1, [Instruction(Op.RECV, 1, key, src_mesh=0)], sends={}, outputs=((0, key),)),
                          [None, None])
    return sender, receiver, key


def test_a_parcel_is_assembled_on_the_receiver_as_it_arrives():
    """The receiver's ``deliver`` (the peer's call, whose argument is the parcel itself) puts the pieces on its
    devices and assembles them before its step asks: the mailbox holds the array in the RECV's layout, and
    the RECV takes it as it is."""
    import jax
    sender, receiver, key = _workers()
    array = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    sender.run_step(7, 0, {0: ("value", array)}, [], [], [])
    kind, arrived = receiver._mailbox[(7, 0, key)]
    assert kind == "value" and isinstance(arrived, jax.Array)
    from alpa_like.runtime.pipeshard_runtime import activation_spec
    assert arrived.sharding.is_equivalent_to(receiver._loaded[7].sharding(activation_spec((8, 4), (1, 2))), 2)
    receiver.run_step(7, 0, {}, [11], [], [])
    assert receiver._store[11] is arrived
    np.testing.assert_array_equal(receiver.fetch(11), array)


def test_a_parcel_that_cannot_be_assembled_fails_the_recv_not_the_call():
    """An error assembling a buffer is mailed: the sender's call returns, and the receiver's RECV raises it
    naming the instruction; a parcel of fewer buffers than keys is refused by the call."""
    from alpa_like.runtime.ray_worker import WorkerStepError
    _, receiver, key = _workers()
    item = {"shape": (8, 4), "dtype": "float32", "src_mesh": 0, "src_spec": _spec("S0R"), "dst_spec": _spec("S1R"),
            "pieces": {2: [(((0, 4), (0, 4)), np.zeros((3, 4), np.float32))]}, "key_impl": None}
    receiver.deliver(7, 0, [key], [item])
    with pytest.raises(WorkerStepError, match=r"mesh 1: instruction #0 `RECV"):
        receiver.run_step(7, 0, {}, [11], [], [])
    with pytest.raises(ValueError, match="2 keys for 1 buffers"):
        receiver.deliver(7, 1, [key, (1, 0)], [item])
    receiver.deliver(8, 0, [key], [item])
    assert receiver._mailbox[(8, 0, key)][0] == "error"


def _spec(text):
    from alpa_like.compiler.sharding_spec import ShardingSpec
    return ShardingSpec.from_str(text)


def test_parcels_of_a_finished_or_aborted_step_are_dropped():
    """A step that ends (here: aborted, its RECV never run) leaves no parcel of its own behind, and a parcel
    for it that arrives later is not kept: the mailbox holds only what a step still to run will RECV."""
    from alpa_like.runtime.ray_worker import WorkerStepError
    sender, receiver, key = _workers()
    array = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    sender.run_step(7, 0, {0: ("value", array)}, [], [], [])
    sender.run_step(7, 1, {0: ("value", array)}, [], [], [])
    assert set(receiver._mailbox) == {(7, 0, key), (7, 1, key)}
    receiver.abort(7, 0)
    receiver._mailbox.pop((7, 0, key))  # step 0's parcel is late: the RECV waits, the abort ends it
    with pytest.raises(WorkerStepError, match="aborted by the driver"):
        receiver.run_step(7, 0, {}, [11], [], [])
    sender.run_step(7, 0, {0: ("value", array)}, [], [], [])  # step 0's parcel arrives after the step ended
    assert set(receiver._mailbox) == {(7, 1, key)}
    receiver.run_step(7, 1, {}, [12], [], [])
    assert receiver._mailbox == {}
    np.testing.assert_array_equal(receiver.fetch(12), array)


def test_buffers_queued_while_a_parcel_is_sent_travel_together_in_the_next():
    """The sender thread takes everything flushed so far: the first buffer leaves alone, and the two flushed
    while its call was still being made leave in one parcel (one object, one call) after it; each arrives."""
    import threading
    import types

    import jax

    from alpa_like.runtime.instructions import PER_STEP
    from alpa_like.runtime.pipeshard_runtime import activation_spec
    from alpa_like.runtime.ray_worker import _StepRun
    sender, receiver, _ = _workers()
    started, release, calls = threading.Event(), threading.Event(), []

    def deliver(exe_id, step, keys, parcel):
        calls.append(list(keys))
        started.set()
        assert release.wait(10)
        receiver.deliver(exe_id, step, keys, parcel)
    sender._loaded[7].peers[1] = types.SimpleNamespace(deliver=types.SimpleNamespace(remote=deliver))
    run = _StepRun(sender, sender._loaded[7], 7, 0)
    src_sharding = sender._loaded[7].sharding(activation_spec((8, 4), (2, 1)))
    arrays = [jax.device_put(np.full((8, 4), v, np.float32), src_sharding) for v in range(3)]
    keys = [(v, PER_STEP) for v in range(3)]
    spec = activation_spec((8, 4), (1, 2))
    run.outbox = {1: [(keys[0], arrays[0], spec)]}
    run.flush()
    assert started.wait(10)
    for key, x in zip(keys[1:], arrays[1:]):
        run.outbox = {1: [(key, x, spec)]}
        run.flush()
    release.set()
    run.finish_sends()
    assert calls == [[keys[0]], keys[1:]]
    for v, key in enumerate(keys):
        kind, arrived = receiver._mailbox[(7, 0, key)]
        assert kind == "value"
        np.testing.assert_array_equal(np.asarray(arrived), np.full((8, 4), v, np.float32))


def test_a_buffer_is_mailed_before_the_rest_of_its_parcel_is_assembled(monkeypatch):
    """``deliver`` mails each buffer as soon as it is assembled: when the parcel's second buffer is being
    assembled, the first one's RECV can already take it."""
    from alpa_like.runtime import ray_worker
    from alpa_like.runtime.instructions import PER_STEP
    sender, receiver, _ = _workers()
    keys = [(0, PER_STEP), (1, PER_STEP)]
    mailed_before = []
    arrival = ray_worker._arrival

    def watched(loaded, exe_id, item):
        mailed_before.append(sorted(k[2] for k in receiver._mailbox))
        return arrival(loaded, exe_id, item)
    monkeypatch.setattr(ray_worker, "_arrival", watched)
    item = {"shape": (8, 4), "dtype": "float32", "src_mesh": 0, "src_spec": _spec("RR"), "dst_spec": _spec("RR"),
            "pieces": {2: [(((0, 8), (0, 4)), np.ones((8, 4), np.float32))],
                       3: [(((0, 8), (0, 4)), np.ones((8, 4), np.float32))]}, "key_impl": None}
    receiver.deliver(7, 0, keys, [item, item])
    assert mailed_before == [[], [keys[0]]]
    assert sorted(k[2] for k in receiver._mailbox) == keys
