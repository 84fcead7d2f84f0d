r"""The inter-operator stage DP: slice layers into pipeline stages and the cluster into submeshes.

Alpa dissertation §3.5.2, Eq. 3.2-3.5 and Algorithm 2 (lines 25-43). The input is a table of stage costs
that the intra-op pass fills in (:class:`StageCosts`); the output is plain data (:class:`StageSolution`).
Nothing here traces, compiles or profiles.

The objective is the pipeline latency of Eq. 3.2 (GPipe and synchronous 1F1B alike): the first micro-batch
goes through every stage, the other ``B - 1`` follow at the pace of the slowest stage,

.. math::
   T^* = \min_{s_1..s_S,\ (n_1, m_1)..(n_S, m_S)}
         \Big\{ \sum_{i=1}^S t_i + (B - 1) \max_{1 \le j \le S} t_j \Big\},
   \qquad \sum_{i=1}^S n_i m_i = N M.            \tag{3.2}

For a fixed bound :math:`t_{max}` on the slowest stage, :math:`F(s, k, d; t_{max})` is the least total
latency of layers :math:`k..K-1` cut into :math:`s` stages on exactly :math:`d` devices (0-based layers
here; the dissertation counts from 1):

.. math::
   F(s, k, d; t_{max}) = \min_{\substack{k \le i < K \\ n_p m_p \le d}}
       \big\{ t_{intra}((k..i), p, s) + F(s - 1, i + 1, d - n_p m_p; t_{max})
       \ \big|\ t_{intra}((k..i), p, s) \le t_{max} \big\},
   \qquad F(0, K, 0) = 0,                          \tag{3.3}

.. math::
   T^*(t_{max}) = \min_s F(s, 0, N M; t_{max}) + (B - 1)\, t_{max},   \tag{3.4}

where :math:`t_{intra}((k..i), p, s)` is the fastest logical view of submesh :math:`p` on which the stage
fits in memory when it is the :math:`s`-th stage from the end of the pipeline:

.. math::
   \mathrm{mem}_{stage} + \min(s, B) \cdot \mathrm{mem}_{act} \le \mathrm{mem}_{device}
   \quad \text{(1F1B)}, \qquad
   \mathrm{mem}_{stage} + B \cdot \mathrm{mem}_{act} \le \mathrm{mem}_{device} \quad \text{(GPipe)}.
                                                    \tag{3.5}

**Reading of Eq. 3.5.** In Eq. 3.3 the stage being chosen is the first of the ``s`` stages that remain,
so ``s`` counts the stages from this one to the last, itself included: the last stage has ``s = 1``, the
first of an ``S``-stage pipeline ``s = S``. Under 1F1B the ``p``-th stage (1-based) runs ``S - p + 1``
forward passes before its first backward, so it holds exactly ``s`` micro-batches of activations. We cap
this at ``B`` (a pipeline never holds more micro-batches than exist); for ``B >= S`` it is the
dissertation's formula verbatim. GPipe runs all ``B`` forwards first, so every stage holds ``B``.

**Enumeration of t_max (Alg. 2 lines 27-30).** Candidates are the distinct finite
:math:`t_{intra}((k..i), p, s)` values, ascending. The enumeration stops once
:math:`B \cdot t_{max} \ge T^*`: a plan whose slowest stage takes :math:`t` costs at least :math:`B t`.
The ``epsilon`` filter groups the sorted values into runs that span less than ``epsilon`` and solves each
run once, at its *largest* value, so every plan is admitted at a :math:`t_{max}` within ``epsilon`` of its
own slowest stage and the answer is within :math:`(B - 1)\epsilon` of the optimum. (Skipping a value that
is within ``epsilon`` of the last solved one, the literal reading, can admit a plan only at a much larger
:math:`t_{max}` and has no such bound.) Two exact shortcuts of ours cut the number of DP runs further:
the first run at which any plan exists (the runs below it give :math:`T^* = \infty`), found by one
bottleneck DP run (Eq. 3.3 with ``max`` for ``+``: the least slowest stage over all plans; a bisection when
there are only a few runs), and an interval bound (:math:`F` does not increase with :math:`t_{max}`, see
``_search``). ``prune=False`` solves every run, for tests. Within a run, a stage whose table time less
both of its boundary savings exceeds :math:`t_{max}`, or that no plan of the remaining stages can follow
on the devices left, is not looked at.

**Whole cluster.** As in Alpa the submeshes of a plan use all ``N * M`` devices, and every submesh must be
one of :func:`alpa_like.compiler.submesh.submesh_shapes`, so :func:`~alpa_like.compiler.submesh.assign_devices`
can always place the answer (App. 3.11).

**Boundaries inside a node (ours).** ``t_intra`` includes what a stage receives from its neighbours, priced
as if every boundary crossed nodes. With :attr:`StageCosts.boundary_saving`, the DP also solves Eq. 3.3 over
the plans whose stages, laid out one after another in pipeline order, are aligned (each ``(1, m)`` mesh at
an offset that is a multiple of ``m``, whole-node meshes at node boundaries): ``assign_devices`` puts those
stages on exactly the nodes of that layout, and the stage chosen with ``d`` devices left starts at device
``N M - d``, so which of its boundaries stay inside a node is known in the DP state. Such stages cost
``t_intra`` minus the saving of each inside boundary; the answer is the better of that DP and the plain one
(:func:`~alpa_like.compiler.stage_placement.price_placed_stages` prices a finished plan the same way; the
tests' brute force agrees).

**Shared NICs (ours).** In an aligned layout a node other than the first and the last that holds two or
more meshes (:func:`~alpa_like.compiler.stage_placement.shared_nodes`) has two transfers through each of its NICs every micro-batch in 1F1B:
into it, its first mesh's activations from the node before and its last mesh's gradients from the node
after; out of it, its first mesh's gradients back and its last mesh's activations on. The simulated backend
books every node's NIC per direction and makes transfers through one NIC take turns
(:class:`~alpa_like.runtime.simulator.NicBook`): when both are ready together one receive lasts its own
transfer plus the other's (the receiving mesh waits), and in the pipelined steady state that repeats every
micro-batch. Wide-ResNet-6.8B on 4 p3.16xlarge nodes with two (1, 4) meshes on node 1 shows it: the first
stage (node 0, the slowest) waits for node 1's outbound NIC once per micro-batch, 1.93 s over 63
micro-batches = 0.031 s each, and the step goes from 8.84 s (NICs unshared) to 10.77 s. A crossing receive
pays :attr:`StageCosts.nic_wait` for its side once for each shared NIC on its way (the sending node's
outbound and the receiving node's inbound NIC), an expected wait that
:func:`~alpa_like.compiler.stage_profiling.shared_nic_wait` derives from the take-turns rule (half the
receive's own NIC time). The receiving stage pays (the simulator charges the wait to the mesh that
receives), so besides the node's first and last mesh the last mesh of the node before and the first mesh of
the node after pay. Their own position tells the node's first and last mesh that they are on a shared node;
a neighbour's does not, so the DP (``_placed_dp``) splits its table by two flags of the stages that remain:
whether the node before their first stage is shared, and whether that first stage is the first mesh of a
shared node. The same rule prices a finished plan (``price_placed_stages``) and the brute force, so the
DP stays exact for its objective. Misaligned plans would be placed by the covering construction
(:func:`~alpa_like.compiler.submesh.assign_devices`), which may put meshes that are not pipeline neighbours
on one node, every one of them crossing nodes: the DP does not know their NICs, so when NICs can be shared
(``nic_wait`` given, 3 nodes or more, a submesh smaller than a node) it considers aligned plans only
(:func:`aligned_plans_only`; the brute force likewise). The wait is an estimate: transfers that are never
ready together do not wait at all, and the other transfer's size stands in for this one's.

**Per-step terms (ours).** A stage may also spend time once per step, outside the pipelined
micro-batches (:attr:`StageCosts.step_seconds`): the apply-grad of a parameter that layers of several
stages read (GPT's tied embedding, read by the first layer and the logits) runs where its last gradient is
made, and first receives the gradient the other stage accumulated, after the pipeline has drained; the
other stage runs the same update (the runtime replicates it, as Megatron-LM does) after receiving the first
one's gradient part. Each mesh does this on its own clock, at the same time as the others (the simulated
step of a GPT ends with the slower of the two receives, not their sum), so the objective is Eq. 3.2 plus
the largest of these terms over the plan's stages. They do not enter the ``t_max`` test (they do not pace
the micro-batches). A maximum does not decompose over the stages of Eq. 3.3, so the DP enumerates it like
``t_max``: for each distinct value ``c`` of the terms it solves Eq. 3.3-3.4 over the stages whose term is at
most ``c`` and adds ``c``; the least total over ``c`` is the optimum (a plan is counted at ``c`` = its own
largest term, and at larger ``c`` only costs more). Exact shortcuts: the optimum ``T_0`` with every stage
admitted is solved first (it is the largest ``c``'s search); no ``c`` does better than ``c + T_0``, so the
levels from the first ``c`` with ``c + T_0`` at or above the best total are skipped, and a level's t_max
groups with ``B t`` at or above its remaining budget are not solved. Levels closer than ``epsilon`` are
solved once, at the largest (error at most ``epsilon`` more). Both pruning rules of ``_search`` stay exact
within each ``c``. GPT-39B's real table at 1024 micro-batches: 41 DP runs, 7.9 s (the sum version: 19 runs,
4.3 s; every level solved in full: 370 runs, 92 s).

**Cost.** One DP is :math:`O(K^3 \cdot NM \cdot P)` for ``P`` submesh shapes (Alpa: :math:`O(K^3 NM (N +
\log M))`), vectorised with numpy over the last layer, submesh and devices; the number of stages and the
first layer are Python loops. Measured on this machine (2 shared cores) for a GPT-39B-like table (``K =
48`` layers, ``8 x 8`` cluster, 11 submeshes and 21 (submesh, logical) pairs, ``B = 64``, 16,800 distinct
t_max candidates): about 15 ms per DP and 0.2-0.5 s per solve with 13-30 DP runs
(``tests/compiler/test_stage_dp.py::test_benchmark_gpt_48_layers_64_devices``; Alpa's Table 3.5 reports
1.65 s for its DP). With only the bisection and Alg. 2's ``B * t_max`` stop, 709 t_max are solved there
(about 14 s); solving all 16,800 (``prune=False``) takes about 4 minutes. All three give the same plan.
With boundary savings every DP run solves the second (aligned) table too, over up to four times as many
t_max candidates: GPT-39B's real table took 2.2 s instead of 0.2 s (``examples/benchmarks/stage_dp.py``).
With shared NICs the aligned DP is the only one, with four tables (the two flags) and up to sixteen times as
many t_max candidates (each side inside a node, or across through 0, 1 or 2 shared NICs); it computes a level
for every first layer at once when it records no choices, each submesh only at the device counts where its
stages start aligned (a whole-node mesh at every ``M``-th: a level of a 1,024-GPU cluster costs about a
quarter of the full width). GPT-39B's real table on 64 GPUs (49 layers,
shared NICs, ``B = 64``): 48 DP runs, about 3.4 s (``examples/benchmarks/planning.py``).
"""
from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable

