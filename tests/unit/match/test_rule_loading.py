"""Rule loading: every bad rule is rejected with file:line: rule NAME: message."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gpuops.errors import RuleError, RuleSetError
from gpuops.match.loader import build_all, load_rules
from gpuops.match.yamlsrc import LineDict, load_yaml

ROOT = Path(__file__).resolve().parents[3]
BAD = Path(__file__).resolve().parent / "bad_rules"

CASES = {
    "agg_unknown_function.yml": "5: rule idle: when: call to 'median': only",
    "agg_unknown_field.yml": (
        "5: rule idle: when: unknown field 'util_gpx' (did you mean util_gpu?)"
    ),
    "agg_window_not_duration.yml": (
        "5: rule idle: when: p95(): the window must be a duration like 10m or 24h, not 'util_mem'"
    ),
    "agg_window_no_unit.yml": (
        "5: rule idle: when: avg(): the window must be a duration like 10m or 24h, not '3600'"
    ),
    "agg_window_too_long.yml": (
        "5: rule idle: when: p95(): window 30d is out of range (over 0, at most 7d)"
    ),
    "agg_text_field.yml": "5: rule idle: when: max(): field 'uuid' is not numeric",
    "duration_outside_window.yml": (
        "5: rule hot: when: 10m is a duration: it may only be a window's length"
    ),
    "agg_group_sum_per_gpu.yml": (
        "5: rule rack-power: when: sum(power_w) aggregates the members of a group"
    ),
    "group_by_no_inventory.yml": (
        "4: rule rack-power: group_by 'rack' is read from the inventory, and none was given"
    ),
    "unknown_field.yml": "5: rule hot: unknown field 'sustain'",
    "bad_duration.yml": "5: rule hot: for: bad duration '60 seconds'",
    "import.yml": "4: rule sneaky: when: call to '__import__': only",
    "dunder_class.yml": "4: rule sneaky: when: attribute access is not allowed",
    "lambda.yml": "4: rule sneaky: when: lambdas are not allowed",
    "unknown_event_field.yml": "4: rule hot: when: unknown field 'temperature'",
    "unknown_playbook.yml": "5: rule hot: unknown playbook 'melt.yml'",
    "duplicate_name.yml": "5: rule hot: duplicate rule name (first defined at",
    "unknown_kind.yml": "3: rule hot: on: 'weather' is not one of",
    "yaml_syntax.yml": "5: YAML: expected ',' or ']'",
    "count_without_within.yml": "4: rule flappy: 'count' and 'within' go together",
    "gpu_group_on_heartbeat.yml": "4: rule beat: group_by gpu: 'heartbeat' events carry no gpu",
    "alert_without_status.yml": "4: rule xid-alert: an alert rule says which status it acts on",
    "template_field.yml": "5: rule hot: vars: unknown field 'temperature' in template",
    "two_forms.yml": "6: rule hot: use one temporal form, not for and absent",
    "deep_condition.yml": "5: rule deep: when: condition too deep (252 levels, limit 32)",
    "deep_vars.yml": "4: rule nested: vars nested too deeply (limit 8 levels)",
    "two_playbooks.yml": "4: rule drain-then-reboot: one playbook per rule: several would run",
    "nan_duration.yml": "5: rule never: for: bad duration nan: must be a finite number",
    "uncatalogued_playbook.yml": "5: rule hot: unknown playbook 'tasks/drain.yml' (not in",
    "unknown_variable.yml": (
        "5: rule low: playbook power_limit.yml does not accept variable 'wats' "
        "(accepts: limits, reason, watts)"
    ),
    "unknown_rung_variable.yml": (
        "5: ladder lost: playbook reboot.yml does not accept variable 'force' (accepts: reason)"
    ),
}


@pytest.mark.parametrize(("name", "expected"), sorted(CASES.items()))
def test_bad_rule_is_rejected_with_file_line_and_rule(name: str, expected: str) -> None:
    path = BAD / name
    with pytest.raises(RuleError) as caught:
        load_rules([path], ROOT / "playbooks")
    assert str(caught.value).startswith(f"{path}:{expected}"), str(caught.value)


def test_every_fixture_has_a_case() -> None:
    assert {p.name for p in BAD.glob("*.yml")} == set(CASES)


def test_all_errors_of_a_load_are_reported_together(tmp_path: Path) -> None:
    for name in ("unknown_field.yml", "lambda.yml", "unknown_playbook.yml"):
        shutil.copy(BAD / name, tmp_path / name)
    with pytest.raises(RuleSetError) as caught:
        load_rules([tmp_path], ROOT / "playbooks")
    assert len(caught.value.errors) == 3


def test_shipped_rules_load() -> None:
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    names = {r.name for r in rules.rules}
    assert {"gpu-overheat", "power-limit-below-policy", "xid-79-gpu-lost", "agent-silent"} <= names


def test_on_is_a_key_not_a_boolean(tmp_path: Path) -> None:
    # PyYAML reads `on:` as True; the loader must keep it a key.
    (tmp_path / "r.yml").write_text("rules:\n  - name: a\n    on: xid\n    when: xid == 79\n")
    rules = load_rules([tmp_path], None)
    assert rules.rules[0].on == "xid"
    assert rules.rules[0].line == 2


def test_durations_are_seconds(tmp_path: Path) -> None:
    (tmp_path / "r.yml").write_text(
        "rules:\n  - name: a\n    on: xid\n    count: 3\n    within: 1h30m\n    cooldown: 500ms\n"
    )
    rule = load_rules([tmp_path], None).rules[0]
    assert (rule.count, rule.within_s, rule.cooldown_s) == (3, 5400.0, 0.5)


def test_any_failure_building_a_rule_is_that_rules_error() -> None:
    # Whatever a rule does to the compiler, the load reports it; it never raises past.
    doc = load_yaml("rules:\n  - name: ok\n    on: xid\n  - name: boom\n    on: xid\n", "r.yml")

    def build(raw: LineDict, file: str, playbooks: Path | None) -> str:
        if raw["name"] == "boom":
            raise RecursionError("maximum recursion depth exceeded")
        return str(raw["name"])

    errors: list[RuleError] = []
    assert build_all(doc["rules"], build, "r.yml", None, errors) == ["ok"]
    assert [str(e) for e in errors] == [
        "r.yml:4: rule boom: cannot compile (RecursionError: maximum recursion depth exceeded)"
    ]


def test_deeply_nested_yaml_is_a_rule_error(tmp_path: Path) -> None:
    path = tmp_path / "r.yml"
    path.write_text("rules:\n  - name: a\n    on: xid\n    description: " + "[" * 400 + "]" * 400)
    with pytest.raises(RuleError, match="YAML nested too deeply"):
        load_rules([path], None)


def test_file_that_is_not_utf8_is_a_rule_error(tmp_path: Path) -> None:
    path = tmp_path / "r.yml"
    path.write_bytes(b"rules:\n  - name: a\n    on: xid\n    description: \xff\xfe\n")
    with pytest.raises(RuleError, match=r"r.yml:4: not UTF-8"):
        load_rules([path], None)
