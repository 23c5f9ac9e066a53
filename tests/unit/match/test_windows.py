"""Each temporal form against a brute-force reference, over random sequences and clock jumps."""

from __future__ import annotations

import itertools

from gpuops.clock import ManualClock
from gpuops.match.windows import Absent, CountWithin, HeldFor, Increase
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_count_within_late_event_counts_only_its_own_window() -> None:
    # Appended unsorted behind 200, 60 stopped expiry there and was counted later, at 210.
    window = CountWithin(3, 50.0)
    assert window.observe("k", 100.0, True) is False
    assert window.observe("k", 200.0, True) is False
    assert window.observe("k", 60.0, True) is False  # only 60 lies in (10, 60]
    assert list(window.state["k"]) == sorted(window.state["k"])
    assert window.observe("k", 210.0, True) is False  # 200 and 210: still two
    assert window.observe("k", 220.0, True) is True


@settings(max_examples=200)
@given(st.permutations(list(range(0, 300, 7))), st.integers(1, 5), st.integers(1, 100))
def test_count_within_never_overcounts_events_out_of_order(
    times: list[int], n: int, within: int
) -> None:
    window = CountWithin(n, float(within))
    seen: list[float] = []
    for t in map(float, times):
        seen.append(t)
        in_window = sum(1 for s in seen if t - within < s <= t)
        if window.observe("k", t, True):
            assert in_window >= n, (t, seen)


def test_increase_ignores_a_sample_older_than_the_newest() -> None:
    # A late 990 after 1000 is not a counter reset: read as one, it rose by 990 at once.
    window = Increase(100.0, 3600.0)
    window.observe("k", 100.0, True, 1000.0)
    assert window.observe("k", 50.0, True, 990.0) is False
    assert window.last["k"] == (100.0, 1000.0)
    assert window.observe("k", 110.0, True, 1010.0) is False  # a rise of 10, not 20 or 990
    assert window.observe("k", 120.0, True, 1100.0) is True


def test_absent_counts_a_future_hit_as_arriving_now() -> None:
    clock = ManualClock(1_800_000_000.0)
    window = Absent(90.0, clock)
    window.observe("n1", clock.now() + 365 * 86400.0, True)  # the node's clock is a year off
    assert window.last["n1"] == clock.now()
    clock.advance(91.0)
    assert window.due(clock.now()) == ["n1"]


def test_absent_forgets_keys_that_fired_until_they_report_again() -> None:
    window = Absent(90.0)
    for node in range(1000):
        window.observe(f"ghost-{node}", 0.0, True)
    window.observe("live", 100.0, True)
    assert len(window.due(120.0)) == 1000
    assert window.sweep(120.0) == 1000
    assert list(window.last) == ["live"]
    window.observe("ghost-1", 130.0, True)  # the next event re-arms it
    assert window.due(300.0) == ["live", "ghost-1"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(gaps, st.just(-3.0)),  # now and then a sample older than the newest
            st.one_of(st.none(), st.integers(0, 6), st.just(3)),  # flat runs are the usual
        ),
        min_size=1,
        max_size=60,
    ),
    st.integers(1, 8),
    st.integers(1, 300).map(float),
)
def test_an_increase_rule_fires_exactly_when_its_window_would(
    tmp_path_factory: object, seq: list[tuple[float, int | None]], by: int, within: float
) -> None:
    """The generated code skips a counter that has not moved (gpuops.match.codegen): the
    rule still fires on exactly the samples the window itself fires on."""
    from pathlib import Path

    from gpuops.match.loader import load_rules
    from gpuops.match.matcher import Matcher

    folder = Path(tmp_path_factory.mktemp("rules"))  # type: ignore[attr-defined]
    (folder / "r.yml").write_text(
        "rules:\n"
        "  - name: climbing\n    on: telemetry\n    group_by: [node, gpu]\n"
        f"    increase: {{field: nvlink_crc_errors, by: {by}, within: {int(within)}s}}\n"
        "    actions:\n      - notify: chatops\n"
    )
    matcher = Matcher(load_rules([folder]))
    window = Increase(float(by), within)
    t = 1000.0
    for i, (gap, value) in enumerate(seq):
        t += gap
        fact = {"node": "n1", "gpu": 0, "nvlink_crc_errors": value}
        fired = bool(matcher.match_facts("telemetry", [fact], t, f"e{i}"))
        expected = window.observe(("n1", 0), t, True, None if value is None else float(value))
        assert fired == expected, (i, seq[: i + 1])
