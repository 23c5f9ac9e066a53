"""A redelivered event decided differently: each verdict is in the audit trail once.

The engine records a decision, then acks its event; a crash between the two brings the
event back, and by then the answer may have changed (the lock that dropped it was let go).
Both decisions are true of their time, and the intents stored belong to the second, so
both are recorded; a replay that comes out the same is recorded once.
"""

from __future__ import annotations

import json

from gpuops.bus.publish import MemoryPublisher
from gpuops.clock import ManualClock
from gpuops.match.loader import load_rules
from gpuops.models import AuditRecord, Reason

from tests.support import decide
from tests.unit.decide.helpers import ROOT, T0, engine_on, match

RULES = load_rules([ROOT / "rules"], ROOT / "playbooks")


def _records(publisher: MemoryPublisher, prefix: str) -> list[dict[str, object]]:
    return [json.loads(p) for s, p in publisher.messages if s.startswith(prefix)]


async def test_a_drop_then_an_acceptance_of_one_event_are_both_recorded_once() -> None:
    clock, publisher = ManualClock(T0), MemoryPublisher()
    engine = engine_on(clock, rules=RULES, publisher=publisher, equivalence_window_s=0)
    pipeline = engine.pipeline
    shown: list[AuditRecord] = []  # what a live view (the demo's timeline) is told of
    pipeline.auditor.listeners.append(shown.append)
    holder = await decide(pipeline, match("xid-79-gpu-lost", gpu=None, event_id="B"))
    assert holder is not None and holder.accepted  # a reboot holds node-001's lock
    clock.advance(1)
    event = match("xid-48-dbe", t=clock.now(), gpu=2, event_id="E")

    dropped = await decide(pipeline, event)  # recorded, then the engine died: not acked
    assert dropped is not None and dropped.reason is Reason.LOCKED
    assert await engine.locks.release("node-001", "B")  # the reboot ended meanwhile
    clock.advance(1)
    accepted = await decide(pipeline, event)  # the same event, redelivered
    assert accepted is not None and accepted.accepted
    again = await decide(pipeline, event)  # redelivered once more: the same answer
    assert again is not None and again.accepted

    intents = [i for i in _records(publisher, "gpuops.actions.") if i["event_id"] == "E"]
    decisions = [
        r["body"]
        for r in _records(publisher, "gpuops.audit.")
        if r["type"] == "decision" and r["body"]["decision"]["match"]["event_id"] == "E"
    ]
    verdicts = [d["decision"]["reason"] for d in decisions]
    assert verdicts == ["locked", "accepted"], "each verdict once, in the order decided"
    assert [i["key"] for i in intents] == decisions[1]["intents"], "the intent is explained"
    told = [
        r.body["decision"]["reason"]
        for r in shown
        if r.body.get("decision", {}).get("match", {}).get("event_id") == "E"
    ]
    assert told == ["locked", "accepted"], "a record stored once is shown once"
