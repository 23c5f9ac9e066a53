"""Telemetry v2 through the real intake on a real nats-server: every sample published is
handled or dead-lettered with its reason, a replica that takes the stream over joins
samples to the static facts the first one kept in KV, and KV going away costs no sample.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import msgspec
import pytest
from gpuops.bus.conn import DLQ, TELEMETRY, Bus
from gpuops.bus.store import MemoryKV
from gpuops.bus.wire import TelemetryWriter
from gpuops.clock import SystemClock
from gpuops.errors import BusError
from gpuops.intake.compact import FactsBook
from gpuops.intake.consumer import Intake
from gpuops.match.facts import Telemetry
from gpuops.models import Event

from tests.conftest import wait_for

pytestmark = pytest.mark.faults
SUBJECT = "gpuops.telemetry.*.*"


def _gpus(temp: float, limit: float = 700.0) -> list[dict[str, Any]]:
    return [
        {"index": i, "uuid": f"GPU-{i}", "power_limit_w": limit, "temp_c": temp, "power_w": 300.0}
        for i in range(4)
    ]


def _intake(bus: Bus, book: FactsBook, handled: list[Event | Telemetry]) -> Intake:
    async def handle(event: Event | Telemetry) -> None:
        handled.append(event)

    return Intake(
        bus.js,
        SystemClock(),
        stream=TELEMETRY,
        subject=SUBJECT,
        durable="t-telemetry",  # one durable consumer: the second intake takes it over
        handler=handle,
        facts=book,
    )


async def _run_until(intake: Intake, done: Any) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        await wait_for(done, 30)
    finally:
        stop.set()
        await task


def _hostile(writer: TelemetryWriter, node: str) -> list[bytes]:
    body = msgspec.msgpack.decode(writer.encode(node, time.time(), _gpus(40.0)))
    nan = {**body, "gpus": [[math.nan if v == 40.0 else v for v in row] for row in body["gpus"]]}
    short = {**body, "gpus": [row[:3] for row in body["gpus"]]}
    return [msgspec.msgpack.encode(nan), msgspec.msgpack.encode(short)]


async def test_v2_samples_are_handled_or_dead_lettered_and_a_takeover_joins_from_kv(
    bus: Bus,
) -> None:
    agent, lost_keyframe = TelemetryWriter("agent"), TelemetryWriter("agent")
    lost_keyframe.encode("node-002", time.time(), _gpus(30.0))  # never arrives
    first = [agent.encode("node-001", time.time() + i, _gpus(40.0 + i)) for i in range(3)]
    first += [lost_keyframe.encode("node-002", time.time(), _gpus(31.0))]  # facts_unknown
    first += _hostile(agent, "node-001")  # schema, twice
    for payload, node in zip(
        first, ["node-001"] * 3 + ["node-002"] + ["node-001"] * 2, strict=True
    ):
        await bus.js.publish(f"gpuops.telemetry.{node}", payload)
    handled: list[Event | Telemetry] = []
    before = _intake(bus, FactsBook(bus.buckets.facts), handled)
    await _run_until(before, lambda: len(handled) == 3 and sum(before.dead.values()) == 3)
    assert before.dead == {"facts_unknown": 1, "schema": 2}

    later = [agent.encode("node-001", time.time() + 10 + i, _gpus(50.0 + i)) for i in range(2)]
    assert not any(b"static" in p for p in later)
    for payload in later:
        await bus.js.publish("gpuops.telemetry.node-001", payload)
    takeover = FactsBook(bus.buckets.facts)  # another replica: nothing in memory
    after = _intake(bus, takeover, handled)
    await _run_until(after, lambda: len(handled) == 5)
    assert not after.dead
    joined = [e for e in handled[3:] if isinstance(e, Telemetry)]
    assert [f["temp_c"] for f in joined[0].facts] == [50.0] * 4
    assert [f["power_limit_w"] for f in joined[1].facts] == [700.0] * 4, "the kept facts"
    assert takeover.facts_of("node-001") is not None and takeover.learnt == 0

    published = len(first) + len(later)
    assert published == len(handled) + sum(before.dead.values()) + sum(after.dead.values())
    assert (await bus.js.stream_info(DLQ)).state.messages == 3


class _FlakyKV(MemoryKV):
    """A KV whose server went away: while `gone`, every write fails as NatsKV's do then."""

    gone = True

    async def put(self, key: str, value: bytes) -> int:
        if self.gone:
            raise BusError("KV unavailable")
        return await super().put(key, value)


async def test_facts_not_written_to_kv_cost_no_sample_and_are_written_on_return(
    bus: Bus,
) -> None:
    agent, kv = TelemetryWriter("agent"), _FlakyKV("facts")
    book = FactsBook(kv)
    for i in range(2):
        await bus.js.publish(
            "gpuops.telemetry.node-001", agent.encode("node-001", time.time() + i, _gpus(40.0))
        )
    handled: list[Event | Telemetry] = []
    intake = _intake(bus, book, handled)
    await _run_until(intake, lambda: len(handled) == 2)
    assert not intake.dead and book.unsaved("node-001"), (
        "decided all the same; the facts wait for KV"
    )
    kv.gone = False  # the server is back
    await bus.js.publish(
        "gpuops.telemetry.node-001", agent.encode("node-001", time.time() + 2, _gpus(41.0))
    )
    await _run_until(intake, lambda: len(handled) == 3)
    assert not book.unsaved("node-001") and list(kv.data) == ["node-001"]
