"""A budget through the real engine: real nats-server, real ansible-runner, simulated rack."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from gpuops import subjects
from gpuops.bus.conn import Bus
from gpuops.bus.identity import KeyRing
from gpuops.bus.server import EmbeddedNats
from gpuops.ops.commands import Caller
from gpuops.record.audit import read_audit
from gpuops.sim.fleet import SimFleet

from tests.conftest import calls, engine_settings, run_outcomes, running_engine, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _rack_draw(fleet: SimFleet) -> float:
    total = 0.0
    for node in fleet.nodes:
        event = fleet.telemetry(node, time.time())
        assert event is not None
        total += sum(g["power_w"] for g in event["data"]["gpus"])
    return total


def _limits(fleet: SimFleet) -> list[float]:
    return [g["power_limit_w"] for n in fleet.nodes for g in fleet.state(n)["gpus"]]


async def _agents(bus: Bus, keys: KeyRing, fleet: SimFleet, stop: asyncio.Event) -> None:
    """What the nodes' agents send: telemetry every second, each signed as its node."""
    while not stop.is_set():
        for node in fleet.nodes:
            event = fleet.telemetry(node, time.time())
            data = json.dumps(event).encode()
            headers = keys.node(node).headers(data)
            await bus.nc.publish(subjects.telemetry(node), data, headers=headers)
        await asyncio.sleep(1.0)


async def test_a_budget_override_caps_the_rack_under_it_and_its_end_restores_policy(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    for node in fleet.nodes:
        fleet.inject(node, "load", 0, workload="training")
    assert _rack_draw(fleet) > 5000.0, "8 GPUs at their 700 W cap"
    settings = engine_settings(tmp_path, fleet, nats_server.url, power={"interval_s": 2})
    stop = asyncio.Event()
    async with running_engine(settings, bus) as app:
        agents = asyncio.create_task(_agents(bus, app.keys, fleet, stop))
        try:
            # The controller has a reading of every GPU before the budget is set.
            await wait_for(lambda: len(app.engine.power.controller.gpus) == 8, 30)
            commands, alice = app.commands(), Caller.of("cli", "alice")
            said = await commands.execute("power budget rack-a1 4kW 10m demand response", alice)
            assert said.startswith("power budget rack-a1: 4.0 kW for 10m")
            await wait_for(lambda: sum(_limits(fleet)) <= 4000.0, 120, 0.5)
            assert _rack_draw(fleet) <= 4000.0, "the rack's power is under its budget"
            assert min(_limits(fleet)) >= 200.0
            status = await commands.execute("power status", alice)
            assert "budget rack-a1: 4.0 kW (override by cli:alice" in status
            assert "node-001 (rack-a1)" in status
            await commands.execute("power budget rack-a1 --end", alice)
            await wait_for(lambda: set(_limits(fleet)) == {700.0}, 120, 0.5)
            await wait_for(lambda: app.engine.power.controller.managed == set(), 30, 0.5)
        finally:
            stop.set()
            await agents
    runs = [o for o in await run_outcomes(bus) if o.playbook == "power_limit.yml"]
    assert runs and all(o.status == "successful" for o in runs)
    assert {o.rule for o in runs} == {"power-budget"}, "no other rule fought the controller"
    set_calls = [c for c in calls(fleet, "node-001", "nvidia-smi") if "-pl" in c]
    assert any(c[-1] != "700.0" for c in set_calls) and set_calls[-1][-1] == "700.0"
    decisions = [
        r
        async for r in read_audit(bus.js, "node-001")
        if r.type == "decision" and r.rule == "power-budget"
    ]
    budgets = decisions[0].body["facts"]["budgets"]
    assert budgets[0]["group"] == "rack-a1" and budgets[0]["budget_w"] == 4000.0
    assert decisions[0].body["facts"]["allocation"]["0"]["use"] == "limited"
