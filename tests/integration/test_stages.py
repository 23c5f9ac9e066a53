"""Each safety stage's decisions, on real KV buckets, with an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.act.notify import Notifier
from engine.app import build_stages
from engine.bus.conn import Bus
from engine.bus.kvjson import keys
from engine.clock import ManualClock
from engine.decide.approval import ApprovalStore
from engine.decide.attempts import AttemptCap
from engine.decide.breaker import CLOSED, HALF_OPEN, OPEN, BreakerStore
from engine.decide.lock import release
from engine.decide.silence import SilenceStore
from engine.decide.stage import Decider
from engine.inventory import Inventory
from engine.match.loader import load_rules
from engine.match.rules import Rule
from engine.models import Match, Reason
from engine.settings import SafetySettings, Settings
from tests.conftest import ROOT

pytestmark = pytest.mark.integration
T0 = 1_800_000_000.0
NODES = frozenset(f"node-{i:03d}" for i in range(1, 21))
INVENTORY = Inventory(
    Path("inv"),
    NODES,
    {"rack-a": frozenset({"node-001", "node-002"})},
    {n: {"rack": "a" if n < "node-011" else "b"} for n in NODES},
)


@pytest.fixture
def rules() -> dict[str, Rule]:
    return {r.name: r for r in load_rules([ROOT / "rules"], ROOT / "playbooks").rules}


def _decider(
    bus: Bus, clock: ManualClock, notifier: Notifier | None = None, **safety: float
) -> Decider:
    settings = Settings(safety=SafetySettings(**safety))  # type: ignore[arg-type]
    return Decider(build_stages(settings, INVENTORY, bus, notifier or Notifier()), clock)


def _m(
    rule: str, node: str = "node-001", t: float = T0, gpu: int | None = 3, kind: str = "xid"
) -> Match:
    key = f"{node}/{gpu}" if gpu is not None else node
    return Match(
        rule=rule,
        kind=kind,
        node=node,
        gpu=gpu,
        key=key,
        event_id=f"e-{rule}-{node}-{t}",
        event_ts=t,
        at=t,
        facts={"node": node, "gpu": gpu, "xid": 79, "temp_c": 88.0},
    )


async def test_silences_by_rule_node_group_label_and_expiry(
    bus: Bus, rules: dict[str, Rule]
) -> None:
    clock = ManualClock(T0)
    store = SilenceStore(bus.kv["control"])
    decider = _decider(bus, clock)
    rule = rules["xid-48-dbe"]
    s = await store.add("group:rack-a", T0, T0 + 600, "rack work")
    assert (await decider.decide(_m(rule.name), rule)).reason is Reason.SILENCED
    assert (await decider.decide(_m(rule.name, "node-003"), rule)).accepted
    await store.add("label:rack=b", T0, T0 + 600, "row b maintenance")
    clock.advance(3)  # the stage re-reads silences every 2 s, not per event
    assert (
        await decider.decide(_m(rule.name, "node-015", clock.now()), rule)
    ).reason is Reason.SILENCED
    await store.add("node:node-004", T0 + 3600, T0 + 7200, "window tonight")  # a maintenance window
    clock.advance(3)
    assert (await decider.decide(_m(rule.name, "node-004", clock.now()), rule)).accepted
    clock.advance(3700)
    assert (
        await decider.decide(_m(rule.name, "node-004", clock.now(), gpu=1), rule)
    ).reason is Reason.SILENCED
    assert await store.remove(s.id) and not await store.remove(s.id)
    assert (await decider.decide(_m(rule.name, "node-002", clock.now()), rule)).accepted


async def test_reboot_supersedes_a_reset_on_the_same_node(bus: Bus, rules: dict[str, Rule]) -> None:
    clock = ManualClock(T0)
    decider = _decider(bus, clock)
    first = await decider.decide(_m("xid-79-gpu-lost"), rules["xid-79-gpu-lost"])
    assert first.accepted and first.actions[0].playbook == "reboot.yml"
    await release(bus.kv["locks"], "node-001")  # the reboot finished
    clock.advance(60)
    reset = await decider.decide(_m("xid-48-dbe", t=clock.now()), rules["xid-48-dbe"])
    assert reset.reason is Reason.SUPERSEDED and "reboot.yml" in reset.detail
    clock.advance(3600)
    assert (
        await decider.decide(_m("xid-48-dbe", t=clock.now(), gpu=2), rules["xid-48-dbe"])
    ).accepted


async def test_node_lock_one_remediation_at_a_time_even_across_replicas(
    bus: Bus, rules: dict[str, Rule]
) -> None:
    clock = ManualClock(T0)
    replica_a, replica_b = _decider(bus, clock), _decider(bus, clock)
    rule = rules["xid-48-dbe"]
    assert (await replica_a.decide(_m(rule.name, gpu=1), rule)).accepted
    second = await replica_b.decide(_m(rule.name, gpu=2), rule)
    assert second.reason is Reason.LOCKED and "xid-48-dbe" in second.detail
    clock.advance(1801)  # the holder died: its 30-minute lease ran out
    assert (await replica_b.decide(_m(rule.name, gpu=2, t=clock.now()), rule)).accepted


async def test_ladder_reboot_then_reprovision_then_needs_human(
    bus: Bus, rules: dict[str, Rule]
) -> None:
    clock = ManualClock(T0)
    decider = _decider(bus, clock)
    rule = rules["xid-79-gpu-lost"]
    seen = []
    for _ in range(3):
        decision = await decider.decide(_m(rule.name, t=clock.now(), gpu=None), rule)
        seen.append((decision.reason, [a.playbook for a in decision.actions]))
        await release(bus.kv["locks"], "node-001")
        clock.advance(2 * 3600)  # past the rule's cooldown, inside the ladder's day
    assert seen[0] == (Reason.ACCEPTED, ["reboot.yml"])
    assert seen[1] == (Reason.ACCEPTED, ["reprovision.yml"])
    assert seen[2][0] is Reason.NEEDS_HUMAN


async def test_attempt_cap_survives_a_restart(bus: Bus, rules: dict[str, Rule]) -> None:
    clock = ManualClock(T0)
    rule = rules["xid-reset-class"]
    for i in range(5):
        decider = _decider(bus, clock, equivalence_window_s=0)  # a new engine each time
        decision = await decider.decide(_m(rule.name, t=clock.now(), gpu=i), rule)
        assert decision.accepted, decision
        await release(bus.kv["locks"], "node-001")
        clock.advance(3601)
    capped = await _decider(bus, clock).decide(_m(rule.name, t=clock.now(), gpu=6), rule)
    assert capped.reason is Reason.ATTEMPT_CAP and "cap 5" in capped.detail
    assert len(await AttemptCap(bus.kv["history"]).attempts("node-001", clock.now())) == 5
    clock.advance(7 * 86400)
    assert (await _decider(bus, clock).decide(_m(rule.name, t=clock.now(), gpu=7), rule)).accepted


async def test_breaker_trips_stays_open_and_half_open_needs_approval(
    bus: Bus, rules: dict[str, Rule]
) -> None:
    clock = ManualClock(T0)
    notifier = Notifier()
    decider = _decider(bus, clock, notifier, breaker_share=0.1)  # 10% of 20 nodes: 2
    rule = rules["gpu-overheat"]
    results = [
        await decider.decide(_m(rule.name, f"node-{i:03d}", kind="telemetry"), rule)
        for i in range(1, 6)
    ]
    assert [r.reason for r in results] == [Reason.ACCEPTED, Reason.ACCEPTED] + [
        Reason.BREAKER_OPEN
    ] * 3
    assert any(m["topic"] == "breaker open" for m in notifier.sent)
    store = BreakerStore(bus.kv["control"])
    assert (await store.get())[0]["state"] == OPEN
    clock.advance(3600)  # open stays open: only a person closes it
    later = await decider.decide(_m(rule.name, "node-009", clock.now(), kind="telemetry"), rule)
    assert later.reason is Reason.BREAKER_OPEN
    await store.set_state(HALF_OPEN, "test", clock.now(), "alice")
    half = await decider.decide(_m(rule.name, "node-010", clock.now(), kind="telemetry"), rule)
    assert half.reason is Reason.APPROVAL_PENDING and "half-open" in half.detail
    await store.set_state(CLOSED, "reset", clock.now(), "alice")
    assert (
        await decider.decide(_m(rule.name, "node-011", clock.now(), kind="telemetry"), rule)
    ).accepted


async def test_approval_required_rule_waits_and_expires(bus: Bus, tmp_path: Path) -> None:
    (tmp_path / "r.yml").write_text(
        "rules:\n  - name: careful\n    on: xid\n    approval: required\n    actions:\n"
        "      - playbook: gpu_reset.yml\n"
    )
    rule = load_rules([tmp_path], ROOT / "playbooks").rules[0]
    clock = ManualClock(T0)
    decision = await _decider(bus, clock).decide(_m("careful"), rule)
    assert (
        decision.reason is Reason.APPROVAL_PENDING
        and decision.actions[0].playbook == "gpu_reset.yml"
    )
    assert await keys(bus.kv["locks"]) == [], "no lock is held while a person decides"
    store = ApprovalStore(bus.kv["control"])
    a = await store.create({"summary": "x", "node": "node-001", "intents": []}, T0, 60)
    approved = await store.decide(a, True, "alice", T0 + 10)
    assert approved["status"] == "approved" and approved["by"] == "alice"
    b = await store.create({"summary": "y", "node": "node-001", "intents": []}, T0, 60)
    with pytest.raises(Exception, match="expired"):
        await store.decide(b, True, "alice", T0 + 61)


async def test_global_dry_run_takes_no_lock_and_counts_no_attempt(
    bus: Bus, rules: dict[str, Rule]
) -> None:
    clock = ManualClock(T0)
    decider = _decider(bus, clock)
    decider.dry_run = True
    rule = rules["xid-48-dbe"]
    decision = await decider.decide(_m(rule.name), rule)
    assert decision.reason is Reason.DRY_RUN and decision.actions[0].playbook == "gpu_reset.yml"
    assert await AttemptCap(bus.kv["history"]).attempts("node-001", clock.now()) == []
    decider.dry_run = False
    assert (await decider.decide(_m(rule.name, gpu=5), rule)).accepted, "no lock was left behind"
