"""TeraPipe's slicing dynamic program (TeraPipe, dissertation ch. 2: Alg. 1, Eq. 2.5-2.8, section 2.3.4).

A sequence of ``L`` tokens goes through ``K`` pipeline stages in slices ``l_1..l_M`` (sum ``L``). Slice ``i``
attends to the ``c_i = sum_{j<i} l_j`` tokens before it, so it costs ``t_i = t(l_i, c_i)`` per stage, and the
pipeline latency is (Eq. 2.4)

.. math::

    T = \\sum_i t_i + (K - 1) \\max_j t_j.

Eq. 2.5-2.8 fix ``t_max`` and solve

.. math::

    S^*(i; t_{max}) = \\min_{1 \\le k \\le i,\\ t(k, i-k) \\le t_{max}} S^*(i - k; t_{max}) + t(k, i - k),
    \\qquad T^* = \\min_{t_{max}} S^*(L; t_{max}) + (K - 1)\\, t_{max},

enumerating ``t_max`` over the distinct slice costs in ascending order and stopping once ``K t_max`` exceeds
the best ``T`` found (a slicing whose dearest slice costs ``t >= t_max`` has ``T >= K t``, so no later
candidate can win), and skipping candidates closer than ``epsilon`` to the last one evaluated (the answer is
then within ``K epsilon`` of the optimum).

Vectorisation: all ``t_max`` candidates of a batch share one pass over ``i``; each step is a masked
``min`` over an array ``[candidates, i]``. ``L = 2048, K = 96`` solves in well under a second.

Joint batch + token slicing (section 2.3.4): for batch-slice sizes ``b = 1..B`` with their own cost tables,
``S*_b(L; t_max)`` is computed for every candidate, a 1-D knapsack picks batch slices ``b_1 + ... = B``
minimising ``sum_j S*_{b_j}``, and ``T = knapsack + (K - 1) t_max``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["SlicingSolution", "JointSolution", "slice_cost_table", "pipeline_latency", "solve_token_slicing",
           "solve_joint_slicing", "uniform_slicing", "format_scheme"]


@dataclasses.dataclass(frozen=True)
class SlicingSolution:
    """The best token slicing of one sequence (or of one batch slice)."""

    lengths: tuple[int, ...]
    """Slice lengths l_1..l_M in sequence order (sum L)."""
    latency: float
    """T of Eq. 2.4 for these slices."""
    t_max: float
    """The cost of the most expensive slice."""
    num_candidates: int
    """How many t_max candidates the DP evaluated (after the early stop and the epsilon step)."""


@dataclasses.dataclass(frozen=True)
class JointSolution:
    """The best joint batch + token slicing (section 2.3.4)."""

    batch_slices: tuple[tuple[int, tuple[int, ...]], ...]
    """(batch-slice size, token slice lengths) of every batch slice, e.g. ((1, (776, 640, 632)),) * 16."""
    latency: float
    t_max: float
    num_candidates: int

    def __str__(self) -> str:
        return format_scheme(self.batch_slices)


def format_scheme(batch_slices: Sequence[tuple[int, Sequence[int]]]) -> str:
    """The paper's notation: runs of equal (batch size, lengths) as ``[(1, [776, 640, 632])] x 16``."""
    runs: list[list] = []
    for b, lengths in batch_slices:
        key = (int(b), [int(x) for x in lengths])
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    return " + ".join(f"[({b}, {lengths})] x {n}" for (b, lengths), n in runs)


def slice_cost_table(cost, seq_len: int) -> np.ndarray:
    """``table[k, c]`` = ``cost(k, c)`` for ``1 <= k <= seq_len``, ``0 <= c <= seq_len - k`` (else inf).

    ``cost`` is a vectorised callable ``(lengths, contexts) -> seconds`` on integer arrays (e.g.
    :meth:`alpa_like.compiler.terapipe_cost.SliceCostModel.slice_time`)."""
    _check_positive("seq_len", seq_len)
    k, c = np.meshgrid(np.arange(seq_len + 1), np.arange(seq_len + 1), indexing="ij")
    valid = (k >= 1) & (k + c <= seq_len)
    table = np.full((seq_len + 1, seq_len + 1), np.inf)
    table[valid] = np.asarray(cost(k[valid], c[valid]), dtype=np.float64)
    if not np.all(np.isfinite(table[valid])) or np.any(table[valid] < 0):
        raise ValueError("slice costs must be finite and >= 0")
    return table


