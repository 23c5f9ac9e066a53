"""`gpuops run` started before its NATS cluster can answer: one member of three is up, so
JetStream has no leader and its requests go unanswered. The engine waits for the others
(`nats.setup_timeout_s`) where a command gives up (`nats.connect_timeout_s`); nothing is
set up twice and the streams come out replicated on all three."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuops.bus.cluster import LocalCluster
from gpuops.bus.conn import EVENTS, open_bus
from gpuops.errors import BusError
from gpuops.settings import NatsSettings

pytestmark = pytest.mark.faults

# Longer than a command's patience, so the engine's set-up spans the wait.
QUORUM_LATE_S = 5.0


@pytest.fixture
def lone(tmp_path: Path) -> Iterator[LocalCluster]:
    """A three-server cluster with only its first member started."""
    cluster = LocalCluster(tmp_path / "nats")
    cluster.members[0].start()
    yield cluster
    cluster.stop()


def _settings(cluster: LocalCluster) -> NatsSettings:
    return NatsSettings(url=cluster.url, replicas=3, connect_timeout_s=2, setup_timeout_s=90)


async def test_run_waits_for_the_cluster_to_elect_its_leader(
    tmp_path: Path, lone: LocalCluster
) -> None:
    async def the_others_later() -> None:
        await asyncio.sleep(QUORUM_LATE_S)
        for member in lone.members[1:]:
            await asyncio.to_thread(member.start)

    late = asyncio.create_task(the_others_later())
    async with asyncio.timeout(120):
        async with open_bus(_settings(lone), tmp_path / "state", role="engine") as bus:
            assert late.done(), "set up only once the others were there"
            info = await bus.js.stream_info(EVENTS)
            assert info.config.num_replicas == 3
            assert info.cluster is not None and info.cluster.leader


@pytest.mark.slow  # a command's whole patience, run out: `make test-slow`
async def test_a_command_gives_up_on_a_cluster_with_no_leader(
    tmp_path: Path, lone: LocalCluster
) -> None:
    async with asyncio.timeout(60):
        with pytest.raises(BusError, match="cannot set up JetStream"):
            async with open_bus(_settings(lone), tmp_path / "state", role="cli"):
                pass
