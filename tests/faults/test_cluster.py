"""Issue 16, second fault: kill -9 a NATS server of a three-server cluster under load,
then bring it back, with two engine replicas sharing the partitions. The member killed
leads the events stream, so the stream elects a new leader while events are published
and decided. Counted from the streams after: every event published was stored once and
decided (acked) once, none dead-lettered, every accepted decision has its intents and no
intent was stored twice; the replicas still share the partitions between them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from gpuops.bus.cluster import CLUSTER_NAME, LocalCluster
from gpuops.bus.conn import EVENTS, Bus

from tests.conftest import wait_for
from tests.faults.test_crash import assert_all_decided_once
from tests.faults.test_replicas import (
    all_up,
    at_work,
    decided_at_least,
    one_decision_per_event,
    owners,
    settle,
    shared_out,
    started,
    stop_all,
)

pytestmark = pytest.mark.faults


async def _leader(bus: Bus) -> int:
    """The member leading the events stream."""
    info = await bus.js.stream_info(EVENTS)
    assert info.cluster is not None and info.cluster.leader is not None
    return int(info.cluster.leader.removeprefix(f"{CLUSTER_NAME}-n"))


@pytest.mark.slow  # a three-server cluster, a kill and a new leader: `make test-slow`
async def test_kill_9_of_the_stream_leader_loses_no_event_and_stores_no_intent_twice(
    tmp_path: Path, cluster: LocalCluster, cluster_bus: Bus
) -> None:
    bus = cluster_bus
    engines, load = started(tmp_path, bus, cluster.url, "ab")
    try:
        await at_work(bus, engines, load)
        killed = await _leader(bus)
        cluster.kill(killed)
        down = time.monotonic()
        target = load.published + 10  # some published after the kill, decided
        await wait_for(lambda: decided_at_least(bus, target), 60, 0.5)
        print(f"events decided again {time.monotonic() - down:.2f}s after the leader died")
        await asyncio.to_thread(cluster.restart, killed)
        await wait_for(lambda: all_up(engines) and shared_out(bus, set(engines)), 60, 0.5)
        published = await load.stop()
        await settle(bus)
        # Counted while the replicas run: stopping them all at once races their takeovers
        # (a partition one gives back taken by another that is stopping too), which can
        # leave a newer consumer behind, made from a floor below what was decided.
        await assert_all_decided_once(bus, published)
        held = await owners(bus)
    finally:
        await load.stop()
        await stop_all(engines)

    await one_decision_per_event(bus)
    assert sorted(held.values()) == ["a"] * 4 + ["b"] * 4, "the replicas share the partitions"
    await wait_for(lambda: _caught_up(bus), 30, 0.5)  # the member that came back


async def _caught_up(bus: Bus) -> bool:
    """Every member of the events stream has all of it (the one restarted catches up)."""
    cluster = (await bus.js.stream_info(EVENTS)).cluster
    return cluster is not None and all(p.current for p in cluster.replicas or [])
