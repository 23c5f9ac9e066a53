"""Reads of a stream leave no consumer behind: the server refuses a stream's thousandth
consumer, so a console or a status poll reading every second would otherwise lock every
reader (the engine's too) out within minutes."""

from __future__ import annotations

import time

import pytest
from gpuops.bus.conn import AUDIT, TELEMETRY, Bus
from gpuops.bus.store import NatsKV
from gpuops.console.views import read_since
from gpuops.record.audit import read_audit

pytestmark = pytest.mark.integration


async def _consumers(bus: Bus, stream: str) -> int:
    return int((await bus.js.stream_info(stream)).state.consumer_count)


async def test_reading_the_audit_trail_and_telemetry_again_and_again_leaves_no_consumer(
    bus: Bus,
) -> None:
    await bus.js.publish("gpuops.audit.node-001", b'{"type": "note"}')
    await bus.js.publish("gpuops.telemetry.node-001", b"{}")

    for _ in range(25):
        [r async for r in read_audit(bus.js)]
        [p async for p in read_since(bus.js, TELEMETRY, "gpuops.telemetry.>", time.time() - 60, 10)]

    assert await _consumers(bus, AUDIT) == 0
    assert await _consumers(bus, TELEMETRY) == 0


async def test_a_read_stopped_half_way_removes_its_consumer_too(bus: Bus) -> None:
    for i in range(3):
        await bus.js.publish(f"gpuops.telemetry.node-00{i}", b"{}")

    reader = read_since(bus.js, TELEMETRY, "gpuops.telemetry.>", time.time() - 60, 10)
    assert await anext(reader) == b"{}"
    await reader.aclose()

    assert await _consumers(bus, TELEMETRY) == 0


async def test_listing_keys_again_and_again_leaves_no_consumer(bus: Bus) -> None:
    kv = NatsKV(bus.kv["control"])
    await bus.kv["control"].put("switch.a", b"1")
    await bus.kv["control"].put("switch.b", b"1")
    await bus.kv["control"].delete("switch.b")

    for _ in range(25):
        assert await kv.keys("switch.") == ["switch.a"], "a deleted key is not listed"

    assert await _consumers(bus, "KV_gpuops_control") == 0