def pipeline_latency(table: np.ndarray, lengths: Sequence[int], num_stages: int) -> float:
    """Eq. 2.4 for given slice lengths: ``sum_i t(l_i, c_i) + (K - 1) max_i t(l_i, c_i)``."""
    times = _slice_times(table, lengths)
    return float(sum(times) + (num_stages - 1) * max(times))


def _slice_times(table: np.ndarray, lengths: Sequence[int]) -> list[float]:
    context, out = 0, []
    for k in lengths:
        out.append(float(table[k, context]))
        context += k
    return out


def _by_end(table: np.ndarray) -> np.ndarray:
    """``e[i, k]`` = cost of the slice of length ``k`` ending at token ``i`` (context ``i - k``)."""
    n = table.shape[0] - 1
    i, k = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = (k >= 1) & (k <= i)
    e = np.full((n + 1, n + 1), np.inf)
    e[valid] = table[k[valid], (i - k)[valid]]
    return e


def _prefix_sums(by_end: np.ndarray, t_max: np.ndarray) -> np.ndarray:
    """``S*(i; t_max)`` for every candidate (rows) and ``i = 0..L`` (columns), Eq. 2.6-2.7."""
    n = by_end.shape[0] - 1
    s = np.full((len(t_max), n + 1), np.inf)
    s[:, 0] = 0.0
    limit = t_max[:, None]
    # Longest slice ending at i that any candidate admits: only k <= longest[i] need looking at.
    admitted = by_end <= t_max.max()
    longest = np.where(admitted.any(axis=1), n - np.argmax(admitted[:, ::-1], axis=1), 0)
    for i in range(1, n + 1):
        k = int(longest[i])
        if k == 0:
            continue
        cost = by_end[i, 1:k + 1]                       # slice lengths 1..k ending at i
        prev = s[:, i - 1:i - 1 - k:-1] if i - 1 - k >= 0 else s[:, i - 1::-1]  # S*(i - 1), ..., S*(i - k)
        s[:, i] = np.min(np.where(cost <= limit, prev + cost, np.inf), axis=1)
    return s


def _backtrack(by_end: np.ndarray, t_max: float) -> tuple[int, ...]:
    """The slice lengths achieving ``S*(L; t_max)``; among equal sums the shortest last slice (so lengths
    come out non-increasing for causal costs)."""
    s = _prefix_sums(by_end, np.array([t_max]))[0]
    n = len(s) - 1
    lengths, i = [], n
    while i > 0:
        cost = by_end[i, 1:i + 1]
        total = np.where(cost <= t_max, s[i - 1::-1] + cost, np.inf)
        k = int(np.flatnonzero(total <= total.min() * (1 + 1e-12) + 1e-300)[0]) + 1
        lengths.append(k)
        i -= k
    return tuple(reversed(lengths))


def _candidates(tables: Sequence[np.ndarray], epsilon: float) -> np.ndarray:
    """Distinct finite slice costs in ascending order, thinned so consecutive ones differ by >= epsilon,
    starting at the least t_max that admits any covering (the cheapest slice holding the last token)."""
    lows, values = [], []
    for table in tables:
        n = table.shape[0] - 1
        k = np.arange(1, n + 1)
        lows.append(np.min(table[k, n - k]))
        values.append(table[np.isfinite(table)])
    low = min(lows)
    values = np.unique(np.concatenate(values))
    values = values[values >= low]
    if epsilon <= 0:
        return values
    keep, last = [], -np.inf
    for v in values:
        if v >= last + epsilon:
            keep.append(v)
            last = v
    return np.asarray(keep)


