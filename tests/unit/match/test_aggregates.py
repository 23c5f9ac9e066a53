"""Window functions and group aggregates against a brute-force reference over the raw samples."""

from __future__ import annotations

import math

import pytest
from gpuops.match.aggregates import (
    BINS,
    BUCKETS,
    MIN_EXP,
    QUANTILES,
    Aggregate,
    Aggregates,
    Series,
    group_value,
)
from hypothesis import given, settings
from hypothesis import strategies as st

# Offsets between samples: mostly forward, sometimes a long jump, sometimes back (late).
steps = st.one_of(
    st.integers(0, 30), st.integers(0, 3000), st.integers(-400, 0), st.integers(-5000, 0)
).map(float)
values = st.one_of(
    st.integers(0, 100).map(float),
    st.floats(-1e3, 1e6, allow_nan=False, allow_infinity=False),
)


def _in_window(held: list[tuple[float, float]], width: float) -> list[float]:
    """The reference window: every sample whose bucket is one of the BUCKETS up to the head."""
    head = max(math.floor(s / width) for s, _ in held)
    return [v for s, v in held if head - BUCKETS < math.floor(s / width) <= head]


def _exact(fn: str, vals: list[float]) -> float:
    if fn == "count":
        return float(len(vals))
    if fn == "sum":
        return math.fsum(vals)
    if fn == "avg":
        return math.fsum(vals) / len(vals)
    if fn == "min":
        return min(vals)
    if fn == "max":
        return max(vals)
    ordered = sorted(vals)
    return ordered[math.ceil(QUANTILES[fn] * len(ordered)) - 1]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(steps, values), min_size=1, max_size=120),
    st.sampled_from([60.0, 600.0, 3600.0, 86400.0]),
)
def test_series_agrees_with_the_raw_samples(seq: list[tuple[float, float]], window: float) -> None:
    series = Series(window, quantiles=True)
    t, held, newest = 1_800_000_000.0, [], -math.inf
    everything: list[float] = []
    for step, value in seq:
        t += step
        series.add(t, value)
        everything.append(value)
        newest = max(newest, math.floor(t / series.width))
        # A sample older than the window that ends at the head bucket is dropped at once.
        if math.floor(t / series.width) > newest - BUCKETS:
            held.append((t, value))
        _agrees(series, held, everything)


def _agrees(series: Series, held: list[tuple[float, float]], everything: list[float]) -> None:
    """Every function of `series` against the samples in its window, within the bounds."""
    vals = _in_window(held, series.width)
    for fn in ("count", "sum", "avg", "min", "max"):
        got = series.value(fn)
        assert got is not None
        assert math.isclose(got, _exact(fn, vals), rel_tol=1e-9, abs_tol=1e-6), fn
    spread = max(everything) - min(everything)
    half = series.bin_width / 2
    # The documented bound: half a bin, and a bin under 2 * spread / (BINS - 2).
    assert half <= max(math.ldexp(1.0, MIN_EXP - 1), spread / (BINS - 2))
    for fn in QUANTILES:
        got = series.value(fn)
        assert got is not None
        assert abs(got - _exact(fn, vals)) <= half + 1e-9 * max(1.0, abs(got)), fn


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(steps, st.one_of(st.sampled_from([97.0, 98.0, 100.0]), values), st.booleans()),
        min_size=1,
        max_size=400,
    ),
    st.sampled_from([60.0, 3600.0, 86400.0]),
    st.integers(1, 50),
)
def test_samples_held_between_reads_agree_with_the_raw_samples(
    seq: list[tuple[float, float, bool]], window: float, every: int
) -> None:
    """Read only now and then (a rule looked at once a minute), so the samples of the head
    bucket are held, up to HELD of them, and put into the arrays together: every read
    still agrees with the samples in the window, late ones and bucket edges included."""
    series = Series(window, quantiles=True)
    t, held, newest = 1_800_000_000.0, [], -math.inf
    everything: list[float] = []
    for i, (step, value, late) in enumerate(seq):
        t += step
        at = t - 7 * window / BUCKETS if late and i % 5 == 0 else t  # a late one now and then
        series.add(at, value)
        everything.append(value)
        newest = max(newest, math.floor(at / series.width))
        if math.floor(at / series.width) > newest - BUCKETS:
            held.append((at, value))
        if i % every == every - 1 or i == len(seq) - 1:
            _agrees(series, held, everything)


def test_a_sample_on_a_bucket_edge_lies_in_the_bucket_its_time_divides_into() -> None:
    """The held way takes a sample only well inside the head bucket; one at an edge is
    put where floor(t / width) says, as the window's reference reads it."""
    series = Series(3600.0, quantiles=False)  # buckets of 112.5 s
    width = series.width
    edge = 16_000_000 * width
    series.add(edge + 1.0, 1.0)
    series.add(math.nextafter(edge + width, -math.inf), 2.0)  # the head bucket's last time
    series.add(edge + width, 4.0)  # the next bucket's first
    assert series.value("count") == 3.0
    # The window moves so that the first bucket has just left it: only 4.0 remains.
    series.add(edge + BUCKETS * width + 1.0, 8.0)
    assert series.value("sum") == 12.0


