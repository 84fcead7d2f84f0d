"""Token slicing in the inter-operator pass: the TeraPipe DP on the stages the stage DP chose.

After the stage DP (Alpa Eq. 3.2-3.5) fixes the stages, each stage's per-micro-batch time ``T_q`` (forward +
backward, whole sequence of ``L`` tokens) is spread over token slices with Eq. 2.9's shape:

.. math::

    t_q(k, c) = T_q \\left[(1 - \\rho_q) \\frac{\\max(k, s)}{L} + \\rho_q \\frac{k (c + k)}{L^2}\\right]

where ``rho_q`` is the share of the stage's FLOPs inside :func:`alpa_like.nn.causal_self_attention` (found
by its named scope in the traced step), the rest scales with the tokens, and ``s`` is the utilisation floor
(TeraPipe Fig. 2.3: a slice shorter than ``s`` tokens takes as long as ``s`` tokens). The slowest stage
bounds every slice, so the DP (Alg. 1) runs on ``max_q t_q`` with ``K`` stages and the micro-batches as
batch slices. Token slicing is kept only when the predicted latency drops below the unsliced one under the
same model.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from alpa_like.compiler.flops import eqn_flops
from alpa_like.compiler.token_slicing import slice_cost_table, solve_joint_slicing
from alpa_like.nn import ATTENTION_SCOPE

__all__ = ["TokenSlicingDecision", "attention_fractions", "stage_slice_costs", "choose_token_slicing"]

DEFAULT_SATURATION_TOKENS = 256
"""TeraPipe Fig. 2.3 (one GPT3-1B layer on a V100 takes as long for 1 token as for 256)."""


@dataclasses.dataclass(frozen=True)
class TokenSlicingDecision:
    """What planning decided for TeraPipe."""

    batch_slices: tuple[tuple[int, tuple[int, ...]], ...]
    """(rows per batch slice, token slice lengths) per micro-batch; empty: token slicing does not help."""
    latency: float
    """Predicted pipeline latency with the slicing (the model of this module)."""
    latency_unsliced: float
    """The same model with whole sequences."""


def attention_fractions(jaxpr, pieces, stage_layers: Sequence[Sequence[int]]) -> list[float]:
    """Per stage, the share of its forward + backward FLOPs inside causal_self_attention."""
    layer_stage = {l: q for q, layers in enumerate(stage_layers) for l in layers}
    total = np.zeros(len(stage_layers))
    attention = np.zeros(len(stage_layers))
    for eqn, piece in zip(jaxpr.eqns, pieces, strict=True):
        if piece is None or piece.phase == "apply" or piece.layer not in layer_stage:
            continue
        flops = eqn_flops(eqn)
        q = layer_stage[piece.layer]
        total[q] += flops
        if ATTENTION_SCOPE in str(eqn.source_info.name_stack):
            attention[q] += flops
    return [float(a / t) if t > 0 else 0.0 for a, t in zip(attention, total)]


def stage_slice_costs(stage_time: float, attention_fraction: float, seq_len: int,
                      saturation_tokens: int = DEFAULT_SATURATION_TOKENS):
    """``cost(k, c)`` of one stage (module docstring); ``cost(L, 0) == stage_time`` when ``L >= s``."""
    if not stage_time >= 0 or not 0 <= attention_fraction <= 1:
        raise ValueError(f"stage_time must be >= 0 and attention_fraction in [0, 1], got {stage_time}, "
                         f"{attention_fraction}")
    floor = min(saturation_tokens, seq_len)

    def cost(k, c):
        k = np.asarray(k, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        return stage_time * ((1 - attention_fraction) * np.maximum(k, floor) / seq_len
                             + attention_fraction * k * (c + k) / seq_len**2)
    return cost


def choose_token_slicing(stage_times: Sequence[float], fractions: Sequence[float], seq_len: int,
                         num_micro_batches: int, rows_per_micro_batch: int, *,
                         saturation_tokens: int = DEFAULT_SATURATION_TOKENS, epsilon: float | None = None,
                         fixed_lengths: Sequence[int] | None = None) -> TokenSlicingDecision:
    """The TeraPipe DP on the chosen stages (or the latency of ``fixed_lengths``).

    ``epsilon`` (seconds) is the DP's t_max step; None: 1e-4 of the unsliced stage time, so the answer is
    within ``K * 1e-4`` of the slowest stage's time from the optimum."""
    costs = [stage_slice_costs(t, f, seq_len, saturation_tokens) for t, f in zip(stage_times, fractions, strict=True)]
    table = np.max([slice_cost_table(c, seq_len) for c in costs], axis=0)
    k = len(stage_times)
    unsliced = num_micro_batches * table[seq_len, 0] + (k - 1) * table[seq_len, 0]
    if fixed_lengths is not None:
        latency = _fixed(table, fixed_lengths, num_micro_batches, k)
        return TokenSlicingDecision(batch_slices=((rows_per_micro_batch, tuple(fixed_lengths)),) * num_micro_batches,
                                    latency=latency, latency_unsliced=float(unsliced))
    epsilon = 1e-4 * float(table[seq_len, 0]) if epsilon is None else epsilon
    solution = solve_joint_slicing({1: table}, num_micro_batches, k, epsilon=epsilon)
    if solution.latency >= unsliced * (1 - 1e-9) or all(len(ls) == 1 for _, ls in solution.batch_slices):
        return TokenSlicingDecision(batch_slices=(), latency=float(unsliced), latency_unsliced=float(unsliced))
    return TokenSlicingDecision(batch_slices=tuple((rows_per_micro_batch, ls) for _, ls in solution.batch_slices),
                                latency=solution.latency, latency_unsliced=float(unsliced))


def _fixed(table, lengths, num_micro_batches: int, num_stages: int) -> float:
    """Eq. 2.4 over every micro-batch's slices: ``M sum_i t_i + (K - 1) max_i t_i``."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    times = [float(table[l, c]) for l, c in zip(lengths, starts)]
    return num_micro_batches * sum(times) + (num_stages - 1) * max(times)
