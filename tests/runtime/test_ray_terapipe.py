"""TeraPipe on the Ray backend: the token-sliced step's instruction programs run by the Ray workers."""
import jax
import numpy as np
import pytest

import alpa_like as al
from alpa_like import pipeshard
from alpa_like.compiler.sharding_spec import ShardingSpec
from alpa_like.runtime import hlo_stats
from alpa_like.runtime.instructions import Op
from alpa_like.runtime.ray_backend import RayPipeshardExecutable
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps
from tests.runtime.test_pipeshard_runtime import stages, train_step_for
from tests.runtime.test_ray_backend import FIXED_CLUSTER, NUM_DEVICES, init_ray
from tests.runtime.test_terapipe_runtime import gpt_case

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_backend(ray_session, tmp_path_factory):
    init_ray(str(tmp_path_factory.mktemp("xla_cache")))
    yield
    al.shutdown()


@pytest.mark.slow  # a worker per mesh compiles four pieces per slice shape, plus the contract check: ~60 s
def test_terapipe_on_ray_matches_jit(ray_backend):
    """Two meshes of two devices, two micro-batches of token slices (10, 6): the workers run the programs
    (token-window LOADs, CARRYs of the key/value prefixes) and the parameters after three SGD steps and the
    losses equal jax.jit's on one device. The backward pieces the workers compiled keep the gradients as
    stacks of partial sums (reduced once per step by MEAN) and all-reduce nothing (as on the local backend:
    tests/runtime/test_terapipe_programs.py). Planned on ``FIXED_CLUSTER``: on this machine's measured
    devices, a low measured latency makes the ILP split the hidden dimension, which all-reduces in backward."""
    loss_fn, state, batches = gpt_case(num_layers=2)
    step = train_step_for(loss_fn)
    half = NUM_DEVICES // 2
    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="terapipe", token_slices=(10, 6),
                                  layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, half),) * 2, ((1, half),) * 2))
    parallel = al.parallelize(step, method=method, cluster=FIXED_CLUSTER)
    got_state, got_losses = run_steps(parallel, state, batches)
    exe = parallel.get_executable(state, batches[0])
    assert isinstance(exe.executor, RayPipeshardExecutable)
    assert any(ins.op is Op.CARRY for ins in exe.mesh_programs.instructions)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    assert_trees_close(jax_values(got_state.params), ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(jax_values(got_losses), ref_losses, rtol=1e-5, atol=1e-6)
    hlo = exe.get_hlo_text()
    reduced = {q: b for (q, phase), b in hlo_stats.reduced_bytes_by_piece(hlo).items() if phase == "bwd"}
    assert all(exe.executor.deferred[q].outputs for q in range(4))
    assert reduced == dict.fromkeys(range(4), 0), [line.strip() for line in hlo.splitlines()
                                                   if "all-reduce" in line or line.startswith("// stage")]


@pytest.mark.slow  # the workers load the exported pieces of two slice shapes: ~25 s
def test_terapipe_on_ray_loads_each_parameter_in_its_stage_layout(ray_backend, monkeypatch):
    """A parameter with a layout on each stage that reads it (GPT's tied word embedding, here given one on
    stage 1 too) is loaded on each mesh in that stage's layout, as on the local backend, not in the first
    stage's everywhere."""
    loss_fn, state, batches = gpt_case(num_layers=2)
    half = NUM_DEVICES // 2
    wte = "state.params.wte.embedding"
    split = ShardingSpec.from_str("S1R")
    plan_specs = pipeshard._optimizer_state_specs
    monkeypatch.setattr(pipeshard, "_optimizer_state_specs", lambda specs, leaves: {
        **plan_specs(specs, leaves), (1, wte): split})
    method = al.PipeshardParallel(num_micro_batches=2, pipeline_schedule="terapipe", token_slices=(10, 6),
                                  layer_option=al.AutoLayerOption(layer_num=2),
                                  stage_option=stages(((0,), (1,)), ((1, half),) * 2, ((1, half),) * 2))
    exe = al.parallelize(train_step_for(loss_fn), method=method).get_executable(state, batches[0])
    k = next(k for k, leaf in enumerate(exe.traced.in_leaves) if leaf.path == wte)
    assert exe.executor.input_placements()[k] == {0: ShardingSpec.from_str("RR"), 1: split}


def jax_values(tree):
    """Remote arrays fetched to the driver."""
    return jax.tree_util.tree_map(lambda x: np.asarray(x), tree)