def test_integer_percentages_are_within_two_points() -> None:
    series = Series(86400.0, quantiles=True)
    for i in range(2000):
        series.add(1_800_000_000.0 + i * 30, float((i * 37) % 101))
    vals = [float((i * 37) % 101) for i in range(2000)]
    got = series.value("p95")
    assert got is not None
    assert series.bin_width == 4.0
    assert abs(got - _exact("p95", vals)) <= 2.0


def test_a_window_that_empties_starts_a_fine_grid_again() -> None:
    series = Series(60.0, quantiles=True)
    series.add(0.0, 0.0)
    series.add(1.0, 1_000_000.0)
    assert series.bin_width > 1000
    series.add(1000.0, 5.0)  # everything before fell out of the window
    series.add(1001.0, 5.5)
    assert series.bin_width < 1
    assert series.value("p50") == 5.0 or abs((series.value("p50") or 0) - 5.0) < series.bin_width


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), steps, st.one_of(st.none(), st.integers(0, 700))),
        min_size=1,
        max_size=80,
    ),
    st.sampled_from(["sum", "avg", "min", "max", "count", "p95", "p50"]),
    st.integers(1, 120).map(float),
)
def test_group_aggregate_is_the_fresh_members_latest_values(
    seq: list[tuple[int, float, int | None]], fn: str, max_gap: float
) -> None:
    agg = Aggregate(fn, "power_w", None, f"{fn}(power_w)")
    aggs = Aggregates((agg,), per_member=False, max_gap=max_gap)
    latest: dict[int, tuple[float, int | None]] = {}
    t, newest = 1_800_000_000.0, -math.inf
    for member, step, value in seq:
        t += step
        fact: dict[str, object] = {"node": f"n{member}", "power_w": value}
        seen = aggs.observe("rack-a", member, t, fact)
        if member in latest and t < latest[member][0]:
            assert seen is None  # late for its member: never evaluated
            continue
        latest[member] = (t, value)
        newest = max(newest, t)
        assert seen == newest  # the group's clock never goes back
        fresh = [float(v) for tm, v in latest.values() if t - tm <= max_gap and v is not None]
        assert fact[agg.name] == group_value(fn, fresh)
        if fresh:
            assert math.isclose(float(fact[agg.name] or 0), _exact(fn, fresh), abs_tol=1e-6)


def test_a_late_sample_of_a_gpu_counts_in_its_bucket_but_is_not_evaluated() -> None:
    agg = Aggregate("max", "temp_c", 600.0, "max(temp_c, 10m)")
    aggs = Aggregates((agg,), per_member=True, max_gap=30.0)
    first: dict[str, object] = {"temp_c": 50}
    assert aggs.observe(("n1", 0), ("n1", 0), 1000.0, first) == 1000.0
    late: dict[str, object] = {"temp_c": 90}
    assert aggs.observe(("n1", 0), ("n1", 0), 990.0, late) is None
    later: dict[str, object] = {"temp_c": 40}
    aggs.observe(("n1", 0), ("n1", 0), 1010.0, later)
    assert later[agg.name] == 90.0


def test_quiet_keys_and_silent_members_are_swept() -> None:
    agg = Aggregate("sum", "power_w", None, "sum(power_w)")
    aggs = Aggregates((agg,), per_member=False, max_gap=30.0)
    aggs.observe("a", ("n1", 0), 1000.0, {"power_w": 100})
    aggs.observe("a", ("n2", 0), 1100.0, {"power_w": 200})
    aggs.observe("b", ("n3", 0), 1000.0, {"power_w": 300})
    assert aggs.sweep(1050.0) == 1  # b's newest is older than its longest span (max_gap)
    assert set(aggs.keys) == {"a"}
    assert set(aggs.keys["a"].members) == {("n2", 0)}  # n1 stopped reporting


def test_a_crowded_quantile_bin_widens_its_counters_and_loses_no_sample() -> None:
    """More samples in one bin than 16 bits hold (a day at 1 Hz of a flat value): the
    counters widen, and every sample is still counted, in its bucket and in the sums."""
    series = Series(86400.0, True)
    t = 1_800_000_000.0
    for i in range(70_000):
        series.add(t + i * 0.01, 42.0)  # all in one time bucket and one bin
    series.add(t + 700.0, 99.0)

    assert series.hist is not None and series.hist.typecode == "I"
    assert series.value("count") == 70_001
    assert sum(series.hist[BUCKETS * BINS :]) == 70_001, "the sums row holds every sample"
    assert series.value("p50") == pytest.approx(42.0, abs=(99.0 - 42.0) / (BINS - 2))
    assert series.value("max") == 99.0


def test_each_series_has_its_own_buckets() -> None:
    """Series start from copies of shared zeroed arrays: what one takes, another (made
    before or after it) never sees, nor does a crowded one widening its counters."""
    before = Series(86400.0, True)
    crowded = Series(86400.0, True)
    t = 1_800_000_000.0
    for i in range(70_000):
        crowded.add(t + i * 0.01, 42.0)
    after = Series(86400.0, True)

    for fresh in (before, after):
        assert fresh.n == 0 and fresh.value("max") is None
        assert fresh.hist is not None and not any(fresh.hist) and not any(fresh.count)
    fresh = Series(3600.0, False)
    fresh.add(t, 7.0)
    assert fresh.value("max") == 7.0 and after.value("max") is None
