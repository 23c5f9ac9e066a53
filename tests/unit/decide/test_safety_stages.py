"""Every safety stage in the live engine's order, on in-memory buckets (table tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.bus.buckets import Buckets
from gpuops.clock import ManualClock
from gpuops.decide.breaker import BreakerState, limit_for
from gpuops.errors import ConfigError
from gpuops.match.loader import load_rules
from gpuops.match.rules import Rule, RuleSet
from gpuops.models import Match, Reason
from gpuops.record.approvals import ApprovalStatus
from gpuops.record.nodestate import validation_nonce
from gpuops.record.notify import Notifier
from gpuops.settings import SafetySettings

from tests.support import decide
from tests.unit.decide.helpers import ROOT, T0, engine_on, match

RULESET = load_rules([ROOT / "rules"], ROOT / "playbooks")


@pytest.fixture
def rules() -> dict[str, Rule]:
    return {r.name: r for r in RULESET.rules}


async def test_silences_by_rule_node_group_label_and_expiry(rules: dict[str, Rule]) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock, lock_lease_s=1.0)
    decider, store = engine.pipeline.decider, engine.silences
    rule = rules["xid-48-dbe"]
    s = await store.add("group:rack-a", T0, T0 + 600, "rack work")
    assert (await decider.decide(match(rule.name), rule)).reason is Reason.SILENCED
    assert (await decider.decide(match(rule.name, "node-003"), rule)).accepted
    await store.add("label:rack=b", T0, T0 + 600, "row b maintenance")
    clock.advance(3)  # the stage re-reads silences every 2 s, not per event
    silenced = await decider.decide(match(rule.name, "node-015", clock.now()), rule)
    assert silenced.reason is Reason.SILENCED
    await store.add("node:node-004", T0 + 3600, T0 + 7200, "window tonight")  # maintenance
    clock.advance(3)
    assert (await decider.decide(match(rule.name, "node-004", clock.now()), rule)).accepted
    clock.advance(3700)
    later = await decider.decide(match(rule.name, "node-004", clock.now(), gpu=1), rule)
    assert later.reason is Reason.SILENCED
    assert await store.remove(s.id) and not await store.remove(s.id)
    assert (await decider.decide(match(rule.name, "node-002", clock.now()), rule)).accepted
    with pytest.raises(ConfigError, match="label:KEY=VALUE"):
        await store.add("rack-a", T0, T0 + 1, "no kind")


async def test_reboot_supersedes_a_reset_on_the_same_node(rules: dict[str, Rule]) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock)
    decider = engine.pipeline.decider
    first = await decider.decide(match("xid-79-gpu-lost"), rules["xid-79-gpu-lost"])
    assert first.accepted and first.actions[0].playbook == "reboot.yml"
    assert await engine.locks.release("node-001", first.match.event_id)  # the reboot finished
    clock.advance(60)
    reset = await decider.decide(match("xid-48-dbe", t=clock.now()), rules["xid-48-dbe"])
    assert reset.reason is Reason.SUPERSEDED and "reboot.yml" in reset.detail
    clock.advance(3600)
    again = await decider.decide(match("xid-48-dbe", t=clock.now(), gpu=2), rules["xid-48-dbe"])
    assert again.accepted


async def test_node_lock_one_remediation_at_a_time_even_across_replicas(
    rules: dict[str, Rule],
) -> None:
    clock, shared = ManualClock(T0), Buckets.memory()
    replica_a = engine_on(clock, shared).pipeline.decider
    replica_b = engine_on(clock, shared).pipeline.decider
    rule = rules["xid-48-dbe"]
    assert (await replica_a.decide(match(rule.name, gpu=1), rule)).accepted
    second = await replica_b.decide(match(rule.name, gpu=2), rule)
    assert second.reason is Reason.LOCKED and "xid-48-dbe" in second.detail
    clock.advance(1801)  # the holder died: its 30-minute lease ran out
    assert (await replica_b.decide(match(rule.name, gpu=2, t=clock.now()), rule)).accepted


async def test_cooldown_is_shared_by_replicas_through_kv(rules: dict[str, Rule]) -> None:
    clock, shared = ManualClock(T0), Buckets.memory()
    rule = rules["xid-48-dbe"]
    a = engine_on(clock, shared, lock_lease_s=1.0).pipeline.decider
    b = engine_on(clock, shared, lock_lease_s=1.0).pipeline.decider
    assert (await b.decide(match(rule.name, t=T0), rule)).accepted  # b has cached nothing
    clock.advance(5)
    assert (await a.decide(match(rule.name, t=T0 + 5), rule)).reason is Reason.COOLDOWN
    clock.advance(5)
    assert (await b.decide(match(rule.name, t=T0 + 10), rule)).reason is Reason.COOLDOWN


async def test_ladder_reboot_then_reprovision_then_needs_human(rules: dict[str, Rule]) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock)
    rule = rules["xid-79-gpu-lost"]
    seen = []
    for _ in range(3):
        d = await engine.pipeline.decider.decide(match(rule.name, t=clock.now(), gpu=None), rule)
        seen.append((d.reason, [a.playbook for a in d.actions]))
        await engine.locks.release("node-001", d.match.event_id)
        clock.advance(2 * 3600)  # past the rule's cooldown, inside the ladder's day
    assert seen[0] == (Reason.ACCEPTED, ["reboot.yml"])
    assert seen[1] == (Reason.ACCEPTED, ["reprovision.yml"])
    assert seen[2][0] is Reason.NEEDS_HUMAN


async def test_past_the_last_rung_a_run_still_in_flight_is_waited_for_not_escalated(
    rules: dict[str, Rule],
) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock, lock_lease_s=4 * 3600)  # a reprovision's lease: longer than 2 h
    rule, decider = rules["xid-79-gpu-lost"], engine.pipeline.decider
    first = await decider.decide(match(rule.name, t=clock.now(), gpu=None), rule)
    await engine.locks.release("node-001", first.match.event_id)
    clock.advance(2 * 3600)
    running = await decider.decide(match(rule.name, t=clock.now(), gpu=None), rule)
    assert running.actions[0].playbook == "reprovision.yml"  # the last rung, still running
    clock.advance(2 * 3600)  # the fault outlived the cooldown, not the reprovision
    waits = await decider.decide(match(rule.name, t=clock.now(), gpu=None), rule)
    assert waits.reason is Reason.LOCKED and "its run ends before" in waits.detail
    assert (await engine.states.get("node-001")).state.value != "needs_human"
    await engine.locks.release("node-001", running.match.event_id)  # it ended; the fault is back
    clock.advance(60)
    done = await decider.decide(match(rule.name, t=clock.now(), gpu=None), rule)
    assert done.reason is Reason.NEEDS_HUMAN and "2 attempts" in done.detail


async def test_past_the_last_rung_another_rule_s_lock_does_not_delay_the_hand_off(
    rules: dict[str, Rule],
) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock, lock_lease_s=4 * 3600)
    rule, decider = rules["xid-79-gpu-lost"], engine.pipeline.decider
    for _ in range(2):  # reboot, reprovision: both ran and ended
        d = await decider.decide(match(rule.name, t=clock.now(), gpu=None), rule)
        await engine.locks.release("node-001", d.match.event_id)
        clock.advance(2 * 3600)
    other = rules["xid-48-dbe"]
    assert (await decider.decide(match(other.name, t=clock.now()), other)).accepted  # its reset
    again = await decider.decide(match(rule.name, t=clock.now(), gpu=None), rule)
    assert again.reason is Reason.NEEDS_HUMAN, again


async def test_attempt_cap_survives_a_restart(rules: dict[str, Rule]) -> None:
    clock, shared = ManualClock(T0), Buckets.memory()
    rule = rules["xid-reset-class"]
    for i in range(5):
        engine = engine_on(clock, shared, equivalence_window_s=0)  # a new engine each time
        d = await engine.pipeline.decider.decide(match(rule.name, t=clock.now(), gpu=i), rule)
        assert d.accepted, d
        await engine.locks.release("node-001", d.match.event_id)
        clock.advance(3601)
    capped = await engine_on(clock, shared).pipeline.decider.decide(
        match(rule.name, t=clock.now(), gpu=6), rule
    )
    assert capped.reason is Reason.ATTEMPT_CAP and "cap 5" in capped.detail
    clock.advance(7 * 86400)
    later = await engine_on(clock, shared).pipeline.decider.decide(
        match(rule.name, t=clock.now(), gpu=7), rule
    )
    assert later.accepted


async def test_breaker_counts_resets_trips_and_half_open_needs_approval(
    rules: dict[str, Rule],
) -> None:
    clock, notifier = ManualClock(T0), Notifier()
    engine = engine_on(clock, notifier=notifier, breaker_share=0.1)  # 10% of 20 nodes: 2
    decider = engine.pipeline.decider
    rule = rules["xid-48-dbe"]  # a GPU reset takes capacity away too: the breaker counts it
    results = [
        (await decider.decide(match(rule.name, f"node-{i:03d}"), rule)).reason for i in range(1, 6)
    ]
    assert results == [Reason.ACCEPTED, Reason.ACCEPTED] + [Reason.BREAKER_OPEN] * 3
    assert any(m["topic"] == "breaker open" for m in notifier.sent)
    assert (await engine.breaker.get())[0].state is BreakerState.OPEN
    clock.advance(3600)  # open stays open: only a person closes it
    later = await decider.decide(match(rule.name, "node-009", clock.now()), rule)
    assert later.reason is Reason.BREAKER_OPEN
    await engine.breaker.set_state(BreakerState.HALF_OPEN, "test", clock.now(), "alice")
    half = await decider.decide(match(rule.name, "node-010", clock.now()), rule)
    assert half.reason is Reason.APPROVAL_PENDING and half.closes_breaker
    assert "half-open" in half.detail
    approved = await decider.decide(half.match, rule, approved_by="alice")
    assert approved.accepted and approved.closes_breaker
    assert (await engine.breaker.get())[0].state is BreakerState.CLOSED


@pytest.mark.parametrize(
    ("fleet", "limit"),
    [(2, 1), (3, 1), (4, 2), (11, 2), (40, 2), (41, 3), (100, 5), (400, 20), (12_500, 20)],
)
def test_the_default_breaker_lets_a_small_fleet_lose_two_nodes_but_never_half(
    fleet: int, limit: int
) -> None:
    s = SafetySettings()
    assert limit_for(fleet, s.breaker_share, s.breaker_absolute, s.breaker_floor) == limit


async def test_approval_holds_no_lock_and_an_approved_match_is_decided_again(
    tmp_path: Path,
) -> None:
    (tmp_path / "r.yml").write_text(
        "rules:\n  - name: careful\n    on: xid\n    approval: required\n    actions:\n"
        "      - playbook: gpu_reset.yml\n"
    )
    rules = load_rules([tmp_path], ROOT / "playbooks")
    rule, clock = rules.rules[0], ManualClock(T0)
    engine = engine_on(clock, rules=rules)
    d = await decide(engine.pipeline, match("careful"))
    assert d is not None and d.reason is Reason.APPROVAL_PENDING
    assert d.actions[0].playbook == "gpu_reset.yml"
    assert (await engine.locks.holder("node-001"))[0] is None, "no lock while a person decides"
    (held,) = await engine.approvals.all()
    assert held.status is ApprovalStatus.PENDING and held.match == d.match
    other = await engine.pipeline.decider.decide(match("careful", gpu=1), rule, approved_by="x")
    assert other.accepted
    clock.advance(10)
    answer = await engine.approvals.decide(held.id, True, "alice", clock.now())
    assert answer.status is ApprovalStatus.APPROVED
    again = await engine.pipeline.decider.decide(held.match, rule, approved_by="alice")
    assert again.reason is Reason.LOCKED, "an approved action still waits for the node's lock"
    with pytest.raises(ConfigError, match="already approved"):
        await engine.approvals.decide(held.id, False, "bob", clock.now())


async def test_global_dry_run_takes_no_lock_and_counts_no_attempt(rules: dict[str, Rule]) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock)
    decider = engine.pipeline.decider
    await engine.stores.dry_run.flip(True, "alice")
    rule = rules["xid-48-dbe"]
    d = await decider.decide(match(rule.name), rule)
    assert d.reason is Reason.DRY_RUN and d.actions[0].playbook == "gpu_reset.yml"
    cap = next(s for s in decider.stages if s.name == "attempt_cap")
    assert await cap.attempts("node-001", clock.now()) == 0  # type: ignore[attr-defined]
    await engine.stores.dry_run.flip(False, "alice")
    assert (await decider.decide(match(rule.name, gpu=5), rule)).accepted, "no lock left behind"


async def test_a_decision_repeated_after_a_crash_is_the_same_decision(
    rules: dict[str, Rule],
) -> None:
    """Commits are idempotent by event id: the redelivered event decides the same again."""
    clock = ManualClock(T0)
    engine = engine_on(clock, attempt_cap=1)
    rule, m = rules["xid-79-gpu-lost"], match("xid-79-gpu-lost", gpu=None)
    first = await engine.pipeline.decider.decide(m, rule)
    assert first.accepted and first.actions[0].playbook == "reboot.yml"
    clock.advance(2)  # the engine died after the commit, before the ack; the event comes back
    second = await engine.pipeline.decider.decide(m, rule)
    assert second.accepted and second.actions == first.actions, second
    other = await engine.pipeline.decider.decide(match(rule.name, t=T0 + 2, gpu=None), rule)
    assert other.reason is Reason.COOLDOWN, "a different event is still held back"


async def test_a_crash_between_check_and_write_frees_the_node_within_a_minute(
    rules: dict[str, Rule],
) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock)
    rule = rules["xid-48-dbe"]

    async def crash(_: object) -> None:
        raise RuntimeError("engine killed while writing the intent")

    with pytest.raises(RuntimeError):
        await engine.pipeline.decider.decide(match(rule.name), rule, crash)
    assert engine.pipeline.publisher.messages == []  # type: ignore[attr-defined]
    clock.advance(61)  # the pending lock's short lease; nothing was committed
    d = await engine.pipeline.decider.decide(match(rule.name, t=clock.now()), rule)
    assert d.accepted, "no cooldown, attempt or lock was left by the decision that died"


async def test_validation_is_a_rule_through_the_stages() -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock, rules=RuleSet(rules=()))
    record = engine.states.store.model(
        node="node-001", state="validating", quarantined=True, cause="decision:xid-79:n:e1"
    )
    nonce = validation_nonce(record)
    probe = match("validation-passed", gpu=None, kind="probe", outcome="pass", nonce=nonce)
    healthy = await decide(engine.pipeline, probe)
    assert healthy is not None and healthy.reason is Reason.NOT_APPLICABLE
    await engine.states.store.put(record, "node-001")
    scheduled = match("validation-passed", gpu=None, kind="probe", outcome="pass")
    stale = await decide(engine.pipeline, scheduled)
    assert stale is not None and stale.reason is Reason.NOT_APPLICABLE
    assert "does not answer the validation's request" in stale.detail
    passed = await decide(engine.pipeline, probe)
    assert passed is not None and passed.accepted
    assert [a.playbook for a in passed.actions] == ["return_to_service.yml"]
    assert passed.actions[0].vars["grade"] == 1, "the gate's grade 1 runs before the return"
    failed = match(
        "validation-failed", gpu=None, kind="probe", outcome="fail", error="bad sum", nonce=nonce
    )
    d = await decide(engine.pipeline, failed)
    assert d is not None and d.reason is Reason.NEEDS_HUMAN and "bad sum" in d.detail
    assert (await engine.states.get("node-001")).state.value == "needs_human"


async def test_the_site_sets_the_gate_s_grade_or_turns_it_off() -> None:
    for grade, want in ((3, {"grade": 3}), (0, {})):
        engine = engine_on(ManualClock(T0), rules=RuleSet(rules=()), validation_grade=grade)
        record = engine.states.store.model(
            node="node-001", state="validating", quarantined=True, cause="decision:xid-79:n:e1"
        )
        await engine.states.store.put(record, "node-001")
        nonce = validation_nonce(record)
        probe = match("validation-passed", gpu=None, kind="probe", outcome="pass", nonce=nonce)
        passed = await decide(engine.pipeline, probe)
        assert passed is not None and passed.accepted
        gate = {k: v for k, v in passed.actions[0].vars.items() if k == "grade"}
        assert gate == want, (grade, passed.actions[0].vars)


async def test_a_redelivered_event_gets_its_first_answer_though_others_came_between(
    rules: dict[str, Rule],
) -> None:
    """A per-node rule's cooldown remembers which event acted on which GPU: event A (GPU 1)
    wrote its intent and died before its record; B (GPU 2) was decided meanwhile; A
    redelivered must be accepted again for GPU 1 (its intent is already queued)."""
    clock = ManualClock(T0)
    engine = engine_on(clock, equivalence_window_s=0)
    decider, rule = engine.pipeline.decider, rules["xid-48-dbe"]
    assert rule.consolidate

    def on(gpu: int, event: str) -> Match:
        m = match(rule.name, t=clock.now(), gpu=gpu, event_id=event)
        return m.model_copy(update={"key": "node-001", "gpus": (gpu,)})

    first = await decider.decide(on(1, "A"), rule)
    assert first.accepted
    await engine.locks.release("node-001", "A")
    clock.advance(5)
    second = await decider.decide(on(2, "B"), rule)
    assert second.accepted and second.match.gpus == (2,)
    await engine.locks.release("node-001", "B")
    again = await decider.decide(on(1, "A"), rule)
    assert again.accepted and again.match.gpus == (1,), again
    repeat = await decider.decide(on(1, "C"), rule)  # GPU 1 still firing: cooling down
    assert repeat.reason is Reason.COOLDOWN