import numpy as np

from alpa_like.compiler.indices import SubmeshIdx
from alpa_like.compiler.schedules import ScheduleName, schedule_name
from alpa_like.compiler.stage_costs import StageChoice, StageCosts, StageSolution, int_pair, is_int
from alpa_like.compiler.stage_placement import AlignedLayouts, price_placed_stages, take
from alpa_like.compiler.submesh import submesh_shapes


_GIB = 2**30


def solve_stages(costs: StageCosts, cluster_shape: tuple[int, int], num_micro_batches: int,
                 device_memory: float, *, epsilon: float = 1e-6,
                 schedule: ScheduleName | str = ScheduleName.ONE_F_ONE_B, prune: bool = True) -> StageSolution:
    r"""Minimises Eq. 3.2 over stage slicings and submesh/logical choices (Alpa Alg. 2, Eq. 3.3-3.5).

    See the module docstring for the equations and the reading of Eq. 3.5.

    Args:
      costs: the profiled stage costs.
      cluster_shape: ``(N, M)``: nodes and devices per node. Every submesh of ``costs`` must be one of
        ``submesh_shapes(N, M)``, and a plan uses all ``N * M`` devices.
      num_micro_batches: ``B`` >= 1.
      device_memory: bytes per device.
      epsilon: seconds; t_max candidates closer than this are solved once (error <= ``(B - 1) * epsilon``).
        0 solves every distinct value.
      schedule: the pipeline schedule (a :class:`~alpa_like.compiler.schedules.ScheduleName`), which sets the
        micro-batches of activations each stage holds (Eq. 3.5; :func:`micro_batches_in_flight`).
      prune: stop the enumeration once ``B * t_max >= T*``, skip infeasible t_max by bisection and skip
        t_max intervals that cannot beat ``T*`` (exact; see ``_search``). ``False`` solves every candidate
        (a reference for tests).

    Returns:
      The best plan; ``stages`` in pipeline order.

    Raises:
      ValueError: for bad arguments; when no plan covers the cluster with finite costs; when no plan fits in
        memory (the message gives the smallest per-device shortfall over all plans, in GiB).

    >>> gpt = StageCosts.from_fn(4, [(1, 1), (1, 2)], lambda i, j, sub, view: ((j - i + 1) * 1e-3, 0, 0),
    ...                          logical_shapes=[[(1, 1)], [(1, 2)]])
    >>> solve_stages(gpt, (1, 2), num_micro_batches=8, device_memory=2**30).layers_per_stage
    (2, 2)
    """
    n_nodes, per_node = int_pair(cluster_shape, "cluster_shape")
    batches = _check_positive_int(num_micro_batches, "num_micro_batches")
    schedule = schedule_name(schedule)
    _check_inputs(costs, (n_nodes, per_node), device_memory, epsilon)
    num_devices = n_nodes * per_node
    sizes = costs.sizes
    max_stages = min(costs.num_layers, num_devices)
    placement = AlignedLayouts.of(costs, num_devices, per_node)
    weight = float(schedule.bubble_weight)
    step = _step_costs(costs)
    answers = []  # (total, t_max, eff, view, in_flight) for each memory rule
    evaluated = 0
    for in_flight, depth in _memory_rules(schedule, max_stages, batches):
        eff, view = _effective_costs(costs, in_flight, device_memory)
        eff[depth:] = np.inf
        answer, runs = _solve_rule(eff, sizes, num_devices, placement, batches, weight, epsilon, prune, step)
        evaluated += runs
        if answer is not None:
            answers.append((*answer, view, in_flight))
    if not answers:
        in_flight = micro_batches_in_flight(schedule, max_stages, batches)
        eff, _ = _effective_costs(costs, in_flight, device_memory)
        if placement is not None and placement.nic is not None and _best_t_max(eff, sizes, num_devices, None,
                                                                                batches, epsilon, prune)[0]:
            raise ValueError(
                f"no aligned contiguous plan (each (1, m) mesh at a device offset that is a multiple of m, "
                f"whole-node meshes at node boundaries) fits the {n_nodes} x {per_node} cluster; with "
                f"nic_wait (shared NICs) the stage DP considers only those, and only misaligned plans fit")
        raise _infeasible_error(costs, (n_nodes, per_node), in_flight, device_memory, schedule, batches)
    _, t_max, eff, view, in_flight = min(answers, key=lambda answer: answer[0])
    stages = _reconstruct(costs, eff, view, t_max, num_devices, in_flight, placement)
    return StageSolution.of(price_placed_stages(costs, stages, per_node), batches, num_t_max_evaluated=evaluated,
                            schedule=schedule)


