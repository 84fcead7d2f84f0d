r"""Operator clustering: group a topologically ordered operator list into ``L`` layers (Alpa Eq. 3.6).

The stage DP (Eq. 3.3) is cubic in the number of units it slices, so Alpa first merges the ``n`` operators
``o_0..o_{n-1}`` into ``L << n`` contiguous *layers*, keeping each layer's FLOPs near the average and
cutting where little data crosses. :math:`G(k, r)` is the least possible largest amount of data that a
single layer receives from earlier operators when ``o_0..o_{k-1}`` form ``r`` layers (0-based operators,
``k`` counts operators):

.. math::
   G(k, r) = \min_{\substack{r - 1 \le i < k \\ \mathrm{FLOP}(o_i..o_{k-1}) \le (1 + \delta)
             \mathrm{FLOP}_{total} / L}} \max\{ G(i, r - 1),\ C(i, k - 1) \},
   \qquad G(0, 0) = 0,                                          \tag{3.6}

where :math:`C(i, k)` (``comm[i, k]``) is the number of bytes that ``o_i..o_k`` receive from
``o_0..o_{i-1}``. The answer is :math:`G(n, L)`.

**Tie-break.** Among clusterings with the optimal :math:`G(n, L)`, Alpa takes the one with the smallest
variance of per-layer FLOPs. The mean is fixed (:math:`\mathrm{FLOP}_{total} / L`), so this is the one with
the smallest sum of squared layer FLOPs. A lexicographic ``(max, sum of squares)`` DP would be wrong (a
prefix with a larger but still non-binding maximum can have the smaller sum of squares), so we solve it in
two exact passes: the bottleneck DP above gives :math:`G^* = G(n, L)`; then a min-sum DP over the layers
that respect both the FLOP bound and :math:`C(i, k) \le G^*` minimises :math:`\sum_r \mathrm{FLOP}(l_r)^2`.
Remaining exact ties go to the clustering whose last layer is shortest, then the one before it, and so on.

**Recomputation.** With per-layer rematerialization a layer's backward recomputes its forward, except
operations at its end whose outputs the backward does not need: a layer that ends right after a
convolution does not recompute that convolution (its gradients need its inputs only). Given
``end_saving[k]``, the forward FLOPs a layer ending at operator ``k`` does not recompute, the tie-break
minimises the variance of what each layer costs in a step instead: forward ``f``, backward ``2 f`` (the
matmul rule) and the recomputation ``f - end_saving``, i.e. :math:`\sum_r (4 f_r - s_r)^2`. Without savings
this is ``16`` times Alpa's sum of squares (the same clustering); with them, among the clusterings of optimal
:math:`G^*`, one whose layers end after heavy operators wins when balance allows.

**Cost.** Both passes are :math:`O(n W L)` where ``W`` is the largest number of operators a layer can hold
within the FLOP bound (at most ``n``; the dissertation's :math:`O(K^2 L)`), vectorised over operators.
FLOP comparisons allow a relative ``1e-9`` of rounding in the prefix sums.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Hashable, Sequence

import numpy as np

_RTOL = 1e-9
DEFAULT_DELTA = 0.6
"""Alpa's default slack of Eq. 3.6 (``AutoLayerOption.eps``): a layer may hold up to 1.6x the average FLOPs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerClustering:
    """The chosen layers: layer ``r`` holds operators ``boundaries[r] .. boundaries[r + 1] - 1``."""

    boundaries: tuple[int, ...]
    """``L + 1`` increasing operator indices, from 0 to ``n``."""
    max_incoming_bytes: float
    """:math:`G(n, L)`: the most bytes any layer receives from earlier operators."""
    layer_flops: tuple[float, ...]
    """FLOPs of each layer."""

    @property
    def num_layers(self) -> int:
        return len(self.boundaries) - 1

    @property
    def layers(self) -> tuple[range, ...]:
        """Operator indices of each layer."""
        return tuple(range(a, b) for a, b in zip(self.boundaries, self.boundaries[1:]))

    @property
    def flop_variance(self) -> float:
        """Population variance of :attr:`layer_flops` (the tie-break of Eq. 3.6)."""
        return float(np.var(self.layer_flops))


