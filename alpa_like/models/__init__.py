"""Bundled models: GPT/OPT (Alpa Table 3.6), GShard MoE (Table 3.7), Wide-ResNet (Table 3.8).

Each family provides a config dataclass, a table of named configs, a Flax linen module, and the functions
``*_loss(model)``, ``*_batch(config, batch_size, rng)``, ``*_batch_shapes(config, batch_size)`` and
``*_param_shapes(config)``. :func:`get_config` finds a name in any table.
"""
from __future__ import annotations

from alpa_like.models.common import lookup_config, num_params
from alpa_like.models.gpt import (
    GPT_CONFIGS,
    GPT_TABLE_3_6_GPUS,
    OPT_CONFIGS,
    GPTBlock,
    GPTConfig,
    GPTModel,
    gpt_batch,
    gpt_batch_shapes,
    gpt_loss,
    gpt_param_shapes,
    megatron_num_params,
)
from alpa_like.models.moe import (
    MOE_CONFIGS,
    MOE_TABLE_3_7_GPUS,
    MoEConfig,
    MoELayer,
    MoEModel,
    expert_capacity,
    moe_batch,
    moe_batch_shapes,
    moe_loss,
    moe_param_shapes,
    top2_gating,
)
from alpa_like.models.wide_resnet import (
    WRESNET_CONFIGS,
    WRESNET_TABLE_3_8_GPUS,
    WideResNet,
    WResNetConfig,
    wresnet_batch,
    wresnet_batch_shapes,
    wresnet_loss,
    wresnet_param_shapes,
)

ModelConfig = GPTConfig | MoEConfig | WResNetConfig

ALL_CONFIG_TABLES = {
    "GPT_CONFIGS": GPT_CONFIGS,
    "OPT_CONFIGS": OPT_CONFIGS,
    "MOE_CONFIGS": MOE_CONFIGS,
    "WRESNET_CONFIGS": WRESNET_CONFIGS,
}
"""Every named config table, by name; names are unique across tables."""


def get_config(name: str) -> ModelConfig:
    """The config called ``name`` in any of ALL_CONFIG_TABLES.

    Raises:
      ValueError: for an unknown name; the message lists the valid names of every table.

    Examples:
      >>> get_config("gpt-350m").hidden_size
      1024
    """
    return lookup_config(name, ALL_CONFIG_TABLES)


__all__ = [
    "ALL_CONFIG_TABLES",
    "GPT_CONFIGS",
    "GPT_TABLE_3_6_GPUS",
    "MOE_CONFIGS",
    "MOE_TABLE_3_7_GPUS",
    "OPT_CONFIGS",
    "WRESNET_CONFIGS",
    "WRESNET_TABLE_3_8_GPUS",
    "GPTBlock",
    "GPTConfig",
    "GPTModel",
    "MoEConfig",
    "MoELayer",
    "MoEModel",
    "ModelConfig",
    "WResNetConfig",
    "WideResNet",
    "expert_capacity",
    "get_config",
    "gpt_batch",
    "gpt_batch_shapes",
    "gpt_loss",
    "gpt_param_shapes",
    "megatron_num_params",
    "moe_batch",
    "moe_batch_shapes",
    "moe_loss",
    "moe_param_shapes",
    "num_params",
    "top2_gating",
    "wresnet_batch",
    "wresnet_batch_shapes",
    "wresnet_loss",
    "wresnet_param_shapes",
]
