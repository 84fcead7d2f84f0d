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

over the distinct slice costs as ``t_max`` candidates, thinned so that consecutive candidates differ by at
least ``epsilon`` (the answer is then within ``K epsilon`` of the optimum; ``epsilon = 0`` keeps every
distinct cost and gives the exact optimum).

Search (exact, :func:`_search_t_max`): the answer is the candidate with the least
``U(t) = S*(L; t) + (K - 1) t``, the smallest on ties, as if every candidate were evaluated. Alg. 1
enumerates the candidates in ascending order and stops once ``K t_max`` exceeds the best ``T`` found; that
stop is weak with few stages (``T`` is then mostly the sum of the slice costs, far above ``K t_max``) and is
provably exact only with ``epsilon = 0``. Here candidates are evaluated in vectorised rounds and skipped with bounds
that hold for any candidate set: ``S*(L; t)`` is non-increasing in ``t`` (a larger ``t_max`` admits more
slicings), so the ``S*`` of the nearest evaluated candidate above ``t`` bounds ``U(t)`` from below, and equal
``S*`` at two evaluated candidates fixes it between them. With ``epsilon = 0`` Alg. 1's ``K t_max`` stop is
applied as well.

Vectorisation: each round's candidates and every batch-slice size share one pass over ``i``; each step is a
masked ``min`` over an array ``[sizes, candidates, i]``. ``L = 2048, K = 96`` solves in well under a second,
and so does the joint DP with few stages (8 sequences of 512 tokens on 4 stages).

Joint batch + token slicing (section 2.3.4): for batch-slice sizes ``b = 1..B`` with their own cost tables,
``S*_b(L; t_max)`` is computed per evaluated candidate, a 1-D knapsack picks batch slices ``b_1 + ... = B``
minimising ``sum_j S*_{b_j}``, and ``T = knapsack + (K - 1) t_max`` (``S*`` above is then that knapsack sum).
"""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["SlicingSolution", "JointSolution", "slice_cost_table", "pipeline_latency", "solve_token_slicing",
           "solve_joint_slicing", "uniform_slicing", "format_scheme", "slice_contexts", "BatchSlices",
           "check_batch_slices", "is_token_lengths", "token_slicing_scheme"]


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


BatchSlices = tuple[tuple[int, tuple[int, ...]], ...]
"""(rows, token slice lengths) of every batch slice, in batch order (``ParallelPlan.token_slicing``)."""


def is_token_lengths(value) -> bool:
    """Whether ``value`` is a non-empty tuple of ints >= 1 (token slice lengths, or a batch slice's rows)."""
    return isinstance(value, tuple) and bool(value) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in value)


def token_slicing_scheme(token_slices, num_micro_batches: int, rows_per_micro_batch: int) -> BatchSlices:
    """``PipeshardParallel.token_slices`` as a batch + token slicing ``((rows, lengths), ...)``: lengths
    alone are used for every micro-batch of ``rows_per_micro_batch`` sequences."""
    if is_token_lengths(token_slices):
        return ((rows_per_micro_batch, tuple(token_slices)),) * num_micro_batches
    return tuple((rows, tuple(lengths)) for rows, lengths in token_slices)


def check_batch_slices(batch_slices, batch_size: int, seq_len: int) -> BatchSlices:
    """The scheme as plain ints; ValueError unless the rows sum to ``batch_size`` and every batch slice's
    token slices are positive and sum to ``seq_len``."""
    try:
        scheme = tuple((int(rows), tuple(int(x) for x in lengths)) for rows, lengths in batch_slices)
    except (TypeError, ValueError):
        raise ValueError(f"batch_slices must be ((rows, (token slice lengths...)), ...), got {batch_slices!r}")
    if not scheme or any(rows < 1 for rows, _ in scheme) or sum(rows for rows, _ in scheme) != batch_size:
        raise ValueError(f"batch_slices {scheme} must have rows >= 1 summing to the batch size {batch_size}")
    for rows, lengths in scheme:
        if not lengths or min(lengths) < 1 or sum(lengths) != seq_len:
            raise ValueError(f"token slices {list(lengths)} of batch slice ({rows}, ...) must be positive lengths "
                             f"summing to the sequence length {seq_len}")
    return scheme


