"""Issue 16, first fault: kill -9 a NATS server of a three-server cluster under load, then
bring it back. The engine runs as a process against every member's URL with R3 streams
and buckets; the member killed is the leader of the events stream, so the stream elects
a new leader while events are published and decided. Counted from the streams after: every
event published was stored once and decided (acked), none dead-lettered, every accepted
decision has its intents and no intent was stored twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError

from gpuops.bus.cluster import CLUSTER_NAME, LocalCluster
from gpuops.bus.conn import EVENTS, Bus, connect
from gpuops.models import new_event, subject_for
from gpuops.settings import NatsSettings
from gpuops.sim.fleet import SimFleet
from tests.conftest import wait_for
from tests.faults.test_crash import Engine, assert_all_decided_once

pytestmark = [pytest.mark.faults, pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    nats_cluster = LocalCluster(tmp_path / "nats", size=3).start()
    yield nats_cluster
    nats_cluster.stop()


@pytest.fixture
async def cluster_bus(cluster: LocalCluster) -> AsyncIterator[Bus]:
    b = await connect(cluster.url, NatsSettings(replicas=3))
    yield b
    await b.close()


async def _publish_until_stored(bus: Bus, node: str, gpu: int) -> None:
    """Publish one XID 48 event; while the stream elects a leader, the same message again
    (its Nats-Msg-Id makes the stream store it once)."""
    event = new_event("xid", node, time.time(), {"gpu": gpu, "xid": 48}, "test")
    data, headers = json.dumps(event).encode(), {"Nats-Msg-Id": event["id"]}
    for _ in range(120):
        try:
            await bus.js.publish(subject_for("xid", node), data, headers=headers, timeout=2)
            return
        except (NatsError, JsError, TimeoutError):
            await asyncio.sleep(0.25)
    raise AssertionError("the cluster never took the event back")


async def _leader(bus: Bus) -> int:
    """The member leading the events stream."""
    info = await bus.js.stream_info(EVENTS)
    assert info.cluster is not None and info.cluster.leader is not None
    return int(info.cluster.leader.removeprefix(f"{CLUSTER_NAME}-n"))


async def _engine_reads(bus: Bus) -> bool:
    try:
        await bus.js.consumer_info(EVENTS, "gpuops-engine", timeout=2)
    except (NatsError, JsError, TimeoutError):
        return False
    return True


async def _settled(bus: Bus, published: int) -> bool:
    try:
        info = await bus.js.consumer_info(EVENTS, "gpuops-engine", timeout=2)
    except (NatsError, JsError, TimeoutError):
        return False
    return (
        info.num_pending == 0
        and info.num_ack_pending == 0
        and (int(info.ack_floor.stream_seq) >= published)
    )


async def test_kill_9_of_the_stream_leader_loses_no_event_and_stores_no_intent_twice(
    tmp_path: Path, cluster: LocalCluster, cluster_bus: Bus
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=6, gpus=8)
    engine = Engine(
        tmp_path,
        cluster.url,
        fleet,
        "engine",  # no executor: every intent stays in the queue to be counted
        nats__replicas="3",
        safety__breaker_share="1.0",
        safety__breaker_absolute="1000",
    )
    bus, published = cluster_bus, 0
    engine.start()
    try:
        # The kill lands on a running engine, not on one still setting up its streams.
        await wait_for(lambda: _engine_reads(bus), 60)
        for round_ in range(3):
            if round_ == 1:
                killed = await _leader(bus)
                cluster.kill(killed)
            for i in range(60):
                await _publish_until_stored(bus, fleet.nodes[i % 6], (i + round_) % 8)
                published += 1
            if round_ == 1:
                await asyncio.to_thread(cluster.restart, killed)
        await wait_for(lambda: _settled(bus, published), 240)
    finally:
        engine.stop()

    await assert_all_decided_once(bus, published)
    replicas = (await bus.js.stream_info(EVENTS)).cluster
    assert replicas is not None and all(p.current for p in replicas.replicas or []), (
        "the member that came back caught up"
    )
