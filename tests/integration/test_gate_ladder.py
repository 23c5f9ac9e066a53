"""Issue 28's fault test: the gate back into service climbs the ladder, for real.

A GPU falls off the bus (XID 79) and comes back slow: its NVLink reads 120 GB/s where an
H200 moves 335+. The engine reboots the node (real ansible-runner, the simulator's
tools); the gate, grade 2 for a lost GPU, fails on device<->device bandwidth and keeps
the node drained; the failed gate climbs the gpu-lost ladder to a reprovisioning, which
clears the slow link; grade 2 passes and the node returns. The audit and the console's
node page show each grade with its numbers.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ScaledClock
from gpuops.console.views import timeline
from gpuops.models import RunStatus
from gpuops.record.audit import read_audit
from gpuops.record.nodestate import NodeState
from gpuops.sim.driver import SimDriver
from gpuops.sim.fleet import SimFleet

from tests.conftest import calls, engine_settings, run_outcomes, running_engine, wait_for

pytestmark = pytest.mark.integration

NODE = "node-001"


@pytest.mark.slow  # four playbook runs, two of them grades: `make test-slow`
async def test_xid_79_reboot_fails_grade_2_then_reprovision_passes_and_the_node_returns(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    # Four GPUs: with two, both ends of the one slow pair look alike (nvbandwidth names
    # the GPU whose links average lowest).
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    fleet.inject(NODE, "slow_d2d", 1, gbs=120.0)  # a reboot keeps it; a reimage clears it
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    clock = ScaledClock(1.0)
    async with running_engine(settings, bus, clock) as app:
        driver = SimDriver(fleet, bus, clock, probe_s=0, keys=app.keys)
        feeder = asyncio.create_task(driver.run(app.stop))
        fleet.inject(NODE, "xid", 1, xid=79)

        async def returned() -> bool:
            record = await app.engine.states.get(NODE)
            assert record.state is not NodeState.NEEDS_HUMAN, record.why
            outcomes = await run_outcomes(bus, NODE)
            return record.state is NodeState.HEALTHY and len(outcomes) == 4

        await wait_for(returned, 300)
        app.stop.set()
        await feeder

    runs = await run_outcomes(bus, NODE)
    assert [(o.playbook, o.status) for o in runs] == [
        ("reboot.yml", RunStatus.SUCCESSFUL),
        ("return_to_service.yml", RunStatus.FAILED),
        ("reprovision.yml", RunStatus.SUCCESSFUL),
        ("return_to_service.yml", RunStatus.SUCCESSFUL),
    ]
    failed, passed = runs[1].grade, runs[3].grade
    assert failed is not None and passed is not None
    assert (failed.grade, failed.ok, passed.grade, passed.ok) == (2, False, 2, True)
    [slow] = failed.failing
    assert (slow.name, slow.gpu, slow.value) == ("nvbandwidth:device_to_device", 1, 120.0)
    assert "120.0 GB/s (expect >= 335" in failed.summary()
    d2d = [c for c in passed.checks if c.name == "nvbandwidth:device_to_device"]
    assert len(d2d) == 1 and d2d[0].ok and d2d[0].value is not None and d2d[0].value >= 335
    assert len(calls(fleet, NODE, "nvbandwidth")) == 2, "grade 2 ran after each rung"

    decisions = [r.body["decision"] async for r in read_audit(bus.js, NODE) if r.type == "decision"]
    climbed = [d for d in decisions if d["match"]["kind"] == "gate"]
    assert len(climbed) == 1 and climbed[0]["accepted"], decisions
    assert climbed[0]["match"]["rule"] == "xid-79-gpu-lost"
    assert [a["playbook"] for a in climbed[0]["actions"]] == ["reprovision.yml"]
    assert not calls(fleet, "node-002", "scontrol"), "the other node was never touched"

    page = await timeline(bus.js, NODE, 0.0)
    titles = [e.title for e in page if e.kind == "run"]
    assert any("grade 2 failed" in t and "120.0 GB/s" in t for t in titles), titles
    assert any("return_to_service.yml successful" in t and "grade 2 passed" in t for t in titles)
