"""One protocol for timing several programs against each other on a shared, noisy machine.

Used by ``ShardParallel``'s measured plan selection and by ``examples/benchmarks/ilp.py``: every program
is run ``warmup`` times first (compilation caches, allocator), then ``rounds`` rounds each run every
program once, in a freshly shuffled (seeded) order, with Python's garbage collector paused during a round.
Shuffling spreads a change of machine load over all programs instead of biasing whichever always ran at
that moment (a fixed rotation showed identical programs up to 45% apart under load); the median of each
program's rounds is its time.

Example::

    >>> import time
    >>> t = time_interleaved({"a": lambda: time.sleep(0.001), "b": lambda: None}, rounds=3)
    >>> sorted(t.medians()) == ["a", "b"] and len(t.wall["a"]) == 3
    True
"""
from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds of every timed run, per program, in the order the rounds ran."""

    wall: Mapping[Hashable, tuple[float, ...]]
    """Wall-clock seconds (``time.perf_counter``)."""
    cpu: Mapping[Hashable, tuple[float, ...]]
    """This process's CPU seconds over the same runs (``time.process_time``), which other jobs on a shared
    machine do not inflate."""

    def medians(self) -> dict[Hashable, float]:
        """Median wall seconds per program."""
        return {k: statistics.median(v) for k, v in self.wall.items()}

    def cpu_medians(self) -> dict[Hashable, float]:
        """Median CPU seconds per program."""
        return {k: statistics.median(v) for k, v in self.cpu.items()}


def time_interleaved(runs: Mapping[Hashable, Callable[[], Any]], *, rounds: int, warmup: int = 1,
                     seed: int = 0) -> Timings:
    """Times every ``runs[k]()`` (one call must block until its work is done, e.g. end with
    ``jax.block_until_ready``) in ``rounds`` shuffled rounds after ``warmup`` untimed calls each.

    Raises:
      ValueError: ``runs`` is empty, ``rounds`` is not an int >= 1 or ``warmup`` not an int >= 0.
    """
    if not runs:
        raise ValueError("runs must name at least one program to time")
    for name, value, low in (("rounds", rounds, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    for run in runs.values():
        for _ in range(warmup):
            run()
    order, rng = list(runs), random.Random(seed)
    wall: dict[Hashable, list[float]] = {k: [] for k in runs}
    cpu: dict[Hashable, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        rng.shuffle(order)
        gc.collect()
        gc.disable()
        try:
            for k in order:
                start, cpu_start = time.perf_counter(), time.process_time()
                runs[k]()
                wall[k].append(time.perf_counter() - start)
                cpu[k].append(time.process_time() - cpu_start)
        finally:
            gc.enable()
    return Timings(wall={k: tuple(v) for k, v in wall.items()}, cpu={k: tuple(v) for k, v in cpu.items()})
