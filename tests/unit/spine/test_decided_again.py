"""A decision the bus failed is decided again, and is then the decision it would have been.

Deciders racing for one record (a storm's partitions counting nodes into the fleet
breaker) lose compare-and-sets; in CI, on a loaded host, one decision lost all sixteen of
its tries, and the telemetry sample behind it was acked with its batch: a drain never
decided. The stages now pause between lost tries, and the pipeline decides a decision the
bus failed again (`DECIDE_TRIES`), with every write idempotent by event id.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import MemoryPublisher
from gpuops.bus.store import CAS_TRIES, MemoryKV
from gpuops.clock import ManualClock
from gpuops.decide import breaker
from gpuops.errors import BusError
from gpuops.match.loader import load_rules
from gpuops.models import Reason
from gpuops.record.metrics import total
from gpuops.record.notify import Notifier
from gpuops.spine import pipeline
from gpuops.spine.pipeline import DECIDE_TRIES

from tests.support import decide
from tests.unit.decide.helpers import ROOT, T0, engine_on, match
from tests.unit.decide.test_diagnose_rules import RULES as FABRIC  # ib-slow: a fabric check

RULES = load_rules([ROOT / "rules"], ROOT / "playbooks")


class LosingKV(MemoryKV):
    """A bucket whose first `losses` compare-and-sets lose, as to other deciders."""

    def __init__(self, name: str, losses: int) -> None:
        super().__init__(name)
        self.losses = losses

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        if self.losses > 0:
            self.losses -= 1
            return None
        return await super().cas(key, value, revision)


class FailingPublisher(MemoryPublisher):
    """Fails its first `failures` publishes (to subjects under `under`) with `error`."""

    def __init__(self, failures: int, error: Exception, under: str = "gpuops.") -> None:
        super().__init__()
        self.failures, self.error, self.under, self.calls = failures, error, under, 0

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None) -> bool:
        self.calls += 1
        if self.failures > 0 and subject.startswith(self.under):
            self.failures -= 1
            raise self.error
        return await super().publish(subject, payload, msg_id)


def _records(publisher: MemoryPublisher, prefix: str) -> list[dict[str, object]]:
    return [json.loads(p) for s, p in publisher.messages if s.startswith(prefix)]


async def test_a_breaker_count_that_lost_every_try_is_decided_again_and_counted_once() -> None:
    control = LosingKV("control", losses=CAS_TRIES + 3)  # the first decision runs out
    buckets = replace(Buckets.memory(), control=control)
    publisher = MemoryPublisher()
    engine = engine_on(
        ManualClock(T0), buckets, rules=RULES, publisher=publisher, breaker_absolute=5
    )
    d = await decide(engine.pipeline, match("gpu-overheat", kind="telemetry", event_id="E"))
    assert d.accepted, d.detail
    assert control.losses == 0, "the lost tries were all taken"
    state, _ = await engine.breaker.get()
    assert [e.node for e in state.entries] == ["node-001"], "the node is counted in once"
    intents = [i for i in _records(publisher, "gpuops.actions.") if i["event_id"] == "E"]
    assert [i["action"]["playbook"] for i in intents] == ["drain.yml"], (
        "one intent: decided again, it has the same key (the queue keeps one)"
    )
    decided = [r for r in _records(publisher, "gpuops.audit.") if r["type"] == "decision"]
    assert len(decided) == 1, "one audit record: the same message id"


async def test_a_store_the_bus_failed_is_decided_again_with_its_intent_stored_once() -> None:
    publisher = FailingPublisher(failures=DECIDE_TRIES - 1, error=TimeoutError("nats slow"))
    engine = engine_on(ManualClock(T0), rules=RULES, publisher=publisher)
    d = await decide(engine.pipeline, match("gpu-overheat", kind="telemetry", event_id="E"))
    assert d.accepted, d.detail
    intents = [i for i in _records(publisher, "gpuops.actions.") if i["event_id"] == "E"]
    assert len(intents) == 1, "one intent: written on each try, under the same key"
    [decided] = [r for r in _records(publisher, "gpuops.audit.") if r["type"] == "decision"]
    assert decided["body"]["intents"] == [intents[0]["key"]], "the audit names it once"


async def test_an_audit_the_bus_failed_is_written_again_and_the_decision_counted_once() -> None:
    publisher = FailingPublisher(failures=1, error=TimeoutError("nats slow"), under="gpuops.audit.")
    engine = engine_on(ManualClock(T0), rules=RULES, publisher=publisher)
    d = await decide(engine.pipeline, match("gpu-overheat", kind="telemetry", event_id="E"))
    assert d.accepted, d.detail
    decided = [r for r in _records(publisher, "gpuops.audit.") if r["type"] == "decision"]
    assert len(decided) == 1, "the decision is in the audit once"
    assert total(engine.metrics.decisions) == 1, (
        "and counted once, though it was recorded on two tries"
    )


async def test_a_drop_whose_audit_failed_is_audited_when_decided_again() -> None:
    """A drop's record is written once a period per rule, key and verdict; the same drop
    decided again is not a repeat of itself, so its record is written on the next try."""
    publisher = FailingPublisher(failures=0, error=TimeoutError("nats slow"), under="gpuops.audit.")
    engine = engine_on(ManualClock(T0), rules=RULES, publisher=publisher)
    first = await decide(engine.pipeline, match("gpu-overheat", kind="telemetry", event_id="E1"))
    assert first.accepted, first.detail
    publisher.failures = 1  # the next audit write fails once
    again = await decide(engine.pipeline, match("gpu-overheat", kind="telemetry", event_id="E2"))
    assert again.reason is Reason.COOLDOWN, again.detail
    decided = [r["body"] for r in _records(publisher, "gpuops.audit.") if r["type"] == "decision"]
    verdicts = [(b["decision"]["match"]["event_id"], b["decision"]["reason"]) for b in decided]
    assert verdicts == [("E1", "accepted"), ("E2", "cooldown")], "the drop is in the audit"
    [episode] = engine.pipeline.recorder.episodes.open.values()
    assert episode.samples == 2, "two decisions, two samples, though E2 was folded on two tries"


async def test_a_bus_that_stays_away_fails_the_handling_after_its_tries() -> None:
    publisher = FailingPublisher(failures=100, error=TimeoutError("nats away"))
    engine = engine_on(ManualClock(T0), rules=RULES, publisher=publisher)
    with pytest.raises(TimeoutError, match="nats away"):
        await decide(engine.pipeline, match("gpu-overheat", kind="telemetry", event_id="E"))
    assert publisher.calls == DECIDE_TRIES, "tried again, but not forever"


async def test_a_fault_of_the_engine_s_own_is_not_decided_again() -> None:
    publisher = FailingPublisher(failures=1, error=RuntimeError("a bug"))
    engine = engine_on(ManualClock(T0), rules=RULES, publisher=publisher)
    with pytest.raises(RuntimeError, match="a bug"):
        await decide(engine.pipeline, match("gpu-overheat", kind="telemetry", event_id="E"))
    assert publisher.calls == 1, "a bug is not the bus: trying again would hide it"


async def test_a_fabric_check_decided_again_keeps_its_peers_and_locks_no_others(
    tmp_path: Path,
) -> None:
    """Review of issue 30: a fabric check's peers are picked among the nodes nobody has
    locked, and decided again its first try's peer locks counted as others': it picked
    new peers, which the audit named while the stored intent kept the first (the queue
    keeps one by key); the new ones stayed locked, unused, for the lock's lease."""
    (tmp_path / "diag.yml").write_text(FABRIC)
    rules = load_rules([tmp_path], ROOT / "playbooks")
    publisher = FailingPublisher(failures=1, error=TimeoutError("nats slow"), under="gpuops.audit.")
    engine = engine_on(ManualClock(T0), rules=rules, publisher=publisher)
    fault = match("ib-slow", gpu=None, kind="ib", ports_down=1, event_id="E")
    d = await decide(engine.pipeline, fault)
    assert d.accepted, d.detail
    [intent] = [i for i in _records(publisher, "gpuops.actions.") if i["event_id"] == "E"]
    peers = intent["action"]["vars"]["peers"]
    assert len(peers) == 2 and d.actions[0].vars["peers"] == peers, "decided as stored"
    [audited] = [r for r in _records(publisher, "gpuops.audit.") if r["type"] == "decision"]
    assert audited["body"]["decision"]["actions"][0]["vars"]["peers"] == peers
    held = {n for n in engine.pipeline.inventory.hosts if (await engine.locks.holder(n))[0]}
    assert held == {"node-001", *peers}, "the node and its peers, no one else"