def incoming_bytes(num_ops: int, edges: Sequence[tuple]) -> np.ndarray:
    """``comm[i, k]``: bytes that operators ``i..k`` receive from operators before ``i`` (``C`` of Eq. 3.6).

    Each edge is ``(producer, consumer, nbytes)``: operator ``producer`` sends a value of ``nbytes`` bytes to
    operator ``consumer > producer``. Such an edge counts for every range ``i..k`` with
    ``producer < i <= consumer <= k``. An optional fourth element names the value: edges with the same name
    (same producer and size) are one value read by several consumers, and a range that holds several of its
    consumers receives it once. Edges without a name are distinct values. Graph inputs (parameters, the
    batch) come from no operator and are not edges.

    Entries with ``k < i`` are 0. Memory is ``O(num_ops^2)``.

    >>> incoming_bytes(3, [(0, 1, 8.0), (0, 2, 8.0, "x"), (1, 2, 4.0)])
    array([[ 0.,  0.,  0.],
           [ 0.,  8., 16.],
           [ 0.,  0., 12.]])
    """
    if not _is_int(num_ops) or num_ops < 1:
        raise ValueError(f"num_ops must be an int >= 1, got {num_ops!r}")
    values: dict[Hashable, tuple[int, float, list[int]]] = {}
    for number, edge in enumerate(edges):
        if not isinstance(edge, (tuple, list)) or len(edge) not in (3, 4):
            raise ValueError(f"edge {edge!r} must be (producer, consumer, nbytes) or (producer, consumer, "
                             f"nbytes, value_name)")
        producer, consumer, nbytes = edge[:3]
        if (not _is_int(producer) or not _is_int(consumer)
                or not 0 <= producer < consumer < num_ops):
            raise ValueError(f"edge {edge!r}: need 0 <= producer < consumer < num_ops = {num_ops} "
                             f"(operators in topological order)")
        if not _is_number(nbytes) or not math.isfinite(nbytes) or nbytes < 0:
            raise ValueError(f"edge {edge!r}: nbytes must be a finite number >= 0")
        key = ("edge", number) if len(edge) == 3 else ("value", edge[3])
        if key in values and values[key][:2] != (producer, float(nbytes)):
            raise ValueError(f"value {edge[3]!r} has edges with different producers or sizes: "
                             f"{values[key][:2]} and {(producer, float(nbytes))}")
        values.setdefault(key, (int(producer), float(nbytes), []))[2].append(int(consumer))
    # A value counts for i in (previous consumer (or producer), consumer], k >= consumer: rectangles that we
    # add to a 2-D difference array and integrate along both axes.
    diff = np.zeros((num_ops + 1, num_ops))
    rows_from, rows_to, cols, amounts = [], [], [], []
    for producer, nbytes, consumers in values.values():
        previous = producer
        for consumer in sorted(set(consumers)):
            rows_from.append(previous + 1)
            rows_to.append(consumer + 1)
            cols.append(consumer)
            amounts.append(nbytes)
            previous = consumer
    np.add.at(diff, (np.array(rows_from, dtype=np.intp), np.array(cols, dtype=np.intp)), amounts)
    np.add.at(diff, (np.array(rows_to, dtype=np.intp), np.array(cols, dtype=np.intp)), np.negative(amounts))
    comm = np.cumsum(np.cumsum(diff, axis=0), axis=1)[:num_ops]
    return np.triu(comm)


