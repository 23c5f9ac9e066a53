"""What status and the console say is what the engine does: dry-run however it came on,
and an engine on a scaled clock (the demo's) up between two heartbeats. A real engine on
a real nats-server, read over real HTTP and through the CLI's own command set."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ScaledClock, SystemClock
from gpuops.ops.commands import Commands, render_status
from gpuops.settings import ChatopsSettings
from gpuops.sim.fleet import SimFleet

from tests.conftest import engine_settings, running_engine, wait_for

pytestmark = pytest.mark.integration


async def _cli_status(bus: Bus) -> dict[str, object]:
    """The status as `gpuops status` reads it: no engine settings, no inventory file."""
    return await Commands.over_bus(bus, SystemClock(), None, ChatopsSettings()).status()


async def test_an_engine_started_with_dry_run_says_so_in_status_and_the_console(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url, http="127.0.0.1:0", dry_run=True)
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port, 30)

        async def beating() -> bool:
            return bool((await _cli_status(bus))["engine"]["running"])  # type: ignore[index]

        await wait_for(beating, 30)
        status = await _cli_status(bus)
        assert status["dry_run"] is True, "the switch is off, the engine's flag is not"
        assert "engine started with --dry-run" in str(status["dry_run_why"])
        assert "dry-run: on (engine started with --dry-run" in render_status(status)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{app.http_port}") as http:
            async with http.get("/console/fleet") as r:
                html = await r.text()
            async with http.get("/console/api/fleet") as r:
                body = await r.json()
                summary = body["summary"]
        badge = html[html.index('id="dry-run"') :].split(">", 1)
        assert "hidden" not in badge[0], "the header shows dry-run"
        assert badge[1].startswith("dry-run on (engine started with --dry-run")
        assert summary["dry_run"] is True and "--dry-run" in summary["dry_run_why"]
        # The heatmap's threshold is the running rules' (no assumed 90 C in the page).
        assert body["fields"][-1] == "temp_at"
        assert body["temp_threshold"] == "gpu-overheat: temp_c >= temp_slowdown_c - 3"


async def test_a_switched_dry_run_names_who_switched_it(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus):
        before = await _cli_status(bus)
        assert before["dry_run"] is False and "dry-run: off" in render_status(before)
        await app_switch(bus)
        status = await _cli_status(bus)
        assert status["dry_run"] is True
        assert status["dry_run_why"] == "switched on by cli:alice"
        assert "dry-run: on (switched on by cli:alice)" in render_status(status)


async def app_switch(bus: Bus) -> None:
    """`gpuops dry-run on` as alice would flip it (the switch in the control bucket)."""
    commands = Commands.over_bus(bus, SystemClock(), None, ChatopsSettings())
    await commands.stores.dry_run.flip(True, "cli:alice")


async def test_an_engine_on_a_scaled_clock_stays_up_between_heartbeats(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url, http="127.0.0.1:0")
    async with running_engine(settings, bus, ScaledClock(10.0)) as app:
        await wait_for(lambda: app.http_port, 30)
        url = f"http://127.0.0.1:{app.http_port}/console/api/fleet"
        seen = []
        async with aiohttp.ClientSession() as http:
            # A beat every 5 wall seconds is 50 s of the demo's clock: sampled over 7 s,
            # the summary must say up every time (the console's cache is push_s old at most).
            for _ in range(14):
                async with http.get(url) as r:
                    seen.append((await r.json())["summary"]["engine"])
                await asyncio.sleep(0.5)
        assert all(seen), f"engine up on every read, saw {seen}"
        status = await app.commands().status()
        assert status["engine"]["running"] is True, status["engine"]["line"]