class BreakerContended(MemoryKV):
    """Other deciders win every compare-and-set on the breaker's record, `losses` times."""

    losses = 0

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        if key.startswith("breaker.") and self.losses > 0:
            self.losses -= 1
            return None
        return await super().cas(key, value, revision)


async def test_a_decision_that_failed_every_try_leaves_no_budget_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review of issue 30: the domain budget had counted the node in before the breaker,
    further on, failed every try; nothing gave the entry back (the sample behind it was
    dead-lettered, never decided again), and the rack's next fault was handed to a
    person as over budget. A check that fails now gives back what the passed took."""

    async def no_pause(lost: int) -> None:
        return None

    monkeypatch.setattr(breaker, "contended", no_pause)
    monkeypatch.setattr(pipeline, "DECIDE_PAUSE_S", 0.0)
    control = BreakerContended("control")
    buckets = replace(Buckets.memory(), control=control)
    clock = ManualClock(T0)
    engine = engine_on(clock, buckets, rules=RULES, domain_budgets={"rack": {"nodes": 1}})
    control.losses = DECIDE_TRIES * CAS_TRIES
    with pytest.raises(BusError, match="too many concurrent changes"):
        await decide(
            engine.pipeline, match("gpu-overheat", "node-001", kind="telemetry", event_id="E1")
        )
    lock, _ = await engine.locks.holder("node-001")
    clock.advance(120)
    same_rack = match("gpu-overheat", "node-002", t=clock.now(), kind="telemetry", event_id="E2")
    d = await decide(engine.pipeline, same_rack)
    assert d.accepted, f"the rack's budget is whole: {d.reason.value} {d.detail}"
    assert lock is None, "its pending lock given back too"


async def test_an_approval_decided_again_asks_people_once() -> None:
    """Review of issue 30: the approval record is opened once by its id, but people were
    asked on every try: an audit write that failed once asked them twice."""
    publisher = FailingPublisher(failures=1, error=TimeoutError("nats slow"), under="gpuops.audit.")
    notifier = Notifier()
    engine = engine_on(ManualClock(T0), rules=RULES, publisher=publisher, notifier=notifier)
    drift = match(
        "drift-needs-approval", gpu=None, kind="drift", event_id="E",
        setting="ecc_mode", expected="1", actual="0",
    )  # fmt: skip
    d = await decide(engine.pipeline, drift)
    assert d.reason is Reason.APPROVAL_PENDING
    [approval] = await engine.approvals.all()
    asked = [m["text"] for m in notifier.sent if m["topic"] == "approval needed"]
    assert len(asked) == 1 and approval.id in asked[0], asked
    decided = [r for r in _records(publisher, "gpuops.audit.") if r["type"] == "decision"]
    assert len(decided) == 1, "written again after the failure, stored once"
