"""Issue 12: a person hears of a fault once per episode, grouped, and recovery is timed."""

from __future__ import annotations

from typing import Any

from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import MemoryPublisher
from gpuops.clock import ManualClock
from gpuops.match.loader import load_rules
from gpuops.models import EVENT_ADAPTER, ActionSpec, Decision, Intent, Reason
from gpuops.record.metrics import Metrics
from gpuops.record.notify import Notifier
from gpuops.record.outbox import Grouping, Outbox, Tell
from gpuops.signing import sign, verify
from gpuops.spine.build import Engine
from gpuops.spine.ruletest import T0, case_event

from tests.unit.decide.helpers import ROOT, engine_on, match


async def _feed(
    engine: Engine, clock: ManualClock, node: str, gpus: list[dict[str, Any]], at: float
) -> None:
    clock.set(T0 + at)
    step = {"kind": "telemetry", "node": node, "gpus": gpus}
    await engine.pipeline.handle(EVENT_ADAPTER.validate_python(case_event(step, at)))


def _told(notifier: Notifier, topic: str) -> list[str]:
    return [m["text"] for m in notifier.sent if m["topic"] == topic]


async def test_attempt_cap_escalates_once_per_episode_then_at_the_repeat_interval() -> None:
    clock, notifier = ManualClock(T0), Notifier()
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    rule = rules.get("xid-reset-class")
    assert rule is not None
    engine = engine_on(clock, notifier=notifier, rules=rules, attempt_cap=1, equivalence_window_s=0)
    decider, recorder = engine.pipeline.decider, engine.recorder
    first = await decider.decide(match(rule.name, t=clock.now(), gpu=1), rule)
    assert first.accepted
    await engine.locks.release("node-001", first.match.event_id)
    reasons = []
    for i in range(200):  # the fault goes on; every sample is decided again
        clock.advance(3601 if i == 0 else 5)
        d = await decider.decide(match(rule.name, t=clock.now(), gpu=2), rule)
        reasons.append(d.reason)
        await recorder.decided(d, [])
    clock.advance(11)
    recorder.flush()
    assert set(reasons) == {Reason.ATTEMPT_CAP}
    assert len(_told(notifier, "needs-human")) == 1, notifier.sent
    open_ = await engine.recorder.episodes.all_open()
    assert [(e.rule, e.node, e.escalated) for e in open_] == [
        (rule.name, "node-001", "attempt_cap")
    ]
    for _ in range(4 * 60 + 5):  # the fault recurs every minute for over four hours
        clock.advance(60)
        d = await decider.decide(match(rule.name, t=clock.now(), gpu=2), rule)
        await recorder.decided(d, [])
        await recorder.sweep()
    clock.advance(61)
    recorder.flush()
    assert len(_told(notifier, "needs-human")) == 2  # Alertmanager's repeat_interval: 4 h
    assert _told(notifier, "resolved") == []
    clock.advance(301)  # no XID for five minutes: the episode is over
    await recorder.sweep()
    clock.advance(61)
    recorder.flush()
    assert len(_told(notifier, "resolved")) == 1
    assert await engine.recorder.episodes.all_open() == []


async def test_an_overheat_episode_resolves_when_every_gpu_cools_and_is_timed() -> None:
    clock, notifier = ManualClock(T0), Notifier()
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    engine = engine_on(clock, notifier=notifier, rules=rules)
    hot = [{"index": 2, "temp_c": 88}, {"index": 5, "temp_c": 89}]
    for t in range(0, 90, 5):  # two GPUs hot for 90 s: gpu-overheat fires (for: 60s)
        await _feed(engine, clock, "node-004", hot, t)
    await engine.recorder.sweep()  # per-sample touches reach KV with the sweep
    [ep] = [e for e in await engine.recorder.episodes.all_open() if e.rule == "gpu-overheat"]
    assert ep.gpus == (2, 5) and ep.decided_at is not None and ep.samples == 6
    await _feed(engine, clock, "node-004", [{"index": 2, "temp_c": 40}, hot[1]], 95)
    [still] = [e for e in await engine.recorder.episodes.all_open() if e.rule == "gpu-overheat"]
    assert engine.recorder.episodes.open[("gpu-overheat", "node-004")].gpus == (5,), still
    await _feed(
        engine, clock, "node-004", [{"index": 2, "temp_c": 40}, {"index": 5, "temp_c": 41}], 100
    )
    assert [e for e in await engine.recorder.episodes.all_open() if e.rule == "gpu-overheat"] == []
    recover = engine.metrics.detect_to_recover.labels("gpu-overheat")
    assert recover._sum.get() == 100 - 60  # detected at the firing sample (60 s), cleared at 100 s
    clock.advance(11)
    engine.recorder.flush()
    assert len(_told(notifier, "incident")) == 1
    assert len(_told(notifier, "resolved")) == 1


