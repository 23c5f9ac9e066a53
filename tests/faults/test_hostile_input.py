"""Issue 10, defect 10: non-finite numbers and subjects with an extra token got through.

Through the real intake on a real nats-server: every message published is either
handled or dead-lettered with its reason, and nothing hostile reaches the handler.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from gpuops.bus.conn import DLQ, EVENTS, TELEMETRY, Bus
from gpuops.clock import SystemClock
from gpuops.intake.consumer import Intake
from gpuops.models import Event, new_event
from nats.js.errors import NoStreamResponseError

from tests.conftest import wait_for

pytestmark = pytest.mark.faults


def _telemetry(node: str, temp: str) -> bytes:
    event = new_event("telemetry", node, time.time(), {"gpus": [{"index": 0, "temp_c": 1}]}, "t")
    return json.dumps(event).replace('"temp_c": 1', f'"temp_c": {temp}').encode()


def _event(kind: str, node: str, data: dict[str, Any]) -> bytes:
    return json.dumps(new_event(kind, node, time.time(), data, "t")).encode()


async def _consume(bus: Bus, stream: str, subject: str, handled: list[Event]) -> Intake:
    async def handle(event: Event) -> None:
        handled.append(event)

    return Intake(
        bus.js, SystemClock(), stream=stream, subject=subject, durable=f"t-{stream}", handler=handle
    )


async def test_hostile_numbers_and_subjects_are_dead_lettered(bus: Bus) -> None:
    published = {
        "gpuops.telemetry.node-001": [_telemetry("node-001", v) for v in ("NaN", "Infinity")],
        "gpuops.telemetry.node-002": [
            _telemetry("node-002", v) for v in ("1e400", "1" + "0" * 400)
        ],
        # node-002's XID on node-001's subject
        "gpuops.events.xid.node-001": [_event("xid", "node-002", {"gpu": 0, "xid": 79})],
        "gpuops.events.heartbeat.node-001": [_event("heartbeat", "node-001", {"seq": 1})],
    }
    for subject, payloads in published.items():
        for payload in payloads:
            await bus.js.publish(subject, payload)
    # A subject with an extra token names no node: no stream stores it, and the publisher
    # is told so (nothing is taken and then lost).
    with pytest.raises(NoStreamResponseError):
        await bus.js.publish("gpuops.events.xid.node-001.x", _event("xid", "node-001", {}))
    await bus.js.publish("gpuops.telemetry.node-001", _telemetry("node-001", "88.5"))
    handled: list[Event] = []
    intakes = [
        await _consume(bus, TELEMETRY, "gpuops.telemetry.*.*", handled),
        await _consume(bus, EVENTS, "gpuops.events.*.*.*", handled),
    ]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(i.run(stop)) for i in intakes]
    try:  # each stream's good message comes last: once both are handled, all were read
        await wait_for(lambda: len(handled) == 2, 30)
    finally:
        stop.set()
        await asyncio.gather(*tasks)

    assert sorted(e.kind for e in handled) == ["heartbeat", "telemetry"]
    assert all(e.node == "node-001" for e in handled)
    dead = intakes[0].dead + intakes[1].dead
    assert dead == {"schema": 4, "subject_mismatch": 1}
    assert (await bus.js.stream_info(DLQ)).state.messages == 5
    sent = sum(len(p) for p in published.values()) + 1
    assert sent == len(handled) + sum(dead.values())