def cluster_layers(flops: Sequence[float], comm: np.ndarray, num_layers: int,
                   delta: float, end_saving: Sequence[float] | None = None) -> LayerClustering:
    r"""Clusters operators into ``num_layers`` contiguous layers by Eq. 3.6 (see the module docstring).

    Args:
      flops: FLOPs of each operator, in topological order; numbers >= 0.
      comm: ``(n, n)`` array, ``comm[i, k]`` = bytes that operators ``i..k`` receive from operators before
        ``i`` (see :func:`incoming_bytes`); only ``k >= i`` is read.
      num_layers: ``L``, 1 <= L <= n.
      delta: balance slack >= 0: every layer has at most ``(1 + delta) * FLOP_total / L`` FLOPs.
      end_saving: per operator ``k``, the FLOPs a rematerialized layer ending at ``k`` does not recompute
        (each at most ``flops[k]``), or None: no rematerialization (see the module docstring).

    Returns:
      The clustering with the least largest incoming communication, then the least variance of the layers'
      FLOPs (of their step FLOPs under rematerialization, with ``end_saving``).

    Raises:
      ValueError: for bad inputs, or when no clustering meets the FLOP bound (the message says which
        ``delta`` would).

    >>> comm = incoming_bytes(4, [(0, 1, 100.0), (1, 2, 1.0), (2, 3, 100.0)])
    >>> cluster_layers([1.0, 1.0, 1.0, 1.0], comm, num_layers=2, delta=0.0).boundaries
    (0, 2, 4)
    """
    flops, comm, num_layers, delta = _check(flops, comm, num_layers, delta)
    n = len(flops)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    total = prefix[-1]
    bound = (1.0 + delta) * total / num_layers
    starts, band_flops, band_comm = _band(prefix, comm, bound + _RTOL * total)
    if not _feasible(prefix, num_layers, bound + _RTOL * total):
        needed = _least_max_layer_flops(prefix, num_layers) * num_layers / total - 1.0
        raise ValueError(
            f"no clustering of {n} operators into {num_layers} layers keeps every layer within (1 + delta) * "
            f"FLOP_total / L = {bound:.6g} FLOPs (delta = {delta}, FLOP_total = {total:.6g}); the most "
            f"balanced clustering needs delta >= {_round_up(needed)}: pass a larger delta or fewer layers")
    g_star = _bottleneck(starts, band_comm, num_layers)
    allowed = band_comm <= g_star
    step_cost = band_flops if end_saving is None else 4.0 * band_flops - _check_saving(end_saving, flops)[:, None]
    boundaries = _least_squares(starts, np.where(allowed, step_cost**2, np.inf), num_layers)
    layer_flops = tuple(float(prefix[b] - prefix[a]) for a, b in zip(boundaries, boundaries[1:]))
    return LayerClustering(boundaries=boundaries, max_incoming_bytes=float(g_star), layer_flops=layer_flops)


def _band(prefix: np.ndarray, comm: np.ndarray, limit: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layers ending at each operator ``k`` that meet the FLOP limit, as a band ``[k, w]`` for start ``k - w``.

    Returns ``starts[k, w] = k - w`` (-1 where invalid), and the layer's FLOPs and incoming bytes (inf where
    invalid). Layer FLOPs shrink as the start moves right, so the valid starts of ``k`` are one interval.
    """
    n = len(prefix) - 1
    ends = np.arange(n)
    first_start = np.searchsorted(prefix, prefix[1:] - limit, side="left")  # Least i: P[k+1] - P[i] <= limit.
    first_start = np.minimum(first_start, ends)  # A single operator is always a candidate (filtered later).
    width = int((ends - first_start).max()) + 1
    starts = ends[:, None] - np.arange(width)[None, :]
    valid = starts >= first_start[:, None]
    safe = np.where(valid, starts, 0)
    layer_flops = np.where(valid, prefix[ends + 1][:, None] - prefix[safe], np.inf)
    valid &= layer_flops <= limit
    layer_comm = np.where(valid, comm[safe, ends[:, None]], np.inf)
    return np.where(valid, starts, -1), np.where(valid, layer_flops, np.inf), layer_comm


def _bottleneck(starts: np.ndarray, band_comm: np.ndarray, num_layers: int) -> float:
    """``G(n, L)`` of Eq. 3.6 over the band (inf if no clustering exists)."""
    n = starts.shape[0]
    g = np.full(n + 1, np.inf)
    g[0] = 0.0
    safe = np.maximum(starts, 0)
    for _ in range(num_layers):
        g_next = np.full(n + 1, np.inf)
        g_next[1:] = np.where(starts >= 0, np.maximum(g[safe], band_comm), np.inf).min(axis=1)
        g = g_next
    return float(g[n])


def _least_squares(starts: np.ndarray, band_cost: np.ndarray, num_layers: int) -> tuple[int, ...]:
    """Boundaries minimising the sum of ``band_cost`` over ``num_layers`` layers; first minimum on ties."""
    n = starts.shape[0]
    h = np.full(n + 1, np.inf)
    h[0] = 0.0
    safe = np.maximum(starts, 0)
    picks = []
    for _ in range(num_layers):
        candidates = np.where(starts >= 0, h[safe] + band_cost, np.inf)
        pick = candidates.argmin(axis=1)  # Smallest w: the shortest last layer.
        h = np.concatenate([[np.inf], candidates[np.arange(n), pick]])
        picks.append(pick)
    if not math.isfinite(h[n]):  # Unreachable: the bottleneck pass found a clustering within G*.
        raise ValueError("internal error: no clustering within the optimal communication bound")
    boundaries, end = [n], n
    for pick in reversed(picks):
        end = int(starts[end - 1, pick[end - 1]])
        boundaries.append(end)
    return tuple(reversed(boundaries))


def _feasible(prefix: np.ndarray, num_layers: int, limit: float) -> bool:
    """Whether ``num_layers`` non-empty contiguous layers can each have at most ``limit`` FLOPs.

    Greedy: the fewest layers under ``limit`` take as many operators as fit each time; any count between
    that and ``n`` is then reachable by splitting layers (splitting never adds FLOPs to a layer).
    """
    n = len(prefix) - 1
    if num_layers > n or np.diff(prefix).max(initial=0.0) > limit:
        return False
    count, start = 0, 0
    while start < n:
        end = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
        # Same test as the DP's band (a rounded difference), so both agree on every layer.
        while end > start + 1 and prefix[end] - prefix[start] > limit:
            end -= 1
        while end < n and prefix[end + 1] - prefix[start] <= limit:
            end += 1
        start, count = max(end, start + 1), count + 1
        if count > num_layers:
            return False
    return True


def least_delta(flops: Sequence[float], num_layers: int) -> float:
    """The smallest delta of Eq. 3.6 for which some clustering of ``flops`` into ``num_layers`` layers
    exists (0 when the operators split evenly), rounded up so that it suffices."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(flops, dtype=np.float64))])
    if prefix[-1] <= 0:
        return 0.0
    return _round_up(max(0.0, _least_max_layer_flops(prefix, num_layers) * num_layers / prefix[-1] - 1.0))


