"""Wide-ResNet with bottleneck blocks, as in Alpa's benchmark (Alpa, dissertation ch. 3, Table 3.8).

A bottleneck block with ``f`` filters is ``1x1 conv (f) -> 3x3 conv (f * width_factor, stride) -> 1x1 conv
(4f)`` with a norm after each conv and a projected shortcut when the shape changes; stage ``i`` uses
``f = base_channels * 2**i``. The stem is a 7x7/2 conv and a 3x3/2 max-pool; the head is a global average
pool and a Dense layer. Note that Alpa widens only the inner 3x3 conv (unlike torchvision's
``wide_resnet50_2``, which also widens the first 1x1 conv).

Normalisation is BatchNorm (``norm="batch"``, statistics in the ``"batch_stats"`` collection) like Alpa, or
GroupNorm (``norm="group"``, no state). Either way the loss function of :func:`wresnet_loss` has the
signature ``loss_fn(params, batch_stats, batch) -> (loss, new_batch_stats)``.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa_like.models.common import (
    check_float_dtype,
    check_positive_int,
    mean_cross_entropy,
    variable_shapes,
)

__all__ = [
    "STAGE_SIZES",
    "WRESNET_CONFIGS",
    "WRESNET_TABLE_3_8_GPUS",
    "BottleneckBlock",
    "WResNetConfig",
    "WideResNet",
    "wresnet_batch",
    "wresnet_batch_shapes",
    "wresnet_loss",
    "wresnet_param_shapes",
]

Batch = dict[str, jax.Array]
WResNetLossFn = Callable[[Any, Any, Batch], tuple[jax.Array, Any]]

STAGE_SIZES: dict[int, tuple[int, ...]] = {
    8: (1, 1),
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}
"""Bottleneck blocks per stage for each depth; depth = 3 * blocks + 2 (stem conv and head)."""

NORMS = ("batch", "group")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WResNetConfig:
    """Shape of a bottleneck Wide-ResNet. Validated on construction (ValueError names the bad field)."""

    num_layers: int
    """Depth, a key of STAGE_SIZES: 50 or 101 for Table 3.8, 8 (two stages of one block) for tests."""
    base_channels: int
    """Filters f of the stem and the first stage; stage i uses f * 2**i."""
    width_factor: int
    """Multiplier of the inner 3x3 conv's output channels."""
    num_classes: int
    """Outputs of the classification head."""
    image_size: int
    """Height and width of the square RGB input."""
    dtype: Any = jnp.float32
    """Compute dtype of activations; parameters and batch statistics are float32, the loss float32."""
    norm: str = "batch"
    """'batch' (BatchNorm with running statistics, Alpa's choice) or 'group' (GroupNorm, stateless)."""
    num_groups: int = 32
    """Groups of GroupNorm; must divide base_channels (hence every channel count). Unused for 'batch'."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_positive_int(
            owner,
            base_channels=self.base_channels,
            width_factor=self.width_factor,
            num_classes=self.num_classes,
            image_size=self.image_size,
            num_groups=self.num_groups,
        )
        if self.num_layers not in STAGE_SIZES:
            raise ValueError(f"{owner}.num_layers must be one of {sorted(STAGE_SIZES)}, got {self.num_layers!r}")
        if self.norm not in NORMS:
            raise ValueError(f"{owner}.norm must be one of {NORMS}, got {self.norm!r}")
        if self.norm == "group" and self.base_channels % self.num_groups:
            raise ValueError(
                f"{owner}.num_groups must divide base_channels={self.base_channels} for norm='group', "
                f"got {self.num_groups}"
            )
        check_float_dtype(owner, self.dtype)

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        """Bottleneck blocks per stage."""
        return STAGE_SIZES[self.num_layers]


def _wresnet(layers: int, base: int, width: int) -> WResNetConfig:
    """A row of Alpa Table 3.8: 224x224 RGB input, 1024 classes."""
    return WResNetConfig(num_layers=layers, base_channels=base, width_factor=width, num_classes=1024, image_size=224)


WRESNET_CONFIGS: dict[str, WResNetConfig] = {
    "wresnet-250m": _wresnet(50, 160, 2),
    "wresnet-1b": _wresnet(50, 320, 2),
    "wresnet-2b": _wresnet(50, 448, 2),
    "wresnet-4b": _wresnet(50, 640, 2),
    "wresnet-6.8b": _wresnet(50, 320, 16),
    "wresnet-13b": _wresnet(101, 320, 16),
    "wresnet-tiny": WResNetConfig(num_layers=8, base_channels=4, width_factor=2, num_classes=10, image_size=16),
}
"""Alpa Table 3.8 Wide-ResNets plus ``wresnet-tiny`` (tests)."""

WRESNET_TABLE_3_8_GPUS: dict[str, int] = {
    "wresnet-250m": 1,
    "wresnet-1b": 4,
    "wresnet-2b": 8,
    "wresnet-4b": 16,
    "wresnet-6.8b": 32,
    "wresnet-13b": 64,
}
"""GPUs used for each Wide-ResNet in Alpa Table 3.8 (weak scaling, batch 1536)."""


class BottleneckBlock(nn.Module):
    """``relu(shortcut(x) + norm(conv1x1(relu(norm(conv3x3(relu(norm(conv1x1(x)))))))))``.

    ``norm`` is a factory called with ``name=`` (and ``scale_init=`` for the last norm, zero-initialised
    so that each block starts as the identity).
    """

    filters: int
    width_factor: int
    strides: int
    norm: Callable[..., nn.Module]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = functools.partial(
            nn.Conv, use_bias=False, dtype=self.dtype, kernel_init=nn.initializers.he_normal()
        )
        stride = (self.strides, self.strides)
        y = nn.relu(self.norm(name="norm1")(conv(self.filters, (1, 1), name="conv1")(x)))
        y = conv(self.filters * self.width_factor, (3, 3), stride, padding=((1, 1), (1, 1)), name="conv2")(y)
        y = nn.relu(self.norm(name="norm2")(y))
        y = conv(4 * self.filters, (1, 1), name="conv3")(y)
        y = self.norm(name="norm3", scale_init=nn.initializers.zeros)(y)
        shortcut = x
        if shortcut.shape != y.shape:
            shortcut = self.norm(name="norm_proj")(conv(4 * self.filters, (1, 1), stride, name="conv_proj")(x))
        return nn.relu(shortcut + y)


def _norm_factory(config: WResNetConfig, train: bool) -> Callable[..., nn.Module]:
    """Factory of the configured normalisation layer (BatchNorm in train or eval mode, or GroupNorm)."""
    if config.norm == "batch":
        return functools.partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=config.dtype
        )
    return functools.partial(nn.GroupNorm, num_groups=config.num_groups, epsilon=1e-5, dtype=config.dtype)


class WideResNet(nn.Module):
    """Wide-ResNet classifier: ``__call__(images, train=True)`` maps float [B, H, W, 3] to [B, classes].

    With ``norm="batch"``, ``train=True`` normalises with batch statistics and updates the running ones
    (apply with ``mutable=["batch_stats"]``); ``train=False`` uses the running statistics. Blocks are named
    ``stage_{i}_block_{j}``.
    """

    config: WResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = True) -> jax.Array:
        cfg = self.config
        expected = (cfg.image_size, cfg.image_size, 3)
        if images.ndim != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must have shape [batch, *{expected}], got {tuple(images.shape)}")
        norm = _norm_factory(cfg, train)
        x = nn.Conv(
            cfg.base_channels,
            (7, 7),
            (2, 2),
            padding=((3, 3), (3, 3)),
            use_bias=False,
            dtype=cfg.dtype,
            kernel_init=nn.initializers.he_normal(),
            name="stem_conv",
        )(images.astype(cfg.dtype))
        x = nn.relu(norm(name="stem_norm")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(cfg.stage_sizes):
            for j in range(blocks):
                x = BottleneckBlock(
                    filters=cfg.base_channels * 2**i,
                    width_factor=cfg.width_factor,
                    strides=2 if i > 0 and j == 0 else 1,
                    norm=norm,
                    dtype=cfg.dtype,
                    name=f"stage_{i}_block_{j}",
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.num_classes, dtype=cfg.dtype, name="head")(x)


def wresnet_loss(model: WideResNet) -> WResNetLossFn:
    """Return ``loss_fn(params, batch_stats, batch) -> (loss, new_batch_stats)`` in training mode.

    The loss is the mean softmax cross entropy over the batch; ``new_batch_stats`` are the updated running
    statistics (BatchNorm) or ``batch_stats`` unchanged (GroupNorm, where it is ``{}``). Use it as
    ``jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats, batch)``.
    ``batch = {"images": float [B, H, W, 3], "labels": int32 [B]}``.
    """

    def loss_fn(params: Any, batch_stats: Any, batch: Batch) -> tuple[jax.Array, Any]:
        variables = {"params": params}
        if batch_stats:
            variables["batch_stats"] = batch_stats
        logits, updates = model.apply(variables, batch["images"], train=True, mutable=["batch_stats"])
        new_stats = updates.get("batch_stats", batch_stats)
        return mean_cross_entropy(logits, batch["labels"]), new_stats

    return loss_fn


def wresnet_batch(config: WResNetConfig, batch_size: int, rng: jax.Array) -> Batch:
    """Synthetic batch: standard-normal images (``config.dtype``) and uniform int32 labels."""
    check_positive_int("wresnet_batch", batch_size=batch_size)
    image_rng, label_rng = jax.random.split(rng)
    shape = (batch_size, config.image_size, config.image_size, 3)
    return {
        "images": jax.random.normal(image_rng, shape, config.dtype),
        "labels": jax.random.randint(label_rng, (batch_size,), 0, config.num_classes, jnp.int32),
    }


def wresnet_batch_shapes(config: WResNetConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """``ShapeDtypeStruct`` version of :func:`wresnet_batch`."""
    check_positive_int("wresnet_batch_shapes", batch_size=batch_size)
    shape = (batch_size, config.image_size, config.image_size, 3)
    return {
        "images": jax.ShapeDtypeStruct(shape, config.dtype),
        "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def wresnet_param_shapes(config: WResNetConfig) -> tuple[Any, Any]:
    """``(params, batch_stats)`` of ``WideResNet(config)`` as ``ShapeDtypeStruct``s (``{}`` stats for
    GroupNorm); nothing is allocated."""
    images = jax.ShapeDtypeStruct((1, config.image_size, config.image_size, 3), config.dtype)
    variables = variable_shapes(WideResNet(config), images, train=False)
    return variables["params"], variables.get("batch_stats", {})
