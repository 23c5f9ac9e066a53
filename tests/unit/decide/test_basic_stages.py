"""The decide stages, each with an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.clock import ManualClock
from gpuops.decide.stage import Decider
from gpuops.inventory.hosts import Inventory
from gpuops.match.loader import load_rules
from gpuops.match.rules import Rule
from gpuops.models import Match, Reason

from tests.unit.decide.helpers import engine_on

RULES = """
rules:
  - name: hot
    on: telemetry
    group_by: [node, gpu]
    when: temp_c > 85
    cooldown: 10m
    actions:
      - playbook: drain.yml
        vars: {reason: "GPU {{ gpu }} at {{ temp_c }} C"}
  - name: shadow
    on: telemetry
    when: temp_c > 85
    dry_run: true
    actions:
      - playbook: drain.yml
  - name: record-only
    on: telemetry
    when: temp_c > 85
"""


@pytest.fixture
def rules(tmp_path: Path) -> dict[str, Rule]:
    (tmp_path / "r.yml").write_text(RULES)
    return {r.name: r for r in load_rules([tmp_path], None).rules}


def _match(rule: str, node: str = "node-001", ts: float = 1000.0) -> Match:
    return Match(
        rule=rule,
        kind="telemetry",
        node=node,
        gpu=3,
        key=f"{node}/3",
        event_id=f"e-{node}-{ts}",
        event_ts=ts,
        at=ts,
        facts={"node": node, "gpu": 3, "temp_c": 90.5},
    )


def _decider(clock: ManualClock, dry_run: bool = False) -> Decider:
    inventory = Inventory(Path("inv"), frozenset({"node-001"}), {}, {})
    return engine_on(
        clock, inventory=inventory, dry_run=dry_run, stale_after_s=300.0, lock_lease_s=1.0
    ).pipeline.decider


async def test_accepted_match_renders_its_vars(rules: dict[str, Rule]) -> None:
    decision = await _decider(ManualClock(1000.0)).decide(_match("hot"), rules["hot"])
    assert decision.accepted and decision.reason is Reason.ACCEPTED
    assert decision.actions[0].vars == {"reason": "GPU 3 at 90.5 C"}


async def test_unknown_node_is_never_acted_upon(rules: dict[str, Rule]) -> None:
    decision = await _decider(ManualClock(1000.0)).decide(_match("hot", "intruder"), rules["hot"])
    assert not decision.accepted and decision.reason is Reason.UNKNOWN_NODE


async def test_stale_event_is_recorded_not_acted_upon(rules: dict[str, Rule]) -> None:
    clock = ManualClock(1000.0 + 301)
    decision = await _decider(clock).decide(_match("hot"), rules["hot"])
    assert decision.reason is Reason.STALE and "5m1s old" in decision.detail


async def test_cooldown_drops_until_it_expires(rules: dict[str, Rule]) -> None:
    clock = ManualClock(1000.0)
    decider = _decider(clock)
    assert (await decider.decide(_match("hot"), rules["hot"])).accepted
    clock.advance(599)
    again = await decider.decide(_match("hot", ts=clock.now()), rules["hot"])
    assert again.reason is Reason.COOLDOWN and again.detail.startswith("1s of 10m")
    clock.advance(1)
    assert (await decider.decide(_match("hot", ts=clock.now()), rules["hot"])).accepted


async def test_cooldown_is_per_group_key(rules: dict[str, Rule]) -> None:
    decider = _decider(ManualClock(1000.0))
    assert (await decider.decide(_match("hot"), rules["hot"])).accepted
    other = _match("hot").model_copy(update={"key": "node-001/4", "gpu": 4})
    assert (await decider.decide(other, rules["hot"])).accepted


async def test_dry_run_global_and_per_rule(rules: dict[str, Rule]) -> None:
    glob = await _decider(ManualClock(1000.0), dry_run=True).decide(_match("hot"), rules["hot"])
    assert not glob.accepted and glob.reason is Reason.DRY_RUN and glob.detail == "global dry-run"
    assert glob.actions, "a dry-run decision still says what would have run"
    per_rule = await _decider(ManualClock(1000.0)).decide(_match("shadow"), rules["shadow"])
    assert per_rule.reason is Reason.DRY_RUN and per_rule.detail == "rule dry-run"


async def test_rule_without_actions_records_only(rules: dict[str, Rule]) -> None:
    decision = await _decider(ManualClock(1000.0)).decide(
        _match("record-only"), rules["record-only"]
    )
    assert decision.reason is Reason.NO_ACTION and not decision.accepted
