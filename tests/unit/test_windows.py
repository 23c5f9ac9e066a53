"""Each temporal form against a brute-force reference, over random sequences and clock jumps."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.match.windows import Absent, CountWithin, HeldFor, Increase

# Gaps between samples: mostly small, sometimes a long jump (an outage, a clock step).
gaps = st.one_of(st.integers(0, 5), st.integers(0, 400)).map(float)
samples = st.lists(st.tuples(gaps, st.booleans()), min_size=1, max_size=60)


def _timeline(seq: list[tuple[float, bool]]) -> list[tuple[float, bool]]:
    t, out = 1000.0, []
    for gap, hit in seq:
        t += gap
        out.append((t, hit))
    return out


@settings(max_examples=300)
@given(samples, st.integers(0, 120).map(float), st.integers(1, 60).map(float))
def test_held_for_matches_reference(
    seq: list[tuple[float, bool]], duration: float, gap: float
) -> None:
    events = _timeline(seq)
    window = HeldFor(duration, gap)
    for i, (t, hit) in enumerate(events):
        fired = window.observe("k", t, hit)
        expected = False
        if hit:
            j = i
            while j > 0 and events[j - 1][1] and events[j][0] - events[j - 1][0] <= gap:
                j -= 1
            expected = t - events[j][0] >= duration
        assert fired == expected, (i, events[: i + 1])


@settings(max_examples=300)
@given(samples, st.integers(1, 6), st.integers(1, 200).map(float))
def test_count_within_matches_reference(
    seq: list[tuple[float, bool]], n: int, within: float
) -> None:
    events = _timeline(seq)
    window = CountWithin(n, within)
    for i, (t, hit) in enumerate(events):
        fired = window.observe("k", t, hit)
        in_window = sum(1 for tj, hj in events[: i + 1] if hj and t - within < tj <= t)
        assert fired == (hit and in_window >= n), (i, events[: i + 1])


@settings(max_examples=300)
@given(
    st.lists(st.tuples(gaps, st.booleans(), st.integers(0, 50)), min_size=1, max_size=60),
    st.integers(1, 60),
    st.integers(1, 300).map(float),
)
def test_increase_matches_reference(
    seq: list[tuple[float, bool, int]], by: int, within: float
) -> None:
    t, events = 1000.0, []
    for gap, hit, value in seq:
        t += gap
        events.append((t, hit, float(value)))
    window = Increase(float(by), within)
    for i, (t, hit, value) in enumerate(events):
        fired = window.observe("k", t, hit, value)
        hits = [(tj, vj) for tj, hj, vj in events[: i + 1] if hj]
        total = 0.0
        for (_, prev), (tj, vj) in itertools.pairwise(hits):
            if t - within < tj <= t:
                total += vj - prev if vj >= prev else vj  # a drop is a counter reset
        assert fired == (hit and len(hits) > 1 and total >= by), (i, events[: i + 1])


@settings(max_examples=300)
@given(
    st.lists(st.tuples(gaps, st.sampled_from(["event", "check"])), min_size=1, max_size=60),
    st.integers(1, 120).map(float),
)
def test_absent_matches_reference(ops: list[tuple[float, str]], after: float) -> None:
    window = Absent(after)
    window.seed("k", 1000.0)
    t, last, fired_since_last = 1000.0, 1000.0, False
    for gap, op in ops:
        t += gap
        if op == "event":
            window.observe("k", t, True)
            last, fired_since_last = t, False
            continue
        due = window.due(t)
        expected = t - last > after and not fired_since_last
        fired_since_last = fired_since_last or expected
        assert (due == ["k"]) == expected


def test_quiet_keys_are_evicted() -> None:
    window = HeldFor(60.0, 30.0)
    for node in range(1000):
        window.observe(f"n{node}", 0.0, True)
    assert len(window) == 1000
    assert window.sweep(100.0) == 1000
    assert len(window) == 0
