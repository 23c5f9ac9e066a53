"""Drops suppressed as repeats are not lost when their slot is swept: the sweep writes
the last one with the count of the others, so every decision is in the audit trail,
as a record or in a record's count."""

from __future__ import annotations

import json
from typing import Any

from gpuops.bus.publish import MemoryPublisher
from gpuops.clock import ManualClock
from gpuops.models import Decision, Reason
from gpuops.record.recorder import REPEAT_PERIOD_S

from tests.unit.decide.helpers import T0, engine_on, match


def _cooldown(event_id: str, t: float) -> Decision:
    m = match("xid-79-gpu-lost", t=t, event_id=event_id)
    return Decision(match=m, accepted=False, reason=Reason.COOLDOWN, detail="cooldown")


def _decisions(publisher: MemoryPublisher) -> list[dict[str, Any]]:
    records = [json.loads(payload) for _, payload in publisher.messages]
    return [r for r in records if r["type"] == "decision"]


async def test_a_swept_slot_writes_the_repeats_it_suppressed() -> None:
    clock, publisher = ManualClock(T0), MemoryPublisher()
    recorder = engine_on(clock, publisher=publisher).recorder
    for i in range(30):  # a cooldown drop every 2 s for a minute
        await recorder.decided(_cooldown(f"ev-{i}", clock.now()), [])
        clock.advance(2)
    clock.advance(REPEAT_PERIOD_S + 1)
    await recorder.sweep()
    swept = _decisions(publisher)
    assert [r["body"]["decision"]["match"]["event_id"] for r in swept] == ["ev-0", "ev-29"]
    assert [r["body"]["repeats_suppressed"] for r in swept] == [0, 28]

    await recorder.decided(_cooldown("ev-late", clock.now()), [])
    await recorder.sweep()  # nothing suppressed since: nothing more to write
    records = _decisions(publisher)
    assert len(records) == 3 and records[-1]["body"]["repeats_suppressed"] == 0
    assert len(records) + sum(r["body"]["repeats_suppressed"] for r in records) == 31