def _least_max_layer_flops(prefix: np.ndarray, num_layers: int) -> float:
    """The least possible largest layer FLOPs over all clusterings (bisection on :func:`_feasible`)."""
    lo, hi = float(np.diff(prefix).max()), float(prefix[-1])
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (lo, mid) if _feasible(prefix, num_layers, mid) else (mid, hi)
    return hi


def _round_up(value: float, digits: int = 4) -> float:
    """``value`` rounded up to ``digits`` significant digits (so that the suggested delta suffices)."""
    if value <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return round(math.ceil(value / step * (1 - 1e-9)) * step, 12)


def _check(flops: object, comm: object, num_layers: object,
           delta: object) -> tuple[np.ndarray, np.ndarray, int, float]:
    flops = np.asarray(flops, dtype=np.float64)
    if flops.ndim != 1 or flops.size == 0 or not np.isfinite(flops).all() or (flops < 0).any():
        raise ValueError(f"flops must be a non-empty 1-D sequence of finite numbers >= 0, got {flops!r}")
    n = flops.size
    comm = np.asarray(comm, dtype=np.float64)
    if comm.shape != (n, n):
        raise ValueError(f"comm must have shape (n, n) = {(n, n)} for {n} operators, got {comm.shape}")
    upper = np.triu(comm)
    if not np.isfinite(upper).all() or (upper < 0).any():
        raise ValueError("comm[i, k] for k >= i must be finite numbers >= 0")
    if not _is_int(num_layers) or not 1 <= num_layers <= n:
        raise ValueError(f"num_layers must be an int in [1, {n}] (the number of operators), got {num_layers!r}")
    if not _is_number(delta) or not math.isfinite(delta) or delta < 0:
        raise ValueError(f"delta must be a finite number >= 0, got {delta!r}")
    return flops, upper, int(num_layers), float(delta)


def _check_saving(end_saving: object, flops: np.ndarray) -> np.ndarray:
    saving = np.asarray(end_saving, dtype=np.float64)
    if saving.shape != flops.shape or not np.isfinite(saving).all() or (saving < 0).any() or (
            saving > flops * (1 + _RTOL)).any():
        raise ValueError(f"end_saving must hold one number per operator, each in [0, flops[k]], got {saving!r}")
    return saving


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
