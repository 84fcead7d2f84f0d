"""The schedule generators: GPipe, 1F1B, interleaved 1F1B, breadth-first, TeraPipe and the zero-bubble
ZB-H1 / ZB-H2, each building a :class:`~alpa_like.compiler.schedules.Schedule` table, and
:func:`make_schedule`, which builds one by name (:class:`~alpa_like.compiler.schedules.ScheduleName`).

>>> print(one_f_one_b(num_meshes=2, num_micro_batches=2).table())
tick  mesh0  mesh1
   0  0F0    .
   1  0F1    1F0
   2  .      1B0
   3  0B0    1F1
   4  .      1B1
   5  0B1    .
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from alpa_like.compiler.indices import MeshIdx, MicroBatchIdx, StageIdx
from alpa_like.compiler.schedules import (Phase, Schedule, ScheduleName, SliceCounts, Task, _is_int, _slice_counts,
                                          _slice_ids, backward, dependencies, forward, schedule_name,
                                          ticks_from_orders, weight_gradient)

def _check_count(arg: str, value: object) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{arg} must be a positive int (1, 2, 3, ...), got {value!r}")


def _looping(name: str, num_meshes: int, num_micro_batches: int, virtual_stages: int,
             orders: Sequence[Sequence[Task]]) -> Schedule:
    """The schedule with stage ``s`` on mesh ``s mod p`` and the given per-mesh orders (validated)."""
    num_stages = num_meshes * virtual_stages
    return Schedule(name=str(name), num_meshes=num_meshes, num_stages=num_stages,
                    num_micro_batches=num_micro_batches,
                    stage_to_mesh=tuple(MeshIdx(s % num_meshes) for s in range(num_stages)),
                    ticks=ticks_from_orders(orders, num_stages))


def _breadth_first_orders(p: int, m: int, v: int) -> list[list[Task]]:
    """Mesh ``i``: the forwards of its stages ``i, i+p, ...`` in turn, each on micro-batches ``0..m-1``;
    then the backwards of its stages in reverse, each on micro-batches ``0..m-1``."""
    return [[forward(c * p + i, k) for c in range(v) for k in range(m)]
            + [backward(c * p + i, k) for c in reversed(range(v)) for k in range(m)]
            for i in range(p)]


def _depth_first_orders(p: int, m: int, v: int, warmup: Callable[[int], int]) -> list[list[Task]]:
    """Mesh ``i``: ``warmup(i)`` forwards, then one forward and one backward in turn, then the remaining
    backwards. The ``j``-th forward runs local chunk ``(j // p) mod v`` on micro-batch
    ``(j // (p v)) p + j mod p`` (micro-batches in groups of ``p``, Megatron-LM 2.2.2); the ``j``-th
    backward runs chunk ``v - 1 - (j // p) mod v`` on the same micro-batch."""
    n = m * v

    def task(i: int, j: int, phase: Phase) -> Task:
        chunk = (j // p) % v
        if phase == Phase.B:
            chunk = v - 1 - chunk
        micro_batch = (j // (p * v)) * p + j % p
        return Task(StageIdx(chunk * p + i), MicroBatchIdx(micro_batch), phase)

    orders = []
    for i in range(p):
        w = min(warmup(i), n)
        order = [task(i, j, Phase.F) for j in range(w)]
        for j in range(n - w):
            order += [task(i, w + j, Phase.F), task(i, j, Phase.B)]
        order += [task(i, j, Phase.B) for j in range(n - w, n)]
        orders.append(order)
    return orders


def gpipe(num_meshes: int, num_micro_batches: int) -> Schedule:
    r"""GPipe: every mesh runs all forwards, then all backwards (Megatron-LM 2.2.1, Fig. 3).

    .. math::
       \frac{t_{pb}}{t_{id}} = \frac{(p-1)(t_f + t_b)}{m (t_f + t_b)} = \frac{p-1}{m},
       \qquad \text{in flight} = m \text{ on every mesh}.
    """
    _check_count("num_meshes", num_meshes)
    _check_count("num_micro_batches", num_micro_batches)
    return _looping(ScheduleName.GPIPE, num_meshes, num_micro_batches, 1,
                    _breadth_first_orders(num_meshes, num_micro_batches, 1))


def one_f_one_b(num_meshes: int, num_micro_batches: int) -> Schedule:
    r"""Synchronous 1F1B (PipeDream-Flush; Megatron-LM 2.2.1, Fig. 4 top): mesh ``i`` runs
    :math:`\min(p-1-i, m)` warm-up forwards, then one forward and one backward in turn, then the remaining
    backwards (cool-down). Same bubble as GPipe, fewer activations:

    .. math::
       \frac{t_{pb}}{t_{id}} = \frac{p-1}{m}, \qquad \text{in flight on mesh } i = \min(p - i, m) \le p.
    """
    _check_count("num_meshes", num_meshes)
    _check_count("num_micro_batches", num_micro_batches)
    p = num_meshes
    return _looping(ScheduleName.ONE_F_ONE_B, p, num_micro_batches, 1,
                    _depth_first_orders(p, num_micro_batches, 1, lambda i: p - 1 - i))


def interleaved_one_f_one_b(num_meshes: int, num_micro_batches: int, virtual_stages: int) -> Schedule:
    r"""Interleaved 1F1B (Megatron-LM 2.2.2, Fig. 4 bottom; BFPP's "depth-first" looping pipeline): stage
    ``s`` on mesh ``s mod p``, micro-batches in groups of ``p`` go through each local chunk in turn.
    Mesh ``i`` runs :math:`w_i = \min((v-1)p + 2(p-1-i),\ m v)` warm-up forwards (Megatron-LM's code;
    not in the seed), then 1F1B, then the cool-down backwards; ``v = 1`` is :func:`one_f_one_b` (warm-up
    :math:`p-1-i`), as in Megatron-LM. With per-stage times :math:`t_f/v, t_b/v`:

    .. math::
       t_{pb}^{int.} = \frac{(p-1)(t_f+t_b)}{v}, \qquad
       \frac{t_{pb}^{int.}}{t_{id}} = \frac{1}{v}\,\frac{p-1}{m}, \qquad
       \text{in flight on mesh } i = \min(w_i + 1,\ m v) \text{ (stage, micro-batch) pairs}.

    Requires ``num_micro_batches`` to be a multiple of ``num_meshes`` (Megatron-LM 2.2.2).

    NOTE: without transfer time, the smaller warm-up :math:`(v-1)p + (p-1-i)` gives the same bubble with
    fewer activations; the extra :math:`p-1-i` forwards are slack that absorbs transfer latency (with a
    latency of 1/4 of a forward, ``p=4, m=8, v=2`` takes 60.5 instead of 64.5 forward-times; 57 without).
    """
    _check_count("num_meshes", num_meshes)
    _check_count("num_micro_batches", num_micro_batches)
    _check_count("virtual_stages", virtual_stages)
    p, m, v = num_meshes, num_micro_batches, virtual_stages
    if m % p:
        raise ValueError(f"interleaved_1f1b needs num_micro_batches divisible by num_meshes (Megatron-LM "
                         f"2.2.2): got num_micro_batches={m}, num_meshes={p}; valid num_micro_batches are "
                         f"{p}, {2 * p}, {3 * p}, ... (breadth_first accepts any)")
    extra = 2 if v > 1 else 1
    return _looping(ScheduleName.INTERLEAVED_1F1B, p, m, v,
                    _depth_first_orders(p, m, v, lambda i: (v - 1) * p + extra * (p - 1 - i)))


def breadth_first(num_meshes: int, num_micro_batches: int, virtual_stages: int) -> Schedule:
    r"""Breadth-first looping pipeline (BFPP 4.1, seed 004): stage ``s`` on mesh ``s mod p``; a mesh runs
    the forward of each of its stages on all micro-batches before the next stage, then the backwards in
    reverse stage order. Any ``num_micro_batches``; ``virtual_stages = 1`` is GPipe.

    .. math::
       \frac{t_{pb}}{t_{id}} = \frac{p - 1 + (v-1)\max(0,\ p-m)}{v\,m}
       \quad\Big(= \frac{p-1}{v\,m} \text{ (BFPP Eq. 9) for } m \ge p\Big),
       \qquad \text{in flight} = m v \text{ pairs on every mesh}.

    With per-stage times :math:`t_f/v, t_b/v` the step takes :math:`T = (vm + p - 1)(t_f + t_b)/v` for
    :math:`m \ge p`. For :math:`m < p`, mesh 0 finishes a loop's ``m`` forwards before micro-batch 0
    comes back from mesh ``p-1`` (``p`` stage times after it left), so each of the ``v-1`` loop-backs
    idles :math:`p - m` stage times (forward and backward alike): the pipeline is a plain
    :math:`pv`-stage GPipe, :math:`T = (pv + m - 1)(t_f + t_b)/v`.
    """
    _check_count("num_meshes", num_meshes)
    _check_count("num_micro_batches", num_micro_batches)
    _check_count("virtual_stages", virtual_stages)
    return _looping(ScheduleName.BREADTH_FIRST, num_meshes, num_micro_batches, virtual_stages,
                    _breadth_first_orders(num_meshes, num_micro_batches, virtual_stages))


def terapipe(num_meshes: int, num_micro_batches: int, num_slices: SliceCounts) -> Schedule:
    r"""TeraPipe (seed 000, Fig. 2.1): GPipe over (micro-batch, token slice) units. Every mesh runs the
    forwards of ``0.0, 0.1, ..., 0.(n-1), 1.0, ...`` in sequence order, then the backwards in reverse
    (so each slice's key/value gradients reach the earlier slices of its sequence). With equal unit times
    it is GPipe with :math:`m n` micro-batches: :math:`t_{pb}/t_{id} = (p-1)/(m n)`. ``num_slices`` may
    give each micro-batch (batch slice, section 2.3.4) its own count; the TeraPipe runtime runs this
    schedule's grid tick by tick.

    >>> print(terapipe(2, 1, 2).table())
    tick  mesh0  mesh1
       0  0F0.0  .
       1  0F0.1  1F0.0
       2  .      1F0.1
       3  .      1B0.1
       4  0B0.1  1B0.0
       5  0B0.0  .
    """
    _check_count("num_meshes", num_meshes)
    _check_count("num_micro_batches", num_micro_batches)
    num_slices = _slice_counts(num_slices, num_micro_batches)
    units = [(k, i) for k in range(num_micro_batches) for i in _slice_ids(num_slices, k)]
    orders = [[Task(StageIdx(q), MicroBatchIdx(k), Phase.F, i) for k, i in units]
              + [Task(StageIdx(q), MicroBatchIdx(k), Phase.B, i) for k, i in reversed(units)]
              for q in range(num_meshes)]
    return Schedule(name=str(ScheduleName.TERAPIPE), num_meshes=num_meshes, num_stages=num_meshes,
                    num_micro_batches=num_micro_batches,
                    stage_to_mesh=tuple(MeshIdx(q) for q in range(num_meshes)),
                    ticks=ticks_from_orders(orders, num_meshes, num_slices), num_slices=num_slices)


def _check_zero_bubble(name: str, num_meshes: int, num_micro_batches: int) -> None:
    _check_count("num_meshes", num_meshes)
    _check_count("num_micro_batches", num_micro_batches)
    if num_micro_batches < num_meshes:
        raise ValueError(f"{name} needs num_micro_batches >= num_meshes (the zero-bubble paper's setting): got "
                         f"num_micro_batches={num_micro_batches}, num_meshes={num_meshes}")


def _one_stage_per_mesh(name: str, num_meshes: int, num_micro_batches: int,
                        orders: Sequence[Sequence[Task]]) -> Schedule:
    return _looping(name, num_meshes, num_micro_batches, 1, orders)


def zb_h1(num_meshes: int, num_micro_batches: int) -> Schedule:
    r"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.2 and Fig. 3 top): each
    backward runs as ``B`` (input gradient, on the critical path) and ``W`` (weight gradients, which wait).
    Mesh ``i`` runs 1F1B's :math:`p - i` forwards, then ``B``, ``W``, ``F`` in turn, its ``W`` lagging its
    ``B`` by ``i`` micro-batches (none on the first mesh); the ``i`` late ``W`` fill the cool-down.

    The paper's Table 1, checked here on the built tables by the simulator (``tests/compiler/
    test_schedules.py``) for :math:`m \ge p`, with per-mesh bubble = step time minus busy time:

    .. math::
       \text{bubble} = (p-1)(T_F + T_B - T_W) \quad (\text{1F1B: } (p-1)(T_F + T_B + T_W)),
       \qquad \text{in flight on every mesh} = p \text{ (1F1B's peak, on its first stage)},

    counting a micro-batch in flight from its ``F`` to its ``W`` (a deferred ``W`` holds it whole); the
    bubble formula holds for :math:`T_W \le T_F, T_B`, equal times included.

    >>> print(zb_h1(2, 2).table())
    tick  mesh0  mesh1
       0  0F0    .
       1  0F1    1F0
       2  .      1B0
       3  0B0    1F1
       4  0W0    1B1
       5  0B1    1W0
       6  0W1    1W1
    """
    _check_zero_bubble(ScheduleName.ZB_H1, num_meshes, num_micro_batches)
    p, m = num_meshes, num_micro_batches
    orders = []
    for i in range(p):
        order = [forward(i, k) for k in range(p - i)]
        for j in range(m):
            order.append(backward(i, j))
            if j >= i:
                order.append(weight_gradient(i, j - i))
            if p - i + j < m:
                order.append(forward(i, p - i + j))
        orders.append(order + [weight_gradient(i, k) for k in range(m - i, m)])
    return _one_stage_per_mesh(ScheduleName.ZB_H1, p, m, orders)


def zb_h2(num_meshes: int, num_micro_batches: int) -> Schedule:
    r"""ZB-H2 (Qi et al., ICLR 2024, section 2.2 and Fig. 3 bottom): more warm-up forwards (``2p - 1`` on
    the first mesh) fill the wait for the first ``B``, and late ``W`` fill the cool-down, so every mesh is
    busy without a break from its first task to its last: the paper's "parallelogram". Built on unit ticks
    by one rule: each mesh runs the first of its next ``B`` if ready, its next ``F`` if ready and fewer than
    ``2p - 1`` micro-batches are in flight (``F`` run, ``W`` not), its oldest pending ``W``.

    The paper's Table 1, checked on the built tables by the simulator for :math:`m \ge 2p - 1` and
    :math:`T_W \le T_F, T_B`:

    .. math::
       \text{bubble within the first mesh} = (p-1)(T_F + T_B - 2 T_W)
       \quad (0 \text{ on every mesh when } T_F = T_B = T_W),
       \qquad \text{in flight on every mesh} = \min(2p - 1, m).

    The bubble the paper counts is each mesh's idle time between its own first and last task
    (:meth:`Timeline.idle_within`): zero only when consecutive steps overlap (the paper's
    post-validation replaces the optimizer step's synchronisation). A step that ends together on every
    mesh still waits :math:`(p-1) T_F` for the pipeline to fill, as long as ZB-H1's with equal times.
    """
    _check_zero_bubble(ScheduleName.ZB_H2, num_meshes, num_micro_batches)
    p, m = num_meshes, num_micro_batches
    cap = 2 * p - 1
    done: dict[Task, int] = {}
    counts = [[0, 0, 0] for _ in range(p)]  # F, B, W run so far on each mesh
    orders: list[list[Task]] = [[] for _ in range(p)]
    tick = 0
    while any(c[2] < m for c in counts):
        ran = []
        for i, (n_f, n_b, n_w) in enumerate(counts):
            def ready(task: Task) -> bool:
                return all(done.get(d, tick) < tick for d in dependencies(task, p))
            if n_b < m and n_b < n_f and ready(backward(i, n_b)):
                task, slot = backward(i, n_b), 1
            elif n_f < m and n_f - n_w < cap and ready(forward(i, n_f)):
                task, slot = forward(i, n_f), 0
            elif n_w < n_b:
                task, slot = weight_gradient(i, n_w), 2
            else:
                continue
            counts[i][slot] += 1
            orders[i].append(task)
            ran.append(task)
        done.update((task, tick) for task in ran)
        tick += 1
    return _one_stage_per_mesh(ScheduleName.ZB_H2, p, m, orders)


_FLAT: dict[str, Callable[[int, int], Schedule]] = {
    ScheduleName.GPIPE: gpipe, ScheduleName.ONE_F_ONE_B: one_f_one_b,
    ScheduleName.ZB_H1: zb_h1, ScheduleName.ZB_H2: zb_h2}
_LOOPING: dict[str, Callable[[int, int, int], Schedule]] = {
    ScheduleName.INTERLEAVED_1F1B: interleaved_one_f_one_b, ScheduleName.BREADTH_FIRST: breadth_first}


def make_schedule(name: ScheduleName | str, num_meshes: int, num_micro_batches: int, virtual_stages: int = 1,
                  num_slices: SliceCounts = 1) -> Schedule:
    """Build the schedule called ``name`` (one of :class:`ScheduleName`); ``num_slices`` is for
    ``"terapipe"`` only.

    >>> make_schedule("breadth_first", 2, 4, virtual_stages=2).num_stages
    4
    """
    name = schedule_name(name)
    if name == ScheduleName.TERAPIPE:
        if virtual_stages != 1:
            raise ValueError(f"terapipe has one stage per mesh: virtual_stages must be 1, got {virtual_stages!r}")
        return terapipe(num_meshes, num_micro_batches, num_slices)
    if num_slices != 1:
        raise ValueError(f"num_slices={num_slices!r} needs the 'terapipe' schedule, got {name!r}")
    if name in _FLAT:
        if virtual_stages != 1:
            raise ValueError(f"{name} has one stage per mesh: virtual_stages must be 1, got {virtual_stages!r} "
                             f"(looping schedules: {sorted(map(str, _LOOPING))})")
        return _FLAT[name](num_meshes, num_micro_batches)
    return _LOOPING[name](num_meshes, num_micro_batches, virtual_stages)
