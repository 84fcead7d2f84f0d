"""A batch read by several stages stays alive until every mesh has loaded it, whatever its layout.

The model is a VAE-like encoder/decoder whose loss reads the input in the first stage (the encoder) and in
the last (the reconstruction). The layouts are the ones where a LOAD's ``device_put`` keeps the micro-batch
slice's own buffer: a batch replicated on its mesh because its rows do not split over it, and one-device
meshes.
"""
import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_like as al
from alpa_like.runtime import pipeshard_runtime
from tests.helpers import assert_trees_close, reference_on_one_device, run_steps

DIMS = (6, 8, 4)  # input, hidden, latent


def vae_loss(params, batch):
    x = batch["x"]
    h = jnp.tanh(x @ params["enc_0"])
    al.mark_pipeline_boundary()
    z = h @ params["enc_1"]
    al.mark_pipeline_boundary()
    h = jnp.tanh(z @ params["dec_0"])
    al.mark_pipeline_boundary()
    recon = h @ params["dec_1"]
    return jnp.mean((recon - x) ** 2) + 0.1 * jnp.mean(z ** 2)


def train_step(state, batch):
    loss, grads = al.value_and_grad(vae_loss)(state.params, batch)
    return state.apply_gradients(grads=grads), loss


def vae_case(rows: int):
    d, h, z = DIMS
    rng = np.random.default_rng(0)
    shapes = {"enc_0": (d, h), "enc_1": (h, z), "dec_0": (z, h), "dec_1": (h, d)}
    params = {name: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)
              for name, shape in shapes.items()}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    batches = [{"x": jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)} for _ in range(2)]
    return state, batches


SCHEDULES = {  # name: virtual stages (two meshes: the looping schedules put two chunks on each)
    "gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "breadth_first": 2,
}
LAYOUTS = {  # name: (devices of the cluster, rows per micro-batch)
    "replicated_on_1x4": (8, 3),  # 3 rows do not split over 4 devices: the slice is replicated on its mesh
    "one_device_meshes": (2, 4),
}


@pytest.fixture
def devices(request):
    count = LAYOUTS[request.node.callspec.params["layout"]][0]
    al.init("local", devices=jax.devices()[:count])
    yield
    al.shutdown()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("schedule, num_micro_batches", [
    (schedule, m) for schedule in sorted(SCHEDULES) for m in (1, 2)
    if not (schedule == "interleaved_1f1b" and m == 1)])  # interleaved: micro-batches a multiple of the meshes
def test_a_batch_two_meshes_load_matches_jit_and_stays_alive(devices, schedule, layout, num_micro_batches):
    state, batches = vae_case(rows=LAYOUTS[layout][1] * num_micro_batches)
    method = al.PipeshardParallel(
        num_micro_batches=num_micro_batches, layer_option=al.ManualLayerOption(),
        stage_option=al.UniformStageOption(num_stages=2, show_progress=False), pipeline_schedule=schedule,
        virtual_stages=SCHEDULES[schedule])
    f = al.parallelize(train_step, method=method)
    got_state, got_losses = run_steps(f, state, batches)
    ref_state, ref_losses = reference_on_one_device(train_step, state, batches)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_losses, ref_losses, rtol=1e-5, atol=1e-6)
    arrays = [x for x in jax.tree.leaves((state, batches)) if isinstance(x, jax.Array)]
    assert arrays and not any(x.is_deleted() for x in arrays)


@pytest.mark.parametrize("layout", ["replicated_on_1x4"])
def test_a_deleted_batch_leaf_is_named(devices, layout):
    state, batches = vae_case(rows=LAYOUTS[layout][1])
    f = al.parallelize(train_step, method=al.PipeshardParallel(
        num_micro_batches=1, layer_option=al.ManualLayerOption(),
        stage_option=al.UniformStageOption(num_stages=2, show_progress=False)))
    f(state, batches[0])
    batches[1]["x"].delete()
    with pytest.raises(ValueError, match=r"step input batch\.x is a deleted array"):
        f(state, batches[1])


def test_doctests():
    assert doctest.testmod(pipeshard_runtime).failed == 0
