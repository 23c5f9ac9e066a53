"""A storm on the simulated fleet: 30% of nodes overheat at once; the breaker holds."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from gpuops.bus.conn import ACTIONS, Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ScaledClock
from gpuops.decide.breaker import BreakerState
from gpuops.sim.driver import SimDriver
from gpuops.sim.fleet import SimFleet
from gpuops.sim.scenario import load_scenario

from tests.conftest import calls, counted, engine_settings, run_outcomes, running_engine, wait_for

pytestmark = pytest.mark.integration


async def _webhook_sink() -> tuple[web.AppRunner, str, list[dict[str, Any]]]:
    """A real HTTP server standing in for Slack's incoming webhook."""
    received: list[dict[str, Any]] = []

    async def hook(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/hooks/T000/B000/secret-token", hook)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/hooks/T000/B000/secret-token", received


async def test_storm_stops_at_the_breaker_limit_and_notifies(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=20, gpus=2)
    runner, url, received = await _webhook_sink()
    settings = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        safety={"breaker_share": 0.1},  # 10% of 20 nodes: at most 2 enter quarantine
        chatops={"webhooks": [{"kind": "slack", "url": url}]},
    )
    clock = ScaledClock(20.0)
    storm = load_scenario("storm", fleet.nodes)
    assert len(storm.faults) == 6  # 30% of 20
    try:
        async with running_engine(settings, bus, clock) as app:
            driver = SimDriver(fleet, bus, clock, storm, probe_s=0, keys=app.keys)
            feeder = asyncio.create_task(driver.run(app.stop))
            metrics = app.engine.metrics
            await wait_for(lambda: counted(metrics.decisions, "breaker_open") >= 4, 60)
            await wait_for(lambda: counted(metrics.runs) >= 2, 60)
            await wait_for(lambda: _queue_empty(bus), 60)
            intents = counted(metrics.intents)
            app.stop.set()
            await feeder
            await wait_for(lambda: any("breaker open" in m["text"] for m in received), 10)
    finally:
        await runner.cleanup()
    drained = [n for n in fleet.nodes if calls(fleet, n, "scontrol")]
    assert len(drained) == 2, drained
    assert intents == 2, "no intent beyond the breaker's limit was ever written"
    assert len(await run_outcomes(bus)) == 2
    state, _ = await app.engine.breaker.get()
    assert state.state is BreakerState.OPEN and "limit 2" in state.why
    assert "secret-token" not in caplog.text, "a webhook URL never reaches a log"


async def _queue_empty(bus: Bus) -> bool:
    return (await bus.js.stream_info(ACTIONS)).state.messages == 0


def _hot(fleet: SimFleet, node: str, t: float) -> dict[str, Any]:
    event = fleet.telemetry(node, t)
    assert event is not None
    event["data"]["gpus"][0]["temp_c"] = 88.0
    return event


@pytest.mark.slow
async def test_a_storm_with_the_breaker_raised_runs_in_batches_and_is_one_message(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    """Issue 12: 30% of 167 nodes overheat; with the breaker's limit raised for the test the
    50 drains run as a few ansible-runner calls, each host's result in the audit, and
    people get one storm message, not 50 incidents."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=167, gpus=1)
    hot = fleet.nodes[::3][:50]
    runner, url, received = await _webhook_sink()
    settings = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        safety={"breaker_share": 1.0, "breaker_absolute": 1000, "domain_budgets": {}},
        executor={"batch_size": 25, "forks": 10, "gather_window_s": 2.0},
        notifications={"group_wait_s": 2.0},
        chatops={"webhooks": [{"kind": "slack", "url": url}]},
    )
    started = time.monotonic()
    try:
        async with running_engine(settings, bus) as app:
            now = time.time()
            for second in range(-70, 1, 5):  # 70 s of hot samples, ending now
                for node in hot:
                    event = _hot(fleet, node, now + second)
                    payload = json.dumps(event).encode()
                    headers = app.keys.node(node).headers(payload, {"Nats-Msg-Id": event["id"]})
                    await bus.js.publish(f"gpuops.telemetry.{node}", payload, headers=headers)
            await wait_for(lambda: counted(app.engine.metrics.runs) >= 50, 240)
            await wait_for(lambda: any("storm" in m["text"] for m in received), 30)
    finally:
        await runner.cleanup()
    wall = time.monotonic() - started
    outcomes = await run_outcomes(bus)
    assert sorted(o.node for o in outcomes) == sorted(hot), "one result per host"
    assert all(o.status == "successful" and o.playbook == "drain.yml" for o in outcomes)
    runs = {o.run_id for o in outcomes}
    print(f"storm: 50 of 167 nodes overheating, drained in {wall:.1f}s wall, {len(runs)} runs")
    assert len(runs) <= 6, f"{len(runs)} ansible-runner calls for 50 hosts"
    assert all(fleet.state(n)["drained"] for n in hot)
    assert not any(calls(fleet, n, "scontrol") for n in fleet.nodes if n not in hot)
    about = [m["text"] for m in received if "gpu-overheat" in m["text"]]
    assert 1 <= len(about) <= 4, f"a storm is a few grouped messages, not one per node: {about}"