def _check_positive(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def solve_token_slicing(table: np.ndarray, num_stages: int, *, epsilon: float = 0.0,
                        batch_size: int = 32) -> SlicingSolution:
    """Alg. 1: the slice lengths minimising Eq. 2.4 for one sequence.

    Args:
      table: ``slice_cost_table(cost, L)``; ``table[k, c]`` is the per-stage time (forward + backward for
        training) of a slice of ``k`` tokens after ``c`` tokens of context.
      num_stages: K, the number of pipeline stages (>= 1).
      epsilon: seconds; t_max candidates closer than this to the previous evaluated one are skipped (the
        latency is then within ``K * epsilon`` of the optimum). 0 evaluates every distinct cost.
      batch_size: t_max candidates solved together in one vectorised pass.

    >>> t = slice_cost_table(lambda k, c: 1.0 + k * (1 + c / 4), 8)
    >>> solve_token_slicing(t, 4).lengths
    (3, 1, 1, 1, 1, 1)
    """
    return _solve({1: table}, 1, num_stages, epsilon, batch_size, allow_batch_split=False)


def solve_joint_slicing(tables: Mapping[int, np.ndarray], batch: int, num_stages: int, *, epsilon: float = 0.0,
                        batch_size: int = 32) -> JointSolution:
    """Section 2.3.4: batch slices ``b_1 + ... + b_n = batch``, each cut into token slices.

    Args:
      tables: batch-slice size ``b`` -> its ``slice_cost_table`` (sizes missing here are not used; the
        token-only setting passes tables for ``b = 1..batch``).
      batch: B, the sequences one pipeline processes per iteration.
      num_stages: K.
      epsilon, batch_size: as in :func:`solve_token_slicing`.
    """
    _check_positive("batch", batch)
    return _solve(tables, batch, num_stages, epsilon, batch_size, allow_batch_split=True)


def _solve(tables: Mapping[int, np.ndarray], batch: int, num_stages: int, epsilon: float, chunk: int,
           allow_batch_split: bool):
    _check_positive("num_stages", num_stages)
    if not tables:
        raise ValueError("tables must hold the cost table of at least one batch-slice size")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0 seconds, got {epsilon!r}")
    sizes = sorted(b for b in tables if 1 <= b <= batch)
    if not sizes:
        raise ValueError(f"no batch-slice size in tables {sorted(tables)} is between 1 and batch={batch}")
    by_end = {b: _by_end(np.asarray(tables[b], dtype=np.float64)) for b in sizes}
    candidates = _candidates([tables[b] for b in sizes], epsilon)
    best = (np.inf, None, None)  # (T, t_max, knapsack choice)
    evaluated, start, size = 0, 0, max(1, chunk)
    while start < len(candidates) and num_stages * candidates[start] <= best[0]:
        batch_t = candidates[start:start + size]
        batch_t = batch_t[num_stages * batch_t <= best[0]]
        evaluated += len(batch_t)
        sums = {b: _prefix_sums(by_end[b], batch_t)[:, -1] for b in sizes}
        for row, t_max in enumerate(batch_t):
            total, choice = _knapsack({b: sums[b][row] for b in sizes}, batch)
            latency = total + (num_stages - 1) * t_max
            if latency < best[0]:
                best = (latency, float(t_max), choice)
        start += size
    latency, t_max, choice = best
    if t_max is None:
        raise ValueError("no slicing satisfies the cost table (every candidate t_max is infeasible)")
    lengths = {b: _backtrack(by_end[b], t_max) for b in set(choice)}
    slices = tuple((b, lengths[b]) for b in choice)
    # Report the exact Eq. 2.4 value of the slices found (t_max may be below the candidate).
    times = [t for b, ls in slices for t in _slice_times(tables[b], ls)]
    exact = float(sum(times) + (num_stages - 1) * max(times))
    if not allow_batch_split:
        return SlicingSolution(lengths=slices[0][1], latency=exact, t_max=max(times), num_candidates=evaluated)
    return JointSolution(batch_slices=slices, latency=exact, t_max=max(times), num_candidates=evaluated)


def _knapsack(sums: Mapping[int, float], batch: int) -> tuple[float, tuple[int, ...]]:
    """min sum_j sums[b_j] subject to sum_j b_j = batch (unbounded 1-D knapsack); the sizes, largest first."""
    best = np.full(batch + 1, np.inf)
    pick = np.zeros(batch + 1, dtype=int)
    best[0] = 0.0
    for total in range(1, batch + 1):
        for b, s in sums.items():
            if b <= total and best[total - b] + s < best[total]:
                best[total], pick[total] = best[total - b] + s, b
    if not np.isfinite(best[batch]):
        return np.inf, ()
    choice, total = [], batch
    while total > 0:
        choice.append(int(pick[total]))
        total -= pick[total]
    return float(best[batch]), tuple(sorted(choice, reverse=True))


def uniform_slicing(table: np.ndarray, num_slices: int, num_stages: int) -> tuple[tuple[int, ...], float]:
    """``num_slices`` slices as equal as possible (the longer ones first) and their Eq. 2.4 latency: the
    baseline of the paper's Table 2.3."""
    seq_len = table.shape[0] - 1
    _check_positive("num_slices", num_slices)
    if num_slices > seq_len:
        raise ValueError(f"num_slices must be <= the sequence length {seq_len}, got {num_slices}")
    q, r = divmod(seq_len, num_slices)
    lengths = tuple(q + 1 if i < r else q for i in range(num_slices))
    return lengths, pipeline_latency(table, lengths, num_stages)