def test_a_storm_is_one_message_and_gpu_notes_under_a_node_fault_are_inhibited() -> None:
    notifier = Notifier()
    box = Outbox(notifier, Grouping(group_wait_s=10, group_interval_s=60, storm_nodes=10))
    for i in range(50):
        box.add(Tell("incident", "gpu-overheat", f"node-{i:03d}", "gpu", "hot"), T0 + i * 0.1)
    assert box.flush(T0 + 5) == 0  # still gathering (group wait)
    assert box.flush(T0 + 10) == 1
    [storm] = notifier.sent
    assert storm["topic"] == "storm" and "50 notes on 50 nodes" in storm["text"]

    notifier.sent.clear()
    box = Outbox(notifier, Grouping(group_wait_s=0, storm_nodes=10))
    box.add(Tell("incident", "power-brake", "n1", "gpu", "brake on GPU 3"), T0)
    box.add(Tell("incident", "power-brake", "n2", "gpu", "brake on GPU 1"), T0)
    box.add(Tell("needs-human", "xid-79", "n1", "node", "n1 fell off the bus"), T0)
    assert box.flush(T0, inhibited=lambda: {"n1"}) == 2 and box.inhibited == 1
    texts = [m["text"] for m in notifier.sent]
    assert any("n2" in t for t in texts) and any("fell off the bus" in t for t in texts)
    assert not any("GPU 3" in t for t in texts)


async def test_a_gpu_that_needs_a_person_is_told_under_a_node_episode_that_acts_on_nothing() -> (
    None
):
    clock, notifier = ManualClock(T0), Notifier()
    recorder = engine_on(clock, notifier=notifier).recorder
    # A node-level fault that only waits: a drift held for approval (no reboot, no drain).
    drift = match("drift-needs-approval", gpu=None, kind="drift", t=clock.now())
    await recorder.decided(
        Decision(
            match=drift,
            accepted=False,
            reason=Reason.APPROVAL_PENDING,
            actions=(ActionSpec(playbook="baseline.yml"),),
        ),
        [],
    )
    # Meanwhile a GPU's ladder ran out: only a person can help it.
    gpu = match("xid_79_gpu_reset", gpu=3, t=clock.now()).model_copy(update={"gpus": (3,)})
    capped = "3 resets in 1d; a person must look"
    await recorder.decided(
        Decision(match=gpu, accepted=False, reason=Reason.ATTEMPT_CAP, detail=capped), []
    )
    assert recorder.episodes.node_level() == {"node-001"}
    clock.advance(15)
    recorder.flush()
    [human] = _told(notifier, "needs-human")
    assert "node-001 GPU 3" in human and capped in human
    assert recorder.outbox.inhibited == 0


def test_a_group_of_a_few_nodes_is_one_message_naming_them() -> None:
    notifier = Notifier()
    box = Outbox(notifier, Grouping(group_wait_s=10, group_interval_s=60, storm_nodes=10))
    for node in ("n3", "n1", "n2"):
        box.add(Tell("needs-human", "power-brake", node, "node", f"{node} braked"), T0)
    box.flush(T0 + 10)
    [message] = notifier.sent
    assert "power-brake on 3 nodes (n1, n2, n3)" in message["text"]
    box.add(Tell("needs-human", "power-brake", "n4", "node", "n4 braked"), T0 + 20)
    assert box.flush(T0 + 40) == 0  # the group interval holds the next message back
    assert box.flush(T0 + 70) == 1


def test_metrics_have_the_latency_histograms() -> None:
    text = Metrics().exposition().decode()
    for name in (
        "gpuops_detect_to_decide_seconds",
        "gpuops_decide_to_run_seconds",
        "gpuops_run_duration_seconds",
        "gpuops_detect_to_recover_seconds",
        "gpuops_episodes_open",
    ):
        assert name in text


async def test_a_restarted_engine_takes_over_open_episodes_and_none_stays_open_forever() -> None:
    clock, shared = ManualClock(T0), Buckets.memory()
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    first = engine_on(clock, shared, rules=rules)
    for t in range(0, 90, 5):  # GPU 2 overheats: an episode opens, the engine then dies
        await _feed(first, clock, "node-006", [{"index": 2, "temp_c": 88}], t)
    await first.recorder.sweep()
    assert [e.rule for e in await first.recorder.episodes.all_open()] == ["gpu-overheat"]
    notifier = Notifier()
    second = engine_on(clock, shared, notifier=notifier, rules=rules)
    clock.advance(3600)  # the node went quiet (no sample says the GPU cooled)
    await second.recorder.sweep()
    assert await second.recorder.episodes.all_open() == []
    second.recorder.flush(force=True)
    assert any("no match for 3600s" in m["text"] for m in notifier.sent), notifier.sent


