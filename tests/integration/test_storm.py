"""A storm on the simulated fleet: 30% of nodes overheat at once; the breaker holds."""

from __future__ import annotations

import asyncio
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
            driver = SimDriver(fleet, bus, clock, storm, probe_s=0)
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
