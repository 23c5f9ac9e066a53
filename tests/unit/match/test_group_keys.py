"""Group keys from the inventory (host variables, `group:PARENT`) and group aggregates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gpuops.errors import RuleError
from gpuops.inventory.hosts import Inventory, load_inventory
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.match.rules import RuleSet
from gpuops.spine.ruletest import run_case

RACK_RULE = """
rules:
  - name: rack-over-budget
    on: telemetry
    group_by: [rack]
    when: sum(power_w) > budget_w
    for: 2m
    cooldown: 10m
    actions:
      - notify: chatops
"""

HOSTVARS = {
    "n1": {"rack": "a1", "budget_w": 1000},
    "n2": {"rack": "a1", "budget_w": 1000},
    "n3": {"rack": "b2", "budget_w": 1000},
    "n4": {},  # no rack: part of no rack group
}


def _inventory(hostvars: dict[str, dict[str, object]] = HOSTVARS) -> Inventory:
    return Inventory(Path("inv.yml"), frozenset(hostvars), {}, hostvars)


def _rules(tmp_path: Path, text: str, inventory: Inventory | None) -> RuleSet:
    (tmp_path / "r.yml").write_text(text)
    return load_rules([tmp_path / "r.yml"], None, inventory)


def _feed(m: Matcher, node: str, t: float, *watts: float) -> list[str]:
    facts = [{"node": node, "gpu": i, "power_w": w} for i, w in enumerate(watts)]
    return [x.key for x in m.match_facts("telemetry", facts, t, f"{node}@{t}")]


def test_a_rack_over_budget_for_two_minutes_fires_for_that_rack(tmp_path: Path) -> None:
    inv = _inventory()
    m = Matcher(_rules(tmp_path, RACK_RULE, inv), inventory=inv)
    fired: list[tuple[int, str]] = []
    for s in range(0, 200, 10):
        t = 1000.0 + s
        # Members report a little apart and out of order: the rack's run must not break.
        keys = _feed(m, "n2", t + 0.2, 250, 250)  # rack a1 with n1: 1100 W > 1000
        keys += _feed(m, "n1", t, 300, 300)  # 600 W
        keys += _feed(m, "n3", t + 0.1, 500, 400)  # rack b2: 900 W, under
        keys += _feed(m, "n4", t, 700, 700)  # no rack: never counted anywhere
        fired += [(s, k) for k in keys]
    assert {k for _, k in fired} == {"a1"}
    # Over budget from n1's first sample (at the group's time 1000.2): two minutes on.
    assert fired[0][0] == 120


def test_a_member_that_stops_reporting_drops_out_after_max_gap(tmp_path: Path) -> None:
    inv = _inventory()
    text = RACK_RULE.replace("for: 2m", "max_gap: 30s")
    m = Matcher(_rules(tmp_path, text, inv), inventory=inv)
    _feed(m, "n1", 1000.0, 600)
    assert _feed(m, "n2", 1001.0, 500) == ["a1"]  # 1100 W
    # n1 silent for more than 30 s: the rack is n2's 500 W alone.
    assert _feed(m, "n2", 1040.0, 500) == []


def test_the_group_value_is_in_the_match_facts(tmp_path: Path) -> None:
    inv = _inventory()
    m = Matcher(_rules(tmp_path, RACK_RULE.replace("for: 2m", ""), inv), inventory=inv)
    _feed(m, "n1", 1000.0, 600)
    out = m.match_facts("telemetry", [{"node": "n2", "gpu": 0, "power_w": 500}], 1001.0, "e")
    assert out[0].facts["sum(power_w)"] == 1100.0
    assert out[0].facts["budget_w"] == 1000
    assert out[0].key == "a1"


def test_a_node_that_moves_rack_counts_in_its_new_rack(tmp_path: Path) -> None:
    inv = _inventory()
    m = Matcher(_rules(tmp_path, RACK_RULE.replace("for: 2m", ""), inv), inventory=inv)
    _feed(m, "n3", 1000.0, 600)
    assert _feed(m, "n1", 1000.5, 300) == []  # a1: 300 W
    moved = {**HOSTVARS, "n1": {"rack": "b2", "budget_w": 1000}}
    m.set_inventory(_inventory(moved))
    assert _feed(m, "n1", 1001.0, 500) == ["b2"]  # b2: n3's 600 + n1's 500


def test_reload_of_an_unchanged_rule_keeps_its_windows(tmp_path: Path) -> None:
    inv = _inventory()
    text = RACK_RULE.replace("sum(power_w) > budget_w", "avg(power_w, 10m) > 400")
    rules = _rules(tmp_path, text.replace("group_by: [rack]", "group_by: [node]"), inv)
    m = Matcher(rules, inventory=inv)
    for s in range(0, 150, 10):
        _feed(m, "n1", 1000.0 + s, 900)
    m.replace(_rules(tmp_path, text.replace("group_by: [rack]", "group_by: [node]"), inv))
    assert _feed(m, "n1", 1150.0, 900) == ["n1"]  # the run and the window went on


def test_window_state_of_a_quiet_key_is_evicted(tmp_path: Path) -> None:
    text = RACK_RULE.replace("sum(power_w) > budget_w", "max(power_w, 10m) > 400")
    m = Matcher(_rules(tmp_path, text.replace("group_by: [rack]", "group_by: [node, gpu]"), None))
    _feed(m, "n1", 1000.0, 900, 900)
    assert m.state_size() == 4  # per GPU: a `for` run and a window
    m.sweep_grace_s = 0.0
    assert m.sweep(1000.0 + 599) == 2  # the runs (max_gap 30 s) go; the windows stay
    assert m.sweep(1000.0 + 601) == 2  # the 10-minute windows went quiet too
    assert m.state_size() == 0


def test_group_by_a_variable_no_host_has_is_rejected(tmp_path: Path) -> None:
    text = RACK_RULE.replace("group_by: [rack]", "group_by: [rak]")
    with pytest.raises(RuleError) as caught:
        _rules(tmp_path, text, _inventory())
    assert str(caught.value).startswith(
        f"{tmp_path / 'r.yml'}:5: rule rack-over-budget: group_by 'rak': no host of inv.yml "
        "has that variable; did you mean rack?"
    )


def test_a_condition_naming_an_unknown_inventory_variable_is_rejected(tmp_path: Path) -> None:
    text = RACK_RULE.replace("> budget_w", "> budgt_w")
    with pytest.raises(RuleError, match=r"unknown field 'budgt_w' \(did you mean budget_w\?\)"):
        _rules(tmp_path, text, _inventory())


def test_group_parent_keys_by_the_child_group_from_a_real_inventory(tmp_path: Path) -> None:
    (tmp_path / "hosts.yml").write_text(
        "all:\n  children:\n    racks:\n      children:\n"
        "        rack_a:\n          hosts: {n1: {}, n2: {}}\n"
        "          vars: {budget_w: 1000}\n"
        "        rack_b:\n          hosts: {n3: {}}\n"
        "          vars: {budget_w: 5000}\n"
        "    spare:\n      hosts: {n4: {}}\n"
    )
    inv = load_inventory(tmp_path / "hosts.yml")
    text = RACK_RULE.replace("group_by: [rack]", 'group_by: ["group:racks"]')
    m = Matcher(_rules(tmp_path, text.replace("for: 2m", ""), inv), inventory=inv)
    _feed(m, "n1", 1000.0, 600)
    assert _feed(m, "n2", 1000.5, 500) == ["rack_a"]
    assert _feed(m, "n3", 1000.5, 2000, 2000) == []  # its own group's budget: 5000 W
    assert _feed(m, "n4", 1000.5, 9000) == []  # in no child of racks
    bad = text.replace("group:racks", "group:spare")
    with pytest.raises(RuleError, match="'spare' is not an inventory group with child groups"):
        _rules(tmp_path, bad, inv)


def test_a_rule_test_case_gives_hosts_their_variables(tmp_path: Path) -> None:
    rules = _rules(tmp_path, RACK_RULE, _inventory())
    case = {
        "name": "rack a1 over budget",
        "hosts": {"n1": {"rack": "a1", "budget_w": 1000}, "n2": {"rack": "a1", "budget_w": 1000}},
        "events": [
            {
                "at": "0s",
                "kind": "telemetry",
                "node": "n1",
                "gpus": [{"index": 0, "power_w": 600}],
                "repeat": {"every": "10s", "until": "3m"},
            },
            {
                "at": "1s",
                "kind": "telemetry",
                "node": "n2",
                "gpus": [{"index": 0, "power_w": 500}],
                "repeat": {"every": "10s", "until": "3m"},
            },
        ],
        "expect": [{"rule": "rack-over-budget", "action": "notify:chatops", "count": 1}],
    }
    result = asyncio.run(run_case("case", case, rules))
    assert result.passed, result.failures
    under = {**case, "hosts": {n: {"rack": "a1", "budget_w": 5000} for n in ("n1", "n2")}}
    under["expect"] = []
    under["forbid"] = [{"rule": "rack-over-budget"}]
    assert asyncio.run(run_case("case", under, rules)).passed


def test_rules_without_aggregates_keep_the_generated_fast_path(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    m = Matcher(load_rules([root / "rules"], None))
    entries = {e.rule.name: e for e in m._by_kind["telemetry"]}
    assert not entries["gpu-overheat"].slow
    assert entries["gpu-underused"].slow