def test_a_storm_still_names_every_node_that_needs_a_person() -> None:
    notifier = Notifier()
    box = Outbox(notifier, Grouping(group_wait_s=10, storm_nodes=3))
    for i in range(12):
        box.add(Tell("incident", "gpu-overheat", f"node-{i:03d}", "gpu", "hot"), T0)
        box.add(Tell("needs-human", "gpu-overheat", f"node-{i:03d}", "node", "drained"), T0)
    assert box.flush(T0 + 1) == 0
    assert box.flush(T0 + 1, force=True) == 2  # at shutdown nothing waits
    [human] = [m["text"] for m in notifier.sent if m["topic"] == "needs-human"]
    assert all(f"node-{i:03d}" in human for i in range(12))
    assert any(m["topic"] == "storm" for m in notifier.sent)


async def test_an_intent_names_the_episode_its_decision_opened_and_later_ones_join() -> None:
    clock, published = ManualClock(T0), MemoryPublisher()
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    engine = engine_on(clock, rules=rules, publisher=published, equivalence_window_s=0)
    xid = {"kind": "xid", "node": "node-003", "data": {"xid": 79, "gpu": 1}}
    await engine.pipeline.handle(EVENT_ADAPTER.validate_python(case_event(xid, 0)))
    [intent] = [Intent.model_validate_json(p) for s, p in published.messages if ".actions." in s]
    [opened] = await engine.recorder.episodes.all_open()
    assert intent.episode == opened.id == f"{intent.rule}@node-003:{int(T0)}"
    assert verify(intent, engine.pipeline.signing_key), "signed with its episode"
    # The fault again, once the node is free: its intent names the same, still open episode.
    await engine.locks.release("node-003", intent.event_id)
    clock.advance(7200)
    await engine.pipeline.handle(EVENT_ADAPTER.validate_python(case_event(xid, 7200)))
    later = [Intent.model_validate_json(p) for s, p in published.messages if ".actions." in s]
    assert len(later) == 2 and later[1].key != intent.key, later
    assert later[1].episode == opened.id
    assert later[1].decision is not None and later[1].decision.episode == opened.id


# An intent as the engine at 355ee68 wrote it, before intents named an episode (none on
# the intent or its decision), signed by that engine's gpuops.signing.sign under the key
# b"k" * 32: the test fails if today's body for an unnamed intent drifts from the old one.
OLD_INTENT = (
    '{"key":"k1","rule":"r","node":"node-001","gpu":1,"gpus":[1],"action":{"playbook":'
    '"drain.yml","ref":null,"vars":{"reason":"x"},"timeout_s":600.0},"event_id":"e",'
    '"event_ts":1.0,"decided_at":2.0,"decision":{"match":{"rule":"r","kind":"xid",'
    '"node":"node-001","gpu":1,"gpus":[1],"key":"node-001/1","event_id":"e","event_ts":1.0,'
    '"at":1.5,"severity":"critical","facts":{"xid":79}},"accepted":true,"reason":"accepted",'
    '"detail":"rung 0","actions":[{"playbook":"drain.yml","ref":null,"vars":{"reason":"x"},'
    '"timeout_s":600.0}],"notify":false,"rung":0,"holds_lock":true,"closes_breaker":false,'
    '"approved_by":null},'
    '"signature":"07bc26c1bad0d5602339d88a284dab8e4c1bbb678d9b6de2b8478ca4e08816e9"}'
)


def test_an_intent_an_older_engine_signed_verifies_after_the_upgrade() -> None:
    key = b"k" * 32
    old = Intent.model_validate_json(OLD_INTENT)
    assert old.episode == "" and old.decision is not None and old.decision.episode == ""
    assert verify(old, key), "queued before the upgrade, still the engine's"
    assert sign(old, key).signature == old.signature, "today's body for it is the old body"
    assert not verify(old.model_copy(update={"decided_at": 3.0}), key)
    named = sign(old.model_copy(update={"episode": "r@node-001:2"}), key)
    assert verify(named, key)
    assert not verify(named.model_copy(update={"episode": "r@node-001:3"}), key)


async def test_an_episode_is_named_for_its_event_so_a_redelivery_names_the_same_one() -> None:
    # A crash after the intents were stored and before the record was written redelivers
    # the event to a later clock: the episode it opens must have the name the stored
    # intents carry, so the name comes from the event, never from the time of deciding.
    xid = {"kind": "xid", "node": "node-003", "data": {"xid": 79, "gpu": 1}}
    named: list[tuple[str, str]] = []
    for late in (2.0, 47.0):
        clock, published = ManualClock(T0 + late), MemoryPublisher()
        rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
        engine = engine_on(clock, rules=rules, publisher=published, equivalence_window_s=0)
        await engine.pipeline.handle(EVENT_ADAPTER.validate_python(case_event(xid, 0)))
        sent = published.messages
        [intent] = [Intent.model_validate_json(p) for s, p in sent if ".actions." in s]
        [opened] = await engine.recorder.episodes.all_open()
        assert intent.decided_at == T0 + late
        named.append((intent.episode, opened.id))
    assert named[0] == named[1] == (f"{intent.rule}@node-003:{int(T0)}",) * 2
