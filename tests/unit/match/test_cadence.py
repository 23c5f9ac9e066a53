"""Rules that read only long-window aggregates are looked at once per 1/1440 of their
window per key (docs/rules.md, Aggregates): every sample still counts, and the answer
is at most that cadence late."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from gpuops.match.aggregates import HELD, Series
from gpuops.match.codegen import _slow, slow_cadence
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher, _match
from gpuops.match.rules import RuleSet
from hypothesis import given, settings
from hypothesis import strategies as st

T0 = 1_700_000_000.0


def _rules(tmp_path: Path, when: str, extra: str = "") -> RuleSet:
    (tmp_path / "r.yml").write_text(
        "rules:\n"
        "  - name: r\n"
        "    on: telemetry\n"
        "    group_by: [node, gpu]\n"
        f"    when: {when}\n"
        f"{extra}"
        "    actions:\n"
        "      - notify: chatops\n"
    )
    return load_rules([tmp_path / "r.yml"], None)


def _first_fire(m: Matcher, util: float, seconds: int) -> float | None:
    for i in range(seconds):
        fact = {"node": "n1", "gpu": 0, "util_gpu": util}
        if m.match_facts("telemetry", [fact], T0 + i, f"e{i}"):
            return T0 + i
    return None


def test_every_sample_is_counted_between_evaluations(tmp_path: Path) -> None:
    rules = _rules(tmp_path, "count(util_gpu, 2h) >= 600")
    assert slow_cadence(rules.rules[0]) == 5.0  # 2 h / 1440
    fired = _first_fire(Matcher(rules), 50.0, 700)
    # Counting only the evaluated samples (one in five) would not reach 600 in 700 s.
    assert fired is not None and T0 + 599 <= fired < T0 + 599 + 5


def test_a_held_condition_fires_at_most_one_cadence_late(tmp_path: Path) -> None:
    rules = _rules(tmp_path, "p95(util_gpu, 2h) < 10", "    for: 10m\n    max_gap: 5m\n")
    fired = _first_fire(Matcher(rules), 5.0, 700)
    assert fired is not None and T0 + 600 <= fired <= T0 + 600 + 5


def test_a_cadence_never_exceeds_half_the_gap_a_run_allows(tmp_path: Path) -> None:
    rules = _rules(tmp_path, "p95(util_gpu, 24h) < 10", "    for: 1h\n    max_gap: 30s\n")
    assert slow_cadence(rules.rules[0]) == 15.0  # not the day's 60 s: the run would break
    assert _first_fire(Matcher(rules), 5.0, 3700) is not None


def test_rules_reading_other_fields_or_short_windows_see_every_sample(tmp_path: Path) -> None:
    mixed = _rules(tmp_path, "p95(util_gpu, 2h) < 10 and temp_c > 80")
    short = _rules(tmp_path, "p95(util_gpu, 10m) < 10")
    assert Matcher(mixed)._by_kind["telemetry"][0].agg_only is False
    assert slow_cadence(short.rules[0]) == 0.0


# Readings a series takes or leaves out: numbers, ints, nulls, NaN, bools, text.
_readings = st.one_of(
    st.floats(0, 100),
    st.integers(0, 100),
    st.none(),
    st.just(math.nan),
    st.booleans(),
    st.just("x"),
)
_samples = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 7.0, 400.0, -2.0]),
        st.integers(0, 1),
        _readings,
        _readings,
    ),
    min_size=1,
    max_size=300,
)


@settings(max_examples=60, deadline=None)
@given(samples=_samples)
def test_the_inline_series_path_is_the_rules_whole_evaluation(samples: list[Any]) -> None:
    """Between two looks at a key the generated code takes the sample into its series
    inline (codegen._between); a matcher that sends every sample through the rule's whole
    evaluation (codegen._slow) makes the same matches and holds the same series."""
    rules = load_rules_text(
        "p95(util_gpu, 2h) < 10 and max(temp_c, 2h) > 50", "    for: 30s\n    max_gap: 20s\n"
    )
    inline, whole = Matcher(rules), Matcher(rules)
    whole._eval_kind["telemetry"] = _without_inline(whole)
    t = T0
    for step, gpu, util, temp in samples:
        t += step
        fact = {"node": "n1", "gpu": gpu, "util_gpu": util, "temp_c": temp}
        got = inline.match_facts("telemetry", [dict(fact)], t, "e")
        want = whole.match_facts("telemetry", [dict(fact)], t, "e")
        assert [(m.key, m.at) for m in got] == [(m.key, m.at) for m in want]
    assert _series(inline) == _series(whole)


def test_the_samples_held_between_looks_stay_under_their_bound() -> None:
    """Between two looks (a minute for a day-long p95) a GPU's samples at 10 Hz are held
    and settled every HELD of them, inline as in Series.add: never more are kept, and
    the series reads what one fed directly reads."""
    rules = load_rules_text("p95(util_gpu, 24h) < 10", "")
    m, direct = Matcher(rules), Series(86400.0, True)
    for i in range(500):
        t, util = T0 + i * 0.1, float(i % 7)
        m.match_facts("telemetry", [{"node": "n1", "gpu": 0, "util_gpu": util}], t, "e")
        direct.add(t, util)
        (series,) = _one_key(m).series
        assert len(series.held) < HELD
    (series,) = _one_key(m).series
    assert [series.value(fn) for fn in ("count", "sum", "p95")] == [
        direct.value(fn) for fn in ("count", "sum", "p95")
    ]


def _one_key(m: Matcher) -> Any:
    agg = m._by_kind["telemetry"][0].agg
    assert agg is not None
    (state,) = agg.keys.values()
    return state


def _without_inline(m: Matcher) -> Any:
    runs = [_slow(e, _match, m._cleared) for e in m._by_kind["telemetry"]]

    def evaluate(f: Any, t: float, eid: str, out: list[Any]) -> None:
        for run in runs:
            run(f, t, eid, out)

    return evaluate


def _series(m: Matcher) -> dict[Any, Any]:
    """Every key's series, bucket for bucket (and when the rule last looked at it)."""
    agg = m._by_kind["telemetry"][0].agg
    assert agg is not None
    return {
        key: (state.evaluated, [_held(s) for s in state.series]) for key, state in agg.keys.items()
    }


def _held(s: Series) -> tuple[Any, ...]:
    hist = None if s.hist is None else list(s.hist)
    arrays = [list(a) for a in (s.count, s.total, s.lo, s.hi)]
    return (s.head, s.n, s.exp, s.base, hist, *arrays, list(s.held))  # held: not settled


def load_rules_text(when: str, extra: str) -> RuleSet:
    with tempfile.TemporaryDirectory() as held:
        return _rules(Path(held), when, extra)
