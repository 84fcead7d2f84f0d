"""Every method's plan says whether it fits the cluster's device memory; a step that cannot fit is not run."""
import dataclasses
import warnings

import jax
import numpy as np
import pytest

import alpa_like as al
from alpa_like.compiler.plan_format import memory_message
from tests.helpers import make_train_step, mlp_batch, mlp_loss, mlp_state

SIZES = (64, 256, 64)
PIPELINE = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2),
                                stage_option=al.UniformStageOption(num_stages=2))
METHODS = [al.DataParallel(), al.Zero2Parallel(), al.Zero3Parallel(), al.ShardParallel(), PIPELINE]
IDS = ["data", "zero2", "zero3", "shard", "pipeshard"]


def _cluster(device_memory: int) -> al.ClusterSpec:
    return dataclasses.replace(al.ClusterSpec.preset("p3.16xlarge"), device_memory=device_memory)


@pytest.fixture(scope="module")
def args():
    return mlp_state(sizes=SIZES), mlp_batch(np.random.default_rng(0), sizes=SIZES)


def _plan(method, args, device_memory):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = al.plan(make_train_step(mlp_loss), *args, method=method, cluster=_cluster(device_memory))
    return plan, [str(w.message) for w in caught if "memory" in str(w.message)]


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_plans_say_whether_they_fit(method, args):
    roomy, warned = _plan(method, args, 2**30)
    assert roomy.fits and roomy.memory_shortfall == 0 and not warned
    peak = max(s.peak_memory_per_device for s in roomy.stages)
    assert peak >= max(s.memory_per_device for s in roomy.stages) > 0
    assert "memory: peak memory per device" in str(roomy) and ": fits" in str(roomy)

    tight, warned = _plan(method, args, 1024)
    assert not tight.fits and tight.memory_shortfall == max(s.peak_memory_per_device for s in tight.stages) - 1024
    assert "does NOT fit" in str(tight) and warned and f"({tight.memory_shortfall} bytes) more" in warned[0]
    assert al.ParallelPlan.from_json(tight.to_json()) == tight
    advised = memory_message(tight).split("a sharding method such as ")[1].split(", or a cluster")[0]
    assert advised.split(" or ") == [m for m in ("Zero3Parallel", "ShardParallel") if m != type(method).__name__]


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_parallelize_refuses_a_plan_that_cannot_fit(method, args):
    step = al.parallelize(make_train_step(mlp_loss), method=method, cluster=_cluster(1024))
    with pytest.raises(ValueError, match=r"does NOT fit; .* \(\d+ bytes\) more per device needed.*its state alone"):
        step(*args)


@pytest.mark.parametrize("method", [al.DataParallel(), al.ShardParallel()], ids=["data", "shard"])
def test_a_plan_over_its_estimate_but_with_room_for_its_state_warns_and_runs(method, args):
    """Only the state is certain; the activations are an estimate (XLA may hold fewer): a plan whose state
    fits but whose estimated peak does not is run, with the warning."""
    plan, _ = _plan(method, args, 2**30)
    state = max(s.memory_per_device for s in plan.stages)
    peak = max(s.peak_memory_per_device for s in plan.stages)
    assert state < peak
    step = al.parallelize(make_train_step(mlp_loss), method=method, cluster=_cluster((state + peak) // 2))
    with pytest.warns(UserWarning, match="does NOT fit; .* its state fits, so this rests on the activation"):
        new_state, _ = step(*args)
    assert np.isfinite(float(jax.tree.leaves(new_state.params)[0].sum()))


def test_a_sharded_method_fits_where_data_parallelism_does_not(args):
    """Zero3 keeps 1/8 of the parameters and optimizer state on a device, DataParallel all of them: a
    device memory between their estimates fits one and not the other."""
    data, _ = _plan(al.DataParallel(), args, 2**30)
    zero3, _ = _plan(al.Zero3Parallel(), args, 2**30)
    low, high = zero3.stages[0].peak_memory_per_device, data.stages[0].peak_memory_per_device
    assert low < high / 4
    middle = (low + high) // 2
    assert _plan(al.Zero3Parallel(), args, middle)[0].fits
    assert not _plan(al.DataParallel(), args, middle)[0].fits


def test_activations_count_per_micro_batch(args):
    """Activations are held for one micro-batch at a time: more micro-batches, a smaller peak."""
    one, _ = _plan(al.DataParallel(num_micro_batches=1), args, 2**30)
    four, _ = _plan(al.DataParallel(num_micro_batches=4), args, 2**30)
    assert four.stages[0].peak_memory_per_device < one.stages[0].peak_memory_per_device
    assert four.stages[0].memory_per_device == one.stages[0].memory_per_device
