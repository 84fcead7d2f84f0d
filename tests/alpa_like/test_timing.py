"""The interleaved timing protocol: how often and in which order it runs each program (no timed assertions)."""
import doctest
import gc

import pytest

from alpa_like import timing
from alpa_like.timing import time_interleaved


def test_every_program_runs_warmup_plus_rounds_times_in_a_fresh_order_each_round():
    calls = []
    runs = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
    result = time_interleaved(runs, rounds=6, warmup=2, seed=1)
    assert calls[:10] == ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]  # warm-up, untimed
    rounds = [calls[10 + 5 * r:15 + 5 * r] for r in range(6)]
    assert all(sorted(r) == list("abcde") for r in rounds)  # each round runs every program once
    assert len({tuple(r) for r in rounds}) > 1  # shuffled: not the same order every round
    assert {k: len(v) for k, v in result.wall.items()} == {k: 6 for k in "abcde"}
    assert {k: len(v) for k, v in result.cpu.items()} == {k: 6 for k in "abcde"}
    assert all(t >= 0 for v in result.wall.values() for t in v)
    assert set(result.medians()) == set(result.cpu_medians()) == set("abcde")
    # The same seed gives the same orders.
    again = []
    time_interleaved({name: (lambda name=name: again.append(name)) for name in "abcde"}, rounds=6, warmup=2, seed=1)
    assert again == calls


def test_the_garbage_collector_is_paused_during_a_round_and_enabled_after_an_error():
    seen = []

    def fails():
        seen.append(gc.isenabled())
        if len(seen) > 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        time_interleaved({"x": fails}, rounds=2, warmup=1)
    assert seen == [True, False]  # the warm-up runs with GC on, the timed run with it paused
    assert gc.isenabled()


@pytest.mark.parametrize("kwargs, match", [
    ({"rounds": 0}, "rounds must be an int >= 1, got 0"),
    ({"rounds": 2.5}, "rounds must be an int >= 1, got 2.5"),
    ({"rounds": 2, "warmup": -1}, "warmup must be an int >= 0, got -1"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        time_interleaved({"a": lambda: None}, **kwargs)
    with pytest.raises(ValueError, match="runs must name at least one program"):
        time_interleaved({}, rounds=1)


def test_doctests():
    assert doctest.testmod(timing).failed == 0