def slice_contexts(batch_slices: Sequence[tuple[int, Sequence[int]]], shared: bool = False
                   ) -> tuple[tuple[int, ...], ...]:
    """Per batch slice, the context every token slice runs with: its start ``l_1 + ... + l_{i-1}``, or with
    ``shared`` (``share_slice_executables=True``: slices of equal (rows, length) share one executable) the
    longest start among the slices of its (rows, length) anywhere in the scheme, its cached keys and values
    left-padded to that length.

    >>> slice_contexts([(1, (256, 128, 128, 128))], shared=True)
    ((0, 512, 512, 512),)
    """
    starts = [tuple(int(x) for x in np.concatenate([[0], np.cumsum(lengths)[:-1]])) for _, lengths in batch_slices]
    if not shared:
        return tuple(starts)
    longest: dict[tuple[int, int], int] = {}
    for (rows, lengths), begins in zip(batch_slices, starts, strict=True):
        for length, start in zip(lengths, begins, strict=True):
            longest[(rows, length)] = max(longest.get((rows, length), 0), start)
    return tuple(tuple(longest[(rows, length)] for length in lengths) for rows, lengths in batch_slices)


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
    e = np.full((n + 1, n + 1), np.inf)
    for k in range(1, n + 1):
        e[k:, k] = table[k, :n + 1 - k]
    return e


def _prefix_sums(by_end: np.ndarray, t_max: np.ndarray) -> np.ndarray:
    """``S*(i; t_max)`` (Eq. 2.6-2.7) of every batch-slice size (``by_end[s]``, one ``_by_end`` table per size)
    and candidate: ``[sizes, candidates, i = 0..L]``.

    One pass over ``i`` serves every size and candidate; at ``i`` only slice lengths some candidate admits
    are looked at. A larger ``t_max`` admits a superset of slices, so ``S*`` is non-increasing in ``t_max``,
    exactly so in floating point (each value is a min of sums, and rounding is monotone)."""
    sizes, n = by_end.shape[0], by_end.shape[1] - 1
    s = np.full((sizes, len(t_max), n + 1), np.inf)
    s[:, :, 0] = 0.0
    limit = t_max[None, :, None]
    admitted = np.any(by_end <= t_max.max(), axis=0)
    longest = np.where(admitted.any(axis=1), n - np.argmax(admitted[:, ::-1], axis=1), 0)
    for i in range(1, n + 1):
        k = int(longest[i])
        if k == 0:
            continue
        cost = by_end[:, None, i, 1:k + 1]            # [sizes, 1, k]: slice lengths 1..k ending at i
        prev = s[:, :, i - 1::-1][:, :, :k]            # S*(i - 1), ..., S*(i - k)
        s[:, :, i] = np.min(prev + cost, axis=2, where=cost <= limit, initial=np.inf)
    return s


def _backtrack(by_end: np.ndarray, t_max: float) -> tuple[int, ...]:
    """The slice lengths achieving ``S*(L; t_max)`` for one ``_by_end`` table; among equal sums the shortest
    last slice (so lengths come out non-increasing for causal costs)."""
    s = _prefix_sums(by_end[None], np.array([t_max]))[0, 0]
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
    ordered, keep, i = values.tolist(), [], 0
    while i < len(ordered):  # keep a value, jump to the first one >= it + epsilon
        keep.append(i)
        i = bisect.bisect_left(ordered, ordered[i] + epsilon, i + 1)
    return values[keep]


