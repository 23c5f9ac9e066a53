"""Lingering telemetry intakes wake on a shared tick of the loop clock, so the pull
requests (and acks) of every partition go to the server in one write."""

from __future__ import annotations

import math

import pytest
from gpuops.intake.consumer import until_tick
from hypothesis import given
from hypothesis import strategies as st


@given(
    now=st.floats(0, 1e7, allow_nan=False),
    every=st.sampled_from([0.01, 0.05, 0.25, 1.0]),
)
def test_the_wait_ends_on_the_next_multiple_of_the_linger(now: float, every: float) -> None:
    wait = until_tick(now, every)
    assert 0 < wait <= every
    ticks = (now + wait) / every
    assert math.isclose(ticks, round(ticks), abs_tol=1e-6), (now, wait)


def test_intakes_that_linger_at_different_times_wake_together() -> None:
    every = 0.05
    wakes = {round(t + until_tick(t, every), 6) for t in (100.001, 100.013, 100.049)}
    assert wakes == {100.05}
    assert until_tick(100.051, every) == pytest.approx(0.049)  # just past: the next one
