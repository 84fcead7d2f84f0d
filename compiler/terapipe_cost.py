"""Per-slice stage times for TeraPipe's DP (TeraPipe, dissertation ch. 2, Eq. 2.9).

.. math::

    t(i, j) = t(i, 0) + t_{ctx}(i, j), \\qquad t_{ctx}(i, j) = a_0 + a_1 i + a_2 j + a_3 i j \\quad (j > 0),

for a slice of ``i`` tokens after ``j`` tokens of context; ``t(i, 0)`` is tabulated for every ``i`` and the
context term is fitted by least squares (the paper reports under 2% error). For training ``t`` is forward
plus backward. Two sources build a :class:`SliceCostModel`:

* :func:`analytic_slice_costs`: FLOPs of a transformer stage's slice on a :class:`~alpa_like.ClusterSpec`
  device, with a utilisation floor (a device takes as long for a little work as for the work of
  ``saturation_tokens`` tokens of the layer on one device, the paper's Fig. 2.3), tensor-parallel
  all-reduces and the stage-to-stage send; :func:`data_parallel_sync_seconds` adds the per-iteration
  gradient all-reduce among data-parallel replicas;
* :func:`measured_slice_costs`: times a real stage on a grid of slice and context lengths and fits.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from alpa_like.compiler.cluster import ClusterSpec

__all__ = ["SliceCostModel", "SliceTimings", "fit_slice_costs", "analytic_slice_costs", "measured_slice_costs",
           "slice_grid", "time_slice_grid",
           "transformer_layer_flops", "data_parallel_sync_seconds"]


@dataclasses.dataclass(frozen=True)
class SliceCostModel:
    """Eq. 2.9 for one stage: ``slice_time(i, j) = base[i - 1] + [j > 0] max(0, a0 + a1 i + a2 j + a3 i j)``
    (a fitted context term never makes a slice cheaper than without context)."""

    base: tuple[float, ...]
    """t(i, 0) in seconds for i = 1..L."""
    context_coefficients: tuple[float, float, float, float]
    """(a0, a1, a2, a3) of t_ctx."""
    fit_error: float
    """Largest relative error of the model over the points it was fitted on."""
    mean_fit_error: float
    """Mean relative error over the same points."""
    fit_points: tuple[tuple[int, int, float, float], ...] = ()
    """Per sample ``(length, context, seconds, model's seconds)``: the fit error at every grid point."""
    last_slice: tuple[float, ...] = ()
    """Measured sources only (``fit_slice_costs(..., tabulate_last_slice=True)``): t(i, L - i) for
    i = 1..L, the slice that ends the sequence, tabulated like ``base`` instead of taken from the plane."""
    context_fit_error: float = 0.0
    """Largest relative error over the samples the context term was fitted on (j > 0, not tabulated)."""
    mean_context_fit_error: float = 0.0

    @property
    def seq_len(self) -> int:
        return len(self.base)

    def slice_time(self, lengths, contexts) -> np.ndarray:
        """Seconds per stage of slices of ``lengths`` tokens after ``contexts`` tokens (vectorised)."""
        i = np.asarray(lengths, dtype=np.int64)
        j = np.asarray(contexts, dtype=np.float64)
        if np.any(i < 1) or np.any(i > self.seq_len) or np.any(j < 0) or np.any(i + j > self.seq_len):
            raise ValueError(f"slices must satisfy 1 <= length and length + context <= {self.seq_len}")
        a0, a1, a2, a3 = self.context_coefficients
        ctx = np.where(j > 0, np.maximum(a0 + a1 * i + a2 * j + a3 * i * j, 0.0), 0.0)
        out = np.asarray(self.base)[i - 1] + ctx
        if self.last_slice:
            out = np.where((i + j == self.seq_len) & (j > 0), np.asarray(self.last_slice)[i - 1], out)
        return out

    def __call__(self, lengths, contexts) -> np.ndarray:
        return self.slice_time(lengths, contexts)

    def relative_errors(self, samples: Sequence[tuple[int, int, float]]) -> np.ndarray:
        """``(model - seconds) / seconds`` per ``(length, context, seconds)`` sample, e.g. on points held out
        of the fit."""
        data = np.asarray(samples, dtype=np.float64).reshape(-1, 3)
        return (self.slice_time(data[:, 0].astype(int), data[:, 1]) - data[:, 2]) / data[:, 2]


def fit_slice_costs(seq_len: int, samples: Sequence[tuple[int, int, float]], *,
                    tabulate_last_slice: bool = False) -> SliceCostModel:
    """Eq. 2.9 from measured ``(length, context, seconds)`` samples.

    ``t(i, 0)`` is interpolated linearly between the sampled lengths with context 0; the context term is
    the least-squares fit of ``t(i, j) - t(i, 0)`` over the samples with ``j > 0``. The fit error is the
    relative error of the resulting model on every sample (also per sample: ``fit_points``);
    ``context_fit_error`` the same over the samples the context term was fitted on.

    ``tabulate_last_slice``: the slice ending the sequence (``i + j = L``; every slicing has exactly one) is
    interpolated from the samples with ``i + j = L`` instead of taken from the fitted plane, which is then
    fitted without them. For measured CPU costs: with ``L`` a power of two, that slice's attention rows are
    ``L`` keys long, and on the machine of this project such rows (1024, 2048 keys) ran 1.7-3.7x slower than
    rows of 1000 or 1048 keys (set-associative cache aliasing of power-of-two strides; measured in the
    benchmark), a step no bilinear context term can fit.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    data = np.asarray(samples, dtype=np.float64).reshape(-1, 3)
    zero = data[data[:, 1] == 0]
    if len(zero) < 1:
        raise ValueError("samples need at least one slice with context 0 (t(i, 0) of Eq. 2.9)")
    order = np.argsort(zero[:, 0])
    lengths = np.arange(1, seq_len + 1)
    base = np.interp(lengths, zero[order, 0], zero[order, 2])
    ends = (data[:, 0] + data[:, 1] == seq_len) & (data[:, 1] > 0)
    last = ()
    if tabulate_last_slice:
        if not ends.any():
            raise ValueError("tabulate_last_slice needs samples with length + context = seq_len and context > 0")
        rows = data[ends]
        rows = rows[np.argsort(rows[:, 0])]
        # i = L (context 0) is t(L, 0); it anchors the interpolation at the long end.
        xs = np.concatenate([rows[:, 0], [seq_len]])
        ys = np.concatenate([rows[:, 2], [base[-1]]])
        last = tuple(float(x) for x in np.interp(lengths, xs, ys))
    ctx = data[(data[:, 1] > 0) & ~(ends & tabulate_last_slice)]
    coefficients = (0.0, 0.0, 0.0, 0.0)
    if len(ctx):
        i, j = ctx[:, 0], ctx[:, 1]
        design = np.stack([np.ones_like(i), i, j, i * j], axis=1)
        target = ctx[:, 2] - np.interp(i, zero[order, 0], zero[order, 2])
        coefficients = tuple(float(x) for x in np.linalg.lstsq(design, target, rcond=None)[0])
    model = SliceCostModel(base=tuple(float(x) for x in base), context_coefficients=coefficients,
                           fit_error=0.0, mean_fit_error=0.0, last_slice=last)
    predicted = model.slice_time(data[:, 0].astype(int), data[:, 1])
    errors = np.abs(predicted - data[:, 2]) / np.maximum(data[:, 2], 1e-30)
    points = tuple((int(i), int(j), float(t), float(p)) for (i, j, t), p in zip(data, predicted, strict=True))
    fitted = errors[(data[:, 1] > 0) & ~(ends & tabulate_last_slice)]
    return dataclasses.replace(model, fit_error=float(errors.max()), mean_fit_error=float(errors.mean()),
                               fit_points=points, context_fit_error=float(fitted.max(initial=0.0)),
                               mean_context_fit_error=float(fitted.mean()) if len(fitted) else 0.0)


def transformer_layer_flops(batch: int, length, context, hidden: int, ffn_ratio: int = 4):
    """Forward FLOPs of one transformer layer on a slice (Megatron-LM's count, section 5.1): projections
    and MLP ``(8 + 4 ffn_ratio) b l h^2``, attention scores and weighted sum ``4 b l (j + l) h`` (the
    causal mask is applied to a full ``l x (j + l)`` block). Returns ``(dense, attention)``."""
    length = np.asarray(length, dtype=np.float64)
    context = np.asarray(context, dtype=np.float64)
    dense = 2.0 * (4 + 2 * ffn_ratio) * batch * length * hidden**2
    attention = 4.0 * batch * length * (context + length) * hidden
    return dense, attention


def data_parallel_sync_seconds(cluster: ClusterSpec, *, hidden: int, layers_per_stage: int, op_degree: int,
                               data_parallel: int, dtype_bytes: int = 2) -> float:
    """Per iteration, the ring all-reduce of one stage's gradients (``12 h^2`` parameters per transformer
    layer, split over ``op_degree`` devices) among ``data_parallel`` replicas, after the pipeline drains
    (TeraPipe section 2.4: replicas "synchronize the gradient updates ... after each forward and backward
    propagation"). Replicas of a stage sit on different nodes and every device of a node syncs at once, so
    each gets ``cluster.inter_node_bandwidth`` (the node's NIC divided by its devices)."""
    if data_parallel <= 1:
        return 0.0
    nbytes = 12 * hidden**2 * layers_per_stage / op_degree * dtype_bytes
    steps = 2 * (data_parallel - 1)
    return steps / data_parallel * nbytes / cluster.inter_node_bandwidth + steps * cluster.inter_node_latency


def analytic_slice_costs(cluster: ClusterSpec, *, seq_len: int, hidden: int, layers_per_stage: int,
                         batch: int = 1, op_degree: int = 1, efficiency: float = 0.5,
                         saturation_tokens: int = 256, saturation_flops: float | None = None,
                         dtype_bytes: int = 2, training: bool = True, cross_node: bool = True) -> SliceCostModel:
    """Eq. 2.9 for a stage of ``layers_per_stage`` transformer layers on ``op_degree`` devices of ``cluster``.

    Per layer and device, ``(max(dense(b l) / op_degree, dense(saturation_tokens)) + attention / op_degree)
    / (peak * efficiency)``: the utilisation floor is per device, so a layer split over ``op_degree`` devices
    needs ``op_degree`` times the tokens to saturate them (each device's GEMMs are ``op_degree`` times narrower),
    times 3 for training (backward = 2 x forward); plus, with ``op_degree > 1``, Megatron's 2 ring
    all-reduces of the ``b l h`` activation per layer and direction inside a node; plus the send of the
    slice's activation (and its gradient when training) to the next stage, over the inter-node link when
    ``cross_node``. The context term is fitted on a grid exactly as for measurements.

    Args:
      efficiency: fraction of ``cluster.peak_flops`` a saturated device reaches (calibrate it on one
        measured latency).
      saturation_tokens: tokens below which a layer on ONE device takes constant time (the utilisation floor
        of the paper's Fig. 2.3: one GPT3-1B layer on a V100 takes as long for 1 token as for 256); on
        ``op_degree`` devices the floor is the same per-device work.
      saturation_flops: the same floor given directly as a device's dense forward FLOPs per layer (overrides
        ``saturation_tokens``; Fig. 2.3's 256 tokens of a GPT3-1B layer are 25.8 GFLOP).
      cross_node: whether the stage-to-stage send crosses nodes (a stage fills its node); False when a node
        holds several consecutive stages of the pipeline (``op_degree < devices per node``), NVLink then.
    """
    for name, value in (("seq_len", seq_len), ("hidden", hidden), ("layers_per_stage", layers_per_stage),
                        ("batch", batch), ("op_degree", op_degree), ("saturation_tokens", saturation_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if saturation_flops is not None and not saturation_flops > 0:
        raise ValueError(f"saturation_flops must be > 0, got {saturation_flops!r}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")

    def exact(length, context):
        length = np.asarray(length, dtype=np.float64)
        dense, attention = transformer_layer_flops(batch, length, context, hidden)
        floor = (saturation_flops if saturation_flops is not None
                 else transformer_layer_flops(1, saturation_tokens, 0, hidden)[0])
        per_device = np.maximum(dense / op_degree, floor) + attention / op_degree
        passes = 3.0 if training else 1.0
        compute = passes * layers_per_stage * per_device / (cluster.peak_flops * efficiency)
        nbytes = batch * length * hidden * dtype_bytes
        directions = 2 if training else 1
        comm = 0.0
        if op_degree > 1:
            ring = 2 * (op_degree - 1) / op_degree * nbytes / cluster.intra_node_bandwidth
            comm += directions * 2 * layers_per_stage * (ring + cluster.intra_node_latency)
        if cross_node:
            link = cluster.inter_node_bandwidth * op_degree, cluster.inter_node_latency
        else:
            link = cluster.intra_node_bandwidth, cluster.intra_node_latency
        comm = comm + directions * (nbytes / link[0] + link[1])
        return compute + comm

    grid_lengths = sorted({1, seq_len, *np.unique(np.geomspace(1, seq_len, 24).astype(int)).tolist()})
    samples = [(i, 0, float(exact(i, 0))) for i in range(1, seq_len + 1)]
    for i in grid_lengths:
        for j in np.unique(np.linspace(0, seq_len - i, 6).astype(int))[1:]:
            samples.append((i, int(j), float(exact(i, j))))
    return fit_slice_costs(seq_len, samples)


@dataclasses.dataclass(frozen=True)
class SliceTimings:
    """Repeated timings of a stage on a grid of ``(length, context)`` points (:func:`time_slice_grid`)."""

    runs: dict[tuple[int, int], tuple[float, ...]]
    """Seconds of every timed run per point, warm-up runs excluded."""

    def medians(self) -> list[tuple[int, int, float]]:
        """``(length, context, median seconds)`` per point: the samples Eq. 2.9 is fitted on."""
        return [(i, j, float(np.median(t))) for (i, j), t in sorted(self.runs.items())]

    def spread(self) -> dict[tuple[int, int], float]:
        """Timing noise per point: interquartile range / median of its runs."""
        return {p: float((np.percentile(t, 75) - np.percentile(t, 25)) / np.median(t)) for p, t in self.runs.items()}

    def halves(self) -> tuple[SliceTimings, SliceTimings]:
        """The even and the odd rounds: two independent measurements of every point (a model fitted on one
        half is scored on the other, so timing noise is not counted as fit quality)."""
        if min(len(t) for t in self.runs.values()) < 2:
            raise ValueError("halves need at least 2 timed runs per point")
        return (SliceTimings(runs={p: t[0::2] for p, t in self.runs.items()}),
                SliceTimings(runs={p: t[1::2] for p, t in self.runs.items()}))


def time_slice_grid(time_slice: Callable[[int, int], float], points: Sequence[tuple[int, int]], *,
                    repeats: int = 9, warmup: int = 2, seed: int = 0) -> SliceTimings:
    """Times ``time_slice(length, context)`` (one blocking run of the stage) at every point: ``warmup`` runs
    per point first (compilation, caches), then ``repeats`` rounds that each time every point once, in a
    fresh random order per round, so a change in machine load during the measurement spreads over all
    points instead of biasing the ones timed at that moment."""
    for name, value in (("repeats", repeats), ("warmup", warmup)):
        if not isinstance(value, int) or value < (1 if name == "repeats" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'repeats' else 0}, got {value!r}")
    points = sorted(set((int(i), int(j)) for i, j in points))
    for i, j in points:
        for _ in range(warmup):
            time_slice(i, j)
    rng = np.random.default_rng(seed)
    runs: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for _ in range(repeats):
        for n in rng.permutation(len(points)):
            start = time.perf_counter()
            time_slice(*points[n])
            runs[points[n]].append(time.perf_counter() - start)
    return SliceTimings(runs={p: tuple(t) for p, t in runs.items()})


def slice_grid(seq_len: int, lengths: Sequence[int] | None = None,
               contexts: Sequence[int] | None = None, *, last_slice: bool = False) -> list[tuple[int, int]]:
    """Every ``(length, context)`` with ``length + context <= seq_len`` from the given lengths and contexts
    (context 0 always; with ``last_slice`` also ``seq_len - length``, the slice that ends the sequence).
    Defaults: 8 lengths from 1 to ``seq_len`` (geometric), 4 contexts per length."""
    lengths = sorted(set(lengths or np.unique(np.geomspace(1, seq_len, 8).astype(int)).tolist()))
    points = []
    for i in lengths:
        if not 1 <= i <= seq_len:
            raise ValueError(f"lengths must lie in 1..{seq_len}, got {i}")
        ctx = contexts if contexts is not None else np.unique(np.linspace(0, seq_len - i, 4).astype(int)).tolist()
        ends = [seq_len - i] if last_slice else []
        points += [(i, j) for j in sorted(set([0, *ends, *[int(c) for c in ctx if 0 <= c <= seq_len - i]]))]
    return points


def measured_slice_costs(time_slice: Callable[[int, int], float], seq_len: int, *,
                         lengths: Sequence[int] | None = None, contexts: Sequence[int] | None = None,
                         repeats: int = 9, warmup: int = 2, tabulate_last_slice: bool = False
                         ) -> SliceCostModel:
    """Eq. 2.9 from timing a real stage: ``time_slice(length, context)`` runs the stage once on such a slice
    (and blocks until done); each grid point (:func:`slice_grid`) is the median of ``repeats`` runs timed
    in shuffled rounds after ``warmup`` runs (:func:`time_slice_grid`), then :func:`fit_slice_costs`
    (``tabulate_last_slice``: also time every length as the sequence's last slice and tabulate it).
    Pick lengths whose stage time is well above the per-call dispatch time, or dispatch dominates the fit.
    """
    grid = slice_grid(seq_len, lengths, contexts, last_slice=tabulate_last_slice)
    timings = time_slice_grid(time_slice, grid, repeats=repeats, warmup=warmup)
    return fit_slice_costs(seq_len, timings.medians(), tabulate_last_slice=tabulate_last_slice)
