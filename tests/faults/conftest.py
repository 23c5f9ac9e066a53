"""The fault suite (issue 10) is slow as a whole: `make test-slow` and .ci/run run it.
The replica fault tests of issue 16 are the exception: each takes under a minute, and
`make test` runs them. Their three-server cluster is a fixture here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from gpuops.bus.cluster import LocalCluster
from gpuops.bus.conn import Bus, connect
from gpuops.settings import NatsSettings

HERE = Path(__file__).resolve().parent
IN_MAKE_TEST = {
    "test_replicas.py",
    "test_cluster.py",
    "test_cluster_start.py",
    "test_start_order.py",
}
# Short leases, so that a replica's death moves its partitions within seconds.
LEASE_S = 4.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if HERE in path.parents and path.name not in IN_MAKE_TEST:
            item.add_marker(pytest.mark.slow)


def cluster_settings() -> NatsSettings:
    """What every replica and the test's own connection use: R3 streams and buckets."""
    return NatsSettings(replicas=3, lease_s=LEASE_S)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """Three clustered nats-servers with JetStream on loopback."""
    nats_cluster = LocalCluster(tmp_path / "nats", size=3).start()
    yield nats_cluster
    nats_cluster.stop()


@pytest.fixture
async def cluster_bus(cluster: LocalCluster) -> AsyncIterator[Bus]:
    """The test's connection to every member, with the streams and buckets created."""
    b = await connect(cluster.url, cluster_settings())
    yield b
    await b.close()
