"""Hand-written Megatron-LM tensor-parallel specs for the bundled transformer models.

Megatron-LM (seed 002, section 2.3): in each block the first matrix of the MLP and the fused QKV
projection are split by columns, the second MLP matrix and the attention output by rows, so each block
needs one all-reduce in the forward pass per sublayer; the vocabulary embedding is split by rows. These
specs are the baseline the intra-op ILP is compared with, and a ready-made ``ManualShardParallel``.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from alpa_like.compiler.trace import key_to_str

_COLUMN = ("qkv", "fc_in")
_ROW = ("out", "fc_out")


def megatron_leaf_spec(path: tuple[str, ...], ndim: int, model_axis: str) -> P:
    """The Megatron spec of one parameter (or optimizer moment) leaf, from the last names of its path."""
    if len(path) >= 2 and path[-2] in _COLUMN:
        return P(None, model_axis) if path[-1] == "kernel" and ndim == 2 else P(model_axis)
    if len(path) >= 2 and path[-2] in _ROW and path[-1] == "kernel" and ndim == 2:
        return P(model_axis, None)
    if path and path[-1] == "embedding" and len(path) >= 2 and path[-2] == "wte":
        return P(model_axis, None)
    return P()


def megatron_specs(tree: Any, model_axis: str = "model") -> Any:
    """A PartitionSpec for every leaf of ``tree`` (params, a TrainState, or ShapeDtypeStructs of them).

    Optimizer moments get the spec of the parameter they mirror (their paths end the same way).
    """
    def spec(path, leaf):
        names = tuple(key_to_str(k) for k in path)
        return megatron_leaf_spec(names, len(getattr(leaf, "shape", ())), model_axis)
    return jax.tree_util.tree_map_with_path(spec, tree)