def _memory_rules(schedule: ScheduleName, max_stages: int, batches: int) -> list[tuple[np.ndarray, int]]:
    """``(in_flight, depth)`` pairs: solve Eq. 3.3-3.4 once per pair over plans of at most ``depth`` stages,
    the ``s``-th stage from the end holding ``in_flight[s - 1]`` micro-batches. One pair, Eq. 3.5's rule, for
    the schedules whose stages hold :func:`micro_batches_in_flight`; for the zero-bubble ones, whose every
    stage holds as many as the pipeline's depth ``S`` sets (``min(S, B)`` for ZB-H1, ``min(2S - 1, B)`` for
    ZB-H2, counted from ``F`` to ``W``), one pair per ``S <= B``: each plan is priced exactly at its own
    depth and never cheaper at a deeper one (more memory held), so the least answer is the optimum."""
    if not schedule.splits_backward:
        return [(micro_batches_in_flight(schedule, max_stages, batches), max_stages)]
    return [(np.full(max_stages, _zero_bubble_held(schedule, depth, batches)), depth)
            for depth in range(1, min(max_stages, batches) + 1)]


def _zero_bubble_held(schedule: ScheduleName, depth: int, batches: int) -> int:
    """Micro-batches every stage of a ``depth``-stage zero-bubble pipeline holds (its schedule's peak)."""
    return min(depth if schedule == ScheduleName.ZB_H1 else 2 * depth - 1, batches)


