"""`density` through a running engine: telemetry from the bus, the report from the engine."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.models import new_event, subject_for
from gpuops.ops.commands import Caller
from gpuops.sim.fleet import SimFleet

from tests.conftest import engine_settings, running_engine, wait_for

pytestmark = pytest.mark.integration


async def test_the_engine_reports_an_idle_gpu_with_its_layout_and_not_a_busy_one(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    start = time.time() - 3600
    async with running_engine(settings, bus) as app:
        for k in range(61):
            gpus = [
                {"index": i, "util_gpu": 3.0 if i == 1 else 90.0, "mem_used_bytes": 6 * 10**9}
                for i in range(4)
            ]
            event = new_event("telemetry", "node-001", start + 60 * k, {"gpus": gpus}, "test")
            payload = json.dumps(event).encode()
            headers = app.keys.node("node-001").headers(payload)  # signed as node-001's agent
            await bus.js.publish(subject_for("telemetry", "node-001"), payload, headers=headers)
        tracker = app.engine.pipeline.density
        await wait_for(
            lambda: len(tracker.gpus) == 4 and tracker.gpus[("node-001", 1)].last >= start + 3599,
            30,
        )

        reply = await app.commands().run("density 10%", Caller.of("cli", "alice"))
        refused = await app.commands().run("density 150", Caller.of("cli", "alice"))

    assert reply.splitlines()[0] == "1 of 4 GPUs under 10% p95 utilisation over the day", reply
    assert "node-001 GPU 1: util p50 3% p95 3%" in reply and "(seen 1.0 h)" in reply
    assert "MIG [19, 19, 19, 19, 19, 19, 19]" in reply
    assert "between 0 and 100%" in refused
