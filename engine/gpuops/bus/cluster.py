"""A NATS cluster on loopback: several nats-server processes routed together, with
clustered JetStream (RAFT), for tests and benchmarks of gpuops on more than one server.

Each member is an EmbeddedNats with its own store and a `cluster` block naming the
others' route ports. Members do not advertise each other to clients (`no_advertise`): a
client reaches the members its URL names and no others, so a test can put a proxy
between one client and the cluster and cut it. Route ports must be known before the
first member starts (each lists the others), so they are picked free up front; client
ports are chosen by each server and read back. A member can be killed (SIGKILL, as a
crash) and started again on its port and store, which is how a real member comes back.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError

from gpuops.bus.server import EmbeddedNats
from gpuops.errors import BusError

CLUSTER_NAME = "gpuops"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalCluster:
    """`size` clustered nats-servers under `root` (member i in `root/n<i>`)."""

    def __init__(self, root: Path, size: int = 3, start_timeout_s: float = 30.0) -> None:
        if size < 1:
            raise BusError("a cluster needs at least one server")
        self.root = root
        self.routes = [_free_port() for _ in range(size)]
        self.members = [
            EmbeddedNats(
                root / f"n{i}",
                start_timeout_s,
                port=_free_port(),
                config_text=self._config(i),
            )
            for i in range(size)
        ]

    def _config(self, i: int) -> str:
        others = ", ".join(
            f"nats-route://127.0.0.1:{port}" for j, port in enumerate(self.routes) if j != i
        )
        return (
            f"server_name: {CLUSTER_NAME}-n{i}\n"
            f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{self.routes[i]}\n"
            f"  routes: [{others}]\n  no_advertise: true\n}}\n"
        )

    @property
    def url(self) -> str:
        """Every member's client URL, comma-separated (what `nats.url` takes)."""
        return ",".join(m.url for m in self.members)

    def start(self) -> LocalCluster:
        """Start every member and wait until clustered JetStream has a leader."""
        for member in self.members:
            member.start()
        asyncio.run(self.wait_ready())
        return self

    async def wait_ready(self, limit_s: float = 60.0) -> None:
        """Until JetStream answers through the cluster (its meta leader is elected)."""
        deadline = time.monotonic() + limit_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                nc = await nats.connect(self.url.split(","), connect_timeout=2)
            except (OSError, NatsError) as exc:
                last = exc
                await asyncio.sleep(0.5)
                continue
            try:
                await self._place_probe(nc)
                return
            except (JsError, NatsError, TimeoutError) as exc:
                last = exc
            finally:
                await nc.close()
            await asyncio.sleep(0.5)
        raise BusError(f"the NATS cluster at {self.url} did not elect a leader: {last}")

    async def _place_probe(self, nc: Client) -> None:
        """A stream replicated on every member, created and deleted: JetStream has a
        leader and knows all its peers."""
        js = nc.jetstream(timeout=5)
        await js.add_stream(
            name="GPUOPS_CLUSTER_PROBE", subjects=[], num_replicas=len(self.members)
        )
        await js.delete_stream("GPUOPS_CLUSTER_PROBE")

    def kill(self, i: int) -> None:
        """SIGKILL member i, as a crash: no goodbye to its routes or clients."""
        self.members[i].kill()

    def restart(self, i: int) -> None:
        """Start member i again on its client port, route port and store."""
        self.members[i].start()

    def stop(self) -> None:
        """Stop every member."""
        for member in self.members:
            member.stop()