def _solve_rule(eff: np.ndarray, sizes: np.ndarray, num_devices: int, placement: AlignedLayouts | None, batches: int,
                weight: float, epsilon: float, prune: bool, step: np.ndarray | None
                ) -> tuple[tuple[float, float, np.ndarray] | None, int]:
    """``((total, t_max, eff), runs)`` of the best plan on ``eff`` with the per-step terms (module docstring),
    or ``(None, runs)`` when none exists."""
    found, evaluated = _best_t_max(eff, sizes, num_devices, placement, batches, epsilon, prune, weight=weight)
    if found is None:
        return None, evaluated
    usable = np.isfinite(eff).any(axis=0) & np.isfinite(step) if step is not None else None
    levels = [] if step is None else _t_max_groups(np.unique(step[usable]), epsilon)
    top = levels[-1][1] if levels else 0.0
    unconstrained = found[0]  # T* with every stage admitted: no level does better than this plus its own value
    best = (unconstrained + top, found[1], eff)  # (total, t_max, eff) of the best level so far
    for _, level in levels[:-1]:  # Per-step terms: plans whose stages' terms are all <= level, plus level.
        if prune and level + unconstrained >= best[0]:  # and so does every larger level
            break
        capped = np.where(step[None] <= level, eff, np.inf)
        found, runs = _best_t_max(capped, sizes, num_devices, placement, batches, epsilon, prune,
                                  bound=best[0] - level if prune else math.inf, weight=weight)
        evaluated += runs
        if found is not None and found[0] + level < best[0]:
            best = (found[0] + level, found[1], capped)
    return best, evaluated


def _best_t_max(eff: np.ndarray, sizes: np.ndarray, num_devices: int, placement: AlignedLayouts | None,
                batches: int, epsilon: float, prune: bool,
                bound: float = math.inf, weight: float = 1.0) -> tuple[tuple[float, float] | None, int]:
    """Eq. 3.4 over the t_max candidates of ``eff`` (Alg. 2 lines 27-30, searched by :func:`_search`):
    ``((T*, t_max), runs)``, or ``(None, runs)`` when no plan exists or none costs less than ``bound`` (a
    plan whose slowest stage takes ``t`` costs at least ``B t``); ``runs`` = DP runs spent. ``weight`` is the
    schedule's :attr:`~alpa_like.compiler.schedules.ScheduleName.bubble_weight` ``c``: the objective is
    ``c F + (B - c) t_max`` (Eq. 3.4 for ``c = 1``)."""
    def total(t_max: float) -> float:
        finals = float(_best_finals(eff, t_max, sizes, num_devices, placement)[0].min())
        return weight * finals + (batches - weight) * t_max

    below = bound / batches + epsilon  # every group starting below bound / B holds only values below this
    groups = [g for g in _t_max_groups(_stage_time_candidates(eff, placement, below), epsilon)
              if batches * g[0] < bound]
    solved: dict[int, float] = {}

    def solve(g: int) -> float:
        if g not in solved:
            solved[g] = total(groups[g][1])
        return solved[g]

    if not prune or len(groups) < _BISECTED_GROUPS:
        if not groups or not math.isfinite(solve(len(groups) - 1)):
            return None, len(solved)
        best_g = _search(groups, solve, batches, weight) if prune else min(range(len(groups)), key=solve)
        return (solve(best_g), groups[best_g][1]), len(solved)
    # The first group with a plan: the least slowest stage over all plans, one bottleneck DP run.
    least = _least_t_max(eff, sizes, num_devices, placement, groups[-1][1])
    first = int(np.searchsorted([hi for _, hi in groups], least, side="left"))
    if first == len(groups):
        return None, 1
    best_g = _search(groups, solve, batches, weight, first_feasible=first)
    return (solve(best_g), groups[best_g][1]), len(solved) + 1


_BISECTED_GROUPS = 4
"""From this many t_max groups on, :func:`_best_t_max` finds the first feasible one with one bottleneck DP run
(:func:`_least_t_max`) instead of bisecting (two or more DP runs)."""


def aligned_plans_only(costs: StageCosts, cluster_shape: tuple[int, int]) -> bool:
    """Whether the DP considers aligned contiguous plans only: when meshes can share a NIC (``nic_wait``
    given, 3 nodes or more, a submesh smaller than a node; see "Shared NICs" in the module docstring)."""
    n_nodes, per_node = int_pair(cluster_shape, "cluster_shape")
    placement = AlignedLayouts.of(costs, n_nodes * per_node, per_node)
    return placement is not None and placement.nic is not None


# ---------------------------------------------------------------------------------------------------
# Stage boundaries inside a node.
# ---------------------------------------------------------------------------------------------------


def _stage_time_candidates(eff: np.ndarray, placement: AlignedLayouts | None, below: float = math.inf) -> np.ndarray:
    """The distinct finite stage times a plan can have, those below ``below`` at least (some above may be
    left out): the t_max candidates of Alg. 2 line 27. Placed, a side of a stage is inside a node (its
    saving off), or crosses nodes through 0, 1 or 2 shared NICs (its ``nic_wait`` on, 0-2 times). Read one
    level ``s`` of ``eff`` at a time, each distinct level once (levels differ only where memory binds)."""
    levels = [q for q in range(len(eff)) if q == 0 or not np.array_equal(eff[q], eff[q - 1])]
    return np.unique(np.concatenate([_level_time_candidates(eff[q], placement, below) for q in levels]))


def _level_time_candidates(eff: np.ndarray, placement: AlignedLayouts | None, below: float) -> np.ndarray:
    """:func:`_stage_time_candidates` of one level ``eff[s - 1]`` (``[k, i, p]``): entries whose times with
    both savings off are not below ``below`` give no time below it and are skipped."""
    cut = 0.0 if placement is None else placement.saving.sum(axis=-1)
    finite = np.isfinite(eff) & (eff - cut < below)
    times = eff[finite]
    if placement is None:
        return np.unique(times)

    def at_finite(table: np.ndarray) -> np.ndarray:  # [k, i, p] -> its entries where eff is finite
        return np.broadcast_to(table, eff.shape)[finite]

    per_side = []
    for side in (0, 1):
        options = [(0.0, 0.0), (at_finite(placement.saving[..., side]), 0.0)]  # (cut, added)
        if placement.nic is not None:
            wait = at_finite(placement.nic[..., side])
            options += [(0.0, wait), (0.0, 2 * wait)]
        per_side.append(options)
    return np.unique(np.concatenate([np.maximum(times - cut0 - cut1, 0.0) + add0 + add1
                                     for (cut0, add0), (cut1, add1) in itertools.product(*per_side)]))


