"""Reading a partition's consumers while a takeover replaces them, on a real nats-server.

A takeover makes its own consumer, then deletes the earlier owner's. A read that lists
the names before and asks their state after sees the earlier one gone: read once, the
partition looked as if it had no consumer (lag: nothing decided; a takeover: from the
stream's start). The takeover here runs at exactly that moment, between the two steps.
"""

from __future__ import annotations

from typing import Any

import pytest
from gpuops.bus.conn import EVENTS, Bus
from gpuops.bus.partitions import durable, events_filter
from gpuops.errors import LeaseLost
from gpuops.scale import takeover
from gpuops.scale.lag import lags
from nats.js.api import AckPolicy, ConsumerConfig

PARTITION = 3


async def _consumer(bus: Bus, epoch: int) -> str:
    name = durable(False, PARTITION, epoch)
    config = ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=events_filter(PARTITION),
        ack_policy=AckPolicy.EXPLICIT,
    )
    await bus.js.add_consumer(EVENTS, config)
    return name


@pytest.fixture
async def taken_over_while_read(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The first listing of names is followed by a takeover (epoch 5 to 9) before the
    reader asks for their state; returns the names each listing gave."""
    old = await _consumer(bus, 5)
    listed: list[str] = []
    real = takeover.consumer_names

    async def names_then_takeover(js: Any, stream: str) -> list[str]:
        names = await real(js, stream)
        listed.append(",".join(names))
        if len(listed) == 1:
            await _consumer(bus, 9)
            await bus.js.delete_consumer(EVENTS, old)
        return names

    monkeypatch.setattr(takeover, "consumer_names", names_then_takeover)
    return listed


async def test_lag_of_a_partition_taken_over_while_read_is_its_new_owners(
    bus: Bus, taken_over_while_read: list[str]
) -> None:
    parts = await lags(bus.js, False, 8)
    assert taken_over_while_read[0] == durable(False, PARTITION, 5), "the race was run"
    assert parts[PARTITION].exists, "a consumer deleted while read is read again"
    assert parts[PARTITION].durable == durable(False, PARTITION, 9)


async def test_a_takeover_racing_another_sees_the_newer_consumer(
    bus: Bus, taken_over_while_read: list[str]
) -> None:
    found = await takeover.partition_consumers(bus.js, EVENTS, False, PARTITION)
    assert taken_over_while_read[0] == durable(False, PARTITION, 5), "the race was run"
    # Seen, a newer epoch stops the slower takeover; unseen, it would make a consumer
    # from the stream's start.
    assert list(found) == [durable(False, PARTITION, 9)]


async def test_a_takeover_stops_when_the_consumers_keep_changing_under_it(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every listing is followed by another takeover: no read ever has all it listed, and
    # a floor taken from part of them could replay what was decided.
    current = [await _consumer(bus, 5)]
    real = takeover.consumer_names

    async def names_then_another_takeover(js: Any, stream: str) -> list[str]:
        names = await real(js, stream)
        current.append(await _consumer(bus, 5 + len(current)))
        await bus.js.delete_consumer(EVENTS, current[-2])
        return names

    monkeypatch.setattr(takeover, "consumer_names", names_then_another_takeover)
    with pytest.raises(LeaseLost, match="kept changing"):
        await takeover.partition_consumers(bus.js, EVENTS, False, PARTITION)
    assert len(current) == 1 + takeover.SNAPSHOT_READS, "read again each time, then stopped"
