"""Reads of a stream leave no consumer behind: the server refuses a stream's thousandth
consumer, so a console or a status poll reading every second would otherwise lock every
reader (the engine's too) out within minutes.

A reader may not delete a consumer (bus/auth.py: it could delete the engine's), so a
read's consumer is an ephemeral one the server removes `ABANDONED_AFTER_S` after its
last pull; these tests make that short and wait for the server to do it."""

from __future__ import annotations

import asyncio
import time

import pytest
from gpuops.bus import reader
from gpuops.bus.conn import AUDIT, EVENTS, TELEMETRY, Bus
from gpuops.bus.store import NatsKV
from gpuops.console.views import read_since
from gpuops.record.audit import read_audit
from nats.js.api import ConsumerConfig, DeliverPolicy

from tests.conftest import wait_for

pytestmark = pytest.mark.integration
ABANDONED_AFTER_S = 1.0
# The server removes an inactive consumer on a timer: allow it well past the threshold.
GONE_WITHIN_S = 10.0


@pytest.fixture(autouse=True)
def _short_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "ABANDONED_AFTER_S", ABANDONED_AFTER_S)


async def _consumers(bus: Bus, stream: str) -> int:
    return int((await bus.js.stream_info(stream)).state.consumer_count)


async def _none_left(bus: Bus, *streams: str) -> bool:
    return all([await _consumers(bus, stream) == 0 for stream in streams])


async def _all_ephemeral(bus: Bus, stream: str) -> int:
    """How many consumers `stream` has; each must be a read's: no durable name, and
    gone after the reader's inactive threshold."""
    infos = await bus.js.consumers_info(stream)
    for info in infos:
        assert info.config.durable_name is None, f"{info.name} is durable"
        assert info.config.inactive_threshold == pytest.approx(ABANDONED_AFTER_S)
    return len(infos)


async def test_reading_the_audit_trail_and_telemetry_again_and_again_leaves_no_consumer(
    bus: Bus,
) -> None:
    await bus.js.publish("gpuops.audit.node-001", b'{"type": "note"}')
    await bus.js.publish("gpuops.telemetry.node-001", b"{}")

    for _ in range(25):
        [r async for r in read_audit(bus.js)]
        since = time.time() - 60
        assert [p async for p in read_since(bus.js, TELEMETRY, "gpuops.telemetry.>", since, 10)]

    for stream in (AUDIT, TELEMETRY):
        assert await _all_ephemeral(bus, stream) <= 25, "one consumer a read at most"
    await wait_for(lambda: _none_left(bus, AUDIT, TELEMETRY), GONE_WITHIN_S)


async def test_a_read_stopped_half_way_leaves_no_consumer_either(bus: Bus) -> None:
    for i in range(3):
        await bus.js.publish(f"gpuops.telemetry.node-00{i}", b"{}")

    read = read_since(bus.js, TELEMETRY, "gpuops.telemetry.>", time.time() - 60, 10)
    assert await anext(read) == b"{}"
    assert await _all_ephemeral(bus, TELEMETRY) == 1, "the read's own consumer, ephemeral"
    await read.aclose()

    await wait_for(lambda: _none_left(bus, TELEMETRY), GONE_WITHIN_S)


async def test_listing_keys_again_and_again_leaves_no_consumer(bus: Bus) -> None:
    kv = NatsKV(bus.kv["control"])
    await bus.kv["control"].put("switch.a", b"1")
    await bus.kv["control"].put("switch.b", b"1")
    await bus.kv["control"].delete("switch.b")

    for _ in range(25):
        assert await kv.keys("switch.") == ["switch.a"], "a deleted key is not listed"

    assert await _all_ephemeral(bus, "KV_gpuops_control") <= 25
    await wait_for(lambda: _none_left(bus, "KV_gpuops_control"), GONE_WITHIN_S)


async def test_a_reads_consumer_is_told_the_shipped_threshold(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.undo()  # the fixture's short threshold: this is the shipped one
    await bus.js.publish("gpuops.telemetry.node-001", b"{}")
    read = read_since(bus.js, TELEMETRY, "gpuops.telemetry.>", time.time() - 60, 10)
    try:
        assert await anext(read) == b"{}"
        [info] = await bus.js.consumers_info(TELEMETRY)
        assert info.config.durable_name is None
        assert info.config.inactive_threshold == pytest.approx(reader.ABANDONED_AFTER_S)
        assert reader.ABANDONED_AFTER_S <= 10.0, "a page a second keeps ~10 consumers alive"
    finally:
        await read.aclose()


async def test_a_slot_read_that_waits_longer_than_a_read_may_goes_on(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of issue 30: an export merging events and telemetry leaves one stream's read
    waiting while it writes hours of the other's; its slot's consumer, removed like a
    read's after 10 s unused, was gone under it and the export died mid-way."""
    monkeypatch.setattr(reader, "SLOT_ABANDONED_AFTER_S", 30.0, raising=False)
    for n in range(4):
        await bus.js.publish("gpuops.events.xid.node-001", b'{"n": %d}' % n)
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    async with reader.slot_read(bus.js, "gpuops.events.>", EVENTS, config) as sub:
        assert len(await sub.fetch(2, timeout=5)) == 2
        await asyncio.sleep(GONE_WITHIN_S)  # far past a read's 1 s, and the server's timer
        assert len(await sub.fetch(2, timeout=5)) == 2, "the slot is still there"
    assert await _consumers(bus, EVENTS) == 0, "and gone once the read ended"