def _step_costs(costs: StageCosts) -> np.ndarray | None:
    """``[k, i, p]``: :attr:`StageCosts.step_seconds` with inf where ``i < k``; None when there are none."""
    if costs.step_seconds is None or not costs.step_seconds.any():
        return None
    k = costs.num_layers
    upper = (np.arange(k)[:, None] <= np.arange(k)[None, :])[:, :, None]
    return np.where(upper, costs.step_seconds, np.inf)


def _best_finals(eff: np.ndarray, t_max: float, sizes: np.ndarray, num_devices: int,
                 placement: AlignedLayouts | None, track: bool = False) -> tuple[np.ndarray, list, bool]:
    """``(finals, choices, placed)`` at ``t_max`` (Eq. 3.3) of the better table: every plan priced with
    boundaries across nodes (``placed = False``), or the aligned plans priced for their layout (preferred on
    ties). When NICs can be shared (``placement.nic``), only the aligned plans."""
    if placement is None:
        return (*_dp(np.where(eff <= t_max, eff, np.inf), sizes, num_devices, np.add, track), False)
    placed = (*_placed_dp(eff, sizes, num_devices, placement, t_max, track), True)
    if placement.nic is not None:
        return placed
    plain = (*_dp(np.where(eff <= t_max, eff, np.inf), sizes, num_devices, np.add, track), False)
    return placed if placed[0].min() <= plain[0].min() else plain


def _least_t_max(eff: np.ndarray, sizes: np.ndarray, num_devices: int, placement: AlignedLayouts | None,
                 most: float = math.inf) -> float:
    """The least ``t_max <= most`` at which :func:`_best_finals` has a plan (inf if none): Eq. 3.3 with ``max``
    in place of ``+`` over the same tables, each stage's time the one the DP compares with ``t_max`` (for the
    aligned plans, with what it waits for its neighbours' shared NICs), stages slower than ``most`` left out
    (as the DP at ``most`` leaves them out). :func:`_best_finals` is finite at ``t_max <= most`` exactly when
    this is at most ``t_max``."""
    least = math.inf
    if placement is not None:
        least = float(_placed_dp(eff, sizes, num_devices, placement, most, combine=np.maximum)[0].min())
    if placement is None or placement.nic is None:
        least = min(least, float(_dp(np.where(eff <= most, eff, np.inf), sizes, num_devices, np.maximum)[0].min()))
    return least


# ---------------------------------------------------------------------------------------------------
# The DP.
# ---------------------------------------------------------------------------------------------------


def micro_batches_in_flight(schedule: ScheduleName | str, max_stages: int, batches: int) -> np.ndarray:
    """Micro-batches of activations held by the ``s``-th stage from the end, ``s = 1..max_stages`` (Eq. 3.5's
    multiplier of ``mem_act``). A zero-bubble schedule's stages all hold what a ``max_stages``-deep pipeline
    sets (exact for a pipeline of ``max_stages`` stages, more than a shallower one holds)."""
    schedule = schedule_name(schedule)
    if schedule.splits_backward:
        return np.full(max_stages, _zero_bubble_held(schedule, max_stages, batches))
    s = np.arange(1, max_stages + 1)
    return np.full(max_stages, batches) if schedule.holds_every_micro_batch else np.minimum(s, batches)


def _effective_costs(costs: StageCosts, in_flight: np.ndarray,
                     device_memory: float) -> tuple[np.ndarray, np.ndarray]:
    """``t_intra((k..i), p, s)`` of Eq. 3.3: the fastest logical view that fits (Eq. 3.5), and its index.

    Returns ``eff[s - 1, k, i, p]`` (inf if ``i < k`` or no view fits) and ``view[s - 1, k, i, p]``.
    """
    k = costs.num_layers
    upper = (np.arange(k)[:, None] <= np.arange(k)[None, :])[:, :, None, None]
    t = np.where(upper, costs.t_intra, np.inf)
    eff = np.empty((len(in_flight),) + t.shape[:3])
    view = np.empty(eff.shape, dtype=np.int16)
    done: dict[int, int] = {}
    for q, held in enumerate(in_flight.tolist()):
        if held in done:  # 1F1B saturates at B; GPipe is constant.
            eff[q], view[q] = eff[done[held]], view[done[held]]
            continue
        fits = costs.mem_stage + held * costs.mem_act <= device_memory
        masked = np.where(fits, t, np.inf)
        view[q] = masked.argmin(axis=-1)
        eff[q] = np.take_along_axis(masked, view[q][..., None].astype(np.intp), axis=-1)[..., 0]
        done[held] = q
    return eff, view


