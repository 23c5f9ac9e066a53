"""The agent's health-signal loop outlives a signal that cannot be published."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gpuops.agent.agent import Agent, AgentSettings
from gpuops.agent.backend import HealthSignal
from gpuops.agent.nvml import NvmlBackend
from gpuops.clock import ManualClock
from nats.aio.client import Client

from tests.conftest import wait_for
from tests.fake_pynvml import FakeNvml


async def test_a_signal_that_fails_is_logged_and_the_next_one_goes_out(tmp_path: Path) -> None:
    settings = AgentSettings(
        node="n1", spool_path=tmp_path / "spool.jsonl", probe_command=("true",)
    )
    agent = Agent(settings, NvmlBackend(FakeNvml()), Client(), ManualClock())  # NATS away
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        agent._signals.put_nowait(HealthSignal("xid", {"gpu": 0, "xid": 13, "bad": {1j}}))
        agent._signals.put_nowait(HealthSignal("xid", {"gpu": 0, "xid": 79}))
        await wait_for(lambda: 79 in _xids(agent), 10)
        assert _xids(agent) == [79] and not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _xids(agent: Agent) -> list[int]:
    events = [json.loads(item.payload) for item in agent.spool.pending()]
    return [e["data"]["xid"] for e in events if e["kind"] == "xid"]
