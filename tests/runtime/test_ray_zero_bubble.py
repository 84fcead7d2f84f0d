"""The Ray backend runs the zero-bubble schedules' B and W pieces with jax.jit's result on one device."""
import pytest

import alpa_like as al
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps
from tests.runtime.test_pipeshard_runtime import gpt_case, mlp_case, moe_case, train_step_for
from tests.runtime.test_ray_backend import MESHES, cache_dir, method_for, ray_backend  # noqa: F401 (fixtures)

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("build,meshes,schedule,num_micro_batches,manual", [
    (mlp_case, "2_meshes", "zb_h1", 2, True),
    pytest.param(gpt_case, "3_meshes", "zb_h2", 4, False, marks=pytest.mark.slow),
    pytest.param(moe_case, "2_meshes", "zb_h1", 2, False, marks=pytest.mark.slow),
], ids=["mlp_2_meshes_zb_h1", "gpt_3_meshes_zb_h2", "moe_2_meshes_zb_h1"])
def test_zero_bubble_schedules_match_jit_on_ray(ray_backend, build, meshes, schedule,  # noqa: F811
                                                num_micro_batches, manual):
    loss_fn, state, batches = build()
    batches = batches[:2]
    step = train_step_for(loss_fn)
    method = method_for(meshes, schedule, num_micro_batches=num_micro_batches, manual=manual)
    f = al.parallelize(step, method=method)
    got_state, got_losses = run_steps(f, state, batches)
    exe = f.get_executable(got_state, batches[0])
    assert any(phase == "wgt" for _, phase in exe.program.pieces)
    ref_state, ref_losses = reference_on_one_device(step, state, batches)
    # Micro-batch sums and sharded matmuls reassociate float32 additions.
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