def _dp(cost: np.ndarray, sizes: np.ndarray, num_devices: int, combine: np.ufunc,
        track: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """Eq. 3.3 over all numbers of stages, with ``combine = np.add`` (sum) or ``np.maximum`` (bottleneck).

    ``cost[s - 1, k, i, p]`` is the cost of layers ``k..i`` on submesh ``p`` as the ``s``-th stage from the
    end. Returns ``finals[s] = F(s, 0, num_devices)`` for ``s = 0..S`` and, if ``track``, per ``s`` the
    minimising ``(i, p)`` as ``i * P + p`` for every ``(k, d)`` (-1 where ``F`` is infinite).

    NOTE: the ``s`` stages that remain need at least ``s`` layers, so level ``s`` only has first and last
    layers ``k, i <= K - s``. For each ``k`` the minimum over ``(i, p)`` is one ``(candidates, devices)``
    reduction over the finite ``cost[s - 1, k, k:, :]`` entries only; small 2-D blocks stay in cache and
    run several times faster than one 4-D broadcast over ``(k, i, p, d)``.
    """
    num_stages, k_layers, _, num_meshes = cost.shape
    width = num_devices + 1
    prev = np.full((k_layers + 1, width), np.inf)
    prev[k_layers, 0] = 0.0  # F(0, K, 0) = 0: no layers left, no devices left.
    finals = np.full(num_stages + 1, np.inf)
    choices = []
    for s in range(1, num_stages + 1):
        top = k_layers - s + 1  # k and i range over 0..K-s.
        shifted = np.full((top, num_meshes, width), np.inf)  # shifted[i, p, d] = F(s-1, i+1, d - size_p)
        for p, size in enumerate(sizes.tolist()):
            shifted[:, p, size:] = prev[1:top + 1, :width - size]
        shifted = shifted.reshape(top * num_meshes, width)
        level = cost[s - 1, :top, :top, :].reshape(top, top * num_meshes)
        current = np.full_like(prev, np.inf)
        best = np.full((top, width), -1, dtype=np.int64) if track else None
        for k in range(top):
            rows = np.flatnonzero(np.isfinite(level[k, k * num_meshes:])) + k * num_meshes
            if rows.size == 0:
                continue
            candidates = combine(level[k, rows][:, None], shifted[rows])
            if track:
                arg = candidates.argmin(axis=0)
                current[k] = candidates[arg, np.arange(width)]
                best[k] = np.where(np.isfinite(current[k]), rows[arg], -1)
            else:
                current[k] = candidates.min(axis=0)
        choices.append(best)
        finals[s] = current[0, num_devices]
        prev = current
        if not np.isfinite(prev).any():
            break
    return finals, choices


def _placed_dp(cost: np.ndarray, sizes: np.ndarray, num_devices: int, placement: AlignedLayouts, t_max: float,
               track: bool = False, combine: np.ufunc = np.add) -> tuple[np.ndarray, list]:
    """Eq. 3.3 over the aligned contiguous layouts only, each stage priced for its layout
    (``price_placed_stages``) and cut at ``t_max`` after pricing; ``cost`` is ``eff`` (not yet cut).

    A stage's own savings and its own node's shared NIC depend on ``(p, d)`` (:meth:`AlignedLayouts.stage_seconds`).
    What it pays for a neighbour's shared node depends on the neighbours, so with shared NICs the table is
    split by two flags of the stages that remain: ``q`` = the node before their first stage is shared (the
    stage before was the last mesh of a shared node: the first stage waits its ``nic_wait[0]``), ``c`` = their
    first stage is the first mesh of a shared node (then the stage before, which ends at that node's
    boundary, waits its ``nic_wait[1]``). ``F_{q,c}(s, k, d)`` is the least total with the first stage of
    class ``c``; a stage takes the rest's ``q`` = whether it is itself the last mesh of a shared node, and
    the better of the rest's two classes. Without shared NICs there is one table (``q = c = 0``). Choices:
    per ``s`` an array ``[q, c, k, d]`` of ``(i * P + p) * 2 + (class of the rest)``. ``combine=np.maximum``
    (with ``t_max = inf``): the least slowest stage instead of the least total (:func:`_least_t_max`).
    """
    num_stages, k_layers, _, num_meshes = cost.shape
    width = num_devices + 1
    flags = 2 if placement.nic is not None else 1
    most_saved = placement.saving[:k_layers, :k_layers].sum(axis=-1)  # [k, i, p]: both sides inside a node
    prev = np.full((flags, flags, k_layers + 1, width), np.inf)
    prev[:, 0, k_layers, 0] = 0.0  # nothing left: of class 0
    finals = np.full(num_stages + 1, np.inf)
    choices = []
    columns = np.arange(width)
    for s in range(1, num_stages + 1):
        top = k_layers - s + 1
        shifted = np.full((flags, flags, top, num_meshes, width), np.inf)
        for p, size in enumerate(sizes.tolist()):
            shifted[..., p, size:] = prev[:, :, 1:top + 1, :width - size]
        shifted = shifted.reshape(flags, flags, top * num_meshes, width)
        level = cost[s - 1, :top, :top, :].reshape(top, top * num_meshes)
        # A stage costs at least its table time less both savings, wherever it starts: rows above t_max
        # even then are inf in every column, and leaving them out changes no minimum.
        fastest = (cost[s - 1, :top, :top, :] - most_saved[:top, :top]).reshape(top, top * num_meshes)
        # The stages after cannot follow (i, p) when every finite F(s - 1, i + 1, .) needs more than the devices
        # left beside p: the fewest devices of any finite entry, plus p's size, exceeds the cluster.
        reachable = np.isfinite(prev[:, :, 1:top + 1, :]).any(axis=(0, 1))
        fewest = np.where(reachable.any(axis=1), reachable.argmax(axis=1), width)
        fastest[:, (fewest[:, None] + sizes[None, :] > num_devices).reshape(-1)] = np.inf
        current = np.full_like(prev, np.inf)
        best = np.full((flags, flags, top, width), -1, dtype=np.int64) if track else None
        if not track:
            _placed_level(level, fastest, shifted, placement, t_max, current, combine)
        for k in range(top if track else 0):
            rows = np.flatnonzero(fastest[k, k * num_meshes:] <= t_max) + k * num_meshes
            if rows.size == 0:
                continue
            for (q, c), (values, code) in _placed_values(k, rows, level[k, rows], shifted, placement,
                                                         t_max, combine).items():
                arg = values.argmin(axis=0)
                current[q, c, k] = values[arg, columns]
                best[q, c, k] = np.where(np.isfinite(current[q, c, k]), code[arg, columns], -1)
        choices.append(best)
        finals[s] = current[0, :, 0, num_devices].min()
        prev = current
        if not np.isfinite(prev).any():
            break
    return finals, choices


_LEVEL_BLOCK = 1 << 20
"""Elements per temporary array of :func:`_placed_level` (its memory, not its result)."""


def _placed_values(k, rows: np.ndarray, seconds: np.ndarray, shifted: np.ndarray, placement: AlignedLayouts,
                   t_max: float, combine: np.ufunc = np.add, columns: np.ndarray | None = None
                   ) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """For each table ``(q, c)`` of :func:`_placed_dp`, ``[row, d]``: the total of stage ``(k..i, p)``
    (flat ``rows``, ``i * P + p``; ``k`` one first layer or one per row; ``seconds`` its ``eff``) starting
    with ``d`` devices left (``d`` in ``columns``; None: every ``d``), followed by the best rest, and the
    choice code of that total (``row * 2 +`` the class of the rest). Infinite where the stage exceeds
    ``t_max``, is misaligned, is not of class ``c``, or nothing can follow. ``combine``: how the stage's time
    and the rest's make the total (``np.add``), or ``np.maximum`` for the slowest stage."""
    num_meshes = placement.saving.shape[2]
    mesh = rows % num_meshes
    own = placement.stage_seconds(k, rows, seconds, columns)
    if placement.nic is None:
        values = combine(np.where(own <= t_max, own, np.inf), take(shifted[0, 0], rows, columns))
        return {(0, 0): (values, np.broadcast_to(rows[:, None] * 2, values.shape))}
    before, after = placement.extra(k, rows)
    last_shared = take(placement.last_shared, mesh, columns)
    rest = [np.where(last_shared, take(shifted[1, c], rows, columns), take(shifted[0, c], rows, columns))
            for c in (0, 1)]
    first_shared = take(placement.first_shared, mesh, columns)
    out = {}
    for q in (0, 1):
        seconds_q = own + q * before
        alone = combine(np.where(seconds_q <= t_max, seconds_q, np.inf), rest[0])
        paying = combine(np.where(seconds_q + after <= t_max, seconds_q + after, np.inf), rest[1])
        values = np.minimum(alone, paying)
        code = rows[:, None] * 2 + (paying < alone)
        for c in (0, 1):
            out[(q, c)] = (np.where(first_shared == c, values, np.inf), code)
    return out


def _placed_level(level: np.ndarray, fastest: np.ndarray, shifted: np.ndarray, placement: AlignedLayouts,
                  t_max: float, current: np.ndarray, combine: np.ufunc = np.add) -> None:
    """One level ``s`` of :func:`_placed_dp` without choices, every first layer ``k`` at once:
    ``current[q, c, k] = min over rows of`` :func:`_placed_values` (the same numbers as the loop over ``k``
    gives; a minimum does not depend on the order), in blocks of at most :data:`_LEVEL_BLOCK` elements."""
    top, flat = level.shape
    num_meshes = flat // top
    upper = np.arange(flat)[None, :] >= (np.arange(top) * num_meshes)[:, None]
    all_firsts, all_rows = np.nonzero(upper & (fastest <= t_max) & np.isfinite(fastest))  # by first layer
    for meshes, columns in placement.column_groups:  # each mesh only where its stages start aligned
        chosen = np.isin(all_rows % num_meshes, meshes)
        firsts, rows = all_firsts[chosen], all_rows[chosen]
        per_block = max(1, _LEVEL_BLOCK // max(1, columns.size))
        for start in range(0, firsts.size, per_block):
            ks, rs = firsts[start:start + per_block], rows[start:start + per_block]
            group_ks, starts = np.unique(ks, return_index=True)
            for (q, c), (values, _) in _placed_values(ks, rs, level[ks, rs], shifted, placement, t_max,
                                                      combine, columns).items():
                smallest = np.minimum.reduceat(values, starts, axis=0)
                table = current[q, c]
                table[np.ix_(group_ks, columns)] = np.minimum(table[np.ix_(group_ks, columns)], smallest)


def _t_max_groups(values: np.ndarray, epsilon: float) -> list[tuple[float, float]]:
    """Sorted distinct ``values`` cut into runs spanning less than ``epsilon``: ``(smallest, largest)``.

    Greedy from the smallest value: a run is every value in ``[v, v + epsilon)``, the next run starts at the
    first value after it. With ``epsilon = 0`` every value is its own run.
    """
    ends = np.maximum(np.searchsorted(values, values + epsilon, side="left"), np.arange(1, len(values) + 1))
    ends, sorted_values, groups, start = ends.tolist(), values.tolist(), [], 0
    while start < len(sorted_values):
        groups.append((sorted_values[start], sorted_values[ends[start] - 1]))
        start = ends[start]
    return groups


def _search(groups: list[tuple[float, float]], solve: Callable[[int], float], batches: int,
            weight: float = 1.0, first_feasible: int | None = None) -> int:
    """Index of the group with the least Eq. 3.4 value, solving as few groups as possible (exact).

    1. Bisection for the first feasible group (feasibility only grows with t_max), unless the caller knows it
       (``first_feasible``: :func:`_least_t_max`).
    2. Alg. 2's pruning: groups whose smallest value has ``B * t >= T*`` cannot help.
    3. For an interval ``a < b`` with ``b`` solved, every group ``g`` strictly between them has
       ``T*(g) = F(g) + (B - 1) t_g >= F(b) + (B - 1) t_{a+1}`` because ``F`` does not increase with t_max;
       if that bound is not below the best ``T*`` so far, none of them is solved, else the interval is
       split at its middle.

    Step 3 is ours (Alg. 2 scans every group up to the step-2 limit); it returns the same group as the full
    scan, up to ties between equal ``T*`` values. With a schedule's ``weight`` ``c`` (``T*(g) = c F(g) +
    (B - c) t_g``, :func:`_best_t_max`) every step holds as written with ``B - c`` for ``B - 1``, as
    ``c F >= c t`` keeps ``T* >= B t``.
    """
    lows = np.array([lo for lo, _ in groups])
    lo, hi = 0, len(groups) - 1  # Invariant: groups[hi] is feasible.
    if first_feasible is not None:
        lo = hi = first_feasible
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if math.isfinite(solve(mid)) else (mid + 1, hi)
    best_g = hi
    intervals = [(hi, len(groups) - 1)]  # (a, b): groups a+1..b are undecided.
    while intervals:
        a, b = intervals.pop()
        best = solve(best_g)
        b = min(b, int(np.searchsorted(lows, best / batches, side="left")) - 1)  # Step 2: B * t < T*.
        if b <= a:
            continue
        if solve(b) < best:
            best_g, best = b, solve(b)
        f_b = solve(b) - (batches - weight) * groups[b][1]
        if b - a <= 1 or f_b + (batches - weight) * groups[a + 1][1] >= best:  # Step 3.
            continue
        mid = (a + b) // 2
        intervals += [(mid, b), (a, mid)]  # Lower half first.
    return best_g


def _reconstruct(costs: StageCosts, eff: np.ndarray, view: np.ndarray, t_max: float, num_devices: int,
                 in_flight: np.ndarray, placement: AlignedLayouts | None) -> tuple[StageChoice, ...]:
    """Re-runs the DP at ``t_max`` with argmins and walks them from ``(S, 0, N * M)`` to ``(0, K, 0)``
    (with the flags of the table that won, :func:`_best_finals`). ``t_intra`` of the stages is the table's
    (not yet priced for placement)."""
    sizes = costs.sizes
    finals, choices, placed = _best_finals(eff, t_max, sizes, num_devices, placement, track=True)
    s = int(np.argmin(finals))  # Ties: fewer stages.
    first, devices, stages = 0, num_devices, []
    state = (0, 0)  # (q, c) of _placed_dp: the first stage starts on node 0, never a shared node.
    while s > 0:
        if placed:
            flat, rest_class = divmod(int(choices[s - 1][state + (first, devices)]), 2)
        else:
            flat = int(choices[s - 1][first, devices])
        last, p = divmod(flat, len(sizes))
        l = int(view[s - 1, first, last, p])
        stages.append(StageChoice(
            layers=(first, last), submesh_index=SubmeshIdx(p), submesh=costs.submeshes[p],
            logical_shape=costs.logical_shapes[p][l], view_index=l, variant=costs.variants[p][l],
            t_intra=float(eff[s - 1, first, last, p]),
            memory_per_device=float(costs.mem_stage[first, last, p, l]
                                    + in_flight[s - 1] * costs.mem_act[first, last, p, l]),
            step_seconds=costs.step_seconds_of(first, last, p)))
        if placed:
            state = (int(placement.nic is not None and placement.last_shared[p, devices]), rest_class)
        first, devices, s = last + 1, devices - int(sizes[p]), s - 1
    return tuple(stages)


# ---------------------------------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------------------------------


def _infeasible_error(costs: StageCosts, cluster_shape: tuple[int, int], in_flight: np.ndarray,
                      device_memory: float, schedule: ScheduleName, batches: int) -> ValueError:
    """Why no plan exists: structurally (no finite costs cover the cluster) or by how much memory.

    The shortfall is a bottleneck DP (Eq. 3.3 with ``max`` in place of ``+``) over the per-stage excess
    ``mem_stage + in_flight * mem_act - mem_device`` of the best-fitting logical view: the least, over all
    plans, of the largest excess of any of their stages. Adding that much memory per device makes a plan fit.
    """
    n_nodes, per_node = cluster_shape
    k = costs.num_layers
    upper = (np.arange(k)[:, None] <= np.arange(k)[None, :])[:, :, None, None]
    usable = upper & np.isfinite(costs.t_intra)
    excess = np.stack([np.where(usable, costs.mem_stage + held * costs.mem_act - device_memory, np.inf).min(-1)
                       for held in in_flight.tolist()])
    # F(0, K, 0) = 0 stands in for max's identity (-inf): harmless, as every plan's shortfall is > 0 here.
    finals, _ = _dp(excess, costs.sizes, n_nodes * per_node, np.maximum)
    missing = float(finals.min())
    if not math.isfinite(missing):
        return ValueError(
            f"no pipeline plan with finite t_intra covers all {n_nodes * per_node} devices of the {n_nodes} x "
            f"{per_node} cluster with {k} layers: each stage needs at least one layer and its own submesh, "
            f"and the submeshes must sum to {n_nodes * per_node} devices; submeshes with costs: "
            f"{list(costs.submeshes)}")
    hint = "" if not schedule.holds_every_micro_batch else ", or the 1F1B schedule (fewer activations in flight)"
    return ValueError(
        f"no pipeline plan fits in {device_memory / _GIB:.4g} GiB per device ({schedule}, {batches} "
        f"micro-batches, {n_nodes} x {per_node} devices): the closest plan still needs "
        f"{missing / _GIB:.3g} GiB more per device ({missing:.0f} bytes). Try more devices, more "
        f"micro-batches (smaller micro-batches hold fewer activations), rematerialization (remat) of the "
        f"layers{hint}")


# ---------------------------------------------------------------------------------------------------
# Argument checks.
# ---------------------------------------------------------------------------------------------------


def _check_inputs(costs: StageCosts, cluster_shape: tuple[int, int], device_memory: float,
                  epsilon: float) -> None:
    if not isinstance(costs, StageCosts):
        raise TypeError(f"costs must be a StageCosts, got {type(costs).__name__}")
    allowed = submesh_shapes(*cluster_shape)
    bad = [s for s in costs.submeshes if s not in allowed]
    if bad:
        raise ValueError(f"submeshes {bad} are not submesh shapes of the {cluster_shape[0]} x "
                         f"{cluster_shape[1]} cluster; valid shapes: {list(allowed)}")
    if not _is_number(device_memory) or not device_memory > 0:
        raise ValueError(f"device_memory must be a number of bytes > 0, got {device_memory!r}")
    if not _is_number(epsilon) or not math.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be a finite number of seconds >= 0, got {epsilon!r}")


def _check_positive_int(value: object, name: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
