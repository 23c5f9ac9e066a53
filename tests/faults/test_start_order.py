"""Issue 31, item 4: start-up order does not matter. An executor and two engine replicas
started at the same instant on a new three-server cluster all come up and stay up (the
executor waits for the streams and buckets the engines make), and the executor then runs
what the engines decide; while it waits, its /healthz says so (503, naming the wait)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gpuops.bus.cluster import LocalCluster
from gpuops.bus.conn import Bus, connect
from gpuops.bus.server import EmbeddedNats
from gpuops.sim.fleet import SimFleet

from tests.conftest import run_outcomes, wait_for
from tests.faults.conftest import cluster_settings
from tests.faults.test_crash import Engine
from tests.faults.test_replicas import all_up, publish_xid, replica, replica_keys, shared_out
from tests.support import free_port


def executor(tmp: Path, url: str, fleet: SimFleet, **env: str) -> Engine:
    """`gpuops run --role executor` on the replicas' state dir (their signing key)."""
    return Engine(tmp, url, fleet, "executor", name="executor", nats__replicas="3", **env)


@pytest.mark.slow  # a new three-server cluster and three processes: `make test-slow`
async def test_an_executor_and_two_engines_started_at_once_on_a_new_cluster_all_come_up(
    tmp_path: Path, cluster: LocalCluster
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=4, gpus=8)
    keys = replica_keys(tmp_path)
    roles = {rid: replica(tmp_path, cluster.url, fleet, rid) for rid in "ab"}
    roles["executor"] = executor(tmp_path, cluster.url, fleet)
    for role in roles.values():  # the same instant: nothing is made on the cluster yet
        role.start()
    bus: Bus | None = None
    try:
        # The test's own connection opens what the engines make, waiting as the executor does.
        bus = await connect(cluster.url, cluster_settings(), setup="open", patience_s=120)
        await wait_for(lambda: all_up(roles) and shared_out(bus, {"a", "b"}), 120, 0.5)
        node = fleet.nodes[0]
        await publish_xid(bus, keys, node, 3)  # XID 48: gpu_reset.yml, run by the executor

        async def ran() -> bool:
            runs = await run_outcomes(bus, node)
            return all_up(roles) and any(r.status == "successful" for r in runs)

        await wait_for(ran, 120, 0.5)
        await asyncio.sleep(2)  # and they stay up
        assert all_up(roles), "every role still runs"
        runs = await run_outcomes(bus, node)
        assert [r.playbook for r in runs if r.status == "successful"][:1] == ["gpu_reset.yml"]
    finally:
        for role in roles.values():
            role.stop()
        if bus is not None:
            await bus.close()


async def _healthz(port: int) -> tuple[int, dict[str, Any]] | None:
    try:
        url = f"http://127.0.0.1:{port}/healthz"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status, await response.json()
    except (aiohttp.ClientError, OSError):
        return None


async def test_an_executor_waiting_for_the_engine_is_degraded_on_healthz_then_ready(
    tmp_path: Path, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    http = free_port()
    waiting = executor(tmp_path, nats_server.url, fleet, http=f"127.0.0.1:{http}")
    waiting.start()
    try:
        answers: list[tuple[int, dict[str, Any]]] = []

        async def answered() -> bool:
            answer = await _healthz(http)
            answers.extend([answer] if answer is not None else [])
            return waiting.running() and bool(answers) and "streams" in str(answers[-1][1])

        await wait_for(answered, 60, 0.2)
        status, body = answers[-1]
        assert status == 503 and body["status"] == "degraded"
        assert "waiting for the engine to make the streams" in body["why"]["starting"]
        engine = await connect(nats_server.url)  # what an engine makes at its start
        try:

            async def ready() -> bool:
                answer = await _healthz(http)
                return waiting.running() and answer is not None and answer[0] == 200

            await wait_for(ready, 60, 0.5)
        finally:
            await engine.close()
    finally:
        waiting.stop()