def _check_positive(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def solve_token_slicing(table: np.ndarray, num_stages: int, *, epsilon: float = 0.0,
                        candidates_per_round: int = 32) -> SlicingSolution:
    """Alg. 1: the slice lengths minimising Eq. 2.4 for one sequence.

    Args:
      table: ``slice_cost_table(cost, L)``; ``table[k, c]`` is the per-stage time (forward + backward for
        training) of a slice of ``k`` tokens after ``c`` tokens of context.
      num_stages: K, the number of pipeline stages (>= 1).
      epsilon: seconds; t_max candidates closer than this to the previous kept one are dropped (the latency
        is then within ``K * epsilon`` of the optimum). 0 keeps every distinct cost (the exact optimum).
      candidates_per_round: t_max candidates solved together in one vectorised pass of the search.

    >>> t = slice_cost_table(lambda k, c: 1.0 + k * (1 + c / 4), 8)
    >>> solve_token_slicing(t, 4).lengths
    (3, 1, 1, 1, 1, 1)
    """
    return _solve({1: table}, 1, num_stages, epsilon, candidates_per_round, allow_batch_split=False)


def solve_joint_slicing(tables: Mapping[int, np.ndarray], batch: int, num_stages: int, *, epsilon: float = 0.0,
                        candidates_per_round: int = 32) -> JointSolution:
    """Section 2.3.4: batch slices ``b_1 + ... + b_n = batch``, each cut into token slices.

    Args:
      tables: batch-slice size ``b`` -> its ``slice_cost_table`` (sizes missing here are not used; the
        token-only setting passes tables for ``b = 1..batch``).
      batch: B, the sequences one pipeline processes per iteration.
      num_stages: K.
      epsilon, candidates_per_round: as in :func:`solve_token_slicing`.
    """
    _check_positive("batch", batch)
    return _solve(tables, batch, num_stages, epsilon, candidates_per_round, allow_batch_split=True)


def _solve(tables: Mapping[int, np.ndarray], batch: int, num_stages: int, epsilon: float, per_round: int,
           allow_batch_split: bool):
    _check_positive("num_stages", num_stages)
    _check_positive("candidates_per_round", per_round)
    if not tables:
        raise ValueError("tables must hold the cost table of at least one batch-slice size")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0 seconds, got {epsilon!r}")
    sizes = sorted(b for b in tables if 1 <= b <= batch)
    if not sizes:
        raise ValueError(f"no batch-slice size in tables {sorted(tables)} is between 1 and batch={batch}")
    by_end = np.stack([_by_end(np.asarray(tables[b], dtype=np.float64)) for b in sizes])
    candidates = _candidates([tables[b] for b in sizes], epsilon)
    index, evaluated = _search_t_max(by_end, sizes, candidates, batch, num_stages, per_round,
                                     paper_stop=epsilon == 0)
    if index == len(candidates):
        raise ValueError("no slicing satisfies the cost table (every candidate t_max is infeasible)")
    t_max = float(candidates[index])
    sums = _prefix_sums(by_end, np.array([t_max]))[:, :, -1]
    choice = _knapsack_choice(_knapsack(sums, sizes, batch), sums, sizes, 0)
    lengths = {b: _backtrack(by_end[sizes.index(b)], t_max) for b in set(choice)}
    slices = tuple((b, lengths[b]) for b in choice)
    # Report the exact Eq. 2.4 value of the slices found (t_max may be below the candidate).
    times = [t for b, ls in slices for t in _slice_times(tables[b], ls)]
    exact = float(sum(times) + (num_stages - 1) * max(times))
    if not allow_batch_split:
        return SlicingSolution(lengths=slices[0][1], latency=exact, t_max=max(times), num_candidates=evaluated)
    return JointSolution(batch_slices=slices, latency=exact, t_max=max(times), num_candidates=evaluated)


def _knapsack(sums: np.ndarray, sizes: Sequence[int], batch: int) -> np.ndarray:
    """The unbounded 1-D knapsack of section 2.3.4 for every column of ``sums[size, candidate]``:
    ``best[total, candidate] = min sum_j sums[b_j] subject to sum_j b_j = total``, ``total = 0..batch``."""
    best = np.full((batch + 1, sums.shape[1]), np.inf)
    best[0] = 0.0
    for total in range(1, batch + 1):
        for row, b in enumerate(sizes):
            if b <= total:
                np.minimum(best[total], best[total - b] + sums[row], out=best[total])
    return best


def _knapsack_choice(best: np.ndarray, sums: np.ndarray, sizes: Sequence[int], column: int) -> tuple[int, ...]:
    """The batch-slice sizes achieving ``best[batch, column]`` (at each total the smallest size that does),
    largest first."""
    choice, total = [], best.shape[0] - 1
    while total > 0:
        row, b = next((row, b) for row, b in enumerate(sizes)
                      if b <= total and best[total - b, column] + sums[row, column] == best[total, column])
        choice.append(b)
        total -= b
    return tuple(sorted(choice, reverse=True))


def _search_t_max(by_end: np.ndarray, sizes: Sequence[int], candidates: np.ndarray, batch: int, num_stages: int,
                  per_round: int, paper_stop: bool) -> tuple[int, int]:
    """Index of the candidate minimising ``U(t) = knapsack(S*(L; t)) + (K - 1) t`` (the smallest on ties)
    and how many candidates were evaluated.

    Exact branch and bound over the ascending candidates. ``U`` is evaluated in rounds of ``per_round``
    candidates solved together: first the smallest (Alg. 1's order; with many stages the optimum is among
    them), then candidates spread evenly over those still open. A candidate ``t`` stays closed, being
    provably no better than the best found, when (a) with ``t'`` the nearest evaluated candidate above it,
    ``knapsack(t') + (K - 1) t`` (a lower bound of ``U(t)``: ``S*`` is non-increasing in ``t_max``) is
    above the best, (b) the knapsack sums at the evaluated candidates just below and above ``t`` are equal
    (then so is ``t``'s, and ``U(t)`` is larger than at the one below), or (c) with ``paper_stop``, Alg. 1's
    stop ``K t >`` best (valid when every distinct cost is a candidate: the optimal slicing's dearest slice
    ``t*`` is then a candidate and ``U(t*) >= K t*``). The largest candidate admits every slice, so it is
    evaluated first: its knapsack sum bounds every other candidate's from below."""
    n = len(candidates)
    sums_at = np.full(n, np.nan)  # knapsack(S*(L; t)) per evaluated candidate
    open_ = np.ones(n, dtype=bool)
    best_u, best_i = np.inf, n

    def evaluate(index: np.ndarray) -> None:
        nonlocal best_u, best_i
        sums = _prefix_sums(by_end, candidates[index])[:, :, -1]
        sums_at[index] = _knapsack(sums, sizes, batch)[batch]
        open_[index] = False
        u = sums_at[index] + (num_stages - 1) * candidates[index]
        j = int(np.argmin(u))  # index is ascending: argmin is the smallest index on ties
        if u[j] < best_u or (u[j] == best_u and index[j] < best_i):
            best_u, best_i = float(u[j]), int(index[j])

    evaluate(np.array([n - 1]))
    first_round = True
    while True:
        evaluated = np.flatnonzero(~np.isnan(sums_at))
        live = np.flatnonzero(open_)
        above = evaluated[np.searchsorted(evaluated, live)]
        below = evaluated[np.maximum(np.searchsorted(evaluated, live) - 1, 0)]
        bound = sums_at[above] + (num_stages - 1) * candidates[live]
        closed = (bound > best_u) | ((bound == best_u) & (live > best_i))
        closed |= (below < live) & (sums_at[below] == sums_at[above])
        if paper_stop:
            closed |= num_stages * candidates[live] > best_u
        open_[live[closed]] = False
        live = live[~closed]
        if not len(live):
            break
        if first_round:
            evaluate(live[:per_round])
            first_round = False
        else:
            evaluate(live[np.unique(np.linspace(0, len(live) - 1, min(per_round, len(live))).round().astype(int))])
    return best_i, int(np.sum(~np.isnan(sums_at)))


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
