"""Token slicing in the inter-operator pass: the TeraPipe DP on the stages the stage DP chose.

After the stage DP (Alpa Eq. 3.2-3.5) fixes the stages, each stage's per-micro-batch time ``T_q`` (forward +
backward, ``R`` whole sequences of ``L`` tokens) is spread over batch slices of ``b`` sequences cut into
token slices, with Eq. 2.9's shape:

.. math::

    t_q(b, k, c) = \\frac{T_q}{R} \\left[(1 - \\rho_q) \\frac{\\max(b k, s)}{L} + \\rho_q \\frac{b k (c + k)}{L^2}\\right]

where ``rho_q`` is the share of the stage's FLOPs inside :func:`alpa_like.nn.causal_self_attention` (found
by its named scope in the traced step), the rest scales with the tokens, and ``s`` is the utilisation floor
(TeraPipe Fig. 2.3: a slice of fewer than ``s`` tokens takes as long as ``s`` tokens). The slowest stage
bounds every slice, so the joint DP (Alg. 1 per batch-slice size, then the knapsack of section 2.3.4) runs on
``max_q t_q`` with ``K`` stages over the step's ``B = M R`` sequences. Token slicing is kept only when the
predicted latency drops below that of the ``M`` micro-batches of whole sequences under the same model.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from alpa_like.compiler.flops import eqn_flops
from alpa_like.compiler.token_slicing import slice_contexts, slice_cost_table, solve_joint_slicing
from alpa_like.compiler.tracing_hooks import ATTENTION_SCOPE

__all__ = ["TokenSlicingDecision", "attention_fractions", "stage_slice_costs", "batch_slice_sizes", "token_grain",
           "choose_token_slicing"]

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
                      saturation_tokens: int = DEFAULT_SATURATION_TOKENS, rows: int = 1,
                      rows_per_micro_batch: int = 1):
    """``cost(k, c)`` of one stage on a batch slice of ``rows`` sequences (module docstring), where
    ``stage_time`` is the stage's time for a micro-batch of ``rows_per_micro_batch`` whole sequences;
    ``cost(L, 0) == stage_time`` for ``rows == rows_per_micro_batch`` when ``rows L >= s``."""
    if not stage_time >= 0 or not 0 <= attention_fraction <= 1:
        raise ValueError(f"stage_time must be >= 0 and attention_fraction in [0, 1], got {stage_time}, "
                         f"{attention_fraction}")
    floor = min(saturation_tokens, seq_len * rows_per_micro_batch)
    per_row = stage_time / rows_per_micro_batch

    def cost(k, c):
        k = np.asarray(k, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        return per_row * ((1 - attention_fraction) * np.maximum(rows * k, floor) / seq_len
                          + attention_fraction * rows * k * (c + k) / seq_len**2)
    return cost


def batch_slice_sizes(batch: int, rows_per_micro_batch: int) -> tuple[int, ...]:
    """Batch-slice sizes the joint DP considers: powers of two up to ``batch`` and the micro-batch size."""
    sizes = {rows_per_micro_batch} | {2**i for i in range(batch.bit_length()) if 2**i <= batch}
    return tuple(sorted(sizes))


def token_grain(seq_len: int, max_units: int = 512) -> int:
    """The smallest divisor ``g`` of ``seq_len`` with ``seq_len / g <= max_units``: slice lengths are searched
    in multiples of ``g`` (keeps the DP's tables at most ``max_units^2`` per batch-slice size)."""
    return next(g for g in range(1, seq_len + 1) if seq_len % g == 0 and seq_len // g <= max_units)


def choose_token_slicing(stage_times: Sequence[float], fractions: Sequence[float], seq_len: int,
                         num_micro_batches: int, rows_per_micro_batch: int, *,
                         saturation_tokens: int = DEFAULT_SATURATION_TOKENS, epsilon: float | None = None,
                         fixed: Sequence[tuple[int, Sequence[int]]] | None = None,
                         shared_contexts: bool = False) -> TokenSlicingDecision:
    """The joint batch + token DP (section 2.3.4) on the chosen stages, or the latency of the ``fixed``
    scheme ``((rows, lengths), ...)``.

    The step's ``B = num_micro_batches * rows_per_micro_batch`` sequences are cut into batch slices of the
    sizes :func:`batch_slice_sizes` offers, each with its own token slicing (lengths in multiples of
    :func:`token_grain`). ``epsilon`` (seconds) is the DP's t_max step; None: 1e-4 of the unsliced stage
    time, so the answer is within ``K * 1e-4`` of the slowest stage's time from the optimum. Token slicing
    is kept only when it beats the micro-batches of whole sequences under the same model.

    ``shared_contexts`` (``share_slice_executables=True``): every slice is priced at the context it runs
    with, the longest among the slices of its (rows, length) (:func:`slice_contexts`), both for ``fixed``
    and for the keep-or-drop decision on the DP's scheme. The DP itself prices each slice at its own
    context: a padded price depends on every other slice of the same length, which Eq. 2.5-2.8's
    subproblems (a prefix of the sequence) do not know, so the DP's scheme is the best unpadded one, not
    necessarily the best padded one."""
    k = len(stage_times)
    batch = num_micro_batches * rows_per_micro_batch

    def table(rows: int, grain: int):
        """The slowest stage's cost per (length, context), in units of ``grain`` tokens."""
        costs = [stage_slice_costs(t, f, seq_len, saturation_tokens, rows, rows_per_micro_batch)
                 for t, f in zip(stage_times, fractions, strict=True)]
        return slice_cost_table(lambda a, b: np.max([c(a * grain, b * grain) for c in costs], axis=0),
                                seq_len // grain)

    whole = float(np.max([stage_slice_costs(t, f, seq_len, saturation_tokens, rows_per_micro_batch,
                                            rows_per_micro_batch)(seq_len, 0)
                          for t, f in zip(stage_times, fractions, strict=True)]))
    unsliced = (num_micro_batches + k - 1) * whole

    def latency(scheme) -> float:
        """Eq. 2.4 over every unit of the scheme, each at the context it runs with."""
        costs = {r: [stage_slice_costs(t, f, seq_len, saturation_tokens, r, rows_per_micro_batch)
                     for t, f in zip(stage_times, fractions, strict=True)] for r in {r for r, _ in scheme}}
        times = [max(float(c(l, ctx)) for c in costs[r])
                 for (r, ls), contexts in zip(scheme, slice_contexts(scheme, shared_contexts), strict=True)
                 for l, ctx in zip(ls, contexts, strict=True)]
        return sum(times) + (k - 1) * max(times)

    if fixed is not None:
        scheme = tuple((int(r), tuple(int(x) for x in ls)) for r, ls in fixed)
        return TokenSlicingDecision(batch_slices=scheme, latency=latency(scheme), latency_unsliced=unsliced)
    epsilon = 1e-4 * whole if epsilon is None else epsilon
    grain = token_grain(seq_len)
    solution = solve_joint_slicing({b: table(b, grain) for b in batch_slice_sizes(batch, rows_per_micro_batch)},
                                   batch, k, epsilon=epsilon)
    scheme = tuple((b, tuple(x * grain for x in ls)) for b, ls in solution.batch_slices)
    predicted = latency(scheme) if shared_contexts else solution.latency
    if predicted >= unsliced * (1 - 1e-9):
        return TokenSlicingDecision(batch_slices=(), latency=unsliced, latency_unsliced=unsliced)
    return TokenSlicingDecision(batch_slices=scheme, latency=predicted, latency_unsliced=unsliced)
