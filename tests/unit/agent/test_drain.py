"""The agent's health events: a signal that fails, and what waits in the spool for NATS."""

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


async def test_heartbeats_while_nats_is_away_are_not_spooled_and_the_xid_stays(
    tmp_path: Path,
) -> None:
    settings = AgentSettings(node="n1", spool_path=tmp_path / "spool.jsonl", spool_max=5)
    agent = Agent(settings, NvmlBackend(FakeNvml()), Client(), ManualClock())  # NATS away
    await agent.publish_health("xid", {"gpu": 0, "xid": 79, "message": "fallen off"}, "kmsg")
    for _ in range(10):  # five minutes of heartbeats, twice the spool
        await agent.publish_heartbeat()
    kinds = [json.loads(item.payload)["kind"] for item in agent.spool.pending()]
    assert kinds == ["xid"] and agent.spool.dropped == 0
    assert agent.seq == 10, "each heartbeat has its number: a gap shows what was lost"


async def test_passing_scheduled_probes_give_way_to_faults_in_a_full_spool(tmp_path: Path) -> None:
    settings = AgentSettings(
        node="n1", spool_path=tmp_path / "spool.jsonl", spool_max=4, probe_command=("true",)
    )
    agent = Agent(settings, NvmlBackend(FakeNvml(gpus=2)), Client(), ManualClock())  # NATS away
    await agent.publish_health("xid", {"gpu": 0, "xid": 79}, "kmsg")
    await agent.probe()  # two passes, one per GPU: the next hour's replace them
    await agent.publish_health("xid", {"gpu": 1, "xid": 48}, "kmsg")
    await agent.probe(nonce="abc")  # answers a validation request: kept like a fault
    held = [json.loads(item.payload) for item in agent.spool.pending()]
    assert [(e["kind"], e["data"].get("xid", e["data"].get("nonce"))) for e in held] == [
        ("xid", 79),
        ("xid", 48),
        ("probe", "abc"),
        ("probe", "abc"),
    ]
    assert agent.spool.dropped == 2
