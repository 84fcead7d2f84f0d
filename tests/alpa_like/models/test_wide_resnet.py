"""Wide-ResNet: shapes, BatchNorm state, GroupNorm option, training, Table 3.8 sizes, bad input."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from alpa_like.models import (
    WRESNET_CONFIGS,
    WRESNET_TABLE_3_8_GPUS,
    WideResNet,
    num_params,
    wresnet_batch,
    wresnet_batch_shapes,
    wresnet_loss,
    wresnet_param_shapes,
)
from tests.alpa_like.models.model_helpers import key, name_to_count

TINY = WRESNET_CONFIGS["wresnet-tiny"]


@pytest.fixture(scope="module")
def tiny():
    model = WideResNet(TINY)
    batch = wresnet_batch(TINY, batch_size=4, rng=key(0))
    variables = jax.jit(lambda k, x: model.init(k, x, train=False))(key(1), batch["images"])
    return model, variables["params"], variables["batch_stats"], batch


def test_shapes_param_names_and_shape_only_init(tiny):
    model, params, batch_stats, batch = tiny
    logits = jax.jit(lambda p, s, x: model.apply({"params": p, "batch_stats": s}, x, train=False))(
        params, batch_stats, batch["images"]
    )
    assert logits.shape == (4, TINY.num_classes) and logits.dtype == jnp.float32
    assert set(params) == {"stem_conv", "stem_norm", "stage_0_block_0", "stage_1_block_0", "head"}
    block = params["stage_1_block_0"]
    f = 2 * TINY.base_channels
    assert block["conv2"]["kernel"].shape == (3, 3, f, f * TINY.width_factor)  # only the 3x3 conv is wide
    assert block["conv3"]["kernel"].shape == (1, 1, f * TINY.width_factor, 4 * f)
    shapes = wresnet_param_shapes(TINY)
    assert jax.tree.map(jnp.shape, (params, batch_stats)) == jax.tree.map(lambda x: x.shape, shapes)


def test_batchnorm_loss_updates_stats_and_decreases_with_adam(tiny):
    model, params, batch_stats, batch = tiny
    loss_fn = wresnet_loss(model)
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, batch_stats, opt_state):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    stats, opt_state, losses = batch_stats, opt.init(params), []
    for _ in range(5):
        params, stats, opt_state, loss = step(params, stats, opt_state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
    assert jax.tree.structure(stats) == jax.tree.structure(batch_stats)
    moved = jax.tree.map(lambda a, b: not np.allclose(a, b), stats, batch_stats)
    assert all(jax.tree.leaves(moved)), "every running statistic is updated in training mode"


def test_group_norm_has_no_stats_and_same_loss_signature():
    config = dataclasses.replace(TINY, norm="group", num_groups=2)
    model = WideResNet(config)
    loss_fn = wresnet_loss(model)
    batch = wresnet_batch(config, batch_size=2, rng=key(3))
    param_shapes, stats_shapes = wresnet_param_shapes(config)
    assert stats_shapes == {} and set(param_shapes["stage_0_block_0"]["norm1"]) == {"scale", "bias"}
    # Tracing value_and_grad checks the has_aux signature without compiling the backward pass.
    (loss, new_stats), grads = jax.eval_shape(
        jax.value_and_grad(loss_fn, has_aux=True), param_shapes, {}, batch
    )
    assert loss.shape == () and new_stats == {}
    assert jax.tree.structure(grads) == jax.tree.structure(param_shapes)
    loss, new_stats = jax.jit(
        lambda k, b: loss_fn(model.init(k, b["images"])["params"], {}, b)
    )(key(4), batch)
    assert np.isfinite(loss) and new_stats == {}


def test_batch_shapes_match_batch():
    batch = wresnet_batch(TINY, batch_size=3, rng=key(2))
    shapes = wresnet_batch_shapes(TINY, 3)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), batch) == jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
    assert int(batch["labels"].max()) < TINY.num_classes


@pytest.mark.parametrize("name", list(WRESNET_TABLE_3_8_GPUS))
def test_param_count_matches_table_3_8_name(name):
    # 10%: every row lands within 3% of its name (wresnet-13b is the furthest, 12.6B); BatchNorm
    # running statistics are not parameters and are not counted.
    params, _ = wresnet_param_shapes(WRESNET_CONFIGS[name])
    assert abs(num_params(params) / name_to_count(name) - 1) < 0.10, num_params(params)


def test_table_3_8_rows():
    rows = {n: (c.num_layers, c.base_channels, c.width_factor) for n, c in WRESNET_CONFIGS.items()}
    assert rows["wresnet-250m"] == (50, 160, 2) and rows["wresnet-13b"] == (101, 320, 16)
    assert {(WRESNET_CONFIGS[n].image_size, WRESNET_CONFIGS[n].num_classes) for n in WRESNET_TABLE_3_8_GPUS} == {
        (224, 1024)
    }
    assert list(WRESNET_TABLE_3_8_GPUS.values()) == [1, 4, 8, 16, 32, 64]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 34}, r"WResNetConfig.num_layers must be one of \[8, 26, 50, 101, 152\], got 34"),
        ({"norm": "layer"}, r"WResNetConfig.norm must be one of \('batch', 'group'\), got 'layer'"),
        ({"norm": "group", "num_groups": 3}, r"num_groups must divide base_channels=4 .* got 3"),
        ({"width_factor": 0}, r"WResNetConfig.width_factor must be a positive int, got 0"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **kwargs)


def test_wrong_image_shape_raises(tiny):
    model, params, batch_stats, _ = tiny
    with pytest.raises(ValueError, match=r"images must have shape \[batch, \*\(16, 16, 3\)\], got \(1, 8, 8, 3\)"):
        model.apply({"params": params, "batch_stats": batch_stats}, jnp.zeros((1, 8, 8, 3)), train=False)
