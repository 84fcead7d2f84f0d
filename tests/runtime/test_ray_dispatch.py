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


def test_a_parcel_is_the_deliver_calls_argument():
    """A peer's ``deliver`` carries the parcel itself (Ray inlines a small one in the call and puts a large
    one in the object store once): each buffer is in the mailbox as it was sent, with no object ref to
    look up."""
    from alpa_like.runtime.ray_worker import MeshWorker
    worker = MeshWorker({})
    items = [{"pieces": {0: [(((0, 2),), np.arange(2.0))]}}, {"pieces": {}}]
    worker.deliver(7, 3, [(1, 0), (2, -1)], items)
    assert worker._wait_for(7, 3, (2, -1)) is items[1]
    assert worker._wait_for(7, 3, (1, 0)) is items[0]
    with pytest.raises(ValueError):  # a key without its buffer
        worker.deliver(7, 4, [(1, 0), (2, -1)], items[:1])
