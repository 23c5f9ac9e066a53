"""Rules that read only long-window aggregates are looked at once per 1/1440 of their
window per key (docs/rules.md, Aggregates): every sample still counts, and the answer
is at most that cadence late."""

from __future__ import annotations

from pathlib import Path

from gpuops.match.codegen import slow_cadence
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.match.rules import RuleSet

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
